"""Save and restore a replay buffer (and the collector's policy version) with the
trainer's checkpoints.

Layout inside ``<output_dir>/checkpoint-<step>/``::

    torchrl_buffer/
        meta.json        {"method", "len", "write_count", "policy_version", ...}
        buffer/          TorchRL ``ReplayBuffer.dumps`` (tensor and memmap storages), or
        items.pt         for storages that ``dumps`` rejects (``ListStorage``,
                         ``LazyStackStorage``): the stored TensorDicts, pickled, with
                         the sampler's and writer's state

The dataset's position needs no file of its own: an epoch-mode
``TorchRLBufferDataset`` reads a pass in the order fixed by ``(seed, epoch, len(buffer))``,
the trainer restores the epoch and skips the batches it already trained on, so the same
buffer contents give the same next samples.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

__all__ = ["BUFFER_DIR", "BufferCheckpointCallback", "load_buffer", "save_buffer"]

BUFFER_DIR = "torchrl_buffer"


def save_buffer(replay_buffer, path: str | os.PathLike, *, extra: dict[str, Any] | None = None) -> Path:
    """Write ``replay_buffer`` (storage, sampler and writer state) under ``path``
    (created). ``extra`` (JSON-able) is stored in ``meta.json``. Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = {"len": len(replay_buffer), "write_count": int(replay_buffer.write_count), **(extra or {})}
    try:
        replay_buffer.dumps(path / "buffer")
        meta["method"] = "dumps"
    except NotImplementedError:
        # ListStorage / LazyStackStorage: their state_dict() fails on non-tensor leaves
        # (text, chat history), so pickle the stored TensorDicts as they are
        items = [replay_buffer.storage.get(i) for i in range(len(replay_buffer))]
        state = {
            "items": items,
            "sampler": replay_buffer._sampler.state_dict(),
            "writer": replay_buffer._writer.state_dict(),
        }
        torch.save(state, path / "items.pt")
        meta["method"] = "items"
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    meta = Path(path) / "meta.json"
    if not meta.is_file():
        raise FileNotFoundError(f"no saved replay buffer at {str(path)!r} (missing meta.json)")
    return json.loads(meta.read_text())


def load_buffer(replay_buffer, path: str | os.PathLike) -> dict[str, Any]:
    """Restore what :func:`save_buffer` wrote into ``replay_buffer`` (built with the same
    storage/sampler/writer types and capacity). Returns the saved ``meta``."""
    path = Path(path)
    meta = read_meta(path)
    if meta["method"] == "dumps":
        replay_buffer.loads(path / "buffer")
    else:
        from tensordict import lazy_stack

        state = torch.load(path / "items.pt", weights_only=False)
        replay_buffer.empty()
        if state["items"]:
            # the items were stored after the buffer's write transforms ran (reward
            # scoring, MCAdvantage): put them back as they are, without running them again
            transform, replay_buffer._transform = replay_buffer._transform, None
            try:
                replay_buffer.extend(lazy_stack(state["items"]))
            finally:
                replay_buffer._transform = transform
        replay_buffer._writer.load_state_dict(state["writer"])
        replay_buffer._sampler.load_state_dict(state["sampler"])
    if len(replay_buffer) != meta["len"]:
        raise RuntimeError(
            f"load_buffer: restored {len(replay_buffer)} items from {str(path)!r}, "
            f"the checkpoint holds {meta['len']}"
        )
    return meta


class BufferCheckpointCallback(TrainerCallback):
    """A ``TrainerCallback`` that saves the buffer into each trainer checkpoint and
    restores it when training resumes.

    Args:
        replay_buffer: the buffer the training dataset reads (local or ``RayReplayBuffer``;
            a Ray buffer's actor writes the files, so the path must be on its node).

    Keyword Args:
        collector: optional; its ``policy_version`` is saved and restored too.

    ``on_save`` writes ``<checkpoint>/torchrl_buffer`` (process zero only: one shared
    buffer). ``on_train_begin`` of a resumed run (``global_step > 0``) loads
    ``<output_dir>/checkpoint-<global_step>/torchrl_buffer`` unless the buffer already
    holds it (same ``write_count``), e.g. because :func:`load_buffer` was called before
    building the dataset, which needs a non-empty buffer.
    """

    def __init__(self, replay_buffer, *, collector=None) -> None:
        self.replay_buffer = replay_buffer
        self.collector = collector
        self.restored_from: str | None = None

    @staticmethod
    def checkpoint_dir(args, state) -> Path:
        return Path(args.output_dir) / f"checkpoint-{state.global_step}" / BUFFER_DIR

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            extra = {"global_step": state.global_step}
            version = getattr(self.collector, "policy_version", None)
            if isinstance(version, int):
                extra["policy_version"] = version
            save_buffer(self.replay_buffer, self.checkpoint_dir(args, state), extra=extra)
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step <= 0:
            return control
        path = self.checkpoint_dir(args, state)
        if not path.is_dir():
            raise FileNotFoundError(
                f"BufferCheckpointCallback: resuming at step {state.global_step} but {str(path)!r} "
                "does not exist; the checkpoint was saved without this callback."
            )
        meta = read_meta(path)
        if int(self.replay_buffer.write_count) != meta["write_count"] or len(self.replay_buffer) != meta["len"]:
            load_buffer(self.replay_buffer, path)
        tracker = getattr(self.collector, "policy_version_tracker", None)
        if tracker is not None and "policy_version" in meta:
            tracker.version = int(meta["policy_version"])
        self.restored_from = str(path)
        return control
