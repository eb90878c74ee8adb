"""The real-model tier for scored groups -> TRL's offline trainers: SmolLM2-135M-Instruct's
TorchRL rollouts, grouped and ranked by a reward function, through ``preference_pairs`` /
``kto_rows`` / ``best_of_n`` into a real ``DPOTrainer`` / ``KTOTrainer`` / ``SFTTrainer`` step.
Every row is checked against the reply the policy generated (its stored tokens decoded alone)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torchrl.modules.llm import TransformersWrapper

from real_model import SAME_LENGTH_QUERIES
from torchrl_trl import RewardFunctionWrapper, TorchRLBufferDataset, layouts, safe_policy_wrapper, testing
from torchrl_trl.data.groups import SkippedRolloutsWarning
from torchrl_trl.data.preference import best_of_n, kto_rows, preference_pairs
from torchrl_trl.layouts import PaddingLostError

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GROUP = 2
TRAIN = dict(use_cpu=True, bf16=False, report_to=[], save_strategy="no", max_steps=1, logging_steps=1,
             dataloader_num_workers=0)


def reply_length(prompts, completions, **kwargs):
    return [float(len(c[-1]["content"])) for c in completions]


def _collect(model, tok, policy_cls, scored=True):
    env = testing.make_chat_env([{"query": q} for q in SAME_LENGTH_QUERIES], batch_size=2, group_size=GROUP)
    if scored:
        env = env.append_transform(RewardFunctionWrapper(reply_length).as_transform())
    kwargs = dict(input_mode="history", generate=True, return_log_probs=True,
                  generate_kwargs={"max_new_tokens": 12, "do_sample": True, "temperature": 1.3})
    policy = safe_policy_wrapper(model, tok, **kwargs) if policy_cls is None else policy_cls(model, tokenizer=tok, **kwargs)
    return testing.collect_rollouts(policy, env, total_turns=len(SAME_LENGTH_QUERIES) * GROUP, seed=1)


@pytest.fixture(scope="module")
def rollouts(smollm2_model, smollm2_dir):
    """4 scored rollouts (2 prompts x 2 sampled replies), and each stored reply decoded alone."""
    tok = testing.smollm2_tokenizer(smollm2_dir)
    rb = _collect(smollm2_model, tok, None)
    replies = {}
    for i in range(len(rb)):
        ids = rb[i].get(("tokens", "response")).tolist()
        replies[i] = tok.decode(ids[:-1] if ids[-1] == tok.eos_token_id else ids)
    assert all(replies.values()), "every sampled reply has content"
    return rb, replies


def _quiet(build, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedRolloutsWarning)
        return build(*args, **kwargs)


def _grad_norms(trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def test_dpo_trainer_on_real_pairs(rollouts, smollm2_model, smollm2_dir, tmp_path):
    from trl import DPOConfig, DPOTrainer

    rb, replies = rollouts
    pairs = _quiet(preference_pairs, rb, group_size=GROUP)
    rows = list(TorchRLBufferDataset(pairs, 2, format="dpo_conversational", reading="epoch"))
    assert rows, "at least one untied group"
    for row in rows:
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert chosen in replies.values() and rejected in replies.values() and chosen != rejected
        assert len(chosen) > len(rejected)  # the reward is the reply's length
    tok = testing.smollm2_tokenizer(smollm2_dir)
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(rows), max_length=96, **TRAIN)
    ds = TorchRLBufferDataset(pairs, 2, format="dpo_conversational", reading="epoch").as_hf_dataset(map_style=True)
    trainer = DPOTrainer(model=copy.deepcopy(smollm2_model).train(), args=args, train_dataset=ds,
                         processing_class=tok)
    trainer.train()
    assert trainer.state.global_step == 1
    assert _grad_norms(trainer)[0] > 0, "chosen and rejected differ: DPO's gradient is not zero"


def test_sft_trainer_on_best_of_n(rollouts, smollm2_model, smollm2_dir, tmp_path):
    from trl import SFTConfig, SFTTrainer

    rb, replies = rollouts
    best = _quiet(best_of_n, rb, k=1, group_size=GROUP)
    rows = list(TorchRLBufferDataset(best, 2, format="sft_conversational", reading="epoch"))
    by_query = {}
    for i, q in enumerate(layouts.read_column(rb[:], "query")):
        by_query.setdefault(q, []).append(replies[i])
    assert sorted(r["completion"][0]["content"] for r in rows) == sorted(max(v, key=len) for v in by_query.values())
    tok = testing.smollm2_tokenizer(smollm2_dir)
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=96, **TRAIN)
    ds = TorchRLBufferDataset(best, 2, format="sft_conversational", reading="epoch").as_hf_dataset(map_style=True)
    trainer = SFTTrainer(model=copy.deepcopy(smollm2_model).train(), args=args, train_dataset=ds, processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    trained = batch["labels"] != -100 if "labels" in batch else batch["completion_mask"].bool()
    assert trained.sum(-1).min() > 2, "more than the closing '<|im_end|>\\n' is trained on"
    trainer.train()
    assert trainer.state.global_step == 1 and torch.isfinite(torch.tensor(_grad_norms(trainer)[0]))


def test_kto_trainer_on_ranked_rows(rollouts, smollm2_model, smollm2_dir, tmp_path):
    from trl import KTOConfig, KTOTrainer

    rb, replies = rollouts
    rows_rb = _quiet(kto_rows, rb, group_size=GROUP)
    rows = list(TorchRLBufferDataset(rows_rb, 4, format="kto_conversational", reading="epoch"))
    assert {r["completion"][0]["content"] for r in rows} <= set(replies.values())
    assert {r["label"] for r in rows} == {True, False}
    tok = testing.smollm2_tokenizer(smollm2_dir)
    args = KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(rows), max_length=96, **TRAIN)
    ds = TorchRLBufferDataset(rows_rb, 4, format="kto_conversational", reading="epoch").as_hf_dataset(map_style=True)
    trainer = KTOTrainer(model=copy.deepcopy(smollm2_model).train(), args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    assert trainer.state.global_step == 1 and _grad_norms(trainer)[0] > 0


def test_pad_eos_rollouts_are_refused_before_any_row(smollm2_model, smollm2_dir):
    """TorchRL's own wrapper with the shipped tokenizer: the replies were lost; no builder makes rows of them."""
    # unscored: the reward function itself would refuse the lost replies while collecting
    rb = _collect(smollm2_model, testing.smollm2_tokenizer(smollm2_dir, "eos"), TransformersWrapper, scored=False)
    for build in (preference_pairs, kto_rows, best_of_n):
        with pytest.raises(PaddingLostError, match="safe_policy_wrapper"):
            _quiet(build, rb, group_size=GROUP)

