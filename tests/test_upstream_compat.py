"""``torchrl_trl.HFRewardModelWrapper`` keeps every contract of upstream's
``torchrl.modules.llm.trl_interop.HFRewardModelWrapper`` (switching is an import change).

One test per contract, with stand-in reward modules that have no ``config`` and no pad
token, as upstream's own tests and tutorial use. Where upstream can run the same input,
its class is the reference.
"""

import pytest
import torch
from tensordict import TensorDict
from torchrl.modules.llm.trl_interop import HFRewardModelWrapper as Upstream

from torchrl_trl import HFRewardModelWrapper, RewardBatching


class _Out:
    def __init__(self, logits):
        self.logits = logits


class PositionalScorer(torch.nn.Module):
    """No ``config``, no pad id. Reward = a position-weighted sum of token embeddings over
    the positions the mask marks, so left vs right padding and dropped columns change it.
    Records what it was called with."""

    def __init__(self, vocab=64, width=12, out_dim=1):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(vocab, out_dim, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(width, generator=g))
        self.calls = []

    def forward(self, input_ids, attention_mask=None):
        self.calls.append((input_ids.clone(), None if attention_mask is None else attention_mask.clone()))
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        w = self.pos[: input_ids.shape[1]] * mask.float()
        return _Out((self.emb[input_ids] * w[..., None]).sum(1))


class MasklessScorer(torch.nn.Module):
    """A module whose ``forward`` has no ``attention_mask`` parameter at all."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 64))
        self.widths = []

    def forward(self, input_ids):
        self.widths.append(input_ids.shape[1])
        return _Out(self.w[input_ids].mean(1, keepdim=True))


def _left_padded(n=3, width=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, width), generator=g)
    mask = torch.ones(n, width, dtype=torch.long)
    for row in range(n):
        mask[row, : 2 * row] = 0  # row i has 2i pads on the left
        ids[row, : 2 * row] = 0
    return TensorDict({"tokens": {"full": ids}, "masks": {"all_attention_mask": mask}}, [n])


def test_stand_in_module_without_config_gets_ids_and_mask_as_given():
    td = _left_padded()
    ours_model, up_model = PositionalScorer(), PositionalScorer()
    ours = HFRewardModelWrapper(ours_model)(td.clone())["reward"]
    up = Upstream(up_model)(td.clone())["reward"]
    assert ours.shape == (3,) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, up)
    # exactly the stored (left-padded) tensors went in, in one call
    (ids, mask), = ours_model.calls
    assert torch.equal(ids, td["tokens", "full"]) and torch.equal(mask, td["masks", "all_attention_mask"])
    # the padding matters to this module: right-padding the same rows gives other rewards
    right = torch.stack([r.roll(-2 * i) for i, r in enumerate(td["masks", "all_attention_mask"])])
    assert not torch.allclose(PositionalScorer()(td["tokens", "full"], right).logits[:, 0], ours)


def test_stand_in_module_chunks_rows_by_budget_in_order():
    td = _left_padded(n=5)
    model = PositionalScorer()
    ours = HFRewardModelWrapper(model, batching=RewardBatching(max_tokens_per_batch=24))(td.clone())["reward"]
    assert [c[0].shape for c in model.calls] == [(2, 12), (2, 12), (1, 12)]
    torch.testing.assert_close(ours, Upstream(PositionalScorer())(td.clone())["reward"])


def test_attention_mask_key_none_calls_model_with_input_ids_only():
    ids = torch.randint(0, 64, (4, 7))
    td = TensorDict({"input_ids": ids}, [4])
    model = MasklessScorer()
    ours = HFRewardModelWrapper(model, token_key="input_ids", attention_mask_key=None)(td.clone())["reward"]
    torch.testing.assert_close(ours, Upstream(model, token_key="input_ids", attention_mask_key=None)(td)["reward"])
    # also with a module that would accept a mask: none is passed
    pos = PositionalScorer(width=7)
    HFRewardModelWrapper(pos, token_key="input_ids", attention_mask_key=None)(td.clone())
    assert all(mask is None for _, mask in pos.calls)


def test_attention_mask_key_none_ragged_rows_to_a_module_without_mask_argument():
    from tensordict import lazy_stack

    rows = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
    td = lazy_stack([TensorDict({"input_ids": torch.tensor(r)}) for r in rows])
    model = MasklessScorer()
    got = HFRewardModelWrapper(model, token_key="input_ids", attention_mask_key=None)(td)["reward"]
    ref = torch.stack([model.w[torch.tensor(r)].mean() for r in rows])
    torch.testing.assert_close(got, ref)
    assert sorted(model.widths) == [1, 2, 3]  # never padded: one forward per length


def test_absent_configured_mask_key_raises_key_error():
    td = TensorDict({"input_ids": torch.randint(0, 64, (2, 5))}, [2])
    wrapper = HFRewardModelWrapper(PositionalScorer(), token_key="input_ids", attention_mask_key="attention_mask")
    with pytest.raises(KeyError, match="attention_mask"):
        wrapper(td)
    # the default mask key too: no silent "every stored token is real"
    default = TensorDict({"tokens": {"full": torch.randint(0, 64, (2, 5))}}, [2])
    with pytest.raises(KeyError, match="all_attention_mask.*attention_mask_key=None"):
        HFRewardModelWrapper(PositionalScorer())(default)


def test_absent_token_key_raises_key_error():
    td = TensorDict({"other": torch.zeros(2, 3)}, [2])
    with pytest.raises(KeyError, match="input_ids"):
        HFRewardModelWrapper(PositionalScorer(), token_key="input_ids", attention_mask_key=None)(td)


def test_vector_head_raises_runtime_error():
    td = TensorDict({"input_ids": torch.randint(0, 64, (3, 4))}, [3])
    wrapper = HFRewardModelWrapper(PositionalScorer(out_dim=3), token_key="input_ids", attention_mask_key=None)
    with pytest.raises(RuntimeError, match="one scalar reward per input.*head_index"):
        wrapper(td)
    # a scalar head shaped [B] is one reward per input
    class Flat(PositionalScorer):
        def forward(self, input_ids, attention_mask=None):
            return _Out(super().forward(input_ids, attention_mask).logits[:, 0])

    out = HFRewardModelWrapper(Flat(), token_key="input_ids", attention_mask_key=None)(td)["reward"]
    assert out.shape == (3,)


def test_unreadable_output_raises_runtime_error():
    class Talks(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return {"score": input_ids.float().sum(-1)}

    td = TensorDict({"input_ids": torch.randint(0, 64, (2, 4))}, [2])
    with pytest.raises(RuntimeError, match="could not extract reward from model output.*dict"):
        HFRewardModelWrapper(Talks(), token_key="input_ids", attention_mask_key=None)(td)


def test_nested_and_custom_keys():
    td = TensorDict(
        {"inputs": {"ids": torch.randint(0, 64, (2, 6)), "mask": torch.ones(2, 6, dtype=torch.long)}}, [2]
    )
    wrapper = HFRewardModelWrapper(
        PositionalScorer(), token_key=("inputs", "ids"), attention_mask_key=("inputs", "mask"), reward_key=("r", "value")
    )
    assert wrapper.in_keys == [("inputs", "ids"), ("inputs", "mask")]
    assert wrapper.out_keys == [("r", "value")]
    out = wrapper(td.clone())
    up = Upstream(
        PositionalScorer(), token_key=("inputs", "ids"), attention_mask_key=("inputs", "mask"), reward_key=("r", "value")
    )(td.clone())
    assert out["r", "value"].shape == (2,)
    torch.testing.assert_close(out["r", "value"], up["r", "value"])


def test_gradients_kept_by_default_and_off_with_inference_mode():
    td = _left_padded()
    model = PositionalScorer()
    reward = HFRewardModelWrapper(model)(td.clone())["reward"]
    assert reward.requires_grad
    reward.sum().backward()
    assert model.pos.grad is not None and model.pos.grad.abs().sum() > 0

    seen = []

    class GradProbe(PositionalScorer):
        def forward(self, input_ids, attention_mask=None):
            seen.append(torch.is_grad_enabled())
            return super().forward(input_ids, attention_mask)

    frozen = HFRewardModelWrapper(GradProbe(), inference_mode=True)(td.clone())["reward"]
    assert seen == [False] and not frozen.requires_grad
    # the reward is an ordinary tensor: usable in a later loss with gradients
    p = torch.nn.Parameter(torch.ones(3))
    (p * frozen).sum().backward()
    torch.testing.assert_close(p.grad, frozen)
