"""Ray: a ``RayReplayBuffer`` as the source of ``TorchRLBufferDataset``, filled by
collectors running in Ray actors (``RayLLMCollector``).

Only imported on use: ``import torchrl_trl`` never imports ``ray``.

Traps this module handles:

- ``RayReplayBuffer`` itself cannot be pickled (it owns the actor's lifetime); what a
  collector actor needs is ``buffer.client()``, a picklable handle without shutdown rights.
- ``TorchRLBufferDataset(ray_buffer, ...)`` reads through the actor: each ``sample`` /
  epoch chunk is one actor round-trip, so prefer large ``batch_size`` reads.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

__all__ = ["make_ray_collector", "make_ray_replay_buffer"]


def _require_ray():
    try:
        import ray
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("torchrl_trl.online.ray needs ray: pip install 'torchrl-trl[ray]'") from err
    return ray


def make_ray_replay_buffer(
    capacity: int,
    *,
    storage: Callable[..., Any] | None = None,
    sampler: Callable[[], Any] | None = None,
    num_cpus: float = 0,
    ray_init_config: dict[str, Any] | None = None,
    **kwargs,
):
    """A ``torchrl.data.RayReplayBuffer`` (one Ray actor owns the storage).

    Args:
        capacity: the storage's size.

    Keyword Args:
        storage: storage class/factory called with ``capacity`` (default ``LazyStackStorage``,
            which holds TorchRL's ragged LLM rollouts as they are).
        sampler: a zero-argument factory of the sampler (built inside the actor).
        num_cpus: CPUs reserved for the buffer actor (0: it only moves data).
        ray_init_config: ``ray.init`` arguments when Ray is not initialised yet.
        **kwargs: other ``ReplayBuffer`` arguments (``batch_size``, ``writer`` factory...).

    Close it with ``buffer.close()`` (kills the actor; what it held is lost unless saved
    with :func:`torchrl_trl.online.save_buffer`).
    """
    _require_ray()
    from torchrl.data import LazyStackStorage, RayReplayBuffer

    if sampler is not None:
        kwargs["sampler"] = sampler
    return RayReplayBuffer(
        storage=partial(storage or LazyStackStorage, capacity),
        remote_config={"num_cpus": num_cpus},
        ray_init_config=ray_init_config,
        **kwargs,
    )


def make_ray_collector(
    env_factory: Callable[[], Any],
    policy_factory: Callable[[], Any],
    replay_buffer,
    *,
    dialog_turns_per_batch: int,
    track_policy_version: bool = True,
    num_cpus: float = 1,
    num_gpus: float = 0,
    **kwargs,
):
    """A ``torchrl.collectors.llm.RayLLMCollector``: an ``LLMCollector`` in a Ray actor
    writing into ``replay_buffer`` (a ``RayReplayBuffer``; its picklable ``client()`` is
    what the actor gets).

    ``env_factory`` / ``policy_factory`` run inside the actor (build the model there, e.g.
    a ``vLLMWrapper`` on the actor's GPU). Start it with ``.start()`` (or let
    :class:`torchrl_trl.CollectorCallback` do it); weights go through
    ``collector.update_policy_weights_``.
    """
    _require_ray()
    from torchrl.collectors.llm import RayLLMCollector

    client = replay_buffer.client() if hasattr(replay_buffer, "client") else replay_buffer
    return RayLLMCollector(
        env=env_factory,
        policy_factory=policy_factory,
        dialog_turns_per_batch=dialog_turns_per_batch,
        replay_buffer=client,
        track_policy_version=track_policy_version,
        remote_config={"num_cpus": num_cpus, "num_gpus": num_gpus},
        **kwargs,
    )
