"""``TorchRLBufferDataset``: a TorchRL replay buffer as a (Hugging Face) dataset for TRL.

A drop-in superset of ``torchrl.modules.llm.trl_interop.TorchRLBufferDataset``. The class
wires four pieces, each in its own module: :class:`~.buffer_reader.BufferReader` (reads
the buffer), a reading strategy (:mod:`.reading`: which rows, in which order),
:class:`~.sharding.Sharding` (who reads which part) and :class:`~.row_columns.RowColumns`
(what a batch of rows becomes); :mod:`.hf` builds the Hugging Face datasets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from .._checks import positive_int
from . import hf
from .buffer_reader import BufferReader, check_strings_survive
from .columns import ColumnSpec
from .formats import BufferFormat
from .reading import EpochPass, OnlineSampling, ReadingStrategy, reading_from_arguments
from .row_columns import RowColumns
from .sharding import Sharding

__all__ = ["TorchRLBufferDataset"]

Mode = Literal["online", "epoch"]


class TorchRLBufferDataset(torch.utils.data.IterableDataset):
    """A TorchRL :class:`~torchrl.data.ReplayBuffer` read as a dataset of flat dict rows.

    Every argument of upstream ``torchrl.modules.llm.trl_interop.TorchRLBufferDataset``
    works with the same meaning; everything after ``num_batches`` is new.

    Args:
        replay_buffer: any TorchRL ``ReplayBuffer`` (``LazyTensorStorage``,
            ``LazyMemmapStorage``, ``ListStorage`` of TensorDicts or plain dicts,
            ``LazyStackStorage`` of LLM rollouts, padded or ragged).
        batch_size: rows read from the buffer per vectorised read (online: per
            ``sample`` call; epoch: per chunk of the pass).

    Keyword Args:
        keys: raw keys to yield, flattened to ``"a.b"`` column names. Without ``keys``,
            ``format`` and ``columns``, all leaf keys are yielded (as upstream). A key the
            samples lack raises ``KeyError`` (upstream warns and drops it).
        device: tensors yielded by ``__iter__`` are moved there.
        num_batches: online sampling: ``sample`` calls per iterator (``None``: unbounded);
            shorthand for ``reading=OnlineSampling(num_batches, seed)``.
        format: a registered format name (``"sft"``, ``"sft_conversational"``,
            ``"sft_messages"``, ``"sft_tokenized"``, ``"grpo"``, ``"grpo_conversational"``,
            see :mod:`torchrl_trl.data.formats`) or a :class:`BufferFormat`.
        columns: ``{trl_column: spec}`` with ``spec`` a nested key (``"a.b"`` or tuple) or
            ``fn(batch) -> list`` (one value per row of the sampled batch).
        extra_columns: keys yielded alongside the format's columns under their flat name
            (e.g. ``["answer"]`` for a GRPO reward function), or a ``{name: key}`` dict.
        reading: the reading strategy: :class:`~torchrl_trl.data.EpochPass` (each item
            stored when a pass starts read exactly once per pass; ``shuffle``, ``seed``,
            ``num_passes``; ``__len__``, ``set_epoch``; also while a collector keeps
            writing, see ``docs/source/distributed_dataset.md``) or
            :class:`~torchrl_trl.data.OnlineSampling` (``num_batches`` batches drawn by
            the buffer's sampler; ``seed`` of the sampling streams). Default: built from
            the shorthands below (online sampling unless ``mode="epoch"``); with
            ``reading`` given, they must stay unset.
        mode: shorthand: ``"online"`` (default) or ``"epoch"``.
        shuffle, seed, num_passes: shorthands for ``EpochPass(shuffle, seed, num_passes)``
            with ``mode="epoch"``; ``seed`` alone for ``OnlineSampling(num_batches, seed)``
            otherwise. ``shuffle``/``num_passes`` with online sampling, and
            ``num_batches`` with an epoch pass, raise ``ValueError``.
        num_shards: shards of the Hugging Face iterable (default: epoch ``4 * world_size``,
            online ``world_size``); ranks and DataLoader workers split them.
        rank, world_size: ``__iter__`` only: also split an epoch pass over processes (for
            a plain ``DataLoader`` under ``torch.distributed``). Leave unset when a trainer
            (accelerate) shards, as it does for :meth:`as_hf_dataset`. (These three make a
            :class:`~torchrl_trl.data.sharding.Sharding`.)
        sample_filter: ``fn(batch) -> bool tensor [B]`` (one value per row, ``B`` the
            product of the batch's dims): rows where it is ``False`` are not yielded (e.g.
            :class:`torchrl_trl.online.StalenessFilter`, which counts what it drops). An
            epoch pass then yields fewer than ``len(self)`` rows. Another dtype or number
            of values raises.
        index_column: yield each row's storage index (an int) under this column name, so
            the trainer can hand it back (e.g. to
            :func:`torchrl_trl.online.update_priorities`); needs
            ``remove_unused_columns=False`` in the trainer's config.
        tokenizer: the policy's tokenizer, optional. Only its pad token is used: TorchRL's
            history mode with ``pad_output=True`` decodes the padded sequence into
            ``text``/``history``, and the pad string is removed from the rows; it is read
            off the samples when they show it, and this names it when they do not (see
            :func:`torchrl_trl.layouts.read_text`).

    Yields:
        ``dict[str, Any]`` rows: for ``format``/``columns`` Python values (str, lists of
        ints, role/content dicts); raw keys keep upstream's types (tensors, unwrapped
        non-tensor data). ``tokens.<part>`` keys yield only the real (unpadded) tokens.

    :attr:`in_keys` are the keys read from each sample, :attr:`column_names` (also
    ``out_keys``) and :attr:`features` what each row holds.

    Example: two TorchRL LLM rollouts (``Text`` and ``Tokens``, as ``LLMCollector`` stores
    them) in a ``LazyStackStorage``, read once as TRL's tokenized SFT rows:

    >>> import torch
    >>> from tensordict import TensorDict, lazy_stack
    >>> from torchrl import torchrl_logger
    >>> from torchrl.data import LazyStackStorage, ReplayBuffer
    >>> from torchrl.modules.llm.policies import Text, Tokens
    >>> from torchrl_trl.data import EpochPass, TorchRLBufferDataset
    >>> torchrl_logger.setLevel("WARNING")
    >>> def rollout(prompt, response, prompt_ids, response_ids):
    ...     return TensorDict(text=Text(prompt=prompt, response=response),
    ...                       tokens=Tokens(prompt=torch.tensor(prompt_ids), response=torch.tensor(response_ids)))
    >>> rb = ReplayBuffer(storage=LazyStackStorage(8))
    >>> _ = rb.extend(lazy_stack([rollout("2+2=", "4", [5, 6, 7], [8]), rollout("1+2=", "3", [4, 6], [9, 2])]))
    >>> ds = TorchRLBufferDataset(rb, 2, format="sft_tokenized", reading=EpochPass())
    >>> next(iter(ds))
    {'input_ids': [5, 6, 7, 8], 'completion_mask': [0, 0, 0, 1]}
    >>> len(ds), ds.in_keys, ds.column_names
    (2, [('tokens', 'prompt'), ('tokens', 'response')], ['input_ids', 'completion_mask'])
    >>> hf = ds.as_hf_dataset()  # what a TRL trainer takes as train_dataset
    >>> [row["input_ids"] for row in hf]
    [[5, 6, 7, 8], [4, 6, 9, 2]]
    """

    def __init__(
        self,
        replay_buffer,
        batch_size: int,
        *,
        keys: Sequence[NestedKey] | None = None,
        device: torch.device | str | None = None,
        num_batches: int | None = 1,
        format: str | BufferFormat | None = None,
        columns: Mapping[str, ColumnSpec] | None = None,
        extra_columns: Sequence[NestedKey] | Mapping[str, NestedKey] | None = None,
        reading: EpochPass | OnlineSampling | None = None,
        mode: Mode | None = None,
        shuffle: bool = False,
        seed: int | None = None,
        num_shards: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        sample_filter: Callable[[TensorDictBase], torch.Tensor] | None = None,
        index_column: str | None = None,
        num_passes: int | None = 1,
        tokenizer: Any = None,
    ) -> None:
        from torchrl.data.replay_buffers import ReplayBuffer

        if not isinstance(replay_buffer, ReplayBuffer):
            raise TypeError(
                f"replay_buffer must be a torchrl ReplayBuffer instance, got {type(replay_buffer).__name__}."
            )
        positive_int(batch_size, "batch_size")
        positive_int(num_batches, "num_batches", allow_none=True)
        self._reading: ReadingStrategy = reading_from_arguments(
            reading, mode=mode, shuffle=shuffle, seed=seed, num_passes=num_passes, num_batches=num_batches,
        )
        self._sharding = Sharding(num_shards, rank, world_size)
        # a string, not the tokenizer: cheap to send to DataLoader workers
        pad_text = None if tokenizer is None else tokenizer.decode([tokenizer.pad_token_id], skip_special_tokens=False)
        self._columns = RowColumns(
            keys=keys, format=format, columns=columns, extra_columns=extra_columns, sample_filter=sample_filter,
            index_column=index_column, device=device, pad_text=pad_text,
        )
        self._reader = BufferReader(replay_buffer, batch_size)
        self._features = None
        if len(replay_buffer) > 0:
            self._check()

    # ------------------------------------------------------------------
    # The pieces
    # ------------------------------------------------------------------

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
        """Check keys/format on the first stored rows (no sampler state consumed) and
        return their columns as Python values."""
        self._reading.check(self._reader)
        peek = self._reader.fetch(torch.arange(min(len(self.replay_buffer), 2)))
        cols = self._columns.check(peek, python=True)
        check_strings_survive(self.replay_buffer, cols)
        return cols

    @property
    def in_keys(self) -> list[NestedKey]:
        """The nested keys read from each stored sample by name: ``keys`` (every leaf key
        when nothing else is asked for), the format's required keys and the keys of
        ``columns``/``extra_columns`` (a callable column reads what it reads)."""
        self._reader.require_items()
        return self._columns.in_keys(self._reader.fetch(torch.arange(1)))

    @property
    def features(self):
        """``datasets.Features`` of the rows :meth:`as_hf_dataset` yields."""
        if self._features is None:
            self._features = self._columns.features(self._check())
        return self._features

    @property
    def column_names(self) -> list[str]:
        """The columns of each row, in order (as :attr:`features`)."""
        return list(self.features)

    out_keys = column_names

    # ------------------------------------------------------------------
    # Epochs
    # ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Epoch pass: the pass number mixed into the shuffle seed (the trainer calls
        this on the Hugging Face iterable from :meth:`as_hf_dataset`, which forwards it).

        Under ``torch.distributed`` with several ranks (then call it on every rank: it
        broadcasts), it also fixes the passes of ``epoch`` to the items rank 0 holds now, so
        every rank reads the same items beside a live writer."""
        self._reader.set_epoch(epoch)
        self._pin_for_ranks()

    def _pin_for_ranks(self) -> None:
        if isinstance(self._reading, EpochPass):
            self._reader.pin_for_ranks(self._sharding.process()[1])

    @property
    def epoch(self) -> int:
        return self._reader.epoch

    def __len__(self) -> int:
        """Epoch pass: rows one iterator yields if nothing is written meanwhile
        (``num_passes * len(replay_buffer)`` times the rows of one stored item, e.g. ``G``
        for items of batch shape ``[G]``), before ``sample_filter``."""
        return self._reading.num_rows(self._reader)

    # ------------------------------------------------------------------
    # torch IterableDataset protocol
    # ------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Rows for this DataLoader worker (and ``rank``, when given).

        Online: each worker draws ``num_batches`` batches from its own random stream.
        Epoch: the pass's chunks of ``batch_size`` are dealt round-robin over
        (rank, worker), so together they read every item once.
        """
        batches = self._reading.consumer_batches(
            self._reader, self._sharding.consumer(), rank=self._sharding.process()[0],
            with_index=self._columns.index_column is not None,
        )
        for batch, index in batches:
            yield from self._columns.rows(batch, python=False, index=index)

    # ------------------------------------------------------------------
    # Hugging Face datasets
    # ------------------------------------------------------------------

    def as_hf_dataset(self, *, map_style: bool = False, tensors: bool = False, **snapshot_kwargs):
        """A ``datasets.IterableDataset`` (``map_style=True``: :meth:`to_hf_dataset`).

        Rows hold Python values matching :attr:`features` (lists for token columns), what
        TRL's per-row dataset preparation (e.g. ``SFTTrainer``'s label building) reads
        fastest. ``tensors=True`` yields tensor and token columns as 1-D tensors instead
        (as upstream does): about 4x cheaper for TRL's collator (``torch.tensor`` of a
        Python list dominates it) when rows go straight to the collator, but slower through
        per-row ``map`` functions that loop over tokens.

        It declares :attr:`features` and is made of ``num_shards`` shards, so under
        several processes accelerate (``dataloader.dispatch_batches=False``, which
        ``SFTTrainer`` forces) gives each rank its own shards, ``datasets`` splits a
        rank's shards over its DataLoader workers, and with ``dispatch_batches=True``
        rank 0 reads all of them: an epoch pass is read exactly once in each case.
        Online, shard ``s`` is an independent sampling stream (``num_batches`` split
        over the shards). Its ``set_epoch`` (what the trainer calls) reaches this dataset.

        Epoch mode under ``torch.distributed`` with several ranks: call it on every rank
        (it broadcasts rank 0's buffer length, which the first epoch's passes then read).
        """
        if map_style:
            if tensors:
                raise TypeError("tensors=True is for the iterable; use .with_format('torch') on the snapshot")
            return self.to_hf_dataset(**snapshot_kwargs)
        if snapshot_kwargs:
            raise TypeError(f"unexpected arguments {sorted(snapshot_kwargs)} (only with map_style=True)")
        features = self.features
        ds = hf.iterable_dataset(self._reader, self._reading, self._columns, self._sharding, features,
                                 tensors=tensors)
        self._pin_for_ranks()
        return ds

    def to_hf_dataset(self, *, cache_dir: str | None = None, keep_in_memory: bool = False,
                      writer_batch_size: int | None = None):
        """A map-style ``datasets.Dataset`` snapshot: one pass over what is stored now (in
        the epoch order), written to Arrow in chunks, so memory does not grow with the
        buffer (unless ``keep_in_memory``)."""
        return hf.snapshot(self._reader, self._reading, self._columns, self.features, cache_dir=cache_dir,
                           keep_in_memory=keep_in_memory, writer_batch_size=writer_batch_size)

    def __repr__(self) -> str:
        c = self._columns
        return (
            f"{self.__class__.__name__}(replay_buffer={self.replay_buffer!r}, "
            f"batch_size={self._reader.batch_size}, keys={c.keys if c.keys is not None else '<all>'}, "
            f"device={c.device}, format={c.format.name if c.format is not None else None}, "
            f"columns={list(c.columns)}, reading={self._reading!r}, sharding={self._sharding!r})"
        )
