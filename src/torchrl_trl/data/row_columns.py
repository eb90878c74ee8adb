"""Which columns a :class:`~torchrl_trl.data.TorchRLBufferDataset` yields, how a batch of
buffer rows becomes them, and their ``datasets.Features``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .. import layouts
from .columns import (
    ColumnSpec, column_name, leaf_keys, missing_key_error, read_key, read_key_columnar, to_nested_key,
)
from .features import infer_feature
from .formats import BufferFormat, check_format, get_format  # the registry, with every built-in format

__all__ = ["RowColumns"]


class RowColumns:
    """Turns a batch of buffer rows (batch shape ``[B]`` or ``[B, G]``) into ``{column: one
    value per row}``; the arguments are ``TorchRLBufferDataset``'s (``pad_text``: the pad
    token's string, removed from decoded text)."""

    def __init__(self, *, keys: Sequence[NestedKey] | None = None, format: str | BufferFormat | None = None,
                 columns: Mapping[str, ColumnSpec] | None = None,
                 extra_columns: Sequence[NestedKey] | Mapping[str, NestedKey] | None = None,
                 sample_filter: Callable[[TensorDictBase], torch.Tensor] | None = None, index_column: str | None = None,
                 device: torch.device | str | None = None, pad_text: str | None = None) -> None:
        if sample_filter is not None and not callable(sample_filter):
            raise TypeError(f"sample_filter must be callable, got {type(sample_filter).__name__}.")
        self.keys = None if keys is None else [to_nested_key(k) for k in keys]
        self.format = get_format(format) if format is not None else None
        self.columns: dict[str, ColumnSpec] = {
            name: spec if callable(spec) else to_nested_key(spec) for name, spec in (columns or {}).items()
        }
        if isinstance(extra_columns, Mapping):
            extra = {name: to_nested_key(k) for name, k in extra_columns.items()}
        else:
            extra = {column_name(to_nested_key(k)): to_nested_key(k) for k in (extra_columns or [])}
        self.columns.update(extra)
        self.sample_filter = sample_filter
        self.index_column = index_column
        self.device = torch.device(device) if device is not None else None
        self.pad_text = pad_text
        self.dtypes: dict[str, torch.dtype] = {}

    def raw_keys(self, batch: TensorDictBase) -> list[NestedKey]:
        """``keys``, or every leaf key when nothing else is asked for."""
        if self.keys is None and self.format is None and not self.columns:
            return leaf_keys(batch)
        return list(self.keys or [])

    def in_keys(self, batch: TensorDictBase) -> list[NestedKey]:
        """The nested keys read by name: raw keys, the format's, the named columns'."""
        named = [s for s in self.columns.values() if not callable(s)]
        keys = [*self.raw_keys(batch), *(self.format.required_keys if self.format else ()), *named]
        return list(dict.fromkeys(to_nested_key(k) for k in keys))

    def check(self, peek: TensorDictBase, *, python: bool | str) -> dict[str, Any]:
        """Convert ``peek`` (the first stored rows) after checking every key is there."""
        if self.format is not None:
            check_format(self.format, peek)
        for spec in [*(self.keys or []), *(s for s in self.columns.values() if not callable(s))]:
            if not layouts.has_key(peek, spec):
                raise missing_key_error(peek, spec, "TorchRLBufferDataset")
        cols = self.convert(peek, python=python)
        if self.index_column is not None:
            cols[self.index_column] = list(range(peek.batch_size.numel()))
        return cols

    def convert(self, batch: TensorDictBase, *, python: bool | str) -> dict[str, Any]:
        """``{column: one value per row}`` for ``batch``: ``python=True`` Python values, ``False``
        tensors for tensor leaves, ``"columnar"`` :func:`read_key_columnar` forms."""
        cols: dict[str, Any] = {}
        if self.format is not None:
            with layouts.decoded_padding(pad_text=self.pad_text), layouts.padding_checked_once():
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
                raise ValueError(f"column {name!r} has {len(values)} values for a batch of {n} rows")
        return cols

    def of_batch(self, batch: TensorDictBase, python: bool | str,
                 index: torch.Tensor | None = None) -> dict[str, Any] | None:
        """:meth:`convert` after ``sample_filter`` (``None``: every row dropped), with the index
        column; ``python=False`` moves tensors to ``device``."""
        if index is not None:
            index = _index_per_row(index, batch)
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
            index = torch.as_tensor(index).reshape(-1)
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
        out = self.sample_filter(batch)
        keep = torch.as_tensor(out) if not isinstance(out, torch.Tensor) else out
        rows = batch.batch_size.numel()
        if keep.dtype != torch.bool:
            raise TypeError(
                f"sample_filter must return bools (a bool tensor of shape [{rows}], one per row), "
                f"got dtype {keep.dtype}"
            )
        if keep.numel() != rows:
            raise ValueError(
                f"sample_filter returned {keep.numel()} values (shape {list(keep.shape)}) for a batch of "
                f"{rows} rows; expected shape [{rows}] (or the batch shape {list(batch.batch_size)})"
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


def _read(batch: TensorDictBase, key: NestedKey, python: bool | str):
    return read_key_columnar(batch, key) if python == "columnar" else read_key(batch, key, python=python)


def _index_per_row(index: torch.Tensor, batch: TensorDictBase) -> torch.Tensor:
    """Storage indices, one per row (an item of batch shape ``[G]`` gives ``G`` rows)."""
    index = torch.as_tensor(index).reshape(-1)
    rows = batch.batch_size.numel()
    if index.numel() and rows != index.numel() and rows % index.numel() == 0:
        index = index.repeat_interleave(rows // index.numel())
    return index
