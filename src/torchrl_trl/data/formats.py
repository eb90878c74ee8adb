"""Formats: :class:`BufferFormat`, the registry, and the built-ins (their columns: ``docs/source/formats.md``).
Online trainers (SFT, GRPO, RLOO) read TorchRL's LLM layout; offline ones :mod:`~torchrl_trl.data.preference`
rows: ``"chosen"``/``"rejected"`` rollouts and a float ``"margin"`` (DPO, Reward), or a bool ``"label"`` (KTO).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts
from .._token_ids import check_integer_ids
from . import features as F

__all__ = [
    "CHOSEN_KEY", "LABEL_KEY", "MARGIN_KEY", "REJECTED_KEY", "BufferFormat", "available_formats", "get_format",
    "prompt_response_ids", "read_token_ids", "register_format",
]
CHOSEN_KEY, REJECTED_KEY, MARGIN_KEY, LABEL_KEY = "chosen", "rejected", "margin", "label"


@dataclass(frozen=True)
class BufferFormat:
    """How to turn a sampled batch into trainer columns.

    Args:
        name (str): registry name.
        required_keys (tuple of NestedKey): keys every sample must hold (checked before the first batch).
        convert (callable): ``convert(batch: TensorDictBase) -> dict[str, list]``, one value per row (the
            batch's leading dims flattened).
        features (callable): ``features() -> dict[str, datasets feature]`` for the columns ``convert``
            returns (a callable so ``datasets`` is imported only when used).
        description (str, optional): one line for docs and ``repr``. Defaults to ``""``.

    A format of one's own (register it to use it by name, see :func:`register_format`):

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
    """Add ``fmt`` to the registry under ``fmt.name`` and return it; ``ValueError`` when the name is taken.

    Args:
        fmt (BufferFormat): the format.

    Keyword Args:
        overwrite (bool, optional): replace a format registered under the same name. Defaults to ``False``.

    >>> from torchrl_trl import layouts
    >>> from torchrl_trl.data import features
    >>> answers = register_format(BufferFormat(
    ...     "answers_only", (layouts.text_key("response"),),
    ...     convert=lambda td: {"completion": layouts.read_text(td, "response")},
    ...     features=lambda: {"completion": features.value()}), overwrite=True)
    >>> get_format("answers_only") is answers
    True
    >>> register_format(answers)
    Traceback (most recent call last):
    ...
    ValueError: register_format: format 'answers_only' is already registered (pass overwrite=True to replace it)
    """
    if not isinstance(fmt, BufferFormat):
        raise TypeError(f"register_format: expected a BufferFormat, got {type(fmt).__name__}")
    if fmt.name in _FORMATS and not overwrite:
        raise ValueError(
            f"register_format: format {fmt.name!r} is already registered (pass overwrite=True to replace it)"
        )
    _FORMATS[fmt.name] = fmt
    return fmt


def get_format(fmt: str | BufferFormat) -> BufferFormat:
    """A registered format by name (or ``fmt`` itself); an unknown name raises ``ValueError``.

    Args:
        fmt (str or BufferFormat): a registered name, or a format (returned as it is).

    >>> fmt = get_format("sft_tokenized")
    >>> fmt.required_keys
    (('tokens', 'prompt'), ('tokens', 'response'))
    >>> get_format(fmt) is fmt
    True
    """
    if isinstance(fmt, BufferFormat):
        return fmt
    if fmt not in _FORMATS:
        raise ValueError(f"get_format: unknown format {fmt!r}; expected one of {available_formats()}")
    return _FORMATS[fmt]


def available_formats() -> list[str]:
    """The registered format names, sorted.

    >>> {"sft", "sft_tokenized", "grpo", "dpo", "kto"} <= set(available_formats())
    True
    """
    return sorted(_FORMATS)


# Built-in formats. Text columns are read from ("text", part) (prompts with the chat template
# applied, as TorchRL stores them), conversational ones from ("history", part) as messages.
_KINDS = {  # kind: (read(td, part) -> one value per row, key(part) -> nested key, its datasets feature)
    "text": (layouts.read_text, layouts.text_key, F.value),
    "history": (layouts.read_history, layouts.history_key, F.messages),
}
_PAIR_PARTS = ((CHOSEN_KEY, "prompt"), (CHOSEN_KEY, "response"), (REJECTED_KEY, "prompt"), (REJECTED_KEY, "response"))
_PROMPT, _COMPLETION = ("prompt", "prompt"), ("completion", "response")


@dataclass(frozen=True)
class _Read:
    """Columns ``(column, part)`` read as ``kind`` (of chosen/rejected pairs when ``pairs``), then the
    ``extra`` key (margin or label); a dataclass, not a lambda: formats pickle into DataLoader workers."""

    kind: str
    parts: tuple[tuple[str, str], ...] = ()
    pairs: bool = False
    extra: str | None = None

    def keys(self) -> tuple:
        key = _KINDS[self.kind][1]
        keys = [(side, *key(part)) for side, part in _PAIR_PARTS] if self.pairs else [key(p) for _, p in self.parts]
        return (*keys, *([self.extra] if self.extra else []))

    def __call__(self, td: TensorDictBase) -> dict[str, list]:
        read = _KINDS[self.kind][0]
        if self.pairs:
            chosen, rejected = td.get(CHOSEN_KEY), td.get(REJECTED_KEY)
            out = {"prompt": read(chosen, "prompt")}
            for i, (a, b) in enumerate(zip(out["prompt"], read(rejected, "prompt"))):
                if a != b:
                    raise ValueError(
                        f"TorchRLBufferDataset: preference row {i}: expected chosen and rejected rollouts of one "
                        f"prompt, got {a!r} vs {b!r}"
                    )
            out.update(chosen=read(chosen, "response"), rejected=read(rejected, "response"))
        else:
            out = {column: read(td, part) for column, part in self.parts}
        if self.extra:
            values = td.get(self.extra).reshape(-1).tolist()
            out[self.extra] = [bool(v) for v in values] if self.extra == LABEL_KEY else values
        return out

    def features(self) -> dict[str, Any]:
        columns = ("prompt", "chosen", "rejected") if self.pairs else [column for column, _ in self.parts]
        out = {column: _KINDS[self.kind][2]() for column in columns}
        if self.extra:
            out[self.extra] = F.value("bool" if self.extra == LABEL_KEY else "float32")
        return out


def _read_format(name: str, description: str, kind: str, *parts: tuple[str, str], pairs: bool = False,
                 extra: str | None = None) -> BufferFormat:
    read = _Read(kind, parts, pairs, extra)
    return BufferFormat(name, read.keys(), read, read.features, description)


def read_token_ids(td: TensorDictBase, part: layouts.Part) -> layouts.Ragged:
    """:func:`layouts.read_tokens` of ``("tokens", part)``; ``TypeError`` if not integers."""
    ragged = layouts.read_tokens(td, part)
    check_integer_ids(ragged.values.dtype, f"TorchRLBufferDataset: key {'.'.join(layouts.token_key(part))!r}")
    return ragged


def prompt_response_ids(td: TensorDictBase) -> tuple[layouts.Ragged, layouts.Ragged]:
    """Each row's prompt + response tokens and a 0/1 int64 mask, 1 on the response (two
    :class:`~torchrl_trl.layouts.Ragged` of the same lengths)."""
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
    return {"input_ids": F.array_rows(ids), "completion_mask": F.array_rows(completion_mask)}


def _sft_tokenized_features() -> dict:
    return {"input_ids": F.token_list(), "completion_mask": F.token_list()}


def _reward_tokenized(td: TensorDictBase) -> dict[str, list]:
    ids = [F.array_rows(prompt_response_ids(td.get(side))[0]) for side in (CHOSEN_KEY, REJECTED_KEY)]
    return {"chosen_ids": ids[0], "rejected_ids": ids[1], "margin": td.get(MARGIN_KEY).reshape(-1).tolist()}


def _reward_tokenized_features() -> dict:
    return {"chosen_ids": F.token_list(), "rejected_ids": F.token_list(), "margin": F.value("float32")}


for _fmt in (
    _read_format("sft", "prompt/completion text (SFTTrainer, prompt-completion)", "text", _PROMPT, _COMPLETION),
    _read_format("sft_conversational", "prompt/completion as role/content messages (SFTTrainer, conversational "
                 "prompt-completion)", "history", _PROMPT, _COMPLETION),
    _read_format("sft_messages", "the whole chat as role/content messages (SFTTrainer, conversational language "
                 "modeling)", "history", ("messages", "full")),
    BufferFormat("sft_tokenized", (layouts.token_key("prompt"), layouts.token_key("response")), _sft_tokenized,
                 _sft_tokenized_features, "pre-tokenized input_ids (prompt + response, no padding) and "
                 "completion_mask (SFTConfig(completion_only_loss=True) makes TRL train on the response only)"),
    _read_format("grpo", "prompt text with the chat template applied (GRPOTrainer/RLOOTrainer)", "text", _PROMPT),
    _read_format("grpo_conversational", "prompt as role/content messages (GRPOTrainer/RLOOTrainer)", "history",
                 _PROMPT),
    _read_format("rloo", "prompt text with the chat template applied (RLOOTrainer, as GRPO)", "text", _PROMPT),
    _read_format("rloo_conversational", "prompt as role/content messages (RLOOTrainer, as GRPO)", "history", _PROMPT),
    # preference pairs (data.preference_pairs): DPOTrainer always tokenizes itself, so no dpo_tokenized
    _read_format("dpo", "prompt/chosen/rejected text from preference pairs (DPOTrainer, RewardTrainer)", "text",
                 pairs=True),
    _read_format("dpo_conversational", "prompt/chosen/rejected messages from preference pairs (DPOTrainer, "
                 "RewardTrainer)", "history", pairs=True),
    _read_format("reward", "prompt/chosen/rejected text and the reward gap as margin (RewardTrainer)", "text",
                 pairs=True, extra=MARGIN_KEY),
    _read_format("reward_conversational", "prompt/chosen/rejected messages and the reward gap as margin "
                 "(RewardTrainer)", "history", pairs=True, extra=MARGIN_KEY),
    BufferFormat("reward_tokenized", (*((side, *layouts.token_key(part)) for side, part in _PAIR_PARTS), MARGIN_KEY),
                 _reward_tokenized, _reward_tokenized_features,
                 "pre-tokenized chosen_ids/rejected_ids (prompt + response) and margin (RewardTrainer)"),
    # unpaired rollouts with a bool label (data.kto_rows)
    _read_format("kto", "prompt/completion text and a desirable label (KTOTrainer, unpaired)", "text", _PROMPT,
                 _COMPLETION, extra=LABEL_KEY),
    _read_format("kto_conversational", "prompt/completion messages and a desirable label (KTOTrainer, unpaired)",
                 "history", _PROMPT, _COMPLETION, extra=LABEL_KEY),
):
    register_format(_fmt)
del _fmt
