"""``TorchRLBufferDataset``: a TorchRL replay buffer as a (Hugging Face) dataset for TRL,
wiring a buffer reader, a reading strategy, a sharding and the row columns."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any, Literal

import torch
from tensordict.utils import NestedKey

from .._checks import config_or_default, positive_int
from .columns import RowColumns
from .formats import BufferFormat
from .reading import (
    BufferReader, EpochPass, OnlineSampling, ReadingStrategy, check_strings_survive, reading_from_arguments,
)
from .sharding import Sharding, broadcast_length

__all__ = ["TorchRLBufferDataset"]


class TorchRLBufferDataset(torch.utils.data.IterableDataset):
    """A TorchRL :class:`~torchrl.data.ReplayBuffer` read as a dataset of flat dict rows.

    Every argument of upstream ``torchrl.modules.llm.trl_interop.TorchRLBufferDataset``
    works with the same meaning; everything after ``num_batches`` is new.

    Args:
        replay_buffer (ReplayBuffer): any TorchRL ``ReplayBuffer`` (LLM rollouts padded or ragged, dict rows).
        batch_size (int): rows per vectorised read (a ``sample`` call, or a chunk of the pass).

    Keyword Args:
        keys (list of NestedKey, optional): raw keys yielded as ``"a.b"`` columns, alone or beside the
            format's (e.g. ``["answer"]`` for GRPO's reward functions). Defaults to ``None``: every leaf key
            when ``format`` gives no column.
        device (torch.device or str, optional): tensors yielded by ``__iter__`` are moved there.
            Defaults to ``None``.
        num_batches (int or None, optional): ``sample`` calls per iterator (``None``:
            unbounded), as ``reading=OnlineSampling(num_batches)``. Defaults to ``1``.
        format (str, BufferFormat or RowColumns, optional): the trainer's columns: a registered format name
            (``"sft"``, ``"grpo_conversational"``, ...), a :class:`BufferFormat`, or a :class:`RowColumns`
            (with named columns, the storage index, a row filter). Defaults to ``None``.
        reading (str, EpochPass or OnlineSampling, optional): ``"online"`` (batches drawn by the buffer's
            sampler), ``"epoch"`` (each item stored when a pass starts read once; has ``__len__``), or an
            :class:`~torchrl_trl.data.OnlineSampling` / :class:`~torchrl_trl.data.EpochPass`. Defaults to
            ``None`` (``"online"``).
        sharding (Sharding, optional): shards of the Hugging Face iterable, ranks of ``__iter__``. Defaults to
            ``None`` (``Sharding()``).

    Yields:
        ``dict[str, Any]`` rows: Python values for the format's and named columns; raw keys keep upstream's
        types (tensors, non-tensor data).

    Two LLM rollouts as ``LLMCollector`` stores them, read once as TRL's tokenized SFT rows:

    >>> import torch
    >>> from tensordict import TensorDict, lazy_stack
    >>> from torchrl import torchrl_logger
    >>> from torchrl.data import LazyStackStorage, ReplayBuffer
    >>> from torchrl.modules.llm.policies import Text, Tokens
    >>> from torchrl_trl.data import TorchRLBufferDataset
    >>> torchrl_logger.setLevel("WARNING")
    >>> def rollout(prompt, response, prompt_ids, response_ids):
    ...     tokens = Tokens(prompt=torch.tensor(prompt_ids), response=torch.tensor(response_ids))
    ...     return TensorDict(text=Text(prompt=prompt, response=response), tokens=tokens)
    >>> rb = ReplayBuffer(storage=LazyStackStorage(8))
    >>> _ = rb.extend(lazy_stack([
    ...     rollout("2+2=", "4", [5, 6, 7], [8]), rollout("1+2=", "3", [4, 6], [9, 2])
    ... ]))
    >>> ds = TorchRLBufferDataset(rb, 2, format="sft_tokenized", reading="epoch")
    >>> next(iter(ds))
    {'input_ids': [5, 6, 7, 8], 'completion_mask': [0, 0, 0, 1]}
    >>> len(ds), ds.in_keys, ds.column_names
    (2, [('tokens', 'prompt'), ('tokens', 'response')], ['input_ids', 'completion_mask'])
    >>> hf = ds.as_hf_dataset()  # what a TRL trainer takes as train_dataset
    >>> [row["input_ids"] for row in hf]
    [[5, 6, 7, 8], [4, 6, 9, 2]]
    """

    def __init__(self, replay_buffer, batch_size: int, *, keys: Sequence[NestedKey] | None = None,
                 device: torch.device | str | None = None, num_batches: int | None = 1,
                 format: str | BufferFormat | RowColumns | None = None,
                 reading: Literal["online", "epoch"] | EpochPass | OnlineSampling | None = None,
                 sharding: Sharding | None = None) -> None:  # fmt: skip
        from torchrl.data.replay_buffers import ReplayBuffer

        name = type(self).__name__
        if not isinstance(replay_buffer, ReplayBuffer):
            got = type(replay_buffer).__name__
            raise TypeError(f"{name}: replay_buffer must be a torchrl ReplayBuffer instance, got {got}.")
        positive_int(batch_size, f"{name}: batch_size")
        positive_int(num_batches, f"{name}: num_batches", allow_none=True)
        self._reading: ReadingStrategy = reading_from_arguments(reading, num_batches=num_batches)
        self._sharding = config_or_default(sharding, Sharding, "sharding", name)
        rows = format if isinstance(format, RowColumns) else RowColumns(format)
        self._columns = rows.bind(keys=keys, device=device)
        self._reader = BufferReader(replay_buffer, batch_size)
        if len(replay_buffer) > 0:
            self._check()

    @property
    def replay_buffer(self):
        return self._reader.replay_buffer

    @property
    def reading(self) -> ReadingStrategy:
        """The reading strategy (:class:`EpochPass` or :class:`OnlineSampling`)."""
        return self._reading

    @property
    def sharding(self) -> Sharding:
        return self._sharding

    @property
    def mode(self) -> str:
        """``"epoch"`` or ``"online"``: the reading strategy's kind."""
        return self._reading.mode

    def _check(self) -> dict[str, list]:
        """The first stored rows' columns as Python values, after checking keys and format."""
        self._reader.require_items(whole_batch=self.mode == "epoch")  # an epoch pass reads whole batches
        peek = self._reader.fetch(torch.arange(min(len(self.replay_buffer), 2)))
        cols = self._columns.check(peek)
        check_strings_survive(self.replay_buffer, cols)
        return cols

    @property
    def in_keys(self) -> list[NestedKey]:
        """The nested keys read by name from each stored sample (not those a callable column reads)."""
        self._reader.require_items()
        return self._columns.in_keys(self._reader.fetch(torch.arange(1)))

    @cached_property
    def features(self):
        """``datasets.Features`` of the rows :meth:`as_hf_dataset` yields."""
        return self._columns.features(self._check())

    @property
    def column_names(self) -> list[str]:
        """The columns of each row, in order (as :attr:`features`)."""
        return list(self.features)

    out_keys = column_names

    def set_epoch(self, epoch: int) -> None:
        """The epoch mixed into the shuffle seed; with several ranks (call it on every rank) it also fixes
        the passes of ``epoch`` to the items rank 0 holds now."""
        self._reader.set_epoch(epoch)
        self._pin_for_ranks()

    def _pin_for_ranks(self) -> None:
        """With several ranks, epoch passes: fix this epoch's to rank 0's length now (every rank calls it)."""
        if isinstance(self._reading, EpochPass) and self._sharding.process()[1] > 1:
            self._reader.lengths.pin(self.epoch, broadcast_length(len(self.replay_buffer)))

    @property
    def epoch(self) -> int:
        return self._reader.epoch

    def __len__(self) -> int:
        """Epoch pass: ``num_passes * len(replay_buffer)`` times the rows of one stored item."""
        return self._reading.num_rows(self._reader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Rows for this DataLoader worker (and ``rank``): online its own ``num_batches`` batches, epoch the
        chunks of the pass dealt round-robin over (rank, worker)."""
        batches = self._reading.consumer_batches(
            self._reader, self._sharding.consumer(), rank=self._sharding.process()[0],
            with_index=self._columns.index_column is not None,
        )
        for batch, index in batches:
            yield from self._columns.rows(batch, python=False, index=index)

    def as_hf_dataset(self, *, map_style: bool = False, tensors: bool = False, **snapshot_kwargs):
        """A ``datasets.IterableDataset`` declaring :attr:`features`, made of the sharding's shards
        (``map_style=True``: :meth:`to_hf_dataset`); its ``set_epoch`` reaches this dataset. Rows hold Python
        values; ``tensors=True``: the tensor columns of ``keys``/``columns`` as 1-D tensors, as upstream.
        Epoch reading with several ranks: call it on every rank (it broadcasts rank 0's buffer length)."""
        if map_style:
            if tensors:
                raise TypeError("TorchRLBufferDataset.as_hf_dataset: tensors=True is for the iterable; use "
                            ".with_format('torch') on the map-style snapshot")
            return self.to_hf_dataset(**snapshot_kwargs)
        if snapshot_kwargs:
            raise TypeError(
                f"TorchRLBufferDataset.as_hf_dataset: {sorted(snapshot_kwargs)} apply with map_style=True only"
            )
        from .. import _compat
        from .arrow import ColumnarExamplesIterable, EpochSharingIterableDataset, HFBatches

        rank, world = self._sharding.process()
        k = self._sharding.shards(self._reading.shards_per_process, world)
        source = HFBatches(self._reader, self._reading, self._columns, k, rank=rank)
        examples = ColumnarExamplesIterable(source, list(range(k)), self.features, tensors, self._reading.num_passes)
        ds = _compat.iterable_dataset_from_examples(examples, self.features, cls=EpochSharingIterableDataset)
        ds.epoch_counter = self._reader.epoch_counter  # its set_epoch reaches this dataset
        self._pin_for_ranks()
        return ds

    def to_hf_dataset(self, *, cache_dir: str | None = None, keep_in_memory: bool = False,
                      writer_batch_size: int | None = None):
        """A map-style ``datasets.Dataset`` snapshot of one pass over what is stored now (the reading's order
        if an :class:`EpochPass`), under a fresh fingerprint (no hashing of the buffer, no stale cache)."""
        from datasets import Dataset

        from .arrow import HFBatches

        one_pass = self._reading if isinstance(self._reading, EpochPass) else EpochPass()
        reading = EpochPass(one_pass.shuffle, one_pass.seed, 1)
        gen = HFBatches(self._reader, reading, self._columns, 1).rows
        kwargs = {"writer_batch_size": writer_batch_size} if writer_batch_size is not None else {}
        return Dataset.from_generator(gen, features=self.features, gen_kwargs={"shard_ids": [0]}, cache_dir=cache_dir,
                                      keep_in_memory=keep_in_memory, fingerprint=f"torchrl_trl_{uuid.uuid4().hex}",
                                      **kwargs)

    def __repr__(self) -> str:
        c = self._columns
        return (
            f"{self.__class__.__name__}(replay_buffer={self.replay_buffer!r}, batch_size={self._reader.batch_size}, "
            f"keys={c.keys if c.keys is not None else '<all>'}, device={c.device}, "
            f"format={c.format.name if c.format is not None else None}, columns={list(c.columns)}, "
            f"reading={self._reading!r}, sharding={self._sharding!r})"
        )
