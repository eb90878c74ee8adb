"""The :class:`Ragged` container, and reading keys through lazy stacks that ``td.get`` cannot
stack (:class:`Batch`, shared by the readers of a batch within :func:`read_once`). Knows
nothing of TorchRL's LLM keys (:mod:`.layouts` does)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase, is_leaf_nontensor
from tensordict.utils import NestedKey

__all__ = [
    "Batch", "Ragged", "available_keys", "batch_numel", "batch_of", "chunks", "first_member", "flatten",
    "get_values", "has_key", "leaves", "per_sample", "read_once", "reads_once",
]


@dataclass(frozen=True)
class Ragged:
    """Variable-length 1-D sequences stored flat: ``values`` (``[sum(lengths)]``, the samples
    concatenated) and int64 ``lengths`` (``[N]``); sample ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    >>> seqs = Ragged.from_list([[1, 2, 3], [4]])
    >>> seqs.tolist(), seqs.lengths.tolist(), seqs[1].tolist()
    ([[1, 2, 3], [4]], [3, 1], [4])
    """

    values: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def from_list(cls, seqs: Sequence[torch.Tensor | Sequence[int]], dtype=torch.long) -> Ragged:
        tensors = [torch.as_tensor(s, dtype=dtype).reshape(-1) for s in seqs]
        lengths = torch.tensor([t.numel() for t in tensors], dtype=torch.long)
        values = torch.cat(tensors) if tensors else torch.empty(0, dtype=dtype)
        return cls(values, lengths)

    @property
    def offsets(self) -> torch.Tensor:
        """int64 ``[N + 1]`` start of each sample in :attr:`values`, then the total."""
        return torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])

    def __len__(self) -> int:
        return self.lengths.numel()

    def __getitem__(self, i: int) -> torch.Tensor:
        offsets = self.offsets
        return self.values[offsets[i] : offsets[i + 1]]

    def split(self) -> tuple[torch.Tensor, ...]:
        """One tensor (a view) per sample."""
        return torch.split(self.values, self.lengths.tolist())

    def tolist(self) -> list[list]:
        """One Python list per sample."""
        flat, bounds = self.values.tolist(), self.offsets.tolist()
        return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


def chunks(value: Any, td: TensorDictBase) -> list[torch.Tensor]:
    """A tensor ``value`` :func:`get_values` read from ``td`` (no lazy stack) as dense ``[n_i, T_i]``
    chunks in row-major order: one chunk, or one per sample where values are ragged."""
    if isinstance(value, list):  # one tensor per sample
        return [torch.as_tensor(v).reshape(1, -1) for v in value]
    if value.is_nested:
        return [t.reshape(1, -1) for t in value.unbind(0)]
    if value.ndim == td.batch_dims:  # a scalar per sample
        return [value.reshape(-1, 1)]
    return [value.reshape(batch_numel(td), value.shape[-1])]


def per_sample(value: Any, td: TensorDictBase) -> list[Any]:
    """A ``value`` :func:`get_values` read from ``td`` (no lazy stack), one per sample."""
    if isinstance(value, list):
        return value
    if isinstance(value, (NonTensorData, NonTensorStack)):
        return flatten(value.tolist(), td.batch_dims)
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return list(value.reshape(-1, *value.shape[td.batch_dims :]).unbind(0))
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    return flatten(value, td.batch_dims)


def get_values(td: TensorDictBase, key: NestedKey) -> Any:
    """``td.get(key)``, or a flat list of one value per sample where they cannot be stacked."""
    try:
        value = td.get(key)
    except RuntimeError:
        if isinstance(td, LazyStackedTensorDict) or td.batch_dims == 0:
            raise
        return flatten(td.get(key, as_list=True), td.batch_dims)
    if value is None:
        raise KeyError(key)
    return value


def flatten(value: Any, depth: int) -> list:
    """The items ``depth`` levels down a nested list, in order."""
    if depth == 0:
        return [value]
    return [item for sub in value for item in flatten(sub, depth - 1)]


def has_key(td: TensorDictBase, key: NestedKey) -> bool:
    """Whether ``key`` is set (and not ``None``) in every sample of ``td`` (no lazy stack)."""
    try:
        return td.get(key, None) is not None
    except (KeyError, RuntimeError):  # only some samples hold the key, or the values cannot be stacked
        return td.batch_dims > 0 and all(has_key(sample, key) for sample in td.unbind(0))


def first_member(td: TensorDictBase) -> TensorDictBase:
    """The first tensordict a (nested) lazy stack is made of, ``td`` itself otherwise.

    >>> import torch
    >>> from tensordict import TensorDict, lazy_stack
    >>> rollouts = lazy_stack([TensorDict({"ids": torch.arange(n)}, []) for n in (2, 3)])
    >>> first_member(rollouts)["ids"].tolist()
    [0, 1]
    >>> dense = TensorDict({"ids": torch.zeros(2, 3)}, [2])
    >>> first_member(dense) is dense
    True
    """
    while isinstance(td, LazyStackedTensorDict) and td.tensordicts:
        td = td.tensordicts[0]
    return td


def available_keys(td: TensorDictBase) -> list[str]:
    """Sorted leaf keys of ``td`` (``"a.b"`` for nested ones), to name in errors.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> available_keys(TensorDict({"tokens": {"full": torch.zeros(3)}, "query": "2+2="}, []))
    ['query', 'tokens.full']
    """
    member = first_member(td)
    keys = member.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)
    return sorted(k if isinstance(k, str) else ".".join(k) for k in keys)


def batch_numel(td: TensorDictBase) -> int:
    """Number of samples: the product of ``td``'s batch dimensions."""
    return td.batch_size.numel()


def leaves(td: TensorDictBase) -> list[TensorDictBase]:
    """The tensordicts that are not lazy stacks under ``td``, in row-major order."""
    if isinstance(td, LazyStackedTensorDict):
        members = td.tensordicts if td.stack_dim == 0 else td.unbind(0)
        return [leaf for sub in members for leaf in leaves(sub)]
    return [td]


class Batch:
    """A batch walked once into its dense members (the leaves of its lazy stacks), each key
    then read from them once and kept, as is anything computed by :meth:`once`. ``td`` must
    not change while a ``Batch`` of it is in use.

    >>> from tensordict import TensorDict, lazy_stack
    >>> rows = Batch(lazy_stack([TensorDict({"ids": torch.arange(n)}) for n in (2, 3)]))
    >>> [c.tolist() for c in rows.chunks("ids")], rows.has("ids"), rows.has("mask")
    ([[[0, 1]], [[0, 1, 2]]], True, False)
    >>> rows.values("ids")[1].tolist(), rows.chunks("mask", None)
    ([0, 1, 2], None)
    """

    def __init__(self, td: TensorDictBase) -> None:
        self.td = td
        self.leaves = leaves(td)
        self.numel = batch_numel(td)
        self._read: dict[Any, Any] = {}

    def once(self, name: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, computed on the first call for ``name`` and kept (an error as well)."""
        if name not in self._read:
            try:
                self._read[name] = compute()
            except KeyError as err:  # a key not set: kept, raised anew each time
                self._read[name] = err
        value = self._read[name]
        if isinstance(value, KeyError):
            raise KeyError(*value.args)
        return value

    def has(self, key: NestedKey) -> bool:
        """Whether ``key`` is set (and not ``None``) in every sample."""
        return self.once(("has", key), lambda: all(has_key(leaf, key) for leaf in self.leaves))

    def _members(self, key: NestedKey) -> list[Any]:
        """:func:`get_values` of each member: the one read of ``key``."""
        return self.once(("read", key), lambda: [get_values(leaf, key) for leaf in self.leaves])

    def chunks(self, key: NestedKey, *default: Any) -> list[torch.Tensor]:
        """:func:`chunks` of the batch; ``KeyError`` (or ``default``) when ``key`` is not set."""
        try:
            return self.once(("chunks", key), lambda: [
                c for leaf, value in zip(self.leaves, self._members(key)) for c in chunks(value, leaf)
            ])
        except KeyError:
            if default:
                return default[0]
            raise

    def values(self, key: NestedKey) -> list[Any]:
        """:func:`per_sample` of the batch, in row-major order."""
        return self.once(("values", key), lambda: [
            v for leaf, value in zip(self.leaves, self._members(key)) for v in per_sample(value, leaf)
        ])

    def stacked(self, key: NestedKey) -> torch.Tensor | None:
        """The tensors at ``key`` as one ``[numel, ...]`` tensor, ``None`` unless they are tensors of one shape."""

        def stack() -> torch.Tensor | None:
            parts = self._members(key)
            if not parts or not all(isinstance(p, torch.Tensor) and not p.is_nested for p in parts):
                return None
            flat = [p.reshape(-1, *p.shape[leaf.batch_dims :]) for p, leaf in zip(parts, self.leaves)]
            if len({f.shape[1:] for f in flat}) > 1:
                return None
            return flat[0] if len(flat) == 1 else torch.cat(flat)

        return self.once(("stacked", key), stack)

    def require(self, key: NestedKey, what: str) -> None:
        """A ``KeyError`` naming ``what``, ``key`` and the available keys unless ``key`` is set."""
        if not self.has(key):
            raise KeyError(f"{what}: key {key!r} not found in the rollouts. Available keys: {available_keys(self.td)}")


_BATCHES: ContextVar[dict | None] = ContextVar("torchrl_trl_batches", default=None)


@contextmanager
def read_once():
    """Within this context (and those nested in it) each tensordict object has one :class:`Batch`,
    however many readers read it; it must not change meanwhile."""
    current = _BATCHES.get()
    token = _BATCHES.set({} if current is None else current)
    try:
        yield
    finally:
        _BATCHES.reset(token)


def batch_of(td: TensorDictBase) -> Batch:
    """The :class:`Batch` of ``td`` in this :func:`read_once` context (made on first use)."""
    batches = _BATCHES.get()
    found = batches.get(id(td))
    if found is None:
        found = batches[id(td)] = Batch(td)  # it holds td: its id cannot be reused while the context lives
    return found


def reads_once(reader: Callable) -> Callable:
    """``reader(td, ...)`` run within a :func:`read_once` context (the caller's, else its own)."""

    @functools.wraps(reader)
    def read(td, *args, **kwargs):
        with read_once():
            return reader(td, *args, **kwargs)

    return read
