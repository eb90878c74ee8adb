"""Who reads what: epoch orders, shards, and per-rank/per-worker random streams.

One epoch pass is ``order`` (a permutation of ``range(len(buffer))`` taken when the pass
starts), cut into ``num_shards`` contiguous shards. Whoever iterates a set of shards
yields exactly those items, so splitting the shard list over ranks (accelerate's
``IterableDataset.shard``, ``datasets.distributed.split_dataset_by_node``) and over
DataLoader workers (``datasets`` does it by shard) reads every item exactly once.

Beside a live writer, everyone reading one pass must agree on ``len(buffer)``:
:class:`PassLengths` takes it once per pass and shares it with DataLoader workers, and
:func:`guard_fork` keeps forked workers from inheriting a buffer in the middle of a write.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "Consumer", "PassLengths", "broadcast_length", "consumer", "epoch_order", "forked_mid_write",
    "guard_fork", "readable_length", "shard_bounds", "stream_seed", "world_size",
]


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


def broadcast_length(n: int) -> int:
    """``n`` as rank 0 has it, when ``torch.distributed`` runs several ranks (every rank
    must call this at the same point); ``n`` itself otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


class PassLengths:
    """``len(buffer)`` taken once per epoch pass and shared by everyone reading that pass.

    An epoch pass reads the items stored when it began. In the main process each pass
    takes its own length. The DataLoader workers of one loader iteration (same base seed,
    same count of iterations in each worker) use the length worker 0 took when the
    iteration began: worker 0 is forked (or pickled) first, so every worker's copy of an
    in-process buffer holds at least those items; the others wait for it (all workers
    start together). Later passes of the same iterator take a new length (the first
    worker to get there, under a file lock) only where workers see new writes (``live``,
    see :func:`readable_length`); a worker's private copy of an in-process buffer never
    grows, so it keeps the first length.

    :meth:`pin` fixes the length of the passes of ``epoch`` (e.g. broadcast from rank 0
    so every rank reads the same items, also when a trainer peeks at the dataset first).
    """

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

    def _take(self, epoch: int, take: Callable[[], int]) -> int:
        if int(self._pin[0]) == epoch:
            return int(self._pin[1])
        return take()

    def length(self, epoch: int, *, first: bool, pass_index: int, take: Callable[[], int], live: bool) -> int:
        """The length pass ``pass_index`` (of epoch ``epoch``) reads; ``first``: the first
        pass of this iteration; ``take()`` reads the length; ``live``: this process sees
        items written after it started (see :func:`readable_length`)."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return self._take(epoch, take)
        if first:
            self._iterations += 1
        key = ((info.seed - info.id) * 1_000_003 + self._iterations) % (2**62)
        if first:
            head = self._slot(key, -1)
            if info.id == 0:
                self._first = self._publish(head, key, -1, self._take(epoch, take))
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
            return self._publish(slot, key, pass_index, self._take(epoch, take))

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
        try:
            os.unlink(path)
        except OSError:
            pass


# ---------------------------------------------------------------------------
# Forking beside a writer thread
# ---------------------------------------------------------------------------

_GUARDED: weakref.WeakSet = weakref.WeakSet()
_HELD: list = []
_FORK_LEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # in a child: len at fork
_TORN: weakref.WeakSet = weakref.WeakSet()  # in a child: buffers forked mid-write
_FORK_WAIT_S = 30.0
_hooks: list = []
_private_tensor_storages: list = []


def guard_fork(replay_buffer) -> None:
    """Make forking (DataLoader workers) wait for a write in progress on
    ``replay_buffer``: the parent holds the buffer's lock across ``fork``, so a child
    neither inherits a lock no thread of its own will release (a deadlock) nor a
    half-written buffer, and records the length it had then (:func:`readable_length`).
    A buffer still locked after 30 s is marked torn in the child (:func:`forked_mid_write`)."""
    if getattr(replay_buffer, "_replay_lock", None) is None:
        return
    if not _hooks:
        from torchrl.data import LazyMemmapStorage, TensorStorage

        _private_tensor_storages.extend([TensorStorage, LazyMemmapStorage])  # nothing to import in the hooks
        os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
        _hooks.append(True)
    _GUARDED.add(replay_buffer)


def forked_mid_write(replay_buffer) -> bool:
    """Whether this process was forked while another thread was writing ``replay_buffer``."""
    return replay_buffer in _TORN


def readable_length(replay_buffer) -> tuple[int, bool]:
    """``(n, live)``: how many items this process can read consistently, and whether
    items written later become readable here.

    In the main process, ``len(buffer)`` and ``True``. A forked DataLoader worker holds a
    private copy of in-process data as it was at the fork, while a ``TensorStorage``'s
    length counter stays shared with the parent: it reads at most the length at the fork
    (memmap storages and remote buffers are shared: live). A spawned worker got a pickled
    copy: tensor storages are moved to shared memory (live), list-based ones are not.
    """
    n = len(replay_buffer)
    if torch.utils.data.get_worker_info() is None:
        return n, True
    from torchrl.data import LazyMemmapStorage, TensorStorage

    storage = getattr(replay_buffer, "_storage", None)
    if storage is None or isinstance(storage, LazyMemmapStorage):
        return n, True
    if replay_buffer in _FORK_LEN:
        return min(n, _FORK_LEN[replay_buffer]), False
    return n, isinstance(storage, TensorStorage)


def _before_fork() -> None:
    for rb in list(_GUARDED):
        lock = getattr(rb, "_replay_lock", None)
        if lock is not None:
            acquired = lock.acquire(timeout=_FORK_WAIT_S)
            _HELD.append((rb, lock, acquired))
            if acquired:
                _FORK_LEN[rb] = len(rb)  # the child keeps this (its copy of the dict)


def _after_in_parent() -> None:
    while _HELD:
        rb, lock, acquired = _HELD.pop()
        _FORK_LEN.pop(rb, None)
        if acquired:
            lock.release()


class _Length:
    """A process-private stand-in for a ``TensorStorage``'s shared length counter."""

    def __init__(self, value: int) -> None:
        self.value = value


def _after_in_child() -> None:
    tensor_storage, memmap_storage = _private_tensor_storages
    while _HELD:
        rb, lock, acquired = _HELD.pop()
        storage = getattr(rb, "_storage", None)
        if acquired and isinstance(storage, tensor_storage) and not isinstance(storage, memmap_storage):
            # the data is this child's copy as of the fork, but the length counter is shared
            # with the parent: without this the child's own sampler (online mode) would draw
            # rows written after the fork, which it holds as uninitialised memory
            storage._len_value = _Length(_FORK_LEN.get(rb, len(storage)))
        if acquired:
            lock.release()
        else:  # the writer thread does not exist here: its lock would never be released
            rb._replay_lock = threading.RLock()
            _TORN.add(rb)
