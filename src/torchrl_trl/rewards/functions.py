"""TRL-style reward functions scoring TorchRL LLM rollouts (TRL -> TorchRL):
:class:`RewardFunctionWrapper`, a TensorDict module writing TorchRL's reward keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey

from torchrl_trl import layouts
from torchrl_trl._checks import WarnOnce, key_tuple, moved_keywords, positive_seconds, strip_next

from .calling import (
    FailureCounter,
    FunctionTimeout,
    RewardFunctionError,
    call_functions,
    check_signature,
    function_names,
    score_items,
)
from .executors import MOVED_TO_EXECUTOR, RewardExecutor, reward_executor
from .reward_transform import RewardTransform
from .rollout_arguments import InputMode, input_keys, trl_arguments
from .shape import RewardShape, trailing_dims
from .writing import write_rewards

__all__ = ["FunctionTimeout", "RewardFunctionError", "RewardFunctionWrapper", "check_reward_shape"]

_OLD_SHAPES = {(): "flat", (1,): "trailing", (1, 1): "step"}


def check_reward_shape(reward_shape: Any) -> RewardShape:
    """``reward_shape`` if it is ``"flat"``, ``"trailing"`` or ``"step"``; the old tuple
    form raises a ``ValueError`` naming its new name.

    >>> check_reward_shape((1, 1))
    Traceback (most recent call last):
    ...
    ValueError: reward_shape=(1, 1) is the old tuple form; pass reward_shape='step' (one of 'flat' [*B], 'trailing' [*B, 1], 'step' [*B, 1, 1])
    """
    if isinstance(reward_shape, (tuple, list, torch.Size)):
        name = _OLD_SHAPES.get(tuple(reward_shape))
        hint = f"pass reward_shape={name!r}" if name else "no name matches it"
        raise ValueError(
            f"reward_shape={reward_shape!r} is the old tuple form; {hint} (one of 'flat' [*B], "
            "'trailing' [*B, 1], 'step' [*B, 1, 1])"
        )
    trailing_dims(reward_shape)  # a ValueError naming the choices
    return reward_shape


class _Logs:
    """Where ``log_extra``/``log_metric`` calls from reward functions land."""

    def __init__(self):
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(column, []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(value)


class RewardFunctionWrapper(TensorDictModuleBase):
    """TRL-style reward functions as a TensorDict module: ``wrapper(td)`` scores the
    rollouts in ``td`` (any batch shape, padded or ragged) and writes the reward keys.

    Each function is called as TRL's ``GRPOTrainer`` calls it::

        f(prompts=..., completions=..., completion_ids=..., <columns>...,
          trainer_state=..., log_extra=..., log_metric=...)

    - chat rollouts (``("history", ...)`` present): ``prompts[i]`` is the prompt
      conversation and ``completions[i]`` the generated messages, as plain
      ``{"role", "content"}`` dicts (TRL's conversational format);
    - text rollouts: ``prompts[i]``/``completions[i]`` are ``("text", "prompt")`` and
      ``("text", "response")``;
    - ``completion_ids[i]``: the response token ids (``("tokens", "response")``, padding
      removed) as a list of ints (``None`` when the rollouts hold no tokens);
    - columns: per-row lists of the dataset fields carried in the rollouts (``"answer"``...).

    Sync functions run one after the other, async ones concurrently (``asyncio.gather``).
    The reward is ``nansum(weights * rewards_per_func)``: a ``None`` (or NaN) is excluded,
    not counted as zero. An infinite reward is excluded the same way (TRL would let it turn
    the group's advantages into NaN), counted in :attr:`nonfinite_counts` and warned about
    once. A row for which every function returned ``None`` gets ``unscorable_reward`` (NaN
    by default, like TRL) and a warning. Both are counted in :attr:`none_counts` and
    :attr:`unscorable_count`. An exception raised by a function is re-raised (same type
    where possible, else :class:`~torchrl_trl.rewards.calling.RewardFunctionError`) with
    the function's name, the original chained as ``__cause__``.

    Where to put it: alone or after a collector (``wrapper(td)``, or :meth:`score` for
    the values); on a ``ChatEnv``, ``env.append_transform(wrapper.as_transform())`` (a
    :class:`~torchrl_trl.rewards.reward_transform.RewardTransform`; the wrapper itself
    raises a ``KeyError`` saying so: TorchRL would call it on the reset tensordict); on a
    replay buffer, ``rb.append_transform(wrapper.as_transform())`` after ``MCAdvantage``
    (write transforms run last to first) or ``rb.append_transform(wrapper, invert=True)``
    scores once on write, ``rb.append_transform(wrapper)`` every sample.

    Args:
        funcs: one reward function or a list of them.

    Keyword Args:
        weights: one float per function (default: all ones), as ``GRPOConfig.reward_weights``.
        columns: the rollout fields passed as keyword arguments: a list of keys (the
            argument name is the last part of the key) or a ``{argument: key}`` mapping.
            ``None`` (default) passes every top-level non-tensor field that is not one of
            TorchRL's own keys (e.g. ``"answer"``, ``"query"``), as TRL passes every
            dataset column.
        input_mode: ``"history"`` (chat messages), ``"text"`` or ``"auto"`` (history when
            ``("history", "response")`` is present).
        tokenizer: the policy tokenizer; when given, completion texts are decoded from the
            response ids with ``skip_special_tokens=True``, as TRL does (TorchRL's
            ``("text", "response")`` keeps special tokens, its chat messages are stripped).
        reward_key: where the combined reward is written. Default ``("next", "reward")``.
        per_function_keys: also write each function's raw (unweighted) reward, NaN where it
            returned ``None``: ``True`` for ``("next", "reward_<name>")`` (next to
            ``reward_key``), or a list of keys, one per function.
        reward_shape: ``"step"`` (default: ``[*B, 1, 1]``, as ``GSM8KRewardParser`` writes
            and ``MCAdvantage``/``GRPOLoss`` read), ``"trailing"`` (``[*B, 1]``) or
            ``"flat"`` (``[*B]``); see :mod:`torchrl_trl.rewards.shape`. The old tuple
            form raises a ``ValueError`` naming the new one.
        unscorable_reward: the reward of a row every function returned ``None`` for.
        names: names of the functions (default: TRL's, ``__name__``, deduplicated).
        trainer_state: passed as ``trainer_state`` (TRL passes its ``TrainerState``).
        timeout: seconds (``None``: no limit, as TRL). Without ``executor``: the limit of
            one call of each function on the whole batch (an async one is cancelled, a sync
            one's helper thread abandoned); a ``TimeoutError`` names the function. With
            ``executor``: the limit of one completion; a late one fails (below).
        executor: ``None`` (default: functions run in the caller, on the whole batch), or
            a :class:`~torchrl_trl.rewards.executors.RewardExecutor` (or just its kind:
            ``"process"``, ``"thread"``, ``"ray"``, a ``concurrent.futures.Executor``):
            each function is then called **once per completion**, isolated, with
            one-element lists (``prompts=[p]``, ``completions=[c]``, each column ``[v]``),
            and must return one reward; ``log_extra``/``log_metric`` calls are replayed here
            in completion order. A completion that raised, timed out or crashed its worker
            gets the executor's ``failure_reward`` (default ``None``: excluded like TRL's
            ``None``), is counted in :attr:`failure_counts` (by function and ``"error" |
            "timeout" | "crash"``) and warned about once per function and kind.
        max_workers, failure_reward, mp_context: moved to ``executor=RewardExecutor(...)``
            (accepted for one release, with a ``DeprecationWarning``).

    ``in_keys`` lists every key it may read: the prompt/response keys of ``input_mode``
    (both the history and the text ones for ``"auto"``), ``("tokens", "response")`` and
    ``("masks", "all_attention_mask")`` (the completion ids), and the named ``columns``;
    ``out_keys`` are ``reward_key`` and the ``per_function_keys``. A function that
    declares a ``completion_ids`` parameter on rollouts without response tokens raises
    ``KeyError`` instead of receiving ``None``.

    Examples:
        >>> from tensordict import TensorDict
        >>> def length_reward(prompts, completions, **kwargs):
        ...     return [float(len(c)) for c in completions]
        >>> def says_hi(prompts, completions, **kwargs):
        ...     return [1.0 if "hi" in c else None for c in completions]
        >>> rollouts = TensorDict(
        ...     {"text": {"prompt": ["q1", "q2"], "response": ["hi there", "no"]}}, batch_size=[2]
        ... )
        >>> wrapper = RewardFunctionWrapper([length_reward, says_hi], weights=[1.0, 10.0])
        >>> wrapper(rollouts)["next", "reward"].flatten().tolist()  # None is excluded, not 0
        [18.0, 2.0]
        >>> rollouts["next", "reward"].shape
        torch.Size([2, 1, 1])
        >>> wrapper.none_counts
        {'length_reward': 0, 'says_hi': 1}
        >>> RewardFunctionWrapper(length_reward, reward_key="score", reward_shape="flat")(rollouts)["score"]
        tensor([8., 2.])
    """

    def __init__(
        self,
        funcs: Callable | Sequence[Callable],
        *,
        weights: Sequence[float] | None = None,
        columns: Sequence[NestedKey] | Mapping[str, NestedKey] | None = None,
        input_mode: InputMode = "auto",
        tokenizer=None,
        reward_key: NestedKey = layouts.REWARD_KEY,
        per_function_keys: bool | Sequence[NestedKey] = False,
        reward_shape: RewardShape = "step",
        unscorable_reward: float = math.nan,
        names: Sequence[str] | None = None,
        trainer_state: Any = None,
        timeout: float | None = None,
        executor: str | Executor | RewardExecutor | None = None,
        **moved,
    ):
        moved = moved_keywords(type(self).__name__, moved, MOVED_TO_EXECUTOR)
        config = reward_executor(executor, **moved)
        super().__init__()
        funcs = [funcs] if callable(funcs) else list(funcs)
        if not funcs:
            raise ValueError("funcs must hold at least one reward function")
        for f in funcs:
            if not callable(f):
                raise TypeError(f"reward functions must be callable, got {type(f).__name__}")
        if input_mode not in ("auto", "history", "text"):
            raise ValueError(f"input_mode must be 'auto', 'history' or 'text', got {input_mode!r}")
        self.names = function_names(funcs, names)
        if weights is None:
            weights = [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(
                f"Number of reward weights ({len(weights)}) must match number of reward "
                f"functions ({len(funcs)})"
            )
        self.reward_key = key_tuple(reward_key)
        if per_function_keys is True:
            prefix, leaf = self.reward_key[:-1], self.reward_key[-1]
            per_function_keys = [prefix + (f"{leaf}_{n}",) for n in self.names]
        elif per_function_keys is False or per_function_keys is None:
            per_function_keys = []
        else:
            per_function_keys = [key_tuple(k) for k in per_function_keys]
            if len(per_function_keys) != len(funcs):
                raise ValueError(
                    f"per_function_keys has {len(per_function_keys)} keys, expected "
                    f"{len(funcs)} (one per function)"
                )
        self.per_function_keys = per_function_keys
        if isinstance(columns, Mapping):
            self.columns = {str(k): key_tuple(v) for k, v in columns.items()}
        elif columns is not None:
            self.columns = {key_tuple(k)[-1]: key_tuple(k) for k in columns}
        else:
            self.columns = None
        self.in_keys = input_keys(input_mode, self.columns)
        self.out_keys = [self.reward_key, *self.per_function_keys]
        self.funcs = funcs
        self.weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)
        self.input_mode = input_mode
        self.tokenizer = tokenizer
        self.reward_shape = check_reward_shape(reward_shape)
        self.unscorable_reward = float(unscorable_reward)
        self.trainer_state = trainer_state
        self.timeout = positive_seconds(timeout, "timeout")
        self.failure_reward = None if config is None else config.failure_reward
        self.executor = None if config is None else config.build(funcs, self.names, self.timeout)
        self._failures = FailureCounter(self.names, type(self).__name__)
        self.logs = _Logs()
        self._none = WarnOnce()  # by function name
        self._nonfinite = WarnOnce()  # by function name
        self._unscorable = WarnOnce()

    # -- counters ------------------------------------------------------------------

    @property
    def none_counts(self) -> dict[str, int]:
        """How many ``None``/NaN rewards each function returned, by name."""
        return {n: self._none.counts[n] for n in self.names}

    @property
    def nonfinite_counts(self) -> dict[str, int]:
        """How many infinite rewards each function returned (excluded like ``None``)."""
        return {n: self._nonfinite.counts[n] for n in self.names}

    @property
    def unscorable_count(self) -> int:
        """How many rows every function returned ``None`` for (or failed on)."""
        return self._unscorable.counts["unscorable"]

    @property
    def failure_counts(self) -> dict[str, dict[str, int]]:
        """Failed items (executor modes) by function name and kind: ``{"f": {"error": 0,
        "timeout": 1, "crash": 0}}``."""
        return self._failures.counts

    def shutdown(self) -> None:
        """Stop the executor's worker processes (a later call starts new ones)."""
        if self.executor is not None:
            self.executor.shutdown()

    def as_transform(self) -> RewardTransform:
        """This scorer as a TorchRL ``Transform`` for an env's step or a replay buffer's
        write: a :class:`~torchrl_trl.rewards.reward_transform.RewardTransform` sharing this
        object (and its counters and workers)."""
        return RewardTransform(self)

    # -- scoring -------------------------------------------------------------------

    def trl_arguments(self, td: TensorDictBase, columns_td: TensorDictBase | None = None) -> dict:
        """The keyword arguments TRL would pass for the rollouts in ``td`` (flattened
        row-major): ``prompts``, ``completions``, ``completion_ids``, the columns and
        ``trainer_state``/``log_extra``/``log_metric``. Columns missing from ``td`` are
        looked up in ``columns_td`` (the ``next`` tensordict of an env step)."""
        kwargs = trl_arguments(
            td, input_mode=self.input_mode, columns=self.columns, tokenizer=self.tokenizer,
            funcs=self.funcs, names=self.names, columns_td=columns_td,
        )
        kwargs["trainer_state"] = self.trainer_state
        kwargs["log_extra"] = self.logs.log_extra
        kwargs["log_metric"] = self.logs.log_metric
        return kwargs

    def score(
        self, td: TensorDictBase, columns_td: TensorDictBase | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score the rollouts in ``td`` without writing anything.

        Returns:
            ``(rewards, rewards_per_func)``: float32 ``[N]`` combined rewards and
            ``[N, n_funcs]`` raw rewards (NaN for ``None``), ``N`` the flattened batch.
        """
        return self.score_arguments(**self.trl_arguments(td, columns_td))

    def score_outputs(self, td: TensorDictBase, columns_td: TensorDictBase | None = None) -> list[torch.Tensor]:
        """One ``[N]`` tensor per out key: the reward, then each function's raw reward if
        ``per_function_keys`` (what :class:`RewardTransform` writes)."""
        rewards, per_func = self.score(td, columns_td)
        return [rewards, *per_func.unbind(1)][: len(self.out_keys)]

    def score_arguments(self, prompts, completions, completion_ids, **kwargs):
        """Score TRL-style arguments directly (see :meth:`score`)."""
        n = len(prompts)
        call_kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        for func, name in zip(self.funcs, self.names):
            check_signature(func, name, list(call_kwargs))
        failed = None
        if self.executor is not None:
            values, failed = score_items(self.executor, call_kwargs, n, self.names, self._failures,
                                         self.failure_reward, "it is excluded like None")
            failed = torch.tensor(failed, dtype=torch.bool).reshape(len(self.funcs), n).T
        else:
            values = call_functions(self.funcs, self.names, call_kwargs, self.timeout)
        values = [[math.nan if v is None else v for v in column] for column in values]
        per_func = torch.tensor(values, dtype=torch.float32).reshape(len(self.funcs), n).T
        self._count_missing(per_func, failed)
        self._exclude_infinite(per_func)
        rewards = (per_func * self.weights).nansum(dim=1)
        unscorable = per_func.isnan().all(dim=1)
        self._count_unscorable(unscorable, prompts, completions)
        rewards[unscorable] = self.unscorable_reward
        return rewards, per_func

    def _exclude_infinite(self, per_func: torch.Tensor) -> None:
        infinite = per_func.isinf()
        for name, count in zip(self.names, infinite.sum(0).tolist()):
            self._nonfinite.add(
                name,
                f"reward function {name!r} returned an infinite reward for {count} of "
                f"{per_func.shape[0]} completions; they are excluded like None (counted in "
                f"{type(self).__name__}.nonfinite_counts)",
                n=count, stacklevel=5,
            )
        per_func[infinite] = math.nan

    def _count_missing(self, per_func: torch.Tensor, failed: torch.Tensor | None) -> None:
        missing = per_func.isnan()
        if failed is not None:  # counted as failures, not as None
            missing &= ~failed
        for name, count in zip(self.names, missing.sum(0).tolist()):
            self._none.add(
                name,
                f"reward function {name!r} returned None for {count} of {per_func.shape[0]} "
                "completions; they are excluded from the weighted sum (counted in "
                f"{type(self).__name__}.none_counts)",
                n=count, stacklevel=5,
            )

    def _count_unscorable(self, unscorable: torch.Tensor, prompts, completions) -> None:
        count = int(unscorable.sum())
        if count:
            row = int(unscorable.nonzero()[0])
            self._unscorable.add(
                "unscorable",
                f"All reward functions returned None for {count} completion(s) (or an "
                f"infinite value, or failed in the executor), e.g. prompt={prompts[row]!r}, "
                f"completion={completions[row]!r}; their reward is {self.unscorable_reward} "
                f"(counted in {type(self).__name__}.unscorable_count)",
                n=count, stacklevel=5,
            )

    def write(
        self, td: TensorDictBase, rewards: torch.Tensor, per_func: torch.Tensor, *, inside_next: bool = False
    ) -> TensorDictBase:
        """Write ``[N]`` rewards (and ``[N, n_funcs]`` per-function rewards, if
        ``per_function_keys``) into ``td`` with
        :func:`~torchrl_trl.rewards.writing.write_rewards` (shaped ``[*td.batch_size,
        *reward_shape]``). ``inside_next``: ``td`` is an env step's ``next`` tensordict, so
        a leading ``"next"`` of the keys is dropped."""
        for key, value in zip(self.out_keys, [rewards, *per_func.unbind(1)]):
            write_rewards(td, value, strip_next(key) if inside_next else key, self.reward_shape)
        return td

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Score ``tensordict`` and write the reward keys into it (always: there is no
        mode in which a call does nothing)."""
        rewards, per_func = self.score(tensordict)
        return self.write(tensordict, rewards, per_func)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(funcs={self.names}, weights={self.weights.tolist()}, "
            f"reward_key={self.reward_key}, reward_shape={self.reward_shape!r}, input_mode={self.input_mode!r}"
            + (f", executor={self.executor!r}" if self.executor is not None else "")
            + ")"
        )
