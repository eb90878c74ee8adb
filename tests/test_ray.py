"""Ray: a RayLLMCollector actor writes into a RayReplayBuffer while a TRL trainer trains
from it; weights pushed to the actor; a killed collector actor and a killed buffer actor
give clear errors, never a hang."""

import gc
import time

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402

from torchrl_trl import layouts  # noqa: E402
from torchrl_trl.data import EpochPass, RowColumns, Sharding, TorchRLBufferDataset  # noqa: E402
from torchrl_trl.online import CollectorCallback, CollectorError, CollectorMetricsCallback, wait_for_items  # noqa: E402
from torchrl_trl.online.ray import is_ray_collector, make_ray_collector, make_ray_replay_buffer  # noqa: E402

ROWS = [{"query": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]

# every test starts Ray (worker processes, actors)
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ray_session():
    import sys

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    # the actor's factories live in this test module, which Ray workers cannot import
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    gc.collect()  # first free collectors: a freed RayLLMCollector's __del__ calls its actor (restarts Ray)
    ray.shutdown()


def _env_factory():
    from tensordict import set_list_to_stack

    from torchrl_trl import testing

    set_list_to_stack(True).set()
    return testing.make_chat_env(ROWS, batch_size=2, group_size=2)


def _policy_factory():
    import torch

    from torchrl_trl import testing

    torch.set_num_threads(1)
    tok = testing.make_tokenizer()
    return testing.make_policy_wrapper(testing.make_policy(tok), tok, max_new_tokens=4)


def _versions(rb):
    return [int(v) for v in layouts.read_column(rb[:], ("next", "policy_version"))]


@pytest.mark.timeout(300)
def test_ray_collector_feeds_trainer_then_faults(ray_session, tmp_path):
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from torchrl_trl import testing

    rb = make_ray_replay_buffer(256)
    collector = make_ray_collector(_env_factory, _policy_factory, rb, dialog_turns_per_batch=4)
    try:
        cb = CollectorCallback(collector, replay_buffer=rb, min_buffer_size=4, wait_timeout=90, update_weights_every=1)
        assert cb.remote and is_ray_collector(collector)  # recognised by type: RayLLMCollector
        cb.start()
        wait_for_items(rb, 4, timeout=90, check=cb.check)
        tok = testing.make_tokenizer()
        model = testing.make_policy(tok)
        ds = TorchRLBufferDataset(rb, 4, format="sft_tokenized", num_batches=None)
        seen, after_last_push = [], []

        class Recording(SFTTrainer):
            def compute_loss(self, model, inputs, *a, **k):
                for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"]):
                    seen.append(tuple(ids[mask.bool()].tolist()))
                return super().compute_loss(model, inputs, *a, **k)

        class AfterLastPush(TrainerCallback):
            """Runs after ``cb`` at the last step, once its push reached the actor: the
            actor, still collecting, writes rollouts stamped with the new version (a bounded
            wait for them). Its writes reach the buffer actor asynchronously, so batches made
            before the push can still land after it (seen under load: versions 0 and 1
            written after the third push): what is checked is that version 3 arrives."""

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 3:
                    deadline = time.monotonic() + 90
                    while 3 not in _versions(rb):
                        wait_for_items(rb, len(rb) + 4, timeout=max(deadline - time.monotonic(), 0.1),
                                       check=cb.check)
                    after_last_push.extend(_versions(rb))

        args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, use_cpu=True, bf16=False,
                         report_to=[], logging_steps=1, save_strategy="no", dataloader_num_workers=0)
        trainer = Recording(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
        cb.attach(trainer)
        CollectorMetricsCallback(cb).attach(trainer)
        trainer.add_callback(AfterLastPush())  # after cb: cb's step-3 push comes first
        trainer.train()
        assert trainer.state.global_step == 3
        # three pushes reached the actor: its PolicyVersion is 3, rollouts made after the
        # last push carry version 3, and none carries a version that was never pushed
        assert collector.policy_version == 3
        assert 3 in after_last_push and max(after_last_push) == 3, after_last_push
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert [h["collector/policy_version"] for h in logs] == [1, 2, 3]
        assert all(h["collector/buffer_size"] >= 4 for h in logs)
        # what the trainer trained on was written by the actor
        td = rb[:]
        stored = {tuple(p + r) for p, r in zip(layouts.read_tokens(td, "prompt").tolist(),
                                               layouts.read_tokens(td, "response").tolist())}
        assert len(seen) == 12 and set(seen) <= stored

        # fault 1: a running collector actor is killed -> the callback watching it (public
        # start()) raises a clear CollectorError; its check() runs at every poll of the
        # bounded wait. (The trainer's end shut the first actor down, env closed: a second one.)
        second = make_ray_collector(_env_factory, _policy_factory, rb, dialog_turns_per_batch=4)
        watcher = CollectorCallback(second, replay_buffer=rb)
        watcher.start()
        wait_for_items(rb, len(rb) + 4, timeout=90, check=watcher.check)  # it runs and writes
        ray.kill(second._collector, no_restart=True)
        with pytest.raises(CollectorError, match="the collector cannot be reached") as info:
            wait_for_items(rb, len(rb) + 10_000, timeout=60, check=watcher.check)
        assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)
        # the buffer keeps its data
        n = len(rb)
        assert n >= 4 and len(_versions(rb)) == n
        with pytest.raises(TimeoutError):  # nobody writes anymore: waiting is bounded
            wait_for_items(rb, n + 1, timeout=0.5)
        epoch = TorchRLBufferDataset(rb, 4, format="sft_tokenized", reading="epoch")
        assert len(list(epoch)) == n
    finally:
        rb.close()
    # fault 2: the buffer actor is gone -> the reader raises Ray's error naming the dead
    # actor's class (the test's timeout bounds how long that may take: never a hang)
    with pytest.raises(ray.exceptions.ActorDiedError, match="class_name: ReplayBuffer"):
        next(iter(ds))


@pytest.mark.timeout(60)
def test_ray_buffer_epoch_reads_each_item_once(ray_session):
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage

    rb = make_ray_replay_buffer(32, storage=LazyTensorStorage)
    try:
        rb.extend(TensorDict({"id": torch.arange(10), "x": 3 * torch.arange(10)}, [10]))
        ranks = [list(TorchRLBufferDataset(rb, 3, keys=["id", "x"], reading=EpochPass(shuffle=True, seed=2),
                                           sharding=Sharding(rank=r, world_size=2))) for r in range(2)]
        ids = sorted(int(row["id"]) for rows in ranks for row in rows)
        assert ids == list(range(10)) and all(ranks)
        assert all(int(row["x"]) == 3 * int(row["id"]) for rows in ranks for row in rows)
        rows = list(TorchRLBufferDataset(rb, 4, keys=["id"], format=RowColumns(index_column="index"), reading="epoch").as_hf_dataset())
        assert [r["index"] for r in rows] == [r["id"] for r in rows] == list(range(10))
    finally:
        rb.close()


@pytest.mark.timeout(120)
def test_weights_pushed_to_a_local_actor_go_through_shared_files(ray_session):
    """On one machine a push hands the actor memory-mapped files, not pickled tensors, and the
    trainer goes on while the actor loads them: ``CollectorGroups.push`` returns the version the
    push makes; once it landed the actor's policy holds exactly the pushed weights (a copy:
    later writes to the files do not reach it)."""
    from torchrl_trl import testing
    from torchrl_trl.online.collector_source import CollectorGroups
    from torchrl_trl.online.weights import _SharedWeights

    rb = make_ray_replay_buffer(64)
    collector = make_ray_collector(_env_factory, _policy_factory, rb, dialog_turns_per_batch=4)
    groups = CollectorGroups(collector, rb, group_size=2, max_staleness=1, timeout=60, max_pending_groups=None,
                             forward_keys=None)

    def actor_weights():
        state = ray.get(collector._collector.state_dict.remote())["policy_state_dict"]
        return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}

    try:
        model = testing.make_policy(testing.make_tokenizer())
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_()
            want = {k: v.clone() for k, v in model.state_dict().items()}
            assert groups.push(model) == version and groups._push_in_flight is not None  # in the background
            with torch.no_grad():  # the trainer's next step: the push sends the weights as they were
                next(model.parameters()).add_(1.0)
            assert groups.policy_version == version == collector.policy_version  # landed
            got = actor_weights()
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        files = _SharedWeights._by_collector[collector].files
        assert files.is_memmap()
        files.zero_()  # the actor copied the weights: the files are scratch between pushes
        assert all(torch.equal(v, want[k]) for k, v in actor_weights().items())
    finally:
        groups.close()
        collector.shutdown()
        rb.close()
