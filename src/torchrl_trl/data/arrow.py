"""Column batches -> ``datasets``: an examples iterable whose rows are already typed (``datasets`` encodes
nothing per row); its Arrow path builds one ``pyarrow.Table`` per batch. A column batch is ``{name: values}``,
``values`` a list, a tensor ``[B, ...]`` or a :class:`~torchrl_trl.layouts.Ragged`. Imports ``datasets``
(:class:`~torchrl_trl.data.TorchRLBufferDataset` imports this module only when asked for one).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from datasets import IterableDataset

from .. import _compat
from ..layouts import Ragged
from .columns import RowColumns, per_row
from .features import to_pylist
from .reading import BufferReader, KeyedBatch, ReadingStrategy

__all__ = ["ColumnarExamplesIterable", "EpochSharingIterableDataset", "HFBatches", "columns_to_table"]

ColumnBatch = Mapping[str, Any]


def _numpy(t: torch.Tensor, dtype) -> np.ndarray:
    """``t`` flattened as a numpy array of the Arrow value type ``dtype``."""
    if t.dtype == torch.bfloat16:
        t = t.float()
    arr = t.detach().cpu().reshape(-1).numpy()
    want = dtype.to_pandas_dtype() if pa.types.is_integer(dtype) or pa.types.is_floating(dtype) else None
    return arr if want is None or arr.dtype == want else arr.astype(want)


def _column_to_arrow(values: Any, arrow_type):
    if isinstance(values, torch.Tensor) and values.ndim == 2 and not values.is_nested:  # rows of equal length
        values = Ragged(values.reshape(-1), torch.full((values.shape[0],), values.shape[1], dtype=torch.int64))
    if isinstance(values, Ragged) and (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        large = pa.types.is_large_list(arrow_type)
        offsets = values.offsets.numpy().astype(np.int64 if large else np.int32)
        cls = pa.LargeListArray if large else pa.ListArray
        return cls.from_arrays(offsets, pa.array(_numpy(values.values, arrow_type.value_type)), type=arrow_type)
    if isinstance(values, torch.Tensor) and values.ndim == 1 and not pa.types.is_nested(arrow_type):
        return pa.array(_numpy(values, arrow_type), type=arrow_type)
    return pa.array(to_pylist(values), type=arrow_type)


def columns_to_table(cols: ColumnBatch, features):
    """A ``pyarrow.Table`` with ``features``' schema from one column batch."""
    schema = features.arrow_schema
    arrays = [_column_to_arrow(cols[name], schema.field(name).type) for name in features]
    return pa.Table.from_arrays(arrays, schema=schema)


def _rows(cols: ColumnBatch, tensors: bool = False) -> Iterator[dict]:
    names = list(cols)
    for row in zip(*(per_row(v, not tensors) for v in cols.values())):
        yield dict(zip(names, row))


@dataclass(eq=False)
class HFBatches:
    """Picklable source of column batches: ``self(shard_ids)`` yields ``(key, {column: values})`` in
    :func:`~torchrl_trl.data.columns.read_key_columnar` forms; ``rank`` is mixed into seeds."""

    reader: BufferReader
    reading: ReadingStrategy
    columns: RowColumns
    num_shards: int
    rank: int = 0

    def start_pass(self, pass_index: int, first: bool) -> dict[str, Any]:
        """Called once per pass, before its shards are read."""
        return self.reading.start_pass(self.reader, pass_index, first)

    def batches(self, shard_ids: list[int], pass_index: int = 0, length: int | None = None) -> Iterator[KeyedBatch]:
        return self.reading.shard_batches(self.reader, shard_ids, self.num_shards, rank=self.rank, length=length,
                                          with_index=self.columns.index_column is not None, pass_index=pass_index)

    def __call__(self, shard_ids: list[int], pass_index: int = 0,
                 length: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        for key, batch, index in self.batches(shard_ids, pass_index, length):
            cols = self.columns.of_batch(batch, "columnar", index)
            if cols is not None:
                yield key, cols

    def rows(self, shard_ids: list[int]) -> Iterator[dict[str, Any]]:
        """Python rows (``from_generator``'s protocol, for the map-style snapshot)."""
        for _, batch, index in self.batches(shard_ids):
            yield from self.columns.rows(batch, True, index)


class ColumnarExamplesIterable(_compat.datasets_examples_iterable_base()):
    """Examples iterable over ``generate_batches([shard], pass_index=k, **start_pass(k, first)) -> ((key,
    column batch), ...)`` (a :class:`HFBatches`) for each of ``shard_ids`` (which
    ``datasets`` splits over ranks and workers), ``num_passes`` times (``None``: endless)."""

    def __init__(self, generate_batches: HFBatches, shard_ids: list[int], features, tensors: bool = False,
                 num_passes: int | None = 1) -> None:
        super().__init__()
        self.generate_batches = generate_batches
        self.shard_ids = list(shard_ids)
        self.features = features
        self.tensors = tensors  # rows hold tensor views for tensor/ragged columns
        self.num_passes = num_passes

    is_typed = True  # rows already match ``features``: datasets applies nothing per row
    features = None  # set per instance (shadows the base class's property)
    sleep_on_threads_shutdown = False

    @property
    def num_shards(self) -> int:
        return len(self.shard_ids)

    def _init_state_dict(self) -> dict:
        self._state_dict = {"pass_idx": 0, "shard_idx": 0, "shard_example_idx": 0, "type": type(self).__name__}
        return self._state_dict

    def _batches(self) -> Iterator[tuple[int, Any, ColumnBatch, int]]:
        """``(start, key, cols, n)``: batches left, ``start`` rows to skip (resuming a state dict)."""
        state = self._state_dict
        k = state.get("pass_idx", 0) if state else 0
        first = True
        while self.num_passes is None or k < self.num_passes:
            kwargs = {"pass_index": k, **self.generate_batches.start_pass(k, first)}  # once per pass, for its shards
            first = False
            first_shard = state["shard_idx"] if state else 0
            for s in self.shard_ids[first_shard:]:
                skip = state["shard_example_idx"] if state else 0
                seen = 0
                for key, cols in self.generate_batches([s], **kwargs):
                    n = len(next(iter(cols.values()))) if cols else 0
                    if seen + n > skip:
                        yield max(skip - seen, 0), key, cols, n
                    seen += n
                if state:
                    state["shard_idx"] += 1
                    state["shard_example_idx"] = 0
            k += 1
            if state:
                state["pass_idx"] = k
                state["shard_idx"] = 0

    def __iter__(self):
        state = self._state_dict
        for start, key, cols, _ in self._batches():
            for i, row in enumerate(itertools.islice(_rows(cols, self.tensors), start, None), start):
                if state:
                    state["shard_example_idx"] += 1
                yield f"{key}_{i}", row

    def iter_arrow(self):
        state = self._state_dict
        for start, key, cols, n in self._batches():
            table = columns_to_table(cols, self.features)
            if start:
                table = table.slice(start)
            if state:
                state["shard_example_idx"] += n - start
            yield key, table

    def _with_shards(self, shard_ids: list[int]) -> ColumnarExamplesIterable:
        return ColumnarExamplesIterable(self.generate_batches, shard_ids, self.features, self.tensors, self.num_passes)

    def shuffle_data_sources(self, generator: np.random.Generator) -> ColumnarExamplesIterable:
        order = deepcopy(generator).permutation(len(self.shard_ids))
        return self._with_shards([self.shard_ids[i] for i in order])

    def shard_data_sources(self, num_shards: int, index: int, contiguous=True) -> ColumnarExamplesIterable:
        picked = self.split_shard_indices_by_worker(num_shards, index, contiguous=contiguous)
        return self._with_shards([self.shard_ids[i] for i in picked])

    def reshard_data_sources(self) -> ColumnarExamplesIterable:
        return self._with_shards(self.shard_ids)


class EpochSharingIterableDataset(IterableDataset):
    """A ``datasets.IterableDataset`` whose :meth:`set_epoch` also writes the shared ``epoch_counter``."""

    epoch_counter: torch.Tensor | None = None

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self.epoch_counter is not None:
            self.epoch_counter.fill_(int(epoch))
