"""A replay buffer read as TensorDict batches for :class:`~torchrl_trl.data.TorchRLBufferDataset`
(:class:`BufferReader`), and the reading strategies: which rows, in which order, for ``__iter__``
(``consumer_batches``) and for the Hugging Face iterable (``start_pass``, then ``shard_batches``)."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_tensor_collection

from .. import _buffers, _compat, layouts
from .._checks import positive_int
from . import sharding

__all__ = [
    "BufferReader", "EpochPass", "OnlineSampling", "ReadingStrategy", "check_strings_survive", "reading_from_arguments",
    "rows_to_td",
]

Batch = tuple[TensorDictBase, "torch.Tensor | None"]  # rows and their storage indices
KeyedBatch = tuple[str, TensorDictBase, Any]


class BufferReader:
    """Batches of rows from ``replay_buffer``, ``batch_size`` at a time; holds what its readers
    share across processes (the epoch counter, :class:`sharding.PassLengths`)."""

    def __init__(self, replay_buffer, batch_size: int) -> None:
        self.replay_buffer = replay_buffer
        self.batch_size = batch_size
        self.epoch_counter = torch.zeros((), dtype=torch.int64).share_memory_()
        self.lengths = sharding.PassLengths()  # the items each epoch pass reads
        _buffers.guard_fork(replay_buffer)  # DataLoader workers forked beside a writer thread
        self.iterations = 0  # online streams started in this process (mixed into their seeds)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_spawn_keepalive"}

    def __reduce_ex__(self, protocol):
        from multiprocessing.context import get_spawning_popen

        try:
            lock = _compat.replay_lock(self.replay_buffer)
        except AttributeError:
            lock = None
        if get_spawning_popen() is None or not hasattr(lock, "acquire"):
            return super().__reduce_ex__(protocol)
        # pickled for a spawned worker: copy the buffer while no thread writes it
        import io
        from multiprocessing.reduction import ForkingPickler

        out = io.BytesIO()
        pickler = ForkingPickler(out, protocol)
        with lock:
            pickler.dump(self.replay_buffer)
        # objects made while pickling (shared-memory storages) must live until the worker starts
        self._spawn_keepalive = pickler.memo.copy()
        state = {k: v for k, v in self.__getstate__().items() if k != "replay_buffer"}
        return _restore, (type(self), state, out.getvalue())

    @property
    def epoch(self) -> int:
        return int(self.epoch_counter)

    def set_epoch(self, epoch: int) -> None:
        self.epoch_counter.fill_(int(epoch))

    @cached_property
    def holds_python_rows(self) -> bool:
        """Whether the storage holds plain Python rows (e.g. dicts in a ``ListStorage``)."""
        from torchrl.data import ListStorage

        storage = _buffers.local_storage(self.replay_buffer)  # remote buffers hold TensorDicts
        return isinstance(storage, ListStorage) and not is_tensor_collection(storage.get(0))

    def fetch(self, index: torch.Tensor) -> TensorDictBase:
        """The rows at storage ``index`` as one batch (one storage read)."""
        rb = self.replay_buffer
        if not self.holds_python_rows:
            return rb[index]
        index = index.tolist()
        rows = rb.storage.get(index)
        # every row is checked against the buffer's first row, whichever chunk it is in
        first = rows[0] if index[0] == 0 else rb.storage.get(0)
        batch = rows_to_td(rows, index, reference=first)
        return rb.transform(batch) if rb.transform is not None and len(rb.transform) else batch

    def sample(self, with_index: bool) -> tuple[TensorDictBase, torch.Tensor | None]:
        """A batch drawn by the buffer's sampler and, when ``with_index``, its storage indices."""
        rb = self.replay_buffer
        if not self.holds_python_rows:
            if not with_index:
                return rb.sample(self.batch_size), None
            batch, info = rb.sample(self.batch_size, return_info=True)
            return batch, torch.as_tensor(info["index"]).reshape(-1)
        index, _ = rb.sampler.sample(rb.storage, self.batch_size)
        index = torch.as_tensor(index).reshape(-1)
        return self.fetch(index), index

    @cached_property
    def rows_per_item(self) -> int:
        """Rows one stored item yields: the numel of its batch shape."""
        return self.fetch(torch.arange(1)).batch_size.numel()

    def require_items(self, n: int | None = None, *, whole_batch: bool = False) -> int:
        """``n`` (default: the readable length) if >= 1 (``whole_batch``: ``batch_size``), else ``ValueError``."""
        if n is None:
            n = _buffers.readable_length(self.replay_buffer)[0]
        if n == 0:
            raise ValueError(
                "TorchRLBufferDataset: the replay buffer is empty; fill it (e.g. run the "
                "collector) before iterating or calling as_hf_dataset()."
            )
        if whole_batch and n < self.batch_size:
            raise ValueError(
                f"TorchRLBufferDataset: the replay buffer holds {n} items, fewer than one epoch "
                f"batch (batch_size={self.batch_size}); lower batch_size or collect more."
            )
        return n

    def pass_length(self, epoch: int, *, first: bool = True, pass_index: int = 0) -> int:
        """The items epoch pass ``pass_index`` reads, taken once when it begins for all its readers."""
        n, live = _buffers.readable_length(self.replay_buffer)
        n = self.lengths.length(epoch, n, first=first, pass_index=pass_index, live=live)
        return self.require_items(n, whole_batch=True)


def _restore(cls, state: dict, buffer: bytes):
    """Rebuild a reader pickled by ``__reduce_ex__``."""
    import pickle

    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    obj.replay_buffer = pickle.loads(buffer)
    return obj


def rows_to_td(rows: list, index: Sequence[int] | None = None, path: tuple = (),
               reference: Any = None) -> TensorDictBase:
    """Plain Python rows (dicts) -> a TensorDict; every row must hold exactly the keys of ``reference``
    (default ``rows[0]``); ``index``: the storage indices named in errors.

    >>> rows_to_td([{"a": 1, "b": "x"}, {"a": 2, "b": "y"}])["a"].tolist()
    [1, 2]
    """
    if rows and is_tensor_collection(rows[0]):
        from tensordict import lazy_stack

        return lazy_stack(list(rows))
    n = len(rows)
    index = list(range(n)) if index is None else list(index)
    if not all(isinstance(r, Mapping) for r in rows):
        i, bad = next((i, type(r).__name__) for i, r in zip(index, rows) if not isinstance(r, Mapping))
        where = f" at {'.'.join(path)!r}" if path else ""
        raise TypeError(
            f"TorchRLBufferDataset: ListStorage rows must be dicts or TensorDicts, got {bad}{where} in row {i}"
        )
    ref, ref_row = (rows[0], index[0]) if reference is None else (reference, 0)
    keys = list(ref) if isinstance(ref, Mapping) else list(rows[0])
    for i, r in zip(index, rows):
        if len(r) != len(keys) or any(k not in r for k in keys):
            missing = [k for k in keys if k not in r]
            extra = [k for k in r if k not in keys]
            name = ".".join((*path, str((missing or extra)[0])))
            raise (KeyError if missing else ValueError)(
                f"TorchRLBufferDataset: ListStorage row {i} {'lacks' if missing else 'has'} key {name!r} "
                f"that row {ref_row} {'has' if missing else 'lacks'} (row {ref_row} keys: {sorted(map(str, keys))}); "
                "every row must hold the same keys"
            )
    out = TensorDict(batch_size=[n])
    for key in keys:
        values = [r[key] for r in rows]
        if isinstance(values[0], Mapping):
            sub_ref = ref.get(key) if reference is not None and isinstance(ref.get(key), Mapping) else None
            out.set(key, rows_to_td(values, index, (*path, str(key)), sub_ref))
        elif all(isinstance(v, torch.Tensor) for v in values) and len({v.shape for v in values}) == 1:
            out.set(key, torch.stack(values))
        elif all(isinstance(v, (int, float, bool)) for v in values):
            out.set(key, torch.tensor(values))
        else:
            out.set(key, NonTensorStack(*[NonTensorData(v) for v in values], batch_size=[n]))
    return out


def check_strings_survive(replay_buffer, cols: dict[str, list]) -> None:
    """Refuse to read text or chat from a storage that does not keep strings."""
    from torchrl.data import LazyMemmapStorage

    storage = _buffers.local_storage(replay_buffer)
    if not isinstance(storage, LazyMemmapStorage) or layouts.memmap_keeps_strings():
        return
    text = [name for name, values in cols.items() if values and _is_text(values[0])]
    if text:
        raise ValueError(
            f"TorchRLBufferDataset: columns {text} hold text, which a LazyMemmapStorage reads back as the first "
            "string stored; expected a LazyStackStorage, ListStorage or LazyTensorStorage, or tokens only"
        )


def _is_text(value: Any) -> bool:
    """A string, or chat messages (a list of role/content dicts)."""
    return isinstance(value, str) or (isinstance(value, list) and bool(value) and isinstance(value[0], dict))


@dataclass(frozen=True)
class EpochPass:
    """Read each item stored when a pass begins exactly once per pass.

    Args:
        shuffle (bool, optional): visit the items in an order drawn from ``(seed, epoch)`` (else storage
            order). Defaults to ``False``.
        seed (int, optional): the shuffle seed; must be equal on every rank. Defaults to ``0``.
        num_passes (int or None, optional): passes one iterator makes, pass ``k`` in the order of epoch
            ``epoch + k`` (``None``: endless, e.g. for a trainer driven by ``max_steps``). Defaults to ``1``.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> from torchrl_trl.data import TorchRLBufferDataset
    >>> rb = ReplayBuffer(storage=ListStorage(10))
    >>> _ = rb.extend(TensorDict({"x": torch.arange(6)}, [6]))
    >>> reading = EpochPass(shuffle=True, seed=1, num_passes=2)
    >>> ds = TorchRLBufferDataset(rb, 2, keys=["x"], reading=reading)
    >>> len(ds)  # 2 passes over 6 items
    12
    >>> xs = [int(row["x"]) for row in ds]
    >>> sorted(xs[:6]) == sorted(xs[6:]) == list(range(6)) and xs[:6] != xs[6:]
    True
    """

    shuffle: bool = False
    seed: int = 0
    num_passes: int | None = 1

    mode: ClassVar[str] = "epoch"
    shards_per_process: ClassVar[int] = 4  # several per rank: DataLoader workers split them

    def __post_init__(self) -> None:
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"EpochPass: shuffle must be a bool, got {self.shuffle!r}")
        _check_seed(self.seed, "EpochPass: seed", "a non-negative int (equal on every rank)")
        positive_int(self.num_passes, "EpochPass: num_passes", allow_none=True)

    def num_rows(self, reader: BufferReader) -> int:
        """Rows one iterator yields if nothing is written meanwhile."""
        if self.num_passes is None:
            raise TypeError(
                "TorchRLBufferDataset: no length with num_passes=None (endless passes); expected an int for len()"
            )
        n = len(reader.replay_buffer)
        return self.num_passes * n * (reader.rows_per_item if n else 1)

    def order(self, n: int, epoch: int) -> torch.Tensor:
        """int64 ``[n]``: the storage indices of the pass of ``epoch``, in read order."""
        return sharding.epoch_order(n, shuffle=self.shuffle, seed=self.seed, epoch=epoch)

    def start_pass(self, reader: BufferReader, pass_index: int, first: bool) -> dict[str, Any]:
        """``{"length": n}``: the items pass ``pass_index`` reads, for all shards."""
        epoch = reader.epoch + pass_index
        return {"length": reader.pass_length(epoch, first=first, pass_index=pass_index)}

    def shard_batches(self, reader: BufferReader, shard_ids: list[int], num_shards: int, *, rank: int,
                      with_index: bool, pass_index: int = 0, length: int | None = None) -> Iterator[KeyedBatch]:
        """``(key, batch, storage index)`` chunks of shards ``shard_ids`` of pass ``pass_index``."""
        epoch = reader.epoch + pass_index
        n = reader.pass_length(epoch) if length is None else length
        shards = torch.tensor_split(self.order(n, epoch), num_shards)
        i = 0
        for s in shard_ids:
            if not shards[s].numel():  # (split() of an empty shard gives one empty chunk)
                continue
            for chunk in shards[s].split(reader.batch_size):
                yield f"epoch{pass_index}_{i}", reader.fetch(chunk), chunk
                i += 1

    def consumer_batches(self, reader: BufferReader, me: tuple[int, int], *, rank: int,
                         with_index: bool) -> Iterator[Batch]:
        """The chunks of every pass dealt to ``me = (index, count)``: chunk ``i`` to ``i % count``."""
        for k in _up_to(self.num_passes):
            epoch = reader.epoch + k
            n = reader.pass_length(epoch, first=k == 0, pass_index=k)
            chunks = self.order(n, epoch).split(reader.batch_size)
            for i in range(me[0], len(chunks), me[1]):
                yield reader.fetch(chunks[i]), chunks[i]


@dataclass(frozen=True)
class OnlineSampling:
    """Draw batches with the replay buffer's own sampler, as upstream's dataset does.

    Args:
        num_batches (int or None, optional): batches drawn per iterator (``None``: unbounded): by each
            DataLoader worker, split over the Hugging Face iterable's shards. Defaults to ``1``.
        seed (int, optional): base seed of the sampling streams, one per (rank, worker or shard, iteration).
            Defaults to ``None`` (``torch.initial_seed()``).

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> from torchrl_trl.data import TorchRLBufferDataset
    >>> rb = ReplayBuffer(storage=ListStorage(10))
    >>> _ = rb.extend(TensorDict({"x": torch.arange(6)}, [6]))
    >>> ds = TorchRLBufferDataset(rb, 4, keys=["x"], reading=OnlineSampling(num_batches=3, seed=0))
    >>> rows = list(ds)
    >>> len(rows), all(0 <= int(r["x"]) < 6 for r in rows)  # 3 batches of 4
    (12, True)
    >>> [int(r["x"]) for r in ds] == [int(r["x"]) for r in rows]  # each iteration: a new stream
    False
    """

    num_batches: int | None = 1
    seed: int | None = None

    mode: ClassVar[str] = "online"
    shards_per_process: ClassVar[int] = 1
    num_passes: ClassVar[int] = 1  # a pass of num_batches batches

    def __post_init__(self) -> None:
        positive_int(self.num_batches, "OnlineSampling: num_batches", allow_none=True)
        if self.seed is not None:
            _check_seed(self.seed, "OnlineSampling: seed", "a non-negative int or None")

    def num_rows(self, reader: BufferReader) -> int:
        raise TypeError("TorchRLBufferDataset: no length in online mode; expected reading='epoch' for len()")

    def stream(self, reader: BufferReader, stream: int, budget: int | None, *, rank: int,
               with_index: bool) -> Iterator[Batch]:
        """``budget`` sampled batches of stream ``stream`` (seeded per rank, worker, iteration)."""
        reader.require_items()
        reader.iterations += 1
        base = sharding.stream_seed(self.seed, rank, stream, sharding.worker_index(), reader.iterations)
        gen = torch.Generator().manual_seed(base)
        for _ in _up_to(budget):
            seed = int(torch.randint(2**62, (), generator=gen))
            with torch.random.fork_rng(devices=[]):
                # the CPU generator only: torch.manual_seed would also seed every accelerator (~1 ms)
                torch.default_generator.manual_seed(seed)
                batch = reader.sample(with_index)
            yield batch

    def start_pass(self, reader: BufferReader, pass_index: int, first: bool) -> dict[str, Any]:
        return {}

    def shard_batches(self, reader: BufferReader, shard_ids: list[int], num_shards: int, *, rank: int,
                      with_index: bool, pass_index: int = 0, length: int | None = None) -> Iterator[KeyedBatch]:
        """Shard ``s`` is stream ``s``, drawing its share of ``num_batches``."""
        n = self.num_batches
        budgets = [None] * num_shards if n is None else sharding.split_count(n, num_shards)
        for s in shard_ids:
            batches = self.stream(reader, s, budgets[s], rank=rank, with_index=with_index)
            for i, (batch, index) in enumerate(batches):
                yield f"{s}_{i}", batch, index

    def consumer_batches(self, reader: BufferReader, me: tuple[int, int], *, rank: int,
                         with_index: bool) -> Iterator[Batch]:
        """``num_batches`` batches of this reader's own stream."""
        return self.stream(reader, me[0], self.num_batches, rank=rank, with_index=with_index)


ReadingStrategy = EpochPass | OnlineSampling


def _up_to(n: int | None) -> Iterator[int]:
    """``0, 1, ..., n - 1``; endless for ``None``."""
    return itertools.count() if n is None else iter(range(n))


def _check_seed(seed: Any, name: str, expected: str) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"{name} must be {expected}, got {seed!r}")


def reading_from_arguments(reading: ReadingStrategy | str | None = None, *,
                           num_batches: int | None = 1) -> ReadingStrategy:
    """The strategy of ``TorchRLBufferDataset(reading=, num_batches=)``.

    >>> reading_from_arguments("epoch")
    EpochPass(shuffle=False, seed=0, num_passes=1)
    >>> reading_from_arguments(num_batches=4)
    OnlineSampling(num_batches=4, seed=None)
    """
    if isinstance(reading, (EpochPass, OnlineSampling)):
        if num_batches != 1:
            raise TypeError(f"TorchRLBufferDataset: expected num_batches={num_batches!r} inside reading={reading!r}, "
                            "not beside it")
        return reading
    if reading is not None and not isinstance(reading, str):
        what = type(reading).__name__
        raise TypeError(f"TorchRLBufferDataset: reading must be 'epoch', 'online', an EpochPass or an OnlineSampling, "
                        f"got {what}")
    mode = reading or "online"
    if mode == "epoch":
        if num_batches != 1:
            raise ValueError(
                f"TorchRLBufferDataset: num_batches={num_batches!r} is for online sampling; an epoch pass reads "
                "every stored item: expected EpochPass(num_passes=)"
            )
        return EpochPass()
    if mode != "online":
        raise ValueError(f"TorchRLBufferDataset: reading must be 'online' or 'epoch', got {mode!r}")
    return OnlineSampling(num_batches)
