"""The only uses of other libraries' private internals, one function each, naming the
version it was checked against; covered by ``tests/test_compat.py``."""
from __future__ import annotations

from types import SimpleNamespace


def replay_lock(replay_buffer):
    """The ``threading.RLock`` a ``torchrl.data.ReplayBuffer`` holds while it writes or samples
    (a no-op context for a Ray client). Private: ``ReplayBuffer._replay_lock`` (torchrl 0.14.1)."""
    return replay_buffer._replay_lock


def bind_ray_replay_buffer(buffer, actor) -> None:
    """Make ``buffer``, a ``RayReplayBuffer`` made without its ``__init__``, use the existing
    replay-buffer ``actor`` (``None`` unbinds it). Private: what ``RayReplayBuffer.__init__``
    sets (torchrl 0.14.1)."""
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
    """A share of this process's Ray runtime, counted with TorchRL's own (the last
    ``.release()`` shuts Ray down only if a share started it).
    Private: ``torchrl._comm.ray_runtime._RayRuntimeLease`` (torchrl 0.14.1)."""
    from torchrl._comm.ray_runtime import _RayRuntimeLease

    return _RayRuntimeLease.acquire(ray_init_config)


def reset_replay_lock(replay_buffer) -> None:
    """Give a local ``replay_buffer`` a fresh, unheld lock (for a forked child).
    Private: sets ``ReplayBuffer._replay_lock`` (torchrl 0.14.1)."""
    import threading

    replay_buffer._replay_lock = threading.RLock()


def pin_storage_length(storage, n: int) -> None:
    """Make ``len(storage)`` of a ``TensorStorage`` read ``n`` in this process only (a forked child).
    Private: ``TensorStorage._len_value`` (torchrl 0.14.1)."""
    storage._len_value = SimpleNamespace(value=int(n))  # a process-private length counter


def datasets_examples_iterable_base() -> type:
    """The base class of what a ``datasets.IterableDataset`` iterates, shards, resumes and reads
    as Arrow. Private: ``datasets.iterable_dataset._BaseExamplesIterable`` (datasets 5.2); the
    public ``from_generator`` re-encodes every row, 2.5x slower in ``benchmarks/bench_dataset.py``."""
    from datasets.iterable_dataset import _BaseExamplesIterable

    return _BaseExamplesIterable


def iterable_dataset_from_examples(ex_iterable, features, cls: type | None = None):
    """A ``datasets.IterableDataset`` (or subclass ``cls``) iterating ``ex_iterable`` with
    ``features``. Private: ``IterableDataset(ex_iterable, info=...)`` (datasets 5.2)."""
    from datasets import DatasetInfo, IterableDataset

    return (cls or IterableDataset)(ex_iterable, info=DatasetInfo(features=features))


def has_own_step(transform) -> bool:
    """Whether ``transform`` is a TorchRL ``Transform`` overriding ``_step`` (a reward parser).
    Private: ``Transform._step`` (torchrl 0.14.1).

    >>> from torchrl.envs.llm import GSM8KRewardParser
    >>> has_own_step(GSM8KRewardParser()), has_own_step(lambda td: td)
    (True, False)
    """
    from torchrl.envs import Transform

    return isinstance(transform, Transform) and type(transform)._step is not Transform._step


def transform_step(transform, tensordict, next_tensordict):
    """Run ``transform``'s per-step hook as ``env.step`` would, filling and returning
    ``next_tensordict``. Private: ``Transform._step`` (torchrl 0.14.1)."""
    return transform._step(tensordict, next_tensordict)


def parser_input_mode_unset(parser) -> bool:
    """Whether a TorchRL reward parser was built without ``input_mode`` (it would guess it
    from a parent env it does not have). Private: ``_input_mode`` (torchrl 0.14.1).

    >>> from torchrl.envs.llm import GSM8KRewardParser
    >>> parser_input_mode_unset(GSM8KRewardParser()), parser_input_mode_unset(GSM8KRewardParser(input_mode="text"))
    (True, False)
    """
    return hasattr(parser, "_input_mode") and parser._input_mode is None


def set_parser_input_mode(parser, mode: str) -> None:
    """Set a reward parser's input mode as its ``input_mode=`` would (call it on a copy).
    Private: ``_input_mode``; the public one is read-only (torchrl 0.14.1)."""
    parser._input_mode = mode


def attn_implementation(config) -> str | None:
    """The attention implementation a transformers config runs with (``"sdpa"``...), or
    ``None``. Private: ``config._attn_implementation`` (transformers 5.24)."""
    return getattr(config, "_attn_implementation", None)
