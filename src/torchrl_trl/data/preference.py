"""Offline training data from groups of scored completions (see
:func:`~torchrl_trl.data.groups.find_groups`): preference pairs (DPO, RewardTrainer), KTO
rows and best-of-n rows for SFT, each a new ``ReplayBuffer(LazyStackStorage)`` with the
:class:`~torchrl_trl.data.groups.SkipStats` of what was skipped as ``build_stats``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts
from .._checks import check_group_size, positive_int
from .groups import find_groups, read_scored, take_rows
from .formats import CHOSEN_KEY, LABEL_KEY, MARGIN_KEY, REJECTED_KEY

__all__ = ["best_of_n", "kto_rows", "preference_pairs"]


def _to_buffer(stats, make_td: Callable[[], TensorDictBase]):
    """``make_td()`` in a new buffer, after :meth:`SkipStats.report` (which raises if it is empty)."""
    from torchrl.data import LazyStackStorage, ReplayBuffer

    stats.report()
    td = make_td()
    rb = ReplayBuffer(storage=LazyStackStorage(max(td.numel(), 1)), batch_size=None)
    rb.extend(td)
    rb.build_stats = stats
    return rb


def _check_threshold(name: str, value) -> float:
    """``value`` as a float, else an error starting with ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value != value:
        raise ValueError(f"{name} must be a number, got NaN")
    return float(value)


def _choices(groups, k: int | None = None):
    """``(g, members, rewards)`` of each group not all tied and, given ``k``, larger than ``k``."""
    for g, rows in enumerate(groups.members):
        r = groups.rewards[rows]
        if k is not None and len(rows) <= k:
            groups.stats.skip("group_not_larger_than_k")
        elif bool((r == r[0]).all()):
            groups.stats.skip("tied_group")
        else:
            yield g, rows, r


def preference_pairs(rollouts, *, strategy: Literal["best_vs_worst", "all"] = "best_vs_worst", margin: float = 0.0,
                     reward_key: NestedKey = layouts.REWARD_KEY, group_key: NestedKey = "query",
                     group_size: int | None = None):
    """Preference pairs from each group of completions of one prompt.

    Args:
        rollouts (ReplayBuffer or TensorDictBase): scored rollouts, each with a group id and one reward.

    Keyword Args:
        strategy (str, optional): ``"best_vs_worst"``: one pair per group, the highest-reward completion (first
            in arrival order among equals) against the lowest; ``"all"``: every pair of the group whose reward
            gap is above ``margin``. Defaults to ``"best_vs_worst"``.
        margin (float, optional): a pair is kept only when ``reward_chosen - reward_rejected > margin``
            (ties are always skipped). Defaults to ``0.0``.
        reward_key (NestedKey, optional): the reward. Defaults to ``("next", "reward")``.
        group_key (NestedKey, optional): the group id. Defaults to ``"query"``.
        group_size (int, optional): as :func:`~torchrl_trl.data.groups.find_groups`. Defaults to ``None``.

    Returns:
        a new ``ReplayBuffer(LazyStackStorage)`` of rows holding ``"chosen"`` and ``"rejected"`` (whole
        rollouts, tensors shared), float ``"margin"`` and int64 ``"group"``; ``.build_stats``: the :class:`SkipStats`.

    Raises:
        KeyError: the rollouts lack ``reward_key`` or ``group_key``.
        ValueError: no pair is left (every group tied, of size one, incomplete, ...).

    Rollouts as ``ChatEnv`` and a reward transform leave them:

    >>> import torch
    >>> from tensordict import TensorDict, lazy_stack
    >>> from torchrl.data.llm import History
    >>> def rollout(prompt, answer, reward):
    ...     chat = History.from_chats([[{"role": "user", "content": prompt},
    ...                                 {"role": "assistant", "content": answer}]])[0]
    ...     return TensorDict({"query": prompt, "history": {"prompt": chat[:1], "response": chat[1:], "full": chat},
    ...                        "next": {"reward": torch.tensor([[reward]])}}, [])
    >>> rollouts = lazy_stack([rollout("2+2=", "4", 1.0), rollout("2+2=", "5", 0.0), rollout("2+2=", "22", 0.5)])
    >>> pairs = preference_pairs(rollouts)
    >>> len(pairs), pairs[0]["margin"].item(), pairs.build_stats.rows
    (1, 1.0, 1)
    >>> from torchrl_trl.data import TorchRLBufferDataset
    >>> row = next(iter(TorchRLBufferDataset(pairs, 1, format="dpo_conversational", reading="epoch")))
    >>> row["chosen"], row["rejected"]
    ([{'role': 'assistant', 'content': '4'}], [{'role': 'assistant', 'content': '5'}])
    >>> len(preference_pairs(rollouts, strategy="all", margin=0.2))  # 4>22 (0.5), 4>5 (1.0), 22>5 (0.5)
    3
    """
    if strategy not in ("best_vs_worst", "all"):
        raise ValueError(f"preference_pairs: strategy must be 'best_vs_worst' or 'all', got {strategy!r}")
    margin = _check_threshold("preference_pairs: margin", margin)
    if margin < 0:
        raise ValueError(f"preference_pairs: margin must be >= 0 (ties are never a preference), got {margin}")
    groups = find_groups(rollouts, group_key=group_key, reward_key=reward_key, group_size=group_size,
                         op="preference_pairs")
    stats, rewards = groups.stats, groups.rewards
    chosen, rejected, group_index = [], [], []
    for g, rows, r in _choices(groups):
        if strategy == "best_vs_worst":
            # argmax/argmin return the first occurrence: ties broken by arrival order
            pairs = [(int(r.argmax()), int(r.argmin()))]
        else:
            i, j = torch.triu_indices(len(rows), len(rows), offset=1)
            first_better = r[i] > r[j]
            ci, ri = torch.where(first_better, i, j), torch.where(first_better, j, i)
            tied = r[i] == r[j]
            stats.skip("tied_pair", int(tied.sum()))
            pairs = [(a, b) for a, b, t in zip(ci.tolist(), ri.tolist(), tied.tolist()) if not t]
        kept = [(a, b) for a, b in pairs if float(r[a] - r[b]) > margin]
        stats.skip("below_margin", len(pairs) - len(kept))
        if kept:
            stats.used_groups += 1
        chosen += [int(rows[a]) for a, _ in kept]
        rejected += [int(rows[b]) for _, b in kept]
        group_index += [g] * len(kept)
    stats.rows = len(chosen)
    ci, ri = torch.tensor(chosen), torch.tensor(rejected)
    return _to_buffer(stats, lambda: TensorDict({
        CHOSEN_KEY: take_rows(groups.rollouts, ci), REJECTED_KEY: take_rows(groups.rollouts, ri),
        MARGIN_KEY: rewards[ci] - rewards[ri], "group": torch.tensor(group_index, dtype=torch.long),
    }, batch_size=[len(chosen)]))


def kto_rows(rollouts, *, threshold: float | None = None, k: int | None = None,
             reward_key: NestedKey = layouts.REWARD_KEY, group_key: NestedKey = "query", group_size: int | None = None):
    """Unpaired desirable/undesirable rows for ``KTOTrainer``.

    Args:
        rollouts (ReplayBuffer or TensorDictBase): scored rollouts, each with a group id and one reward.

    Keyword Args:
        threshold (float, optional): a number: every rollout is a row, desirable (``label=True``) when its
            reward is ``>= threshold``, no grouping. ``None``: within each group the ``k`` best are desirable,
            the ``k`` worst not; rewards on both sides of the cut, the middle of an odd group, all-tied groups
            and groups of one are skipped. Defaults to ``None``.
        k (int, optional): rank mode: completions per side. Defaults to ``None`` (``len(group) // 2``).
        reward_key (NestedKey, optional): the reward. Defaults to ``("next", "reward")``.
        group_key (NestedKey, optional): the group id. Defaults to ``"query"``.
        group_size (int, optional): as :func:`~torchrl_trl.data.groups.find_groups`. Defaults to ``None``.

    Returns:
        a new ``ReplayBuffer(LazyStackStorage)`` of the selected rollouts (tensors shared), each with a bool
        ``"label"``; ``.build_stats``: the :class:`SkipStats`.

    >>> import torch
    >>> from tensordict import TensorDict, lazy_stack
    >>> def rollout(answer, reward):
    ...     return TensorDict({"query": "2+2=", "text": {"prompt": "2+2=", "response": answer},
    ...                        "next": {"reward": torch.tensor([[reward]])}}, [])
    >>> rollouts = lazy_stack([rollout("4", 1.0), rollout("5", 0.0), rollout("four", 0.8), rollout("22", 0.1)])
    >>> ranked = kto_rows(rollouts)  # the 2 best desirable, the 2 worst not
    >>> [(str(r["text", "response"]), bool(r["label"])) for r in ranked[:]]
    [('4', True), ('four', True), ('22', False), ('5', False)]
    >>> [bool(r["label"]) for r in kto_rows(rollouts, threshold=0.5)[:]]  # no grouping
    [True, False, True, False]
    """
    positive_int(k, "kto_rows: k", allow_none=True)
    if threshold is not None:
        if k is not None:
            raise ValueError("kto_rows: expected threshold= or k= (rank within groups), got both")
        threshold = _check_threshold("kto_rows: threshold", threshold)
        rows_td, rewards, index, stats = read_scored(rollouts, reward_key, "kto_rows")
        labels = rewards[index] >= threshold
        stats.rows = index.numel()
    else:
        groups = find_groups(rollouts, group_key=group_key, reward_key=reward_key, group_size=group_size, op="kto_rows")
        stats, rows_td = groups.stats, groups.rollouts
        picked, picked_labels = [], []
        for _, rows, r in _choices(groups):
            n = len(rows)
            kk = n // 2 if k is None else min(k, n // 2)
            order = torch.sort(r, descending=True, stable=True).indices
            top, bottom = order[:kk], order[n - kk :]
            stats.skip("middle_rollout", n - 2 * kk)
            both = set(r[top].tolist()) & set(r[bottom].tolist())
            good = [int(rows[i]) for i in top.tolist() if float(r[i]) not in both]
            bad = [int(rows[i]) for i in bottom.tolist() if float(r[i]) not in both]
            stats.skip("tied_at_cut", 2 * kk - len(good) - len(bad))
            if good or bad:
                stats.used_groups += 1
            picked += good + bad
            picked_labels += [True] * len(good) + [False] * len(bad)
        index, labels = torch.tensor(picked, dtype=torch.long), torch.tensor(picked_labels, dtype=torch.bool)
        stats.rows = len(picked)
    return _to_buffer(stats, lambda: take_rows(rows_td, index).set(LABEL_KEY, labels))


def best_of_n(rollouts, *, k: int = 1, reward_key: NestedKey = layouts.REWARD_KEY, group_key: NestedKey = "query",
              group_size: int | None = None, min_reward: float | None = None):
    """Rejection sampling: the ``k`` highest-reward completions of each group, for SFT.

    Args:
        rollouts (ReplayBuffer or TensorDictBase): scored rollouts, each with a group id and one reward.

    Keyword Args:
        k (int, optional): completions kept per group (ties broken by arrival order); groups of ``k`` or fewer
            and all-tied groups are skipped. Defaults to ``1``.
        reward_key (NestedKey, optional): the reward. Defaults to ``("next", "reward")``.
        group_key (NestedKey, optional): the group id. Defaults to ``"query"``.
        group_size (int, optional): as :func:`~torchrl_trl.data.groups.find_groups`. Defaults to ``None``.
        min_reward (float, optional): also drop kept completions whose reward is ``< min_reward``. Defaults to
            ``None``.

    Returns:
        a new ``ReplayBuffer(LazyStackStorage)`` of the kept rollouts (tensors shared); ``.build_stats``: the
        :class:`SkipStats`.

    >>> import torch
    >>> from tensordict import TensorDict, lazy_stack
    >>> def rollout(prompt, answer, reward):
    ...     return TensorDict({"query": prompt, "text": {"prompt": prompt, "response": answer},
    ...                        "next": {"reward": torch.tensor([[reward]])}}, [])
    >>> rollouts = lazy_stack([rollout("2+2=", "5", 0.0), rollout("2+2=", "4", 1.0),
    ...                        rollout("3+3=", "6", 0.9), rollout("3+3=", "9", 0.1)])
    >>> best = best_of_n(rollouts, k=1)
    >>> [str(r["text", "response"]) for r in best[:]]
    ['4', '6']
    >>> from torchrl_trl.data import TorchRLBufferDataset
    >>> list(TorchRLBufferDataset(best, 2, format="sft", reading="epoch"))
    [{'prompt': '2+2=', 'completion': '4'}, {'prompt': '3+3=', 'completion': '6'}]
    """
    positive_int(k, "best_of_n: k")
    check_group_size(group_size, "best_of_n")
    if group_size is not None and k >= group_size:
        raise ValueError(
            f"best_of_n: expected k < group_size, got k={k} for groups of {group_size} (every completion kept)"
        )
    if min_reward is not None:
        min_reward = _check_threshold("best_of_n: min_reward", min_reward)
    groups = find_groups(rollouts, group_key=group_key, reward_key=reward_key, group_size=group_size, op="best_of_n")
    stats, kept = groups.stats, []
    for _, rows, r in _choices(groups, k):
        top = torch.sort(r, descending=True, stable=True).indices[:k]
        if min_reward is not None:
            ok = r[top] >= min_reward
            stats.skip("below_min_reward", int((~ok).sum()))
            top = top[ok]
        if top.numel():
            stats.used_groups += 1
        kept += rows[top].tolist()
    stats.rows = len(kept)
    return _to_buffer(stats, lambda: take_rows(groups.rollouts, torch.tensor(kept, dtype=torch.long)))
