"""TorchRL as the rollout engine of TRL's ``GRPOTrainer`` (``rollout_func=``).

:class:`TorchRLRolloutFunc` is a TRL ``rollout_func`` backed by a TorchRL LLM policy
(``TransformersWrapper``) and, optionally, a TorchRL ``ChatEnv`` with its transforms
(reward parsers, tools, several turns). Every rollout can be written into a TorchRL
replay buffer, one item per sample and turn, as ``LLMCollector`` writes them.

The contract with TRL's ``GRPOTrainer`` (each point checked in ``tests/test_rollout_func.py``):

- **Prompts arrive repeated**: TRL's sampler repeats each prompt ``num_generations`` times in
  a row and passes that batch as is, so the function returns exactly one completion per
  prompt it receives, in order (TRL groups rewards by consecutive blocks).
- **Keys**: ``prompt_ids``, ``completion_ids``, ``logprobs`` are required; ``env_mask`` is
  the tool mask (the loss mask is ``completion_mask * env_mask``); every other key that is a
  list is merged into each input row and so reaches every reward function as a keyword.
- **Log-probs** become TRL's sampling log-probs (NaN: unknown). They enter the loss only
  through the vLLM importance-sampling correction (``use_vllm``) or
  ``off_policy_mask_threshold``; otherwise TRL recomputes its own.
- TRL scores prompts padded on the left and completions on the right without
  ``position_ids``; with RoPE models that equals scoring each sequence alone.

On the TorchRL side:

- ``TransformersWrapper(generate=True, return_log_probs=True)`` writes ``0.0`` as the
  log-prob of the *first* generated token. ``logprobs="rescore"`` recomputes them with
  TorchRL's own scoring path (:class:`~torchrl_trl.online.behaviour.ResponseScorer`) on the
  exact sequence, right after generation: one more forward pass (about 40% of a rollout on
  a 25M-parameter policy). ``"generate"`` keeps the generated values with that first one
  NaN. ``"auto"`` (default) rescores only where the log-probs are read: without a trainer
  (rollouts that may train later), or a trainer that reads them (see above, or
  ``reads_rollout_logprobs = True`` as ``BehaviourLogProbsMixin`` sets).
- The log-probs are those of the raw logits (temperature 1): equal to TRL's recomputation
  when ``temperature == 1`` (a warning is given otherwise).
- ``ChatEnv`` in history mode re-renders the chat each turn; turn ``k + 1``'s prompt tokens
  must start with turn ``k``'s prompt + response, else the sequence TRL trains on would not
  be what the policy generated: that raises, it is never patched silently.
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
from .behaviour import ResponseScorer
from .episodes import GROUP_ID_KEY, TURN_KEY, VERSION_KEY, RolloutBatch, forward_fields, per_sample, rollout_batch, turns_to_trl
from .prompt_primer import check_history_batch, columns_td, env_query
from .weights import load_weights

__all__ = ["TorchRLRolloutFunc", "RolloutBatch", "TRL_ROLLOUT_KEYS"]

#: Keys TRL's ``GRPOTrainer`` requires from a ``rollout_func``.
TRL_ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")


class TorchRLRolloutFunc:
    """A TRL ``GRPOTrainer`` ``rollout_func`` that generates with TorchRL.

    ``f(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", "env_mask", **extra}``,
    one completion per prompt received (TRL repeats each prompt ``num_generations`` times).

    Args:
        policy: a TorchRL ``TransformersWrapper`` (``generate=True``, ``return_log_probs=True``,
            ``input_mode`` ``"text"`` or ``"history"``). ``None``: built on the first call
            around the trainer's own model and tokenizer (shared parameters, on-policy), with
            TRL's generation settings (``max_completion_length``, ``temperature``, ``top_p``,
            ``top_k``, ``min_p``, ``repetition_penalty``).

    Keyword Args:
        env: a TorchRL ``ChatEnv`` (a ``TransformedEnv`` over one, e.g. with a reward parser
            or a ``StepCounter(max_steps=k)`` for ``k`` turns), in the policy's input mode.
            The prompts are given to it in chunks of its batch size as ``"query"`` at reset;
            ``len(prompts)`` must be a multiple of that size. ``None``: one generation per
            prompt, no env.
        max_turns: most turns per episode with ``env`` (the env's ``done`` ends it earlier;
            all samples of a chunk must end at the same turn).
        context_fn: ``fn(prompts) -> {column: list}``, columns added to the env's reset
            TensorDict (e.g. the ``"answer"`` a reward parser reads; TRL gives a
            ``rollout_func`` the prompts only).
        forward_keys: top-level rollout keys to pass to TRL's reward functions (read from
            each sample's last turn). ``None``: every non-TorchRL top-level key (e.g.
            ``"answer"``). The env's reward ``("next", "reward")``, summed over turns, is
            always passed as ``"torchrl_reward"`` when present.
        replay_buffer: a TorchRL ``ReplayBuffer``; each sample's every turn is extended into
            it as one item, with ``"group_id"`` (consecutive ``num_generations`` samples share
            it), ``"policy_version"`` and ``"turn"``.
        logprobs: ``"auto"`` (default), ``"rescore"`` or ``"generate"``, see the module doc.
        sync_weights: when the trainer's ``global_step`` changed and ``policy`` does not
            share the trainer's parameters: ``"copy"`` loads the trainer model's ``state_dict``
            into ``policy.model``; a callable ``fn(trainer_model, version)`` does the transfer
            itself (e.g. through a TorchRL collector's ``update_policy_weights_``); ``None``
            never touches the weights.

    Attributes:
        policy_version: the trainer's ``global_step`` when the weights last generated.
        calls, samples: counters.

    Example (without a trainer: one completion per prompt received, as TRL calls it):

    >>> import torch
    >>> from torchrl.data import LazyStackStorage, ReplayBuffer
    >>> from torchrl_trl.testing import make_policy, make_policy_wrapper, make_tokenizer
    >>> tok = make_tokenizer()
    >>> rb = ReplayBuffer(storage=LazyStackStorage(16))
    >>> func = TorchRLRolloutFunc(make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3), replay_buffer=rb)
    >>> _ = torch.manual_seed(0)
    >>> out = func([[{"role": "user", "content": "hi"}]] * 2)  # TRL repeats each prompt
    >>> sorted(out), len(out["completion_ids"])
    (['completion_ids', 'logprobs', 'prompt_ids'], 2)
    >>> [len(lp) for lp in out["logprobs"]] == [len(c) for c in out["completion_ids"]]
    True
    >>> len(rb), rb[0]["group_id"].item(), rb[1]["group_id"].item()  # one group of 2 stored
    (2, 0, 0)
    """

    def __init__(
        self,
        policy=None,
        *,
        env=None,
        max_turns: int = 1,
        context_fn: Callable[[list], dict[str, Sequence[Any]]] | None = None,
        forward_keys: Sequence[NestedKey] | None = None,
        replay_buffer=None,
        logprobs: Literal["auto", "rescore", "generate"] = "auto",
        sync_weights: Literal["copy"] | Callable | None = "copy",
    ):
        if logprobs not in ("auto", "rescore", "generate"):
            raise ValueError(f"logprobs must be 'auto', 'rescore' or 'generate', got {logprobs!r}")
        if sync_weights not in ("copy", None) and not callable(sync_weights):
            raise ValueError(f"sync_weights must be 'copy', a callable or None, got {sync_weights!r}")
        max_turns = positive_int(max_turns, "max_turns")
        if env is None and max_turns != 1:
            raise ValueError("max_turns > 1 needs an env (a ChatEnv) to produce the next turn's prompt")
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

    # -- TRL entry point ---------------------------------------------------------------

    def __call__(self, prompts: list, trainer=None) -> RolloutBatch:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a non-empty list, got {type(prompts).__name__} {prompts!r:.80}")
        with self._lock:
            policy = self._policy_for(trainer, prompts)
            group_size = _group_size(trainer, len(prompts))
            version = self._sync(trainer, policy)
            self.calls += 1
            logprobs = self.logprobs
            if logprobs == "auto":
                logprobs = "rescore" if _reads_logprobs(trainer) else "generate"
            return self.rollout(prompts, group_size=group_size, version=version, logprobs=logprobs)

    def rollout(
        self, prompts: list, *, group_size: int, version: int, logprobs: Literal["rescore", "generate"] | None = None
    ) -> RolloutBatch:
        """Generate one completion per prompt with :attr:`policy` (and :attr:`env`), tag
        the rollouts with ``version`` and their group (``group_size`` consecutive prompts),
        write them into the replay buffer, and return TRL's dict. The weights are used as
        they are. ``logprobs``: ``"rescore"`` or ``"generate"`` for this call; ``None``: the
        constructor's, ``"auto"`` then rescoring (no trainer here to say it will not read
        them)."""
        if self.policy is None:
            raise ValueError("no policy yet: pass one, or call the function once with the trainer")
        if len(prompts) % group_size:
            raise ValueError(f"got {len(prompts)} prompts, not a multiple of group_size={group_size}")
        if self.env is None:
            steps = [self._generate(self.policy, prompts)]
        else:
            steps = self._run_env(self.policy, prompts)
        if logprobs is None:
            logprobs = "rescore" if self.logprobs == "auto" else self.logprobs
        batch = self._to_trl(self.policy, steps, logprobs)
        self._annotate(steps, group_size, version)
        if self.replay_buffer is not None:
            for step in steps:
                self.replay_buffer.extend(step)
        self.samples += len(prompts)
        return batch

    # -- weights -----------------------------------------------------------------------

    def _policy_for(self, trainer, prompts: list):
        if self.policy is not None:
            return self.policy
        if trainer is None:
            raise ValueError("policy=None builds the policy from the trainer, but no trainer was passed")
        from torchrl.modules.llm import TransformersWrapper

        from ..rewards.trl_funcs import is_conversational

        if self.env is not None:
            input_mode = self.env.input_mode
        else:
            input_mode = "history" if is_conversational(prompts) else "text"
        model = trainer.accelerator.unwrap_model(trainer.model)
        generate_kwargs = {
            "max_new_tokens": trainer.max_completion_length,
            "do_sample": True,
            "temperature": trainer.temperature,
        }
        # TRL's "disabled" values (top_k=0, top_p=1, ...) are left out: TorchRL rejects top_k=0
        disabled = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
        for name, off in disabled.items():
            value = getattr(trainer, name, None)
            if value is not None and value != off:
                generate_kwargs[name] = value
        self.policy = TransformersWrapper(
            model,
            tokenizer=trainer.processing_class,
            input_mode=input_mode,
            generate=True,
            return_log_probs=True,
            pad_output=False,
            generate_kwargs=generate_kwargs,
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
            self._warnings.add(
                "temperature",
                f"trainer.temperature={temperature}: TorchRL's log-probs are those of the raw logits "
                "(temperature 1), TRL's recomputed ones use logits / temperature; they differ",
                stacklevel=4,
            )
        return self.policy_version

    # -- generation --------------------------------------------------------------------

    def _generate(self, policy, prompts: list) -> TensorDictBase:
        td = _policy_input(policy, prompts)
        return per_sample(policy(td))

    def _run_env(self, policy, prompts: list) -> list[TensorDictBase]:
        env = self.env
        chunk = env.batch_size.numel()
        if len(prompts) % chunk:
            raise ValueError(
                f"got {len(prompts)} prompts but the env's batch size is {tuple(env.batch_size)}: the "
                f"number of prompts (TRL's generation batch) must be a multiple of {chunk}"
            )
        context = self.context_fn(list(prompts)) if self.context_fn is not None else {}
        for name, values in context.items():
            if len(values) != len(prompts):
                raise ValueError(
                    f"context_fn returned {len(values)} values for column {name!r}, expected {len(prompts)}"
                )
        per_chunk = []
        for start in range(0, len(prompts), chunk):
            part = prompts[start : start + chunk]
            cols = {k: list(v[start : start + chunk]) for k, v in context.items()}
            per_chunk.append(self._episode(policy, part, cols))
        n_turns = {len(c) for c in per_chunk}
        if len(n_turns) != 1:
            raise ValueError(f"env episodes of different chunks ended after different numbers of turns: {n_turns}")
        return [lazy_stack([s for c in per_chunk for s in c[t].tensordicts]) for t in range(n_turns.pop())]

    def _episode(self, policy, prompts: list, columns: dict) -> list[TensorDictBase]:
        env = self.env
        if env.input_mode == "history":
            check_history_batch(prompts)
        reset = TensorDict({"query": env_query(prompts)}, batch_size=env.batch_size)
        td = env.reset(reset.update(columns_td(columns, env.batch_size)))
        steps = []
        for turn in range(self.max_turns):
            td = policy(td)
            last = turn == self.max_turns - 1
            if last:
                step = env.step(td)
            else:
                step, td = env.step_and_maybe_reset(td)
            step = per_sample(step)
            steps.append(step)
            done = step.get(layouts.DONE_KEY).reshape(-1)
            if done.all():
                break
            if done.any():
                raise ValueError(
                    f"turn {turn}: {int(done.sum())} of {done.numel()} episodes ended while others go on; "
                    "TorchRLRolloutFunc needs every episode of an env batch to end at the same turn "
                    "(e.g. a StepCounter(max_steps=k))"
                )
        return steps

    # -- TorchRL -> TRL ----------------------------------------------------------------

    def _to_trl(self, policy, steps: list[TensorDictBase], logprobs_mode: str = "generate") -> RolloutBatch:
        rows = turns_to_trl(steps)
        if logprobs_mode == "rescore":
            if self._scorer is None or self._scorer.model is not policy.model:
                self._scorer = ResponseScorer(policy)
            rows["logprobs"] = self._scorer(rows["prompt_ids"], rows["completion_ids"])
        return rollout_batch(rows, forward_fields(steps, self.forward_keys), steps)

    def _annotate(self, steps: list[TensorDictBase], group_size: int, version: int) -> None:
        n = steps[0].batch_size[0]
        groups = [self._next_group + i // group_size for i in range(n)]
        self._next_group += -(-n // group_size)
        for turn, step in enumerate(steps):
            for i, sample in enumerate(step.tensordicts):
                sample.set(GROUP_ID_KEY, torch.tensor(groups[i]))
                sample.set(VERSION_KEY, torch.tensor(version))
                sample.set(TURN_KEY, torch.tensor(turn))


def _reads_logprobs(trainer) -> bool:
    """Whether ``trainer`` may read the log-probs a ``rollout_func`` returns (unknown: yes):
    TRL's vLLM importance-sampling correction, its off-policy sequence mask, or a trainer
    class that says so (``reads_rollout_logprobs = True``)."""
    if trainer is None:
        return True
    vllm_correction = getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False)
    return bool(
        vllm_correction
        or getattr(trainer, "off_policy_mask_threshold", None) is not None
        or getattr(trainer, "reads_rollout_logprobs", False)
    )


def _check_policy(policy) -> None:
    if not getattr(policy, "generate", False):
        raise ValueError("policy must generate (TransformersWrapper(..., generate=True))")
    if not getattr(policy, "return_log_probs", False):
        raise ValueError("policy must return log-probs (TransformersWrapper(..., return_log_probs=True))")
    if getattr(policy, "num_samples", None) not in (None, 1):
        raise ValueError(
            f"policy.num_samples={policy.num_samples}: TRL already repeats each prompt num_generations "
            "times, so the policy must sample one completion per prompt"
        )
    mode = getattr(policy, "input_mode", None)
    if mode not in ("text", "history"):
        raise ValueError(f"policy.input_mode must be 'text' or 'history', got {mode!r}")


def _group_size(trainer, n: int, expected: int | None = None) -> int:
    """TRL's group size for a call with ``n`` prompts (``num_generations``, or
    ``num_generations_eval`` in evaluation), checked to divide ``n`` and to equal
    ``expected`` (a collector's group size) when given."""
    if trainer is None:
        return n if expected is None else expected
    training = getattr(trainer.model, "training", True)
    g = trainer.num_generations if training else getattr(trainer, "num_generations_eval", trainer.num_generations)
    if expected is not None and g != expected:
        raise ValueError(f"the trainer uses num_generations={g}, the collector group_size={expected}")
    if n % g:
        raise ValueError(f"got {n} prompts, not a multiple of group_size={g}")
    return g


def _policy_input(policy, prompts: list) -> TensorDictBase:
    from ..rewards.trl_funcs import is_conversational

    n = len(prompts)
    chat = is_conversational(prompts)
    if policy.input_mode == "history":
        from torchrl.data.llm import History

        if not chat:
            raise ValueError(
                "the policy reads chat history (input_mode='history') but TRL's prompts are plain text; "
                "use a dataset of conversational prompts or a policy with input_mode='text'"
            )
        check_history_batch(prompts)
        history = History.from_chats([layouts.to_messages(p) for p in prompts])
        return TensorDict({"history": {"prompt": history}}, batch_size=[n])
    if chat:
        tok = policy.tokenizer
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    else:
        texts = [str(p) for p in prompts]
    return TensorDict({"text": {"prompt": texts}}, batch_size=[n])
