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

from tensordict import TensorDictBase

from .. import layouts
from . import features as F
from .columns import array_rows, prompt_response_ids
from .registry import BufferFormat, available_formats, check_format, get_format, register_format

__all__ = [
    "BufferFormat",
    "available_formats",
    "check_format",
    "get_format",
    "register_format",
]


# ---------------------------------------------------------------------------
# Built-ins
# ---------------------------------------------------------------------------


def _sft_text(td: TensorDictBase) -> dict[str, list]:
    return {"prompt": layouts.read_text(td, "prompt"), "completion": layouts.read_text(td, "response")}


def _sft_conversational(td: TensorDictBase) -> dict[str, list]:
    return {"prompt": layouts.read_history(td, "prompt"), "completion": layouts.read_history(td, "response")}


def _sft_messages(td: TensorDictBase) -> dict[str, list]:
    return {"messages": layouts.read_history(td, "full")}


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


for _name, _base in (("rloo", "grpo"), ("rloo_conversational", "grpo_conversational")):
    _b = get_format(_base)
    register_format(BufferFormat(_name, _b.required_keys, _b.convert, _b.features,
                                 _b.description.replace("GRPOTrainer/RLOOTrainer", "RLOOTrainer, as GRPO")))
del _name, _base, _b

# the offline trainers' formats (dpo, reward, kto) register themselves on import: importing
# this module gives the whole registry
from . import offline_formats  # noqa: E402,F401
