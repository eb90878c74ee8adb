"""
A TRL trainer reading a TorchRL buffer
======================================

A TorchRL ``LLMCollector`` writes rollouts into a ``ReplayBuffer``; TRL's ``SFTTrainer``
trains from that buffer through :class:`torchrl_trl.TorchRLBufferDataset`, with no
hand-written collator. Everything on the TorchRL side is TorchRL's own API.
"""

# %%
# Quiet libraries
# ---------------
# Progress bars and the libraries' own deprecation warnings would fill the output;
# ``torchrl_trl``'s warnings stay visible (the patterns are anchored, so ``torch`` does not
# also match ``torchrl_trl``).
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
# A policy, loaded by path
# ------------------------
# ``tiny_checkpoints`` saves a tiny Llama policy and its tokenizer (ChatML chat template)
# with ``save_pretrained``, offline; with a real model, ``model_dir`` is a hub id such as
# ``"Qwen/Qwen2.5-0.5B-Instruct"`` or a local directory.
import tempfile

from tensordict import set_list_to_stack
from transformers import AutoModelForCausalLM, AutoTokenizer

from torchrl_trl.testing import tiny_checkpoints

set_list_to_stack(True).set()  # TorchRL's LLM stack stores chat turns as stacks
workdir = tempfile.mkdtemp()
model_dir = tiny_checkpoints(workdir).policy
tokenizer = AutoTokenizer.from_pretrained(model_dir)
policy = AutoModelForCausalLM.from_pretrained(model_dir)

# %%
# Fill a buffer with TorchRL's collector
# --------------------------------------
# ``ChatEnv`` asks the questions (each twice: a GRPO-style group), TorchRL's
# ``TransformersWrapper`` answers with its default ``pad_output=False`` (ragged tokens,
# the layout upstream's adapter fails on), and ``LLMCollector`` writes every turn into a
# ``ReplayBuffer(LazyStackStorage)``. :func:`torchrl_trl.safe_policy_wrapper` builds that
# wrapper with a pad token that never occurs in a chat: with a tokenizer whose pad is its
# EOS (most chat models) the plain wrapper drops every end-of-turn token from the rollouts
# (see :doc:`/troubleshooting`).
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.envs import StepCounter
from torchrl.envs.llm import ChatEnv

from torchrl_trl import safe_policy_wrapper

questions = [f"what is {i} plus {i}?" for i in range(4)]
loader = DataLoader(questions, batch_size=2, collate_fn=lambda qs: {"query": qs})
env = ChatEnv.from_dataloader(dataloader=loader, batch_size=2, repeats=2, input_mode="history")
env = env.append_transform(StepCounter(max_steps=1))  # one assistant turn per episode
wrapper = safe_policy_wrapper(
    policy, tokenizer, input_mode="history", generate=True, return_log_probs=True,
    generate_kwargs={"max_new_tokens": 8, "do_sample": True},
)
buffer = ReplayBuffer(storage=LazyStackStorage(64))
collector = LLMCollector(env=env, policy=wrapper, dialog_turns_per_batch=4, replay_buffer=buffer,
                         total_dialog_turns=8)
for _ in collector:
    pass
collector.shutdown()
print(len(buffer), "rollouts; first answer:", repr(buffer[0]["text", "response"]))

# %%
# The buffer as a TRL dataset
# ---------------------------
# ``format="sft_tokenized"`` yields the rollouts' own token ids (``input_ids``) and a
# ``completion_mask`` (1 on the generated tokens), read from TorchRL's ``Tokens`` with the
# padding removed; ``reading="epoch"`` reads every stored rollout once per pass.
# ``as_hf_dataset(map_style=True)`` is a ``datasets.Dataset`` with a length, so the trainer
# can count epochs (the streaming ``as_hf_dataset()`` needs ``max_steps``).
from torchrl_trl import TorchRLBufferDataset

dataset = TorchRLBufferDataset(buffer, batch_size=4, format="sft_tokenized", reading="epoch")
hf_dataset = dataset.as_hf_dataset(map_style=True)
print(len(hf_dataset), "rows; columns:", hf_dataset.column_names)
print(hf_dataset[0])

# %%
# Train with SFTTrainer
# ---------------------
# ``completion_only_loss=True``: only the generated tokens are trained on.
from trl import SFTConfig, SFTTrainer

args = SFTConfig(
    output_dir=f"{workdir}/sft",
    num_train_epochs=10,
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    completion_only_loss=True,
    use_cpu=True,
    bf16=False,  # TRL defaults to bf16, which a CPU run must turn off
    report_to=[],
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
)
trainer = SFTTrainer(model=policy, args=args, train_dataset=hf_dataset, processing_class=tokenizer)
trainer.remove_callback(transformers.PrinterCallback)  # the losses are plotted below, not printed

# %%
# What the trainer receives
# -------------------------
# One collated batch: every row is one rollout's real tokens, right-padded by TRL's
# collator; the prompt is masked out of the labels (-100), the completion is trained on.
import matplotlib.pyplot as plt
import numpy as np

batch = next(iter(trainer.get_train_dataloader()))
kind = np.where(batch["attention_mask"] == 0, 0, np.where(batch["labels"] == -100, 1, 2))
fig, ax = plt.subplots(figsize=(7, 2.2))
ax.imshow(kind, cmap=plt.matplotlib.colors.ListedColormap(["#dddddd", "#8fb3d9", "#e07b39"]),
          aspect="auto", interpolation="nearest", vmin=0, vmax=2)
ax.set_xlabel("token position")
ax.set_ylabel("row")
ax.set_yticks(range(kind.shape[0]))
ax.set_title("one batch: padding (grey), prompt (blue, not trained), completion (orange)")
fig.tight_layout()
print("real tokens:", int(batch["attention_mask"].sum()), "of", batch["attention_mask"].numel())

# %%
# Train, and the loss curve
# -------------------------
trainer.train()
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(range(1, len(losses) + 1), losses, marker="o")
ax.set_xlabel("optimizer step")
ax.set_ylabel("SFT loss (completion tokens)")
ax.set_title("SFTTrainer on the TorchRL buffer")
fig.tight_layout()
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")

# sphinx_gallery_thumbnail_number = 2
