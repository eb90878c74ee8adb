"""TorchRL rollouts -> the keyword arguments TRL passes a reward function (``prompts``,
``completions``, ``completion_ids``, columns); the inverse is
:func:`torchrl_trl.rewards.trl_rollouts.rollouts_from_trl`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase
from tensordict.utils import NestedKey

from torchrl_trl import layouts

from .calling import declares
from .render import resolve_input_mode
from .trl_rollouts import as_messages

__all__ = ["InputMode", "column_keys", "input_keys", "resolve_mode", "trl_arguments"]

InputMode = Literal["auto", "history", "text", "tokens"]

# reward functions take these as prompts/completions/completion_ids, not as columns
_NOT_COLUMNS = ("prompt", "completion", "completion_ids")
_NO_RESPONSE = "; on an env, attach wrapper.as_transform() (a plain module never sees the step's output)"
_DECODE = "pass tokenizer= (the policy's) to decode prompts and completions from the tokens"


def input_keys(input_mode: InputMode, columns: Mapping[str, tuple] | None, *, tokenizer: bool = False) -> list[NestedKey]:
    """Every key the arguments may be read from: prompt/response keys of ``input_mode``,
    response tokens and mask, the prompt tokens where prompts are decoded from tokens
    (``"tokens"``, or ``"auto"`` with a ``tokenizer``), and ``columns``.

    >>> input_keys("text", {"answer": ("answer",)})  # doctest: +NORMALIZE_WHITESPACE
    [('text', 'prompt'), ('text', 'response'), ('tokens', 'response'),
     ('masks', 'all_attention_mask'), ('answer',)]
    """
    history = [layouts.history_key("prompt"), layouts.history_key("response")]
    text = [layouts.text_key("prompt"), layouts.text_key("response")]
    keys = {"history": history, "text": text, "tokens": []}.get(input_mode, history + text)
    keys = keys + [layouts.token_key("response"), layouts.ATTENTION_MASK_KEY]
    if input_mode == "tokens" or (input_mode == "auto" and tokenizer):
        keys.append(layouts.token_key("prompt"))
    return keys + [k for k in (columns or {}).values() if k not in keys]


def resolve_mode(td: TensorDictBase, input_mode: InputMode, tokenizer: Any = None) -> str:
    """``"history"``, ``"text"`` or ``"tokens"`` (``"auto"``: history when
    ``("history", "response")`` is present, else text, else tokens with a ``tokenizer``); a
    ``KeyError`` naming what to use when ``td`` holds no response (or only tokens and no
    ``tokenizer`` to decode them)."""
    inputs = {"history": [[layouts.history_key("response")]], "text": [[layouts.text_key("response")]]}
    if input_mode == "tokens" or (input_mode == "auto" and tokenizer is not None):
        inputs["tokens"] = [[layouts.token_key("prompt"), layouts.token_key("response")]]
    if input_mode == "tokens" and tokenizer is None:
        raise ValueError(f"RewardFunctionWrapper: input_mode='tokens': {_DECODE}")
    stored = (layouts.history_key("response"), layouts.text_key("response"))
    tokens_only = (tokenizer is None and layouts.has_key(td, layouts.token_key("response"))
                   and not any(layouts.has_key(td, key) for key in stored))
    hint = f". These rollouts hold only tokens (ChatEnv(input_mode='tokens')): {_DECODE}" if tokens_only else ""
    return resolve_input_mode(td, input_mode, inputs, owner="RewardFunctionWrapper", what="response to score",
                              hint=hint or _NO_RESPONSE)


def column_keys(td: TensorDictBase, columns: Mapping[str, tuple] | None) -> dict[str, tuple]:
    """``{argument: rollout key}``: ``columns``, or every top-level non-tensor field that is
    not one of TorchRL's own keys."""
    if columns is not None:
        return dict(columns)
    sample = td
    while hasattr(sample, "tensordicts") and sample.tensordicts:
        sample = sample.tensordicts[0]
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
    if one of ``funcs`` declares it) and one ``N``-list per column (looked up in
    ``columns_td`` when missing from ``td``).

    Tokens are the truth: with ``tokenizer`` (the policy's) each completion is its response
    ids decoded as TRL decodes them (``skip_special_tokens=True``: no EOS), one assistant
    message for history. Without it, completions are the stored chat (history) or text, read
    through :mod:`torchrl_trl.layouts`, which refuses rows that lost tokens to padding.
    Prompts are the stored chat or text; in ``"tokens"`` mode (rollouts of
    ``ChatEnv(input_mode="tokens")``, ``tokenizer`` required) the prompt ids decoded with
    their special tokens (the text the policy saw) and completions are strings.

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
            f"RewardFunctionWrapper: tokenizer= decodes completions from {response!r}, which is missing. "
            f"Available keys: {layouts.available_keys(td)}"
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
            raise KeyError(f"RewardFunctionWrapper: column {name!r}: key {key!r} not found in the rollouts. "
                           f"Available keys: {layouts.available_keys(td)}")
        kwargs[name] = [_plain(v) for v in layouts.read_column(source, key)]
    return kwargs
