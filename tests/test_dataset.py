"""TorchRLBufferDataset: storages, formats, features, epoch/online modes, workers, errors."""

import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader
from torchrl.data import LazyMemmapStorage, LazyStackStorage, LazyTensorStorage, ListStorage, ReplayBuffer

from torchrl_trl import layouts
from torchrl_trl.data import (
    BufferFormat,
    EpochPass,
    OnlineSampling,
    RowColumns,
    Sharding,
    TorchRLBufferDataset,
    register_format,
)
from torchrl_trl.data.formats import available_formats, get_format


def _dense(n=10, t=6, storage=LazyTensorStorage):
    rb = ReplayBuffer(storage=storage(32))
    ids = torch.arange(n * t).view(n, t)
    rb.extend(TensorDict({"input_ids": ids, "meta": {"score": torch.arange(n).float()}}, [n]))
    return rb, ids


def _as_list(rows):
    return rows


def _ids(rows, key="input_ids"):
    return [tuple(torch.as_tensor(r[key]).tolist()) for r in rows]


@pytest.mark.parametrize("storage", [LazyTensorStorage, LazyMemmapStorage], ids=["tensor", "memmap"])
def test_dense_storages_epoch_and_upstream_keys(storage):
    from torchrl.modules.llm.trl_interop import TorchRLBufferDataset as Upstream

    rb, ids = _dense(storage=storage)
    ds = TorchRLBufferDataset(rb, 4, reading="epoch")
    rows = list(ds)
    assert len(ds) == 10 and _ids(rows) == [tuple(r) for r in ids.tolist()]
    assert [r["meta.score"].item() for r in rows] == list(range(10))
    up = next(iter(Upstream(rb, 4)))
    assert set(up) == set(rows[0]) and type(up["input_ids"]) is type(rows[0]["input_ids"])
    hf = ds.as_hf_dataset()
    assert dict(hf.features) == {"input_ids": hf.features["input_ids"], "meta.score": hf.features["meta.score"]}
    assert str(hf.features["meta.score"].dtype) == "float32"
    assert [r["input_ids"] for r in hf] == ids.tolist()


def test_list_storage_dicts_and_tensordicts():
    rb = ReplayBuffer(storage=ListStorage(10))
    rb.extend([{"prompt": f"p{i}", "completion": f"c{i}", "x": i} for i in range(5)])
    rows = list(TorchRLBufferDataset(rb, 2, keys=["prompt", "completion"], reading="epoch").as_hf_dataset())
    assert rows == [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]
    online = list(TorchRLBufferDataset(rb, 3, num_batches=2, keys=["x"]))
    assert len(online) == 6 and all(0 <= int(r["x"]) < 5 for r in online)
    rb2 = ReplayBuffer(storage=ListStorage(10))
    for i in range(5):
        rb2.add(TensorDict({"text": {"prompt": f"q{i}"}, "ids": torch.arange(i + 1)}, []))
    ds = TorchRLBufferDataset(rb2, 2, format=RowColumns(columns={"prompt": "text.prompt", "input_ids": "ids"}), reading="epoch")
    rows = list(ds.as_hf_dataset())
    assert rows == [{"prompt": f"q{i}", "input_ids": list(range(i + 1))} for i in range(5)]


@pytest.fixture(scope="module", params=[False, True], ids=["ragged", "padded"])
def rollouts(request, policy_and_tokenizer):
    from torchrl_trl import testing

    model, tok = policy_and_tokenizer
    env = testing.make_chat_env([{"query": f"say {i}", "answer": str(i)} for i in range(4)], batch_size=2, group_size=2)
    policy = testing.make_policy_wrapper(model, tok, pad_output=request.param, max_new_tokens=5)
    return testing.collect_rollouts(policy, env, total_turns=8)


def test_lazy_stack_rollouts_formats_and_features(rollouts, policy_and_tokenizer):
    _, tok = policy_and_tokenizer
    assert isinstance(rollouts.storage, LazyStackStorage)
    td = rollouts[:]
    prompts, responses = layouts.read_tokens(td, "prompt").tolist(), layouts.read_tokens(td, "response").tolist()
    for name in ["sft", "sft_conversational", "sft_messages", "sft_tokenized", "grpo", "grpo_conversational"]:
        ds = TorchRLBufferDataset(rollouts, 3, format=name, keys=["answer"], reading="epoch")
        hf = ds.as_hf_dataset()
        rows = list(hf)
        assert len(rows) == 8
        assert list(hf.features) == list(rows[0]) == [*get_format(name).features(), "answer"]
        hf.features.encode_example(rows[0])  # the declared schema accepts what is yielded
        assert [r["answer"] for r in rows] == layouts.read_column(td, "answer")
        if name == "sft_tokenized":
            assert [r["input_ids"] for r in rows] == [p + r for p, r in zip(prompts, responses)]
            assert [r["completion_mask"] for r in rows] == [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses)]
            assert tok.pad_token_id not in sum((r["input_ids"] for r in rows), [])
        if name == "grpo":
            assert [r["prompt"] for r in rows] == layouts.read_text(td, "prompt")
        if name == "sft_conversational":
            assert [r["completion"] for r in rows] == layouts.read_history(td, "response")
            assert set(rows[0]["completion"][0]) == {"role", "content"}
    # raw token keys yield only the real tokens (padded rollouts too)
    raw = list(TorchRLBufferDataset(rollouts, 4, keys=["tokens.response"], reading="epoch"))
    assert [r["tokens.response"].tolist() for r in raw] == responses


def test_a_batch_is_walked_once_and_each_key_read_once(rollouts, monkeypatch):
    """However many keys a format, ``keys=`` and named columns read, a batch's lazy stack is
    walked once and each of its keys read once from its members (layouts.read_once)."""
    from torchrl_trl import _ragged

    batches, reads = [], []
    init, get_values = _ragged.Batch.__init__, _ragged.get_values
    monkeypatch.setattr(_ragged.Batch, "__init__", lambda self, td: batches.append(td) or init(self, td))
    monkeypatch.setattr(_ragged, "get_values", lambda td, key: reads.append((id(td), key)) or get_values(td, key))
    for name in ["sft", "sft_conversational", "sft_tokenized", "grpo"]:
        columns = RowColumns(name, columns={"ids": "tokens.full", "n": lambda b: layouts.read_tokens(b).lengths})
        ds = TorchRLBufferDataset(rollouts, 8, format=columns, keys=["answer", "tokens.response"], reading="epoch")
        batches.clear(), reads.clear()
        assert len(list(ds)) == 8
        assert len(batches) == 1 and reads and len(reads) == len(set(reads)), name


def test_token_rows_are_lists_whose_tensors_are_private_copies(rollouts):
    """What TRL does to token rows (``torch.tensor``, truncation by slicing, its collator) sees
    the list's values; tensors made from a row never share memory with it."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    td = rollouts[:]
    prompts, responses = layouts.read_tokens(td, "prompt").tolist(), layouts.read_tokens(td, "response").tolist()
    expected = [p + r for p, r in zip(prompts, responses)]
    rows = list(TorchRLBufferDataset(rollouts, 3, format="sft_tokenized", reading="epoch").as_hf_dataset())
    ids = [r["input_ids"] for r in rows]
    assert all(isinstance(row, list) for row in ids) and ids == expected
    for row, want in zip(ids, expected):
        assert torch.tensor(row).tolist() == want and torch.tensor(row).dtype == torch.int64
        for sl in (slice(None, 3), slice(-2, None), slice(None, None, -2), slice(1, 4, 2)):
            assert row[sl] == want[sl] and torch.tensor(row[sl]).tolist() == want[sl]
        torch.as_tensor(row).fill_(-1)  # a copy: the row keeps its values
        assert torch.tensor(row).tolist() == want
    row, head = ids[0], ids[0][:2]
    row.append(7)
    row[0] = 99
    assert torch.tensor(row).tolist() == [99, *expected[0][1:], 7]  # in-place changes reach tensors
    assert torch.tensor(head).tolist() == expected[0][:2]  # a slice taken before does not change

    batch = DataCollatorForLanguageModeling(pad_token_id=0)([{"input_ids": r["input_ids"][-4:]} for r in rows[1:]])
    tails = [want[-4:] for want in expected[1:]]
    width = max(map(len, tails))
    assert batch["input_ids"].tolist() == [t + [0] * (width - len(t)) for t in tails]
    assert batch["labels"].tolist() == [t + [-100] * (width - len(t)) for t in tails]


def test_tensors_true_gives_one_tensor_per_row_as_upstream(rollouts):
    responses = layouts.read_tokens(rollouts[:], "response").tolist()
    for kwargs in ({"keys": ["tokens.response"]}, {"format": RowColumns(columns={"ids": "tokens.response"})}):
        ds = TorchRLBufferDataset(rollouts, 3, reading="epoch", sharding=Sharding(num_shards=1), **kwargs)
        rows = [next(iter(row.values())) for row in ds.as_hf_dataset(tensors=True)]
        assert all(type(r) is torch.Tensor and r.ndim == 1 for r in rows)
        assert [r.tolist() for r in rows] == responses


def test_columns_callable_and_map_snapshot(rollouts):
    ds = TorchRLBufferDataset(
        rollouts, 4, reading="epoch",
        format=RowColumns(
            columns={"prompt": "text.prompt", "n_tokens": lambda b: layouts.read_tokens(b, "full").lengths.tolist()}
        ),
    )
    snap = ds.as_hf_dataset(map_style=True)
    it = list(ds.as_hf_dataset())
    assert len(snap) == 8 and snap.features == ds.features and snap.to_list() == it
    assert it[0]["n_tokens"] == len(layouts.read_tokens(rollouts[:1], "full").values)


def test_register_format():
    fmt = BufferFormat("test_double", ("input_ids",), lambda b: {"x": (b.get("input_ids")[:, 0] * 2).tolist()},
                       lambda: {"x": __import__("datasets").Value("int64")})
    register_format(fmt)
    assert "test_double" in available_formats()
    with pytest.raises(ValueError, match="already registered"):
        register_format(fmt)
    rb, ids = _dense()
    assert [r["x"] for r in TorchRLBufferDataset(rb, 4, format="test_double", reading="epoch").as_hf_dataset()] == (ids[:, 0] * 2).tolist()


def test_epoch_shuffle_seed_and_set_epoch():
    rb, ids = _dense(20)
    ds = TorchRLBufferDataset(rb, 4, reading=EpochPass(shuffle=True, seed=3))
    a = _ids(ds)
    assert sorted(a) == sorted(_ids([{"input_ids": r} for r in ids]))
    assert a == _ids(TorchRLBufferDataset(rb, 4, reading=EpochPass(shuffle=True, seed=3)))
    hf = ds.as_hf_dataset()
    assert _ids(hf) == a
    hf.set_epoch(1)  # what the trainer calls reaches the dataset
    assert ds.epoch == 1 and _ids(hf) != a and sorted(_ids(hf)) == sorted(a)


@pytest.mark.distributed
@pytest.mark.parametrize("hf", [False, True], ids=["torch", "hf"])
def test_epoch_exactly_once_two_workers(hf):
    rb, ids = _dense(22)
    ds = TorchRLBufferDataset(rb, 4, reading=EpochPass(shuffle=True))
    source = ds.as_hf_dataset() if hf else ds
    loader = DataLoader(source, batch_size=3, num_workers=2, collate_fn=_as_list)
    seen = [tuple(torch.as_tensor(r["input_ids"]).tolist()) for batch in loader for r in batch]
    assert sorted(seen) == sorted(tuple(r) for r in ids.tolist())


def test_epoch_rank_split_exactly_once():
    rb, ids = _dense(22)
    shuffled, seen = EpochPass(shuffle=True), []
    for rank in range(2):
        seen += _ids(TorchRLBufferDataset(rb, 4, reading=shuffled, sharding=Sharding(rank=rank, world_size=2)))
    assert sorted(seen) == sorted(tuple(r) for r in ids.tolist())
    # accelerate's sharding of the HF iterable (what it does when dispatch_batches=False)
    hf = TorchRLBufferDataset(rb, 4, reading=shuffled, sharding=Sharding(num_shards=4)).as_hf_dataset()
    seen = _ids(hf.shard(2, 0, contiguous=True)) + _ids(hf.shard(2, 1, contiguous=True))
    assert sorted(seen) == sorted(tuple(r) for r in ids.tolist())


@pytest.mark.distributed
def test_online_streams_differ_per_worker_and_shard():
    rb, _ = _dense(32)
    ds = TorchRLBufferDataset(rb, 8, reading=OnlineSampling(num_batches=2, seed=0))
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    rows = [tuple(r["input_ids"].tolist()) for r in loader]
    assert len(rows) == 2 * 2 * 8  # each worker draws num_batches batches (as upstream)
    assert rows[0::2] != rows[1::2]  # distinct streams per worker
    hf = TorchRLBufferDataset(
        rb, 8, reading=OnlineSampling(num_batches=4, seed=0), sharding=Sharding(num_shards=2)
    ).as_hf_dataset()
    a, b = _ids(hf.shard(2, 0)), _ids(hf.shard(2, 1))
    assert len(a) == len(b) == 16 and a != b
    assert len(_ids(hf)) == 32  # num_batches split over the shards
    assert len(list(TorchRLBufferDataset(rb, 8, num_batches=None).__iter__().__next__())) > 0


def test_bad_inputs_raise_at_once(rollouts):
    empty = ReplayBuffer(storage=LazyTensorStorage(8))
    ds = TorchRLBufferDataset(empty, 4)
    with pytest.raises(ValueError, match="replay buffer is empty"):
        next(iter(ds))
    with pytest.raises(ValueError, match="replay buffer is empty"):
        ds.as_hf_dataset()
    rb, _ = _dense()
    with pytest.raises(KeyError, match=r"'nope'.*Available keys: \['input_ids', 'meta.score'\]"):
        TorchRLBufferDataset(rb, 4, keys=["nope"])
    with pytest.raises(KeyError, match=r"'meta.nope'.*Available keys"):
        TorchRLBufferDataset(rb, 4, format=RowColumns(columns={"prompt": "meta.nope"}))
    with pytest.raises(KeyError, match=r"format 'sft' needs keys \['text.prompt', 'text.response'\].*Available keys: \['input_ids'"):
        TorchRLBufferDataset(rb, 4, format="sft")
    with pytest.raises(ValueError, match="get_format: unknown format 'no_such_format'; expected one of"):
        TorchRLBufferDataset(rb, 4, format="no_such_format")
    with pytest.raises(ValueError, match="holds 10 items, fewer than one epoch batch"):
        TorchRLBufferDataset(rb, 16, reading="epoch")
    with pytest.raises(KeyError, match="format 'grpo_conversational' needs keys"):
        TorchRLBufferDataset(rb, 4, format="grpo_conversational")
    with pytest.raises(TypeError, match="no length in online mode"):
        len(TorchRLBufferDataset(rb, 4))
    # a buffer filled after construction is checked when iteration starts
    later = TorchRLBufferDataset(empty, 4, format="sft_tokenized")
    empty.extend(TensorDict({"input_ids": torch.zeros(8, 3, dtype=torch.long)}, [8]))
    with pytest.raises(KeyError, match="format 'sft_tokenized' needs keys"):
        later.as_hf_dataset()


# ---------------------------------------------------------------------------
# Reading strategies (reading=) and the strings and num_batches= that build them
# ---------------------------------------------------------------------------


def test_reading_strategies_and_their_names():
    rb, ids = _dense(12)
    stored = sorted(tuple(r) for r in ids.tolist())
    ds = TorchRLBufferDataset(rb, 4, keys=["input_ids"], reading=EpochPass(shuffle=True, seed=3, num_passes=2))
    assert ds.reading == EpochPass(True, 3, 2) and ds.mode == "epoch"
    rows = _ids(ds)
    assert _ids(ds.as_hf_dataset()) == rows and len(ds) == 24
    assert sorted(rows[:12]) == sorted(rows[12:]) == stored and rows[:12] != rows[12:]  # 2 passes, 2 orders
    assert _ids(TorchRLBufferDataset(rb, 4, reading=EpochPass(shuffle=True, seed=4))) != rows[:12]
    assert _ids(TorchRLBufferDataset(rb, 4, reading="epoch")) == [tuple(r) for r in ids.tolist()]
    assert TorchRLBufferDataset(rb, 4, reading="epoch").reading == EpochPass()
    online = TorchRLBufferDataset(rb, 4, keys=["input_ids"], reading=OnlineSampling(num_batches=3, seed=0))
    assert TorchRLBufferDataset(rb, 4, num_batches=3, reading="online").reading == OnlineSampling(3)
    assert TorchRLBufferDataset(rb, 4, num_batches=3).reading == OnlineSampling(3)  # upstream's argument
    assert online.mode == "online" and len(_ids(online)) == 12 and set(_ids(online)) <= set(stored)
    assert len(_ids(online.as_hf_dataset())) == 12
    assert TorchRLBufferDataset(rb, 4, sharding=Sharding(num_shards=3)).sharding.num_shards == 3


@pytest.mark.parametrize("kwargs,error,match", [
    ({"reading": 3}, TypeError, "reading must be 'epoch', 'online', an EpochPass or an OnlineSampling, got int"),
    ({"reading": "offline"}, ValueError, "reading must be 'online' or 'epoch', got 'offline'"),
    ({"reading": OnlineSampling(), "num_batches": 2}, TypeError, r"num_batches=2 inside reading=OnlineSampling"),
    ({"reading": "epoch", "num_batches": 3}, ValueError, r"num_batches=3 is for online sampling.*num_passes"),
    ({"sharding": 4}, TypeError, "TorchRLBufferDataset: sharding must be a Sharding or None, got int"),
    ({"batch_size": 0}, ValueError, "batch_size must be a positive integer, got 0"),
    ({"num_batches": 0}, ValueError, "num_batches must be a positive integer or None, got 0"),
    ({"shuffle": True}, TypeError, r"got an unexpected keyword argument 'shuffle'"),
    ({"num_shards": 2}, TypeError, r"got an unexpected keyword argument 'num_shards'"),
])
def test_reading_and_sharding_arguments_are_checked(kwargs, error, match):
    rb, _ = _dense()
    kwargs = {**kwargs}
    batch_size = kwargs.pop("batch_size", 4)
    with pytest.raises(error, match=match):
        TorchRLBufferDataset(rb, batch_size, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_shards": 0}, "num_shards must be a positive integer or None, got 0"),
    ({"rank": 0}, "Sharding: expected both rank and world_size"),
    ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, world_size=2\), got 2"),
])
def test_sharding_settings_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sharding(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"shuffle": 1}, "EpochPass: shuffle must be a bool"),
    ({"seed": -1}, "EpochPass: seed must be a non-negative int"),
    ({"num_passes": 0}, "EpochPass: num_passes must be a positive integer or None"),
])
def test_epoch_pass_settings_are_checked(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        EpochPass(**kwargs)


def test_in_keys_and_features_are_what_is_read_and_yielded(rollouts):
    """Rows built from only ``in_keys`` of each sample are the same rows; the features
    name exactly the yielded columns and accept them."""
    stored = rollouts[:]
    cases = [
        {"format": name} for name in ["sft", "sft_conversational", "sft_messages", "sft_tokenized", "grpo"]
    ] + [
        {"keys": ["tokens.response", "text.prompt"]},
        {"format": RowColumns(columns={"prompt": "text.prompt"}), "keys": ["answer"]},
        {"format": RowColumns("sft_tokenized", index_column="item")},
    ]
    for kwargs in cases:
        ds = TorchRLBufferDataset(rollouts, 4, reading="epoch", **kwargs)
        only = ReplayBuffer(storage=LazyStackStorage(16))
        only.extend(stored.select(*ds.in_keys))
        ref = TorchRLBufferDataset(only, 4, reading="epoch", **kwargs)
        rows, ref_rows = list(ds.as_hf_dataset()), list(ref.as_hf_dataset())
        assert rows == ref_rows, kwargs
        assert list(rows[0]) == ds.column_names == ds.out_keys == list(ds.features), kwargs
        for row in rows:
            ds.features.encode_example(row)
        assert set(ds.in_keys) <= set(stored.keys(True, True)) | set(stored.keys(True)), kwargs
    everything = TorchRLBufferDataset(_dense()[0], 4, reading="epoch")  # no keys: every leaf, as upstream
    assert everything.in_keys == ["input_ids", ("meta", "score")] and everything.column_names == ["input_ids", "meta.score"]
