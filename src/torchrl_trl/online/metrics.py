"""``CollectorMetricsCallback``: the collector's numbers (buffer size, throughput, policy version,
staleness) in the trainer's logs."""

from __future__ import annotations

import time

from transformers import TrainerCallback

from .staleness import VERSION_KEYS, StalenessFilter, collector_policy_version, read_policy_version

__all__ = ["CollectorMetricsCallback", "insert_before_reporters"]

#: how many of the newest stored items ``staleness/buffer_*`` reads
_STALENESS_WINDOW = 4096


def insert_before_reporters(trainer, callback):
    """Add ``callback`` to ``trainer`` after its flow callback, before the reporting integrations. Returns it."""
    callbacks = trainer.callback_handler.callbacks
    callbacks.insert(min(1, len(callbacks)), callback)
    return callback


class CollectorMetricsCallback(TrainerCallback):
    """Adds the collector's metrics to every trainer log (``logs`` and ``state.log_history``).

    Args:
        collection (CollectorCallback, optional): the
            :class:`~torchrl_trl.online.callback.CollectorCallback` running the collector (the
            defaults below are its own). Defaults to ``None``: pass ``replay_buffer=``.

    Keyword Args:
        replay_buffer (ReplayBuffer, optional): the buffer to measure. Defaults to ``None``:
            ``collection.replay_buffer``.
        collector (collector, optional): read for ``policy_version``. Defaults to ``None``:
            ``collection.collector``.
        staleness (StalenessFilter, optional): whose counters are logged. Defaults to ``None``:
            ``collection.staleness``.
        log_buffer_staleness (bool, optional): log mean/max staleness of (up to 4096 of) the
            newest stored items. Defaults to ``True``.
        log_prefix (str, optional): prefix of the collector metrics. Defaults to ``"collector/"``.

    Logged: ``<prefix>buffer_size``, ``<prefix>write_count``, ``<prefix>frames_per_sec`` (since
    the previous step's log), ``<prefix>policy_version``; with a ``collection`` also
    ``<prefix>collect_seconds`` and ``<prefix>weight_updates``; the :class:`StalenessFilter`'s
    ``staleness/*``; with ``log_buffer_staleness`` and a policy version,
    ``staleness/buffer_mean`` and ``staleness/buffer_max``.

    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=ListStorage(8))
    >>> metrics = CollectorMetricsCallback(replay_buffer=rb)
    >>> _ = rb.extend(["a", "b", "c"])  # a collector writes 3 items
    >>> m = metrics.metrics(step=1)
    >>> m["collector/buffer_size"], m["collector/write_count"], m["collector/frames_per_sec"] > 0
    (3, 3, True)
    >>> metrics.metrics(step=1)["collector/frames_per_sec"] == m["collector/frames_per_sec"]
    True
    """

    def __init__(
        self, collection=None, *, replay_buffer=None, collector=None, staleness: StalenessFilter | None = None,
        log_buffer_staleness: bool = True, log_prefix: str = "collector/"
    ) -> None:
        if replay_buffer is None and collection is None:
            raise ValueError("CollectorMetricsCallback: expected the CollectorCallback it reports on, or "
                             "replay_buffer= (the buffer the collector writes)")
        self.collection = collection
        self.replay_buffer = replay_buffer if replay_buffer is not None else collection.replay_buffer
        self.collector = collector if collector is not None else getattr(collection, "collector", None)
        self.staleness = staleness if staleness is not None else getattr(collection, "staleness", None)
        self.log_buffer_staleness = bool(log_buffer_staleness)
        self.log_prefix = log_prefix
        self._restart_at_first_step = False
        self.restart_window()

    def restart_window(self) -> None:
        """Measure throughput from now on (e.g. after the initial fill, before step 1)."""
        # the window: (time, write_count) where it starts; the step and rate of the last one closed
        self._window_start = (time.monotonic(), int(self.replay_buffer.write_count))
        self._window_step: int | None = None
        self._window_rate = 0.0

    def _frames_per_sec(self, step: int | None, write_count: int) -> float:
        if step is not None and step == self._window_step:
            return self._window_rate  # same step logged again: same window, same value
        now = time.monotonic()
        t_prev, wc_prev = self._window_start
        rate = (write_count - wc_prev) / max(now - t_prev, 1e-9)
        self._window_start, self._window_step, self._window_rate = (now, write_count), step, rate
        return rate

    def metrics(self, step: int | None = None) -> dict[str, float]:
        """The metrics for the log at global step ``step`` (a new ``step`` closes the throughput window)."""
        p = self.log_prefix
        wc = int(self.replay_buffer.write_count)
        out: dict[str, float] = {f"{p}buffer_size": len(self.replay_buffer), f"{p}write_count": wc,
                                 f"{p}frames_per_sec": self._frames_per_sec(step, wc)}
        if self.collection is not None:
            out[f"{p}collect_seconds"] = self.collection.collect_seconds
            out[f"{p}weight_updates"] = self.collection.weight_updates
        version = collector_policy_version(self.collector)
        if version is not None:
            out[f"{p}policy_version"] = version
        if self.staleness is not None:
            out.update(self.staleness.stats())
        if self.log_buffer_staleness and version is not None:
            out.update(self._buffer_staleness(version))
        return out

    def _buffer_staleness(self, version: int) -> dict[str, float]:
        n = len(self.replay_buffer)
        if not n:
            return {}
        try:
            versions = read_policy_version(self.replay_buffer[max(0, n - _STALENESS_WINDOW) : n], VERSION_KEYS)
        except KeyError:  # rollouts without a version: nothing to report
            return {}
        stale = (version - versions).clamp_min(0).float()
        return {"staleness/buffer_mean": float(stale.mean()), "staleness/buffer_max": float(stale.max())}

    def attach(self, trainer) -> CollectorMetricsCallback:
        """Add this callback to ``trainer`` before its reporting integrations. Returns ``self``."""
        return insert_before_reporters(trainer, self)

    def on_train_begin(self, args, state, control, **kwargs):
        self._restart_at_first_step = True
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        # throughput from the first step on, not the initial fill (other callbacks' on_train_begin)
        if self._restart_at_first_step:
            self._restart_at_first_step = False
            self.restart_window()
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = self.metrics(step=state.global_step)
        if logs is not None:
            logs.update(metrics)
        # Trainer.log appends a copy of ``logs`` to log_history before on_log runs
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)
        return control
