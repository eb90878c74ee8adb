"""Async GRPO through ``GRPOTrainer``: a TorchRL generator thread runs ahead of the trainer.

- :class:`AsyncGroupCollector`: a background thread that keeps generating complete GRPO
  groups (``group_size`` completions of one prompt) with a :class:`TorchRLRolloutFunc` (its
  policy holds its *own* copy of the weights), tags each with the policy version that
  generated it, keeps up to ``max_pending_groups`` of them, and writes every rollout into the
  rollout func's TorchRL replay buffer (nothing generated is lost, stale or not).
- :class:`AsyncTorchRLRolloutFunc`: the ``rollout_func`` to give ``GRPOTrainer``. On each
  call it pushes the trainer's weights to the collector when the trainer's ``global_step``
  (the policy version) changed, then takes whole groups whose age
  ``global_step - group_version`` is at most ``max_staleness``; older groups are dropped and
  counted. A collector that died raises :class:`~torchrl_trl.online.CollectorError` at the next
  wait (polled every ``poll_s``), a collector that produces nothing within ``timeout`` too.

Off-policy correction: the behaviour log-probs the collector recorded are returned as
``logprobs``; TRL applies them only with ``use_vllm=True`` (importance-sampling
correction) or through ``off_policy_mask_threshold`` (sequence masking), see
:mod:`torchrl_trl.online.rollout_func`. Without either, a stale group is trained as if it
were on-policy (TRL's ratio is exactly 1). :class:`BehaviourLogProbsMixin` is the smallest
hook that fixes it: mixed into ``GRPOTrainer`` it overrides the public ``compute_loss`` to
make the behaviour log-probs TRL's ``old_per_token_logps``, so the clipped ratio
``pi_theta / mu`` of TRL's own loss corrects stale samples (as PPO does).
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence


from .._checks import positive_int
from .callback import CollectorError
from .group_rollouts import GroupReplay, GroupRolloutFunc, RolloutGroup, split_groups, take_fresh
from .rollout_func import TorchRLRolloutFunc
from .weights import GenerationLock, load_weights

__all__ = ["AsyncGroupCollector", "AsyncTorchRLRolloutFunc", "GroupReplay", "RolloutGroup"]


class AsyncGroupCollector:
    """Generate complete GRPO groups in a background thread.

    Args:
        rollout: a :class:`TorchRLRolloutFunc` with a policy whose model is *not* the
            trainer's (the trainer updates its weights while this thread generates); its
            replay buffer, if any, receives every rollout.
        prompts: the prompt source: a sequence (cycled forever) or an iterator (the
            collector stops when it ends), each item a TRL prompt (text or messages).

    Keyword Args:
        group_size: completions per prompt (``GRPOConfig.num_generations``).
        prompts_per_batch: prompts generated together (one policy call of
            ``prompts_per_batch * group_size`` sequences).
        max_pending_groups: the thread waits while this many groups are unconsumed.

    Example:

    >>> from torchrl_trl.online import TorchRLRolloutFunc
    >>> from torchrl_trl.testing import make_policy, make_policy_wrapper, make_tokenizer
    >>> tok = make_tokenizer()
    >>> policy = make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3)  # its own weights
    >>> collector = AsyncGroupCollector(TorchRLRolloutFunc(policy), [[{"role": "user", "content": "hi"}]],
    ...                                 group_size=2, max_pending_groups=2)
    >>> collector.start()
    >>> (group,) = collector.get_groups(1, consumer_version=0, max_staleness=0, timeout=60)
    >>> collector.stop()
    >>> group.version, group.prompt, len(group.batch["completion_ids"])
    (0, [{'role': 'user', 'content': 'hi'}], 2)
    """

    def __init__(
        self,
        rollout: TorchRLRolloutFunc,
        prompts: Sequence | Iterable,
        *,
        group_size: int,
        prompts_per_batch: int = 1,
        max_pending_groups: int = 8,
    ):
        group_size = positive_int(group_size, "group_size")
        prompts_per_batch = positive_int(prompts_per_batch, "prompts_per_batch")
        max_pending_groups = positive_int(max_pending_groups, "max_pending_groups")
        if not isinstance(rollout, TorchRLRolloutFunc) or rollout.policy is None:
            raise ValueError("rollout must be a TorchRLRolloutFunc with a policy")
        self.rollout = rollout
        self._prompts = itertools.cycle(prompts) if isinstance(prompts, Sequence) else iter(prompts)
        if isinstance(prompts, Sequence) and not prompts:
            raise ValueError("prompts is empty")
        self.group_size = group_size
        self.prompts_per_batch = prompts_per_batch
        self.max_pending_groups = max_pending_groups
        self.policy_version = 0
        self.produced_groups = 0
        self.consumed_groups = 0
        self.dropped_stale_groups = 0
        self.dropped_filtered_groups = 0
        self.wait_s = 0.0
        self._pending: deque[RolloutGroup] = deque()
        self._cond = threading.Condition()
        self._weights_lock = GenerationLock()  # held while generating and while loading weights
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._exhausted = False

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="torchrl-grpo-collector", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the thread to stop after its current batch and wait for it."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                warnings.warn(f"the collector thread did not stop within {timeout} s", stacklevel=2)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    # -- weights -----------------------------------------------------------------------

    def update_policy_weights_(self, weights=None, *, version: int) -> None:
        """Load ``weights`` (an ``nn.Module``, a ``state_dict`` or ``(name, tensor)`` pairs,
        see :func:`~torchrl_trl.online.weights.load_weights`; ``None``: keep the weights)
        into the collector's policy between two generations, and make ``version`` the
        version of every group generated from now on."""
        with self._weights_lock.push():
            if weights is not None:
                load_weights(self.rollout.policy.model, weights)
            self.policy_version = int(version)

    def pause(self) -> None:
        """Block generation (after the batch in flight) until :meth:`resume`."""
        self._weights_lock.pause()

    def resume(self, *, version: int | None = None) -> None:
        """Let generation go on, with ``version`` as the policy version if given."""
        if version is not None:
            self.policy_version = int(version)
        self._weights_lock.resume()

    def load_named_weights(self, named_tensors) -> int:
        """Copy ``(name, tensor)`` pairs into the policy's tensors of those names (call
        between :meth:`pause` and :meth:`resume`). Returns how many were loaded."""
        return load_weights(self.rollout.policy.model, named_tensors)

    # -- producer ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    while len(self._pending) >= self.max_pending_groups and not self._stop.is_set():
                        self._cond.wait(0.1)
                if self._stop.is_set():
                    return
                prompts = list(itertools.islice(self._prompts, self.prompts_per_batch))
                if not prompts:
                    self._exhausted = True
                    return
                repeated = [p for p in prompts for _ in range(self.group_size)]
                with self._weights_lock.batch():
                    version = self.policy_version
                    batch = self.rollout.rollout(repeated, group_size=self.group_size, version=version)
                groups = [RolloutGroup(version, p, b) for p, b in zip(prompts, split_groups(batch, self.group_size))]
                with self._cond:
                    self._pending.extend(groups)
                    self.produced_groups += len(groups)
                    self._cond.notify_all()
        except BaseException as err:  # surfaced to the consumer
            self._error = err
            with self._cond:
                self._cond.notify_all()

    # -- consumer ----------------------------------------------------------------------

    def get_groups(
        self,
        n: int,
        *,
        consumer_version: int,
        max_staleness: int | None,
        timeout: float = 60.0,
        poll_s: float = 0.1,
        keep: Callable[[RolloutGroup], bool] | None = None,
        wait: bool = True,
    ) -> list[RolloutGroup]:
        """Take ``n`` whole groups, oldest first, dropping (and counting) those with
        ``consumer_version - version > max_staleness`` (:attr:`dropped_stale_groups`) and
        those ``keep`` rejects (:attr:`dropped_filtered_groups`). ``wait=False``: only the
        groups ready now (possibly fewer than ``n``, none waited for).

        Raises:
            CollectorError: the thread died (its exception is the cause), the prompt source
                ended, or fewer than ``n`` fresh groups came within ``timeout`` seconds.
        """
        out: list[RolloutGroup] = []
        start = time.monotonic()
        with self._cond:
            while True:
                taken, stale, filtered = take_fresh(
                    self._pending, n - len(out), consumer_version=consumer_version,
                    max_staleness=max_staleness, keep=keep,
                )
                out += taken
                self.dropped_stale_groups += stale
                self.dropped_filtered_groups += filtered
                self._cond.notify_all()
                if len(out) == n:
                    break
                if self._error is not None:
                    raise CollectorError(f"the collector thread died: {self._error!r}") from self._error
                if not wait:
                    break
                if self._exhausted:
                    raise CollectorError(f"the prompt source ended; got {len(out)} of {n} groups")
                if self._thread is None or not self._thread.is_alive():
                    raise CollectorError("the collector thread is not running (call start())")
                if timeout is not None and time.monotonic() - start > timeout:
                    raise CollectorError(
                        f"only {len(out)} of {n} groups within max_staleness={max_staleness} after "
                        f"{timeout} s ({self.produced_groups} produced, {self.dropped_stale_groups} dropped stale)"
                    )
                self._cond.wait(poll_s)
        self.wait_s += time.monotonic() - start
        self.consumed_groups += len(out)
        return out


class AsyncTorchRLRolloutFunc(GroupRolloutFunc):
    """``GRPOTrainer(rollout_func=...)`` that drains an :class:`AsyncGroupCollector`.

    Args:
        collector: the background collector (started on the first call).

    Keyword Args:
        max_staleness, timeout, push_weights, drop_zero_std, reuse: see
            :class:`~torchrl_trl.online.group_rollouts.GroupRolloutFunc`; a group's age is
            the trainer's ``global_step`` minus the version it was generated with, and
            ``push_weights`` copies the trainer model's weights into the collector's policy
            (:meth:`AsyncGroupCollector.update_policy_weights_`). Groups ``drop_zero_std``
            rejects are counted in ``collector.dropped_filtered_groups``.

    Attributes: those of :class:`~torchrl_trl.online.group_rollouts.GroupRolloutFunc`.

    Example (``trainer`` stands in for ``GRPOTrainer``: only the attributes shown are read):

    >>> from types import SimpleNamespace
    >>> from torchrl_trl.online import AsyncGroupCollector, TorchRLRolloutFunc
    >>> from torchrl_trl.testing import make_policy, make_policy_wrapper, make_tokenizer
    >>> tok = make_tokenizer()
    >>> chat = [{"role": "user", "content": "hi"}]
    >>> collector = AsyncGroupCollector(
    ...     TorchRLRolloutFunc(make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3)), [chat], group_size=2)
    >>> trainer = SimpleNamespace(num_generations=2, model=make_policy(tok), state=SimpleNamespace(global_step=0),
    ...                           accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    >>> with AsyncTorchRLRolloutFunc(collector, max_staleness=1) as func:
    ...     batch = func([chat, chat], trainer)  # pushes the trainer's weights, starts the collector
    >>> batch["torchrl_prompt"] == [chat, chat], batch["staleness"], collector.alive
    (True, [0, 0], False)
    """

    def __init__(
        self,
        collector: AsyncGroupCollector,
        *,
        max_staleness: int | None = 1,
        timeout: float = 60.0,
        push_weights: bool = True,
        drop_zero_std: bool = False,
        reuse: int = 0,
    ):
        super().__init__(
            max_staleness=max_staleness, timeout=timeout, push_weights=push_weights,
            drop_zero_std=drop_zero_std, reuse=reuse,
        )
        self.collector = collector
        self.group_size = collector.group_size

    def _sync(self, trainer) -> int:
        collector = self.collector
        version = int(trainer.state.global_step)
        trainer_model = trainer.accelerator.unwrap_model(trainer.model)
        if collector.rollout.policy.model is trainer_model:
            raise ValueError(
                "the collector's policy wraps the trainer's model object: the background thread would "
                "generate with weights the optimizer is writing; give the collector its own copy"
            )
        if version != collector.policy_version or not collector.alive:
            collector.update_policy_weights_(trainer_model if self.push_weights else None, version=version)
        collector.start()
        return version

    def next_groups(self, n: int, *, version: int | None = None, wait: bool = True, keep=None) -> list[RolloutGroup]:
        version = self.collector.policy_version if version is None else version
        return self.collector.get_groups(
            n, consumer_version=version, max_staleness=self.max_staleness, timeout=self.timeout, keep=keep, wait=wait
        )

    def start(self) -> None:
        self.collector.start()

    def send_named_weights(self, named_tensors) -> None:
        collector, version = self.collector, None
        collector.pause()
        try:
            collector.load_named_weights(named_tensors)
            version = collector.policy_version + 1
        finally:
            collector.resume(version=version)

    @property
    def tokenizer(self):
        return self.collector.rollout.policy.tokenizer

    def close(self) -> None:
        self.collector.stop()
