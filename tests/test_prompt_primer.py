"""``PromptPrimer``: TRL prompts (chats of any length, or plain text) fed to a real TorchRL
``ChatEnv`` stepped by a real ``LLMCollector``; checked against the prompts themselves and
the tokenizer alone (not our reading code)."""

import pytest
import torch
from tensordict import set_list_to_stack

from torchrl_trl import layouts
from torchrl_trl.online import CollectorError, RolloutOptions, TorchRLRolloutFunc
from torchrl_trl.online.episodes import PromptPrimer, PromptSourceEnded
from torchrl_trl.testing import make_policy, make_policy_wrapper

set_list_to_stack(True).set()

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two?"}],
    [{"role": "user", "content": "hello world"}],
]


def _collector(tok, primer, input_mode, group_size=2):
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv

    env = ChatEnv(batch_size=(group_size,), input_mode=input_mode, tokenizer=tok)
    env = env.append_transform(primer).append_transform(StepCounter(max_steps=1))
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    policy = make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3, input_mode=input_mode)
    collector = LLMCollector(env=env, policy=policy, dialog_turns_per_batch=group_size, replay_buffer=rb,
                             track_policy_version=True, total_dialog_turns=-1)
    return collector, rb


def test_every_prompt_generated_once_in_order_then_the_source_ends(policy_and_tokenizer):
    """Chats of different lengths (one env batch = one group, so one length per batch), a
    context column, a finite source: the collector's extra first reset skips no prompt, each
    group has its prompt twice, and once the source ends every served group is still
    delivered before ``CollectorError``."""
    _, tok = policy_and_tokenizer
    answers = {"hi": "a", "what is two plus two?": "four", "hello world": "b"}
    primer = PromptPrimer(
        iter(CHATS), repeats=2, context_fn=lambda chats: {"answer": [answers[c[-1]["content"]] for c in chats]}
    )
    collector, rb = _collector(tok, primer, "history")
    options = RolloutOptions(group_size=2, max_staleness=None, timeout=60)
    with TorchRLRolloutFunc(source=collector, sync_weights=None, options=options) as func:
        func.groups.start()
        groups = func.groups.next_groups(3, version=0)
        with pytest.raises(CollectorError, match="prompt source ended"):
            func.groups.next_groups(1, version=0)
    assert isinstance(primer.error, PromptSourceEnded) and primer.served_prompts == 3
    assert [g.prompt for g in groups] == CHATS  # the history prompt is the chat itself
    for group, chat in zip(groups, CHATS):
        assert group.batch["answer"] == [answers[chat[-1]["content"]]] * 2
        assert [int(i) for i in layouts.read_column(group.batch.steps[0], "group_id")] == [CHATS.index(chat)] * 2
        # the tokens generated from are the tokenizer's rendering of the chat
        expected = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert group.batch["prompt_ids"] == [list(expected["input_ids"])] * 2
    assert rb.write_count == 6  # nothing written for the source's end


def test_plain_text_prompts_reach_the_policy_as_they_are(policy_and_tokenizer):
    """``raw_text=True`` in text mode: TRL's plain-text prompts are tokenized as they are
    (TRL's own generation does not apply a chat template to them)."""
    _, tok = policy_and_tokenizer
    prompts = ["the sky is", "two plus two is"]
    collector, rb = _collector(tok, PromptPrimer(prompts, repeats=2, raw_text=True), "text")
    batches = iter(collector)
    for _ in range(2):
        next(batches)
    items = rb[:]
    assert layouts.read_text(items, "prompt") == [p for p in prompts for _ in range(2)]
    assert layouts.read_tokens(items, "prompt").tolist() == [tok(p)["input_ids"] for p in prompts for _ in range(2)]
    assert items["group_id"].tolist() == [0, 0, 1, 1]


def test_a_failing_source_raises_at_the_next_step_not_before_the_served_batch(policy_and_tokenizer):
    _, tok = policy_and_tokenizer

    def prompts():
        yield CHATS[0]
        raise RuntimeError("dataset broke")

    primer = PromptPrimer(prompts(), repeats=2)
    collector, rb = _collector(tok, primer, "history")
    batches = iter(collector)
    next(batches)  # the served prompt is generated and written
    assert rb.write_count == 2 and isinstance(primer.error, RuntimeError)
    with pytest.raises(RuntimeError, match="dataset broke"):
        next(batches)
    with pytest.raises(ValueError, match="prompts is empty"):
        PromptPrimer([])
    with pytest.raises(RuntimeError, match="first"):  # nothing served yet: the error is raised at once

        def broken():
            raise RuntimeError("first")
            yield

        _collector(tok, PromptPrimer(broken()), "history")[0].env.reset()
    assert torch.equal(rb[:]["group_id"], torch.tensor([0, 0]))


def test_chats_of_different_lengths_in_one_batch_are_a_clear_error(policy_and_tokenizer):
    """TorchRL's history-mode policy cannot generate chats of different lengths together
    (a zip error deep in History.extend): named up front, in the sync path and in the
    collector's; a text-mode policy generates them."""
    from torchrl_trl.online import TorchRLRolloutFunc, make_prompt_collector

    _, tok = policy_and_tokenizer
    mixed = [CHATS[0], CHATS[0], CHATS[1], CHATS[1]]
    func = TorchRLRolloutFunc(make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3))
    with pytest.raises(ValueError, match=r"chats of \[1, 2\] messages"):
        func.rollout(mixed, group_size=2, version=0)
    text = TorchRLRolloutFunc(make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3, input_mode="text"))
    assert len(text.rollout(mixed, group_size=2, version=0)["completion_ids"]) == 4

    with pytest.raises(ValueError, match=r"chats of \[1, 2\] messages"):  # LLMCollector resets once when built
        make_prompt_collector(func.policy, CHATS[:2], group_size=2, prompts_per_batch=2)
