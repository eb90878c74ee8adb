"""Online and distributed: a TorchRL collector feeding a TRL trainer.

- :class:`CollectorCallback` (``transformers.TrainerCallback``): collect between optimizer
  steps or in the background, push weights, log buffer size / throughput / staleness.
- :class:`StalenessFilter`: drop or down-weight rows older than ``max_staleness`` versions.
- :func:`update_priorities`, :class:`TensorPrioritizedSampler`: priority feedback.
- :class:`BufferCheckpointCallback`, :func:`save_buffer`, :func:`load_buffer`: the buffer
  saved with, and restored from, the trainer's checkpoints.
- :class:`TorchRLRolloutFunc`: TorchRL (policy, ``ChatEnv``, replay buffer) as the
  ``rollout_func`` of TRL's ``GRPOTrainer``; :class:`AsyncGroupCollector` +
  :class:`AsyncTorchRLRolloutFunc`: the same with generation in a background thread,
  bounded staleness; :class:`BehaviourLogProbsMixin`: TRL's GRPO loss corrected with the
  behaviour log-probs; :class:`TorchRLRolloutWorker`, :class:`TorchRLWeightTransfer`:
  the same collector behind ``trl.experimental.async_grpo.AsyncGRPOTrainer``'s protocols.
- :mod:`torchrl_trl.online.ray`: Ray buffers and collectors (imports ``ray`` on use).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CollectorCallback": ".callback",
    "CollectorError": ".callback",
    "wait_for_items": ".callback",
    "StalenessFilter": ".staleness",
    "read_policy_version": ".staleness",
    "update_priorities": ".priority",
    "TensorPrioritizedSampler": ".priority",
    "BufferCheckpointCallback": ".checkpoint",
    "save_buffer": ".checkpoint",
    "load_buffer": ".checkpoint",
    "BufferCheckpointError": ".checkpoint",
    "make_ray_replay_buffer": ".ray",
    "make_ray_collector": ".ray",
    "connect_ray_replay_buffer": ".ray",
    "TorchRLRolloutFunc": ".rollout_func",
    "AsyncGroupCollector": ".async_rollouts",
    "AsyncTorchRLRolloutFunc": ".async_rollouts",
    "BehaviourLogProbsMixin": ".async_rollouts",
    "GroupReplay": ".async_rollouts",
    "TorchRLRolloutWorker": ".trl_async_grpo",
    "TorchRLWeightTransfer": ".trl_async_grpo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrl_trl.online' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
