"""Pad tokens TorchRL's LLM wrappers can trust: the one home of the pad == eos check.

TorchRL's ``TransformersWrapper`` finds padding as ``tokens != tokenizer.pad_token_id``. When
the pad token is also a token of the chat (most often the EOS, which TRL, lm-eval and TorchRL
itself pick when a tokenizer has none), every occurrence is taken for padding: the prompt's
``<|im_end|>`` vanish from ``("tokens", "full")``, the response loses its final EOS and its
log-prob, ``("text", "response")`` is cut and the ``History`` reply is ``""``. And when
``generate`` pads finished sequences with another id than the tokenizer's pad (the model's
``generation_config.pad_token_id``), those pads are taken for generated tokens.

:func:`safe_policy_wrapper` builds a wrapper that gets both right; :func:`check_policy_padding`
refuses a wrapper that does not, where our classes receive a policy.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["PAD_CANDIDATES", "check_policy_padding", "eos_token_ids", "pad_is_unsafe", "safe_pad_tokenizer",
           "safe_policy_wrapper"]

#: Pad tokens tried, in order, when a tokenizer's own pad is unsafe; each must be an added (atomic)
#: token of the vocabulary, which plain text never tokenises into. ``<|fim_pad|>``: Qwen2.5, whose
#: ``<|endoftext|>`` is also one of its generation config's EOS ids.
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
    """Ids of the special tokens a rendered chat holds (those the chat template writes out)."""
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
    vocabulary that is neither an EOS id nor in the chat template. The vocabulary is unchanged.

    Raises ``ValueError`` when no such token exists, naming how to add one.
    """
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
    """A TorchRL ``TransformersWrapper`` around ``model`` whose padding loses no token.

    The tokenizer is :func:`safe_pad_tokenizer` (a copy with a pad token that never occurs in a
    chat, when its own is the EOS or missing) and ``generate`` pads with that same id. Every
    other keyword goes to ``TransformersWrapper`` unchanged (``input_mode``, ``generate``,
    ``return_log_probs``, ``pad_output``, ``generate_kwargs``, ...).

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
    """A ``ValueError`` naming ``where`` when ``policy`` (a TorchRL LLM wrapper) would lose
    tokens to padding: its pad token is unsafe (:func:`pad_is_unsafe`), or ``generate`` pads
    with another id than the tokenizer's. Policies without a Hugging Face tokenizer pass.

    Args:
        policy (TransformersWrapper or vLLMWrapper): the policy.
        where (str): who checks, the start of the message (e.g. the class receiving the policy).

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
