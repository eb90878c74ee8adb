"""Find the groups of completions of one prompt in scored rollouts, as TorchRL's
``MCAdvantage`` does, over a whole buffer at once; what cannot be used is counted in
:class:`SkipStats`."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_tensor_collection
from tensordict.utils import NestedKey

from .. import layouts
from .._checks import check_group_size

__all__ = ["Groups", "SkipStats", "SkippedRolloutsWarning", "find_groups", "read_rewards", "to_rollouts"]


class SkippedRolloutsWarning(UserWarning):
    """Some rollouts or groups could not be used (see the :class:`SkipStats` counts).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     SkipStats(op="my_builder", rollouts=3, rows=2, skipped=Counter(singleton_group=1)).report()
    >>> caught[0].category is SkippedRolloutsWarning
    True
    """


@dataclass
class SkipStats:
    """What a builder read, produced and skipped.

    Args:
        op (str): the builder (``"best_of_n"``, ``"preference_pairs"``, ...).
        rollouts (int, optional): rollouts read from the input. Defaults to ``0``.
        groups (int, optional): complete groups found (before the builder's own skips). Defaults to ``0``.
        used_groups (int, optional): groups that produced at least one output row. Defaults to ``0``.
        rows (int, optional): output rows written (pairs, KTO rows, best-of-n rollouts). Defaults to ``0``.
        skipped (Counter, optional): ``{reason: count}``: ``"nonfinite_reward"``, ``"incomplete_group"`` (and
            ``"incomplete_group_rollouts"``), ``"singleton_group"``, ``"tied_group"``, ``"tied_pair"``,
            ``"below_margin"``, ``"tied_at_cut"``, ``"middle_rollout"``, ``"below_min_reward"``,
            ``"group_not_larger_than_k"``. Defaults to an empty ``Counter``.

    >>> stats = SkipStats(op="my_builder", rollouts=6, groups=2)
    >>> stats.skip("tied_group")
    >>> stats.used_groups, stats.rows = 1, 1
    >>> stats.summary()
    'my_builder: read 6 rollouts in 2 complete groups, 1 used, 1 rows written; skipped: tied_group=1'
    >>> stats.as_dict()
    {'rollouts': 6, 'groups': 2, 'used_groups': 1, 'rows': 1, 'skipped_tied_group': 1}
    """

    op: str
    rollouts: int = 0
    groups: int = 0
    used_groups: int = 0
    rows: int = 0
    skipped: Counter = field(default_factory=Counter)

    def skip(self, reason: str, n: int = 1) -> None:
        if n:
            self.skipped[reason] += int(n)

    def summary(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "nothing"
        grouped = f" in {self.groups} complete groups, {self.used_groups} used," if self.groups else ","
        return f"{self.op}: read {self.rollouts} rollouts{grouped} {self.rows} rows written; skipped: {skipped}"

    def as_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "groups": self.groups, "used_groups": self.used_groups,
                "rows": self.rows, **{f"skipped_{k}": v for k, v in self.skipped.items()}}

    def report(self) -> None:
        """Warn (once per call) when anything was skipped; raise when nothing is left."""
        if self.rows == 0:
            raise ValueError(f"{self.summary()}; expected rows to train on, none left")
        if self.skipped:
            warnings.warn(self.summary(), SkippedRolloutsWarning, stacklevel=4)  # the builder's caller


@dataclass
class Groups:
    """The groups :func:`find_groups` found.

    Attributes:
        rollouts: the rollouts ``[N]``; rewards: their float rewards ``[N]``.
        ids: each group's id (str, number or tuple); members: its int64 indices into ``rollouts``, in order.
        stats: the :class:`SkipStats` of what was left out.
    """

    rollouts: TensorDictBase
    rewards: torch.Tensor
    ids: list
    members: list[torch.Tensor]
    stats: SkipStats

    def __len__(self) -> int:
        return len(self.members)


def to_rollouts(rollouts, op: str = "find_groups") -> TensorDictBase:
    """A ``ReplayBuffer`` (all it stores) or a TensorDict of rollouts as a TensorDict ``[N]``."""
    from torchrl.data import ReplayBuffer

    if isinstance(rollouts, ReplayBuffer) and len(rollouts) == 0:
        raise ValueError(f"{op}: expected rollouts, the replay buffer is empty; fill it (e.g. run the collector) first")
    td = rollouts[:] if isinstance(rollouts, ReplayBuffer) else rollouts
    if not is_tensor_collection(td):
        raise TypeError(f"{op}: rollouts must be a torchrl ReplayBuffer of TensorDicts or a TensorDict, "
                        f"got {type(td).__name__}")
    if td.ndim == 0:
        td = td.unsqueeze(0)
    elif td.ndim > 1:
        td = td.reshape(-1)
    if td.numel() == 0:
        raise ValueError(f"{op}: expected rollouts, the input holds 0 rows")
    return td


def read_rewards(td: TensorDictBase, reward_key: NestedKey = layouts.REWARD_KEY,
                 op: str = "find_groups") -> torch.Tensor:
    """One float reward per rollout (``[N]``) from ``reward_key`` (one value per rollout, ``[N, 1, 1]``,
    ``[N, 1]`` or ``[N]``); errors start with ``op``."""
    if not layouts.has_key(td, reward_key):
        raise KeyError(
            f"{op}: no reward at key {reward_key!r}; score the rollouts first (a reward transform) or pass "
            f"reward_key=. Available keys: {layouts.available_keys(td)}"
        )
    rows = layouts.read_column(td, reward_key)
    bad = next((r for r in rows if not isinstance(r, torch.Tensor) or r.numel() != 1), None)
    if bad is not None:
        shape = tuple(bad.shape) if isinstance(bad, torch.Tensor) else type(bad).__name__
        raise ValueError(
            f"{op}: expected one reward per rollout at {reward_key!r}, got a rollout with reward shape {shape}"
        )
    return torch.stack([r.reshape(()) for r in rows]).float()


def read_scored(rollouts, reward_key: NestedKey, op: str) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor, Any]:
    """``(rollouts [N], rewards [N], indices of finite rewards, stats)``; non-finite ones counted, rollouts
    that lost tokens to padding refused (:func:`~torchrl_trl.layouts.check_padding_kept`)."""
    td = to_rollouts(rollouts, op)
    layouts.check_padding_kept(td, repairable=True)
    rewards = read_rewards(td, reward_key, op)
    stats = SkipStats(op=op, rollouts=td.numel())
    finite = torch.isfinite(rewards)
    stats.skip("nonfinite_reward", int((~finite).sum()))
    return td, rewards, finite.nonzero().reshape(-1), stats


def _group_ids(td: TensorDictBase, group_key: NestedKey, op: str) -> list:
    if not layouts.has_key(td, group_key):
        raise KeyError(
            f"{op}: no group id at key {group_key!r} (MCAdvantage's prompt_key; ChatEnv writes the prompt "
            f"as 'query'). Available keys: {layouts.available_keys(td)}"
        )
    ids = []
    for value in layouts.read_column(td, group_key):
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else tuple(value.reshape(-1).tolist())
        elif not isinstance(value, str):
            raise TypeError(f"{op}: group id at {group_key!r} must be a string or a tensor, got {type(value).__name__}")
        ids.append(value)
    return ids


def find_groups(rollouts, *, group_key: NestedKey = "query", reward_key: NestedKey = layouts.REWARD_KEY,
                group_size: int | None = None, op: str = "find_groups") -> Groups:
    """Group scored rollouts by prompt.

    Args:
        rollouts (ReplayBuffer or TensorDictBase): a ``ReplayBuffer`` (all it stores is read) or a TensorDict
            of rollouts, each with a group id at ``group_key`` and one reward at ``reward_key``.

    Keyword Args:
        group_key (NestedKey, optional): the group id (``MCAdvantage``'s ``prompt_key``): string or tensor.
            Defaults to ``"query"``.
        reward_key (NestedKey, optional): the reward, ``[*, 1, 1]`` as TorchRL's GRPO pipeline writes it.
            Defaults to ``("next", "reward")``.
        group_size (int, optional): ``None``: all rollouts sharing an id form one group (groups of one
            skipped). An int: as ``MCAdvantage(grpo_size=...)``, every ``group_size`` rollouts of an id close
            a group, in arrival order (a remainder is skipped). Defaults to ``None``.
        op (str, optional): the name used in stats and messages. Defaults to ``"find_groups"``.

    Returns:
        :class:`Groups`; rollouts with a non-finite reward are left out (counted).

    Scored rollouts as a TorchRL LLM pipeline leaves them, from two collector batches:

    >>> import torch
    >>> from tensordict import TensorDict, lazy_stack
    >>> def scored(prompt, reward):
    ...     return TensorDict({"query": prompt, "next": {"reward": torch.tensor([[reward]])}}, [])
    >>> first = lazy_stack([scored("2+2=", 1.0), scored("3+3=", 0.0), scored("5+5=", 1.0)])
    >>> second = lazy_stack([scored("2+2=", 0.0), scored("3+3=", float("nan"))])
    >>> groups = find_groups(torch.cat([first, second]))
    >>> groups.ids, [m.tolist() for m in groups.members], groups.rewards[groups.members[0]].tolist()
    (['2+2='], [[0, 3]], [1.0, 0.0])
    >>> dict(groups.stats.skipped)
    {'nonfinite_reward': 1, 'singleton_group': 2}

    >>> repeated = lazy_stack([scored("q", r) for r in (1.0, 0.0, 0.5, 0.2, 0.9)])
    >>> [m.tolist() for m in find_groups(repeated, group_size=2).members]
    [[0, 1], [2, 3]]
    """
    check_group_size(group_size, op)
    td, rewards, kept, stats = read_scored(rollouts, reward_key, op)
    ids = _group_ids(td, group_key, op)
    queues: dict[Any, list[int]] = {}
    for i in kept.tolist():
        queues.setdefault(ids[i], []).append(i)
    group_ids, members = [], []
    for gid, rows in queues.items():
        if group_size is None and len(rows) < 2:
            stats.skip("singleton_group")
            continue
        size = group_size or len(rows)
        rest = len(rows) % size
        if rest:
            stats.skip("incomplete_group")
            stats.skip("incomplete_group_rollouts", rest)
        for j in range(0, len(rows) - rest, size):
            group_ids.append(gid)
            members.append(torch.tensor(rows[j : j + size], dtype=torch.long))
    stats.groups = len(members)
    return Groups(td, rewards, group_ids, members, stats)


def take_rows(td: TensorDictBase, index: torch.Tensor) -> TensorDictBase:
    """Rows ``index`` of a 1-D TensorDict as a new one (tensors shared) whose new keys don't reach ``td``."""
    index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0:
        from tensordict import lazy_stack

        return lazy_stack([td.tensordicts[i].copy() for i in index.tolist()])
    return td[index]  # dense: indexing with a tensor gathers into new storage
