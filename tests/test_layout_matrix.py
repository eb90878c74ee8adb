"""The layout matrix: what TorchRL really produces x where it is stored x who reads it.

Producers are TorchRL's own ``TransformersWrapper`` (input modes text / history / tokens,
``pad_output`` True and False, ``num_samples``) and ``ChatEnv`` + ``LLMCollector`` (one and
two turns). Storages: the direct output, ``LazyStackStorage``, ``ListStorage`` and, where
TorchRL accepts the data, ``LazyTensorStorage``; read back with ``rb[:]`` and
``rb.sample()``. Consumers: the layout readers, the reward-model wrapper (with and without
tokenizers), ``RewardFunctionWrapper`` and the dataset formats.

Every cell is compared with an independent reference built here, sample by sample: the
real tokens are a sample's stored tokens where its own attention mask is 1, the clean
text is the policy tokenizer's decoding of those tokens, and a reward is the reward
model's score of that one sequence alone, unpadded.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from torchrl.data import LazyMemmapStorage, LazyStackStorage, LazyTensorStorage, ListStorage, ReplayBuffer
from torchrl.data.llm import History
from torchrl.modules.llm import TransformersWrapper

from torchrl_trl import HFRewardModelWrapper, RewardFunctionWrapper, RewardRenderer, layouts
from torchrl_trl.data import RowColumns, TorchRLBufferDataset
from torchrl_trl.testing import collect_rollouts, make_chat_env, make_policy, make_tokenizer

PROMPTS = ["hi", "what is two plus two?", "a b c", "hello world! how are you today?"]
MAX_NEW = 10


def _early_eos(model, eos_id: int, bonus: float = 4.0):
    """A copy of ``model`` whose EOS logit is raised, so some responses stop early and
    get right padding (a random tiny policy rarely samples EOS by itself)."""
    model = copy.deepcopy(model)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[eos_id] = bonus
    model.lm_head = head
    return model.eval()


# ---------------------------------------------------------------------------
# Producers (run once per module)
# ---------------------------------------------------------------------------


def _wrapper(model, tok, mode, pad, num_samples=None):
    return TransformersWrapper(
        model,
        tokenizer=tok,
        input_mode=mode,
        generate=True,
        pad_output=pad,
        return_log_probs=True,
        num_samples=num_samples,
        generate_kwargs={"max_new_tokens": MAX_NEW, "do_sample": True},
    )


def _inputs(tok, mode):
    if mode == "text":
        return TensorDict({"text": {"prompt": PROMPTS}}, batch_size=[len(PROMPTS)])
    chats = History.from_chats([[{"role": "user", "content": p}] for p in PROMPTS])
    if mode == "history":
        return TensorDict({"history": {"prompt": chats}}, batch_size=[len(PROMPTS)])
    # tokens mode: TorchRL's ragged prompt ids (the chat template applied)
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats.tolist()]
    ids = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return lazy_stack([TensorDict({"tokens": {"prompt": i}}) for i in ids])


@pytest.fixture(scope="module")
def policy(policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    return _early_eos(model, tok.eos_token_id), tok


@pytest.fixture(scope="module")
def eos_policy(tmp_path_factory):
    """A policy whose EOS (``</s>``) is not ChatML's end of turn: TorchRL's history parser
    then keeps what follows it (``"</s><pad>..."`` in padded mode) in the assistant turn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = make_tokenizer(eos_token="</s>")
    path = tmp_path_factory.mktemp("eos_policy")
    make_policy(tok, seed=3).save_pretrained(path)
    tok.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    return _early_eos(AutoModelForCausalLM.from_pretrained(path), tok.eos_token_id), tok


PRODUCERS = [
    *[(f"wrapper-{m}-pad{int(p)}", m, p, None) for m in ("text", "history", "tokens") for p in (False, True)],
    ("wrapper-history-pad0-n2", "history", False, 2),
    ("wrapper-history-pad1-n2", "history", True, 2),
    ("wrapper-text-pad1-n2", "text", True, 2),
    ("eos-history-pad1", "history", True, None),
    ("eos-history-pad0", "history", False, None),
    ("collector-1turn-pad0", "collector", False, 1),
    ("collector-1turn-pad1", "collector", True, 1),
    ("collector-2turn-pad0", "collector", False, 2),
    ("collector-2turn-pad1", "collector", True, 2),
]


@pytest.fixture(scope="module")
def produced(policy, eos_policy):
    """``{producer name: (rollouts TensorDict, policy tokenizer)}``, seeded."""
    out = {}
    warnings.simplefilter("ignore")
    for seed, (name, mode, pad, extra) in enumerate(PRODUCERS):
        torch.manual_seed(seed)
        model, tok = eos_policy if name.startswith("eos") else policy
        if mode == "collector":
            env = make_chat_env([{"query": p} for p in PROMPTS], batch_size=2, group_size=2, max_turns=extra)
            wrapper = _wrapper(model, tok, "history", pad)
            rb = collect_rollouts(wrapper, env, total_turns=8 * extra, seed=seed)
            out[name] = (rb[:], tok)
        else:
            out[name] = (_wrapper(model, tok, mode, pad, extra)(_inputs(tok, mode)), tok)
    return out


# ---------------------------------------------------------------------------
# Storages
# ---------------------------------------------------------------------------

STORAGES = [
    "direct", "lazystack[:]", "lazystack.sample", "list[:]", "list.sample", "lazytensor[:]", "lazymemmap[:]",
    "lazymemmap.sample",
]


def _samples(td: TensorDictBase) -> list[TensorDictBase]:
    """Every sample of ``td`` (batch flattened row-major), one TensorDict each."""
    if td.batch_dims == 0:
        return [td]
    return [s for row in td.unbind(0) for s in _samples(row)]


def _store(td: TensorDictBase, storage: str) -> TensorDictBase:
    if storage == "direct":
        return td
    kind, read = storage.split(".") if "." in storage else (storage[:-3], "[:]")
    items = _samples(td)
    make = {
        "lazystack": LazyStackStorage, "list": ListStorage, "lazytensor": LazyTensorStorage,
        "lazymemmap": LazyMemmapStorage,
    }[kind]
    rb = ReplayBuffer(storage=make(len(items) + 4), batch_size=len(items))
    try:
        if kind == "list":
            rb.extend(lazy_stack(items))
        else:
            rb.extend(td.reshape(-1) if not td.is_locked and td.batch_dims > 1 else td)
    except Exception as err:  # TorchRL itself refuses this data in this storage
        pytest.skip(f"TorchRL's {make.__name__} does not accept {storage}: {type(err).__name__}")
    if read == "[:]":
        return rb[:]
    torch.manual_seed(0)
    return rb.sample()


# ---------------------------------------------------------------------------
# The independent reference, one sample at a time
# ---------------------------------------------------------------------------


def _mask(sample):
    return sample.get(layouts.ATTENTION_MASK_KEY).bool()


def ref_tokens(sample, part: str) -> list[int]:
    """A sample's real token ids: the stored ids where its own mask is 1 (TorchRL pads
    the prompt on the left and the response on the right of the full sequence)."""
    mask = _mask(sample)
    full = sample.get(("tokens", "full"))
    assert full.shape == mask.shape
    if part == "full":
        return full[mask].tolist()
    response = sample.get(("tokens", "response"))
    n_resp = int(mask[-response.shape[-1] :].sum()) if response.shape[-1] <= mask.shape[-1] else None
    real_response = full[mask].tolist()[len(full[mask]) - n_resp :] if n_resp else []
    if part == "response":
        return real_response
    return full[mask].tolist()[: int(mask.sum()) - len(real_response)]


def ref_texts(samples, tok, part):
    return [tok.decode(ref_tokens(s, part), skip_special_tokens=False) for s in samples]


def _score_alone(model, ids):
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


CELLS = [(p[0], s) for p in PRODUCERS for s in STORAGES]


@pytest.fixture(scope="module")
def reward_models(checkpoints):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    same = AutoModelForSequenceClassification.from_pretrained(checkpoints.reward_model).eval()
    other = AutoModelForSequenceClassification.from_pretrained(checkpoints.reward_model_other_tokenizer).eval()
    other_tok = AutoTokenizer.from_pretrained(checkpoints.reward_model_other_tokenizer)
    return same, other, other_tok


_STORED: dict = {}  # (producer, storage) -> the stored rollouts, built once per session


def _cell(produced, producer, storage):
    """The stored rollouts of one cell and the policy tokenizer."""
    td, tok = produced[producer]
    key = (producer, storage)
    if key not in _STORED:
        _STORED[key] = _store(td, storage)
    return _STORED[key], tok


def _strings_lost(produced, producer, storage) -> bool:
    """Whether this cell's storage gives back other strings than TorchRL wrote: TorchRL
    0.14.1's ``LazyMemmapStorage`` keeps only the first string of a column (probed on this
    TorchRL by ``layouts.memmap_keeps_strings``), which matters when the produced responses are not all one string. Our
    readers must then refuse the text and chat, never return the first row's for all."""
    if not storage.startswith("lazymemmap") or layouts.memmap_keeps_strings():
        return False
    td, _ = produced[producer]
    for key in (("text", "response"), ("history", "response")):
        if layouts.has_key(td, key) and len({str(v) for v in layouts.read_column(td, key)}) > 1:
            return True
    return False


def _refused():
    return pytest.raises(ValueError, match="LazyMemmapStorage reads every stored string")  # either check


# ---------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("producer,storage", CELLS)
def test_tokens_and_text(produced, producer, storage):
    td, tok = _cell(produced, producer, storage)
    samples = _samples(td)
    n = len(samples)
    for part in ("full", "response", "prompt"):
        got = layouts.read_tokens(td, part).tolist()
        assert got == [ref_tokens(s, part) for s in samples], part
    pad = tok.pad_token
    if _strings_lost(produced, producer, storage):  # the tokens survive, the text is refused
        for read, key in ((layouts.read_text, ("text", "full")), (layouts.read_history, ("history", "full"))):
            if layouts.has_key(td, key):
                with _refused():
                    read(td, "full")
        return
    if layouts.has_key(td, ("text", "response")):
        for part in ("full", "response"):
            if part == "full" and not layouts.has_key(td, ("text", "prompt")):
                continue  # tokens input mode: TorchRL stores no prompt text
            texts = layouts.read_text(td, part)
            assert len(texts) == n
            assert texts == ref_texts(samples, tok, part), part
            assert not any(pad in t for t in texts), part
    if layouts.has_key(td, ("history", "full")):
        chats = layouts.read_history(td, "full")
        responses = layouts.read_history(td, "response")
        prompts = layouts.read_history(td, "prompt")
        assert len(chats) == len(responses) == len(prompts) == n
        for chat, prompt, response in zip(chats, prompts, responses):
            assert chat == prompt + response
            assert all(pad not in m["content"] for m in chat)
            assert all(set(m) == {"role", "content"} for m in chat)


@pytest.mark.parametrize("producer,storage", CELLS)
def test_reward_model_tokens(produced, reward_models, producer, storage):
    """Reward model sharing the policy's vocabulary, no tokenizer: the real tokens are
    scored as they are; each reward equals the sequence scored alone."""
    td, _ = _cell(produced, producer, storage)
    if producer.startswith("eos"):
        pytest.skip("the eos policy has its own vocabulary")
    rm = reward_models[0]
    out = HFRewardModelWrapper(rm, inference_mode=True)(td.copy())
    got = out.get("reward").reshape(-1).tolist()
    want = [_score_alone(rm, ref_tokens(s, "full")) for s in _samples(td)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("producer,storage", [c for c in CELLS if "history" in c[0] or "collector" in c[0]])
def test_reward_model_own_tokenizer(produced, reward_models, producer, storage):
    """Reward model with its own tokenizer and template: the chat is re-rendered; the
    reference renders the prompt chat plus the assistant turns TorchRL parses out of the
    clean (real-token) text, with the reward model's template, scored alone."""
    td, tok = _cell(produced, producer, storage)
    _, rm, rm_tok = reward_models
    if _strings_lost(produced, producer, storage):
        with _refused():
            HFRewardModelWrapper(rm, renderer=RewardRenderer(tokenizer=rm_tok), inference_mode=True)(td.copy())
        return
    out = HFRewardModelWrapper(rm, renderer=RewardRenderer(tokenizer=rm_tok), inference_mode=True)(td.copy())
    got = out.get("reward").reshape(-1)
    want = []
    for s in _samples(td):
        text = tok.decode(ref_tokens(s, "full"), skip_special_tokens=False)
        chat = History.from_text(text, chat_template_name="chatml_format").tolist()
        messages = [{"role": m["role"], "content": m["content"]} for m in chat]
        rendered = rm_tok.apply_chat_template(messages, tokenize=False)
        want.append(_score_alone(rm, rm_tok(rendered, add_special_tokens=False)["input_ids"]))
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("producer,storage", CELLS)
def test_reward_function_sees_real_completion_ids(produced, producer, storage):
    td, tok = _cell(produced, producer, storage)
    seen = {}

    def record(prompts, completions, completion_ids, **kwargs):
        seen["ids"], seen["completions"] = completion_ids, completions
        return [float(len(c)) for c in completion_ids]

    if not layouts.has_key(td, ("text", "response")):
        # tokens input mode: TorchRL 0.14.1 stores no text, so there are no completions
        with pytest.raises(KeyError, match="text', 'response'"):
            RewardFunctionWrapper([record])(td.copy())
        return
    if _strings_lost(produced, producer, storage):
        with _refused():
            RewardFunctionWrapper([record])(td.copy())
        return
    out = RewardFunctionWrapper([record])(td.copy())
    samples = _samples(td)
    assert seen["ids"] == [ref_tokens(s, "response") for s in samples]
    rewards = out.get(layouts.REWARD_KEY).reshape(-1).tolist()
    assert rewards == [float(len(ref_tokens(s, "response"))) for s in samples]
    flat = [c if isinstance(c, str) else " ".join(m["content"] for m in c) for c in seen["completions"]]
    assert not any(tok.pad_token in c for c in flat)


@pytest.mark.parametrize("producer,storage", [c for c in CELLS if c[1] != "direct" and c[1].endswith("[:]")])
@pytest.mark.parametrize("fmt", ["sft", "sft_tokenized", "sft_conversational", "sft_messages"])
def test_dataset_formats(produced, producer, storage, fmt):
    """Epoch mode over a buffer yields each stored sample once, as its real content."""
    td, tok = _cell(produced, producer, storage)
    samples = _samples(td)
    rb = ReplayBuffer(storage=ListStorage(len(samples)))
    rb.extend(lazy_stack(samples))
    needs_history = fmt in ("sft_conversational", "sft_messages")
    if needs_history and not layouts.has_key(td, ("history", "full")):
        pytest.skip("no chat in this layout")
    if fmt == "sft" and not layouts.has_key(td, ("text", "prompt")):
        pytest.skip("no prompt text in this layout")
    if fmt != "sft_tokenized" and _strings_lost(produced, producer, storage):
        with _refused():
            list(TorchRLBufferDataset(rb, batch_size=3, format=RowColumns(fmt, tokenizer=tok), reading="epoch"))
        return
    ds = TorchRLBufferDataset(rb, batch_size=3, format=RowColumns(fmt, tokenizer=tok), reading="epoch")
    rows = list(ds)
    assert len(rows) == len(samples) == len(ds)
    try:  # without the tokenizer: the same rows, or an error asking for it; never pads
        assert list(TorchRLBufferDataset(rb, batch_size=3, format=fmt, reading="epoch")) == rows
    except ValueError as err:
        assert "tokenizer" in str(err) and "pad_output=True" in str(err)
    if fmt == "sft_tokenized":
        assert [r["input_ids"] for r in rows] == [ref_tokens(s, "full") for s in samples]
        assert [sum(r["completion_mask"]) for r in rows] == [len(ref_tokens(s, "response")) for s in samples]
        # the Hugging Face rows give TRL's collator the very batch plain Python lists give it
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        hf_rows = list(ds.as_hf_dataset())
        assert sorted(r["input_ids"] for r in hf_rows) == sorted(ref_tokens(s, "full") for s in samples)
        collate = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)
        got, want = collate(hf_rows), collate([{k: list(v) for k, v in r.items()} for r in hf_rows])
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    elif fmt == "sft":
        assert [r["prompt"] + r["completion"] for r in rows] == ref_texts(samples, tok, "full")
    else:
        for r in rows:
            for m in r.get("messages", []) + r.get("completion", []):
                assert tok.pad_token not in m["content"]


@pytest.mark.parametrize("producer", ["wrapper-history-pad1", "eos-history-pad1", "collector-2turn-pad1"])
def test_matrix_sees_torchrl_padding_artifacts(produced, producer):
    """The padded history producers really carry what the readers must clean: pad strings
    in TorchRL's stored text, right-padded (early-EOS) responses, and, for an EOS that
    is not the chat's end of turn, pads inside the parsed assistant turn."""
    td, tok = produced[producer]
    raw = [str(t) for t in layouts.read_column(td, ("text", "full"))]
    assert any(tok.pad_token in t for t in raw)
    trailing = [not bool(_mask(s)[-1]) for s in _samples(td)]
    assert any(trailing)
    if producer.startswith("eos"):
        turns = [m["content"] for c in td.get(("history", "response")).tolist() for m in c]
        assert any(tok.pad_token in c for c in turns)


@pytest.mark.parametrize("storage", ["lazystack", "list"])
@pytest.mark.parametrize("producer", ["collector-1turn-pad0", "collector-1turn-pad1"])
def test_preference_builders(produced, reward_models, producer, storage):
    """Collector rollouts scored by a reward model, grouped into preference pairs, KTO rows
    and best-of-n: every row is a real rollout's clean content, the chosen side the better."""
    from torchrl_trl import best_of_n, kto_rows, preference_pairs

    td, tok = produced[producer]
    samples = _samples(td)
    make = {"lazystack": LazyStackStorage, "list": ListStorage}[storage]
    rb = ReplayBuffer(storage=make(len(samples)))
    rb.extend(lazy_stack(samples))
    scored = HFRewardModelWrapper.for_grpo(reward_models[0], inference_mode=True)(rb[:])
    rewards = scored.get(layouts.REWARD_KEY).reshape(-1).tolist()
    reward_of = {}  # text -> rewards (two token sequences can decode to one text)
    for text, reward in zip(ref_texts(samples, tok, "full"), rewards):
        reward_of.setdefault(text, []).append(reward)
    scored_rb = ReplayBuffer(storage=make(len(samples)))
    scored_rb.extend(scored)

    def read(buffer, fmt):  # the policy's tokenizer names the pad string for small batches
        return list(TorchRLBufferDataset(buffer, batch_size=2, format=RowColumns(fmt, tokenizer=tok), reading="epoch"))

    pairs = read(preference_pairs(scored_rb), "dpo")
    assert pairs
    for row in pairs:
        chosen, rejected = row["prompt"] + row["chosen"], row["prompt"] + row["rejected"]
        assert chosen in reward_of and rejected in reward_of  # real rollouts, no pad strings
        assert max(reward_of[chosen]) > min(reward_of[rejected])
    for fmt, builder in (("kto", kto_rows), ("sft", best_of_n)):
        rows = read(builder(scored_rb), fmt)
        assert rows and all(r["prompt"] + r["completion"] in reward_of for r in rows)


@pytest.mark.parametrize("producer", ["wrapper-history-pad1", "collector-1turn-pad1", "collector-2turn-pad1"])
def test_padded_text_one_sample_at_a_time(produced, producer):
    """A sample alone, with its pads only on the right: its text is clean with the policy's
    tokenizer (or within ``decoded_padding``); without either, it is clean when the pad
    string can be read off it (two or more pads) and an error otherwise, never pads."""
    td, tok = produced[producer]
    checked = 0
    for s in _samples(td):
        mask = _mask(s)
        if not (mask[0] and not mask[-1]):
            continue
        one, want = lazy_stack([s]), ref_texts([s], tok, "full")
        assert layouts.read_text(one, "full", tokenizer=tok) == want
        assert layouts.read_history(one, "full", tokenizer=tok)[0][-1]["content"].find(tok.pad_token) < 0
        with layouts.decoded_padding(tok):
            assert layouts.read_text(one, "full") == want
        try:
            assert layouts.read_text(one, "full") == want
        except ValueError as err:
            assert "tokenizer" in str(err) and int((~mask).sum()) == 1
        checked += 1
    assert checked


def test_clean_text_ending_in_a_repeat_is_left_alone():
    """Text mode decodes the unpadded response, so a reply ending in a repeated string
    ("!!") next to two pad columns is real text, not padding: nothing is stripped."""
    td = TensorDict(
        {
            "tokens": {"full": torch.tensor([[7, 8, 9, 9, 0, 0]]), "response": torch.tensor([[9, 9, 0, 0]])},
            "masks": {"all_attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])},
            "text": {"prompt": ["ab"], "response": ["!!"], "full": ["ab!!"]},
        },
        batch_size=[1],
    )
    assert layouts.read_text(td, "full") == ["ab!!"]
    assert layouts.read_text(td, "response") == ["!!"]


def test_dataset_refuses_text_from_a_storage_that_loses_strings(produced):
    """TorchRL 0.14.1's LazyMemmapStorage reads every string back as the first one: text
    formats are refused there with an error naming the storages that work; tokens read."""
    from torchrl_trl.layouts import memmap_keeps_strings

    td, _ = produced["wrapper-text-pad1"]
    rb = ReplayBuffer(storage=LazyMemmapStorage(16))
    rb.extend(td)
    rows = list(TorchRLBufferDataset(rb, batch_size=2, format="sft_tokenized", reading="epoch"))
    assert [r["input_ids"] for r in rows] == [ref_tokens(s, "full") for s in _samples(td)]
    if memmap_keeps_strings():
        assert len(list(TorchRLBufferDataset(rb, batch_size=2, format="sft", reading="epoch"))) == len(rows)
    else:
        with pytest.raises(ValueError, match="LazyMemmapStorage reads every stored string back"):
            TorchRLBufferDataset(rb, batch_size=2, format="sft", reading="epoch").as_hf_dataset()
