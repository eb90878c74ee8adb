"""Ready formats: map a sampled batch of rollouts to the columns a TRL trainer reads.

A format is a :class:`BufferFormat`: the keys it needs, a vectorised ``convert(batch) ->
{column: [one value per row]}`` built on :mod:`torchrl_trl.layouts`, and the
``datasets`` features of those columns. Register new ones (DPO, KTO, ...) with
:func:`register_format`; ``TorchRLBufferDataset(format=...)`` takes a registered name or
a :class:`BufferFormat`.

Built-in formats (keys are TorchRL's LLM layout, see :mod:`torchrl_trl.layouts`):

==========================  =========================================  ==========================
name                        columns                                    read from
==========================  =========================================  ==========================
``"sft"``                   ``prompt``, ``completion`` (str)           ``text.prompt/response``
``"sft_conversational"``    ``prompt``, ``completion`` (messages)      ``history.prompt/response``
``"sft_messages"``          ``messages`` (messages)                    ``history.full``
``"sft_tokenized"``         ``input_ids``, ``completion_mask`` (ints)  ``tokens.prompt/response``
``"grpo"``                  ``prompt`` (str, chat template applied)    ``text.prompt``
``"grpo_conversational"``   ``prompt`` (messages)                      ``history.prompt``
==========================  =========================================  ==========================

"messages" are lists of plain ``{"role", "content"}`` dicts (TRL's conversational format).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts
from . import features as F
from .columns import array_rows, read_token_ids

__all__ = [
    "BufferFormat",
    "available_formats",
    "get_format",
    "register_format",
]


@dataclass(frozen=True)
class BufferFormat:
    """How to turn a sampled batch into trainer columns.

    Attributes:
        name: registry name.
        required_keys: keys every sample must hold (checked before the first batch, so a
            wrong format fails at once, naming the missing key and the available ones).
        convert: ``convert(batch: TensorDictBase) -> dict[str, list]``, one value per row
            (the batch's leading dims flattened). Vectorised: read each key once.
        features: ``features() -> dict[str, datasets feature]`` for the columns
            ``convert`` returns (a callable so ``datasets`` is imported only when used).
        description: one line for docs and ``repr``.

    A format of one's own, read from a TorchRL rollout batch (register it to use it by
    name, see :func:`register_format`):

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl_trl import layouts
    >>> from torchrl_trl.data import features
    >>> n_tokens = BufferFormat(
    ...     "n_tokens", (layouts.token_key("full"),),
    ...     convert=lambda td: {"n_tokens": layouts.read_tokens(td, "full").lengths.tolist()},
    ...     features=lambda: {"n_tokens": features.token_list()},
    ...     description="how many tokens each rollout holds")
    >>> batch = TensorDict({"tokens": {"full": torch.ones(2, 3, dtype=torch.long)}}, [2])
    >>> n_tokens(batch)
    {'n_tokens': [3, 3]}
    >>> n_tokens.missing_keys(TensorDict({}, [2]))
    [('tokens', 'full')]
    """

    name: str
    required_keys: tuple[NestedKey, ...]
    convert: Callable[[TensorDictBase], dict[str, list]]
    features: Callable[[], dict[str, Any]]
    description: str = field(default="", compare=False)

    def missing_keys(self, td: TensorDictBase) -> list[NestedKey]:
        return [k for k in self.required_keys if not layouts.has_key(td, k)]

    def __call__(self, td: TensorDictBase) -> dict[str, list]:
        return self.convert(td)


_FORMATS: dict[str, BufferFormat] = {}


def register_format(fmt: BufferFormat, *, overwrite: bool = False) -> BufferFormat:
    """Add ``fmt`` to the registry under ``fmt.name`` (returns it, so usable inline).

    Raises ``ValueError`` when the name is taken, unless ``overwrite``.

    >>> from torchrl_trl import layouts
    >>> from torchrl_trl.data import features
    >>> answers = register_format(BufferFormat(
    ...     "answers_only", (layouts.text_key("response"),),
    ...     convert=lambda td: {"completion": layouts.read_text(td, "response")},
    ...     features=lambda: {"completion": features.string()}), overwrite=True)
    >>> get_format("answers_only") is answers
    True
    >>> register_format(answers)
    Traceback (most recent call last):
    ...
    ValueError: format 'answers_only' is already registered (pass overwrite=True to replace it)
    """
    if not isinstance(fmt, BufferFormat):
        raise TypeError(f"register_format expects a BufferFormat, got {type(fmt).__name__}")
    if fmt.name in _FORMATS and not overwrite:
        raise ValueError(f"format {fmt.name!r} is already registered (pass overwrite=True to replace it)")
    _FORMATS[fmt.name] = fmt
    return fmt


def get_format(fmt: str | BufferFormat) -> BufferFormat:
    """A registered format by name (or ``fmt`` itself); an unknown name raises
    ``ValueError`` listing the registered ones.

    >>> fmt = get_format("sft_tokenized")
    >>> fmt.required_keys
    (('tokens', 'prompt'), ('tokens', 'response'))
    >>> get_format(fmt) is fmt
    True
    """
    if isinstance(fmt, BufferFormat):
        return fmt
    if fmt not in _FORMATS:
        raise ValueError(f"unknown format {fmt!r}; registered formats: {available_formats()}")
    return _FORMATS[fmt]


def available_formats() -> list[str]:
    """The registered format names, sorted.

    >>> {"sft", "sft_tokenized", "grpo", "dpo", "kto"} <= set(available_formats())
    True
    """
    return sorted(_FORMATS)


# ---------------------------------------------------------------------------
# Built-ins
# ---------------------------------------------------------------------------


def _sft_text(td: TensorDictBase) -> dict[str, list]:
    return {"prompt": layouts.read_text(td, "prompt"), "completion": layouts.read_text(td, "response")}


def _sft_conversational(td: TensorDictBase) -> dict[str, list]:
    return {"prompt": layouts.read_history(td, "prompt"), "completion": layouts.read_history(td, "response")}


def _sft_messages(td: TensorDictBase) -> dict[str, list]:
    return {"messages": layouts.read_history(td, "full")}


def prompt_response_ids(td: TensorDictBase) -> tuple[layouts.Ragged, layouts.Ragged]:
    """Each row's prompt then response tokens (padding removed), and a 0/1 int64 mask that
    is 1 on the response: two :class:`~torchrl_trl.layouts.Ragged` of the same lengths."""
    prompt, response = read_token_ids(td, "prompt"), read_token_ids(td, "response")
    lengths = prompt.lengths + response.lengths
    # interleave prompt and response tokens row by row with index arithmetic
    starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    within = torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)
    is_completion = within >= prompt.lengths.repeat_interleave(lengths)
    values = torch.empty(int(lengths.sum()), dtype=prompt.values.dtype)
    values[~is_completion] = prompt.values
    values[is_completion] = response.values
    return layouts.Ragged(values, lengths), layouts.Ragged(is_completion.long(), lengths)


def _sft_tokenized(td: TensorDictBase) -> dict[str, list]:
    ids, completion_mask = prompt_response_ids(td)
    # ArrayRow lists: what TRL's collator turns into tensors fastest (see columns.ArrayRow)
    return {"input_ids": array_rows(ids), "completion_mask": array_rows(completion_mask)}


def _grpo_text(td: TensorDictBase) -> dict[str, list]:
    return {"prompt": layouts.read_text(td, "prompt")}


def _grpo_conversational(td: TensorDictBase) -> dict[str, list]:
    return {"prompt": layouts.read_history(td, "prompt")}


for _fmt in (
    BufferFormat(
        "sft",
        (layouts.text_key("prompt"), layouts.text_key("response")),
        _sft_text,
        lambda: {"prompt": F.string(), "completion": F.string()},
        "prompt/completion text (SFTTrainer, prompt-completion)",
    ),
    BufferFormat(
        "sft_conversational",
        (layouts.history_key("prompt"), layouts.history_key("response")),
        _sft_conversational,
        lambda: {"prompt": F.messages(), "completion": F.messages()},
        "prompt/completion as role/content messages (SFTTrainer, conversational prompt-completion)",
    ),
    BufferFormat(
        "sft_messages",
        (layouts.history_key("full"),),
        _sft_messages,
        lambda: {"messages": F.messages()},
        "the whole chat as role/content messages (SFTTrainer, conversational language modeling)",
    ),
    BufferFormat(
        "sft_tokenized",
        (layouts.token_key("prompt"), layouts.token_key("response")),
        _sft_tokenized,
        lambda: {"input_ids": F.token_list(), "completion_mask": F.token_list()},
        "pre-tokenized input_ids (prompt + response, no padding) and completion_mask "
        "(SFTConfig(completion_only_loss=True) makes TRL train on the response only)",
    ),
    BufferFormat(
        "grpo",
        (layouts.text_key("prompt"),),
        _grpo_text,
        lambda: {"prompt": F.string()},
        "prompt text with the chat template applied (GRPOTrainer/RLOOTrainer, standard)",
    ),
    BufferFormat(
        "grpo_conversational",
        (layouts.history_key("prompt"),),
        _grpo_conversational,
        lambda: {"prompt": F.messages()},
        "prompt as role/content messages (GRPOTrainer/RLOOTrainer, conversational)",
    ),
):
    register_format(_fmt)
del _fmt


def check_format(fmt: BufferFormat, td: TensorDictBase) -> None:
    """Raise ``KeyError`` naming every key ``fmt`` needs that ``td`` lacks."""
    missing = fmt.missing_keys(td)
    if missing:
        names = [k if isinstance(k, str) else ".".join(k) for k in missing]
        raise KeyError(
            f"format {fmt.name!r} needs keys {names} that the replay buffer's samples lack. "
            f"Available keys: {layouts.available_keys(td)}"
        )


# the offline trainers' formats (dpo, reward, kto, rloo) register themselves on import; done
# here so that the registry is complete whichever module is imported first
from . import offline_formats  # noqa: E402,F401
