"""A local replay buffer told from a remote one (a ``RayReplayBuffer`` or its client), and what
a forked process (a DataLoader worker) may read of a local one (:func:`guard_fork`,
:func:`readable_length`); whether ``LazyMemmapStorage`` keeps strings."""

from __future__ import annotations

import functools
import os
import weakref

from . import _compat

__all__ = ["guard_fork", "is_local", "local_parts", "local_sampler", "local_storage", "memmap_keeps_strings",
           "readable_length"]


def is_local(replay_buffer) -> bool:
    """Whether ``replay_buffer`` is a ``torchrl.data.ReplayBuffer`` with ``service_backend == "direct"``.

    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> is_local(ReplayBuffer(storage=ListStorage(4))), is_local(object())
    (True, False)
    """
    from torchrl.data import ReplayBuffer

    return isinstance(replay_buffer, ReplayBuffer) and replay_buffer.service_backend == "direct"


def local_storage(replay_buffer):
    """The buffer's storage, or ``None`` when it lives elsewhere (a Ray actor)."""
    return replay_buffer.storage if is_local(replay_buffer) else None


def local_sampler(replay_buffer):
    """The buffer's sampler, or ``None`` when it lives elsewhere (a Ray actor)."""
    return replay_buffer.sampler if is_local(replay_buffer) else None


def local_parts(replay_buffer, what: str):
    """``(storage, sampler, writer)`` of a local buffer; ``TypeError`` naming ``what`` for a remote one."""
    if not is_local(replay_buffer):
        raise TypeError(f"{what}: {type(replay_buffer).__name__} keeps its storage elsewhere (e.g. a Ray actor); "
                        "save or load a local torchrl.data.ReplayBuffer")
    return replay_buffer.storage, replay_buffer.sampler, replay_buffer.writer


@functools.cache
def memmap_keeps_strings() -> bool:
    """Whether this TorchRL's ``LazyMemmapStorage`` reads strings back as written (probed once)."""
    import tempfile

    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    with tempfile.TemporaryDirectory() as tmp:
        rb = ReplayBuffer(storage=LazyMemmapStorage(2, scratch_dir=tmp))
        rb.extend(TensorDict({"s": ["a", "b"]}, batch_size=[2]))
        return [str(s) for s in rb[:].get("s")] == ["a", "b"]


_GUARDED: weakref.WeakSet = weakref.WeakSet()
_HELD: list = []
_FORK_LEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # in a child: len at fork
_TORN: weakref.WeakSet = weakref.WeakSet()  # in a child: buffers forked mid-write
_FORK_WAIT_S = 30.0
_private_tensor_storages: list = []  # also: whether the fork hooks are registered


def guard_fork(replay_buffer) -> None:
    """Make ``fork`` wait for a write in progress on ``replay_buffer`` (the parent holds its lock
    across the fork); one still locked after 30 s is marked torn in the child (:func:`readable_length`)."""
    if not is_local(replay_buffer):
        return
    if not _private_tensor_storages:
        from torchrl.data import LazyMemmapStorage, TensorStorage

        # no imports in the hooks (a forked child must not wait for the import lock)
        _private_tensor_storages.extend([TensorStorage, LazyMemmapStorage])
        os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
    _GUARDED.add(replay_buffer)


def readable_length(replay_buffer) -> tuple[int, bool]:
    """``(n, live)``: how many items this process can read consistently, and whether later
    writes become readable here (a forked worker's copy of in-process data stops at the fork);
    ``RuntimeError`` where this process was forked while another thread wrote the buffer."""
    import torch.utils.data
    from torchrl.data import LazyMemmapStorage, TensorStorage

    if replay_buffer in _TORN:
        raise RuntimeError(
            "TorchRLBufferDataset: this DataLoader worker was forked while the buffer was written (lock held "
            "30 s): its copy may be torn; use num_workers=0, 'spawn', or pause the writer"
        )
    n = len(replay_buffer)
    if torch.utils.data.get_worker_info() is None:
        return n, True
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
            # the child's data stops at the fork, but its length counter is shared with the parent
            _compat.pin_storage_length(storage, _FORK_LEN.get(rb, len(storage)))
        if acquired:
            lock.release()
        else:  # the writer thread does not exist here: its lock would never be released
            _compat.reset_replay_lock(rb)
            _TORN.add(rb)
