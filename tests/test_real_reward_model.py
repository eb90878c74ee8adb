"""The Hugging Face reward-model path on a real pretrained chat model: SmolLM2-135M-Instruct as
the policy (built with ``safe_policy_wrapper``) and a reward model from the same backbone
trained by ``trl.RewardTrainer`` (conftest's ``smollm2_reward_dir``).

References are independent of torchrl_trl (``tests/real_model.py``): each chat scored alone by
the reward model with its own chat template (``reward_alone``), the prompt TorchRL showed the
policy written out by hand, replies generated alone (``greedy_reply``)."""

from __future__ import annotations

import pytest
import torch
from real_model import SAME_LENGTH_QUERIES, ended, greedy_reply, reply_text, reward_alone
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from torchrl_trl import HFRewardModelWrapper, HFRewardTransform, RewardRenderer, safe_policy_wrapper
from torchrl_trl.testing import collect_rollouts, make_chat_env, prompt_dataloader

pytestmark = pytest.mark.real_model

MAX_NEW_TOKENS = 16
GROUP = 2


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    """The policy's tokenizer as shipped: pad == eos == ``<|im_end|>``."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    return tokenizer


@pytest.fixture(scope="module")
def rm(smollm2_reward_dir):
    """The reward model and its tokenizer, loaded with plain transformers (the reference's)."""
    model = AutoModelForSequenceClassification.from_pretrained(smollm2_reward_dir).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_reward_dir)


def _prompt_text(query: str) -> str:
    """The prompt TorchRL shows the policy for one user turn, written out: its own ChatML
    (``chatml_format``, picked for a local checkpoint), without the model's default system line."""
    return f"<|im_start|>user\n{query}<|im_end|>\n<|im_start|>assistant\n"


def _lazy(td):
    from tensordict import LazyStackedTensorDict

    return isinstance(td, LazyStackedTensorDict)


def _reply_ids(td, i: int, pad_id: int) -> list[int]:
    """Sample ``i``'s reply ids as stored, right padding (a safe pad id, never generated) dropped."""
    row = td.get(("tokens", "response"), as_list=True)[i].tolist() if _lazy(td) else td["tokens", "response"][i].tolist()
    return [t for t in row if t != pad_id]


def _alone_text(rm, text: str) -> float:
    """The reward model on one plain text alone, as ``trl.RewardTrainer`` scores plain-text pairs:
    its EOS appended unless the text ends with it, tokenised with the tokenizer's special tokens."""
    model, rm_tok = rm
    if not text.endswith(rm_tok.eos_token):
        text += rm_tok.eos_token
    ids = rm_tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, 0])


class _CountRows:
    """Rows of every forward of ``model`` (a forward hook, removed on exit), in call order."""

    def __init__(self, model):
        self.model, self.rows = model, []

    def __enter__(self):
        def hook(module, args, kwargs, out):
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self.rows.append(int(ids.shape[0]))

        self.handle = self.model.register_forward_hook(hook, with_kwargs=True)
        return self.rows

    def __exit__(self, *exc):
        self.handle.remove()


# README quickstart 2 on the real model: ChatEnv + HFRewardTransform + LLMCollector + MCAdvantage + GRPOLoss


@pytest.fixture(scope="module")
def quickstart(smollm2_model, tok, smollm2_reward_dir):
    """README quickstart 2's collection, on the real models: 2 prompts x a group of 2, sampled."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm.grpo import MCAdvantage

    scorer = HFRewardModelWrapper.for_grpo(str(smollm2_reward_dir), renderer=RewardRenderer(policy_tokenizer=tok))
    env = make_chat_env([{"query": q} for q in SAME_LENGTH_QUERIES], batch_size=2, group_size=GROUP)
    env = env.append_transform(HFRewardTransform(scorer))
    policy = safe_policy_wrapper(
        smollm2_model, tok, input_mode="history", generate=True, return_log_probs=True, pad_output=False,
        generate_kwargs={"max_new_tokens": MAX_NEW_TOKENS, "do_sample": True},
    )
    rb = ReplayBuffer(storage=LazyStackStorage(16))
    rb.append_transform(MCAdvantage(grpo_size=GROUP))
    with _CountRows(scorer.model) as rows:
        collect_rollouts(policy, env, total_turns=2 * GROUP, replay_buffer=rb, seed=0)
    return rb, rows, policy


def test_quickstart2_rewards_are_each_chat_alone_one_forward_each(quickstart, rm, tok):
    rb, rows, policy = quickstart
    data = rb[:]
    n = len(rb)
    assert n == 2 * GROUP
    # defect 3: one reward-model row per completion (the env's inverse pass scored them again: 8)
    assert sum(rows) == n, f"reward-model rows per forward: {rows}, for {n} completions"

    pad = policy.tokenizer.pad_token_id
    rewards = torch.stack(data.get(("next", "reward"), as_list=True)).reshape(-1)
    chats = data["history", "full"]
    diffs, stored_token_diffs = [], []
    model, rm_tok = rm
    for i, query in enumerate(data["query"]):
        reply = _reply_ids(data, i, pad)
        messages = [{"role": "user", "content": query},
                    {"role": "assistant", "content": reply_text(reply, policy.model, tok)}]
        # the chat TorchRL stored is the prompt + what was generated
        assert [{"role": r, "content": c} for r, c in zip(chats[i].role, chats[i].content)] == messages
        ref = reward_alone(model, rm_tok, messages)
        diffs.append(abs(float(rewards[i]) - ref))
        # defect 2: the stored tokens (TorchRL's rendering) are not what the reward model's template renders
        stored = data.get(("tokens", "full"), as_list=True)[i][None]
        with torch.no_grad():
            stored_token_diffs.append(abs(float(model(input_ids=stored).logits[0, 0]) - ref))
    print(f"max |reward - reward_alone| = {max(diffs):.2e}; stored tokens as they are: {max(stored_token_diffs):.3f} off")
    assert max(diffs) < 1e-4, diffs
    assert max(stored_token_diffs) > 1e-3  # the re-rendering matters here: the check can fail
    assert len({round(float(r), 4) for r in rewards}) > 1  # rewards differ between replies


def test_quickstart2_grpo_loss_counts_the_assistant_tokens(quickstart, smollm2_model, tok):
    from torchrl.objectives.llm.grpo import GRPOLoss

    rb, _, policy = quickstart
    pad = policy.tokenizer.pad_token_id
    before = rb[:]
    kept = {k: [t.clone() for t in before.get(k, as_list=True)]
            for k in [("tokens", "prompt"), ("tokens", "response"), ("log_probs", "response")]}
    replies = [_reply_ids(before, i, pad) for i in range(len(rb))]
    closed = [ended(r, smollm2_model, tok) for r in replies]
    assert any(closed), "no reply ended"

    learner = safe_policy_wrapper(smollm2_model, tok, input_mode="history", generate=False, return_log_probs=True,
                                  pad_output=False)
    # rb[:] of a LazyStackStorage holds the stored tensordicts themselves, and TorchRL's wrapper
    # (inplace=True) first removes its out_keys from its input: on rb[:] it would delete
    # tokens.prompt/response and log_probs.response from the stored rollouts. On a copy it does not.
    rollouts = rb[:].copy()
    with torch.no_grad():
        rollouts = learner(rollouts)
    # the learner's call does not delete what the buffer stores
    after = rb[:]
    for key, values in kept.items():
        assert key in after.keys(True), f"{key} deleted from the stored rollouts by the learner call"
        for a, b in zip(after.get(key, as_list=True), values):
            torch.testing.assert_close(a, b)

    advantage = rollouts.get("advantage", as_padded_tensor=True)
    assert advantage.abs().sum() > 0, "every group's replies scored the same: no advantage to learn from"
    loss_fn = GRPOLoss(learner)
    # the tokens GRPOLoss counts: TorchRL's own mask, from the loss's log-weight. Every generated
    # token of each reply but a finished reply's closing EOS: the learner re-renders the chat with
    # TorchRL's chatml_format, whose {% generation %} block (the assistant mask) ends before
    # '<|im_end|>' (with pad == eos: 0 tokens, the loss exactly 0.0)
    _, _, _, mask = loss_fn._log_weight(rollouts.copy(), adv_shape=advantage.shape[:-1])
    assert mask.sum(-1).tolist() == [len(r) - c for r, c in zip(replies, closed)]
    loss = loss_fn(rollouts).loss_objective
    assert loss.item() != 0.0
    loss.backward()
    grads = [p.grad for p in smollm2_model.parameters() if p.grad is not None]
    try:
        assert grads and any(bool(g.abs().sum() > 0) for g in grads)
    finally:
        smollm2_model.zero_grad(set_to_none=True)  # the session's model stays as it was


@pytest.mark.parametrize("pad_output", [False, True], ids=["ragged", "padded"])
def test_quickstart2_plain_wrapper_pad_eos(smollm2_model, tok, rm, greedy_replies, pad_output):
    """README quickstart 2 with TorchRL's own wrapper on pad == eos: ragged rollouts lost their
    replies' EOS and the reward path refuses them (cause and fix named) before any forward;
    padded ones kept every token and are scored on the chats rebuilt from them."""
    from torchrl.modules.llm import TransformersWrapper

    model, rm_tok = rm
    scorer = HFRewardModelWrapper.for_grpo(model, renderer=RewardRenderer(tokenizer=rm_tok, policy_tokenizer=tok))
    env = make_chat_env([{"query": q} for q in SAME_LENGTH_QUERIES], batch_size=2, group_size=1)
    env = env.append_transform(HFRewardTransform(scorer))
    plain = TransformersWrapper(
        smollm2_model, tokenizer=AutoTokenizer.from_pretrained(tok.name_or_path), input_mode="history", generate=True,
        return_log_probs=True, pad_output=pad_output,
        generate_kwargs={"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False},
    )
    if not pad_output:
        with _CountRows(model) as rows, pytest.raises(ValueError, match=r"lost tokens to padding.*safe_policy_wrapper"):
            collect_rollouts(plain, env, total_turns=2)
        assert rows == []  # nothing was scored
        return
    data = collect_rollouts(plain, env, total_turns=2)[:]
    rewards = torch.stack(data.get(("next", "reward"), as_list=True)).reshape(-1)
    for i, query in enumerate(data["query"]):
        messages = [{"role": "user", "content": query},
                    {"role": "assistant", "content": reply_text(greedy_replies[query], smollm2_model, tok)}]
        assert abs(float(rewards[i]) - reward_alone(model, rm_tok, messages)) < 1e-4


# HFRewardModelWrapper directly on the real policy's outputs


@pytest.fixture(scope="module")
def greedy_replies(smollm2_model, tok):
    """Each query's reply generated alone, greedy, from the prompt written out by hand."""
    out = {}
    for q in SAME_LENGTH_QUERIES:
        prompt = tok(_prompt_text(q), add_special_tokens=False)["input_ids"]
        out[q] = greedy_reply(smollm2_model, tok, prompt, MAX_NEW_TOKENS)
    assert any(ended(r, smollm2_model, tok) for r in out.values()) and not all(
        ended(r, smollm2_model, tok) for r in out.values()), "want one finished reply and one cut by max_new_tokens"
    return out


@pytest.mark.parametrize("input_mode", ["history", "text"])
def test_wrapper_on_policy_outputs(smollm2_model, tok, rm, greedy_replies, input_mode):
    """Padded and ragged outputs of the real policy: history scored as each chat alone on the
    reward model's template; text (no chat stored) as that text alone, as RewardTrainer scores
    plain text."""
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv

    rows = [{"query": q} for q in SAME_LENGTH_QUERIES]
    env = ChatEnv.from_dataloader(dataloader=prompt_dataloader(rows, 2), batch_size=2, repeats=1,
                                  input_mode=input_mode, tokenizer=tok).append_transform(StepCounter(max_steps=1))
    model, rm_tok = rm
    scorer = HFRewardModelWrapper(model, renderer=RewardRenderer(tokenizer=rm_tok, policy_tokenizer=tok),
                                  inference_mode=True)
    diffs = []
    for pad_output in (True, False):
        policy = safe_policy_wrapper(
            smollm2_model, tok, input_mode=input_mode, generate=True, return_log_probs=True, pad_output=pad_output,
            generate_kwargs={"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False},
        )
        out = policy(env.reset())
        rewards = scorer(out)["reward"]
        for i, query in enumerate(out["query"]):
            reply = greedy_replies[query]
            if input_mode == "history":
                messages = [{"role": "user", "content": query},
                            {"role": "assistant", "content": reply_text(reply, smollm2_model, tok)}]
                ref = reward_alone(model, rm_tok, messages)
            else:
                ref = _alone_text(rm, _prompt_text(query) + tok.decode(reply, skip_special_tokens=False))
            diffs.append(abs(float(rewards[i]) - ref))
    print(f"{input_mode}: max |reward - reference| = {max(diffs):.2e}")
    assert max(diffs) < 1e-4, diffs
