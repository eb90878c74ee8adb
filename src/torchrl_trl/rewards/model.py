"""``HFRewardModelWrapper``: a Hugging Face reward model as a TorchRL module, a drop-in
superset of ``torchrl.modules.llm.trl_interop.HFRewardModelWrapper``."""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from .. import layouts
from .._checks import WarnOnce, config_or_default
from .._token_ids import check_token_ids, check_tokenizer_fits, embedding_size
from ..layouts import Ragged
from .batching import MicroBatch, RewardBatching
from .packing import causal_classifier, iter_packs, packing_unsupported, score_pack
from .postprocess import RewardOutput, RewardShape, extract_scores, nonfinite_scores, select_head, write_rewards
from .render import RewardRenderer

__all__ = ["HFRewardModelWrapper", "load_reward_model"]


def load_reward_model(path: str | os.PathLike, *, trust_remote_code: bool = False,
                      dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
                      load_tokenizer: bool = True, **model_kwargs) -> tuple[nn.Module, Any]:
    """Load a reward model (``AutoModelForSequenceClassification``, safetensors only) and its
    tokenizer from a local directory (``trl.RewardTrainer``'s output).

    Args:
        path (str or os.PathLike): the checkpoint directory.

    Keyword Args:
        trust_remote_code (bool, optional): passed to ``from_pretrained``. Defaults to ``False``.
        dtype (torch.dtype or str, optional): the weights' dtype. Defaults to ``None``.
        device (torch.device or str, optional): where the weights go. Defaults to ``None`` (CPU).
        load_tokenizer (bool, optional): also load the tokenizer saved there. Defaults to ``True``.
        **model_kwargs: more ``from_pretrained`` arguments.

    Returns:
        ``(model in eval mode, tokenizer or None)``.

    >>> import tempfile
    >>> from torchrl_trl import testing
    >>> model, tokenizer = load_reward_model(testing.tiny_checkpoints(tempfile.mkdtemp()).reward_model)
    >>> model.training, model.config.num_labels
    (False, 1)
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.fspath(path)
    kwargs = dict(use_safetensors=True, trust_remote_code=trust_remote_code, **model_kwargs)
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    model = model if device is None else model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code) if load_tokenizer else None
    return model.eval(), tokenizer


class RenderingScorer:
    """A reward-model scorer rendering texts, chats and tensordicts into its ``score_ids``."""

    renderer: RewardRenderer
    reward_key: NestedKey
    reward_shape: RewardShape

    def _bind_renderer(self, renderer: RewardRenderer, loaded_tokenizer, *, eos_token_id, token_key=None,
                       attention_mask_key=layouts.ATTENTION_MASK_KEY, reward_key: NestedKey = "reward") -> None:
        """Bind ``renderer`` to its tokenizer (else ``loaded_tokenizer``) and the keys."""
        tokenizer = loaded_tokenizer if renderer.tokenizer is None else renderer.tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.renderer = renderer.bind(
            tokenizer, token_key=token_key, attention_mask_key=attention_mask_key,
            eos_token_id=eos_token_id if eos is None else eos,
        )  # fmt: skip
        self.tokenizer = tokenizer
        self.token_key = self.renderer.token_key
        self.in_keys = self.renderer.in_keys()
        self.reward_key = reward_key
        self.out_keys = [reward_key]

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """Rewards ``float32 [N]`` for plain texts (EOS rule applied)."""
        return self.score_ids(self.renderer.encode_texts(list(texts)))

    def score_messages(self, conversations: list[list[dict[str, str]]]) -> torch.Tensor:
        """Rewards ``float32 [N]`` for chats (``{"role", "content"}`` dicts or ``History``)."""
        return self.score_ids(self.renderer.encode_messages(list(conversations)))

    def score(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Rewards ``float32 [N]`` for every sample of ``tensordict`` (batch flattened)."""
        mode = self.renderer.resolve_mode(tensordict)
        where = f"{mode} at {self.renderer.in_keys(mode)[0]!r}"
        return self.score_ids(self.renderer.render(tensordict, mode), where=where)

    def score_outputs(self, tensordict: TensorDictBase, columns_td: TensorDictBase | None = None) -> list[torch.Tensor]:
        """``[score(tensordict)]`` (the :class:`~torchrl_trl.rewards.RewardTransform` API)."""
        return [self.score(tensordict)]

    def write(
        self, tensordict: TensorDictBase, rewards: torch.Tensor, key: NestedKey | None = None, *,
        accumulate: bool = False,
    ) -> TensorDictBase:
        """Write ``[N]`` rewards at ``key`` (default :attr:`reward_key`) shaped per
        :attr:`reward_shape`; ``accumulate`` adds to a reward already there."""
        key = self.reward_key if key is None else key
        return write_rewards(tensordict, rewards, key, self.reward_shape, accumulate=accumulate)


class HFRewardModelWrapper(RenderingScorer, TensorDictModuleBase):
    """Score TorchRL LLM samples (tokens, text or chat) with a Hugging Face sequence-classification
    reward model, one reward per sample.

    Args:
        model (nn.Module or str or os.PathLike): a loaded reward model (output
            ``logits``/``rewards`` ``[n]`` or ``[n, num_labels]``) used as it is, or a local
            path (:meth:`from_pretrained`).

    Keyword Args:
        token_key (NestedKey, optional): where token ids are read. Defaults to ``None``:
            ``("tokens", part)``.
        attention_mask_key (NestedKey or None, optional): mask of real tokens, required with
            tokens; ``None``: every stored token is real. Defaults to ``("masks", "all_attention_mask")``.
        reward_key (NestedKey, optional): where the reward is written. Defaults to ``"reward"``.
        inference_mode (bool, optional): score under ``torch.no_grad()``. Defaults to ``False``.
        renderer (RewardRenderer, optional): what the model sees, with the reward model's
            tokenizer (else the one saved beside a model loaded by path). Defaults to
            ``RewardRenderer()``.
        batching (RewardBatching, optional): how it is fed. Defaults to ``RewardBatching()``.
        output (RewardOutput, optional): which head, what a NaN/inf score does, the written
            shape. Defaults to ``RewardOutput()``.

    The first four keyword arguments are upstream's, with the same meaning and defaults. A
    module with no ``config`` and no pad id (a stand-in, as in upstream's tests) gets the
    stored ids and mask as given when the rows have one width and nothing is truncated or
    appended. Counters: :attr:`truncated_count`, :attr:`nonfinite_count`, ``real_tokens`` and
    ``processed_tokens`` (:attr:`padding_efficiency`).

    Examples:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from torchrl_trl import testing
        >>> from torchrl_trl.rewards import RewardBatching
        >>> paths = testing.tiny_checkpoints(tempfile.mkdtemp())
        >>> scorer = HFRewardModelWrapper.for_grpo(
        ...     str(paths.reward_model), batching=RewardBatching(max_tokens_per_batch=64))
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
        self, model: nn.Module | str | os.PathLike, *, token_key: NestedKey | None = None,
        attention_mask_key: NestedKey | None = layouts.ATTENTION_MASK_KEY, reward_key: NestedKey = "reward",
        inference_mode: bool = False, renderer: RewardRenderer | None = None, batching: RewardBatching | None = None,
        output: RewardOutput | None = None,
    ) -> None:  # fmt: skip
        name = type(self).__name__
        renderer = config_or_default(renderer, RewardRenderer, "renderer", name)
        batching = config_or_default(batching, RewardBatching, "batching", name)
        output = config_or_default(output, RewardOutput, "output", name)
        super().__init__()
        loaded_tok = None
        if isinstance(model, (str, os.PathLike)):
            model, loaded_tok = load_reward_model(model, load_tokenizer=renderer.tokenizer is None)
        if batching.packing and (reason := packing_unsupported(model)) is not None:
            raise ValueError(f"{name}: RewardBatching(packing=True): {reason}; expected packing=False here")
        self.model, self.inference_mode, self.attention_mask_key = model, inference_mode, attention_mask_key
        self.batching, self.output, self.reward_shape = batching, output, output.shape
        config = getattr(model, "config", None)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._text_config = text_config
        self.max_length = batching.max_length or getattr(text_config, "max_position_embeddings", None)
        self.num_embeddings = embedding_size(model)
        eos = getattr(text_config, "eos_token_id", None)
        self._bind_renderer(
            renderer, loaded_tok, token_key=token_key, attention_mask_key=attention_mask_key,
            eos_token_id=eos[0] if isinstance(eos, (list, tuple)) and eos else eos,
            reward_key=reward_key,
        )  # fmt: skip
        check_tokenizer_fits(self.tokenizer, self.num_embeddings, name)
        self.pad_token_id = self._resolve_pad(batching.pad_token_id)
        # a stand-in module (no config, no pad id): stored ids + mask go in as given
        self._as_given = text_config is None and self.pad_token_id is None
        self._model_takes_mask = _takes_argument(model, "attention_mask")
        # right padding comes after every real token: a causal decoder needs no mask for it
        self._causal = causal_classifier(model)
        self._nonfinite, self._truncations = WarnOnce(RuntimeWarning), WarnOnce(RuntimeWarning)
        self.real_tokens = self.processed_tokens = 0

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | str | None = None, trust_remote_code: bool = False,
                        model_kwargs: dict | None = None, **wrapper_kwargs) -> HFRewardModelWrapper:
        """Load a reward model from a local directory with :func:`load_reward_model` (its
        tokenizer too unless ``renderer`` has one) and wrap it; ``**wrapper_kwargs`` go to the
        constructor.

        >>> import tempfile
        >>> from torchrl_trl import testing
        >>> path = testing.tiny_checkpoints(tempfile.mkdtemp()).reward_model
        >>> HFRewardModelWrapper.from_pretrained(path, dtype=torch.float32).score_texts(["hi"]).dtype
        torch.float32
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"{cls.__name__}.from_pretrained: expected a local directory, got a {type(path).__name__}; "
                f"wrap a loaded model with {cls.__name__}(model, ...)"
            )
        renderer = config_or_default(wrapper_kwargs.pop("renderer", None), RewardRenderer, "renderer", cls.__name__)
        model, tokenizer = load_reward_model(
            path, trust_remote_code=trust_remote_code, dtype=dtype, device=device,
            load_tokenizer=renderer.tokenizer is None, **(model_kwargs or {}),
        )  # fmt: skip
        if tokenizer is not None:
            renderer = copy.copy(renderer)
            renderer.tokenizer = tokenizer
        return cls(model, renderer=renderer, **wrapper_kwargs)

    @classmethod
    def for_grpo(cls, model, **kwargs) -> HFRewardModelWrapper:
        """TorchRL's GRPO convention: reward ``[*B, 1, 1]`` (``output=RewardOutput(shape="step")``)
        at ``("next", "reward")``, no gradients (all overridable: a given ``output`` is used as
        it is); a path also takes :meth:`from_pretrained`'s arguments."""
        kwargs = {"reward_key": layouts.REWARD_KEY, "output": RewardOutput(shape="step"), "inference_mode": True,
                  **kwargs}
        return cls.from_pretrained(model, **kwargs) if isinstance(model, (str, os.PathLike)) else cls(model, **kwargs)

    def _resolve_pad(self, pad_token_id: int | None) -> int | None:
        config_pad = getattr(self._text_config, "pad_token_id", None)
        if pad_token_id is None:
            return config_pad
        if config_pad is None and self._text_config is not None:
            self._text_config.pad_token_id = pad_token_id
        elif config_pad is not None and config_pad != pad_token_id:
            raise ValueError(
                f"HFRewardModelWrapper: expected model.config.pad_token_id ({config_pad}, which the model pools "
                f"against), got RewardBatching(pad_token_id={pad_token_id}): another id changes rewards"
            )
        return pad_token_id

    @property
    def nonfinite_count(self) -> int:
        return self._nonfinite.counts["nonfinite"]

    @property
    def truncated_count(self) -> int:
        return self._truncations.counts["truncated"]

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / processed (padded) tokens over all calls so far."""
        return self.real_tokens / self.processed_tokens if self.processed_tokens else 1.0

    def check_ids(self, ids: Ragged, where: str) -> Ragged:
        """``ids`` if this model can embed them, else an error naming ``where``."""
        hint = (": the tokens come from another tokenizer; pass RewardRenderer(policy_tokenizer=...) "
                "(and the reward model's tokenizer) to re-tokenise")
        return check_token_ids(ids, where, num_embeddings=self.num_embeddings, hint=hint)

    def _model_device(self) -> torch.device:
        param = next(iter(self.model.parameters()), None)
        return param.device if param is not None else torch.device("cpu")

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """One model call -> float ``[n]`` scores (head selected)."""
        device = self._model_device()
        inputs = {"input_ids": input_ids.to(device)}
        if attention_mask is not None and not (self.attention_mask_key is None and bool(attention_mask.all())):
            inputs["attention_mask"] = attention_mask.to(device)
        out = self.model(**inputs)
        return select_head(extract_scores(out), self.output.head_index, input_ids.shape[0]).float()

    def score_ids(self, ids: Ragged, *, where: str = "reward-model input") -> torch.Tensor:
        """Rewards ``float32 [N]`` on the model's device for reward-model token ids, one per
        row, in order; ``where`` names the input in error messages."""
        self.check_ids(ids, where)
        ids, n_cut = self.batching.truncate(ids, self.max_length)
        self._truncations.add(
            "truncated", f"{n_cut} reward-model input(s) longer than max_length={self.max_length} were "
            f"truncated ({self.batching.truncation}); counted in truncated_count", n=n_cut, stacklevel=4,
        )  # fmt: skip
        if len(ids) == 0:
            return torch.zeros(0, device=self._model_device())
        pad, packing = self.pad_token_id, self.batching.packing
        if packing:
            parts = iter_packs(ids, pad_token_id=pad, max_tokens_per_batch=self.batching.max_tokens_per_batch,
                               max_batch_size=self.batching.max_batch_size)
        else:  # a model that takes no mask cannot tell padding: equal lengths only
            equal = self.attention_mask_key is None and not self._model_takes_mask
            parts = self.batching.micro_batches(ids, pad_token_id=0 if pad is None else pad, equal_lengths=equal)
        return self._score_parts(parts, packing)

    def _score_parts(self, parts, packing: bool = False) -> torch.Tensor:
        """Scores of the micro-batches (or packs) ``parts``, in the original row order."""
        pad, scores, order = self.pad_token_id, [], []
        with torch.no_grad() if self.inference_mode else contextlib.nullcontext():
            for part in parts:
                needs_pad = part.processed_tokens != part.real_tokens or part.index.numel() > 1
                if not packing and pad is None and needs_pad and self._text_config is not None:
                    raise ValueError(
                        "HFRewardModelWrapper: the reward model has no pad token (model.config.pad_token_id is None): "
                        "expected RewardBatching(pad_token_id=...) or RewardBatching(max_batch_size=1)"
                    )
                self.real_tokens += part.real_tokens
                self.processed_tokens += part.processed_tokens
                if packing:
                    logits = score_pack(self.model, part)
                    scores.append(select_head(logits, self.output.head_index, len(part.index)).float())
                else:
                    scores.append(self._forward(part.input_ids, None if self._causal else part.attention_mask))
                order.append(part.index)
        flat = torch.cat(scores)
        return nonfinite_scores(flat[torch.argsort(torch.cat(order)).to(flat.device)], self.output.on_nonfinite,
                                self._nonfinite)

    def _given_tokens(self, td: TensorDictBase) -> list[MicroBatch] | None:
        """For a stand-in module, the stored ``[N, T]`` ids and mask, unchanged, in budget-sized chunks."""
        r = self.renderer
        if r.part != "full" or not r.keeps_tokens or r.resolve_mode(td) != "tokens":
            return None
        self.check_ids(r.read_token_ids(td), f"tokens at {self.token_key!r}")  # mask present
        rows = layouts.read_column(td, self.token_key)
        one_width = len({tuple(t.shape) for t in rows}) == 1 and rows[0].ndim == 1
        if not one_width or (self.max_length is not None and rows[0].shape[0] > self.max_length):
            return None
        ids = torch.stack(rows)
        mask_key = self.attention_mask_key
        mask = torch.ones_like(ids) if mask_key is None else torch.stack(layouts.read_column(td, mask_key))
        if mask.shape != ids.shape:
            raise ValueError(
                f"HFRewardModelWrapper: the attention mask at {mask_key!r} has shape "
                f"{tuple(mask.shape)}, the tokens at {self.token_key!r} {tuple(ids.shape)}: "
                "expected the same shape"
            )
        n, width = ids.shape
        budget, cap = self.batching.max_tokens_per_batch, self.batching.max_batch_size
        rows = n if budget is None else max(1, budget // max(width, 1))
        rows = min(rows, cap or rows)
        return [MicroBatch(torch.arange(i, min(i + rows, n)), ids[i : i + rows], mask[i : i + rows])
                for i in range(0, n, rows)]

    def score(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Rewards ``float32 [N]`` for every sample of ``tensordict`` (batch flattened)."""
        given = self._given_tokens(tensordict) if self._as_given else None
        return super().score(tensordict) if given is None else self._score_parts(given)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Score ``tensordict`` (any batch shape) and write the reward at ``reward_key``."""
        return self.write(tensordict, self.score(tensordict))


def _takes_argument(model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
