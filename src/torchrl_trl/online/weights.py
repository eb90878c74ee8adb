"""The trainer's weights to a TorchRL collector's policy, through TorchRL's own path.

``collector.update_policy_weights_(weights)`` is TorchRL's weight-update entry point: the
local fallback copy, a configured ``weight_updater`` (``vLLMUpdater``, ...) or the Ray
actor; with ``track_policy_version=True`` it also bumps the collector's ``PolicyVersion``,
which stamps every rollout generated afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from .ray import is_ray_collector

__all__ = ["collector_weights", "push_weights"]


def collector_weights(collector, model: torch.nn.Module) -> TensorDict:
    """``model``'s parameters and buffers (``TensorDict.from_module(model).data``) in the
    form ``collector.update_policy_weights_`` loads: nested under ``"model"`` when the
    collector's policy holds the model as ``policy.model`` (``TransformersWrapper``) or
    runs remotely (a Ray actor, which also gets them on the CPU)."""
    weights = TensorDict.from_module(model).data
    remote = is_ray_collector(collector)
    if remote:
        weights = weights.cpu()
    inner = getattr(getattr(collector, "policy", None), "model", None)
    if remote or isinstance(inner, torch.nn.Module):
        weights = TensorDict({"model": weights}, batch_size=[])
    return weights


def push_weights(
    collector,
    model: torch.nn.Module,
    *,
    weights_fn: Callable[[torch.nn.Module], Any] | None = None,
    lock: contextlib.AbstractContextManager | None = None,
) -> None:
    """Load ``model``'s weights into ``collector``'s policy with
    ``collector.update_policy_weights_`` (see the module doc).

    Args:
        weights_fn: ``fn(model) -> weights`` to hand TorchRL instead of
            :func:`collector_weights`.
        lock: held while TorchRL loads them (e.g. the lock a collector batch, or a
            behaviour log-prob scoring, holds), so no reader sees half of them.
    """
    weights = weights_fn(model) if weights_fn is not None else collector_weights(collector, model)
    with lock if lock is not None else contextlib.nullcontext():
        collector.update_policy_weights_(weights)
