"""TorchRLRolloutFunc(source=collector): TRL's GRPOTrainer trains on the whole GRPO groups a real TorchRL
LLMCollector writes (MCAdvantage on the buffer), weights pushed through
``collector.update_policy_weights_`` and versioned by TorchRL's PolicyVersion; locally (the
collector's background thread) and with the collector in a Ray actor writing into a
RayReplayBuffer."""

import gc
import os
import sys
import time

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from torchrl_trl import layouts  # noqa: E402
from torchrl_trl.online import CollectorError  # noqa: E402
from torchrl_trl.online import RolloutOptions, TorchRLRolloutFunc  # noqa: E402
from torchrl_trl.online.staleness import read_policy_version  # noqa: E402
from test_rollout_func import Recorder, _wait  # noqa: E402

ROWS = [{"query": q, "answer": a} for q, a in [("what is two plus two?", "four"), ("hello world", "hi")]]
ANSWERS = {r["query"]: r["answer"] for r in ROWS}


def _func(collector, rb, *, push=True, **options):
    """The rollout function over ``collector`` (its buffer ``rb``), pushing the trainer's weights unless not ``push``."""
    return TorchRLRolloutFunc(source=collector, replay_buffer=rb, sync_weights="copy" if push else None,
                              options=RolloutOptions(**options))


def _length_reward(completions, **kwargs):
    return [float(len(c[-1]["content"])) for c in completions]


def _env(rows=ROWS, batch_size=2):
    """ChatEnv over ROWS, each prompt twice (a GRPO group of 2), one turn, the reply's length
    as the env's reward (MCAdvantage needs one)."""
    from tensordict import set_list_to_stack

    from torchrl_trl import RewardFunctionWrapper, testing

    set_list_to_stack(True).set()
    env = testing.make_chat_env(rows, batch_size=batch_size, group_size=2)
    return env.append_transform(RewardFunctionWrapper(_length_reward).as_transform())


def _recording_collector(model, tok, rb, max_new_tokens=4):
    """A real LLMCollector over :func:`_env` writing into ``rb``, its policy around ``model``,
    recording the behaviour log-probs (``BehaviourLogProbsPostproc``)."""
    from torchrl.collectors.llm import LLMCollector

    from torchrl_trl.online import BehaviourLogProbsPostproc
    from torchrl_trl.testing import make_policy_wrapper

    policy = make_policy_wrapper(model, tok, max_new_tokens=max_new_tokens)
    return LLMCollector(env=_env(), policy=policy, dialog_turns_per_batch=2, replay_buffer=rb,
                        track_policy_version=True, total_dialog_turns=-1, postproc=BehaviourLogProbsPostproc(policy))


def _trainer(model, tok, func, reward, tmp_path, max_steps, cls=None):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        shuffle_dataset=False, gradient_checkpointing=False, learning_rate=1e-2, logging_steps=1,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": r["query"]}] for r in ROWS]})
    return (cls or GRPOTrainer)(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                                processing_class=tok, rollout_func=func)


def _reward(completions, torchrl_prompt, torchrl_reward, answer, **kwargs):
    assert [ANSWERS[p[-1]["content"]] for p in torchrl_prompt] == answer  # the rollout's own columns
    return list(torchrl_reward)


@pytest.mark.parametrize("mc_advantage", [True, False], ids=["MCAdvantage", "plain-buffer"])
def test_local_llm_collector_weights_version_and_staleness(checkpoints, policy_and_tokenizer, tmp_path, mc_advantage):
    """A real LLMCollector in its background thread: the trainer's weights reach the
    collector's policy through update_policy_weights_, PolicyVersion advances by one per
    step, groups are whole, within max_staleness, and nothing written is lost. A buffer
    without MCAdvantage works too when each batch holds whole groups (single turn, the env
    repeating each prompt group_size times)."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage
    from transformers import AutoModelForCausalLM

    from torchrl_trl.testing import make_policy_wrapper

    _, tok = policy_and_tokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    own = AutoModelForCausalLM.from_pretrained(checkpoints.policy)  # the collector's copy
    rb = ReplayBuffer(storage=LazyStackStorage(1024), transform=MCAdvantage(grpo_size=2) if mc_advantage else None)
    collector = LLMCollector(env=_env(), policy=make_policy_wrapper(own, tok, max_new_tokens=4),
                             dialog_turns_per_batch=2, replay_buffer=rb, track_policy_version=True,
                             total_dialog_turns=-1)
    seen = []

    def reward(completions, **kwargs):  # runs after the push of this step, before the optimizer
        seen.append((collector.policy_version,
                     all(torch.equal(a, b) for a, b in zip(own.parameters(), model.parameters()))))
        return _reward(completions, **kwargs)

    with _func(collector, rb, group_size=2, max_staleness=1, timeout=120) as func:
        rollout = Recorder(func, "rollout")
        trainer = _trainer(model, tok, rollout, Recorder(reward, "reward"), tmp_path, max_steps=3)
        before = [p.detach().clone() for p in model.parameters()]
        trainer.train()
    assert not collector.is_running()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained
    # one push per step, each bumping TorchRL's PolicyVersion; the collector's policy held the
    # trainer's weights at every step (pushed before it generated for the step)
    assert func.groups.weight_pushes == 3 and collector.policy_version == 3
    assert seen == [(1, True), (2, True), (3, True)]
    assert len(func.consumed_staleness) == 3 * 2 and max(func.consumed_staleness) <= 1
    # whole groups: both completions of a row pair answer one prompt
    for _, _, batch in rollout.calls:
        prompts = batch["torchrl_prompt"]
        assert prompts[0] == prompts[1] and prompts[2] == prompts[3]
        assert all(torch.isnan(torch.tensor(lp[0])) for lp in batch["logprobs"])  # TorchRL's 0.0: unknown
    # nothing lost: every item written is still in the buffer; every group read was trained
    # on, dropped as stale or is pending; what TRL trained on is what TorchRL stored
    assert len(rb) == rb.write_count >= 2 * func.groups.read_groups
    assert func.groups.read_groups == func.groups.consumed_groups + func.groups.dropped_stale_groups + len(func.groups._pending)
    assert func.groups.missed_items == 0
    stored = rb[:]
    stored = set(zip(map(tuple, layouts.read_tokens(stored, "prompt").tolist()),
                     map(tuple, layouts.read_tokens(stored, "response").tolist())))
    trained = {(tuple(p), tuple(c)) for _, _, b in rollout.calls for p, c in zip(b["prompt_ids"], b["completion_ids"])}
    assert len(trained) > 1 and trained <= stored
    versions = [int(v) for v in layouts.read_column(rb[:], ("next", "policy_version"))]
    assert versions == sorted(versions) and max(versions) <= 3


def test_local_collector_records_behaviour_logprobs_for_the_correction(checkpoints, policy_and_tokenizer, tmp_path):
    """BehaviourLogProbsPostproc on the LLMCollector: the log-probs TRL gets are complete (no
    unknown first token) and, on groups generated after the step's push, equal an
    independent forward of the trainer's weights; BehaviourLogProbsMixin trains on them."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from test_rollout_func import _reference_logps
    from torchrl_trl.online import BehaviourLogProbsMixin

    _, tok = policy_and_tokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    rb = ReplayBuffer(storage=LazyStackStorage(1024), transform=MCAdvantage(grpo_size=2))
    collector = _recording_collector(AutoModelForCausalLM.from_pretrained(checkpoints.policy), tok, rb)
    checked = {"fresh": 0}

    def reward(completions, **kwargs):  # after this step's push and rollout, before its optimizer step
        batch = rollout.calls[-1][2]
        ref = _reference_logps(model, batch["prompt_ids"], batch["completion_ids"])
        for lp, r, age in zip(batch["logprobs"], ref, batch["staleness"]):
            assert not torch.isnan(torch.tensor(lp)).any()
            if age == 0:
                checked["fresh"] += 1
                torch.testing.assert_close(torch.tensor(lp), r, atol=1e-4, rtol=1e-4)
        return _reward(completions, **kwargs)

    with _func(collector, rb, group_size=2, max_staleness=1, timeout=120) as func:
        rollout = Recorder(func, "rollout")
        corrected = type("Corrected", (BehaviourLogProbsMixin, GRPOTrainer), {})
        trainer = _trainer(model, tok, rollout, Recorder(reward, "reward"), tmp_path, max_steps=3, cls=corrected)
        trainer.train()
    assert trainer.state.global_step == 3 and checked["fresh"] > 0


def test_pushes_land_between_batches_never_inside_one(checkpoints, policy_and_tokenizer):
    """Weights pushed into a running in-process collector, 5 times in a row while it
    generates: every group's behaviour log-probs equal an independent forward of the weights
    of the version stamped on it (a push landing inside a batch would mix two versions:
    generated under one, scored or stamped under the next)."""
    import copy

    from torchrl.data import LazyStackStorage, ReplayBuffer
    from transformers import AutoModelForCausalLM

    from test_rollout_func import _reference_logps, _wait
    from torchrl_trl.online.episodes import GENERATED_LOGPROBS_KEY

    _, tok = policy_and_tokenizer
    torch.manual_seed(0)
    own = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    rb = ReplayBuffer(storage=LazyStackStorage(100_000))
    collector = _recording_collector(own, tok, rb, max_new_tokens=12)
    weights = {0: copy.deepcopy(own)}
    with _func(collector, rb, group_size=2, max_staleness=None, push=False) as func:
        func.groups.start()
        for version in range(1, 6):
            written = rb.write_count
            _wait(lambda: rb.write_count >= written + 4)  # generating when the push comes
            trained = copy.deepcopy(weights[version - 1])
            with torch.no_grad():
                for p in trained.parameters():
                    p.add_(0.2 * torch.randn_like(p))
            weights[version] = trained
            assert func.groups.push(trained) == version and func.groups.weight_pushes == version
        written = rb.write_count
        _wait(lambda: rb.write_count >= written + 4)
        func.close()
        groups = func.groups.next_groups(func.groups.pending, version=5, wait=False)
    assert {g.version for g in groups} == set(range(6))
    for group in groups:
        batch = group.batch
        reference = _reference_logps(weights[group.version], batch["prompt_ids"], batch["completion_ids"])
        generated = layouts.read_column(batch.steps[0], GENERATED_LOGPROBS_KEY)  # while generating
        for scored, sampled, ref in zip(batch["logprobs"], generated, reference):
            torch.testing.assert_close(torch.tensor(scored), ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(sampled[1 : len(ref)], ref[1:], atol=1e-4, rtol=1e-4)  # first: TorchRL's 0.0


@pytest.mark.timeout(60)
def test_a_push_into_a_stalled_collector_is_a_named_error(policy_and_tokenizer):
    """A push waits for the batch in flight; a collector stuck inside one (an env step that
    never returns) raises CollectorError after ``timeout``, not a hang."""
    import threading

    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.envs import Transform

    from torchrl_trl.testing import make_policy, make_policy_wrapper

    model, tok = policy_and_tokenizer
    gate = threading.Event()

    class Stall(Transform):  # the env step waits for the gate
        def _step(self, tensordict, next_tensordict):
            gate.wait()
            return next_tensordict

        def _reset(self, tensordict, tensordict_reset):
            return tensordict_reset

    rb = ReplayBuffer(storage=LazyStackStorage(64))
    collector = LLMCollector(env=_env().append_transform(Stall()),
                             policy=make_policy_wrapper(make_policy(tok), tok, max_new_tokens=2),
                             dialog_turns_per_batch=2, replay_buffer=rb, track_policy_version=True,
                             total_dialog_turns=-1)
    func = _func(collector, rb, group_size=2, timeout=1)
    func.groups.start()
    start = time.monotonic()
    with pytest.raises(CollectorError, match="did not end within timeout=1"):
        func.groups.push(model)
    assert time.monotonic() - start < 10 and func.groups.weight_pushes == 0
    gate.set()
    func.close()


def test_caller_pushes_weights_staleness_against_the_collectors_version(policy_and_tokenizer):
    """push=False: the caller moves the collector's PolicyVersion itself; every call
    measures staleness against that version, so groups from before the caller's push are
    dropped with max_staleness=0."""
    import copy
    from types import SimpleNamespace

    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    from torchrl_trl.testing import make_policy_wrapper

    model, tok = policy_and_tokenizer
    trainer = SimpleNamespace(
        num_generations=2, num_generations_eval=2, model=model, state=SimpleNamespace(global_step=0),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
    )
    prompts = [[{"role": "user", "content": "x"}]] * 2
    rb = ReplayBuffer(storage=LazyStackStorage(256), transform=MCAdvantage(grpo_size=2))
    collector = LLMCollector(env=_env(), policy=make_policy_wrapper(copy.deepcopy(model), tok, max_new_tokens=2),
                             dialog_turns_per_batch=2, replay_buffer=rb, track_policy_version=True,
                             total_dialog_turns=-1)
    with _func(collector, rb, group_size=2, push=False, max_staleness=0, timeout=60) as func:
        func(prompts * 2, trainer)
        assert func.policy_version == collector.policy_version == 0 and func.groups.weight_pushes == 0
        collector.increment_version()  # the caller's own push, outside the rollout function
        batch = func(prompts * 2, trainer)
        assert func.policy_version == collector.policy_version == 1 and func.groups.weight_pushes == 0
        assert func.consumed_staleness == [0, 0, 0, 0] and batch["staleness"] == [0] * 4
        # only groups holding an item written before the push can be dropped
        assert func.groups.dropped_stale_groups <= int((read_policy_version(rb[:]) == 0).sum())
        assert func.groups.read_groups == func.groups.consumed_groups + func.groups.dropped_stale_groups + len(func.groups._pending)


def test_max_pending_groups_holds_the_collector(policy_and_tokenizer):
    """max_pending_groups=2: the collector writes 2 groups and waits in TorchRL's
    post_collect_hook (generating nothing) until one is taken; a user's own hook still runs.
    Without the bound TorchRL's collector.start() runs free (checked: dozens of items)."""
    import copy
    import time

    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from torchrl_trl.testing import make_policy_wrapper

    model, tok = policy_and_tokenizer

    def settles_at(rb, expected, settle_s=1.5):
        _wait(lambda: rb.write_count >= expected)
        time.sleep(settle_s)  # free, it writes a batch every few ms here (2244 items in 30 s)
        return rb.write_count

    for bound in (2, None):
        rb = ReplayBuffer(storage=LazyStackStorage(4096))
        collector = LLMCollector(env=_env(), policy=make_policy_wrapper(copy.deepcopy(model), tok, max_new_tokens=2),
                                 dialog_turns_per_batch=2, replay_buffer=rb, track_policy_version=True,
                                 total_dialog_turns=-1)  # one group (2 items) per batch
        seen = []
        collector.post_collect_hook = lambda batch: seen.append(batch.numel())
        with _func(collector, rb, group_size=2, push=False, max_pending_groups=bound,
                                     timeout=60) as func:
            func.groups.start()
            if bound is None:
                _wait(lambda: rb.write_count > 20)
                continue
            assert settles_at(rb, 4) == 4  # 2 groups, the third batch held
            assert len(func.groups.next_groups(1, version=0)) == 1
            assert settles_at(rb, 6) == 6  # room for one more
            assert func.groups.read_groups == 3 and set(seen) == {2}


def test_bad_buffer_and_stopped_collector_are_clear_errors(policy_and_tokenizer):
    import copy
    from types import SimpleNamespace

    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from torchrl_trl.testing import make_policy_wrapper

    model, tok = policy_and_tokenizer
    trainer = SimpleNamespace(
        num_generations=2, num_generations_eval=2, model=model, state=SimpleNamespace(global_step=0),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
    )
    prompts = [[{"role": "user", "content": "x"}]] * 2
    # no MCAdvantage(grpo_size=3): the env writes pairs, so 3 consecutive items are never one group
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    collector = LLMCollector(env=_env(), policy=make_policy_wrapper(copy.deepcopy(model), tok, max_new_tokens=2),
                             dialog_turns_per_batch=2, replay_buffer=rb, track_policy_version=True,
                             total_dialog_turns=-1)
    with _func(collector, rb, group_size=3, push=False) as func:
        with pytest.raises(ValueError, match=r"MCAdvantage\(grpo_size=3"):
            func(prompts[:1] * 3, SimpleNamespace(**{**vars(trainer), "num_generations": 3, "num_generations_eval": 3}))
    # a collector that stops (total_dialog_turns reached) surfaces as an error, never a hang
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    collector = LLMCollector(env=_env(), policy=make_policy_wrapper(copy.deepcopy(model), tok, max_new_tokens=2),
                             dialog_turns_per_batch=2, replay_buffer=rb, track_policy_version=True,
                             total_dialog_turns=2)
    with _func(collector, rb, group_size=2, push=False, timeout=60) as func:
        with pytest.raises(CollectorError, match="not running"):
            func(prompts * 4, trainer)
    with pytest.raises(ValueError, match="max_staleness"):
        _func(collector, rb, group_size=2, max_staleness=-1)
    with pytest.raises(ValueError, match="group_size"):
        _func(collector, rb, group_size=0)
    from torchrl_trl.online import BehaviourLogProbsPostproc

    _, postproc = BehaviourLogProbsPostproc.for_factory(lambda: None)  # its factory never ran here
    with pytest.raises(RuntimeError, match="paired factory"):
        postproc(rb[:])


def test_reuse_and_drop_zero_std_through_a_real_llm_collector(checkpoints, policy_and_tokenizer, tmp_path):
    """reuse=1 and drop_zero_std on the LLMCollector path, trained by GRPOTrainer: the
    collector writes 4 groups and stops (total_dialog_turns=8); the 2 groups of the prompt
    whose env reward is constant are dropped (or left pending, never trained on); each of
    the other 2 is trained on exactly twice
    (fresh at step 1, reused at step 2, once the collector has nothing new), with the rows
    it was generated with."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage
    from transformers import AutoModelForCausalLM

    from torchrl_trl import RewardFunctionWrapper, testing

    def hello_length(prompts, completions, **kwargs):  # constant for the other prompt: no spread
        return [float(len(c[-1]["content"])) + 0.5 * i if "hello" in str(p) else 1.0
                for i, (p, c) in enumerate(zip(prompts, completions))]

    _, tok = policy_and_tokenizer
    env = testing.make_chat_env(ROWS, batch_size=2, group_size=2)
    env = env.append_transform(RewardFunctionWrapper(hello_length).as_transform())
    rb = ReplayBuffer(storage=LazyStackStorage(64), transform=MCAdvantage(grpo_size=2))
    own = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    collector = LLMCollector(env=env, policy=testing.make_policy_wrapper(own, tok, max_new_tokens=4),
                             dialog_turns_per_batch=2, replay_buffer=rb, track_policy_version=True,
                             total_dialog_turns=8)
    func = _func(collector, rb, group_size=2, max_staleness=None, reuse=1, drop_zero_std=True,
                                   timeout=120)
    with func:
        rollout = Recorder(func, "rollout")
        model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
        trainer = _trainer(model, tok, rollout, _reward, tmp_path, max_steps=2)
        trainer.train()
    # the env's prompt order depends on the RNG: a zero-spread group may still be pending
    # (written after the last step read) instead of dropped
    assert func.groups.pending + func.groups.dropped_filtered_groups == 2 and func.groups.read_groups == 4
    assert func.consumed_reuse == [0, 0, 1, 1] and func.replay.reused == 2
    (_, _, first), (_, _, second) = rollout.calls
    assert first["reuse"] == [0] * 4 and second["reuse"] == [1] * 4
    assert all("hello" in str(p) for p in first["torchrl_prompt"] + second["torchrl_prompt"])
    groups = lambda b: sorted(tuple(map(tuple, b["completion_ids"][i : i + 2])) for i in (0, 2))  # noqa: E731
    assert groups(first) == groups(second)  # the same two groups, as generated


def test_async_grpo_protocols_on_a_real_llm_collector(checkpoints, policy_and_tokenizer):
    """TorchRLRolloutWorker / TorchRLWeightTransfer over TorchRL's own LLMCollector (through
    TorchRLRolloutFunc(source=collector)), driven as AsyncGRPOTrainer does: a weight sync streams the
    trainer's named parameters (TorchRL's update_policy_weights_ loads them and bumps its
    PolicyVersion to 1), the worker queues RolloutSamples of whole groups whose old
    log-probs are an independent forward of the synced weights."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol, WeightTransferProtocol

    from test_rollout_func import _reference_logps
    from torchrl_trl.online import TorchRLRolloutWorker, TorchRLWeightTransfer

    _, tok = policy_and_tokenizer
    torch.manual_seed(0)
    trained = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    with torch.no_grad():  # the trainer's weights moved on
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))
    own = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    rb = ReplayBuffer(storage=LazyStackStorage(1024))
    collector = _recording_collector(own, tok, rb)
    source = _func(collector, rb, group_size=2, max_staleness=None, timeout=120)
    worker = TorchRLRolloutWorker(source, [lambda completion_ids, **kw: [float(sum(c) % 7) for c in completion_ids]])
    transfer = TorchRLWeightTransfer(source)
    for proto, obj in ((RolloutWorkerProtocol, worker), (WeightTransferProtocol, transfer)):
        assert all(hasattr(obj, name) for name in dir(proto) if not name.startswith("_"))
    transfer.init_weight_transfer()
    transfer.pause()
    transfer.send_weights((n, p.detach()) for n, p in trained.named_parameters())
    transfer.resume()
    worker.update_model_version(1)
    assert collector.policy_version == 1 and transfer.loaded == len(list(trained.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(own.parameters(), trained.parameters()))
    worker.start()
    try:
        samples = [worker.rollout_buffer.get(timeout=120) for _ in range(4)]
        worker.check_health(60.0)
    finally:
        worker.stop()
    assert not collector.is_running()
    assert [s.group_id for s in samples] == [0, 0, 1, 1] and {s.model_version for s in samples} == {1}
    for a, b in (samples[:2], samples[2:]):
        assert a.prompt == b.prompt and a.advantage == pytest.approx(-b.advantage)
    for s in samples:
        mask = torch.as_tensor(s.completion_mask).bool()
        n_prompt = int((~mask).cumprod(0).sum())
        ids = torch.as_tensor(s.input_ids)
        (ref,) = _reference_logps(trained, [ids[:n_prompt].tolist()], [ids[n_prompt:].tolist()])
        torch.testing.assert_close(torch.as_tensor(s.old_log_probs)[n_prompt:], ref, atol=1e-4, rtol=1e-4)
        assert not torch.as_tensor(s.old_log_probs)[:n_prompt].any()


def _ray_env_factory():  # runs in the collector actor
    return _env()


def _ray_policy_factory():
    import torch

    from torchrl_trl import testing

    torch.set_num_threads(1)
    tok = testing.make_tokenizer()
    return testing.make_policy_wrapper(testing.make_policy(tok), tok, max_new_tokens=4)


@pytest.fixture
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the factories live here
    yield ray
    gc.collect()  # first free the test's collector: a freed RayLLMCollector's __del__ calls its actor (restarts Ray)
    ray.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ray_collector_actor_feeds_grpo_trainer(ray_session, policy_and_tokenizer, tmp_path):
    """Local Ray: the LLMCollector runs in a RayLLMCollector actor and writes whole groups
    (MCAdvantage inside the RayReplayBuffer actor); GRPOTrainer.train() drains them within
    max_staleness, weights go to the actor through update_policy_weights_, the actor records
    complete behaviour log-probs (BehaviourLogProbsPostproc.for_factory) and
    BehaviourLogProbsMixin trains on them."""
    from functools import partial

    ray = ray_session
    from torchrl.objectives.llm import MCAdvantage
    from trl import GRPOTrainer

    from torchrl_trl import testing
    from torchrl_trl.online import BehaviourLogProbsMixin, BehaviourLogProbsPostproc
    from torchrl_trl.online.ray import make_ray_collector, make_ray_replay_buffer

    _, tok = policy_and_tokenizer
    rb = make_ray_replay_buffer(1024, transform_factory=partial(MCAdvantage, grpo_size=2))
    factory, postproc = BehaviourLogProbsPostproc.for_factory(_ray_policy_factory)
    collector = make_ray_collector(_ray_env_factory, factory, rb, dialog_turns_per_batch=2, postproc=postproc)
    model = testing.make_policy(tok)  # the same weights as the actor's (seed 0)
    with _func(collector, rb, group_size=2, max_staleness=1, timeout=180) as func:
        rollout = Recorder(func, "rollout")
        corrected = type("Corrected", (BehaviourLogProbsMixin, GRPOTrainer), {})
        trainer = _trainer(model, tok, rollout, Recorder(_reward, "reward"), tmp_path, max_steps=3, cls=corrected)
        trainer.train()
        version = func.groups.policy_version  # once the last push landed in the actor
    assert trainer.state.global_step == 3 and len(rollout.calls) == 3
    logprobs = [lp for _, _, b in rollout.calls for lp in b["logprobs"]]  # recorded in the actor
    assert logprobs and not any(torch.isnan(torch.tensor(lp)).any() for lp in logprobs)
    assert func.groups.weight_pushes == 3 and version == 3  # TorchRL's PolicyVersion, in the actor
    assert len(func.consumed_staleness) == 6 and max(func.consumed_staleness) <= 1
    assert func.groups.read_groups == func.groups.consumed_groups + func.groups.dropped_stale_groups + len(func.groups._pending)
    stored = rb[:]
    assert len(rb) == rb.write_count >= 2 * func.groups.read_groups and func.groups.missed_items == 0
    versions = [int(v) for v in layouts.read_column(stored, ("next", "policy_version"))]
    assert versions == sorted(versions) and max(versions) <= 3
    stored = set(zip(map(tuple, layouts.read_tokens(stored, "prompt").tolist()),
                     map(tuple, layouts.read_tokens(stored, "response").tolist())))
    trained = {(tuple(p), tuple(c)) for _, _, b in rollout.calls for p, c in zip(b["prompt_ids"], b["completion_ids"])}
    assert len(trained) > 1 and trained <= stored
    # the collector actor dies: calls fail (ray.kill is asynchronous: until the actor is gone,
    # groups it already wrote may still be served, at most all of them), the buffer keeps its data
    ray.kill(collector._collector, no_restart=True)
    served = 0
    with pytest.raises(CollectorError, match="cannot be reached"):
        while served <= rb.write_count // 2:
            func.groups.take(1, version=version)
            served += 1
    assert len(rb) >= len(versions)
    rb.close()


@pytest.mark.parametrize("yield_completed", [True, False], ids=["completed", "batches"])
def test_two_turn_chat_env_episodes_train_as_one_sample(tmp_path, yield_completed):
    """A two-turn ChatEnv collected by a real LLMCollector (MCAdvantage writing whole groups
    of whole episodes) trains GRPOTrainer with one sample per episode: the row's tokens are
    the episode's last step's full sequence, the policy's two responses are trained and the
    tokens between them (the chat template's) are masked out of the loss."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage
    import copy

    from trl import GRPOTrainer

    from test_rollout_func import _no_whitespace
    from torchrl_trl import RewardFunctionWrapper, testing

    # ChatEnv re-renders the chat each turn: a character-level tokenizer and a policy that
    # emits no whitespace give the same ids back (as in test_rollout_func's two-turn test)
    tok = testing.make_tokenizer(vocab_size=104)
    model = _no_whitespace(testing.make_policy(tok, seed=3), tok)
    own = copy.deepcopy(model)  # the collector's own weights
    torch.manual_seed(0)
    env = testing.make_chat_env(ROWS, batch_size=2, group_size=2, max_turns=2)
    env = env.append_transform(RewardFunctionWrapper(_length_reward).as_transform())
    rb = ReplayBuffer(storage=LazyStackStorage(1024), transform=MCAdvantage(grpo_size=2))
    collector = LLMCollector(env=env, policy=testing.make_policy_wrapper(own, tok, max_new_tokens=3),
                             dialog_turns_per_batch=4, replay_buffer=rb, track_policy_version=True,
                             total_dialog_turns=-1, yield_completed_trajectories=yield_completed)
    masked = []

    class MaskRecorder(GRPOTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            masked.append((inputs["completion_ids"], inputs["completion_mask"] * inputs["tool_mask"]))
            return super().compute_loss(model, inputs, *args, **kwargs)

    with _func(collector, rb, group_size=2, max_staleness=1, timeout=120) as func:
        rollout = Recorder(func, "rollout")
        trainer = _trainer(model, tok, rollout, Recorder(_length_reward, "reward"), tmp_path, max_steps=2,
                           cls=MaskRecorder)
        trainer.train()
    assert trainer.state.global_step == 2 and len(rollout.calls) == 2
    # the stored episodes, read independently: consecutive steps, the last one done
    stored = rb[:]
    done = [bool(d.all()) for d in layouts.read_column(stored, ("next", "done"))]
    assert done == [False, True] * (len(done) // 2)  # two steps per episode, in order
    full = layouts.read_tokens(stored, "full").tolist()
    responses = layouts.read_tokens(stored, "response").tolist()
    episodes = {tuple(full[i]): responses[i - 1] + responses[i] for i in range(1, len(done), 2)}
    for _, _, batch in rollout.calls:
        assert len(batch["completion_ids"]) == 4 and "env_mask" in batch
        for p, c, mask in zip(batch["prompt_ids"], batch["completion_ids"], batch["env_mask"]):
            assert tuple(p + c) in episodes  # the episode's last full sequence, token for token
            assert [t for t, m in zip(c, mask) if m] == episodes[tuple(p + c)]  # the policy's tokens only
            assert 0 < mask.count(0) < len(mask)
    # TRL's loss mask (completion mask x tool mask) keeps exactly the policy's two responses
    assert masked
    for ids, mask in masked:
        for row_ids, row_mask in zip(ids, mask):
            kept = row_ids[row_mask.bool()].tolist()
            assert kept in list(episodes.values())


def test_buffer_reading_wraps_and_counts_overwritten_items():
    """The reading logic alone, on a buffer written by hand (a stand-in collector): groups
    are read by write_count across the storage's wrap-around, items overwritten before they
    were read are counted (and warned about once), never returned."""
    from types import SimpleNamespace

    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    def groups(first_id, n, version):
        ids = torch.arange(first_id, first_id + n).repeat_interleave(2)
        return TensorDict({"query": ids, "policy_version": torch.full((2 * n,), version)}, [2 * n])

    rb = ReplayBuffer(storage=LazyTensorStorage(6))  # 3 groups of 2
    collector = SimpleNamespace(is_running=lambda: True, policy_version=0)
    func = _func(collector, rb, group_size=2, max_staleness=0, timeout=1)
    func.groups.poll_s = 0.01
    rb.extend(groups(0, 2, version=0))
    assert [int(g["query"][0]) for _, g in func.groups.take(1, version=0)] == [0]  # group 1 stays pending
    rb.extend(groups(2, 4, version=0))  # 8 items written since: 2 were overwritten before the read
    with pytest.warns(UserWarning, match="2 items were overwritten"):
        got = func.groups.take(4, version=0)
    assert [int(g["query"][0]) for _, g in got] == [1, 3, 4, 5] and func.groups.missed_items == 2
    assert all(torch.equal(g["query"], g["query"][:1].expand(2)) for _, g in got)  # whole groups
    rb.extend(groups(6, 1, version=0))  # a push happened: version-0 groups are now too old
    with pytest.raises(CollectorError, match="expected 1 groups within max_staleness=0, got 0"):
        func.groups.take(1, version=1)
    assert func.groups.dropped_stale_groups == 1 and func.groups.read_groups == 6 and func.groups.missed_items == 2  # group 2 was never read
