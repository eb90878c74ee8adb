"""A buffer dataset as Hugging Face ``datasets``: the streaming ``IterableDataset`` (one
shard per reading stream or slice of an epoch pass) and the map-style ``Dataset`` snapshot.

The rows come from :class:`HFBatches`, which asks the reading strategy
(:mod:`torchrl_trl.data.reading`) for batches and :class:`~.row_columns.RowColumns` for
their columns. This module imports ``datasets`` only inside its functions.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDictBase

from .buffer_reader import BufferReader
from .reading import EpochPass, ReadingStrategy
from .row_columns import RowColumns
from .sharding import Sharding

__all__ = ["HFBatches", "iterable_dataset", "snapshot"]


class HFBatches:
    """Picklable source of column batches for ``datasets``: ``gen(shard_ids)`` yields
    ``(key, {column: values})`` for the shards it is given (see :mod:`.arrow`).

    Args:
        reader: the buffer.
        reading: the reading strategy (how shards map to reads).
        columns: what each batch becomes.
        num_shards: the number of shards the iterable is made of.
        rank: this training process's rank (mixed into online sampling seeds).
        python: the column form (``"columnar"`` for the iterable, ``True`` for rows).
    """

    def __init__(self, reader: BufferReader, reading: ReadingStrategy, columns: RowColumns, num_shards: int,
                 rank: int = 0, python: bool | str = "columnar") -> None:
        self.reader = reader
        self.reading = reading
        self.columns = columns
        self.num_shards = num_shards
        self.rank = rank
        self.python = python

    def start_pass(self, pass_index: int, first: bool) -> dict[str, Any]:
        """Called once per pass of one iteration, before its shards are read (an epoch pass
        takes its length here, so every shard reads the same items)."""
        return self.reading.start_pass(self.reader, pass_index, first)

    def batches(self, shard_ids: list[int], pass_index: int = 0,
                length: int | None = None) -> Iterator[tuple[str, TensorDictBase, torch.Tensor | None]]:
        return self.reading.shard_batches(
            self.reader, shard_ids, self.num_shards, rank=self.rank,
            with_index=self.columns.index_column is not None, pass_index=pass_index, length=length,
        )

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
    """A ``datasets.IterableDataset`` declaring ``features``, made of ``sharding``'s shards
    (default: ``reading.shards_per_process`` per training process); ``set_epoch`` on it
    reaches ``reader``'s epoch counter."""
    from .arrow import make_iterable_dataset

    rank, world = sharding.process()
    k = sharding.shards(reading.shards_per_process, world)
    source = HFBatches(reader, reading, columns, k, rank=rank)
    return make_iterable_dataset(source, list(range(k)), features, tensors=tensors, num_passes=reading.passes,
                                 epoch_counter=reader.epoch_counter)


def snapshot(reader: BufferReader, reading: ReadingStrategy, columns: RowColumns, features, *,
             cache_dir: str | None = None, keep_in_memory: bool = False, writer_batch_size: int | None = None):
    """A map-style ``datasets.Dataset``: one pass over what is stored now (in the epoch
    order of ``reading`` if it is an :class:`EpochPass`, else storage order), written to
    Arrow in chunks by ``datasets.Dataset.from_generator`` under a fresh fingerprint (so
    ``datasets`` neither hashes the generator, which would pickle the whole buffer, nor
    reuses a stale cache)."""
    from datasets import Dataset

    one_pass = reading if isinstance(reading, EpochPass) else EpochPass()
    gen = HFBatches(reader, EpochPass(one_pass.shuffle, one_pass.seed, 1), columns, 1, python=True).rows
    kwargs = {"writer_batch_size": writer_batch_size} if writer_batch_size is not None else {}
    return Dataset.from_generator(
        gen, features=features, gen_kwargs={"shard_ids": [0]}, cache_dir=cache_dir,
        keep_in_memory=keep_in_memory, fingerprint=f"torchrl_trl_{uuid.uuid4().hex}", **kwargs,
    )
