"""Read one column of a sampled batch, vectorised: the batch is indexed once per column.

A column spec is a ``NestedKey`` (``"a.b"`` strings name nested keys, as upstream
``TorchRLBufferDataset`` flattens them) or a callable ``fn(batch) -> list`` returning one
value per row. LLM keys go through :mod:`torchrl_trl.layouts`: ``tokens.<part>`` yields only
the real (unpadded) tokens, ``history.<part>`` plain ``{"role", "content"}`` messages.
"""

from __future__ import annotations

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
    "ArrayRow", "ColumnSpec", "array_rows", "column_name", "missing_key_error", "read_key",
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
    return KeyError(
        f"{what}: key {column_name(key)!r} is not in the replay buffer's samples. "
        f"Available keys: {layouts.available_keys(td)}"
    )


def read_key(
    td: TensorDictBase, key: NestedKey, *, python: bool = True
) -> tuple[list, torch.dtype | None]:
    """Per-row values of ``key`` in ``td`` (leading batch dims flattened).

    Returns:
        ``(values, dtype)``: a list with one entry per row — Python objects (lists for
        tensors) when ``python`` else tensors for tensor leaves — and the source tensor
        dtype (``None`` for non-tensor data).

    Raises:
        KeyError: naming ``key`` and the available keys when it is missing.
    """
    values, dtype = read_key_columnar(td, key)
    if python:
        return to_pylist(values), dtype
    if isinstance(values, layouts.Ragged):
        return list(values.split()), dtype
    if isinstance(values, torch.Tensor):
        return list(values.unbind(0)), dtype
    return list(values), dtype


def to_pylist(values: Any) -> list:
    """A column from :func:`read_key_columnar` as one Python value per row (lists for
    tensors and ragged rows; integer and bool sequences as :class:`ArrayRow` lists).

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
    """One row of integers (token ids, a mask) or bools: a plain Python list for everyone
    (``==``, ``isinstance(row, list)``, ``datasets.Features``, Arrow, JSON) that also
    hands ``torch.tensor(row)`` its values as one array, through the DLPack protocol.

    TRL's collators call ``torch.tensor`` on every row's ids; from a Python list that
    converts each int (~70 us for 256 ids), from this row it copies one array (~10 us,
    about what a tensor row costs). The array is a private copy taken when the row is
    built (a later write to the replay buffer does not reach it), each export is a fresh
    copy, and any in-place change of the list (``append``, ``row[i] = ...``) drops the
    array, so ``torch.tensor(row)`` equals ``torch.tensor(list(row))`` (except that an
    empty row gives an empty int64 tensor where an empty list gives float32).

    >>> import numpy as np, torch
    >>> row = ArrayRow.from_array(np.array([5, 6, 7]))
    >>> row == [5, 6, 7], isinstance(row, list)
    (True, True)
    >>> torch.tensor(row)
    tensor([5, 6, 7])
    >>> row.append(8)
    >>> torch.tensor(row)
    tensor([5, 6, 7, 8])
    """

    __slots__ = ("_array",)

    @classmethod
    def from_array(cls, array: np.ndarray, values: list | None = None) -> ArrayRow:
        """The row of 1-D ``array`` (integers, stored as int64 as ``torch.tensor`` of
        Python ints gives, or bools); ``values``: ``array.tolist()`` when already made."""
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


def _dropping_array(name: str):
    method = getattr(list, name)

    def mutate(self, *args):
        self._array = None
        return method(self, *args)

    mutate.__name__ = name
    mutate.__doc__ = method.__doc__
    return mutate


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend",
              "insert", "pop", "remove", "clear", "sort", "reverse"):
    setattr(ArrayRow, _name, _dropping_array(_name))
del _name


def _row_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The numpy dtype of ``torch.tensor`` of such Python values (``None``: not a kind
    :class:`ArrayRow` holds; floats follow torch's default dtype, so they stay lists)."""
    if dtype == torch.bool:
        return np.dtype(np.bool_)
    if not (dtype.is_floating_point or dtype.is_complex):
        return np.dtype(np.int64)
    return None


def array_rows(values: Any) -> list[ArrayRow] | None:
    """A ``[B, T]`` integer/bool tensor or a :class:`~torchrl_trl.layouts.Ragged` of
    integers/bools as ``B`` :class:`ArrayRow` lists (one copy of the values); ``None`` for
    anything else.

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
    dtype = _row_dtype(flat.dtype)
    if dtype is None:
        return None
    # a private copy: later buffer writes don't reach it
    array = flat.detach().cpu().numpy().astype(dtype, copy=True)
    if lengths is None:
        pieces = array.reshape(values.shape)
        rows = [ArrayRow(v) for v in pieces.tolist()]
    else:
        ends = np.cumsum(np.asarray(lengths.tolist(), dtype=np.int64))
        pieces = np.split(array, ends[:-1]) if len(ends) else []
        flat_list = array.tolist()
        rows = [ArrayRow(flat_list[e - len(a):e]) for a, e in zip(pieces, ends.tolist())]
    for row, piece in zip(rows, pieces):
        row._array = piece
    return rows


def read_key_columnar(td: TensorDictBase, key: NestedKey) -> tuple[Any, torch.dtype | None]:
    """``key``'s values for the whole batch in their cheapest form, one row per entry:

    a tensor ``[B, ...]`` (dense leaves), a :class:`~torchrl_trl.layouts.Ragged`
    (``tokens.<part>``: only the real tokens) or a list (text, messages, non-tensor data,
    ragged/nested leaves as per-row Python lists). Also returns the source tensor dtype
    (``None`` for non-tensor data).

    Raises:
        KeyError: naming ``key`` and the available keys when it is missing.
    """
    key = to_nested_key(key)
    if not layouts.has_key(td, key):
        raise missing_key_error(td, key, "column")
    tkey = key if isinstance(key, tuple) else (key,)
    if len(tkey) == 2 and tkey[1] in _PARTS and tkey[0] in ("tokens", "history"):
        if tkey[0] == "history":
            return layouts.read_history(td, tkey[1]), None
        ragged = read_token_ids(td, tkey[1])
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
    """:func:`layouts.read_tokens` of ``("tokens", part)``; a ``TypeError`` naming the key
    and the dtype when the ids are not integers (see :func:`check_integer_ids`)."""
    ragged = layouts.read_tokens(td, part)
    check_integer_ids(ragged.values.dtype, f"key {column_name(layouts.token_key(part))!r}")
    return ragged


class _RaggedRows(list):
    """Per-row values (tensors of different shapes, or anything else) read row by row;
    ``tolist`` converts each tensor row to Python."""

    def tolist(self) -> list:
        return [r.tolist() if isinstance(r, torch.Tensor) else r for r in self]


def _get_dense(td: TensorDictBase, key: NestedKey) -> Any:
    """``td.get(key)``, or ``None`` where the rows cannot be stacked (a lazy stack, also
    one nested in a dense tensordict, e.g. ``ListStorage`` samples of ragged rollouts):
    then the caller reads row by row through :func:`layouts.read_column`."""
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
    """Each row's prompt then response tokens (padding removed), and a 0/1 int64 mask that
    is 1 on the response: two :class:`~torchrl_trl.layouts.Ragged` of the same lengths."""
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
