"""From model outputs to rewards: read the score, pick a head, handle non-finite scores, write
``[N]`` scores as TorchRL rewards (:func:`write_rewards`, used by every scorer) and normalise
with running statistics (:class:`RunningRewardNorm`; scale and clip are TorchRL's
``RewardScaling``/``RewardClipping``, composed after the scorer).

A written reward's shape (``reward_shape=`` of every scorer, :data:`RewardShape`) is
``"flat"`` ``[*B]`` (upstream ``HFRewardModelWrapper``), ``"trailing"`` ``[*B, 1]`` (an env's
``reward_spec``) or ``"step"`` ``[*B, 1, 1]`` (TorchRL's LLM reward parsers, ``MCAdvantage``,
``GRPOLoss``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.envs import Transform

from .. import layouts
from .._checks import WarnOnce

__all__ = ["RewardOutput", "RewardShape", "RewardShapeError", "RunningRewardNorm", "extract_scores", "nonfinite_scores",
           "select_head", "trailing_dims", "write_rewards"]

RewardShape = Literal["flat", "trailing", "step"]
_TRAILING = {"flat": (), "trailing": (1,), "step": (1, 1)}


def trailing_dims(reward_shape: RewardShape, owner: str) -> tuple[int, ...]:
    """The dims a reward of ``reward_shape`` adds after the batch dims (``"step"``: ``(1, 1)``)."""
    try:
        return _TRAILING[reward_shape]
    except (KeyError, TypeError):
        raise ValueError(f"{owner}: reward_shape must be one of {sorted(_TRAILING)}, got {reward_shape!r}") from None


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


@dataclass(frozen=True)
class RewardOutput:
    """How a reward model's output becomes the reward it writes: the ``output=`` of
    :class:`~torchrl_trl.rewards.HFRewardModelWrapper` and
    :class:`~torchrl_trl.rewards.service.RewardServiceClient`.

    Args:
        head_index (int, optional): which output of a multi-label head is the reward.
            Defaults to ``None`` (the model returns one score per input).
        on_nonfinite (str or float, optional): ``"raise"`` on NaN/inf scores (a
            ``FloatingPointError``), ``"warn"`` (count and keep them) or a finite number
            written instead. Defaults to ``"raise"``.
        shape (str, optional): the written reward's shape: ``"flat"`` ``[*B]``, ``"trailing"``
            ``[*B, 1]`` or ``"step"`` ``[*B, 1, 1]``. Defaults to ``"flat"`` (upstream's).

    Examples:
        >>> RewardOutput(head_index=1, on_nonfinite=0.0).shape
        'flat'
    """

    head_index: int | None = None
    on_nonfinite: Literal["raise", "warn"] | float = "raise"
    shape: RewardShape = "flat"

    def __post_init__(self) -> None:
        index = self.head_index
        if index is not None and (isinstance(index, bool) or not isinstance(index, numbers.Integral)):
            raise TypeError(f"RewardOutput: head_index must be an int or None, got {index!r}")
        policy = self.on_nonfinite
        number = isinstance(policy, numbers.Real) and not isinstance(policy, bool) and math.isfinite(policy)
        if policy not in ("raise", "warn") and not number:
            raise ValueError(f"RewardOutput: on_nonfinite must be 'raise', 'warn' or a finite replacement value, "
                             f"got {policy!r}")
        trailing_dims(self.shape, "RewardOutput")  # checks the name


class RewardShapeError(RuntimeError, ValueError):
    """The model output is not one scalar reward per input (a ``RuntimeError`` as upstream raises)."""


def extract_scores(out: Any) -> torch.Tensor:
    """The score tensor of a model output: a tensor, ``.logits``/``.rewards`` or a dict's
    ``"logits"`` (else a ``RuntimeError``)."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "rewards"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    raise RuntimeError(
        f"HFRewardModelWrapper: could not extract reward from model output ({type(out).__name__}): expected a tensor, "
        "a dict with 'logits' or an output with .logits or .rewards"
    )


def select_head(logits: torch.Tensor, head_index: int | None, n_rows: int) -> torch.Tensor:
    """``[n]`` or ``[n, k]`` model scores -> ``[n]``; a multi-label head needs ``head_index``."""
    if logits.ndim == 1 and logits.shape[0] == n_rows:
        if head_index not in (None, 0):
            raise ValueError(f"HFRewardModelWrapper: RewardOutput(head_index={head_index}) given, expected a "
                             "multi-label model, it returns one score per row")
        return logits
    if logits.ndim != 2 or logits.shape[0] != n_rows:
        raise RewardShapeError(
            f"HFRewardModelWrapper: expected one scalar reward per input with shape [{n_rows}] "
            f"or [{n_rows}, 1] (or [{n_rows}, num_labels] with head_index=), got {tuple(logits.shape)}"
        )
    k = logits.shape[-1]
    if head_index is None and k != 1:
        raise RewardShapeError(
            f"HFRewardModelWrapper: expected one scalar reward per input, got logits of shape "
            f"{tuple(logits.shape)} (num_labels={k}): pick one with RewardOutput(head_index=0..{k - 1})"
        )
    head_index = 0 if head_index is None else head_index
    if not -k <= head_index < k:
        raise ValueError(f"HFRewardModelWrapper: RewardOutput(head_index={head_index}): expected -{k} <= head_index < "
                         f"{k} (num_labels={k})")
    return logits[:, head_index]


def nonfinite_scores(scores: torch.Tensor, policy: str | float, counter: WarnOnce) -> torch.Tensor:
    """``scores`` by ``policy`` (:attr:`RewardOutput.on_nonfinite`) where NaN/inf: a ``FloatingPointError``,
    or counted in ``counter`` (warned once) and kept (``"warn"``) or replaced by the number given."""
    finite = torch.isfinite(scores)
    if bool(finite.all()):
        return scores
    bad = int((~finite).sum())
    if policy == "raise":
        raise FloatingPointError(
            f"HFRewardModelWrapper: expected finite rewards, the model returned {bad} NaN/inf of "
            f"{scores.numel()}; pass output=RewardOutput(on_nonfinite='warn' or a value) to go on"
        )
    counter.add("nonfinite", f"reward model returned {bad} non-finite reward(s); counted in "
                "nonfinite_count", n=bad, stacklevel=4)  # fmt: skip
    if policy != "warn":
        scores = torch.where(finite, scores, scores.new_tensor(float(policy)))
    return scores


class RunningRewardNorm(Transform):
    """Normalise rewards by running statistics, ``(r - mean) / std``, on a tensordict, an env or a
    replay buffer (TorchRL's ``VecNormV2`` only runs in an env's step).

    Welford statistics over every finite reward seen (non-finite ones pass through), in float64
    buffers (saved with ``state_dict``); the std is 1 until two rewards were seen, and at least ``eps``.

    Args:
        in_keys (list of NestedKey, optional): the reward keys (rollouts:
            ``[("next", "reward")]``). Defaults to ``None`` (``["reward"]``).

    Keyword Args:
        update_stats (bool, optional): whether each call updates the statistics (freeze them
            for eval). Defaults to ``True``.
        eps (float, optional): floor of the std. Defaults to ``1e-6``.

    Examples:
        >>> from tensordict import TensorDict
        >>> norm = RunningRewardNorm(in_keys=[("next", "reward")])
        >>> td = TensorDict({("next", "reward"): torch.tensor([[[1.0]], [[3.0]]])}, batch_size=[2])
        >>> norm(td)["next", "reward"].flatten()
        tensor([-0.7071,  0.7071])
        >>> float(norm.mean), int(norm.count)
        (2.0, 2)
    """

    def __init__(self, in_keys: list[NestedKey] | None = None, *, update_stats: bool = True, eps: float = 1e-6) -> None:
        in_keys = ["reward"] if in_keys is None else in_keys
        super().__init__(in_keys=in_keys, out_keys=list(in_keys))
        if not (isinstance(eps, numbers.Real) and eps > 0):
            raise ValueError(f"RunningRewardNorm: eps must be a number > 0, got {eps!r}")
        self.update_stats, self.eps = bool(update_stats), float(eps)
        for name in ("count", "mean", "m2"):  # float64 buffers, saved with state_dict
            self.register_buffer(name, torch.zeros((), dtype=torch.float64))

    @property
    def std(self) -> torch.Tensor:
        if self.count < 2:
            return torch.ones((), dtype=torch.float64)
        return (self.m2 / (self.count - 1)).sqrt().clamp_min(self.eps)

    @torch.no_grad()
    def _update(self, x: torch.Tensor) -> None:
        x = x.detach().double().cpu()
        n = x.numel()
        if n == 0:
            return
        mean_b, total = x.mean(), self.count + n
        delta = mean_b - self.mean
        self.mean += delta * n / total
        self.m2 += ((x - mean_b) ** 2).sum() + delta**2 * self.count * n / total
        self.count.fill_(total)

    def _apply_transform(self, reward: torch.Tensor) -> torch.Tensor:
        finite = torch.isfinite(reward)
        if self.update_stats:
            self._update(reward[finite])
        out = (reward - self.mean.to(reward.device, reward.dtype)) / self.std.to(reward.device, reward.dtype)
        return torch.where(finite, out, reward)
