"""A TorchRL GRPO step end to end with a reward model trained by trl.RewardTrainer:
LLMCollector over a ChatEnv carrying HFRewardTransform -> ReplayBuffer(LazyStackStorage)
with MCAdvantage -> GRPOLoss forward, backward and an optimizer step. Rewards, advantages,
the loss terms on-policy and the clipped objective after the step are each compared with
values computed here from the models, one sequence at a time."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from torchrl_trl import layouts
from torchrl_trl.rewards import HFRewardModelWrapper, HFRewardTransform, RewardRenderer
from torchrl_trl.testing import collect_rollouts, make_chat_env, make_policy_wrapper

ROWS = [
    {"query": "what is two plus two?", "answer": "4"},
    {"query": "hello world", "answer": "hi"},
]


@pytest.fixture(scope="module")
def trained_reward_model(checkpoints, tmp_path_factory):
    """A reward model trained 2 steps by RewardTrainer, saved with save_model."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    out = tmp_path_factory.mktemp("rm_trained")
    pairs = Dataset.from_list(
        [
            {"chosen": "the answer is four.", "rejected": "a b c d"},
            {"chosen": "hello! how are you today?", "rejected": "x y z"},
        ]
        * 2
    )
    tokenizer = AutoTokenizer.from_pretrained(checkpoints.reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(checkpoints.reward_model, num_labels=1)
    before = model.score.weight.detach().clone()
    args = RewardConfig(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(str(out))
    assert not torch.equal(trainer.model.score.weight.detach().cpu(), before)
    return out


def test_grpo_step_with_reward_trainer_model(checkpoints, policy_and_tokenizer, trained_reward_model):
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import GRPOLoss, MCAdvantage

    policy_model, tokenizer = policy_and_tokenizer
    policy_model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)  # trained below
    reward_tf = HFRewardTransform(  # by path
        HFRewardModelWrapper.from_pretrained(
            trained_reward_model, inference_mode=True, renderer=RewardRenderer(policy_tokenizer=tokenizer)
        )
    )
    env = make_chat_env(ROWS, batch_size=2, group_size=2).append_transform(reward_tf)
    rb = ReplayBuffer(storage=LazyStackStorage(16), batch_size=4)
    rb.append_transform(MCAdvantage(grpo_size=2))
    policy = make_policy_wrapper(policy_model, tokenizer, pad_output=False, max_new_tokens=8)
    collect_rollouts(policy, env, total_turns=4, replay_buffer=rb)
    assert len(rb) == 4
    data = rb[:]

    # rewards are the loaded reward model's own scores of what the policy generated: each chat
    # rendered with its own template (as RewardTrainer trained it), alone
    rm = AutoModelForSequenceClassification.from_pretrained(trained_reward_model).eval()
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in layouts.read_history(data, "full")]
    with torch.no_grad():
        ref = torch.stack(
            [rm(input_ids=torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])).logits[0, 0] for t in texts]
        )
    rewards = torch.stack(data.get(("next", "reward"), as_list=True))
    assert rewards.shape == (4, 1, 1)
    torch.testing.assert_close(rewards.reshape(-1), ref, atol=1e-5, rtol=0)

    # MCAdvantage grouped by prompt: (r - mean) / std within each group of 2
    advantage = data.get("advantage", as_padded_tensor=True)
    assert advantage.shape == (4, 1, 1)
    queries = layouts.read_column(data, "query")
    for q in set(queries):
        idx = [i for i, x in enumerate(queries) if x == q]
        r = rewards.reshape(-1)[idx]
        torch.testing.assert_close(
            advantage.reshape(-1)[idx], (r - r.mean()) / r.std().clamp_min(1e-6), atol=1e-5, rtol=0
        )

    # GRPOLoss needs ("log_probs", "full") from a generate=False pass (the behaviour policy)
    train_policy = make_policy_wrapper(policy_model, tokenizer, generate=False, pad_output=False)
    sampled = rb.sample()
    samples = [s.clone() for s in sampled.unbind(0)]  # as collected, before the pass below
    with torch.no_grad():
        batch = train_policy(sampled)
    loss_fn = GRPOLoss(actor_network=train_policy)
    adv = torch.stack([s.get("advantage").reshape(()) for s in samples])
    # what GRPOLoss trains on: the assistant turn of the chat as the generate=False pass
    # re-renders it (its tokens can differ from the sampled ones: TorchRL re-tokenizes the
    # text), with the end-of-turn token the template closes it with
    trained = [_trained_tokens(rendered, tokenizer.eos_token_id) for rendered in batch.unbind(0)]
    old_logp, old_entropy = zip(*(_logp_and_entropy(policy_model, *t) for t in trained))

    # on-policy (ratio 1): the objective is minus the token mean of the advantages, the
    # entropy term minus 0.01 times the token mean of the policy's entropy
    loss = loss_fn(batch)
    n_tokens = torch.tensor([float(len(lp)) for lp in old_logp])
    torch.testing.assert_close(loss.loss_objective, -(adv * n_tokens).sum() / n_tokens.sum(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss.loss_entropy, -0.01 * torch.cat(old_entropy).mean(), atol=1e-5, rtol=1e-5)
    optim = torch.optim.Adam(policy_model.parameters(), lr=1e-2)
    (loss.loss_objective + loss.loss_entropy).backward()
    grads = [p.grad for p in policy_model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    optim.step()

    # off-policy after the step: PPO's clipped ratio against the behaviour log-probs,
    # each sequence scored alone by the updated model
    new_logp = [_logp_and_entropy(policy_model, *t)[0] for t in trained]
    gains = []
    for a, old, new in zip(adv, old_logp, new_logp):
        ratio = (new - old).exp()
        gains.append(torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a))
    want = -torch.cat(gains).mean()
    with torch.no_grad():
        got = loss_fn(batch).loss_objective
    assert not torch.allclose(torch.cat(new_logp), torch.cat(old_logp))  # the step changed the policy
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def _trained_tokens(rendered, end_of_turn: int) -> tuple[torch.Tensor, int]:
    """``(ids, n)``: the real tokens of a re-rendered chat up to its assistant turn's end,
    and how many of them, at the end, the assistant mask marks (the turn and its
    end-of-turn token)."""
    attention = rendered.get(("masks", "all_attention_mask"))
    ids = rendered.get(("tokens", "full"))[attention]
    assistant = rendered.get(("masks", "all_assistant_mask"))[attention].nonzero().reshape(-1)
    assert torch.equal(assistant, torch.arange(int(assistant[0]), int(assistant[-1]) + 1))  # one turn
    assert ids[assistant[-1]] == end_of_turn
    return ids[: int(assistant[-1]) + 1], len(assistant)


def _logp_and_entropy(model, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the last ``n`` tokens of ``ids``: the policy's log-probability of it and
    the entropy of the policy's next-token distribution before it, ``ids`` scored alone."""
    with torch.no_grad():
        logp = model(input_ids=ids[None]).logits[0, -n - 1 : -1].log_softmax(-1)
    return logp.gather(-1, ids[-n:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
