"""RewardFunctionWrapper: TRL-style reward functions in TorchRL pipelines (ChatEnv,
LLMCollector, replay buffer + MCAdvantage), TRL's argument format, None handling, errors."""

import asyncio
import math

import pytest
import torch

from torchrl_trl import layouts
from torchrl_trl.rewards.executors import RewardExecutor
from torchrl_trl.rewards.functions import RewardFunctionWrapper
from torchrl_trl.rewards.transform import RewardTransform
from torchrl_trl.testing import collect_rollouts, make_chat_env, make_policy_wrapper

ROWS = [
    {"query": "what is two plus two?", "answer": "#### 4"},
    {"query": "hello world", "answer": "#### hi"},
]


class Recorder:
    """A TRL-style reward function recording what it was called with."""

    def __init__(self, fn, name):
        self.fn, self.__name__, self.calls = fn, name, []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs))
        return self.fn(prompts, completions, completion_ids, **kwargs)


def n_ids(prompts, completions, completion_ids, answer, **kw):
    # depends on the row (ids) and on the column (answer) so row mix-ups show
    return [len(ids) + (0.5 if a == "#### 4" else 0.0) + ids[0] / 1000 for ids, a in zip(completion_ids, answer)]


async def async_len(prompts, completions, completion_ids, **kw):
    await asyncio.sleep(0.01)
    return [float(len(c[-1]["content"])) for c in completions]


@pytest.fixture(scope="module")
def rollouts(policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    rb = collect_rollouts(make_policy_wrapper(model, tok), make_chat_env(ROWS), total_turns=4)
    return rb[:]


def _stack(td, key):
    return torch.stack([torch.as_tensor(v).reshape(-1) for v in layouts.read_column(td, key)]).reshape(-1)


def test_env_sync_async_weighted(policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    sync_f, async_f = Recorder(n_ids, "n_ids"), async_len
    out_keys = [("next", "reward"), ("next", "reward_n_ids"), ("next", "reward_async_len")]
    wrapper = RewardFunctionWrapper([sync_f, async_f], weights=[1.0, 0.5], out_keys=out_keys)
    env = make_chat_env(ROWS).append_transform(wrapper.as_transform())
    assert "reward_n_ids" in env.full_reward_spec.keys()
    data = collect_rollouts(make_policy_wrapper(model, tok), env, total_turns=4)[:]
    # TRL's argument format: every stored row was passed, as TRL passes it (the collector
    # may step once more than it stores, so match rows by their token ids)
    seen = {}
    for call in sync_f.calls:
        for j, row_ids in enumerate(call["completion_ids"]):
            seen[tuple(row_ids)] = {k: call[k][j] for k in ("prompts", "completions", "answer")}
    ids = layouts.read_tokens(data, "response").tolist()
    assert all(isinstance(i, int) for row in ids for i in row)
    rows = [seen[tuple(i)] for i in ids]
    prompts = [r["prompts"] for r in rows]
    completions = [r["completions"] for r in rows]
    answers = [r["answer"] for r in rows]
    assert prompts == layouts.read_history(data, "prompt")
    assert all(isinstance(m, dict) and set(m) == {"role", "content"} for p in prompts for m in p)
    assert completions == layouts.read_history(data, "response")
    assert answers == layouts.read_column(data, "answer")
    assert "trainer_state" in sync_f.calls[0] and callable(sync_f.calls[0]["log_metric"])
    # rewards: exactly what the functions return, in the right rows
    r1 = torch.tensor(n_ids(prompts, completions, ids, answers))
    r2 = torch.tensor([float(len(c[-1]["content"])) for c in completions])
    reward = torch.stack(data.get(("next", "reward"), as_list=True))
    assert reward.shape == (4, 1, 1)
    torch.testing.assert_close(reward.reshape(-1), r1 + 0.5 * r2)
    torch.testing.assert_close(_stack(data, ("next", "reward_n_ids")), r1)
    torch.testing.assert_close(_stack(data, ("next", "reward_async_len")), r2)


def test_replay_buffer_before_mcadvantage(policy_and_tokenizer):
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    model, tok = policy_and_tokenizer
    f = Recorder(n_ids, "n_ids")
    wrapper = RewardFunctionWrapper(f)
    rb = ReplayBuffer(storage=LazyStackStorage(16), batch_size=4)
    rb.append_transform(MCAdvantage(grpo_size=2))
    rb.append_transform(wrapper.as_transform())  # write transforms run last-to-first: scored first
    collect_rollouts(make_policy_wrapper(model, tok), make_chat_env(ROWS), total_turns=4, replay_buffer=rb)
    data = rb[:]
    assert len(rb) == 4
    expected = n_ids(None, None, layouts.read_tokens(data, "response").tolist(), layouts.read_column(data, "answer"))
    torch.testing.assert_close(_stack(data, ("next", "reward")), torch.tensor(expected))
    adv = data.get("advantage", as_padded_tensor=True).reshape(-1)
    assert adv.shape == (4,) and torch.isfinite(adv).all()
    calls = len(f.calls)
    rb.sample()
    assert len(f.calls) == calls  # sampling does not score again


def test_module_text_mode_and_tokenizer_decoding(rollouts, policy_and_tokenizer):
    _, tok = policy_and_tokenizer
    f = Recorder(lambda p, c, i, **kw: [float(len(x)) for x in c], "f")
    td = rollouts.clone()
    RewardFunctionWrapper(f, input_mode="text", out_keys=["score"], reward_shape="flat")(td)
    assert f.calls[-1]["prompts"] == layouts.read_text(rollouts, "prompt")
    assert f.calls[-1]["completions"] == layouts.read_text(rollouts, "response")
    assert _stack(td, "score").tolist() == [float(len(x)) for x in layouts.read_text(rollouts, "response")]
    # with the policy tokenizer, completions are decoded from the ids exactly as TRL does
    RewardFunctionWrapper(f, tokenizer=tok)(rollouts.clone())
    decoded = tok.batch_decode(layouts.read_tokens(rollouts, "response").tolist(), skip_special_tokens=True)
    assert f.calls[-1]["completions"] == [[{"role": "assistant", "content": d}] for d in decoded]
    # columns by name, as a mapping; nothing else passed
    RewardFunctionWrapper(f, columns={"solution": "answer"})(rollouts.clone())
    assert f.calls[-1]["solution"] == layouts.read_column(rollouts, "answer")
    assert "query" not in f.calls[-1]


def test_none_excluded_not_zero(rollouts):
    def half(prompts, completions, completion_ids, **kw):
        return [None if i % 2 else 2.0 for i in range(len(prompts))]

    def first_only(prompts, completions, completion_ids, **kw):
        return [3.0] + [None] * (len(prompts) - 1)

    wrapper = RewardFunctionWrapper([half, first_only], weights=[1.0, 10.0],
                                    out_keys=[("next", "reward"), ("next", "reward_half"), ("next", "reward_first")])
    td = rollouts.clone()
    with pytest.warns(UserWarning, match="All reward functions returned None"):
        wrapper(td)
    reward = _stack(td, ("next", "reward"))
    # row 0: 2 + 10*3; row 2: 2 (None excluded); rows 1, 3: nothing -> NaN (TRL: unscorable)
    assert reward[0] == 32.0 and reward[2] == 2.0
    assert math.isnan(reward[1]) and math.isnan(reward[3])
    assert math.isnan(_stack(td, ("next", "reward_half"))[1])
    assert wrapper.none_counts == {"half": 2, "first_only": 3}
    assert wrapper.unscorable_count == 2
    td = rollouts.clone()
    RewardFunctionWrapper([half, first_only], executor=RewardExecutor(unscorable_reward=0.0))(td)
    assert _stack(td, ("next", "reward")).tolist() == [5.0, 0.0, 2.0, 0.0]


def test_bad_inputs(rollouts):
    td = rollouts.clone()
    with pytest.raises(ValueError, match=r"'short' returned 1 rewards, but 4 were expected"):
        RewardFunctionWrapper({"short": lambda *a, **k: [1.0]})(td)
    with pytest.raises(TypeError, match=r"non-numeric reward at index 0: 'good'"):
        RewardFunctionWrapper(lambda prompts, **k: ["good"] * len(prompts))(td)
    with pytest.raises(TypeError, match="must return a list"):
        RewardFunctionWrapper(lambda prompts, **k: "1.0")(td)

    def needs_solution(prompts, completions, completion_ids, solution, **kw):
        return [1.0] * len(prompts)

    with pytest.raises(KeyError, match=r"requires the argument 'solution'.*answer"):
        RewardFunctionWrapper(needs_solution)(td)
    with pytest.raises(KeyError, match=r"column 'solution'.*not found.*Available keys"):
        RewardFunctionWrapper(needs_solution, columns=["solution"])(td)
    with pytest.raises(ValueError, match=r"expected one weight per reward function \(2\), got 1"):
        RewardFunctionWrapper([n_ids, async_len], weights=[1.0])
    with pytest.raises(ValueError, match=r"out_keys must be 1 key \(the weighted sum\) or 3"):
        RewardFunctionWrapper([n_ids, async_len], out_keys=["a", "b"])
    # TRL passes everything by keyword: positional-only names are caught before the call
    with pytest.raises(KeyError, match=r"requires the argument 'p'"):
        RewardFunctionWrapper(lambda p, c, i, **k: [1.0] * len(p))(td)


def test_completion_ids_of_a_dense_output_with_ragged_tokens(policy_and_tokenizer):
    """TransformersWrapper(input_mode="text", pad_output=False) returns a dense TensorDict
    whose Tokens are lazily stacked: the functions get each sample's real response ids."""
    from tensordict import TensorDict

    model, tok = policy_and_tokenizer
    policy = make_policy_wrapper(model, tok, input_mode="text", pad_output=False, max_new_tokens=6)
    prompts = TensorDict({"text": {"prompt": ["hello there", "what is 2 plus 2 ok", "a", "b c"]}}, [4])
    for seed in range(20):  # sample until a reply stops early (EOS), so responses are ragged too
        torch.manual_seed(seed)
        out = policy(prompts.clone())
        reference = [out[i]["tokens", "response"].tolist() for i in range(4)]  # each sample alone
        if len({len(r) for r in reference}) > 1:
            break
    assert len({len(r) for r in reference}) > 1
    assert type(out).__name__ == "TensorDict"  # dense at the top, lazily stacked Tokens inside
    f = Recorder(lambda p, c, ids, **kw: [len(i) + i[0] / 1000 for i in ids], "f")
    RewardFunctionWrapper(f, out_keys=["score"], reward_shape="flat")(out)
    assert f.calls[-1]["completion_ids"] == reference
    assert all(len(i) for i in reference)
    assert _stack(out, "score").tolist() == pytest.approx([len(r) + r[0] / 1000 for r in reference])


def _text_rollouts():
    from tensordict import TensorDict

    return TensorDict({"text": {"prompt": ["q1", "q2"], "response": ["hi there", "no"]}}, batch_size=[2])


@pytest.mark.timeout(60)
def test_timeouts_name_the_function():
    import threading

    async def stuck(prompts, completions, **kw):
        await asyncio.Event().wait()

    release, unblock = threading.Event(), threading.Event()

    async def blocks_the_loop(prompts, completions, **kw):
        unblock.wait(30)  # no await: cancelling cannot stop it (bounded, never set in time)
        return [1.0] * len(prompts)

    def sync_stuck(prompts, completions, **kw):
        release.wait()
        return [1.0] * len(prompts)

    for func, pattern in ((stuck, "'stuck' did not return within timeout=0.5s"),
                          (blocks_the_loop, r"blocks_the_loop.*did not return within timeout=1.5s"),
                          (sync_stuck, "'sync_stuck' did not return within timeout=0.5s")):
        # each never returns by itself: only the timeout can end the call
        with pytest.raises(TimeoutError, match=pattern):
            RewardFunctionWrapper(func, executor=RewardExecutor(timeout=0.5))(_text_rollouts())
        if func is blocks_the_loop:
            unblock.set()  # free the loop it still blocks
    release.set()
    with pytest.raises(ValueError, match="RewardExecutor: timeout must be a positive number of seconds or None, got 0"):
        RewardExecutor(timeout=0)


def test_infinite_reward_excluded_counted_and_warned():
    def infinite(prompts, completions, **kw):
        return [math.inf, 1.0]

    def two(prompts, completions, **kw):
        return [2.0, -math.inf]

    wrapper = RewardFunctionWrapper([infinite, two], out_keys=[("next", "reward"), ("next", "reward_infinite"),
                                                               ("next", "reward_two")])
    td = _text_rollouts()
    with pytest.warns(UserWarning, match="'infinite' returned an infinite reward for 1 of 2"):
        wrapper(td)
    assert _stack(td, ("next", "reward")).tolist() == [2.0, 1.0]  # excluded, like None
    assert math.isnan(_stack(td, ("next", "reward_infinite"))[0])
    assert wrapper.nonfinite_counts == {"infinite": 1, "two": 1}
    assert wrapper.none_counts == {"infinite": 0, "two": 0}


def test_a_raising_function_keeps_its_name_and_cause():
    def broken(prompts, completions, **kw):
        raise ValueError("bad row 3")

    async def broken_async(prompts, completions, **kw):
        raise KeyError("solution")

    with pytest.raises(ValueError, match="reward function 'broken' raised ValueError: bad row 3") as info:
        RewardFunctionWrapper(broken)(_text_rollouts())
    assert isinstance(info.value.__cause__, ValueError) and str(info.value.__cause__) == "bad row 3"
    with pytest.raises(KeyError, match="'broken_async' raised KeyError") as info:
        RewardFunctionWrapper(broken_async)(_text_rollouts())
    assert isinstance(info.value.__cause__, KeyError)

    async def upstream_timeout(prompts, completions, **kw):
        raise TimeoutError("judge API timed out")

    for timeout in (None, 5.0):  # its own TimeoutError, not the wrapper's timeout
        with pytest.raises(TimeoutError, match="'upstream_timeout' raised TimeoutError: judge API timed out"):
            RewardFunctionWrapper(upstream_timeout, executor=RewardExecutor(timeout=timeout))(_text_rollouts())


def test_async_functions_inside_a_running_event_loop():
    async def length(prompts, completions, **kw):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    async def main():  # a notebook or an async server calling the wrapper
        return RewardFunctionWrapper(length, out_keys=["r"], reward_shape="flat")(_text_rollouts())

    assert asyncio.run(main())["r"].tolist() == [8.0, 2.0]


def test_in_keys_are_the_keys_read_and_completion_ids_never_silently_none():
    def needs_ids(prompts, completions, completion_ids, **kw):
        return [float(len(i)) for i in completion_ids]

    tokens, mask = ("tokens", "response"), ("masks", "all_attention_mask")
    text = [("text", "prompt"), ("text", "response")]
    history = [("history", "prompt"), ("history", "response")]
    assert RewardFunctionWrapper(needs_ids, input_mode="text", columns=["answer"]).in_keys == text + [tokens, mask, "answer"]
    assert RewardFunctionWrapper(needs_ids, input_mode="history").in_keys == history + [tokens, mask]
    assert RewardFunctionWrapper(needs_ids).in_keys == history + text + [tokens, mask]
    with pytest.raises(KeyError, match=r"\['needs_ids'\] take completion_ids.*'tokens', 'response'"):
        RewardFunctionWrapper(needs_ids)(_text_rollouts())


def test_attached_to_an_env_a_call_still_scores_and_the_wrong_attachment_says_what_to_use(policy_and_tokenizer):
    """A call of the scorer always scores (never a silent no-op), and so does its transform
    outside a buffer. Passing the scorer itself to env.append_transform fails naming
    as_transform()."""
    model, tok = policy_and_tokenizer
    scorer = RewardFunctionWrapper(n_ids)
    transform = scorer.as_transform()
    assert isinstance(transform, RewardTransform) and transform.scorer is scorer
    env = make_chat_env(ROWS).append_transform(transform)
    data = collect_rollouts(make_policy_wrapper(model, tok), env, total_turns=2)[:]
    expected = torch.tensor(
        n_ids(None, None, layouts.read_tokens(data, "response").tolist(), layouts.read_column(data, "answer"))
    )
    for score in (transform, scorer):  # called directly, while the transform is on the env
        td = data.exclude(("next", "reward"))
        assert not layouts.has_key(td, ("next", "reward"))
        out = score(td)
        torch.testing.assert_close(_stack(out, ("next", "reward")), expected)
    with pytest.raises(KeyError, match=r"found no response to score.*wrapper\.as_transform\(\)"):
        make_chat_env(ROWS).append_transform(RewardFunctionWrapper(n_ids)).reset()


def test_a_scorer_in_a_replay_buffer_scores_on_write_with_invert():
    """TorchRL's own way to run a module on a buffer's write path: append_transform(invert=True)."""
    from torchrl.data import LazyStackStorage, ReplayBuffer

    calls = []

    def length(prompts, completions, **kw):
        calls.append(len(completions))
        return [float(len(c)) for c in completions]

    rb = ReplayBuffer(storage=LazyStackStorage(8), batch_size=2)
    rb.append_transform(RewardFunctionWrapper(length), invert=True)
    rb.extend(_text_rollouts())
    assert calls == [2]
    assert rb[:]["next", "reward"].reshape(-1).tolist() == [8.0, 2.0]
    rb.sample()
    assert calls == [2]  # sampling does not score again


def test_reward_shape_names():
    td = RewardFunctionWrapper(lambda prompts, completions, **kw: [1.0, 2.0], reward_shape="trailing")(_text_rollouts())
    assert td["next", "reward"].shape == (2, 1)
    with pytest.raises(ValueError, match=r"reward_shape must be one of \['flat', 'step', 'trailing'\]"):
        RewardFunctionWrapper(n_ids, reward_shape="scalar")


def test_write_is_write_rewards_per_key():
    """The module's write is the one every scorer writes with (postprocess.write_rewards): a
    reward already at the key keeps its dtype, inside_next drops the leading "next"."""
    from tensordict import TensorDict

    wrapper = RewardFunctionWrapper(lambda prompts, completions, **kw: [1.0, 2.0],
                                    out_keys=[("next", "reward"), ("next", "reward_<lambda>")])
    td = _text_rollouts().set(("next", "reward"), torch.zeros(2, 1, 1, dtype=torch.float64))
    wrapper(td)
    assert td["next", "reward"].dtype == torch.float64 and td["next", "reward"].flatten().tolist() == [1.0, 2.0]
    assert td["next", "reward_<lambda>"].dtype == torch.get_default_dtype()
    step = wrapper.write(TensorDict(batch_size=[2]), *wrapper.score(td), inside_next=True)
    assert sorted(step.keys()) == ["reward", "reward_<lambda>"] and step["reward"].shape == (2, 1, 1)


@pytest.mark.timeout(60)
def test_run_in_thread_raises_the_named_error_and_carries_torch_modes():
    """torchrl_trl._threads.run_in_thread, the one timeout-by-thread helper: the error
    names what did not return and holds the abandoned thread; grad mode is the caller's."""
    import threading

    from torchrl_trl._threads import run_in_thread
    from torchrl_trl.rewards.calling import FunctionTimeout

    release = threading.Event()
    with pytest.raises(FunctionTimeout, match="the judge did not return") as caught:
        run_in_thread(release.wait, 0.05, "the judge did not return", error=FunctionTimeout)
    assert caught.value.thread.is_alive()  # abandoned, not stopped
    release.set()
    caught.value.thread.join(10)
    assert not caught.value.thread.is_alive()
    with torch.no_grad():
        assert run_in_thread(torch.is_grad_enabled, 10) is False
    assert run_in_thread(torch.is_grad_enabled, 10) is True
    with pytest.raises(KeyError, match="its own error"):
        run_in_thread(lambda: {}["its own error"], 10)
