"""``torchrl-trl inspect`` / ``export`` / ``score`` on buffers of SmolLM2-135M-Instruct rollouts:
right on those a safe policy wrote, refused (exit status 2, the cause and the fix named, no
traceback) on those TorchRL's wrapper wrote with the shipped pad == eos tokenizer."""

from __future__ import annotations

import pytest
import torch
from torchrl.modules.llm import TransformersWrapper

from real_model import SAME_LENGTH_QUERIES, reward_alone
from test_cli import _fail, run
from torchrl_trl import layouts, safe_policy_wrapper, save_buffer, testing

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def _save(model, tok, policy_cls, path):
    env = testing.make_chat_env([{"query": q} for q in SAME_LENGTH_QUERIES], batch_size=2, group_size=1)
    kwargs = dict(input_mode="history", generate=True, return_log_probs=True,
                  generate_kwargs={"max_new_tokens": 8, "do_sample": False})
    policy = safe_policy_wrapper(model, tok, **kwargs) if policy_cls is None else policy_cls(model, tokenizer=tok, **kwargs)
    rb = testing.collect_rollouts(policy, env, total_turns=2)
    save_buffer(rb, path)
    return rb


@pytest.fixture(scope="module")
def buffers(smollm2_model, smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("real_buffers")
    tok = testing.smollm2_tokenizer(smollm2_dir)
    safe = _save(smollm2_model, tok, None, root / "safe")
    _save(smollm2_model, testing.smollm2_tokenizer(smollm2_dir), TransformersWrapper, root / "lost")
    return root, safe


def test_cli_on_safe_rollouts(buffers, smollm2_dir, smollm2_reward_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root, rb = buffers
    proc = run("inspect", str(root / "safe"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    reply = layouts.read_history(rb[:1], "response")[0][0]["content"]
    assert reply and repr(reply)[:40] in proc.stdout
    proc = run("export", str(root / "safe"), "--format", "sft_conversational", "--out", str(tmp_path / "rows"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    from datasets import load_from_disk

    rows = load_from_disk(str(tmp_path / "rows"))
    assert sorted(r["completion"][0]["content"] for r in rows) == sorted(
        c[0]["content"] for c in layouts.read_history(rb[:], "response"))
    proc = run("score", "--reward-model", str(smollm2_reward_dir), str(root / "safe"), "--out", str(tmp_path / "scored"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from torchrl_trl import load_buffer

    scored = ReplayBuffer(storage=LazyStackStorage(len(rb)))
    load_buffer(scored, tmp_path / "scored")
    rm = AutoModelForSequenceClassification.from_pretrained(smollm2_reward_dir).eval()
    rm_tok = AutoTokenizer.from_pretrained(smollm2_reward_dir)
    want = [reward_alone(rm, rm_tok, layouts.read_history(scored[i : i + 1], "full")[0]) for i in range(len(scored))]
    got = [float(scored[i]["next", "reward"].reshape(())) for i in range(len(scored))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize("command", ["inspect", "export", "score"])
def test_cli_refuses_rollouts_that_lost_tokens(buffers, smollm2_reward_dir, tmp_path, command):
    root, _ = buffers
    args = {"inspect": ["inspect", str(root / "lost")],
            "export": ["export", str(root / "lost"), "--format", "sft_conversational", "--out", str(tmp_path / "o")],
            "score": ["score", "--reward-model", str(smollm2_reward_dir), str(root / "lost"), "--out", str(tmp_path / "s")]}
    _fail(run(*args[command]), "lost tokens to padding", "safe_policy_wrapper")
