"""Who reads what: epoch orders cut into contiguous shards over ranks and DataLoader workers, per-rank
and per-worker random streams, and one buffer length per pass for all its readers (:class:`PassLengths`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
import weakref

import numpy as np
import torch

from .._checks import positive_int

__all__ = ["PassLengths", "Sharding", "broadcast_length", "epoch_order", "split_count", "stream_seed", "worker_index"]


def _in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def worker_index() -> int:
    """This DataLoader worker's id (0 outside a worker)."""
    info = torch.utils.data.get_worker_info()
    return 0 if info is None else info.id


class Sharding:
    """Who reads which part of a :class:`~torchrl_trl.data.TorchRLBufferDataset`: ranks,
    DataLoader workers and Hugging Face shards.

    Args:
        num_shards (int, optional): shards of the Hugging Face iterable, split over ranks and workers.
            Defaults to ``None``: ``4 * world_size`` for epoch reading, ``world_size`` online.
        rank (int, optional): this process's rank, for ``TorchRLBufferDataset.__iter__`` only: split an epoch
            pass over processes (a plain ``DataLoader``); leave unset when a trainer shards. Defaults to ``None``.
        world_size (int, optional): the number of processes, with ``rank``. Defaults to ``None``.

    >>> s = Sharding(rank=1, world_size=2)
    >>> s.consumer()  # (index, count) outside a DataLoader worker
    (1, 2)
    >>> s.shards(default_per_process=4, world_size=2)
    8
    """

    def __init__(self, num_shards: int | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        self.num_shards = positive_int(num_shards, "Sharding: num_shards", allow_none=True)
        if (rank is None) != (world_size is None):
            raise ValueError("Sharding: expected both rank and world_size, or neither")
        if world_size is not None:
            positive_int(world_size, "Sharding: world_size")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
                raise ValueError(f"Sharding: rank must be an int in [0, world_size={world_size}), got {rank!r}")
        self.rank, self.world_size = rank, world_size
        self._process: tuple[int, int] | None = None
        if _distributed():
            self.process()  # joins the running group: nothing is started

    def process(self) -> tuple[int, int]:
        """``(rank, world_size)`` from accelerate's ``PartialState``, read once in the main process (a
        DataLoader worker uses its parent's)."""
        if self._process is None:
            if _in_worker() and not _distributed():
                return 0, 1
            from accelerate import PartialState

            state = PartialState()
            self._process = state.process_index, state.num_processes
        return self._process

    def shards(self, default_per_process: int, world_size: int | None = None) -> int:
        """``num_shards``, else ``default_per_process`` shards per training process."""
        if self.num_shards is not None:
            return self.num_shards
        return default_per_process * (self.process()[1] if world_size is None else world_size)

    def consumer(self) -> tuple[int, int]:
        """``(index, count)`` of the current ``__iter__`` reader among (rank, DataLoader worker) pairs."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        rank, world = (0, 1) if self.rank is None else (self.rank, self.world_size)
        return rank * workers + worker, world * workers

    def __getstate__(self) -> dict:
        if not _in_worker():  # pickled for a spawned DataLoader worker: it inherits our read
            self.process()
        return self.__dict__

    def __repr__(self) -> str:
        return f"Sharding(num_shards={self.num_shards}, rank={self.rank}, world_size={self.world_size})"


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """int64 ``[n]``: the read order of one pass, the same everywhere for ``(seed, epoch)``."""
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(_seed_from(seed, epoch))
    return torch.randperm(n, generator=gen)


def split_count(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` near-equal counts, as ``torch.tensor_split`` splits.

    >>> split_count(10, 4)
    [3, 3, 2, 2]
    """
    return [len(p) for p in torch.tensor_split(torch.empty(n, dtype=torch.uint8), parts)]


def _seed_from(*entropy: int) -> int:
    """A 63-bit seed from a tuple of non-negative ints (``numpy.random.SeedSequence``)."""
    lo, hi = np.random.SeedSequence([int(e) for e in entropy]).generate_state(2, np.uint32)
    return (int(hi) << 32 | int(lo)) & (2**63 - 1)


def stream_seed(base: int | None, rank: int, *parts: int) -> int:
    """A seed for one online stream, distinct per ``rank`` and ``parts`` (e.g. worker, pass);
    ``base=None``: ``torch.initial_seed()``.

    >>> stream_seed(0, 0, 1) == stream_seed(0, 0, 1) != stream_seed(0, 1, 1)
    True
    """
    return _seed_from(torch.initial_seed() if base is None else base, rank, *parts)


def broadcast_length(n: int) -> int:
    """``n`` as rank 0 has it under ``torch.distributed`` (every rank calls this), else ``n``."""
    import torch.distributed as dist

    if not _distributed() or dist.get_world_size() == 1:
        return n
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


class PassLengths:
    """``len(buffer)`` taken once per epoch pass and shared by everyone reading that pass: the length
    worker 0 took when the loader iteration began; a later pass takes a new one (the first worker there,
    under a file lock) only where workers see new writes. :meth:`pin` fixes it for ``epoch`` (rank 0's)."""

    def __init__(self, slots: int = 64, timeout: float = 120.0) -> None:
        # (key, pass, n) per slot; pin: (epoch, n)
        self._table = torch.full((slots, 3), -1, dtype=torch.int64).share_memory_()
        self._pin = torch.full((2,), -1, dtype=torch.int64).share_memory_()
        self._timeout = timeout
        self._iterations = 0  # per process: worker iterations started
        self._first = 0  # per process: the length of this worker iteration's first pass
        fd, self._lock_path = tempfile.mkstemp(prefix="torchrl_trl_pass_", suffix=".lock")
        os.close(fd)
        weakref.finalize(self, _unlink_if_owner, self._lock_path, os.getpid())

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_iterations": 0, "_first": 0}

    def pin(self, epoch: int, n: int) -> None:
        self._pin[0] = -1
        self._pin[1] = n
        self._pin[0] = epoch

    def length(self, epoch: int, n: int, *, first: bool, pass_index: int, live: bool) -> int:
        """The length pass ``pass_index`` of ``epoch`` reads (``first``: this iteration's first; ``n``: the
        length this reader sees now; ``live``: see :func:`torchrl_trl._buffers.readable_length`)."""
        n = int(self._pin[1]) if int(self._pin[0]) == epoch else n
        info = torch.utils.data.get_worker_info()
        if info is None:
            return n
        if first:
            self._iterations += 1
        key = ((info.seed - info.id) * 1_000_003 + self._iterations) % (2**62)
        if first:
            head = self._slot(key, -1)
            if info.id == 0:
                self._first = self._publish(head, key, -1, n)
            else:
                self._first = self._wait(head, key, -1)
            return self._first
        if not live:  # this worker's copy never grows: every pass reads the first length
            return self._first
        slot = self._slot(key, pass_index)
        with open(self._lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            if self._matches(slot, key, pass_index):
                return int(self._table[slot, 2])
            return self._publish(slot, key, pass_index, n)

    def _slot(self, key: int, pass_index: int) -> int:
        return (key + 7919 * pass_index) % self._table.shape[0]

    def _matches(self, slot: int, key: int, pass_index: int) -> bool:
        return int(self._table[slot, 0]) == key and int(self._table[slot, 1]) == pass_index

    def _publish(self, slot: int, key: int, pass_index: int, n: int) -> int:
        self._table[slot, 0] = -1  # readers ignore the slot while it is rewritten
        self._table[slot, 2] = n
        self._table[slot, 1] = pass_index
        self._table[slot, 0] = key
        return n

    def _wait(self, slot: int, key: int, pass_index: int) -> int:
        deadline = time.monotonic() + self._timeout
        while not self._matches(slot, key, pass_index):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"TorchRLBufferDataset: DataLoader worker waited {self._timeout:.0f} s for worker 0 "
                    "to take the length of the epoch pass; worker 0 did not start iterating"
                )
            time.sleep(0.001)
        return int(self._table[slot, 2])


def _unlink_if_owner(path: str, pid: int) -> None:
    if os.getpid() == pid:
        with contextlib.suppress(OSError):
            os.unlink(path)
