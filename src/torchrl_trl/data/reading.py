"""Reading strategies of :class:`~torchrl_trl.data.TorchRLBufferDataset` (which rows, in
which order): small frozen values, read by ``__iter__`` (``consumer_batches``) and by the
Hugging Face iterable (``start_pass``, then ``shard_batches`` per shard)."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from tensordict import TensorDictBase

from .._checks import positive_int
from . import sharding
from .buffer_reader import BufferReader

__all__ = ["EpochPass", "OnlineSampling", "ReadingStrategy", "reading_from_arguments"]

Batch = tuple[TensorDictBase, "torch.Tensor | None"]  # rows and their storage indices
KeyedBatch = tuple[str, TensorDictBase, Any]


@dataclass(frozen=True)
class EpochPass:
    """Read each item stored when a pass begins exactly once per pass.

    Args:
        shuffle (bool, optional): visit the items in an order drawn from ``(seed, epoch)``
            (else storage order). Defaults to ``False``.
        seed (int, optional): the shuffle seed; must be equal on every rank. Defaults to ``0``.
        num_passes (int or None, optional): passes one iterator makes, pass ``k`` in the order
            of epoch ``epoch + k`` (``None``: endless, e.g. for a trainer driven by
            ``max_steps``). Defaults to ``1``.

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

    def check(self, reader: BufferReader) -> None:
        """Refuse a buffer that holds less than one batch."""
        reader.require_items(whole_batch=True)

    def num_rows(self, reader: BufferReader) -> int:
        """Rows one iterator yields if nothing is written meanwhile (before any filter)."""
        if self.num_passes is None:
            raise TypeError(
                "TorchRLBufferDataset: no length with num_passes=None (endless passes); expected an int for len()"
            )
        n = len(reader.replay_buffer)
        return self.num_passes * n * (reader.rows_per_item() if n else 1)

    def order(self, n: int, epoch: int) -> torch.Tensor:
        """int64 ``[n]``: the storage indices of the pass of ``epoch``, in read order."""
        return sharding.epoch_order(n, shuffle=self.shuffle, seed=self.seed, epoch=epoch)

    def start_pass(self, reader: BufferReader, pass_index: int, first: bool) -> dict[str, Any]:
        """``{"length": n}``: the items pass ``pass_index`` reads, for all shards."""
        epoch = reader.epoch + pass_index
        return {"length": reader.pass_length(epoch, first=first, pass_index=pass_index)}

    def shard_batches(self, reader: BufferReader, shard_ids: list[int], num_shards: int, *, rank: int,
                      with_index: bool, pass_index: int = 0, length: int | None = None) -> Iterator[KeyedBatch]:
        """``(key, batch, storage index)`` chunks of shards ``shard_ids`` (of ``num_shards``)
        of pass ``pass_index`` over the first ``length`` items (default: taken now)."""
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
        num_batches (int or None, optional): batches drawn per iterator (``None``: unbounded):
            by each DataLoader worker, split over the Hugging Face iterable's shards. Defaults
            to ``1``.
        seed (int, optional): base seed of the sampling streams, one per (rank, worker or
            shard, iteration). Defaults to ``None`` (``torch.initial_seed()``).

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

    def check(self, reader: BufferReader) -> None:
        reader.require_items()

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
