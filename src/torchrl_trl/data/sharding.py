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

import contextlib
import fcntl
import os
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .. import _compat
from .._buffers import is_local, local_storage
from .._checks import positive_int

__all__ = [
    "Consumer", "PassLengths", "Sharding", "broadcast_length", "epoch_order", "forked_mid_write", "guard_fork",
    "process", "readable_length", "split_count", "stream_seed", "worker_index",
]


def process() -> tuple[int, int]:
    """``(rank, world_size)`` of this training process as accelerate's ``PartialState``
    sees it (the state TRL's trainers set up; it joins a process group already started
    with ``torch.distributed``). Call it in the main process, not in a DataLoader worker:
    under a launcher with no process group yet, ``PartialState`` starts one."""
    from accelerate import PartialState

    state = PartialState()
    return state.process_index, state.num_processes


def _in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


def worker_index() -> int:
    """This DataLoader worker's id (0 outside a worker)."""
    info = torch.utils.data.get_worker_info()
    return 0 if info is None else info.id


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


class Sharding:
    """Who reads which part of a :class:`~torchrl_trl.data.TorchRLBufferDataset`
    (``TorchRLBufferDataset(..., sharding=Sharding(...))``): the one place that knows ranks,
    DataLoader workers and Hugging Face shards.

    Args:
        num_shards: shards of the Hugging Face iterable (``None``: the reading strategy's
            default for this many processes, see :meth:`shards`). Ranks and DataLoader
            workers split them (accelerate, ``datasets``).
        rank, world_size: for ``TorchRLBufferDataset.__iter__`` only: also split an epoch
            pass over processes (a plain ``DataLoader`` under ``torch.distributed``). Leave
            unset when a trainer (accelerate) shards the Hugging Face iterable.

    The process's own rank (mixed into online sampling seeds, so ranks draw different
    samples) comes from accelerate's ``PartialState``, read in the main process and kept
    for DataLoader workers.

    >>> s = Sharding(rank=1, world_size=2)
    >>> s.consumer()  # outside a DataLoader worker
    Consumer(rank=1, world_size=2, worker=0, num_workers=1)
    >>> s.shards(default_per_process=4, world_size=2)
    8
    """

    def __init__(self, num_shards: int | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        self.num_shards = positive_int(num_shards, "num_shards", allow_none=True)
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither.")
        if world_size is not None:
            positive_int(world_size, "world_size")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
                raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}.")
        self.rank, self.world_size = rank, world_size
        self._process: tuple[int, int] | None = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.process()  # joins the running group: nothing is started

    def process(self) -> tuple[int, int]:
        """``(rank, world_size)`` of this training process (:func:`process`), read once in
        the main process; a DataLoader worker uses what its parent read (or ``(0, 1)`` if
        the parent never read it and no process group is running)."""
        if self._process is None:
            if _in_worker() and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                return 0, 1
            self._process = process()
        return self._process

    def shards(self, default_per_process: int, world_size: int | None = None) -> int:
        """``num_shards``, else ``default_per_process`` shards per training process."""
        if self.num_shards is not None:
            return self.num_shards
        return default_per_process * (self.process()[1] if world_size is None else world_size)

    def consumer(self) -> Consumer:
        """The current reader of ``__iter__``: (``rank``, DataLoader worker); the rank is
        0 of 1 unless ``rank``/``world_size`` were given."""
        info = torch.utils.data.get_worker_info()
        return Consumer(
            rank=0 if self.rank is None else self.rank,
            world_size=1 if self.world_size is None else self.world_size,
            worker=0 if info is None else info.id,
            num_workers=1 if info is None else info.num_workers,
        )

    def __getstate__(self) -> dict:
        if not _in_worker():  # pickled for a spawned DataLoader worker: it inherits our read
            self.process()
        return self.__dict__

    def __repr__(self) -> str:
        return f"Sharding(num_shards={self.num_shards}, rank={self.rank}, world_size={self.world_size})"


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """int64 ``[n]``: the read order of one pass, the same in every process for the
    same ``(seed, epoch)``."""
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(_seed_from(seed, epoch))
    return torch.randperm(n, generator=gen)


def split_count(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` near-equal counts (earlier parts get the remainder), as
    ``torch.tensor_split`` splits a sequence.

    >>> split_count(10, 4)
    [3, 3, 2, 2]
    """
    return [len(p) for p in torch.tensor_split(torch.empty(n, dtype=torch.uint8), parts)]


def _seed_from(*entropy: int) -> int:
    """A 63-bit seed from a tuple of non-negative ints (``numpy.random.SeedSequence``)."""
    lo, hi = np.random.SeedSequence([int(e) for e in entropy]).generate_state(2, np.uint32)
    return (int(hi) << 32 | int(lo)) & (2**63 - 1)


def stream_seed(base: int | None, rank: int, *parts: int) -> int:
    """A seed for one online stream, distinct for each ``parts`` tuple (e.g. shard or
    worker, pass) and for each process ``rank``, so processes that a trainer seeded alike
    still draw different samples. ``base=None`` uses ``torch.initial_seed()``.

    >>> stream_seed(0, 0, 1) == stream_seed(0, 0, 1) != stream_seed(0, 1, 1)
    True
    """
    return _seed_from(torch.initial_seed() if base is None else base, rank, *parts)


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
        with contextlib.suppress(OSError):
            os.unlink(path)


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
    if not is_local(replay_buffer):  # a Ray client: nothing in this process to fork
        return
    if not _hooks:
        from torchrl.data import LazyMemmapStorage, TensorStorage

        # nothing to import in the hooks (a forked child must not wait for the import lock)
        _private_tensor_storages.extend([TensorStorage, LazyMemmapStorage])
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

    storage = local_storage(replay_buffer)
    if storage is None or isinstance(storage, LazyMemmapStorage):
        return n, True
    if replay_buffer in _FORK_LEN:
        return min(n, _FORK_LEN[replay_buffer]), False
    return n, isinstance(storage, TensorStorage)


def _before_fork() -> None:
    for rb in list(_GUARDED):
        lock = _compat.replay_lock(rb)
        if hasattr(lock, "acquire"):
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


def _after_in_child() -> None:
    tensor_storage, memmap_storage = _private_tensor_storages
    while _HELD:
        rb, lock, acquired = _HELD.pop()
        storage = rb.storage  # guarded buffers are local
        if acquired and isinstance(storage, tensor_storage) and not isinstance(storage, memmap_storage):
            # the data is this child's copy as of the fork, but the length counter is shared
            # with the parent: without this the child's own sampler (online mode) would draw
            # rows written after the fork, which it holds as uninitialised memory
            _compat.pin_storage_length(storage, _FORK_LEN.get(rb, len(storage)))
        if acquired:
            lock.release()
        else:  # the writer thread does not exist here: its lock would never be released
            _compat.reset_replay_lock(rb)
            _TORN.add(rb)
