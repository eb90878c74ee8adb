"""TorchRL rewards as TRL ``reward_funcs`` (TorchRL -> TRL): :func:`as_trl_reward_func` turns
a TorchRL reward (``HFRewardModelWrapper``, a reward parser, a TensorDict module) or a plain
TRL function to run isolated into ``f(prompts, completions, completion_ids, **columns) ->
list[float]``. It is deliberately not an ``nn.Module``: TRL treats those as reward models.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from torchrl_trl import _compat, layouts
from torchrl_trl._checks import WarnOnce, key_tuple, strip_next

from .arguments import TRL_EXTRA_KWARGS, as_messages, check_signature, declares, is_conversational, rollouts_from_trl
from .calling import FAILURES, call_function, call_functions, function_names, run_with_timeout, score_items
from .executors import RewardExecutor, reward_executor
from .scheduler import warm_up

__all__ = ["TRLRewardFunc", "as_trl_reward_func", "is_conversational", "is_trl_function", "rollouts_from_trl"]


def _conversations(prompts, completions) -> list[list[dict]]:
    return [list(p) + as_messages(c) for p, c in zip(prompts, completions)]


def is_trl_function(reward: Any) -> bool:
    """Whether ``reward`` is a plain TRL reward function (called with ``prompts=``,
    ``completions=``...) rather than a TorchRL module called with a TensorDict: not a
    module or scorer, and its signature names ``completions`` or takes only ``**kwargs``."""
    from tensordict.nn import TensorDictModuleBase

    scorer = any(hasattr(reward, a) for a in ("score_ids", "score_texts", "score_messages"))
    if scorer or isinstance(reward, (torch.nn.Module, TensorDictModuleBase)):
        return False
    try:
        params = inspect.signature(reward).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.name == "completions" for p in params):
        return True
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return not required and any(p.kind is p.VAR_KEYWORD for p in params)


class TRLRewardFunc:
    """A TorchRL reward (or a plain TRL function, run isolated) as a TRL reward function, built
    by :func:`as_trl_reward_func`: ``f(prompts, completions, completion_ids=None, **kwargs) ->
    list[float | None]``. Counters: :attr:`calls`, :attr:`scored`, :attr:`nonfinite` (returned
    as ``None``), :attr:`failure_counts` (executor modes).
    """

    def __init__(
        self, reward: Any, *, tokenizer=None, name: str | None = None, reward_key: NestedKey | None = None,
        columns: Sequence[str] | None = None, executor: str | Executor | RewardExecutor | None = None,
    ):
        config = reward_executor(executor)
        if isinstance(reward, TRLRewardFunc):
            raise TypeError("as_trl_reward_func: expected a TorchRL reward, got a TRLRewardFunc (already a TRL one)")
        if not callable(reward):
            raise TypeError(
                "as_trl_reward_func: expected a TorchRL module or transform, or a TRL reward function, got "
                f"{type(reward).__name__}"
            )
        if not math.isnan(config.unscorable_reward):  # TRL decides for the rows no function scored
            raise ValueError("as_trl_reward_func: RewardExecutor(unscorable_reward=) applies to RewardFunctionWrapper: "
                             "expected it unset (TRL scores the rows no function scored)")
        self.reward = reward
        self.tokenizer = tokenizer
        self.is_trl_function = is_trl_function(reward)
        if name is None and self.is_trl_function:
            name = function_names([reward])[0]  # TRL's name
        path = getattr(getattr(getattr(reward, "model", None), "config", None), "name_or_path", "")
        self.__name__ = name or (str(path).rstrip("/").split("/")[-1] if path else type(reward).__name__)
        self.reward_key = reward_key
        self.columns = list(columns) if columns is not None else None
        self.timeout = config.timeout
        self.calls = self.scored = 0  # calls received, completions scored
        self._nonfinite = WarnOnce()
        self._parsers: dict[str, Any] = {}
        self.failure_reward = config.failure_reward
        self.executor = None
        self._failures = WarnOnce()  # by (name, kind)
        if config.isolated:  # the workers run the function, or a copy of this without executor
            inner = copy.copy(self)
            inner.timeout = None  # the executor bounds each completion
            work = reward if self.is_trl_function else inner.raw_rewards
            self.executor = config.build([work], [self.__name__])

    @property
    def nonfinite(self) -> int:
        """Non-finite rewards returned as ``None``."""
        return self._nonfinite.counts["nonfinite"]

    @property
    def failure_counts(self) -> dict[str, int]:
        """Failed completions by kind (executor modes): ``{"error", "timeout", "crash"}``."""
        return {kind: self._failures.counts[(self.__name__, kind)] for kind in FAILURES}

    def shutdown(self) -> None:
        """Stop the executor's worker processes (a later call starts new ones)."""
        if self.executor is not None:
            self.executor.shutdown()

    def _torchrl_trl_warm_up(self) -> None:
        """The imports a first call would do (seconds of work), then the reward's own warm-up (see :func:`warm_up`)."""
        import trl.data_utils  # noqa: F401  is_conversational
        from torchrl.data.llm import History  # noqa: F401  rollouts_from_trl, for chat

        warm_up(self.reward)

    def __repr__(self) -> str:
        return f"TRLRewardFunc({self.__name__!r}, reward={type(self.reward).__name__})"

    def __call__(self, prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
        self.calls += 1
        if len(completions) != len(prompts):
            raise ValueError(f"TRLRewardFunc: expected one completion per prompt, got {len(prompts)} prompts and "
                             f"{len(completions)} completions")
        if not prompts:
            return []
        args = (prompts, completions, completion_ids)
        out = self._call_items(*args, kwargs) if self.executor is not None else self.raw_rewards(*args, **kwargs)
        self.scored += len(prompts)
        bad = [i for i, r in enumerate(out) if r is not None and not math.isfinite(r)]
        if bad:
            self._nonfinite.add(
                "nonfinite",
                f"reward function {self.__name__!r} scored {len(bad)} of {len(out)} completions "
                f"{[out[i] for i in bad[:3]]}; returned as None, which TRL excludes from the weighted sum "
                "(counted in .nonfinite)",
                n=len(bad),
            )
            for i in bad:
                out[i] = None
        return out

    def _call_items(self, prompts, completions, completion_ids, kwargs) -> list[float | None]:
        """Executor modes: one call per completion, with one-element lists."""
        call_kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        if not self.is_trl_function:
            self._select_columns(kwargs)  # a missing column fails here, not once per completion
        else:
            if "environments" in call_kwargs and self.executor.kind in ("process", "ray"):
                if declares(self.reward, "environments"):
                    raise TypeError(
                        f"TRLRewardFunc: reward function {self.__name__!r} takes TRL's environments (live objects), "
                        f"which executor={self.executor.kind!r} cannot send; expected executor='thread'"
                    )
                call_kwargs.pop("environments")  # only reachable through **kwargs: not sent
            # as TRL would fail, but once here rather than per completion
            check_signature(self.reward, self.__name__, list(call_kwargs), type(self).__name__)
        rewards, _ = score_items(self.executor, call_kwargs, len(prompts), [self.__name__], self._failures,
                                 type(self).__name__, self.failure_reward, "it is returned as None (excluded by TRL)")
        return rewards[0]  # NaN/inf: counted by __call__

    def raw_rewards(self, prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
        """The rewards in the caller, without an executor (``None`` and non-finite values kept)."""
        if self.is_trl_function:  # called as TRL calls it
            call_kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
            return call_functions([self.reward], [self.__name__], call_kwargs, self.timeout, type(self).__name__)[0]
        columns = self._select_columns(kwargs)
        with torch.inference_mode():  # as TRL scores its reward models
            rewards = run_with_timeout(lambda: self._score(prompts, completions, completion_ids, columns),
                                       self.timeout, f"{type(self).__name__}: reward function {self.__name__!r}")
        rewards = rewards.detach().float().cpu().reshape(len(prompts), -1)
        if rewards.shape[1] != 1:
            raise ValueError(
                f"TRLRewardFunc {self.__name__!r}: expected one reward per completion, got shape "
                f"{tuple(rewards.shape)} for {len(prompts)} completions"
            )
        return rewards[:, 0].tolist()

    def _select_columns(self, kwargs: dict) -> dict:
        columns = {k: v for k, v in kwargs.items() if k not in TRL_EXTRA_KWARGS}
        if self.columns is not None:
            missing = [c for c in self.columns if c not in columns]
            if missing:
                raise KeyError(
                    f"TRLRewardFunc {self.__name__!r}: columns {missing} were not passed by the trainer: expected "
                    f"dataset columns, got {sorted(columns)}"
                )
            columns = {c: columns[c] for c in self.columns}
        return columns

    def _call_reward(self, fn, *args):
        """``fn(*args)``, its exceptions carrying this function's name."""
        return call_function(lambda: fn(*args), self.__name__, {}, None, type(self).__name__)

    def _score(self, prompts, completions, completion_ids, columns) -> torch.Tensor:
        reward = self.reward
        chat = is_conversational(prompts)
        if hasattr(reward, "score_ids") and getattr(reward, "tokenizer", None) is not None:
            return self._score_like_trl(prompts, completions, chat)
        if chat and hasattr(reward, "score_messages"):
            return torch.as_tensor(self._call_reward(reward.score_messages, _conversations(prompts, completions)))
        if not chat and hasattr(reward, "score_texts"):
            return torch.as_tensor(self._call_reward(reward.score_texts, [p + c for p, c in zip(prompts, completions)]))
        td = rollouts_from_trl(prompts, completions, completion_ids, columns=columns, tokenizer=self.tokenizer)
        if _compat.has_own_step(reward):  # a reward parser: reads the step and "next", writes "next"
            parser = self._parser_for(reward, chat)
            next_td = td.select(*columns) if columns else td.empty()
            out = self._call_reward(_compat.transform_step, parser, td, next_td)
            return self._read_reward(out if out is not None else next_td, relative=True)
        out = self._call_reward(reward, td)
        return self._read_reward(out if isinstance(out, TensorDictBase) else td, relative=False)

    def _score_like_trl(self, prompts, completions, chat: bool) -> torch.Tensor:
        """Our HFRewardModelWrapper on the token ids TRL's ``reward_funcs=[model]`` builds:
        chat template (or text) over ``prompt + completion``, ``add_special_tokens=False``."""
        reward, tok = self.reward, self.reward.tokenizer
        if not chat:
            texts = [p + c for p, c in zip(prompts, completions)]
        elif hasattr(getattr(reward, "renderer", None), "render_messages"):
            texts = reward.renderer.render_messages(_conversations(prompts, completions))
        else:
            texts = [tok.apply_chat_template(c, tokenize=False) for c in _conversations(prompts, completions)]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        return self._call_reward(reward.score_ids, layouts.Ragged.from_list(ids))

    def _parser_for(self, parser, chat: bool):
        """The parser set up for chat (history) or text data: a shallow copy when it needs keys or a mode."""
        mode = "history" if chat else "text"
        if mode not in self._parsers:
            in_keys = list(getattr(parser, "in_keys", []) or [])
            unset_mode = _compat.parser_input_mode_unset(parser)
            if not in_keys or unset_mode:
                parser = copy.copy(parser)
            if not in_keys:
                answer = self.columns[0] if self.columns else "answer"
                parser.in_keys = [layouts.history_key("full") if chat else layouts.text_key("response"), answer]
            if unset_mode:
                first = parser.in_keys[0]
                _compat.set_parser_input_mode(parser, first[0] if isinstance(first, tuple) else mode)
            self._parsers[mode] = parser
        return self._parsers[mode]

    def _read_reward(self, td: TensorDictBase, *, relative: bool) -> torch.Tensor:
        if self.reward_key is not None:
            candidates = [strip_next(key_tuple(self.reward_key)) if relative else key_tuple(self.reward_key)]
        elif relative:
            candidates = [("reward",)]
        else:
            out_keys = [key_tuple(k) for k in getattr(self.reward, "out_keys", []) or []]
            candidates = [tuple(layouts.REWARD_KEY), ("reward",)] + [k for k in out_keys if "reward" in k[-1]]
        for key in candidates:
            if layouts.has_key(td, key):
                values = layouts.read_column(td, key)
                return torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in values])
        raise KeyError(
            f"TRLRewardFunc {self.__name__!r}: the reward module wrote none of the reward keys {candidates}: expected "
            f"reward_key= of one it writes: {layouts.available_keys(td)}"
        )


def as_trl_reward_func(
    reward: Any, *, tokenizer=None, name: str | None = None, reward_key: NestedKey | None = None,
    columns: Sequence[str] | None = None, executor: str | Executor | RewardExecutor | None = None,
) -> TRLRewardFunc:
    """Wrap a TorchRL reward as a TRL reward function (for ``reward_funcs=[...]``).

    Args:
        reward (module, transform or callable): our ``HFRewardModelWrapper`` (scored as TRL's
            own ``reward_funcs=[model]``, micro-batched); a TorchRL reward parser such as
            ``GSM8KRewardParser`` (run as ``env.step`` runs it on :func:`rollouts_from_trl`;
            without ``in_keys`` it reads the history or response text and the ``"answer"``
            column, or ``columns[0]``); a TensorDict module writing a reward; or a plain TRL
            reward function, to use ``executor=``.

    Keyword Args:
        tokenizer (transformers tokenizer, optional): the policy tokenizer, to build text and
            tokens for chat data. Defaults to ``None``.
        name (str, optional): the name TRL logs. Defaults to ``None``: the reward model's
            directory, or the class name.
        reward_key (NestedKey, optional): where the module writes the reward. Defaults to
            ``None``: ``("next", "reward")``, ``"reward"`` or an out_key named ``*reward*``.
        columns (sequence of str, optional): dataset columns to pass; a missing one is a
            ``KeyError``. Defaults to ``None`` (all).
        executor (RewardExecutor, str or concurrent.futures.Executor, optional): how the reward
            runs (failures of isolated kinds counted in :attr:`TRLRewardFunc.failure_counts`).
            Defaults to ``None``: ``RewardExecutor()``.

    Returns:
        a :class:`TRLRewardFunc`: exceptions carry its name, non-finite rewards become ``None``.

    Examples:
        >>> import tempfile
        >>> from torchrl_trl import HFRewardModelWrapper, testing
        >>> paths = testing.tiny_checkpoints(tempfile.mkdtemp())
        >>> reward_func = as_trl_reward_func(HFRewardModelWrapper(str(paths.reward_model)), name="rm")
        >>> reward_func.__name__
        'rm'
        >>> rewards = reward_func(prompts=[[{"role": "user", "content": "hi"}]],
        ...                       completions=[[{"role": "assistant", "content": "hello"}]], completion_ids=[[1]])
        >>> len(rewards), isinstance(rewards[0], float)
        (1, True)
    """
    return TRLRewardFunc(reward, tokenizer=tokenizer, name=name, reward_key=reward_key, columns=columns,
                         executor=executor)
