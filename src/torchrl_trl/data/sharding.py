"""Who reads what: epoch orders, shards, and per-rank/per-worker random streams.

One epoch pass is ``order`` (a permutation of ``range(len(buffer))`` taken when the pass
starts), cut into ``num_shards`` contiguous shards. Whoever iterates a set of shards
yields exactly those items, so splitting the shard list over ranks (accelerate's
``IterableDataset.shard``, ``datasets.distributed.split_dataset_by_node``) and over
DataLoader workers (``datasets`` does it by shard) reads every item exactly once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["Consumer", "consumer", "epoch_order", "shard_bounds", "stream_seed", "world_size"]


def world_size() -> int:
    """Number of training processes: ``torch.distributed`` if initialised, else the
    ``WORLD_SIZE`` that ``torchrun``/``accelerate launch`` export, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class Consumer:
    """One reader of the stream: a (rank, DataLoader worker) pair."""

    rank: int
    world_size: int
    worker: int
    num_workers: int

    @property
    def index(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def count(self) -> int:
        return self.world_size * self.num_workers


def consumer(rank: int | None = None, world: int | None = None) -> Consumer:
    """The current reader. ``rank``/``world`` default to 0/1 (no rank sharding) unless
    given; the worker comes from ``torch.utils.data.get_worker_info()``."""
    info = torch.utils.data.get_worker_info()
    return Consumer(
        rank=0 if rank is None else rank,
        world_size=1 if world is None else world,
        worker=0 if info is None else info.id,
        num_workers=1 if info is None else info.num_workers,
    )


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """int64 ``[n]``: the read order of one pass, the same in every process for the
    same ``(seed, epoch)``."""
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(n, generator=gen)


def shard_bounds(n: int, num_shards: int) -> list[int]:
    """``num_shards + 1`` cut points splitting ``range(n)`` into near-equal contiguous
    shards (sizes differ by at most one)."""
    base, extra = divmod(n, num_shards)
    bounds = [0]
    for s in range(num_shards):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def stream_seed(base: int | None, *parts: int) -> int:
    """A seed for one online stream, distinct for each ``parts`` tuple (e.g. shard or
    worker, pass) and for each process rank, so processes that a trainer seeded alike
    still draw different samples. ``base=None`` uses ``torch.initial_seed()``."""
    seed = torch.initial_seed() if base is None else int(base)
    for p in (_rank(), *parts):
        seed = (seed * 6_364_136_223_846_793_005 + int(p) + 1_442_695_040_888_963_407) % (2**63)
    return seed
