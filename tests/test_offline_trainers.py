"""TRL's offline trainers (Reward, DPO, KTO, SFT best-of-n) and RLOO trained from buffers a
real LLMCollector filled and a TRL-style reward function scored: every batch of one epoch of
each trainer's dataloader is checked against the buffer's rows (each row exactly once)."""

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


def _epoch(trainer) -> list[dict]:
    """Every batch of one pass of the trainer's own (shuffled) train dataloader."""
    return list(trainer.get_train_dataloader())


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
    ds = TorchRLBufferDataset(pairs, 4, format=fmt, reading="epoch")
    args = RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **TRAIN)
    trainer = RewardTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    td = pairs[:]
    eos = "" if fmt == "reward_tokenized" else tok.eos_token  # TRL adds EOS to text only if missing
    prompts = layouts.read_text(td.get("chosen"), "prompt")
    sides = {
        side: [p + r + ("" if r.endswith(tok.eos_token) else eos) for p, r in zip(prompts, layouts.read_text(td.get(side), "response"))]
        for side in ("chosen", "rejected")
    }
    chosen_rewards = td.get("chosen").get(("next", "reward")).reshape(-1)
    rejected_rewards = td.get("rejected").get(("next", "reward")).reshape(-1)
    # the ids of tokenized pairs are the buffer's own tokens, not re-tokenized text
    chosen_ids = [tuple(torch.cat([layouts.read_tokens(td.get("chosen"), p)[i] for p in ("prompt", "response")]).tolist())
                  for i in range(len(td))]
    want = sorted(zip(sides["chosen"], sides["rejected"], (chosen_rewards - rejected_rewards).tolist(), chosen_ids))
    got = []
    for batch in _epoch(trainer):
        texts, n = _decode_rows(tok, batch), len(batch["margin"])
        ids = [tuple(i[m.bool()].tolist()) for i, m in zip(batch["input_ids"][:n], batch["attention_mask"][:n])]
        got.extend(zip(texts[:n], texts[n:], batch["margin"].tolist(), ids))
    assert len(got) == len(want) == len(td)
    for g, w in zip(sorted(got), want):
        assert g[:2] == w[:2]
        assert g[2] == pytest.approx(w[2], abs=1e-5)
        if fmt == "reward_tokenized":
            assert g[3] == w[3]
    # chosen = the longest reply of its prompt, rejected = the shortest; margin = the reward gap
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
    ds = TorchRLBufferDataset(pairs, 4, format="dpo_conversational", reading="epoch")
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=128, **TRAIN)
    trainer = DPOTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    assert trainer.ref_model is not None
    td = pairs[:]
    prompts = layouts.read_history(td.get("chosen"), "prompt")
    want = []  # per pair: (chosen chat, rejected chat, chosen completion, rejected completion)
    for prompt, chosen, rejected in zip(prompts, *(layouts.read_history(td.get(s), "response") for s in ("chosen", "rejected"))):
        head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = [tok.apply_chat_template(prompt + reply, tokenize=False) for reply in (chosen, rejected)]
        want.append((*full, *(f[len(head) :] for f in full)))
    got = []
    for batch in _epoch(trainer):
        texts, completions = _decode_rows(tok, batch), _decode_rows(tok, batch, mask="completion_mask")
        n = len(texts) // 2
        got.extend(zip(texts[:n], texts[n:], completions[:n], completions[n:]))
    assert len(got) == len(td) and sorted(got) == sorted(want)
    trainer.train()
    assert trainer.state.global_step == 2


def test_kto_trainer_from_ranked_rows(rollouts, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tok = AutoTokenizer.from_pretrained(checkpoints.policy)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    rows = _quiet(kto_rows, rollouts, group_size=GROUP)
    ds = TorchRLBufferDataset(rows, 4, format="kto", reading="epoch")
    args = KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_length=128, **TRAIN)
    trainer = KTOTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    td = rows[:]
    prompts, responses = layouts.read_text(td, "prompt"), layouts.read_text(td, "response")
    texts = [p + r + ("" if r.endswith(tok.eos_token) else tok.eos_token) for p, r in zip(prompts, responses)]
    want = sorted(zip(texts, td.get("label").tolist()))
    got = sorted(pair for batch in _epoch(trainer) for pair in zip(_decode_rows(tok, batch), batch["label"].tolist()))
    assert len(got) == len(td) and got == want
    # labels follow the rank in each group: desirable rows out-score undesirable ones of their prompt
    rewards = td.get(("next", "reward")).reshape(-1)
    queries = layouts.read_column(td, "query")
    for q in set(queries):
        good = [float(r) for r, qq, lab in zip(rewards, queries, td.get("label")) if qq == q and lab]
        bad = [float(r) for r, qq, lab in zip(rewards, queries, td.get("label")) if qq == q and not lab]
        assert good and bad and min(good) > max(bad)
    trainer.train()
    assert trainer.state.global_step == 2


def test_sft_trainer_best_of_n(rollouts, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(checkpoints.policy)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    best = _quiet(best_of_n, rollouts, k=1, group_size=GROUP)
    ref = _reference(rollouts)
    ds = TorchRLBufferDataset(best, 4, format="sft_conversational", reading="epoch")
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **TRAIN)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds.as_hf_dataset(), processing_class=tok)
    td = best[:]
    assert len(td) == len(ROWS)
    expected = [tok.apply_chat_template(h, tokenize=False) for h in layouts.read_history(td, "full")]
    assert sorted(text for batch in _epoch(trainer) for text in _decode_rows(tok, batch)) == sorted(expected)
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

    ds = TorchRLBufferDataset(rollouts, 4, format="rloo_conversational", keys=["answer"], reading="epoch")
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
