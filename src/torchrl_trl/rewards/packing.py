"""Packed scoring: whole sequences back to back in one row, ``position_ids`` restarting per
sequence, no padding and no ``attention_mask`` (transformers then keeps the sequences apart
for causal decoders; flash attention gets ``cu_seq_lens``). The score is pooled here as the
model pools it: the ``score`` head on each sequence's last token that is not the pad id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layouts import Ragged
from .._checks import positive_int
from .._compat import attn_implementation

__all__ = ["Pack", "causal_classifier", "iter_packs", "packing_unsupported", "plan_packs", "score_pack"]

#: attention implementations that keep packed sequences apart (see the module doc)
PACKED_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
_ATTENTION_LAYERS = ("full_attention", "sliding_attention")


def causal_classifier(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers decoder ``*ForSequenceClassification`` with
    causal attention (right padding needs no mask, packing only restarting positions)."""
    from transformers.modeling_layers import GenericForSequenceClassification

    if not isinstance(model, GenericForSequenceClassification):
        return False
    config = model.config.get_text_config()
    return getattr(config, "is_causal", True) is not False and not getattr(
        config, "use_bidirectional_attention", False
    )


def packing_unsupported(model: nn.Module) -> str | None:
    """``None`` when ``model`` can be scored packed, else why not (one sentence)."""
    name = type(model).__name__
    if not causal_classifier(model):
        return f"{name} is not a causal transformers decoder *ForSequenceClassification (the pooling reproduced)"
    config = model.config.get_text_config()
    impl = attn_implementation(config)
    if impl not in PACKED_ATTENTION:
        return f"{name} uses attention {impl!r}; packing needs one of {PACKED_ATTENTION}"
    kinds = set(getattr(config, "layer_types", None) or ())
    if not kinds <= set(_ATTENTION_LAYERS):
        return f"{name} has {sorted(kinds - set(_ATTENTION_LAYERS))} layers, which carry state across packed sequences"
    if not isinstance(getattr(model, "score", None), nn.Module):
        return f"{name} has no `score` head"
    return None


@dataclass(frozen=True)
class Pack:
    """Whole sequences in one row: ``index`` int64 ``[n]`` (positions in the original
    batch), ``input_ids`` and ``position_ids`` (restarting per sequence) int64 ``[1, T]``,
    ``pool`` int64 ``[n]`` (where each score is read) and ``lengths`` int64 ``[n]``."""

    index: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pool: torch.Tensor
    lengths: torch.Tensor

    @property
    def real_tokens(self) -> int:
        return self.input_ids.numel()

    processed_tokens = real_tokens


def plan_packs(
    lengths: torch.Tensor, *, max_tokens_per_batch: int | None, max_batch_size: int | None = None
) -> list[torch.Tensor]:
    """Indices of the sequences of each pack, longest first, each up to
    ``max_tokens_per_batch`` tokens (or one longer sequence) and ``max_batch_size``
    sequences; together a permutation of ``range(N)``."""
    positive_int(max_tokens_per_batch, "plan_packs: max_tokens_per_batch", allow_none=True)
    positive_int(max_batch_size, "plan_packs: max_batch_size", allow_none=True)
    order = torch.sort(lengths, descending=True, stable=True).indices
    budget = max_tokens_per_batch or int(lengths.sum())
    packs, current, used = [], [], 0
    for i, n in zip(order.tolist(), lengths[order].tolist()):
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (used + n > budget or full):
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(current)
    return [torch.tensor(p, dtype=torch.long) for p in packs]


def iter_packs(ids: Ragged, *, pad_token_id: int | None, max_tokens_per_batch: int | None,
               max_batch_size: int | None = None):
    """Yield :class:`Pack` s covering every row of ``ids`` once; ``pad_token_id``: the id
    the model's pooling skips (``None``: pool at each sequence's last token)."""
    rows = ids.split()  # views; no repeat_interleave (slow with 2+ threads on a busy CPU)
    for index in plan_packs(ids.lengths, max_tokens_per_batch=max_tokens_per_batch, max_batch_size=max_batch_size):
        parts = [rows[i] for i in index.tolist()]
        lengths = ids.lengths[index]
        if pad_token_id is None:
            last = lengths - 1
        else:  # HF: argmax(position * (id != pad)), i.e. the last non-pad token, else 0
            last = torch.tensor([_last_kept(p, pad_token_id) for p in parts], dtype=torch.long)
        within = torch.cat([torch.arange(len(p)) for p in parts])
        starts = lengths.cumsum(0) - lengths
        yield Pack(index, torch.cat(parts)[None], within[None], starts + last, lengths)


def _last_kept(seq: torch.Tensor, pad_token_id: int) -> int:
    kept = (seq != pad_token_id).nonzero()
    return int(kept[-1]) if kept.numel() else 0


def score_pack(model: nn.Module, pack: Pack) -> torch.Tensor:
    """The ``score`` head's output ``[n, num_labels]`` for each sequence of ``pack``
    (``model`` passed :func:`packing_unsupported`)."""
    device = model.score.weight.device
    base = getattr(model, model.base_model_prefix)
    kwargs = {}
    if (attn_implementation(model.config.get_text_config()) or "").startswith("flash"):
        cu = torch.cat([pack.lengths.new_zeros(1), pack.lengths.cumsum(0)]).to(device, torch.int32)
        longest = int(pack.lengths.max())
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    out = base(input_ids=pack.input_ids.to(device), position_ids=pack.position_ids.to(device), use_cache=False,
               **kwargs)
    return model.score(out.last_hidden_state[0, pack.pool.to(device)])
