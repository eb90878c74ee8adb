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
# A TRL reward function in a TorchRL environment
# ----------------------------------------------
# TRL reward functions take ``prompts``, ``completions``, ``completion_ids`` and every
# dataset column by keyword, and return one float (or ``None``) per completion.
import tempfile

from transformers import AutoModelForCausalLM, AutoTokenizer

from torchrl_trl import HFRewardModelWrapper, RewardFunctionWrapper, as_trl_reward_func, layouts, testing


def vowel_fraction(prompts, completions, **kwargs):
    texts = ["".join(m["content"] for m in c) if isinstance(c, list) else c for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def says_the_answer(prompts, completions, answer, **kwargs):
    return [1.0 if a in c[-1]["content"] else 0.0 for c, a in zip(completions, answer)]


workdir = tempfile.mkdtemp()
paths = testing.tiny_checkpoints(workdir)
tokenizer = AutoTokenizer.from_pretrained(paths.policy)
policy = AutoModelForCausalLM.from_pretrained(paths.policy)

rows = [{"query": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
env = testing.make_chat_env(rows, batch_size=2, group_size=2)
env = env.append_transform(
    RewardFunctionWrapper([vowel_fraction, says_the_answer], weights=[1.0, 0.5], per_function_keys=True)
)
buffer = testing.collect_rollouts(testing.make_policy_wrapper(policy, tokenizer), env, total_turns=4)
rollouts = buffer[:]
for text, reward in zip(
    layouts.read_text(rollouts, "response"), layouts.read_column(rollouts, ("next", "reward"))
):
    print(f"{float(reward):.3f}  {text!r}")

# %%
# A TorchRL reward model as a TRL reward function
# -----------------------------------------------
# TRL's own reward-model path scores all ``B * G`` completions in one padded forward;
# wrapped, the same model scores them in length-sorted micro-batches with the same rewards.
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

reward_model = HFRewardModelWrapper(str(paths.reward_model_other_tokenizer), max_tokens_per_batch=512)
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
trainer.train()
print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith("rewards/")})
