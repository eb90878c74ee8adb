"""A local replay buffer (storage, sampler and writer in this process) told from a remote one
(a ``RayReplayBuffer`` or its client), through TorchRL's public ``ReplayBuffer`` properties."""

from __future__ import annotations


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
