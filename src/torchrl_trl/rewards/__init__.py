"""Rewards, both ways: Hugging Face reward models and TRL reward functions in TorchRL
(:class:`RewardTransform`, :class:`HFRewardModelWrapper`, :class:`RewardFunctionWrapper`),
and TorchRL rewards as TRL ``reward_funcs`` (:func:`as_trl_reward_func`). Public names are
declared in ``__init__.pyi`` and imported on first use (a reward worker does not import
transformers).
"""

from .._exports import attach

__getattr__, __dir__, __all__ = attach(__name__, __file__)
