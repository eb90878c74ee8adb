"""TorchRL episodes -> the rows TRL's ``GRPOTrainer`` trains on (one row per episode).

Turn ``k + 1``'s prompt tokens must start with turn ``k``'s prompt + response; the tokens in
between (end of turn, a tool's reply) go into ``completion_ids`` with ``env_mask`` 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, lazy_stack
from tensordict.utils import NestedKey

from .. import layouts

__all__ = ["RolloutBatch", "episodes_to_trl", "forward_fields", "per_sample", "rollout_batch", "turns_to_trl"]

#: Generation log-probs of the response tokens, as TorchRL's wrappers write them.
GENERATED_LOGPROBS_KEY: NestedKey = ("log_probs", "response")
#: Per-token behaviour log-probs a collector's postproc records (``collector_rollouts``).
BEHAVIOUR_KEY = "behaviour_log_probs"
#: Name under which the env's reward (summed over turns) reaches TRL's reward functions.
TORCHRL_REWARD_FIELD = "torchrl_reward"
GROUP_ID_KEY = "group_id"
VERSION_KEY = "policy_version"
TURN_KEY = "turn"
#: Keys this package adds to rollout items: not dataset columns to forward.
OWN_KEYS = frozenset({GROUP_ID_KEY, VERSION_KEY, TURN_KEY, BEHAVIOUR_KEY, "query", "_reset"})


class RolloutBatch(dict):
    """TRL's rollout dict with the TorchRL steps it came from in :attr:`steps` (a lazy stack per turn)."""

    steps: list[TensorDictBase]


def per_sample(td: TensorDictBase) -> TensorDictBase:
    """``td`` ``[B]`` as a lazy stack of ``B`` per-sample TensorDicts (as ``LazyStackStorage`` stores)."""
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0 and td.batch_dims == 1:
        return td
    return lazy_stack(list(td.reshape(-1).unbind(0)))


def turns_to_trl(
    steps: Sequence[TensorDictBase], *, logprobs_key: NestedKey = GENERATED_LOGPROBS_KEY
) -> dict[str, list[list]]:
    """``N`` episodes of the same number of turns (``steps[t]``: the ``N`` samples' turn
    ``t``) as TRL's ``prompt_ids``, ``completion_ids``, ``env_mask`` and ``logprobs`` (lists
    of ``N`` lists), the log-probs read at ``logprobs_key`` (TorchRL's generated ones: each
    turn's first value NaN)."""
    prompt_ids = layouts.read_tokens(steps[0], "prompt").tolist()
    completion_ids, env_mask, logprobs = ([[] for _ in prompt_ids] for _ in range(3))
    generated = logprobs_key == GENERATED_LOGPROBS_KEY
    for turn, step in enumerate(steps):
        prompts = layouts.read_tokens(step, "prompt").tolist()
        responses = layouts.read_tokens(step, "response").tolist()
        if generated:
            lps = layouts.read_tokens(step, "response", key=logprobs_key).tolist()
        else:
            lps = [torch.as_tensor(v).reshape(-1).tolist() for v in layouts.read_column(step, logprobs_key)]
        for i, (p, r, lp) in enumerate(zip(prompts, responses, lps)):
            prev = prompt_ids[i] + completion_ids[i]  # the previous turn's prompt + response
            if p[: len(prev)] != prev:
                at = next((j for j, (a, b) in enumerate(zip(p, prev)) if a != b), min(len(p), len(prev)))
                raise ValueError(
                    f"turns_to_trl: sample {i}, turn {turn}: expected the prompt tokens to start with the previous "
                    f"turn's, they differ at {at} (re-tokenised chat); use ChatEnv(input_mode='tokens')"
                )
            if len(lp) != len(r):
                raise ValueError(
                    f"turns_to_trl: sample {i}, turn {turn}: expected one log-prob per response token at "
                    f"{logprobs_key!r}, got {len(lp)} for {len(r)}"
                )
            if generated and lp:  # TorchRL writes 0.0 for the first generated token: unknown
                lp = [float("nan")] + lp[1:]
            glue = p[len(prev) :]
            completion_ids[i] += glue + r
            env_mask[i] += [0] * len(glue) + [1] * len(r)
            logprobs[i] += [float("nan")] * len(glue) + list(lp)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "env_mask": env_mask, "logprobs": logprobs}


def forward_fields(steps: Sequence[TensorDictBase], keys: Sequence[NestedKey] | None = None) -> dict[str, list]:
    """Per-episode columns for TRL's reward functions: ``keys`` read from the last turn
    (``None``: every top-level key neither TorchRL's nor ours) and the env's reward summed
    over turns as ``"torchrl_reward"``."""
    last = steps[-1]
    if keys is None:
        skip = {*layouts.TORCHRL_ROOT_KEYS, *OWN_KEYS}
        keys = [k for k in layouts.first_member(last).keys() if k not in skip]
    fields = {}
    for key in keys:
        name = key if isinstance(key, str) else ".".join(key)
        fields[name] = [_to_python(v) for v in layouts.read_column(last, key)]
    if layouts.has_key(last, layouts.REWARD_KEY):
        total = sum(
            torch.stack([r.reshape(()) for r in layouts.read_column(s, layouts.REWARD_KEY)]).float() for s in steps
        )
        fields[TORCHRL_REWARD_FIELD] = total.tolist()
    return fields


def rollout_batch(rows: dict[str, list[list]], fields: dict[str, list], steps: list[TensorDictBase]) -> RolloutBatch:
    """TRL's rollout dict from :func:`turns_to_trl` rows and :func:`forward_fields`;
    ``env_mask`` only where some completion token is not the policy's."""
    out = RolloutBatch(prompt_ids=rows["prompt_ids"], completion_ids=rows["completion_ids"], logprobs=rows["logprobs"])
    if any(0 in m for m in rows["env_mask"]):
        out["env_mask"] = rows["env_mask"]
    out.update(fields)
    out.steps = steps
    return out


def episodes_to_trl(
    episodes: Sequence[TensorDictBase], *, logprobs_key: NestedKey = GENERATED_LOGPROBS_KEY,
    forward_keys: Sequence[NestedKey] | None = None,
) -> RolloutBatch:
    """One TRL row per episode (``episodes[i]``: its steps ``[T_i]``), in order;
    :attr:`RolloutBatch.steps`: the episodes' first steps, one lazy stack."""
    n = len(episodes)
    by_length: dict[int, list[int]] = {}
    for i, episode in enumerate(episodes):
        by_length.setdefault(episode.shape[0], []).append(i)
    out: dict[str, list] = {}
    for n_turns, index in by_length.items():
        steps = [lazy_stack([episodes[i][t] for i in index]) for t in range(n_turns)]
        new = {**turns_to_trl(steps, logprobs_key=logprobs_key), **forward_fields(steps, forward_keys)}
        for key, values in new.items():
            for i, value in zip(index, values):
                out.setdefault(key, [None] * n)[i] = value
    rows = {key: out.pop(key, []) for key in ("prompt_ids", "completion_ids", "env_mask", "logprobs")}
    return rollout_batch(rows, out, [lazy_stack([episode[0] for episode in episodes])])


def _to_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value
