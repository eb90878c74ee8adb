"""``HFRewardModelWrapper``: a Hugging Face reward model as a TorchRL module.

A drop-in superset of ``torchrl.modules.llm.trl_interop.HFRewardModelWrapper``: the
same arguments with the same meaning and defaults (reward ``[*B]`` at top-level
``"reward"``, gradients kept unless ``inference_mode=True``), plus loading by path,
ragged / text / chat inputs, re-tokenisation for a reward model with its own tokenizer
or chat template, token-budget micro-batching, a truncation policy, device/dtype
placement, TorchRL's GRPO reward convention and post-processing.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from .. import layouts
from ..layouts import Ragged
from .batching import check_count, check_fraction, iter_micro_batches, truncate
from .packing import causal_classifier, iter_packs, packing_unsupported, score_pack
from .postprocess import RewardPostprocess, select_head
from .render import RewardRenderer, check_ids

__all__ = ["HFRewardModelWrapper", "load_reward_model"]

RewardShape = Literal["flat", "trailing", "step"]


def load_reward_model(
    path: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    load_tokenizer: bool = True,
    **model_kwargs,
) -> tuple[nn.Module, Any]:
    """Load ``AutoModelForSequenceClassification`` (safetensors only) and its tokenizer
    from a local directory, e.g. one written by ``trl.RewardTrainer.save_model``.

    Returns:
        ``(model in eval mode, tokenizer or None)``.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.fspath(path)
    kwargs = dict(use_safetensors=True, trust_remote_code=trust_remote_code, **model_kwargs)
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    if device is not None:
        model = model.to(device)
    tokenizer = None
    if load_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer


class HFRewardModelWrapper(TensorDictModuleBase):
    """Score TorchRL LLM samples with a Hugging Face sequence-classification reward model.

    Reads each sample's tokens, text or chat (see :mod:`torchrl_trl.rewards.render` for
    which one and how it is rendered), scores them in length-sorted, right-padded
    micro-batches and writes one reward per sample.

    Args:
        model: a loaded reward model (any ``*ForSequenceClassification`` or module whose
            output has ``logits``/``rewards`` of shape ``[n]`` or ``[n, num_labels]``), or
            a local path, loaded with :func:`load_reward_model` (safetensors,
            ``trust_remote_code=False`` unless asked) together with its tokenizer.

    The first four keyword arguments are upstream's, with the same meaning and defaults;
    the rest are added.

    Keyword Args:
        token_key: where token ids are read. Defaults to ``("tokens", part)``, i.e.
            ``("tokens", "full")`` as upstream.
        attention_mask_key: mask of real tokens; it must be present when tokens are read
            (``KeyError`` otherwise, as upstream). ``None``: every stored token is real and
            the model is called with ``input_ids`` only, as upstream, unless a micro-batch
            holds sequences of different lengths: then it also gets the padding mask (not
            a causal transformers decoder, whose real tokens never see the right padding),
            or, when its ``forward`` takes no ``attention_mask``, only equal lengths are
            batched together.
        reward_key: where the reward is written. Defaults to ``"reward"``.
        inference_mode: ``True`` scores under ``torch.no_grad()``; ``False`` (default)
            keeps the graph.

        tokenizer: the reward model's tokenizer (loaded from ``model``'s path by default).
            Needed for text and chat inputs and for re-tokenisation.
        policy_tokenizer: the tokenizer that produced the tokens in the tensordict. When it
            differs from ``tokenizer`` (vocabulary or chat template), samples are
            re-rendered (chat with the reward model's template, else text, else tokens
            decoded with this tokenizer) and re-tokenised.
        input_mode: ``"auto"`` (default), ``"tokens"``, ``"text"`` or ``"history"``.
        part: ``"full"`` (prompt + response, default) or ``"response"``.
        add_eos: ``"auto"`` (default; as ``trl.RewardTrainer`` tokenised its pairs),
            ``"always"`` or ``"never"``.
        chat_template_kwargs: forwarded to ``apply_chat_template``.
        max_tokens_per_batch: token budget (rows x padded width) of one forward;
            ``None``: one forward over everything. Defaults to 16384.
        max_batch_size: optional cap on rows per forward.
        pad_to_multiple_of: round each micro-batch width up to this multiple.
        min_fill: a micro-batch only holds sequences of at least ``min_fill`` x its
            longest, so its padding efficiency is >= ``min_fill`` (``None``: budget only).
            Defaults to 0.95 (0.9 left ~4% padding on a long-tailed batch).
        packing: score whole sequences back to back in one row per forward (at most
            ``max_tokens_per_batch`` tokens, ``max_batch_size`` sequences), positions
            restarting per sequence, no padding; the score is pooled from the base model's
            hidden states (see :mod:`torchrl_trl.rewards.packing`). Causal transformers
            ``*ForSequenceClassification`` models only (``ValueError`` otherwise). On CPU
            the attention of a pack costs ``T^2``: keep the budget near the longest
            sequence; with flash attention (GPU) it is the varlen kernel.
        max_length: longest sequence fed to the model; defaults to the model's
            ``max_position_embeddings`` when known. Longer ones follow ``truncation``.
        truncation: ``"keep_end"`` (default: keep the last ``max_length`` tokens, i.e.
            the response and its EOS), ``"keep_start"`` or ``"error"``. Truncations are
            counted in :attr:`truncated_count` and warned about once.
        reward_shape: ``"flat"`` (``[*B]``, upstream), ``"trailing"`` (``[*B, 1]``) or
            ``"step"`` (``[*B, 1, 1]``, TorchRL's GRPO convention as ``GSM8KRewardParser``
            writes). Use :meth:`for_grpo` for ``("next", "reward")`` + ``"step"``.
        accumulate: add to a reward already at ``reward_key`` instead of overwriting it.
        reward_dtype: dtype of the written reward; defaults to the dtype of a reward
            already there, else ``torch.get_default_dtype()``.
        head_index: which output of a multi-label head is the reward.
        scale, shift, clip, normalize, on_nonfinite, nonfinite_value: see
            :class:`~torchrl_trl.rewards.postprocess.RewardPostprocess`.
        pad_token_id: pad id for right-padding; defaults to the model config's (the id
            HF's sequence classifiers pool against). If the model has none, this value is
            also set on ``model.config`` so batched forwards work.
        device, dtype: move / cast a model loaded by path. Inputs always go to the
            model's device. With a model object they raise ``TypeError`` (move the model
            yourself with ``model.to(...)``: it is used where it is).
        trust_remote_code, model_kwargs: for loading by path only (``TypeError`` with a
            model object).

    A module with no ``config`` and no ``pad_token_id=`` (a stand-in like upstream's
    tests use) gets the stored ``input_ids`` + ``attention_mask`` as given, as upstream
    passes them, in row chunks of the token budget, whenever the rows have one width and
    nothing is truncated or appended; otherwise (ragged rows) they are right-padded with
    0 next to their mask.

    Attributes:
        in_keys: the keys read when every input is present: ``[token_key,
            attention_mask_key]`` when tokens are used as they are, else
            ``[("history", part)]`` (reward model with a chat template) or
            ``[("text", part)]``; ``input_mode="auto"`` falls back to another input when
            those are absent.
        truncated_count: sequences truncated so far.
        nonfinite_count: non-finite rewards seen so far (``on_nonfinite="warn"``).
        real_tokens, processed_tokens: token counters over all calls (padding
            efficiency = real / processed).

    Examples:
        Ragged rollouts (TorchRL's default ``pad_output=False``) scored in TorchRL's GRPO
        convention:

        >>> import tempfile, torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from torchrl_trl import testing
        >>> paths = testing.tiny_checkpoints(tempfile.mkdtemp())
        >>> scorer = HFRewardModelWrapper.for_grpo(str(paths.reward_model))
        >>> rollouts = lazy_stack([
        ...     TensorDict({"tokens": {"full": torch.tensor(t)},
        ...                 "masks": {"all_attention_mask": torch.ones(len(t), dtype=torch.bool)}})
        ...     for t in ([5, 6, 7], [8, 9])
        ... ])
        >>> scorer(rollouts)["next", "reward"].shape
        torch.Size([2, 1, 1])
        >>> scorer.score_texts(["hello", "bye"]).shape
        torch.Size([2])
    """

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        *,
        token_key: NestedKey | None = None,
        attention_mask_key: NestedKey | None = ("masks", "all_attention_mask"),
        reward_key: NestedKey = "reward",
        inference_mode: bool = False,
        tokenizer: Any = None,
        policy_tokenizer: Any = None,
        input_mode: Literal["auto", "tokens", "text", "history"] = "auto",
        part: layouts.Part = "full",
        add_eos: Literal["auto", "always", "never"] = "auto",
        chat_template_kwargs: dict | None = None,
        max_tokens_per_batch: int | None = 16384,
        max_batch_size: int | None = None,
        pad_to_multiple_of: int | None = None,
        min_fill: float | None = 0.95,
        packing: bool = False,
        max_length: int | None = None,
        truncation: Literal["keep_end", "keep_start", "error"] = "keep_end",
        reward_shape: RewardShape = "flat",
        accumulate: bool = False,
        reward_dtype: torch.dtype | None = None,
        head_index: int | None = None,
        scale: float = 1.0,
        shift: float = 0.0,
        clip: tuple[float | None, float | None] | None = None,
        normalize: Literal["running"] | None = None,
        on_nonfinite: Literal["raise", "warn"] = "raise",
        nonfinite_value: float | None = None,
        pad_token_id: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        trust_remote_code: bool = False,
        model_kwargs: dict | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, (str, os.PathLike)):
            for_path_only = {"device": device, "dtype": dtype, "model_kwargs": model_kwargs}
            for_path_only["trust_remote_code"] = trust_remote_code or None
            given = sorted(k for k, v in for_path_only.items() if v is not None)
            if given:
                raise TypeError(
                    f"{given} only apply when the model is loaded by path, but a "
                    f"{type(model).__name__} object was passed: it is used where and as it is "
                    "(move or cast it first, e.g. model.to(device, dtype))"
                )
        if isinstance(model, (str, os.PathLike)):
            model, loaded_tok = load_reward_model(
                model,
                trust_remote_code=trust_remote_code,
                dtype=dtype,
                device=device,
                load_tokenizer=tokenizer is None,
                **(model_kwargs or {}),
            )
            tokenizer = tokenizer if tokenizer is not None else loaded_tok
        if truncation not in ("keep_end", "keep_start", "error"):
            raise ValueError(
                f"truncation must be 'keep_end', 'keep_start' or 'error', got {truncation!r}"
            )
        if reward_shape not in ("flat", "trailing", "step"):
            raise ValueError(
                f"reward_shape must be 'flat', 'trailing' or 'step', got {reward_shape!r}"
            )
        check_count("max_tokens_per_batch", max_tokens_per_batch)
        check_count("max_batch_size", max_batch_size)
        check_count("pad_to_multiple_of", pad_to_multiple_of)
        check_fraction("min_fill", min_fill)
        check_count("max_length", max_length)
        check_count("pad_token_id", pad_token_id, minimum=0)
        if head_index is not None and (isinstance(head_index, bool) or not isinstance(head_index, int)):
            raise TypeError(f"head_index must be an int or None, got {head_index!r}")
        if reward_dtype is not None and not (
            isinstance(reward_dtype, torch.dtype) and reward_dtype.is_floating_point
        ):
            raise TypeError(f"reward_dtype must be a floating torch.dtype or None, got {reward_dtype!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.inference_mode = inference_mode
        self.attention_mask_key, self.reward_key = attention_mask_key, reward_key
        self.out_keys = [reward_key]
        self.max_tokens_per_batch, self.max_batch_size = max_tokens_per_batch, max_batch_size
        self.pad_to_multiple_of, self.min_fill = pad_to_multiple_of, min_fill
        if not isinstance(packing, bool):
            raise TypeError(f"packing must be a bool, got {packing!r}")
        if packing and (reason := packing_unsupported(model)) is not None:
            raise ValueError(f"packing=True: {reason}; use packing=False (padded micro-batches)")
        self.packing = packing
        self.truncation, self.reward_shape, self.accumulate = truncation, reward_shape, accumulate
        self.reward_dtype, self.head_index = reward_dtype, head_index
        config = getattr(model, "config", None)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._text_config = text_config
        if max_length is None:
            max_length = getattr(text_config, "max_position_embeddings", None)
        self.max_length = max_length
        self._num_embeddings = self._embedding_size(model)
        self._check_vocab(tokenizer, "tokenizer")
        self.pad_token_id = self._resolve_pad(pad_token_id)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(text_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        self.renderer = RewardRenderer(
            tokenizer,
            policy_tokenizer=policy_tokenizer,
            input_mode=input_mode,
            part=part,
            token_key=token_key,
            attention_mask_key=attention_mask_key,
            add_eos=add_eos,
            eos_token_id=eos,
            chat_template_kwargs=chat_template_kwargs,
        )
        self.token_key = self.renderer.token_key
        #: the keys read when every input is present (``input_mode="auto"`` falls back to
        #: history or text, or to tokens, when the preferred input is absent)
        self.in_keys = self.renderer.in_keys()
        # a stand-in module (no config, no pad id): stored ids + mask go in as given
        self._as_given = self._text_config is None and self.pad_token_id is None
        self._model_takes_mask = _takes_argument(model, "attention_mask")
        # right padding comes after every real token: a causal decoder needs no mask for it
        self._causal = causal_classifier(model)
        self.postprocess = RewardPostprocess(
            scale=scale,
            shift=shift,
            clip=clip,
            normalize=normalize,
            on_nonfinite=on_nonfinite,
            nonfinite_value=nonfinite_value,
        )
        self.truncated_count = 0
        self.real_tokens = 0
        self.processed_tokens = 0
        self._warned_truncation = False

    @classmethod
    def for_grpo(cls, model, **kwargs) -> HFRewardModelWrapper:
        """TorchRL's GRPO convention: reward ``[*B, 1, 1]`` at ``("next", "reward")``,
        scored without gradients (all overridable)."""
        kwargs.setdefault("reward_key", layouts.REWARD_KEY)
        kwargs.setdefault("reward_shape", "step")
        kwargs.setdefault("inference_mode", True)
        return cls(model, **kwargs)

    # -- checks --------------------------------------------------------------------

    @staticmethod
    def _embedding_size(model) -> int | None:
        get = getattr(model, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        return getattr(emb, "num_embeddings", None)

    def _check_vocab(self, tokenizer, what: str) -> None:
        if tokenizer is None or self._num_embeddings is None:
            return
        if len(tokenizer) > self._num_embeddings:
            raise ValueError(
                f"{what} has {len(tokenizer)} tokens but the reward model's embedding has "
                f"{self._num_embeddings} rows: it is not this model's tokenizer (or call "
                "model.resize_token_embeddings and fine-tune)"
            )

    def _resolve_pad(self, pad_token_id: int | None) -> int | None:
        config_pad = getattr(self._text_config, "pad_token_id", None)
        if pad_token_id is None:
            return config_pad
        if config_pad is None and self._text_config is not None:
            # HF sequence classifiers pool at the right-most token != config.pad_token_id
            self._text_config.pad_token_id = pad_token_id
        elif config_pad is not None and config_pad != pad_token_id:
            raise ValueError(
                f"pad_token_id={pad_token_id} differs from model.config.pad_token_id={config_pad}, "
                "which the model pools against: right-padding with another id changes rewards"
            )
        return pad_token_id

    # -- scoring -------------------------------------------------------------------

    @property
    def nonfinite_count(self) -> int:
        return self.postprocess.nonfinite_count

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / processed (padded) tokens over all calls so far."""
        return self.real_tokens / self.processed_tokens if self.processed_tokens else 1.0

    def _model_device(self) -> torch.device:
        param = next(iter(self.model.parameters()), None)
        return param.device if param is not None else torch.device("cpu")

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One model call -> float ``[n]`` scores (head selected, not post-processed).
        ``attention_mask=`` is omitted when ``attention_mask_key`` is ``None`` and nothing
        is padding."""
        device = self._model_device()
        if attention_mask is None or (self.attention_mask_key is None and bool(attention_mask.all())):
            out = self.model(input_ids=input_ids.to(device))
        else:
            out = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
        return select_head(_extract_scores(out), self.head_index, input_ids.shape[0]).float()

    def _check_vocab_range(self, ids: Ragged, where: str) -> None:
        if self._num_embeddings is None or not ids.values.numel():
            return
        top = int(ids.values.max())
        if top >= self._num_embeddings:
            raise ValueError(
                f"{where}: token id {top} is outside the reward model's embedding "
                f"(num_embeddings={self._num_embeddings}): the tokens come from another "
                "tokenizer; pass policy_tokenizer= (and the reward model's tokenizer) to "
                "re-tokenise"
            )

    def score_ids(self, ids: Ragged, *, where: str = "reward-model input") -> torch.Tensor:
        """Post-processed rewards ``float32 [N]`` on the model's device for reward-model
        token ids (one sample per row of ``ids``), in the order given. ``where`` names the
        input in error messages."""
        check_ids(ids, where)
        ids, n_cut = truncate(ids, self.max_length, self.truncation)
        if n_cut:
            self.truncated_count += n_cut
            if not self._warned_truncation:
                self._warned_truncation = True
                warnings.warn(
                    f"{n_cut} reward-model input(s) longer than max_length={self.max_length} were "
                    f"truncated ({self.truncation}); counted in truncated_count (warned once)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        n = len(ids)
        if n == 0:
            return torch.zeros(0, device=self._model_device())
        self._check_vocab_range(ids, where)
        pad = self.pad_token_id
        no_mask = self.attention_mask_key is None and not self._model_takes_mask
        ctx = torch.no_grad() if self.inference_mode else contextlib.nullcontext()
        scores, order = [], []
        with ctx:
            if self.packing:
                for pack in iter_packs(
                    ids, pad_token_id=pad, max_tokens_per_batch=self.max_tokens_per_batch,
                    max_batch_size=self.max_batch_size,
                ):
                    self.real_tokens += pack.real_tokens
                    self.processed_tokens += pack.processed_tokens
                    scores.append(select_head(score_pack(self.model, pack), self.head_index, len(pack.index)).float())
                    order.append(pack.index)
            else:
                for mb in iter_micro_batches(
                    ids,
                    pad_token_id=0 if pad is None else pad,
                    max_tokens_per_batch=self.max_tokens_per_batch,
                    max_batch_size=self.max_batch_size,
                    # a model that takes no mask cannot tell padding: equal lengths only
                    pad_to_multiple_of=None if no_mask else self.pad_to_multiple_of,
                    min_fill=1.0 if no_mask else self.min_fill,
                ):
                    needs_pad = mb.processed_tokens != mb.real_tokens or mb.index.numel() > 1
                    if pad is None and needs_pad and self._text_config is not None:
                        raise ValueError(
                            "the reward model has no pad token (model.config.pad_token_id is None) "
                            "so a padded batch cannot be pooled; pass pad_token_id= (RewardTrainer "
                            "uses tokenizer.pad_token, else eos) or max_batch_size=1"
                        )
                    self.real_tokens += mb.real_tokens
                    self.processed_tokens += mb.processed_tokens
                    scores.append(self._forward(mb.input_ids, None if self._causal else mb.attention_mask))
                    order.append(mb.index)
        flat = torch.cat(scores)
        inverse = torch.empty_like(torch.cat(order))
        inverse[torch.cat(order)] = torch.arange(n)
        return self.postprocess(flat[inverse.to(flat.device)])

    def _given_tokens(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The stored ``[N, T]`` ids (and mask) as they are, when a stand-in module gets
        them so (see the class doc); ``None`` when the general path applies."""
        r = self.renderer
        if not self._as_given or r.part != "full" or not r.keeps_tokens:
            return None
        rows = layouts.read_column(td, self.token_key)
        if len({tuple(t.shape) for t in rows}) != 1 or rows[0].ndim != 1:
            return None
        if self.max_length is not None and rows[0].shape[0] > self.max_length:
            return None
        ids = torch.stack(rows)
        if self.attention_mask_key is None:
            return ids, None
        mask = torch.stack(layouts.read_column(td, self.attention_mask_key))
        if mask.shape != ids.shape:
            raise ValueError(
                f"the attention mask at {self.attention_mask_key!r} has shape {tuple(mask.shape)}, "
                f"the tokens at {self.token_key!r} {tuple(ids.shape)}: expected the same shape"
            )
        return ids, mask

    def _score_given(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Rows of stored ``[N, T]`` ids + mask, unchanged, in budget-sized chunks."""
        n, width = ids.shape
        rows = n if self.max_tokens_per_batch is None else max(1, self.max_tokens_per_batch // max(width, 1))
        rows = min(rows, self.max_batch_size or rows)
        ctx = torch.no_grad() if self.inference_mode else contextlib.nullcontext()
        with ctx:
            scores = [
                self._forward(ids[i : i + rows], None if mask is None else mask[i : i + rows])
                for i in range(0, n, rows)
            ]
        self.real_tokens += int(mask.sum()) if mask is not None else ids.numel()
        self.processed_tokens += ids.numel()
        return self.postprocess(torch.cat(scores))

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """Rewards ``float32 [N]`` for plain texts (EOS rule applied), on the model's device."""
        return self.score_ids(self.renderer.encode_texts(list(texts)))

    def score_messages(self, conversations: list[list[dict[str, str]]]) -> torch.Tensor:
        """Rewards ``float32 [N]`` for chats (lists of ``{"role", "content"}`` dicts, or
        TorchRL ``History``), rendered with the reward model's chat template."""
        return self.score_ids(self.renderer.encode_messages(list(conversations)))

    def score(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Rewards ``float32 [N]`` for every sample of ``tensordict`` (batch flattened),
        on the model's device; nothing is written."""
        mode = self.renderer.resolve_mode(tensordict)
        if mode == "tokens":
            where = f"tokens at {self.token_key!r}"
            ids = self.renderer.read_token_ids(tensordict)  # mask present, ids checked
            self._check_vocab_range(ids, where)
            given = self._given_tokens(tensordict)
            if given is not None:
                return self._score_given(*given)
            return self.score_ids(self.renderer.append_eos(ids), where=where)
        where = f"{mode} at {self.renderer.in_keys(mode)[0]!r}"
        return self.score_ids(self.renderer.render(tensordict, mode), where=where)

    # -- writing -------------------------------------------------------------------

    def shape_rewards(
        self, rewards: torch.Tensor, batch_size: torch.Size, *, like: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """``[N]`` -> ``batch_size`` + the trailing dims of :attr:`reward_shape`, with the
        output dtype (``like``'s, else :attr:`reward_dtype` / default) on ``device``."""
        trailing = {"flat": (), "trailing": (1,), "step": (1, 1)}[self.reward_shape]
        dtype = self.reward_dtype
        if dtype is None:
            dtype = like.dtype if like is not None and like.is_floating_point() else torch.get_default_dtype()
        out = rewards.reshape(*batch_size, *trailing).to(dtype)
        return out.to(device) if device is not None else out

    def write(self, tensordict: TensorDictBase, rewards: torch.Tensor, key: NestedKey | None = None):
        """Write ``[N]`` rewards into ``tensordict`` at ``key`` (default :attr:`reward_key`)."""
        key = self.reward_key if key is None else key
        existing = tensordict.get(key, None) if layouts.has_key(tensordict, key) else None
        if isinstance(existing, torch.Tensor) and existing.is_nested:
            existing = None
        device = tensordict.device
        if device is None:
            device = existing.device if isinstance(existing, torch.Tensor) else torch.device("cpu")
        out = self.shape_rewards(
            rewards, tensordict.batch_size, like=existing if isinstance(existing, torch.Tensor) else None,
            device=device,
        )
        if self.accumulate and isinstance(existing, torch.Tensor):
            if existing.shape != out.shape:
                raise ValueError(
                    f"accumulate=True: the reward already at {key!r} has shape "
                    f"{tuple(existing.shape)}, this scorer writes {tuple(out.shape)} "
                    f"(reward_shape={self.reward_shape!r}); pass the reward_shape of the reward "
                    "it adds to"
                )
            out = existing.to(out.dtype) + out
        tensordict.set(key, out)
        return tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Score ``tensordict`` and write the reward at ``reward_key`` (in place).

        Reads tokens at ``token_key`` (+ ``attention_mask_key``), or ``("text", part)`` /
        ``("history", part)``; any batch shape. Writes ``reward_key`` shaped
        ``batch_size`` (+ ``(1,)`` / ``(1, 1)`` per :attr:`reward_shape`) on the
        tensordict's device.
        """
        return self.write(tensordict, self.score(tensordict))


def _takes_argument(model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _extract_scores(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "rewards"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    raise RuntimeError(
        "HFRewardModelWrapper: could not extract reward from model output. Got type "
        f"{type(out).__name__}. Expected an output with a 'logits' or 'rewards' attribute, a "
        "dict with 'logits', or a bare torch.Tensor."
    )
