"""``executor="process"``: each item a task of a :class:`pebble.ProcessPool`.

pebble does the pool: ``max_workers`` processes, a per-task timeout counted from when a worker
has loaded the task's arguments (the worker is then stopped and replaced), a worker that dies
failing only its own task (``ProcessExpired``), and an initializer per worker, which loads the
functions once (cloudpickle: lambdas, closures, functions of ``__main__``, of stdin or of a
notebook) and warms them up (:func:`~torchrl_trl.rewards.scheduler.warm_up`), so a worker's
start-up is never on an item's clock. What pebble 5.1.1 cannot do, and the test showing it
(each fails with a plain ``pebble.ProcessPool``), is the code kept here:

- an unguarded script's functions: multiprocessing's ``"spawn"`` runs the script's top level
  again in every worker (which trains again, then fails); :class:`_SpawnWithoutMain` starts
  workers without the trainer's ``__main__``
  (``test_reward_function_of_main_in_process_workers[unguarded_script]``);
- a bound on start-up: pebble waits forever for a worker stuck loading the functions;
  ``startup_timeout`` stops the pool and raises
  (``test_a_worker_that_cannot_load_the_functions_in_startup_timeout_raises``);
- workers die with the trainer: pebble's outlive a trainer that was SIGKILLed; each worker
  watches it (``test_a_worker_exits_when_its_trainer_is_killed``);
- a worker that exits with code 0 mid-task: pebble takes it for a normal exit and never ends
  the task (or calls it a timeout); a ``"crash"`` here (``test_a_worker_exiting_with_code_0_is_a_crash``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing import context, popen_spawn_posix, reduction, spawn, util

import cloudpickle
import pebble

from .scheduler import ItemExecutor, ItemResult, _describe, call_item, warm_up

__all__ = ["ProcessItemExecutor"]


class _SpawnWithoutMain(popen_spawn_posix.Popen):
    """``"spawn"``'s ``Popen`` (``_launch`` as in CPython 3.10-3.13) with preparation data that
    name no ``__main__``: a worker never runs the trainer's script; the functions it needs
    come with cloudpickle."""

    def _launch(self, process_obj):
        from multiprocessing import resource_tracker

        self._fds.append(tracker_fd := resource_tracker.getfd())
        prep = spawn.get_preparation_data(process_obj._name)
        prep = {k: v for k, v in prep.items() if k not in ("init_main_from_path", "init_main_from_name")}
        fp = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep, fp)
            reduction.dump(process_obj, fp)
        finally:
            context.set_spawning_popen(None)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        self._fds += [child_r, child_w]
        try:
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, [parent_r, parent_w])
            os.close(child_r)
            os.close(child_w)


class _SpawnContext(context.SpawnContext):
    class Process(context.SpawnProcess):
        _Popen = staticmethod(_SpawnWithoutMain)


def _exit_detail(exitcode: int | None) -> str:
    if exitcode is None:
        return "worker process ended without a result"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"worker process killed by {signal.Signals(-exitcode).name}"
        return f"worker process killed by signal {-exitcode}"
    return f"worker process exited with code {exitcode}"


def _watch_trainer(trainer_pid: int) -> None:
    """Exit once the trainer is gone (the parent-death signal covers pools of its main thread)."""
    with contextlib.suppress(AttributeError, OSError):  # Linux >= 5.3: readable once it exits
        multiprocessing.connection.wait([os.pidfd_open(trainer_pid)])
    while os.getppid() == trainer_pid:  # elsewhere: adopted by another process once it exits
        time.sleep(0.5)
    os._exit(1)


_FUNCS: list = []
_LOAD_ERROR = ""


def _init_worker(payload: bytes, trainer_pid: int, die_with_parent: bool) -> None:
    """pebble's initializer: watch the trainer, load the functions and warm them up. A failure
    is kept for the first item to report (a raising initializer makes pebble restart the worker
    forever)."""
    global _FUNCS, _LOAD_ERROR
    if die_with_parent and sys.platform.startswith("linux"):  # SIGKILL even while C code holds the GIL
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    threading.Thread(target=_watch_trainer, args=(trainer_pid,), daemon=True).start()
    try:
        _FUNCS = pickle.loads(payload)
        for func in _FUNCS:
            warm_up(func)
    except BaseException as err:
        _LOAD_ERROR = _describe(err)


def _run_item(func_index: int, shared: dict, kwargs: dict) -> tuple:
    """In a worker: ``(status, value, detail, logs)`` of one call."""
    if _LOAD_ERROR:
        return "load_error", None, _LOAD_ERROR, []
    try:
        value, logs = call_item(_FUNCS[func_index], {**shared, **kwargs})
    except BaseException as err:
        tb = traceback.extract_tb(err.__traceback__)
        where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
        return "error", None, _describe(err) + where, []
    try:
        pickle.dumps((value, logs))
    except Exception as err:
        return "error", None, f"its output could not be sent back: {_describe(err)}", []
    return "ok", value, "", logs


class ProcessItemExecutor(ItemExecutor):
    """Items on a :class:`pebble.ProcessPool` of ``max_workers`` processes, ``"spawn"`` (fresh
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
        self.replaced = 0  # worker processes stopped (timeout) or found dead (crash)

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._pool: pebble.ProcessPool | None = None
        self._gone: dict = {}  # future -> when its worker was first seen gone without an end

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the current workers."""
        return [] if self._pool is None else list(self._pool._pool_manager.worker_manager.workers)

    def _begin(self, shared, n):
        try:
            pickle.dumps(shared)
        except Exception as err:
            raise TypeError(
                f"RewardExecutor: executor='process' could not send the shared arguments {sorted(shared)} to a "
                f"worker process: {_describe(err)}; expected picklable arguments"
            ) from err
        self._gone = {}
        if self._pool is not None and not self._pool.active:  # broken (a worker died idle): a new one
            self.shutdown()
        if self._pool is None:
            ctx = multiprocessing.get_context("fork") if self.mp_context == "fork" else _SpawnContext()
            # the parent-death signal fires when the thread that started the worker exits:
            # pebble's own thread starts the replacements, this one the first workers
            die = threading.current_thread() is threading.main_thread()
            self._pool = pebble.ProcessPool(self.max_workers, initializer=_init_worker,
                                            initargs=(self.payload, os.getpid(), die), context=ctx)

    def _first_timeout(self):
        return self.startup_timeout  # until a worker has taken the item and loaded its arguments

    def _submit(self, index, func_index, kwargs, shared):
        return self._pool.schedule(_run_item, (func_index, shared, kwargs), timeout=self.timeout)

    def _collect(self, busy, wait_for):
        out = super()._collect(busy, 1.0 if wait_for is None else min(1.0, wait_for))
        if not self._pool.active:  # pebble's own threads stopped: nothing more would end
            self.shutdown()
            raise RuntimeError("RewardExecutor: executor='process': the pebble pool broke (a worker died while idle); "
                               "expected it alive (the next call starts a new pool)")
        now, waiting = time.monotonic(), set(busy) - {future for future, _ in out}
        for future in waiting:
            if future.running():
                self._running[future][1] = None  # pebble's timeout from here
            elif now >= self._running[future][1]:
                self.shutdown()
                raise RuntimeError(
                    f"RewardExecutor: executor='process': a worker did not load the reward functions {self.names} "
                    f"within {self.startup_timeout}s, or an item's arguments; expected a larger startup_timeout"
                )
        return out + self._lost(waiting, now)

    def _outcome(self, get) -> ItemResult:
        try:
            status, value, detail, logs = get()
        except concurrent.futures.TimeoutError:
            self.replaced += 1
            return ItemResult("timeout", detail=self._late("worker killed"))
        except pebble.ProcessExpired as err:
            self.replaced += 1
            return ItemResult("crash", detail=_exit_detail(err.exitcode))
        except (pickle.PicklingError, TypeError, AttributeError) as err:  # pebble could not send it
            raise TypeError(
                f"RewardExecutor: executor='process' could not send an item's arguments to a worker process: "
                f"{_describe(err)}; expected picklable arguments"
            ) from err
        if status == "load_error":
            self.shutdown()
            raise RuntimeError(
                f"RewardExecutor: executor='process': a worker could not load the reward functions {self.names}: "
                f"{detail}; expected their module importable (sent by reference)"
            )
        return ItemResult(status, value, detail, logs)

    def _lost(self, running: set, now: float) -> list:
        """Started tasks whose worker pebble dropped without ending them (it exited with code 0):
        a crash once seen so for 1 s (pebble ends a crash's task right after dropping its worker)."""
        manager = self._pool._pool_manager
        workers, lost = manager.worker_manager.workers, []
        for task in list(manager.task_manager.tasks.values()):
            late = task.timeout and time.time() - task.timestamp > task.timeout  # pebble is stopping it
            if task.future in running and task.started and task.worker_id not in workers and not late:
                if now - self._gone.setdefault(task.future, now) >= 1.0:
                    self.replaced += 1
                    lost.append((task.future, ItemResult("crash", detail=_exit_detail(None))))
        return lost

    def _cancel(self, future):
        future.cancel()  # pebble stops its worker if it runs
        return self._late("worker killed")

    def shutdown(self) -> None:
        """Stop the workers (a later ``run`` starts new ones)."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.stop()
            pool.join()

    def __del__(self):
        try:  # the workers must not outlive the pool (not contextlib: gone at interpreter exit)
            self.shutdown()
        except Exception:
            pass
