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

from .._checks import moved_keywords, positive_int
from . import hf
from .buffer_reader import BufferReader, check_strings_survive
from .columns import ColumnSpec
from .formats import BufferFormat
from .reading import EpochPass, OnlineSampling, ReadingStrategy, reading_from_arguments
from .row_columns import RowColumns
from .sharding import Sharding

__all__ = ["TorchRLBufferDataset"]

_READING_KEYWORDS = ("mode", "shuffle", "seed", "num_passes")
#: keywords that moved into ``reading=`` / ``sharding=``, and where they went
_MOVED = {
    "mode": "pass reading='epoch' or reading='online' (or an EpochPass / OnlineSampling)",
    "shuffle": "pass reading=EpochPass(shuffle=...)",
    "seed": "pass reading=EpochPass(seed=...) or reading=OnlineSampling(seed=...)",
    "num_passes": "pass reading=EpochPass(num_passes=...)",
    "num_shards": "pass sharding=Sharding(num_shards=...)",
    "rank": "pass sharding=Sharding(rank=..., world_size=...)",
    "world_size": "pass sharding=Sharding(rank=..., world_size=...)",
}


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
        num_batches: online sampling: ``sample`` calls per iterator (``None``: unbounded),
            as ``reading=OnlineSampling(num_batches)``.
        format: a registered format name (``"sft"``, ``"grpo_conversational"``, ...: see
            :func:`~torchrl_trl.data.available_formats`) or a :class:`BufferFormat`.
        columns: ``{trl_column: spec}`` with ``spec`` a nested key (``"a.b"`` or tuple) or
            ``fn(batch) -> list`` (one value per row of the sampled batch).
        extra_columns: keys yielded alongside the format's columns under their flat name
            (e.g. ``["answer"]`` for a GRPO reward function), or a ``{name: key}`` dict.
        reading: ``"online"`` (default: ``num_batches`` batches drawn by the buffer's
            sampler), ``"epoch"`` (each item stored when a pass starts read once; has
            ``__len__`` and ``set_epoch``), or the same with settings:
            :class:`~torchrl_trl.data.OnlineSampling` (``num_batches``, ``seed``) or
            :class:`~torchrl_trl.data.EpochPass` (``shuffle``, ``seed``, ``num_passes``; also
            beside a live writer, see ``docs/source/distributed_dataset.md``).
        sharding: a :class:`~torchrl_trl.data.Sharding`: the Hugging Face iterable's
            ``num_shards`` (default: epoch ``4 * world_size``, online ``world_size``), and
            ``rank``/``world_size`` to split ``__iter__``'s epoch pass over processes (a
            plain ``DataLoader`` under ``torch.distributed``; leave them unset when a
            trainer shards, as it does for :meth:`as_hf_dataset`).
        sample_filter: ``fn(batch) -> bool tensor [B]`` (one value per row, ``B`` the
            product of the batch's dims): rows where it is ``False`` are not yielded (e.g.
            :class:`torchrl_trl.online.StalenessFilter`, which counts what it drops). An
            epoch pass then yields fewer than ``len(self)`` rows. Another dtype or number
            of values raises.
        index_column: yield each row's storage index (an int) under this column name, so
            the trainer can hand it back (e.g. to
            :func:`torchrl_trl.online.update_priorities`); needs
            ``remove_unused_columns=False`` in the trainer's config.
        tokenizer: the policy's tokenizer, optional; only its pad string is used, to remove
            the padding TorchRL's history mode with ``pad_output=True`` decodes into
            ``text``/``history`` where the samples do not show it (see
            :func:`torchrl_trl.layouts.read_text`).

    Moved keywords (they work for one more release, with a ``DeprecationWarning``):
    ``mode``, ``shuffle``, ``seed``, ``num_passes`` (into ``reading=``) and ``num_shards``,
    ``rank``, ``world_size`` (into ``sharding=``).

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
        reading: Literal["online", "epoch"] | EpochPass | OnlineSampling | None = None,
        sharding: Sharding | None = None,
        sample_filter: Callable[[TensorDictBase], torch.Tensor] | None = None,
        index_column: str | None = None,
        tokenizer: Any = None,
        **moved,
    ) -> None:
        from torchrl.data.replay_buffers import ReplayBuffer

        moved = moved_keywords("TorchRLBufferDataset", moved, _MOVED)
        if not isinstance(replay_buffer, ReplayBuffer):
            raise TypeError(
                "replay_buffer must be a torchrl ReplayBuffer instance, got "
                f"{type(replay_buffer).__name__}."
            )
        positive_int(batch_size, "batch_size")
        positive_int(num_batches, "num_batches", allow_none=True)
        shorthands = {k: moved.pop(k) for k in _READING_KEYWORDS if k in moved}
        self._reading: ReadingStrategy = reading_from_arguments(
            reading, num_batches=num_batches, **shorthands
        )
        self._sharding = _sharding(sharding, moved)  # what is left: num_shards, rank, world_size
        # a string, not the tokenizer: cheap to send to DataLoader workers
        pad_text = None
        if tokenizer is not None:
            pad_text = tokenizer.decode([tokenizer.pad_token_id], skip_special_tokens=False)
        self._columns = RowColumns(
            keys=keys, format=format, columns=columns, extra_columns=extra_columns,
            sample_filter=sample_filter, index_column=index_column, device=device,
            pad_text=pad_text,
        )  # fmt: skip
        self._reader = BufferReader(replay_buffer, batch_size)
        self._features = None
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

    def as_hf_dataset(self, *, map_style: bool = False, tensors: bool = False, **snapshot_kwargs):
        """A ``datasets.IterableDataset`` declaring :attr:`features` (``map_style=True``:
        :meth:`to_hf_dataset`).

        Rows hold Python values (lists for token columns), what TRL's per-row dataset
        preparation (e.g. ``SFTTrainer``'s) reads fastest; ``tensors=True`` yields tensor and
        token columns as 1-D tensors (as upstream), cheaper for a collator fed directly and
        slower through per-row ``map`` functions.

        It is made of the sharding's shards: accelerate gives each rank its own (rank 0 all
        of them with ``dispatch_batches=True``) and ``datasets`` splits a rank's over its
        DataLoader workers, so an epoch pass is read exactly once either way; online, each
        shard is its own sampling stream. Its ``set_epoch`` reaches this dataset. Epoch
        reading under ``torch.distributed``: call it on every rank (it broadcasts rank 0's
        buffer length, which the first epoch's passes then read).
        """
        if map_style:
            if tensors:
                raise TypeError(
                    "tensors=True is for the iterable; use .with_format('torch') on the snapshot"
                )
            return self.to_hf_dataset(**snapshot_kwargs)
        if snapshot_kwargs:
            raise TypeError(
                f"unexpected arguments {sorted(snapshot_kwargs)} (only with map_style=True)"
            )
        features = self.features
        ds = hf.iterable_dataset(
            self._reader, self._reading, self._columns, self._sharding, features, tensors=tensors
        )
        self._pin_for_ranks()
        return ds

    def to_hf_dataset(self, *, cache_dir: str | None = None, keep_in_memory: bool = False,
                      writer_batch_size: int | None = None):
        """A map-style ``datasets.Dataset`` snapshot: one pass over what is stored now (in
        the epoch order), written to Arrow in chunks, so memory does not grow with the
        buffer (unless ``keep_in_memory``)."""
        return hf.snapshot(
            self._reader, self._reading, self._columns, self.features, cache_dir=cache_dir,
            keep_in_memory=keep_in_memory, writer_batch_size=writer_batch_size,
        )  # fmt: skip

    def __repr__(self) -> str:
        c = self._columns
        return (
            f"{self.__class__.__name__}(replay_buffer={self.replay_buffer!r}, "
            f"batch_size={self._reader.batch_size}, "
            f"keys={c.keys if c.keys is not None else '<all>'}, "
            f"device={c.device}, format={c.format.name if c.format is not None else None}, "
            f"columns={list(c.columns)}, reading={self._reading!r}, sharding={self._sharding!r})"
        )


def _sharding(sharding: Sharding | None, moved: dict[str, Any]) -> Sharding:
    """``sharding``, or the one the moved ``num_shards``/``rank``/``world_size`` make."""
    if sharding is None:
        return Sharding(**moved)
    if not isinstance(sharding, Sharding):
        raise TypeError(
            f"sharding must be a torchrl_trl.data.Sharding, got {type(sharding).__name__}"
        )
    if moved:
        raise TypeError(f"pass {sorted(moved)} inside sharding={sharding!r}, not beside it")
    return sharding
