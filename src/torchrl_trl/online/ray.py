"""Ray: a ``RayReplayBuffer`` as the source of ``TorchRLBufferDataset``, filled by collectors in
Ray actors (``RayLLMCollector``), reached by name from other processes. Imports ``ray`` on use only."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from .._checks import positive_int, positive_seconds

__all__ = ["connect_ray_replay_buffer", "is_ray_collector", "make_ray_collector", "make_ray_replay_buffer"]


def is_ray_collector(collector) -> bool:
    """Whether ``collector`` is a ``torchrl.collectors.llm.RayLLMCollector`` (``False``, importing
    nothing, without ray).

    >>> is_ray_collector(object())
    False
    """
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return False
    from torchrl.collectors.llm import RayLLMCollector

    return isinstance(collector, RayLLMCollector)


def _require_ray():
    try:
        import ray
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("torchrl_trl.online.ray: expected Ray installed: pip install 'torchrl-trl[ray]'") from err
    return ray


def make_ray_replay_buffer(
    capacity: int, *, storage: Callable[..., Any] | None = None, sampler: Callable[[], Any] | None = None,
    num_cpus: float = 0, ray_init_config: dict[str, Any] | None = None, name: str | None = None,
    namespace: str | None = None, **kwargs
):
    """A ``torchrl.data.RayReplayBuffer`` (one Ray actor owns the storage; ``close()`` kills it,
    and :func:`~torchrl_trl.online.save_buffer` saves local buffers only: copy ``buffer[:]``
    into a local ``ReplayBuffer`` first to keep what it holds).

    Args:
        capacity (int): the storage's size.

    Keyword Args:
        storage (callable, optional): storage class/factory called with ``capacity``. Defaults
            to ``None`` (``LazyStackStorage``).
        sampler (callable, optional): a zero-argument factory of the sampler (built inside the
            actor). Defaults to ``None`` (uniform).
        num_cpus (float, optional): CPUs reserved for the buffer actor. Defaults to ``0``.
        ray_init_config (dict, optional): ``ray.init`` arguments when Ray is not initialised yet.
            Defaults to ``None``.
        name (str, optional): make it a named actor, for :func:`connect_ray_replay_buffer`.
            Defaults to ``None``.
        namespace (str, optional): the named actor's namespace. Defaults to ``None``: the
            current job's, which other jobs do not see.
        **kwargs: other ``ReplayBuffer`` arguments (``batch_size``, ``writer`` factory...).

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import LazyTensorStorage
    >>> rb = make_ray_replay_buffer(16, storage=LazyTensorStorage)  # doctest: +SKIP
    >>> rb.extend(TensorDict({"x": torch.arange(4)}, [4]))  # doctest: +SKIP
    >>> len(rb), rb[:]["x"].tolist()  # doctest: +SKIP
    (4, [0, 1, 2, 3])
    >>> rb.close()  # doctest: +SKIP
    """
    _require_ray()
    capacity = positive_int(capacity, "make_ray_replay_buffer: capacity")
    from torchrl.data import LazyStackStorage, RayReplayBuffer

    if namespace is not None and name is None:
        raise ValueError("make_ray_replay_buffer: namespace= names where a named actor lives; expected name= too")
    if sampler is not None:
        kwargs["sampler"] = sampler
    named = {key: value for key, value in (("name", name), ("namespace", namespace)) if value is not None}
    return RayReplayBuffer(storage=functools.partial(storage or LazyStackStorage, capacity),
                           remote_config={"num_cpus": num_cpus, **named}, ray_init_config=ray_init_config, **kwargs)


def make_ray_collector(
    env_factory: Callable[[], Any], policy_factory: Callable[[], Any], replay_buffer, *, dialog_turns_per_batch: int,
    track_policy_version: bool = True, num_cpus: float = 1, num_gpus: float = 0, **kwargs
):
    """A ``torchrl.collectors.llm.RayLLMCollector``: an ``LLMCollector`` in a Ray actor (where
    ``env_factory`` / ``policy_factory`` run) writing into the ``RayReplayBuffer`` ``replay_buffer``.

    Args:
        env_factory (callable): builds the env, in the actor.
        policy_factory (callable): builds the policy, in the actor.
        replay_buffer (RayReplayBuffer): the buffer it writes into.

    Keyword Args:
        dialog_turns_per_batch (int): turns per collector batch.
        track_policy_version (bool, optional): tag the rollouts with the policy version.
            Defaults to ``True``.
        num_cpus (float, optional): CPUs of the collector actor. Defaults to ``1``.
        num_gpus (float, optional): GPUs of the collector actor. Defaults to ``0``.
        **kwargs: other ``RayLLMCollector`` arguments.

    >>> from torchrl_trl import testing
    >>> def env_factory():  # runs in the actor
    ...     return testing.make_chat_env([{"query": "1+1?", "answer": "2"}], batch_size=1)
    >>> def policy_factory():
    ...     tok = testing.make_tokenizer()
    ...     return testing.make_policy_wrapper(testing.make_policy(tok), tok, max_new_tokens=4)
    >>> rb = make_ray_replay_buffer(256)  # doctest: +SKIP
    >>> collector = make_ray_collector(env_factory, policy_factory, rb, dialog_turns_per_batch=4)  # doctest: +SKIP
    >>> collector.start()  # doctest: +SKIP
    """
    _require_ray()
    dialog_turns_per_batch = positive_int(dialog_turns_per_batch, "make_ray_collector: dialog_turns_per_batch")
    from torchrl.collectors.llm import RayLLMCollector

    client = replay_buffer.client() if hasattr(replay_buffer, "client") else replay_buffer
    return RayLLMCollector(
        env=env_factory, policy_factory=policy_factory, dialog_turns_per_batch=dialog_turns_per_batch,
        replay_buffer=client, track_policy_version=track_policy_version,
        remote_config={"num_cpus": num_cpus, "num_gpus": num_gpus}, **kwargs,
    )


def connect_ray_replay_buffer(
    name: str, *, namespace: str | None = None, address: str | None = None, timeout: float | None = 30.0,
    ray_init_config: dict[str, Any] | None = None
):
    """Attach this process (e.g. each ``torchrun`` rank) to a named Ray buffer actor made by
    another with ``make_ray_replay_buffer(..., name=name, namespace=namespace)``.

    Args:
        name (str): the actor's name.

    Keyword Args:
        namespace (str, optional): the actor's namespace (as given when it was made). Defaults
            to ``None``.
        address (str, optional): the cluster to join when Ray is not initialised here
            (``"auto"``, ``"HOST:6379"`` or the creator's ``ray.get_runtime_context().gcs_address``);
            ignored if it is. Defaults to ``None``.
        timeout (float or None, optional): seconds to wait for the actor, then ``LookupError``
            (``None``: no limit). Defaults to ``30.0``.
        ray_init_config (dict, optional): other ``ray.init`` arguments. Defaults to ``None``.

    Returns:
        An ``AttachedRayReplayBuffer``: a ``torchrl.data.RayReplayBuffer`` whose reads, writes and
        ``len`` go to the actor; its ``close()`` detaches this process only (and leaves Ray if
        this call started it).

    >>> owner = make_ray_replay_buffer(64, name="rollouts", namespace="demo")  # doctest: +SKIP
    >>> view = connect_ray_replay_buffer("rollouts", namespace="demo")  # doctest: +SKIP
    >>> len(view) == len(owner)  # doctest: +SKIP
    True
    >>> view.close()  # doctest: +SKIP
    """
    ray = _require_ray()
    timeout = positive_seconds(timeout, "connect_ray_replay_buffer: timeout")
    from .._compat import ray_runtime_lease

    config = dict(ray_init_config or {})
    if address is not None:
        config.setdefault("address", address)
    if namespace is not None:
        config.setdefault("namespace", namespace)
    lease = ray_runtime_lease(config)
    try:
        actor = _wait_for_actor(ray, name, namespace, timeout)
        return _attached_class()(actor, lease=lease)
    except BaseException:
        lease.release()
        raise


def _wait_for_actor(ray, name: str, namespace: str | None, timeout: float | None):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    try:
        known = sorted(f"{a['namespace']}/{a['name']}" for a in ray.util.list_named_actors(all_namespaces=True))
    except Exception:  # listing is only for the message
        known = ["<could not list>"]
    ns = namespace if namespace is not None else ray.get_runtime_context().namespace
    raise LookupError(
        f"connect_ray_replay_buffer: expected a Ray actor named {name!r} in namespace {ns!r}, none after {timeout}s; "
        f"named actors: {known or 'none'} (make_ray_replay_buffer creates it)"
    )


@functools.cache
def _attached_class():
    from torchrl.data import RayReplayBuffer

    from .._compat import bind_ray_replay_buffer

    class AttachedRayReplayBuffer(RayReplayBuffer):
        """A ``RayReplayBuffer`` view of an actor another process owns: no shutdown rights."""

        def __init__(self, actor, *, lease=None):
            # RayReplayBuffer.__init__ would create a new actor: bind to the existing one
            bind_ray_replay_buffer(self, actor)
            self._attached_actor = actor
            self._attached_lease = lease

        def close(self) -> None:
            """Detach: the actor keeps running for its owner and the other processes."""
            if self.is_alive:
                bind_ray_replay_buffer(self, None)
                if self._attached_lease is not None:
                    self._attached_lease.release()

        def __reduce__(self):
            # a copy (e.g. in a DataLoader worker) is another reader, without the lease
            if not self.is_alive:
                raise RuntimeError("AttachedRayReplayBuffer: this view was closed; connect again to read the actor")
            return (type(self), (self._attached_actor,))

        def __repr__(self) -> str:
            actor = self._attached_actor if self.is_alive else "<detached>"
            return f"{type(self).__name__}(actor={actor!r})"

    # pickled by reference to this module (its __getattr__ below)
    AttachedRayReplayBuffer.__module__ = __name__
    AttachedRayReplayBuffer.__qualname__ = "AttachedRayReplayBuffer"
    return AttachedRayReplayBuffer


def __getattr__(name: str):  # the class subclasses torchrl's RayReplayBuffer: built on first use
    if name == "AttachedRayReplayBuffer":
        return _attached_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
