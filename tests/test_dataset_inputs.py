"""TorchRLBufferDataset on awkward input: small and batch-shaped buffers, bad rows and
arguments (each a clear error naming the key or argument), ragged ListStorage rollouts, and
epoch passes beside a live writer (threads, DataLoader workers)."""

import threading
import time

import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader
from torchrl.data import LazyStackStorage, LazyTensorStorage, ListStorage, ReplayBuffer

from torchrl_trl import _buffers, testing
from torchrl_trl.data import EpochPass, RowColumns, Sharding, TorchRLBufferDataset, sharding


def _ids_buffer(n, storage=LazyTensorStorage, capacity=100_000):
    rb = ReplayBuffer(storage=storage(capacity))
    rb.extend(TensorDict({"x": torch.arange(n)}, [n]))
    return rb


def _xs(rows):
    return [int(r["x"]) for r in rows]


# ---------------------------------------------------------------------------
# Small and batch-shaped buffers
# ---------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("n,num_shards", [(1, None), (3, None), (5, 8)])
def test_epoch_with_fewer_items_than_shards(n, num_shards):
    rb = _ids_buffer(n)
    ds = TorchRLBufferDataset(
        rb, 1, reading=EpochPass(shuffle=True), keys=["x"], sharding=Sharding(num_shards=num_shards)
    )
    assert sorted(_xs(ds.as_hf_dataset())) == list(range(n))
    assert sorted(_xs(ds)) == list(range(n))
    assert sorted(_xs(ds.as_hf_dataset(map_style=True))) == list(range(n))
    hf = ds.as_hf_dataset()  # split over 2 ranks: some shards are empty
    assert sorted(_xs(hf.shard(2, 0)) + _xs(hf.shard(2, 1))) == list(range(n))
    loader = DataLoader(hf, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert sorted(_xs(loader)) == list(range(n))


@pytest.fixture(scope="module")
def grouped_rollouts(policy_and_tokenizer):
    """``TransformersWrapper(num_samples=2)`` output: 3 prompts x 2 samples, batch ``[3, 2]``."""
    model, tok = policy_and_tokenizer
    policy = testing.make_policy_wrapper(model, tok, pad_output=True, max_new_tokens=4, input_mode="text",
                                         num_samples=2)
    torch.manual_seed(0)
    return policy(TensorDict({"text": {"prompt": ["hi", "ho there", "x"]}}, batch_size=[3]))


@pytest.mark.parametrize("storage", [LazyStackStorage, ListStorage, LazyTensorStorage])
def test_len_counts_rows_of_batch_shaped_items(grouped_rollouts, storage):
    rb = ReplayBuffer(storage=storage(20))
    rb.extend(grouped_rollouts.to_tensordict() if storage is LazyTensorStorage else grouped_rollouts)
    assert len(rb) == 3  # items of batch shape [2]
    ds = TorchRLBufferDataset(rb, 2, reading="epoch", format=RowColumns("sft_tokenized", index_column="item"))
    hf_rows, rows = list(ds.as_hf_dataset()), list(ds)
    assert len(ds) == len(hf_rows) == len(rows) == 6
    # each item's two samples, with the item's storage index, in the item's order
    assert [r["item"] for r in hf_rows] == [0, 0, 1, 1, 2, 2]
    ref = [rb[i // 2][i % 2] for i in range(6)]  # each sample alone
    expected = [(t["tokens", "prompt"][t["masks", "all_attention_mask"][: t["tokens", "prompt"].shape[-1]]].tolist(),
                 t["tokens", "response"][t["masks", "all_attention_mask"][-t["tokens", "response"].shape[-1]:]].tolist())
                for t in ref]
    assert [(r["input_ids"], r["completion_mask"]) for r in hf_rows] == [
        (p + c, [0] * len(p) + [1] * len(c)) for p, c in expected
    ]
    assert len(TorchRLBufferDataset(rb, 2, format="sft_tokenized", reading=EpochPass(num_passes=3))) == 18


# ---------------------------------------------------------------------------
# Bad arguments and rows: a clear error naming the key or argument
# ---------------------------------------------------------------------------


def _token_rows(dtype):
    n, t = 4, 3
    return TensorDict({
        "tokens": {"prompt": torch.ones(n, t, dtype=dtype), "response": torch.full((n, t), 2, dtype=dtype)},
        "text": {"prompt": [f"p{i}" for i in range(n)], "response": [f"r{i}" for i in range(n)]},
    }, [n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_non_integer_token_ids_raise_naming_the_key(dtype):
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(_token_rows(dtype))
    with pytest.raises(TypeError, match=rf"key 'tokens.prompt': token ids must be integers, got dtype {dtype}"):
        TorchRLBufferDataset(rb, 2, reading="epoch", format="sft_tokenized")
    with pytest.raises(TypeError, match=r"key 'tokens.response': token ids must be integers"):
        TorchRLBufferDataset(rb, 2, reading="epoch", keys=["tokens.response"])


@pytest.mark.parametrize("bad", [None, 123])
def test_non_string_text_raises_naming_the_key(bad):
    rb = ReplayBuffer(storage=ListStorage(8))
    rb.extend([{"text": {"prompt": f"p{i}", "response": f"r{i}" if i != 1 else bad}} for i in range(3)])
    with pytest.raises(TypeError, match=rf"'response'.*sample 1 holds {type(bad).__name__}.*expected a string"):
        list(TorchRLBufferDataset(rb, 3, reading="epoch", format="sft").as_hf_dataset())


def test_list_storage_dict_rows_must_share_keys():
    rb = ReplayBuffer(storage=ListStorage(10))
    rb.extend([{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(4)])
    rb.add({"prompt": "p4", "completion": "c4", "answer": "42"})  # an extra key, row 4
    ds = TorchRLBufferDataset(rb, 2, reading="epoch", keys=["prompt"])
    with pytest.raises(ValueError, match=r"row 4 has key 'answer' that row \d lacks"):
        list(ds.as_hf_dataset())
    rb = ReplayBuffer(storage=ListStorage(10))
    rb.extend([{"prompt": f"p{i}", "meta": {"id": i, "src": "a"}} for i in range(3)])
    rb.add({"prompt": "p3", "meta": {"id": 3}})  # a nested key missing, row 3
    ds = TorchRLBufferDataset(rb, 4, reading="epoch", keys=["prompt", "meta.id"])
    with pytest.raises(KeyError, match=r"row 3 lacks key 'meta.src' that row 0 has"):
        list(ds)
    rb = ReplayBuffer(storage=ListStorage(10))
    rb.extend([{"prompt": "a"}, {"completion": "b"}])  # the constructor's peek sees it at once
    with pytest.raises(KeyError, match=r"row 1 lacks key 'prompt'"):
        TorchRLBufferDataset(rb, 2, keys=["prompt"])


def test_sample_filter_must_return_one_bool_per_row():
    rb = _ids_buffer(6)
    for wrong in (lambda b: torch.ones(3, dtype=torch.bool), lambda b: [True] * 7):
        ds = TorchRLBufferDataset(rb, 4, reading="epoch", keys=["x"], format=RowColumns(sample_filter=wrong))
        with pytest.raises(ValueError, match=r"sample_filter returned \d values .* expected shape \[4\]"):
            list(ds)
    ds = TorchRLBufferDataset(rb, 4, reading="epoch", keys=["x"], format=RowColumns(sample_filter=lambda b: b["x"] % 2))
    with pytest.raises(TypeError, match=r"sample_filter must return bools .* got dtype torch.int64"):
        list(ds)
    keep_even = TorchRLBufferDataset(rb, 4, reading="epoch", keys=["x"],
                                     format=RowColumns(sample_filter=lambda b: b["x"] % 2 == 0))
    assert _xs(keep_even) == [0, 2, 4]
    with pytest.raises(TypeError, match="RowColumns: sample_filter must be callable"):
        RowColumns(sample_filter=True)


# ---------------------------------------------------------------------------
# ListStorage of ragged rollouts (dense samples whose Tokens are lazy stacks)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ragged_list_buffer(policy_and_tokenizer):
    """``TransformersWrapper(pad_output=False)`` outputs of prompts of different lengths in
    a ``ListStorage``: ``rb[:]`` is a dense TensorDict whose ``tokens`` are a lazy stack."""
    from torchrl.data.llm import History

    model, tok = policy_and_tokenizer
    policy = testing.make_policy_wrapper(model, tok, pad_output=False, max_new_tokens=4, input_mode="history")
    rb = ReplayBuffer(storage=ListStorage(20))
    torch.manual_seed(0)
    for b in range(3):
        chats = [[{"role": "user", "content": "hi " * (i + b + 1)}] for i in range(2)]
        rb.extend(policy(TensorDict({"history": {"prompt": History.from_chats(chats)}}, batch_size=[2])))
    return rb


def test_list_storage_ragged_rollouts_raw_keys_and_sft_tokenized(ragged_list_buffer):
    rb = ragged_list_buffer
    items = [rb[i] for i in range(len(rb))]  # the reference: each rollout alone
    with pytest.raises(RuntimeError):  # the layout at stake: rows that cannot be stacked
        rb[:].get(("tokens", "prompt"))
    keys = ["tokens.prompt", "tokens.response", "log_probs.response", "text.response"]
    ds = TorchRLBufferDataset(rb, 4, reading="epoch", keys=keys)
    for rows in (list(ds.as_hf_dataset()), [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in r.items()}
                                             for r in ds]):
        assert len(rows) == 6
        assert [r["tokens.prompt"] for r in rows] == [t["tokens", "prompt"].tolist() for t in items]
        assert [r["tokens.response"] for r in rows] == [t["tokens", "response"].tolist() for t in items]
        assert [r["text.response"] for r in rows] == [t["text", "response"] for t in items]
        for r, t in zip(rows, items):
            assert r["log_probs.response"] == pytest.approx(t["log_probs", "response"].tolist())
    hf = list(TorchRLBufferDataset(rb, 4, reading="epoch", format="sft_tokenized").as_hf_dataset())
    assert [r["input_ids"] for r in hf] == [
        t["tokens", "prompt"].tolist() + t["tokens", "response"].tolist() for t in items
    ]
    online = list(TorchRLBufferDataset(rb, 3, num_batches=4, format="sft_tokenized"))
    whole = {tuple(r["input_ids"]) for r in hf}
    assert len(online) == 12 and {tuple(r["input_ids"]) for r in online} <= whole


# ---------------------------------------------------------------------------
# Epoch passes beside a live writer
# ---------------------------------------------------------------------------


class _Writer(threading.Thread):
    """Adds items ``x = 40, 41, ...`` one at a time until stopped (``pause``: seconds
    between writes; 0 writes continuously)."""

    def __init__(self, rb, pause=0.0005):
        super().__init__(daemon=True)
        self.rb, self.pause, self.stop = rb, pause, threading.Event()
        self.writes, self._wrote = 0, threading.Condition()

    def run(self):
        i = int(self.rb[len(self.rb) - 1]["x"]) + 1
        while not self.stop.is_set():
            self.rb.extend(TensorDict({"x": torch.tensor([i])}, [1]))
            i += 1
            with self._wrote:
                self.writes += 1
                self._wrote.notify_all()
            time.sleep(self.pause)

    def wait_for_a_write(self):
        """Return once the writer has added another item."""
        with self._wrote:
            n = self.writes
            assert self._wrote.wait_for(lambda: self.writes > n, timeout=30), "the writer stopped writing"

    def interleave(self, rows):
        """``rows``, each yielded after one more write: the pass is read while writes land."""
        for row in rows:
            self.wait_for_a_write()
            yield row

    def __enter__(self):
        self.start()
        self.wait_for_a_write()  # writing has begun
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()


def _slow(batch):
    # forked workers have no writer thread to wait for: pace the pass, the parent writes on
    time.sleep(0.003)
    return [0] * batch.numel()


def _assert_one_pass(xs, before, after):
    """The pass read the items stored when it began, each once, and nothing written later."""
    assert sorted(xs) == list(range(len(xs))), "items missed, duplicated or written mid-pass"
    assert before <= len(xs) < after, (before, len(xs), after)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("storage", [LazyTensorStorage, LazyStackStorage])
@pytest.mark.parametrize("shuffle", [False, True])
def test_epoch_pass_beside_writer_thread(storage, shuffle):
    rb = _ids_buffer(40, storage)
    ds = TorchRLBufferDataset(rb, 2, reading=EpochPass(shuffle=shuffle), keys=["x"])
    with _Writer(rb) as writer:
        for read in (lambda: ds.as_hf_dataset(), lambda: ds):
            before = len(rb)
            xs = _xs(list(writer.interleave(read())))
            _assert_one_pass(xs, before, len(rb))


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("hf", [True, False], ids=["hf", "torch"])
def test_epoch_pass_beside_writer_with_forked_workers(hf):
    """Workers forked while the writer writes continuously: no deadlock (the fork waits
    for the write in progress), and every worker reads the same items."""
    rb = _ids_buffer(40)
    ds = TorchRLBufferDataset(
        rb, 2, reading=EpochPass(shuffle=True), keys=["x"], format=RowColumns(columns={"slow": _slow})
    )
    with _Writer(rb, pause=0) as writer:
        for _ in range(2):
            loader = DataLoader(ds.as_hf_dataset() if hf else ds, batch_size=None, num_workers=2,
                                multiprocessing_context="fork")
            before = len(rb)
            xs = _xs(loader)
            writer.wait_for_a_write()  # at least one write the pass must not hold
            _assert_one_pass(xs, before, len(rb))


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_online_sampling_beside_writer_with_forked_workers():
    """A forked worker's copy of an in-memory tensor storage stops at the fork: its
    sampler must not draw rows written later (it would read uninitialised memory)."""
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000))
    rb.extend(TensorDict({"x": torch.arange(1, 41)}, [40]))  # 0 would be an unwritten row
    ds = TorchRLBufferDataset(rb, 8, num_batches=30, keys=["x"])
    with _Writer(rb, pause=0):
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        xs = _xs(loader)
    assert len(xs) == 2 * 30 * 8 and min(xs) > 0


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_worker_forked_mid_write_is_refused(monkeypatch):
    """A buffer whose lock another thread holds past the fork wait is refused in the
    worker with a clear error, not read torn or waited on forever."""
    monkeypatch.setattr(_buffers, "_FORK_WAIT_S", 0.2)
    rb = _ids_buffer(8)
    ds = TorchRLBufferDataset(rb, 2, reading="epoch", keys=["x"])
    held, release = threading.Event(), threading.Event()

    def stuck_writer():
        with rb._replay_lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=stuck_writer, daemon=True)
    t.start()
    held.wait(5)
    try:
        loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork")
        with pytest.raises(RuntimeError, match=r"forked while the buffer was written.*num_workers=0"):
            for _ in loader:  # (not list(): its len() hint would wait for the buffer's lock)
                pass
    finally:
        release.set()
        t.join()
    assert sorted(_xs(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork"))) == list(range(8))



# ---------------------------------------------------------------------------
# Sharding: the one place that knows ranks, workers and shards
# ---------------------------------------------------------------------------


def test_sharding_counts_seeds_and_process():
    import numpy as np
    from accelerate import PartialState

    for n in range(0, 23):
        for k in range(1, 9):  # numpy's array_split as the independent reference
            assert sharding.split_count(n, k) == [len(p) for p in np.array_split(np.arange(n), k)]
    seeds = {sharding.stream_seed(0, rank, stream, worker, 1) for rank in range(2) for stream in range(3) for worker in range(2)}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)
    assert sharding.stream_seed(5, 0, 1) == sharding.stream_seed(5, 0, 1)
    state = PartialState()
    assert sharding.Sharding().process() == (state.process_index, state.num_processes) == (0, 1)
    assert sharding.Sharding().shards(4) == 4 and sharding.Sharding(num_shards=3).shards(4) == 3
    order = sharding.epoch_order(10, shuffle=True, seed=2, epoch=1)
    assert sorted(order.tolist()) == list(range(10)) and order.tolist() != list(range(10))
    assert order.tolist() == sharding.epoch_order(10, shuffle=True, seed=2, epoch=1).tolist()
    assert order.tolist() != sharding.epoch_order(10, shuffle=True, seed=2, epoch=2).tolist()
