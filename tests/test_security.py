"""Security and durability of the online pieces: buffer checkpoints never unpickle, saves
are atomic, mixed or crafted checkpoints are refused, bad priority indices raise, a
collector that blocks cannot hang ``collect()``."""

import json
import os
import pickle
import shutil
import threading

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, TensorDictBase, is_tensorclass
from torchrl.data import LazyMemmapStorage, LazyStackStorage, LazyTensorStorage, ListStorage, ReplayBuffer

from torchrl_trl import testing
from torchrl_trl.online import (
    CollectorCallback,
    CollectorError,
    TensorPrioritizedSampler,
    load_buffer,
    save_buffer,
    update_priorities,
)
from torchrl_trl.online import checkpoint as ckpt
from torchrl_trl.online.checkpoint import BufferCheckpointError

ROWS = [{"query": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]


class _Payload:
    """Unpickling this creates ``marker``: the proof that a pickle ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _write_pickle(path, marker):
    torch.save({"items": [_Payload(marker)], "sampler": {}, "writer": {}}, path)


def test_the_payload_is_live(tmp_path):
    # the test below would prove nothing if the payload did not run when unpickled
    _write_pickle(tmp_path / "p.pt", tmp_path / "ran")
    torch.load(tmp_path / "p.pt", weights_only=False)
    assert (tmp_path / "ran").exists()


def test_crafted_pickle_checkpoints_are_refused_not_run(tmp_path):
    marker = tmp_path / "PWNED"
    rb = ReplayBuffer(storage=LazyStackStorage(8))
    # 1. the old (pickle) layout: items.pt + meta.json
    old = tmp_path / "old"
    old.mkdir()
    _write_pickle(old / "items.pt", marker)
    (old / "meta.json").write_text(json.dumps({"method": "items", "len": 1, "write_count": 1}))
    with pytest.raises(BufferCheckpointError, match=r"items.pt.*pickle"):
        load_buffer(rb, old)
    # 2. a manifest that vouches for a pickle in place of the safetensors file
    save_buffer(_small_stack_buffer(), tmp_path / "good")
    crafted = tmp_path / "crafted"
    shutil.copytree(tmp_path / "good", crafted)
    _write_pickle(crafted / ckpt.TENSORS, marker)
    manifest = json.loads((crafted / ckpt.MANIFEST).read_text())
    manifest["files"][ckpt.TENSORS] = {"size": (crafted / ckpt.TENSORS).stat().st_size,
                                       "sha256": ckpt._sha256(crafted / ckpt.TENSORS)}
    (crafted / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BufferCheckpointError, match="tensors.safetensors.*not a safetensors file"):
        load_buffer(rb, crafted)
    # 3. a structure that names a class to build: only the allow-list is rebuilt
    evil = tmp_path / "evil"
    shutil.copytree(tmp_path / "good", evil)
    structure = json.loads((evil / ckpt.STRUCTURE).read_text())
    structure["items"]["v"][0] = {"T": "tensorclass", "cls": "subprocess.Popen", "td": {"T": "py", "v": None},
                                  "non_td": {"T": "dict", "v": {}}}
    (evil / ckpt.STRUCTURE).write_text(json.dumps(structure))
    manifest = json.loads((evil / ckpt.MANIFEST).read_text())
    manifest["files"][ckpt.STRUCTURE] = {"size": (evil / ckpt.STRUCTURE).stat().st_size,
                                         "sha256": ckpt._sha256(evil / ckpt.STRUCTURE)}
    (evil / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BufferCheckpointError, match=r"'subprocess.Popen' at 'items/0'.*not an allowed class"):
        load_buffer(rb, evil)
    # 4. the prioritised sampler's own files
    sampler = TensorPrioritizedSampler(4)
    (tmp_path / "prio").mkdir()
    _write_pickle(tmp_path / "prio" / "priority.safetensors", marker)
    with pytest.raises(ValueError, match="priority.safetensors.*safetensors"):
        sampler.loads(tmp_path / "prio")
    assert not marker.exists()
    assert len(rb) == 0  # nothing half-loaded


def _small_stack_buffer(offset=0, n=3):
    rb = ReplayBuffer(storage=LazyStackStorage(8))
    rb.extend(_ragged_items(offset, n))
    return rb


def _ragged_items(offset, n):
    from tensordict import lazy_stack

    return lazy_stack([TensorDict({"tokens": torch.arange(offset, offset + 2 + i), "text": f"row {offset + i}"}, [])
                       for i in range(n)])


def _assert_same(a, b, path=()):
    """Structural equality, written independently of the checkpoint code: same types at
    every level, equal tensors (dtype too), equal non-tensor data."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, NonTensorData):
        assert a.data == b.data and a.batch_size == b.batch_size, path
    elif isinstance(a, LazyStackedTensorDict):  # NonTensorStack too
        assert a.stack_dim == b.stack_dim and len(a.tensordicts) == len(b.tensordicts), path
        for i, (x, y) in enumerate(zip(a.tensordicts, b.tensordicts)):
            _assert_same(x, y, path + (i,))
    elif is_tensorclass(a):
        _assert_same(a._tensordict, b._tensordict, path)
    elif isinstance(a, TensorDictBase):
        assert a.batch_size == b.batch_size and set(a.keys()) == set(b.keys()), (path, set(a.keys()) ^ set(b.keys()))
        for k in a.keys():
            _assert_same(a._get_str(k, None), b._get_str(k, None), path + (k,))
    else:
        assert a == b, path


def test_round_trip_real_llm_rollouts(policy_and_tokenizer, tmp_path):
    """LazyStackStorage of LLMCollector chat rollouts (ragged tokens, text, History,
    Tokens/Masks/Text/ChatHistory/LogProbs tensorclasses): every item equal after load."""
    model, tok = policy_and_tokenizer
    env = testing.make_chat_env(ROWS, batch_size=2, group_size=2)
    rb = testing.collect_rollouts(testing.make_policy_wrapper(model, tok, max_new_tokens=4), env, total_turns=8)
    assert len({rb.storage.get(i)["tokens", "full"].numel() for i in range(len(rb))}) > 1  # really ragged
    save_buffer(rb, tmp_path / "b", extra={"policy_version": 3})
    rb2 = ReplayBuffer(storage=LazyStackStorage(16))
    meta = load_buffer(rb2, tmp_path / "b")
    assert meta["len"] == len(rb2) == 8 and meta["policy_version"] == 3
    for i in range(8):
        _assert_same(rb.storage.get(i), rb2.storage.get(i))
    assert not list(tmp_path.glob(".b.*"))  # no temporary directory left behind


@pytest.mark.parametrize("storage", [LazyTensorStorage, LazyMemmapStorage, ListStorage])
def test_round_trip_tensor_and_list_storages(storage, tmp_path):
    cap = 6
    def kwargs(name):
        return {"scratch_dir": tmp_path / name} if storage is LazyMemmapStorage else {}

    sampler = TensorPrioritizedSampler(cap)
    rb = ReplayBuffer(storage=storage(cap, **kwargs("scratch")), sampler=sampler)
    for start in (0, 4):  # 8 items into 6 slots: the writer wraps around
        ids = torch.arange(start, start + 4)
        batch = TensorDict({"ids": ids, "x": torch.randn(4, 3), "n": {"b": ids.bool()}, "text": [f"t{i}" for i in ids]}, [4])
        rb.extend(batch)
    update_priorities(rb, [1, 5], [2.5, 7.0])
    save_buffer(rb, tmp_path / "b")
    rb2 = ReplayBuffer(storage=storage(cap, **kwargs("scratch2")), sampler=TensorPrioritizedSampler(cap))
    meta = load_buffer(rb2, tmp_path / "b")
    assert len(rb2) == meta["len"] == cap and meta["write_count"] == rb.write_count == 8
    if storage is ListStorage:
        for i in range(cap):
            _assert_same(rb.storage.get(i), rb2.storage.get(i))
    else:
        _assert_same(rb.storage.get(torch.arange(cap)), rb2.storage.get(torch.arange(cap)))
    torch.testing.assert_close(rb2._sampler.priorities(), sampler.priorities())
    if storage is LazyMemmapStorage:
        assert rb2.storage._storage.is_memmap()
    rb2.extend(TensorDict({"ids": torch.tensor([99]), "x": torch.zeros(1, 3), "n": {"b": torch.tensor([True])},
                           "text": ["new"]}, [1]))
    assert int(rb2[2]["ids"]) == 99  # the writer's cursor came back (8 % 6 = 2)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "b"
    save_buffer(_small_stack_buffer(0), path)
    real_write = ckpt._write_files

    def dies_midway(directory, tensors, structure):
        real_write(directory, tensors, structure)
        (directory / ckpt.STRUCTURE).write_text("{")  # half written
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, "_write_files", dies_midway)
    with pytest.raises(OSError, match="simulated"):
        save_buffer(_small_stack_buffer(100, 5), path)
    monkeypatch.undo()
    # the swap itself failing: the old directory is put back
    real_replace = os.replace
    calls = []

    def second_replace_fails(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError("rename failed (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", second_replace_fails)
    with pytest.raises(OSError, match="rename failed"):
        save_buffer(_small_stack_buffer(200, 4), path)
    monkeypatch.undo()
    rb = ReplayBuffer(storage=LazyStackStorage(8))
    load_buffer(rb, path)
    _assert_same(rb[:], _small_stack_buffer(0)[:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # nothing left behind


def test_mixed_or_partial_checkpoints_are_refused(tmp_path):
    save_buffer(_small_stack_buffer(0), tmp_path / "a")
    save_buffer(_small_stack_buffer(50, 4), tmp_path / "b")
    rb = ReplayBuffer(storage=LazyStackStorage(8))
    # new data files under an old manifest
    shutil.copy(tmp_path / "b" / ckpt.TENSORS, tmp_path / "a" / ckpt.TENSORS)
    with pytest.raises(BufferCheckpointError, match="tensors.safetensors.*does not match manifest.json"):
        load_buffer(rb, tmp_path / "a")
    (tmp_path / "b" / ckpt.STRUCTURE).unlink()
    with pytest.raises(BufferCheckpointError, match="structure.json.*missing"):
        load_buffer(rb, tmp_path / "b")
    (tmp_path / "b" / ckpt.MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
        load_buffer(rb, tmp_path / "b")
    save_buffer(_small_stack_buffer(0), tmp_path / "c")
    with pytest.raises(BufferCheckpointError, match="LazyTensorStorage"):
        load_buffer(ReplayBuffer(storage=LazyTensorStorage(8)), tmp_path / "c")
    assert len(rb) == 0


def test_save_refuses_what_needs_pickle(tmp_path):
    rb = ReplayBuffer(storage=ListStorage(4))
    rb.extend([{"ok": 1, "bad": object()}])
    with pytest.raises(TypeError, match=r"'items/0/bad'.*object"):
        save_buffer(rb, tmp_path / "b")
    assert not (tmp_path / "b").exists() and not list(tmp_path.iterdir())

    class RemoteBuffer:  # what a RayReplayBuffer looks like from here: no local storage
        write_count = 0

        def __len__(self):
            return 0

    with pytest.raises(TypeError, match="RemoteBuffer keeps its storage elsewhere"):
        save_buffer(RemoteBuffer(), tmp_path / "r")


def test_prioritized_sampler_files_round_trip(tmp_path):
    sampler = TensorPrioritizedSampler(5)
    sampler.update_priority([1, 3], [4.0, 9.0])
    sampler.dumps(tmp_path / "s")
    other = TensorPrioritizedSampler(5)
    other.loads(tmp_path / "s")
    assert other.priorities().tolist() == sampler.priorities().tolist() and other._max_priority == 9.0
    with pytest.raises(ValueError, match=r"max_capacity=3"):
        TensorPrioritizedSampler(3).loads(tmp_path / "s")


def test_update_priorities_rejects_bad_indices():
    sampler = TensorPrioritizedSampler(8)
    rb = ReplayBuffer(storage=LazyTensorStorage(8), sampler=sampler)
    rb.extend(TensorDict({"x": torch.arange(5)}, [5]))
    with pytest.raises(TypeError, match=r"indices must be integer.*float32"):
        update_priorities(rb, torch.tensor([1.7, 2.0]), [1.0, 1.0])
    with pytest.raises(TypeError, match="indices"):
        update_priorities(rb, [0.5], [1.0])
    with pytest.raises(IndexError, match=r"indices \[5\] are outside the 5 stored items"):
        update_priorities(rb, [1, 5], [1.0, 1.0])
    with pytest.raises(IndexError, match=r"indices \[-1\]"):
        update_priorities(rb, [-1], [1.0])
    assert sampler.priorities(5).tolist() == [1.0] * 5  # nothing was written


class _BlockingCollector:
    """A collector whose iterator blocks forever on its second batch (a stuck env or
    generation server)."""

    def __init__(self):
        self.replay_buffer = ReplayBuffer(storage=LazyTensorStorage(16))
        self.frames_per_batch = 2
        self.release = threading.Event()

    def __iter__(self):
        self.replay_buffer.extend(TensorDict({"x": torch.arange(2)}, [2]))
        yield None
        self.release.wait()  # never set by collect(); the test sets it to clean up
        yield None


@pytest.mark.timeout(60)
def test_sync_collect_on_a_blocking_collector_times_out():
    collector = _BlockingCollector()
    cb = CollectorCallback(collector, wait_timeout=1.0)
    assert cb.collect(2) == 2
    # the blocked batch never returns: only wait_timeout can end this call (the test's
    # timeout ends a hang)
    with pytest.raises(CollectorError, match=r"did not finish within wait_timeout=1.0s") as info:
        cb.collect(2)
    assert isinstance(info.value.__cause__, TimeoutError)
    with pytest.raises(CollectorError, match="still running") as info:
        cb.collect(2)  # refused without waiting again: the stuck batch still owns the iterator
    assert "a previous collector batch" in str(info.value.__cause__)
    assert len(collector.replay_buffer) == 2  # what was stored is kept
    collector.release.set()
    with pytest.raises(ValueError, match="wait_timeout"):
        CollectorCallback(collector, wait_timeout=0)


def test_malformed_structure_and_wrong_sampler_are_refused(tmp_path):
    save_buffer(_small_stack_buffer(0), tmp_path / "b")
    evil = tmp_path / "b"
    (evil / ckpt.STRUCTURE).write_text(json.dumps({"storage": "list", "items": {"T": "lazy_stack"}}))
    manifest = json.loads((evil / ckpt.MANIFEST).read_text())
    manifest["files"][ckpt.STRUCTURE] = {"size": (evil / ckpt.STRUCTURE).stat().st_size,
                                         "sha256": ckpt._sha256(evil / ckpt.STRUCTURE)}
    (evil / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BufferCheckpointError, match="structure.json.*malformed"):
        load_buffer(ReplayBuffer(storage=LazyStackStorage(8)), evil)
    # priorities saved from a TensorPrioritizedSampler(8) do not fit a 4-slot one
    rb = ReplayBuffer(storage=LazyTensorStorage(8), sampler=TensorPrioritizedSampler(8))
    rb.extend(TensorDict({"x": torch.arange(3)}, [3]))
    save_buffer(rb, tmp_path / "p")
    other = ReplayBuffer(storage=LazyTensorStorage(8), sampler=TensorPrioritizedSampler(4))
    with pytest.raises(BufferCheckpointError, match="TensorPrioritizedSampler"):
        load_buffer(other, tmp_path / "p")
    assert len(other) == 0
    plain = ReplayBuffer(storage=LazyTensorStorage(8))  # items only, e.g. to inspect them
    load_buffer(plain, tmp_path / "p", restore_state=False)
    assert plain[:]["x"].tolist() == [0, 1, 2]
