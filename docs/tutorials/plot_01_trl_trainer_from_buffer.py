"""
A TRL trainer reading a TorchRL buffer
======================================

A TorchRL ``LLMCollector`` writes rollouts into a ``ReplayBuffer``; TRL's ``SFTTrainer``
trains from that buffer through :class:`torchrl_trl.TorchRLBufferDataset`, with no
hand-written collator.
"""

# %%
# Tiny models, built offline
# --------------------------
# ``tiny_checkpoints`` saves a tiny Llama policy, its tokenizer (with a ChatML chat
# template) and two reward models with ``save_pretrained``; we load them back with
# ``from_pretrained`` as we would load any checkpoint.
import tempfile

from transformers import AutoModelForCausalLM, AutoTokenizer

from torchrl_trl import TorchRLBufferDataset, testing

workdir = tempfile.mkdtemp()
paths = testing.tiny_checkpoints(workdir)
tokenizer = AutoTokenizer.from_pretrained(paths.policy)
policy = AutoModelForCausalLM.from_pretrained(paths.policy)

# %%
# Fill a buffer with a real collector
# -----------------------------------
# A ``ChatEnv`` asks the questions, TorchRL's ``TransformersWrapper`` answers with its
# default ``pad_output=False`` (ragged tokens: the layout upstream's adapter fails on),
# and ``LLMCollector`` writes every turn into a ``ReplayBuffer(LazyStackStorage)``.
rows = [{"query": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
env = testing.make_chat_env(rows, batch_size=2, group_size=2)
wrapper = testing.make_policy_wrapper(policy, tokenizer, max_new_tokens=8)
buffer = testing.collect_rollouts(wrapper, env, total_turns=8)
print(len(buffer), "rollouts; first answer:", repr(buffer[0]["text", "response"]))

# %%
# The buffer as a TRL dataset
# ---------------------------
# ``format="sft_conversational"`` yields TRL's conversational prompt/completion columns
# (plain role/content dicts read from TorchRL's ``ChatHistory``); ``mode="epoch"`` reads
# every stored rollout exactly once per pass and gives the dataset a length.
dataset = TorchRLBufferDataset(buffer, batch_size=4, format="sft_conversational", mode="epoch")
hf_dataset = dataset.as_hf_dataset()
print(len(dataset), "rows per epoch; columns:", hf_dataset.column_names)
print(next(iter(hf_dataset)))

# %%
# Train with SFTTrainer
# ---------------------
from trl import SFTConfig, SFTTrainer

args = SFTConfig(
    output_dir=f"{workdir}/sft",
    max_steps=3,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    use_cpu=True,
    bf16=False,
    report_to=[],
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
)
trainer = SFTTrainer(model=policy, args=args, train_dataset=hf_dataset, processing_class=tokenizer)
trainer.train()
print([round(entry["loss"], 3) for entry in trainer.state.log_history if "loss" in entry])
