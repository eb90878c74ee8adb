"""TorchRL episodes in, TRL's ``GRPOTrainer`` rows out (:func:`episodes_to_trl`), the prompts in between
(:class:`PromptPrimer`, :func:`make_prompt_collector`), and behaviour log-probs to correct stale groups
(:class:`BehaviourLogProbsPostproc`).
"""

from __future__ import annotations

import functools
import itertools
import math
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, TensorDictBase, lazy_stack
from tensordict.utils import NestedKey
from torchrl.envs import Transform

from .. import layouts
from .._checks import positive_int
from ..padding import check_policy_padding

__all__ = [
    "BehaviourLogProbsPostproc", "PromptPrimer", "PromptSourceEnded", "ResponseScorer", "RolloutBatch",
    "episodes_to_trl", "forward_fields", "make_prompt_collector", "per_sample", "rollout_batch", "turns_to_trl",
]

#: Generation log-probs of the response tokens, as TorchRL's wrappers write them.
GENERATED_LOGPROBS_KEY: NestedKey = ("log_probs", "response")
#: Per-token behaviour log-probs a collector's postproc records (:class:`BehaviourLogProbsPostproc`).
BEHAVIOUR_KEY = "behaviour_log_probs"
#: Name under which the env's reward (summed over turns) reaches TRL's reward functions.
TORCHRL_REWARD_FIELD = "torchrl_reward"
GROUP_ID_KEY = "group_id"
VERSION_KEY = "policy_version"
TURN_KEY = "turn"
#: Keys this package adds to rollout items: not dataset columns to forward.
OWN_KEYS = frozenset({GROUP_ID_KEY, VERSION_KEY, TURN_KEY, BEHAVIOUR_KEY, "query", "_reset"})


class RolloutBatch(dict):
    """TRL's rollout dict with the TorchRL steps it came from in :attr:`steps` (a lazy stack per turn)."""

    steps: list[TensorDictBase]


def per_sample(td: TensorDictBase) -> TensorDictBase:
    """``td`` ``[B]`` as a lazy stack of ``B`` per-sample TensorDicts (as ``LazyStackStorage`` stores)."""
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0 and td.batch_dims == 1:
        return td
    return lazy_stack(list(td.reshape(-1).unbind(0)))


def turns_to_trl(
    steps: Sequence[TensorDictBase], *, logprobs_key: NestedKey = GENERATED_LOGPROBS_KEY
) -> dict[str, list[list]]:
    """``N`` episodes of the same number of turns (``steps[t]``: the ``N`` samples' turn
    ``t``) as TRL's ``prompt_ids``, ``completion_ids``, ``env_mask`` and ``logprobs`` (lists
    of ``N`` lists), the log-probs read at ``logprobs_key`` (TorchRL's generated ones: each
    turn's first value NaN). Turn ``k + 1``'s prompt tokens must start with turn ``k``'s prompt +
    response; the tokens in between (end of turn, a tool's reply) get ``env_mask`` 0."""
    prompt_ids = layouts.read_tokens(steps[0], "prompt").tolist()
    completion_ids, env_mask, logprobs = ([[] for _ in prompt_ids] for _ in range(3))
    generated = logprobs_key == GENERATED_LOGPROBS_KEY
    for turn, step in enumerate(steps):
        prompts = layouts.read_tokens(step, "prompt").tolist()
        responses = layouts.read_tokens(step, "response").tolist()
        if generated:
            lps = layouts.read_tokens(step, "response", key=logprobs_key).tolist()
        else:
            lps = [torch.as_tensor(v).reshape(-1).tolist() for v in layouts.read_column(step, logprobs_key)]
        for i, (p, r, lp) in enumerate(zip(prompts, responses, lps)):
            prev = prompt_ids[i] + completion_ids[i]  # the previous turn's prompt + response
            if p[: len(prev)] != prev:
                at = next((j for j, (a, b) in enumerate(zip(p, prev)) if a != b), min(len(p), len(prev)))
                raise ValueError(
                    f"turns_to_trl: sample {i}, turn {turn}: expected the prompt tokens to start with the previous "
                    f"turn's, they differ at {at} (re-tokenised chat); use ChatEnv(input_mode='tokens')"
                )
            if len(lp) != len(r):
                raise ValueError(
                    f"turns_to_trl: sample {i}, turn {turn}: expected one log-prob per response token at "
                    f"{logprobs_key!r}, got {len(lp)} for {len(r)}"
                )
            if generated and lp:  # TorchRL writes 0.0 for the first generated token: unknown
                lp = [float("nan")] + lp[1:]
            glue = p[len(prev) :]
            completion_ids[i] += glue + r
            env_mask[i] += [0] * len(glue) + [1] * len(r)
            logprobs[i] += [float("nan")] * len(glue) + list(lp)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "env_mask": env_mask, "logprobs": logprobs}


def forward_fields(steps: Sequence[TensorDictBase], keys: Sequence[NestedKey] | None = None) -> dict[str, list]:
    """Per-episode columns for TRL's reward functions: ``keys`` read from the last turn
    (``None``: every top-level key neither TorchRL's nor ours) and the env's reward summed
    over turns as ``"torchrl_reward"``."""
    last = steps[-1]
    if keys is None:
        skip = {*layouts.TORCHRL_ROOT_KEYS, *OWN_KEYS}
        keys = [k for k in layouts.first_member(last).keys() if k not in skip]
    fields = {}
    for key in keys:
        name = key if isinstance(key, str) else ".".join(key)
        fields[name] = [_to_python(v) for v in layouts.read_column(last, key)]
    if layouts.has_key(last, layouts.REWARD_KEY):
        total = sum(
            torch.stack([r.reshape(()) for r in layouts.read_column(s, layouts.REWARD_KEY)]).float() for s in steps
        )
        fields[TORCHRL_REWARD_FIELD] = total.tolist()
    return fields


def rollout_batch(columns: dict[str, list], steps: list[TensorDictBase]) -> RolloutBatch:
    """TRL's rollout dict from :func:`turns_to_trl`'s rows and :func:`forward_fields`' columns;
    ``env_mask`` only where some completion token is not the policy's."""
    out = RolloutBatch(columns)
    if all(0 not in m for m in out["env_mask"]):
        del out["env_mask"]
    out.steps = steps
    return out


def episodes_to_trl(
    episodes: Sequence[TensorDictBase], *, logprobs_key: NestedKey = GENERATED_LOGPROBS_KEY,
    forward_keys: Sequence[NestedKey] | None = None,
) -> RolloutBatch:
    """One TRL row per episode (``episodes[i]``: its steps ``[T_i]``), in order;
    :attr:`RolloutBatch.steps`: the episodes' first steps, one lazy stack."""
    n = len(episodes)
    by_length: dict[int, list[int]] = {}
    for i, episode in enumerate(episodes):
        by_length.setdefault(episode.shape[0], []).append(i)
    out: dict[str, list] = {}
    for n_turns, index in by_length.items():
        steps = [lazy_stack([episodes[i][t] for i in index]) for t in range(n_turns)]
        new = {**turns_to_trl(steps, logprobs_key=logprobs_key), **forward_fields(steps, forward_keys)}
        for key, values in new.items():
            for i, value in zip(index, values):
                out.setdefault(key, [None] * n)[i] = value
    return rollout_batch(out, [lazy_stack([episode[0] for episode in episodes])])


def _to_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


# --- prompts into a ChatEnv ---------------------------------------------------------------------

class PromptSourceEnded(Exception):
    """The prompt source of a :class:`PromptPrimer` has no more prompts."""


def env_query(prompts: list):
    """TRL prompts as a ``ChatEnv`` ``"query"``: a ``History`` for chats, a stack of strings for texts."""
    from ..rewards.trl_funcs import is_conversational

    if is_conversational(prompts):
        from torchrl.data.llm import History

        return History.from_chats([layouts.to_messages(p) for p in prompts])
    return NonTensorStack(*[str(p) for p in prompts])


def check_history_batch(prompts: list, owner: str) -> None:
    """Raise if the chats of one batch have different numbers of messages, which TorchRL's
    history-mode ``TransformersWrapper`` cannot generate."""
    lengths = sorted({len(layouts.to_messages(p)) for p in prompts})
    if len(lengths) > 1:
        raise ValueError(
            f"{owner}: expected chats of one length per batch (TorchRL's history mode), got chats of {lengths} "
            "messages; use input_mode='text', or batches of one prompt (prompts_per_batch=1)"
        )


def columns_td(columns: dict[str, Sequence[Any]], batch_size) -> TensorDict:
    """``{name: one value per sample}`` as a TensorDict (tensors stacked, others a ``NonTensorStack``)."""
    out = TensorDict(batch_size=batch_size)
    for name, values in columns.items():
        out.set(name, torch.stack(list(values)) if isinstance(values[0], torch.Tensor) else NonTensorStack(*values))
    return out


def context_columns(context_fn: Callable[[list], dict[str, Sequence[Any]]] | None, prompts: list, owner: str) -> dict:
    """``context_fn(prompts)`` (``{}`` without one), checked to give one value per prompt."""
    columns = context_fn(list(prompts)) if context_fn is not None else {}
    for name, values in columns.items():
        if len(values) != len(prompts):
            raise ValueError(
                f"{owner}: context_fn returned {len(values)} values for column {name!r}, expected {len(prompts)}"
            )
    return columns


class PromptPrimer(Transform):
    """Give a ``ChatEnv`` its prompts at each reset (TorchRL's ``DataLoadingPrimer`` rejects a batch of
    chats): ``"query"``, ``"group_id"`` (int64, shared by the ``repeats`` consecutive copies of a prompt)
    and the columns of ``context_fn``.

    Args:
        prompts (sequence or iterable): TRL prompts (texts or message lists): a sequence,
            cycled forever, or an iterator.

    Keyword Args:
        repeats (int, optional): copies of each prompt in a row (``GRPOConfig.num_generations``).
            Defaults to ``1``.
        context_fn (callable, optional): ``fn(prompts) -> {column: values}``, one value per env.
            Defaults to ``None``.
        raw_text (bool, optional): give plain-text prompts to a ``ChatEnv(input_mode="text")``
            as they are instead of through the tokenizer's chat template. Defaults to ``False``.

    A reset not followed by a step serves the same prompts again. When the source ends or
    raises, the next step raises :class:`PromptSourceEnded` (or the source's error), kept in
    :attr:`error`. A partial reset raises.

    Example:

    >>> from torchrl.envs.llm import ChatEnv
    >>> from torchrl_trl.testing import make_tokenizer
    >>> chats = [[{"role": "user", "content": q}] for q in ("hi", "hello")]
    >>> env = ChatEnv(batch_size=(2,), input_mode="history", tokenizer=make_tokenizer())
    >>> env = env.append_transform(PromptPrimer(chats, repeats=2))
    >>> td = env.reset()
    >>> [h["content"] for h in td["history", "prompt"][:, -1].tolist()], td["group_id"].tolist()
    (['hi', 'hi'], [0, 0])
    """

    def __init__(
        self, prompts: Sequence | Iterable, *, repeats: int = 1,
        context_fn: Callable[[list], dict[str, Sequence[Any]]] | None = None, raw_text: bool = False,
    ):
        super().__init__()
        if isinstance(prompts, Sequence) and not prompts:
            raise ValueError("PromptPrimer: expected prompts, prompts is empty")
        self.repeats = positive_int(repeats, "PromptPrimer: repeats")
        self.context_fn = context_fn
        self.raw_text = raw_text
        self.served_prompts = 0
        self.error: BaseException | None = None
        self._source = itertools.cycle(prompts) if isinstance(prompts, Sequence) else iter(prompts)
        self._stream = self._repeated()
        self._current: TensorDict | None = None
        self._stepped = True
        self._filler = False

    def _repeated(self) -> Iterator[tuple[Any, int]]:
        for group, prompt in enumerate(self._source):
            self.served_prompts += 1
            yield from itertools.repeat((prompt, group), self.repeats)

    def _next_batch(self, batch_size: torch.Size) -> TensorDict:
        n = batch_size.numel()
        try:
            items = list(itertools.islice(self._stream, n))
            if len(items) < n:
                raise PromptSourceEnded(
                    f"PromptPrimer: the prompt source ended ({len(items)} prompt copies left, expected the env's "
                    f"batch of {n})"
                )
            prompts = [p for p, _ in items]
            if getattr(self.parent, "input_mode", None) == "history":
                check_history_batch(prompts, "PromptPrimer")
        except Exception as err:
            if self._current is None:
                raise
            self.error, self._filler = err, True  # generate what was served, fail at the next step
            return self._current
        td = TensorDict({"query": env_query(prompts), GROUP_ID_KEY: torch.tensor([g for _, g in items])}, [n])
        td.update(columns_td(context_columns(self.context_fn, prompts, "PromptPrimer"), [n]))
        return td.reshape(batch_size)

    def _reset_env_preprocess(self, tensordict: TensorDictBase | None) -> TensorDictBase:
        partial = None if tensordict is None else tensordict.get("_reset", None)
        if partial is not None and not partial.all():
            raise ValueError(
                f"PromptPrimer: {int(partial.sum())} of {partial.numel()} envs reset while others go on; every "
                "episode of an env batch must end at the same turn (e.g. StepCounter(max_steps=k))"
            )
        if self._stepped:
            self._current = self._next_batch(self.parent.batch_size)
            self._stepped = False
        primed = self._current.clone(False)
        return primed if tensordict is None else tensordict.update(primed)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        for key in self._current.keys():
            if key != "query" and key not in tensordict_reset.keys():
                tensordict_reset.set(key, self._current.get(key))
        if self.raw_text and getattr(self.parent, "input_mode", None) == "text":
            queries = layouts.read_column(self._current, "query")
            if all(isinstance(q, str) for q in queries):
                tensordict_reset.set(layouts.text_key("prompt"), NonTensorStack(*queries))
        return tensordict_reset

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if self._filler:
            raise self.error
        self._stepped = True
        return next_tensordict


def make_prompt_collector(
    policy, prompts: Sequence | Iterable, *, group_size: int, prompts_per_batch: int = 1, env=None,
    context_fn: Callable[[list], dict[str, Sequence[Any]]] | None = None, replay_buffer=None,
    behaviour_logprobs: bool = True,
):
    """A TorchRL ``LLMCollector`` generating whole GRPO groups from TRL prompts, for
    ``TorchRLRolloutFunc(source=...)``: a one-turn ``ChatEnv`` fed by a :class:`PromptPrimer`.

    Args:
        policy (TransformersWrapper): the generating policy, with its *own* copy of the model
            (generation must not read weights the optimizer writes), built with
            :func:`torchrl_trl.safe_policy_wrapper`.
        prompts (sequence or iterable): TRL prompts (texts or message lists), a sequence (cycled
            forever) or an iterator.

    Keyword Args:
        group_size (int): completions per prompt (``GRPOConfig.num_generations``).
        prompts_per_batch (int, optional): prompts generated together. Defaults to ``1``.
        env (ChatEnv, optional): the env, in the policy's input mode (its transforms run, e.g. a
            reward). Defaults to ``None``: a plain ``ChatEnv``.
        context_fn (callable, optional): ``fn(prompts) -> {column: list}``, columns added at reset.
            Defaults to ``None``.
        replay_buffer (ReplayBuffer, optional): the buffer it writes into. Defaults to ``None``: a
            ``LazyStackStorage`` buffer of 1024 items.
        behaviour_logprobs (bool, optional): record each token's log-prob under the generating
            weights (:class:`BehaviourLogProbsPostproc`). Defaults to ``True``.

    Returns:
        LLMCollector: started by the rollout function on its first call.

    Example (``trainer`` stands in for ``GRPOTrainer``: only the attributes shown are read):

    >>> from types import SimpleNamespace
    >>> from torchrl_trl.online import TorchRLRolloutFunc
    >>> from torchrl_trl.testing import make_policy, make_policy_wrapper, make_tokenizer
    >>> tok = make_tokenizer()
    >>> chat = [{"role": "user", "content": "hi"}]
    >>> policy = make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3)  # its own weights
    >>> collector = make_prompt_collector(policy, [chat], group_size=2)
    >>> trainer = SimpleNamespace(num_generations=2, model=make_policy(tok), state=SimpleNamespace(global_step=0),
    ...                           accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    >>> with TorchRLRolloutFunc(source=collector) as func:
    ...     batch = func([chat, chat], trainer)  # pushes the trainer's weights, starts the collector
    >>> batch["torchrl_prompt"] == [chat, chat], batch["staleness"], func.groups.weight_pushes
    (True, [0, 0], 1)
    """
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.envs import Compose, StepCounter, TransformedEnv
    from torchrl.envs.llm import ChatEnv

    group_size = positive_int(group_size, "make_prompt_collector: group_size")
    prompts_per_batch = positive_int(prompts_per_batch, "make_prompt_collector: prompts_per_batch")
    check_policy_padding(policy, "make_prompt_collector")
    primer = PromptPrimer(prompts, repeats=group_size, context_fn=context_fn, raw_text=env is None)
    turns = group_size * prompts_per_batch
    if env is None:
        env = ChatEnv(batch_size=(turns,), input_mode=policy.input_mode, tokenizer=policy.tokenizer)
    one_turn = StepCounter(max_steps=1, step_count_key=TURN_KEY)
    env = TransformedEnv(env, Compose(primer, one_turn), auto_unwrap=False)  # the caller's env stays as is
    if replay_buffer is None:
        replay_buffer = ReplayBuffer(storage=LazyStackStorage(1024))
    return LLMCollector(  # a batch holds whole groups and whole env batches
        env=env, policy=policy, dialog_turns_per_batch=math.lcm(turns, env.batch_size.numel()),
        replay_buffer=replay_buffer, track_policy_version=True, total_dialog_turns=-1,
        postproc=BehaviourLogProbsPostproc(policy) if behaviour_logprobs else None,
    )


def find_primer(env) -> PromptPrimer | None:
    """The :class:`PromptPrimer` among ``env``'s transforms (:func:`make_prompt_collector`'s), if any."""
    while env is not None:
        transform = getattr(env, "transform", None)
        for t in transform if isinstance(transform, Iterable) else [transform]:
            if isinstance(t, PromptPrimer):
                return t
        env = getattr(env, "base_env", None)
    return None


# --- behaviour log-probs ------------------------------------------------------------------------

class ResponseScorer:
    """Per-token log-probs of completions by TorchRL's scoring path (``generate=False``) on
    the exact token sequences: ``scorer(prompt_ids, completion_ids) -> [[float] * len(c)]``."""

    def __init__(self, policy):
        self.policy, self.model = policy, policy.model
        # a copy of tokenizer_kwargs: get_new_version(pad_output=...) writes into the original's
        self._scorer = policy.get_new_version(
            generate=False, input_mode="tokens", input_key=("tokens", "full"), pad_output=False,
            tokenizer_kwargs=dict(policy.tokenizer_kwargs),
        )

    def __call__(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        rows = [
            TensorDict({"tokens": {"full": torch.tensor(p + c, dtype=torch.long)}})
            for p, c in zip(prompt_ids, completion_ids)
        ]
        with torch.no_grad():
            scored = self._scorer(lazy_stack(rows))
        full = scored.get(("log_probs", "full"), as_list=True)
        return [lp[len(p) :].tolist() for lp, p in zip(full, prompt_ids)]


class BehaviourLogProbsPostproc:
    """``LLMCollector(postproc=...)`` recording each response token's log-prob under the
    weights that generated it (by :class:`ResponseScorer`, in the collector's thread right
    after generation) at ``"behaviour_log_probs"`` (float ``[n_response_tokens]`` per sample).

    Args:
        policy (TransformersWrapper): the collector's policy (the same object); a Ray actor's:
            :meth:`for_factory`.

    Example (on one policy call, as the collector calls it after each rollout batch):

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl_trl.testing import make_policy, make_policy_wrapper, make_tokenizer
    >>> tok = make_tokenizer()
    >>> policy = make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3, input_mode="text")
    >>> _ = torch.manual_seed(0)
    >>> out = BehaviourLogProbsPostproc(policy)(policy(TensorDict({"text": {"prompt": ["hi", "hello"]}}, [2])))
    >>> generated = out[0]["log_probs", "response"]  # TorchRL's: 0.0 for the first token
    >>> behaviour = out[0]["behaviour_log_probs"]
    >>> generated[0].item(), behaviour[0].item() < 0, torch.allclose(behaviour[1:], generated[1:], atol=1e-4)
    (0.0, True, True)
    """

    def __init__(self, policy):
        self.policy = policy
        self._scorer = ResponseScorer(policy)

    @classmethod
    def for_factory(cls, policy_factory):
        """``(policy_factory, postproc)`` for a collector that builds its policy where it
        runs (a Ray actor): the postproc scores with the policy the factory built. Pass both
        to the same collector; keep ``max_staleness >= 1`` (weights load while it scores)."""
        token = uuid.uuid4().hex
        factory = functools.partial(_recording_factory, policy_factory, token)
        return factory, functools.partial(_deferred_postproc, token)

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        td = per_sample(td)
        prompts = layouts.read_tokens(td, "prompt").tolist()
        responses = layouts.read_tokens(td, "response").tolist()
        scored = self._scorer(prompts, responses)
        for sample, lp in zip(td.tensordicts, scored):
            sample.set(BEHAVIOUR_KEY, torch.tensor(lp, dtype=torch.float32))
        return td


def trl_corrects_logprobs(trainer) -> bool:
    """Whether TRL's own vLLM importance-sampling correction is on for ``trainer``."""
    return bool(getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False))


#: postprocs of the policies :meth:`BehaviourLogProbsPostproc.for_factory` factories built, in this process
_BUILT_POLICIES: dict = {}


def _recording_factory(factory, token: str):
    policy = factory()
    _BUILT_POLICIES[token] = BehaviourLogProbsPostproc(policy)
    return policy


def _deferred_postproc(token: str, td: TensorDictBase) -> TensorDictBase:
    postproc = _BUILT_POLICIES.get(token)
    if postproc is None:
        raise RuntimeError(
            "BehaviourLogProbsPostproc.for_factory: the postproc runs in a process whose collector did not "
            "build its policy with the paired factory; give both to the same collector"
        )
    return postproc(td)
