"""RewardFunctionWrapper: TRL-style reward functions in TorchRL pipelines (ChatEnv,
LLMCollector, replay buffer + MCAdvantage), TRL's argument format, None handling, errors."""

import asyncio
import math

import pytest
import torch

from torchrl_trl import layouts
from torchrl_trl.rewards.functions import RewardFunctionWrapper
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
    wrapper = RewardFunctionWrapper([sync_f, async_f], weights=[1.0, 0.5], per_function_keys=True)
    env = make_chat_env(ROWS).append_transform(wrapper)
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
    rb.append_transform(wrapper)  # write transforms run last-to-first: scored first
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
    RewardFunctionWrapper(f, input_mode="text", reward_key="score", reward_shape=())(td)
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

    wrapper = RewardFunctionWrapper([half, first_only], weights=[1.0, 10.0], per_function_keys=True)
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
    RewardFunctionWrapper([half, first_only], unscorable_reward=0.0)(td)
    assert _stack(td, ("next", "reward")).tolist() == [5.0, 0.0, 2.0, 0.0]


def test_bad_inputs(rollouts):
    td = rollouts.clone()
    with pytest.raises(ValueError, match=r"'short' returned 1 rewards, but 4 were expected"):
        RewardFunctionWrapper(lambda *a, **k: [1.0], names=["short"])(td)
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
    with pytest.raises(ValueError, match="Number of reward weights"):
        RewardFunctionWrapper([n_ids, async_len], weights=[1.0])
    # TRL passes everything by keyword: positional-only names are caught before the call
    with pytest.raises(KeyError, match=r"requires the argument 'p'"):
        RewardFunctionWrapper(lambda p, c, i, **k: [1.0] * len(p))(td)
