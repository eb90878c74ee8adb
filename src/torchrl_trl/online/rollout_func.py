"""TorchRL as the rollout engine of TRL's ``GRPOTrainer`` (``rollout_func=``).

Log-probs (raw logits', NaN: unknown): ``logprobs="rescore"`` recomputes them on the exact
sequence (one more forward), ``"generate"`` keeps TorchRL's with each first token NaN, ``"auto"``
rescores where TRL reads them (no trainer, vLLM correction, ``off_policy_mask_threshold``,
``reads_rollout_logprobs``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from tensordict.utils import NestedKey

from .. import layouts
from .._checks import WarnOnce, positive_int
from ..padding import check_policy_padding, safe_policy_wrapper
from .behaviour import ResponseScorer, trl_corrects_logprobs
from .episodes import GROUP_ID_KEY, TURN_KEY, VERSION_KEY, RolloutBatch, forward_fields, per_sample, rollout_batch, turns_to_trl
from .prompt_primer import check_history_batch, columns_td, context_columns, env_query
from .weights import load_weights

__all__ = ["TorchRLRolloutFunc", "RolloutBatch"]


class TorchRLRolloutFunc:
    """A TRL ``GRPOTrainer`` ``rollout_func`` that generates with TorchRL:
    ``f(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", "env_mask", **extra}``,
    one completion per prompt received, in order (TRL repeats each prompt ``num_generations`` times).

    Args:
        policy (TransformersWrapper, optional): a TorchRL ``TransformersWrapper`` (``generate=True``,
            ``return_log_probs=True``, ``input_mode`` ``"text"`` or ``"history"``) whose padding
            loses no token: build it with
            :func:`torchrl_trl.safe_policy_wrapper` (a pad == eos policy is refused with a
            ``ValueError``, :func:`torchrl_trl.check_policy_padding`). ``None``: built that way on
            the first call around the trainer's model and tokenizer (a copy with a pad token of its
            own where its pad is the EOS) with TRL's generation settings (``max_completion_length``,
            sampling, its EOS ids, ``GRPOConfig.generation_kwargs`` last). Defaults to ``None``.

    Keyword Args:
        env (ChatEnv, optional): a TorchRL ``ChatEnv`` in the policy's input mode, given the
            prompts as ``"query"`` at reset in chunks of its batch size. Defaults to ``None``:
            one generation per prompt.
        max_turns (int, optional): most turns per episode with ``env`` (a chunk's samples end
            together). Defaults to ``1``.
        context_fn (callable, optional): ``fn(prompts) -> {column: list}``, columns added to the
            env's reset. Defaults to ``None``.
        forward_keys (sequence of NestedKey, optional): top-level rollout keys passed to TRL's
            reward functions; the env's reward, summed over turns, goes as ``"torchrl_reward"``.
            Defaults to ``None`` (every non-TorchRL key).
        replay_buffer (ReplayBuffer, optional): extended with every sample's every turn, tagged
            ``"group_id"``, ``"policy_version"`` and ``"turn"``. Defaults to ``None``.
        logprobs (str, optional): ``"auto"``, ``"rescore"`` or ``"generate"``, see the module
            doc. Defaults to ``"auto"``.
        sync_weights (str, callable or None, optional): when the trainer's ``global_step``
            changed and ``policy`` does not share its parameters: ``"copy"`` loads them into
            ``policy.model``, a callable ``fn(trainer_model, version)`` transfers them, ``None``
            does nothing. Defaults to ``"copy"``.

    Attributes:
        policy_version: the trainer's ``global_step`` when the weights last generated.
        calls, samples: counters.

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
    """

    def __init__(
        self, policy=None, *, env=None, max_turns: int = 1,
        context_fn: Callable[[list], dict[str, Sequence[Any]]] | None = None,
        forward_keys: Sequence[NestedKey] | None = None, replay_buffer=None,
        logprobs: Literal["auto", "rescore", "generate"] = "auto",
        sync_weights: Literal["copy"] | Callable | None = "copy",
    ):
        if logprobs not in ("auto", "rescore", "generate"):
            raise ValueError(f"TorchRLRolloutFunc: logprobs must be 'auto', 'rescore' or 'generate', got {logprobs!r}")
        if sync_weights not in ("copy", None) and not callable(sync_weights):
            raise ValueError(
                f"TorchRLRolloutFunc: sync_weights must be 'copy', a callable or None, got {sync_weights!r}"
            )
        max_turns = positive_int(max_turns, "TorchRLRolloutFunc: max_turns")
        if env is None and max_turns != 1:
            raise ValueError(
                "TorchRLRolloutFunc: max_turns > 1 needs an env (a ChatEnv) to produce the next turn's prompt"
            )
        if policy is not None:
            _check_policy(policy)
        self.policy = policy
        self.env = env
        self.max_turns = max_turns
        self.context_fn = context_fn
        self.forward_keys = None if forward_keys is None else list(forward_keys)
        self.replay_buffer = replay_buffer
        self.logprobs = logprobs
        self.sync_weights = sync_weights
        self.policy_version = -1
        self.calls = 0
        self.samples = 0
        self.__name__ = type(self).__name__
        self._scorer = None
        self._next_group = 0
        self._lock = threading.Lock()
        self._warnings = WarnOnce()

    def __call__(self, prompts: list, trainer=None) -> RolloutBatch:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(
                f"TorchRLRolloutFunc: prompts must be a non-empty list, got {type(prompts).__name__} {prompts!r:.60}"
            )
        with self._lock:
            policy = self._policy_for(trainer, prompts)
            group_size = _group_size(trainer, len(prompts))
            version = self._sync(trainer, policy)
            self.calls += 1
            return self.rollout(prompts, group_size=group_size, version=version, logprobs=self._logprobs_mode(trainer))

    def rollout(
        self, prompts: list, *, group_size: int, version: int, logprobs: Literal["rescore", "generate"] | None = None
    ) -> RolloutBatch:
        """Generate one completion per prompt with the weights as they are, tag the rollouts with
        ``version`` and their group (``group_size`` consecutive prompts), write them into the
        replay buffer, and return TRL's dict (``logprobs=None``: the constructor's)."""
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
        batch = rollout_batch(rows, forward_fields(steps, self.forward_keys), steps)
        self._annotate(steps, group_size, version)
        if self.replay_buffer is not None:
            for step in steps:
                self.replay_buffer.extend(step)
        self.samples += len(prompts)
        return batch

    def _logprobs_mode(self, trainer) -> str:
        if self.logprobs != "auto":
            return self.logprobs
        return "rescore" if _reads_logprobs(trainer) else "generate"

    def _policy_for(self, trainer, prompts: list):
        if self.policy is not None:
            return self.policy
        if trainer is None:
            raise ValueError(
                "TorchRLRolloutFunc: policy=None builds the policy from the trainer: expected a trainer, got none"
            )
        from ..rewards.trl_funcs import is_conversational

        chat = is_conversational(prompts)
        if self.env is not None:
            input_mode = self.env.input_mode
        else:
            input_mode = "history" if chat else "text"
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
        context = context_columns(self.context_fn, prompts, "TorchRLRolloutFunc")
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


def _reads_logprobs(trainer) -> bool:
    """Whether ``trainer`` may read the log-probs a ``rollout_func`` returns (no trainer: yes)."""
    return trainer is None or bool(
        trl_corrects_logprobs(trainer) or getattr(trainer, "off_policy_mask_threshold", None) is not None
        or getattr(trainer, "reads_rollout_logprobs", False)
    )


def _check_policy(policy) -> None:
    if not getattr(policy, "generate", False):
        raise ValueError("TorchRLRolloutFunc: expected a generating policy (TransformersWrapper(..., generate=True))")
    if not getattr(policy, "return_log_probs", False):
        raise ValueError(
            "TorchRLRolloutFunc: expected a policy returning log-probs (TransformersWrapper(..., "
            "return_log_probs=True))"
        )
    if getattr(policy, "num_samples", None) not in (None, 1):
        raise ValueError(
            f"TorchRLRolloutFunc: expected policy.num_samples=1 (TRL repeats each prompt num_generations times), got "
            f"{policy.num_samples}"
        )
    mode = getattr(policy, "input_mode", None)
    if mode not in ("text", "history"):
        raise ValueError(f"TorchRLRolloutFunc: policy.input_mode must be 'text' or 'history', got {mode!r}")
    check_policy_padding(policy, "TorchRLRolloutFunc")


def _group_size(trainer, n: int, expected: int | None = None, owner: str = "TorchRLRolloutFunc") -> int:
    """TRL's group size (``num_generations[_eval]``), checked to divide ``n`` and to equal ``expected``;
    errors start with ``owner``."""
    if trainer is None:
        return n if expected is None else expected
    training = getattr(trainer.model, "training", True)
    g = trainer.num_generations if training else getattr(trainer, "num_generations_eval", trainer.num_generations)
    if expected is not None and g != expected:
        raise ValueError(f"{owner}: expected the trainer's num_generations ({g}) to be the collector's group_size "
                         f"({expected})")
    if n % g:
        raise ValueError(f"{owner}: got {n} prompts, not a multiple of group_size={g}")
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
