"""Token-budget micro-batches: sort by length, pack, pad right, restore order.

A batch of ``N`` sequences of lengths ``L_i`` padded to ``max(L)`` costs ``N * max(L)``
token slots. Sorting by length and packing consecutive sequences while
``rows * longest <= max_tokens_per_batch`` makes the processed slots close to
``sum(L)`` (padding efficiency ~1) and bounds the peak activation memory by the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts import Ragged

__all__ = [
    "MicroBatch",
    "check_count",
    "check_fraction",
    "iter_micro_batches",
    "plan_micro_batches",
    "truncate",
]


def check_count(name: str, value, *, minimum: int = 1, optional: bool = True) -> int | None:
    """``value`` as an ``int >= minimum`` (``None`` allowed when ``optional``); a
    ``ValueError``/``TypeError`` naming the argument otherwise."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_fraction(name: str, value) -> float | None:
    """``value`` as a float in ``(0, 1]``, or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in (0, 1] or None, got {value!r}")
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1] (or None), got {value}")
    return float(value)


@dataclass(frozen=True)
class MicroBatch:
    """One right-padded chunk of a :class:`Ragged` batch.

    Attributes:
        index: int64 ``[n]`` positions of these rows in the original batch.
        input_ids: int64 ``[n, T]`` right-padded with the pad id.
        attention_mask: int64 ``[n, T]``, 1 on real tokens.
    """

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
    if not multiple or multiple <= 1:
        return n
    return -(-n // multiple) * multiple


def plan_micro_batches(
    lengths: torch.Tensor,
    *,
    max_tokens_per_batch: int | None,
    max_batch_size: int | None = None,
    pad_to_multiple_of: int | None = None,
    min_fill: float | None = 0.95,
) -> list[torch.Tensor]:
    """Split sample indices into micro-batches by a token budget.

    Args:
        lengths: int64 ``[N]`` sequence lengths.
        max_tokens_per_batch: budget on ``rows * padded_width`` per micro-batch; ``None``
            puts everything in one batch (still length-sorted). A sequence longer than
            the budget gets a micro-batch of its own.
        max_batch_size: optional cap on rows per micro-batch.
        pad_to_multiple_of: the padded width is rounded up to this multiple.
        min_fill: a micro-batch only takes sequences at least ``min_fill`` x its longest,
            so each one's padding efficiency is >= ``min_fill`` (before rounding);
            ``None`` packs by the budget alone.

    Returns:
        index tensors, longest sequences first; together a permutation of ``range(N)``.
    """
    check_count("max_tokens_per_batch", max_tokens_per_batch)
    check_count("max_batch_size", max_batch_size)
    check_count("pad_to_multiple_of", pad_to_multiple_of)
    check_fraction("min_fill", min_fill)
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
        if max_tokens_per_batch is not None:
            # descending order: the first row sets the width of the whole micro-batch
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


def iter_micro_batches(
    ids: Ragged,
    *,
    pad_token_id: int,
    max_tokens_per_batch: int | None,
    max_batch_size: int | None = None,
    pad_to_multiple_of: int | None = None,
    min_fill: float | None = 0.95,
):
    """Yield right-padded :class:`MicroBatch` es covering every row of ``ids`` once."""
    # row views + one masked copy per micro-batch: no ``repeat_interleave``
    # (``Ragged.select``), which takes milliseconds per call with 2+ threads on a busy CPU
    rows = ids.split()
    for index in plan_micro_batches(
        ids.lengths,
        max_tokens_per_batch=max_tokens_per_batch,
        max_batch_size=max_batch_size,
        pad_to_multiple_of=pad_to_multiple_of,
        min_fill=min_fill,
    ):
        lengths = ids.lengths[index]
        width = _round_up(max(max(lengths.tolist()), 1), pad_to_multiple_of)  # no parallel reduction
        mask = torch.arange(width) < lengths[:, None]
        input_ids = ids.values.new_full((len(index), width), pad_token_id)
        input_ids[mask] = torch.cat([rows[i] for i in index.tolist()])
        yield MicroBatch(index, input_ids, mask.long())


def truncate(
    ids: Ragged, max_length: int | None, side: str
) -> tuple[Ragged, int]:
    """Cut sequences longer than ``max_length``.

    Args:
        side: ``"keep_end"`` keeps the last ``max_length`` tokens (the response and its
            EOS, where reward models pool), ``"keep_start"`` the first ones, ``"error"``
            raises.

    Returns:
        ``(ids, n_truncated)``.
    """
    if max_length is None or len(ids) == 0:
        return ids, 0
    too_long = ids.lengths > max_length
    n = int(too_long.sum())
    if n == 0:
        return ids, 0
    if side == "error":
        worst = int(ids.lengths.max())
        raise ValueError(
            f"{n} sequence(s) exceed max_length={max_length} tokens (longest: {worst}); "
            "pass truncation='keep_end' or 'keep_start', or a larger max_length"
        )
    seqs = list(ids.split())
    for i in too_long.nonzero().flatten().tolist():
        seqs[i] = seqs[i][-max_length:] if side == "keep_end" else seqs[i][:max_length]
    return Ragged.from_list(seqs, dtype=ids.values.dtype), n
