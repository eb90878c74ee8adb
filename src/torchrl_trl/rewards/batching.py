"""Token-budget micro-batches: sorted by length, filled while ``rows * longest <=
max_tokens_per_batch`` (padding close to none, peak memory bounded), padded right."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .._checks import non_negative_int, positive_int
from ..layouts import Ragged

__all__ = ["MicroBatch", "RewardBatching", "plan_micro_batches"]

Truncation = Literal["keep_end", "keep_start", "error"]


@dataclass(frozen=True)
class RewardBatching:
    """How a reward scorer feeds its model: token budget, fill, width, length, packing.

    Args:
        max_tokens_per_batch (int or None, optional): token budget (rows x padded width) of one
            forward; ``None``: one forward over everything. Defaults to ``16384``.
        max_batch_size (int, optional): cap on rows (sequences) per forward. Defaults to ``None``.
        min_fill (float or None, optional): a micro-batch only holds sequences of at least
            ``min_fill`` x its longest (``None``: budget only). Defaults to ``0.95``.
        pad_to_multiple_of (int, optional): round each micro-batch width up to this multiple.
            Defaults to ``None``.
        max_length (int, optional): longest sequence fed to the model. Defaults to ``None``: the
            model's ``max_position_embeddings`` when known.
        truncation (str, optional): ``"keep_end"`` (keep the last ``max_length`` tokens, where
            reward models pool), ``"keep_start"`` or ``"error"``. Defaults to ``"keep_end"``.
        packing (bool, optional): score whole sequences back to back in one row per forward, no
            padding (causal transformers decoders only). Defaults to ``False``.
        pad_token_id (int, optional): the id rows are right-padded with (set on a
            ``model.config`` without one). Defaults to ``None``: the model config's.

    Examples:
        >>> import torch
        >>> from torchrl_trl.layouts import Ragged
        >>> policy = RewardBatching(max_tokens_per_batch=8, min_fill=None)
        >>> ids = Ragged.from_list([[1, 2, 3, 4], [5, 6], [7, 8, 9]])
        >>> [mb.index.tolist() for mb in policy.micro_batches(ids, pad_token_id=0)]  # longest first
        [[0, 2], [1]]
        >>> RewardBatching(max_length=2).truncate(ids)[1]  # (ids, how many were cut)
        2
    """

    max_tokens_per_batch: int | None = 16384
    max_batch_size: int | None = None
    min_fill: float | None = 0.95
    pad_to_multiple_of: int | None = None
    max_length: int | None = None
    truncation: Truncation = "keep_end"
    packing: bool = False
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_batch", "max_batch_size", "pad_to_multiple_of", "max_length"):
            positive_int(getattr(self, name), f"RewardBatching: {name}", allow_none=True)
        if self.pad_token_id is not None:
            non_negative_int(self.pad_token_id, "RewardBatching: pad_token_id")
        fill = self.min_fill
        if fill is not None and (isinstance(fill, bool) or not isinstance(fill, (int, float))):
            raise TypeError(f"RewardBatching: min_fill must be a float in (0, 1] or None, got {fill!r}")
        if fill is not None and not 0 < fill <= 1:
            raise ValueError(f"RewardBatching: min_fill must be in (0, 1] (or None), got {fill}")
        if self.truncation not in ("keep_end", "keep_start", "error"):
            raise ValueError(
                f"RewardBatching: truncation must be 'keep_end', 'keep_start' or 'error', got {self.truncation!r}"
            )
        if not isinstance(self.packing, bool):
            raise TypeError(f"RewardBatching: packing must be a bool, got {self.packing!r}")

    def truncate(self, ids: Ragged, max_length: int | None = None) -> tuple[Ragged, int]:
        """``(ids cut to max_length per truncation, number cut)`` (``"error"``: a ``ValueError``)."""
        max_length = self.max_length if max_length is None else max_length
        if max_length is None or len(ids) == 0:
            return ids, 0
        too_long = ids.lengths > max_length
        n = int(too_long.sum())
        if n == 0:
            return ids, 0
        if self.truncation == "error":
            raise ValueError(
                f"RewardBatching: expected sequences of at most max_length={max_length} tokens, {n} exceed it "
                f"(longest: {int(ids.lengths.max())}); pass truncation='keep_end' or 'keep_start', or a larger "
                "max_length"
            )
        seqs = list(ids.split())
        for i in too_long.nonzero().flatten().tolist():
            seqs[i] = seqs[i][-max_length:] if self.truncation == "keep_end" else seqs[i][:max_length]
        return Ragged.from_list(seqs, dtype=ids.values.dtype), n

    def micro_batches(self, ids: Ragged, *, pad_token_id: int, equal_lengths: bool = False):
        """Yield right-padded :class:`MicroBatch` es covering every row of ``ids`` once
        (``equal_lengths``: only sequences of one length together)."""
        multiple = None if equal_lengths else self.pad_to_multiple_of
        rows = ids.split()  # views + one masked copy per micro-batch (no gather of the flat values)
        for index in plan_micro_batches(
            ids.lengths, max_tokens_per_batch=self.max_tokens_per_batch, max_batch_size=self.max_batch_size,
            pad_to_multiple_of=multiple, min_fill=1.0 if equal_lengths else self.min_fill,
        ):  # fmt: skip
            lengths = ids.lengths[index]
            width = _round_up(max(max(lengths.tolist()), 1), multiple)  # Python max: no parallel reduction
            mask = torch.arange(width) < lengths[:, None]
            input_ids = ids.values.new_full((len(index), width), pad_token_id)
            input_ids[mask] = torch.cat([rows[i] for i in index.tolist()])
            yield MicroBatch(index, input_ids, mask.long())


@dataclass(frozen=True)
class MicroBatch:
    """One right-padded chunk: ``index`` int64 ``[n]`` (rows in the original batch),
    ``input_ids`` int64 ``[n, T]`` and ``attention_mask`` int64 ``[n, T]`` (1 on real tokens)."""

    index: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def processed_tokens(self) -> int:
        return self.input_ids.numel()


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple or multiple <= 1 else -(-n // multiple) * multiple


def plan_micro_batches(lengths: torch.Tensor, *, max_tokens_per_batch: int | None, max_batch_size: int | None = None,
                       pad_to_multiple_of: int | None = None, min_fill: float | None = 0.95) -> list[torch.Tensor]:
    """Index tensors of the micro-batches of sequences of ``lengths`` (int64 ``[N]``), longest
    first, together a permutation of ``range(N)``; arguments as :class:`RewardBatching`."""
    RewardBatching(max_tokens_per_batch=max_tokens_per_batch, max_batch_size=max_batch_size,
                   min_fill=min_fill, pad_to_multiple_of=pad_to_multiple_of)  # checks them
    n = lengths.numel()
    if n == 0:
        return []
    # stable descending sort: equal lengths keep their order (deterministic batches)
    order = torch.sort(lengths, descending=True, stable=True).indices
    if max_tokens_per_batch is None and max_batch_size is None:
        return [order]
    sorted_lengths = lengths[order].tolist()
    batches, start = [], 0
    while start < n:
        width = _round_up(max(int(sorted_lengths[start]), 1), pad_to_multiple_of)
        rows = n - start
        if max_tokens_per_batch is not None:  # descending order: the first row sets the width
            rows = min(rows, max(1, max_tokens_per_batch // width))
        if max_batch_size is not None:
            rows = min(rows, max_batch_size)
        if min_fill:
            floor = min_fill * sorted_lengths[start]
            fits = 1
            while fits < rows and sorted_lengths[start + fits] >= floor:
                fits += 1
            rows = fits
        batches.append(order[start : start + rows])
        start += rows
    return batches
