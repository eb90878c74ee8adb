"""Real TRL trainers (SFT, GRPO) trained from buffers a real LLMCollector filled: what the
trainer's dataloader / reward function receives is exactly what the buffer holds."""

import pytest
import torch

from torchrl_trl import layouts, testing
from torchrl_trl.data import TorchRLBufferDataset

ROWS = [{"query": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]


@pytest.fixture(scope="module", params=[False, True], ids=["ragged", "padded"])
def rollouts(request, policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    env = testing.make_chat_env(ROWS, batch_size=2, group_size=2)
    policy = testing.make_policy_wrapper(model, tok, pad_output=request.param, max_new_tokens=6)
    return testing.collect_rollouts(policy, env, total_turns=8)


def _sft(model, tok, dataset, tmp_path, steps=2, **kwargs):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, use_cpu=True,
        bf16=False, report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0, **kwargs,
    )
    return SFTTrainer(model=model, args=args, train_dataset=dataset.as_hf_dataset(), processing_class=tok)


def _received(batch, i):
    mask = batch["attention_mask"][i].bool()
    return batch["input_ids"][i][mask], batch["labels"][i][mask]


def test_sft_tokenized_receives_buffer_tokens(rollouts, policy_and_tokenizer, tmp_path):
    model, tok = policy_and_tokenizer
    ds = TorchRLBufferDataset(rollouts, 4, format="sft_tokenized", reading="epoch")
    # TRL folds completion_mask into the labels only with completion_only_loss=True
    trainer = _sft(model, tok, ds, tmp_path, completion_only_loss=True)
    batch = next(iter(trainer.get_train_dataloader()))
    td = rollouts[:4]
    prompts, responses = layouts.read_tokens(td, "prompt").split(), layouts.read_tokens(td, "response").split()
    for i in range(4):
        ids, labels = _received(batch, i)
        torch.testing.assert_close(ids, torch.cat([prompts[i], responses[i]]))
        # completion_mask reached the loss: prompt tokens are ignored, response tokens trained
        assert (labels[: len(prompts[i])] == -100).all()
        torch.testing.assert_close(labels[len(prompts[i]) :], responses[i])
    assert (batch["input_ids"] != tok.pad_token_id).sum() == sum(len(p) + len(r) for p, r in zip(prompts, responses))
    trainer.train()
    assert trainer.state.global_step == 2


@pytest.mark.parametrize("fmt", ["sft", "sft_conversational", "sft_messages"])
def test_sft_text_and_conversational(rollouts, policy_and_tokenizer, tmp_path, fmt):
    model, tok = policy_and_tokenizer
    ds = TorchRLBufferDataset(rollouts, 4, format=fmt, reading="epoch")
    trainer = _sft(model, tok, ds, tmp_path, steps=1)
    batch = next(iter(trainer.get_train_dataloader()))
    td = rollouts[:4]
    if fmt == "sft":
        expected = [p + r + tok.eos_token for p, r in zip(layouts.read_text(td, "prompt"), layouts.read_text(td, "response"))]
    else:
        expected = [tok.apply_chat_template(h, tokenize=False) for h in layouts.read_history(td, "full")]
    got = [tok.decode(_received(batch, i)[0]) for i in range(4)]
    assert got == expected
    trainer.train()
    assert trainer.state.global_step == 1


def test_grpo_receives_prompts_and_answers(rollouts, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(checkpoints.policy)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    seen = []

    def reward_len(prompts, completions, answer, **kwargs):
        seen.extend(zip(prompts, answer))
        return [float(len(c)) for c in completions]

    ds = TorchRLBufferDataset(rollouts, 4, format="grpo", keys=["answer"], reading="epoch")
    hf = ds.as_hf_dataset()
    assert list(hf.features) == ["prompt", "answer"]
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        beta=0.0, shuffle_dataset=False, logging_steps=1,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=hf, processing_class=tok)
    trainer.train()
    td = rollouts[:]
    stored = list(zip(layouts.read_text(td, "prompt"), layouts.read_column(td, "answer")))
    # 2 steps x 4 completions = 4 prompts, each repeated num_generations=2 times, in buffer order
    assert seen == [row for row in stored[:4] for _ in range(2)]
    assert trainer.state.global_step == 2


def test_grpo_conversational_prompt(rollouts, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(checkpoints.policy)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    seen = []

    def reward_answer(prompts, completions, answer, **kwargs):
        seen.extend(zip(prompts, answer))
        return [0.0 for _ in completions]

    ds = TorchRLBufferDataset(rollouts, 4, format="grpo_conversational", keys=["answer"], reading="epoch")
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        beta=0.0, shuffle_dataset=False,
    )
    GRPOTrainer(model=model, reward_funcs=reward_answer, args=args, train_dataset=ds.as_hf_dataset(),
                processing_class=tok).train()
    td = rollouts[:2]
    stored = list(zip(layouts.read_history(td, "prompt"), layouts.read_column(td, "answer")))
    assert seen == [row for row in stored for _ in range(2)]
