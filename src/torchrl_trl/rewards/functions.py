"""TRL-style reward functions scoring TorchRL LLM rollouts (TRL -> TorchRL):
:class:`RewardFunctionWrapper`, a TensorDict module writing TorchRL's reward keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from types import SimpleNamespace

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey

from torchrl_trl import layouts
from torchrl_trl._checks import WarnOnce, key_tuple, strip_next

from .arguments import InputMode, check_signature, input_keys, trl_arguments
from .calling import FAILURES, FunctionTimeout, RewardFunctionError, call_functions, function_names, score_items
from .executors import RewardExecutor, reward_executor
from .postprocess import RewardShape, trailing_dims, write_rewards
from .scheduler import warm_up
from .transform import RewardTransform

__all__ = ["FunctionTimeout", "RewardFunctionError", "RewardFunctionWrapper"]


class RewardFunctionWrapper(TensorDictModuleBase):
    """TRL-style reward functions as a TensorDict module: ``wrapper(td)`` scores the rollouts in
    ``td`` (any batch shape, padded or ragged) and writes the reward keys.

    Each function is called as TRL's ``GRPOTrainer`` calls it
    (:func:`~torchrl_trl.rewards.arguments.trl_arguments`). The reward is
    ``nansum(weights * rewards_per_func)``: ``None``, NaN and inf are excluded (counted in
    :attr:`none_counts` / :attr:`nonfinite_counts`, warned once); a row with no reward left gets
    the executor's ``unscorable_reward``. A function's exception is re-raised with its name. On a
    ``ChatEnv`` or a replay buffer use :meth:`as_transform`.

    Args:
        funcs (callable, sequence of callables or mapping of str to callable): one reward
            function, a list of them, or ``{name: function}`` (default names: TRL's,
            ``__name__``, deduplicated).

    Keyword Args:
        weights (sequence of float, optional): one weight per function, as
            ``GRPOConfig.reward_weights``. Defaults to ``None`` (all ones).
        columns (sequence of NestedKey or mapping of str to NestedKey, optional): the rollout
            fields passed: keys (the argument is the key's last part) or ``{argument: key}``.
            Defaults to ``None``: every top-level non-tensor field not TorchRL's.
        input_mode (str, optional): ``"history"``, ``"text"``, ``"tokens"`` (needs ``tokenizer``)
            or ``"auto"`` (history when present, else text, else tokens when ``tokenizer`` is
            given). Defaults to ``"auto"``.
        tokenizer (transformers tokenizer, optional): the policy tokenizer; given, completions
            are decoded from the response ids as TRL decodes them. Defaults to ``None``.
        out_keys (sequence of NestedKey, optional): where the rewards are written: the weighted
            sum, then, if given, one key per function for its raw reward (NaN for ``None``).
            Defaults to ``None``: ``[("next", "reward")]``.
        reward_shape (str, optional): ``"step"`` (``[*B, 1, 1]``), ``"trailing"`` (``[*B, 1]``)
            or ``"flat"`` (``[*B]``). Defaults to ``"step"``.
        executor (RewardExecutor, str or concurrent.futures.Executor, optional): how the
            functions run (failures of isolated kinds counted in :attr:`failure_counts`).
            Defaults to ``None``: ``RewardExecutor()``.

    :attr:`trainer_state` is passed to the functions as ``trainer_state`` (``None`` until set).

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
        >>> wrapper.none_counts
        {'length_reward': 0, 'says_hi': 1}
    """

    def __init__(
        self, funcs: Callable | Sequence[Callable] | Mapping[str, Callable], *, weights: Sequence[float] | None = None,
        columns: Sequence[NestedKey] | Mapping[str, NestedKey] | None = None, input_mode: InputMode = "auto",
        tokenizer=None, out_keys: Sequence[NestedKey] | None = None, reward_shape: RewardShape = "step",
        executor: str | Executor | RewardExecutor | None = None,
    ):
        name = type(self).__name__
        config = reward_executor(executor)
        super().__init__()
        names = list(funcs) if isinstance(funcs, Mapping) else None
        funcs = list(funcs.values()) if isinstance(funcs, Mapping) else [funcs] if callable(funcs) else list(funcs)
        if not funcs:
            raise ValueError(f"{name}: expected at least one reward function, got none")
        for f in funcs:
            if not callable(f):
                raise TypeError(f"{name}: reward functions must be callable, got {type(f).__name__}")
        if input_mode not in ("auto", "history", "text", "tokens"):
            raise ValueError(f"{name}: input_mode must be 'auto', 'history', 'text' or 'tokens', got {input_mode!r}")
        if input_mode == "tokens" and tokenizer is None:
            raise ValueError(f"{name}: input_mode='tokens' decodes prompts and completions from the rollouts' "
                             "tokens: expected tokenizer= (the policy's)")
        self.names = function_names(funcs, names)
        weights = [1.0] * len(funcs) if weights is None else weights
        if len(weights) != len(funcs):
            raise ValueError(f"{name}: expected one weight per reward function ({len(funcs)}), got {len(weights)}")
        out_keys = [layouts.REWARD_KEY] if out_keys is None else list(out_keys)
        if len(out_keys) not in (1, 1 + len(funcs)):
            raise ValueError(f"{name}: out_keys must be 1 key (the weighted sum) or {1 + len(funcs)} (then one per "
                             f"function), got {len(out_keys)}")
        if columns is not None and not isinstance(columns, Mapping):
            columns = {key_tuple(k)[-1]: k for k in columns}
        self.columns = None if columns is None else {str(k): key_tuple(v) for k, v in columns.items()}
        self.in_keys = input_keys(input_mode, self.columns, tokenizer=tokenizer is not None)
        self.out_keys = [key_tuple(k) for k in out_keys]
        self.funcs = funcs
        self.weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)
        self.input_mode = input_mode
        self.tokenizer = tokenizer
        trailing_dims(reward_shape, name)  # checks the name
        self.reward_shape = reward_shape
        self.unscorable_reward = config.unscorable_reward
        self.trainer_state = None
        self.timeout = config.timeout
        self.failure_reward = config.failure_reward
        self.executor = config.build(funcs, self.names) if config.isolated else None
        self.logs = SimpleNamespace(extra={}, metrics={})  # where log_extra/log_metric calls land
        self._none, self._nonfinite, self._unscorable, self._failures = WarnOnce(), WarnOnce(), WarnOnce(), WarnOnce()

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
        """Failed items (executor modes) by function and kind: ``{"f": {"error": 0, "timeout": 1, "crash": 0}}``."""
        return {n: {kind: self._failures.counts[(n, kind)] for kind in FAILURES} for n in self.names}

    def shutdown(self) -> None:
        """Stop the executor's worker processes (a later call starts new ones)."""
        if self.executor is not None:
            self.executor.shutdown()

    def _torchrl_trl_warm_up(self) -> None:
        """The imports a first call would do, then the functions' own warm-up (see :func:`warm_up`)."""
        from trl.trainer.utils import is_async_callable  # noqa: F401  call_functions

        for func in self.funcs:
            warm_up(func)

    def as_transform(self) -> RewardTransform:
        """This scorer (shared, with its counters) as a :class:`RewardTransform`."""
        return RewardTransform(self)

    def trl_arguments(self, td: TensorDictBase, columns_td: TensorDictBase | None = None) -> dict:
        """The keyword arguments TRL would pass for the rollouts in ``td`` (flattened row-major);
        columns missing from ``td`` are read from ``columns_td`` (an env step's ``next``)."""
        kwargs = trl_arguments(
            td, input_mode=self.input_mode, columns=self.columns, tokenizer=self.tokenizer,
            funcs=self.funcs, names=self.names, columns_td=columns_td,
        )
        return {**kwargs, "trainer_state": self.trainer_state,
                "log_extra": lambda column, values: self.logs.extra.setdefault(column, []).extend(values),
                "log_metric": lambda name, value: self.logs.metrics.setdefault(name, []).append(value)}

    def score(self, td: TensorDictBase, columns_td: TensorDictBase | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rewards, rewards_per_func)`` of the rollouts in ``td``, writing nothing: float32
        ``[N]`` and ``[N, n_funcs]`` (NaN for ``None``), ``N`` the flattened batch."""
        return self.score_arguments(**self.trl_arguments(td, columns_td))

    def score_outputs(self, td: TensorDictBase, columns_td: TensorDictBase | None = None) -> list[torch.Tensor]:
        """One ``[N]`` tensor per out key: the reward, then each function's raw reward."""
        rewards, per_func = self.score(td, columns_td)
        return [rewards, *per_func.unbind(1)][: len(self.out_keys)]

    def score_arguments(self, prompts, completions, completion_ids, **kwargs):
        """Score TRL-style arguments directly (see :meth:`score`)."""
        n = len(prompts)
        call_kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        for func, name in zip(self.funcs, self.names):
            check_signature(func, name, list(call_kwargs), type(self).__name__)
        if self.executor is not None:
            values, failed = score_items(self.executor, call_kwargs, n, self.names, self._failures, type(self).__name__,
                                         self.failure_reward, "it is excluded like None")
        else:
            values = call_functions(self.funcs, self.names, call_kwargs, self.timeout, type(self).__name__)
            failed = False
        values = [[math.nan if v is None else v for v in column] for column in values]
        per_func = torch.tensor(values, dtype=torch.float32).reshape(len(self.funcs), n).T
        failed = torch.tensor(failed, dtype=torch.bool).expand(len(self.funcs), n).T
        self._count(self._none, per_func.isnan() & ~failed, "returned None", "none_counts")
        infinite = per_func.isinf()
        self._count(self._nonfinite, infinite, "returned an infinite reward", "nonfinite_counts")
        per_func[infinite] = math.nan
        rewards = (per_func * self.weights).nansum(dim=1)
        unscorable = per_func.isnan().all(dim=1)
        count = int(unscorable.sum())
        if count:
            row = int(unscorable.nonzero()[0])
            self._unscorable.add(
                "unscorable",
                f"All reward functions returned None for {count} completion(s) (or an infinite value, or failed in the "
                f"executor), e.g. prompt={prompts[row]!r}, completion={completions[row]!r}; their reward is "
                f"{self.unscorable_reward} (counted in {type(self).__name__}.unscorable_count)",
                n=count, stacklevel=4,
            )
        rewards[unscorable] = self.unscorable_reward
        return rewards, per_func

    def _count(self, counter: WarnOnce, mask: torch.Tensor, what: str, attr: str) -> None:
        """Count the ``[N, n_funcs]`` ``mask`` per function, warning once per function."""
        for name, count in zip(self.names, mask.sum(0).tolist()):
            counter.add(
                name,
                f"reward function {name!r} {what} for {count} of {mask.shape[0]} completions; they "
                f"are excluded from the weighted sum (counted in {type(self).__name__}.{attr})",
                n=count, stacklevel=5,
            )

    def write(
        self, td: TensorDictBase, rewards: torch.Tensor, per_func: torch.Tensor, *, inside_next: bool = False
    ) -> TensorDictBase:
        """Write ``[N]`` rewards (and ``[N, n_funcs]`` per-function ones) into ``td`` with
        :func:`~torchrl_trl.rewards.postprocess.write_rewards`; ``inside_next``: ``td`` is an env
        step's ``next`` tensordict (a leading ``"next"`` of the keys is dropped)."""
        for key, value in zip(self.out_keys, [rewards, *per_func.unbind(1)]):
            write_rewards(td, value, strip_next(key) if inside_next else key, self.reward_shape)
        return td

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Score ``tensordict`` and write the reward keys into it."""
        return self.write(tensordict, *self.score(tensordict))

    def __repr__(self) -> str:
        executor = f", executor={self.executor!r}" if self.executor is not None else ""
        return (
            f"{type(self).__name__}(funcs={self.names}, weights={self.weights.tolist()}, out_keys="
            f"{self.out_keys}, reward_shape={self.reward_shape!r}, input_mode={self.input_mode!r}{executor})"
        )
