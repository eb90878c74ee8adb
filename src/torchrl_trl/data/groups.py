"""Find the groups of completions of one prompt in scored rollouts, as ``MCAdvantage`` does.

TorchRL's ``MCAdvantage`` groups rollouts by ``prompt_key`` (default ``"query"``): a string
(the prompt) or a tensor (e.g. an integer group id, grouped by value). With a fixed
``group_size`` it queues rollouts per id in arrival order and closes a group every
``group_size`` rollouts. :func:`find_groups` does the same over a whole buffer at once, so a
group may be spread over several collector batches; what cannot be used is counted in
:class:`SkipStats` (non-finite rewards, incomplete groups, groups of size 1).

The builders in :mod:`torchrl_trl.data.preference` start from :func:`find_groups`.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_tensor_collection
from tensordict.utils import NestedKey

from .. import layouts

__all__ = ["Groups", "SkipStats", "SkippedRolloutsWarning", "find_groups", "read_rewards", "to_rollouts"]


class SkippedRolloutsWarning(UserWarning):
    """Some rollouts or groups could not be used (see the :class:`SkipStats` counts).

    >>> import warnings
    >>> stats = SkipStats(op="my_builder", rollouts=3, rows=2)
    >>> stats.skip("singleton_group")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     stats.report()
    >>> caught[0].category is SkippedRolloutsWarning
    True
    """


@dataclass
class SkipStats:
    """What a builder read, produced and skipped.

    Attributes:
        op: the builder (``"best_of_n"``, ``"preference_pairs"``, ...).
        rollouts: rollouts read from the input.
        groups: complete groups found (before the builder's own skips).
        used_groups: groups that produced at least one output row.
        rows: output rows written (pairs, KTO rows, best-of-n rollouts).
        skipped: ``{reason: count}``. Reasons: ``"nonfinite_reward"`` (rollouts),
            ``"incomplete_group"`` (groups short of ``group_size``) and
            ``"incomplete_group_rollouts"`` (their rollouts), ``"singleton_group"``,
            ``"tied_group"`` (every reward equal), ``"tied_pair"``, ``"below_margin"``
            (pairs), ``"tied_at_cut"``, ``"middle_rollout"``, ``"below_min_reward"``
            (rollouts), ``"group_not_larger_than_k"`` (groups).

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
            raise ValueError(f"nothing left to train on. {self.summary()}")
        if self.skipped:
            warnings.warn(self.summary(), SkippedRolloutsWarning, stacklevel=4)  # the builder's caller


@dataclass
class Groups:
    """Rollouts grouped by prompt.

    Attributes:
        rollouts: the rollouts, flattened to one dimension ``[N]``.
        rewards: float ``[N]`` one scalar reward per rollout.
        ids: the group id of each group (a string, a number or a tuple of numbers).
        members: per group, int64 row indices into :attr:`rollouts`, in arrival order.
        stats: counts of what grouping read and skipped.
    """

    rollouts: TensorDictBase
    rewards: torch.Tensor
    ids: list
    members: list[torch.Tensor]
    stats: SkipStats

    def __len__(self) -> int:
        return len(self.members)


def to_rollouts(rollouts) -> TensorDictBase:
    """A ``ReplayBuffer`` (everything it stores) or a TensorDict of rollouts, as a 1-D
    TensorDict ``[N]``."""
    from torchrl.data import ReplayBuffer

    if isinstance(rollouts, ReplayBuffer):
        if len(rollouts) == 0:
            raise ValueError("the replay buffer is empty; fill it (e.g. run the collector) first")
        td = rollouts[:]
    else:
        td = rollouts
    if not is_tensor_collection(td):
        raise TypeError(
            f"rollouts must be a torchrl ReplayBuffer of TensorDicts or a TensorDict, got {type(td).__name__}"
        )
    if td.ndim == 0:
        td = td.unsqueeze(0)
    elif td.ndim > 1:
        td = td.reshape(-1)
    if td.numel() == 0:
        raise ValueError("no rollouts: the input holds 0 rows")
    return td


def read_rewards(td: TensorDictBase, reward_key: NestedKey = layouts.REWARD_KEY) -> torch.Tensor:
    """One float reward per rollout (``[N]``) from ``reward_key`` (``[N, 1, 1]``, ``[N, 1]`` or
    ``[N]``; ragged rows must hold one element each).

    Raises:
        KeyError: naming ``reward_key`` and the available keys when the rollouts lack it.
        ValueError: when a rollout holds more than one reward value.
    """
    if not layouts.has_key(td, reward_key):
        raise KeyError(
            f"no reward at key {reward_key!r} in the rollouts; score them first (e.g. a "
            f"RewardFunctionWrapper or HFRewardTransform on the env or the buffer) or pass "
            f"reward_key=. Available keys: {layouts.available_keys(td)}"
        )
    rows = layouts.read_column(td, reward_key)
    bad = next((r for r in rows if not isinstance(r, torch.Tensor) or r.numel() != 1), None)
    if bad is not None:
        shape = tuple(bad.shape) if isinstance(bad, torch.Tensor) else type(bad).__name__
        raise ValueError(
            f"expected one reward per rollout at {reward_key!r}, got a rollout with reward shape {shape}"
        )
    return torch.stack([r.reshape(()) for r in rows]).float()


def _group_ids(td: TensorDictBase, group_key: NestedKey) -> list:
    if not layouts.has_key(td, group_key):
        raise KeyError(
            f"no group id at key {group_key!r} in the rollouts (MCAdvantage's prompt_key; ChatEnv "
            f"writes the prompt as 'query'). Available keys: {layouts.available_keys(td)}"
        )
    ids = []
    for value in layouts.read_column(td, group_key):
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else tuple(value.reshape(-1).tolist())
        elif not isinstance(value, str):
            raise TypeError(
                f"group id at {group_key!r} must be a string or a tensor, got {type(value).__name__}"
            )
        ids.append(value)
    return ids


def find_groups(
    rollouts,
    *,
    group_key: NestedKey = "query",
    reward_key: NestedKey = layouts.REWARD_KEY,
    group_size: int | None = None,
    op: str = "find_groups",
) -> Groups:
    """Group scored rollouts by prompt.

    Args:
        rollouts: a ``ReplayBuffer`` (all it stores is read) or a TensorDict of rollouts,
            each with a group id at ``group_key`` and one reward at ``reward_key``.

    Keyword Args:
        group_key: the group id (``MCAdvantage``'s ``prompt_key``): string or tensor.
        reward_key: the reward, ``[*, 1, 1]`` as TorchRL's GRPO pipeline writes it.
        group_size: ``None``: all rollouts sharing an id form one group, groups of one are
            skipped. An int: as ``MCAdvantage(grpo_size=group_size)``, every ``group_size``
            rollouts of an id (in arrival order) close a group, a remainder is an
            incomplete group and skipped.
        op: the name used in stats and messages.

    Returns:
        :class:`Groups`; rollouts with a non-finite reward are left out (counted).

    Scored rollouts as a TorchRL LLM pipeline leaves them (the prompt under ``"query"``,
    the reward ``[1, 1]`` under ``("next", "reward")``), from two collector batches:

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

    With ``group_size`` (``MCAdvantage(grpo_size=...)``), ids repeat: every ``group_size``
    rollouts of one id close a group, in arrival order.

    >>> repeated = lazy_stack([scored("q", r) for r in (1.0, 0.0, 0.5, 0.2, 0.9)])
    >>> [m.tolist() for m in find_groups(repeated, group_size=2).members]
    [[0, 1], [2, 3]]
    """
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2):
        raise ValueError(f"group_size must be an integer >= 2 or None, got {group_size!r}")
    td = to_rollouts(rollouts)
    rewards = read_rewards(td, reward_key)
    ids = _group_ids(td, group_key)
    stats = SkipStats(op=op, rollouts=len(ids))
    finite = torch.isfinite(rewards)
    stats.skip("nonfinite_reward", int((~finite).sum()))
    queues: dict[Any, list[int]] = {}
    for i in finite.nonzero().reshape(-1).tolist():
        queues.setdefault(ids[i], []).append(i)
    group_ids, members = [], []
    for gid, rows in queues.items():
        if group_size is None:
            if len(rows) < 2:
                stats.skip("singleton_group")
                continue
            chunks = [rows]
        else:
            n_full = len(rows) // group_size
            chunks = [rows[j * group_size : (j + 1) * group_size] for j in range(n_full)]
            rest = len(rows) - n_full * group_size
            if rest:
                stats.skip("incomplete_group")
                stats.skip("incomplete_group_rollouts", rest)
        for chunk in chunks:
            group_ids.append(gid)
            members.append(torch.tensor(chunk, dtype=torch.long))
    stats.groups = len(members)
    return Groups(td, rewards, group_ids, members, stats)


def take_rows(td: TensorDictBase, index: torch.Tensor) -> TensorDictBase:
    """Rows ``index`` of a 1-D TensorDict as a new TensorDict ``[len(index)]`` whose members
    can take new keys without touching ``td`` (tensors are shared, not copied)."""
    index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0:
        from tensordict import lazy_stack

        return lazy_stack([td.tensordicts[i].copy() for i in index.tolist()])
    return td[index]  # dense: indexing with a tensor gathers into new storage
