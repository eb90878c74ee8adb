"""TRL's ``GRPOTrainer`` trained on the GRPO groups a TorchRL ``LLMCollector`` writes.

New writes (by ``write_count``; nothing is taken out of the buffer) are cut into episodes at
``("next", "done")``, and those into groups of ``G`` consecutive episodes sharing a prompt.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts
from .._checks import positive_int
from ..padding import check_policy_padding
from .callback import CollectorError
from .episodes import BEHAVIOUR_KEY, GENERATED_LOGPROBS_KEY, episodes_to_trl
from .group_rollouts import GroupRolloutFunc, RolloutGroup, split_groups, take_fresh
from .ray import is_ray_collector
from .staleness import read_policy_version
from .weights import push_weights, weights_td

__all__ = ["LLMCollectorRolloutFunc"]


class LLMCollectorRolloutFunc(GroupRolloutFunc):
    """``GRPOTrainer(rollout_func=...)`` training on the complete GRPO groups a TorchRL
    ``LLMCollector`` / ``RayLLMCollector`` writes into ``replay_buffer``.

    Args:
        collector (LLMCollector or RayLLMCollector): built with ``replay_buffer=``,
            ``track_policy_version=True``, a policy with its own weights (multi-turn:
            ``yield_completed_trajectories=True``) and, for exact log-probs,
            ``postproc=BehaviourLogProbsPostproc(policy)``. Started on the first call. An
            in-process collector's policy must keep its tokens through padding
            (:func:`torchrl_trl.safe_policy_wrapper`): a pad == eos policy is refused with a
            ``ValueError`` (:func:`torchrl_trl.check_policy_padding`).
        replay_buffer (ReplayBuffer or RayReplayBuffer): the buffer it writes into, with an
            ``MCAdvantage(grpo_size=group_size)`` write transform where a group can span batches.

    Keyword Args:
        group_size (int): completions per prompt (``GRPOConfig.num_generations``).
        max_staleness (int or None, optional): largest accepted age of a group,
            ``collector.policy_version`` minus its items' ``policy_version`` (``None``: keep
            all). Defaults to ``1``.
        timeout (float or None, optional): seconds to wait for fresh groups, or for the batch in
            flight before a weight push. Defaults to ``120.0``.
        group_key (NestedKey, optional): the key all items of a group share (``MCAdvantage``'s
            ``prompt_key``). Defaults to ``"query"``.
        push_weights (bool, optional): push the trainer's weights when ``global_step`` changed.
            Defaults to ``True``.
        drop_zero_std (bool, optional): drop (and count) groups whose env reward is the same for
            every completion. Defaults to ``False``.
        reuse (int, optional): train on each group up to ``1 + reuse`` times. Defaults to ``0``.
        max_pending_groups (int, optional): an in-process collector waits before writing a batch
            until its groups and those not yet taken are at most this many. Defaults to ``None``
            (no bound).
        forward_keys (sequence of NestedKey, optional): top-level keys passed to TRL's reward
            functions, as in :class:`~torchrl_trl.online.TorchRLRolloutFunc`. Defaults to ``None``
            (every non-TorchRL key).

    :attr:`poll_s` (a class attribute, ``0.1``; an instance may set its own) is the wait
    between two reads of the buffer.

    Attributes:
        read_groups, consumed_groups, dropped_stale_groups, dropped_filtered_groups, missed_items, weight_pushes:
            counters; ``wait_s``, ``push_s``: seconds spent waiting for groups and pushing weights.

    Example (``trainer`` stands in for ``GRPOTrainer``: only the attributes shown are read):

    >>> from types import SimpleNamespace
    >>> from torchrl.collectors.llm import LLMCollector
    >>> from torchrl.data import LazyStackStorage, ReplayBuffer
    >>> from torchrl_trl import testing
    >>> tok = testing.make_tokenizer()
    >>> env = testing.make_chat_env([{"query": "hi"}], batch_size=2, group_size=2)  # "hi" twice: a group
    >>> rb = ReplayBuffer(storage=LazyStackStorage(256))  # a batch is a whole group: no MCAdvantage needed
    >>> collector = LLMCollector(
    ...     env=env, policy=testing.make_policy_wrapper(testing.make_policy(tok), tok, max_new_tokens=3),
    ...     dialog_turns_per_batch=2, replay_buffer=rb, track_policy_version=True, total_dialog_turns=-1)
    >>> trainer = SimpleNamespace(num_generations=2, model=testing.make_policy(tok), state=SimpleNamespace(global_step=0),
    ...                           accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    >>> with LLMCollectorRolloutFunc(collector, rb, group_size=2, max_staleness=1) as func:
    ...     batch = func([[{"role": "user", "content": "hi"}]] * 2, trainer)  # pushes, starts, takes a group
    >>> collector.policy_version, func.weight_pushes, batch["staleness"], batch["torchrl_prompt"][0][-1]["content"]
    (1, 1, [0, 0], 'hi')
    """

    #: seconds between two reads of the buffer while waiting (and between two checks of a
    #: collector held at its batch boundary)
    poll_s: float = 0.1

    def __init__(
        self, collector, replay_buffer, *, group_size: int, max_staleness: int | None = 1,
        timeout: float | None = 120.0, group_key="query", push_weights: bool = True,
        drop_zero_std: bool = False, reuse: int = 0, max_pending_groups: int | None = None,
        forward_keys: Sequence[NestedKey] | None = None,
    ):
        super().__init__(max_staleness=max_staleness, timeout=timeout, push_weights=push_weights,
                         drop_zero_std=drop_zero_std, reuse=reuse)
        self.collector = collector
        self.replay_buffer = replay_buffer
        self.group_size = positive_int(group_size, "LLMCollectorRolloutFunc: group_size")
        self.group_key = group_key
        self.forward_keys = None if forward_keys is None else list(forward_keys)
        self.read_groups = self.consumed_groups = self.weight_pushes = 0
        self.dropped_stale_groups = self.dropped_filtered_groups = 0
        self.wait_s = self.push_s = 0.0
        self.policy_version = 0
        self._cursor = int(replay_buffer.stats()["write_count"])  # what was there before is not ours
        self._pending: deque[tuple[int, TensorDictBase]] = deque()
        self._pushed_step: int | None = None
        self._started = False
        self._in_process = not is_ray_collector(collector)
        if self._in_process:  # a Ray collector's policy lives in its actor
            check_policy_padding(getattr(collector, "policy", None), "LLMCollectorRolloutFunc")
        self.max_pending_groups = positive_int(max_pending_groups, "LLMCollectorRolloutFunc: max_pending_groups",
                                               allow_none=True)
        if self.max_pending_groups is not None and not self._in_process:
            raise ValueError(
                "LLMCollectorRolloutFunc: max_pending_groups bounds an in-process collector (its post_collect_hook); "
                "expected None for a Ray collector"
            )
        self._reading = threading.Condition()  # the trainer and the collector's batch boundary
        self._closing = threading.Event()
        self._pauses = 0  # paused() callers waiting for, or holding, the collector at a boundary
        self._at_boundary = False  # the collector's thread is in its post_collect_hook

    def _sync(self, trainer) -> int:
        step = int(trainer.state.global_step)
        if self.push_weights and step != self._pushed_step:
            self.push(trainer.accelerator.unwrap_model(trainer.model))
            self._pushed_step = step
        else:  # the caller may push weights itself: staleness is against the collector's version
            self.policy_version = self._collector_version()
        self.start()
        return self.policy_version

    def start(self) -> None:
        if not self._started:
            if self._in_process:
                self._install_boundary()
            self.collector.start()
            self._started = True

    def _install_boundary(self) -> None:
        """Chain a ``post_collect_hook`` that holds the collector between two batches while
        :meth:`paused` holds it, or while its batch would exceed ``max_pending_groups``."""
        previous = self.collector.post_collect_hook

        def between_batches(batch: TensorDictBase) -> None:
            with self._reading:
                self._at_boundary = True
                self._reading.notify_all()
            try:
                if previous is not None:  # may wait on the trainer too: a push need not wait for it
                    previous(batch)
                incoming = -(-sum(_ends_episode(batch)) // self.group_size)  # groups, rounded up
                with self._reading:
                    while not self._closing.is_set() and (self._pauses or self._too_far_ahead(incoming)):
                        self._reading.wait(self.poll_s)
            finally:
                with self._reading:
                    self._at_boundary = False

        self.collector.post_collect_hook = between_batches

    def _too_far_ahead(self, incoming: int) -> bool:
        if self.max_pending_groups is None:
            return False
        self._read_new()
        pending = len(self._pending)
        return pending > 0 and pending + incoming > self.max_pending_groups  # a batch over the bound goes alone

    @contextlib.contextmanager
    def paused(self):
        """Hold an in-process collector between two batches for the ``with`` block (a Ray
        actor is not held).

        Raises:
            CollectorError: the batch in flight did not end within ``timeout`` seconds.
        """
        start = time.monotonic()
        with self._reading:
            self._pauses += 1
        try:
            with self._reading:
                while self._started and self._in_process and not self._at_boundary and _is_running(self.collector):
                    if self.timeout is not None and time.monotonic() - start > self.timeout:
                        raise CollectorError(
                            f"LLMCollectorRolloutFunc: the collector's batch in flight did not end within "
                            f"timeout={self.timeout} s (a weight push waits for it)"
                        )
                    self._reading.wait(self.poll_s)
            yield
        finally:
            with self._reading:
                self._pauses -= 1
                self._reading.notify_all()

    def next_groups(self, n: int, *, version: int | None = None, wait: bool = True, keep=None) -> list[RolloutGroup]:
        self.policy_version = self._collector_version() if version is None else version
        out: list[RolloutGroup] = []
        while len(out) < n:
            groups = self.take(n - len(out), wait=wait)
            if not groups:
                break
            episodes = [group[s:e] for _, group in groups for s, e in _episode_bounds(group)]
            key = BEHAVIOUR_KEY if layouts.has_key(episodes[0], BEHAVIOUR_KEY) else GENERATED_LOGPROBS_KEY
            batch = episodes_to_trl(episodes, logprobs_key=key, forward_keys=self.forward_keys)
            prompts = _prompts(batch.steps[0])[:: self.group_size]
            for (group_version, _), prompt, part in zip(groups, prompts, split_groups(batch, self.group_size)):
                group = RolloutGroup(group_version, prompt, part)
                if keep is None or keep(group):
                    out.append(group)
                else:
                    self.dropped_filtered_groups += 1
            if not wait:
                break
        return out

    def push(self, model: torch.nn.Module | TensorDictBase | None, *, version: int | None = None) -> int:
        """Send ``model``'s weights (or a TensorDict of them; ``None``: none) to the collector's policy
        between two of its batches (:meth:`paused`); returns its new policy version (``version`` if given).
        A Ray actor loads them while it generates: a batch in flight can mix two versions and is
        stamped with the new one, so keep ``max_staleness >= 1`` there."""
        start = time.monotonic()
        with self.paused():
            if model is not None:
                push_weights(self.collector, model)
                self.weight_pushes += 1
            if version is not None:
                self.collector.policy_version_tracker.version = int(version)
        self.push_s += time.monotonic() - start
        self.policy_version = self._collector_version()
        return self.policy_version

    def send_named_weights(self, named_tensors) -> None:
        self.push(weights_td(named_tensors))

    tokenizer = property(lambda self: self.collector.policy.tokenizer)

    def _collector_version(self) -> int:
        version = self.collector.policy_version
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(
                f"LLMCollectorRolloutFunc: expected an int collector.policy_version, got {version!r}: build the "
                "collector with track_policy_version=True"
            )
        return version

    @property
    def pending(self) -> int:
        """Groups written and not yet taken."""
        with self._reading:
            self._read_new()
            return len(self._pending)

    def take(self, n: int, *, wait: bool = True) -> list[tuple[int, TensorDictBase]]:
        """``n`` whole groups ``(version, items [G])``, oldest first, within ``max_staleness``
        of :attr:`policy_version`; waits up to ``timeout`` (``wait=False``: those ready now).

        Raises:
            CollectorError: the collector stopped, or fewer than ``n`` fresh groups came in time.
        """
        out: list[tuple[int, TensorDictBase]] = []
        start = time.monotonic()
        try:
            while True:
                running = _is_running(self.collector)  # asked first: what it wrote before stopping counts
                with self._reading:
                    self._read_new()
                    taken, stale, _ = take_fresh(
                        self._pending, n - len(out), consumer_version=self.policy_version,
                        max_staleness=self.max_staleness, version=lambda group: group[0],
                    )
                    self._reading.notify_all()  # room for a collector held by max_pending_groups
                out += taken
                self.dropped_stale_groups += stale
                if len(out) == n or not wait:
                    return out
                counts = f"({self.read_groups} read, {self.dropped_stale_groups} dropped stale)"
                if not running:
                    raise CollectorError(
                        f"LLMCollectorRolloutFunc: the collector is not running (it stopped or died); got {len(out)} "
                        f"of {n} groups {counts}"
                    )
                if self.timeout is not None and time.monotonic() - start > self.timeout:
                    raise CollectorError(
                        f"LLMCollectorRolloutFunc: expected {n} groups within max_staleness={self.max_staleness}, "
                        f"got {len(out)} after {self.timeout} s {counts}"
                    )
                time.sleep(self.poll_s)
        finally:
            self.wait_s += time.monotonic() - start
            self.consumed_groups += len(out)

    def _read_new(self) -> None:
        stats = self.replay_buffer.stats()
        written, capacity = int(stats["write_count"]), stats.get("capacity")
        if written == self._cursor:
            return
        first = self._cursor if capacity is None else max(self._cursor, written - int(capacity))
        self._missed(first - self._cursor)
        positions = torch.arange(first, written)
        items = self.replay_buffer[positions if capacity is None else positions % int(capacity)]
        after = int(self.replay_buffer.stats()["write_count"])
        if capacity is not None and after - int(capacity) > first:  # overwritten while read
            lost = min(after - int(capacity), written) - first
            self._missed(lost)
            items, first = items[lost:], first + lost
        self._split(items, aligned=first == self._cursor)
        self._cursor = written

    def _missed(self, n: int) -> None:
        self._warnings.add(
            "missed", f"{n} items were overwritten in the buffer before they were read: give it a larger "
            "capacity (it must hold what the collector writes between two trainer steps)", n=n, stacklevel=5,
        )

    @property
    def missed_items(self) -> int:
        """Items overwritten in the buffer before they were read (never trained on)."""
        return self._warnings.counts["missed"]

    def _split(self, items: TensorDictBase, *, aligned: bool) -> None:
        """Queue ``items`` as groups ``(version, steps)`` of ``G`` consecutive episodes sharing ``group_key``;
        not ``aligned`` (older items overwritten): a leading partial group is skipped and counted."""
        bounds = _episode_bounds(items)
        if not aligned:
            bounds = self._skip_partial_episode(items, bounds)
        keys = layouts.read_column(items, self.group_key)
        g = self.group_size
        runs = itertools.groupby(bounds, key=lambda bound: _hashable(keys[bound[0]]))
        for i, (key, run) in enumerate(runs):
            run = list(run)
            extra = len(run) % g
            if extra and i == 0 and not aligned:  # the rest of a group whose start was overwritten
                self._missed(run[extra - 1][1] - run[0][0])
                run = run[extra:]
            elif extra:
                raise ValueError(
                    f"LLMCollectorRolloutFunc: expected whole groups of {g}, {len(run)} consecutive episodes share "
                    f"{self.group_key!r}={key!r:.30}; write through MCAdvantage(grpo_size={g})"
                )
            for first in range(0, len(run), g):
                group = items[run[first][0] : run[first + g - 1][1]]
                self._pending.append((int(read_policy_version(group).min()), group))
                self.read_groups += 1

    def _skip_partial_episode(self, items: TensorDictBase, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Drop a first episode whose first steps were overwritten (``step_count`` > 0, or multi-turn)."""
        if not bounds:
            return bounds
        start, end = bounds[0]
        if layouts.has_key(items, "step_count"):
            partial = int(torch.as_tensor(layouts.read_column(items[start : start + 1], "step_count")[0]).max()) > 0
        else:
            partial = end - start > 1
        if partial:
            self._missed(end - start)
            return bounds[1:]
        return bounds

    def close(self, timeout: float = 30.0) -> None:
        """Stop the collector (``async_shutdown``), releasing it if it waits at a batch boundary."""
        self._closing.set()
        if self._started:
            self.collector.async_shutdown(timeout=timeout)


def _episode_bounds(items: TensorDictBase) -> list[tuple[int, int]]:
    """``(start, end)`` of each episode in ``items``; ``ValueError`` if the last one is cut short."""
    ends = [i + 1 for i, end in enumerate(_ends_episode(items)) if end]
    n = items.shape[0]
    if n and (not ends or ends[-1] != n):
        raise ValueError(
            f"LLMCollectorRolloutFunc: expected whole episodes, the new writes end inside one ({layouts.DONE_KEY!r} "
            "False): use yield_completed_trajectories=True and MCAdvantage(grpo_size=)"
        )
    return list(zip([0, *ends[:-1]], ends))


def _ends_episode(items: TensorDictBase) -> list[bool]:
    """Whether each step ends its episode (``("next", "done")``; without it, every step)."""
    if not layouts.has_key(items, layouts.DONE_KEY):
        return [True] * items.shape[0]
    return [bool(d.all()) for d in layouts.read_column(items, layouts.DONE_KEY)]


def _hashable(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.reshape(-1).tolist())
    return value if isinstance(value, (str, int, float, tuple)) else repr(value)


def _prompts(items: TensorDictBase) -> list:
    if layouts.has_key(items, layouts.history_key("prompt")):
        return layouts.read_history(items, "prompt")
    return layouts.read_text(items, "prompt")


def _is_running(collector) -> bool:
    """Whether the collector still collects; ``CollectorError`` if it cannot be asked (a dead Ray actor)."""
    running = getattr(collector, "is_running", None)
    if not callable(running):
        return True
    try:
        return bool(running())
    except Exception as err:  # e.g. ray.exceptions.RayActorError: the actor died
        raise CollectorError(f"the collector cannot be reached: {type(err).__name__}: {err}"[:500]) from err
