"""``TorchRLBufferDataset``: a TorchRL replay buffer as a (Hugging Face) dataset for TRL.

A drop-in superset of ``torchrl.modules.llm.trl_interop.TorchRLBufferDataset``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict import is_tensor_collection
from tensordict.utils import NestedKey

from .. import layouts
from . import sharding
from .columns import (
    ColumnSpec, column_name, leaf_keys, missing_key_error, read_key, read_key_columnar, to_nested_key,
)
from .features import infer_feature
from .formats import BufferFormat, check_format, get_format

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
        num_batches: online mode: ``sample`` calls per iterator (``None``: unbounded).
        format: a registered format name (``"sft"``, ``"sft_conversational"``,
            ``"sft_messages"``, ``"sft_tokenized"``, ``"grpo"``, ``"grpo_conversational"``,
            see :mod:`torchrl_trl.data.formats`) or a :class:`BufferFormat`.
        columns: ``{trl_column: spec}`` with ``spec`` a nested key (``"a.b"`` or tuple) or
            ``fn(batch) -> list`` (one value per row of the sampled batch).
        extra_columns: keys yielded alongside the format's columns under their flat name
            (e.g. ``["answer"]`` for a GRPO reward function), or a ``{name: key}`` dict.
        mode: ``"online"`` samples with the buffer's own sampler; ``"epoch"`` reads each
            item stored when a pass starts exactly once (``__len__``, ``set_epoch``), also
            while a collector keeps writing: one length per pass, shared by every shard
            and DataLoader worker (see ``docs/source/distributed_dataset.md``).
        shuffle: epoch mode: visit items in a random order drawn from ``(seed, epoch)``.
            Online mode samples with the buffer's own sampler (e.g. TorchRL's
            ``RandomSampler``), so ``shuffle=True`` there raises ``ValueError``.
        seed: epoch mode: the shuffle seed (default 0; must be equal on every rank).
            Online mode: base seed of the per-rank/per-worker sampling streams (default:
            ``torch.initial_seed()``; the rank is always mixed in).
        num_shards: shards of the Hugging Face iterable (default: epoch ``4 * world_size``,
            online ``world_size``); ranks and DataLoader workers split them.
        rank, world_size: ``__iter__`` only: also split an epoch pass over processes (for
            a plain ``DataLoader`` under ``torch.distributed``). Leave unset when a trainer
            (accelerate) shards, as it does for :meth:`as_hf_dataset`.
        sample_filter: ``fn(batch) -> bool tensor [B]`` (one value per row, ``B`` the
            product of the batch's dims): rows where it is ``False`` are not yielded (e.g.
            :class:`torchrl_trl.online.StalenessFilter`, which counts what it drops). An
            epoch pass then yields fewer than ``len(self)`` rows. Another dtype or number
            of values raises.
        index_column: yield each row's storage index (an int) under this column name, so
            the trainer can hand it back (e.g. to
            :func:`torchrl_trl.online.update_priorities`); needs
            ``remove_unused_columns=False`` in the trainer's config.
        num_passes: epoch mode: passes over the buffer one iterator makes, pass ``k``
            shuffled with epoch ``epoch + k`` (default 1; ``None``: endless). With a trainer
            driven by ``max_steps``, ``None`` makes its whole run one Transformers "epoch",
            so resuming from a checkpoint skips exactly the batches already trained, also
            after the first pass (with 1, Transformers counts ``max_steps`` batches per
            epoch and a resume after the first pass restarts at the next pass).
        tokenizer: the policy's tokenizer, optional. Only its pad token is used: TorchRL's
            history mode with ``pad_output=True`` decodes the padded sequence into
            ``text``/``history``, and the pad string is removed from the rows; it is read
            off the samples when they show it, and this names it when they do not (see
            :func:`torchrl_trl.layouts.read_text`).

    Yields:
        ``dict[str, Any]`` rows: for ``format``/``columns`` Python values (str, lists of
        ints, role/content dicts); raw keys keep upstream's types (tensors, unwrapped
        non-tensor data). ``tokens.<part>`` keys yield only the real (unpadded) tokens.
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
        mode: Mode = "online",
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
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        if num_batches is not None and (
            isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches <= 0
        ):
            raise ValueError(f"num_batches must be a positive integer or None, got {num_batches!r}.")
        if mode not in ("online", "epoch"):
            raise ValueError(f"mode must be 'online' or 'epoch', got {mode!r}.")
        if shuffle and mode == "online":
            raise ValueError(
                "shuffle=True is for mode='epoch' (a permuted pass over the stored items); "
                "mode='online' draws rows with the replay buffer's own sampler (give the buffer "
                "a RandomSampler to sample at random)."
            )
        if sample_filter is not None and not callable(sample_filter):
            raise TypeError(f"sample_filter must be callable, got {type(sample_filter).__name__}.")
        if num_shards is not None and (not isinstance(num_shards, int) or num_shards <= 0):
            raise ValueError(f"num_shards must be a positive integer or None, got {num_shards!r}.")
        if num_passes is not None and (
            isinstance(num_passes, bool) or not isinstance(num_passes, int) or num_passes <= 0
        ):
            raise ValueError(f"num_passes must be a positive integer or None, got {num_passes!r}.")
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither.")
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
        self._replay_buffer = replay_buffer
        self._batch_size = batch_size
        self._keys = None if keys is None else [to_nested_key(k) for k in keys]
        self._device = torch.device(device) if device is not None else None
        self._num_batches = num_batches
        self._format = get_format(format) if format is not None else None
        self._columns: dict[str, ColumnSpec] = {}
        for name, spec in (columns or {}).items():
            self._columns[name] = spec if callable(spec) else to_nested_key(spec)
        if isinstance(extra_columns, Mapping):
            extra = {name: to_nested_key(k) for name, k in extra_columns.items()}
        else:
            extra = {column_name(to_nested_key(k)): to_nested_key(k) for k in (extra_columns or [])}
        self._columns.update(extra)
        self._mode = mode
        self._shuffle = shuffle
        self._seed = seed
        self._num_shards = num_shards
        self._rank, self._world_size = rank, world_size
        self._sample_filter = sample_filter
        self._index_column = index_column
        self._num_passes = num_passes
        # a string, not the tokenizer: cheap to send to DataLoader workers
        self._pad_text = (
            None if tokenizer is None else tokenizer.decode([tokenizer.pad_token_id], skip_special_tokens=False)
        )
        # shared memory, so DataLoader workers and the HF iterable see set_epoch()
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._lengths = sharding.PassLengths()  # the items each epoch pass reads
        sharding.guard_fork(replay_buffer)  # DataLoader workers forked beside a writer thread
        self._item_rows: int | None = None
        self._passes = 0
        self._features = None
        self._python_rows: bool | None = None
        if len(replay_buffer) > 0:
            self._check(python=True)

    # ------------------------------------------------------------------
    # Reading the buffer
    # ------------------------------------------------------------------

    @property
    def replay_buffer(self):
        return self._replay_buffer

    @property
    def mode(self) -> str:
        return self._mode

    def _holds_python_rows(self) -> bool:
        """Whether the storage holds plain Python rows (e.g. dicts in a ``ListStorage``),
        which TorchRL's default collate cannot stack."""
        if self._python_rows is None:
            from torchrl.data import ListStorage

            # remote buffers (RayReplayBuffer) expose no local storage: they hold TensorDicts
            storage = getattr(self._replay_buffer, "_storage", None)
            self._python_rows = isinstance(storage, ListStorage) and not is_tensor_collection(
                storage.get(0)
            )
        return self._python_rows

    def _fetch(self, index: torch.Tensor) -> TensorDictBase:
        """The rows at ``index`` as one batch (one storage read)."""
        rb = self._replay_buffer
        if not self._holds_python_rows():
            return rb[index]
        index = index.tolist()
        rows = rb.storage.get(index)
        # every row is checked against the buffer's first row, whichever chunk it is in
        first = rows[0] if index[0] == 0 else rb.storage.get(0)
        batch = _rows_to_td(rows, index, reference=first)
        transform = rb.transform
        if transform is not None and len(transform):
            batch = transform(batch)
        return batch

    def _sample(self) -> tuple[TensorDictBase, torch.Tensor | None]:
        """A sampled batch and, when ``index_column`` is set, its storage indices."""
        rb = self._replay_buffer
        if not self._holds_python_rows():
            if self._index_column is None:
                return rb.sample(self._batch_size), None
            batch, info = rb.sample(self._batch_size, return_info=True)
            return batch, torch.as_tensor(info["index"]).reshape(-1)
        index, _ = rb.sampler.sample(rb.storage, self._batch_size)
        index = torch.as_tensor(index).reshape(-1)
        return self._fetch(index), index

    def _require_nonempty(self, n: int | None = None) -> int:
        if n is None:
            n = self._readable()[0]
        if n == 0:
            raise ValueError(
                "TorchRLBufferDataset: the replay buffer is empty; fill it (e.g. run the "
                "collector) before iterating or calling as_hf_dataset()."
            )
        if self._mode == "epoch" and n < self._batch_size:
            raise ValueError(
                f"TorchRLBufferDataset: the replay buffer holds {n} items, fewer than one epoch "
                f"batch (batch_size={self._batch_size}); lower batch_size or collect more."
            )
        return n

    def _check(self, python: bool) -> dict[str, list]:
        """Validate keys/format on the first stored rows (no sampler state consumed)."""
        n = self._require_nonempty()
        peek = self._fetch(torch.arange(min(n, 2)))
        if self._format is not None:
            check_format(self._format, peek)
        for spec in [*(self._keys or []), *(s for s in self._columns.values() if not callable(s))]:
            if not layouts.has_key(peek, spec):
                raise missing_key_error(peek, spec, "TorchRLBufferDataset")
        cols = self._convert(peek, python=python)
        _check_strings_survive(self._replay_buffer, cols)
        if self._index_column is not None:
            cols[self._index_column] = list(range(peek.batch_size.numel()))
        return cols

    def _convert(self, batch: TensorDictBase, *, python: bool | str) -> dict[str, Any]:
        """``{column: one value per row}`` for a sampled batch, each key read once.

        ``python``: ``True`` lists of Python values, ``False`` lists of tensors for tensor
        leaves, ``"columnar"`` each column in its cheapest whole-batch form (a list, a
        tensor ``[B, ...]`` or a ``Ragged``; see :mod:`torchrl_trl.data.arrow`).
        """
        cols: dict[str, Any] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        raw_keys = self._keys
        if raw_keys is None and self._format is None and not self._columns:
            raw_keys = leaf_keys(batch)
        if self._format is not None:
            with layouts.decoded_padding(pad_text=self._pad_text):
                cols.update(self._format(batch))
        for key in raw_keys or []:
            cols[column_name(key)], self._dtypes[column_name(key)] = self._read(batch, key, python)
        for name, spec in self._columns.items():
            if callable(spec):
                cols[name] = list(spec(batch))
            else:
                cols[name], self._dtypes[name] = self._read(batch, spec, python)
        n = batch.batch_size.numel()
        for name, values in cols.items():
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values for a batch of {n} rows")
        return cols

    @staticmethod
    def _read(batch: TensorDictBase, key: NestedKey, python: bool | str):
        if python == "columnar":
            return read_key_columnar(batch, key)
        return read_key(batch, key, python=python)

    def _columns_of(
        self, batch: TensorDictBase, python: bool | str, index: torch.Tensor | None = None
    ) -> dict[str, Any] | None:
        """The converted columns of ``batch`` after ``sample_filter`` (``None``: all dropped)."""
        if index is not None:
            index = _index_per_row(index, batch)
        if self._sample_filter is not None:
            keep = self._keep(batch)
            if not keep.all():
                kept = keep.nonzero().squeeze(-1)
                if not kept.numel():
                    return None
                batch = batch[kept]
                index = None if index is None else index[kept]
        cols = self._convert(batch, python=python)
        if self._index_column is not None:
            index = torch.as_tensor(index).reshape(-1)
            cols[self._index_column] = index.clone() if python == "columnar" else index.tolist()
        if python is False and self._device is not None:
            for name, values in cols.items():
                cols[name] = [v.to(self._device) if isinstance(v, torch.Tensor) else v for v in values]
        return cols

    def _keep(self, batch: TensorDictBase) -> torch.Tensor:
        """``sample_filter(batch)`` as bool ``[B]``; anything else raises."""
        out = self._sample_filter(batch)
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

    def _rows(self, batch: TensorDictBase, python: bool, index: torch.Tensor | None = None) -> Iterator[dict[str, Any]]:
        cols = self._columns_of(batch, python, index)
        if cols is None:
            return
        names = list(cols)
        for row in zip(*cols.values()):
            yield dict(zip(names, row))

    # ------------------------------------------------------------------
    # Epoch mode
    # ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Epoch mode: the pass number mixed into the shuffle seed (the trainer calls
        this on the Hugging Face iterable from :meth:`as_hf_dataset`, which shares it).

        Under ``torch.distributed`` with several ranks (then call it on every rank: it
        broadcasts), it also fixes the passes of ``epoch`` to the items rank 0 holds now, so
        every rank reads the same items beside a live writer."""
        self._epoch.fill_(int(epoch))
        self._pin_for_ranks()

    def _pin_for_ranks(self) -> None:
        if self._mode == "epoch" and sharding.world_size() > 1:
            self._lengths.pin(self.epoch, sharding.broadcast_length(len(self._replay_buffer)))

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def __len__(self) -> int:
        """Epoch mode: rows one iterator yields if nothing is written meanwhile
        (``num_passes * len(replay_buffer)`` times the rows of one stored item, e.g. ``G``
        for items of batch shape ``[G]``), before ``sample_filter``."""
        if self._mode != "epoch":
            raise TypeError("TorchRLBufferDataset has no length in online mode; use mode='epoch'.")
        if self._num_passes is None:
            raise TypeError("TorchRLBufferDataset has no length with num_passes=None (endless passes).")
        n = len(self._replay_buffer)
        return self._num_passes * n * (self._rows_per_item() if n else 1)

    def _rows_per_item(self) -> int:
        """Rows one stored item yields: the numel of its batch shape (TorchRL stacks a
        buffer's items, so they share it)."""
        if self._item_rows is None:
            self._item_rows = self._fetch(torch.arange(1)).batch_size.numel()
        return self._item_rows

    def _readable(self) -> tuple[int, bool]:
        """``(n, live)`` of :func:`sharding.readable_length`, refusing a buffer this process
        inherited in the middle of a write."""
        rb = self._replay_buffer
        if sharding.forked_mid_write(rb):
            raise RuntimeError(
                "TorchRLBufferDataset: this DataLoader worker was forked while another thread was "
                "writing the replay buffer (its lock stayed held for 30 s), so its copy may be torn. "
                "Read with num_workers=0, use multiprocessing_context='spawn', or pause the writer."
            )
        return sharding.readable_length(rb)

    def _pass_length(self, epoch: int, *, first: bool = True, pass_index: int = 0) -> int:
        """The number of items epoch pass ``pass_index`` of this iteration reads: taken once
        when the pass begins and shared with every shard and DataLoader worker reading it,
        so a writer adding items meanwhile changes nothing in the pass."""
        n, live = self._readable()
        n = self._lengths.length(epoch, first=first, pass_index=pass_index, take=lambda: n, live=live)
        return self._require_nonempty(n)

    def _order(self, epoch: int, n: int) -> torch.Tensor:
        seed = 0 if self._seed is None else self._seed
        return sharding.epoch_order(n, shuffle=self._shuffle, seed=seed, epoch=epoch)

    def _pass_epochs(self) -> Iterator[int]:
        """The epoch of each pass one iterator makes (``epoch``, ``epoch + 1``, ...)."""
        first, k = self.epoch, 0
        while self._num_passes is None or k < self._num_passes:
            yield first + k
            k += 1

    def _epoch_batches(
        self, shard_ids: Sequence[int], num_shards: int, epoch: int, n: int
    ) -> Iterator[tuple[TensorDictBase, torch.Tensor]]:
        """``(batch, storage index)`` chunks of shards ``shard_ids`` of the pass ``epoch``
        over the first ``n`` items (a shard may be empty when ``n < num_shards``)."""
        order = self._order(epoch, n)
        bounds = sharding.shard_bounds(order.numel(), num_shards)
        for s in shard_ids:
            shard = order[bounds[s] : bounds[s + 1]]
            if shard.numel():
                for chunk in shard.split(self._batch_size):
                    yield self._fetch(chunk), chunk

    # ------------------------------------------------------------------
    # Online mode
    # ------------------------------------------------------------------

    def _online(self, stream: int, budget: int | None) -> Iterator[tuple[TensorDictBase, torch.Tensor | None]]:
        """``(batch, storage index or None)``: ``budget`` sampled batches of stream ``stream``."""
        self._require_nonempty()
        self._passes += 1
        worker = sharding.consumer().worker
        gen = torch.Generator().manual_seed(sharding.stream_seed(self._seed, stream, worker, self._passes))
        done = 0
        while budget is None or done < budget:
            seed = int(torch.randint(2**62, (), generator=gen))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                batch, index = self._sample()
            yield batch, index
            done += 1

    # ------------------------------------------------------------------
    # torch IterableDataset protocol
    # ------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Rows for this DataLoader worker (and ``rank``, when given).

        Online: each worker draws ``num_batches`` batches from its own random stream.
        Epoch: the pass's chunks of ``batch_size`` are dealt round-robin over
        (rank, worker), so together they read every item once.
        """
        me = sharding.consumer(self._rank, self._world_size)
        if self._mode == "online":
            for batch, index in self._online(me.index, self._num_batches):
                yield from self._rows(batch, python=False, index=index)
            return
        for k, epoch in enumerate(self._pass_epochs()):
            n = self._pass_length(epoch, first=k == 0, pass_index=k)
            chunks = self._order(epoch, n).split(self._batch_size)
            for i in range(me.index, len(chunks), me.count):
                yield from self._rows(self._fetch(chunks[i]), python=False, index=chunks[i])

    # ------------------------------------------------------------------
    # Hugging Face datasets
    # ------------------------------------------------------------------

    @property
    def features(self):
        """``datasets.Features`` of the rows :meth:`as_hf_dataset` yields."""
        from datasets import Features

        if self._features is None:
            sample = self._check(python=True)
            declared = self._format.features() if self._format is not None else {}
            feats = {}
            for name, values in sample.items():
                feats[name] = declared[name] if name in declared else infer_feature(
                    values, self._dtypes.get(name)
                )
            if self._index_column is not None:
                from datasets import Value

                feats[self._index_column] = Value("int64")
            self._features = Features(feats)
        return self._features

    @property
    def column_names(self) -> list[str]:
        return list(self.features)

    def _default_shards(self) -> int:
        if self._num_shards is not None:
            return self._num_shards
        world = sharding.world_size()
        return 4 * world if self._mode == "epoch" else world

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
        over the shards).

        Epoch mode under ``torch.distributed`` with several ranks: call it on every rank
        (it broadcasts rank 0's buffer length, which the first epoch's passes then read).
        """
        if map_style:
            if tensors:
                raise TypeError("tensors=True is for the iterable; use .with_format('torch') on the snapshot")
            return self.to_hf_dataset(**snapshot_kwargs)
        if snapshot_kwargs:
            raise TypeError(f"unexpected arguments {sorted(snapshot_kwargs)} (only with map_style=True)")
        from .arrow import make_iterable_dataset

        features = self.features
        k = self._default_shards()
        passes = self._num_passes if self._mode == "epoch" else 1
        ds = make_iterable_dataset(_HFBatches(self, k), list(range(k)), features, tensors=tensors, num_passes=passes)
        ds._epoch = self._epoch  # one shared counter: the trainer's set_epoch reaches us
        self._pin_for_ranks()
        return ds

    def to_hf_dataset(self, *, cache_dir: str | None = None, keep_in_memory: bool = False,
                      writer_batch_size: int | None = None):
        """A map-style ``datasets.Dataset`` snapshot: one pass over what is stored now (in
        the epoch order), written to Arrow in chunks, so memory does not grow with the
        buffer (unless ``keep_in_memory``)."""
        features = self.features
        gen = _HFBatches(self, 1, force_epoch=True).rows
        return _from_generator(
            gen, features, {"shard_ids": [0]}, streaming=False, cache_dir=cache_dir,
            keep_in_memory=keep_in_memory, writer_batch_size=writer_batch_size,
        )

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_spawn_keepalive"}

    def __reduce_ex__(self, protocol):
        from multiprocessing.context import get_spawning_popen

        lock = getattr(self._replay_buffer, "_replay_lock", None)
        if get_spawning_popen() is None or lock is None:
            return super().__reduce_ex__(protocol)
        # pickled for a spawned DataLoader worker: copy the buffer while no thread writes it
        # (torch moves its tensors to shared memory meanwhile, which races a write)
        import io
        from multiprocessing.reduction import ForkingPickler

        out = io.BytesIO()
        pickler = ForkingPickler(out, protocol)
        with lock:
            pickler.dump(self._replay_buffer)
        # objects made while pickling (e.g. shared-memory storages whose file descriptors
        # the child inherits) must live until the worker has started
        self._spawn_keepalive = pickler.memo.copy()
        state = {k: v for k, v in self.__getstate__().items() if k != "_replay_buffer"}
        return _restore, (type(self), state, out.getvalue())

    def __repr__(self) -> str:
        keys_repr = self._keys if self._keys is not None else "<all>"
        fmt = self._format.name if self._format is not None else None
        return (
            f"{self.__class__.__name__}(replay_buffer={self._replay_buffer!r}, "
            f"batch_size={self._batch_size}, keys={keys_repr}, device={self._device}, "
            f"num_batches={self._num_batches}, format={fmt}, columns={list(self._columns)}, "
            f"mode={self._mode!r}, shuffle={self._shuffle}, seed={self._seed})"
        )


class _HFBatches:
    """Picklable source of column batches for ``datasets``: ``gen(shard_ids)`` yields
    ``(key, {column: values})`` for the shards it is given (see :mod:`.arrow`)."""

    def __init__(self, dataset: TorchRLBufferDataset, num_shards: int, force_epoch: bool = False,
                 python: bool | str = "columnar"):
        self.dataset = dataset
        self.num_shards = num_shards
        self.epoch_mode = force_epoch or dataset.mode == "epoch"
        self.python = python

    def start_pass(self, pass_index: int, first: bool) -> dict[str, Any]:
        """Called once per pass of one iteration, before its shards are read: epoch mode
        takes the pass's length here (``{"length": n}``), so every shard reads the same items."""
        if not self.epoch_mode:
            return {}
        ds = self.dataset
        return {"length": ds._pass_length(ds.epoch + pass_index, first=first, pass_index=pass_index)}

    def batches(self, shard_ids: list[int], pass_index: int = 0,
                length: int | None = None) -> Iterator[tuple[str, TensorDictBase, torch.Tensor | None]]:
        """Epoch mode: pass ``pass_index`` of an iterator (shuffled with ``epoch + pass_index``)
        over the first ``length`` items (default: taken now)."""
        ds = self.dataset
        if self.epoch_mode:
            epoch = ds.epoch + pass_index
            n = ds._pass_length(epoch) if length is None else length
            for i, (batch, index) in enumerate(ds._epoch_batches(shard_ids, self.num_shards, epoch, n)):
                yield f"epoch{pass_index}_{i}", batch, index
            return
        budgets = None
        if ds._num_batches is not None:
            bounds = sharding.shard_bounds(ds._num_batches, self.num_shards)
            budgets = [bounds[s + 1] - bounds[s] for s in range(self.num_shards)]
        for s in shard_ids:
            for i, (batch, index) in enumerate(ds._online(s, None if budgets is None else budgets[s])):
                yield f"{s}_{i}", batch, index

    def __call__(self, shard_ids: list[int], pass_index: int = 0,
                 length: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        for key, batch, index in self.batches(shard_ids, pass_index, length):
            cols = self.dataset._columns_of(batch, self.python, index)
            if cols is not None:
                yield key, cols

    def rows(self, shard_ids: list[int]) -> Iterator[dict[str, Any]]:
        """Python rows (``from_generator``'s protocol, for the map-style snapshot)."""
        for key, batch, index in self.batches(shard_ids):
            yield from self.dataset._rows(batch, True, index)


def _from_generator(gen, features, gen_kwargs, *, streaming: bool, **kwargs):
    """``datasets`` ``from_generator`` with a fresh fingerprint, so ``datasets`` neither
    hashes the generator (which would pickle the whole buffer) nor reuses a stale cache."""
    from datasets.io.generator import GeneratorDatasetInputStream

    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return GeneratorDatasetInputStream(
        generator=gen,
        features=features,
        gen_kwargs=gen_kwargs,
        streaming=streaming,
        fingerprint=f"torchrl_trl_{uuid.uuid4().hex}",
        **kwargs,
    ).read()


def _restore(cls, state: dict, buffer: bytes):
    """Rebuild a dataset pickled by ``__reduce_ex__`` for a spawned worker (``buffer``: our
    own bytes, from the parent process)."""
    import pickle

    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    obj._replay_buffer = pickle.loads(buffer)
    return obj


def _index_per_row(index: torch.Tensor, batch: TensorDictBase) -> torch.Tensor:
    """Storage indices, one per row: an item of batch shape ``[G]`` gives ``G`` rows."""
    index = torch.as_tensor(index).reshape(-1)
    rows = batch.batch_size.numel()
    if index.numel() and rows != index.numel() and rows % index.numel() == 0:
        index = index.repeat_interleave(rows // index.numel())
    return index


def _rows_to_td(rows: list, index: Sequence[int] | None = None, path: tuple = (),
                reference: Any = None) -> TensorDictBase:
    """Plain Python rows (dicts) -> a TensorDict with one row per entry. Every row must
    hold the keys of ``reference`` (storage row 0; default ``rows[0]``), no more, no fewer
    (``index``: the rows' storage indices, named in errors)."""
    if rows and is_tensor_collection(rows[0]):
        from tensordict import lazy_stack

        return lazy_stack(list(rows))
    n = len(rows)
    index = list(range(n)) if index is None else list(index)
    if not all(isinstance(r, Mapping) for r in rows):
        i, bad = next((i, type(r).__name__) for i, r in zip(index, rows) if not isinstance(r, Mapping))
        where = f" at {'.'.join(path)!r}" if path else ""
        raise TypeError(
            f"TorchRLBufferDataset: ListStorage rows must be dicts or TensorDicts, got {bad}{where} in row {i}"
        )
    ref, ref_row = (rows[0], index[0]) if reference is None else (reference, 0)
    keys = list(ref) if isinstance(ref, Mapping) else list(rows[0])
    for i, r in zip(index, rows):
        if len(r) != len(keys) or any(k not in r for k in keys):
            missing = [k for k in keys if k not in r]
            extra = [k for k in r if k not in keys]
            name = ".".join((*path, str((missing or extra)[0])))
            which = "lacks" if missing else "has"
            raise (KeyError if missing else ValueError)(
                f"TorchRLBufferDataset: ListStorage row {i} {which} key {name!r} that row {ref_row} "
                f"{'has' if missing else 'lacks'} (row {ref_row} keys: {sorted(map(str, keys))}); "
                "every row must hold the same keys"
            )
    out = TensorDict(batch_size=[n])
    for key in keys:
        values = [r[key] for r in rows]
        if isinstance(values[0], Mapping):
            sub_ref = ref.get(key) if reference is not None and isinstance(ref.get(key), Mapping) else None
            out.set(key, _rows_to_td(values, index, (*path, str(key)), sub_ref))
        elif all(isinstance(v, torch.Tensor) for v in values) and len({v.shape for v in values}) == 1:
            out.set(key, torch.stack(values))
        elif all(isinstance(v, (int, float, bool)) for v in values):
            out.set(key, torch.tensor(values))
        else:
            out.set(key, NonTensorStack(*[NonTensorData(v) for v in values], batch_size=[n]))
    return out


def _check_strings_survive(replay_buffer, cols: dict[str, list]) -> None:
    """Refuse to read text or chat from a storage that does not keep strings."""
    from torchrl.data import LazyMemmapStorage

    storage = getattr(replay_buffer, "storage", None)
    if not isinstance(storage, LazyMemmapStorage) or _memmap_keeps_strings():
        return
    text = [name for name, values in cols.items() if values and _is_text(values[0])]
    if text:
        raise ValueError(
            f"columns {text} hold text or chat, but this TorchRL's LazyMemmapStorage reads every "
            "stored string back as the first one written; store LLM rollouts in a "
            "LazyStackStorage, ListStorage or LazyTensorStorage, or read only tokens from it "
            "(format='sft_tokenized', keys=[('tokens', ...)])"
        )


def _is_text(value: Any) -> bool:
    """A string, or chat messages (a list of role/content dicts)."""
    return isinstance(value, str) or (isinstance(value, list) and bool(value) and isinstance(value[0], dict))


@functools.cache
def _memmap_keeps_strings() -> bool:
    """Whether this TorchRL's ``LazyMemmapStorage`` reads strings back as written (0.14.1
    returns the first row's string for every row); probed once in a temporary directory."""
    import tempfile

    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    with tempfile.TemporaryDirectory() as tmp:
        rb = ReplayBuffer(storage=LazyMemmapStorage(2, scratch_dir=tmp))
        rb.extend(TensorDict({"s": ["a", "b"]}, batch_size=[2]))
        return [str(s) for s in rb[:].get("s")] == ["a", "b"]
