"""``executor="process"``: our own worker pool; a task past its deadline has its worker killed
and replaced, a dead worker fails only its item. Workers are fresh interpreters (never the
trainer's ``__main__``) that get the functions once, with cloudpickle, and die with the trainer.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref

import cloudpickle

from .scheduler import ItemExecutor, ItemResult, _deadline, _describe, _left, call_item, warm_up

__all__ = ["ProcessItemExecutor"]


def _exit_detail(exitcode: int | None) -> str:
    if exitcode is None:
        return "worker process died"
    if exitcode < 0:
        try:
            return f"worker process killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"worker process killed by signal {-exitcode}"
    return f"worker process exited with code {exitcode}"


def _watch_trainer(trainer_pid: int) -> None:
    # exit once the trainer is gone (the parent-death signal covers main-thread workers on Linux)
    try:
        handle = os.pidfd_open(trainer_pid)  # Linux >= 5.3: readable once it exits
    except (AttributeError, OSError):
        handle = None
    if handle is not None:
        multiprocessing.connection.wait([handle])  # returns once the trainer exits
        os._exit(1)
    while True:
        time.sleep(1.0)
        try:
            os.kill(trainer_pid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or its pid reused by another user
            os._exit(1)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits, even while C code holds the GIL."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # no libc prctl: the watcher thread remains
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


# a fresh interpreter with the trainer's sys.path, importing neither its __main__ nor torch
_WORKER_COMMAND = (
    "import sys; sys.path[:] = sys.argv[4:]; "
    "from torchrl_trl.rewards.process_pool import _worker_main; "
    "_worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == '1')"
)


def _worker_main(conn, trainer_pid: int, die_with_parent: bool = False) -> None:
    """A worker process: load the functions (``conn``'s first message) and warm them up
    (:func:`~torchrl_trl.rewards.scheduler.warm_up`: the imports their first call would do),
    say it is ready, run tasks until told to stop. Loading and warming up are its start-up,
    bounded by ``startup_timeout``; no item's ``timeout`` pays for them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if die_with_parent:
        _die_with_parent()
    threading.Thread(target=_watch_trainer, args=(trainer_pid,), daemon=True).start()
    if isinstance(conn, int):
        conn = multiprocessing.connection.Connection(conn)
    try:
        funcs = pickle.loads(conn.recv_bytes())
        for func in funcs:
            warm_up(func)
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
            detail = f"its output could not be sent back: {_describe(err)}"
            conn.send((task_id, "error", None, detail, []))


class _Worker:
    """A worker process (``Popen`` or forked ``Process``), our end of its pipe, and its state."""

    def __init__(self, process, conn):
        self.process, self.conn = process, conn
        self.started = time.monotonic()
        self.ready, self.task, self.running = False, None, False
        self.shared_version = -1

    def exitcode(self) -> int | None:
        """``None`` while it runs; negative: the signal that killed it."""
        return self.process.poll() if isinstance(self.process, subprocess.Popen) else self.process.exitcode

    def join(self, timeout: float | None) -> None:
        if not isinstance(self.process, subprocess.Popen):
            return self.process.join(timeout)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)

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
    """A pool of ``max_workers`` processes with a deadline per task: ``"spawn"`` (fresh
    interpreters) or ``"fork"`` (fastest; inherits the trainer's threads, locks and CUDA)."""

    kind = "process"

    def __init__(self, funcs, names, timeout, config):
        super().__init__(funcs, names, timeout, config)
        self.mp_context = "fork" if config.mp_context == "fork" else "spawn"
        for f, name in zip(self.funcs, self.names):
            try:
                cloudpickle.dumps(f)
            except Exception as err:
                raise TypeError(
                    f"RewardExecutor: executor='process' sends reward function {name!r} with cloudpickle, which failed "
                    f"({_describe(err)}); expected it picklable, or executor='thread'"
                ) from err
        self.payload = cloudpickle.dumps(self.funcs)
        self.replaced = 0  # worker processes killed (timeout) or found dead (crash)

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._workers: list[_Worker] = []
        self._shared_version, self._target = 0, 0
        _LIVE_POOLS.add(self)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the current workers."""
        return [w.process.pid for w in self._workers]

    def _spawn(self) -> None:
        parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
        # the parent-death signal fires when the *thread* that started the worker exits
        die = threading.current_thread() is threading.main_thread()
        try:
            if self.mp_context == "fork":
                process = multiprocessing.get_context("fork").Process(
                    target=_worker_main, args=(child_conn, os.getpid(), die),
                    name="torchrl-trl-reward-worker", daemon=True,
                )
                process.start()
            else:
                fd = child_conn.fileno()
                args = [str(fd), str(os.getpid()), str(int(die)), *map(str, sys.path)]
                process = subprocess.Popen([sys.executable, "-c", _WORKER_COMMAND, *args],
                                           pass_fds=[fd], stdin=subprocess.DEVNULL)
        finally:
            child_conn.close()
        self._workers.append(_Worker(process, parent_conn))
        with contextlib.suppress(OSError):  # it died at once: _collect says so
            parent_conn.send_bytes(self.payload)

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        if worker in self._workers:
            self._workers.remove(worker)
            self.replaced += 1

    def _send(self, worker: _Worker, msg, what: str) -> None:
        try:
            worker.conn.send(msg)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise TypeError(
                f"RewardExecutor: executor='process' could not send {what} to a worker process: "
                f"{_describe(err)}; expected picklable arguments"
            ) from err

    def _begin(self, shared, n):
        self._shared_version += 1
        self._target = min(self.max_workers, n)

    def _slot(self, running):
        while len(self._workers) < self._target:
            self._spawn()
        return next((w for w in self._workers if w.ready and w.task is None), None)

    def _first_timeout(self):
        # until the worker has loaded the arguments (imports), the start-up bound applies
        return self.startup_timeout

    def _submit(self, worker, index, func_index, kwargs, shared):
        try:
            if worker.shared_version != self._shared_version:
                self._send(worker, ("shared", shared), f"the shared arguments {sorted(shared)}")
                worker.shared_version = self._shared_version
            what = f"the arguments {sorted(kwargs)} of reward function {self.names[func_index]!r}"
            self._send(worker, ("task", index, func_index, kwargs), what)
        except OSError:  # it died while idle: replace it
            self._drop(worker)
            return None
        worker.task, worker.running = index, False
        return worker

    def _collect(self, busy, wait_for):
        starting = [w for w in self._workers if not w.ready]
        watched = starting + busy
        if not watched:
            return []
        # a worker's death closes its pipe, unless a process it forked holds it: look each second
        limits = [1.0, *(_left(w.started + self.startup_timeout) for w in starting)]
        limits += [] if wait_for is None else [wait_for]
        multiprocessing.connection.wait([w.conn for w in watched], min(limits))
        done = []
        for worker in watched:
            dead = False
            try:
                while worker.conn.poll():
                    done += self._on_message(worker, worker.conn.recv())
            except (EOFError, OSError):
                dead = True
            if dead or worker.exitcode() is not None:
                worker.join(5)
                detail = _exit_detail(worker.exitcode())
                self._drop(worker)
                if not worker.ready:
                    raise RuntimeError(
                        f"RewardExecutor: executor='process': a worker process died while loading the reward "
                        f"functions {self.names} ({detail})"
                    )
                if worker.task is not None:
                    done.append((worker, ItemResult("crash", detail=detail)))
            elif not worker.ready and time.monotonic() >= worker.started + self.startup_timeout:
                self._drop(worker)
                raise RuntimeError(
                    f"RewardExecutor: executor='process': a worker did not load the reward functions "
                    f"{self.names} within {self.startup_timeout}s (startup_timeout)"
                )
        return done

    def _on_message(self, worker: _Worker, msg) -> list:
        if msg[0] == "ready":
            worker.ready = True
        elif msg[0] == "started":
            if msg[1] == worker.task and worker in self._running:
                worker.running = True
                self._running[worker][1] = _deadline(self.timeout)
        elif msg[0] == "init_error":
            self._drop(worker)
            raise RuntimeError(
                f"RewardExecutor: executor='process': a worker could not load the reward functions {self.names}: "
                f"{msg[1]}; expected their module importable (sent by reference)"
            )
        elif msg[0] == worker.task:  # (task_id, status, value, detail, logs)
            worker.task, worker.running = None, False
            return [(worker, ItemResult(*msg[1:]))]
        return []

    def _cancel(self, worker):
        late = f"the worker did not load the arguments within {self.startup_timeout}s; killed"
        detail = self._late("worker killed") if worker.running else late
        self._drop(worker)
        return detail

    def shutdown(self) -> None:
        """Stop the workers: idle ones are asked to exit, any alive 1 s later (or busy) is
        killed; the first error is re-raised once all were handled."""
        workers, self._workers = list(getattr(self, "_workers", [])), []
        idle = [w for w in workers if w.ready and w.task is None]
        for worker in idle:
            with contextlib.suppress(OSError, ValueError):  # already dead, or its pipe closed
                worker.conn.send(("stop",))
        deadline = _deadline(1.0)
        first_error = None
        for worker in workers:
            try:
                if worker in idle:
                    worker.join(_left(deadline))
                worker.kill()
            except Exception as err:  # keep stopping the others
                first_error = first_error or err
        if first_error is not None:
            raise first_error

    def __del__(self):
        with contextlib.suppress(Exception):  # the workers must not outlive the pool
            self.shutdown()
