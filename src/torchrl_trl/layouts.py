"""Read TorchRL LLM layouts into per-sample sequences, texts and chat messages: the one
place that knows the keys TorchRL's LLM wrappers, ``ChatEnv`` and ``LLMCollector`` write::

    ("tokens", "prompt" | "response" | "full")       int64 [*B, T] padded, or ragged
    ("masks", "all_attention_mask")                   [*B, T_full], 1 on real tokens
    ("text", "prompt" | "response" | "full")          str per sample
    ("history", "prompt" | "response" | "full")       History [*B, n_messages]
    ("next", "reward")                                float [*B, 1, 1] (GRPO convention)

Leading batch dims are flattened row-major (sample ``i`` is the same rollout in every reader);
inputs may be padded, ragged lazy stacks, lazy stacks of padded batches, or nested tensors.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase
from tensordict.utils import NestedKey

from . import _ragged
from ._ragged import Ragged, available_keys, batch_numel, first_member, has_key

__all__ = [
    "ATTENTION_MASK_KEY", "DONE_KEY", "PaddingLostError", "Part", "REWARD_KEY", "Ragged", "TORCHRL_ROOT_KEYS",
    "available_keys", "batch_numel", "check_padding_kept", "check_strings_kept", "decoded_padding", "first_member",
    "has_key", "history_key", "padding_checked_once", "padding_text", "read_column", "read_history", "read_text",
    "read_tokens", "text_key", "to_messages", "token_key",
]

Part = Literal["prompt", "response", "full"]
_PARTS = ("prompt", "response", "full")

ATTENTION_MASK_KEY: NestedKey = ("masks", "all_attention_mask")
#: Top-level keys TorchRL writes into LLM rollouts (any other, e.g. ``"answer"``, came from the dataset).
TORCHRL_ROOT_KEYS = frozenset({
    "text", "history", "tokens", "masks", "log_probs", "next", "done", "terminated",
    "truncated", "step_count", "reward", "action", "is_init", "collector", "advantage",
})  # fmt: skip
#: Where TorchRL's GRPO pipeline (``MCAdvantage``, reward parsers) reads the reward.
REWARD_KEY: NestedKey = ("next", "reward")
#: Whether a step ended its episode (``[*B, 1]`` bool).
DONE_KEY: NestedKey = ("next", "done")


def _part_key(root: str, part: str) -> NestedKey:
    if part not in _PARTS:
        owner = {"tokens": "token_key", "text": "text_key", "history": "history_key"}[root]
        raise ValueError(f"{owner}: part must be one of {_PARTS}, got {part!r}")
    return (root, part)


def token_key(part: Part) -> NestedKey:
    """``("tokens", part)``."""
    return _part_key("tokens", part)


def text_key(part: Part) -> NestedKey:
    """``("text", part)``."""
    return _part_key("text", part)


def history_key(part: Part) -> NestedKey:
    """``("history", part)``."""
    return _part_key("history", part)


def read_tokens(
    td: TensorDictBase, part: Part = "full", *, key: NestedKey | None = None,
    mask_key: NestedKey | None = ATTENTION_MASK_KEY, check: bool = True,
) -> Ragged:
    """The real (unpadded) token ids of each sample at ``("tokens", part)`` (or ``key``, e.g.
    ``("log_probs", "response")``).

    Padding is removed with the full sequence's mask at ``mask_key`` when present; ``part``
    says how it lines up. Padded rows whose mask took real tokens for padding (pad == eos)
    are read with the mask rebuilt from the tokens (:func:`check_padding_kept`; ``check=False``
    skips that). Returns :class:`Ragged` int64 ids, one sample per batch element. Raises
    ``KeyError`` naming the available keys, ``ValueError`` for a mask that does not fit and
    :class:`PaddingLostError` for ragged rows that lost tokens to padding.

    Examples:
        Left-padded tokens (``pad_output=True``) and ragged ones read the same:

        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> padded = TensorDict({"tokens": {"full": torch.tensor([[0, 5, 6], [7, 8, 9]])},
        ...                      "masks": {"all_attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}}, [2])
        >>> read_tokens(padded).tolist()
        [[5, 6], [7, 8, 9]]
        >>> ragged = lazy_stack([TensorDict({"tokens": {"full": torch.tensor(t)}}) for t in ([5, 6], [7, 8, 9])])
        >>> read_tokens(ragged).tolist()
        [[5, 6], [7, 8, 9]]
    """
    key = token_key(part) if key is None else key
    try:
        tokens = _ragged.chunks(td, key)
    except KeyError:
        _ragged.require(td, key, "read_tokens")
        raise
    lost = _padding_loss(td, repairable=True) if check and key[0] in ("tokens", "log_probs") else None
    if mask_key is None or not has_key(td, mask_key):
        values = [t.reshape(-1) for t in tokens]
        lengths = [n for t in tokens for n in [t.shape[-1]] * t.shape[0]]
        return Ragged(torch.cat(values), torch.tensor(lengths, dtype=torch.long))
    masks = _ragged.chunks(td, mask_key)
    if lost is not None and mask_key == ATTENTION_MASK_KEY:
        masks = _rebuilt_masks(td, masks, lost)
    if [t.shape[0] for t in tokens] != [m.shape[0] for m in masks]:
        # one side stacks and the other does not: line them up sample by sample
        tokens, masks = _rows(tokens), _rows(masks)
    if part != "full":
        masks = [_slice_mask(m, t.shape[-1], part) for m, t in zip(masks, tokens)]
    for m, t in zip(masks, tokens):
        if m is None or m.shape != t.shape:
            raise ValueError(
                f"read_tokens: the mask at {mask_key!r} (width {None if m is None else m.shape[-1]}) does not line "
                f"up with the tokens at {key!r} (shape {tuple(t.shape)}); expected the full sequence's attention mask"
            )
    if len({t.shape[-1] for t in tokens}) == 1:  # one vectorised pass
        tokens, masks = [torch.cat(tokens)], [torch.cat(masks)]
    masks = [m.bool() for m in masks]
    values = torch.cat([t[m] for t, m in zip(tokens, masks)])
    return Ragged(values, torch.cat([m.sum(-1) for m in masks]))


def _rows(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [row for part in parts for row in part.split(1)]


def _slice_mask(full_mask: torch.Tensor, width: int, part: str) -> torch.Tensor | None:
    n = full_mask.shape[-1]
    if n < width:
        return None
    return full_mask[..., :width] if part == "prompt" else full_mask[..., n - width :]


class PaddingLostError(ValueError):
    """Rollouts in which TorchRL's wrapper took real tokens for padding (its pad token is also a
    token of the chat, most often the EOS): what it dropped cannot be read back."""


#: how to collect rollouts that keep their tokens (troubleshooting.md says why)
_PAD_FIX = "collect with torchrl_trl.safe_policy_wrapper (a pad token of its own)"


def _holes(mask: torch.Tensor) -> torch.Tensor:
    """Per row of a ``[n, T]`` bool mask, whether a 0 lies between its first and last 1."""
    first = mask.int().argmax(-1)
    last = mask.shape[-1] - 1 - mask.flip(-1).int().argmax(-1)
    return mask.any(-1) & (mask.sum(-1) != last - first + 1)


def _lost_pad_id(td: TensorDictBase) -> tuple[int, bool] | None | Literal[False]:
    """For padded rows that TorchRL's mask took real tokens from: ``(the pad id, whether a
    prompt lost tokens)``; ``None`` when every masked-out id is padding, ``False`` when no row
    is padded. Lost tokens show as 0s between real tokens, or as an id both masked out and real
    (a safe pad never occurs in a chat)."""
    masks, fulls = _chunks_if_set(td, ATTENTION_MASK_KEY), _chunks_if_set(td, token_key("full"))
    if masks is None or fulls is None or not has_key(td, token_key("prompt")):
        return False  # TorchRL's wrappers write all three: anything else is not their padding
    if bool(torch.cat([m.reshape(-1) for m in masks]).all()):
        return False  # one pass where nothing is padded (ragged rows)
    masked, real, hole_ids = [], [], []
    for t, m in zip(fulls, masks):
        m = m.bool()
        if t.shape != m.shape or m.all():
            continue
        t, m = t[m.any(-1)], m[m.any(-1)]  # a row with no real token says nothing of its padding
        masked.append(t[~m].unique())
        real.append(t[m].unique())
        if (holes := _holes(m)).any():
            row = holes.nonzero()[0, 0]
            inside = (m[row].int().cumsum(-1) > 0) & (m[row].flip(-1).int().cumsum(-1).flip(-1) > 0)
            hole_ids.append(t[row][inside & ~m[row]][:1])
    if hole_ids:
        return int(hole_ids[0]), True
    if not masked:
        return False
    masked_ids = torch.cat(masked).unique()
    shared = masked_ids[torch.isin(masked_ids, torch.cat(real))]
    return (int(shared[0]), False) if shared.numel() else None


def _short_rows(td: TensorDictBase) -> str | None:
    """Where no row is padded (the stored widths are the real lengths): the first sample whose
    ``("tokens", "full")`` is shorter than its prompt + response, described; else ``None``."""
    try:
        prompt, response, full = (_widths(td, token_key(p)) for p in _PARTS)
    except KeyError:
        return None
    short = (full < prompt + response).nonzero().flatten()
    if not short.numel():
        return None
    i = int(short[0])
    return f"sample {i}'s ('tokens', 'full') holds {int(full[i])} tokens, its prompt + response {int(prompt[i] + response[i])}"


_CHECKED: ContextVar[dict | None] = ContextVar("torchrl_trl_padding_checked", default=None)


def _memoised(td: TensorDictBase, scan):
    """``scan(td)``, computed once per ``td`` object inside :func:`padding_checked_once`."""
    memo = _CHECKED.get()
    if memo is None:
        return scan(td)
    key = (id(td), scan.__name__)
    if key not in memo:
        memo[key] = (td, scan(td))  # td held: its id cannot be reused while the memo lives
    return memo[key][1]


@contextmanager
def padding_checked_once():
    """Within this context, each rollout batch (the same tensordict object) is checked for
    tokens lost to padding once, however many readers read it; it must not change meanwhile."""
    token = _CHECKED.set({})
    try:
        yield
    finally:
        _CHECKED.reset(token)


def _rebuilt_masks(td: TensorDictBase, masks: list[torch.Tensor], pad_id: int) -> list[torch.Tensor]:
    """Full-sequence masks of padded rows rebuilt from the tokens where ``pad_id`` was also a
    real token: the prompt is real after its left padding, the response up to and with its
    first ``pad_id`` (the EOS generation stopped at), all of it when it holds none."""
    fulls, prompts = _ragged.chunks(td, token_key("full")), _ragged.chunks(td, token_key("prompt"))
    out = []
    for t, m, p in zip(fulls, masks, prompts):
        width, prompt_width = t.shape[-1], p.shape[-1]
        if m.shape != t.shape or prompt_width > width:
            out.append(m)
            continue
        cols = torch.arange(width).expand(t.shape)
        prompt_start = m[:, :prompt_width].int().argmax(-1, keepdim=True)
        is_pad = t[:, prompt_width:] == pad_id
        stop = torch.where(is_pad.any(-1), is_pad.int().argmax(-1), width - prompt_width).unsqueeze(-1)
        out.append((cols >= prompt_start) & ((cols < prompt_width) | (cols - prompt_width <= stop)))
    return out


def _chunks_if_set(td: TensorDictBase, key: NestedKey) -> list[torch.Tensor] | None:
    """:func:`_ragged.chunks`, ``None`` where ``key`` is not set (cheaper than asking first)."""
    try:
        return _ragged.chunks(td, key)
    except KeyError:
        return None


def _widths(td: TensorDictBase, key: NestedKey) -> torch.Tensor:
    """Each sample's stored width at ``key`` (its length where nothing is padded); ``KeyError`` if unset."""
    return torch.tensor([n for t in _ragged.chunks(td, key) for n in [t.shape[-1]] * t.shape[0]])


def _has_text(td: TensorDictBase) -> bool:
    return any(has_key(td, key(part)) for key in (text_key, history_key) for part in ("prompt", "full"))


def _rebuilt_texts(td: TensorDictBase, part: Part, tokenizer: Any) -> list[str] | None:
    """``None`` for rows whose padding kept every token; for padded rows that lost tokens to
    padding, ``part``'s text decoded from the rebuilt tokens (a ``PaddingLostError`` without
    ``tokenizer``); ragged rows that lost tokens raise."""
    if _padding_loss(td, repairable=True) is None:
        return None
    if tokenizer is None:
        _padding_loss(td)  # raises, saying how to read them
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in read_tokens(td, part).tolist()]


def check_padding_kept(td: TensorDictBase, *, repairable: bool = False) -> None:
    """A :class:`PaddingLostError` when TorchRL's wrapper took real tokens of ``td`` for padding
    (its pad token was the EOS or another token of the chat):

    - padded rows (``pad_output=True``) where an id under the mask's 0s is also a real token.
      Their tokens are all there: with ``repairable=True`` they pass (:func:`read_tokens`
      rebuilds their mask), else the error says how to read them; but rows without text or
      chat (``input_mode="tokens"``) whose prompt lost tokens were generated from a prompt with
      those tokens masked out, and are refused;
    - ragged rows (``pad_output=False``) whose ``("tokens", "full")`` is shorter than prompt +
      response (chats: the prompt's end-of-turn tokens were dropped): the reply's final EOS, its
      log-prob and the reply's text are gone, and whether a reply ended cannot be told.

    Not caught: ragged rows of ``input_mode="text"`` or ``"tokens"`` whose only loss is the
    reply's EOS look whole (the row holds no trace of it); :func:`torchrl_trl.check_policy_padding`
    refuses the policy that writes them.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> rows = TensorDict({"tokens": {"full": torch.tensor([[5, 2, 6, 7, 2, 2]]), "prompt": torch.tensor([[5, 2, 6]]),
    ...                               "response": torch.tensor([[7, 2, 2]])},
    ...                    "masks": {"all_attention_mask": torch.tensor([[1, 0, 1, 1, 0, 0]])}}, [1])
    >>> check_padding_kept(rows)  # the EOS (2) was the pad: a 0 between real tokens
    Traceback (most recent call last):
    ...
    torchrl_trl.layouts.PaddingLostError: check_padding_kept: expected pad != EOS, got token id 2 real under the mask's 0s: input_mode='tokens' prompts were masked in generate, not trainable; collect with torchrl_trl.safe_policy_wrapper (a pad token of its own)
    """
    _padding_loss(td, repairable=repairable)


def _padding_loss(td: TensorDictBase, *, repairable: bool = False) -> int | None:
    """:func:`check_padding_kept`, returning the pad id of padded rows that pass as repairable
    (``None``: nothing was lost)."""
    lost = _memoised(td, _lost_pad_id)
    if lost:
        pad, prompt_masked = lost
        text = _has_text(td)
        if repairable and (text or not prompt_masked):
            return pad
        why = (
            "input_mode='tokens' prompts were masked in generate, not trainable" if prompt_masked and not text else
            "texts are cut, tokens whole: read_text(tokenizer=) rebuilds them"
        )
        raise PaddingLostError(
            f"check_padding_kept: expected pad != EOS, got token id {pad} real under the mask's 0s: {why}; {_PAD_FIX}"
        )
    if lost is None:
        return None  # padded rows whose masked ids are all padding
    if (found := _memoised(td, _short_rows)) is None:
        return None
    raise PaddingLostError(
        f"check_padding_kept: expected whole rollouts, they lost tokens to padding (pad == eos): {found}; "
        f"{_PAD_FIX} and collect again"
    )


def read_column(td: TensorDictBase, key: NestedKey) -> list[Any]:
    """Per-sample values at ``key``: Python objects for non-tensor data, tensors (one per
    sample, ragged allowed) otherwise."""
    _ragged.require(td, key, "read_column")
    lazy = isinstance(td, LazyStackedTensorDict)
    value = td.get(key, as_list=True) if lazy else _ragged.get_values(td, key)
    if isinstance(value, list) and not lazy:
        return value  # one value per sample already
    if isinstance(value, (NonTensorData, NonTensorStack)):
        _refuse_memmap_strings(td, key)
        return _ragged.flatten(value.tolist(), td.batch_dims)
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return list(value.reshape(-1, *value.shape[td.batch_dims :]).unbind(0))
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    return _ragged.flatten(value, td.batch_dims)


def _strings(td: TensorDictBase, key: NestedKey) -> list[str]:
    values = read_column(td, key)
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(f"read_text: key {key!r}: sample {i} holds {type(v).__name__} {v!r:.40}, expected a string")
    return values


def read_text(td: TensorDictBase, part: Part = "full", *, tokenizer: Any = None) -> list[str]:
    """The text of each sample at ``("text", part)``; ``"full"`` falls back to
    prompt + response. Pad strings TorchRL decoded into the text (``input_mode="history"``,
    ``pad_output=True``) are removed where the mask says (``tokenizer``: see :func:`padding_text`).
    Rows that lost tokens to padding (:func:`check_padding_kept`) are decoded from their
    rebuilt tokens with ``tokenizer`` where padded, else refused. Raises ``TypeError`` for a
    non-string, ``ValueError`` for strings lost in storage (:func:`check_strings_kept`)."""
    key = text_key(part)
    if has_key(td, token_key("full")) and (rebuilt := _rebuilt_texts(td, part, tokenizer)) is not None:
        return rebuilt
    if part == "full" and not has_key(td, key) and has_key(td, text_key("prompt")):
        prompts, responses = read_text(td, "prompt"), read_text(td, "response")
        return [p + r for p, r in zip(prompts, responses)]
    texts = _strings(td, key)
    check_strings_kept(td, part, texts)
    if part == "prompt" or not _padded_text_possible(td):
        return texts
    full = texts if part == "full" else _strings(td, text_key("full"))
    pad = padding_text(td, tokenizer)
    if not pad:
        return texts
    clean = [_unpad(text, pad, n, m) for text, n, m in zip(full, *_pad_counts(td))]
    if part == "full":
        return clean
    out = []
    for i, (c, f, p, t) in enumerate(zip(clean, full, read_text(td, "prompt"), texts)):
        if c is f:  # nothing was stripped
            out.append(t)
        elif c.startswith(p):
            out.append(c[len(p) :])
        else:
            raise ValueError(f"read_text: sample {i}: expected the unpadded text.full to start with text.prompt")
    return out


_LOST_STRINGS = "LazyMemmapStorage reads every stored string back as the first: store them in a LazyStackStorage"


def check_strings_kept(td: TensorDictBase, part: Part = "full", strings: list[str] | None = None) -> None:
    """Raise ``ValueError`` (naming the key and the storages that keep strings) where text
    cannot be what TorchRL wrote: ``td`` is memory-mapped and :func:`memmap_keeps_strings`
    is false, or every sample holds the same ``("text", part)`` (``strings`` if already
    read) while their ``("tokens", part)`` differ."""
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
            f"check_strings_kept: expected one {key!r} per {ids_key!r}, every sample reads {str(first)!r:.30}: "
            f"{_LOST_STRINGS}"
        )


def _refuse_memmap_strings(td: TensorDictBase, key: NestedKey) -> None:
    if td.is_memmap() and not memmap_keeps_strings():
        raise ValueError(f"read_column: key {key!r} is memory-mapped, expected strings kept: {_LOST_STRINGS}")


@functools.cache
def memmap_keeps_strings() -> bool:
    """Whether this TorchRL's ``LazyMemmapStorage`` reads strings back as written (probed once)."""
    import tempfile

    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    with tempfile.TemporaryDirectory() as tmp:
        rb = ReplayBuffer(storage=LazyMemmapStorage(2, scratch_dir=tmp))
        rb.extend(TensorDict({"s": ["a", "b"]}, batch_size=[2]))
        return [str(s) for s in rb[:].get("s")] == ["a", "b"]


def _padded_text_possible(td: TensorDictBase) -> bool:
    keys = (ATTENTION_MASK_KEY, text_key("full"), text_key("prompt"), token_key("full"))
    return all(has_key(td, k) for k in keys)


def _pad_counts(td: TensorDictBase) -> tuple[list[int], list[int]]:
    """Per sample, the pad columns before and after the real tokens."""
    lead, trail = [], []
    for m in _ragged.chunks(td, ATTENTION_MASK_KEY):
        m = m.bool()
        lead += (m.cumsum(-1) == 0).sum(-1).tolist()
        trail += (m.flip(-1).cumsum(-1) == 0).sum(-1).tolist()
    return lead, trail


def _unpad(text: str, pad: str, lead: int, trail: int) -> str:
    """``text`` without ``lead`` pads before and ``trail`` after, where present."""
    if lead and text.startswith(pad * lead):
        text = text[len(pad) * lead :]
    if trail and text.endswith(pad * trail):
        text = text[: len(text) - len(pad) * trail]
    return text


def _pad_string(tokenizer: Any, pad_id: int | None = None) -> str:
    """The string ``tokenizer`` decodes its pad token (or ``pad_id``) to."""
    pad_id = tokenizer.pad_token_id if pad_id is None else pad_id
    return tokenizer.decode([pad_id], skip_special_tokens=False)


def padding_text(td: TensorDictBase, tokenizer: Any = None) -> str | None:
    """The string one pad token decodes to in ``td``'s stored text, or ``None`` if none.

    ``tokenizer`` decodes the pad id; without it, the pad string is read off the samples,
    else taken from :func:`decoded_padding`. Raises ``ValueError`` when samples disagree or
    the padding cannot be told apart from text without the tokenizer.
    """
    lead, trail = _pad_counts(td)
    if not any(lead) and not any(trail):
        return None
    full = read_column(td, text_key("full"))
    if tokenizer is not None:
        pad = _pad_string(tokenizer, _pad_id(td))
        found = any(_unpad(f, pad, n, m) != f for f, n, m in zip(full, lead, trail))
        return pad if found else None
    if not has_key(td, history_key("prompt")):
        return None  # TorchRL decodes padded text only in history mode
    found, clean_rows = set(), 0
    for f, p, before, after in zip(full, read_column(td, text_key("prompt")), lead, trail):
        at = f.find(p) if p else -1
        if before and at == 0:
            clean_rows += 1  # the text starts with its prompt: no pads were decoded
        elif before and at > 0 and at % before == 0 and f[: at // before] * before == f[:at]:
            found.add(f[: at // before])
        elif not before and after >= 2 and (period := _shortest_period(f, after)):
            found.add(period)
    if len(found) > 1:
        raise ValueError(
            f"padding_text: expected one pad string, the stored text holds {sorted(found)}; pass tokenizer="
        )
    if found:
        return found.pop()
    if clean_rows:
        return None
    if _PAD_TEXT.get() is not None:
        return _PAD_TEXT.get()
    raise ValueError(
        "padding_text: expected the pad string of text decoded from pad_output=True tokens, none in these samples; "
        "pass the policy's tokenizer (RowColumns(tokenizer=), RewardRenderer(policy_tokenizer=), ...)"
    )


def _shortest_period(text: str, repeats: int) -> str | None:
    """The shortest ``s`` such that ``text`` ends with ``s * repeats``, if any."""
    for n in range(1, len(text) // repeats + 1):
        if text.endswith(text[-n:] * repeats):
            return text[-n:]
    return None


_PAD_TEXT: ContextVar[str | None] = ContextVar("torchrl_trl_pad_text", default=None)


@contextmanager
def decoded_padding(tokenizer: Any = None, *, pad_text: str | None = None):
    """Within this context, readers take ``pad_text`` (default: ``tokenizer``'s decoded pad
    token) as the pad string of padded text wherever the samples do not show it."""
    if pad_text is None and tokenizer is not None:
        pad_text = _pad_string(tokenizer)
    token = _PAD_TEXT.set(pad_text)
    try:
        yield
    finally:
        _PAD_TEXT.reset(token)


def _pad_id(td: TensorDictBase) -> int:
    for t, m in zip(_ragged.chunks(td, token_key("full")), _ragged.chunks(td, ATTENTION_MASK_KEY)):
        if t.shape == m.shape and not m.bool().all():
            return int(t[~m.bool()][0])
    raise ValueError("padding_text: expected a padded position in ('tokens', 'full'), found none")


def _messages(conversation: Any) -> list[dict]:
    """The message dicts of one conversation, TorchRL's ``"<none>"`` padding dropped."""
    if hasattr(conversation, "tolist"):
        conversation = conversation.tolist()
    if isinstance(conversation, dict):
        conversation = [conversation]
    return [m for m in conversation if m.get("role") not in (None, "<none>")]


def to_messages(history: Any) -> list[dict[str, str]]:
    """A TorchRL ``History`` (one conversation) or list of message dicts -> TRL's
    ``[{"role", "content"}, ...]`` (extra fields and ``"<none>"`` padding dropped).
    Raises ``TypeError`` for a role or content that is not a string."""
    out = []
    for i, m in enumerate(_messages(history)):
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            role, content = type(m["role"]).__name__, type(m["content"]).__name__
            raise TypeError(
                f"to_messages: chat message {i} has role {role} and content {content} ({m['content']!r:.40}); "
                "expected strings")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def read_history(td: TensorDictBase, part: Part = "full", *, tokenizer: Any = None) -> list[list[dict[str, str]]]:
    """The chat of each sample at ``("history", part)`` as role/content dicts, pad strings
    TorchRL left in an open turn removed (``tokenizer`` as in :func:`read_text`). Replies of
    padded rows that lost tokens to padding are rebuilt from their tokens with ``tokenizer``
    (else refused, as in :func:`read_text`)."""
    key = history_key(part)
    _ragged.require(td, key, "read_history")
    check_strings_kept(td)  # chat content is no witness: two token rows can parse to one chat
    if part != "prompt" and has_key(td, token_key("full")):
        replies = _rebuilt_texts(td, "response", tokenizer)
        if replies is not None:
            return _rebuilt_history(td, part, replies, tokenizer)
    raw = []
    for sub in _ragged.leaves(td):
        history = sub.get(key)
        raw.extend(_ragged.flatten(history.tolist(), history.batch_dims - 1))
    out = [to_messages(c) for c in raw]
    if part != "prompt" and _padded_text_possible(td):
        # a turn left open (an EOS that is not the end-of-turn marker) holds the pads that followed
        _, trail = _pad_counts(td)
        open_rows = [i for i, (c, t) in enumerate(zip(raw, trail)) if t and not _complete(c)]
        pad = padding_text(td, tokenizer) if open_rows else None
        for i in open_rows if pad else ():
            out[i] = _strip_trailing(out[i], pad)
    return out


def _rebuilt_history(td: TensorDictBase, part: Part, replies: list[str], tokenizer: Any) -> list[list[dict[str, str]]]:
    """The chats of padded rows whose replies were cut by padding: the stored prompt turns, then
    each reply decoded from its rebuilt tokens, its closing EOS left out."""
    eos = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False) if tokenizer.eos_token_id is not None else None
    messages = [[{"role": "assistant", "content": r[: -len(eos)] if eos and r.endswith(eos) else r}] for r in replies]
    if part == "response":
        return messages
    return [prompt + reply for prompt, reply in zip(read_history(td, "prompt"), messages)]


def _complete(conversation: Any) -> bool:
    messages = _messages(conversation)
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
