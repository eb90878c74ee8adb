"""
A Hugging Face reward model in a TorchRL GRPO step
==================================================

A reward model saved by ``trl.RewardTrainer`` scores TorchRL rollouts inside the
environment (:class:`torchrl_trl.HFRewardTransform`), ``MCAdvantage`` turns the rewards of
each group into advantages, and ``GRPOLoss`` takes one optimizer step.
"""

# %%
# Quiet libraries
# ---------------
# Progress bars and the libraries' own deprecation warnings would fill the output;
# ``torchrl_trl``'s warnings stay visible (anchored patterns: ``torch`` does not also
# match ``torchrl_trl``).
import logging
import warnings

import datasets
import transformers

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
datasets.disable_progress_bars()
logging.getLogger("accelerate").setLevel(logging.ERROR)
for lib in ("torch", "torchrl", "tensordict", "transformers", "trl", "accelerate", "datasets"):
    warnings.filterwarnings("ignore", module=rf"{lib}(\.|$)")

# %%
# Train a reward model with TRL
# -----------------------------
# ``tiny_checkpoints`` saves a tiny policy and reward model offline with
# ``save_pretrained``; with real models these are hub ids or local directories.
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer

from tensordict import set_list_to_stack

from torchrl_trl import HFRewardModelWrapper, HFRewardTransform, RewardRenderer
from torchrl_trl.testing import tiny_checkpoints

set_list_to_stack(True).set()

workdir = tempfile.mkdtemp()
paths = tiny_checkpoints(workdir)
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
reward_trainer.remove_callback(transformers.PrinterCallback)  # no per-log metric dicts
reward_trainer.train()
reward_trainer.save_model(f"{workdir}/rm")

# %%
# The reward model inside the environment
# ---------------------------------------
# ``HFRewardTransform`` loads the saved directory by path (model and tokenizer). Each
# ``env.step`` scores the conversation so far and writes ``("next", "reward")`` shaped
# ``[B, 1, 1]``, the convention ``MCAdvantage`` and ``GRPOLoss`` read.
# :func:`torchrl_trl.safe_policy_wrapper` builds TorchRL's ``TransformersWrapper`` with a
# pad token that never occurs in a chat: with a tokenizer whose pad is its EOS (most chat
# models) the plain wrapper drops every end-of-turn token from the rollouts (see
# :doc:`/troubleshooting`).
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.envs import StepCounter
from torchrl.envs.llm import ChatEnv
from torchrl.objectives.llm import GRPOLoss, MCAdvantage

from torchrl_trl import safe_policy_wrapper

tokenizer = AutoTokenizer.from_pretrained(paths.policy)
policy = AutoModelForCausalLM.from_pretrained(paths.policy)
group_size = 4  # completions per prompt
loader = DataLoader(["what is two plus two?", "say hello"], batch_size=2, collate_fn=lambda qs: {"query": qs})
env = ChatEnv.from_dataloader(dataloader=loader, batch_size=2, repeats=group_size, input_mode="history")
env = env.append_transform(StepCounter(max_steps=1))
# the scorer: the reward model, re-rendering each chat with its own template (the policy's
# tokenizer tells it how the policy tokenised); the transform writes ("next", "reward")
scorer = HFRewardModelWrapper.for_grpo(f"{workdir}/rm", renderer=RewardRenderer(policy_tokenizer=tokenizer))
env = env.append_transform(HFRewardTransform(scorer))

buffer = ReplayBuffer(storage=LazyStackStorage(16), batch_size=2 * group_size)
buffer.append_transform(MCAdvantage(grpo_size=group_size))  # groups completions of the same prompt
sampler = safe_policy_wrapper(
    policy, tokenizer, input_mode="history", generate=True, return_log_probs=True,
    generate_kwargs={"max_new_tokens": 8, "do_sample": True},
)
collector = LLMCollector(env=env, policy=sampler, dialog_turns_per_batch=2 * group_size,
                         replay_buffer=buffer, total_dialog_turns=2 * group_size)
for _ in collector:
    pass
collector.shutdown()

batch = buffer[:]  # a lazy stack of 8 rows; one-step rewards stack to [8, 1, 1]
rewards = batch["next", "reward"].flatten()
advantages = batch["advantage"].flatten()
prompts = list(batch["history", "prompt"][:, 0].content)  # each prompt's first message
print("rewards:   ", rewards)
print("advantages:", advantages)

# %%
# Rewards and advantages per group
# --------------------------------
# ``MCAdvantage`` normalises each reward within its group (same prompt): the advantages of
# a group have mean 0, whatever the reward model's scale.
import matplotlib.pyplot as plt

order = sorted(range(len(prompts)), key=lambda i: prompts[i])
fig, axes = plt.subplots(1, 2, figsize=(8, 3), sharey=False)
colors = ["tab:blue" if prompts[i] == prompts[order[0]] else "tab:orange" for i in order]
axes[0].bar(range(len(order)), rewards[order], color=colors)
axes[0].set_title("reward-model reward")
axes[1].bar(range(len(order)), advantages[order], color=colors)
axes[1].set_title("MCAdvantage advantage")
for ax in axes:
    ax.set_xlabel("rollout (colour: prompt)")
    ax.axhline(0, color="grey", linewidth=0.8)
fig.tight_layout()

# %%
# One GRPO step
# -------------
# ``GRPOLoss`` needs the sampling policy's log-probabilities of the full sequence: a
# ``generate=False`` pass of TorchRL's wrapper writes ``("log_probs", "full")``.
learner = safe_policy_wrapper(policy, tokenizer, input_mode="history", generate=False,
                              return_log_probs=True, pad_output=False)
loss_fn = GRPOLoss(learner, entropy_coeff=0.0)
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
with torch.no_grad():
    batch = learner(batch)
# at the first step the importance ratio is 1, so the loss is minus the token-mean advantage
loss = loss_fn(batch).loss_objective
loss.backward()
optimizer.step()
print("GRPO loss:", loss.item())
