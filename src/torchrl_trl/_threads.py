"""A callable run in a helper thread, bounded by a timeout (a late thread is abandoned).

Imports neither torch nor the rest of this package (reward worker processes import it).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["in_caller_modes", "run_async", "run_in_thread"]


def in_caller_modes(fn: Callable) -> Callable:
    """``fn`` run under the calling thread's torch grad and inference modes (kept per thread)."""
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
    """``fn()``'s value (or exception) from a daemon thread under the caller's torch modes;
    past ``timeout`` s raises ``error(message)``, its ``thread`` the thread still running."""
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
    """``awaitable``'s result from synchronous code: ``asyncio.run``, in a helper thread
    (:func:`run_in_thread`) when this thread already runs a loop or a ``timeout`` bounds it."""

    async def main():
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        if timeout is None:
            return asyncio.run(main())
    return run_in_thread(lambda: asyncio.run(main()), timeout, message, error=error)
