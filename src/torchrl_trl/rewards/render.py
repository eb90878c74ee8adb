"""Render TorchRL samples into the reward model's own token ids.

What the reward model sees, per input (``input_mode="auto"`` picks the first that
applies, in this order):

1. ``"tokens"`` used as they are, when no re-tokenisation is needed: the reward model
   has no tokenizer of its own, or ``policy_tokenizer`` is given and equals it (same
   vocabulary and chat template). Padding is removed with the attention mask.
2. ``"history"``: the chat (``("history", part)``) rendered with the **reward model's**
   chat template (``add_generation_prompt=False``) and tokenised with
   ``add_special_tokens=False``, exactly as ``trl.RewardTrainer`` tokenises
   conversational preference pairs (``apply_chat_template(messages, tokenize=True)``;
   no EOS is added: the template writes its own end-of-turn tokens).
3. ``"text"`` (``("text", part)``, or prompt + response): tokenised with the reward
   model's tokenizer (``add_special_tokens=True``), with its EOS appended when missing,
   as ``RewardTrainer`` does for plain-text pairs. A trailing policy EOS that differs from
   the reward model's is replaced by it.
4. ``"tokens"`` decoded with ``policy_tokenizer`` (special tokens kept), then as 3.

EOS rule (``add_eos="auto"``): text and tokens get the reward model's EOS appended
unless they already end with it, optionally followed by whitespace (ChatML ends a turn
with ``"<|im_end|>\\n"``); tokens are left as they are when the reward model's tokenizer
is unknown (a model object passed without ``tokenizer=``, as upstream). Chat-template renders are left exactly as the template writes
them. ``"always"``/``"never"`` force it either way. Decoding then re-encoding can give
other token ids than the policy generated (BPE merges across the boundary): prefer
history or a shared tokenizer when exactness matters.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts
from ..layouts import Ragged

__all__ = ["RewardRenderer", "same_tokenizer"]

InputMode = Literal["auto", "tokens", "text", "history"]


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map text and chats to the same ids."""
    if a is None or b is None:
        return False
    if a is b:
        return True
    return (
        a.get_vocab() == b.get_vocab()
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
        and type(getattr(a, "backend_tokenizer", None)) is type(getattr(b, "backend_tokenizer", None))
        and _backend_json(a) == _backend_json(b)
    )


def _backend_json(tok: Any) -> str | None:
    backend = getattr(tok, "backend_tokenizer", None)
    return backend.to_str() if backend is not None else None


class RewardRenderer:
    """Reads a tensordict (or lists of texts / chats) and returns reward-model token ids.

    Args:
        tokenizer: the reward model's tokenizer, or ``None`` (then only tokens work).
        policy_tokenizer: the tokenizer that produced ``("tokens", ...)``; decides whether
            tokens can be used directly and decodes them when they cannot.
        input_mode: ``"auto"``, ``"tokens"``, ``"text"`` or ``"history"`` (see module doc).
        part: which part to score, ``"full"`` (prompt + response, the default) or
            ``"response"``.
        token_key, attention_mask_key: where tokens and their mask are read
            (``attention_mask_key=None``: every stored token is real).
        add_eos: ``"auto"``, ``"always"`` or ``"never"`` (see module doc).
        eos_token_id: EOS id for token inputs when there is no tokenizer.
        chat_template_kwargs: extra arguments to ``apply_chat_template``.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        policy_tokenizer: Any = None,
        input_mode: InputMode = "auto",
        part: layouts.Part = "full",
        token_key: NestedKey | None = None,
        attention_mask_key: NestedKey | None = layouts.ATTENTION_MASK_KEY,
        add_eos: Literal["auto", "always", "never"] = "auto",
        eos_token_id: int | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> None:
        if input_mode not in ("auto", "tokens", "text", "history"):
            raise ValueError(
                f"input_mode must be 'auto', 'tokens', 'text' or 'history', got {input_mode!r}"
            )
        if add_eos not in ("auto", "always", "never"):
            raise ValueError(f"add_eos must be 'auto', 'always' or 'never', got {add_eos!r}")
        if input_mode in ("text", "history") and tokenizer is None:
            raise ValueError(
                f"input_mode={input_mode!r} needs the reward model's tokenizer: pass tokenizer= "
                "(or load the model by path, which loads its tokenizer)"
            )
        self.tokenizer = tokenizer
        self.policy_tokenizer = policy_tokenizer
        self.input_mode = input_mode
        self.part = part
        self.token_key = layouts.token_key(part) if token_key is None else token_key
        self.attention_mask_key = attention_mask_key
        self.add_eos = add_eos
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
        self.eos_token_id = eos_token_id
        #: tokens can be fed as they are (no re-tokenisation)
        self.tokens_direct = tokenizer is None or same_tokenizer(tokenizer, policy_tokenizer)
        self._whitespace_ids: set[int] | None = None

    # -- choosing the input --------------------------------------------------------

    def resolve_mode(self, td: TensorDictBase) -> str:
        """The input actually used for ``td``: ``"tokens"``, ``"tokens->text"``,
        ``"text"`` or ``"history"``."""
        has_tokens = layouts.has_key(td, self.token_key)
        has_history = layouts.has_key(td, layouts.history_key(self.part))
        has_text = layouts.has_key(td, layouts.text_key(self.part)) or (
            self.part == "full"
            and layouts.has_key(td, layouts.text_key("prompt"))
            and layouts.has_key(td, layouts.text_key("response"))
        )
        mode = self.input_mode
        if mode == "auto":
            if has_tokens and self.tokens_direct:
                mode = "tokens"
            elif has_history and getattr(self.tokenizer, "chat_template", None):
                mode = "history"
            elif has_text:
                mode = "text"
            elif has_tokens:
                mode = "tokens"
            else:
                raise KeyError(
                    f"no reward-model input found: looked for tokens at {self.token_key!r}, "
                    f"history at {layouts.history_key(self.part)!r} and text at "
                    f"{layouts.text_key(self.part)!r}. Available keys: {layouts.available_keys(td)}"
                )
        wanted = {"tokens": has_tokens, "text": has_text, "history": has_history}[mode]
        if not wanted:
            key = {
                "tokens": self.token_key,
                "text": layouts.text_key(self.part),
                "history": layouts.history_key(self.part),
            }[mode]
            raise KeyError(
                f"input_mode={mode!r}: key {key!r} not found. Available keys: "
                f"{layouts.available_keys(td)}"
            )
        if mode == "tokens" and not self.tokens_direct:
            if self.policy_tokenizer is None:
                # the tokens are taken to be in the reward model's vocabulary
                return "tokens"
            return "tokens->text"
        return mode

    def render(self, td: TensorDictBase) -> Ragged:
        """Reward-model token ids of every sample of ``td`` (batch flattened row-major)."""
        mode = self.resolve_mode(td)
        if mode == "tokens":
            ids = layouts.read_tokens(
                td, self.part, key=self.token_key, mask_key=self.attention_mask_key
            )
            return self._eos_tokens(ids)
        if mode == "history":
            return self.encode_messages(layouts.read_history(td, self.part))
        if mode == "text":
            return self.encode_texts(layouts.read_text(td, self.part))
        ids = layouts.read_tokens(td, self.part, key=self.token_key, mask_key=self.attention_mask_key)
        texts = self.policy_tokenizer.batch_decode(ids.tolist(), skip_special_tokens=False)
        return self.encode_texts(texts)

    # -- encoders ------------------------------------------------------------------

    def render_messages(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        """Chats -> text with the reward model's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "the reward model's tokenizer has no chat_template: score the text instead "
                "(input_mode='text') or set tokenizer.chat_template"
            )
        return [
            self.tokenizer.apply_chat_template(
                layouts.to_messages(c),
                tokenize=False,
                add_generation_prompt=False,
                **self.chat_template_kwargs,
            )
            for c in conversations
        ]

    def encode_messages(self, conversations: list[list[dict[str, str]]]) -> Ragged:
        texts = self.render_messages(conversations)
        if self.add_eos == "always":
            texts = [t + self.tokenizer.eos_token for t in texts]
        enc = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return Ragged.from_list(enc)

    def prepare_texts(self, texts: list[str]) -> list[str]:
        """Apply the EOS rule to plain texts (see module doc)."""
        eos = self.tokenizer.eos_token
        policy_eos = getattr(self.policy_tokenizer, "eos_token", None)
        out = []
        for t in texts:
            if policy_eos and policy_eos != eos and t.rstrip().endswith(policy_eos):
                t = t.rstrip()[: -len(policy_eos)]
            if eos and (self.add_eos == "always" or (
                self.add_eos == "auto" and not t.rstrip().endswith(eos)
            )):
                t = t + eos
            out.append(t)
        return out

    def encode_texts(self, texts: list[str]) -> Ragged:
        if self.tokenizer is None:
            raise ValueError("scoring text needs the reward model's tokenizer: pass tokenizer=")
        enc = self.tokenizer(self.prepare_texts(list(texts)), add_special_tokens=True)["input_ids"]
        return Ragged.from_list(enc)

    def _eos_tokens(self, ids: Ragged) -> Ragged:
        eos = self.eos_token_id
        if self.add_eos == "never" or eos is None or len(ids) == 0:
            return ids
        if self.add_eos == "auto" and self.tokenizer is None:
            # without the tokenizer a trailing "\n" after EOS cannot be told from text:
            # tokens are used as they are (upstream behaviour)
            return ids
        seqs = list(ids.split())
        changed = False
        for i, s in enumerate(seqs):
            if self.add_eos == "always" or not self._ends_with_eos(s.tolist(), eos):
                seqs[i] = torch.cat([s, s.new_tensor([eos])])
                changed = True
        return Ragged.from_list(seqs) if changed else ids

    def _ends_with_eos(self, seq: list[int], eos: int) -> bool:
        # trailing tokens that decode to whitespace only (ChatML's "\n") do not count
        ws = self._whitespace()
        for tok in reversed(seq):
            if tok == eos:
                return True
            if tok not in ws:
                return False
        return False

    def _whitespace(self) -> set[int]:
        if self._whitespace_ids is None:
            self._whitespace_ids = set()
            if self.tokenizer is not None:
                specials = set(self.tokenizer.all_special_ids)
                n = len(self.tokenizer)
                texts = self.tokenizer.batch_decode([[i] for i in range(n)])
                self._whitespace_ids = {
                    i for i, t in enumerate(texts) if t and not t.strip() and i not in specials
                }
        return self._whitespace_ids
