"""The main job: `torchrl-trl demo --quick` end to end, as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Measured over seeds 0-3 with --quick: with learning (lr=3e-3) the true score rose by
# 0.27-0.30; with lr=0 (pure sampling noise) it moved by at most 0.02. (After the chat
# template's generation tags moved, seed 0 rises by 0.225.)
MIN_TRUE_SCORE_GAIN = 0.1
# Phase 5, TRL's GRPOTrainer generating through TorchRLRolloutFunc, --quick (12 iterations
# of 64 completions), first -> last iteration's mean true score, measured on seeds 0-2:
# +0.288, +0.158, +0.266; with lr=0 (sampling noise, seeds 0-1): -0.040, -0.008, every
# iteration within 0.145-0.182. Fresh samples before -> after: +0.30, +0.14, +0.26 (lr=0: 0).
MIN_TRL_GRPO_GAIN = 0.08
# Phase 4, SFTTrainer on the best-of-n rollouts of phase 3 from the initial policy, --quick,
# fresh samples before -> after, seeds 0-3: +0.251, +0.215, +0.265, +0.196 (learning rate
# 1e-2; at 1e-3 it was +0.063 to +0.113, and the full run went down, 0.176 -> 0.169; now
# 0.176 -> 0.938). The samples are drawn with a fixed seed, so without learning the two are
# equal (a gain of 0).
MIN_SFT_GAIN = 0.1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_quick_learns_the_hidden_rule(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "torchrl_trl", "demo", "--quick", "--no-progress", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert (out / "reward_curve.png").stat().st_size > 0
    assert "true score (hidden rule)" in proc.stdout

    # the reward model learned the rule from RewardTrainer pairs (chance is 0.5)
    before, after = results["reward_model"]["heldout_pairwise_accuracy"]
    assert after > 0.7 and after > before
    grpo = results["grpo"]
    assert len(grpo["true_score"]) == len(grpo["rm_score"]) == 12
    # GRPO with the reward model raised both its score and the hidden rule's true score
    assert grpo["rm_score"][-1] > grpo["rm_score"][0]
    assert grpo["true_score"][-1] - grpo["true_score"][0] > MIN_TRUE_SCORE_GAIN
    # step 4: best-of-n rows read out of the TorchRL buffer taught the initial policy the rule
    sft = results["sft_best_of_n"]
    assert sft["rows"] > 0
    assert sft["true_score_after"] - sft["true_score_before"] > MIN_SFT_GAIN

    # TRL's GRPOTrainer fed by TorchRL rollouts learned the hidden rule too
    assert grpo["true_score_after"] > grpo["true_score_before"]
    trl = results["trl_grpo"]
    assert len(trl["true_score"]) == 12 and trl["rollout_calls"] == 12 and trl["samples"] == 12 * 64
    assert trl["true_score"][-1] - trl["true_score"][0] > MIN_TRL_GRPO_GAIN
    assert trl["true_score_after"] - trl["true_score_before"] > MIN_TRL_GRPO_GAIN
    assert all(isinstance(v, float) for v in trl["true_score"]) and isinstance(trl["samples"], int)
    assert "TRL GRPO (TorchRL rollouts) true score" in proc.stdout and "trl_grpo" in results["timings_s"]

    # numbers are JSON numbers, not strings
    assert isinstance(results["config"]["iterations"], int) and results["config"]["quick"] is True
    assert isinstance(results["config"]["lr"], float) and results["config"]["policy"] is None
    assert all(isinstance(v, float) for v in results["timings_s"].values())
    assert isinstance(sft["rows"], int) and isinstance(grpo["true_score"][0], float)

    # both trained policies saved (safetensors only) and loadable; SFT changed the weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policies = [Path(grpo["policy_path"]), Path(sft["policy_path"])]
    assert policies == [out / "policy_grpo", out / "policy_sft"]
    models = []
    for path in policies:
        assert list(path.glob("*.safetensors")) and not list(path.glob("*.bin"))
        AutoTokenizer.from_pretrained(path)
        models.append(AutoModelForCausalLM.from_pretrained(path, use_safetensors=True))
    assert any(not torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()))
    print("demo --quick wall time:", results["timings_s"])


def test_trl_grpo_phase_runs_on_torchrl_rollouts(checkpoints, tmp_path):
    """Step 5 in small: one iteration (one TorchRL generation of 2 prompts x 2 x 4 steps,
    4 TRL optimizer steps) with the untrained reward model; typed numbers."""
    from torchrl_trl.cli.demo import DemoConfig, run_trl_grpo
    from torchrl_trl.cli.demo_tasks import vowels_task

    cfg = DemoConfig(output_dir=tmp_path, iterations=1, prompts_per_batch=2, group_size=2, max_new_tokens=4, lr=1e-2)
    out = run_trl_grpo(checkpoints.policy, checkpoints.reward_model, vowels_task(), cfg)
    assert out["rollout_calls"] == 1 and out["samples"] == 16 and len(out["true_score"]) == 1
    assert all(isinstance(out[k], float) for k in ("true_score_before", "true_score_after"))
    assert 0.0 <= out["true_score"][0] <= 1.0


def test_arithmetic_task_on_tiny_models_runs_every_phase(tmp_path):
    """The smollm2 task's plumbing on the tiny models (nothing is learned): held-out prompts
    scored by math-verify, best-of-n SFT from the prompt/reply split TorchRL collected."""
    from torchrl_trl.cli.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        output_dir=tmp_path, task="arithmetic", iterations=2, prompts_per_batch=2, group_size=2, max_new_tokens=4,
        reward_pairs=32, sft_steps=2, eval_samples=0, updates_per_iteration=1, progress=False,
    )
    results = run_demo(cfg)
    assert results["task"] == "arithmetic" and results["config"]["eval_samples"] == 0
    assert len(results["grpo"]["true_score"]) == 2 and results["sft_best_of_n"]["rows"] > 0
    assert results["trl_grpo"]["samples"] == 2 * 4
    for phase in ("grpo", "sft_best_of_n", "trl_grpo"):
        assert 0.0 <= results[phase]["true_score_after"] <= 1.0


def test_arithmetic_true_score_is_math_verify_on_the_asked_sum():
    from torchrl_trl.cli.demo_tasks import arithmetic_task

    task = arithmetic_task()
    assert set(task.train_prompts).isdisjoint(task.heldout_prompts)
    assert len(task.train_prompts) + len(task.heldout_prompts) == 81 and len(task.heldout_prompts) == 27
    q = "What is 3 + 5?"
    assert task.true_score(q, "3 + 5 = 8") == task.true_score(q, "The answer is 8.") == 1.0
    assert task.true_score(q, "3 + 5 = 9") == task.true_score(q, "To find the sum of 3 and 5, we") == 0.0
    assert task.true_score(q, "3 + 5 = 8\n\nThis is 3") == 0.0  # the last number stated is the answer
    pairs = task.preference_pairs(None, 300, seed=0)
    kinds = set()
    for pair in pairs:  # chosen: the right sum as an equation; rejected: never that
        q, chosen, rejected = pair["prompt"][0]["content"], pair["chosen"][0]["content"], pair["rejected"][0]["content"]
        def equation(reply):
            return " + " in reply or " plus " in reply

        assert equation(chosen) and task.true_score(q, chosen) == 1.0
        right = task.true_score(q, rejected) == 1.0
        assert not (right and equation(rejected)), (q, rejected)
        kinds.add("wrong equation" if equation(rejected) else "right short" if right else "other")
    assert kinds == {"wrong equation", "right short", "other"}
    heldout = task.preference_pairs(None, 50, seed=0, heldout=True)
    assert {p["prompt"][0]["content"] for p in heldout} <= set(task.heldout_prompts)


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_on_smollm2_in_small(smollm2_dir, tmp_path):
    """``--model smollm2``'s phases on the real model, cut to one iteration of 2 prompts x 2
    replies: the reward model's head trains on the real backbone and every phase reports a
    held-out true score (the full run's learning is measured in the README, not here)."""
    from torchrl_trl.cli.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        output_dir=tmp_path, model="smollm2", iterations=1, prompts_per_batch=2, group_size=2, max_new_tokens=8,
        reward_pairs=32, sft_steps=1, progress=False,
    )
    results = run_demo(cfg)
    assert results["config"]["reward_head_only"] is True and results["task"] == "arithmetic"
    before, after = results["reward_model"]["heldout_pairwise_accuracy"]
    assert after > before  # the head learned something from 32 pairs (measured 0.45 -> 0.81 on 256)
    # the initial policy's greedy answers: 9 of the 27 held-out sums (measured)
    assert results["grpo"]["true_score_before"] == results["sft_best_of_n"]["true_score_before"] == pytest.approx(1 / 3)
    assert results["sft_best_of_n"]["rows"] == 2 and results["trl_grpo"]["samples"] == 4


def test_demo_help_lists_the_flags():
    proc = subprocess.run(
        [sys.executable, "-m", "torchrl_trl", "demo", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    for flag in ("--quick", "--policy", "--reward-model", "--device", "--seed", "--iterations", "--output-dir"):
        assert flag in proc.stdout


def test_true_score_is_the_vowel_fraction():
    from torchrl_trl.cli.demo_tasks import vowel_fraction

    assert vowel_fraction("", "") == 0.0
    assert vowel_fraction("", "aaaa") == 1.0
    assert vowel_fraction("", "abcd") == 0.25


def test_run_demo_refuses_pickle_only_checkpoints_unloaded(tmp_path):
    """The API path too: a reward model directory with only ``pytorch_model.bin`` is
    refused before anything is loaded (its unpickling would create ``marker``)."""
    from torchrl_trl.cli import CLIError
    from torchrl_trl.cli.demo import DemoConfig, run_demo

    from test_cli import pickle_only_checkpoint

    marker = tmp_path / "unpickled"
    bad = pickle_only_checkpoint(tmp_path, marker)
    with pytest.raises(CLIError, match=r"reward_model.*safetensors.*pytorch_model\.bin"):
        run_demo(DemoConfig(output_dir=tmp_path / "out", reward_model=bad, quick=True))
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_quiet_libraries_keeps_our_warnings():
    """The demo silences the libraries' warnings, not torchrl_trl's (whose module name
    starts with "torch")."""
    import warnings

    from torchrl_trl.data.groups import SkippedRolloutsWarning
    from torchrl_trl.cli.demo_output import quiet_libraries

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn_explicit("ours", SkippedRolloutsWarning, "groups.py", 1, module="torchrl_trl.data.groups")
        warnings.warn_explicit("theirs", UserWarning, "functional.py", 1, module="torch.nn.functional")
        warnings.warn_explicit("theirs", FutureWarning, "base.py", 1, module="torchrl.collectors.llm.base")
    assert [str(w.message) for w in caught] == ["ours"]
