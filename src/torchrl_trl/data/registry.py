"""The format registry: :class:`BufferFormat` (a sampled batch of rollouts -> the columns
a TRL trainer reads) and the names formats are registered under. The built-in formats
register themselves from :mod:`torchrl_trl.data.formats` (online trainers) and
:mod:`torchrl_trl.data.offline_formats` (offline ones); importing ``formats`` registers both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts

__all__ = ["BufferFormat", "available_formats", "check_format", "get_format", "register_format"]


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

    >>> from torchrl_trl.data import formats  # the built-in formats register on import
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

    >>> from torchrl_trl.data import formats  # the built-in formats register on import
    >>> {"sft", "sft_tokenized", "grpo", "dpo", "kto"} <= set(available_formats())
    True
    """
    return sorted(_FORMATS)


def check_format(fmt: BufferFormat, td: TensorDictBase) -> None:
    """Raise ``KeyError`` naming every key ``fmt`` needs that ``td`` lacks."""
    missing = fmt.missing_keys(td)
    if missing:
        names = [k if isinstance(k, str) else ".".join(k) for k in missing]
        raise KeyError(
            f"format {fmt.name!r} needs keys {names} that the replay buffer's samples lack. "
            f"Available keys: {layouts.available_keys(td)}"
        )
