"""Small checks shared by every module: argument validation, key helpers, warn-once counters.

One helper per concern, so every module words its errors and its once-only warnings alike.
"""
from __future__ import annotations

import numbers
import warnings
from collections import Counter

__all__ = [
    "WarnOnce",
    "key_tuple",
    "moved_keywords",
    "non_negative_int",
    "positive_int",
    "positive_seconds",
    "strip_next",
]


def positive_int(value, name: str, *, allow_none: bool = False):
    """``value`` if it is an int > 0 (or ``None`` when ``allow_none``), else a ``ValueError``
    naming ``name``.

    >>> positive_int(4, "batch_size")
    4
    >>> positive_int(0, "batch_size")
    Traceback (most recent call last):
    ...
    ValueError: batch_size must be a positive integer, got 0
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        expected = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def non_negative_int(value, name: str) -> int:
    """``value`` if it is an int >= 0 (counts where 0 means "never" / "none"), else a
    ``ValueError`` naming ``name``.

    >>> non_negative_int(0, "reuse")
    0
    >>> non_negative_int(-1, "reuse")
    Traceback (most recent call last):
    ...
    ValueError: reuse must be an integer >= 0, got -1
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def positive_seconds(value, name: str) -> float | None:
    """``value`` as a float if it is a number > 0, ``None`` if ``None``, else a ``ValueError``.

    >>> positive_seconds(2, "timeout")
    2.0
    >>> positive_seconds(None, "timeout") is None
    True
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def key_tuple(key) -> tuple:
    """A nested key as a tuple (``"reward"`` -> ``("reward",)``), so keys compare and
    concatenate alike.

    >>> key_tuple("reward"), key_tuple(("next", "reward"))
    (('reward',), ('next', 'reward'))
    """
    return (key,) if isinstance(key, str) else tuple(key)


def strip_next(key):
    """A nested key without its leading ``"next"``: where a transform writes what the env
    later moves under ``"next"``.

    >>> strip_next(("next", "reward"))
    ('reward',)
    >>> strip_next("reward")
    'reward'
    """
    if isinstance(key, tuple) and len(key) > 1 and key[0] == "next":
        return key[1:]
    return key


class WarnOnce:
    """Counts events per reason and warns the first time each reason occurs.

    ``counts`` keeps the totals (what a user reads after a run); the warning is issued once
    per reason, so a loop over millions of samples warns once, and nothing is silent.

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


def moved_keywords(owner: str, kwargs: dict, moved: dict[str, str]) -> dict:
    """Accept the keywords of ``kwargs`` that moved elsewhere for one more release: each
    one given warns with a ``DeprecationWarning`` naming its new home (``moved[name]``).
    A keyword that never existed is a ``TypeError``, as Python raises for any call.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     moved_keywords("Thing", {"old": 1}, {"old": "pass it to Other(old=...)"})
    {'old': 1}
    >>> print(caught[0].category.__name__, caught[0].message)
    DeprecationWarning Thing(old=...) is deprecated and goes in the next release: pass it to Other(old=...)
    >>> moved_keywords("Thing", {"typo": 1}, {"old": "..."})
    Traceback (most recent call last):
    ...
    TypeError: Thing() got an unexpected keyword argument 'typo'
    """
    for name in kwargs:
        if name not in moved:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        warnings.warn(
            f"{owner}({name}=...) is deprecated and goes in the next release: {moved[name]}",
            DeprecationWarning,
            stacklevel=3,
        )
    return dict(kwargs)
