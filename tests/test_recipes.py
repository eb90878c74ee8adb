"""examples/recipes: each recipe's ``--dry-run`` (tiny offline models, CPU, one step) runs
the whole script end to end in a subprocess, so the recipes cannot rot unnoticed. The real
runs (hub models, GPU) are not part of the suite."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).parents[1] / "examples" / "recipes"


def _dry_run(script: str, tmp_path) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, str(RECIPES / script), "--dry-run", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(150)
def test_torchrl_to_trl_dpo_dry_run(tmp_path):
    out = _dry_run("torchrl_to_trl_dpo.py", tmp_path)
    assert "collected batch 1/1: 4 scored completions" in out, out
    assert "2 preference pairs" in out, out  # best_vs_worst: one pair per group of 2
    assert "DPO: 1 optimizer steps" in out, out
    assert (tmp_path / "out" / "policy_dpo" / "model.safetensors").is_file()


@pytest.mark.timeout(150)
def test_hf_reward_to_torchrl_grpo_dry_run(tmp_path):
    from safetensors.torch import load_file

    from torchrl_trl.testing import tiny_checkpoints

    out = _dry_run("hf_reward_to_torchrl_grpo.py", tmp_path)
    assert "iteration 1/1: reward mean" in out, out
    assert "GRPO: 1 optimizer steps" in out, out
    trained = load_file(tmp_path / "out" / "policy_grpo" / "model.safetensors")
    initial = load_file(tiny_checkpoints(tmp_path / "ckpt").policy / "model.safetensors")
    assert trained.keys() == initial.keys()
    assert any(not (trained[k] == initial[k]).all() for k in trained), "the optimizer step changed nothing"


def test_recipe_config_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(RECIPES / "hf_reward_to_torchrl_grpo.py"), "--config", str(tmp_path / "nope.yaml")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "--config" in proc.stderr and "nope.yaml" in proc.stderr, proc.stderr[-2000:]
