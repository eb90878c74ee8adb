"""The few places where torchrl-trl relies on another library's private internals.

Each function wraps exactly one private use that has no public equivalent, names the
library versions it was checked against, and is covered by ``tests/test_compat.py``, so an
upgrade that breaks it fails in one obvious place instead of deep inside a trainer.
"""
from __future__ import annotations


def replay_lock(replay_buffer):
    """The lock a ``torchrl.data.ReplayBuffer`` holds while it writes or samples: holding it
    gives one consistent moment of its storage, sampler and writer (writers and samplers
    wait). A ``threading.RLock``; a no-op context for buffers that keep their storage in a
    Ray actor.

    Private use: ``ReplayBuffer._replay_lock`` (checked against torchrl 0.14.1, which has no
    public accessor for it).

    >>> import threading
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=ListStorage(4))
    >>> with replay_lock(rb):
    ...     writer = threading.Thread(target=rb.add, args=(1,))
    ...     writer.start(); writer.join(0.2)
    ...     len(rb), writer.is_alive()  # the writer waits for the lock
    (0, True)
    >>> writer.join(); len(rb)
    1
    """
    return replay_buffer._replay_lock


def bind_ray_replay_buffer(buffer, actor) -> None:
    """Make ``buffer``, a ``torchrl.data.RayReplayBuffer`` (subclass) instance created
    without ``RayReplayBuffer.__init__`` (which would start a new actor), read and write
    through ``actor``, an existing replay-buffer actor (e.g. ``ray.get_actor(name)``).
    ``actor=None`` unbinds it: ``buffer.is_alive`` is then ``False`` and its reads fail.
    The actor is never killed here. Data is moved to CPU before it is sent.

    Private use: the attributes ``RayReplayBuffer.__init__`` sets for the actor it creates
    (``_rb``, ``has_gpu``, ``_transport_kind``, ``_delayed_init``, ``_client``), checked
    against torchrl 0.14.1, which has no public way to attach to a running buffer actor.
    Exercised by ``tests/test_compat.py`` (needs ray).
    """
    if actor is None:
        for name in ("_rb", "_client"):
            buffer.__dict__.pop(name, None)
        return
    buffer._rb = actor
    buffer.has_gpu = False
    buffer._transport_kind = "ray"
    buffer._delayed_init = False
    buffer._client = buffer.client()  # public: a client of the actor bound above


def ray_runtime_lease(ray_init_config: dict | None = None):
    """A share of this process's Ray runtime: ``ray.init(**ray_init_config)`` if Ray is not
    initialised yet; ``.release()`` of the last share shuts Ray down only if a share started
    it. Shares are counted together with TorchRL's own Ray owners (``RayReplayBuffer``,
    collectors), so releasing ours never shuts Ray down under one of theirs.

    Private use: ``torchrl._comm.ray_runtime._RayRuntimeLease`` (checked against
    torchrl 0.14.1). Exercised by ``tests/test_compat.py`` (needs ray).
    """
    from torchrl._comm.ray_runtime import _RayRuntimeLease

    return _RayRuntimeLease.acquire(ray_init_config)


def reset_replay_lock(replay_buffer) -> None:
    """Give ``replay_buffer`` a fresh, unheld lock. For a process forked while another
    thread held the buffer's lock: that thread does not exist in the child, so the
    inherited lock would never be released.

    Private use: ``ReplayBuffer._replay_lock`` (a ``threading.RLock``), set; checked against
    torchrl 0.14.1. A buffer without that lock (a Ray client) is left alone.

    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=ListStorage(4))
    >>> held = replay_lock(rb); _ = held.acquire()
    >>> reset_replay_lock(rb)
    >>> replay_lock(rb) is not held and replay_lock(rb).acquire(blocking=False)
    True
    """
    import threading

    if hasattr(getattr(replay_buffer, "_replay_lock", None), "acquire"):
        replay_buffer._replay_lock = threading.RLock()


class _FixedLength:
    """A process-private stand-in for a ``TensorStorage``'s shared length counter."""

    def __init__(self, value: int) -> None:
        self.value = value


def pin_storage_length(storage, n: int) -> None:
    """Make ``len(storage)`` of a ``torchrl.data.TensorStorage`` read ``n`` in this process
    only. For a forked process: its copy of the tensors stops at the fork, but the length
    counter is shared memory that the parent keeps advancing, so the child's own sampler
    would draw rows it holds as uninitialised memory.

    Private use: ``TensorStorage._len_value`` (a ``multiprocessing.Value`` or an int; the
    storage reads ``._len_value.value`` when it is shared), checked against torchrl 0.14.1.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl import torchrl_logger
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> torchrl_logger.setLevel("WARNING")  # no storage-creation log line in the output
    >>> rb = ReplayBuffer(storage=LazyTensorStorage(8))
    >>> _ = rb.extend(TensorDict({"x": torch.arange(5)}, [5]))
    >>> pin_storage_length(rb.storage, 3)
    >>> len(rb.storage)
    3
    """
    storage._len_value = _FixedLength(int(n))


def datasets_examples_iterable_base() -> type:
    """The base class of ``datasets``' examples iterables: what a
    ``datasets.IterableDataset`` iterates, shards over ranks and DataLoader workers
    (``shard_data_sources``, ``num_shards``), resumes (``_init_state_dict``,
    ``state_dict``) and reads as Arrow (``iter_arrow``), and whose ``is_typed`` /
    ``features`` tell ``datasets`` that rows already match the features.

    Private use: ``datasets.iterable_dataset._BaseExamplesIterable`` and the protocol above,
    checked against datasets 5.2; ``tests/test_compat.py`` checks the protocol's names.

    Why not the public ``IterableDataset.from_generator(gen, features=...)``: it encodes and
    decodes every row against the features, which turns the rows' token lists (that hand
    TRL's collator one array each, see ``data/columns.py``) into plain Python lists, and it
    has no Arrow path (``with_format("torch")``, batched ``map`` go row by row). Measured by
    ``benchmarks/bench_dataset.py`` (fixed T=256, DataLoader + TRL's collator, 2 shared CPU
    cores, datasets 5.2): the same rows through ``from_generator`` ran at 0.31x of upstream
    where this path ran at 0.93-0.94x, 3x slower (0.19x when the rows hold tensors, which
    it converts to lists). Passes that share one buffer length across shards
    (``EpochPass(num_passes=)`` beside a live writer) and ``set_epoch`` reaching the buffer
    also need a class of our own.
    """
    from datasets.iterable_dataset import _BaseExamplesIterable

    return _BaseExamplesIterable


def iterable_dataset_from_examples(ex_iterable, features, cls: type | None = None):
    """A ``datasets.IterableDataset`` (or subclass ``cls``) iterating ``ex_iterable`` (an
    instance of a :func:`datasets_examples_iterable_base` subclass) and declaring
    ``features``.

    Private use: ``IterableDataset(ex_iterable, info=...)``, the constructor that
    ``datasets``' own builders call with their internal iterables; checked against
    datasets 5.2.
    """
    from datasets import DatasetInfo, IterableDataset

    return (cls or IterableDataset)(ex_iterable, info=DatasetInfo(features=features))


# -- TorchRL reward parsers run outside an env (rewards/trl_funcs.py) ----------------------


def has_own_step(transform) -> bool:
    """Whether ``transform`` is a TorchRL ``Transform`` that overrides ``_step``: a reward
    parser (``GSM8KRewardParser``...) that reads the step's input and writes ``next``.

    Private use: ``Transform._step`` (checked against torchrl 0.14.1: the per-step hook
    has no public name; ``TransformedEnv`` calls it).

    >>> from torchrl.envs.llm import GSM8KRewardParser
    >>> has_own_step(GSM8KRewardParser()), has_own_step(lambda td: td)
    (True, False)
    """
    from torchrl.envs import Transform

    return isinstance(transform, Transform) and type(transform)._step is not Transform._step


def transform_step(transform, tensordict, next_tensordict):
    """Run ``transform``'s per-step hook as ``env.step`` would: ``tensordict`` holds the
    step's input (the policy output), ``next_tensordict`` the step's result, which the
    transform fills (a reward parser writes its reward there). Returns the next tensordict.

    Private use: ``Transform._step(tensordict, next_tensordict)`` (checked against torchrl
    0.14.1; the public path is a ``TransformedEnv`` around a base env, which a TRL reward
    call has no use for).
    """
    return transform._step(tensordict, next_tensordict)


def parser_input_mode_unset(parser) -> bool:
    """Whether a TorchRL reward parser (``GSM8KRewardParser``) was built without
    ``input_mode`` and would guess it from a parent env it does not have (its public
    ``input_mode`` property then settles on ``"history"``).

    Private use: the parser's ``_input_mode`` attribute (checked against torchrl 0.14.1).

    >>> from torchrl.envs.llm import GSM8KRewardParser
    >>> parser_input_mode_unset(GSM8KRewardParser()), parser_input_mode_unset(GSM8KRewardParser(input_mode="text"))
    (True, False)
    """
    return hasattr(parser, "_input_mode") and parser._input_mode is None


def set_parser_input_mode(parser, mode: str) -> None:
    """Set the input mode (``"history"``, ``"text"``, ``"tokens"``) of a reward parser
    built without one, as its constructor's ``input_mode=`` would (call it on a copy).

    Private use: the parser's ``_input_mode`` attribute; its public ``input_mode`` is a
    read-only property (checked against torchrl 0.14.1).
    """
    parser._input_mode = mode


def attn_implementation(config) -> str | None:
    """The attention implementation a transformers config runs with (``"eager"``,
    ``"sdpa"``, ``"flash_attention_2"``, ...), or ``None`` when it says none.

    transformers has no public getter: the value lives in ``config._attn_implementation``
    (set by ``from_pretrained(attn_implementation=...)`` / ``set_attn_implementation``).
    Checked against transformers 5.24.
    """
    return getattr(config, "_attn_implementation", None)
