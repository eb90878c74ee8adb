"""The :class:`Ragged` container, and reading a key through lazy stacks that ``td.get``
cannot stack. Knows nothing of TorchRL's LLM keys (:mod:`.layouts` does)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_leaf_nontensor
from tensordict.utils import NestedKey

__all__ = [
    "Ragged", "available_keys", "batch_numel", "chunks", "first_member", "flatten", "get_values",
    "has_key", "leaves", "members", "require",
]


@dataclass(frozen=True)
class Ragged:
    """Variable-length 1-D sequences stored flat: ``values`` (``[sum(lengths)]``, the samples
    concatenated) and int64 ``lengths`` (``[N]``); sample ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    Examples:
        >>> seqs = Ragged.from_list([[1, 2, 3], [4]])
        >>> seqs.tolist(), seqs.lengths.tolist()
        ([[1, 2, 3], [4]], [3, 1])
        >>> ids, mask = seqs.to_padded(0, side="left")
        >>> ids.tolist()
        [[1, 2, 3], [0, 0, 4]]
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

    def to_padded(
        self, pad_value: int | float = 0, *, side: Literal["left", "right"] = "right", width: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(padded, mask)``, both ``[N, width]`` (default: the longest sample); ``mask``
        is ``True`` on real elements."""
        n = len(self)
        longest = int(self.lengths.max()) if n else 0
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"Ragged.to_padded: expected width >= the longest sample ({longest}), got width={width}")
        cols = torch.arange(width).expand(n, width)
        mask = cols < self.lengths[:, None] if side == "right" else cols >= (width - self.lengths)[:, None]
        padded = self.values.new_full((n, width), pad_value)
        padded[mask] = self.values
        return padded, mask


def members(td: LazyStackedTensorDict) -> list[TensorDictBase]:
    """The tensordicts of a lazy stack, in row-major order of its batch."""
    return td.tensordicts if td.stack_dim == 0 else td.unbind(0)


def chunks(td: TensorDictBase, key: NestedKey) -> list[torch.Tensor]:
    """The tensor at ``key`` as dense ``[n_i, T_i]`` chunks in row-major order of ``td``'s
    batch: one per dense member of a lazy stack, one per sample where values are ragged."""
    if isinstance(td, LazyStackedTensorDict):
        if td.stack_dim == 0 and td.batch_dims == 1:  # a sample per member (LazyStackStorage rows)
            values = td.get(key, as_list=True)  # one call, not a get per member
            if values is not None and all(isinstance(v, torch.Tensor) and v.ndim == 1 and not v.is_nested
                                          for v in values):
                return [v[None] for v in values]
        return [chunk for sub in members(td) for chunk in chunks(sub, key)]
    value = get_values(td, key)
    if isinstance(value, list):  # one tensor per sample
        return [torch.as_tensor(v).reshape(1, -1) for v in value]
    if value.is_nested:
        return [t.reshape(1, -1) for t in value.unbind(0)]
    if value.ndim == td.batch_dims:  # a scalar per sample
        return [value.reshape(-1, 1)]
    return [value.reshape(batch_numel(td), value.shape[-1])]


def get_values(td: TensorDictBase, key: NestedKey) -> Any:
    """``td.get(key)``, or a flat list with one value per sample where the values cannot be
    stacked. ``KeyError`` when ``key`` is not set."""
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
    """Whether ``key`` is set (and not ``None``) in every sample of ``td``, even where its
    values cannot be stacked."""
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0:
        return all(has_key(sub, key) for sub in td.tensordicts)
    try:
        return td.get(key, None) is not None
    except (KeyError, RuntimeError):
        # only some members hold the key, or the values cannot be stacked: ask the parts
        if isinstance(td, LazyStackedTensorDict):
            return all(has_key(sub, key) for sub in members(td))
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


def require(td: TensorDictBase, key: NestedKey, what: str) -> None:
    """A ``KeyError`` naming ``what``, ``key`` and the available keys unless ``key`` is set."""
    if not has_key(td, key):
        raise KeyError(f"{what}: key {key!r} not found in the rollouts. Available keys: {available_keys(td)}")


def batch_numel(td: TensorDictBase) -> int:
    """Number of samples, i.e. the product of ``td``'s batch dimensions."""
    return td.batch_size.numel()


def leaves(td: TensorDictBase) -> list[TensorDictBase]:
    """The tensordicts that are not lazy stacks under ``td``, in row-major order."""
    if isinstance(td, LazyStackedTensorDict):
        return [leaf for sub in members(td) for leaf in leaves(sub)]
    return [td]
