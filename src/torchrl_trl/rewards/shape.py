"""How a written reward is shaped (``reward_shape=`` of every scorer): ``"flat"`` ``[*B]``
(upstream ``HFRewardModelWrapper``), ``"trailing"`` ``[*B, 1]`` (an env's ``reward_spec``) or
``"step"`` ``[*B, 1, 1]`` (TorchRL's LLM reward parsers, ``MCAdvantage``, ``GRPOLoss``).
"""
from __future__ import annotations

from typing import Literal

__all__ = ["RewardShape", "trailing_dims"]

RewardShape = Literal["flat", "trailing", "step"]
_TRAILING = {"flat": (), "trailing": (1,), "step": (1, 1)}


def trailing_dims(reward_shape: RewardShape, owner: str) -> tuple[int, ...]:
    """The dims a reward of ``reward_shape`` adds after the batch dims; an unknown name is a
    ``ValueError`` starting with ``owner``.

    >>> trailing_dims("step", "RewardTransform")
    (1, 1)
    """
    try:
        return _TRAILING[reward_shape]
    except (KeyError, TypeError):
        raise ValueError(f"{owner}: reward_shape must be one of {sorted(_TRAILING)}, got {reward_shape!r}") from None
