"""TRL-style reward functions scoring TorchRL LLM rollouts (TRL -> TorchRL).

A TRL reward function is a plain callable (sync or ``async``)::

    f(prompts, completions, completion_ids, **columns) -> list[float | None]

:class:`RewardFunctionWrapper` calls one or more of them on TorchRL rollouts with the
arguments ``GRPOTrainer._calculate_rewards`` would pass, combines them the way TRL does
(weighted ``nansum``; ``None`` excluded, not zero) and writes the reward where TorchRL's
GRPO pipeline reads it (``("next", "reward")``, shaped ``[*B, 1, 1]``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Literal

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase
from tensordict.utils import NestedKey
from torchrl.envs import Transform

from torchrl_trl import layouts
from torchrl_trl.rewards.executors import FailureCounter, failure_value, make_item_executor, merge_logs

__all__ = ["RewardFunctionError", "RewardFunctionWrapper", "callable_name", "is_async_callable"]

InputMode = Literal["auto", "history", "text"]

#: keyword arguments TRL passes that are not dataset columns
TRL_EXTRA_KWARGS = ("trainer_state", "log_extra", "log_metric", "environments")


def callable_name(func: Callable) -> str:
    """The name TRL logs a reward function under (``__name__``, or the class name)."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async_callable(func: Callable) -> bool:
    """Whether calling ``func`` returns a coroutine (functions, partials, callable objects)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        getattr(type(func), "__call__", None)
    )


class RewardFunctionError(RuntimeError):
    """A reward function raised an exception that cannot be re-raised as its own type
    with the function's name (the original is the ``__cause__``)."""


def named_error(err: BaseException, name: str) -> BaseException:
    """``err`` re-created with the reward function's ``name`` in its message, keeping its
    type where the type takes a message (so ``except KeyError`` still works); raise the
    result ``from err``."""
    message = f"reward function {name!r} raised {type(err).__name__}: {err}"
    try:
        new = type(err)(message)
    except Exception:
        return RewardFunctionError(message)
    return new if name in str(new) else RewardFunctionError(message)


class FunctionTimeout(TimeoutError):
    """A reward function (or scorer) did not return within its ``timeout``."""


def run_with_timeout(fn: Callable[[], Any], timeout: float | None, what: str, *, thread: bool = False) -> Any:
    """``fn()``; with ``timeout`` (s) (or ``thread=True``) it runs in a daemon thread and a
    ``TimeoutError`` naming ``what`` is raised if it has not returned by then (Python
    cannot stop the thread; it is abandoned). Exceptions of ``fn`` are re-raised as they are."""
    if timeout is None and not thread:
        return fn()
    out: dict[str, Any] = {}
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()  # per thread

    def run():
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                out["value"] = fn()
        except BaseException as err:
            out["error"] = err

    worker = threading.Thread(target=run, name="torchrl-trl-reward", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise FunctionTimeout(f"{what} did not return within timeout={timeout}s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def _unique_names(funcs: Sequence[Callable], names: Sequence[str] | None) -> list[str]:
    if names is not None:
        if len(names) != len(funcs):
            raise ValueError(f"names has {len(names)} entries, expected {len(funcs)} (one per function)")
        if len(set(names)) != len(names):
            raise ValueError(f"names must be unique, got {list(names)}")
        return list(names)
    out, seen = [], defaultdict(int)
    for f in funcs:
        base = callable_name(f)
        out.append(base if seen[base] == 0 else f"{base}_{seen[base]}")
        seen[base] += 1
    return out


def to_rewards(output: Any, *, name: str, expected: int) -> list[float]:
    """Validate one reward function's output: ``expected`` numbers or ``None`` (-> NaN)."""
    if isinstance(output, torch.Tensor):
        output = output.reshape(-1).tolist()
    elif hasattr(output, "tolist") and not isinstance(output, (str, bytes)):
        output = output.tolist()  # numpy arrays
    if isinstance(output, (str, bytes, Mapping)) or not isinstance(output, Sequence):
        raise TypeError(
            f"reward function {name!r} must return a list of floats (or None), one per "
            f"completion; got {type(output).__name__}"
        )
    if len(output) != expected:
        raise ValueError(
            f"reward function {name!r} returned {len(output)} rewards, but {expected} were "
            f"expected (one per prompt-completion pair)"
        )
    rewards = []
    for i, value in enumerate(output):
        if value is None:
            rewards.append(math.nan)
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        elif hasattr(value, "item") and not isinstance(value, (str, bytes)):
            value = value.item()  # numpy scalars
        if not isinstance(value, numbers.Real):
            raise TypeError(
                f"reward function {name!r} returned a non-numeric reward at index {i}: "
                f"{value!r} ({type(value).__name__}); expected a float, an int or None"
            )
        rewards.append(float(value))
    return rewards


def _run_coroutines(coros: list, names: list[str], timeout: float | None = None) -> list:
    """Run coroutines concurrently (``asyncio.gather``), also from inside a running loop.
    With ``timeout`` (s), each must finish in time, else ``TimeoutError`` naming it; an
    exception raised by one is re-raised with its function's name."""

    async def one(coro, name):
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            raise FunctionTimeout(f"reward function {name!r} did not return within timeout={timeout}s")
        try:
            return task.result()
        except Exception as err:  # the function's own exception, TimeoutError included
            raise named_error(err, name) from err

    async def gather():
        return await asyncio.gather(*(one(c, n) for c, n in zip(coros, names)))

    try:
        asyncio.get_running_loop()
        inside_loop = True
    except RuntimeError:
        inside_loop = False
    if not inside_loop and timeout is None:
        return asyncio.run(gather())
    # already inside an event loop (notebooks, async servers), or bounded: a fresh loop in
    # a thread; the margin covers a coroutine that blocks the loop itself (no await)
    return run_with_timeout(
        lambda: asyncio.run(gather()),
        None if timeout is None else timeout + 1.0,
        f"the async reward functions {names} (one blocks the event loop without awaiting)",
        thread=True,
    )


def split_item_kwargs(call_kwargs: dict, n: int) -> tuple[dict, dict]:
    """``(shared, per_item)``: the arguments holding one value per completion (lists or
    tuples of length ``n``: prompts, completions, columns...) and the rest
    (``trainer_state``...). ``log_extra``/``log_metric`` are left out (the executors
    record them per item)."""
    shared, per_item = {}, {}
    for key, value in call_kwargs.items():
        if key in ("log_extra", "log_metric"):
            continue
        if key != "trainer_state" and isinstance(value, (list, tuple)) and len(value) == n:
            per_item[key] = value
        else:
            shared[key] = value
    return shared, per_item


def check_signature(func: Callable, name: str, provided: Sequence[str]) -> None:
    """Raise a clear error if ``func`` requires an argument that will not be passed."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return
    params = sig.parameters.values()
    accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    columns = [k for k in provided if k not in ("prompts", "completions", "completion_ids")]
    columns = [k for k in columns if k not in TRL_EXTRA_KWARGS]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.name not in provided:
            raise KeyError(
                f"reward function {name!r} requires the argument {p.name!r}, which is not a "
                f"column of the rollouts. Columns passed: {columns}. Name the rollout key "
                f"with columns=[...] (or columns={{{p.name!r}: <key>}})."
            )
    if not accepts_kwargs:
        unexpected = [k for k in provided if k not in sig.parameters]
        if unexpected:
            raise TypeError(
                f"reward function {name!r} does not accept the arguments {unexpected} "
                f"(TRL passes every column and trainer_state/log_extra/log_metric): add "
                f"**kwargs to its signature"
            )


class _Logs:
    """Where ``log_extra``/``log_metric`` calls from reward functions land."""

    def __init__(self):
        self.extra: dict[str, list] = defaultdict(list)
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def log_extra(self, column: str, values: list) -> None:
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(value)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (NonTensorData, NonTensorStack)):
        return value.tolist()
    return value


class RewardFunctionWrapper(Transform):
    """TRL-style reward functions as a TensorDict module and a TorchRL ``Transform``.

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

    With ``tokenizer`` given, completion texts are decoded from the token ids with
    ``skip_special_tokens=True``, exactly as TRL decodes them (TorchRL's ``("text",
    "response")`` keeps special tokens and its chat messages are stripped).

    Sync functions run one after the other, async ones concurrently (``asyncio.gather``).
    The reward is ``nansum(weights * rewards_per_func)``: a ``None`` (or NaN) is excluded,
    not counted as zero. An infinite reward is excluded the same way (TRL would let it turn
    the group's advantages into NaN), counted in :attr:`nonfinite_counts` and warned about
    once. A row for which every function returned ``None`` gets ``unscorable_reward`` (NaN
    by default, like TRL) and a warning. Both are counted in :attr:`none_counts` and
    :attr:`unscorable_count`. An exception raised by a function is re-raised (same type
    where possible, else :class:`RewardFunctionError`) with the function's name, the
    original chained as ``__cause__``.

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
            response ids as TRL does.
        reward_key: where the combined reward is written. Default ``("next", "reward")``.
        per_function_keys: also write each function's raw (unweighted) reward, NaN where it
            returned ``None``: ``True`` for ``("next", "reward_<name>")`` (next to
            ``reward_key``), or a list of keys, one per function.
        reward_shape: trailing shape of each written reward. Default ``(1, 1)``
            (``[*B, 1, 1]``, as ``GSM8KRewardParser`` writes and ``MCAdvantage``/``GRPOLoss``
            read).
        unscorable_reward: the reward of a row every function returned ``None`` for.
        names: names of the functions (default: their ``__name__``, deduplicated).
        trainer_state: passed as ``trainer_state`` (TRL passes its ``TrainerState``).
        timeout: seconds (``None``: no limit, as TRL). Without ``executor``: the limit of
            one call of each function on the whole batch; an async function is cancelled
            at the timeout, a sync one runs in a helper thread that is abandoned; either
            way a ``TimeoutError`` names the function. With ``executor``: the limit of one
            completion (counted from when a worker takes it); a late item gets
            ``failure_reward`` and the run goes on.
        executor: ``None`` (default: functions run in the caller, on the whole batch), or
            run them **one completion at a time**, isolated: ``"process"`` (a pool of
            worker processes; a worker that runs past ``timeout``, segfaults or exits is
            killed/replaced), ``"thread"`` (daemon threads; a late thread is abandoned),
            ``"ray"`` (Ray tasks, force-cancelled at the timeout) or a
            ``concurrent.futures.Executor`` (timeout from submission). Each function is
            then called with one-element lists (``prompts=[p]``, ``completions=[c]``,
            ``completion_ids=[ids]``, each column ``[v]``) and must return one reward.
            For ``"process"`` functions must be picklable (importable top-level
            functions) and so must the arguments; ``log_extra``/``log_metric`` calls are
            recorded in the worker and replayed here in completion order (a failed item
            logs ``None`` in each column). See :mod:`torchrl_trl.rewards.executors`.
        max_workers: how many completions run at once (default: the CPU count for
            process/Ray, ``min(32, cpus + 4)`` threads, an executor's own size).
        failure_reward: the reward of an item that raised, timed out or crashed its
            worker (executor modes only). ``None`` (default): excluded like TRL's
            ``None``. Failures are counted in :attr:`failure_counts` (by function and
            ``"error" | "timeout" | "crash"``) and warned about once per function and kind.
        mp_context: ``"forkserver"`` (default where available), ``"spawn"`` or ``"fork"``
            for ``executor="process"``.

    ``in_keys`` lists every key it may read: the prompt/response keys of ``input_mode``
    (both the history and the text ones for ``"auto"``), ``("tokens", "response")`` and
    ``("masks", "all_attention_mask")`` (the completion ids), and the named ``columns``.
    A function that declares a ``completion_ids`` parameter on rollouts without response
    tokens raises ``KeyError`` instead of receiving ``None``.

    Usage:
        - as a module: ``wrapper(td)`` scores the rollouts in ``td`` (any batch shape,
          padded or ragged) and writes the reward keys into it;
        - on a ``ChatEnv``: ``env.append_transform(wrapper)``; ``env.step`` writes
          ``("next", "reward")``;
        - on a replay buffer: ``rb.append_transform(wrapper)``: rollouts are scored when
          written (``extend``), not again when sampled (once attached to an env or a
          buffer, calling ``forward`` directly is a no-op). Transforms run in reverse order on
          write, so append it *after* ``MCAdvantage`` to score before the advantage.

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
        reward_shape: Sequence[int] = (1, 1),
        unscorable_reward: float = math.nan,
        names: Sequence[str] | None = None,
        trainer_state: Any = None,
        timeout: float | None = None,
        executor: str | Executor | None = None,
        max_workers: int | None = None,
        failure_reward: float | None = None,
        mp_context: str | None = None,
    ):
        funcs = [funcs] if callable(funcs) else list(funcs)
        if not funcs:
            raise ValueError("funcs must hold at least one reward function")
        for f in funcs:
            if not callable(f):
                raise TypeError(f"reward functions must be callable, got {type(f).__name__}")
        if input_mode not in ("auto", "history", "text"):
            raise ValueError(f"input_mode must be 'auto', 'history' or 'text', got {input_mode!r}")
        self.names = _unique_names(funcs, names)
        if weights is None:
            weights = [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(
                f"Number of reward weights ({len(weights)}) must match number of reward "
                f"functions ({len(funcs)})"
            )
        self.reward_key = _as_tuple(reward_key)
        if per_function_keys is True:
            prefix, leaf = self.reward_key[:-1], self.reward_key[-1]
            per_function_keys = [prefix + (f"{leaf}_{n}",) for n in self.names]
        elif per_function_keys is False or per_function_keys is None:
            per_function_keys = []
        else:
            per_function_keys = [_as_tuple(k) for k in per_function_keys]
            if len(per_function_keys) != len(funcs):
                raise ValueError(
                    f"per_function_keys has {len(per_function_keys)} keys, expected "
                    f"{len(funcs)} (one per function)"
                )
        self.per_function_keys = per_function_keys
        if isinstance(columns, Mapping):
            self.columns = {str(k): _as_tuple(v) for k, v in columns.items()}
        elif columns is not None:
            self.columns = {_as_tuple(k)[-1]: _as_tuple(k) for k in columns}
        else:
            self.columns = None
        in_keys = _mode_in_keys(input_mode) + [layouts.token_key("response"), layouts.ATTENTION_MASK_KEY]
        in_keys += [k for k in (self.columns or {}).values() if k not in in_keys]
        super().__init__(in_keys=in_keys, out_keys=[self.reward_key, *self.per_function_keys])
        self.funcs = funcs
        self.weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)
        self.input_mode = input_mode
        self.tokenizer = tokenizer
        self.reward_shape = tuple(reward_shape)
        self.unscorable_reward = float(unscorable_reward)
        self.trainer_state = trainer_state
        self.timeout = check_timeout(timeout)
        if executor is None and failure_reward is not None:
            raise ValueError("failure_reward applies with an executor (executor='process' | 'thread' | 'ray' | an Executor)")
        self.failure_reward = failure_reward
        self.executor = make_item_executor(
            executor, funcs, self.names, timeout=self.timeout, max_workers=max_workers, mp_context=mp_context
        )
        self._failures = FailureCounter(self.names, type(self).__name__)
        self.logs = _Logs()
        #: how many ``None``/NaN rewards each function returned, by name
        self.none_counts: dict[str, int] = {n: 0 for n in self.names}
        #: how many infinite rewards each function returned (excluded like ``None``), by name
        self.nonfinite_counts: dict[str, int] = {n: 0 for n in self.names}
        #: how many rows every function returned ``None`` for
        self.unscorable_count = 0
        self._warned: set[str] = set()

    @property
    def failure_counts(self) -> dict[str, dict[str, int]]:
        """Failed items (executor modes) by function name and kind: ``{"f": {"error": 0,
        "timeout": 1, "crash": 0}}``."""
        return self._failures.counts

    def shutdown(self) -> None:
        """Stop the executor's worker processes (a later call starts new ones)."""
        if self.executor is not None:
            self.executor.shutdown()

    # -- TRL arguments -------------------------------------------------------------

    def trl_arguments(self, td: TensorDictBase, columns_td: TensorDictBase | None = None) -> dict:
        """The keyword arguments TRL would pass for the rollouts in ``td`` (flattened
        row-major): ``prompts``, ``completions``, ``completion_ids``, the columns and
        ``trainer_state``/``log_extra``/``log_metric``. Columns missing from ``td`` are
        looked up in ``columns_td`` (the ``next`` tensordict of an env step)."""
        mode = self._resolve_mode(td)
        n = layouts.batch_numel(td)
        ids = (
            layouts.read_tokens(td, "response").tolist()
            if layouts.has_key(td, layouts.token_key("response"))
            else None
        )
        if ids is None:
            needs = [name for f, name in zip(self.funcs, self.names) if _declares(f, "completion_ids")]
            if needs:
                raise KeyError(
                    f"reward functions {needs} take completion_ids, but the rollouts hold no "
                    f"{layouts.token_key('response')!r} to read them from. Available keys: "
                    f"{layouts.available_keys(td)}"
                )
        decoded = None
        if self.tokenizer is not None:
            if ids is None:
                raise KeyError(
                    "RewardFunctionWrapper(tokenizer=...) decodes completions from "
                    f"{layouts.token_key('response')!r}, which is missing. Available keys: "
                    f"{layouts.available_keys(td)}"
                )
            decoded = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        if mode == "history":
            prompts = layouts.read_history(td, "prompt")
            if decoded is not None:
                completions = [[{"role": "assistant", "content": c}] for c in decoded]
            else:
                completions = layouts.read_history(td, "response")
        else:
            prompts = layouts.read_text(td, "prompt")
            completions = decoded if decoded is not None else layouts.read_text(td, "response")
        kwargs = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": ids if ids is not None else [None] * n,
        }
        for name, key in self._column_keys(td).items():
            source = td if layouts.has_key(td, key) else columns_td
            if source is None or not layouts.has_key(source, key):
                raise KeyError(
                    f"column {name!r}: key {key!r} not found in the rollouts. Available "
                    f"keys: {layouts.available_keys(td)}"
                )
            kwargs[name] = [_plain(v) for v in layouts.read_column(source, key)]
        kwargs["trainer_state"] = self.trainer_state
        kwargs["log_extra"] = self.logs.log_extra
        kwargs["log_metric"] = self.logs.log_metric
        return kwargs

    def _resolve_mode(self, td: TensorDictBase) -> str:
        if self.input_mode != "auto":
            return self.input_mode
        if layouts.has_key(td, layouts.history_key("response")):
            return "history"
        if layouts.has_key(td, layouts.text_key("response")):
            return "text"
        raise KeyError(
            "RewardFunctionWrapper: found neither ('history', 'response') nor ('text', "
            f"'response') in the rollouts. Available keys: {layouts.available_keys(td)}"
        )

    def _column_keys(self, td: TensorDictBase) -> dict[str, tuple]:
        if self.columns is not None:
            return self.columns
        sample = td
        while hasattr(sample, "tensordicts") and sample.tensordicts:
            sample = sample.tensordicts[0]
        out = {}
        for key in sample.keys():
            if key in layouts.TORCHRL_ROOT_KEYS or key in ("prompt", "completion", "completion_ids"):
                continue
            if isinstance(sample.get(key), (NonTensorData, NonTensorStack)):
                out[key] = (key,)
        return out

    # -- scoring -------------------------------------------------------------------

    def score(
        self, td: TensorDictBase, columns_td: TensorDictBase | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score the rollouts in ``td``.

        Returns:
            ``(rewards, rewards_per_func)``: float32 ``[N]`` combined rewards and
            ``[N, n_funcs]`` raw rewards (NaN for ``None``), ``N`` the flattened batch.
        """
        kwargs = self.trl_arguments(td, columns_td)
        return self.score_arguments(**kwargs)

    def score_arguments(self, prompts, completions, completion_ids, **kwargs):
        """Score TRL-style arguments directly (see :meth:`score`)."""
        n = len(prompts)
        call_kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids)
        call_kwargs.update(kwargs)
        per_func = torch.full((n, len(self.funcs)), math.nan, dtype=torch.float32)
        for func, name in zip(self.funcs, self.names):
            check_signature(func, name, list(call_kwargs))
        failed = None
        if self.executor is not None:
            failed = self._score_items(per_func, call_kwargs)
        pending = []
        for i, (func, name) in enumerate(zip(self.funcs, self.names)):
            if self.executor is not None:
                continue
            if is_async_callable(func):
                pending.append((i, name, func(**call_kwargs)))
            else:
                try:
                    out = run_with_timeout(
                        functools.partial(func, **call_kwargs), self.timeout, f"reward function {name!r}"
                    )
                except FunctionTimeout:
                    raise
                except Exception as err:
                    raise named_error(err, name) from err
                per_func[:, i] = torch.tensor(to_rewards(out, name=name, expected=n), dtype=torch.float32)
        if pending:
            outputs = _run_coroutines([c for _, _, c in pending], [nm for _, nm, _ in pending], self.timeout)
            for (i, name, _), out in zip(pending, outputs):
                per_func[:, i] = torch.tensor(
                    to_rewards(out, name=name, expected=n), dtype=torch.float32
                )
        self._count_missing(per_func, prompts, completions, failed)
        self._exclude_infinite(per_func)
        rewards = (per_func * self.weights).nansum(dim=1)
        unscorable = per_func.isnan().all(dim=1)
        self._count_unscorable(unscorable, prompts, completions)
        rewards[unscorable] = self.unscorable_reward
        return rewards, per_func

    def _score_items(self, per_func: torch.Tensor, call_kwargs: dict) -> torch.Tensor:
        """Executor modes: each function on each completion alone; fills ``per_func`` and
        returns the ``[N, n_funcs]`` mask of failed items."""
        n = per_func.shape[0]
        shared, per_item = split_item_kwargs(call_kwargs, n)
        loggers = {k: None for k in ("log_extra", "log_metric") if k in call_kwargs}  # set per item
        items = [
            (i, {**{k: [v[row]] for k, v in per_item.items()}, **loggers})
            for i in range(len(self.funcs))
            for row in range(n)
        ]
        results = self.executor.run(items, shared)
        failed = torch.zeros(per_func.shape, dtype=torch.bool)
        note = (
            "it is excluded like None"
            if self.failure_reward is None
            else f"its reward is failure_reward={self.failure_reward}"
        )
        for i, name in enumerate(self.names):
            mine = results[i * n : (i + 1) * n]
            for row, result in enumerate(mine):
                if result.status == "ok":
                    per_func[row, i] = to_rewards(result.value, name=name, expected=1)[0]
                else:
                    failed[row, i] = True
                    per_func[row, i] = failure_value(self.failure_reward)
                    self._failures.add(name, result, note)
            columns, metrics = merge_logs(mine)
            for column, values in columns.items():
                self.logs.log_extra(column, values)
            for metric, value in metrics:
                self.logs.log_metric(metric, value)
        return failed

    def _exclude_infinite(self, per_func) -> None:
        infinite = per_func.isinf()
        for name, count in zip(self.names, infinite.sum(0).tolist()):
            self.nonfinite_counts[name] += count
            if count and f"inf:{name}" not in self._warned:
                self._warned.add(f"inf:{name}")
                warnings.warn(
                    f"reward function {name!r} returned an infinite reward for {count} of "
                    f"{per_func.shape[0]} completions; they are excluded like None (counted in "
                    "RewardFunctionWrapper.nonfinite_counts). Warning once.",
                    stacklevel=4,
                )
        per_func[infinite] = math.nan

    def _count_missing(self, per_func, prompts, completions, failed=None) -> None:
        missing = per_func.isnan()
        if failed is not None:  # counted as failures, not as None
            missing &= ~failed
        for name, count in zip(self.names, missing.sum(0).tolist()):
            self.none_counts[name] += count
            if count and name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"reward function {name!r} returned None for {count} of {len(prompts)} "
                    "completions; they are excluded from the weighted sum (counted in "
                    "RewardFunctionWrapper.none_counts). Warning once.",
                    stacklevel=4,
                )

    def _count_unscorable(self, unscorable, prompts, completions) -> None:
        if unscorable.any():
            self.unscorable_count += int(unscorable.sum())
            row = int(unscorable.nonzero()[0])
            if "__unscorable__" not in self._warned:
                self._warned.add("__unscorable__")
                warnings.warn(
                    f"All reward functions returned None for {int(unscorable.sum())} "
                    f"completion(s) (or an infinite value, or failed in the executor), e.g. prompt={prompts[row]!r}, completion="
                    f"{completions[row]!r}; their reward is {self.unscorable_reward} "
                    "(counted in RewardFunctionWrapper.unscorable_count). Warning once.",
                    stacklevel=4,
                )

    def _write(self, td: TensorDictBase, rewards, per_func, strip_next: bool) -> TensorDictBase:
        shape = tuple(td.batch_size) + self.reward_shape
        items = [(self.reward_key, rewards)]
        items += [(k, per_func[:, i]) for i, k in enumerate(self.per_function_keys)]
        for key, value in items:
            if strip_next and key[0] == "next" and len(key) > 1:
                key = key[1:]
            td.set(key, value.reshape(shape))
        return td

    # -- module / transform entry points --------------------------------------------

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Score ``tensordict`` and write the reward keys into it. Inside a replay buffer
        this is the sampling path: rollouts were scored when written, so it is a no-op."""
        if self.__dict__.get("_container") is not None:
            return tensordict
        rewards, per_func = self.score(tensordict)
        return self._write(tensordict, rewards, per_func, strip_next=False)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        # replay-buffer write (``extend``)
        rewards, per_func = self.score(tensordict)
        return self._write(tensordict, rewards, per_func, strip_next=False)

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        # env.step: the policy's output is in ``tensordict``, the reward goes to ``next``
        rewards, per_func = self.score(tensordict, next_tensordict)
        return self._write(next_tensordict, rewards, per_func, strip_next=True)

    def transform_output_spec(self, output_spec):
        # out_keys are rollout keys ("next", "reward"); specs are relative to "next"
        output_spec = output_spec.clone()
        if "full_reward_spec" in output_spec.keys():
            output_spec["full_reward_spec"] = self.transform_reward_spec(
                output_spec["full_reward_spec"]
            )
        return output_spec

    def transform_reward_spec(self, reward_spec):
        from torchrl.data import Composite, Unbounded

        shape = reward_spec.shape + self.reward_shape
        for key in self.out_keys:
            key = key[1:] if key[0] == "next" and len(key) > 1 else key
            if len(key) == 1:
                reward_spec.set(key[0], Unbounded(shape))
            else:
                reward_spec.update(Composite({key: Unbounded(shape)}, shape=reward_spec.shape))
        return reward_spec

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(funcs={self.names}, weights={self.weights.tolist()}, "
            f"reward_key={self.reward_key}, input_mode={self.input_mode!r}"
            + (f", executor={self.executor!r}" if self.executor is not None else "")
            + ")"
        )


def _as_tuple(key: NestedKey) -> tuple:
    return (key,) if isinstance(key, str) else tuple(key)


def _mode_in_keys(mode: str) -> list[NestedKey]:
    history = [layouts.history_key("prompt"), layouts.history_key("response")]
    text = [layouts.text_key("prompt"), layouts.text_key("response")]
    return {"history": history, "text": text}.get(mode, history + text)


def _declares(func: Callable, arg: str) -> bool:
    """Whether ``func``'s signature names ``arg`` (not just ``**kwargs``)."""
    try:
        return arg in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
