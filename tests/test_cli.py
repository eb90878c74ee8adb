"""``torchrl-trl`` on buffers a real LLMCollector filled and ``save_buffer`` wrote (a ragged
``LazyStackStorage`` and a padded ``LazyTensorStorage``): through the installed console
script where a test says ``script=True`` (``--version``, ``env``), else through ``torchrl_trl.cli.main`` in this
process (the same parser and commands, without a fresh interpreter's imports per call)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

import torchrl_trl

ROWS = [{"query": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
SCRIPT = Path(sys.executable).parent / "torchrl-trl"  # the console script pip installed


def run(*args: str, script: bool = False, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrl-trl ARGS``, offline: the installed script in a subprocess (``script=True``)
    or ``main(ARGS)`` here, its exit status and output captured alike."""
    if script:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)
    from torchrl_trl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse and parser.exit
            code = exit_.code
    return subprocess.CompletedProcess(["torchrl-trl", *args], code or 0, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def saved(tmp_path_factory, policy_and_tokenizer):
    """``{"ragged": (path, buffer), "padded": (path, buffer)}`` saved with ``save_buffer``."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement

    from torchrl_trl import save_buffer, testing

    model, tok = policy_and_tokenizer
    root = tmp_path_factory.mktemp("buffers")
    env = testing.make_chat_env(ROWS, batch_size=2, group_size=2)
    ragged = testing.collect_rollouts(testing.make_policy_wrapper(model, tok, max_new_tokens=6), env, total_turns=8)
    env = testing.make_chat_env(ROWS, batch_size=2, group_size=2)
    one_batch = testing.collect_rollouts(
        testing.make_policy_wrapper(model, tok, pad_output=True, max_new_tokens=6), env, total_turns=4
    )
    # another sampler than the CLI's default, with a state: items still read
    padded = ReplayBuffer(storage=LazyTensorStorage(8), sampler=SamplerWithoutReplacement(), batch_size=2)
    padded.extend(one_batch[:].contiguous())  # one padded collector batch: a dense TensorDict
    padded.sample()
    out = {}
    for name, rb in (("ragged", ragged), ("padded", padded)):
        out[name] = (save_buffer(rb, root / name), rb)
    return out


def _fail(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr[-2000:])
    return proc.stderr


def test_version_and_help_read_as_plain_text():
    proc = run("--version", script=True)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"torchrl-trl {torchrl_trl.__version__}"
    for args in (["--help"], ["env", "--help"], ["inspect", "--help"], ["export", "--help"], ["score", "--help"], ["demo", "--help"]):
        proc = run(*args)
        assert proc.returncode == 0, proc.stderr
        assert "``" not in proc.stdout and ":class:" not in proc.stdout and ":func:" not in proc.stdout, proc.stdout
    demo_help = " ".join(run("demo", "--help").stdout.split())
    from torchrl_trl.cli import FULL_TIME, QUICK_TIME, SMOLLM2_TIME

    assert QUICK_TIME in demo_help and FULL_TIME in demo_help and SMOLLM2_TIME in demo_help  # measured times, stated
    assert all("idle CPU cores, measured" in t and "other jobs" in t for t in (QUICK_TIME, FULL_TIME, SMOLLM2_TIME))


@pytest.mark.parametrize(
    "args",
    [
        ["export", "buffer", "--format", "sft", "--out", "out", "--batch-size", "0"],
        ["score", "buffer", "--reward-model", "rm", "--max-tokens-per-batch", "-5"],
        ["demo", "--iterations", "two"],
    ],
    ids=["export", "score", "demo"],
)
def test_counts_must_be_positive_integers(args):
    """Refused by argparse, before any path is looked at or anything heavy is imported."""
    proc = run(*args)
    flag, value = args[-2:]
    _fail(proc, f"argument {flag}: expected a positive integer, got {value!r}")


def test_env_reports_versions_and_devices():
    proc = run("env", script=True)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line[2:].split(":", 1) for line in proc.stdout.splitlines() if line.startswith("- "))
    lines = {k: v.strip() for k, v in lines.items()}
    for name in ("torch", "torchrl", "tensordict", "trl", "transformers", "datasets", "accelerate"):
        assert lines[name] == version(name)
    assert lines["python"] == ".".join(map(str, sys.version_info[:3]))
    assert lines["cuda"] == ("not available" if not torch.cuda.is_available() else lines["cuda"])
    assert "platform" in lines


@pytest.mark.parametrize("name", ["ragged", "padded"])
def test_inspect(saved, name):
    path, rb = saved[name]
    proc = run("inspect", str(path), "--format", "grpo")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"length:  {len(rb)}\n" in out
    assert ("layout:  ragged" if name == "ragged" else "layout:  padded") in out
    keys = [line.strip() for line in out.split("keys:\n")[1].split("formats:")[0].splitlines()]
    assert {"tokens.full", "history.full.content", "text.prompt", "query"} <= set(keys)
    formats = out.split("formats: ")[1].splitlines()[0].split(", ")
    assert {"sft", "sft_conversational", "sft_tokenized", "grpo"} <= set(formats)
    assert "dpo" not in formats  # needs chosen/rejected pairs
    # the row, against TorchRL's own text of the first stored rollout
    first_prompt = rb.storage.get(0)["text", "prompt"]
    assert f"  prompt: {first_prompt!r}" in out


@pytest.mark.parametrize("widths", [(3, 5, 2), (4, 4, 4)], ids=["ragged", "equal"])
def test_inspect_tokens_without_torchrl_padded_flag(tmp_path, widths):
    """Tokens written by other code than TorchRL's wrappers carry no ``Tokens.padded``
    flag: the stored widths say the layout (samples of different lengths cannot be stacked)."""
    from tensordict import TensorDict, lazy_stack
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from torchrl_trl import save_buffer

    rb = ReplayBuffer(storage=LazyStackStorage(4))
    rb.extend(lazy_stack([TensorDict({"tokens": {"full": torch.arange(1, n + 1)}}) for n in widths]))
    assert "padded" not in rb[:]["tokens"].keys()
    proc = run("inspect", str(save_buffer(rb, tmp_path / "buffer")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "ragged (real lengths 2..5)" if widths == (3, 5, 2) else "padded (width 4, real lengths 4..4)"
    assert f"layout:  {expected}\n" in proc.stdout, proc.stdout


def test_export_dataset_on_disk_matches_the_buffer(saved, tmp_path):
    from datasets import load_from_disk

    path, rb = saved["ragged"]
    proc = run("export", str(path), "--format", "sft_conversational", "--out", str(tmp_path / "ds"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds = load_from_disk(str(tmp_path / "ds"))
    assert len(ds) == len(rb)
    for i, row in enumerate(ds):  # storage order, every item once
        item = rb.storage.get(i)
        expected = [{"role": m["role"], "content": m["content"]} for m in item["history", "prompt"].tolist()]
        assert row["prompt"] == expected


def test_export_parquet_tokens(saved, tmp_path):
    from datasets import Dataset

    path, rb = saved["ragged"]
    out = tmp_path / "rows.parquet"
    proc = run("export", str(path), "--format", "sft_tokenized", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds = Dataset.from_parquet(str(out))
    assert len(ds) == len(rb)
    for i, row in enumerate(ds):
        item = rb.storage.get(i)  # pad_output=False: each item's tokens are unpadded
        prompt, response = item["tokens", "prompt"].tolist(), item["tokens", "response"].tolist()
        assert row["input_ids"] == prompt + response
        assert row["completion_mask"] == [0] * len(prompt) + [1] * len(response)


def test_export_and_inspect_errors(saved, tmp_path):
    path, _ = saved["padded"]
    _fail(run("export", str(path), "--format", "nope", "--out", str(tmp_path / "x")), "'nope'", "sft_conversational")
    _fail(run("export", str(path), "--format", "dpo", "--out", str(tmp_path / "x")), "chosen.text.prompt")
    assert not (tmp_path / "x").exists()
    _fail(run("inspect", str(tmp_path / "missing")), "no such directory", "missing")
    not_a_buffer = tmp_path / "empty_dir"
    not_a_buffer.mkdir()
    _fail(run("inspect", str(not_a_buffer)), "manifest.json")


def _reference_rewards(rm_dir, rb) -> torch.Tensor:
    """Each stored chat rendered with the reward model's own chat template (as
    ``RewardTrainer`` tokenises conversations) and scored alone, without padding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tok = AutoTokenizer.from_pretrained(rm_dir)
    out = []
    with torch.no_grad():
        for i in range(len(rb)):
            chat = [{"role": m["role"], "content": m["content"]} for m in rb.storage.get(i)["history", "full"].tolist()]
            ids = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False, return_tensors="pt")
            out.append(model(input_ids=ids["input_ids"]).logits[0, 0])
    return torch.stack(out)


@pytest.mark.parametrize("name", ["ragged", "padded"])
def test_score_writes_rewards_back(saved, checkpoints, tmp_path, name):
    """A new key in a tensor storage too (the padded buffer had no reward)."""
    from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer

    from torchrl_trl import load_buffer

    src, rb = saved[name]
    path = tmp_path / "buffer"
    rm_dir = checkpoints.reward_model_other_tokenizer  # another tokenizer and chat template
    if name == "ragged":  # in place
        shutil.copytree(src, path)
        proc = run("score", "--reward-model", str(rm_dir), str(path))
    else:  # to a copy: the saved buffer stays as it was
        before = {p.name: p.read_bytes() for p in src.iterdir()}
        proc = run("score", "--reward-model", str(rm_dir), str(src), "--out", str(path))
        assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scoring" in proc.stderr  # the progress bar

    storage = LazyStackStorage if name == "ragged" else LazyTensorStorage
    restored = ReplayBuffer(storage=storage(len(rb)))
    load_buffer(restored, path)
    assert len(restored) == len(rb)
    got = torch.stack([restored.storage.get(i)["next", "reward"] for i in range(len(rb))])
    assert got.shape == (len(rb), 1, 1)  # TorchRL's GRPO convention per rollout
    ref = _reference_rewards(checkpoints.reward_model_other_tokenizer, rb)
    torch.testing.assert_close(got.reshape(-1), ref, atol=1e-5, rtol=0)
    # the rest of each rollout is untouched
    for i in range(len(rb)):
        assert restored.storage.get(i)["text", "full"] == rb.storage.get(i)["text", "full"]
    stats = proc.stdout.split("reward: ")[1].split()
    assert float(stats[1]) == pytest.approx(float(ref.mean()), abs=1e-3)
    assert float(stats[5]) == pytest.approx(float(ref.min()), abs=1e-3)
    assert float(stats[7]) == pytest.approx(float(ref.max()), abs=1e-3)


def pickle_only_checkpoint(root: Path, marker: Path) -> Path:
    """A directory holding config.json and a ``pytorch_model.bin`` whose unpickling would
    create ``marker``."""

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    d = root / "pickle_only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_labels": 1}))
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    return d


def test_pickle_only_checkpoints_are_refused_unloaded(saved, tmp_path):
    marker = tmp_path / "unpickled"
    bad = pickle_only_checkpoint(tmp_path, marker)
    path = tmp_path / "buffer"
    shutil.copytree(saved["ragged"][0], path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    err = _fail(run("score", "--reward-model", str(bad), str(path)), "--reward-model", "pytorch_model.bin", "safetensors")
    err += _fail(run("demo", "--reward-model", str(bad), "--output-dir", str(tmp_path / "demo")), "--reward-model", "pytorch_model.bin")
    err += _fail(run("demo", "--policy", str(bad), "--output-dir", str(tmp_path / "demo")), "--policy", "pytorch_model.bin")
    assert not marker.exists()  # never unpickled
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # buffer untouched
    assert not (tmp_path / "demo").exists()  # refused before the demo started


def test_demo_hub_id_offline_and_missing_path(tmp_path):
    err = _fail(run("demo", "--policy", "Qwen/Qwen2.5-0.5B-Instruct", "--output-dir", str(tmp_path / "d")), "--policy", "offline", "hf download")
    assert "Repo id must" not in err and "onnect" not in err
    err = _fail(run("demo", "--reward-model", str(tmp_path / "no_such_model"), "--output-dir", str(tmp_path / "d")), "no such directory")
    assert "Repo id must" not in err
    _fail(run("demo", "--policy", "./relative/missing"), "no such directory")
    assert not (tmp_path / "d").exists()
