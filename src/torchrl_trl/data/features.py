"""``datasets.Features`` for the columns this package yields: declared by formats, else
inferred from the first converted batch (with the source tensor dtype when known)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["infer_feature", "messages", "string", "token_list", "value"]

_DTYPES = {d: str(d).removeprefix("torch.") for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.float64,
)}
_DTYPES[torch.bfloat16] = "float32"  # Arrow has no bfloat16


def value(dtype: str = "string"):
    """``datasets.Value(dtype)``."""
    from datasets import Value

    return Value(dtype)


def string():
    """``datasets.Value("string")``."""
    return value("string")


def token_list(dtype: str = "int64"):
    """``List(Value(dtype))``: one token sequence (or mask) per row."""
    from datasets import List

    return List(value(dtype))


def messages():
    """``List({"role": string, "content": string})``: TRL's conversational format."""
    from datasets import List

    return List({"role": string(), "content": string()})


def infer_feature(values: Sequence[Any], dtype: torch.dtype | None = None):
    """The feature of one column from its per-row Python values (``None`` rows skipped).

    Raises:
        ValueError: when no row holds a value to infer from.
    """
    from datasets import List

    for v in values:
        if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
            continue
        if isinstance(v, str):
            return value("string")
        if isinstance(v, bool):
            return value("bool")
        if isinstance(v, int):
            return value("int64" if dtype is None else _DTYPES.get(dtype, "int64"))
        if isinstance(v, float):
            return value("float64" if dtype is None else _DTYPES.get(dtype, "float32"))
        if isinstance(v, torch.Tensor):
            return infer_feature([v.tolist()], v.dtype)
        if isinstance(v, Mapping):
            return {k: infer_feature([r[k] for r in values if r is not None and k in r], dtype) for k in v}
        if isinstance(v, (list, tuple)):
            inner = [x for r in values if isinstance(r, (list, tuple)) for x in r]
            return List(infer_feature(inner, dtype))
        raise TypeError(f"TorchRLBufferDataset: expected column values datasets can type (numbers, strings, lists, "
                    f"dicts, tensors), got {type(v).__name__}")
    # only empty lists / None: a list of the dtype, or a string
    if any(isinstance(v, (list, tuple)) for v in values):
        return List(value("string" if dtype is None else _DTYPES.get(dtype, "int64")))
    raise ValueError(
        "TorchRLBufferDataset: cannot infer a column's datasets feature: expected a value, every row is None"
    )
