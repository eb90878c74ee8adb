"""Column values and their ``datasets.Features``: integer rows as :class:`ArrayRow` lists, features
declared by formats, else inferred from the first converted batch (with the source tensor dtype)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..layouts import Ragged

__all__ = ["ArrayRow", "array_rows", "infer_feature", "messages", "to_pylist", "token_list", "value"]

_CPU_DEVICE = np.empty(0).__dlpack_device__()  # (kDLCPU, 0)

_DTYPES = {d: str(d).removeprefix("torch.") for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.float64,
)}
_DTYPES[torch.bfloat16] = "float32"  # Arrow has no bfloat16


def value(dtype: str = "string"):
    """``datasets.Value(dtype)``; a string by default."""
    from datasets import Value

    return Value(dtype)


def token_list(dtype: str = "int64"):
    """``List(Value(dtype))``: one token sequence (or mask) per row."""
    from datasets import List

    return List(value(dtype))


def messages():
    """``List({"role": string, "content": string})``: TRL's conversational format."""
    from datasets import List

    return List({"role": value(), "content": value()})


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


def to_pylist(values: Any) -> list:
    """A column (:func:`~torchrl_trl.data.columns.read_key_columnar`) as one Python value per row (integer
    sequences as :class:`ArrayRow` lists).

    >>> import torch
    >>> to_pylist(torch.tensor([[1, 2], [3, 4]]))
    [[1, 2], [3, 4]]
    >>> to_pylist(torch.tensor([0.5, 1.5]))
    [0.5, 1.5]
    """
    if type(values) is list:  # ragged tensor rows among them converted one by one
        return [v.tolist() if isinstance(v, torch.Tensor) else v for v in values]
    rows = array_rows(values)
    if rows is not None:
        return rows
    if isinstance(values, torch.Tensor) and values.dtype == torch.bfloat16:
        values = values.float()
    if hasattr(values, "tolist"):
        return values.tolist()
    return list(values)


class ArrayRow(list):
    """A plain list of ints or bools that hands ``torch.tensor(row)`` (TRL's collators, per row) its values
    as one private array copy through DLPack. A slice keeps the array (``SFTTrainer`` truncates by slicing);
    an in-place change drops it. An empty row gives an int64 tensor (an empty ``list`` gives float32).

    >>> import numpy as np, torch
    >>> row = ArrayRow.from_array(np.array([5, 6, 7]))
    >>> row == [5, 6, 7], isinstance(row, list)
    (True, True)
    >>> torch.tensor(row), torch.tensor(row[1:])
    (tensor([5, 6, 7]), tensor([6, 7]))
    >>> row.append(8)
    >>> torch.tensor(row)
    tensor([5, 6, 7, 8])
    """

    __slots__ = ("_array",)

    @classmethod
    def from_array(cls, array: np.ndarray, values: list | None = None) -> ArrayRow:
        """The row of 1-D int64 or bool ``array``; ``values``: ``array.tolist()`` if already made."""
        row = cls(array.tolist() if values is None else values)
        row._array = array
        return row

    def __dlpack__(self, **kwargs):  # TRL's collator calls it twice per row: kept flat
        array = getattr(self, "_array", None)
        if array is None:  # built from a list, or changed in place since: torch's own rules
            return torch.tensor(list(self)).__dlpack__(**kwargs)
        return array.copy().__dlpack__(**kwargs)  # torch.as_tensor(row) must not alias the row

    def __dlpack_device__(self):
        return _CPU_DEVICE

    def __getitem__(self, index):
        item = list.__getitem__(self, index)
        array = getattr(self, "_array", None)
        if type(index) is slice and array is not None:
            return ArrayRow.from_array(array[index], item)
        return item


def _dropping_array(name: str):
    method = getattr(list, name)

    @functools.wraps(method)
    def mutate(self, *args):
        self._array = None
        return method(self, *args)

    return mutate


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend",
              "insert", "pop", "remove", "clear", "sort", "reverse"):
    setattr(ArrayRow, _name, _dropping_array(_name))
del _name


def array_rows(values: Any) -> list[ArrayRow] | None:
    """A ``[B, T]`` integer/bool tensor or :class:`~torchrl_trl.layouts.Ragged` as ``B``
    :class:`ArrayRow` lists; ``None`` for anything else (floats stay plain lists).

    >>> import torch
    >>> from torchrl_trl.layouts import Ragged
    >>> rows = array_rows(Ragged.from_list([[1, 2, 3], [4]]))
    >>> rows, torch.tensor(rows[1])
    ([[1, 2, 3], [4]], tensor([4]))
    >>> array_rows(torch.zeros(2, 3)) is None  # floats stay plain lists
    True
    """
    if isinstance(values, Ragged):
        flat = values.values
    elif isinstance(values, torch.Tensor) and values.ndim == 2 and not values.is_nested:
        flat = values.reshape(-1)
    else:
        return None
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        return None
    # a private copy (later buffer writes don't reach it), of torch.tensor's dtype for such values
    array = flat.detach().cpu().numpy().astype(np.bool_ if flat.dtype == torch.bool else np.int64, copy=True)
    if not isinstance(values, Ragged):
        pieces = array.reshape(values.shape)
        return [ArrayRow.from_array(p, v) for p, v in zip(pieces, pieces.tolist())]
    bounds = values.offsets.tolist()
    flat_list = array.tolist()
    return [ArrayRow.from_array(array[a:b], flat_list[a:b]) for a, b in zip(bounds, bounds[1:])]
