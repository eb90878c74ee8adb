"""examples/recipes: each recipe's ``--dry-run`` (tiny offline models, CPU, one step) runs
the whole script end to end as ``python recipe.py`` would (``runpy`` with its own argv, in
this process: the suite has already paid the imports), so the recipes cannot rot
unnoticed. The real runs (hub models, GPU) are not part of the suite."""

import contextlib
import io
import runpy
import sys
import traceback
from pathlib import Path

import pytest

RECIPES = Path(__file__).parents[1] / "examples" / "recipes"


@pytest.fixture
def run_recipe(tmp_path, monkeypatch):
    """``run_recipe(script, *args) -> (exit status, stdout, stderr)``: the script as
    ``__main__`` with that command line, from ``tmp_path`` (offline: see conftest). Output
    goes to buffers of this call (never closed: a logging handler the script creates may
    outlive it)."""

    def run(script: str, *args: str):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [str(RECIPES / script), *args])
        monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts its folder first
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(RECIPES / script), run_name="__main__")
                code = 0
            except SystemExit as exit_:
                code = exit_.code
            except Exception:  # what the interpreter would print before exiting with 1
                code = 1
                print(traceback.format_exc(), file=sys.stderr)
        return code, out.getvalue(), err.getvalue()

    return run


@pytest.fixture
def dry_run(run_recipe, tmp_path):
    def run(script: str) -> str:
        code, out, err = run_recipe(script, "--dry-run", "--output-dir", str(tmp_path / "out"))
        assert code in (0, None), out[-3000:] + err[-3000:]
        return out

    return run


@pytest.mark.timeout(150)
def test_torchrl_to_trl_dpo_dry_run(dry_run, tmp_path):
    out = dry_run("torchrl_to_trl_dpo.py")
    assert "collected batch 1/1: 4 scored completions" in out, out
    assert "2 preference pairs" in out, out  # best_vs_worst: one pair per group of 2
    assert "DPO: 1 optimizer steps" in out, out
    assert (tmp_path / "out" / "policy_dpo" / "model.safetensors").is_file()


@pytest.mark.timeout(150)
def test_hf_reward_to_torchrl_grpo_dry_run(dry_run, tmp_path):
    from safetensors.torch import load_file

    from torchrl_trl.testing import tiny_checkpoints

    out = dry_run("hf_reward_to_torchrl_grpo.py")
    assert "iteration 1/1: reward mean" in out, out
    assert "GRPO: 1 optimizer steps" in out, out
    trained = load_file(tmp_path / "out" / "policy_grpo" / "model.safetensors")
    initial = load_file(tiny_checkpoints(tmp_path / "ckpt").policy / "model.safetensors")
    assert trained.keys() == initial.keys()
    assert any(not (trained[k] == initial[k]).all() for k in trained), "the optimizer step changed nothing"


def test_recipe_config_errors(run_recipe, tmp_path):
    code, _, err = run_recipe("hf_reward_to_torchrl_grpo.py", "--config", str(tmp_path / "nope.yaml"))
    assert code not in (0, None)
    assert "--config" in err and "nope.yaml" in err, err[-2000:]


def _load_common():
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipes_common", RECIPES / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prompts_from_a_conversational_dataset(tmp_path):
    """The real configs read a conversational prompt-only dataset (as
    ``trl-lib/ultrafeedback-prompt``): the last user turn is the query; here a local parquet."""
    from datasets import Dataset

    rows = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {i}"}]
            for i in range(5)]
    Dataset.from_dict({"prompt": rows}).to_parquet(tmp_path / "p.parquet")
    common = _load_common()
    spec = {"dataset": "parquet", "data_files": str(tmp_path / "p.parquet"), "split": "train",
            "column": "prompt", "limit": 3}
    assert common.load_prompts(spec) == ["question 0", "question 1", "question 2"]
    with pytest.raises(KeyError, match="'query' is not a column"):
        common.load_prompts({**spec, "column": "query"})


def test_real_configs_are_valid(tmp_path):
    """The GPU configs (not run here): the model ids documented in the README, dtypes that
    exist, and a ``dpo:`` section that ``trl.DPOConfig`` accepts as it is."""
    import yaml
    from trl import DPOConfig

    common = _load_common()
    for name in ("torchrl_to_trl_dpo.yaml", "hf_reward_to_torchrl_grpo.yaml"):
        cfg = yaml.safe_load((RECIPES / name).read_text())
        assert cfg["policy"] == "Qwen/Qwen2.5-0.5B-Instruct"
        assert cfg["reward_model"] == "Skywork/Skywork-Reward-V2-Qwen3-0.6B"
        assert cfg["reward_model"] in (RECIPES / "README.md").read_text()
        for key in ("dtype", "policy_dtype"):
            common.torch_dtype(cfg[key])
        assert cfg["prompts"]["dataset"] == "trl-lib/ultrafeedback-prompt"
    cfg = yaml.safe_load((RECIPES / "torchrl_to_trl_dpo.yaml").read_text())
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **cfg["dpo"])
    assert args.beta == cfg["dpo"]["beta"] and args.max_length == cfg["dpo"]["max_length"]
