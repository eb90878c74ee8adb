"""Read one column of a sampled batch, vectorised. A column spec is a ``NestedKey`` (``"a.b"``
names a nested key) or ``fn(batch) -> list``; ``tokens.<part>`` yields only the real tokens,
``history.<part>`` plain ``{"role", "content"}`` messages (via :mod:`torchrl_trl.layouts`)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, Union

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase
from tensordict import is_tensor_collection
from tensordict.utils import NestedKey

from .. import layouts
from .._token_ids import check_integer_ids

__all__ = [
    "ArrayRow", "ColumnSpec", "array_rows", "column_name", "missing_key_error", "per_row", "read_key",
    "read_key_columnar", "read_token_ids", "to_nested_key", "to_pylist",
]  # fmt: skip

ColumnSpec = Union[NestedKey, Callable[[TensorDictBase], list]]
_PARTS = ("prompt", "response", "full")
_CPU_DEVICE = np.empty(0).__dlpack_device__()  # (kDLCPU, 0)


def to_nested_key(key: NestedKey) -> NestedKey:
    """``"a.b"`` -> ``("a", "b")``; tuples and plain names unchanged."""
    if isinstance(key, str):
        return tuple(key.split(".")) if "." in key else key
    if isinstance(key, tuple) and len(key) == 1:
        return key[0]
    return key


def column_name(key: NestedKey) -> str:
    """The flat ``"a.b"`` name of a nested key."""
    return key if isinstance(key, str) else ".".join(str(k) for k in key)


def missing_key_error(td: TensorDictBase, key: NestedKey, what: str) -> KeyError:
    keys = layouts.available_keys(td)
    return KeyError(f"{what}: key {column_name(key)!r} is not in the replay buffer's samples. Available keys: {keys}")


def read_key(td: TensorDictBase, key: NestedKey, *, python: bool = True) -> tuple[list, torch.dtype | None]:
    """``(values, dtype)``: ``key``'s values, one per row (Python objects when ``python``, else
    tensors for tensor leaves), and the source tensor dtype (``None`` for non-tensor data).
    A missing key raises ``KeyError`` naming the available keys."""
    values, dtype = read_key_columnar(td, key)
    return per_row(values, python), dtype


def per_row(values: Any, python: bool = True) -> list:
    """A :func:`read_key_columnar` column, one value per row (``python``: :func:`to_pylist`, else tensor views)."""
    if python:
        return to_pylist(values)
    if isinstance(values, layouts.Ragged):
        return list(values.split())
    if isinstance(values, torch.Tensor):
        return list(values.unbind(0))
    return list(values)


def to_pylist(values: Any) -> list:
    """A :func:`read_key_columnar` column as one Python value per row (integer and bool
    sequences as :class:`ArrayRow` lists).

    >>> import torch
    >>> to_pylist(torch.tensor([[1, 2], [3, 4]]))
    [[1, 2], [3, 4]]
    >>> to_pylist(torch.tensor([0.5, 1.5]))
    [0.5, 1.5]
    """
    if type(values) is list:
        return values
    rows = array_rows(values)
    if rows is not None:
        return rows
    if isinstance(values, torch.Tensor) and values.dtype == torch.bfloat16:
        values = values.float()
    if hasattr(values, "tolist"):
        return values.tolist()
    return list(values)


class ArrayRow(list):
    """A plain Python list of integers or bools that hands ``torch.tensor(row)`` its values
    as one private array copy through DLPack (TRL's collators call ``torch.tensor`` on
    every row). A slice is an ``ArrayRow`` of the same array (``SFTTrainer`` truncates rows by
    slicing before collating), so indexing runs in Python (about 0.2 us, ten times a list's).
    An in-place change of the list drops the array. An empty row gives an int64 tensor (an
    empty ``list`` gives float32).

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
        """The row of 1-D int64 or bool ``array``; ``values``: ``array.tolist()`` if made."""
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
    if isinstance(values, layouts.Ragged):
        flat, lengths = values.values, values.lengths
    elif isinstance(values, torch.Tensor) and values.ndim == 2 and not values.is_nested:
        flat, lengths = values.reshape(-1), None
    else:
        return None
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        return None
    # a private copy (later buffer writes don't reach it), of torch.tensor's dtype for such values
    array = flat.detach().cpu().numpy().astype(np.bool_ if flat.dtype == torch.bool else np.int64, copy=True)
    if lengths is None:
        pieces = array.reshape(values.shape)
        return [ArrayRow.from_array(p, v) for p, v in zip(pieces, pieces.tolist())]
    bounds = [0, *itertools.accumulate(lengths.tolist())]
    flat_list = array.tolist()
    return [ArrayRow.from_array(array[a:b], flat_list[a:b]) for a, b in zip(bounds, bounds[1:])]


def read_key_columnar(td: TensorDictBase, key: NestedKey) -> tuple[Any, torch.dtype | None]:
    """``(values, dtype)`` as :func:`read_key`, the values in their cheapest whole-batch form:
    a tensor ``[B, ...]``, a :class:`~torchrl_trl.layouts.Ragged` (``tokens.<part>``) or a list."""
    key = to_nested_key(key)
    if not layouts.has_key(td, key):
        raise missing_key_error(td, key, "column")
    if isinstance(key, tuple) and len(key) == 2 and key[1] in _PARTS and key[0] in ("tokens", "history"):
        if key[0] == "history":
            return layouts.read_history(td, key[1]), None
        ragged = read_token_ids(td, key[1])
        return ragged, ragged.values.dtype
    value = _get_dense(td, key)
    if value is None:  # ragged lazy stack: one tensor per row
        rows = layouts.read_column(td, key)
        dtype = rows[0].dtype if rows and isinstance(rows[0], torch.Tensor) else None
        return _RaggedRows(rows), dtype
    if isinstance(value, (NonTensorData, NonTensorStack)):
        return layouts.read_column(td, key), None
    if is_tensor_collection(value):
        raise TypeError(
            f"column: key {column_name(key)!r} holds a nested {type(value).__name__}, not a leaf; "
            f"name one of its leaves. Available keys: {layouts.available_keys(td)}"
        )
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return _RaggedRows(list(value.unbind(0))), value.dtype
        return value.reshape(-1, *value.shape[td.batch_dims :]), value.dtype
    return layouts.read_column(td, key), None


def read_token_ids(td: TensorDictBase, part: layouts.Part) -> layouts.Ragged:
    """:func:`layouts.read_tokens` of ``("tokens", part)``; ``TypeError`` if not integers."""
    ragged = layouts.read_tokens(td, part)
    check_integer_ids(ragged.values.dtype, f"key {column_name(layouts.token_key(part))!r}")
    return ragged


class _RaggedRows(list):
    """Per-row values read row by row; ``tolist`` converts each tensor row to Python."""

    def tolist(self) -> list:
        return [r.tolist() if isinstance(r, torch.Tensor) else r for r in self]


def _get_dense(td: TensorDictBase, key: NestedKey) -> Any:
    """``td.get(key)``, or ``None`` where the rows cannot be stacked (ragged lazy stacks)."""
    try:
        return td.get(key)
    except (RuntimeError, ValueError, TypeError):
        if isinstance(td, LazyStackedTensorDict) or td.batch_dims > 0:
            return None
        raise


def leaf_keys(td: TensorDictBase) -> list[NestedKey]:
    """Every leaf key of ``td`` (tensors and non-tensor data), in a stable order."""
    return [to_nested_key(k) for k in layouts.available_keys(td)]


def prompt_response_ids(td: TensorDictBase) -> tuple[layouts.Ragged, layouts.Ragged]:
    """Each row's prompt + response tokens and a 0/1 int64 mask, 1 on the response (two
    :class:`~torchrl_trl.layouts.Ragged` of the same lengths)."""
    prompt, response = read_token_ids(td, "prompt"), read_token_ids(td, "response")
    lengths = prompt.lengths + response.lengths
    # interleave prompt and response tokens row by row with index arithmetic
    starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    within = torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)
    is_completion = within >= prompt.lengths.repeat_interleave(lengths)
    values = torch.empty(int(lengths.sum()), dtype=prompt.values.dtype)
    values[~is_completion] = prompt.values
    values[is_completion] = response.values
    return layouts.Ragged(values, lengths), layouts.Ragged(is_completion.long(), lengths)
