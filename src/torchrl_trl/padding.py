"""Pad tokens TorchRL's LLM wrappers can trust: the one home of the pad == eos check.

TorchRL's ``TransformersWrapper`` finds padding as ``tokens != tokenizer.pad_token_id``: a pad
token that is also a token of the chat (most often the EOS) loses every occurrence of it, and
``generate`` padding with another id than the tokenizer's leaves pads taken for generated tokens.
:func:`safe_policy_wrapper` builds a wrapper that gets both right; :func:`check_policy_padding`
refuses one that does not. The tensor side of :func:`torchrl_trl.layouts.check_padding_kept`, on
rollouts already collected, is here too (:mod:`.layouts` reads the keys).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch

__all__ = [
    "COLLECT_FIX", "PAD_CANDIDATES", "PaddingLostError", "check_policy_padding", "eos_token_ids", "first_pad_id",
    "lost_pad_id", "pad_counts", "pad_is_unsafe", "pad_string", "pad_strings", "rebuilt_masks", "safe_pad_tokenizer",
    "safe_policy_wrapper", "short_row", "strip_trailing", "unpad",
]

#: Pad tokens tried, in order, when a tokenizer's own pad is unsafe (added tokens only, which plain
#: text never tokenises into). ``<|fim_pad|>``: Qwen2.5, whose ``<|endoftext|>`` is also an EOS id.
PAD_CANDIDATES = ("<|endoftext|>", "<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>", "<|fim_pad|>",
                  "<|vision_pad|>", "<|end_of_text|>")

_FIX = "expected a pad token of its own: build the policy with torchrl_trl.safe_policy_wrapper"


def eos_token_ids(tokenizer: Any, model: Any = None) -> set[int]:
    """Every id that ends a generation: the tokenizer's EOS and the model's generation config's."""
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return ids


def _chat_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the special tokens the chat template writes out."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return set()
    return {i for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids) if t in template}


def pad_is_unsafe(tokenizer: Any, model: Any = None) -> str | None:
    """Why ``tokenizer``'s pad token breaks TorchRL's padding (``None`` if it does not):
    no pad token (TorchRL then takes the EOS), the pad is an EOS id, or it occurs in chats."""
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        return "the tokenizer has no pad token, so TorchRL's TransformersWrapper sets pad = eos"
    if pad_id in eos_token_ids(tokenizer, model):
        return f"the tokenizer's pad token {tokenizer.pad_token!r} (id {pad_id}) is its EOS"
    if pad_id in _chat_token_ids(tokenizer):
        return f"the tokenizer's pad token {tokenizer.pad_token!r} (id {pad_id}) occurs in its chat template"
    return None


def safe_pad_tokenizer(tokenizer: Any, model: Any = None, *, pad_token: str | None = None) -> Any:
    """``tokenizer`` itself if its pad token is safe for TorchRL (:func:`pad_is_unsafe`), else a
    copy whose pad token is ``pad_token`` or the first of :data:`PAD_CANDIDATES` in its
    vocabulary that is neither an EOS id nor in the chat template; ``ValueError`` if none is."""
    if pad_token is None and not pad_is_unsafe(tokenizer, model):
        return tokenizer
    unsafe = eos_token_ids(tokenizer, model) | _chat_token_ids(tokenizer)
    atomic = tokenizer.get_added_vocab()
    candidates = [pad_token] if pad_token is not None else PAD_CANDIDATES
    for candidate in candidates:
        if candidate in atomic and atomic[candidate] not in unsafe:
            safe = copy.deepcopy(tokenizer)
            safe.pad_token = candidate
            return safe
    tried = repr(pad_token) if pad_token is not None else f"one of {list(PAD_CANDIDATES)}"
    raise ValueError(
        f"safe_pad_tokenizer: expected an added token {tried} that is no EOS and not in the chat template; add "
        "one (add_special_tokens({'pad_token': '<|pad|>'}), resize_token_embeddings)"
    )


def safe_policy_wrapper(model: Any, tokenizer: Any, *, pad_token: str | None = None, **wrapper_kwargs: Any):
    """A TorchRL ``TransformersWrapper`` around ``model`` whose padding loses no token: its
    tokenizer is :func:`safe_pad_tokenizer`'s and ``generate`` pads with that same id.

    Args:
        model (transformers.PreTrainedModel): the policy model.
        tokenizer (transformers tokenizer): its tokenizer (not modified: a copy gets the pad token).

    Keyword Args:
        pad_token (str, optional): the added token to pad with. Defaults to ``None``: the first
            safe one of :data:`PAD_CANDIDATES`.
        **wrapper_kwargs: ``TransformersWrapper`` arguments.

    >>> from torchrl_trl.testing import make_policy, make_tokenizer
    >>> tok = make_tokenizer()
    >>> tok.pad_token = tok.eos_token  # the common set-up, which TorchRL cannot read back
    >>> policy = safe_policy_wrapper(make_policy(tok), tok, input_mode="history", generate=True)
    >>> policy.tokenizer.pad_token, tok.pad_token
    ('<|pad|>', '<|im_end|>')
    """
    from torchrl.modules.llm import TransformersWrapper

    tokenizer = safe_pad_tokenizer(tokenizer, model, pad_token=pad_token)
    if wrapper_kwargs.get("generate", True):
        generate_kwargs = dict(wrapper_kwargs.get("generate_kwargs") or {})
        generate_kwargs["pad_token_id"] = tokenizer.pad_token_id
        wrapper_kwargs["generate_kwargs"] = generate_kwargs
    return TransformersWrapper(model, tokenizer=tokenizer, **wrapper_kwargs)


def check_policy_padding(policy: Any, where: str) -> None:
    """A ``ValueError`` naming ``where`` when ``policy`` would lose tokens to padding: its pad
    token is unsafe (:func:`pad_is_unsafe`), or ``generate`` pads with another id than the tokenizer's.

    Args:
        policy (TransformersWrapper or vLLMWrapper): the policy.
        where (str): the start of the message (e.g. the class receiving the policy).

    >>> from torchrl.modules.llm import TransformersWrapper
    >>> from torchrl_trl.testing import make_policy, make_tokenizer
    >>> tok = make_tokenizer()
    >>> model = make_policy(tok)
    >>> tok.pad_token = tok.eos_token
    >>> check_policy_padding(TransformersWrapper(model, tokenizer=tok, input_mode="history"), "my loop")
    Traceback (most recent call last):
    ...
    ValueError: my loop: the tokenizer's pad token '<|im_end|>' (id 2) is its EOS, which TorchRL drops as padding; ...
    """
    tokenizer = getattr(policy, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "pad_token_id"):
        return
    model = getattr(policy, "model", None)
    if reason := pad_is_unsafe(tokenizer, model):
        raise ValueError(f"{where}: {reason}, which TorchRL drops as padding; {_FIX}")
    if not getattr(policy, "generate", False):
        return
    pad = (getattr(policy, "generate_kwargs", None) or {}).get("pad_token_id")
    if pad is None:  # transformers' generate falls back to the first EOS id
        config = getattr(model, "generation_config", None)
        pad = getattr(config, "pad_token_id", None)
        if pad is None and config is not None:
            eos = getattr(config, "eos_token_id", None)
            pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if pad is not None and pad != tokenizer.pad_token_id:
        raise ValueError(
            f"{where}: generate pads finished sequences with id {pad}, expected the tokenizer's pad id "
            f"{tokenizer.pad_token_id}: pass generate_kwargs={{'pad_token_id': ...}} or use safe_policy_wrapper"
        )


# -- rollouts already collected: what TorchRL's padding took (layouts.py reads the keys) -------


class PaddingLostError(ValueError):
    """Rollouts in which TorchRL's wrapper took real tokens for padding (its pad was a token of the chat)."""


#: how to collect rollouts that keep their tokens (troubleshooting.md says why)
COLLECT_FIX = "collect with torchrl_trl.safe_policy_wrapper (a pad token of its own)"


def lost_pad_id(fulls: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[int, bool] | None | Literal[False]:
    """``(the pad id, whether a prompt lost tokens)`` where the masks of the ``[n, T]`` chunks
    ``fulls`` took real tokens (0s between real tokens, or an id both masked out and real);
    ``None`` when every masked-out id is padding, ``False`` when no row is padded.

    >>> lost_pad_id([torch.tensor([[5, 2, 6, 2]])], [torch.tensor([[1, 0, 1, 0]])])  # 2: a pad between real tokens
    (2, True)
    >>> lost_pad_id([torch.tensor([[0, 5, 6]])], [torch.tensor([[0, 1, 1]])]) is None  # 0 is only padding
    True
    """
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
        inside = (m.cumsum(-1) > 0) & (m.flip(-1).cumsum(-1).flip(-1) > 0)  # first to last real token of a row
        if (holes := inside & ~m).any():
            hole_ids.append(t[holes][:1])  # the first hole of the first row with one
    if hole_ids:
        return int(hole_ids[0]), True
    if not masked:
        return False
    masked_ids = torch.cat(masked).unique()
    shared = masked_ids[torch.isin(masked_ids, torch.cat(real))]
    return (int(shared[0]), False) if shared.numel() else None


def short_row(prompt: list[int], response: list[int], full: list[int]) -> str | None:
    """The first sample whose full width is below its prompt's + response's, described; else ``None``.

    >>> short_row([3, 2], [2, 2], [5, 3])
    "sample 1's ('tokens', 'full') holds 3 tokens, its prompt + response 4"
    """
    i = next((i for i, (p, r, f) in enumerate(zip(prompt, response, full)) if f < p + r), None)
    if i is None:
        return None
    return f"sample {i}'s ('tokens', 'full') holds {full[i]} tokens, its prompt + response {prompt[i] + response[i]}"


def rebuilt_masks(fulls: list[torch.Tensor], masks: list[torch.Tensor], prompts: list[torch.Tensor],
                  pad_id: int) -> list[torch.Tensor]:
    """Masks of the ``("tokens", "full")`` chunks ``fulls`` rebuilt where ``pad_id`` was also a
    real token: real from the prompt's left padding to the response's first ``pad_id`` (its EOS)."""
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


def first_pad_id(fulls: list[torch.Tensor], masks: list[torch.Tensor]) -> int | None:
    """The id at the first padded position of the ``fulls`` chunks, if any."""
    for t, m in zip(fulls, masks):
        if t.shape == m.shape and not m.bool().all():
            return int(t[~m.bool()][0])
    return None


def pad_counts(masks: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Per sample of the mask chunks ``masks``, the pad columns before and after its real tokens."""
    lead, trail = [], []
    for m in masks:
        m = m.bool()
        lead += (m.cumsum(-1) == 0).sum(-1).tolist()
        trail += (m.flip(-1).cumsum(-1) == 0).sum(-1).tolist()
    return lead, trail


def pad_string(tokenizer: Any, pad_id: int | None = None) -> str:
    """The string ``tokenizer`` decodes its pad token (or ``pad_id``) to."""
    pad_id = tokenizer.pad_token_id if pad_id is None else pad_id
    return tokenizer.decode([pad_id], skip_special_tokens=False)


def unpad(text: str, pad: str, lead: int, trail: int) -> str:
    """``text`` without ``lead`` pads before and ``trail`` after, where present.

    >>> unpad("<p><p>hi<p>", "<p>", 2, 1), unpad("hi", "<p>", 2, 0)
    ('hi', 'hi')
    """
    if lead and text.startswith(pad * lead):
        text = text[len(pad) * lead :]
    if trail and text.endswith(pad * trail):
        text = text[: len(text) - len(pad) * trail]
    return text


def pad_strings(fulls: list[str], prompts: list[str], lead: list[int], trail: list[int]) -> tuple[set[str], int]:
    """``(pad strings, clean rows)`` read off decoded texts: pads decoded before the prompt or
    repeated at the end; a text that starts with its prompt despite ``lead`` pads is clean."""
    found, clean_rows = set(), 0
    for f, p, before, after in zip(fulls, prompts, lead, trail):
        at = f.find(p) if p else -1
        if before and at == 0:
            clean_rows += 1
        elif before and at > 0 and at % before == 0 and f[: at // before] * before == f[:at]:
            found.add(f[: at // before])
        elif not before and after >= 2 and (period := _shortest_period(f, after)):
            found.add(period)
    return found, clean_rows


def _shortest_period(text: str, repeats: int) -> str | None:
    """The shortest ``s`` such that ``text`` ends with ``s * repeats``, if any."""
    for n in range(1, len(text) // repeats + 1):
        if text.endswith(text[-n:] * repeats):
            return text[-n:]
    return None


def strip_trailing(conversation: list[dict[str, str]], pad: str) -> list[dict[str, str]]:
    """``conversation`` with ``pad`` strings stripped off each message's end (one left empty dropped)."""
    out = []
    for m in conversation:
        content = m["content"]
        while content.endswith(pad):
            content = content[: -len(pad)]
        if content or not m["content"]:
            out.append({**m, "content": content})
    return out
