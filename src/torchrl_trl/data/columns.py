"""The columns a :class:`~torchrl_trl.data.TorchRLBufferDataset` yields from a batch of buffer rows
(:class:`RowColumns`), each read vectorised, and their ``datasets.Features``. A column spec is a
``NestedKey`` (``"a.b"`` nests) or ``fn(batch) -> list``; ``tokens.<part>`` yields the real tokens,
``history.<part>`` plain ``{"role", "content"}`` messages (via :mod:`torchrl_trl.layouts`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from tensordict import TensorDictBase, is_tensor_collection
from tensordict.utils import NestedKey

from .. import layouts, padding
from .features import infer_feature, to_pylist
from .formats import BufferFormat, get_format, read_token_ids  # the registry, with every built-in format

__all__ = ["ColumnSpec", "RowColumns", "column_name", "per_row", "read_key_columnar", "to_nested_key"]

ColumnSpec = Union[NestedKey, Callable[[TensorDictBase], list]]


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


def per_row(values: Any, python: bool = True) -> list:
    """A :func:`read_key_columnar` column, one value per row (``python``: :func:`to_pylist`, else tensor views)."""
    if python:
        return to_pylist(values)
    if isinstance(values, layouts.Ragged):
        return list(values.split())
    if isinstance(values, torch.Tensor):
        return list(values.unbind(0))
    return list(values)


def read_key_columnar(td: TensorDictBase, key: NestedKey) -> tuple[Any, torch.dtype | None]:
    """``(values, dtype)``: ``key``'s values in their cheapest whole-batch form (a tensor ``[B, ...]``, a
    :class:`~torchrl_trl.layouts.Ragged` for ``tokens.<part>``, or a list) and the source tensor dtype
    (``None`` for non-tensor data). A missing key raises ``KeyError`` naming the available keys."""
    key = to_nested_key(key)
    if not layouts.has_key(td, key):
        raise KeyError(f"RowColumns: key {column_name(key)!r} is not in the replay buffer's samples. Available keys: "
                       f"{layouts.available_keys(td)}")
    if isinstance(key, tuple) and len(key) == 2 and key[1] in layouts.PARTS and key[0] in ("tokens", "history"):
        if key[0] == "history":
            return layouts.read_history(td, key[1]), None
        ragged = read_token_ids(td, key[1])
        return ragged, ragged.values.dtype
    values = layouts.read_column(td, key, stack=True)
    if isinstance(values, torch.Tensor):
        return values, values.dtype
    if values and isinstance(values[0], torch.Tensor):  # ragged: one tensor per row
        return values, values[0].dtype
    if values and is_tensor_collection(values[0]):
        raise TypeError(
            f"RowColumns: key {column_name(key)!r} holds a nested {type(values[0]).__name__}, not a leaf; "
            f"name one of its leaves. Available keys: {layouts.available_keys(td)}"
        )
    return values, None


class RowColumns:
    """What each row of a :class:`~torchrl_trl.data.TorchRLBufferDataset` holds beyond upstream's
    ``keys``: a format's columns, named columns, the storage index, after a row filter. Pass it as the
    dataset's ``format=`` (a format name or :class:`~torchrl_trl.data.BufferFormat` is ``RowColumns(format)``).

    Args:
        format (str or BufferFormat, optional): a registered format name (``"sft"``, ...: see
            :func:`~torchrl_trl.data.formats.available_formats`) or a :class:`~torchrl_trl.data.BufferFormat`.
            Defaults to ``None``.
        columns (mapping of str to NestedKey or callable, optional): ``{column: spec}``, ``spec`` a nested
            key or ``fn(batch) -> list`` (e.g. :meth:`torchrl_trl.online.StalenessFilter.weight_column`),
            yielded beside the format's. Defaults to ``None``.

    Keyword Args:
        index_column (str, optional): yield each row's storage index (an int) under this column name (e.g.
            for :func:`torchrl_trl.online.update_priorities`; needs ``remove_unused_columns=False`` in the
            trainer's config). Defaults to ``None``.
        sample_filter (callable, optional): ``fn(batch) -> bool tensor [B]``: rows where it is ``False`` are
            not yielded (e.g. :class:`torchrl_trl.online.StalenessFilter`), so an epoch pass yields fewer than
            ``len(dataset)`` rows. Defaults to ``None``.
        tokenizer (transformers tokenizer, optional): the policy's tokenizer; its pad string is removed from
            decoded ``text``/``history`` (see :func:`torchrl_trl.layouts.read_text`). Defaults to ``None``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import ListStorage, ReplayBuffer
        >>> from torchrl_trl.data import TorchRLBufferDataset
        >>> rb = ReplayBuffer(storage=ListStorage(8))
        >>> _ = rb.extend(TensorDict({"x": torch.arange(4), "y": torch.arange(4) * 10}, [4]))
        >>> rows = RowColumns(columns={"y_plus_x": lambda td: (td["y"] + td["x"]).tolist()}, index_column="index",
        ...                   sample_filter=lambda td: td["x"] % 2 == 1)
        >>> list(TorchRLBufferDataset(rb, 4, keys=["x"], format=rows, reading="epoch").as_hf_dataset())
        [{'x': 1, 'y_plus_x': 11, 'index': 1}, {'x': 3, 'y_plus_x': 33, 'index': 3}]
    """

    def __init__(self, format: str | BufferFormat | None = None, columns: Mapping[str, ColumnSpec] | None = None, *,
                 index_column: str | None = None, sample_filter: Callable[[TensorDictBase], torch.Tensor] | None = None,
                 tokenizer: Any = None) -> None:  # fmt: skip
        if format is not None and not isinstance(format, (str, BufferFormat)):
            raise TypeError(
                f"RowColumns: format must be a format name, a BufferFormat or None, got {type(format).__name__}"
            )
        if columns is not None and not isinstance(columns, Mapping):
            raise TypeError(f"RowColumns: columns must be a mapping {{column: key or fn}}, got "
                            f"{type(columns).__name__} (keys under their flat name: the dataset's keys=)")
        if sample_filter is not None and not callable(sample_filter):
            raise TypeError(f"RowColumns: sample_filter must be callable, got {type(sample_filter).__name__}")
        self.format = get_format(format) if format is not None else None
        self.columns: dict[str, ColumnSpec] = {
            name: spec if callable(spec) else to_nested_key(spec) for name, spec in (columns or {}).items()
        }
        self.sample_filter = sample_filter
        self.index_column = index_column
        self.tokenizer = tokenizer
        # set by bind(): the dataset's keys and device, the pad string
        self.keys: list[NestedKey] | None = None
        self.device: torch.device | None = None
        self.pad_text: str | None = None
        self.dtypes: dict[str, torch.dtype] = {}

    def bind(self, *, keys: Sequence[NestedKey] | None = None, device: torch.device | str | None = None) -> RowColumns:
        """A copy for one dataset's ``keys`` and ``device``, the tokenizer kept as its pad string."""
        bound = copy.copy(self)
        bound.keys = None if keys is None else [to_nested_key(k) for k in keys]
        bound.device = torch.device(device) if device is not None else None
        bound.pad_text = None if self.tokenizer is None else padding.pad_string(self.tokenizer)
        bound.tokenizer = None
        bound.dtypes = {}
        return bound

    def raw_keys(self, batch: TensorDictBase) -> list[NestedKey]:
        """``keys``, or every leaf key when nothing else is asked for."""
        if self.keys is None and self.format is None and not self.columns:
            return [to_nested_key(k) for k in layouts.available_keys(batch)]
        return list(self.keys or [])

    def in_keys(self, batch: TensorDictBase) -> list[NestedKey]:
        """The nested keys read by name: raw keys, the format's, the named columns'."""
        named = [s for s in self.columns.values() if not callable(s)]
        keys = [*self.raw_keys(batch), *(self.format.required_keys if self.format else ()), *named]
        return list(dict.fromkeys(to_nested_key(k) for k in keys))

    def check(self, peek: TensorDictBase) -> dict[str, Any]:
        """``peek`` (the first stored rows) as Python values, after checking the format's keys are there (the
        others are checked as they are read)."""
        if self.format is not None and (missing := self.format.missing_keys(peek)):
            names = [column_name(k) for k in missing]
            raise KeyError(f"TorchRLBufferDataset: format {self.format.name!r} needs keys {names} that the replay "
                           f"buffer's samples lack. Available keys: {layouts.available_keys(peek)}")
        cols = self.convert(peek, python=True)
        if self.index_column is not None:
            cols[self.index_column] = list(range(peek.batch_size.numel()))
        return cols

    def convert(self, batch: TensorDictBase, *, python: bool | str) -> dict[str, Any]:
        """``{column: one value per row}``: ``python=True`` Python values, ``False`` tensors for tensor
        leaves, ``"columnar"`` :func:`read_key_columnar` forms."""
        cols: dict[str, Any] = {}
        with layouts.read_once():  # the format, the keys and the named columns share one read of the batch
            if self.format is not None:
                with layouts.decoded_padding(pad_text=self.pad_text):
                    cols.update(self.format(batch))
            for key in self.raw_keys(batch):
                cols[column_name(key)], self.dtypes[column_name(key)] = _read(batch, key, python)
            for name, spec in self.columns.items():
                if callable(spec):
                    cols[name] = list(spec(batch))
                else:
                    cols[name], self.dtypes[name] = _read(batch, spec, python)
        n = batch.batch_size.numel()
        for name, values in cols.items():
            if len(values) != n:
                raise ValueError(f"TorchRLBufferDataset: expected one value per row in column {name!r}, "
                                 f"got {len(values)} for a batch of {n} rows")
        return cols

    def of_batch(self, batch: TensorDictBase, python: bool | str,
                 index: torch.Tensor | None = None) -> dict[str, Any] | None:
        """:meth:`convert` after ``sample_filter`` (``None``: every row dropped), with the index column."""
        if index is not None:  # one per row: an item of batch shape [G] gives G rows
            index = torch.as_tensor(index).reshape(-1)
            rows = batch.batch_size.numel()
            if index.numel() and rows != index.numel() and rows % index.numel() == 0:
                index = index.repeat_interleave(rows // index.numel())
        if self.sample_filter is not None:
            keep = self.keep(batch)
            if not keep.all():
                kept = keep.nonzero().squeeze(-1)
                if not kept.numel():
                    return None
                batch = batch[kept]
                index = None if index is None else index[kept]
        cols = self.convert(batch, python=python)
        if self.index_column is not None:
            cols[self.index_column] = index.clone() if python == "columnar" else index.tolist()
        if python is False and self.device is not None:
            for name, values in cols.items():
                cols[name] = [v.to(self.device) if isinstance(v, torch.Tensor) else v for v in values]
        return cols

    def rows(self, batch: TensorDictBase, python: bool, index: torch.Tensor | None = None) -> Iterator[dict[str, Any]]:
        """:meth:`of_batch` as one dict per row."""
        cols = self.of_batch(batch, python, index) or {}
        for row in zip(*cols.values()):
            yield dict(zip(cols, row))

    def keep(self, batch: TensorDictBase) -> torch.Tensor:
        """``sample_filter(batch)`` as bool ``[B]``; anything else raises."""
        keep = torch.as_tensor(self.sample_filter(batch))
        rows = batch.batch_size.numel()
        if keep.dtype != torch.bool:
            raise TypeError(
                f"RowColumns: sample_filter must return bools (a bool tensor of shape [{rows}], one per row), "
                f"got dtype {keep.dtype}"
            )
        if keep.numel() != rows:
            raise ValueError(
                f"RowColumns: sample_filter returned {keep.numel()} values (shape {list(keep.shape)}) for a batch "
                f"of {rows} rows; expected shape [{rows}] (or {list(batch.batch_size)})"
            )
        return keep.reshape(-1)

    def features(self, sample: dict[str, list]):
        """``datasets.Features`` of a :meth:`check` result: the format's, else inferred."""
        from datasets import Features, Value

        declared = self.format.features() if self.format is not None else {}
        feats = {name: declared[name] if name in declared else infer_feature(values, self.dtypes.get(name))
                 for name, values in sample.items()}
        if self.index_column is not None:
            feats[self.index_column] = Value("int64")
        return Features(feats)


def _read(batch: TensorDictBase, key: NestedKey, python: bool | str) -> tuple[Any, torch.dtype | None]:
    values, dtype = read_key_columnar(batch, key)
    return (values if python == "columnar" else per_row(values, python)), dtype
