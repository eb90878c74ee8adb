"""How reward functions run (:class:`RewardExecutor`), and the isolated kinds (one completion at a
time: threads, an ``Executor``, Ray) on one scheduler. Worker processes import this module: no torch."""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchrl_trl._checks import positive_int, positive_seconds
from torchrl_trl._threads import in_caller_modes

from .scheduler import ItemExecutor, ItemResult, _describe, call_item, warm_up

__all__ = ["FuturesItemExecutor", "RayItemExecutor", "RewardExecutor", "ThreadItemExecutor", "reward_executor"]


@dataclass(frozen=True)
class RewardExecutor:
    """How reward functions run, and the reward of what they do not score: the ``executor=`` of
    :class:`~torchrl_trl.rewards.RewardFunctionWrapper` and :func:`~torchrl_trl.rewards.as_trl_reward_func`
    (a kind alone, ``executor="process"``, is ``RewardExecutor("process")``).

    Args:
        kind (str or concurrent.futures.Executor, optional): ``"caller"`` (each function called
            once on the whole batch, in the caller), or one completion at a time, isolated:
            ``"process"``, ``"thread"``, ``"ray"`` or a ``concurrent.futures.Executor``.
            Defaults to ``"caller"``.
        max_workers (int, optional): completions run at once (isolated kinds). Defaults to
            ``None``: the CPU count (``min(32, cpus + 4)`` threads, an Executor's own size).
        mp_context (str, optional): ``"spawn"`` (``"forkserver"`` means the same) or ``"fork"``
            (``kind="process"`` only). Defaults to ``None`` (``"spawn"``).
        timeout (float, optional): seconds one call of a function on the batch (``"caller"``),
            or one completion (isolated kinds), may take before a ``TimeoutError`` naming the
            function. Defaults to ``None`` (no limit).
        startup_timeout (float, optional): seconds a new process or Ray worker may take to load
            and warm up the functions (not counted in ``timeout``). Defaults to ``120.0``.
        failure_reward (float, optional): the reward of a completion that raised, timed out or
            crashed its worker (isolated kinds). Defaults to ``None``: excluded, like TRL's ``None``.
        unscorable_reward (float, optional): the reward of a row every function returned
            ``None`` for, or failed on (:class:`~torchrl_trl.rewards.RewardFunctionWrapper`).
            Defaults to ``nan``, as TRL marks it.

    Examples:
        >>> RewardExecutor("thread", max_workers=2, failure_reward=0).failure_reward
        0.0
        >>> RewardExecutor("thread", mp_context="fork")
        Traceback (most recent call last):
        ...
        ValueError: RewardExecutor: mp_context applies to kind='process' only: expected it there, got kind='thread'
    """

    kind: str | concurrent.futures.Executor = "caller"
    max_workers: int | None = None
    mp_context: str | None = None
    timeout: float | None = None
    startup_timeout: float = 120.0
    failure_reward: float | None = None
    unscorable_reward: float = math.nan

    def __post_init__(self) -> None:
        kind = self.kind
        if kind not in ("caller", "process", "thread", "ray") and not isinstance(kind, concurrent.futures.Executor):
            raise ValueError(
                "RewardExecutor: kind must be 'caller', 'process', 'thread', 'ray' or a concurrent.futures.Executor, "
                f"got {kind!r}"
            )
        positive_int(self.max_workers, "RewardExecutor: max_workers", allow_none=True)
        given = [n for n in ("max_workers", "failure_reward") if getattr(self, n) is not None]
        if kind == "caller" and given:
            raise ValueError(f"RewardExecutor: {given} apply to isolated kinds: expected kind='process', 'thread' or "
                             "'ray', got 'caller'")
        if self.mp_context is not None and kind != "process":
            raise ValueError(f"RewardExecutor: mp_context applies to kind='process' only: expected it there, got "
                             f"kind={kind!r}")
        if (ctx := self.mp_context) not in (None, "spawn", "forkserver", "fork"):
            raise ValueError(f"RewardExecutor: mp_context must be 'spawn', 'forkserver' or 'fork', got {ctx!r}")
        object.__setattr__(self, "timeout", positive_seconds(self.timeout, "RewardExecutor: timeout"))
        if self.startup_timeout is None:
            raise ValueError("RewardExecutor: startup_timeout must be a positive number of seconds, got None")
        startup_timeout = positive_seconds(self.startup_timeout, "RewardExecutor: startup_timeout")
        object.__setattr__(self, "startup_timeout", startup_timeout)
        if self.failure_reward is not None:
            object.__setattr__(self, "failure_reward", float(self.failure_reward))
        object.__setattr__(self, "unscorable_reward", float(self.unscorable_reward))

    @property
    def isolated(self) -> bool:
        """Whether completions run one at a time in workers (every kind but ``"caller"``)."""
        return self.kind != "caller"

    def build(self, funcs: Sequence[Callable], names: Sequence[str]):
        """The item executor running ``funcs`` (isolated kinds only)."""
        from .process_pool import ProcessItemExecutor

        cls = {"process": ProcessItemExecutor, "thread": ThreadItemExecutor, "ray": RayItemExecutor}
        return cls.get(self.kind, FuturesItemExecutor)(funcs, names, self.timeout, self)


def reward_executor(executor) -> RewardExecutor:
    """``executor=`` (``None``, a kind, an Executor or a :class:`RewardExecutor`) as a :class:`RewardExecutor`."""
    if isinstance(executor, RewardExecutor):
        return executor
    return RewardExecutor() if executor is None else RewardExecutor(executor)


class ThreadItemExecutor(ItemExecutor):
    """Each item in a daemon thread; one past its deadline is abandoned (it keeps running)
    and counted in :attr:`abandoned`."""

    kind = "thread"

    abandoned = 0  # threads past their deadline, still running

    def _default_workers(self, cpus):
        return min(32, cpus + 4)  # as the standard library's ThreadPoolExecutor

    def _submit(self, index, func_index, kwargs, shared):
        future, func = concurrent.futures.Future(), self.funcs[func_index]

        def work():
            try:
                future.set_result(call_item(func, {**shared, **kwargs}))
            except BaseException as err:
                future.set_exception(err)

        threading.Thread(target=in_caller_modes(work), name="torchrl-trl-reward", daemon=True).start()
        return future  # one past its deadline is abandoned: its late result goes nowhere

    def _cancel(self, future):
        self.abandoned += 1
        return self._late("thread abandoned")


class FuturesItemExecutor(ItemExecutor):
    """One ``executor.submit`` per item, timed from submission; a timed-out future is
    cancelled or abandoned. A broken executor raises: it cannot run anything more."""

    kind = "executor"

    def __init__(self, funcs, names, timeout, config):
        self.executor = config.kind
        super().__init__(funcs, names, timeout, config)

    def _default_workers(self, cpus):
        return getattr(self.executor, "_max_workers", None) or cpus

    def __deepcopy__(self, memo):
        return FuturesItemExecutor(self.funcs, self.names, self.timeout, self.config)

    def __getstate__(self):
        raise TypeError(
            f"RewardExecutor: an executor wrapping {type(self.executor).__name__} cannot be pickled; expected "
            "executor='process' or 'thread' (rebuilt in the copy)"
        )

    def _broken(self, err, what: str) -> RuntimeError:
        return RuntimeError(
            f"RewardExecutor: the {type(self.executor).__name__} passed as executor= {what} "
            f"({_describe(err)}); expected one that survives, executor='process' replaces workers that die"
        )

    def _submit(self, index, func_index, kwargs, shared):
        try:
            return self.executor.submit(call_item, self.funcs[func_index], {**shared, **kwargs})
        except concurrent.futures.BrokenExecutor as err:
            raise self._broken(err, "is broken: it cannot run more reward items") from err

    def _error(self, err):
        if isinstance(err, concurrent.futures.BrokenExecutor):
            raise self._broken(err, "broke while running a reward item") from err
        return super()._error(err)

    def _cancel(self, future):
        return self._late("cancelled" if future.cancel() else "abandoned")


def _ray_call_item(funcs, index, shared, kwargs):
    if index is None:  # a warm-up task: the shared arguments are loaded, the functions warmed up
        for func in funcs:
            warm_up(func)
        return None
    return call_item(funcs[index], {**shared, **kwargs})


class RayItemExecutor(ItemExecutor):
    """One Ray task per item (``num_cpus=1``, no retries), force-cancelled past its deadline;
    the first call waits (``startup_timeout``) for ``max_workers`` warm workers, and a worker
    that died (a crash, a cancelled task) is replaced the same way before the next item starts,
    so no item's ``timeout`` pays for a worker's start-up."""

    kind = "ray"

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        # _job: the Ray job the remote function and the refs belong to; _dead: workers to replace
        self._remote = self._funcs_ref = self._shared_ref = self._job = None
        self._dead = 0

    def _begin(self, shared, n):
        import ray

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False)
        job = ray.get_runtime_context().get_job_id()
        if self._job != job:  # first call, or Ray was restarted: refs of the old job are gone
            self._remote, self._job = None, job
        if self._remote is None:
            self._remote = ray.remote(num_cpus=1, max_retries=0)(_ray_call_item)
            self._funcs_ref = ray.put(self.funcs)
            self._warm(self.max_workers, shared)
        self._shared_ref = ray.put(shared)  # serialised once per call, not once per item

    def _warm(self, n: int, shared) -> None:
        """Wait for ``n`` workers that loaded the functions and the shared arguments (TRL's
        TrainerState imports modules) and warmed the functions up (:func:`warm_up`): a
        worker's start-up is not on an item's clock."""
        import ray

        warm = [self._remote.remote(self._funcs_ref, None, shared, {}) for _ in range(n)]
        ready, _ = ray.wait(warm, num_returns=n, timeout=self.startup_timeout)
        if len(ready) < n:
            raise RuntimeError(
                f"RewardExecutor: expected {n} Ray workers within startup_timeout={self.startup_timeout}s, "
                f"{n - len(ready)} did not start (max_workers={self.max_workers}; fewer free CPUs?)"
            )

    def _slot_free(self, running: dict) -> bool:
        free = self.max_workers - len(running)
        if self._dead and free > 0:  # replace dead workers (as many as are free) before the next item
            n = min(self._dead, free)
            self._dead -= n
            self._warm(n, self._shared_ref)
        return super()._slot_free(running)

    def _submit(self, index, func_index, kwargs, shared):
        return self._remote.remote(self._funcs_ref, func_index, self._shared_ref, kwargs)

    def _collect(self, busy, wait_for):
        import ray

        finished, _ = ray.wait(busy, num_returns=1, timeout=wait_for)
        if finished:  # and every other one finished by now
            finished, _ = ray.wait(busy, num_returns=len(busy), timeout=0)
        return [(ref, self._outcome(functools.partial(ray.get, ref))) for ref in finished]

    def _error(self, err):
        from ray import exceptions as rex

        if isinstance(err, rex.RayTaskError):
            return super()._error(err.cause if getattr(err, "cause", None) is not None else err)
        crashed = (rex.WorkerCrashedError, rex.RayActorError, rex.TaskCancelledError, rex.ObjectLostError)
        if not isinstance(err, crashed):
            raise err
        self._dead += 1
        return ItemResult("crash", detail=_describe(err).splitlines()[0])

    def _cancel(self, ref):
        import ray

        ray.cancel(ref, force=True)  # kills its worker
        self._dead += 1
        return self._late("Ray task cancelled")
