"""TorchRL as the rollout engine of TRL's ``GRPOTrainer`` (``rollout_func=``): one function,
rollouts from a pluggable source.

* ``source=None``: generated on each call from TRL's prompts by a TorchRL policy (the
  trainer's own model, on-policy), optionally through a ``ChatEnv`` over several turns.
* ``source=`` a TorchRL ``LLMCollector`` (its own thread) or ``RayLLMCollector`` (an actor): whole
  groups it generated ahead (:mod:`~torchrl_trl.online.collector_source`); weights pushed to it.

Log-probs (raw logits', NaN: unknown): ``logprobs="rescore"`` recomputes them on the exact
sequence (one more forward), ``"generate"`` keeps TorchRL's with each first token NaN, ``"auto"``
rescores where TRL reads them (no trainer, vLLM correction, ``off_policy_mask_threshold``,
``reads_rollout_logprobs``). A collector records them with ``BehaviourLogProbsPostproc``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from tensordict.utils import NestedKey

from .. import layouts
from .._checks import WarnOnce, config_or_default, non_negative_int, positive_int, positive_seconds
from ..padding import check_policy_padding, safe_policy_wrapper
from .collector_source import CollectorGroups, GroupReplay, concat_groups, has_reward_spread
from .episodes import (
    GROUP_ID_KEY, TURN_KEY, VERSION_KEY, BehaviourLogProbsPostproc, ResponseScorer, RolloutBatch,
    check_history_batch, columns_td, context_columns, env_query, forward_fields, per_sample, rollout_batch,
    trl_corrects_logprobs, turns_to_trl,
)
from .staleness import check_max_staleness
from .weights import load_weights

__all__ = ["RolloutBatch", "RolloutOptions", "TorchRLRolloutFunc"]

#: extra fields of every row taken from a collector (reward functions get them)
PROMPT_FIELD, STALENESS_FIELD, REUSE_FIELD = "torchrl_prompt", "staleness", "reuse"


@dataclass(frozen=True)
class RolloutOptions:
    """The less common settings of :class:`TorchRLRolloutFunc`; all but the first two apply to a
    collector source only (a setting that does not apply is a ``ValueError``).

    Args:
        context_fn (callable, optional): ``fn(prompts) -> {column: list}``, columns added to the
            env's reset (``source=None``). Defaults to ``None``.
        forward_keys (sequence of NestedKey, optional): top-level rollout keys passed to TRL's
            reward functions; the env's reward, summed over turns, goes as ``"torchrl_reward"``.
            Defaults to ``None`` (every non-TorchRL key).
        group_size (int, optional): completions per prompt. Defaults to ``None``: ``num_generations``.
        max_staleness (int or None, optional): largest accepted age of a group (the collector's policy
            version minus the group's); older ones are dropped, counted. ``None``: any. Defaults to ``1``.
        reuse (int, optional): train on each collected group up to ``1 + reuse`` times (fresh
            groups waited for only for what is missing). Defaults to ``0``.
        drop_zero_std (bool, optional): drop (and count) groups whose env reward is the same for
            every completion (GRPO advantages all 0). Defaults to ``False``.
        timeout (float or None, optional): seconds to wait for a collector's groups (or its batch
            in flight, before a push). Defaults to ``120.0``.
        max_pending_groups (int, optional): an in-process collector waits before writing a batch
            until its groups and those not yet taken are at most this many. Defaults to ``None``.

    >>> RolloutOptions(reuse=-1)
    Traceback (most recent call last):
    ValueError: RolloutOptions: reuse must be an integer >= 0, got -1
    """

    context_fn: Callable[[list], dict[str, Sequence[Any]]] | None = None
    forward_keys: Sequence[NestedKey] | None = None
    group_size: int | None = None
    max_staleness: int | None = 1
    reuse: int = 0
    drop_zero_std: bool = False
    timeout: float | None = 120.0
    max_pending_groups: int | None = None

    def __post_init__(self):
        positive_int(self.group_size, "RolloutOptions: group_size", allow_none=True)
        check_max_staleness(self.max_staleness, "RolloutOptions")
        non_negative_int(self.reuse, "RolloutOptions: reuse")
        positive_seconds(self.timeout, "RolloutOptions: timeout")
        positive_int(self.max_pending_groups, "RolloutOptions: max_pending_groups", allow_none=True)


_DEFAULTS = RolloutOptions()
_COLLECTOR_OPTIONS = ("group_size", "max_staleness", "reuse", "drop_zero_std", "timeout", "max_pending_groups")


class TorchRLRolloutFunc:
    """A TRL ``GRPOTrainer`` ``rollout_func`` whose rollouts TorchRL makes:
    ``f(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", "env_mask", **fields}``,
    one completion per prompt received, in order (TRL repeats each prompt ``num_generations`` times).

    Args:
        policy (TransformersWrapper, optional): with ``source=None``, the generating TorchRL
            ``TransformersWrapper`` (``generate=True``, ``return_log_probs=True``, ``input_mode``
            ``"text"`` or ``"history"``), built with :func:`torchrl_trl.safe_policy_wrapper` (a pad
            == eos policy is refused). ``None``: built that way on the first call around the
            trainer's model and tokenizer, with TRL's generation settings. Defaults to ``None``.

    Keyword Args:
        source (LLMCollector or RayLLMCollector, optional): where rollouts come from.
            ``None``: generated on each call from TRL's prompts (on-policy). A TorchRL collector
            built with ``replay_buffer=`` and ``track_policy_version=True``, with a policy of its
            own weights (multi-turn: ``yield_completed_trajectories=True``; exact log-probs:
            ``postproc=BehaviourLogProbsPostproc(policy)``; from TRL prompts:
            :func:`~torchrl_trl.online.make_prompt_collector`): whole groups it generated ahead,
            taken as :class:`RolloutOptions` says; rows then carry ``"torchrl_prompt"`` (reward
            functions must read it, not TRL's ``prompts``), ``"staleness"`` and ``"reuse"``.
            Started on the first call. Defaults to ``None``.
        env (ChatEnv, optional): with ``source=None``, a TorchRL ``ChatEnv`` in the policy's input
            mode, given the prompts as ``"query"`` at reset in chunks of its batch size.
            Defaults to ``None``: one generation per prompt.
        max_turns (int, optional): most turns per episode with ``env`` (a chunk's samples end
            together). Defaults to ``1``.
        replay_buffer (ReplayBuffer, optional): ``source=None``: extended with every sample's every
            turn, tagged ``"group_id"``, ``"policy_version"`` and ``"turn"``. With a collector: the
            buffer it writes into. Defaults to ``None`` (with a collector: ``source.replay_buffer``).
        logprobs (str, optional): ``"auto"``, ``"rescore"`` or ``"generate"``, see the module doc.
            Defaults to ``"auto"``.
        sync_weights (str, callable or None, optional): when the trainer's ``global_step`` changed:
            ``"copy"`` loads the trainer's weights into ``policy.model`` (where it does not share
            them) or pushes them to the collector (``update_policy_weights_``, between two of its
            batches); a callable ``fn(trainer_model, global_step)`` transfers them itself (and, with a
            collector, advances its ``PolicyVersion``); ``None`` does nothing. Defaults to ``"copy"``.
        options (RolloutOptions, optional): env columns, forwarded keys and how a collector's
            groups are taken. Defaults to ``None``: ``RolloutOptions()``.

    Attributes:
        policy_version: the version of the weights that generated last (``source=None``: the
            trainer's ``global_step``; a collector: its ``PolicyVersion``, + 1 per weight push).
        calls, samples, consumed_staleness, consumed_reuse: counters; the last two list the age
            and prior uses of every collected group returned.
        groups (CollectorGroups): with a collector, its reader and counters; else ``None``.

    Example (without a trainer: one completion per prompt received, as TRL calls it):

    >>> from torchrl.data import LazyStackStorage, ReplayBuffer
    >>> from torchrl_trl.testing import make_policy, make_policy_wrapper, make_tokenizer
    >>> tok = make_tokenizer()
    >>> rb = ReplayBuffer(storage=LazyStackStorage(16))
    >>> func = TorchRLRolloutFunc(make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3), replay_buffer=rb)
    >>> out = func([[{"role": "user", "content": "hi"}]] * 2)  # TRL repeats each prompt
    >>> sorted(out), len(out["completion_ids"])
    (['completion_ids', 'logprobs', 'prompt_ids'], 2)
    >>> [len(lp) for lp in out["logprobs"]] == [len(c) for c in out["completion_ids"]]
    True
    >>> len(rb), rb[0]["group_id"].item(), rb[1]["group_id"].item()  # one group of 2 stored
    (2, 0, 0)

    From a collector running ahead: see :func:`~torchrl_trl.online.make_prompt_collector`.
    """

    def __init__(
        self, policy=None, *, source=None, env=None, max_turns: int = 1, replay_buffer=None,
        logprobs: Literal["auto", "rescore", "generate"] = "auto",
        sync_weights: Literal["copy"] | Callable | None = "copy", options: RolloutOptions | None = None,
    ):
        if logprobs not in ("auto", "rescore", "generate"):
            raise ValueError(f"TorchRLRolloutFunc: logprobs must be 'auto', 'rescore' or 'generate', got {logprobs!r}")
        if sync_weights not in ("copy", None) and not callable(sync_weights):
            raise ValueError(
                f"TorchRLRolloutFunc: sync_weights must be 'copy', a callable or None, got {sync_weights!r}"
            )
        self.options = options = config_or_default(options, RolloutOptions, "options", "TorchRLRolloutFunc")
        if positive_int(max_turns, "TorchRLRolloutFunc: max_turns") != 1 and env is None:
            raise ValueError("TorchRLRolloutFunc: max_turns > 1 needs an env (a ChatEnv) to make the next prompt")
        fields = _COLLECTOR_OPTIONS if source is None else ("context_fn",)
        if ignored := [f for f in fields if getattr(options, f) != getattr(_DEFAULTS, f)]:
            where = ("without a collector source" if source is None
                     else "with a collector (make_prompt_collector takes it)")
            raise ValueError(f"TorchRLRolloutFunc: RolloutOptions {ignored} do not apply {where}")
        self.groups: CollectorGroups | None = None
        if source is not None:
            if policy is not None or env is not None:
                raise ValueError("TorchRLRolloutFunc: with a source, expected policy=None and env=None (the "
                                 "collector has its own policy and env)")
            replay_buffer = replay_buffer if replay_buffer is not None else getattr(source, "replay_buffer", None)
            if replay_buffer is None:
                raise ValueError("TorchRLRolloutFunc: expected the source collector built with replay_buffer=, or "
                                 "replay_buffer= the buffer it writes into")
            self.groups = CollectorGroups(
                source, replay_buffer, group_size=options.group_size,
                max_staleness=options.max_staleness, timeout=options.timeout,
                max_pending_groups=options.max_pending_groups, forward_keys=options.forward_keys,
            )
        elif policy is not None:
            _check_policy(policy)
        self.policy, self.env, self.max_turns, self.replay_buffer = policy, env, max_turns, replay_buffer
        self.logprobs, self.sync_weights = logprobs, sync_weights
        self.replay = GroupReplay(options.reuse, options.max_staleness)
        self.policy_version, self.calls, self.samples = -1, 0, 0
        self.consumed_staleness: list[int] = []
        self.consumed_reuse: list[int] = []
        self.__name__ = type(self).__name__
        self._scorer = None
        self._next_group = 0
        self._synced_step: int | None = None
        self._lock = threading.Lock()
        self._warnings = WarnOnce()

    def __call__(self, prompts: list, trainer=None) -> RolloutBatch:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(
                f"TorchRLRolloutFunc: prompts must be a non-empty list, got {type(prompts).__name__} {prompts!r:.60}"
            )
        with self._lock:
            self.calls += 1
            if self.groups is not None:
                return self._collected(prompts, trainer)
            policy = self._policy_for(trainer, prompts)
            group_size = _group_size(trainer, len(prompts))
            version = self._sync(trainer, policy)
            return self.rollout(prompts, group_size=group_size, version=version, logprobs=self._logprobs_mode(trainer))

    def _collected(self, prompts: list, trainer) -> RolloutBatch:
        """TRL's batch from the collector's groups: fresh ones ready now, reused ones, then fresh ones waited for."""
        groups = self.groups
        g = groups.group_size = _group_size(trainer, len(prompts), groups.group_size)
        version = self._sync_collector(trainer)
        n = len(prompts) // g
        keep = has_reward_spread if self.options.drop_zero_std else None
        fresh = groups.next_groups(n, version=version, wait=False, keep=keep) if self.replay.reuse else []
        reused = self.replay.draw(n - len(fresh), consumer_version=version)
        if len(fresh) + len(reused) < n:
            fresh += groups.next_groups(n - len(fresh) - len(reused), version=version, keep=keep)
        self.replay.add(fresh)
        chosen = [(group, 0) for group in fresh] + reused
        batch = concat_groups([group.batch for group, _ in chosen])
        batch[PROMPT_FIELD] = [group.prompt for group, _ in chosen for _ in range(g)]
        staleness = [version - group.version for group, _ in chosen]
        batch[STALENESS_FIELD] = [s for s in staleness for _ in range(g)]
        batch[REUSE_FIELD] = [uses for _, uses in chosen for _ in range(g)]
        self.consumed_staleness.extend(staleness)
        self.consumed_reuse.extend(uses for _, uses in chosen)
        self.samples += len(prompts)
        mismatches = sum(a != b for a, b in zip(prompts, batch[PROMPT_FIELD]))
        self._warnings.add("prompt_mismatch", f"{mismatches} of TRL's {len(prompts)} prompts are not the prompts the "
                           f"collector generated for: reward functions must read {PROMPT_FIELD!r} (and env columns), "
                           "not 'prompts'", n=mismatches, stacklevel=4)
        return batch

    def _sync_collector(self, trainer) -> int:
        """Push the trainer's weights when ``global_step`` changed, start the collector; return its policy version."""
        groups, pushed = self.groups, None
        if trainer is not None:
            step = int(trainer.state.global_step)
            model = trainer.accelerator.unwrap_model(trainer.model)
            collector = groups.collector
            if groups.in_process and getattr(collector.policy, "model", None) is model:
                raise ValueError(
                    "TorchRLRolloutFunc: expected the collector's policy to hold its own copy of the model, it wraps "
                    "the trainer's (generation would read weights the optimizer writes)"
                )
            postproc = getattr(collector, "postproc", None)
            if not groups.started and isinstance(postproc, BehaviourLogProbsPostproc) \
                    and self._logprobs_mode(trainer) == "generate":
                collector.postproc = None  # TRL will not read them: no scoring pass per batch
            if step != self._synced_step:
                if self.sync_weights == "copy":
                    pushed = groups.push(model)  # may still be landing in a Ray actor
                elif callable(self.sync_weights):
                    self.sync_weights(model, step)
                self._synced_step = step
        groups.start()
        self.policy_version = groups.policy_version if pushed is None else pushed
        return self.policy_version

    @property
    def prompt_mismatches(self) -> int:
        """How many of TRL's prompts differed from the collected groups' prompts, over all calls."""
        return self._warnings.counts["prompt_mismatch"]

    def close(self) -> None:
        """Stop a collector source (nothing to do without one)."""
        if self.groups is not None:
            self.groups.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def rollout(
        self, prompts: list, *, group_size: int, version: int, logprobs: Literal["rescore", "generate"] | None = None
    ) -> RolloutBatch:
        """Generate one completion per prompt with the weights as they are, tag the rollouts with
        ``version`` and their group (``group_size`` consecutive prompts), write them into the
        replay buffer, and return TRL's dict (``logprobs=None``: the constructor's)."""
        if self.groups is not None:
            raise ValueError("TorchRLRolloutFunc: rollout() generates inline; with a source, call the function")
        if self.policy is None:
            raise ValueError(
                "TorchRLRolloutFunc: expected a policy: pass one, or call the function once with the trainer"
            )
        if len(prompts) % group_size:
            raise ValueError(
                f"TorchRLRolloutFunc: got {len(prompts)} prompts, not a multiple of group_size={group_size}"
            )
        if self.env is None:
            steps = [per_sample(self.policy(_policy_input(self.policy, prompts)))]
        else:
            steps = self._run_env(self.policy, prompts)
        rows = turns_to_trl(steps)
        if (logprobs or self._logprobs_mode(trainer=None)) == "rescore":  # no trainer: "auto" rescores
            if self._scorer is None or self._scorer.model is not self.policy.model:
                self._scorer = ResponseScorer(self.policy)
            rows["logprobs"] = self._scorer(rows["prompt_ids"], rows["completion_ids"])
        batch = rollout_batch({**rows, **forward_fields(steps, self.options.forward_keys)}, steps)
        self._annotate(steps, group_size, version)
        if self.replay_buffer is not None:
            for step in steps:
                self.replay_buffer.extend(step)
        self.samples += len(prompts)
        return batch

    def _logprobs_mode(self, trainer) -> str:
        """``self.logprobs``; for ``"auto"``, whether ``trainer`` may read the log-probs (no trainer: yes)."""
        if self.logprobs != "auto":
            return self.logprobs
        reads = trainer is None or trl_corrects_logprobs(trainer) or getattr(trainer, "reads_rollout_logprobs", False) \
            or getattr(trainer, "off_policy_mask_threshold", None) is not None
        return "rescore" if reads else "generate"

    def _policy_for(self, trainer, prompts: list):
        if self.policy is not None:
            return self.policy
        if trainer is None:
            raise ValueError(
                "TorchRLRolloutFunc: policy=None builds the policy from the trainer: expected a trainer, got none"
            )
        from ..rewards.trl_funcs import is_conversational

        chat = is_conversational(prompts)
        input_mode = self.env.input_mode if self.env is not None else "history" if chat else "text"
        model = trainer.accelerator.unwrap_model(trainer.model)
        generate_kwargs = {"max_new_tokens": trainer.max_completion_length, "do_sample": True,
                           "temperature": trainer.temperature}
        # TRL's "disabled" values (top_k=0, top_p=1, ...) are left out: TorchRL rejects top_k=0
        for name, off in {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}.items():
            if getattr(trainer, name, None) not in (None, off):
                generate_kwargs[name] = getattr(trainer, name)
        if getattr(trainer, "eos_token_ids", None):  # TRL stops at the tokenizer's EOS and the model's
            generate_kwargs["eos_token_id"] = list(trainer.eos_token_ids)
        # GRPOConfig.generation_kwargs override these, as in TRL's own generation (do_sample=False: greedy, where
        # transformers ignores the trainer's sampling settings and TorchRL refuses them)
        extra = getattr(getattr(trainer, "args", None), "generation_kwargs", None) or {}
        if extra.get("do_sample") is False:
            for name in ("temperature", "top_p", "top_k", "min_p"):
                generate_kwargs.pop(name, None)
        generate_kwargs.update(extra)
        # a copy of the trainer's tokenizer with a pad token of its own where its pad is the EOS (TRL sets pad = eos
        # when there is none): TorchRL would take every EOS for padding, and drop it from completion_ids
        self.policy = safe_policy_wrapper(
            model, trainer.processing_class, input_mode=input_mode, generate=True, return_log_probs=True,
            pad_output=False, generate_kwargs=generate_kwargs,
        )
        return self.policy

    def _sync(self, trainer, policy) -> int:
        """Bring ``policy``'s weights to the trainer's and return their version."""
        if trainer is None:
            self.policy_version = max(self.policy_version, 0)
            return self.policy_version
        step = int(trainer.state.global_step)
        if step != self.policy_version:
            model = trainer.accelerator.unwrap_model(trainer.model)
            if policy.model is not model and self.sync_weights == "copy":
                load_weights(policy.model, model)
            elif policy.model is not model and callable(self.sync_weights):
                self.sync_weights(model, step)
            self.policy_version = step
        temperature = getattr(trainer, "temperature", 1.0)
        if temperature != 1.0:
            self._warnings.add("temperature", f"trainer.temperature={temperature}: TorchRL's log-probs are those of "
                               "the raw logits (temperature 1), TRL's recomputed ones use logits / temperature; "
                               "they differ", stacklevel=4)
        return self.policy_version

    def _run_env(self, policy, prompts: list) -> list[TensorDictBase]:
        env = self.env
        chunk = env.batch_size.numel()
        if len(prompts) % chunk:
            raise ValueError(
                f"TorchRLRolloutFunc: expected a multiple of {chunk} prompts (the env's batch "
                f"{tuple(env.batch_size)}), got {len(prompts)} (TRL's generation batch)"
            )
        context = context_columns(self.options.context_fn, prompts, "TorchRLRolloutFunc")
        per_chunk = [
            self._episode(policy, prompts[i : i + chunk], {k: list(v[i : i + chunk]) for k, v in context.items()})
            for i in range(0, len(prompts), chunk)
        ]
        n_turns = {len(c) for c in per_chunk}
        if len(n_turns) != 1:
            raise ValueError(
                f"TorchRLRolloutFunc: expected the env chunks' episodes to end at one turn, got {n_turns} turns"
            )
        return [lazy_stack([s for c in per_chunk for s in c[t].tensordicts]) for t in range(n_turns.pop())]

    def _episode(self, policy, prompts: list, columns: dict) -> list[TensorDictBase]:
        env = self.env
        if env.input_mode == "history":
            check_history_batch(prompts, "TorchRLRolloutFunc")
        reset = TensorDict({"query": env_query(prompts)}, batch_size=env.batch_size)
        td = env.reset(reset.update(columns_td(columns, env.batch_size)))
        steps = []
        for turn in range(self.max_turns):
            td = policy(td)
            if turn == self.max_turns - 1:
                step = env.step(td)
            else:
                step, td = env.step_and_maybe_reset(td)
            steps.append(per_sample(step))
            done = steps[-1].get(layouts.DONE_KEY).reshape(-1)
            if done.all():
                break
            if done.any():
                raise ValueError(
                    "TorchRLRolloutFunc: expected an env batch's episodes to end at one turn (e.g. "
                    f"StepCounter(max_steps=k)), turn {turn}: {int(done.sum())} of {done.numel()} ended"
                )
        return steps

    def _annotate(self, steps: list[TensorDictBase], group_size: int, version: int) -> None:
        n = steps[0].batch_size[0]
        groups = [self._next_group + i // group_size for i in range(n)]
        self._next_group += -(-n // group_size)
        for turn, step in enumerate(steps):
            for group, sample in zip(groups, step.tensordicts):
                sample.update({GROUP_ID_KEY: torch.tensor(group), VERSION_KEY: torch.tensor(version),
                               TURN_KEY: torch.tensor(turn)})


def _check_policy(policy) -> None:
    if not getattr(policy, "generate", False):
        raise ValueError("TorchRLRolloutFunc: expected a generating policy (TransformersWrapper(..., generate=True))")
    if not getattr(policy, "return_log_probs", False):
        raise ValueError("TorchRLRolloutFunc: expected a policy returning log-probs (return_log_probs=True)")
    if getattr(policy, "num_samples", None) not in (None, 1):
        raise ValueError(f"TorchRLRolloutFunc: expected policy.num_samples=1 (TRL repeats each prompt "
                         f"num_generations times), got {policy.num_samples}")
    mode = getattr(policy, "input_mode", None)
    if mode not in ("text", "history"):
        raise ValueError(f"TorchRLRolloutFunc: policy.input_mode must be 'text' or 'history', got {mode!r}")
    check_policy_padding(policy, "TorchRLRolloutFunc")


def _group_size(trainer, n: int, expected: int | None = None) -> int:
    """TRL's group size (``num_generations[_eval]``), checked to divide ``n`` and to equal ``expected``."""
    if trainer is None:
        return n if expected is None else expected
    training = getattr(trainer.model, "training", True)
    g = trainer.num_generations if training else getattr(trainer, "num_generations_eval", trainer.num_generations)
    if expected is not None and g != expected:
        raise ValueError(f"TorchRLRolloutFunc: expected the trainer's num_generations ({g}) to be the collector's "
                         f"group_size ({expected})")
    if n % g:
        raise ValueError(f"TorchRLRolloutFunc: got {n} prompts, not a multiple of group_size={g}")
    return g


def _policy_input(policy, prompts: list) -> TensorDictBase:
    from ..rewards.trl_funcs import is_conversational

    chat = is_conversational(prompts)
    if policy.input_mode == "history":
        if not chat:
            raise ValueError(
                "TorchRLRolloutFunc: the policy reads chat history (input_mode='history') but TRL's prompts are "
                "plain text; expected conversational prompts or a policy with input_mode='text'"
            )
        check_history_batch(prompts, "TorchRLRolloutFunc")
        return TensorDict({"history": {"prompt": env_query(prompts)}}, batch_size=[len(prompts)])
    if chat:
        tok = policy.tokenizer
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    else:
        texts = [str(p) for p in prompts]
    return TensorDict({"text": {"prompt": texts}}, batch_size=[len(prompts)])
