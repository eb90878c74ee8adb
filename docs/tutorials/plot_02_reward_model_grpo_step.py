"""
A Hugging Face reward model in a TorchRL GRPO step
==================================================

A reward model saved by ``trl.RewardTrainer`` scores TorchRL rollouts inside the
environment (:class:`torchrl_trl.HFRewardTransform`), ``MCAdvantage`` turns the rewards of
each group into advantages, and ``GRPOLoss`` takes one optimizer step.
"""

# %%
# Train a reward model with TRL
# -----------------------------
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer

from torchrl_trl import HFRewardTransform, layouts, testing

workdir = tempfile.mkdtemp()
paths = testing.tiny_checkpoints(workdir)
rm_tokenizer = AutoTokenizer.from_pretrained(paths.reward_model)
pairs = Dataset.from_list(
    [
        {"chosen": "hello! how are you today?", "rejected": "x y z"},
        {"chosen": "the answer is four.", "rejected": "a b c d"},
    ]
    * 8
)
reward_trainer = RewardTrainer(
    model=AutoModelForSequenceClassification.from_pretrained(paths.reward_model),
    args=RewardConfig(
        output_dir=f"{workdir}/rm", max_steps=4, per_device_train_batch_size=4, use_cpu=True,
        bf16=False, report_to=[], save_strategy="no", disable_tqdm=True,
    ),
    train_dataset=pairs,
    processing_class=rm_tokenizer,
)
reward_trainer.train()
reward_trainer.save_model(f"{workdir}/rm")

# %%
# The reward model inside the environment
# ---------------------------------------
# ``HFRewardTransform`` loads the saved directory by path (model and tokenizer). Each
# ``env.step`` scores the conversation so far and writes ``("next", "reward")`` shaped
# ``[B, 1, 1]``, the convention ``MCAdvantage`` and ``GRPOLoss`` read.
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.objectives.llm import GRPOLoss, MCAdvantage

tokenizer = AutoTokenizer.from_pretrained(paths.policy)
policy = AutoModelForCausalLM.from_pretrained(paths.policy)
rows = [{"query": "what is two plus two?"}, {"query": "say hello"}]
env = testing.make_chat_env(rows, batch_size=2, group_size=2)
env = env.append_transform(HFRewardTransform(f"{workdir}/rm", policy_tokenizer=tokenizer))

buffer = ReplayBuffer(storage=LazyStackStorage(16), batch_size=4)
buffer.append_transform(MCAdvantage(grpo_size=2))  # groups completions of the same prompt
sampler = testing.make_policy_wrapper(policy, tokenizer, max_new_tokens=8)
testing.collect_rollouts(sampler, env, total_turns=4, replay_buffer=buffer)

batch = buffer[:]
print("rewards:   ", torch.stack(layouts.read_column(batch, ("next", "reward"))).flatten())
print("advantages:", torch.stack(layouts.read_column(batch, "advantage")).flatten())

# %%
# One GRPO step
# -------------
# ``GRPOLoss`` needs the sampling policy's log-probabilities of the full sequence: a
# ``generate=False`` pass of TorchRL's wrapper writes ``("log_probs", "full")``.
learner = testing.make_policy_wrapper(policy, tokenizer, generate=False)
loss_fn = GRPOLoss(learner, entropy_coeff=0.0)
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
with torch.no_grad():
    batch = learner(batch)
# at the first step the importance ratio is 1, so the loss is minus the token-mean advantage
loss = loss_fn(batch).loss_objective
loss.backward()
optimizer.step()
print("GRPO loss:", float(loss))
