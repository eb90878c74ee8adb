"""
TRL GRPO on TorchRL rollouts
============================

TRL's ``GRPOTrainer`` normally generates its completions itself. Here TorchRL does it: a
``TransformersWrapper`` policy generates through :class:`torchrl_trl.TorchRLRolloutFunc`
(TRL's ``rollout_func`` hook), every rollout lands in a TorchRL replay buffer, and TRL
trains on exactly those tokens and log-probabilities. Then the same function with
generation by TorchRL's ``LLMCollector`` running ahead of the trainer (bounded staleness),
stored groups reused once, and the behaviour log-probs correcting the stale samples.
"""

# %%
# Quiet libraries
# ---------------
# Progress bars and the libraries' own deprecation warnings would fill the output;
# ``torchrl_trl``'s warnings stay visible (anchored patterns: ``torch`` does not also
# match ``torchrl_trl``). TRL flags ``rollout_func`` as experimental on every trainer.
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
warnings.filterwarnings("ignore", message=r"You are using 'rollout_func', which is an experimental")

# %%
# A policy, a task, a TorchRL buffer
# ----------------------------------
# ``tiny_checkpoints`` saves a tiny policy offline with ``save_pretrained``; with a real
# model this is a hub id or a local directory. The task is a verifiable reward: the share
# of vowels in the answer. The TorchRL policy is a ``TransformersWrapper`` around the very
# model TRL trains (shared weights: on-policy), built by
# :func:`torchrl_trl.safe_policy_wrapper` with a pad token that never occurs in a chat: with
# a tokenizer whose pad is its EOS (most chat models) the plain wrapper drops every reply's
# final EOS, and :class:`~torchrl_trl.TorchRLRolloutFunc` refuses such a policy (see
# :doc:`/troubleshooting`).
import tempfile

import torch
from datasets import Dataset
from tensordict import set_list_to_stack
from torchrl.data import LazyStackStorage, ReplayBuffer
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from torchrl_trl import TorchRLRolloutFunc, safe_policy_wrapper
from torchrl_trl.testing import tiny_checkpoints

set_list_to_stack(True).set()
torch.manual_seed(0)
workdir = tempfile.mkdtemp()
paths = tiny_checkpoints(workdir)
tokenizer = AutoTokenizer.from_pretrained(paths.policy)
questions = ["say something nice", "what is two plus two?", "describe the sea", "hello"]
prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})


def vowel_share(completions, **kwargs):
    """TRL reward function: the fraction of vowels in each answer (chat completions)."""
    texts = [c[-1]["content"] for c in completions]
    return [sum(ch in "aeiouAEIOU" for ch in t) / max(len(t), 1) for t in texts]


# ``epsilon_high`` (DAPO's clip-higher) only acts where TRL's ratio is not 1: on the stale
# samples the async run corrects below, where TRL's symmetric clip can make a rare token
# ever rarer until no group has any reward spread left.
def grpo_args(name, steps):
    return GRPOConfig(
        output_dir=f"{workdir}/{name}", max_steps=steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, learning_rate=3e-2, beta=0.0, use_cpu=True, bf16=False, report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, seed=0,
        epsilon_high=0.28,
    )


model = AutoModelForCausalLM.from_pretrained(paths.policy)
policy = safe_policy_wrapper(
    model, tokenizer, input_mode="history", generate=True, return_log_probs=True,
    pad_output=False, generate_kwargs={"max_new_tokens": 8, "do_sample": True},
)
buffer = ReplayBuffer(storage=LazyStackStorage(1_000))
rollout_func = TorchRLRolloutFunc(policy, replay_buffer=buffer)

# %%
# TRL trains on TorchRL's rollouts
# --------------------------------
# TRL hands the function each prompt ``num_generations`` times in a row and gets back the
# prompt and completion token ids and the policy's per-token log-probs; TRL's reward
# functions then score the completions as usual.
trainer = GRPOTrainer(
    model=model, reward_funcs=[vowel_share], args=grpo_args("sync", 20), train_dataset=prompts,
    processing_class=tokenizer, rollout_func=rollout_func,
)
trainer.remove_callback(transformers.PrinterCallback)  # no per-log metric dicts
trainer.train()
sync_curve = [log["reward"] for log in trainer.state.log_history if "reward" in log]
print(f"mean reward, first -> last step: {sync_curve[0]:.3f} -> {sync_curve[-1]:.3f}")

# %%
# Every rollout is in the TorchRL buffer, one item per completion, tagged with its GRPO
# group and the policy version (TRL's ``global_step``) that generated it; the same buffer
# feeds ``preference_pairs`` / ``best_of_n`` and TRL's offline trainers later.
items = buffer[: len(buffer)]
print("items:", len(buffer))
print("group_id:      ", items["group_id"].flatten()[:12].tolist())
print("policy_version:", items["policy_version"].flatten()[::8][:12].tolist())
print("a completion:  ", repr(items[-1]["text", "response"]))

# %%
# Async: generation runs ahead, groups are reused
# -----------------------------------------------
# The same function takes its rollouts from a TorchRL ``LLMCollector`` instead
# (``source=``). :func:`~torchrl_trl.make_prompt_collector` builds one over a ``ChatEnv``
# fed with the prompts; it generates whole groups in its background thread with its *own*
# copy of the weights. At every step the function pushes the trainer's weights to it (each
# push advances the collector's policy version by one) and takes groups at most
# ``max_staleness`` versions old. With ``reuse=1`` each group may be trained on twice, so a
# step takes stored groups instead of waiting when nothing fresh is ready.
# :class:`~torchrl_trl.BehaviourLogProbsMixin` makes the collector's recorded log-probs
# TRL's old log-probs, so TRL's clipped ratio corrects the stale samples.
from torchrl_trl import BehaviourLogProbsMixin, RolloutOptions, make_prompt_collector

model = AutoModelForCausalLM.from_pretrained(paths.policy)
generator_policy = safe_policy_wrapper(
    AutoModelForCausalLM.from_pretrained(paths.policy), tokenizer, input_mode="history",
    generate=True, return_log_probs=True, pad_output=False,
    generate_kwargs={"max_new_tokens": 8, "do_sample": True},
)
collector = make_prompt_collector(generator_policy, list(prompts["prompt"]), group_size=4, prompts_per_batch=2)


class CorrectedGRPOTrainer(BehaviourLogProbsMixin, GRPOTrainer):
    pass


options = RolloutOptions(max_staleness=2, reuse=1, max_pending_groups=2)
with TorchRLRolloutFunc(source=collector, options=options) as async_func:
    trainer = CorrectedGRPOTrainer(
        model=model, reward_funcs=[vowel_share], args=grpo_args("async", 20), train_dataset=prompts,
        processing_class=tokenizer, rollout_func=async_func,
    )
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
async_curve = [log["reward"] for log in trainer.state.log_history if "reward" in log]
print(f"mean reward, first -> last step: {async_curve[0]:.3f} -> {async_curve[-1]:.3f}")
print("group ages (steps):", async_func.consumed_staleness)
print("reused groups:", async_func.replay.reused, "of", len(async_func.consumed_reuse))

# %%
# The collector stays at most 2 groups ahead (``max_pending_groups=2``): when a step finds
# nothing fresh it reuses a stored group, no older than 2 versions, instead of waiting. Groups
# up to 2 steps old learn more slowly per step than on-policy ones; the async run's gain is
# in wall time when generation is the bottleneck (``benchmarks/bench_grpo_rollouts.py``).
#
# The async run reads prompts from the collector's own source (reward functions that need
# the prompt read the ``torchrl_prompt`` column), so TRL's ``prompts`` differ from what
# was generated for: the mean reward per step is what both runs optimise.
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(sync_curve, label="TorchRLRolloutFunc (on-policy)")
ax.plot(async_curve, label="async, max_staleness=2, reuse=1")
ax.set_xlabel("GRPOTrainer step")
ax.set_ylabel("mean reward (vowel share)")
ax.legend()
fig.tight_layout()
