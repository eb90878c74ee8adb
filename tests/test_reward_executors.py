"""Reward functions that cannot hang training: executor="process" | "thread" | "ray" | an
Executor, a per-completion timeout, failed items counted and excluded, the pool surviving
workers that loop forever, raise, segfault or exit; inside TorchRL (ChatEnv, replay
buffer) and as TRL reward_funcs in GRPOTrainer.train(); the math verifier example."""

import concurrent.futures
import copy
import math
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

# Only the standard library and pytest at import time: worker processes import this
# module to load its reward functions, and start faster without torch.

TIMEOUT = 2.0
THREAD_TIMEOUT = 0.5
# a "stall" waits for this event, which the test sets once it has its results: the
# timeout, not the clock of a sleep, decides (threads cannot be stopped; this frees them)
RELEASE = threading.Event()
# one completion per behaviour; the others score len(text)
BAD = ("loop", "raise", "segv", "exit")


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _misbehave(how: str) -> None:
    if how == "loop":
        while True:
            pass
    if how == "raise":
        raise ValueError("cannot parse this completion")
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "exit":
        os._exit(3)
    if how == "exit0":
        os._exit(0)


def by_text(prompts, completions, **kwargs):
    """Misbehaves when the completion text names a behaviour; else its length."""
    text = _text(completions[0])
    _misbehave(text)
    return [float(len(text))]


def stalls(prompts, completions, **kwargs):
    """by_text, and a "stall" (for executors that cannot stop a thread) until RELEASE is
    set; bounded against a hang. Not in by_text: Ray pickles that by value, an Event cannot."""
    if _text(completions[0]) == "stall":
        RELEASE.wait(120)
    return by_text(prompts, completions, **kwargs)


def by_column(prompts, completions, behaviour, log_extra=None, **kwargs):
    """Batch-capable TRL function: misbehaves per the ``behaviour`` column; logs a column."""
    for how in behaviour:
        _misbehave(how)
    if log_extra is not None:
        log_extra("length", [len(_text(c)) for c in completions])
    return [float(len(_text(c))) for c in completions]


def uses_envs(prompts, completions, environments, **kwargs):
    return [float(id(e)) for e in environments]


def _expected(texts):
    """The independent reference: len(text), NaN for a failing item."""
    return [math.nan if t in BAD + ("stall",) else float(len(t)) for t in texts]


def RewardFunctionWrapper(*args, **kwargs):
    from torchrl_trl.rewards.functions import RewardFunctionWrapper

    return RewardFunctionWrapper(*args, **kwargs)


def RewardExecutor(*args, **kwargs):
    from torchrl_trl.rewards.executors import RewardExecutor

    return RewardExecutor(*args, **kwargs)


def as_trl_reward_func(*args, **kwargs):
    from torchrl_trl.rewards.trl_funcs import as_trl_reward_func

    return as_trl_reward_func(*args, **kwargs)


def _text_rollouts(texts):
    from tensordict import TensorDict

    return TensorDict({"text": {"prompt": ["q"] * len(texts), "response": list(texts)}}, batch_size=[len(texts)])


def _rewards(td):
    return td["next", "reward"].reshape(-1).tolist()


def _same(a, b):
    assert len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b)), (a, b)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_process_pool_survives_loop_raise_segfault_exit():
    texts = ["ab", "loop", "raise", "segv", "abc", "exit", "x", "four"]
    wrapper = RewardFunctionWrapper(by_text, executor=RewardExecutor("process", max_workers=2, mp_context="fork",
                                                                             timeout=TIMEOUT))
    try:
        _same(_rewards(wrapper(_text_rollouts(["ab", "c"]))), [2.0, 1.0])  # warm pool
        pids = set(wrapper.executor.worker_pids)
        with pytest.warns(UserWarning) as record:
            td = wrapper(_text_rollouts(texts))
        _same(_rewards(td), _expected(texts))
        assert wrapper.failure_counts == {"by_text": {"error": 1, "timeout": 1, "crash": 2}}
        assert wrapper.none_counts == {"by_text": 0} and wrapper.unscorable_count == 4
        ours = [str(w.message) for w in record if "RewardFunctionWrapper" in str(w.message)]
        for part in ("ran past its timeout", "worker killed", "ValueError: cannot parse", "killed by SIGSEGV"):
            assert part in " ".join(ours)
        # once per kind (the exit is a second crash) + the unscorable rows; other libraries'
        # warnings (they vary by machine) are not counted
        assert len(ours) == 4, [str(w.message) for w in record]
        assert wrapper.executor.replaced == 3 and len(set(wrapper.executor.worker_pids) - pids) >= 1
        # the pool still works, the counts only grow, each kind is warned about once
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            _same(_rewards(wrapper(_text_rollouts(["loop", "okay"]))), [math.nan, 4.0])
        assert [str(w.message) for w in record if "RewardFunctionWrapper" in str(w.message)] == []
        assert wrapper.failure_counts["by_text"]["timeout"] == 2
    finally:
        wrapper.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_default_context_and_failure_reward_and_copy():
    """The default start method (fresh interpreters): workers import this module; a failed
    item gets failure_reward; a deep copy of the wrapper gets its own pool."""
    wrapper = RewardFunctionWrapper(by_text, executor=RewardExecutor("process", max_workers=2, failure_reward=-1.0,
                                                                             timeout=TIMEOUT))
    clone = None
    try:
        assert wrapper.executor.mp_context == "spawn"
        wrapper(_text_rollouts(["warm", "up"]))
        with pytest.warns(UserWarning, match="failure_reward=-1.0"):
            _same(_rewards(wrapper(_text_rollouts(["ab", "segv", "loop", "raise", "abc"]))), [2.0, -1.0, -1.0, -1.0, 3.0])
        assert wrapper.failure_counts["by_text"] == {"error": 1, "timeout": 1, "crash": 1}
        assert wrapper.unscorable_count == 0  # a failure_reward is a reward
        clone = copy.deepcopy(wrapper)
        assert clone.executor.worker_pids == [] and clone.executor is not wrapper.executor
        _same(_rewards(clone(_text_rollouts(["xyz"]))), [3.0])
        assert not set(clone.executor.worker_pids) & set(wrapper.executor.worker_pids)
    finally:
        wrapper.shutdown()
        if clone is not None:
            clone.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_worker_exiting_with_code_0_is_a_crash():
    """A function that ends its worker with os._exit(0): pebble takes that for a worker's normal
    end and never ends the task (with a timeout, it calls it a timeout); here a crash of that
    item only, with no timeout set, and the pool runs on."""
    wrapper = RewardFunctionWrapper(by_text, executor=RewardExecutor("process", max_workers=2, mp_context="fork"))
    try:
        with pytest.warns(UserWarning, match="crashed its worker"):
            _same(_rewards(wrapper(_text_rollouts(["ab", "exit0", "abc"]))), [2.0, math.nan, 3.0])
        assert wrapper.failure_counts["by_text"] == {"error": 0, "timeout": 0, "crash": 1}
        _same(_rewards(wrapper(_text_rollouts(["four"]))), [4.0])
    finally:
        wrapper.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_thread_and_user_executor():
    """A stalled item times out while its thread still waits (RELEASE is set only after
    the results are in), and its thread is abandoned."""
    texts = ["ab", "stall", "raise", "abc"]
    wrapper = RewardFunctionWrapper(stalls, executor=RewardExecutor("thread", max_workers=2, timeout=THREAD_TIMEOUT))
    try:
        with pytest.warns(UserWarning, match="thread abandoned"):
            _same(_rewards(wrapper(_text_rollouts(texts))), _expected(texts))
    finally:
        RELEASE.set()
    RELEASE.clear()
    assert wrapper.failure_counts["stalls"] == {"error": 1, "timeout": 1, "crash": 0}
    assert wrapper.executor.abandoned == 1
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        wrapper = RewardFunctionWrapper(stalls, executor=RewardExecutor(pool, timeout=THREAD_TIMEOUT))
        try:
            with pytest.warns(UserWarning, match="abandoned"):
                _same(_rewards(wrapper(_text_rollouts(texts))), _expected(texts))
        finally:
            RELEASE.set()  # before the pool's shutdown waits for its threads
        RELEASE.clear()
        assert wrapper.failure_counts["stalls"] == {"error": 1, "timeout": 1, "crash": 0}
    # a standard process pool does not survive a segfault: said clearly, not counted per item
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        wrapper = RewardFunctionWrapper(by_text, executor=RewardExecutor(pool, timeout=TIMEOUT))
        with pytest.raises(RuntimeError, match="ProcessPoolExecutor passed as executor= broke"):
            wrapper(_text_rollouts(["ab", "segv"]))


def length(prompts, completions, **kwargs):
    return [float(len(_text(c))) for c in completions]


@pytest.mark.timeout(60)
def test_failed_item_is_excluded_from_the_weighted_sum_not_zero():
    wrapper = RewardFunctionWrapper([by_text, length], weights=[1.0, 10.0],
                                    executor=RewardExecutor("thread", timeout=THREAD_TIMEOUT),
                                    out_keys=[("next", k) for k in ("reward", "reward_by_text", "reward_length")])
    with pytest.warns(UserWarning, match="'by_text' raised on a completion"):
        td = wrapper(_text_rollouts(["raise", "ab"]))
    _same(_rewards(td), [10.0 * 5, 2.0 + 10.0 * 2])  # TRL's nansum: the failure counts as None
    _same(td["next", "reward_by_text"].reshape(-1).tolist(), [math.nan, 2.0])
    assert wrapper.failure_counts == {"by_text": {"error": 1, "timeout": 0, "crash": 0},
                                      "length": {"error": 0, "timeout": 0, "crash": 0}}
    assert wrapper.unscorable_count == 0 and wrapper.none_counts == {"by_text": 0, "length": 0}


@pytest.mark.timeout(60)
def test_bad_arguments_raise_naming_them():
    lock = threading.Lock()

    def locked(prompts, completions, **kw):
        with lock:
            return [1.0]

    with pytest.raises(TypeError, match=r"'locked'.*cloudpickle, which failed.*lock"):
        RewardFunctionWrapper(locked, executor="process")
    # a lambda, and the closure variable it reads, are sent by value (cloudpickle)
    bonus = 10.0
    closure = RewardFunctionWrapper(lambda prompts, completions, **kw: [bonus + len(_text(completions[0]))],
                                    executor=RewardExecutor("process", max_workers=1))
    try:
        _same(_rewards(closure(_text_rollouts(["ab"]))), [12.0])
    finally:
        closure.shutdown()
    with pytest.raises(ValueError, match="RewardExecutor: kind must be 'caller', 'process', 'thread', 'ray'"):
        RewardFunctionWrapper(by_text, executor="processes")
    with pytest.raises(ValueError, match="max_workers must be a positive int"):
        RewardExecutor("thread", max_workers=0)
    with pytest.raises(ValueError, match="RewardExecutor: mp_context applies to kind='process' only"):
        RewardFunctionWrapper(by_text, executor=RewardExecutor("thread", mp_context="fork"))
    with pytest.raises(ValueError, match="mp_context must be 'spawn', 'forkserver' or 'fork', got 'forks'"):
        RewardExecutor("process", mp_context="forks")
    with pytest.raises(ValueError, match="startup_timeout must be a positive number"):
        RewardExecutor("process", startup_timeout=0)
    spawn = RewardFunctionWrapper(by_text, executor=RewardExecutor("process", mp_context="forkserver"))
    assert spawn.executor.mp_context == "spawn"
    # an argument that cannot cross a process: a clear error, and the pool is reusable
    wrapper = RewardFunctionWrapper(by_text, executor=RewardExecutor("process", mp_context="fork", max_workers=1))
    wrapper.trainer_state = lambda: None
    try:
        with pytest.raises(TypeError, match=r"could not send the shared arguments \['trainer_state'\]"):
            wrapper(_text_rollouts(["a"]))
        wrapper.trainer_state = None
        _same(_rewards(wrapper(_text_rollouts(["a"]))), [1.0])
    finally:
        wrapper.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_functions_a_worker_cannot_import_raise(tmp_path, monkeypatch):
    """A function the worker processes cannot load (it is sent by reference, and its
    module is gone): a clear error, not a hang or a silent None."""
    (tmp_path / "gone_module.py").write_text("def gone(prompts, completions, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gone_module

    wrapper = RewardFunctionWrapper(gone_module.gone, executor=RewardExecutor("process", max_workers=1, timeout=TIMEOUT))
    (tmp_path / "gone_module.py").unlink()
    monkeypatch.delitem(sys.modules, "gone_module")
    try:
        with pytest.raises(RuntimeError, match=r"could not load the reward functions \['gone'\].*No module named 'gone_module'"):
            wrapper(_text_rollouts(["a"]))
    finally:
        wrapper.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_worker_that_cannot_load_the_functions_in_startup_timeout_raises(tmp_path, monkeypatch):
    """RewardExecutor(startup_timeout=): a worker still loading the functions (here an
    import that blocks in the workers only) is killed and a clear error raised."""
    (tmp_path / "slow_module.py").write_text(
        "import os, threading\n"
        "if os.environ.get('SLOW_IMPORT'):\n"
        "    threading.Event().wait(100)\n"
        "def slow(prompts, completions, **kw):\n    return [1.0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_module

    monkeypatch.setenv("SLOW_IMPORT", "1")  # the workers, fresh interpreters, block on import
    wrapper = RewardFunctionWrapper(slow_module.slow, executor=RewardExecutor("process", startup_timeout=1))
    try:
        with pytest.raises(RuntimeError, match=r"did not load the reward functions \['slow'\] within 1.0s"):
            wrapper(_text_rollouts(["a"]))
        assert wrapper.executor.worker_pids == []  # the stuck worker was killed, not left behind
    finally:
        wrapper.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_workers_start_up_is_not_on_an_items_clock():
    """Issue 33, defect 6: a RewardFunctionWrapper sent to a fresh worker imports torch and
    torchrl when unpickled (before the worker says it is ready), and its first call imported
    TRL (transformers, datasets: 5-8 s on 2 cores), which counted against the first item's
    timeout: as_trl_reward_func(RewardFunctionWrapper(f), executor=RewardExecutor("process", timeout=2))
    returned [None, None] (each replacement worker paid it again). Workers now warm the
    functions up while starting, under startup_timeout, before any item is sent."""
    func = as_trl_reward_func(RewardFunctionWrapper(by_text), executor=RewardExecutor("process", max_workers=1,
                                                                                               timeout=TIMEOUT))
    try:
        assert func(["q", "q"], ["ab", "abc"]) == [2.0, 3.0]
        assert func.failure_counts == {"error": 0, "timeout": 0, "crash": 0}
        assert func.executor.replaced == 0
    finally:
        func.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_loading_the_functions_is_not_on_an_items_clock(tmp_path, monkeypatch):
    """A function whose module takes longer to import in the workers than an item's timeout
    (a worker's start-up): every item still gets its whole timeout."""
    (tmp_path / "slow_load.py").write_text(
        "import os, time\n"
        "if os.environ.get('SLOW_LOAD'):\n"
        "    time.sleep(3)\n"
        "def quick(prompts, completions, **kw):\n    return [float(len(completions[0]))]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_load

    monkeypatch.setenv("SLOW_LOAD", "1")  # the workers, fresh interpreters, take 3 s to load it
    func = as_trl_reward_func(slow_load.quick, executor=RewardExecutor("process", max_workers=2, timeout=1))
    try:
        assert func(["q"] * 3, ["a", "bb", "ccc"]) == [1.0, 2.0, 3.0]
        assert func.failure_counts == {"error": 0, "timeout": 0, "crash": 0}
    finally:
        func.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_trl_function_per_completion_with_logs():
    """as_trl_reward_func(plain TRL function, executor="process"): TRL's call, one
    completion per worker call, log_extra replayed aligned (None for a failed one)."""
    func = as_trl_reward_func(by_column, executor=RewardExecutor("process", max_workers=2, mp_context="fork",
                                                                           timeout=TIMEOUT))
    assert func.is_trl_function and func.__name__ == "by_column"
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
    completions = [[{"role": "assistant", "content": c}] for c in ("a", "bb", "ccc", "dddd")]
    logged, metrics = {}, []
    try:
        with pytest.warns(UserWarning, match="returned as None"):
            out = func(prompts, completions, completion_ids=[[1]] * 4, behaviour=["ok", "loop", "ok", "segv"],
                       trainer_state=None, log_extra=lambda c, v: logged.setdefault(c, []).extend(v),
                       log_metric=lambda n, v: metrics.append((n, v)))
        assert out == [1.0, None, 3.0, None]
        assert func.failure_counts == {"error": 0, "timeout": 1, "crash": 1} and func.scored == 4
        assert logged == {"length": [1, None, 3, None]}
        # arguments the function cannot take: raised once, before any completion is sent
        with pytest.raises(KeyError, match="'by_column' requires the argument 'behaviour'"):
            func(prompts, completions, completion_ids=[[1]] * 4)
        # TRL's environments (live objects) go to threads, one per completion, not to processes
        envs = [object() for _ in range(4)]
        assert as_trl_reward_func(uses_envs, executor="thread")(prompts, completions, environments=envs) == [
            float(id(e)) for e in envs
        ]
        refused = as_trl_reward_func(uses_envs, executor=RewardExecutor("process", mp_context="fork"))
        with pytest.raises(TypeError, match="'uses_envs' takes TRL's environments.*executor='thread'"):
            refused(prompts, completions, environments=envs)
        assert refused.executor.worker_pids == []
        # without an executor the same function scores the batch in one call
        inline = as_trl_reward_func(by_column)
        assert inline(prompts, completions, behaviour=["ok"] * 4) == by_column(prompts, completions, ["ok"] * 4)
    finally:
        func.shutdown()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_trainer_train_continues_past_hangs_and_crashes(checkpoints, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    behaviours = ["ok", "loop", "raise", "segv"]
    func = as_trl_reward_func(by_column, executor=RewardExecutor("process", max_workers=2, timeout=TIMEOUT))
    calls = []

    def recorded(prompts, completions, **kwargs):  # what TRL receives back
        out = func(prompts, completions, **kwargs)
        calls.append((list(kwargs["behaviour"]), [_text(c) for c in completions], out))
        return out

    recorded.__name__ = "by_column"
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=2,
        max_completion_length=8, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        logging_steps=1, shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=str(checkpoints.policy), reward_funcs=[recorded], args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"question {i}" for i in range(4)], "behaviour": behaviours}),
    )
    try:
        with pytest.warns(UserWarning, match="by_column"):
            trainer.train()
    finally:
        func.shutdown()
    assert trainer.state.global_step == 1 and len(calls) == 1
    seen = [b for call in calls for b in call[0]]
    assert sorted(seen) == sorted(behaviours * 2)  # every prompt, num_generations times
    for behaviour, texts, out in calls:
        assert out == [float(len(t)) if b == "ok" else None for b, t in zip(behaviour, texts)]
    assert func.failure_counts == {"error": 2, "timeout": 2, "crash": 2}
    assert all(math.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)


ROWS = [{"query": "what is two plus two?", "answer": "ok"}, {"query": "hello world", "answer": "loop"}]


def by_answer(prompts, completions, answer, **kwargs):
    """TorchRL side: hangs on the rows whose ``answer`` column says so."""
    _misbehave(answer[0])
    return [float(len(_text(completions[0])))]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_inside_torchrl_chat_env_and_replay_buffer(policy_and_tokenizer):
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from torchrl_trl import layouts
    from torchrl_trl.testing import collect_rollouts, make_chat_env, make_policy_wrapper

    model, tok = policy_and_tokenizer
    wrapper = RewardFunctionWrapper(by_answer, executor=RewardExecutor("process", max_workers=2, mp_context="fork",
                                                                             timeout=TIMEOUT))
    try:
        env = make_chat_env(ROWS).append_transform(wrapper.as_transform())
        with pytest.warns(UserWarning, match="ran past its timeout"):
            data = collect_rollouts(make_policy_wrapper(model, tok), env, total_turns=4)[:]
        answers = layouts.read_column(data, "answer")
        expected = [math.nan if a == "loop" else float(len(c[-1]["content"]))
                    for a, c in zip(answers, layouts.read_history(data, "response"))]
        _same(data.get(("next", "reward"), as_padded_tensor=True).reshape(-1).tolist(), expected)
        assert wrapper.failure_counts["by_answer"]["timeout"] >= answers.count("loop") > 0
        # the same wrapper scoring rollouts as they are written to a buffer: exact counts
        rb = ReplayBuffer(storage=LazyStackStorage(16))
        executor = RewardExecutor("process", max_workers=2, mp_context="fork", failure_reward=0.0, timeout=TIMEOUT)
        scorer = RewardFunctionWrapper(by_answer, executor=executor)
        rb.append_transform(scorer.as_transform())
        rollouts = data.exclude(("next", "reward"))
        with pytest.warns(UserWarning):
            rb.extend(rollouts)
        _same(rb[:].get(("next", "reward"), as_padded_tensor=True).reshape(-1).tolist(),
              [0.0 if math.isnan(e) else e for e in expected])
        assert scorer.failure_counts["by_answer"] == {"error": 0, "timeout": answers.count("loop"), "crash": 0}
        scorer.shutdown()
    finally:
        wrapper.shutdown()


@pytest.mark.timeout(120)
def test_ray_tasks_survive_loop_raise_crash():
    ray = pytest.importorskip("ray")
    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    if time.monotonic() - started > 30:
        ray.shutdown()
        pytest.skip("a local Ray cluster took more than 30 s to start")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    try:
        texts = ["ab", "loop", "raise", "segv", "abc", "exit"]
        wrapper = RewardFunctionWrapper(by_text, executor=RewardExecutor("ray", max_workers=2, timeout=TIMEOUT))
        wrapper(_text_rollouts(["warm"]))
        with pytest.warns(UserWarning):
            _same(_rewards(wrapper(_text_rollouts(texts))), _expected(texts))
        assert wrapper.failure_counts["by_text"] == {"error": 1, "timeout": 1, "crash": 2}
        _same(_rewards(wrapper(_text_rollouts(["ok"]))), [2.0])
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()


@pytest.mark.timeout(120)
def test_math_verifier_example(monkeypatch):
    pytest.importorskip("math_verify")
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples"))  # workers import it too
    import math_verifier

    result = math_verifier.run(timeout=3.0, max_workers=2)
    # right, right (2/6 = 1/3), wrong, hangs in sympy (killed), unparseable solution
    assert result["rewards"] == [1.0, 1.0, 0.0, None, None]
    assert result["failure_counts"] == {"error": 0, "timeout": 1, "crash": 0}
    # the function itself, in this process, on the answers that return
    assert math_verifier.math_accuracy([r"\boxed{4}", r"\boxed{5}"], ["$4$", "$4$"]) == [1.0, 0.0]
