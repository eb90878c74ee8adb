"""Small checks shared by every module: argument validation, key helpers, warn-once counters."""
from __future__ import annotations

import numbers
import warnings
from collections import Counter

__all__ = ["WarnOnce", "check_group_size", "config_or_default", "key_tuple", "non_negative_int", "positive_int",
           "positive_seconds", "strip_next"]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_group_size(group_size, owner: str) -> None:
    """A ``ValueError`` naming ``owner`` unless ``group_size`` is ``None`` or an int >= 2."""
    if group_size is not None and (not _is_int(group_size) or group_size < 2):
        raise ValueError(f"{owner}: group_size must be an integer >= 2 or None, got {group_size!r}")


def config_or_default(value, cls: type, name: str, owner: str):
    """``value`` if it is a ``cls`` (``None``: ``cls()``), else a ``TypeError`` naming ``owner`` and ``name``.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Batching:
    ...     size: int = 4
    >>> config_or_default(None, Batching, "batching", "Scorer")
    Batching(size=4)
    >>> config_or_default({"size": 2}, Batching, "batching", "Scorer")
    Traceback (most recent call last):
    ...
    TypeError: Scorer: batching must be a Batching or None, got dict
    """
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{owner}: {name} must be a {cls.__name__} or None, got {type(value).__name__}")
    return value


def positive_int(value, name: str, *, allow_none: bool = False):
    """``value`` if it is an int > 0 (or ``None`` when ``allow_none``), else a ``ValueError`` starting with ``name``.

    >>> positive_int(0, "TorchRLBufferDataset: batch_size")
    Traceback (most recent call last):
    ...
    ValueError: TorchRLBufferDataset: batch_size must be a positive integer, got 0
    """
    if value is None and allow_none:
        return None
    if not _is_int(value) or value <= 0:
        expected = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def non_negative_int(value, name: str) -> int:
    """``value`` if it is an int >= 0, else a ``ValueError`` starting with ``name``."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def positive_seconds(value, name: str) -> float | None:
    """``value`` as a float if it is a number > 0 (or ``None``), else a ``ValueError`` starting with ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def key_tuple(key) -> tuple:
    """A nested key as a tuple: ``"reward"`` -> ``("reward",)``."""
    return (key,) if isinstance(key, str) else tuple(key)


def strip_next(key):
    """A nested key without its leading ``"next"``: ``("next", "reward")`` -> ``"reward"``,
    ``("next", "a", "b")`` -> ``("a", "b")``."""
    if isinstance(key, tuple) and len(key) > 1 and key[0] == "next":
        return key[1] if len(key) == 2 else key[1:]
    return key


class WarnOnce:
    """Counts events per reason in ``counts`` and warns the first time each reason occurs.

    >>> import warnings
    >>> skipped = WarnOnce()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     skipped.add("empty", "2 empty completions skipped", n=2)
    ...     skipped.add("empty", "1 empty completion skipped")
    >>> len(caught), skipped.counts["empty"]
    (1, 3)
    """

    def __init__(self, category: type[Warning] = UserWarning):
        self.category = category
        self.counts: Counter = Counter()

    def add(self, reason, message: str, *, n: int = 1, stacklevel: int = 3) -> None:
        """Count ``n`` events of ``reason``; warn with ``message`` if it is the first time."""
        if n <= 0:
            return
        first = reason not in self.counts
        self.counts[reason] += n
        if first:
            warnings.warn(f"{message} (warning once)", self.category, stacklevel=stacklevel)
