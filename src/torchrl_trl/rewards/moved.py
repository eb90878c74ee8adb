"""Keyword arguments of the reward-model scorers that moved, and where: removed ones
(:data:`MOVED`) raise a ``TypeError`` naming their replacement; deprecated ones
(:data:`DEPRECATED`) still work, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .batching import RewardBatching

__all__ = [
    "CLIENT_DEPRECATED", "DEPRECATED", "MOVED", "RAY_OPTIONS", "checked_batching",
    "moved_arguments_error", "moved_line",
]  # fmt: skip

_SCALE = (
    "a TorchRL transform after the scorer: "
    "torchrl.envs.RewardScaling(loc=shift, scale=scale, in_keys=[reward_key])"
)
_LOADING = (
    "HFRewardModelWrapper.from_pretrained(path, {}=...) (a model object is used as it is: "
    "model.to(device, dtype))"
)
#: keyword arguments removed from the constructor (a ``TypeError``), and where they went
MOVED = {
    **{name: f"RewardRenderer({name}=...) (renderer=)" for name in
       ("policy_tokenizer", "input_mode", "part", "add_eos", "chat_template_kwargs")},
    **{name: f"RewardBatching({name}=...) (batching=)" for name in
       ("max_tokens_per_batch", "max_batch_size", "pad_to_multiple_of", "min_fill", "packing",
        "max_length", "truncation")},
    "scale": _SCALE,
    "shift": _SCALE,
    "clip": "a TorchRL transform after the scorer: torchrl.envs.RewardClipping(clamp_min, "
            "clamp_max, in_keys=[reward_key]) (both bounds: +-inf for a one-sided clip)",
    "normalize": "a transform after the scorer: "
                 "torchrl_trl.rewards.RunningRewardNorm(in_keys=[reward_key])",
    "nonfinite_value": "on_nonfinite=<value> (the replacement value itself)",
    "accumulate": "HFRewardTransform(scorer, accumulate=True), or "
                  "scorer.write(td, rewards, accumulate=True)",
    "reward_dtype": "a transform after the scorer: torchrl.envs.DTypeCastTransform (the reward "
                    "is written in the dtype of a reward already at reward_key, else "
                    "torch.get_default_dtype())",
    **{name: _LOADING.format(name) for name in
       ("device", "dtype", "trust_remote_code", "model_kwargs")},
}  # fmt: skip
#: keyword arguments that moved into a config object: accepted with a ``DeprecationWarning``
DEPRECATED = {"pad_token_id": "pass it to RewardBatching(pad_token_id=...) (batching=)"}
#: Ray actor options ``RewardServiceClient`` took one by one, now keys of its ``remote_config``
RAY_OPTIONS = ("namespace", "num_cpus", "num_gpus", "max_restarts", "lifetime")
CLIENT_DEPRECATED = {
    **DEPRECATED,
    **{name: f"pass it in remote_config={{{name!r}: ...}} (Ray actor options)"
       for name in RAY_OPTIONS},
}  # fmt: skip


def moved_arguments_error(owner: str, given: dict) -> TypeError:
    """The ``TypeError`` naming where each keyword ``owner`` no longer takes moved.

    >>> print(moved_arguments_error("HFRewardModelWrapper", {"max_length": 8}))
    HFRewardModelWrapper: max_length moved to RewardBatching(max_length=...) (batching=)
    """
    return TypeError(f"{owner}: " + "; ".join(moved_line(name) for name in sorted(given)))


def moved_line(name: str) -> str:
    """Where the removed keyword ``name`` went (or that it is unexpected)."""
    return f"{name} moved to {MOVED[name]}" if name in MOVED else f"unexpected keyword argument {name!r}"


def checked_batching(batching: Any, moved: dict, owner: str) -> RewardBatching:
    """``batching`` (default ``RewardBatching()``) with a deprecated ``pad_token_id=`` (from
    ``moved``) folded in; a ``TypeError`` when it is not a :class:`RewardBatching`."""
    batching = RewardBatching() if batching is None else batching
    if not isinstance(batching, RewardBatching):
        raise TypeError(f"batching must be a RewardBatching, got {type(batching).__name__}")
    pad = moved.get("pad_token_id")
    if pad is None:
        return batching
    if batching.pad_token_id not in (None, pad):
        raise ValueError(
            f"{owner}: pad_token_id={pad!r} and batching=RewardBatching(pad_token_id="
            f"{batching.pad_token_id!r}) disagree; give it once, in RewardBatching"
        )
    return dataclasses.replace(batching, pad_token_id=pad)
