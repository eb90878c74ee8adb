"""Writing ``[N]`` scores into a tensordict as TorchRL rewards (shape, dtype, device): the
one convention every reward scorer writes with.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts
from .shape import RewardShape, trailing_dims

__all__ = ["write_rewards"]


def write_rewards(tensordict: TensorDictBase, rewards: torch.Tensor, key: NestedKey, reward_shape: RewardShape,
                  *, accumulate: bool = False) -> TensorDictBase:
    """Write ``[N]`` rewards into ``tensordict`` at ``key`` (in place), shaped
    ``[*batch_size, *trailing dims of reward_shape]``, in the floating dtype and on the device
    of a reward already there (else the default dtype, the tensordict's device or CPU);
    ``accumulate``: add to that reward (same shape required).

    >>> from tensordict import TensorDict
    >>> td = TensorDict({("next", "reward"): torch.ones(2, 1, 1)}, batch_size=[2])
    >>> write_rewards(td, torch.tensor([1.0, 2.0]), ("next", "reward"), "step", accumulate=True)["next", "reward"].flatten()
    tensor([2., 3.])
    """
    existing = tensordict.get(key, None) if layouts.has_key(tensordict, key) else None
    if not isinstance(existing, torch.Tensor) or existing.is_nested:
        existing = None
    device = tensordict.device if tensordict.device is not None else getattr(existing, "device", torch.device("cpu"))
    floating = existing is not None and existing.is_floating_point()
    dtype = existing.dtype if floating else torch.get_default_dtype()
    out = rewards.reshape(*tensordict.batch_size, *trailing_dims(reward_shape, "write_rewards")).to(device, dtype)
    if accumulate and existing is not None:
        if existing.shape != out.shape:
            raise ValueError(
                f"write_rewards: accumulate=True onto the reward at {key!r} of shape {tuple(existing.shape)}, expected "
                f"this scorer's {tuple(out.shape)} (reward_shape={reward_shape!r}); pass the matching reward_shape"
            )
        out = existing.to(out.dtype) + out
    tensordict.set(key, out)
    return tensordict
