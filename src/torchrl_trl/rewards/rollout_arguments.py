"""TorchRL rollouts -> the keyword arguments TRL passes a reward function.

The one place that maps a tensordict of LLM rollouts (padded or ragged, history or text)
onto ``GRPOTrainer._calculate_rewards``'s call: ``prompts``, ``completions``,
``completion_ids`` and one per-row list per dataset column. The inverse (TRL's arguments
-> rollouts) is :func:`torchrl_trl.rewards.trl_rollouts.rollouts_from_trl`.
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

__all__ = ["InputMode", "column_keys", "input_keys", "resolve_mode", "trl_arguments"]

InputMode = Literal["auto", "history", "text"]

# reward functions take these as prompts/completions/completion_ids, not as columns
_NOT_COLUMNS = ("prompt", "completion", "completion_ids")
_NO_RESPONSE = (
    ". A reward needs the policy's output; on an env that is the root tensordict of a step, "
    "which env.append_transform(RewardFunctionWrapper(...)) never sees (TorchRL calls a plain "
    "module on the reset and 'next' tensordicts): attach RewardFunctionTransform(...) (or "
    "wrapper.as_transform()) to the env instead"
)


def input_keys(input_mode: InputMode, columns: Mapping[str, tuple] | None) -> list[NestedKey]:
    """Every key the arguments may be read from: the prompt/response keys of ``input_mode``
    (history and text for ``"auto"``), the response tokens and mask, and ``columns``.

    >>> input_keys("text", {"answer": ("answer",)})  # doctest: +NORMALIZE_WHITESPACE
    [('text', 'prompt'), ('text', 'response'), ('tokens', 'response'),
     ('masks', 'all_attention_mask'), ('answer',)]
    """
    history = [layouts.history_key("prompt"), layouts.history_key("response")]
    text = [layouts.text_key("prompt"), layouts.text_key("response")]
    keys = {"history": history, "text": text}.get(input_mode, history + text)
    keys = keys + [layouts.token_key("response"), layouts.ATTENTION_MASK_KEY]
    return keys + [k for k in (columns or {}).values() if k not in keys]


def resolve_mode(td: TensorDictBase, input_mode: InputMode) -> str:
    """``"history"`` or ``"text"``: ``input_mode``, or for ``"auto"`` history when
    ``("history", "response")`` is present (see :func:`.render.resolve_input_mode`). Raises
    a ``KeyError`` naming what to use when the rollouts hold no response at all (e.g. an
    env's reset or ``next`` tensordict)."""
    inputs = {
        "history": [[layouts.history_key("response")]],
        "text": [[layouts.text_key("response")]],
    }
    return resolve_input_mode(td, input_mode, inputs, what="response to score", hint=_NO_RESPONSE)


def column_keys(td: TensorDictBase, columns: Mapping[str, tuple] | None) -> dict[str, tuple]:
    """``{argument name: rollout key}``: ``columns``, or (``None``) every top-level
    non-tensor field that is not one of TorchRL's own keys, as TRL passes every dataset
    column."""
    if columns is not None:
        return dict(columns)
    sample = td
    while hasattr(sample, "tensordicts") and sample.tensordicts:
        sample = sample.tensordicts[0]
    out = {}
    for key in sample.keys():
        if key in layouts.TORCHRL_ROOT_KEYS or key in _NOT_COLUMNS:
            continue
        if isinstance(sample.get(key), (NonTensorData, NonTensorStack)):
            out[key] = (key,)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (NonTensorData, NonTensorStack)):
        return value.tolist()
    return value


def trl_arguments(
    td: TensorDictBase,
    *,
    input_mode: InputMode = "auto",
    columns: Mapping[str, tuple] | None = None,
    tokenizer=None,
    funcs: Sequence[Callable] = (),
    names: Sequence[str] = (),
    columns_td: TensorDictBase | None = None,
) -> dict:
    """The keyword arguments TRL would pass for the rollouts in ``td`` (flattened
    row-major, ``N`` rows): ``prompts``, ``completions``, ``completion_ids`` (lists of
    ints, or ``N`` ``None`` without response tokens) and one ``N``-list per column.

    - history rollouts: ``prompts[i]``/``completions[i]`` are lists of plain
      ``{"role", "content"}`` messages (TRL's conversational format);
    - text rollouts: ``("text", "prompt")`` and ``("text", "response")`` strings;
    - ``tokenizer``: completion texts are decoded from the response ids with
      ``skip_special_tokens=True``, as TRL decodes them.

    ``funcs``/``names``: a function declaring ``completion_ids`` on rollouts without
    response tokens raises a ``KeyError`` naming it instead of receiving ``None``. Columns
    missing from ``td`` are looked up in ``columns_td`` (the ``next`` tensordict of a step).

    >>> from tensordict import TensorDict
    >>> td = TensorDict({"text": {"prompt": ["q"], "response": ["a"]}, "answer": ["4"]}, [1])
    >>> trl_arguments(td)
    {'prompts': ['q'], 'completions': ['a'], 'completion_ids': [None], 'answer': ['4']}
    """
    mode = resolve_mode(td, input_mode)
    n = layouts.batch_numel(td)
    has_ids = layouts.has_key(td, layouts.token_key("response"))
    ids = layouts.read_tokens(td, "response").tolist() if has_ids else None
    if ids is None:
        needs = [name for f, name in zip(funcs, names) if declares(f, "completion_ids")]
        if needs:
            raise KeyError(
                f"reward functions {needs} take completion_ids, but the rollouts hold no "
                f"{layouts.token_key('response')!r} to read them from. Available keys: "
                f"{layouts.available_keys(td)}"
            )
    decoded = None
    if tokenizer is not None:
        if ids is None:
            raise KeyError(
                f"tokenizer= decodes completions from {layouts.token_key('response')!r}, which "
                f"is missing. Available keys: {layouts.available_keys(td)}"
            )
        decoded = tokenizer.batch_decode(ids, skip_special_tokens=True)
    if mode == "history":
        prompts = layouts.read_history(td, "prompt")
        if decoded is not None:
            completions = [[{"role": "assistant", "content": c}] for c in decoded]
        else:
            completions = layouts.read_history(td, "response")
    else:
        prompts = layouts.read_text(td, "prompt")
        completions = decoded if decoded is not None else layouts.read_text(td, "response")
    completion_ids = ids if ids is not None else [None] * n
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
    for name, key in column_keys(td, columns).items():
        source = td if layouts.has_key(td, key) else columns_td
        if source is None or not layouts.has_key(source, key):
            raise KeyError(
                f"column {name!r}: key {key!r} not found in the rollouts. Available "
                f"keys: {layouts.available_keys(td)}"
            )
        kwargs[name] = [_plain(v) for v in layouts.read_column(source, key)]
    return kwargs
