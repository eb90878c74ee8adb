"""
Reward functions across TorchRL and TRL
=======================================

Reward code written for one library runs in the other:

- a TRL-style reward function scores rollouts in a TorchRL ``ChatEnv``
  (:class:`torchrl_trl.RewardFunctionWrapper`);
- a TorchRL-side scorer — our micro-batched :class:`torchrl_trl.HFRewardModelWrapper` —
  becomes one of TRL ``GRPOTrainer``'s ``reward_funcs`` (:func:`torchrl_trl.as_trl_reward_func`).
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
# A TRL reward function in a TorchRL environment
# ----------------------------------------------
# TRL reward functions take ``prompts``, ``completions``, ``completion_ids`` and every
# dataset column by keyword, and return one float (or ``None``) per completion.
import tempfile

from transformers import AutoModelForCausalLM, AutoTokenizer

from tensordict import set_list_to_stack

from torchrl_trl import HFRewardModelWrapper, RewardBatching, RewardFunctionWrapper, as_trl_reward_func, safe_policy_wrapper
from torchrl_trl.testing import tiny_checkpoints

set_list_to_stack(True).set()


def vowel_fraction(prompts, completions, **kwargs):
    texts = ["".join(m["content"] for m in c) if isinstance(c, list) else c for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def says_the_answer(prompts, completions, answer, **kwargs):
    return [1.0 if a in c[-1]["content"] else 0.0 for c, a in zip(completions, answer)]


workdir = tempfile.mkdtemp()
paths = tiny_checkpoints(workdir)  # tiny offline models; yours are hub ids or directories
tokenizer = AutoTokenizer.from_pretrained(paths.policy)
policy = AutoModelForCausalLM.from_pretrained(paths.policy)

# ChatEnv carries every dataset field ("answer") into the rollouts, and the wrapper passes
# it to the functions by keyword, as TRL's GRPOTrainer passes dataset columns.
# :func:`torchrl_trl.safe_policy_wrapper` builds TorchRL's ``TransformersWrapper`` with a
# pad token that never occurs in a chat: with a tokenizer whose pad is its EOS (most chat
# models) the plain wrapper drops every end-of-turn token from the rollouts (see
# :doc:`/troubleshooting`).
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.envs import StepCounter
from torchrl.envs.llm import ChatEnv

rows = [{"query": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
loader = DataLoader(rows, batch_size=2, collate_fn=lambda batch: {k: [r[k] for r in batch] for k in batch[0]})
env = ChatEnv.from_dataloader(dataloader=loader, batch_size=2, repeats=2, input_mode="history")
env = env.append_transform(StepCounter(max_steps=1))
# the weighted sum, then each function's raw reward (see below)
out_keys = [("next", "reward"), ("next", "reward_vowel_fraction"), ("next", "reward_says_the_answer")]
env = env.append_transform(
    RewardFunctionWrapper([vowel_fraction, says_the_answer], weights=[1.0, 0.5], out_keys=out_keys).as_transform()
)
wrapper = safe_policy_wrapper(
    policy, tokenizer, input_mode="history", generate=True, return_log_probs=True,
    generate_kwargs={"max_new_tokens": 8, "do_sample": True},
)
buffer = ReplayBuffer(storage=LazyStackStorage(16))
collector = LLMCollector(env=env, policy=wrapper, dialog_turns_per_batch=4, replay_buffer=buffer,
                         total_dialog_turns=8)
for _ in collector:
    pass
collector.shutdown()
rollouts = buffer[:]  # a lazy stack of 8 rows, read with tensordict's own indexing
for text, reward in zip(rollouts["text", "response"], rollouts["next", "reward"].flatten()):
    print(f"{float(reward):.3f}  {text!r}")

# %%
# Each function's share of the reward
# -----------------------------------
# ``out_keys`` beyond the first write each function's raw reward next to the weighted
# sum (``("next", "reward_vowel_fraction")``, ...), as TRL logs ``rewards/<name>``.
import matplotlib.pyplot as plt

vowels = rollouts["next", "reward_vowel_fraction"].flatten()
answer = rollouts["next", "reward_says_the_answer"].flatten()
total = rollouts["next", "reward"].flatten()
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(range(len(total)), 1.0 * vowels, label="1.0 x vowel_fraction")
ax.bar(range(len(total)), 0.5 * answer, bottom=1.0 * vowels, label="0.5 x says_the_answer")
ax.plot(range(len(total)), total, "k_", markersize=18, label="reward written")
ax.set_xlabel("rollout")
ax.set_ylabel("reward")
ax.legend(fontsize=8)
fig.tight_layout()

# %%
# A TorchRL reward model as a TRL reward function
# -----------------------------------------------
# TRL's own reward-model path scores all ``B * G`` completions in one padded forward;
# wrapped, the same model scores them in length-sorted micro-batches with the same rewards.
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

reward_model = HFRewardModelWrapper(
    str(paths.reward_model_other_tokenizer), batching=RewardBatching(max_tokens_per_batch=512)
)
reward_func = as_trl_reward_func(reward_model, name="tiny_rm")
print(reward_func([[{"role": "user", "content": "hi"}]], [[{"role": "assistant", "content": "hello"}]]))

trainer = GRPOTrainer(
    model=str(paths.policy),  # by path, so GRPO can rebuild its reference model
    reward_funcs=[reward_func, vowel_fraction],
    args=GRPOConfig(
        output_dir=f"{workdir}/grpo", max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True,
    ),
    train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": r["query"]}]} for r in rows]),
)
trainer.remove_callback(transformers.PrinterCallback)  # no per-log metric dicts
trainer.train()
print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith("rewards/")})
