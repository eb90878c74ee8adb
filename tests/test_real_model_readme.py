"""The README's quickstarts on a real pretrained chat model (SmolLM2-135M-Instruct, its tokenizer
as shipped: pad == eos), run as written with only the checkpoint directories changed."""

from __future__ import annotations

import tempfile

import pytest
import torch

from test_readme import ROOT, _end_like_a_script, python_blocks
from torchrl_trl.layouts import PaddingLostError

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

TINY_POLICY = "model_dir = tiny_checkpoints(tempfile.mkdtemp()).policy"


def _quickstart(index: int) -> tuple[int, str]:
    return python_blocks(ROOT / "README.md")[index]


def _run(code: str, line: int, tmp_path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace: dict = {"__name__": "__docs_test__"}
    exec(compile("\n" * (line - 1) + code, "README.md", "exec"), namespace)
    return namespace


def test_quickstart_1_trains_on_the_real_replies(smollm2_dir, tmp_path, monkeypatch):
    """Every SFT row the trainer reads is the reply the policy generated: the stored response
    tokens decoded alone, the closing EOS left out where the reply ended."""
    line, code = _quickstart(0)
    assert TINY_POLICY in code
    code = code.replace(TINY_POLICY, f"model_dir = {str(smollm2_dir)!r}")
    ns = _run(code, line, tmp_path, monkeypatch)
    try:
        tok, rb, trainer = ns["tokenizer"], ns["replay_buffer"], ns["trainer"]
        assert trainer.state.global_step >= 1
        assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
        rows = list(ns["dataset"].as_hf_dataset(map_style=True))
        want = []
        for i in range(len(rb)):
            ids = rb[i].get(("tokens", "response")).tolist()
            closed = ids[-1] == tok.eos_token_id
            want.append(tok.decode(ids[:-1] if closed else ids))
        # TorchRL's History parser strips a turn's surrounding whitespace: a reply cut by
        # max_new_tokens after a space token reads without it (TorchRL's, not ours to undo)
        assert sorted(r["completion"][0]["content"] for r in rows) == sorted(w.strip() for w in want)
        assert sum(bool(w) for w in want) == len(want), "every reply has content"
    finally:
        _end_like_a_script(ns)


def test_quickstart_1_with_torchrls_plain_wrapper_is_refused_before_training(smollm2_dir, tmp_path, monkeypatch):
    """The same quickstart with TorchRL's wrapper on the shipped tokenizer (pad == eos): the
    rollouts lost their end-of-turn tokens, and the trainer is refused them before it trains."""
    line, code = _quickstart(0)
    code = code.replace(TINY_POLICY, f"model_dir = {str(smollm2_dir)!r}")
    plain = code.replace("policy = safe_policy_wrapper(\n    model, tokenizer,",
                         "from torchrl.modules.llm import TransformersWrapper\n"
                         "policy = TransformersWrapper(\n    model, tokenizer=tokenizer,")
    assert plain != code
    plain = plain.replace("trainer.train()", "raise AssertionError('trained on damaged rollouts')")
    with pytest.raises(PaddingLostError, match="safe_policy_wrapper"):
        _run(plain, line, tmp_path, monkeypatch)


TINY_PAIR = "model_dir, reward_model_dir = ckpts.policy, ckpts.reward_model_other_tokenizer"


def test_quickstart_2_scores_and_trains_on_the_real_replies(smollm2_dir, smollm2_reward_dir, tmp_path, monkeypatch):
    """Each reward equals the reward model's score of that chat alone, rendered with its own
    template; GRPOLoss is computed over the assistant tokens; the learner pass keeps the stored
    tokens and log-probs."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from real_model import reward_alone
    from torchrl_trl import layouts

    line, code = _quickstart(1)
    assert TINY_PAIR in code
    code = code.replace(TINY_PAIR, f"model_dir, reward_model_dir = {str(smollm2_dir)!r}, {str(smollm2_reward_dir)!r}")
    ns = _run(code, line, tmp_path, monkeypatch)
    try:
        rollouts = ns["rollouts"]
        rm = AutoModelForSequenceClassification.from_pretrained(smollm2_reward_dir).eval()
        rm_tok = AutoTokenizer.from_pretrained(smollm2_reward_dir)
        chats = layouts.read_history(rollouts, "full")
        assert all(c[-1]["role"] == "assistant" and c[-1]["content"] for c in chats)
        want = torch.tensor([reward_alone(rm, rm_tok, c) for c in chats])
        torch.testing.assert_close(rollouts["next", "reward"].reshape(-1), want, atol=1e-4, rtol=0)
        assert ns["loss"].detach().item() != 0.0
        for key in (("tokens", "prompt"), ("tokens", "response"), ("log_probs", "response")):
            assert layouts.has_key(ns["replay_buffer"][:], key), key
    finally:
        _end_like_a_script(ns)
