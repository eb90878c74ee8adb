"""Priority feedback: a prioritised buffer, ``TorchRLBufferDataset(format=RowColumns(index_column="index"))`` and
:func:`update_priorities` called in ``compute_loss`` with the indices and a per-sample value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import Sampler

from .._checks import positive_int
from .._buffers import local_sampler

__all__ = ["TensorPrioritizedSampler", "update_priorities"]


def update_priorities(replay_buffer, indices, values, *, eps: float = 1e-6) -> None:
    """Set the priority of the rows at ``indices`` (int ``[B]``) to ``|values| + eps`` (``[B]``).

    Raises ``ValueError`` on mismatched lengths or non-finite values, ``TypeError`` for non-integer
    indices or a sampler without priorities, ``IndexError`` for an index outside the buffer.

    Args:
        replay_buffer (ReplayBuffer): a buffer with a prioritised sampler.
        indices (int tensor or sequence): the storage indices (``[B]``), e.g. a dataset's
            ``RowColumns(index_column=)`` column.
        values (tensor or sequence): one value per index (``[B]``), e.g. per-sample losses.

    Keyword Args:
        eps (float, optional): added to ``|values|``. Defaults to ``1e-6``.

    >>> import torch
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> sampler = TensorPrioritizedSampler(4)
    >>> rb = ReplayBuffer(storage=ListStorage(4), sampler=sampler)
    >>> _ = rb.extend(["a", "b", "c", "d"])
    >>> per_sample_loss = torch.tensor([0.5, -2.0])   # e.g. from compute_loss, shape [B]
    >>> update_priorities(rb, torch.tensor([1, 3]), per_sample_loss, eps=0.0)
    >>> sampler.priorities(4).tolist()                # new rows start at the max priority, 1
    [1.0, 0.5, 1.0, 2.0]
    >>> update_priorities(rb, [0.0], [1.0])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: update_priorities: indices must be integer storage indices, got dtype torch.float32 ...
    """
    idx, stored = torch.as_tensor(indices).detach().to("cpu"), len(replay_buffer)
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
        raise TypeError(f"update_priorities: indices must be integer storage indices, got dtype {idx.dtype} "
                        f"({idx.reshape(-1)[:4].tolist()}...); pass the dataset's index column as given")
    idx = idx.long().reshape(-1)
    bad = (idx < 0) | (idx >= stored)
    if bad.any():
        raise IndexError(f"update_priorities: indices {idx[bad][:8].tolist()} are outside the {stored} stored "
                         f"items (valid: 0..{stored - 1})")
    val = torch.as_tensor(values).detach().to("cpu", torch.float64).reshape(-1)
    if idx.numel() != val.numel():
        raise ValueError(f"update_priorities: {idx.numel()} indices but {val.numel()} values")
    if not torch.isfinite(val).all():
        raise ValueError(f"update_priorities: non-finite values at positions "
                         f"{(~torch.isfinite(val)).nonzero().flatten().tolist()}")
    sampler = local_sampler(replay_buffer)  # a Ray buffer's sampler lives in its actor
    if sampler is not None and type(sampler).update_priority is Sampler.update_priority:
        raise TypeError(f"update_priorities: the buffer's sampler {type(sampler).__name__} keeps no priorities; "
                        "use torchrl.data.PrioritizedSampler or torchrl_trl.online.TensorPrioritizedSampler.")
    replay_buffer.update_priority(idx, val.abs() + eps)


class TensorPrioritizedSampler(Sampler):
    """Proportional prioritised sampling, ``P(i) ∝ p_i ** alpha``, with importance weights
    ``(N P(i)) ** -beta / max``, in plain PyTorch: TorchRL's ``PrioritizedSampler`` protocol for
    when its C++ segment trees cannot load.

    Args:
        max_capacity (int): the storage's capacity.
        alpha (float, optional): the priority exponent. Defaults to ``1.0``.
        beta (float, optional): the importance-weight exponent. Defaults to ``1.0``.
        eps (float, optional): a priority's floor. Defaults to ``1e-8``.

    >>> import torch
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> sampler = TensorPrioritizedSampler(3)
    >>> rb = ReplayBuffer(storage=ListStorage(3), sampler=sampler)
    >>> _ = rb.extend(["low", "mid", "high"])
    >>> rb.update_priority(torch.tensor([0, 1, 2]), torch.tensor([1.0, 3.0, 6.0]))
    >>> _ = torch.manual_seed(0)
    >>> index, info = sampler.sample(rb.storage, 1000)  # what rb.sample(1000) draws
    >>> round((index == 2).float().mean().item(), 1), info["_weight"].max().item()  # P(high) = 6 / 10
    (0.6, 1.0)
    """

    def __init__(self, max_capacity: int, alpha: float = 1.0, beta: float = 1.0, eps: float = 1e-8):
        self._max_capacity = positive_int(max_capacity, "TensorPrioritizedSampler: max_capacity")
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self._priority = torch.zeros(self._max_capacity, dtype=torch.float64)
        self._max_priority = 1.0

    def sample(self, storage, batch_size: int):
        n = len(storage)
        if n == 0:
            raise RuntimeError("TensorPrioritizedSampler: cannot sample from an empty storage.")
        p = self._priority[:n].clamp_min(self._eps) ** self._alpha
        probs = p / p.sum()
        index = torch.multinomial(probs, batch_size, replacement=True)
        w = (n * probs[index]) ** (-self._beta)
        return index, {"_weight": (w / w.max()).float()}

    def add(self, index: int) -> None:
        self._priority[index] = self._max_priority

    def extend(self, index) -> None:
        self._priority[torch.as_tensor(index).reshape(-1)] = self._max_priority

    def update_priority(self, index, priority, *, storage=None) -> None:
        index = torch.as_tensor(index).reshape(-1).long()
        priority = torch.as_tensor(priority, dtype=torch.float64).reshape(-1).expand(index.numel())
        self._priority[index] = priority
        self._max_priority = max(self._max_priority, float(priority.max()))

    def mark_update(self, index, *, storage=None) -> None:
        self.update_priority(index, self._max_priority)

    def priorities(self, n: int | None = None) -> torch.Tensor:
        """float64 ``[n]``: the stored priorities (``p_i``, before ``alpha``)."""
        return self._priority[: self._max_capacity if n is None else n].clone()

    def state_dict(self) -> dict[str, Any]:
        return {"priority": self._priority.clone(), "max_priority": self._max_priority}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._priority.copy_(torch.as_tensor(state_dict["priority"]))
        self._max_priority = float(state_dict["max_priority"])

    def _empty(self):
        self._priority.zero_()
        self._max_priority = 1.0

    def dumps(self, path):
        """Write the priorities to ``path/priority.safetensors`` (no pickle)."""
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        save_file({"priority": self._priority.contiguous(), "max_priority": torch.tensor(self._max_priority)},
                  str(Path(path) / "priority.safetensors"))

    def loads(self, path):
        """Read what :meth:`dumps` wrote; refuses other files with a ``ValueError``."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        file = Path(path) / "priority.safetensors"
        try:
            state = load_file(str(file))
        except (SafetensorError, FileNotFoundError) as err:
            raise ValueError(f"TensorPrioritizedSampler.loads: cannot read {str(file)!r} as safetensors: "
                             f"{err}") from err
        if set(state) != {"priority", "max_priority"} or state["priority"].shape != self._priority.shape:
            raise ValueError(f"TensorPrioritizedSampler.loads: {str(file)!r} holds {sorted(state)} with priority shape "
                             f"{tuple(state['priority'].shape) if 'priority' in state else None}, expected "
                             f"{tuple(self._priority.shape)} (max_capacity={self._max_capacity})")
        self.load_state_dict({"priority": state["priority"], "max_priority": float(state["max_priority"])})

    def __repr__(self):
        return f"TensorPrioritizedSampler(max_capacity={self._max_capacity}, alpha={self._alpha}, beta={self._beta})"
