"""torchrl-trl: mix TorchRL and Hugging Face TRL one piece at a time.

Public names (imported on first use, so ``import torchrl_trl`` stays light and never
imports ``trl``, ``datasets`` or ``ray``):

- TorchRL -> TRL data: :class:`TorchRLBufferDataset`, :func:`register_format`,
  :class:`BufferFormat`, :func:`available_formats`; scored groups -> offline trainer rows:
  :func:`best_of_n`, :func:`preference_pairs`, :func:`kto_rows`
- HF/TRL -> TorchRL rewards: :class:`HFRewardModelWrapper`, :class:`HFRewardTransform`;
  one reward model on Ray shared by many collectors: :class:`RewardServiceClient`
- reward functions both ways: :class:`RewardFunctionWrapper` (TRL-style functions in
  TorchRL), :func:`as_trl_reward_func` (TorchRL rewards as TRL ``reward_funcs``)
- online: :class:`CollectorCallback` (a TorchRL collector alongside a TRL trainer),
  :class:`StalenessFilter`, :func:`update_priorities`, :class:`BufferCheckpointCallback`
- TRL's GRPO on TorchRL rollouts: :class:`TorchRLRolloutFunc` (a ``rollout_func``),
  :class:`AsyncGroupCollector` + :class:`AsyncTorchRLRolloutFunc` (generation ahead of
  the trainer, bounded staleness, :class:`GroupReplay` reuse), :class:`BehaviourLogProbsMixin`; for
  ``AsyncGRPOTrainer``: :class:`TorchRLRolloutWorker`, :class:`TorchRLWeightTransfer`
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "TorchRLBufferDataset": "torchrl_trl.data",
    "BufferFormat": "torchrl_trl.data",
    "available_formats": "torchrl_trl.data",
    "get_format": "torchrl_trl.data",
    "register_format": "torchrl_trl.data",
    "best_of_n": "torchrl_trl.data.preference",
    "preference_pairs": "torchrl_trl.data.preference",
    "kto_rows": "torchrl_trl.data.preference",
    "SkipStats": "torchrl_trl.data.groups",
    "SkippedRolloutsWarning": "torchrl_trl.data.groups",
    "find_groups": "torchrl_trl.data.groups",
    "HFRewardModelWrapper": "torchrl_trl.rewards",
    "HFRewardTransform": "torchrl_trl.rewards",
    "load_reward_model": "torchrl_trl.rewards",
    "RewardServiceClient": "torchrl_trl.rewards.service",
    "RewardServiceError": "torchrl_trl.rewards.service",
    "RewardFunctionWrapper": "torchrl_trl.rewards.functions",
    "as_trl_reward_func": "torchrl_trl.rewards.trl_funcs",
    "CollectorCallback": "torchrl_trl.online",
    "CollectorError": "torchrl_trl.online",
    "StalenessFilter": "torchrl_trl.online",
    "update_priorities": "torchrl_trl.online",
    "TensorPrioritizedSampler": "torchrl_trl.online",
    "BufferCheckpointCallback": "torchrl_trl.online",
    "save_buffer": "torchrl_trl.online",
    "load_buffer": "torchrl_trl.online",
    "BufferCheckpointError": "torchrl_trl.online",
    "wait_for_items": "torchrl_trl.online",
    "connect_ray_replay_buffer": "torchrl_trl.online",
    "TorchRLRolloutFunc": "torchrl_trl.online",
    "AsyncGroupCollector": "torchrl_trl.online",
    "AsyncTorchRLRolloutFunc": "torchrl_trl.online",
    "BehaviourLogProbsMixin": "torchrl_trl.online",
    "GroupReplay": "torchrl_trl.online",
    "TorchRLRolloutWorker": "torchrl_trl.online",
    "TorchRLWeightTransfer": "torchrl_trl.online",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrl_trl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


if TYPE_CHECKING:
    from .data import BufferFormat, TorchRLBufferDataset, available_formats, get_format, register_format
    from .rewards import HFRewardModelWrapper, HFRewardTransform, load_reward_model
    from .rewards.functions import RewardFunctionWrapper
    from .rewards.service import RewardServiceClient, RewardServiceError
    from .data.groups import SkippedRolloutsWarning, SkipStats, find_groups
    from .data.preference import best_of_n, kto_rows, preference_pairs
    from .online import (
        BufferCheckpointCallback,
        BufferCheckpointError,
        CollectorCallback,
        CollectorError,
        StalenessFilter,
        TensorPrioritizedSampler,
        load_buffer,
        save_buffer,
        update_priorities,
        connect_ray_replay_buffer,
        wait_for_items,
        TorchRLRolloutFunc,
        AsyncGroupCollector,
        AsyncTorchRLRolloutFunc,
        BehaviourLogProbsMixin,
        GroupReplay,
        TorchRLRolloutWorker,
        TorchRLWeightTransfer,
    )
    from .rewards.trl_funcs import as_trl_reward_func
