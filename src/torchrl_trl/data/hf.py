"""A buffer dataset as Hugging Face ``datasets``: the streaming ``IterableDataset`` and the
map-style ``Dataset`` snapshot (``datasets`` imported only inside functions)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .columns import RowColumns
from .reading import BufferReader, EpochPass, KeyedBatch, ReadingStrategy
from .sharding import Sharding

__all__ = ["HFBatches", "iterable_dataset", "snapshot"]


@dataclass(eq=False)
class HFBatches:
    """Picklable source of column batches: ``self(shard_ids)`` yields ``(key, {column: values})``
    (``python``: their form, see :meth:`RowColumns.convert`); ``rank`` is mixed into seeds."""

    reader: BufferReader
    reading: ReadingStrategy
    columns: RowColumns
    num_shards: int
    rank: int = 0
    python: bool | str = "columnar"

    def start_pass(self, pass_index: int, first: bool) -> dict[str, Any]:
        """Called once per pass, before its shards are read."""
        return self.reading.start_pass(self.reader, pass_index, first)

    def batches(self, shard_ids: list[int], pass_index: int = 0, length: int | None = None) -> Iterator[KeyedBatch]:
        return self.reading.shard_batches(self.reader, shard_ids, self.num_shards, rank=self.rank, length=length,
                                          with_index=self.columns.index_column is not None, pass_index=pass_index)

    def __call__(self, shard_ids: list[int], pass_index: int = 0,
                 length: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        for key, batch, index in self.batches(shard_ids, pass_index, length):
            cols = self.columns.of_batch(batch, self.python, index)
            if cols is not None:
                yield key, cols

    def rows(self, shard_ids: list[int]) -> Iterator[dict[str, Any]]:
        """Python rows (``from_generator``'s protocol, for the map-style snapshot)."""
        for _, batch, index in self.batches(shard_ids):
            yield from self.columns.rows(batch, True, index)


def iterable_dataset(reader: BufferReader, reading: ReadingStrategy, columns: RowColumns, sharding: Sharding,
                     features, *, tensors: bool = False):
    """A ``datasets.IterableDataset`` declaring ``features``, made of ``sharding``'s shards (``tensors``:
    tensor columns as 1-row tensor views); its ``set_epoch`` writes ``reader.epoch_counter``."""
    from .. import _compat
    from .arrow import ColumnarExamplesIterable, EpochSharingIterableDataset

    rank, world = sharding.process()
    k = sharding.shards(reading.shards_per_process, world)
    source = HFBatches(reader, reading, columns, k, rank=rank)
    examples = ColumnarExamplesIterable(source, list(range(k)), features, tensors, reading.num_passes)
    ds = _compat.iterable_dataset_from_examples(examples, features, cls=EpochSharingIterableDataset)
    ds.epoch_counter = reader.epoch_counter
    return ds


def snapshot(reader: BufferReader, reading: ReadingStrategy, columns: RowColumns, features, *,
             cache_dir: str | None = None, keep_in_memory: bool = False, writer_batch_size: int | None = None):
    """A map-style ``datasets.Dataset`` of one pass over what is stored now (``reading``'s order
    if an :class:`EpochPass`), under a fresh fingerprint (no hashing of the buffer, no stale cache)."""
    from datasets import Dataset

    one_pass = reading if isinstance(reading, EpochPass) else EpochPass()
    gen = HFBatches(reader, EpochPass(one_pass.shuffle, one_pass.seed, 1), columns, 1, python=True).rows
    kwargs = {"writer_batch_size": writer_batch_size} if writer_batch_size is not None else {}
    fingerprint = f"torchrl_trl_{uuid.uuid4().hex}"
    return Dataset.from_generator(gen, features=features, gen_kwargs={"shard_ids": [0]}, cache_dir=cache_dir,
                                  keep_in_memory=keep_in_memory, fingerprint=fingerprint, **kwargs)
