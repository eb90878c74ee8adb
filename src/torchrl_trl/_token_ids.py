"""Token ids against a vocabulary (integer ids inside a model's embedding, a tokenizer that
fits it): the one home of these checks, for the dataset's columns and every reward scorer."""

from __future__ import annotations

from typing import Any

import torch

from .layouts import Ragged

__all__ = ["check_integer_ids", "check_token_ids", "check_tokenizer_fits", "embedding_size"]


def check_integer_ids(dtype: torch.dtype, where: str) -> None:
    """A ``TypeError`` naming ``where`` unless ``dtype`` holds integer token ids."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(
            f"{where}: token ids must be integers, got dtype {dtype}; store them as int64, as TorchRL's wrappers do"
        )


def _sample_of(ids: Ragged, bad: torch.Tensor) -> int:
    """The sample holding the first ``True`` of the flat mask ``bad``."""
    position = bad.nonzero()[0, 0]
    return int(torch.searchsorted(ids.offsets[1:], position, right=True))


def check_token_ids(ids: Ragged, where: str, *, num_embeddings: int | None = None, hint: str = "") -> Ragged:
    """``ids`` if they are integer token ids in ``[0, num_embeddings)``, at least one per sample;
    else an error naming ``where``, the sample and the id (then ``hint``).

    >>> check_token_ids(Ragged.from_list([[1, 2], [7]]), "input", num_embeddings=5)
    Traceback (most recent call last):
    ...
    ValueError: input: token id 7 in sample 1 is outside the model's embedding (num_embeddings=5)
    """
    check_integer_ids(ids.values.dtype, where)
    empty = (ids.lengths == 0).nonzero().flatten()
    if empty.numel():
        raise ValueError(
            f"{where}: sample(s) {empty[:10].tolist()} (of {len(ids)}) have no tokens (an empty "
            "sequence or an all-zero attention-mask row): there is nothing to score"
        )
    if not ids.values.numel():
        return ids
    low, top = int(ids.values.min()), int(ids.values.max())
    if low < 0:
        raise ValueError(
            f"{where}: negative token id {low} in sample {_sample_of(ids, ids.values < 0)}; token ids must be >= 0"
        )
    if num_embeddings is not None and top >= num_embeddings:
        sample = _sample_of(ids, ids.values >= num_embeddings)
        raise ValueError(
            f"{where}: token id {top} in sample {sample} is outside the model's embedding "
            f"(num_embeddings={num_embeddings}){hint}"
        )
    return ids


def embedding_size(model: Any) -> int | None:
    """Rows of ``model``'s input embedding (``None`` when it has none)."""
    get = getattr(model, "get_input_embeddings", None)
    return getattr(get() if callable(get) else None, "num_embeddings", None)


def check_tokenizer_fits(tokenizer: Any, num_embeddings: int | None, owner: str):
    """A ``ValueError`` naming ``owner`` when ``tokenizer`` has more tokens than the embedding has rows."""
    if tokenizer is None or num_embeddings is None or len(tokenizer) <= num_embeddings:
        return
    raise ValueError(
        f"{owner}: expected the model's tokenizer, got one of {len(tokenizer)} tokens for an embedding of "
        f"{num_embeddings} rows (or resize_token_embeddings and fine-tune)"
    )
