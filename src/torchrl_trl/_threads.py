"""A callable run in a helper thread, bounded by a timeout: the one place for the idea.

Python cannot stop a thread: one still running at its timeout is abandoned (a daemon
thread) and the caller gets a ``TimeoutError`` naming what did not return. Imports
neither torch nor the rest of this package (reward worker processes import it).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["in_caller_modes", "run_async", "run_in_thread"]


def in_caller_modes(fn: Callable) -> Callable:
    """``fn`` run under the calling thread's torch grad and inference modes (torch keeps
    both per thread); ``fn`` itself when torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return fn
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(*args, **kwargs):
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn(*args, **kwargs)

    return run


def run_in_thread(fn: Callable[[], Any], timeout: float | None, message: str = "", *,
                  error: type = TimeoutError, name: str = "torchrl-trl-worker") -> Any:
    """``fn()`` in a daemon thread under the caller's torch modes, waited for at most
    ``timeout`` s (``None``: until it returns): its value, or its exception re-raised.
    Past the timeout raises ``error(message)``, its ``thread`` the thread still running.

    >>> import threading
    >>> run_in_thread(threading.Event().wait, 0.01, "wait() did not return within 0.01s")
    Traceback (most recent call last):
    ...
    TimeoutError: wait() did not return within 0.01s
    """
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:  # re-raised in the caller's thread
            box["error"] = err

    thread = threading.Thread(target=in_caller_modes(run), name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        late = error(message)
        late.thread = thread
        raise late
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_async(awaitable: Awaitable, timeout: float | None = None, message: str = "", *,
              error: type = TimeoutError) -> Any:
    """``awaitable``'s result, from synchronous code: ``asyncio.run`` here, or in a fresh
    loop in a helper thread (:func:`run_in_thread`) when this thread already runs a loop
    (a notebook, an async server) or a ``timeout`` bounds it."""

    async def main():
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        if timeout is None:
            return asyncio.run(main())
    return run_in_thread(lambda: asyncio.run(main()), timeout, message, error=error)
