"""The item scheduler every reward executor kind shares (:class:`ItemExecutor`): items run at most
``max_workers`` at a time, each bounded by a deadline. Worker processes import this module: no torch."""

from __future__ import annotations

import concurrent.futures
import inspect
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchrl_trl._threads import run_async

__all__ = ["WARM_UP", "ItemExecutor", "ItemResult", "call_item", "warm_up"]


@dataclass
class ItemResult:
    """What one item gave: ``status`` ``"ok"`` (``value``), else ``"error"`` (it raised), ``"timeout"`` or
    ``"crash"`` (its worker died), with ``detail``."""

    status: str
    value: Any = None
    detail: str = ""
    logs: list = field(default_factory=list)


def call_item(func: Callable, kwargs: dict) -> tuple[Any, list]:
    """``(func(**kwargs), logs)``, awaited if async, with ``log_extra``/``log_metric``
    recorded into ``logs`` as ``("extra", column, values)`` / ``("metric", name, value)``."""
    logs: list = []
    kwargs = dict(kwargs)
    if "log_extra" in kwargs:
        kwargs["log_extra"] = lambda column, values: logs.append(("extra", column, list(values)))
    if "log_metric" in kwargs:
        kwargs["log_metric"] = lambda name, value: logs.append(("metric", name, value))
    out = func(**kwargs)
    if inspect.isawaitable(out):
        out = run_async(out)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(out, torch.Tensor):
        out = out.tolist()
    return out, logs


#: The method a reward object may define to do, once per worker, what its first call would do
#: before any work (imports): a fresh worker runs it while starting, within ``startup_timeout``,
#: so that no item's ``timeout`` pays for it.
WARM_UP = "_torchrl_trl_warm_up"


def warm_up(func: Callable) -> None:
    """Run the :data:`WARM_UP` method of ``func`` (of its object, for a bound method), if any.

    >>> class Scorer:
    ...     def _torchrl_trl_warm_up(self):
    ...         print("imports done")
    ...     def score(self, prompts, completions, **kwargs):
    ...         return [1.0] * len(completions)
    >>> warm_up(Scorer().score)
    imports done
    """
    owner = func.__self__ if inspect.ismethod(func) else func
    hook = getattr(type(owner), WARM_UP, None)  # on the class: a __getattr__ answers nothing here
    if callable(hook):
        hook(owner)


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


class ItemExecutor:
    """Runs items, at most :attr:`max_workers` at a time, each bounded by :attr:`timeout`.
    A subclass defines ``_submit(index, func_index, kwargs, shared) -> handle`` (a future of
    ``call_item``'s output, else it defines ``_collect``) and ``_cancel(handle) -> detail``."""

    kind = "base"

    def __init__(self, funcs: Sequence[Callable], names: Sequence[str], timeout: float | None, config):
        self.funcs, self.names, self.timeout = list(funcs), list(names), timeout
        self.config, self.startup_timeout = config, config.startup_timeout
        self.max_workers = config.max_workers or self._default_workers(os.cpu_count() or 1)
        self._reset_runtime()

    def _default_workers(self, cpus: int) -> int:
        return cpus

    def run(self, items: Sequence[tuple[int, dict]], shared: dict | None = None) -> list:
        """One :class:`ItemResult` per item, in order; ``shared`` kwargs go to every call."""
        if not items:
            return []
        items, shared = list(items), dict(shared or {})
        results: list[ItemResult | None] = [None] * len(items)
        pending = deque(range(len(items)))
        with self._lock:
            self._running = running = {}  # handle -> [item index, deadline]
            self._begin(shared, len(items))
            try:
                while pending or running:
                    while pending and self._slot_free(running):
                        index = pending.popleft()
                        handle = self._submit(index, *items[index], shared)
                        seconds = self._first_timeout()
                        running[handle] = [index, None if seconds is None else time.monotonic() + seconds]
                    first = min((d for _, d in running.values() if d is not None), default=None)
                    wait_for = None if first is None else max(0.0, first - time.monotonic())
                    for handle, result in self._collect(list(running), wait_for):
                        results[running.pop(handle)[0]] = result
                    now = time.monotonic()
                    for handle, (index, deadline) in list(running.items()):
                        if deadline is not None and now >= deadline:
                            del running[handle]
                            results[index] = ItemResult("timeout", detail=self._cancel(handle))
            except BaseException:  # interrupted (Ctrl-C, a bad argument): no stale task survives
                for handle in list(running):
                    self._cancel(handle)
                raise
        return results  # type: ignore[return-value]

    def _collect(self, busy: list, wait_for: float | None) -> list:
        """``[(handle, ItemResult)]`` of every handle finished by then, waiting up to ``wait_for`` s
        for a first one (what it leaves out is timed out)."""
        done, _ = concurrent.futures.wait(busy, wait_for, concurrent.futures.FIRST_COMPLETED)
        return [(future, self._outcome(future.result)) for future in done]

    def _outcome(self, get: Callable) -> ItemResult:
        try:
            value, logs = get()
        except BaseException as err:
            return self._error(err)
        return ItemResult("ok", value, logs=logs)

    def _error(self, err: BaseException) -> ItemResult:
        return ItemResult("error", detail=_describe(err))

    def _begin(self, shared: dict, n: int) -> None:
        pass

    def _slot_free(self, running: dict) -> bool:
        return len(running) < self.max_workers

    def _first_timeout(self) -> float | None:
        return self.timeout

    def _late(self, how: str) -> str:
        return f"no result within timeout={self.timeout}s; {how}"

    def shutdown(self) -> None:
        """Stop the workers (a later ``run`` starts new ones)."""

    def __getstate__(self):
        # a copy (deepcopy, pickling the wrapper) gets the configuration, not the workers
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._lock = threading.Lock()
        self._running: dict = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(timeout={self.timeout}, max_workers={self.max_workers})"
