"""Online loop on one machine: CollectorCallback with a real LLMCollector and a real TRL
trainer, staleness, priority feedback, checkpoint/resume, faults, concurrent reads."""

import threading
import time

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors.llm import LLMCollector
from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer

from torchrl_trl import layouts, testing
from torchrl_trl.data import EpochPass, OnlineSampling, RowColumns, TorchRLBufferDataset
from torchrl_trl.online import (
    BufferCheckpointCallback,
    CollectorCallback,
    CollectorError,
    CollectorMetricsCallback,
    StalenessFilter,
    TensorPrioritizedSampler,
    load_buffer,
    save_buffer,
    update_priorities,
    wait_for_items,
)

ROWS = [{"query": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]


def _load(checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(checkpoints.policy), AutoTokenizer.from_pretrained(checkpoints.policy)


def _collector(model, tok, rb, policy=None):
    env = testing.make_chat_env(ROWS, batch_size=2, group_size=2)
    policy = policy or testing.make_policy_wrapper(model, tok, max_new_tokens=4)
    return LLMCollector(env=env, policy=policy, dialog_turns_per_batch=4, replay_buffer=rb, total_dialog_turns=-1,
                        track_policy_version=True)


def _sft_args(tmp_path, steps, **kw):
    from trl import SFTConfig

    kw.setdefault("save_strategy", "no")
    return SFTConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, use_cpu=True, bf16=False,
                     report_to=[], logging_steps=1, dataloader_num_workers=0, **kw)


@pytest.mark.timeout(120)
def test_callback_collects_pushes_weights_and_logs(checkpoints, tmp_path):
    from trl import SFTTrainer

    trainer_model, tok = _load(checkpoints)
    collector_model, _ = _load(checkpoints)  # the collector's own copy: weights must be pushed
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    collector = _collector(collector_model, tok, rb)
    staleness = StalenessFilter(max_staleness=None)
    cb = CollectorCallback(collector, update_weights_every=1, collect_every=1, min_buffer_size=4, staleness=staleness)
    cb.collect(4)  # the dataset needs data to declare its features
    ds = TorchRLBufferDataset(rb, 4, format=RowColumns("sft_tokenized", sample_filter=staleness), num_batches=None)
    seen = []

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, *a, **k):
            for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"]):
                seen.append(ids[mask.bool()].tolist())
            return super().compute_loss(model, inputs, *a, **k)

    with cb:
        trainer = Recording(model=trainer_model, args=_sft_args(tmp_path, 3), train_dataset=ds.as_hf_dataset(),
                            processing_class=tok, callbacks=[cb, CollectorMetricsCallback(cb)])
        trainer.train()

    # each step: optimizer step -> weights pushed (version + 1) -> one batch collected with them
    versions = sorted(layouts.read_column(rb[:], ("next", "policy_version")))
    assert [int(v) for v in versions] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert collector.policy_version == 3 and cb.weight_updates == 3
    for name, p in trainer_model.named_parameters():
        torch.testing.assert_close(collector_model.get_parameter(name), p, msg=name)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["collector/buffer_size"] for h in logs] == [8, 12, 16]
    assert [h["collector/policy_version"] for h in logs] == [1, 2, 3]
    assert [h["staleness/buffer_max"] for h in logs] == [1, 2, 3]
    assert all(h["collector/frames_per_sec"] > 0 for h in logs)
    # the end-of-training summary is logged at the last step again: same window, same rate
    (summary,) = [h for h in trainer.state.log_history if "train_runtime" in h]
    assert summary["step"] == 3 and summary["collector/frames_per_sec"] == logs[-1]["collector/frames_per_sec"]
    assert logs[-1]["staleness/seen"] == staleness.seen > 0
    # what the trainer trained on is what the collector stored
    td = rb[:]
    prompts, responses = layouts.read_tokens(td, "prompt").tolist(), layouts.read_tokens(td, "response").tolist()
    stored = {tuple(p + r) for p, r in zip(prompts, responses)}
    assert seen and all(tuple(t) in stored for t in seen)


class _Fingerprint:
    """``fp(model)``: one float per parameter tensor (a fixed pseudo-random projection of
    it), equal for equal weights, different for a copy that is stale or half-written."""

    def __init__(self, model):
        self.probes = [torch.randn(p.numel(), generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                       for i, p in enumerate(model.parameters())]

    def __call__(self, model) -> tuple[float, ...]:
        with torch.no_grad():
            return tuple(float(p.reshape(-1).double() @ q) for p, q in zip(model.parameters(), self.probes))


@pytest.mark.timeout(300)
def test_generation_lock_lets_a_waiting_push_go_before_the_next_batch():
    """A loop that takes the lock again the moment it lets it go (as a collector thread
    does) does not starve a push: the push waits for the batch in flight, at most one more
    if the loop was already past its check. With a plain ``threading.Lock`` in its
    place, 3 of 4 runs had a push wait while 59-1533 batches went through."""
    import threading

    from torchrl_trl.online.weights import GenerationLock

    gate, stop, batches, during = GenerationLock(), threading.Event(), [0], []
    x = torch.ones(32, 32)

    def loop():
        while not stop.is_set():
            with gate.batch():
                batches[0] += 1
                x @ x  # a few microseconds of work under the lock, without the GIL as generation

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        for _ in range(50):
            start = batches[0]
            while batches[0] < start + 10:  # the loop is running
                pass
            before = batches[0]
            with gate.push():
                during.append(batches[0] - before)
                held = batches[0]
                sum(range(10_000))
                assert batches[0] == held  # no batch while a push holds it
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and max(during) <= 2, during


def test_background_collection_trains_and_pushes_whole_trained_weights(checkpoints, tmp_path):
    """``background=True``: the collector thread keeps generating while the trainer steps;
    each push hands it the trainer's weights whole (the collector's parameters equal the
    trainer's at the version it reports), and every generation ran on one whole pushed
    state, never on a half-copied one. A push waits for the batch in flight only: the
    collector thread does not take the lock again before it (it did: Python's Lock is not
    fair, and a push once waited while 6,000 items were written)."""
    from transformers import TrainerCallback
    from trl import SFTTrainer

    trainer_model, tok = _load(checkpoints)
    collector_model, _ = _load(checkpoints)  # the collector's own copy
    rb = ReplayBuffer(storage=LazyStackStorage(1024))
    fingerprint = _Fingerprint(collector_model)
    used = []  # per generate call: (version, weights) when it began and when it ended
    generate = collector_model.generate

    def recording_generate(*args, **kwargs):
        begin = (collector.policy_version, fingerprint(collector_model))
        out = generate(*args, **kwargs)
        used.append((begin, (collector.policy_version, fingerprint(collector_model))))
        return out

    collector_model.generate = recording_generate  # what the collector's TransformersWrapper calls
    collector = _collector(collector_model, tok, rb)
    pushed = [fingerprint(collector_model)]  # version 0: the initial weights
    cb = CollectorCallback(collector, background=True, update_weights_every=1, min_buffer_size=4, wait_timeout=120)
    ds = TorchRLBufferDataset(rb, 4, format="sft_tokenized", num_batches=None)

    written_during_push = []

    class BeforePush(TrainerCallback):  # runs before cb's push
        def on_step_end(self, args, state, control, **kwargs):
            written_during_push.append(rb.write_count)

    class CheckPushes(TrainerCallback):  # runs after cb's push, in the trainer's thread
        writes = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            written_during_push[-1] = rb.write_count - written_during_push[-1]
            assert cb.policy_version == collector.policy_version == state.global_step
            for name, p in model.named_parameters():
                torch.testing.assert_close(collector_model.get_parameter(name), p, rtol=0, atol=0, msg=name)
            pushed.append(fingerprint(model))
            # the collector keeps writing while the trainer trains: wait for its next batch
            self.writes.append(_next_write(rb, cb))

    steps = 4
    with cb:
        cb.collect(4)  # the dataset needs data to declare its features
        trainer = SFTTrainer(model=trainer_model, args=_sft_args(tmp_path, steps), train_dataset=ds.as_hf_dataset(),
                             processing_class=tok, callbacks=[BeforePush(), cb, CheckPushes()])
        trainer.train()
    assert trainer.state.global_step == steps and cb.weight_updates == steps
    # one collector batch is dialog_turns_per_batch=4 items: at most the one in flight
    assert len(written_during_push) == steps and max(written_during_push) <= 4, written_during_push
    assert len(set(pushed)) == steps + 1  # each push changed the weights
    # generation ran at every version (after each push the trainer waited for a new batch),
    # each batch from start to end on exactly the weights pushed at the version it reports
    assert {v for (v, _), _ in used} == set(range(steps + 1))
    changed = sum(begin != end for begin, end in used)
    wrong = sum(fp != pushed[v] for pair in used for v, fp in pair)
    assert not changed and not wrong, f"{changed} batches saw the weights change, {wrong} states were never pushed"
    assert CheckPushes.writes == sorted(CheckPushes.writes)


def _next_write(rb, cb, timeout=120.0) -> int:
    """Wait for the collector's next write into ``rb`` (its ``write_count`` grows, also
    once it is full); the timeout only stops a hang."""
    start, deadline = rb.write_count, time.monotonic() + timeout
    while rb.write_count == start:
        cb.check()
        assert time.monotonic() < deadline, "the background collector wrote nothing"
        time.sleep(0.01)
    return rb.write_count


@pytest.mark.timeout(120)
def test_collector_callback_logs_nothing_its_metrics_callback_logs(checkpoints, tmp_path):
    """Collection and metrics are two callbacks: the collector callback alone adds nothing
    to the logs, a CollectorMetricsCallback beside it reports on it under its own prefix."""
    from trl import SFTTrainer

    trainer_model, tok = _load(checkpoints)
    collector_model, _ = _load(checkpoints)
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    collector = _collector(collector_model, tok, rb)
    cb = CollectorCallback(collector, min_buffer_size=4)
    assert not cb.remote  # a local LLMCollector is not a Ray one
    cb.collect(4)
    ds = TorchRLBufferDataset(rb, 4, format="sft_tokenized", num_batches=None)

    def train(*callbacks):
        trainer = SFTTrainer(model=trainer_model, args=_sft_args(tmp_path, 2), train_dataset=ds.as_hf_dataset(),
                             processing_class=tok, callbacks=list(callbacks))
        trainer.train()
        return [h for h in trainer.state.log_history if "loss" in h]

    with cb:
        logs = train(cb)
    assert not any(k.startswith(("collector/", "staleness/", "c/")) for h in logs for k in h)
    assert collector.policy_version == 2  # it did its own job: two pushes
    with cb:
        logs = train(cb, CollectorMetricsCallback(cb, log_prefix="c/", log_buffer_staleness=False))
    assert [h["c/weight_updates"] for h in logs] == [3, 4]
    assert [h["c/policy_version"] for h in logs] == [3, 4]
    assert [h["c/buffer_size"] for h in logs] == [h["c/write_count"] for h in logs] == [len(rb) - 4, len(rb)]
    assert not any(k.startswith(("collector/", "staleness/")) for h in logs for k in h)
    with pytest.raises(ValueError, match="replay_buffer="):
        CollectorMetricsCallback()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"collect_every": 0}, "CollectorCallback: collect_every must be a positive integer, got 0"),
     ({"update_weights_every": -1}, "CollectorCallback: update_weights_every must be an integer >= 0, got -1"),
     ({"min_buffer_size": -3}, "CollectorCallback: min_buffer_size must be an integer >= 0, got -3"),
     ({"wait_timeout": 0}, "CollectorCallback: wait_timeout must be a positive number of seconds or None, got 0")],
)
def test_collector_callback_names_a_bad_argument(kwargs, message):
    rb = ReplayBuffer(storage=LazyStackStorage(4))
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        CollectorCallback(iter(()), replay_buffer=rb, **kwargs)
    assert CollectorCallback(iter(()), replay_buffer=rb, update_weights_every=0, min_buffer_size=0).update_weights_every == 0


def test_shared_model_only_bumps_version(policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    rb = ReplayBuffer(storage=LazyStackStorage(16))
    collector = _collector(model, tok, rb)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = CollectorCallback(collector)
    assert cb._shares_model(model)
    cb.push_weights(model)
    assert collector.policy_version == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    collector.shutdown()


def _versioned_buffer(versions):
    n = len(versions)
    rb = ReplayBuffer(storage=LazyTensorStorage(n))
    ids = torch.arange(n)
    rb.extend(TensorDict({"id": ids, "next": {"policy_version": torch.as_tensor(versions)}}, [n]))
    return rb


def test_staleness_filter_drops_counts_and_weights():
    versions = [0, 1, 2, 3, 4, 5, 5, 2]
    rb = _versioned_buffer(versions)
    filt = StalenessFilter(max_staleness=2, consumer_version=5)
    rows = RowColumns(columns={"id": "id", "weight": filt.weight_column}, sample_filter=filt)
    ds = TorchRLBufferDataset(rb, 3, reading="epoch", format=rows)
    with pytest.warns(UserWarning, match="max_staleness=2"):
        rows = list(ds.as_hf_dataset())
    assert sorted(r["id"] for r in rows) == [i for i, v in enumerate(versions) if 5 - v <= 2]
    assert all(r["weight"] == pytest.approx(1 / (1 + 5 - versions[r["id"]])) for r in rows)
    stats = filt.stats()
    assert stats["staleness/dropped"] == 4 and stats["staleness/seen"] == 8
    assert stats["staleness/max_read"] == 5
    with pytest.raises(KeyError, match="track_policy_version"):
        StalenessFilter(1)(TensorDict({"id": torch.arange(2)}, [2]))
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0, got -1"):
        StalenessFilter(-1)


def test_staleness_filter_is_shared_with_worker_copies():
    """DataLoader workers get the filter through torch's ForkingPickler: the trainer's
    later version updates reach them, and their drops reach the trainer's counters."""
    import io
    import pickle

    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  registers torch's shared-memory reductions

    filt = StalenessFilter(max_staleness=1, consumer_version=0)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(filt)
    worker_copy = pickle.loads(buf.getvalue())
    filt.consumer_version = 3  # the trainer pushed weights after the workers started
    batch = TensorDict({"next": {"policy_version": torch.tensor([0, 2, 3])}}, [3])
    with pytest.warns(UserWarning, match="max_staleness=1"):
        keep = worker_copy(batch)
    assert keep.tolist() == [False, True, True]
    assert filt.stats()["staleness/dropped"] == 1 and filt.seen == 3


def _collate(rows):
    ids = torch.stack([torch.as_tensor(r["input_ids"]) for r in rows])
    return {"input_ids": ids, "labels": ids.clone(), "index": torch.as_tensor([r["index"] for r in rows])}


def _id_buffer(n, sampler=None):
    rb = ReplayBuffer(storage=LazyTensorStorage(n), sampler=sampler)
    i = torch.arange(n)
    ids = torch.stack([1 + i // 10, 1 + i % 10, torch.full_like(i, 5), torch.full_like(i, 6)], -1)
    rb.extend(TensorDict({"input_ids": ids}, [n]))
    return rb


def _item_id(ids):
    return int((ids[0] - 1) * 10 + ids[1] - 1)


@pytest.mark.timeout(120)
def test_priority_feedback_from_compute_loss(policy_and_tokenizer, tmp_path):
    from transformers import Trainer, TrainingArguments

    _, tok = policy_and_tokenizer
    model = testing.make_policy(tok)
    n = 12
    sampler = TensorPrioritizedSampler(n, alpha=1.0, beta=1.0)
    rb = _id_buffer(n, sampler)
    ds = TorchRLBufferDataset(rb, 4, keys=["input_ids"], format=RowColumns(index_column="index"),
                              reading=OnlineSampling(num_batches=None, seed=0))
    updates = []

    class PriorityTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            index = inputs.pop("index")
            for ids, i in zip(inputs["input_ids"], index):  # the index names the row it came with
                assert _item_id(ids) == int(i)
            logits = model(input_ids=inputs["input_ids"]).logits[:, :-1]
            per_token = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), inputs["labels"][:, 1:], reduction="none")
            per_sample = per_token.mean(-1)
            update_priorities(rb, index, per_sample)
            updates.append((index.clone(), per_sample.detach().clone()))
            return per_sample.mean()

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, use_cpu=True,
                             bf16=False, report_to=[], save_strategy="no", remove_unused_columns=False,
                             dataloader_num_workers=0)
    PriorityTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), data_collator=_collate).train()
    assert len(updates) == 3
    prio = sampler.priorities(n)
    last = {}
    for index, values in updates:
        for i, v in zip(index.tolist(), values.tolist()):
            last[i] = v
    for i, v in last.items():
        assert prio[i].item() == pytest.approx(v + 1e-6, rel=1e-5)
    # sampling follows the updated priorities
    update_priorities(rb, torch.arange(n), torch.tensor([1e6] + [1e-3] * (n - 1)))
    torch.manual_seed(0)
    ds = TorchRLBufferDataset(rb, 8, keys=["input_ids"], format=RowColumns(index_column="index"),
                              reading=OnlineSampling(seed=1))
    got = [row["index"] for row in ds]
    assert got.count(0) >= 7
    with pytest.raises(TypeError, match="keeps no priorities"):
        update_priorities(_id_buffer(4), [0], [1.0])
    with pytest.raises(ValueError, match="2 indices but 1 values"):
        update_priorities(rb, [0, 1], [1.0])


def test_buffer_save_load_ragged_rollouts(policy_and_tokenizer, tmp_path):
    model, tok = policy_and_tokenizer
    env = testing.make_chat_env(ROWS, batch_size=2, group_size=2)
    rb = testing.collect_rollouts(testing.make_policy_wrapper(model, tok, max_new_tokens=4), env, total_turns=8)
    save_buffer(rb, tmp_path / "b")  # LazyStackStorage: ragged items, text and History, no pickle
    rb2 = ReplayBuffer(storage=LazyStackStorage(16))
    meta = load_buffer(rb2, tmp_path / "b")
    assert meta["storage"] == "list" and len(rb2) == len(rb) == 8
    assert layouts.read_tokens(rb2[:], "full").tolist() == layouts.read_tokens(rb[:], "full").tolist()
    assert layouts.read_history(rb2[:], "full") == layouts.read_history(rb[:], "full")
    rb2.extend(rb[:2])  # the writer's cursor came back too
    assert len(rb2) == 10


def test_load_buffer_restores_without_rerunning_write_transforms(tmp_path):
    calls = []

    def double(td):  # a write transform (like reward scoring): runs once per write
        calls.append(td.batch_size[0])
        td = td.clone()
        td["x"] = td["x"] * 2
        return td

    sampler = TensorPrioritizedSampler(8)
    rb = ReplayBuffer(storage=LazyTensorStorage(8), sampler=sampler)
    rb.append_transform(double, invert=True)
    rb.extend(TensorDict({"x": torch.arange(4)}, [4]))
    rb.update_priority(torch.tensor([1]), torch.tensor([5.0]))
    assert rb[:]["x"].tolist() == [0, 2, 4, 6] and calls == [4]
    save_buffer(rb, tmp_path / "b")

    sampler2 = TensorPrioritizedSampler(8)
    rb2 = ReplayBuffer(storage=LazyTensorStorage(8), sampler=sampler2)
    rb2.append_transform(double, invert=True)
    calls.clear()
    assert load_buffer(rb2, tmp_path / "b")["len"] == 4
    assert rb2[:]["x"].tolist() == [0, 2, 4, 6] and calls == []  # stored as they were, not doubled again
    assert sampler2.priorities(4).tolist() == [1.0, 5.0, 1.0, 1.0] and rb2.write_count == 4
    rb2.extend(TensorDict({"x": torch.tensor([10])}, [1]))  # later writes still go through it
    assert rb2[:]["x"].tolist() == [0, 2, 4, 6, 20] and calls == [1]
    with pytest.raises(TypeError, match="keeps its storage elsewhere"):
        save_buffer(object(), tmp_path / "c")


def _resume_run(tmp_path, max_steps, resume=None):
    from transformers import Trainer, TrainingArguments

    tok = testing.make_tokenizer()
    model = testing.make_policy(tok)
    rb = ReplayBuffer(storage=LazyTensorStorage(40))
    if resume is None:
        i = torch.arange(18)
        ids = torch.stack([1 + i // 10, 1 + i % 10, torch.full_like(i, 5), torch.full_like(i, 6)], -1)
        rb.extend(TensorDict({"input_ids": ids}, [18]))
    else:
        load_buffer(rb, tmp_path / f"checkpoint-{resume}" / "torchrl_buffer")
    ds = TorchRLBufferDataset(rb, 4, keys=["input_ids"], format=RowColumns(index_column="index"),
                              reading=EpochPass(shuffle=True, seed=3))
    seen = []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            seen.append(inputs.pop("index").tolist())
            return model(**inputs).loss

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
                             use_cpu=True, bf16=False, report_to=[], save_strategy="steps", save_steps=3,
                             remove_unused_columns=False, dataloader_num_workers=0, logging_steps=1)
    cb = BufferCheckpointCallback(rb)
    trainer = Recording(model=model, args=args, train_dataset=ds.as_hf_dataset(), data_collator=_collate, callbacks=[cb])
    trainer.train(resume_from_checkpoint=None if resume is None else str(tmp_path / f"checkpoint-{resume}"))
    return seen, cb


@pytest.mark.timeout(150)
def test_resume_from_checkpoint_gives_same_next_samples(tmp_path):
    # 18 items, shuffled, batches of 4: a pass is 5 steps; checkpoint at step 3, resume to 5
    full, _ = _resume_run(tmp_path / "full", 5)
    first, _ = _resume_run(tmp_path / "cut", 3)
    assert first == full[:3]
    resumed, cb = _resume_run(tmp_path / "cut", 5, resume=3)  # a fresh buffer, loaded from the checkpoint
    assert cb.restored_from is not None
    assert resumed == full[3:5]
    assert sorted(i for b in full for i in b) == list(range(18))  # the pass read every item once


# ----------------------------------------------------------------------------
# faults
# ----------------------------------------------------------------------------


class _FailingPolicy:
    """Wraps a policy; raises on call number ``fail_at`` (0-based); with ``blocked``, each
    call first waits until that event is set (a generation server that hangs)."""

    def __init__(self, policy, fail_at=None, blocked: threading.Event | None = None):
        self.policy, self.fail_at, self.blocked, self.calls = policy, fail_at, blocked, 0

    def __call__(self, td):
        self.calls += 1
        if self.fail_at is not None and self.calls > self.fail_at:
            raise RuntimeError("simulated generation failure")
        if self.blocked is not None:
            self.blocked.wait()
        return self.policy(td)

    def __getattr__(self, name):
        return getattr(self.__dict__["policy"], name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_collector_that_dies_raises_clear_error(checkpoints, tmp_path, background):
    from trl import SFTTrainer

    model, tok = _load(checkpoints)
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    policy = _FailingPolicy(testing.make_policy_wrapper(model, tok, max_new_tokens=4), fail_at=2)
    collector = _collector(model, tok, rb, policy=policy)
    cb = CollectorCallback(collector, background=background, update_weights_every=0, wait_timeout=20)
    cb.collect(4)
    stored = layouts.read_tokens(rb[:], "full").tolist()
    ds = TorchRLBufferDataset(rb, 4, format="sft_tokenized", num_batches=None)
    trainer = SFTTrainer(model=model, args=_sft_args(tmp_path, 50), train_dataset=ds.as_hf_dataset(),
                         processing_class=tok, callbacks=[cb])
    with cb, pytest.raises(CollectorError, match="simulated generation failure|died") as info:
        trainer.train()  # the timeout mark bounds it: an error, never a hang
    assert "simulated generation failure" in repr(info.value.__cause__)
    assert trainer.state.global_step < 50
    # nothing already stored is lost
    now = layouts.read_tokens(rb[:], "full").tolist()
    assert now[: len(stored)] == stored and len(now) >= 4


@pytest.mark.timeout(60)
def test_buffer_that_runs_dry_times_out(policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    hung = threading.Event()
    policy = _FailingPolicy(testing.make_policy_wrapper(model, tok, max_new_tokens=4), blocked=hung)
    cb = CollectorCallback(_collector(model, tok, rb, policy=policy), background=True, min_buffer_size=4,
                           wait_timeout=1.0)
    with pytest.raises(TimeoutError, match="holds 0 items after waiting"):
        cb.on_train_begin(None, None, None)  # the generation server hangs: bounded by wait_timeout
    assert policy.calls == 1 and len(rb) == 0
    with pytest.raises(TimeoutError):
        wait_for_items(rb, 1, timeout=0.2)
    hung.set()
    cb.stop(timeout=60)
    # an empty buffer is an error for the dataset, not a hang
    with pytest.raises(ValueError, match="replay buffer is empty"):
        next(iter(TorchRLBufferDataset(ReplayBuffer(storage=LazyStackStorage(4)), 2, keys=["x"])))


# ----------------------------------------------------------------------------
# concurrency
# ----------------------------------------------------------------------------


def _item(ids):
    n = ids.numel()
    k = 3 + (ids % 5)  # ragged lengths derived from the id
    return [TensorDict({"id": i, "double": 2 * i, "tokens": torch.full((int(kk),), int(i)),
                        "text": f"item-{int(i)}"}, []) for i, kk in zip(ids, k)][:n]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage", ["tensor", "stack"])
def test_concurrent_writer_and_reader_see_whole_items(storage):
    from tensordict import lazy_stack

    cap = 48
    if storage == "tensor":
        rb = ReplayBuffer(storage=LazyTensorStorage(cap))

        def batch(ids):
            return TensorDict({"id": ids, "double": 2 * ids, "tokens": ids[:, None].expand(-1, 6).clone()}, [len(ids)])
    else:
        rb = ReplayBuffer(storage=LazyStackStorage(cap))

        def batch(ids):
            return lazy_stack(_item(ids))

    rb.extend(batch(torch.arange(8)))
    written = [8]
    stop = threading.Event()
    errors = []

    def writer():
        try:
            while not stop.is_set() and written[0] < 4000:
                rb.extend(batch(torch.arange(written[0], written[0] + 8)))
                written[0] += 8
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    keys = ["id", "double", "tokens"]
    online = TorchRLBufferDataset(rb, 8, keys=keys, reading=OnlineSampling(num_batches=None, seed=0))
    epoch = TorchRLBufferDataset(rb, 8, keys=keys, reading="epoch")
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    rows = 0
    try:
        for _ in range(60):  # rounds, each an online burst and an epoch pass over what is there
            it = iter(online)
            for _ in range(40):
                rows += _check_row(next(it), written[0])
            for row in epoch:
                rows += _check_row(row, written[0])
    finally:
        stop.set()
        t.join(10)
    assert not errors, errors
    assert written[0] > 8 * 10, "the writer barely ran: no real concurrency"
    assert rows > 500


def _check_row(row, written):
    i = int(row["id"])
    assert 0 <= i < written + 8
    assert int(row["double"]) == 2 * i
    tokens = torch.as_tensor(row["tokens"])
    assert tokens.numel() > 0 and (tokens == i).all(), (i, tokens)
    return 1
