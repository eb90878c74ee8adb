"""Read TorchRL LLM layouts into per-sample sequences, texts and chat messages.

This module is the one place that knows TorchRL's LLM key layout: the ``Tokens``,
``Masks``, ``Text``, ``ChatHistory`` and ``LogProbs`` containers that
``TransformersWrapper``/``vLLMWrapper``, ``ChatEnv`` and ``LLMCollector`` write::

    ("tokens", "prompt" | "response" | "full")       int64 [*B, T] padded, or ragged
    ("masks", "all_attention_mask")                   [*B, T_full], 1 on real tokens
    ("text", "prompt" | "response" | "full")          str per sample
    ("history", "prompt" | "response" | "full")       History [*B, n_messages]
    ("next", "reward")                                float [*B, 1, 1] (GRPO convention)

Any leading batch shape is flattened in row-major order, so sample ``i`` of every
reader is the same rollout. Inputs may be dense padded tensors
(``pad_output=True``: the prompt left-padded, the response right-padded), lazy stacks of
per-sample tensors of different lengths (``pad_output=False``, ``LazyStackStorage``),
lazy stacks of separately padded batches (several ``pad_output=True`` collector batches
in one buffer) or nested tensors. Padding is removed with the attention mask.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase, is_leaf_nontensor
from tensordict.utils import NestedKey

__all__ = [
    "Part",
    "Ragged",
    "available_keys",
    "batch_numel",
    "check_strings_kept",
    "decoded_padding",
    "first_member",
    "has_key",
    "history_key",
    "padding_text",
    "read_column",
    "read_history",
    "read_text",
    "read_tokens",
    "REWARD_KEY",
    "text_key",
    "token_key",
    "ATTENTION_MASK_KEY",
    "DONE_KEY",
    "TORCHRL_ROOT_KEYS",
    "to_messages",
]

Part = Literal["prompt", "response", "full"]
_PARTS = ("prompt", "response", "full")

ATTENTION_MASK_KEY: NestedKey = ("masks", "all_attention_mask")
#: Top-level keys TorchRL's LLM envs, wrappers, collectors and losses write into rollouts
#: (anything else at the top level, e.g. ``"answer"``, came from the dataset).
TORCHRL_ROOT_KEYS = frozenset({
    "text", "history", "tokens", "masks", "log_probs", "next", "done", "terminated",
    "truncated", "step_count", "reward", "action", "is_init", "collector", "advantage",
})  # fmt: skip
#: Where TorchRL's GRPO pipeline (``MCAdvantage``, reward parsers) reads the reward.
REWARD_KEY: NestedKey = ("next", "reward")
#: Whether a step ended its episode (``[*B, 1]`` bool); ``False`` on the inner turns of a
#: multi-turn ``ChatEnv`` episode.
DONE_KEY: NestedKey = ("next", "done")


def token_key(part: Part) -> NestedKey:
    """``("tokens", part)``."""
    return ("tokens", _check_part(part))


def text_key(part: Part) -> NestedKey:
    """``("text", part)``."""
    return ("text", _check_part(part))


def history_key(part: Part) -> NestedKey:
    """``("history", part)``."""
    return ("history", _check_part(part))


def _check_part(part: str) -> str:
    if part not in _PARTS:
        raise ValueError(f"part must be one of {_PARTS}, got {part!r}")
    return part


# ---------------------------------------------------------------------------
# Ragged sequences
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ragged:
    """Variable-length 1-D sequences stored flat: sample ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``.

    Attributes:
        values: ``[sum(lengths)]`` all samples' elements, concatenated.
        lengths: int64 ``[N]`` length of each sample.

    Examples:
        >>> seqs = Ragged.from_list([[1, 2, 3], [4]])
        >>> seqs.tolist(), seqs.lengths.tolist()
        ([[1, 2, 3], [4]], [3, 1])
        >>> ids, mask = seqs.to_padded(0, side="left")
        >>> ids.tolist()
        [[1, 2, 3], [0, 0, 4]]
        >>> seqs.select([1, 0]).tolist()
        [[4], [1, 2, 3]]
    """

    values: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def from_list(cls, seqs: Sequence[torch.Tensor | Sequence[int]], dtype=torch.long) -> Ragged:
        tensors = [torch.as_tensor(s, dtype=dtype).reshape(-1) for s in seqs]
        lengths = torch.tensor([t.numel() for t in tensors], dtype=torch.long)
        values = torch.cat(tensors) if tensors else torch.empty(0, dtype=dtype)
        return cls(values, lengths)

    @property
    def offsets(self) -> torch.Tensor:
        """int64 ``[N + 1]`` start of each sample in :attr:`values`, then the total."""
        return torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])

    def __len__(self) -> int:
        return self.lengths.numel()

    def __getitem__(self, i: int) -> torch.Tensor:
        offsets = self.offsets
        return self.values[offsets[i] : offsets[i + 1]]

    def split(self) -> tuple[torch.Tensor, ...]:
        """One tensor (a view) per sample."""
        return torch.split(self.values, self.lengths.tolist())

    def tolist(self) -> list[list]:
        """One Python list per sample."""
        flat = self.values.tolist()
        out, start = [], 0
        for n in self.lengths.tolist():
            out.append(flat[start : start + n])
            start += n
        return out

    def select(self, index: torch.Tensor | Sequence[int]) -> Ragged:
        """The samples at ``index`` (in that order), gathered without a Python loop."""
        index = torch.as_tensor(index, dtype=torch.long)
        lengths = self.lengths[index]
        starts = self.offsets[:-1][index]
        # position of each output element inside its own sample
        new_starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        within = torch.arange(int(lengths.sum())) - new_starts.repeat_interleave(lengths)
        return Ragged(self.values[starts.repeat_interleave(lengths) + within], lengths)

    def to_padded(
        self,
        pad_value: int | float = 0,
        *,
        side: Literal["left", "right"] = "right",
        width: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad to ``[N, width]`` (``width`` defaults to the longest sample).

        Returns:
            ``(padded, mask)``; ``mask`` is bool ``[N, width]``, ``True`` on real elements.
        """
        n = len(self)
        longest = int(self.lengths.max()) if n else 0
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"width={width} is shorter than the longest sample ({longest})")
        cols = torch.arange(width).expand(n, width)
        if side == "right":
            mask = cols < self.lengths[:, None]
        else:
            mask = cols >= (width - self.lengths)[:, None]
        padded = self.values.new_full((n, width), pad_value)
        padded[mask] = self.values
        return padded, mask


# ---------------------------------------------------------------------------
# Walking lazy stacks
# ---------------------------------------------------------------------------


def _chunks(td: TensorDictBase, key: NestedKey) -> list[torch.Tensor]:
    """The tensor at ``key`` as a list of dense ``[n_i, T_i]`` chunks, in row-major order
    of ``td``'s batch: one chunk per dense sub-tensordict of a lazy stack, one per sample
    where a dense tensordict holds a lazily stacked sub-tensordict."""
    if isinstance(td, LazyStackedTensorDict):
        subs = td.tensordicts if td.stack_dim == 0 else td.unbind(0)
        chunks = []
        for sub in subs:
            if sub.batch_dims == 0:  # one sample (a rollout in a LazyStackStorage): the common case, kept short
                value = sub.get(key)
                if isinstance(value, torch.Tensor) and value.ndim <= 1 and not value.is_nested:
                    chunks.append(value.reshape(1, -1))
                    continue
            chunks.extend(_chunks(sub, key))
        return chunks
    value = _get(td, key)
    if isinstance(value, list):  # one tensor per sample
        return [torch.as_tensor(v).reshape(1, -1) for v in value]
    if value.is_nested:
        return [t.reshape(1, -1) for t in value.unbind(0)]
    if value.ndim == td.batch_dims:  # a scalar per sample
        return [value.reshape(-1, 1)]
    return [value.reshape(batch_numel(td), value.shape[-1])]


def _get(td: TensorDictBase, key: NestedKey) -> Any:
    """``td.get(key)``; where that cannot stack (a dense tensordict whose ``Tokens`` /
    ``Masks`` are a lazy stack of samples of different lengths, as
    ``TransformersWrapper(pad_output=False)`` with text or history input and
    ``ReplayBuffer(ListStorage)`` samples give), a flat list with one value per sample.
    ``KeyError`` when ``key`` is not set."""
    try:
        value = td.get(key)
    except RuntimeError:
        if isinstance(td, LazyStackedTensorDict) or td.batch_dims == 0:
            raise
        return _flatten_nested_list(td.get(key, as_list=True), td.batch_dims)
    if value is None:
        raise KeyError(key)
    return value


def has_key(td: TensorDictBase, key: NestedKey) -> bool:
    """Whether ``key`` is set (and not ``None``) in every sample of ``td``.

    Looks inside lazy stacks, also those nested in a dense tensordict: a key that is
    present but cannot be stacked counts as present."""
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0:
        # ask the members at once: getting the key from the stack would stack it first
        return all(has_key(sub, key) for sub in td.tensordicts)
    try:
        return td.get(key, None) is not None
    except (KeyError, RuntimeError):
        # a lazy stack raises when only some members hold the key, or when the
        # members cannot be stacked; then ask the members (or the samples)
        if isinstance(td, LazyStackedTensorDict):
            subs = td.tensordicts if td.stack_dim == 0 else td.unbind(0)
            return all(has_key(sub, key) for sub in subs)
        if td.batch_dims == 0:
            return False
        return all(has_key(sample, key) for sample in td.unbind(0))


def first_member(td: TensorDictBase) -> TensorDictBase:
    """The first tensordict a (nested) lazy stack is made of: ``td`` itself when it is not
    a lazy stack. What listing keys looks at: every member of a rollout stack carries the
    same keys, and the first one lists them without stacking anything.

    >>> import torch
    >>> from tensordict import TensorDict, lazy_stack
    >>> rollouts = lazy_stack([TensorDict({"ids": torch.arange(n)}, []) for n in (2, 3)])
    >>> first_member(rollouts)["ids"].tolist()
    [0, 1]
    >>> dense = TensorDict({"ids": torch.zeros(2, 3)}, [2])
    >>> first_member(dense) is dense
    True
    """
    while isinstance(td, LazyStackedTensorDict) and td.tensordicts:
        td = td.tensordicts[0]
    return td


def available_keys(td: TensorDictBase) -> list[str]:
    """Sorted leaf keys of ``td`` (``"a.b"`` for nested ones), to name in errors.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> available_keys(TensorDict({"tokens": {"full": torch.zeros(3)}, "query": "2+2="}, []))
    ['query', 'tokens.full']
    """
    keys = first_member(td).keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)
    return sorted(k if isinstance(k, str) else ".".join(k) for k in keys)


def _require(td: TensorDictBase, key: NestedKey, what: str) -> None:
    if not has_key(td, key):
        raise KeyError(
            f"{what}: key {key!r} not found in the rollouts. Available keys: "
            f"{available_keys(td)}"
        )


def batch_numel(td: TensorDictBase) -> int:
    """Number of samples, i.e. the product of ``td``'s batch dimensions."""
    return td.batch_size.numel()


# ---------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------


def read_tokens(
    td: TensorDictBase,
    part: Part = "full",
    *,
    key: NestedKey | None = None,
    mask_key: NestedKey | None = ATTENTION_MASK_KEY,
) -> Ragged:
    """The real (unpadded) token ids of each sample at ``("tokens", part)``.

    Padding is removed with ``("masks", "all_attention_mask")`` when it is present: the
    full sequence uses the mask as is; with padded outputs the prompt is the mask's first
    ``T_prompt`` columns and the response its last ``T_response`` columns (TorchRL pads the
    prompt on the left and the response on the right). Without a mask, every stored token
    is taken as real.

    ``key`` reads another token key (then ``part`` only says how the mask lines up with
    it); ``mask_key`` reads another mask, ``None`` takes every stored token as real.

    Returns:
        :class:`Ragged` int64 token ids, one sample per batch element (flattened).

    Examples:
        Left-padded tokens (``pad_output=True``) and ragged ones read the same:

        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> padded = TensorDict({
        ...     "tokens": {"full": torch.tensor([[0, 5, 6], [7, 8, 9]])},
        ...     "masks": {"all_attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])},
        ... }, batch_size=[2])
        >>> read_tokens(padded).tolist()
        [[5, 6], [7, 8, 9]]
        >>> ragged = lazy_stack([TensorDict({"tokens": {"full": torch.tensor(t)}}) for t in ([5, 6], [7, 8, 9])])
        >>> read_tokens(ragged).tolist()
        [[5, 6], [7, 8, 9]]
    """
    key = token_key(part) if key is None else key
    try:
        tokens = _chunks(td, key)
    except KeyError:
        _require(td, key, "read_tokens")  # raises naming the key and the available ones
        raise
    masks = (
        _chunks(td, mask_key) if mask_key is not None and has_key(td, mask_key) else None
    )
    if masks is not None:
        if [t.shape[0] for t in tokens] != [m.shape[0] for m in masks]:
            # one side stacks and the other does not (e.g. equal response widths, mask
            # widths differing between collector batches): line them up sample by sample
            tokens, masks = _rows(tokens), _rows(masks)
        if part != "full":
            masks = [_slice_mask(m, t.shape[-1], part) for m, t in zip(masks, tokens)]
        for m, t in zip(masks, tokens):
            if m is None or m.shape != t.shape:
                raise ValueError(
                    f"read_tokens: the mask at {mask_key!r} (width {None if m is None else m.shape[-1]}) "
                    f"does not line up with the tokens at {key!r} (shape {tuple(t.shape)}); "
                    "expected the attention mask of the full sequence"
                )
    else:
        masks = [None] * len(tokens)
    widths = {t.shape[-1] for t in tokens}
    if len(widths) == 1 and all(m is not None for m in masks):
        # one vectorised pass over everything (dense, or equal-width chunks)
        values, mask = torch.cat(tokens), torch.cat(masks).bool()
        return Ragged(values[mask], mask.sum(-1))
    if all(m is None and t.shape[0] == 1 for t, m in zip(tokens, masks)):  # one unmasked sample per chunk
        return Ragged(torch.cat(tokens, dim=1).reshape(-1), torch.tensor([t.shape[-1] for t in tokens]))
    values, lengths = [], []
    for t, m in zip(tokens, masks):
        if m is None:  # every stored token is real: lengths from the shape, no tensor op per sample
            values.append(t.reshape(-1))
            lengths.extend([t.shape[-1]] * t.shape[0])
        else:
            m = m.bool()
            values.append(t[m])
            lengths.extend(m.sum(-1).tolist())
    return Ragged(torch.cat(values), torch.tensor(lengths, dtype=torch.long))


def _rows(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    return [row for chunk in chunks for row in chunk.split(1)]


def _slice_mask(full_mask: torch.Tensor, width: int, part: str) -> torch.Tensor | None:
    if full_mask.shape[-1] < width:
        return None
    return full_mask[..., :width] if part == "prompt" else full_mask[..., full_mask.shape[-1] - width :]


def _flatten_nested_list(value: Any, depth: int) -> list:
    if depth == 0:
        return [value]
    return [item for sub in value for item in _flatten_nested_list(sub, depth - 1)]


def read_column(td: TensorDictBase, key: NestedKey) -> list[Any]:
    """Per-sample values at ``key``: Python objects for non-tensor data, tensors (one per
    sample, ragged allowed) otherwise."""
    _require(td, key, "read_column")
    value = td.get(key, as_list=True) if isinstance(td, LazyStackedTensorDict) else _get(td, key)
    if isinstance(value, list) and not isinstance(td, LazyStackedTensorDict):
        return value  # one value per sample already
    if isinstance(value, (NonTensorData, NonTensorStack)):
        _refuse_memmap_strings(td, key)
        value = value.tolist()
        return _flatten_nested_list(value, td.batch_dims) if td.batch_dims else [value]
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return list(value.reshape(-1, *value.shape[td.batch_dims :]).unbind(0))
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    return _flatten_nested_list(value, td.batch_dims)


def read_text(td: TensorDictBase, part: Part = "full", *, tokenizer: Any = None) -> list[str]:
    """The text of each sample at ``("text", part)``; ``"full"`` falls back to
    prompt + response when only those are stored.

    TorchRL's history mode with ``pad_output=True`` decodes the *padded* sequence, so its
    ``text.full`` holds pad strings and its ``text.response`` starts inside the prompt.
    There the padding is removed exactly (see :func:`padding_text`) and the response is
    what follows the prompt in the clean full text, as TorchRL defines it.

    Args:
        tokenizer: the policy's tokenizer, optional: names the pad string (otherwise it is
            read off the padded samples themselves).

    Raises:
        TypeError: a sample's text is not a string.
        ValueError: the strings were lost in storage (see :func:`check_strings_kept`).
    """
    key = text_key(part)
    if part == "full" and not has_key(td, key) and has_key(td, text_key("prompt")):
        prompts, responses = read_text(td, "prompt"), read_text(td, "response")
        return [p + r for p, r in zip(prompts, responses)]
    texts = _strings(read_column(td, key), key)
    check_strings_kept(td, part, texts)
    if part == "prompt" or not _padded_text_possible(td):
        return texts
    full = texts if part == "full" else _strings(read_column(td, text_key("full")), key)
    clean = _strip_padding(td, full, tokenizer)
    if clean is None:
        return texts
    if part == "full":
        return clean
    out = []
    for i, (c, f, p, t) in enumerate(zip(clean, full, read_text(td, "prompt"), texts)):
        if c is f:  # nothing was stripped
            out.append(t)
        elif c.startswith(p):
            out.append(c[len(p) :])
        else:
            raise ValueError(f"sample {i}: the unpadded text.full does not start with text.prompt")
    return out


# ---------------------------------------------------------------------------
# Strings a storage lost
# ---------------------------------------------------------------------------

_KEEPING_STORAGES = "LazyStackStorage, ListStorage or LazyTensorStorage"


def check_strings_kept(td: TensorDictBase, part: Part = "full", strings: list[str] | None = None) -> None:
    """Refuse text and chat that cannot be the ones TorchRL wrote.

    TorchRL 0.14.1's ``LazyMemmapStorage`` keeps only the first string of a non-tensor
    column: ``rb[:]`` and ``rb.sample()`` read every row's text, chat and string columns
    back as the first row's, while the tokens survive. Caught two ways:

    - ``td`` is memory-mapped (``rb[:]`` of such a storage) and this TorchRL loses
      strings there;
    - a sample of it (``rb.sample()`` copies into ordinary tensors, leaving no trace of
      the storage): every row holds the same ``("text", part)`` while the rows' real
      ``("tokens", part)`` differ, which TorchRL's decoding of each row's own tokens does
      not produce.

    Args:
        part: the text part to compare with its tokens (skipped when either is missing).
        strings: that part's strings when the caller has read them already.

    Raises:
        ValueError: naming the key, with the storages that keep strings.
    """
    key, ids_key = text_key(part), token_key(part)
    _refuse_memmap_strings(td, key)
    if batch_numel(td) < 2 or not has_key(td, ids_key) or (strings is None and not has_key(td, key)):
        return
    first, *rest = strings if strings is not None else read_column(td, key)
    if any(v != first for v in rest):
        return
    ids = read_tokens(td, part).tolist()
    if any(row != ids[0] for row in ids[1:]):
        raise ValueError(
            f"every sample's {key!r} reads {str(first)!r:.60} while their {ids_key!r} differ: "
            "the strings were lost in storage (TorchRL 0.14.1's LazyMemmapStorage reads every "
            f"stored string back as the first one). Store LLM rollouts in a {_KEEPING_STORAGES}, "
            "or read only their tokens"
        )


def _refuse_memmap_strings(td: TensorDictBase, key: NestedKey | None) -> None:
    if td.is_memmap() and not memmap_keeps_strings():
        where = f"key {key!r}: " if key is not None else ""
        raise ValueError(
            f"{where}these rollouts are memory-mapped, and this TorchRL's LazyMemmapStorage "
            "reads every stored string (text, chat, string columns) back as the first one "
            f"written. Store LLM rollouts in a {_KEEPING_STORAGES}, or read only their tokens"
        )


@functools.cache
def memmap_keeps_strings() -> bool:
    """Whether this TorchRL's ``LazyMemmapStorage`` reads strings back as written (0.14.1
    returns the first row's string for every row); probed once in a temporary directory."""
    import tempfile

    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    with tempfile.TemporaryDirectory() as tmp:
        rb = ReplayBuffer(storage=LazyMemmapStorage(2, scratch_dir=tmp))
        rb.extend(TensorDict({"s": ["a", "b"]}, batch_size=[2]))
        return [str(s) for s in rb[:].get("s")] == ["a", "b"]


def _strings(values: list, key: NestedKey) -> list[str]:
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(
                f"key {key!r}: sample {i} holds {type(v).__name__} {v!r:.40}, expected a string"
            )
    return values


def _padded_text_possible(td: TensorDictBase) -> bool:
    # only a padded (dense) full sequence with a mask, text and a prompt can carry pads
    return (
        has_key(td, ATTENTION_MASK_KEY)
        and has_key(td, text_key("full"))
        and has_key(td, text_key("prompt"))
        and has_key(td, token_key("full"))
    )


def _pad_counts(td: TensorDictBase) -> tuple[list[int], list[int]]:
    """Per sample, the pad columns before and after the real tokens of the full mask."""
    lead, trail = [], []
    for m in _chunks(td, ATTENTION_MASK_KEY):
        m = m.bool()
        lead += (m.cumsum(-1) == 0).sum(-1).tolist()
        trail += (m.flip(-1).cumsum(-1) == 0).sum(-1).tolist()
    return lead, trail


def padding_text(td: TensorDictBase, tokenizer: Any = None) -> str | None:
    """The string one pad token decodes to in ``td``'s stored text, or ``None`` when the
    text holds no padding.

    With ``tokenizer``, its decoding of the pad id found in the padded ``tokens.full``.
    Without, read off a sample whose text starts with pad strings before its prompt
    (``text.full == pad * n_left + prompt + ...`` with ``n_left`` from the mask), else off
    one whose text ends with two or more pads.

    Raises:
        ValueError: samples disagree on the pad string, or the text may hold padding that
            cannot be told apart from real text without the tokenizer.
    """
    lead, trail = _pad_counts(td)
    if not any(lead) and not any(trail):
        return None
    full = read_column(td, text_key("full"))
    prompts = read_column(td, text_key("prompt"))
    if tokenizer is not None:
        pad_id = _pad_id(td)
        pad = tokenizer.decode([pad_id], skip_special_tokens=False)
        return pad if any(_has_padding(f, pad, l, t) for f, l, t in zip(full, lead, trail)) else None
    if not has_key(td, history_key("prompt")):
        return None  # TorchRL decodes padded text only in history mode
    found, clean_rows = set(), 0
    for f, p, l, t in zip(full, prompts, lead, trail):
        at = f.find(p) if p else -1
        if l and at == 0:
            clean_rows += 1  # the text starts with its prompt: no pads were decoded
        elif l and at > 0 and at % l == 0 and f[: at // l] * l == f[:at]:
            found.add(f[: at // l])
        elif not l and t >= 2:
            period = _shortest_period(f, t)
            if period:
                found.add(period)
    if len(found) > 1:
        raise ValueError(f"the stored text holds different pad strings {sorted(found)}; pass tokenizer=")
    if found:
        return found.pop()
    if clean_rows:
        return None
    if _PAD_TEXT.get() is not None:
        return _PAD_TEXT.get()
    raise ValueError(
        "the text at ('text', 'full') was decoded by TorchRL from padded tokens "
        "(input_mode='history', pad_output=True) and its pad string cannot be read off "
        "these samples; pass the policy's tokenizer to what reads them "
        "(TorchRLBufferDataset(tokenizer=), RewardFunctionWrapper(tokenizer=), "
        "HFRewardModelWrapper(renderer=RewardRenderer(policy_tokenizer=)), read_text(tokenizer=)) or read within "
        "torchrl_trl.layouts.decoded_padding(tokenizer)"
    )


_PAD_TEXT: ContextVar[str | None] = ContextVar("torchrl_trl_pad_text", default=None)


@contextmanager
def decoded_padding(tokenizer: Any = None, *, pad_text: str | None = None):
    """Within this context, readers take ``pad_text`` (or ``tokenizer``'s pad token as it
    decodes) as the pad string of TorchRL's padded history-mode text wherever the samples
    at hand do not show it (e.g. a batch of equal-length prompts whose responses end
    with a single pad). Readers still strip it only where the mask says padding is.

    Examples:
        >>> with decoded_padding(pad_text="<pad>"):
        ...     pass
    """
    if pad_text is None and tokenizer is not None:
        pad_text = tokenizer.decode([tokenizer.pad_token_id], skip_special_tokens=False)
    token = _PAD_TEXT.set(pad_text)
    try:
        yield
    finally:
        _PAD_TEXT.reset(token)


def _pad_id(td: TensorDictBase) -> int:
    for t, m in zip(_chunks(td, token_key("full")), _chunks(td, ATTENTION_MASK_KEY)):
        if t.shape == m.shape and not m.bool().all():
            return int(t[~m.bool()][0])
    raise ValueError("no padded position in ('tokens', 'full')")


def _has_padding(text: str, pad: str, lead: int, trail: int) -> bool:
    return (lead and text.startswith(pad * lead)) or (trail and text.endswith(pad * trail))


def _shortest_period(text: str, repeats: int) -> str | None:
    """The shortest ``s`` such that ``text`` ends with ``s * repeats``, if any."""
    for n in range(1, len(text) // repeats + 1):
        if text.endswith(text[-n:] * repeats):
            return text[-n:]
    return None


def _strip_padding(td: TensorDictBase, full: list[str], tokenizer: Any) -> list[str] | None:
    """``full`` with each sample's decoded padding removed, or ``None`` if it has none.
    Only what the mask says was padding is removed, and only where it is there."""
    pad = padding_text(td, tokenizer)
    if not pad:
        return None
    lead, trail = _pad_counts(td)
    out = []
    for text, l, t in zip(full, lead, trail):
        if l and text.startswith(pad * l):
            text = text[len(pad) * l :]
        if t and text.endswith(pad * t):
            text = text[: len(text) - len(pad) * t]
        out.append(text)
    return out


def to_messages(history: Any) -> list[dict[str, str]]:
    """A TorchRL ``History`` (one conversation) or list of message dicts -> plain
    ``[{"role", "content"}, ...]`` as TRL's conversational format expects (TorchRL's
    extra ``is_complete``/tool fields and ``"<none>"`` padding messages dropped).

    Raises:
        TypeError: a message's role or content is not a string.
    """
    if hasattr(history, "tolist"):
        history = history.tolist()
    if isinstance(history, dict):
        history = [history]
    out = []
    for i, m in enumerate(history):
        if m.get("role") in (None, "<none>"):
            continue
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise TypeError(
                f"chat message {i} has role {type(m['role']).__name__} and content "
                f"{type(m['content']).__name__} ({m['content']!r:.40}); expected strings"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


def read_history(
    td: TensorDictBase, part: Part = "full", *, tokenizer: Any = None
) -> list[list[dict[str, str]]]:
    """The chat of each sample at ``("history", part)`` as plain role/content dicts.

    Where TorchRL parsed the response out of padded text (history mode,
    ``pad_output=True``), pad strings trailing a message are removed and a message made of
    padding only is dropped (``tokenizer`` as in :func:`read_text`).
    """
    key = history_key(part)
    _require(td, key, "read_history")
    check_strings_kept(td)  # chat content is no witness: two token rows can parse to one chat
    raw = []
    for sub in _leaf_tds(td):
        history = sub.get(key)
        # a History of batch [n_messages] gives one conversation; [k, n] gives k
        raw.extend(_flatten_nested_list(history.tolist(), history.batch_dims - 1))
    out = [to_messages(c) for c in raw]
    if part != "prompt" and _padded_text_possible(td):
        # a turn TorchRL closed at its end-of-turn marker holds nothing after it; one left
        # open by an early EOS that is not that marker holds the pads that followed
        _, trail = _pad_counts(td)
        open_rows = [i for i, (c, t) in enumerate(zip(raw, trail)) if t and not _ends_complete(c)]
        pad = padding_text(td, tokenizer) if open_rows else None
        for i in open_rows if pad else ():
            out[i] = _strip_trailing(out[i], pad)
    return out


def _ends_complete(conversation: Any) -> bool:
    messages = [conversation] if isinstance(conversation, dict) else conversation
    messages = [m for m in messages if m.get("role") not in (None, "<none>")]
    return bool(messages) and bool(messages[-1].get("is_complete", False))


def _strip_trailing(conversation: list[dict[str, str]], pad: str) -> list[dict[str, str]]:
    out = []
    for m in conversation:
        content = m["content"]
        while content.endswith(pad):
            content = content[: -len(pad)]
        if content or not m["content"]:
            out.append({**m, "content": content})
    return out


def _leaf_tds(td: TensorDictBase) -> list[TensorDictBase]:
    if isinstance(td, LazyStackedTensorDict):
        subs = td.tensordicts if td.stack_dim == 0 else td.unbind(0)
        return [leaf for sub in subs for leaf in _leaf_tds(sub)]
    return [td]
