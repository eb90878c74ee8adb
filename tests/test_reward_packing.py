"""Packed reward-model scoring (``HFRewardModelWrapper(batching=RewardBatching(packing=True))``): every sequence's
reward equals the same sequence scored alone, unpadded, by the plain model call."""

import pytest
import torch
from tensordict import TensorDict
from torchrl.modules.llm import TransformersWrapper

from torchrl_trl.layouts import Ragged
from torchrl_trl.rewards import HFRewardModelWrapper, RewardBatching, RewardRenderer
from torchrl_trl.rewards.packing import iter_packs, plan_packs, score_pack
from torchrl_trl.testing import make_reward_model

PROMPTS = ["hi", "what is two plus two?", "count to ten please, slowly", "a", "tell me a long story about cats"]


@pytest.fixture(scope="module")
def rollouts(policy_and_tokenizer):
    """TorchRL's own default output: TransformersWrapper(pad_output=False), ragged tokens."""
    model, tok = policy_and_tokenizer
    policy = TransformersWrapper(
        model,
        tokenizer=tok,
        input_mode="text",
        generate=True,
        pad_output=False,
        generate_kwargs={"max_new_tokens": 12, "do_sample": True},
    )
    torch.manual_seed(0)
    return policy(TensorDict({"text": {"prompt": PROMPTS}}, batch_size=[len(PROMPTS)]))


def _alone(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0, 0].float()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_each_sequence_alone(rollouts, policy_and_tokenizer, kind, attn):
    _, tok = policy_and_tokenizer
    rm = make_reward_model(tok, kind=kind, seed=1)
    rm.set_attn_implementation(attn)
    td = rollouts.clone()
    seqs = [td[i]["tokens", "full"] for i in range(len(PROMPTS))]
    assert len({len(s) for s in seqs}) > 2  # ragged: packs hold sequences of several lengths
    ref = torch.stack([_alone(rm, s) for s in seqs])

    budget = 2 * max(map(len, seqs))  # several packs, most holding several sequences
    scorer = HFRewardModelWrapper(
        rm, batching=RewardBatching(packing=True, max_tokens_per_batch=budget),
        renderer=RewardRenderer(add_eos="never"), inference_mode=True,
    )
    got = scorer(td)["reward"]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert ref.std() > 1e-4  # the sequences get different rewards: order is checked
    assert scorer.padding_efficiency == 1.0 and scorer.real_tokens == sum(map(len, seqs))
    packs = plan_packs(torch.tensor([len(s) for s in seqs]), max_tokens_per_batch=budget)
    assert 1 < len(packs) < len(seqs)

    # the default EOS rule too (a model object without its tokenizer: tokens kept as they
    # are): packed and padded micro-batches both give each sequence's reward alone
    padded = HFRewardModelWrapper(rm, inference_mode=True)(rollouts.clone())["reward"]
    packed = HFRewardModelWrapper(rm, batching=RewardBatching(packing=True), inference_mode=True)(rollouts.clone())["reward"]
    torch.testing.assert_close(padded, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed, ref, atol=1e-5, rtol=0)


def test_restarting_positions_are_what_keeps_sequences_apart(policy_and_tokenizer):
    """Sanity check of the test above: the same pack with positions running on (one long
    sequence to the model) changes the later sequences' scores."""
    _, tok = policy_and_tokenizer
    rm = make_reward_model(tok, kind="llama", seed=1)
    g = torch.Generator().manual_seed(0)
    ids = Ragged.from_list([torch.randint(5, len(tok), (n,), generator=g) for n in (9, 4, 6)])
    (pack,) = iter_packs(ids, pad_token_id=rm.config.pad_token_id, max_tokens_per_batch=None)
    with torch.no_grad():
        good = score_pack(rm, pack)[:, 0]
        flat = torch.arange(pack.input_ids.shape[1])[None]
        leaky = score_pack(rm, type(pack)(pack.index, pack.input_ids, flat, pack.pool, pack.lengths))[:, 0]
        ref = torch.stack([_alone(rm, ids[int(i)]) for i in pack.index])
    torch.testing.assert_close(good, ref, atol=1e-5, rtol=0)
    assert (leaky[1:] - ref[1:]).abs().min() > 1e-4


def test_pooling_follows_the_pad_rule_and_gradients(policy_and_tokenizer):
    """HF pools at the last token that is not the pad id (index 0 if all are); with
    gradients on, the packed graph gives the same gradient as padded micro-batches."""
    _, tok = policy_and_tokenizer
    rm = make_reward_model(tok, kind="qwen2", seed=2)
    pad = rm.config.pad_token_id
    seqs = [torch.tensor([7, 8, 9, pad, pad]), torch.tensor([pad, pad]), torch.tensor([5]), torch.tensor([11, 12, 13])]
    ref = torch.stack([_alone(rm, s) for s in seqs])
    scorer = HFRewardModelWrapper(rm, batching=RewardBatching(packing=True, max_batch_size=3), renderer=RewardRenderer(add_eos="never"))
    got = scorer.score_ids(Ragged.from_list(seqs))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)

    got.sum().backward()
    packed_grad = rm.score.weight.grad.clone()
    rm.zero_grad()
    HFRewardModelWrapper(rm, renderer=RewardRenderer(add_eos="never"), batching=RewardBatching(max_batch_size=1)).score_ids(Ragged.from_list(seqs)).sum().backward()
    one_by_one_grad = rm.score.weight.grad.clone()
    # the independent reference: the gradient of the plain model calls, each sequence alone
    rm.zero_grad()
    torch.stack([rm(input_ids=s[None]).logits[0, 0] for s in seqs]).sum().backward()
    torch.testing.assert_close(packed_grad, rm.score.weight.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(one_by_one_grad, rm.score.weight.grad, atol=1e-5, rtol=0)


def test_packing_refused_where_it_cannot_be_exact(policy_and_tokenizer):
    _, tok = policy_and_tokenizer

    class StandIn(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids.float().sum(-1, keepdim=True)

    with pytest.raises(ValueError, match=r"RewardBatching\(packing=True\): StandIn is not a causal"):
        HFRewardModelWrapper(StandIn(), batching=RewardBatching(packing=True))
    bidirectional = make_reward_model(tok, kind="llama")
    bidirectional.config.is_causal = False
    with pytest.raises(ValueError, match=r"RewardBatching\(packing=True\): LlamaForSequenceClassification"):
        HFRewardModelWrapper(bidirectional, batching=RewardBatching(packing=True))
    with pytest.raises(TypeError, match="packing must be a bool"):
        RewardBatching(packing="yes")


def test_packed_sliding_window_layers(policy_and_tokenizer):
    """Qwen2 with sliding-window attention shorter than the sequences: transformers' sliding
    mask composed with the packed one still keeps each sequence alone."""
    _, tok = policy_and_tokenizer
    rm = make_reward_model(tok, kind="qwen2", seed=4, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert set(rm.config.layer_types) == {"sliding_attention"}
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(5, len(tok), (n,), generator=g) for n in (7, 1, 30, 12, 3, 25)]
    ref = torch.stack([_alone(rm, s) for s in seqs])
    got = HFRewardModelWrapper(rm, batching=RewardBatching(packing=True), renderer=RewardRenderer(add_eos="never"), inference_mode=True).score_ids(Ragged.from_list(seqs))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
