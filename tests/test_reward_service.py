"""One reward-model service on Ray shared by several collectors: rewards equal an
independent per-sequence reference; concurrent requests are coalesced into fewer forwards
and routed back in order; a killed or hung actor gives a clear error within a bound, a
restartable one recovers."""

import os
import sys
import threading
import time
import warnings

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

from torchrl_trl import layouts  # noqa: E402
from torchrl_trl.layouts import Ragged  # noqa: E402
from torchrl_trl.rewards import (  # noqa: E402
    HFRewardModelWrapper, HFRewardTransform, RewardBatching, RewardOutput, RewardRenderer,
)
from torchrl_trl.rewards.service import RewardServiceClient, RewardServiceError  # noqa: E402
from torchrl_trl.testing import collect_rollouts, make_chat_env, make_policy_wrapper  # noqa: E402

ROWS = [
    {"query": "what is two plus two?", "answer": "4"},
    {"query": "hello world", "answer": "hi"},
]


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    # the worker function lives in this test module, which Ray workers cannot import
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def _reference(path, sequences):
    """The checkpoint loaded with plain transformers, each sequence alone, unpadded."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in sequences])


def _history_ids(path, conversations):
    tok = AutoTokenizer.from_pretrained(path)
    return [tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]
            for c in conversations]  # fmt: skip


def _rewards(rb):
    return torch.stack(rb[:].get(("next", "reward"), as_list=True))


def _collect_in_worker(path, policy_path, actor_name):
    """A collector in another process (a Ray task), as an env worker would run: its own
    transform, attached to the service by name."""
    import os

    from tensordict import set_list_to_stack
    from transformers import AutoModelForCausalLM

    set_list_to_stack(True).set()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(policy_path)
    model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    client = RewardServiceClient(path, renderer=RewardRenderer(policy_tokenizer=tok), remote_config={"name": actor_name},
                                 timeout=60)
    tf = HFRewardTransform(client)
    env = make_chat_env(ROWS, batch_size=2, group_size=1).append_transform(tf)
    rb = collect_rollouts(make_policy_wrapper(model, tok, max_new_tokens=6), env, total_turns=4, seed=1)
    return _rewards(rb), layouts.read_history(rb[:], "full"), tf.scorer.info()["pid"], os.getpid()


@pytest.mark.distributed  # starts Ray: a reward-model service actor
@pytest.mark.timeout(120)
def test_two_collectors_share_one_service(ray_session, checkpoints, policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    path = str(checkpoints.reward_model_other_tokenizer)
    client = RewardServiceClient(path, renderer=RewardRenderer(policy_tokenizer=tok),
                                 remote_config={"name": "rm-shared", "num_cpus": 0}, timeout=60)  # fmt: skip
    tf = HFRewardTransform(client)
    assert tf.in_keys == [("history", "full")] and tf.out_keys == [("next", "reward")]
    # the second collector runs in another process, concurrently with the first
    remote = ray.remote(num_cpus=1)(_collect_in_worker).remote(path, str(checkpoints.policy), "rm-shared")
    env = make_chat_env(ROWS, batch_size=2, group_size=1).append_transform(tf)
    rb = collect_rollouts(make_policy_wrapper(model, tok, max_new_tokens=6), env, total_turns=4, seed=0)
    remote_rewards, remote_convs, remote_service_pid, worker_pid = ray.get(remote, timeout=100)

    # one actor: created by the first transform, attached to by name from the worker
    assert [n for n in ray.util.list_named_actors() if n == "rm-shared"] == ["rm-shared"]
    assert remote_service_pid == tf.scorer.info()["pid"] and worker_pid != os.getpid()
    in_process = HFRewardModelWrapper(path, renderer=RewardRenderer(policy_tokenizer=tok), inference_mode=True)
    for rewards, convs in [(_rewards(rb), layouts.read_history(rb[:], "full")), (remote_rewards, remote_convs)]:
        assert rewards.shape == (4, 1, 1) and rewards.dtype == torch.float32
        # an independent reference: plain transformers, each conversation alone, unpadded
        ref = _reference(path, _history_ids(path, convs))
        torch.testing.assert_close(rewards.reshape(-1), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(rewards.reshape(-1), in_process.score_messages(convs), atol=1e-5, rtol=0)
    assert len({float(r) for r in _rewards(rb).reshape(-1)}) > 1
    stats = tf.scorer.stats()
    # every env step (2 samples) of both collectors was one request to the one service
    assert stats["sequences"] == 2 * stats["requests"] >= 8

    # called as a module (a buffer's write path): scores and writes ("next", "reward")
    # TorchRL's ModuleTransform spelling: attaches to the running service by name (the
    # tokens are re-rendered here from the chat, so no policy tokenizer is needed)
    standalone = HFRewardTransform(path, use_ray_service=True, actor_name="rm-shared", num_cpus=0)
    again = standalone(rb[:].exclude(("next", "reward")))
    torch.testing.assert_close(torch.stack(again.get(("next", "reward"), as_list=True)), _rewards(rb),
                               atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.distributed  # starts Ray: a reward-model service actor
@pytest.mark.timeout(60)
def test_concurrent_requests_coalesce_split_and_route_back(ray_session, checkpoints):
    path = str(checkpoints.reward_model_other_tokenizer)
    # 3 s of bounded wait: five threads released by one barrier meet in one flush even on
    # a busy machine
    client = RewardServiceClient(path, batching=RewardBatching(max_tokens_per_batch=64), max_wait_ms=3000,
                                 remote_config={"name": "rm-batching", "num_cpus": 0}, timeout=60)  # fmt: skip
    gen = torch.Generator().manual_seed(0)

    def seqs(lengths):
        return [torch.randint(4, 140, (n,), generator=gen).tolist() for n in lengths]

    # each caller alone: 2 forwards (12 < 0.9 x 30); the last request (180 tokens) exceeds
    # the 64-token budget by itself and must be split
    requests = [seqs([12, 30]) for _ in range(3)] + [seqs([30] * 6)]
    bad = seqs([8])
    bad[0][-1] = 500  # outside the 140-row embedding
    results, errors = [None] * 5, [None] * 5
    barrier = threading.Barrier(5)

    def call(i, sequences):
        barrier.wait()
        try:
            results[i] = client.score_ids(Ragged.from_list(sequences))
        except Exception as e:
            errors[i] = e

    threads = [threading.Thread(target=call, args=(i, s)) for i, s in enumerate(requests + [bad])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    # only the caller who sent the bad ids gets the error, naming what was wrong
    assert errors[:4] == [None] * 4, errors
    assert isinstance(errors[4], ValueError) and "token id 500 in sample 0 is outside the model's embedding" in str(errors[4])
    for sequences, got in zip(requests, results):
        torch.testing.assert_close(got, _reference(path, sequences), atol=1e-5, rtol=0)
    stats = client.stats()
    alone = HFRewardModelWrapper(path, batching=RewardBatching(max_tokens_per_batch=64), inference_mode=True)
    calls = []
    alone.model.register_forward_hook(lambda *a: calls.append(1))
    for sequences in requests:
        alone.score_ids(Ragged.from_list(sequences))
    assert stats["sequences"] == 3 * 2 + 6 + 1 and stats["max_requests_per_flush"] >= 4
    assert stats["max_forward_tokens"] <= 64  # the big request was split by the budget
    assert stats["forwards"] < len(calls), (stats, len(calls))  # coalescing saved forwards

    # a caller whose timeout is shorter than the service takes (here: it holds a lone
    # request up to 3 s for company) gets the error naming its timeout, not a hang
    impatient = RewardServiceClient(path, batching=RewardBatching(max_tokens_per_batch=64),
                                    remote_config={"name": "rm-batching"}, timeout=0.3)
    with pytest.raises(RewardServiceError, match=r"'rm-batching' did not answer score\(\) within timeout=0\.3s"):
        impatient.score_ids(Ragged.from_list(seqs([5])))
    client.shutdown()


@pytest.mark.distributed  # starts Ray: a reward-model service actor
@pytest.mark.timeout(90)
def test_restart_if_configured_then_killed_service_errors_within_bound(ray_session, checkpoints):
    path = str(checkpoints.reward_model)
    texts = ["hello world", "bye"]
    # the independent reference: plain transformers on each text alone, tokenised as
    # RewardTrainer does (special tokens, the reward model's EOS appended)
    tok = AutoTokenizer.from_pretrained(path)
    ref = _reference(path, [tok(t + tok.eos_token)["input_ids"] for t in texts])
    assert ref[0] != ref[1]
    torch.testing.assert_close(HFRewardModelWrapper(path, inference_mode=True).score_texts(texts), ref, atol=1e-5, rtol=0)
    # the caller's timeout outlasts the test's: an error by the timeout could not pass
    client = RewardServiceClient(path, remote_config={"name": "rm-faults", "num_cpus": 0, "max_restarts": 1}, timeout=600)
    torch.testing.assert_close(client.score_texts(texts), ref, atol=1e-5, rtol=0)
    pid = client.info()["pid"]
    # max_restarts=1: Ray restarts the killed actor (weights reloaded) and the call goes through
    ray.kill(client.actor, no_restart=False)
    torch.testing.assert_close(client.score_texts(texts), ref, atol=1e-5, rtol=0)
    assert client.info()["pid"] != pid
    # killed for good: the next call fails with the error naming the death, not the
    # timeout (600 s: the test's 90 s timeout would end a wait for it first)
    ray.kill(client.actor, no_restart=True)
    with pytest.raises(RewardServiceError, match="'rm-faults' died or cannot be reached"):
        client.score_texts(texts)


def test_service_arguments_are_checked(checkpoints, policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    path = str(checkpoints.reward_model)
    with pytest.raises(TypeError, match="RewardServiceClient: expected a local path"):
        RewardServiceClient(model)
    with pytest.raises(ValueError, match="RewardServiceClient: timeout must be a finite"):
        RewardServiceClient(path, timeout=float("inf"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'inference_mode'"):
        RewardServiceClient(path, inference_mode=False)
    with pytest.raises(TypeError, match="RewardServiceClient: model_kwargs takes load_reward_model's loading"):
        RewardServiceClient(path, model_kwargs={"load_tokenizer": False})
    with pytest.raises(TypeError, match="RewardServiceClient: output must be a RewardOutput or None, got str"):
        RewardServiceClient(path, output="step")
    with pytest.raises(TypeError, match="use_ray_service=True serves the reward model from a local path"):
        HFRewardTransform(HFRewardModelWrapper(path), use_ray_service=True)


class _Created(Exception):
    """Raised where the client would create the actor: what it asked Ray for is recorded."""


class _RecordingRay:
    """Stands in for ``ray`` up to the actor's creation: records the Ray options and the
    actor's arguments (``ray.remote(cls).options(**options).remote(*args, **kwargs)``)."""

    def __init__(self):
        self.asked = {}

    def is_initialized(self):
        return True

    def remote(self, cls):
        asked = self.asked

        class _Actor:
            def options(self, **options):
                asked["options"] = options
                return self

            def remote(self, *args, **kwargs):
                asked["args"] = (args, kwargs)
                raise _Created

        return _Actor()


@pytest.fixture
def recording_ray(monkeypatch):
    from torchrl_trl.rewards import service

    fake = _RecordingRay()
    monkeypatch.setattr(service, "_require_ray", lambda: fake)
    return fake.asked


def test_ray_options_reach_the_actor(checkpoints, recording_ray):
    """``remote_config`` is the actor's Ray options; the wrapper's settings go to the actor."""
    path = str(checkpoints.reward_model)
    ray_options = {"num_cpus": 0.5, "num_gpus": 1, "namespace": "rl", "max_restarts": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(_Created):
            RewardServiceClient(path, remote_config={**ray_options, "name": "rm"}, batching=RewardBatching(pad_token_id=0),
                                output=RewardOutput(head_index=1, shape="step"), model_kwargs={"device": "cpu"})
    assert recording_ray["options"] == {**ray_options, "name": "rm", "get_if_exists": True, "lifetime": "detached",
                                     "max_task_retries": -1, "max_concurrency": 1000}
    (model_path,), kwargs = recording_ray["args"]
    # the service-side settings: batching, the output's head (not its shape, the caller's), loading
    assert model_path == path and kwargs == {"batching": RewardBatching(pad_token_id=0),
                                             "output": RewardOutput(head_index=1), "model_kwargs": {"device": "cpu"},
                                             "max_wait_ms": 5.0}


def test_private_actor_options(checkpoints, recording_ray):
    with pytest.raises(_Created):
        RewardServiceClient(str(checkpoints.reward_model), remote_config={"lifetime": "detached"})
    # unnamed: no name, no lifetime (it dies with its creator), no retries without restarts
    assert recording_ray["options"] == {"max_restarts": 0, "max_task_retries": 0, "max_concurrency": 1000}
    assert recording_ray["args"][1]["model_kwargs"] == {}


@pytest.mark.distributed  # starts Ray: a reward-model service actor
@pytest.mark.timeout(90)
def test_service_killed_while_a_request_is_in_flight_errors_within_bound(ray_session, checkpoints):
    """The actor dies while it holds a caller's request (waiting up to 60 s for company):
    the caller gets RewardServiceError naming the death, not its timeout (600 s, longer
    than the test may run), and no hang."""
    path = str(checkpoints.reward_model)
    client = RewardServiceClient(path, remote_config={"num_cpus": 0}, timeout=600, max_wait_ms=60_000)  # private actor
    assert client.stats()["pending"] == 0  # started and loaded
    outcome = {}

    def call():
        try:
            outcome["result"] = client.score_texts(["hello world", "bye"])
        except Exception as e:
            outcome["error"] = e

    caller = threading.Thread(target=call)
    caller.start()
    # the service holds the request (pending) before it is killed; polling only bounds the
    # wait, the test's timeout ends a hang
    deadline = time.monotonic() + 60
    while client.stats()["pending"] == 0:
        assert caller.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.05)
    ray.kill(client.actor, no_restart=True)
    caller.join(timeout=80)
    assert not caller.is_alive()
    assert "result" not in outcome, outcome
    assert isinstance(outcome["error"], RewardServiceError), outcome
    assert "died or cannot be reached" in str(outcome["error"]), outcome
