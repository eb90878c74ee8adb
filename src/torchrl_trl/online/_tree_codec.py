"""A tree of TensorDicts, lazy stacks, allowed tensorclasses and JSON data as JSON nodes plus a
flat dict of tensors, and back, with no pickle: what :mod:`torchrl_trl.online.checkpoint` stores."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["TreeDecoder", "TreeEncoder", "allowed_classes"]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def allowed_classes(extra: Iterable[type] = ()) -> dict[str, type]:
    from tensordict import MetaData, NonTensorData
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory, LogProbs, Masks, Text, Tokens

    classes = (NonTensorData, MetaData, History, Tokens, Masks, Text, ChatHistory, LogProbs, *extra)
    return {_qualname(c): c for c in classes}


def _key_str(path: tuple) -> str:
    return "/".join(map(str, path)) or "<root>"


class TreeEncoder:
    """``encoder(x)`` -> a JSON node tree; the tensors it meets go to :attr:`tensors` by id."""

    def __init__(self, allowed: dict[str, type]):
        self.allowed = allowed
        self.tensors: dict[str, torch.Tensor] = {}

    def _class(self, obj: Any, path: tuple) -> str:
        name = _qualname(type(obj))
        if name not in self.allowed:
            raise TypeError(
                f"save_buffer: the item at {_key_str(path)!r} is a {name}, which is not one of the classes a "
                f"checkpoint may hold ({sorted(self.allowed)}); pass classes=[{type(obj).__name__}] to save_buffer "
                "and load_buffer"
            )
        return name

    def __call__(self, x: Any, path: tuple = ()) -> dict:
        from tensordict import (LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase,
                                is_tensorclass)

        if isinstance(x, torch.Tensor):
            name = f"t{len(self.tensors)}"
            self.tensors[name] = x.detach().to("cpu").as_subclass(torch.Tensor).contiguous().clone()
            return {"T": "tensor", "id": name}
        if isinstance(x, NonTensorData):
            return {"T": "nontensor", "cls": self._class(x, path), "batch": list(x.batch_size),
                    "device": _device(x.device), "v": self.python(x.data, path)}
        if is_tensorclass(x):
            return {"T": "tensorclass", "cls": self._class(x, path), "td": self(x._tensordict, path),
                    "non_td": self.python(dict(getattr(x, "_non_tensordict", {}) or {}), path)}
        if isinstance(x, LazyStackedTensorDict):  # NonTensorStack included
            return {"T": "nontensor_stack" if isinstance(x, NonTensorStack) else "lazy_stack", "dim": x.stack_dim,
                    "v": [self(t, path + (i,)) for i, t in enumerate(x.tensordicts)]}
        if isinstance(x, TensorDictBase):
            if not isinstance(x, TensorDict):  # sub-tensordicts, persistent ones...
                x = x.to_tensordict()
            return {"T": "tensordict", "batch": list(x.batch_size), "device": _device(x.device),
                    "v": {k: self(v, path + (k,)) for k, v in x.items()}}
        return self.python(x, path)

    def python(self, x: Any, path: tuple) -> dict:
        """``x`` as a JSON node: JSON data, or what :meth:`__call__` encodes."""
        if x is None or isinstance(x, (bool, int, str)):
            return {"T": "py", "v": x}
        if isinstance(x, float):
            return {"T": "float", "v": repr(x)}  # keeps nan/inf exact and JSON standard
        if isinstance(x, (list, tuple)):
            return {"T": type(x).__name__, "v": [self(v, path + (i,)) for i, v in enumerate(x)]}
        if isinstance(x, dict):
            bad = [k for k in x if not isinstance(k, str)]
            if bad:
                raise TypeError(f"save_buffer: the dict at {_key_str(path)!r} has non-string keys {bad[:3]}")
            return {"T": "dict", "v": {k: self(v, path + (k,)) for k, v in x.items()}}
        from tensordict import is_tensor_collection

        if isinstance(x, torch.Tensor) or is_tensor_collection(x):
            return self(x, path)
        raise TypeError(
            f"save_buffer: the value at {_key_str(path)!r} is a {type(x).__name__}; a checkpoint holds tensors, "
            "TensorDicts, allowed tensorclasses and JSON data (str, int, float, bool, None, lists and dicts of them)"
        )


def _device(device) -> str | None:
    return None if device is None else str(device)


class TreeDecoder:
    """``decoder(node)`` -> the object :class:`TreeEncoder` encoded, rebuilding only the
    ``allowed`` classes; anything else raises ``error`` naming ``where`` and the path."""

    def __init__(self, tensors: dict[str, torch.Tensor], allowed: dict[str, type], where: str,
                 error: type[Exception] = ValueError):
        self.tensors, self.allowed, self.where, self.error = tensors, allowed, where, error

    def _class(self, name: str, path: tuple) -> type:
        cls = self.allowed.get(name)
        if cls is None:
            raise self.error(
                f"load_buffer: {self.where} holds a {name!r} at {_key_str(path)!r}, which is not an "
                f"allowed class ({sorted(self.allowed)}); pass classes=[...] to load_buffer if you trust it"
            )
        return cls

    def __call__(self, node: dict, path: tuple = ()) -> Any:
        from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict

        try:
            kind, value = node["T"], node.get("v")
        except (TypeError, KeyError):
            raise self.error(f"load_buffer: malformed node at {_key_str(path)!r} in {self.where}") from None
        if kind == "tensor":
            if node.get("id") not in self.tensors:
                raise self.error(f"load_buffer: {self.where} names tensor {node.get('id')!r} at {_key_str(path)!r}, "
                                 "which is not among the saved tensors")
            return self.tensors[node["id"]]
        if kind == "py":
            return value
        if kind == "float":
            return float(value)
        if kind in ("list", "tuple"):
            out = [self(v, path + (i,)) for i, v in enumerate(value)]
            return out if kind == "list" else tuple(out)
        if kind == "dict":
            return {k: self(v, path + (k,)) for k, v in value.items()}
        if kind == "nontensor":
            cls = self._class(node["cls"], path)
            return cls(data=self(value, path), batch_size=node["batch"], device=node["device"])
        if kind in ("nontensor_stack", "lazy_stack"):
            cls = NonTensorStack if kind == "nontensor_stack" else LazyStackedTensorDict
            return cls(*[self(v, path + (i,)) for i, v in enumerate(value)], stack_dim=node["dim"])
        if kind == "tensordict":
            return TensorDict({k: self(v, path + (k,)) for k, v in value.items()}, batch_size=node["batch"],
                              device=node["device"])
        if kind == "tensorclass":
            cls = self._class(node["cls"], path)
            return cls._from_tensordict(self(node["td"], path), non_tensordict=self(node["non_td"], path))
        raise self.error(f"load_buffer: unknown node type {kind!r} at {_key_str(path)!r} in {self.where}")
