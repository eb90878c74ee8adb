"""The TRL trainers' side: :class:`BehaviourLogProbsMixin` for ``GRPOTrainer``, and TorchRL as the
rollout worker and weight sink of ``trl.experimental.async_grpo.AsyncGRPOTrainer``.

``AsyncGRPOTrainer`` needs CUDA: on CPU these are tested against TRL's worker and weight-transfer protocols.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from .._checks import positive_int
from ..rewards.functions import RewardFunctionWrapper
from .collector_source import CollectorGroups, RolloutGroup
from .episodes import trl_corrects_logprobs
from .rollout_func import TorchRLRolloutFunc
from .weights import weights_td

__all__ = ["BehaviourLogProbsMixin", "TorchRLRolloutWorker", "TorchRLWeightTransfer"]


class BehaviourLogProbsMixin:
    """Mix into ``GRPOTrainer`` (``class Trainer(BehaviourLogProbsMixin, GRPOTrainer)``) so TRL's
    loss uses the rollout func's log-probs as ``old_per_token_logps`` (ratio ``pi_theta / mu``), unless
    TRL corrects them itself (``use_vllm`` with ``vllm_importance_sampling_correction``). NaN behaviour
    log-probs raise ``ValueError`` on trained tokens and are set to 0 on masked ones.

    Example (``Base`` stands in for ``GRPOTrainer``, whose loss then reads the old log-probs):

    >>> import torch
    >>> class Base:
    ...     def compute_loss(self, model, inputs):
    ...         return inputs["old_per_token_logps"]
    >>> class Trainer(BehaviourLogProbsMixin, Base):
    ...     pass
    >>> inputs = {"sampling_per_token_logps": torch.tensor([[-0.5, -1.0, float("nan")]]),
    ...           "completion_mask": torch.tensor([[1, 1, 0]])}
    >>> Trainer().compute_loss(None, inputs)  # the behaviour log-probs; NaN on a masked token -> 0
    tensor([[-0.5000, -1.0000,  0.0000]])
    """

    #: tells ``TorchRLRolloutFunc(logprobs="auto")`` to return exact log-probs
    reads_rollout_logprobs = True

    def compute_loss(self, model, inputs, *args, **kwargs):
        behaviour = inputs.get("sampling_per_token_logps")
        if behaviour is not None and not trl_corrects_logprobs(self):
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            unknown = torch.isnan(behaviour)
            if (unknown & mask.bool()).any():
                raise ValueError(
                    "BehaviourLogProbsMixin: expected behaviour log-probs on trained tokens, sampling_per_token_logps "
                    "holds NaN; use TorchRLRolloutFunc(logprobs='rescore')"
                )
            inputs["old_per_token_logps"] = behaviour.masked_fill(unknown, 0.0)
        return super().compute_loss(model, inputs, *args, **kwargs)


class TorchRLRolloutWorker:
    """``AsyncGRPOTrainer(rollout_worker=...)`` backed by a TorchRL collector: a pump thread
    scores each group, computes TRL's group advantages (``(r - mean) / (std + 1e-8)``; 0 for
    a completion no function scored) and puts one ``RolloutSample`` per completion on
    :attr:`rollout_buffer` (``completion_mask`` 0 on the prompt and env tokens).

    Args:
        rollout_func (TorchRLRolloutFunc): one with a collector ``source`` and
            ``RolloutOptions(group_size=...)``; ``max_staleness=None`` leaves staleness to
            ``AsyncGRPOTrainer`` (each sample carries its ``model_version``).
        reward_funcs (sequence of callables): TRL-style ``f(prompts, completions, completion_ids,
            **fields) -> list``, scored by one :class:`~torchrl_trl.RewardFunctionWrapper` (:attr:`scorer`).

    Keyword Args:
        reward_weights (sequence of float, optional): one float per function, as in ``GRPOConfig``.
            Defaults to ``None`` (all ones).
        queue_maxsize (int, optional): bound of :attr:`rollout_buffer` (the pump waits when it
            is full). Defaults to ``1024``.

    Example:

    >>> from torchrl_trl.online import RolloutOptions, TorchRLRolloutFunc, make_prompt_collector
    >>> from torchrl_trl.testing import make_policy, make_policy_wrapper, make_tokenizer
    >>> tok = make_tokenizer()
    >>> policy = make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3)
    >>> collector = make_prompt_collector(policy, [[{"role": "user", "content": "hi"}]], group_size=2)
    >>> func = TorchRLRolloutFunc(source=collector, options=RolloutOptions(group_size=2, max_staleness=None,
    ...                                                                    max_pending_groups=1))
    >>> def length(completions, **kwargs):
    ...     return [float(len(c[0]["content"])) for c in completions]
    >>> worker = TorchRLRolloutWorker(func, [length], queue_maxsize=2)
    >>> worker.start()
    >>> a, b = worker.rollout_buffer.get(timeout=60), worker.rollout_buffer.get(timeout=60)  # one group
    >>> worker.stop()
    >>> a.group_id == b.group_id, a.model_version, len(a.input_ids) == len(a.completion_mask) == len(a.old_log_probs)
    (True, 0, True)
    >>> round(a.advantage + b.advantage, 6)  # (r - mean) / (std + 1e-8) within the group
    0.0
    """

    def __init__(
        self, rollout_func: TorchRLRolloutFunc, reward_funcs: Sequence[Callable], *,
        reward_weights: Sequence[float] | None = None, queue_maxsize: int = 1024,
    ):
        if not reward_funcs:
            raise ValueError(
                "TorchRLRolloutWorker: expected reward functions (the worker scores every group it sends), got none"
            )
        self.rollout_func = rollout_func
        self.source = _collector_groups(rollout_func, type(self).__name__)
        self.reward_funcs = list(reward_funcs)
        self.scorer = RewardFunctionWrapper(self.reward_funcs, weights=reward_weights)
        maxsize = positive_int(queue_maxsize, "TorchRLRolloutWorker: queue_maxsize")
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=maxsize)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._heartbeat = time.time()
        self._group_ids = 0

    def start(self) -> None:
        if self._thread is not None:
            return
        self.source.start()
        self._heartbeat = time.time()
        self._thread = threading.Thread(target=self._pump, name="torchrl-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.source.close()
        if self._thread is not None:
            self._thread.join(30)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)
        if self.source.in_process and self.source.policy_version != self.model_version:
            self.source.push(None, version=self.model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise ``RuntimeError`` if the pump died or nothing moved for ``stale_after_s`` seconds."""
        if self._error is not None:
            raise RuntimeError(
                f"TorchRLRolloutWorker: the TorchRL rollout worker failed: {self._error!r}"
            ) from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("TorchRLRolloutWorker: expected the rollout worker thread running, it exited")
        age = time.time() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(
                f"TorchRLRolloutWorker: expected progress within {stale_after_s:.0f} s, none for {age:.0f} s"
            )

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                (group,) = self.source.next_groups(1, version=self.source.policy_version)
                for sample in self.to_samples(group):
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=0.1)
                            break
                        except queue.Full:
                            self._heartbeat = time.time()  # waiting on the trainer is not a hang
                self._heartbeat = time.time()
        except BaseException as err:
            if not self._stop.is_set():
                self._error = err

    def to_samples(self, group: RolloutGroup) -> list:
        """Score one group and turn it into TRL ``RolloutSample`` rows."""
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        batch = group.batch
        n = len(batch["completion_ids"])
        texts = self.source.collector.policy.tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
        chat = isinstance(group.prompt, list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        fields = {k: v for k, v in batch.items() if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        prompts = [group.prompt] * n
        rewards, per_func = self.scorer.score_arguments(prompts, completions, batch["completion_ids"], **fields)
        rewards, per_func = rewards.double().numpy(), per_func.T.double().numpy()
        scored = rewards[~np.isnan(rewards)]  # NaN: no function could score it, advantage 0
        advantages = np.nan_to_num((rewards - scored.mean()) / (scored.std() + 1e-8)) if scored.size else np.zeros(n)
        group_id, self._group_ids = self._group_ids, self._group_ids + 1
        samples = []
        for i, (prompt_ids, completion_ids) in enumerate(zip(batch["prompt_ids"], batch["completion_ids"])):
            env_mask = batch["env_mask"][i] if "env_mask" in batch else [1] * len(completion_ids)
            logprobs = np.nan_to_num(np.asarray(batch["logprobs"][i], dtype=np.float32), nan=0.0)
            metrics = {"reward": float(rewards[i])}
            metrics.update({f"rewards/{name}": float(per_func[j, i]) for j, name in enumerate(self.scorer.names)})
            samples.append(RolloutSample(
                prompt=group.prompt, completion=completions[i],
                input_ids=np.asarray(list(prompt_ids) + list(completion_ids), dtype=np.int64),
                completion_mask=np.asarray([0] * len(prompt_ids) + list(env_mask), dtype=np.int64),
                old_log_probs=np.concatenate([np.zeros(len(prompt_ids), dtype=np.float32), logprobs]),
                advantage=float(advantages[i]), model_version=group.version, group_id=group_id, metrics=metrics,
            ))
        return samples


class TorchRLWeightTransfer:
    """``AsyncGRPOTrainer(weight_transfer=...)`` loading the trainer's ``(name, tensor)`` stream
    into the collector's policy between two of its batches, its policy version + 1.

    Args:
        rollout_func (TorchRLRolloutFunc): the rollouts' source, as :class:`TorchRLRolloutWorker`'s.

    Example (the calls ``AsyncGRPOTrainer`` makes at a weight sync):

    >>> import torch
    >>> from torchrl_trl.online import TorchRLRolloutFunc, make_prompt_collector
    >>> from torchrl_trl.testing import make_policy, make_policy_wrapper, make_tokenizer
    >>> tok = make_tokenizer()
    >>> policy = make_policy_wrapper(make_policy(tok, seed=0), tok)
    >>> collector = make_prompt_collector(policy, [[{"role": "user", "content": "hi"}]], group_size=2)
    >>> trained = make_policy(tok, seed=1)
    >>> transfer = TorchRLWeightTransfer(TorchRLRolloutFunc(source=collector))
    >>> transfer.pause()
    >>> transfer.send_weights(trained.named_parameters())
    >>> transfer.resume()
    >>> same = all(torch.equal(a, b) for a, b in zip(policy.model.parameters(), trained.parameters()))
    >>> collector.policy_version, same
    (1, True)
    """

    def __init__(self, rollout_func: TorchRLRolloutFunc):
        self.rollout_func = rollout_func
        self.source = _collector_groups(rollout_func, type(self).__name__)
        self.transfers = 0
        self.loaded = 0

    def init_weight_transfer(self) -> None:
        """Nothing to do (nor in :meth:`pause`, :meth:`resume`, :meth:`destroy`): :meth:`send_weights` waits
        for a batch boundary."""

    pause = resume = destroy = init_weight_transfer

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        named = list(iterator)
        self.source.push(weights_td(named))
        self.loaded = len(named)
        self.transfers += 1


def _collector_groups(rollout_func, owner: str) -> CollectorGroups:
    """The collector reader of ``rollout_func``; a ``TypeError`` naming ``owner`` for anything else."""
    if not isinstance(rollout_func, TorchRLRolloutFunc):
        raise TypeError(f"{owner}: expected a TorchRLRolloutFunc with a collector source, got "
                        f"{type(rollout_func).__name__}")
    if rollout_func.groups is None:
        raise TypeError(f"{owner}: expected a TorchRLRolloutFunc with a collector source, got one with source=None")
    return rollout_func.groups
