"""Calling TRL reward functions (sync or async) the way TRL calls them: outputs validated,
exceptions re-raised with the function's name, optional timeouts; in the caller or one
completion at a time in an item executor.
"""

from __future__ import annotations

import asyncio
import numbers
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchrl_trl._checks import WarnOnce
from torchrl_trl._threads import run_async, run_in_thread

from .arguments import per_completion_items

__all__ = [
    "FAILURES", "FunctionTimeout", "RewardFunctionError", "call_function", "call_functions", "function_names",
    "named_error", "replay_logs", "run_coroutines", "run_with_timeout", "score_items", "to_rewards",
]  # fmt: skip


#: how an item of an isolated executor fails (the kinds of ``failure_counts``), as its warning says
FAILURES = {"error": "raised on", "timeout": "ran past its timeout on", "crash": "crashed its worker on"}


class RewardFunctionError(RuntimeError):
    """A reward function's exception that cannot be re-raised as its own type with the function's name."""


class FunctionTimeout(TimeoutError):
    """A reward function (or scorer) did not return within its ``timeout``."""


def function_names(funcs: Sequence[Callable], names: Sequence[str] | None = None) -> list[str]:
    """``names``, or TRL's names of ``funcs`` deduplicated with a ``_1``, ``_2``... suffix.

    >>> import functools
    >>> def acc(prompts, completions, **kw): ...
    >>> class Judge:
    ...     def __call__(self, prompts, completions, **kw): ...
    >>> function_names([acc, functools.partial(acc), Judge()])
    ['acc', 'acc_1', 'Judge']
    """
    if names is not None:
        return list(names)
    from trl.trainer.utils import get_callable_name

    out, seen = [], Counter()
    for f in funcs:
        base = get_callable_name(f)
        out.append(base if not seen[base] else f"{base}_{seen[base]}")
        seen[base] += 1
    return out


def named_error(err: BaseException, name: str, owner: str) -> BaseException:
    """``err`` re-created (same type where it can, else :class:`RewardFunctionError`) with ``owner`` and ``name``."""
    message = f"{owner}: reward function {name!r} raised {type(err).__name__}: {err}"
    try:
        new = type(err)(message)
    except Exception:
        return RewardFunctionError(message)
    return new if name in str(new) else RewardFunctionError(message)


def run_with_timeout(fn: Callable[[], Any], timeout: float | None, what: str) -> Any:
    """``fn()``; with ``timeout`` (s) in a daemon thread (abandoned past it: :class:`FunctionTimeout`)."""
    if timeout is None:
        return fn()
    return run_in_thread(fn, timeout, f"{what} did not return within timeout={timeout}s: expected a result by then",
                         error=FunctionTimeout, name="torchrl-trl-reward")


def run_coroutines(coros: list, names: list[str], timeout: float | None, owner: str) -> list:
    """Coroutines run concurrently (also from inside a running loop), each within ``timeout`` (s)."""

    async def one(coro, name):
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            raise FunctionTimeout(f"{owner}: reward function {name!r} did not return within timeout={timeout}s: "
                                  "expected a result by then")
        try:
            return task.result()
        except Exception as err:  # the function's own exception, TimeoutError included
            raise named_error(err, name, owner) from err

    async def gather():
        return await asyncio.gather(*(one(c, n) for c, n in zip(coros, names)))

    bound = None if timeout is None else timeout + 1.0  # the margin: a coroutine blocking the loop
    what = f"{owner}: the async reward functions {names} (one blocks the event loop without awaiting)"
    return run_async(gather(), bound, f"{what} did not return within timeout={bound}s: expected a result by then",
                     error=FunctionTimeout)


def call_function(func: Callable, name: str, kwargs: dict, timeout: float | None, owner: str) -> Any:
    """``func(**kwargs)`` within ``timeout`` (s), its exception re-raised with ``owner`` and ``name``."""
    try:
        return run_with_timeout(lambda: func(**kwargs), timeout, f"{owner}: reward function {name!r}")
    except FunctionTimeout:
        raise
    except Exception as err:
        raise named_error(err, name, owner) from err


def call_functions(funcs: Sequence[Callable], names: Sequence[str], kwargs: dict, timeout: float | None,
                   owner: str) -> list[list[float | None]]:
    """Each function called once on the whole batch (async ones concurrently): one validated list
    of rewards per function (``None`` kept)."""
    from trl.trainer.utils import is_async_callable

    n = len(kwargs["prompts"])
    pending = [i for i, f in enumerate(funcs) if is_async_callable(f)]
    out = {i: to_rewards(call_function(f, names[i], kwargs, timeout, owner), name=names[i], expected=n, owner=owner)
           for i, f in enumerate(funcs) if i not in pending}
    if pending:
        coros = [funcs[i](**kwargs) for i in pending]
        for i, value in zip(pending, run_coroutines(coros, [names[i] for i in pending], timeout, owner)):
            out[i] = to_rewards(value, name=names[i], expected=n, owner=owner)
    return [out[i] for i in range(len(funcs))]


def to_rewards(output: Any, *, name: str, expected: int, owner: str) -> list[float | None]:
    """One function's output as ``expected`` floats or ``None``, else a ``TypeError``/``ValueError``.

    >>> to_rewards([1, None, 0.5], name="f", expected=3, owner="RewardFunctionWrapper")
    [1.0, None, 0.5]
    >>> to_rewards([1.0], name="f", expected=2, owner="RewardFunctionWrapper")
    Traceback (most recent call last):
    ...
    ValueError: RewardFunctionWrapper: reward function 'f' returned 1 rewards, but 2 were expected (one per completion)
    """
    if hasattr(output, "tolist") and not isinstance(output, (str, bytes)):
        output = output.reshape(-1).tolist() if isinstance(output, torch.Tensor) else output.tolist()
    if isinstance(output, (str, bytes, Mapping)) or not isinstance(output, Sequence):
        raise TypeError(
            f"{owner}: reward function {name!r} must return a list of floats (or None), one per "
            f"completion; got {type(output).__name__}"
        )
    if len(output) != expected:
        raise ValueError(
            f"{owner}: reward function {name!r} returned {len(output)} rewards, but {expected} were "
            f"expected (one per completion)"
        )
    rewards = []
    for i, value in enumerate(output):
        if hasattr(value, "item") and not isinstance(value, (str, bytes)):
            value = value.item()  # tensors, numpy scalars
        if value is not None and not isinstance(value, numbers.Real):
            raise TypeError(
                f"{owner}: reward function {name!r} returned a non-numeric reward at index {i}: "
                f"{value!r:.40} ({type(value).__name__}); expected a float, an int or None"
            )
        rewards.append(None if value is None else float(value))
    return rewards


def replay_logs(results: Sequence, log_extra: Callable | None, log_metric: Callable | None) -> None:
    """Replay the items' ``log_extra`` calls (one per column, ``None`` for an item that did not log
    it) and ``log_metric`` calls, in item order."""
    if callable(log_extra):
        for column in dict.fromkeys(e[1] for r in results for e in r.logs if e[0] == "extra"):
            values: list = []
            for result in results:
                logged = [e[2] for e in result.logs if e[0] == "extra" and e[1] == column]
                values.extend(logged[0] if logged else [None])
            log_extra(column, values)
    if callable(log_metric):
        for entry in (e for r in results for e in r.logs if e[0] == "metric"):
            log_metric(entry[1], entry[2])


def score_items(executor, call_kwargs: dict, n: int, names: Sequence[str], failures: WarnOnce, owner: str,
                failure_reward: float | None, excluded: str) -> tuple[list[list[float | None]], list[list[bool]]]:
    """Each function on each of the ``n`` completions alone, in an item ``executor``: ``(rewards,
    failed)``, per function one entry per completion (``failure_reward`` where it failed, counted
    in ``failures`` by ``(name, kind)`` and warned once)."""
    results = executor.run(*per_completion_items(call_kwargs, n, len(names)))
    note = excluded if failure_reward is None else f"its reward is failure_reward={failure_reward}"
    note += f" (counted in {owner}.failure_counts), once per function and kind"
    rewards, failed = [], []
    for i, name in enumerate(names):
        mine = results[i * n : (i + 1) * n]
        rewards.append([])
        for result in mine:
            if result.status == "ok":
                rewards[-1] += to_rewards(result.value, name=name, expected=1, owner=owner)
            else:
                failures.add((name, result.status), f"reward function {name!r} {FAILURES[result.status]} a completion "
                             f"({result.detail}); {note}", stacklevel=5)
                rewards[-1].append(failure_reward)
        failed.append([r.status != "ok" for r in mine])
        replay_logs(mine, call_kwargs.get("log_extra"), call_kwargs.get("log_metric"))
    return rewards, failed
