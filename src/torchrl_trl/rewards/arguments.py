"""TRL reward-function arguments, both ways: TorchRL rollouts -> the keyword arguments TRL passes
a reward function (:func:`trl_arguments`) and back (:func:`rollouts_from_trl`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, lazy_stack
from tensordict.utils import NestedKey

from torchrl_trl import layouts

from .render import InputMode, resolve_input_mode

__all__ = [
    "TRL_EXTRA_KWARGS", "InputMode", "as_messages", "check_signature", "column_keys", "declares", "input_keys",
    "is_conversational", "per_completion_items", "resolve_mode", "rollouts_from_trl", "trl_arguments",
]  # fmt: skip

#: keyword arguments TRL passes that are not dataset columns
TRL_EXTRA_KWARGS = ("trainer_state", "log_extra", "log_metric", "environments")
# reward functions take these as prompts/completions/completion_ids, not as columns
_NOT_COLUMNS = ("prompt", "completion", "completion_ids")
_NO_RESPONSE = "; on an env, attach wrapper.as_transform() (a plain module never sees the step's output)"
_DECODE = "pass tokenizer= (the policy's) to decode prompts and completions from the tokens"


def input_keys(input_mode: InputMode, columns: Mapping[str, tuple] | None, *, tokenizer: bool = False) -> list[NestedKey]:
    """Every key the arguments may be read from: prompt/response keys of ``input_mode``, tokens, mask, ``columns``."""
    history = [layouts.history_key("prompt"), layouts.history_key("response")]
    text = [layouts.text_key("prompt"), layouts.text_key("response")]
    keys = {"history": history, "text": text, "tokens": []}.get(input_mode, history + text)
    keys = keys + [layouts.token_key("response"), layouts.ATTENTION_MASK_KEY]
    if input_mode == "tokens" or (input_mode == "auto" and tokenizer):
        keys.append(layouts.token_key("prompt"))
    return keys + [k for k in (columns or {}).values() if k not in keys]


def resolve_mode(td: TensorDictBase, input_mode: InputMode, tokenizer: Any = None) -> str:
    """``"history"``, ``"text"`` or ``"tokens"`` (``"auto"``: the first present, tokens only with a
    ``tokenizer``); a ``KeyError`` naming what to use when ``td`` holds no response."""
    inputs = {"history": [[layouts.history_key("response")]], "text": [[layouts.text_key("response")]]}
    if input_mode == "tokens" or (input_mode == "auto" and tokenizer is not None):
        inputs["tokens"] = [[layouts.token_key("prompt"), layouts.token_key("response")]]
    stored = (layouts.history_key("response"), layouts.text_key("response"))
    tokens_only = (tokenizer is None and layouts.has_key(td, layouts.token_key("response"))
                   and not any(layouts.has_key(td, key) for key in stored))
    hint = f". These rollouts hold only tokens (ChatEnv(input_mode='tokens')): {_DECODE}" if tokens_only else ""
    return resolve_input_mode(td, input_mode, inputs, owner="RewardFunctionWrapper", what="response to score",
                              hint=hint or _NO_RESPONSE)


def column_keys(td: TensorDictBase, columns: Mapping[str, tuple] | None) -> dict[str, tuple]:
    """``{argument: rollout key}``: ``columns``, or every top-level non-tensor field not TorchRL's."""
    if columns is not None:
        return dict(columns)
    sample = layouts.first_member(td)
    own = (*layouts.TORCHRL_ROOT_KEYS, *_NOT_COLUMNS)
    non_tensor = (NonTensorData, NonTensorStack)
    return {k: (k,) for k in sample.keys() if k not in own and isinstance(sample.get(k), non_tensor)}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (NonTensorData, NonTensorStack)):
        return value.tolist()
    return value


def trl_arguments(
    td: TensorDictBase, *, input_mode: InputMode = "auto", columns: Mapping[str, tuple] | None = None,
    tokenizer=None, funcs: Sequence[Callable] = (), names: Sequence[str] = (),
    columns_td: TensorDictBase | None = None,
) -> dict:
    """The keyword arguments TRL would pass for the ``N`` rollouts in ``td`` (row-major):
    ``prompts``, ``completions``, ``completion_ids`` (``None`` without tokens: a ``KeyError``
    if one of ``funcs`` declares it) and one ``N``-list per column (else from ``columns_td``).

    With ``tokenizer`` (the policy's) each completion is its response ids decoded as TRL decodes
    them (``skip_special_tokens=True``); without it, the stored chat or text (rows that lost
    tokens to padding are refused). In ``"tokens"`` mode prompts are the prompt ids decoded with
    their special tokens (the text the policy saw), completions strings.

    >>> from tensordict import TensorDict
    >>> td = TensorDict({"text": {"prompt": ["q"], "response": ["a"]}, "answer": ["4"]}, [1])
    >>> trl_arguments(td)
    {'prompts': ['q'], 'completions': ['a'], 'completion_ids': [None], 'answer': ['4']}
    """
    mode = resolve_mode(td, input_mode, tokenizer)
    response = layouts.token_key("response")
    ids = layouts.read_tokens(td, "response").tolist() if layouts.has_key(td, response) else None
    needs = [name for f, name in zip(funcs, names) if declares(f, "completion_ids")] if ids is None else []
    if needs:
        raise KeyError(
            f"RewardFunctionWrapper: reward functions {needs} take completion_ids: expected {response!r} in the "
            f"rollouts. Available keys: {layouts.available_keys(td)}"
        )
    if tokenizer is not None and ids is None:
        raise KeyError(
            f"RewardFunctionWrapper: tokenizer= decodes completions from the response ids: expected {response!r} in "
            f"the rollouts. Available keys: {layouts.available_keys(td)}"
        )
    if mode == "tokens":
        prompt_ids = layouts.read_tokens(td, "prompt").tolist()
        prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
    else:
        read = layouts.read_history if mode == "history" else layouts.read_text
        prompts = read(td, "prompt")  # as the env wrote them (the readers refuse rows that lost tokens)
    if tokenizer is None:
        completions = read(td, "response")
    else:  # decoded as TRL decodes them
        completions = tokenizer.batch_decode(ids, skip_special_tokens=True)
        completions = [as_messages(c) for c in completions] if mode == "history" else completions
    completion_ids = ids if ids is not None else [None] * layouts.batch_numel(td)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
    for name, key in column_keys(td, columns).items():
        source = td if layouts.has_key(td, key) else columns_td
        if source is None or not layouts.has_key(source, key):
            raise KeyError(f"RewardFunctionWrapper: column {name!r}: expected {key!r} in the rollouts, not found. "
                           f"Available keys: {layouts.available_keys(td)}")
        kwargs[name] = [_plain(v) for v in layouts.read_column(source, key)]
    return kwargs


def per_completion_items(call_kwargs: dict, n: int, n_funcs: int = 1) -> tuple[list[tuple[int, dict]], dict]:
    """``(items, shared)`` for an item executor: one ``(function index, kwargs)`` item per function
    and completion (function-major), per-completion arguments cut to one-element lists.

    >>> items, shared = per_completion_items({"prompts": ["a", "b"], "trainer_state": None, "log_metric": print}, 2)
    >>> items, shared
    ([(0, {'prompts': ['a'], 'log_metric': None}), (0, {'prompts': ['b'], 'log_metric': None})], {'trainer_state': None})
    """
    loggers = {k: None for k in ("log_extra", "log_metric") if k in call_kwargs}
    rest = {k: v for k, v in call_kwargs.items() if k not in loggers}
    per_item = {k: v for k, v in rest.items() if k != "trainer_state" and isinstance(v, (list, tuple)) and len(v) == n}
    shared = {k: v for k, v in rest.items() if k not in per_item}
    items = [(i, {**{k: [v[row]] for k, v in per_item.items()}, **loggers}) for i in range(n_funcs) for row in range(n)]
    return items, shared


def check_signature(func: Callable, name: str, provided: Sequence[str], owner: str) -> None:
    """A ``KeyError`` if ``func`` requires an argument not ``provided``, a ``TypeError`` if it refuses one."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return
    params = sig.parameters.values()
    columns = [k for k in provided if k not in ("prompts", "completions", "completion_ids", *TRL_EXTRA_KWARGS)]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.name not in provided:
            raise KeyError(
                f"{owner}: reward function {name!r} requires the argument {p.name!r}, not a column passed "
                f"({columns}); expected columns={{{p.name!r}: <key>}}"
            )
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unexpected = [k for k in provided if k not in sig.parameters]
        if unexpected:
            raise TypeError(
                f"{owner}: reward function {name!r} does not accept {unexpected} (TRL passes every column and "
                "trainer_state/log_extra/log_metric): expected **kwargs in its signature"
            )


def declares(func: Callable, arg: str) -> bool:
    """Whether ``func``'s signature names ``arg`` (not just ``**kwargs``)."""
    try:
        return arg in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def is_conversational(prompts: Sequence[Any]) -> bool:
    """Whether TRL reads these prompts as chat (``trl.data_utils.is_conversational``)."""
    from trl.data_utils import is_conversational as trl_is_conversational

    if not prompts or (isinstance(prompts[0], list) and not prompts[0]):
        return False
    return trl_is_conversational({"prompt": prompts[0]})


def as_messages(completion: Any) -> list[dict]:
    """A completion as chat messages (a string is one assistant message)."""
    return [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)


def rollouts_from_trl(
    prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None = None,
    *, columns: dict[str, Sequence[Any]] | None = None, tokenizer=None,
) -> TensorDictBase:
    """TorchRL rollouts (a lazy stack of ``N`` TensorDicts) from TRL's reward-function arguments:
    history (chat), text (chat: with ``tokenizer``'s template), tokens (``completion_ids``, the
    prompt's with ``tokenizer``), each column at the top level.

    >>> td = rollouts_from_trl(["2+2="], ["4"], [[19]], columns={"answer": ["4"]})
    >>> list(td["text", "full"]), td["tokens", "response"][0].tolist(), list(td["answer"])
    (['2+2=4'], [19], ['4'])
    """
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"rollouts_from_trl: expected one completion per prompt, got {n} prompts and "
                         f"{len(completions)} completions")
    if completion_ids is not None and len(completion_ids) != n:
        raise ValueError(f"rollouts_from_trl: expected one completion_ids per prompt, got {n} prompts and "
                         f"{len(completion_ids)} completion_ids")
    columns = columns or {}
    for name, values in columns.items():
        if len(values) != n:
            raise ValueError(
                f"rollouts_from_trl: column {name!r} has {len(values)} values, expected {n} (one per completion)"
            )
    chat = is_conversational(prompts)
    if chat:
        from torchrl.data.llm import History

    rows = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        row: dict[str, Any] = {}
        text = {"response": "".join(m.get("content") or "" for m in as_messages(completion))}
        prompt_text = None if chat else prompt
        if chat:
            completion = as_messages(completion)
            row["history"] = {
                "prompt": History.from_chats([prompt])[0],
                "response": History.from_chats([completion])[0],
                "full": History.from_chats([list(prompt) + list(completion)])[0],
            }
            if tokenizer is not None:
                prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        if prompt_text is not None:
            text.update(prompt=prompt_text, full=prompt_text + text["response"])
        row["text"] = {k: NonTensorData(v) for k, v in text.items()}
        tokens = {}
        if completion_ids is not None:
            tokens["response"] = torch.as_tensor(list(completion_ids[i]), dtype=torch.long)
        if tokenizer is not None and prompt_text is not None:
            prompt_ids = tokenizer(str(prompt_text), add_special_tokens=False)["input_ids"]
            tokens["prompt"] = torch.as_tensor(prompt_ids, dtype=torch.long)
            if "response" in tokens:
                tokens["full"] = torch.cat([tokens["prompt"], tokens["response"]])
        if tokens:
            row["tokens"] = tokens
        for name, values in columns.items():
            value = values[i]
            row[name] = value if isinstance(value, torch.Tensor) else NonTensorData(value)
        rows.append(TensorDict(row, batch_size=[]))
    return lazy_stack(rows)
