"""The trainer's weights to a TorchRL collector's policy, through ``collector.update_policy_weights_``."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import weakref

import torch
from tensordict import TensorDict, TensorDictBase

from .ray import is_ray_collector

__all__ = ["GenerationLock", "load_weights", "push_weights", "staged_weights", "weights_td"]


def load_weights(module: torch.nn.Module, weights) -> int:
    """Copy ``weights`` (an ``nn.Module``, a TensorDict, a mapping or ``(name, tensor)`` pairs)
    into ``module``'s tensors of the same names, in place; returns how many were copied.

    Raises:
        KeyError, ValueError: a name ``module`` does not have, or a different shape.

    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> load_weights(a, b.named_parameters()), torch.equal(a.weight, b.weight)
    (2, True)
    >>> load_weights(a, {"bias": torch.zeros(3)})
    Traceback (most recent call last):
    ...
    ValueError: load_weights: weight 'bias' has shape (3,), expected the policy's (2,)
    >>> load_weights(a, {"lm_head.weight": torch.zeros(2, 2)})
    Traceback (most recent call last):
    ...
    KeyError: "load_weights: expected a parameter or buffer of the policy model Linear, got weight 'lm_head.weight'"
    """
    weights = weights_td(weights)
    target = TensorDict.from_module(module)
    for name, tensor in weights.items(include_nested=True, leaves_only=True):
        dotted = ".".join(name) if isinstance(name, tuple) else name
        if name not in target.keys(include_nested=True, leaves_only=True):
            raise KeyError(f"load_weights: expected a parameter or buffer of the policy model {type(module).__name__}, "
                           f"got weight {dotted!r}")
        if target.get(name).shape != tensor.shape:
            raise ValueError(f"load_weights: weight {dotted!r} has shape {tuple(tensor.shape)}, expected the policy's "
                             f"{tuple(target.get(name).shape)}")
    with torch.no_grad():
        target.update_(weights.data)
    return len(list(weights.keys(include_nested=True, leaves_only=True)))


def weights_td(weights) -> TensorDictBase:
    """``weights`` (an ``nn.Module``, a TensorDict, a mapping or ``(name, tensor)`` pairs with
    dotted names) as a TensorDict nested by module path."""
    if isinstance(weights, torch.nn.Module):
        return TensorDict.from_module(weights).data
    if isinstance(weights, TensorDictBase):
        return weights
    return TensorDict(dict(weights.items() if hasattr(weights, "items") else weights)).unflatten_keys(".")


def push_weights(
    collector, model: torch.nn.Module | TensorDictBase, *, lock: contextlib.AbstractContextManager | None = None,
) -> None:
    """Load ``model``'s weights (:func:`staged_weights`) into ``collector``'s policy with
    ``collector.update_policy_weights_``, holding ``lock`` meanwhile; a Ray actor on this machine
    reads them from memory-mapped files (``benchmarks/bench_weight_push.py``)."""
    weights = staged_weights(collector, model)
    with lock if lock is not None else contextlib.nullcontext():
        collector.update_policy_weights_(weights)


def staged_weights(collector, model: torch.nn.Module | TensorDictBase) -> TensorDictBase:
    """``model``'s weights (or ``model``, a TensorDict of them) as ``collector.update_policy_weights_``
    loads them: under ``"model"`` for a ``policy.model`` or a Ray actor, which gets them on the CPU (on
    this machine copied into its memory-mapped files, ``is_memmap()``: the trainer may step while it loads them)."""
    weights = weights_td(model)
    if is_ray_collector(collector):
        return _SharedWeights.of(collector, TensorDict({"model": weights.cpu()}, batch_size=[]))
    if isinstance(getattr(getattr(collector, "policy", None), "model", None), torch.nn.Module):
        return TensorDict({"model": weights}, batch_size=[])
    return weights


class _SharedWeights:
    """Weights for a Ray collector whose actor runs on this machine, in memory-mapped files the
    actor reads in place: a push pickles their file names, not every tensor through Ray's object
    store. The actor copies them (``update_``) before ``update_policy_weights_`` returns, so the
    next push may overwrite them."""

    _by_collector: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, weights: TensorDictBase) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in weights.values(True, True))
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        room = shm is not None and shutil.disk_usage(shm).free > 2 * nbytes
        self._dir = tempfile.TemporaryDirectory(prefix="torchrl_trl_weights_", dir=shm if room else None)
        self.layout = _layout(weights)
        self.files = weights.memmap(self._dir.name)

    @classmethod
    def of(cls, collector, weights: TensorDictBase) -> TensorDictBase:
        """``weights`` copied into ``collector``'s files (made at its first push, or again for
        other shapes); ``weights`` as they are when Ray runs on more than one machine."""
        shared = cls._by_collector.get(collector, False)
        if shared is None:
            return weights
        if shared is False or shared.layout != _layout(weights):  # new files, holding the weights
            import ray

            one_machine = sum(node["Alive"] for node in ray.nodes()) == 1
            shared = cls._by_collector[collector] = cls(weights) if one_machine else None
            return weights if shared is None else shared.files
        return shared.files.update_(weights)


def _layout(weights: TensorDictBase) -> list:
    return [(key, t.shape, t.dtype) for key, t in weights.items(True, True)]


class GenerationLock:
    """The lock between a background generation loop (:meth:`batch` around each batch) and
    weight pushes (:meth:`push`); a waiting push goes before the loop's next batch (Python's
    ``Lock`` is not fair)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting_pushes = 0
        self._no_push_waiting = threading.Event()
        self._no_push_waiting.set()

    @contextlib.contextmanager
    def batch(self):
        """Held by the generation loop around one batch."""
        self._no_push_waiting.wait()
        with self._lock:
            yield

    @contextlib.contextmanager
    def push(self):
        """Held around a weight push, taken after the batch in flight, before the loop's next one."""
        with self._count:
            self._waiting_pushes += 1
            self._no_push_waiting.clear()
        self._lock.acquire()
        with self._count:
            self._waiting_pushes -= 1
        try:
            yield
        finally:
            self._lock.release()
            with self._count:
                if not self._waiting_pushes:
                    self._no_push_waiting.set()
