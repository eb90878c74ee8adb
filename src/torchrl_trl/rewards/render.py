"""Render TorchRL samples into the reward model's own token ids. ``input_mode="auto"`` tries,
in order:

1. ``"history"``, when the reward model has a chat template (and ``part="full"``): the chat
   rendered with the reward model's own template (``add_special_tokens=False``, as
   ``trl.RewardTrainer``), even when ``policy_tokenizer`` equals the reward model's tokenizer
   (TorchRL's ``History.apply_chat_template`` may pick another template by the tokenizer's name).
2. ``"tokens"`` as they are, when they are in the reward model's vocabulary (it has no
   tokenizer, or ``policy_tokenizer`` equals it): samples without a chat (text or tokens
   input modes), and ``part="response"`` (no template around a reply).
3. ``"history"`` without a chat template only with ``input_mode="history"`` (an error).
4. ``"text"`` (``add_special_tokens=True``).
5. tokens of another tokenizer, decoded with ``policy_tokenizer``, then as text.

EOS rule (``add_eos="auto"``): text and tokens get the reward model's EOS unless they end
with it (then whitespace); chat renders are kept.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts
from .._checks import key_tuple
from .._token_ids import check_token_ids
from ..layouts import Ragged

__all__ = ["RewardRenderer", "resolve_input_mode", "same_tokenizer"]

InputMode = Literal["auto", "tokens", "text", "history"]


def resolve_input_mode(td: TensorDictBase, input_mode: str, inputs: Mapping[str, Sequence[Sequence[NestedKey]]],
                       *, owner: str, what: str = "input", hint: str = "") -> str:
    """``input_mode``, or for ``"auto"`` the first of ``inputs`` present in ``td`` (``inputs[mode]``:
    alternative key sets); else a ``KeyError`` naming ``owner``, ``what`` and the keys tried.

    >>> from tensordict import TensorDict
    >>> td = TensorDict({"text": {"response": ["a"]}}, [1])
    >>> inputs = {"history": [[("history", "response")]], "text": [[("text", "response")]]}
    >>> resolve_input_mode(td, "auto", inputs, owner="RewardRenderer")
    'text'
    """
    if input_mode != "auto" and input_mode not in inputs:
        raise ValueError(f"{owner}: input_mode must be 'auto' or one of {list(inputs)}, got {input_mode!r}")
    tried = list(inputs) if input_mode == "auto" else [input_mode]
    for mode in tried:
        if any(all(layouts.has_key(td, k) for k in keys) for keys in inputs[mode]):
            return mode
    looked = "; ".join(
        f"{mode} at " + " or ".join(" + ".join(repr(k) for k in keys) for keys in inputs[mode])
        for mode in tried
    )
    raise KeyError(
        f"{owner}: found no {what} (input_mode={input_mode!r}): looked for {looked}. Available keys: "
        f"{layouts.available_keys(td)}{hint}"
    )


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map text and chats to the same ids."""
    if a is None or b is None:
        return False
    if a is b:
        return True
    backend_a, backend_b = (getattr(t, "backend_tokenizer", None) for t in (a, b))
    return (
        a.get_vocab() == b.get_vocab()
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
        and type(backend_a) is type(backend_b)
        and (backend_a is None or backend_a.to_str() == backend_b.to_str())
    )


class RewardRenderer:
    """What the reward model sees: input, part, EOS rule, chat template arguments, the reward
    model's tokenizer and the policy's. Bound to a reward model (:meth:`bind`, done by
    ``HFRewardModelWrapper(renderer=)``), it turns tensordicts, texts or chats into its token ids.

    Keyword Args:
        input_mode (str, optional): ``"auto"``, ``"tokens"``, ``"text"`` or ``"history"`` (see
            :mod:`torchrl_trl.rewards.render`). Defaults to ``"auto"``.
        part (str, optional): ``"full"`` (prompt + response) or ``"response"``. Defaults to ``"full"``.
        add_eos (str, optional): ``"auto"``, ``"always"`` or ``"never"``. Defaults to ``"auto"``.
        chat_template_kwargs (dict, optional): extra arguments to ``apply_chat_template`` (not
            ``tokenize`` or ``add_generation_prompt``). Defaults to ``None``.
        tokenizer (transformers tokenizer, optional): the reward model's tokenizer, for text and
            chat inputs and re-tokenisation. Defaults to ``None``: the one saved beside a model
            loaded by path, else none (token inputs only).
        policy_tokenizer (transformers tokenizer, optional): the tokenizer of the tokens in the
            tensordict; when it differs from the reward model's, samples are re-rendered and
            re-tokenised (see :mod:`torchrl_trl.rewards.render`). Defaults to ``None``.

    Examples:
        >>> import tempfile
        >>> from transformers import AutoTokenizer
        >>> from torchrl_trl import testing
        >>> paths = testing.tiny_checkpoints(tempfile.mkdtemp())
        >>> rm_tok = AutoTokenizer.from_pretrained(paths.reward_model)
        >>> renderer = RewardRenderer(input_mode="text", add_eos="always", tokenizer=rm_tok).bind()
        >>> renderer.encode_texts(["hello"]).tolist()[0][-1] == rm_tok.eos_token_id
        True
    """

    def __init__(
        self, *, input_mode: InputMode = "auto", part: layouts.Part = "full",
        add_eos: Literal["auto", "always", "never"] = "auto", chat_template_kwargs: dict | None = None,
        tokenizer: Any = None, policy_tokenizer: Any = None,
    ) -> None:
        if input_mode not in ("auto", "tokens", "text", "history"):
            raise ValueError(
                f"RewardRenderer: input_mode must be 'auto', 'tokens', 'text' or 'history', got {input_mode!r}"
            )
        if add_eos not in ("auto", "always", "never"):
            raise ValueError(f"RewardRenderer: add_eos must be 'auto', 'always' or 'never', got {add_eos!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(
                f"RewardRenderer: chat_template_kwargs must be a dict or None, got {chat_template_kwargs!r}"
            )
        if fixed := sorted({"tokenize", "add_generation_prompt"} & set(chat_template_kwargs or {})):
            raise ValueError(f"RewardRenderer: chat_template_kwargs {fixed} cannot be set: expected neither (the chat "
                             "is scored as text, without a generation prompt, as trl.RewardTrainer does)")
        self.policy_tokenizer = policy_tokenizer
        self.input_mode = input_mode
        self.part = part
        self.add_eos = add_eos
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.tokenizer = tokenizer
        # set by bind(); unbound: the default keys, no EOS
        self.token_key = layouts.token_key(part)
        self.attention_mask_key = layouts.ATTENTION_MASK_KEY
        self.eos_token_id = None
        self.tokens_direct = True  # tokens fed as they are
        self._whitespace_ids: dict[int, bool] = {}

    def bind(
        self, tokenizer: Any = None, *, token_key: NestedKey | None = None,
        attention_mask_key: NestedKey | None = layouts.ATTENTION_MASK_KEY, eos_token_id: int | None = None,
    ) -> RewardRenderer:
        """A copy bound to a reward model's ``tokenizer`` (default :attr:`tokenizer`), keys and
        ``eos_token_id`` (default: the tokenizer's)."""
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        if self.input_mode in ("text", "history") and tokenizer is None:
            raise ValueError(
                f"RewardRenderer: input_mode={self.input_mode!r} needs the reward model's tokenizer: expected "
                "RewardRenderer(tokenizer=) or the model loaded by path (its tokenizer is loaded)"
            )
        part = self.part
        if token_key is not None and part != "full" and key_tuple(token_key) == layouts.token_key("full"):
            raise ValueError(
                f"RewardRenderer: part={part!r} with token_key={token_key!r}: expected {layouts.token_key(part)!r} "
                "(token_key unset) or part='full'"
            )
        bound = copy.copy(self)
        bound.tokenizer = tokenizer
        bound.token_key = layouts.token_key(part) if token_key is None else token_key
        bound.attention_mask_key = attention_mask_key
        bound.eos_token_id = tokenizer.eos_token_id if eos_token_id is None and tokenizer is not None else eos_token_id
        # the stored ids are in the reward model's vocabulary; a chat is still re-rendered (_inputs)
        bound.tokens_direct = tokenizer is None or same_tokenizer(tokenizer, self.policy_tokenizer)
        bound._whitespace_ids = {}
        return bound

    def __repr__(self) -> str:
        rm, policy = (type(t).__name__ if t else None for t in (self.tokenizer, self.policy_tokenizer))
        return (
            f"{type(self).__name__}(input_mode={self.input_mode!r}, part={self.part!r}, add_eos={self.add_eos!r}, "
            f"chat_template_kwargs={self.chat_template_kwargs!r}, tokenizer={rm}, policy_tokenizer={policy})"
        )

    def _inputs(self) -> dict[str, list[list[NestedKey]]]:
        """The inputs ``"auto"`` tries, in the module's order, each with its alternative key sets."""
        template = bool(getattr(self.tokenizer, "chat_template", None))
        inputs = {}
        if template and self.part == "full":
            inputs["history"] = [[layouts.history_key(self.part)]]
        if self.tokens_direct:
            inputs["tokens"] = [[self.token_key]]
        if self.input_mode == "history" or template:
            inputs.setdefault("history", [[layouts.history_key(self.part)]])
        inputs["text"] = [[layouts.text_key(self.part)]]
        if self.part == "full":
            inputs["text"].append([layouts.text_key("prompt"), layouts.text_key("response")])
        inputs.setdefault("tokens", [[self.token_key]])
        return inputs

    def resolve_mode(self, td: TensorDictBase) -> str:
        """The input used for ``td``: ``"tokens"``, ``"tokens->text"``, ``"text"`` or ``"history"``."""
        mode = resolve_input_mode(td, self.input_mode, self._inputs(), owner="RewardRenderer",
                                  what="reward-model input")
        decode = mode == "tokens" and not self.tokens_direct and self.policy_tokenizer is not None
        return "tokens->text" if decode else mode  # no policy tokenizer: tokens in the reward vocabulary

    def preferred_mode(self) -> str:
        """The input read when every input is present."""
        return next(iter(self._inputs())) if self.input_mode == "auto" else self.input_mode

    def in_keys(self, mode: str | None = None) -> list[NestedKey]:
        """The keys read for ``mode`` (default: :meth:`preferred_mode`)."""
        mode = self.preferred_mode() if mode is None else mode
        if mode == "history":
            return [layouts.history_key(self.part)]
        if mode == "text":
            return [layouts.text_key(self.part)]
        return [self.token_key] + ([self.attention_mask_key] if self.attention_mask_key is not None else [])

    @property
    def keeps_tokens(self) -> bool:
        """Whether token inputs reach the model unchanged (no EOS appended)."""
        auto_unknown = self.add_eos == "auto" and self.tokenizer is None
        return self.add_eos == "never" or self.eos_token_id is None or auto_unknown

    def read_token_ids(self, td: TensorDictBase) -> Ragged:
        """The real token ids at :attr:`token_key` (padding removed with the mask), checked."""
        mask_key = self.attention_mask_key
        if mask_key is not None and not layouts.has_key(td, mask_key):
            raise KeyError(
                f"HFRewardModelWrapper: expected attention_mask_key {mask_key!r} beside the tokens at "
                f"{self.token_key!r} (or attention_mask_key=None). Available keys: {layouts.available_keys(td)}"
            )
        where = f"tokens at {self.token_key!r}" + (f" (attention mask {mask_key!r})" if mask_key is not None else "")
        try:
            ids = layouts.read_tokens(td, self.part, key=self.token_key, mask_key=mask_key)
        except RuntimeError:
            # a zero-length member of a lazy stack: name it
            check_token_ids(Ragged.from_list(layouts.read_column(td, self.token_key)), where)
            raise
        return check_token_ids(ids, where)

    def render(self, td: TensorDictBase, mode: str | None = None) -> Ragged:
        """Reward-model token ids of every sample of ``td`` (row-major), ``mode`` from :meth:`resolve_mode`."""
        mode = self.resolve_mode(td) if mode is None else mode
        if mode == "tokens":
            return self.append_eos(self.read_token_ids(td))
        if mode == "history":
            return self.encode_messages(layouts.read_history(td, self.part, tokenizer=self.policy_tokenizer))
        if mode == "text":
            return self.encode_texts(layouts.read_text(td, self.part, tokenizer=self.policy_tokenizer))
        ids = self.read_token_ids(td).tolist()
        return self.encode_texts(self.policy_tokenizer.batch_decode(ids, skip_special_tokens=False))

    def render_messages(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        """Chats -> text with the reward model's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "RewardRenderer: expected a chat_template on the reward model's tokenizer, it has none: score the text "
                "(input_mode='text') or set tokenizer.chat_template"
            )
        kwargs = {"tokenize": False, "add_generation_prompt": False, **self.chat_template_kwargs}
        apply = self.tokenizer.apply_chat_template
        return [apply(_checked_messages(c, i), **kwargs) for i, c in enumerate(conversations)]

    def encode_messages(self, conversations: list[list[dict[str, str]]]) -> Ragged:
        texts = self.render_messages(conversations)
        if self.add_eos == "always":
            texts = [t + self.tokenizer.eos_token for t in texts]
        return Ragged.from_list(self.tokenizer(texts, add_special_tokens=False)["input_ids"])

    def encode_texts(self, texts: list[str]) -> Ragged:
        """Plain texts -> ids, with the EOS rule (a policy EOS at the end swapped for the reward model's)."""
        if self.tokenizer is None:
            raise ValueError(
                "RewardRenderer: scoring text needs the reward model's tokenizer: expected RewardRenderer(tokenizer=)"
            )
        eos, policy_eos = self.tokenizer.eos_token, getattr(self.policy_tokenizer, "eos_token", None)
        out = []
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"RewardRenderer: text {i} is a {type(t).__name__}, expected str: {t!r:.40}")
            if policy_eos and policy_eos != eos and t.rstrip().endswith(policy_eos):
                t = t.rstrip()[: -len(policy_eos)]
            if eos and (self.add_eos == "always" or (self.add_eos == "auto" and not t.rstrip().endswith(eos))):
                t = t + eos
            out.append(t)
        return Ragged.from_list(self.tokenizer(out, add_special_tokens=True)["input_ids"])

    def append_eos(self, ids: Ragged) -> Ragged:
        """Token inputs with the EOS rule applied."""
        eos = self.eos_token_id
        if self.keeps_tokens or len(ids) == 0:
            return ids
        seqs = list(ids.split())
        add = [self.add_eos == "always" or not self._ends_with_eos(s.tolist(), eos) for s in seqs]
        if not any(add):
            return ids
        return Ragged.from_list([torch.cat([s, s.new_tensor([eos])]) if a else s for s, a in zip(seqs, add)])

    def _ends_with_eos(self, seq: list[int], eos: int) -> bool:
        """Whether ``seq`` ends with ``eos`` before tokens that decode to whitespace only (ChatML's "\\n"),
        each decoded once per id met, not for the whole vocabulary (1.4 s for 49k ids, at each bind)."""
        known, tokenizer = self._whitespace_ids, self.tokenizer
        for tok in reversed(seq):
            if tok not in known:  # special tokens are not whitespace
                text = "" if tokenizer is None or tok in tokenizer.all_special_ids else tokenizer.decode([tok])
                known[tok] = bool(text) and not text.strip()
            if tok == eos or not known[tok]:
                return tok == eos
        return False


def _checked_messages(conversation: Any, index: int) -> list[dict]:
    try:
        return layouts.to_messages(conversation)
    except TypeError as e:  # a non-string role or content: say which conversation
        raise TypeError(f"RewardRenderer: conversation {index}: {e}") from e
