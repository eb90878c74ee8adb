"""HFRewardModelWrapper: the same rewards whatever the input layout, re-tokenisation,
micro-batching, truncation, post-processing transforms, device/dtype and bad input."""

import warnings

import pytest
import torch
from tensordict import NonTensorStack, TensorDict, lazy_stack
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from torchrl_trl.layouts import Ragged
from torchrl_trl.rewards import HFRewardModelWrapper, RewardBatching, RewardOutput, RewardRenderer, RunningRewardNorm

CONVS = [
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello world! how are you today?"}],
    [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "0 1 2 3 4 5 6 7 8 9 10 11 12"},
    ],
    [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps"}],
]


@pytest.fixture(scope="module")
def tok(checkpoints):
    return AutoTokenizer.from_pretrained(checkpoints.policy)


@pytest.fixture(scope="module")
def rm(checkpoints):
    return AutoModelForSequenceClassification.from_pretrained(checkpoints.reward_model).eval()


def _alone(model, ids):
    """Reference: one sequence, no padding, plain model call."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].float()


def _ids(tok, convs=CONVS):
    return [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in convs]


def _ragged_td(ids):
    return lazy_stack(
        [
            TensorDict(
                {
                    "tokens": {"full": torch.tensor(i, dtype=torch.long)},
                    "masks": {"all_attention_mask": torch.ones(len(i), dtype=torch.bool)},
                },
                [],
            )
            for i in ids
        ]
    )


def _left_padded_td(ids, pad):
    width = max(map(len, ids))
    tokens = torch.full((len(ids), width), pad)
    mask = torch.zeros(len(ids), width, dtype=torch.bool)
    for row, i in enumerate(ids):
        tokens[row, width - len(i) :] = torch.tensor(i)
        mask[row, width - len(i) :] = True
    return TensorDict({"tokens": {"full": tokens}, "masks": {"all_attention_mask": mask}}, [len(ids)])


def _text_td(texts):
    return TensorDict({"text": {"full": NonTensorStack(*texts)}}, [len(texts)])


def _history_td(convs):
    from torchrl.data.llm import History

    return TensorDict({"history": {"full": History.from_chats(convs)}}, [len(convs)])


def test_same_rewards_across_layouts(checkpoints, tok, rm):
    ids = _ids(tok)
    texts = [tok.apply_chat_template(c, tokenize=False) for c in CONVS]
    ref = torch.stack([_alone(rm, i) for i in ids])
    scorer = HFRewardModelWrapper(checkpoints.reward_model, renderer=RewardRenderer(policy_tokenizer=tok), inference_mode=True)

    got = {
        "ragged": scorer(_ragged_td(ids))["reward"],
        "left_padded": scorer(_left_padded_td(ids, tok.pad_token_id))["reward"],
        "text": scorer(_text_td(texts))["reward"],
        "history": scorer(_history_td(CONVS))["reward"],
        "score_texts": scorer.score_texts(texts),
        "score_messages": scorer.score_messages(CONVS),
    }
    assert scorer.renderer.resolve_mode(_ragged_td(ids)) == "tokens"
    assert scorer.renderer.resolve_mode(_history_td(CONVS)) == "history"
    for name, value in got.items():
        assert value.shape == (4,), name
        torch.testing.assert_close(value, ref, atol=1e-5, rtol=0, msg=name)
    # the rewards differ between conversations: agreement is not trivial
    assert ref.std() > 1e-4


def test_micro_batched_equals_unbatched_and_order_restored(checkpoints, tok, rm):
    ids = _ids(tok) * 3
    td = _ragged_td(ids)
    one = HFRewardModelWrapper(checkpoints.reward_model, batching=RewardBatching(max_tokens_per_batch=None), inference_mode=True)
    small = HFRewardModelWrapper(checkpoints.reward_model, batching=RewardBatching(max_tokens_per_batch=60), inference_mode=True)
    r_one = one(td.clone())["reward"]
    r_small = small(td.clone())["reward"]
    # both against the independent reference: the model on each sequence alone, unpadded
    ref = torch.stack([_alone(rm, i) for i in ids])
    torch.testing.assert_close(r_one, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(r_small, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(r_small, r_one, atol=1e-5, rtol=0)
    torch.testing.assert_close(r_small[:4], r_small[4:8], atol=1e-6, rtol=0)
    # several micro-batches ran, each within the budget (or a single over-long row)
    assert small.processed_tokens > 0 and small.padding_efficiency >= one.padding_efficiency
    from torchrl_trl.rewards.batching import plan_micro_batches

    lengths = torch.tensor([len(i) for i in ids])
    plan = plan_micro_batches(lengths, max_tokens_per_batch=60)
    assert len(plan) > 1
    assert sorted(torch.cat(plan).tolist()) == list(range(len(ids)))
    for idx in plan:
        assert len(idx) == 1 or len(idx) * int(lengths[idx].max()) <= 60


def test_leading_batch_shape_and_grpo_convention(checkpoints, tok, rm):
    ids = _ids(tok)
    td = _left_padded_td(ids, tok.pad_token_id).reshape(2, 2)
    ref = torch.stack([_alone(rm, i) for i in ids]).reshape(2, 2)
    flat = HFRewardModelWrapper(checkpoints.reward_model)(td.clone())
    assert flat["reward"].shape == (2, 2)
    grpo = HFRewardModelWrapper.for_grpo(checkpoints.reward_model)(td.clone())
    assert grpo["next", "reward"].shape == (2, 2, 1, 1)
    torch.testing.assert_close(grpo["next", "reward"].reshape(2, 2), ref, atol=1e-5, rtol=0)


def test_other_tokenizer_is_rerendered_with_its_template(checkpoints, tok):
    path = checkpoints.reward_model_other_tokenizer
    rm_tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    scorer = HFRewardModelWrapper(path, renderer=RewardRenderer(policy_tokenizer=tok), inference_mode=True)
    assert not scorer.renderer.tokens_direct

    # history: exactly the model on the text rendered with the RM's own template
    rendered = [rm_tok.apply_chat_template(c, tokenize=False) for c in CONVS]
    assert rendered[0].startswith("[user] ")
    ref = torch.stack([_alone(model, rm_tok(t, add_special_tokens=False)["input_ids"]) for t in rendered])
    td = _history_td(CONVS)
    # tokens are there too, but they are the policy's: auto prefers the chat
    td.update(_left_padded_td(_ids(tok), tok.pad_token_id))
    torch.testing.assert_close(scorer(td)["reward"], ref, atol=1e-6, rtol=0)

    # tokens only: decoded with the policy tokenizer, policy EOS swapped for the RM's,
    # re-tokenised with the RM's tokenizer
    ids = [i + [tok.eos_token_id] if i[-1] != tok.eos_token_id else i for i in _ids(tok)]
    only_tokens = _ragged_td(ids)
    assert scorer.renderer.resolve_mode(only_tokens) == "tokens->text"
    texts = tok.batch_decode(ids, skip_special_tokens=False)
    expected_texts = [t + rm_tok.eos_token if not t.rstrip().endswith(rm_tok.eos_token) else t for t in texts]
    ref_tokens = torch.stack([_alone(model, rm_tok(t)["input_ids"]) for t in expected_texts])
    torch.testing.assert_close(scorer(only_tokens)["reward"], ref_tokens, atol=1e-6, rtol=0)


def test_eos_rule_matches_reward_trainer(checkpoints, tok, rm):
    # RewardTrainer appends EOS to plain-text pairs that lack it
    scorer = HFRewardModelWrapper(checkpoints.reward_model, inference_mode=True)
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello"
    ref = _alone(rm, tok(text + tok.eos_token)["input_ids"])
    torch.testing.assert_close(scorer.score_texts([text])[0], ref, atol=1e-6, rtol=0)
    # a truncated response's tokens get the same EOS
    ids = tok(text)["input_ids"]
    torch.testing.assert_close(scorer(_ragged_td([ids]))["reward"][0], ref, atol=1e-5, rtol=0)
    never = HFRewardModelWrapper(checkpoints.reward_model, inference_mode=True, renderer=RewardRenderer(add_eos="never"))
    torch.testing.assert_close(never(_ragged_td([ids]))["reward"][0], _alone(rm, ids), atol=1e-5, rtol=0)


def test_upstream_defaults_and_gradients(checkpoints, tok, rm):
    from torchrl.modules.llm.trl_interop import HFRewardModelWrapper as Upstream

    td = _left_padded_td(_ids(tok), tok.pad_token_id)
    up = Upstream(rm)(td.clone())["reward"]
    ours = HFRewardModelWrapper(rm)(td.clone())["reward"]
    assert ours.shape == up.shape == (4,)
    torch.testing.assert_close(ours, up.detach(), atol=1e-4, rtol=0)
    assert ours.requires_grad  # inference_mode=False keeps gradients, as upstream
    ours.sum().backward()
    assert rm.score.weight.grad is not None
    rm.zero_grad(set_to_none=True)
    assert not HFRewardModelWrapper(rm, inference_mode=True)(td.clone())["reward"].requires_grad


def test_truncation_is_counted(checkpoints, tok, rm):
    ids = _ids(tok)
    td = _ragged_td(ids)
    keep_end = HFRewardModelWrapper(rm, batching=RewardBatching(max_length=10), inference_mode=True)
    with pytest.warns(RuntimeWarning, match="truncated"):
        r = keep_end(td.clone())["reward"]
    n_long = sum(len(i) > 10 for i in ids)
    assert keep_end.truncated_count == n_long > 0
    torch.testing.assert_close(r, torch.stack([_alone(rm, i[-10:]) for i in ids]), atol=1e-5, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        keep_end(td.clone())
    assert keep_end.truncated_count == 2 * n_long
    keep_start = HFRewardModelWrapper(rm, batching=RewardBatching(max_length=10, truncation="keep_start"), inference_mode=True)
    with pytest.warns(RuntimeWarning):
        r = keep_start(td.clone())["reward"]
    torch.testing.assert_close(r, torch.stack([_alone(rm, i[:10]) for i in ids]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_length=10"):
        HFRewardModelWrapper(rm, batching=RewardBatching(max_length=10, truncation="error"))(td.clone())
    # default max_length: the model's position limit
    assert HFRewardModelWrapper(rm).max_length == rm.config.max_position_embeddings


def test_postprocessing_transforms(checkpoints, tok, rm):
    """Scale/shift/clip are TorchRL's transforms composed after the scorer; running
    normalisation is RunningRewardNorm; each against values computed by hand."""
    from tensordict.nn import TensorDictSequential
    from torchrl.envs import RewardClipping, RewardScaling

    ids = _ids(tok)
    td = _ragged_td(ids)
    raw = torch.stack([_alone(rm, i) for i in ids])
    scorer = HFRewardModelWrapper(rm, inference_mode=True)
    s = TensorDictSequential(scorer, RewardScaling(loc=1.0, scale=2.0))(td.clone())["reward"]
    torch.testing.assert_close(s, 2 * raw + 1, atol=1e-5, rtol=0)
    mid = float(raw.median())
    # TorchRL 0.14.1's RewardClipping needs both bounds (None fails in torch.as_tensor)
    c = RewardClipping(clamp_min=float("-inf"), clamp_max=mid)(scorer(td.clone()))["reward"]
    torch.testing.assert_close(c, raw.clamp(max=mid), atol=1e-5, rtol=0)
    norm = RunningRewardNorm()
    n1 = norm(scorer(td.clone()))["reward"]
    torch.testing.assert_close(n1, (raw - raw.mean()) / raw.std(), atol=1e-4, rtol=0)
    n2 = norm(scorer(_ragged_td(ids[:2])))["reward"]
    seen = torch.cat([raw, raw[:2]])
    torch.testing.assert_close(n2, (raw[:2] - seen.mean()) / seen.std(), atol=1e-4, rtol=0)
    assert int(norm.count) == 6
    # the statistics save with the state dict and are restored
    restored = RunningRewardNorm()
    restored.load_state_dict(norm.state_dict())
    torch.testing.assert_close(restored.std, norm.std)
    # frozen statistics (eval) do not move
    restored.update_stats = False
    restored(scorer(td.clone()))
    assert int(restored.count) == 6


def test_multi_label_head(checkpoints, tok):
    from torchrl_trl.testing import make_reward_model

    model = make_reward_model(tok, num_labels=3)
    td = _ragged_td(_ids(tok))
    with pytest.raises(ValueError, match="num_labels=3.*head_index"):
        HFRewardModelWrapper(model)(td.clone())
    r = HFRewardModelWrapper(model, output=RewardOutput(head_index=2), inference_mode=True)(td.clone())["reward"]
    with torch.no_grad():
        ref = torch.stack([model(input_ids=torch.tensor([i])).logits[0, 2] for i in _ids(tok)])
    torch.testing.assert_close(r, ref, atol=1e-5, rtol=0)


def test_bad_input_errors(checkpoints, tok, rm):
    from torchrl_trl.testing import make_reward_model, make_tokenizer

    td = TensorDict({"query": NonTensorStack("a", "b"), "foo": torch.zeros(2)}, [2])
    with pytest.raises(KeyError, match=r"found no reward-model input.*history.*text.*tokens.*Available keys.*foo"):
        HFRewardModelWrapper(checkpoints.reward_model)(td)
    with pytest.raises(KeyError, match="Available keys"):
        HFRewardModelWrapper(rm, renderer=RewardRenderer(input_mode="tokens"))(td)
    with pytest.raises(ValueError, match="tokenizer"):
        HFRewardModelWrapper(rm, renderer=RewardRenderer(input_mode="text"))
    with pytest.raises(ValueError, match=r"\['add_generation_prompt'\] cannot be set"):
        RewardRenderer(chat_template_kwargs={"add_generation_prompt": True, "enable_thinking": False})
    # a tokenizer whose vocabulary does not fit the model
    big = make_tokenizer(vocab_size=200)
    with pytest.raises(ValueError, match="200 tokens.*160 rows"):
        HFRewardModelWrapper(rm, renderer=RewardRenderer(tokenizer=big))
    with pytest.raises(ValueError, match=r"token id 500 in sample 0 is outside the model's embedding.*policy_tokenizer"):
        HFRewardModelWrapper(rm)(_ragged_td([[1, 2, 500]]))
    # no pad token
    nopad = make_reward_model(tok, pad_token_id=None)
    two = _ragged_td(_ids(tok)[:2])
    with pytest.raises(ValueError, match="no pad token"):
        HFRewardModelWrapper(nopad, batching=RewardBatching(min_fill=None))(two.clone())
    one_by_one = HFRewardModelWrapper(nopad, batching=RewardBatching(max_batch_size=1), inference_mode=True)(two.clone())["reward"]
    batching = RewardBatching(min_fill=None, pad_token_id=tok.pad_token_id)  # gives the model a pad id
    scorer = HFRewardModelWrapper(nopad, batching=batching, inference_mode=True)
    assert scorer.pad_token_id == nopad.config.pad_token_id == tok.pad_token_id
    padded = scorer(two.clone())
    ref = torch.stack([_alone(nopad, i) for i in _ids(tok)[:2]])  # each alone, unpadded
    torch.testing.assert_close(one_by_one, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded["reward"], ref, atol=1e-5, rtol=0)
    assert scorer.processed_tokens > scorer.real_tokens  # one padded forward, not one by one


class _NaNModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(160, 1)
        self.config = None

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, attention_mask=None):
        out = self.emb(input_ids)[:, 0]
        out[0] = float("nan")
        return out


def test_nonfinite_rewards(tok):
    td = _ragged_td(_ids(tok))
    with pytest.raises(FloatingPointError, match=r"expected finite rewards, the model returned \d NaN/inf of 4"):
        HFRewardModelWrapper(_NaNModel(), batching=RewardBatching(pad_token_id=0))(td.clone())
    w = HFRewardModelWrapper(_NaNModel(), output=RewardOutput(on_nonfinite=0.0), batching=RewardBatching(max_batch_size=1))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        r = w(td.clone())["reward"]
    assert w.nonfinite_count == 4 and torch.equal(r, torch.zeros(4))
    kept = HFRewardModelWrapper(_NaNModel(), output=RewardOutput(on_nonfinite="warn"), batching=RewardBatching(max_batch_size=1))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        r = kept(td.clone())["reward"]
    assert kept.nonfinite_count == 4 and bool(r.isnan().all())


def test_bfloat16_model_float_tensordict(checkpoints, tok):
    ids = _ids(tok)
    scorer = HFRewardModelWrapper.for_grpo(checkpoints.reward_model, dtype=torch.bfloat16)
    assert next(scorer.model.parameters()).dtype == torch.bfloat16
    td = _ragged_td(ids)
    out = scorer(td)
    assert out["next", "reward"].dtype == torch.float32
    bf16 = AutoModelForSequenceClassification.from_pretrained(checkpoints.reward_model, dtype=torch.bfloat16)
    ref = torch.stack([_alone(bf16, i) for i in ids])
    # bfloat16 arithmetic: batched and alone agree to bf16 precision
    torch.testing.assert_close(out["next", "reward"].reshape(-1), ref, atol=2e-4, rtol=0)
    # an existing float64 reward sets the output dtype
    td64 = _ragged_td(ids)
    td64.set(("next", "reward"), torch.zeros(4, 1, 1, dtype=torch.float64))
    assert scorer(td64)["next", "reward"].dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_model_cpu_tensordict(checkpoints, tok, rm):
    ids = _ids(tok)
    scorer = HFRewardModelWrapper.from_pretrained(checkpoints.reward_model, device="cuda", inference_mode=True)
    out = scorer(_ragged_td(ids))["reward"]
    assert out.device.type == "cpu"
    ref = torch.stack([_alone(rm, i) for i in ids])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


# -- bad input: a clear error naming the argument / key / shape ------------------------


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"max_batch_size": 0, "min_fill": None}, ValueError, "max_batch_size must be a positive integer or None, got 0"),
        ({"max_batch_size": -2, "min_fill": None}, ValueError, "max_batch_size must be a positive integer or None, got -2"),
        ({"max_tokens_per_batch": 0}, ValueError, "max_tokens_per_batch"),
        ({"max_tokens_per_batch": 1.5}, ValueError, "max_tokens_per_batch"),
        ({"pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of"),
        ({"min_fill": 0.0}, ValueError, "min_fill"),
        ({"min_fill": 1.5}, ValueError, "min_fill"),
        ({"max_length": 0}, ValueError, "max_length"),
        ({"truncation": "middle"}, ValueError, "truncation"),
        ({"packing": 1}, TypeError, "packing"),
        ({"pad_token_id": -1}, ValueError, "pad_token_id must be an integer >= 0, got -1"),
    ],
)
def test_batching_arguments_checked_at_construction(kwargs, error, words):
    with pytest.raises(error, match=words):
        RewardBatching(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"head_index": 0.5}, TypeError, "RewardOutput: head_index must be an int or None, got 0.5"),
        ({"on_nonfinite": float("inf")}, ValueError, "RewardOutput: on_nonfinite"),
        ({"on_nonfinite": "ignore"}, ValueError, "RewardOutput: on_nonfinite"),
        ({"shape": "column"}, ValueError, "reward_shape"),
    ],
)
def test_output_arguments_checked_at_construction(kwargs, error, words):
    with pytest.raises(error, match=words):
        RewardOutput(**kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"renderer": {"part": "response"}}, "HFRewardModelWrapper: renderer must be a RewardRenderer or None, got dict"),
        ({"batching": 128}, "HFRewardModelWrapper: batching must be a RewardBatching or None, got int"),
        ({"output": "step"}, "HFRewardModelWrapper: output must be a RewardOutput or None, got str"),
    ],
)
def test_config_arguments_checked_at_construction(rm, kwargs, words):
    with pytest.raises(TypeError, match=words):
        HFRewardModelWrapper(rm, **kwargs)


def test_micro_batch_planner_refuses_zero_rows():
    from torchrl_trl.rewards.batching import plan_micro_batches

    # max_batch_size=0 used to loop forever (no row ever taken)
    with pytest.raises(ValueError, match="max_batch_size"):
        plan_micro_batches(torch.tensor([3, 2]), max_tokens_per_batch=None, max_batch_size=0, min_fill=None)


def test_float_token_ids_raise(rm):
    td = TensorDict(
        {"tokens": {"full": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, "masks": {"all_attention_mask": torch.ones(2, 2)}},
        [2],
    )
    with pytest.raises(TypeError, match=r"tokens at \('tokens', 'full'\).*integers.*float32"):
        HFRewardModelWrapper(rm)(td)


def test_negative_token_id_is_named(rm):
    td = _ragged_td([[5, 6, 7], [8, -3, 9]])
    with pytest.raises(ValueError, match=r"tokens at \('tokens', 'full'\).*negative token id -3 in sample 1"):
        HFRewardModelWrapper(rm)(td)


def test_zero_length_sequence_raises(rm):
    td = _ragged_td([[5, 6, 7], []])
    with pytest.raises(ValueError, match=r"tokens at \('tokens', 'full'\).*sample\(s\) \[1\].*no tokens"):
        HFRewardModelWrapper(rm)(td)
    with pytest.raises(ValueError, match=r"sample\(s\) \[0\].*no tokens"):
        HFRewardModelWrapper(rm).score_ids(Ragged.from_list([[], [1, 2]]))


def test_all_zero_mask_row_raises(rm, tok):
    td = _left_padded_td(_ids(tok)[:3], tok.pad_token_id)
    td["masks", "all_attention_mask"][2] = False  # tokens stored, none of them real
    with pytest.raises(ValueError, match=r"attention mask \('masks', 'all_attention_mask'\).*sample\(s\) \[2\]"):
        HFRewardModelWrapper(rm)(td)


@pytest.mark.parametrize("content", [None, 5, 2.5])
def test_non_string_chat_content_raises(checkpoints, content):
    scorer = HFRewardModelWrapper(checkpoints.reward_model)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    with pytest.raises(TypeError, match=r"conversation 1: .*message 1 .*content " + type(content).__name__):
        scorer.score_messages([CONVS[0], chat])


def test_accumulate_onto_another_shape_raises(rm, tok):
    td = _ragged_td(_ids(tok))
    td.set("reward", torch.zeros(4, 1))
    scorer = HFRewardModelWrapper(rm, inference_mode=True)
    with pytest.raises(ValueError, match=r"accumulate=True.*'reward'.*\(4, 1\).*\(4,\)"):
        scorer.write(td, scorer.score(td), accumulate=True)
    # same shape: added
    first = HFRewardModelWrapper(rm, inference_mode=True)(_ragged_td(_ids(tok)))["reward"]
    td = _ragged_td(_ids(tok))
    td.set("reward", torch.ones(4))
    out = scorer.write(td, scorer.score(td), accumulate=True)["reward"]
    torch.testing.assert_close(out, first + 1)


def test_from_pretrained_places_and_casts(checkpoints, rm, tok):
    scorer = HFRewardModelWrapper.from_pretrained(
        checkpoints.reward_model, device="cpu", dtype=torch.bfloat16, inference_mode=True
    )
    assert next(scorer.model.parameters()).dtype == torch.bfloat16
    assert scorer.tokenizer is not None and not scorer.model.training
    with pytest.raises(TypeError, match="HFRewardModelWrapper.from_pretrained: expected a local directory"):
        HFRewardModelWrapper.from_pretrained(rm)
    # wrapper arguments pass through; the renderer's tokenizer is used instead of the saved one
    scorer = HFRewardModelWrapper.from_pretrained(checkpoints.reward_model, renderer=RewardRenderer(tokenizer=tok),
                                                  output=RewardOutput(shape="step"))
    assert scorer.tokenizer is tok and scorer.reward_shape == "step"


# -- part and declared keys -------------------------------------------------------------


def test_part_response_scores_the_response_tokens(checkpoints, policy_and_tokenizer, rm):
    """TorchRL's own padded output; the reward of the response alone (trailing pads
    stripped, EOS appended as RewardTrainer does)."""
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    from torchrl_trl.testing import make_policy_wrapper

    model, ptok = policy_and_tokenizer
    torch.manual_seed(0)
    prompts = History.from_chats([c[:-1] for c in CONVS[:2]])
    out = make_policy_wrapper(model, ptok, pad_output=True, max_new_tokens=6)(
        TensorDict({"history": ChatHistory(prompt=prompts, batch_size=[2])}, [2])
    )
    scorer = HFRewardModelWrapper(checkpoints.reward_model, renderer=RewardRenderer(policy_tokenizer=ptok, part="response"), inference_mode=True)
    assert scorer.in_keys == [("tokens", "response"), ("masks", "all_attention_mask")]
    got = scorer(out)["reward"]
    refs = []
    for row in out["tokens", "response"].tolist():
        while row and row[-1] == ptok.pad_token_id:
            row.pop()
        refs.append(_alone(rm, row if row[-1] == ptok.eos_token_id else row + [ptok.eos_token_id]))
    torch.testing.assert_close(got, torch.stack(refs), atol=1e-5, rtol=0)
    full = HFRewardModelWrapper(checkpoints.reward_model, renderer=RewardRenderer(policy_tokenizer=ptok), inference_mode=True)(out)["reward"]
    assert (full - got).abs().max() > 1e-4
    with pytest.raises(ValueError, match="part='response' with token_key=\\('tokens', 'full'\\)"):
        HFRewardModelWrapper(rm, renderer=RewardRenderer(part="response"), token_key=("tokens", "full"))


def test_in_keys_are_the_keys_read(checkpoints, tok, rm):
    other = checkpoints.reward_model_other_tokenizer
    history = HFRewardModelWrapper(other, renderer=RewardRenderer(policy_tokenizer=tok), inference_mode=True)
    assert history.in_keys == [("history", "full")]
    text = HFRewardModelWrapper(other, renderer=RewardRenderer(policy_tokenizer=tok, input_mode="text"))
    assert text.in_keys == [("text", "full")]
    # the same tokenizer: a chat is still re-rendered with the reward model's own template
    # (TorchRL renders with a template of its own); stored tokens go in as they are only
    # without a chat, or when asked for
    same_chat = HFRewardModelWrapper(checkpoints.reward_model, renderer=RewardRenderer(policy_tokenizer=tok))
    assert same_chat.in_keys == [("history", "full")]
    assert same_chat.renderer.resolve_mode(_ragged_td(_ids(tok))) == "tokens"
    same = HFRewardModelWrapper(checkpoints.reward_model, renderer=RewardRenderer(policy_tokenizer=tok, input_mode="tokens"))
    assert same.in_keys == [("tokens", "full"), ("masks", "all_attention_mask")]
    # a tensordict holding only the declared keys is enough (select relies on it)
    td = _history_td(CONVS)
    td.update(_left_padded_td(_ids(tok), tok.pad_token_id))
    torch.testing.assert_close(
        history(td.select(*history.in_keys))["reward"], history(td.clone())["reward"], atol=0, rtol=0
    )
    torch.testing.assert_close(
        same(td.select(*same.in_keys))["reward"], same(td.clone())["reward"], atol=0, rtol=0
    )
    # and what they read gives the reward of each conversation alone, unpadded (the other
    # model on its own template's rendering; the same-tokenizer model on the policy's ids)
    other_tok = AutoTokenizer.from_pretrained(other)
    other_model = AutoModelForSequenceClassification.from_pretrained(other).eval()
    rendered = [other_tok.apply_chat_template(c, tokenize=False) for c in CONVS]
    ref_history = torch.stack([_alone(other_model, other_tok(t, add_special_tokens=False)["input_ids"]) for t in rendered])
    torch.testing.assert_close(history(td.select(*history.in_keys))["reward"], ref_history, atol=1e-5, rtol=0)
    ref_tokens = torch.stack([_alone(rm, i) for i in _ids(tok)])
    torch.testing.assert_close(same(td.select(*same.in_keys))["reward"], ref_tokens, atol=1e-5, rtol=0)
    rendered = [tok.apply_chat_template(c, tokenize=False) for c in CONVS]
    ref_chat = torch.stack([_alone(rm, tok(t, add_special_tokens=False)["input_ids"]) for t in rendered])
    torch.testing.assert_close(same_chat(td.select(*same_chat.in_keys))["reward"], ref_chat, atol=1e-5, rtol=0)


@pytest.mark.parametrize("is_causal", [True, False])
def test_padding_mask_only_where_attention_can_see_it(tok, is_causal):
    """Right-padded micro-batches: a causal decoder is called without the mask (its real
    tokens never see later padding); a bidirectional one (``config.is_causal=False``)
    gets it. Both equal each sequence alone."""
    from torchrl_trl.testing import make_reward_model

    rm = make_reward_model(tok, kind="llama", seed=3)
    rm.config.is_causal = is_causal
    calls = []
    rm.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs.get("attention_mask")), with_kwargs=True)
    ids = _ids(tok)
    ref = torch.stack([_alone(rm, i) for i in ids])
    calls.clear()
    got = HFRewardModelWrapper(rm, inference_mode=True, batching=RewardBatching(min_fill=None))(_ragged_td(ids))["reward"]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert len(calls) == 1 and (calls[0] is None) == is_causal
