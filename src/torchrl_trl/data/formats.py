"""Formats: :class:`BufferFormat`, the registry, and the built-ins (their columns:
``docs/source/formats.md``).

Online trainers (SFT, GRPO, RLOO) read TorchRL's LLM layout. Offline ones read
:mod:`~torchrl_trl.data.preference` rows: ``"chosen"``/``"rejected"`` rollouts of one prompt and
a float ``"margin"`` (DPO, RewardTrainer), or a rollout and a bool ``"label"`` (KTO).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts
from . import features as F
from .columns import array_rows, column_name, prompt_response_ids

__all__ = [
    "CHOSEN_KEY", "COLUMN_KINDS", "LABEL_KEY", "MARGIN_KEY", "REJECTED_KEY", "BufferFormat", "available_formats",
    "check_format", "get_format", "register_format", "simple_format",
]
CHOSEN_KEY, REJECTED_KEY, MARGIN_KEY, LABEL_KEY = "chosen", "rejected", "margin", "label"


@dataclass(frozen=True)
class BufferFormat:
    """How to turn a sampled batch into trainer columns.

    Attributes:
        name: registry name.
        required_keys: keys every sample must hold (checked before the first batch).
        convert: ``convert(batch: TensorDictBase) -> dict[str, list]``, one value per row
            (the batch's leading dims flattened).
        features: ``features() -> dict[str, datasets feature]`` for the columns
            ``convert`` returns (a callable so ``datasets`` is imported only when used).
        description: one line for docs and ``repr``.

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
    """Add ``fmt`` to the registry under ``fmt.name`` and return it; ``ValueError`` when the
    name is taken, unless ``overwrite``.

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


def check_format(fmt: BufferFormat, td: TensorDictBase) -> None:
    """Raise ``KeyError`` naming every key ``fmt`` needs that ``td`` lacks."""
    missing = fmt.missing_keys(td)
    if missing:
        names = [column_name(k) for k in missing]
        raise KeyError(
            f"format {fmt.name!r} needs keys {names} that the replay buffer's samples lack. "
            f"Available keys: {layouts.available_keys(td)}"
        )


#: column kinds of :func:`simple_format`: ``kind -> (read(td, part), key(part), feature())``
COLUMN_KINDS: dict[str, tuple[Callable, Callable, Callable]] = {
    "text": (layouts.read_text, layouts.text_key, F.string),
    "history": (layouts.read_history, layouts.history_key, F.messages),
}


def _read_columns(td: TensorDictBase, spec: tuple) -> dict[str, list]:
    return {name: COLUMN_KINDS[kind][0](td, part) for name, kind, part in spec}


def _column_features(spec: tuple) -> dict[str, Any]:
    return {name: COLUMN_KINDS[kind][2]() for name, kind, _ in spec}


def simple_format(name: str, description: str, **columns: tuple[str, Any]) -> BufferFormat:
    """A picklable :class:`BufferFormat` whose column ``name=(kind, part)`` is read by
    :data:`COLUMN_KINDS` ``[kind]`` (e.g. ``prompt=("text", "prompt")``)."""
    spec = tuple((col, kind, part) for col, (kind, part) in columns.items())
    keys = tuple(COLUMN_KINDS[kind][1](part) for _, kind, part in spec)
    return BufferFormat(name, keys, partial(_read_columns, spec=spec), partial(_column_features, spec), description)



def _sft_tokenized(td: TensorDictBase) -> dict[str, list]:
    ids, completion_mask = prompt_response_ids(td)
    return {"input_ids": array_rows(ids), "completion_mask": array_rows(completion_mask)}


def _tokenized_features() -> dict:
    return {"input_ids": F.token_list(), "completion_mask": F.token_list()}


def _margin(td: TensorDictBase) -> list[float]:
    return td.get(MARGIN_KEY).reshape(-1).tolist()


def _labels(td: TensorDictBase, part=None) -> list[bool]:
    return [bool(v) for v in td.get(LABEL_KEY).reshape(-1).tolist()]


COLUMN_KINDS["label"] = (_labels, lambda part: LABEL_KEY, partial(F.value, "bool"))


def _pairs(td: TensorDictBase, kind: str, margin: bool = False) -> dict[str, list]:
    read = COLUMN_KINDS[kind][0]
    chosen, rejected = td.get(CHOSEN_KEY), td.get(REJECTED_KEY)
    prompt = read(chosen, "prompt")
    for i, (a, b) in enumerate(zip(prompt, read(rejected, "prompt"))):
        if a != b:
            raise ValueError(
                f"preference row {i}: the chosen and rejected rollouts have different prompts "
                f"({a!r} vs {b!r}); pairs must share their prompt (group by the prompt)"
            )
    out = {"prompt": prompt, "chosen": read(chosen, "response"), "rejected": read(rejected, "response")}
    return {**out, "margin": _margin(td)} if margin else out


def _pair_features(kind: str, margin: bool = False) -> dict:
    feature = COLUMN_KINDS[kind][2]
    out = {"prompt": feature(), "chosen": feature(), "rejected": feature()}
    return {**out, "margin": F.value("float32")} if margin else out


def _reward_tokenized(td: TensorDictBase) -> dict[str, list]:
    ids = [array_rows(prompt_response_ids(td.get(side))[0]) for side in (CHOSEN_KEY, REJECTED_KEY)]
    return {"chosen_ids": ids[0], "rejected_ids": ids[1], "margin": _margin(td)}


def _reward_tokenized_features() -> dict:
    return {"chosen_ids": F.token_list(), "rejected_ids": F.token_list(), "margin": F.value("float32")}


def _side_keys(key_fn) -> tuple:
    return tuple((side, *key_fn(part)) for side in (CHOSEN_KEY, REJECTED_KEY) for part in ("prompt", "response"))


# text columns come from ("text", ...) (prompts with the chat template applied), messages from ("history", ...)
for _kind, _suffix, _what in (("text", "", "text"), ("history", "_conversational", "role/content messages")):
    _keys, _prompt, _completion = _side_keys(COLUMN_KINDS[_kind][1]), (_kind, "prompt"), (_kind, "response")
    for _fmt in (
        simple_format(f"sft{_suffix}", f"prompt/completion {_what} (SFTTrainer)", prompt=_prompt,
                      completion=_completion),
        simple_format(f"grpo{_suffix}", f"prompt {_what} (GRPOTrainer/RLOOTrainer)", prompt=_prompt),
        simple_format(f"rloo{_suffix}", f"prompt {_what} (RLOOTrainer, as GRPO)", prompt=_prompt),
        simple_format(f"kto{_suffix}", f"prompt/completion {_what} and a desirable label (KTOTrainer, unpaired)",
                      prompt=_prompt, completion=_completion, label=("label", None)),
        BufferFormat(f"dpo{_suffix}", _keys, partial(_pairs, kind=_kind), partial(_pair_features, _kind),
                     f"prompt/chosen/rejected {_what} from preference pairs (DPOTrainer, RewardTrainer)"),
        BufferFormat(f"reward{_suffix}", (*_keys, MARGIN_KEY), partial(_pairs, kind=_kind, margin=True),
                     partial(_pair_features, _kind, margin=True),
                     f"prompt/chosen/rejected {_what} and the reward gap as margin (RewardTrainer)"),
    ):
        register_format(_fmt)
del _kind, _suffix, _what, _keys, _prompt, _completion, _fmt
register_format(simple_format(
    "sft_messages", "the whole chat as role/content messages (SFTTrainer, conversational language modeling)",
    messages=("history", "full"),
))
register_format(BufferFormat(
    "sft_tokenized", (layouts.token_key("prompt"), layouts.token_key("response")), _sft_tokenized,
    _tokenized_features, "pre-tokenized input_ids (prompt + response, no padding) and completion_mask "
    "(SFTConfig(completion_only_loss=True) makes TRL train on the response only)",
))
# DPOTrainer always tokenizes itself, so there is no dpo_tokenized
register_format(BufferFormat(
    "reward_tokenized", (*_side_keys(layouts.token_key), MARGIN_KEY), _reward_tokenized, _reward_tokenized_features,
    "pre-tokenized chosen_ids/rejected_ids (prompt + response) and margin (RewardTrainer)",
))
