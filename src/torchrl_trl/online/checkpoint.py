"""Save and restore a replay buffer with the trainer's checkpoints, atomically and without pickle:
``tensors.safetensors`` (tensor leaves), ``structure.json`` (the rest) and ``manifest.json`` (written
last: ``len``, ``write_count``, ``extra``, size and SHA-256 of the other two)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from .._compat import replay_lock
from .._buffers import local_parts
from .staleness import collector_policy_version

__all__ = ["BUFFER_DIR", "BufferCheckpointCallback", "BufferCheckpointError", "load_buffer", "save_buffer"]

BUFFER_DIR = "torchrl_buffer"
FORMAT = "torchrl_trl.buffer"
VERSION = 2
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
STRUCTURE = "structure.json"
_DATA_FILES = (TENSORS, STRUCTURE)
_PICKLE_FILES = ("items.pt", "meta.json", "buffer")  # what the old, pickling format wrote


class BufferCheckpointError(ValueError):
    """A saved buffer that cannot be read safely or consistently (old pickle format, files that
    do not match the manifest, an unknown class).

    >>> import pathlib, tempfile
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> old = pathlib.Path(tempfile.mkdtemp()) / "torchrl_buffer"
    >>> old.mkdir(); (old / "items.pt").write_bytes(b"pickle")  # the old, pickling format
    6
    >>> load_buffer(ReplayBuffer(storage=ListStorage(4)), old)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    torchrl_trl.online.checkpoint.BufferCheckpointError: load_buffer: ... old torchrl_trl buffer format (items.pt), ...
    """


# --- TensorDicts, lazy stacks, allowed tensorclasses and JSON data <-> JSON nodes + tensors, no pickle ----------

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
                    "device": _device(x.device), "v": self(x.data, path)}
        if is_tensorclass(x):
            return {"T": "tensorclass", "cls": self._class(x, path), "td": self(x._tensordict, path),
                    "non_td": self(dict(getattr(x, "_non_tensordict", {}) or {}), path)}
        if isinstance(x, LazyStackedTensorDict):  # NonTensorStack included
            return {"T": "nontensor_stack" if isinstance(x, NonTensorStack) else "lazy_stack", "dim": x.stack_dim,
                    "v": [self(t, path + (i,)) for i, t in enumerate(x.tensordicts)]}
        if isinstance(x, TensorDictBase):
            if not isinstance(x, TensorDict):  # sub-tensordicts, persistent ones...
                x = x.to_tensordict()
            return {"T": "tensordict", "batch": list(x.batch_size), "device": _device(x.device),
                    "v": {k: self(v, path + (k,)) for k, v in x.items()}}
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
        raise TypeError(
            f"save_buffer: the value at {_key_str(path)!r} is a {type(x).__name__}; a checkpoint holds tensors, "
            "TensorDicts, allowed tensorclasses and JSON data (str, int, float, bool, None, lists and dicts of them)"
        )


def _device(device) -> str | None:
    return None if device is None else str(device)


class TreeDecoder:
    """``decoder(node)`` -> the object :class:`TreeEncoder` encoded, rebuilding only the
    ``allowed`` classes; anything else raises :class:`BufferCheckpointError` naming ``where`` and the path."""

    def __init__(self, tensors: dict[str, torch.Tensor], allowed: dict[str, type], where: str):
        self.tensors, self.allowed, self.where = tensors, allowed, where

    def _class(self, name: str, path: tuple) -> type:
        cls = self.allowed.get(name)
        if cls is None:
            raise BufferCheckpointError(
                f"load_buffer: {self.where} holds a {name!r} at {_key_str(path)!r}, which is not an "
                f"allowed class ({sorted(self.allowed)}); pass classes=[...] to load_buffer if you trust it"
            )
        return cls

    def __call__(self, node: dict, path: tuple = ()) -> Any:
        from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict

        try:
            kind, value = node["T"], node.get("v")
        except (TypeError, KeyError):
            raise BufferCheckpointError(f"load_buffer: malformed node at {_key_str(path)!r} in {self.where}") from None
        if kind == "tensor":
            if node.get("id") not in self.tensors:
                raise BufferCheckpointError(f"load_buffer: {self.where} names tensor {node.get('id')!r} at "
                                            f"{_key_str(path)!r}, which is not among the saved tensors")
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
        raise BufferCheckpointError(f"load_buffer: unknown node type {kind!r} at {_key_str(path)!r} in {self.where}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stored_items(storage, n: int):
    """The storage's kind and items in order: a TensorDict ``[n]`` (tensor storages) or a list."""
    from torchrl.data.replay_buffers.storages import ListStorage, TensorStorage

    if isinstance(storage, TensorStorage):
        return {"kind": "tensor", "data": storage.get(torch.arange(n)) if n else None}
    if isinstance(storage, ListStorage):
        return {"kind": "list", "data": [storage.get(i) for i in range(n)]}
    raise TypeError(f"save_buffer: storage {type(storage).__name__} is not supported (tensor or list storages)")


def save_buffer(
    replay_buffer, path: str | os.PathLike, *, extra: dict[str, Any] | None = None, classes: Iterable[type] = ()
) -> Path:
    """Write ``replay_buffer`` (items, sampler and writer state) to the directory ``path``, atomically.
    Returns ``path``; raises ``TypeError`` naming the key of a value that cannot be stored without pickle.

    Args:
        replay_buffer (ReplayBuffer): a local TorchRL replay buffer.
        path (str or os.PathLike): the directory written (replaced atomically).

    Keyword Args:
        extra (dict, optional): JSON data kept in the manifest. Defaults to ``None``.
        classes (iterable of type, optional): more tensorclasses the items may hold. Defaults to ``()``.

    >>> import tempfile
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=ListStorage(8))
    >>> _ = rb.extend(["a", "b"])
    >>> path = save_buffer(rb, f"{tempfile.mkdtemp()}/torchrl_buffer")
    >>> sorted(p.name for p in path.iterdir())
    ['manifest.json', 'structure.json', 'tensors.safetensors']
    """
    path = Path(path)
    storage, sampler, writer = local_parts(replay_buffer, "save_buffer")
    encode = TreeEncoder(allowed_classes(classes))
    with replay_lock(replay_buffer):  # writers wait: items, sampler and writer of one moment
        n = len(replay_buffer)
        items = _stored_items(storage, n)
        structure = {"storage": items["kind"], "items": encode(items["data"], ("items",)),
                     "sampler": encode(sampler.state_dict(), ("sampler",)),
                     "writer": encode(writer.state_dict(), ("writer",))}
        write_count = int(replay_buffer.write_count)
    extra = dict(extra or {})
    json.dumps(extra)  # refuse what JSON cannot hold before anything is written

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_files(tmp, encode.tensors, structure)
        manifest = {
            "format": FORMAT, "version": VERSION, "len": n, "write_count": write_count,
            "storage": items["kind"], "extra": extra,
            "files": {f: {"size": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in _DATA_FILES},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_files(directory: Path, tensors: dict[str, torch.Tensor], structure: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(directory / TENSORS))
    (directory / STRUCTURE).write_text(json.dumps(structure, allow_nan=False))


def _replace_dir(new: Path, path: Path) -> None:
    """Move ``new`` to ``path``; an old ``path`` is moved aside and deleted once ``new`` is in place."""
    if not path.exists():
        os.replace(new, path)
        return
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the buffer at ``path`` (with ``extra`` at the top level), data files unchecked."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        old = [f for f in _PICKLE_FILES if (path / f).exists()]
        if old:
            raise BufferCheckpointError(
                f"load_buffer: {str(path)!r} was written in the old torchrl_trl buffer format ({', '.join(old)}), "
                "which is pickle and cannot be read safely; re-create it with this version's save_buffer."
            )
        leftovers = sorted(p.name for p in path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
        hint = f"; an interrupted save left the previous checkpoint in {leftovers}" if leftovers else ""
        raise FileNotFoundError(
            f"load_buffer: expected a saved replay buffer at {str(path)!r}, {MANIFEST} is missing{hint}"
        )
    try:
        meta = json.loads(manifest.read_text())
    except ValueError as err:
        raise BufferCheckpointError(f"load_buffer: {str(manifest)!r} is not valid JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise BufferCheckpointError(f"load_buffer: {str(manifest)!r} is not a {FORMAT} version {VERSION} manifest "
                                    f"(format={meta.get('format') if isinstance(meta, dict) else None!r})")
    return {**meta.get("extra", {}), **meta}


def load_buffer(
    replay_buffer, path: str | os.PathLike, *, classes: Iterable[type] = (), restore_state: bool = True
) -> dict[str, Any]:
    """Restore what :func:`save_buffer` wrote into ``replay_buffer`` (same storage/sampler/writer types
    and capacity), without unpickling or running write transforms. Returns the manifest (``len``,
    ``write_count``, ``extra`` entries); raises :class:`BufferCheckpointError` for a checkpoint not
    read safely (the old pickle format, files not matching the manifest, a class not allowed).

    Args:
        replay_buffer (ReplayBuffer): the buffer filled (its storage, sampler and writer types and
            capacity as the saved one's).
        path (str or os.PathLike): the directory :func:`save_buffer` wrote.

    Keyword Args:
        classes (iterable of type, optional): more tensorclasses to rebuild. Defaults to ``()``.
        restore_state (bool, optional): also restore the sampler and writer state (``False``:
            the items only). Defaults to ``True``.

    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=ListStorage(8))
    >>> _ = rb.extend([TensorDict({"reward": torch.tensor(float(i))}) for i in range(3)])
    >>> path = save_buffer(rb, f"{tempfile.mkdtemp()}/torchrl_buffer", extra={"step": 7})
    >>> restored = ReplayBuffer(storage=ListStorage(8))
    >>> meta = load_buffer(restored, path)
    >>> meta["len"], meta["step"], [float(td["reward"]) for td in restored[:]]
    (3, 7, [0.0, 1.0, 2.0])
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from tensordict import TensorDictBase, lazy_stack

    path = Path(path)
    storage, sampler, writer = local_parts(replay_buffer, "load_buffer")
    meta = read_meta(path)
    for name in _DATA_FILES:
        f, expected = path / name, meta.get("files", {}).get(name)
        if expected is None or not f.is_file():
            raise BufferCheckpointError(f"load_buffer: {str(f)!r} is missing or not in {MANIFEST}; "
                                        "refusing a partial checkpoint")
        if f.stat().st_size != expected["size"] or _sha256(f) != expected["sha256"]:
            raise BufferCheckpointError(f"load_buffer: {str(f)!r} does not match {MANIFEST} (size or SHA-256 differ): "
                                        "the directory mixes files of different saves; refusing it")
    try:
        tensors = load_file(str(path / TENSORS))
    except SafetensorError as err:
        raise BufferCheckpointError(f"load_buffer: {str(path / TENSORS)!r} is not a safetensors file: {err}") from err
    decode = TreeDecoder(tensors, allowed_classes(classes), repr(str(path / STRUCTURE)))
    try:
        structure = json.loads((path / STRUCTURE).read_text())
        if structure.get("storage") != _stored_items(storage, 0)["kind"]:
            raise BufferCheckpointError(
                f"load_buffer: {str(path)!r} holds a {structure.get('storage')} storage's items but the buffer "
                f"has a {type(storage).__name__}; build it with the storage type it was saved from"
            )
        items = decode(structure["items"], ("items",))
        sampler_state = decode(structure["sampler"], ("sampler",))
        writer_state = decode(structure["writer"], ("writer",))
    except BufferCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, RecursionError) as err:
        raise BufferCheckpointError(f"load_buffer: {str(path / STRUCTURE)!r} is malformed: {err!r}") from err
    n = meta["len"]
    if items is None or isinstance(items, list):
        count = len(items or [])
    elif isinstance(items, (torch.Tensor, TensorDictBase)) and len(items.shape):
        count = items.shape[0]
    else:
        raise BufferCheckpointError(f"load_buffer: {str(path / STRUCTURE)!r} holds no item list or batch "
                                    f"({type(items).__name__})")
    if count != n:
        raise BufferCheckpointError(f"load_buffer: {str(path)!r} holds {count} items, its manifest says {n}")
    if isinstance(items, list) and n and all(isinstance(i, TensorDictBase) for i in items):
        items = lazy_stack(items)
    with replay_lock(replay_buffer):  # nobody writes or samples a half-restored buffer
        replay_buffer.empty()
        if n:  # stored after the write transforms ran: not through ReplayBuffer.extend
            sampler.extend(writer.extend(items))
        if restore_state:
            try:
                writer.load_state_dict(writer_state)
                sampler.load_state_dict(sampler_state)
            except Exception as err:
                replay_buffer.empty()
                raise BufferCheckpointError(
                    f"load_buffer: the writer/sampler state in {str(path)!r} does not fit this buffer's "
                    f"{type(writer).__name__}/{type(sampler).__name__}: {err!r}; build it with the ones "
                    "it was saved with"
                ) from err
    if len(replay_buffer) != n:
        raise RuntimeError(
            f"load_buffer: restored {len(replay_buffer)} items from {str(path)!r}, the checkpoint holds {n}; "
            "is the buffer's capacity smaller than the saved one's?"
        )
    return meta


class BufferCheckpointCallback(TrainerCallback):
    """A ``TrainerCallback`` that saves the buffer into each trainer checkpoint and restores it on resume.

    ``on_save`` writes ``<checkpoint>/torchrl_buffer`` (process zero); a resumed run's
    ``on_train_begin`` loads it unless the buffer holds it already.

    Args:
        replay_buffer (ReplayBuffer): the local buffer the dataset reads.

    Keyword Args:
        collector (collector, optional): its ``policy_version`` is saved and restored too.
            Defaults to ``None``.
        classes (iterable of type, optional): see :func:`save_buffer`. Defaults to ``()``.

    >>> import tempfile
    >>> from types import SimpleNamespace
    >>> from torchrl.data import ListStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=ListStorage(8))
    >>> _ = rb.extend(["a", "b", "c"])
    >>> args = SimpleNamespace(output_dir=tempfile.mkdtemp())   # a Trainer passes its own
    >>> state = SimpleNamespace(global_step=5, is_world_process_zero=True)
    >>> _ = BufferCheckpointCallback(rb).on_save(args, state, None)  # the trainer saves checkpoint-5
    >>> fresh = ReplayBuffer(storage=ListStorage(8))
    >>> resumed = BufferCheckpointCallback(fresh)
    >>> _ = resumed.on_train_begin(args, state, None)          # resume_from_checkpoint=".../checkpoint-5"
    >>> len(fresh), resumed.restored_from.endswith("checkpoint-5/torchrl_buffer")
    (3, True)
    """

    def __init__(self, replay_buffer, *, collector=None, classes: Iterable[type] = ()) -> None:
        self.replay_buffer = replay_buffer
        self.collector = collector
        self.classes = tuple(classes)
        self.restored_from: str | None = None

    @staticmethod
    def checkpoint_dir(args, state) -> Path:
        return Path(args.output_dir) / f"checkpoint-{state.global_step}" / BUFFER_DIR

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            extra = {"global_step": state.global_step}
            version = collector_policy_version(self.collector)  # a Ray collector: one remote call
            if version is not None:
                extra["policy_version"] = version
            save_buffer(self.replay_buffer, self.checkpoint_dir(args, state), extra=extra, classes=self.classes)
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step <= 0:
            return control
        path = self.checkpoint_dir(args, state)
        if not path.is_dir():
            raise FileNotFoundError(f"BufferCheckpointCallback: resuming at step {state.global_step} but {str(path)!r} "
                                    "does not exist; the checkpoint was saved without this callback.")
        meta = read_meta(path)
        if int(self.replay_buffer.write_count) != meta["write_count"] or len(self.replay_buffer) != meta["len"]:
            load_buffer(self.replay_buffer, path, classes=self.classes)
        tracker = getattr(self.collector, "policy_version_tracker", None)
        if tracker is not None and "policy_version" in meta:
            tracker.version = int(meta["policy_version"])
        self.restored_from = str(path)
        return control
