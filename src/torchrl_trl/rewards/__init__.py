"""Rewards, both ways: Hugging Face reward models and TRL reward functions in TorchRL, and
TorchRL rewards as TRL ``reward_funcs``.

- :class:`RewardTransform`: any scorer below in a TorchRL env's step or a buffer's write.
- :class:`HFRewardModelWrapper`, :class:`HFRewardTransform`, :func:`load_reward_model`: a
  sequence-classification reward model scoring TorchRL rollouts;
  :class:`RewardServiceClient`, :class:`RewardServiceError`: one such model on Ray shared
  by many collectors.
- :class:`RewardFunctionWrapper`: TRL-style reward functions in TorchRL;
  :func:`as_trl_reward_func`: TorchRL rewards as TRL ``reward_funcs``.

The public names are declared once, in ``__init__.pyi``, and imported on first use, so a
reward worker process that only needs :mod:`torchrl_trl.rewards.executors` does not
import transformers.
"""

from .._exports import attach

__getattr__, __dir__, __all__ = attach(__name__, __file__)
