"""Reward post-processing: pick a head, check finiteness, normalise, scale/shift, clip.

Order (each step optional): ``logits[:, head_index]`` -> non-finite check ->
running normalisation ``(r - mean) / std`` -> ``scale * r + shift`` -> ``clamp(clip)``.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Literal

import torch
from torch import nn

__all__ = ["RewardPostprocess", "RewardShapeError", "check_real", "select_head"]


class RewardShapeError(RuntimeError, ValueError):
    """The model output is not one scalar reward per input. A ``RuntimeError`` as
    upstream's ``HFRewardModelWrapper`` raises (and a ``ValueError``)."""


def check_real(name: str, value, *, optional: bool = False) -> float | None:
    """``value`` as a finite float (``None`` allowed when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite number{' or None' if optional else ''}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def select_head(logits: torch.Tensor, head_index: int | None, n_rows: int) -> torch.Tensor:
    """``[n]`` or ``[n, k]`` model scores -> ``[n]``; a multi-label head needs ``head_index``."""
    if logits.ndim == 1 and logits.shape[0] == n_rows:
        if head_index not in (None, 0):
            raise ValueError(f"head_index={head_index} given but the model returns one score per row")
        return logits
    if logits.ndim != 2 or logits.shape[0] != n_rows:
        raise RewardShapeError(
            f"HFRewardModelWrapper: expected one scalar reward per input with shape [{n_rows}] "
            f"or [{n_rows}, 1] (or [{n_rows}, num_labels] with head_index=), got "
            f"{tuple(logits.shape)}"
        )
    k = logits.shape[-1]
    if head_index is None:
        if k != 1:
            raise RewardShapeError(
                f"HFRewardModelWrapper: expected one scalar reward per input, got logits of "
                f"shape {tuple(logits.shape)}: the reward model has a multi-label head "
                f"(num_labels={k}); pass head_index= (0..{k - 1}) to pick the output to use as "
                "the reward"
            )
        return logits[:, 0]
    if not -k <= head_index < k:
        raise ValueError(f"head_index={head_index} out of range for num_labels={k}")
    return logits[:, head_index]


class RewardPostprocess(nn.Module):
    """Turn raw ``[N]`` scores into rewards.

    Args:
        scale, shift: ``r = scale * r + shift`` (after normalisation).
        clip: ``(low, high)`` bounds (either may be ``None``), applied last.
        normalize: ``"running"`` divides by a running std after subtracting a running mean
            (Welford statistics over every reward seen, kept in buffers so they save with
            ``state_dict``); ``None`` leaves scores as they are.
        update_stats: whether each call updates the running statistics.
        on_nonfinite: ``"raise"`` on NaN/inf scores; ``"warn"`` counts them in
            :attr:`nonfinite_count`, warns once and writes ``nonfinite_value`` instead
            (``None`` keeps the NaN/inf).
        nonfinite_value: replacement for non-finite scores in ``"warn"`` mode.
        eps: floor of the running std.
    """

    def __init__(
        self,
        *,
        scale: float = 1.0,
        shift: float = 0.0,
        clip: tuple[float | None, float | None] | None = None,
        normalize: Literal["running"] | None = None,
        update_stats: bool = True,
        on_nonfinite: Literal["raise", "warn"] = "raise",
        nonfinite_value: float | None = None,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if normalize not in (None, "running"):
            raise ValueError(f"normalize must be None or 'running', got {normalize!r}")
        if on_nonfinite not in ("raise", "warn"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'warn', got {on_nonfinite!r}")
        if clip is not None:
            if not isinstance(clip, (tuple, list)) or len(clip) != 2:
                raise ValueError(f"clip must be (low, high), got {clip!r}")
            low = check_real("clip[0]", clip[0], optional=True)
            high = check_real("clip[1]", clip[1], optional=True)
            if low is not None and high is not None and low > high:
                raise ValueError(f"clip=(low, high) needs low <= high, got {clip!r}")
            clip = (low, high)
        scale, shift = check_real("scale", scale), check_real("shift", shift)
        nonfinite_value = check_real("nonfinite_value", nonfinite_value, optional=True)
        if check_real("eps", eps) <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.scale, self.shift, self.clip = scale, shift, clip
        self.normalize, self.update_stats, self.eps = normalize, update_stats, eps
        self.on_nonfinite, self.nonfinite_value = on_nonfinite, nonfinite_value
        self.nonfinite_count = 0
        self._warned = False
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("m2", torch.zeros((), dtype=torch.float64))

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
        mean_b = x.mean()
        m2_b = ((x - mean_b) ** 2).sum()
        total = self.count + n
        delta = mean_b - self.mean
        self.mean += delta * n / total
        self.m2 += m2_b + delta**2 * self.count * n / total
        self.count.fill_(total)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        finite = torch.isfinite(scores)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            if self.on_nonfinite == "raise":
                raise FloatingPointError(
                    f"reward model returned {bad} non-finite reward(s) out of {scores.numel()} "
                    "(pass on_nonfinite='warn' to count them and continue)"
                )
            self.nonfinite_count += bad
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"reward model returned {bad} non-finite reward(s); counted in "
                    f"nonfinite_count (this warning is shown once)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            if self.nonfinite_value is not None:
                scores = torch.where(finite, scores, scores.new_tensor(self.nonfinite_value))
        if self.normalize == "running":
            ok = torch.isfinite(scores)
            if self.update_stats:
                self._update(scores[ok])
            mean = self.mean.to(scores.device, scores.dtype)
            scores = (scores - mean) / self.std.to(scores.device, scores.dtype)
        if self.scale != 1.0 or self.shift != 0.0:
            scores = scores * self.scale + self.shift
        if self.clip is not None:
            low, high = self.clip
            scores = scores.clamp(min=low, max=high)
        return scores
