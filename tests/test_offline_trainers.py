"""TRL's offline trainers (Reward, DPO, KTO, SFT best-of-n) and RLOO trained from buffers a
real LLMCollector filled and a TRL-style reward function scored: the first batch each
trainer's dataloader yields is checked against the buffer's rollouts."""

import warnings

import pytest
import torch

from torchrl_trl import layouts, testing
from torchrl_trl.data import TorchRLBufferDataset
from torchrl_trl.data.groups import SkippedRolloutsWarning, find_groups
from torchrl_trl.data.preference import best_of_n, kto_rows, preference_pairs
from torchrl_trl.rewards.functions import RewardFunctionWrapper

ROWS = [{"query": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
GROUP = 4
TRAIN = dict(use_cpu=True, bf16=False, report_to=[], save_strategy="no", max_steps=2, logging_steps=1,
             dataloader_num_workers=0)


def response_length(prompts, completions, **kwargs):
    """A TRL-style reward function (conversational): the length of the reply."""
    return [float(len(c[-1]["content"])) for c in completions]


@pytest.fixture(scope="module")
def rollouts(policy_and_tokenizer):
    """16 scored rollouts: 4 prompts x 4 completions, 2 per collector batch (so every group
    is spread over several batches)."""
    model, tok = policy_and_tokenizer
    env = testing.make_chat_env(ROWS, batch_size=2, group_size=GROUP)
    env = env.append_transform(RewardFunctionWrapper(response_length).as_transform())
    policy = testing.make_policy_wrapper(model, tok, max_new_tokens=8)
    return testing.collect_rollouts(policy, env, total_turns=len(ROWS) * GROUP)


def _quiet(build, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedRolloutsWarning)
        return build(*args, **kwargs)


def _reference(rollouts):
    """(query, reply, reward recomputed with the reward function) per stored rollout."""
    td = rollouts[:]
    replies = layouts.read_history(td, "response")
    rewards = response_length(None, replies)
    torch.testing.assert_close(td.get(("next", "reward")).reshape(-1), torch.tensor(rewards))
    return list(zip(layouts.read_column(td, "query"), [r[-1]["content"] for r in replies], rewards))


def _decode_rows(tok, batch, key="input_ids", mask="attention_mask"):
    return [tok.decode(ids[m.bool()]) for ids, m in zip(batch[key], batch[mask])]


def test_groups_span_collector_batches(rollouts):
    groups = find_groups(rollouts, group_size=GROUP)
    assert len(groups) == len(ROWS) and not groups.stats.skipped
    # the collector wrote 2 rollouts per batch: each group of 4 came from >= 2 batches
    assert all(len({i // 2 for i in m.tolist()}) >= 2 for m in groups.members)
    queries = layouts.read_column(rollouts[:], "query")
    assert all(len({queries[i] for i in m.tolist()}) == 1 for m in groups.members)


@pytest.mark.parametrize("fmt", ["reward", "reward_tokenized"])
def test_reward_trainer_from_pairs(rollouts, checkpoints, tmp_path, fmt):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tok = AutoTokenizer.from_pretrained(checkpoints.reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(checkpoints.reward_model)
    pairs = _quiet(preference_pairs, rollouts, group_size=GROUP)
    ref = _reference(rollouts)
    ds = TorchRLBufferDataset(pairs, 4, format=fmt, mode="epoch")
    args = RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **TRAIN)
    trainer = RewardTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    td = pairs[:4]
    prompts = layouts.read_text(td.get("chosen"), "prompt")
    texts = _decode_rows(tok, batch)
    n = len(prompts)
    for i, side in enumerate(["chosen", "rejected"]):
        responses = layouts.read_text(td.get(side), "response")
        eos = "" if fmt == "reward_tokenized" else tok.eos_token  # TRL adds EOS to text only if missing
        expected = [p + r + ("" if r.endswith(tok.eos_token) else eos) for p, r in zip(prompts, responses)]
        assert texts[i * n : (i + 1) * n] == expected
    if fmt == "reward_tokenized":
        for i in range(n):  # the ids are the buffer's own tokens, not re-tokenized text
            ids = torch.cat([layouts.read_tokens(td.get("chosen"), p)[i] for p in ("prompt", "response")])
            torch.testing.assert_close(batch["input_ids"][i][: len(ids)], ids)
    # chosen = the longest reply of its prompt, rejected = the shortest; margin = the reward gap
    chosen_rewards = td.get("chosen").get(("next", "reward")).reshape(-1)
    rejected_rewards = td.get("rejected").get(("next", "reward")).reshape(-1)
    torch.testing.assert_close(batch["margin"], chosen_rewards - rejected_rewards)
    queries = layouts.read_column(td.get("chosen"), "query")
    for q, c, r in zip(queries, chosen_rewards.tolist(), rejected_rewards.tolist()):
        group = [rw for qq, _, rw in ref if qq == q]
        assert (c, r) == (max(group), min(group))
    trainer.train()
    assert trainer.state.global_step == 2


def test_dpo_trainer_from_pairs(rollouts, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(checkpoints.policy)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)  # by path: the ref model is rebuilt from it
    pairs = _quiet(preference_pairs, rollouts, group_size=GROUP)
    ds = TorchRLBufferDataset(pairs, 4, format="dpo_conversational", mode="epoch")
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=128, **TRAIN)
    trainer = DPOTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    assert trainer.ref_model is not None
    batch = next(iter(trainer.get_train_dataloader()))
    td = pairs[:2]
    prompts = layouts.read_history(td.get("chosen"), "prompt")
    texts = _decode_rows(tok, batch)
    completions = _decode_rows(tok, batch, mask="completion_mask")
    for i, side in enumerate(["chosen", "rejected"]):
        for j, (prompt, reply) in enumerate(zip(prompts, layouts.read_history(td.get(side), "response"))):
            full = tok.apply_chat_template(prompt + reply, tokenize=False)
            head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            assert texts[i * 2 + j] == full
            assert completions[i * 2 + j] == full[len(head) :]
    trainer.train()
    assert trainer.state.global_step == 2


def test_kto_trainer_from_ranked_rows(rollouts, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tok = AutoTokenizer.from_pretrained(checkpoints.policy)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    rows = _quiet(kto_rows, rollouts, group_size=GROUP)
    ds = TorchRLBufferDataset(rows, 4, format="kto", mode="epoch")
    args = KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_length=128, **TRAIN)
    trainer = KTOTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    td = rows[:4]
    prompts, responses = layouts.read_text(td, "prompt"), layouts.read_text(td, "response")
    expected = [p + r + ("" if r.endswith(tok.eos_token) else tok.eos_token) for p, r in zip(prompts, responses)]
    assert _decode_rows(tok, batch) == expected
    assert batch["label"].tolist() == td.get("label").tolist()
    # labels follow the rank in each group: desirable rows out-score undesirable ones of their prompt
    rewards = td.get(("next", "reward")).reshape(-1)
    queries = layouts.read_column(td, "query")
    for q in set(queries):
        good = [float(r) for r, qq, lab in zip(rewards, queries, batch["label"]) if qq == q and lab]
        bad = [float(r) for r, qq, lab in zip(rewards, queries, batch["label"]) if qq == q and not lab]
        assert not good or not bad or min(good) > max(bad)
    trainer.train()
    assert trainer.state.global_step == 2


def test_sft_trainer_best_of_n(rollouts, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(checkpoints.policy)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    best = _quiet(best_of_n, rollouts, k=1, group_size=GROUP)
    ref = _reference(rollouts)
    ds = TorchRLBufferDataset(best, 4, format="sft_conversational", mode="epoch")
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **TRAIN)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    td = best[:]
    assert len(td) == len(ROWS)
    expected = [tok.apply_chat_template(h, tokenize=False) for h in layouts.read_history(td, "full")]
    assert _decode_rows(tok, batch) == expected
    # each kept reply is (the first of) its prompt's longest
    for q, reply in zip(layouts.read_column(td, "query"), layouts.read_history(td, "response")):
        group = [(rw, text) for qq, text, rw in ref if qq == q]
        assert reply[-1]["content"] == max(group, key=lambda x: x[0])[1]
    trainer.train()
    assert trainer.state.global_step == 2


def test_rloo_trainer_prompts_from_buffer(rollouts, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    tok = AutoTokenizer.from_pretrained(checkpoints.policy)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)  # by path: RLOO rebuilds its ref model
    seen = []

    def reward_len(prompts, completions, answer, **kwargs):
        seen.extend(zip(prompts, answer))
        return [float(len(c[-1]["content"])) for c in completions]

    ds = TorchRLBufferDataset(rollouts, 4, format="rloo_conversational", extra_columns=["answer"], mode="epoch")
    args = RLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, shuffle_dataset=False, **TRAIN)
    trainer = RLOOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=ds.as_hf_dataset(),
                          processing_class=tok)
    assert trainer.ref_model is not None
    trainer.train()
    td = rollouts[:4]
    stored = list(zip(layouts.read_history(td, "prompt"), layouts.read_column(td, "answer")))
    # 2 steps x 4 completions = the first 4 buffer prompts, each generated num_generations=2 times
    assert seen == [row for row in stored for _ in range(2)]
    assert trainer.state.global_step == 2


def test_full_circle_reward_model_learns_the_function(tmp_path):
    """examples/full_circle.py: buffer -> RewardTrainer -> saved RM by path -> TorchRL scores
    held-out rollouts. Measured over seeds 0-2: trained 0.78-0.85, the untrained RM 0.37-0.46,
    randomly initialised RMs 0.31-0.65 on such held-out pairs; 0.70 is above all of those."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "full_circle.py"
    spec = importlib.util.spec_from_file_location("full_circle", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.run(tmp_path, seed=0)
    assert result["heldout_pairs"] >= 30
    assert result["accuracy"] >= 0.70, result
    assert result["accuracy"] - result["untrained_accuracy"] >= 0.2, result
