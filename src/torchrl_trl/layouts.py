"""Read TorchRL LLM layouts into per-sample sequences, texts and chat messages: the one
place that knows the keys TorchRL's LLM wrappers, ``ChatEnv`` and ``LLMCollector`` write::

    ("tokens", "prompt" | "response" | "full")       int64 [*B, T] padded, or ragged
    ("masks", "all_attention_mask")                   [*B, T_full], 1 on real tokens
    ("text", "prompt" | "response" | "full")          str per sample
    ("history", "prompt" | "response" | "full")       History [*B, n_messages]
    ("next", "reward")                                float [*B, 1, 1] (GRPO convention)

Leading batch dims are flattened row-major; inputs may be padded, ragged lazy stacks, lazy
stacks of padded batches, or nested tensors. Within :func:`read_once` every reader of a batch
shares one walk of it, one read of each key and the padding checks (their tensor side is in
:mod:`torchrl_trl.padding`).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from . import padding
from ._buffers import memmap_keeps_strings
from ._ragged import Batch, Ragged, available_keys, batch_numel, batch_of, first_member, flatten, read_once, reads_once
from .padding import PaddingLostError

__all__ = [
    "ATTENTION_MASK_KEY", "DONE_KEY", "PARTS", "PaddingLostError", "Part", "REWARD_KEY", "Ragged", "TORCHRL_ROOT_KEYS",
    "available_keys", "batch_numel", "check_padding_kept", "check_strings_kept", "decoded_padding", "first_member",
    "has_key", "history_key", "memmap_keeps_strings", "padding_text", "read_column", "read_history", "read_once",
    "read_text", "read_tokens", "text_key", "to_messages", "token_key",
]

Part = Literal["prompt", "response", "full"]
PARTS = ("prompt", "response", "full")

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
    if part not in PARTS:
        owner = {"tokens": "token_key", "text": "text_key", "history": "history_key"}[root]
        raise ValueError(f"{owner}: part must be one of {PARTS}, got {part!r}")
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


@reads_once
def has_key(td: TensorDictBase, key: NestedKey) -> bool:
    """Whether ``key`` is set (and not ``None``) in every sample of ``td``, even where its values cannot be stacked.

    >>> from tensordict import TensorDict
    >>> td = TensorDict({"tokens": {"full": torch.tensor([[5, 6], [7, 8]])}}, [2])
    >>> with read_once():  # the readers of td share one walk of it and one read of each key
    ...     has_key(td, token_key("full")), read_tokens(td).tolist()
    (True, [[5, 6], [7, 8]])
    """
    return batch_of(td).has(key)


@reads_once
def read_tokens(
    td: TensorDictBase, part: Part = "full", *, key: NestedKey | None = None,
    mask_key: NestedKey | None = ATTENTION_MASK_KEY, check: bool = True,
) -> Ragged:
    """The real token ids of each sample at ``("tokens", part)`` (or ``key``, e.g.
    ``("log_probs", "response")``) as :class:`Ragged`, unpadded with the full sequence's mask
    at ``mask_key`` when present; a mask that took real tokens for padding is rebuilt from the
    tokens (:func:`check_padding_kept`; ``check=False`` skips that). Raises ``KeyError``,
    ``ValueError`` for a mask that does not fit, :class:`PaddingLostError` for ragged rows that
    lost tokens to padding.

    >>> from tensordict import TensorDict, lazy_stack
    >>> padded = TensorDict({"tokens": {"full": torch.tensor([[0, 5, 6], [7, 8, 9]])},
    ...                      "masks": {"all_attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}}, [2])
    >>> read_tokens(padded).tolist()
    [[5, 6], [7, 8, 9]]
    >>> ragged = lazy_stack([TensorDict({"tokens": {"full": torch.tensor(t)}}) for t in ([5, 6], [7, 8, 9])])
    >>> read_tokens(ragged).tolist()  # ragged rows read the same
    [[5, 6], [7, 8, 9]]
    """
    b, key = batch_of(td), token_key(part) if key is None else key
    b.require(key, "read_tokens")
    tokens = b.chunks(key)
    lost = _padding_loss(b, repairable=True) if check and key[0] in ("tokens", "log_probs") else None
    if mask_key is None or not b.has(mask_key):
        values = [t.reshape(-1) for t in tokens]
        lengths = [n for t in tokens for n in [t.shape[-1]] * t.shape[0]]
        return Ragged(torch.cat(values), torch.tensor(lengths, dtype=torch.long))
    masks = b.chunks(mask_key)
    if lost is not None and mask_key == ATTENTION_MASK_KEY:
        masks = padding.rebuilt_masks(b.chunks(token_key("full")), masks, b.chunks(token_key("prompt")), lost)
    if [t.shape[0] for t in tokens] != [m.shape[0] for m in masks]:  # line them up sample by sample
        tokens, masks = ([row for c in side for row in c.split(1)] for side in (tokens, masks))
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


def _slice_mask(full_mask: torch.Tensor, width: int, part: str) -> torch.Tensor | None:
    n = full_mask.shape[-1]
    if n < width:
        return None
    return full_mask[..., :width] if part == "prompt" else full_mask[..., n - width :]


def _lost_pad_id(b: Batch) -> tuple[int, bool] | None | Literal[False]:
    """:func:`torchrl_trl.padding.lost_pad_id` of the batch; ``False`` unless TorchRL's wrapper wrote it."""
    masks, fulls = b.chunks(ATTENTION_MASK_KEY, None), b.chunks(token_key("full"), None)
    if masks is None or fulls is None or not b.has(token_key("prompt")):
        return False
    return padding.lost_pad_id(fulls, masks)


def _short_rows(b: Batch) -> str | None:
    """:func:`torchrl_trl.padding.short_row` of the stored widths."""
    try:
        widths = [[n for t in b.chunks(token_key(p)) for n in [t.shape[-1]] * t.shape[0]] for p in PARTS]
    except KeyError:
        return None
    return padding.short_row(*widths)


def _rebuilt_texts(b: Batch, part: Part, tokenizer: Any) -> list[str] | None:
    """``None`` where padding kept every token, else ``part``'s text decoded from the rebuilt tokens."""
    if _padding_loss(b, repairable=True) is None:
        return None
    if tokenizer is None:
        _padding_loss(b)  # raises, saying how to read them
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in read_tokens(b.td, part).tolist()]


@reads_once
def check_padding_kept(td: TensorDictBase, *, repairable: bool = False) -> None:
    """A :class:`PaddingLostError` when TorchRL's wrapper took real tokens of ``td`` for padding
    (its pad token was the EOS or another token of the chat): padded rows where an id under the
    mask's 0s is also a real token (they pass with ``repairable=True``, unless an
    ``input_mode="tokens"`` prompt lost tokens), or ragged rows whose ``("tokens", "full")`` is
    shorter than prompt + response. Ragged rows whose only loss is the reply's EOS look whole:
    :func:`torchrl_trl.padding.check_policy_padding` refuses the policy that writes them.

    >>> from tensordict import TensorDict
    >>> rows = TensorDict({"tokens": {"full": torch.tensor([[5, 2, 6, 7, 2, 2]]), "prompt": torch.tensor([[5, 2, 6]]),
    ...                               "response": torch.tensor([[7, 2, 2]])},
    ...                    "masks": {"all_attention_mask": torch.tensor([[1, 0, 1, 1, 0, 0]])}}, [1])
    >>> check_padding_kept(rows)  # the EOS (2) was the pad: a 0 between real tokens
    Traceback (most recent call last):
    ...
    torchrl_trl.padding.PaddingLostError: check_padding_kept: expected pad != EOS, got token id 2 real under the mask's 0s: input_mode='tokens' prompts were masked in generate, not trainable; collect with torchrl_trl.safe_policy_wrapper (a pad token of its own)
    """
    _padding_loss(batch_of(td), repairable=repairable)


def _padding_loss(b: Batch, *, repairable: bool = False) -> int | None:
    """:func:`check_padding_kept`, returning the pad id of repairable rows (``None``: nothing lost)."""
    lost = b.once("lost_pad_id", lambda: _lost_pad_id(b))
    if lost:
        pad, prompt_masked = lost
        text = any(b.has(key(part)) for key in (text_key, history_key) for part in ("prompt", "full"))
        if repairable and (text or not prompt_masked):
            return pad
        why = (
            "input_mode='tokens' prompts were masked in generate, not trainable" if prompt_masked and not text else
            "texts are cut, tokens whole: read_text(tokenizer=) rebuilds them"
        )
        raise PaddingLostError(f"check_padding_kept: expected pad != EOS, got token id {pad} real under the mask's "
                               f"0s: {why}; {padding.COLLECT_FIX}")
    if lost is None or (found := b.once("short_rows", lambda: _short_rows(b))) is None:
        return None  # padded rows whose masked ids are all padding, or whole ragged rows
    raise PaddingLostError(
        f"check_padding_kept: expected whole rollouts, they lost tokens to padding (pad == eos): {found}; "
        f"{padding.COLLECT_FIX} and collect again"
    )


@reads_once
def read_column(td: TensorDictBase, key: NestedKey, *, stack: bool = False) -> list[Any] | torch.Tensor:
    """Per-sample values at ``key``: Python objects for non-tensor data, else tensors (ragged allowed);
    with ``stack=True``, one ``[B, ...]`` tensor where every sample holds a tensor of one shape."""
    b = batch_of(td)
    b.require(key, "read_column")
    if stack and (stacked := b.stacked(key)) is not None:
        return stacked
    values = b.values(key)
    if values and not isinstance(values[0], torch.Tensor):
        _refuse_memmap_strings(b, key, "read_column")
    return list(values)


def _strings(td: TensorDictBase, key: NestedKey) -> list[str]:
    values = read_column(td, key)
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(f"read_text: key {key!r}: sample {i} holds {type(v).__name__} {v!r:.40}, expected a string")
    return values


@reads_once
def read_text(td: TensorDictBase, part: Part = "full", *, tokenizer: Any = None) -> list[str]:
    """The text of each sample at ``("text", part)`` (``"full"`` falls back to prompt + response),
    pad strings TorchRL decoded into it removed (:func:`padding_text`); rows that lost tokens to
    padding are decoded from their rebuilt tokens with ``tokenizer``, else refused. Raises
    ``TypeError`` for a non-string, ``ValueError`` for strings lost in storage."""
    b, key = batch_of(td), text_key(part)
    if b.has(token_key("full")) and (rebuilt := _rebuilt_texts(b, part, tokenizer)) is not None:
        return rebuilt
    if part == "full" and not b.has(key) and b.has(text_key("prompt")):
        return [p + r for p, r in zip(read_text(td, "prompt"), read_text(td, "response"))]
    texts = _strings(td, key)
    check_strings_kept(td, part, texts)
    if part == "prompt" or not _padded_text_possible(b):
        return texts
    full = texts if part == "full" else _strings(td, text_key("full"))
    pad = padding_text(td, tokenizer)
    if not pad:
        return texts
    clean = [padding.unpad(text, pad, n, m) for text, n, m in zip(full, *_pad_counts(b))]
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


@reads_once
def check_strings_kept(td: TensorDictBase, part: Part = "full", strings: list[str] | None = None) -> None:
    """A ``ValueError`` where text cannot be what TorchRL wrote: ``td`` is memory-mapped and
    :func:`memmap_keeps_strings` is false, or every sample holds the same ``("text", part)``
    (``strings`` if already read) while their ``("tokens", part)`` differ."""
    b, key, ids_key = batch_of(td), text_key(part), token_key(part)
    _refuse_memmap_strings(b, key, "check_strings_kept")
    if b.numel < 2 or not b.has(ids_key) or (strings is None and not b.has(key)):
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


def _refuse_memmap_strings(b: Batch, key: NestedKey, what: str) -> None:
    if b.once("is_memmap", b.td.is_memmap) and not memmap_keeps_strings():
        raise ValueError(f"{what}: key {key!r} is memory-mapped, expected strings kept: {_LOST_STRINGS}")


def _padded_text_possible(b: Batch) -> bool:
    return all(b.has(k) for k in (ATTENTION_MASK_KEY, text_key("full"), text_key("prompt"), token_key("full")))


def _pad_counts(b: Batch) -> tuple[list[int], list[int]]:
    """Per sample, the pad columns before and after the real tokens."""
    return b.once("pad_counts", lambda: padding.pad_counts(b.chunks(ATTENTION_MASK_KEY)))


@reads_once
def padding_text(td: TensorDictBase, tokenizer: Any = None) -> str | None:
    """The string one pad token decodes to in ``td``'s stored text, or ``None``: decoded with
    ``tokenizer``, else read off the samples, else taken from :func:`decoded_padding`. Raises
    ``ValueError`` when samples disagree or the padding cannot be told from text."""
    b = batch_of(td)
    lead, trail = _pad_counts(b)
    if not any(lead) and not any(trail):
        return None
    full = read_column(td, text_key("full"))
    if tokenizer is not None:
        pad_id = padding.first_pad_id(b.chunks(token_key("full")), b.chunks(ATTENTION_MASK_KEY))
        if pad_id is None:
            raise ValueError("padding_text: expected a padded position in ('tokens', 'full'), found none")
        pad = padding.pad_string(tokenizer, pad_id)
        found = any(padding.unpad(f, pad, n, m) != f for f, n, m in zip(full, lead, trail))
        return pad if found else None
    if not b.has(history_key("prompt")):
        return None  # TorchRL decodes padded text only in history mode
    found, clean_rows = padding.pad_strings(full, read_column(td, text_key("prompt")), lead, trail)
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


_PAD_TEXT: ContextVar[str | None] = ContextVar("torchrl_trl_pad_text", default=None)


@contextmanager
def decoded_padding(tokenizer: Any = None, *, pad_text: str | None = None):
    """Within this context, readers take ``pad_text`` (default: ``tokenizer``'s decoded pad
    token) as the pad string of padded text wherever the samples do not show it."""
    if pad_text is None and tokenizer is not None:
        pad_text = padding.pad_string(tokenizer)
    token = _PAD_TEXT.set(pad_text)
    try:
        yield
    finally:
        _PAD_TEXT.reset(token)


def _messages(conversation: Any) -> list[dict]:
    """The message dicts of one conversation, TorchRL's ``"<none>"`` padding dropped."""
    if hasattr(conversation, "tolist"):
        conversation = conversation.tolist()
    if isinstance(conversation, dict):
        conversation = [conversation]
    return [m for m in conversation if m.get("role") not in (None, "<none>")]


def to_messages(history: Any) -> list[dict[str, str]]:
    """A TorchRL ``History`` (one conversation) or list of message dicts -> TRL's
    ``[{"role", "content"}, ...]``; ``TypeError`` for a role or content that is not a string."""
    out = []
    for i, m in enumerate(_messages(history)):
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            role, content = type(m["role"]).__name__, type(m["content"]).__name__
            raise TypeError(
                f"to_messages: chat message {i} has role {role} and content {content} ({m['content']!r:.40}); "
                "expected strings")
        out.append({"role": m["role"], "content": m["content"]})
    return out


@reads_once
def read_history(td: TensorDictBase, part: Part = "full", *, tokenizer: Any = None) -> list[list[dict[str, str]]]:
    """The chat of each sample at ``("history", part)`` as role/content dicts, pad strings
    TorchRL left in an open turn removed; ``tokenizer`` as in :func:`read_text`."""
    b, key = batch_of(td), history_key(part)
    b.require(key, "read_history")
    check_strings_kept(td)  # chat content is no witness: two token rows can parse to one chat
    if part != "prompt" and b.has(token_key("full")):
        replies = _rebuilt_texts(b, "response", tokenizer)
        if replies is not None:
            return _rebuilt_history(b, part, replies, tokenizer)
    raw = []
    for leaf in b.leaves:
        history = leaf.get(key)
        raw.extend(flatten(history.tolist(), history.batch_dims - 1))
    out = [to_messages(c) for c in raw]
    if part != "prompt" and _padded_text_possible(b):
        # a turn left open (an EOS that is not the end-of-turn marker) holds the pads that followed
        _, trail = _pad_counts(b)
        open_rows = [i for i, (c, t) in enumerate(zip(raw, trail)) if t and not _complete(c)]
        pad = padding_text(td, tokenizer) if open_rows else None
        for i in open_rows if pad else ():
            out[i] = padding.strip_trailing(out[i], pad)
    return out


def _rebuilt_history(b: Batch, part: Part, replies: list[str], tokenizer: Any) -> list[list[dict[str, str]]]:
    """The stored prompt turns, then each reply decoded from its rebuilt tokens (without its EOS)."""
    eos = tokenizer.eos_token_id
    eos = None if eos is None else tokenizer.decode([eos], skip_special_tokens=False)
    messages = [[{"role": "assistant", "content": r[: -len(eos)] if eos and r.endswith(eos) else r}] for r in replies]
    if part == "response":
        return messages
    return [prompt + reply for prompt, reply in zip(read_history(b.td, "prompt"), messages)]


def _complete(conversation: Any) -> bool:
    messages = _messages(conversation)
    return bool(messages) and bool(messages[-1].get("is_complete", False))
