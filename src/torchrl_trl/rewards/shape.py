"""How a written reward is shaped: one vocabulary for reward models and reward functions.

TorchRL reads rewards in three shapes, and every scorer in this package names them the
same way (``reward_shape=``):

- ``"flat"``: ``[*B]``, what upstream ``HFRewardModelWrapper`` writes;
- ``"trailing"``: ``[*B, 1]``, an env's ``reward_spec`` shape for one reward per step;
- ``"step"``: ``[*B, 1, 1]``, what TorchRL's LLM reward parsers (``GSM8KRewardParser``)
  write at ``("next", "reward")`` and what ``MCAdvantage``/``GRPOLoss`` read.
"""
from __future__ import annotations

from typing import Literal

__all__ = ["RewardShape", "trailing_dims"]

RewardShape = Literal["flat", "trailing", "step"]
_TRAILING = {"flat": (), "trailing": (1,), "step": (1, 1)}


def trailing_dims(reward_shape: RewardShape) -> tuple[int, ...]:
    """The dims a reward of ``reward_shape`` adds after the batch dims.

    >>> trailing_dims("step")
    (1, 1)
    >>> trailing_dims("flat")
    ()
    """
    try:
        return _TRAILING[reward_shape]
    except (KeyError, TypeError):
        raise ValueError(
            f"reward_shape must be one of {sorted(_TRAILING)}, got {reward_shape!r}"
        ) from None
