"""Hugging Face reward models as TorchRL rewards (TRL/HF -> TorchRL).

Names are imported on first use, so a reward worker process that only needs
:mod:`torchrl_trl.rewards.executors` does not import transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["HFRewardModelWrapper", "HFRewardTransform", "load_reward_model"]

_EXPORTS = {
    "HFRewardModelWrapper": ".model",
    "load_reward_model": ".model",
    "HFRewardTransform": ".transform",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:
    from .model import HFRewardModelWrapper, load_reward_model
    from .transform import HFRewardTransform
