"""A TorchRL GRPO step end to end with a reward model trained by trl.RewardTrainer:
LLMCollector over a ChatEnv carrying HFRewardTransform -> ReplayBuffer(LazyStackStorage)
with MCAdvantage -> GRPOLoss forward, backward and an optimizer step."""

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

    # rewards are the loaded reward model's own scores of what the policy generated
    rm = AutoModelForSequenceClassification.from_pretrained(trained_reward_model).eval()
    ids = layouts.read_tokens(data, "full").tolist()
    with torch.no_grad():
        ref = torch.stack(
            [rm(input_ids=torch.tensor([i + ([tokenizer.eos_token_id] if i[-1] != tokenizer.eos_token_id else [])])).logits[0, 0] for i in ids]
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
    batch = rb.sample()
    with torch.no_grad():
        batch = train_policy(batch)
    loss_fn = GRPOLoss(actor_network=train_policy)
    loss = loss_fn(batch)
    assert torch.isfinite(loss.loss_objective)
    optim = torch.optim.Adam(policy_model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in policy_model.parameters()]
    (loss.loss_objective + loss.loss_entropy).backward()
    grads = [p.grad for p in policy_model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    optim.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, policy_model.parameters()))
