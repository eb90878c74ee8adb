"""Run reward functions one completion at a time, isolated, with a per-completion timeout.

A rule reward (math verification, code execution) that hangs or crashes on one completion
must not stop training. :func:`make_item_executor` builds an executor that calls
``funcs[i](**shared, **item_kwargs)`` for a list of items and returns one
:class:`ItemResult` per item, never raising for a single bad item:

- ``"process"``: a small pool of worker processes of our own (the standard
  ``ProcessPoolExecutor`` cannot stop a running task). A task past its deadline has its
  worker killed (SIGKILL) and replaced; a worker that dies (segfault, ``os._exit``) fails
  only its own item and is replaced. Workers are fresh interpreters that never import
  the trainer's ``__main__``; the functions are sent once per worker with cloudpickle (by
  value those of ``__main__``, a notebook or a lambda; by reference those of an
  importable module), arguments once per item.
- ``"thread"``: daemon threads; a timed-out thread cannot be stopped, it is abandoned
  (and keeps its CPU) and a fresh thread takes its place.
- ``"ray"``: one Ray task per item; a timed-out task is cancelled with ``force=True``
  (its worker process is killed).
- a ``concurrent.futures.Executor``: one ``submit`` per item; the timeout counts from
  submission; a timed-out task is cancelled if it has not started, else abandoned.

``timeout`` is per item: it starts when a worker starts the item (a process worker
once it has loaded the item's arguments, which may import modules; a thread when it
starts; a Ray task or an Executor's future when submitted), not when it is queued, so a
call takes at most about ``ceil(items / max_workers) * timeout`` plus worker start-up.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import inspect
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from torchrl_trl._checks import WarnOnce, positive_int

# no torch import here: worker processes import this module, and start faster without it

__all__ = [
    "FAILURE_KINDS",
    "FailureCounter",
    "ItemResult",
    "ProcessItemExecutor",
    "ThreadItemExecutor",
    "FuturesItemExecutor",
    "RayItemExecutor",
    "make_item_executor",
]

#: the ways one item can fail: the function raised, ran past ``timeout``, or its worker died
FAILURE_KINDS = ("error", "timeout", "crash")

#: seconds a new worker process may take to import the functions before it is an error
STARTUP_TIMEOUT = 120.0


@dataclass
class ItemResult:
    """What one item gave: ``status`` is ``"ok"`` (``value`` is the function's output) or
    one of :data:`FAILURE_KINDS` (``detail`` says what happened)."""

    status: str
    value: Any = None
    detail: str = ""
    logs: list = field(default_factory=list)


def call_item(func: Callable, kwargs: dict) -> tuple[Any, list]:
    """``func(**kwargs)`` with ``log_extra``/``log_metric`` replaced by recorders (the
    trainer's own cannot cross a process); an async function is run to completion.
    Returns ``(output, logs)``, ``logs`` a list of ``("extra", column, values)`` and
    ``("metric", name, value)``."""
    logs: list = []
    kwargs = dict(kwargs)
    if "log_extra" in kwargs:
        kwargs["log_extra"] = lambda column, values: logs.append(("extra", column, list(values)))
    if "log_metric" in kwargs:
        kwargs["log_metric"] = lambda name, value: logs.append(("metric", name, value))
    out = func(**kwargs)
    if inspect.isawaitable(out):
        out = _await(out)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(out, torch.Tensor):
        out = out.tolist()
    return out, logs


def _await(awaitable):
    async def wait():
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    # called from inside a running loop (a thread of an async app): a fresh loop elsewhere
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("v", asyncio.run(wait())), daemon=True)
    thread.start()
    thread.join()
    return box["v"]


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _exit_detail(exitcode: int | None) -> str:
    if exitcode is None:
        return "worker process died"
    if exitcode < 0:
        try:
            return f"worker process killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"worker process killed by signal {-exitcode}"
    return f"worker process exited with code {exitcode}"


class FailureCounter:
    """Counts failed items by function name and kind, and warns once per (name, kind).

    >>> import warnings
    >>> failures = FailureCounter(["f"], "RewardFunctionWrapper")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     for _ in range(2):
    ...         failures.add("f", ItemResult("timeout", detail="no result within timeout=1s"), "it is excluded")
    >>> failures.counts, len(caught)
    ({'f': {'error': 0, 'timeout': 2, 'crash': 0}}, 1)
    """

    def __init__(self, names: Sequence[str], owner: str):
        self.owner = owner
        self.names = list(names)
        self._seen = WarnOnce()  # by (name, kind)

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        return {n: {kind: self._seen.counts[(n, kind)] for kind in FAILURE_KINDS} for n in self.names}

    def add(self, name: str, result: ItemResult, value_note: str) -> None:
        what = {
            "error": "raised on",
            "timeout": "ran past its timeout on",
            "crash": "crashed its worker on",
        }[result.status]
        self._seen.add(
            (name, result.status),
            f"reward function {name!r} {what} a completion ({result.detail}); {value_note} "
            f"(counted in {self.owner}.failure_counts), once per function and kind",
            stacklevel=5,
        )


class ItemExecutor:
    """Base class: ``run(items, shared) -> list[ItemResult]`` with ``items`` a list of
    ``(function_index, kwargs)``; ``shared`` kwargs go to every call."""

    kind = "base"

    def __init__(self, funcs: Sequence[Callable], *, timeout: float | None, max_workers: int):
        self.funcs = list(funcs)
        self.timeout = timeout
        self.max_workers = max_workers
        self._lock = threading.Lock()

    def run(self, items: Sequence[tuple[int, dict]], shared: dict | None = None) -> list[ItemResult]:
        if not items:
            return []
        with self._lock:
            return self._run(list(items), dict(shared or {}))

    def _run(self, items, shared) -> list[ItemResult]:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the workers (a later ``run`` starts new ones)."""

    def __getstate__(self):
        # a copy (deepcopy, pickling the wrapper) gets the configuration, not the workers
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(timeout={self.timeout}, max_workers={self.max_workers})"


# -- process pool ----------------------------------------------------------------------


def _watch_trainer(trainer_pid: int) -> None:
    # once the trainer is gone, do not keep running a stuck task (the parent-death signal
    # covers workers started by the main thread on Linux only)
    try:
        handle = os.pidfd_open(trainer_pid)  # Linux >= 5.3: readable once it exits
    except (AttributeError, OSError):
        handle = None
    while True:
        if handle is not None:
            if multiprocessing.connection.wait([handle], None):
                os._exit(1)
            continue
        time.sleep(1.0)
        try:
            os.kill(trainer_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # the pid was reused by another user's process
            os._exit(1)


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent exits (``PR_SET_PDEATHSIG``).
    Unlike the watcher thread, this also stops a task holding the GIL in C code (a regex
    that backtracks forever, big-integer arithmetic), where no Python thread runs."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no libc prctl: the watcher thread remains
        pass


# a worker's command line: a fresh interpreter with the trainer's sys.path, which imports
# this module and neither the trainer's __main__ nor torch (multiprocessing's spawn and
# forkserver re-run an unguarded main script in the child)
_WORKER_COMMAND = ("import sys; sys.path[:] = sys.argv[4:]; from torchrl_trl.rewards.executors import "
                   "_worker_main; _worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == '1')")


def _worker_main(conn, trainer_pid: int, die_with_parent: bool = False) -> None:
    """A worker process: load the functions (the first message of ``conn``, a
    connection or its file descriptor), then run tasks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if die_with_parent:
        _die_with_parent()
    threading.Thread(target=_watch_trainer, args=(trainer_pid,), daemon=True).start()
    if isinstance(conn, int):
        conn = multiprocessing.connection.Connection(conn)
    try:
        # our parent's cloudpickle output, over a pipe only the two of us hold
        funcs = pickle.loads(conn.recv_bytes())
    except BaseException as err:
        conn.send(("init_error", _describe(err)))
        return
    conn.send(("ready",))
    shared: dict = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "shared":
            shared = msg[1]
            continue
        _, task_id, index, kwargs = msg
        conn.send(("started", task_id))  # the arguments are loaded (imports done): the clock starts
        try:
            value, logs = call_item(funcs[index], {**shared, **kwargs})
            reply = (task_id, "ok", value, "", logs)
        except BaseException as err:
            tb = traceback.extract_tb(err.__traceback__)
            where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
            reply = (task_id, "error", None, _describe(err) + where, [])
        try:
            conn.send(reply)
        except Exception as err:  # an output that cannot be pickled
            conn.send((task_id, "error", None, f"its output could not be sent back: {_describe(err)}", []))


class _Worker:
    """A worker process (a ``subprocess.Popen``, or a forked ``multiprocessing.Process``)
    and our end of its pipe."""

    def __init__(self, process, conn):
        self.process, self.conn = process, conn
        self.state = "starting"
        self.started = time.monotonic()
        self.task: int | None = None
        self.deadline: float | None = None
        self.running = False  # the task's function has started
        self.shared_version = -1

    def exitcode(self) -> int | None:
        """``None`` while it runs; negative: the signal that killed it."""
        if isinstance(self.process, subprocess.Popen):
            return self.process.poll()
        return self.process.exitcode

    def join(self, timeout: float) -> None:
        if isinstance(self.process, subprocess.Popen):
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        else:
            self.process.join(timeout)

    def kill(self) -> None:
        try:
            if self.exitcode() is None:
                self.process.kill()
            self.join(5)
        finally:
            self.conn.close()


_LIVE_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for pool in list(_LIVE_POOLS):
        pool.shutdown()


class ProcessItemExecutor(ItemExecutor):
    """A pool of ``max_workers`` processes with a deadline per task (see the module doc).

    ``mp_context``: ``"spawn"`` (default; ``"forkserver"`` means the same): each worker
    is a fresh interpreter (``subprocess``) that inherits no threads, locks or CUDA state
    and does not import the trainer's ``__main__``, so an unguarded script, code piped to
    ``python -`` and a notebook work. ``"fork"``: a forked ``multiprocessing.Process``,
    fastest to start but it inherits the trainer's state.
    """

    kind = "process"

    def __init__(self, funcs, *, timeout, max_workers, names=None, mp_context: str | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT):
        super().__init__(funcs, timeout=timeout, max_workers=max_workers)
        self.names = list(names) if names is not None else [getattr(f, "__name__", repr(f)) for f in funcs]
        if mp_context not in (None, "spawn", "forkserver", "fork"):
            raise ValueError(f"mp_context must be 'spawn', 'forkserver' or 'fork', got {mp_context!r}")
        self.mp_context = "fork" if mp_context == "fork" else "spawn"
        self.startup_timeout = startup_timeout
        self.payload = self._pickle_funcs()
        #: how many worker processes were killed (timeout) or found dead (crash) and replaced
        self.replaced = 0
        self._reset_runtime()

    def _pickle_funcs(self) -> bytes:
        for f, name in zip(self.funcs, self.names):
            try:
                cloudpickle.dumps(f)
            except Exception as err:
                raise TypeError(
                    f"executor='process' sends reward function {name!r} to worker processes "
                    f"with cloudpickle, which failed ({_describe(err)}). The function and "
                    "what it uses (globals, closure variables) must be picklable; or use "
                    "executor='thread'."
                ) from err
        return cloudpickle.dumps(self.funcs)

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._workers: list[_Worker] = []
        self._shared_version = 0
        _LIVE_POOLS.add(self)

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
        # the kernel's parent-death signal fires when the *thread* that started the
        # worker exits: safe from this process's main thread only
        die_with_parent = threading.current_thread() is threading.main_thread()
        try:
            if self.mp_context == "fork":
                process = multiprocessing.get_context("fork").Process(
                    target=_worker_main, args=(child_conn, os.getpid(), die_with_parent),
                    name="torchrl-trl-reward-worker", daemon=True,
                )
                process.start()
            else:
                fd = child_conn.fileno()
                process = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_COMMAND, str(fd), str(os.getpid()), str(int(die_with_parent)),
                     *map(str, sys.path)],
                    pass_fds=[fd], stdin=subprocess.DEVNULL,
                )
        finally:
            child_conn.close()
        worker = _Worker(process, parent_conn)
        self._workers.append(worker)
        try:
            parent_conn.send_bytes(self.payload)
        except OSError:  # it died at once: _wait_and_collect says so
            pass
        return worker

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the current workers."""
        return [w.process.pid for w in self._workers]

    def _send(self, worker: _Worker, msg, what: str) -> None:
        try:
            worker.conn.send(msg)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise TypeError(
                f"executor='process' could not send {what} to a worker process: "
                f"{_describe(err)}. Arguments must be picklable."
            ) from err

    def _run(self, items, shared) -> list[ItemResult]:
        results: list[ItemResult | None] = [None] * len(items)
        pending = deque(range(len(items)))
        self._shared_version += 1
        target = min(self.max_workers, len(items))
        while len(self._workers) < target:
            self._spawn()
        finished = False
        try:
            while pending or any(w.state == "busy" for w in self._workers):
                for worker in list(self._workers):
                    if worker.state == "idle" and pending:
                        index = pending.popleft()
                        func_index, kwargs = items[index]
                        try:
                            if worker.shared_version != self._shared_version:
                                self._send(worker, ("shared", shared), f"the shared arguments {sorted(shared)}")
                                worker.shared_version = self._shared_version
                            self._send(worker, ("task", index, func_index, kwargs),
                                       f"the arguments {sorted(kwargs)} of reward function {self.names[func_index]!r}")
                        except OSError:  # it died while idle: replace it, retry the item
                            pending.appendleft(index)
                            self._drop(worker)
                            self.replaced += 1
                            continue
                        worker.state, worker.task = "busy", index
                        # until the worker says it has loaded the arguments (which may
                        # import modules), the start-up bound applies, not the timeout
                        worker.deadline = time.monotonic() + self.startup_timeout
                        worker.running = False
                self._wait_and_collect(results)
                while len(self._workers) < target:
                    self._spawn()
            finished = True
        finally:
            if not finished:  # interrupted (Ctrl-C, a bad argument): no stale task survives
                for worker in [w for w in self._workers if w.state == "busy"]:
                    self._drop(worker)
        return results  # type: ignore[return-value]

    def _wait_and_collect(self, results) -> None:
        now = time.monotonic()
        watched = [w for w in self._workers if w.state in ("starting", "busy")]
        if not watched:  # nothing to wait for (a dead idle worker was just dropped)
            return
        deadlines = [w.deadline for w in watched if w.deadline is not None]
        deadlines += [w.started + self.startup_timeout for w in watched if w.state == "starting"]
        # a worker's death closes its pipe, unless a process it forked holds it: look at
        # least once a second
        wait_for = min(1.0, max(0.0, min(deadlines) - now)) if deadlines else 1.0
        multiprocessing.connection.wait([w.conn for w in watched], wait_for)
        for worker in list(watched):
            dead = False
            try:
                while worker.conn.poll():
                    self._on_message(worker, worker.conn.recv(), results)
            except (EOFError, OSError):
                dead = True
            if worker not in self._workers:
                continue
            dead = dead or worker.exitcode() is not None
            now = time.monotonic()
            if dead:
                worker.join(5)
                detail = _exit_detail(worker.exitcode())
                if worker.state == "starting":
                    self._drop(worker)
                    raise RuntimeError(
                        f"executor='process': a worker process died while loading the reward "
                        f"functions {self.names} ({detail})"
                    )
                if worker.state == "busy":
                    results[worker.task] = ItemResult("crash", detail=detail)
                self._drop(worker)
                self.replaced += 1
            elif worker.state == "busy" and worker.deadline is not None and now >= worker.deadline:
                detail = (
                    f"no result within timeout={self.timeout}s; worker killed"
                    if worker.running
                    else f"the worker did not load the arguments within {self.startup_timeout}s; killed"
                )
                results[worker.task] = ItemResult("timeout", detail=detail)
                self._drop(worker)
                self.replaced += 1
            elif worker.state == "starting" and now >= worker.started + self.startup_timeout:
                self._drop(worker)
                raise RuntimeError(
                    f"executor='process': a worker process did not load the reward functions "
                    f"{self.names} within {self.startup_timeout}s"
                )

    def _on_message(self, worker: _Worker, msg, results) -> None:
        if msg[0] == "ready":
            worker.state = "idle"
        elif msg[0] == "started":
            if worker.state == "busy" and msg[1] == worker.task:
                worker.running = True
                worker.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        elif msg[0] == "init_error":
            self._drop(worker)
            raise RuntimeError(
                f"executor='process': a worker process could not load the reward functions "
                f"{self.names}: {msg[1]}. A function of an importable module is sent by "
                "reference: the worker (a fresh interpreter with the trainer's sys.path) must "
                "be able to import that module."
            )
        else:
            task_id, status, value, detail, logs = msg
            if worker.state == "busy" and task_id == worker.task:
                results[task_id] = ItemResult(status, value, detail, logs)
                worker.state, worker.task, worker.deadline, worker.running = "idle", None, None, False

    def shutdown(self) -> None:
        """Stop the workers: idle ones are asked to exit; any still alive 1 s later (and
        a busy or stuck one at once) is killed, so no worker outlives this call. An error
        stopping one worker does not leave the others running: the first is re-raised
        once all were handled."""
        workers, self._workers = list(getattr(self, "_workers", [])), []
        for worker in workers:
            if worker.state == "idle":
                try:
                    worker.conn.send(("stop",))
                except (OSError, ValueError):  # already dead, or its pipe closed
                    pass
        deadline = time.monotonic() + 1.0
        first_error = None
        for worker in workers:
            try:
                if worker.state == "idle":
                    worker.join(max(0.0, deadline - time.monotonic()))
                worker.kill()
            except Exception as err:  # keep stopping the others
                first_error = first_error or err
        if first_error is not None:
            raise first_error

    def __del__(self):
        # garbage collection / interpreter exit: nothing to report to, but the workers
        # must not outlive the pool (kill() runs for every worker whatever happens)
        try:
            self.shutdown()
        except Exception:
            pass


# -- threads ---------------------------------------------------------------------------


class ThreadItemExecutor(ItemExecutor):
    """Each item in a daemon thread, at most ``max_workers`` at a time (abandoned threads
    do not count). A thread past its deadline cannot be stopped: it is abandoned and
    counted in :attr:`abandoned` (it keeps running; prefer ``"process"`` for code that
    may loop forever)."""

    kind = "thread"

    def __init__(self, funcs, *, timeout, max_workers):
        super().__init__(funcs, timeout=timeout, max_workers=max_workers)
        self.abandoned = 0

    def _run(self, items, shared) -> list[ItemResult]:
        import torch

        results: list[ItemResult | None] = [None] * len(items)
        done: queue.Queue = queue.Queue()
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        pending = deque(range(len(items)))
        running: dict[int, float | None] = {}  # item -> deadline

        def work(index):
            func_index, kwargs = items[index]
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    value, logs = call_item(self.funcs[func_index], {**shared, **kwargs})
                done.put((index, ItemResult("ok", value, logs=logs)))
            except BaseException as err:
                done.put((index, ItemResult("error", detail=_describe(err))))

        while pending or running:
            while pending and len(running) < self.max_workers:
                index = pending.popleft()
                running[index] = None if self.timeout is None else time.monotonic() + self.timeout
                threading.Thread(target=work, args=(index,), name="torchrl-trl-reward", daemon=True).start()
            deadlines = [d for d in running.values() if d is not None]
            wait_for = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            try:
                index, result = done.get(timeout=wait_for)
                if index in running:  # not an abandoned one finishing late
                    del running[index]
                    results[index] = result
            except queue.Empty:
                pass
            now = time.monotonic()
            for index, deadline in list(running.items()):
                if deadline is not None and now >= deadline:
                    del running[index]
                    self.abandoned += 1
                    results[index] = ItemResult(
                        "timeout", detail=f"no result within timeout={self.timeout}s; thread abandoned"
                    )
        return results  # type: ignore[return-value]


# -- a user's concurrent.futures.Executor ------------------------------------------------


class FuturesItemExecutor(ItemExecutor):
    """One ``executor.submit(call_item, func, kwargs)`` per item, at most ``max_workers``
    in flight; the timeout counts from submission. A timed-out future is cancelled if it
    has not started, else abandoned (it keeps its worker). A broken executor (a
    ``ProcessPoolExecutor`` whose worker died) raises: it cannot run anything more."""

    kind = "executor"

    def __init__(self, funcs, *, timeout, max_workers, executor: concurrent.futures.Executor):
        super().__init__(funcs, timeout=timeout, max_workers=max_workers)
        self.executor = executor

    def __deepcopy__(self, memo):
        return FuturesItemExecutor(self.funcs, timeout=self.timeout, max_workers=self.max_workers,
                                   executor=self.executor)

    def __getstate__(self):
        raise TypeError(
            f"a reward executor wrapping {type(self.executor).__name__} cannot be pickled; "
            "use executor='process' or 'thread', which are rebuilt in the copy"
        )

    def _run(self, items, shared) -> list[ItemResult]:
        results: list[ItemResult | None] = [None] * len(items)
        pending = deque(range(len(items)))
        running: dict[concurrent.futures.Future, tuple[int, float | None]] = {}
        while pending or running:
            while pending and len(running) < self.max_workers:
                index = pending.popleft()
                func_index, kwargs = items[index]
                try:
                    future = self.executor.submit(call_item, self.funcs[func_index], {**shared, **kwargs})
                except concurrent.futures.BrokenExecutor as err:
                    raise RuntimeError(
                        f"the executor {type(self.executor).__name__} passed as executor= is broken "
                        f"({_describe(err)}); it cannot run more reward items. executor='process' "
                        "replaces dead workers."
                    ) from err
                running[future] = (index, None if self.timeout is None else time.monotonic() + self.timeout)
            deadlines = [d for _, d in running.values() if d is not None]
            wait_for = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            finished, _ = concurrent.futures.wait(list(running), wait_for, concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                index, _ = running.pop(future)
                try:
                    value, logs = future.result()
                    results[index] = ItemResult("ok", value, logs=logs)
                except concurrent.futures.BrokenExecutor as err:
                    raise RuntimeError(
                        f"the executor {type(self.executor).__name__} passed as executor= broke "
                        f"while running a reward item ({_describe(err)}); executor='process' "
                        "survives a worker that dies."
                    ) from err
                except BaseException as err:
                    results[index] = ItemResult("error", detail=_describe(err))
            now = time.monotonic()
            for future, (index, deadline) in list(running.items()):
                if deadline is not None and now >= deadline:
                    del running[future]
                    how = "cancelled" if future.cancel() else "abandoned"
                    results[index] = ItemResult("timeout", detail=f"no result within timeout={self.timeout}s; {how}")
        return results  # type: ignore[return-value]


# -- Ray --------------------------------------------------------------------------------


def _ray_call_item(funcs, index, shared, kwargs):
    return call_item(funcs[index], {**shared, **kwargs})


class RayItemExecutor(ItemExecutor):
    """One Ray task per item (``num_cpus=1``, no retries), at most ``max_workers`` in
    flight; a task past its deadline is cancelled with ``force=True`` (its worker process
    is killed); a dead worker fails only its item. Starts a local Ray if none is running.
    The first call waits (up to ``startup_timeout``) for ``max_workers`` warm workers that
    have loaded the shared arguments, so worker start-up does not count against
    ``timeout``; the timeout counts from submission."""

    kind = "ray"

    def __init__(self, funcs, *, timeout, max_workers, startup_timeout: float = STARTUP_TIMEOUT):
        super().__init__(funcs, timeout=timeout, max_workers=max_workers)
        self.startup_timeout = startup_timeout
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._remote = None
        self._funcs_ref = None
        self._job = None  # the Ray job the remote function and the refs belong to

    def _setup(self, shared: dict):
        import ray

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False)
        job = ray.get_runtime_context().get_job_id()
        if self._job != job:  # first call, or Ray was restarted: refs of the old job are gone
            self._remote, self._job = None, job
        if self._remote is None:
            self._remote = ray.remote(num_cpus=1, max_retries=0)(_ray_call_item)
            self._funcs_ref = ray.put(self.funcs)
            # loading the shared arguments (TRL's TrainerState) imports modules: not on the clock
            warm = [self._remote.remote([_noop], 0, shared, {}) for _ in range(self.max_workers)]
            ready, _ = ray.wait(warm, num_returns=len(warm), timeout=self.startup_timeout)
            if len(ready) < len(warm):
                raise RuntimeError(
                    f"executor='ray': {len(warm) - len(ready)} of {len(warm)} Ray workers did not "
                    f"start within {self.startup_timeout}s (max_workers={self.max_workers}; the "
                    "cluster may have fewer free CPUs)"
                )
        return ray

    def _run(self, items, shared) -> list[ItemResult]:
        ray = self._setup(shared)
        from ray import exceptions as rex

        results: list[ItemResult | None] = [None] * len(items)
        pending = deque(range(len(items)))
        running: dict = {}
        shared_ref = ray.put(shared)  # serialised once per call, not once per item
        while pending or running:
            while pending and len(running) < self.max_workers:
                index = pending.popleft()
                func_index, kwargs = items[index]
                ref = self._remote.remote(self._funcs_ref, func_index, shared_ref, kwargs)
                running[ref] = (index, None if self.timeout is None else time.monotonic() + self.timeout)
            deadlines = [d for _, d in running.values() if d is not None]
            wait_for = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            finished, _ = ray.wait(list(running), num_returns=1, timeout=wait_for)
            for ref in finished:
                index, _ = running.pop(ref)
                try:
                    value, logs = ray.get(ref)
                    results[index] = ItemResult("ok", value, logs=logs)
                except rex.RayTaskError as err:
                    cause = err.cause if getattr(err, "cause", None) is not None else err
                    results[index] = ItemResult("error", detail=_describe(cause))
                except (rex.WorkerCrashedError, rex.RayActorError, rex.TaskCancelledError,
                        rex.ObjectLostError) as err:
                    results[index] = ItemResult("crash", detail=_describe(err).splitlines()[0])
            now = time.monotonic()
            for ref, (index, deadline) in list(running.items()):
                if deadline is not None and now >= deadline:
                    del running[ref]
                    ray.cancel(ref, force=True)
                    results[index] = ItemResult(
                        "timeout", detail=f"no result within timeout={self.timeout}s; Ray task cancelled"
                    )
        return results  # type: ignore[return-value]


def _noop(**kwargs):
    return None


# -- construction ----------------------------------------------------------------------


def _workers(max_workers: int | None, default: int) -> int:
    return default if max_workers is None else positive_int(max_workers, "max_workers")


def make_item_executor(
    executor: str | concurrent.futures.Executor | None,
    funcs: Sequence[Callable],
    names: Sequence[str],
    *,
    timeout: float | None,
    max_workers: int | None = None,
    mp_context: str | None = None,
) -> ItemExecutor | None:
    """The item executor for ``executor=`` (``None`` -> ``None``: run in the caller).

    ``max_workers`` defaults to the CPU count (process, Ray), ``min(32, cpus + 4)``
    (thread, as the standard library), or the executor's own ``_max_workers``.
    """
    cpus = os.cpu_count() or 1
    if executor is None:
        if max_workers is not None or mp_context is not None:
            raise ValueError(
                "max_workers/mp_context apply to executor='process' | 'thread' | 'ray' | an "
                "Executor; executor is None (functions run in the caller)"
            )
        return None
    if mp_context is not None and executor != "process":
        raise ValueError(f"mp_context applies to executor='process' only, got executor={executor!r}")
    if executor == "process":
        return ProcessItemExecutor(funcs, names=names, timeout=timeout,
                                   max_workers=_workers(max_workers, cpus), mp_context=mp_context)
    if executor == "thread":
        return ThreadItemExecutor(funcs, timeout=timeout, max_workers=_workers(max_workers, min(32, cpus + 4)))
    if executor == "ray":
        return RayItemExecutor(funcs, timeout=timeout, max_workers=_workers(max_workers, cpus))
    if isinstance(executor, concurrent.futures.Executor):
        default = getattr(executor, "_max_workers", None) or cpus
        return FuturesItemExecutor(funcs, timeout=timeout, max_workers=_workers(max_workers, default),
                                   executor=executor)
    raise ValueError(
        f"executor must be None, 'process', 'thread', 'ray' or a concurrent.futures.Executor, "
        f"got {executor!r}"
    )


def replay_logs(results: Sequence[ItemResult], log_extra: Callable | None, log_metric: Callable | None) -> None:
    """Replay the ``log_extra``/``log_metric`` calls the items' functions made in their
    workers, in item order: each ``log_extra`` column once, joined over the items (``None``
    for an item that did not log it, e.g. a failed one, so the column stays aligned with the
    completions), then every ``log_metric`` call. A target that is not callable is skipped."""
    columns: dict[str, list] = {}
    metrics: list[tuple[str, Any]] = []
    for result in results:
        for entry in result.logs:
            if entry[0] == "extra":
                columns.setdefault(entry[1], [])
            else:
                metrics.append((entry[1], entry[2]))
    if callable(log_extra):
        for column, values in columns.items():
            for result in results:
                logged = [e[2] for e in result.logs if e[0] == "extra" and e[1] == column]
                values.extend(logged[0] if logged else [None])
            log_extra(column, values)
    if callable(log_metric):
        for metric, value in metrics:
            log_metric(metric, value)


def failure_value(failure_reward: float | None) -> float:
    """The reward written for a failed item: NaN (excluded, TRL's ``None``) by default."""
    return math.nan if failure_reward is None else float(failure_reward)
