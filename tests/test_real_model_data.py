"""The real-model tier for TorchRL -> TRL data: SmolLM2-135M-Instruct's rollouts, as TorchRL's
own ``TransformersWrapper`` writes them in every input mode, padded and ragged (its output, and
read back from a ``LazyStackStorage`` and a ``ListStorage``), read by the
layout readers and the dataset formats, against an independent reference (each prompt
generated alone, greedy, unpadded: ``tests/real_model.py``).

With a policy from :func:`torchrl_trl.safe_policy_wrapper` every field is right, whatever the
tokenizer's pad set-up. With TorchRL's wrapper on the shipped tokenizer (pad == eos), ragged rows
lost tokens for good and are refused; padded rows kept them and are read rebuilt.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from torchrl.data import LazyStackStorage, ListStorage, ReplayBuffer
from torchrl.data.llm import History
from torchrl.modules.llm import TransformersWrapper

from real_model import SAME_LENGTH_QUERIES, ended, greedy_reply, reply_text
from torchrl_trl import TorchRLBufferDataset, layouts, safe_policy_wrapper
from torchrl_trl.layouts import PaddingLostError
from torchrl_trl.testing import smollm2_tokenizer

pytestmark = pytest.mark.real_model

#: One reply of each kind under TorchRL's rendering: one cut at 8 tokens, one that ends before.
MAX_NEW = 8
MODES = ("history", "text", "tokens")


def _inputs(tok, mode: str):
    chats = History.from_chats([[{"role": "user", "content": q}] for q in SAME_LENGTH_QUERIES])
    if mode == "history":
        return TensorDict({"history": {"prompt": chats}}, batch_size=[len(SAME_LENGTH_QUERIES)])
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats.tolist()]
    if mode == "text":
        return TensorDict({"text": {"prompt": texts}}, batch_size=[len(texts)])
    ids = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return lazy_stack([TensorDict({"tokens": {"prompt": i}}) for i in ids])


def _prompt_ids(tok, mode: str) -> list[list[int]]:
    """What the policy was given, rendered by TorchRL (history) or by the tokenizer (text, tokens)."""
    chats = History.from_chats([[{"role": "user", "content": q}] for q in SAME_LENGTH_QUERIES])
    if mode == "history":
        rendered = chats.apply_chat_template(tokenizer=tok, add_generation_prompt=True, tokenize=False)
    else:
        rendered = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats.tolist()]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in rendered]


def _generate(model, tok, mode, pad_output, safe):
    kwargs = dict(input_mode=mode, generate=True, return_log_probs=True, pad_output=pad_output,
                  generate_kwargs={"max_new_tokens": MAX_NEW, "do_sample": False})
    policy = safe_policy_wrapper(model, tok, **kwargs) if safe else TransformersWrapper(model, tokenizer=tok, **kwargs)
    out = policy(_inputs(tok, mode))
    rb = ReplayBuffer(storage=LazyStackStorage(8))
    rb.extend(out)
    listed = ReplayBuffer(storage=ListStorage(8))
    listed.extend(out)
    # what readers meet: the wrapper's output, LazyStackStorage and ListStorage reads, in order
    return (out, rb[:], listed[:]), rb


@pytest.fixture(scope="module")
def reference(smollm2_model, smollm2_dir):
    """Per input mode: ``(prompt ids, reply ids)`` of each prompt generated alone."""
    tok = smollm2_tokenizer(smollm2_dir, "own")
    out = {}
    for mode in MODES:
        prompts = _prompt_ids(tok, "history" if mode == "history" else "text")
        out[mode] = [(p, greedy_reply(smollm2_model, tok, p, MAX_NEW)) for p in prompts]
    assert sorted(ended(r, smollm2_model, tok) for _, r in out["history"]) == [False, True], "one cut, one finished"
    return out


@pytest.fixture(scope="module")
def safe_rollouts(smollm2_model, smollm2_dir):
    """``{(mode, padded): (wrapper output, buffer)}`` from safe wrappers; the set-ups rotate
    over the cells (each set-up gives the same safe wrapper)."""
    setups = ["eos", "none", "own"]
    return {
        (mode, padded): _generate(smollm2_model, smollm2_tokenizer(smollm2_dir, setups[i % 3]), mode, padded, safe=True)
        for i, (mode, padded) in enumerate((m, p) for m in MODES for p in (False, True))
    }


@pytest.mark.parametrize("padded", [False, True], ids=["ragged", "padded"])
@pytest.mark.parametrize("mode", MODES)
def test_safe_wrapper_rows_equal_the_reference(safe_rollouts, reference, smollm2_model, smollm2_dir, mode, padded):
    tok = smollm2_tokenizer(smollm2_dir, "own")
    views, rb = safe_rollouts[mode, padded]
    want = reference[mode]
    for td in views:
        assert layouts.read_tokens(td, "prompt").tolist() == [p for p, _ in want]
        assert layouts.read_tokens(td, "response").tolist() == [r for _, r in want]
        assert layouts.read_tokens(td, "full").tolist() == [p + r for p, r in want]
        logprobs = layouts.read_tokens(td, "response", key=("log_probs", "response"))
        assert logprobs.lengths.tolist() == [len(r) for _, r in want]
        if mode == "tokens":
            continue  # TorchRL 0.14.1 stores no text in tokens mode
        assert layouts.read_text(td, "response", tokenizer=tok) == [tok.decode(r) for _, r in want]
        assert layouts.read_text(td, "full", tokenizer=tok) == [tok.decode(p + r) for p, r in want]
        if mode == "history":
            replies = [[{"role": "assistant", "content": reply_text(r, smollm2_model, tok)}] for _, r in want]
            assert layouts.read_history(td, "response", tokenizer=tok) == replies
    _check_sft_tokenized(rb, want)


def _check_sft_tokenized(rb, want) -> None:
    rows = list(TorchRLBufferDataset(rb, batch_size=2, format="sft_tokenized", reading="epoch"))
    assert [list(r["input_ids"]) for r in rows] == [p + r for p, r in want]
    assert [list(r["completion_mask"]) for r in rows] == [[0] * len(p) + [1] * len(r) for p, r in want]


def test_safe_wrapper_conversational_formats(safe_rollouts, reference, smollm2_model, smollm2_dir):
    tok = smollm2_tokenizer(smollm2_dir, "own")
    _, rb = safe_rollouts["history", False]
    replies = [reply_text(r, smollm2_model, tok) for _, r in reference["history"]]
    rows = list(TorchRLBufferDataset(rb, batch_size=2, format="sft_conversational", reading="epoch"))
    assert [r["completion"] for r in rows] == [[{"role": "assistant", "content": c}] for c in replies]
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": q}] for q in SAME_LENGTH_QUERIES]
    rows = list(TorchRLBufferDataset(rb, batch_size=2, format="sft", reading="epoch"))
    assert [r["completion"] for r in rows] == [tok.decode(r) for _, r in reference["history"]]


@pytest.fixture(scope="module")
def shipped_rollouts(smollm2_model, smollm2_dir):
    """TorchRL's own wrapper with the tokenizer as shipped (pad == eos)."""
    cells = [("history", False), ("history", True), ("text", True), ("tokens", True)]
    return {(mode, padded): _generate(smollm2_model, smollm2_tokenizer(smollm2_dir, "eos"), mode, padded, False)
            for mode, padded in cells}


def test_shipped_tokenizer_ragged_chats_are_refused(shipped_rollouts, smollm2_dir):
    """Ragged chats lost the prompt's end-of-turn tokens, the reply's EOS and its text: nothing
    reads them. (Ragged text/tokens rows whose only loss is the reply's EOS hold no trace of
    it: only check_policy_padding, where a policy is received, catches those.)"""
    views, rb = shipped_rollouts["history", False]
    tok = smollm2_tokenizer(smollm2_dir, "eos")
    for td in views:
        with pytest.raises(PaddingLostError, match="safe_policy_wrapper"):
            layouts.read_tokens(td, "response")
        with pytest.raises(PaddingLostError, match="pad == eos"):
            layouts.read_text(td, "response", tokenizer=tok)
        with pytest.raises(PaddingLostError):
            layouts.read_history(td, "response", tokenizer=tok)
    for fmt in ("sft_conversational", "sft", "sft_tokenized"):
        with pytest.raises(PaddingLostError):
            list(TorchRLBufferDataset(rb, batch_size=2, format=fmt, reading="epoch"))


def test_shipped_tokenizer_padded_tokens_mode_is_refused(shipped_rollouts):
    """Tokens mode fed generate the prompt with its EOS masked out: the replies are not the
    model's (they differ from the reference), and no reader takes them."""
    views, rb = shipped_rollouts["tokens", True]
    for td in views:
        with pytest.raises(PaddingLostError, match="input_mode='tokens'"):
            layouts.read_tokens(td, "response")


@pytest.mark.parametrize("mode", ["history", "text"])
def test_shipped_tokenizer_padded_rows_are_rebuilt_from_tokens(shipped_rollouts, reference, smollm2_model,
                                                               smollm2_dir, mode):
    """Padded rows kept every token (the mask lied): tokens read right; texts and chats are
    rebuilt from them with the tokenizer, and refused without it."""
    views, rb = shipped_rollouts[mode, True]
    tok = smollm2_tokenizer(smollm2_dir, "eos")
    want = reference[mode]
    for td in views:
        assert layouts.read_tokens(td, "prompt").tolist() == [p for p, _ in want]
        assert layouts.read_tokens(td, "response").tolist() == [r for _, r in want]
        assert layouts.read_tokens(td, "full").tolist() == [p + r for p, r in want]
        with pytest.raises(PaddingLostError, match="tokenizer="):
            layouts.read_text(td, "response")
        assert layouts.read_text(td, "response", tokenizer=tok) == [tok.decode(r) for _, r in want]
        if mode == "history":
            replies = [[{"role": "assistant", "content": reply_text(r, smollm2_model, tok)}] for _, r in want]
            assert layouts.read_history(td, "response", tokenizer=tok) == replies
    _check_sft_tokenized(rb, want)
