"""Staleness: how many policy versions before the trainer's (consumer) version a row was generated."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .._checks import WarnOnce, non_negative_int

__all__ = ["StalenessFilter", "check_max_staleness", "collector_policy_version", "read_policy_version", "VERSION_KEYS"]

#: where TorchRL puts the version: ("next", ...) at generation time, the root one at reset
VERSION_KEYS: tuple[NestedKey, ...] = (("next", "policy_version"), "policy_version")


def check_max_staleness(value, owner: str) -> int | None:
    """A staleness bound: an int >= 0, or ``None`` for none; errors start with ``owner``."""
    return None if value is None else non_negative_int(value, f"{owner}: max_staleness")


def collector_policy_version(collector) -> int | None:
    """The collector's ``policy_version`` (an int), or ``None`` when it tracks none."""
    version = getattr(collector, "policy_version", None)
    return version if isinstance(version, int) else None


def read_policy_version(batch: TensorDictBase, keys: Sequence[NestedKey] = VERSION_KEYS) -> torch.Tensor:
    """int64 ``[B]``: each row's policy version, from the first of ``keys`` the batch has (else ``KeyError``).

    Args:
        batch (TensorDictBase): rows of rollouts.
        keys (sequence of NestedKey, optional): the keys tried, in order. Defaults to :data:`VERSION_KEYS`.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> read_policy_version(TensorDict({"next": {"policy_version": torch.tensor([2, 3])}}, [2])).tolist()
    [2, 3]
    """
    from .. import layouts

    for key in keys:
        if layouts.has_key(batch, key):
            values = layouts.read_column(batch, key)
            return torch.as_tensor([int(torch.as_tensor(v).reshape(-1)[0]) for v in values], dtype=torch.int64)
    raise KeyError(f"read_policy_version: expected a policy version at {list(keys)} (collect with "
                   f"track_policy_version=True); available keys: {layouts.available_keys(batch)}")


_COUNTS_LOCK = threading.Lock()  # module-level: a filter stays picklable for DataLoader workers


def _inverse_staleness(staleness: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + staleness.float())


class StalenessFilter:
    """Drop (and count) rows generated more than ``max_staleness`` versions ago: a callable
    ``fn(batch) -> bool tensor [B]`` for ``RowColumns(sample_filter=...)`` (a dataset's
    ``format``); or down-weight them with :meth:`weight_column` as a ``RowColumns(columns=)`` entry.

    Args:
        max_staleness (int or None, optional): largest accepted ``consumer_version -
            row_version`` (``None``: keep all). Defaults to ``None``.

    Keyword Args:
        version_keys (sequence of NestedKey, optional): keys tried in order to read each row's
            version. Defaults to :data:`VERSION_KEYS`.
        weight_fn (callable, optional): ``staleness (int64 [B]) -> float [B]`` for
            :meth:`weight_column`. Defaults to ``None``: ``1 / (1 + staleness)``.
        consumer_version (int, optional): initial version of the trainer's weights (then set
            by :class:`CollectorCallback`). Defaults to ``0``.

    Counters ``seen``, ``dropped``, ``max_seen``, ``stats()`` are shared with DataLoader workers.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> batch = TensorDict({"next": {"policy_version": torch.tensor([0, 3, 5, 5])}}, [4])
    >>> filt = StalenessFilter(max_staleness=2, consumer_version=5)
    >>> import warnings
    >>> with warnings.catch_warnings(record=True):  # warns once: "dropping rows older than ..."
    ...     filt(batch).tolist()
    [False, True, True, True]
    >>> [round(w, 3) for w in filt.weight_column(batch)]  # 1 / (1 + staleness), to down-weight instead
    [0.167, 0.333, 1.0, 1.0]
    >>> filt.stats()["staleness/dropped"], filt.stats()["staleness/max_read"]
    (1, 5)
    """

    def __init__(
        self, max_staleness: int | None = None, *, version_keys: Sequence[NestedKey] = VERSION_KEYS,
        weight_fn: Callable[[torch.Tensor], torch.Tensor] | None = None, consumer_version: int = 0
    ) -> None:
        self.max_staleness = check_max_staleness(max_staleness, "StalenessFilter")
        self.version_keys = tuple(version_keys)
        self.weight_fn = weight_fn or _inverse_staleness
        # shared memory: DataLoader workers' copies see version updates and count their drops
        self._version = torch.tensor([int(consumer_version)]).share_memory_()
        self._counts = torch.zeros(4, dtype=torch.int64).share_memory_()  # seen, dropped, sum, max
        self._warnings = WarnOnce()  # per process; the counters above are the shared totals

    @property
    def consumer_version(self) -> int:
        """The version of the trainer's weights that staleness is measured against."""
        return int(self._version[0])

    @consumer_version.setter
    def consumer_version(self, value: int) -> None:
        self._version[0] = int(value)

    seen = property(lambda self: int(self._counts[0]), doc="Rows read.")
    dropped = property(lambda self: int(self._counts[1]), doc="Rows dropped.")
    max_seen = property(lambda self: int(self._counts[3]), doc="The largest staleness read.")

    def staleness(self, batch: TensorDictBase) -> torch.Tensor:
        """int64 ``[B]``: ``consumer_version - version`` of each row (clamped at 0)."""
        return (self.consumer_version - read_policy_version(batch, self.version_keys)).clamp_min(0)

    def __call__(self, batch: TensorDictBase) -> torch.Tensor:
        stale = self.staleness(batch)
        keep = torch.ones_like(stale, dtype=torch.bool) if self.max_staleness is None else stale <= self.max_staleness
        n_drop = int((~keep).sum())
        with _COUNTS_LOCK:  # within a process; across worker processes the counts may race
            self._counts[0] += stale.numel()
            self._counts[1] += n_drop
            self._counts[2] += int(stale.sum())
            self._counts[3] = max(int(self._counts[3]), int(stale.max()) if stale.numel() else 0)
        self._warnings.add("dropped", f"StalenessFilter: dropping rows older than max_staleness={self.max_staleness} "
                           f"versions (consumer_version={self.consumer_version}); counted in 'staleness/dropped'",
                           n=n_drop)
        return keep

    def weight_column(self, batch: TensorDictBase) -> list[float]:
        """A ``columns=`` spec: ``weight_fn(staleness)`` per row (down-weighting)."""
        return [float(w) for w in self.weight_fn(self.staleness(batch))]

    def stats(self) -> dict[str, float]:
        seen, dropped, total, most = self._counts.tolist()
        return {
            "staleness/seen": seen,
            "staleness/dropped": dropped,
            "staleness/mean_read": total / seen if seen else 0.0,
            "staleness/max_read": most,
        }
