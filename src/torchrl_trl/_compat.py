"""The few places where torchrl-trl relies on another library's private internals.

Each function wraps exactly one private use that has no public equivalent, names the
library versions it was checked against, and is covered by ``tests/test_compat.py``, so an
upgrade that breaks it fails in one obvious place instead of deep inside a trainer.
"""
from __future__ import annotations


def replay_lock(replay_buffer):
    """The lock a ``torchrl.data.ReplayBuffer`` holds while it writes or samples: holding it
    gives one consistent moment of its storage, sampler and writer (writers and samplers
    wait). A ``threading.RLock``; a no-op context for buffers that keep their storage in a
    Ray actor.

    Private use: ``ReplayBuffer._replay_lock`` (checked against torchrl 0.14.1, which has no
    public accessor for it).

    >>> import threading
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=ListStorage(4))
    >>> with replay_lock(rb):
    ...     writer = threading.Thread(target=rb.add, args=(1,))
    ...     writer.start(); writer.join(0.2)
    ...     len(rb), writer.is_alive()  # the writer waits for the lock
    (0, True)
    >>> writer.join(); len(rb)
    1
    """
    return replay_buffer._replay_lock


def bind_ray_replay_buffer(buffer, actor) -> None:
    """Make ``buffer``, a ``torchrl.data.RayReplayBuffer`` (subclass) instance created
    without ``RayReplayBuffer.__init__`` (which would start a new actor), read and write
    through ``actor``, an existing replay-buffer actor (e.g. ``ray.get_actor(name)``).
    ``actor=None`` unbinds it: ``buffer.is_alive`` is then ``False`` and its reads fail.
    The actor is never killed here. Data is moved to CPU before it is sent.

    Private use: the attributes ``RayReplayBuffer.__init__`` sets for the actor it creates
    (``_rb``, ``has_gpu``, ``_transport_kind``, ``_delayed_init``, ``_client``), checked
    against torchrl 0.14.1, which has no public way to attach to a running buffer actor.
    Exercised by ``tests/test_compat.py`` (needs ray).
    """
    if actor is None:
        for name in ("_rb", "_client"):
            buffer.__dict__.pop(name, None)
        return
    buffer._rb = actor
    buffer.has_gpu = False
    buffer._transport_kind = "ray"
    buffer._delayed_init = False
    buffer._client = buffer.client()  # public: a client of the actor bound above


def ray_runtime_lease(ray_init_config: dict | None = None):
    """A share of this process's Ray runtime: ``ray.init(**ray_init_config)`` if Ray is not
    initialised yet; ``.release()`` of the last share shuts Ray down only if a share started
    it. Shares are counted together with TorchRL's own Ray owners (``RayReplayBuffer``,
    collectors), so releasing ours never shuts Ray down under one of theirs.

    Private use: ``torchrl._comm.ray_runtime._RayRuntimeLease`` (checked against
    torchrl 0.14.1). Exercised by ``tests/test_compat.py`` (needs ray).
    """
    from torchrl._comm.ray_runtime import _RayRuntimeLease

    return _RayRuntimeLease.acquire(ray_init_config)
