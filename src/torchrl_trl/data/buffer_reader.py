"""Reading a TorchRL replay buffer as TensorDict batches: by storage index or with its own
sampler, and how many items an epoch pass may read beside a live writer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_tensor_collection

from .. import _compat, layouts
from .._buffers import local_storage
from . import sharding

__all__ = ["BufferReader"]


class BufferReader:
    """Batches of rows from ``replay_buffer``, ``batch_size`` at a time; holds what its readers
    share across processes (the epoch counter, :class:`sharding.PassLengths`)."""

    def __init__(self, replay_buffer, batch_size: int) -> None:
        self.replay_buffer = replay_buffer
        self.batch_size = batch_size
        self.epoch_counter = torch.zeros((), dtype=torch.int64).share_memory_()
        self.lengths = sharding.PassLengths()  # the items each epoch pass reads
        sharding.guard_fork(replay_buffer)  # DataLoader workers forked beside a writer thread
        self.iterations = 0  # online streams started in this process (mixed into their seeds)
        self._python_rows: bool | None = None
        self._item_rows: int | None = None

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

    def holds_python_rows(self) -> bool:
        """Whether the storage holds plain Python rows (e.g. dicts in a ``ListStorage``)."""
        if self._python_rows is None:
            from torchrl.data import ListStorage

            storage = local_storage(self.replay_buffer)  # remote buffers hold TensorDicts
            self._python_rows = isinstance(storage, ListStorage) and not is_tensor_collection(storage.get(0))
        return self._python_rows

    def fetch(self, index: torch.Tensor) -> TensorDictBase:
        """The rows at storage ``index`` as one batch (one storage read)."""
        rb = self.replay_buffer
        if not self.holds_python_rows():
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
        if not self.holds_python_rows():
            if not with_index:
                return rb.sample(self.batch_size), None
            batch, info = rb.sample(self.batch_size, return_info=True)
            return batch, torch.as_tensor(info["index"]).reshape(-1)
        index, _ = rb.sampler.sample(rb.storage, self.batch_size)
        index = torch.as_tensor(index).reshape(-1)
        return self.fetch(index), index

    def rows_per_item(self) -> int:
        """Rows one stored item yields: the numel of its batch shape."""
        if self._item_rows is None:
            self._item_rows = self.fetch(torch.arange(1)).batch_size.numel()
        return self._item_rows

    def readable(self) -> tuple[int, bool]:
        """:func:`sharding.readable_length`, refusing a buffer inherited in the middle of a write."""
        rb = self.replay_buffer
        if sharding.forked_mid_write(rb):
            raise RuntimeError(
                "TorchRLBufferDataset: this DataLoader worker was forked while the buffer was written (lock held "
                "30 s): its copy may be torn; use num_workers=0, 'spawn', or pause the writer"
            )
        return sharding.readable_length(rb)

    def require_items(self, n: int | None = None, *, whole_batch: bool = False) -> int:
        """``n`` (default: the readable length) if >= 1 (``whole_batch``: ``batch_size``), else ``ValueError``."""
        if n is None:
            n = self.readable()[0]
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
        n, live = self.readable()
        n = self.lengths.length(epoch, first=first, pass_index=pass_index, take=lambda: n, live=live)
        return self.require_items(n, whole_batch=True)

    def pin_for_ranks(self, world_size: int) -> None:
        """With several ranks: fix this epoch's passes to rank 0's length now (every rank calls it)."""
        if world_size > 1:
            self.lengths.pin(self.epoch, sharding.broadcast_length(len(self.replay_buffer)))


def _restore(cls, state: dict, buffer: bytes):
    """Rebuild a reader pickled by ``__reduce_ex__`` (``buffer``: our parent's own bytes)."""
    import pickle

    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    obj.replay_buffer = pickle.loads(buffer)
    return obj


def rows_to_td(rows: list, index: Sequence[int] | None = None, path: tuple = (),
               reference: Any = None) -> TensorDictBase:
    """Plain Python rows (dicts) -> a TensorDict; every row must hold the keys of ``reference``
    (default ``rows[0]``), no more, no fewer (``index``: storage indices, named in errors).

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

    storage = local_storage(replay_buffer)
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
