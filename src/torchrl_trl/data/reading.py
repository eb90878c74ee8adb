"""Reading strategies of :class:`~torchrl_trl.data.TorchRLBufferDataset`: which rows of
the buffer are read, in which order, by whom.

- :class:`EpochPass`: every item stored when a pass begins, exactly once per pass
  (``shuffle``, ``seed``, ``num_passes``); has a length.
- :class:`OnlineSampling`: ``num_batches`` batches drawn by the buffer's own sampler
  (``seed``: the base of the per-rank, per-worker sampling streams); unbounded with
  ``num_batches=None``.

A strategy is a small frozen value: it holds no buffer and is cheap to send to DataLoader
workers. Both readers of a dataset use it the same way: ``TorchRLBufferDataset.__iter__``
(:meth:`consumer_batches`, one reader per rank and DataLoader worker) and the Hugging Face
iterable (:meth:`start_pass` then :meth:`shard_batches`, one call per shard).
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class EpochPass:
    """Read each item stored when a pass begins exactly once per pass.

    Args:
        shuffle: visit the items in a random order drawn from ``(seed, epoch)``; otherwise
            in storage order.
        seed: the shuffle seed; must be equal on every rank (default 0).
        num_passes: passes over the buffer one iterator makes, pass ``k`` read in the order
            of epoch ``epoch + k`` (``None``: endless). With a trainer driven by
            ``max_steps``, ``None`` makes its whole run one Transformers "epoch", so
            resuming from a checkpoint skips exactly the batches already trained.

    A pass over ``n`` items is cut into ``batch_size`` chunks; the Hugging Face iterable
    cuts its order into contiguous shards, ``__iter__`` deals the chunks round-robin over
    (rank, DataLoader worker).

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
            raise TypeError(f"EpochPass.shuffle must be a bool, got {self.shuffle!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(f"EpochPass.seed must be a non-negative int (equal on every rank), got {self.seed!r}")
        positive_int(self.num_passes, "EpochPass.num_passes", allow_none=True)

    @property
    def passes(self) -> int | None:
        return self.num_passes

    def check(self, reader: BufferReader) -> None:
        """Refuse a buffer that holds less than one batch."""
        reader.require_items(whole_batch=True)

    def num_rows(self, reader: BufferReader) -> int:
        """Rows one iterator yields if nothing is written meanwhile (before any filter)."""
        if self.num_passes is None:
            raise TypeError("TorchRLBufferDataset has no length with num_passes=None (endless passes).")
        n = len(reader.replay_buffer)
        return self.num_passes * n * (reader.rows_per_item() if n else 1)

    def order(self, n: int, epoch: int) -> torch.Tensor:
        """int64 ``[n]``: the storage indices of the pass of ``epoch``, in read order."""
        return sharding.epoch_order(n, shuffle=self.shuffle, seed=self.seed, epoch=epoch)

    # -- the Hugging Face iterable: one call per pass, then per shard
    def start_pass(self, reader: BufferReader, pass_index: int, first: bool) -> dict[str, Any]:
        """``{"length": n}``: the items pass ``pass_index`` reads, taken once for all shards."""
        return {"length": reader.pass_length(reader.epoch + pass_index, first=first, pass_index=pass_index)}

    def shard_batches(self, reader: BufferReader, shard_ids: list[int], num_shards: int, *, rank: int,
                      with_index: bool, pass_index: int = 0,
                      length: int | None = None) -> Iterator[tuple[str, TensorDictBase, Any]]:
        """``(key, batch, storage index)`` chunks of shards ``shard_ids`` (of ``num_shards``)
        of pass ``pass_index`` over the first ``length`` items (default: taken now). A
        shard may be empty when there are fewer items than shards."""
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

    # -- TorchRLBufferDataset.__iter__: one reader per (rank, DataLoader worker)
    def consumer_batches(self, reader: BufferReader, me: sharding.Consumer, *, rank: int,
                         with_index: bool) -> Iterator[Batch]:
        """The chunks of every pass dealt to ``me``: chunk ``i`` goes to reader ``i % count``."""
        k = 0
        while self.num_passes is None or k < self.num_passes:
            epoch = reader.epoch + k
            n = reader.pass_length(epoch, first=k == 0, pass_index=k)
            chunks = self.order(n, epoch).split(reader.batch_size)
            for i in range(me.index, len(chunks), me.count):
                yield reader.fetch(chunks[i]), chunks[i]
            k += 1


@dataclass(frozen=True)
class OnlineSampling:
    """Draw batches with the replay buffer's own sampler (e.g. TorchRL's ``RandomSampler``,
    ``PrioritizedSampler``), as upstream's dataset does.

    Args:
        num_batches: batches drawn per iterator (``None``: unbounded). Each DataLoader
            worker draws ``num_batches`` (as upstream); the Hugging Face iterable splits
            them over its shards.
        seed: base seed of the sampling streams (default ``torch.initial_seed()``). Every
            (rank, worker or shard, iteration) gets its own stream, so processes seeded
            alike still draw different samples.

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
    passes: ClassVar[int] = 1

    def __post_init__(self) -> None:
        positive_int(self.num_batches, "num_batches", allow_none=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
                                      or self.seed < 0):
            raise ValueError(f"OnlineSampling.seed must be a non-negative int or None, got {self.seed!r}")

    def check(self, reader: BufferReader) -> None:
        reader.require_items()

    def num_rows(self, reader: BufferReader) -> int:
        raise TypeError("TorchRLBufferDataset has no length in online mode; use mode='epoch'.")

    def stream(self, reader: BufferReader, stream: int, budget: int | None, *, rank: int,
               with_index: bool) -> Iterator[Batch]:
        """``budget`` sampled batches of stream ``stream`` (its own seed, per rank, worker
        and iteration)."""
        reader.require_items()
        reader.iterations += 1
        worker = sharding.worker_index()
        gen = torch.Generator().manual_seed(sharding.stream_seed(self.seed, rank, stream, worker, reader.iterations))
        done = 0
        while budget is None or done < budget:
            seed = int(torch.randint(2**62, (), generator=gen))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                batch = reader.sample(with_index)
            yield batch
            done += 1

    def start_pass(self, reader: BufferReader, pass_index: int, first: bool) -> dict[str, Any]:
        return {}

    def shard_batches(self, reader: BufferReader, shard_ids: list[int], num_shards: int, *, rank: int,
                      with_index: bool, pass_index: int = 0,
                      length: int | None = None) -> Iterator[tuple[str, TensorDictBase, Any]]:
        """Shard ``s`` is stream ``s``, drawing its share of ``num_batches``."""
        budgets = None if self.num_batches is None else sharding.split_count(self.num_batches, num_shards)
        for s in shard_ids:
            budget = None if budgets is None else budgets[s]
            for i, (batch, index) in enumerate(self.stream(reader, s, budget, rank=rank, with_index=with_index)):
                yield f"{s}_{i}", batch, index

    def consumer_batches(self, reader: BufferReader, me: sharding.Consumer, *, rank: int,
                         with_index: bool) -> Iterator[Batch]:
        """``num_batches`` batches of this reader's own stream."""
        return self.stream(reader, me.index, self.num_batches, rank=rank, with_index=with_index)


ReadingStrategy = EpochPass | OnlineSampling


def reading_from_arguments(reading: ReadingStrategy | None = None, *, mode: str | None = None,
                           shuffle: bool = False, seed: int | None = None,
                           num_passes: int | None = 1, num_batches: int | None = 1) -> ReadingStrategy:
    """The strategy that ``TorchRLBufferDataset``'s shorthand arguments stand for.

    ``reading`` given: returned as is, and every shorthand must be left at its default
    (each means something only inside one strategy). Otherwise ``mode="epoch"`` builds
    ``EpochPass(shuffle, seed, num_passes)`` and ``mode="online"`` (the default)
    ``OnlineSampling(num_batches, seed)``; a setting of the other mode raises.

    >>> reading_from_arguments(mode="epoch", shuffle=True)
    EpochPass(shuffle=True, seed=0, num_passes=1)
    >>> reading_from_arguments(num_batches=4, seed=3)
    OnlineSampling(num_batches=4, seed=3)
    """
    defaults = {"mode": None, "shuffle": False, "seed": None, "num_passes": 1, "num_batches": 1}
    values = {"mode": mode, "shuffle": shuffle, "seed": seed, "num_passes": num_passes, "num_batches": num_batches}
    given = {name: v for name, v in values.items() if v is not defaults[name] and v != defaults[name]}
    if reading is not None:
        if not isinstance(reading, (EpochPass, OnlineSampling)):
            raise TypeError(f"reading must be an EpochPass or an OnlineSampling, got {type(reading).__name__}")
        if given:
            raise TypeError(
                f"pass {sorted(given)} inside reading={reading!r} (they are its settings), not beside it"
            )
        return reading
    mode = "online" if mode is None else mode
    if mode == "epoch":
        if num_batches != 1:
            raise ValueError(
                f"num_batches={num_batches!r} is for mode='online' (batches drawn by the sampler); an epoch "
                "pass reads every stored item: set num_passes instead"
            )
        return EpochPass(shuffle, 0 if seed is None else seed, num_passes)
    if mode != "online":
        raise ValueError(f"mode must be 'online' or 'epoch', got {mode!r}.")
    if shuffle:
        raise ValueError(
            "shuffle=True is for mode='epoch' (a permuted pass over the stored items); "
            "mode='online' draws rows with the replay buffer's own sampler (give the buffer "
            "a RandomSampler to sample at random)."
        )
    if "num_passes" in given:
        raise ValueError(f"num_passes={num_passes!r} is for mode='epoch'; mode='online' draws num_batches batches")
    return OnlineSampling(num_batches, seed)
