"""Hugging Face reward models as TorchRL rewards (TRL/HF -> TorchRL)."""

from .model import HFRewardModelWrapper, load_reward_model
from .transform import HFRewardTransform

__all__ = ["HFRewardModelWrapper", "HFRewardTransform", "load_reward_model"]
