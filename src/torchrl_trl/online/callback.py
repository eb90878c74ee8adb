"""``CollectorCallback``: run a TorchRL collector beside a Hugging Face / TRL trainer."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable

import torch
from transformers import TrainerCallback

from .._checks import WarnOnce, non_negative_int, positive_int, positive_seconds
from .._buffers import local_sampler
from .._threads import run_in_thread
from ..padding import check_policy_padding
from .metrics import insert_before_reporters
from .ray import is_ray_collector
from .staleness import StalenessFilter, collector_policy_version
from .weights import GenerationLock, push_weights

#: consecutive collector batches that write nothing before ``collect`` gives up
_MAX_EMPTY_BATCHES = 64

__all__ = ["CollectorCallback", "CollectorError", "collector_running", "wait_for_items"]


class CollectorError(RuntimeError):
    """The collector feeding the trainer failed (its exception is the ``__cause__``).

    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> def broken_collector():  # any iterable collector; this one fails on its first batch
    ...     raise ConnectionError("generation server down")
    ...     yield
    >>> cb = CollectorCallback(broken_collector(), replay_buffer=ReplayBuffer(storage=ListStorage(4)))
    >>> cb.collect(1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    torchrl_trl.online.callback.CollectorError: CollectorCallback: the collector raised ... ConnectionError('generation server down')
    """


def collector_running(collector, owner: str) -> bool:
    """Whether ``collector`` still collects (``True`` if it cannot say); a :class:`CollectorError`
    naming ``owner`` if it cannot be asked (a dead Ray actor)."""
    running = getattr(collector, "is_running", None)
    if not callable(running):
        return True
    try:
        return bool(running())
    except Exception as err:  # e.g. ray.exceptions.RayActorError: the actor died
        raise CollectorError(f"{owner}: the collector cannot be reached (its actor died?): {type(err).__name__}: "
                             f"{err}"[:190]) from err


def wait_for_items(
    replay_buffer, min_items: int, *, timeout: float | None, check: Callable[[], None] | None = None,
    poll: float = 0.05
) -> int:
    """Block until ``len(replay_buffer) >= min_items``; return the length (``TimeoutError`` after ``timeout`` s).

    Args:
        replay_buffer (ReplayBuffer): the buffer a producer fills (local or Ray).
        min_items (int): the length to wait for.

    Keyword Args:
        timeout (float or None): seconds to wait (``None``: no limit).
        check (callable, optional): ``check()`` runs at every poll (it raises if the producer
            died). Defaults to ``None``.
        poll (float, optional): seconds between two reads of the length. Defaults to ``0.05``.

    >>> import threading
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=ListStorage(8))
    >>> threading.Timer(0.1, rb.extend, [["a", "b", "c", "d"]]).start()  # a producer thread
    >>> wait_for_items(rb, 4, timeout=10)
    4
    >>> wait_for_items(rb, 5, timeout=0.2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TimeoutError: wait_for_items: expected at least 5 items, the replay buffer holds 4 items after waiting ...s ...
    """
    timeout = positive_seconds(timeout, "wait_for_items: timeout")
    start = time.monotonic()
    n = len(replay_buffer)
    while n < min_items:
        if check is not None:
            check()
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise TimeoutError(
                f"wait_for_items: expected at least {min_items} items, the replay buffer holds {n} items after waiting "
                f"{waited:.1f}s (timeout={timeout}s): the collector writes too slowly or not at all"
            )
        time.sleep(poll)
        n = len(replay_buffer)
    return n


class CollectorCallback(TrainerCallback):
    """Run a TorchRL collector that fills the buffer a ``TorchRLBufferDataset`` reads, beside a
    ``transformers.Trainer``: collect between optimizer steps or in the background, push the
    trainer's weights, wait for data, and raise the collector's errors as :class:`CollectorError`.

    Args:
        collector (collector): an ``LLMCollector`` (any TorchRL collector) or a ``RayLLMCollector``
            (runs remotely); a local one's pad == eos policy is refused (:func:`torchrl_trl.safe_policy_wrapper`).

    Keyword Args:
        replay_buffer (ReplayBuffer, optional): the buffer. Defaults to ``collector.replay_buffer``.
        collect_every (int, optional): collect one collector batch (``frames_per_batch`` /
            ``dialog_turns_per_batch`` items) every this many optimizer steps (synchronous
            mode). Defaults to ``1``.
        background (bool, optional): collect continuously in a background thread (local
            collectors). Defaults to ``False``.
        min_buffer_size (int, optional): ``on_train_begin`` collects or waits until the buffer
            holds this many items. Defaults to ``1``.
        wait_timeout (float or None, optional): seconds to wait for data, and the longest one
            synchronous collector batch may take (it runs in a helper thread); ``None``: no
            limit. Defaults to ``60.0``.
        update_weights_every (int, optional): push the trainer's weights (:meth:`push_weights`) every
            this many optimizer steps (``0``: never). Defaults to ``1``.
        staleness (StalenessFilter, optional): its ``consumer_version`` follows the policy
            version. Defaults to ``None``.

    Metrics are logged by a second callback, ``CollectorMetricsCallback(cb)``. Use as a context
    manager (or call :meth:`close`); the collector itself is the caller's to shut down.

    >>> from torchrl.collectors.llm import LLMCollector
    >>> from torchrl.data import LazyStackStorage, ReplayBuffer
    >>> from torchrl_trl import CollectorMetricsCallback, testing
    >>> tok = testing.make_tokenizer()
    >>> policy = testing.make_policy_wrapper(testing.make_policy(tok), tok, max_new_tokens=2)
    >>> env = testing.make_chat_env([{"query": "1+1?", "answer": "2"}], batch_size=2)
    >>> rb = ReplayBuffer(storage=LazyStackStorage(16))
    >>> collector = LLMCollector(env=env, policy=policy, dialog_turns_per_batch=2, replay_buffer=rb,
    ...                          total_dialog_turns=-1, track_policy_version=True)
    >>> with CollectorCallback(collector, min_buffer_size=2) as cb:
    ...     cb.collect(4), len(rb)              # what trainer steps do between optimizer steps
    ...     cb.push_weights(policy.model)       # the trainer's model is the policy's: version + 1
    ...     collector.policy_version, CollectorMetricsCallback(cb).metrics()["collector/write_count"]
    (4, 4)
    (1, 4)
    """

    def __init__(
        self, collector, *, replay_buffer=None, collect_every: int = 1, background: bool = False,
        min_buffer_size: int = 1, wait_timeout: float | None = 60.0, update_weights_every: int = 1,
        staleness: StalenessFilter | None = None,
    ) -> None:
        name = type(self).__name__
        self.collector = collector
        self.replay_buffer = replay_buffer if replay_buffer is not None else getattr(collector, "replay_buffer", None)
        if self.replay_buffer is None:
            raise ValueError(f"{name}: expected a replay buffer, the collector has none; build it with "
                             "replay_buffer=... (the buffer the dataset reads) or pass replay_buffer=.")
        self.remote = is_ray_collector(collector)
        if not self.remote:  # a pad == eos policy writes rows without their EOS: refused before anything trains
            check_policy_padding(getattr(collector, "policy", None), name)
        # one collector batch per collection: the collector's own batch size
        self.frames_per_step = 1 if self.remote else int(getattr(collector, "frames_per_batch", None) or 1)
        self.collect_every = positive_int(collect_every, f"{name}: collect_every")
        self.background = bool(background)
        self.min_buffer_size = non_negative_int(min_buffer_size, f"{name}: min_buffer_size")
        self.wait_timeout = positive_seconds(wait_timeout, f"{name}: wait_timeout")
        self.update_weights_every = non_negative_int(update_weights_every, f"{name}: update_weights_every")
        self.staleness = staleness

        self.weight_updates = 0
        self.collect_seconds = 0.0
        self._iter = None
        self._lock = GenerationLock()  # one collector batch, or one weight push, at a time
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._exhausted = False
        self._started_remote = False
        self._warnings = WarnOnce()
        self._hung: threading.Thread | None = None  # a sync batch that outlived wait_timeout

    def _write_count(self) -> int:
        return int(self.replay_buffer.write_count)

    def _next_batch(self) -> bool:
        """One collector batch into the buffer; ``False`` when the collector is exhausted."""
        if self._iter is None:
            self._iter = iter(self.collector)
        try:
            next(self._iter)
        except StopIteration:
            self._warnings.add("exhausted", f"CollectorCallback: the collector is exhausted (total_dialog_turns "
                               f"reached) after {self._write_count()} writes; training continues on the stored data",
                               stacklevel=4)
            self._exhausted = True
            return False
        return True

    def _next_batch_bounded(self) -> bool:
        """:meth:`_next_batch` in a helper thread, waited for at most ``wait_timeout`` s."""
        if self.wait_timeout is None:
            return self._next_batch()
        if self._hung is not None and self._hung.is_alive():
            raise TimeoutError(
                f"CollectorCallback: a previous collector batch has run past wait_timeout={self.wait_timeout}s "
                "and is still running; expected it to end (the collector is stuck)"
            )
        self._hung = None
        message = (f"CollectorCallback: one collector batch did not finish within wait_timeout={self.wait_timeout}s "
                   "(the collector blocks: a stuck environment, generation server or iterator?)")
        try:
            return run_in_thread(self._next_batch, self.wait_timeout, message, name="torchrl-trl-collect")
        except TimeoutError as err:
            self._hung = getattr(err, "thread", None)  # cannot be killed; later calls refuse at once
            raise

    def collect(self, frames: int | None = None, *, model: torch.nn.Module | None = None) -> int:
        """Collect at least ``frames`` items (default ``frames_per_step``) now, in this thread;
        returns how many were written. Collector errors (and a batch slower than ``wait_timeout``)
        raise :class:`CollectorError`. With a shared model, generation runs in eval mode."""
        frames = self.frames_per_step if frames is None else int(frames)
        start_wc, t0 = self._write_count(), time.monotonic()
        was_training = model is not None and self._shares_model(model) and model.training
        if was_training:
            model.eval()
        try:
            with self._lock.batch():
                empty_batches = 0
                while self._write_count() - start_wc < frames and not self._exhausted:
                    before = self._write_count()
                    self._next_batch_bounded()
                    # a write transform (MCAdvantage) may hold batches back, but not forever
                    empty_batches = empty_batches + 1 if self._write_count() == before else 0
                    if empty_batches >= _MAX_EMPTY_BATCHES and not self._exhausted:
                        raise RuntimeError(
                            f"CollectorCallback: {empty_batches} collector batches in a row wrote nothing into the "
                            "replay buffer watched; expected the buffer the collector writes to as replay_buffer="
                        )
        except Exception as err:
            raise CollectorError(
                f"CollectorCallback: the collector raised while collecting {frames} items "
                f"({self._write_count() - start_wc} written, {len(self.replay_buffer)} kept): {err!r}"
            ) from err
        finally:
            if was_training:
                model.train()
            self.collect_seconds += time.monotonic() - t0
        return self._write_count() - start_wc

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock.batch():
                    if not self._next_batch():
                        return
        except BaseException as err:  # handed to the trainer thread by check()
            self._error = err

    def start(self) -> None:
        """Start continuous collection: a background thread (local) or the remote collector's ``start()``."""
        if self.remote and not self._started_remote:
            self.collector.start()
            self._started_remote = True
        elif not self.remote and (self._thread is None or not self._thread.is_alive()):
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="torchrl-trl-collector", daemon=True)
            self._thread.start()

    def check(self) -> None:
        """Raise :class:`CollectorError` if the collector died (background thread raised, Ray actor gone)."""
        if self._error is not None:
            raise CollectorError(f"CollectorCallback: the background collector died: {self._error!r}; the "
                                 f"{len(self.replay_buffer)} items already stored are kept") from self._error
        if self.remote and self._started_remote and not collector_running(self.collector, "CollectorCallback"):
            raise CollectorError("CollectorCallback: expected the remote collector running, its thread ended")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop continuous collection (joins the thread up to ``timeout`` s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                warnings.warn(f"CollectorCallback: the collector thread did not stop within {timeout}s", stacklevel=2)
            self._thread = None
        if self.remote and self._started_remote:
            try:
                self.collector.async_shutdown(timeout=timeout)
            except Exception as err:  # the actor may be gone already
                warnings.warn(f"CollectorCallback: remote collector shutdown failed: {err!r}", stacklevel=2)
            self._started_remote = False

    def close(self) -> None:
        """Stop collecting (the collector is not shut down: it is the caller's)."""
        self.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _shares_model(self, model) -> bool:
        policy = getattr(self.collector, "policy", None) if not self.remote else None
        return model is not None and getattr(policy, "model", policy) is model

    @property
    def policy_version(self) -> int | None:
        """The collector's policy version (``None`` if it tracks none)."""
        return collector_policy_version(self.collector)

    def push_weights(self, model: torch.nn.Module) -> None:
        """Send ``model``'s weights to the collector's policy now, bumping its version (a policy that *is*
        ``model`` only gets its version bumped)."""
        if self._shares_model(model):
            if self.background:
                self._warnings.add("shared_model", "CollectorCallback(background=True) with a policy that shares the "
                                   "trainer's model: generation reads weights while the optimizer updates them; give "
                                   "the collector its own copy of the model for consistent rollouts")
            with self._lock.push():
                self.collector.increment_version()
        else:
            push_weights(self.collector, model, lock=self._lock.push())
        self.weight_updates += 1
        self._sync_versions()

    def _sync_versions(self) -> None:
        version = self.policy_version
        if version is None:
            return
        if self.staleness is not None:
            self.staleness.consumer_version = version
        sampler = local_sampler(self.replay_buffer)
        if sampler is not None and hasattr(sampler, "consumer_version"):
            sampler.consumer_version = version

    def attach(self, trainer) -> CollectorCallback:
        """Add this callback to ``trainer`` before its reporting integrations. Returns ``self``."""
        return insert_before_reporters(trainer, self)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._sync_versions()
        if self.background or self.remote:
            self.start()
            wait_for_items(self.replay_buffer, self.min_buffer_size, timeout=self.wait_timeout, check=self.check)
        else:
            missing = self.min_buffer_size - len(self.replay_buffer)
            if missing > 0:
                self.collect(missing, model=model)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        try:
            self.check()
        except CollectorError:
            self.stop()
            raise
        step = state.global_step
        if self.update_weights_every and step % self.update_weights_every == 0 and model is not None:
            self.push_weights(model)
        if not (self.background or self.remote) and step % self.collect_every == 0:
            self.collect(model=model)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        return control
