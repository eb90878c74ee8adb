"""HFRewardTransform on a replay buffer (score once on write, ahead of MCAdvantage) and
on a ChatEnv (single- and multi-turn); RewardTransform with any scorer."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from torchrl_trl import layouts
from torchrl_trl.rewards import HFRewardModelWrapper, HFRewardTransform, RewardRenderer
from torchrl_trl.testing import collect_rollouts, make_chat_env, make_policy_wrapper

ROWS = [
    {"query": "what is two plus two?", "answer": "4"},
    {"query": "hello world", "answer": "hi"},
]


def _scorer(path, policy_tokenizer):
    """The scorer the transform composes: the reward model, re-rendering the policy's samples."""
    return HFRewardModelWrapper.from_pretrained(
        path, inference_mode=True, renderer=RewardRenderer(policy_tokenizer=policy_tokenizer)
    )


def _history_reference(path, conversations):
    """The RM's own template + tokenizer, one conversation at a time."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for c in conversations:
            ids = tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]
            out.append(model(input_ids=torch.tensor([ids])).logits[0, 0])
    return torch.stack(out)


def test_replay_buffer_scores_once_before_mcadvantage(checkpoints, policy_and_tokenizer):
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    model, tok = policy_and_tokenizer
    path = checkpoints.reward_model_other_tokenizer
    reward_tf = HFRewardTransform(_scorer(path, tok))
    rb = ReplayBuffer(storage=LazyStackStorage(16), batch_size=4)
    rb.append_transform(MCAdvantage(grpo_size=2))
    rb.append_transform(reward_tf)  # the buffer runs write transforms last-to-first
    collect_rollouts(make_policy_wrapper(model, tok), make_chat_env(ROWS), total_turns=4, replay_buffer=rb)
    assert len(rb) == 4
    data = rb[:]
    rewards = torch.stack(data.get(("next", "reward"), as_list=True))
    assert rewards.shape == (4, 1, 1)
    ref = _history_reference(path, layouts.read_history(data, "full"))
    torch.testing.assert_close(rewards.reshape(-1), ref, atol=1e-5, rtol=0)
    assert data.get("advantage", as_padded_tensor=True).shape == (4, 1, 1)
    scored = reward_tf.scorer.real_tokens
    rb.sample()  # sampling does not score again
    assert reward_tf.scorer.real_tokens == scored


def test_env_multi_turn_rewards(checkpoints, policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    path = checkpoints.reward_model_other_tokenizer
    env = make_chat_env(ROWS, batch_size=2, group_size=1, max_turns=2)
    env = env.append_transform(HFRewardTransform(_scorer(path, tok)))
    rb = collect_rollouts(make_policy_wrapper(model, tok), env, total_turns=4)
    data = rb[:]
    assert len(rb) == 4
    convs = layouts.read_history(data, "full")
    n_assistant = sorted(sum(m["role"] == "assistant" for m in c) for c in convs)
    assert n_assistant == [1, 1, 2, 2]  # the second turn scores the whole conversation
    rewards = torch.stack(data.get(("next", "reward"), as_list=True)).reshape(-1)
    torch.testing.assert_close(rewards, _history_reference(path, convs), atol=1e-5, rtol=0)


def test_configured_wrapper_is_used_as_configured(checkpoints, policy_and_tokenizer):
    from torchrl_trl.rewards import HFRewardModelWrapper, RewardRenderer

    model, tok = policy_and_tokenizer
    scorer = HFRewardModelWrapper.for_grpo(str(checkpoints.reward_model), renderer=RewardRenderer(policy_tokenizer=tok))
    env = make_chat_env(ROWS, batch_size=2, group_size=1).append_transform(HFRewardTransform(scorer))
    data = collect_rollouts(make_policy_wrapper(model, tok), env, total_turns=2)[:]
    rewards = torch.stack(data.get(("next", "reward"), as_list=True))
    assert rewards.shape == (2, 1, 1) and not rewards.requires_grad
    # the transform writes: its own key/shape, when given, win over the scorer's
    assert HFRewardTransform(scorer, reward_shape="trailing").reward_shape == "trailing"


def test_composes_with_retrieve_kl(checkpoints, policy_and_tokenizer):
    """TorchRL's RetrieveKL, run on rollouts our transform scored, turns the reward-model
    reward into the per-token reward ``rm_reward - kl_penalty`` (coeff 1)."""
    from transformers import AutoModelForCausalLM
    from torchrl.envs.llm.transforms import RetrieveKL

    model, tok = policy_and_tokenizer
    ref = AutoModelForCausalLM.from_pretrained(checkpoints.policy).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    env = make_chat_env(ROWS, batch_size=2, group_size=2)
    env = env.append_transform(HFRewardTransform(_scorer(checkpoints.reward_model, tok)))
    data = collect_rollouts(make_policy_wrapper(model, tok), env, total_turns=4)[:]
    rm_reward = torch.stack(layouts.read_column(data, layouts.REWARD_KEY)).reshape(-1)

    kl = RetrieveKL(
        gen_model=make_policy_wrapper(model, tok, generate=False),
        ref_model=make_policy_wrapper(ref, tok, generate=False, log_probs_key="ref_log_probs"),
        assistant_only=True,
        coeff=1.0,
    )
    out = kl(data)
    token_rewards = out.get(("next", "reward"), as_list=True)
    penalties = out.get(("next", "kl_penalty"), as_list=True)
    for i in range(4):
        torch.testing.assert_close(token_rewards[i].reshape(-1), rm_reward[i] - penalties[i].reshape(-1))
    assert any(p.abs().sum() > 0 for p in penalties)  # the reference really differs


def test_called_as_a_module_writes_the_reward_and_declares_what_it_reads(checkpoints, policy_and_tokenizer):
    """``transform(td)`` (and inside a TensorDictSequential after the policy) writes
    ``("next", "reward")``; ``in_keys`` are what is read: the chat for a reward model with
    its own template (sharing the policy's tokenizer or not), tokens + mask when asked for."""
    from tensordict import TensorDict
    from tensordict.nn import TensorDictSequential
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    model, tok = policy_and_tokenizer
    path = checkpoints.reward_model_other_tokenizer
    tf = HFRewardTransform(_scorer(path, tok))
    assert tf.in_keys == [("history", "full")] and tf.out_keys == [("next", "reward")]
    # the same tokenizer: the chat is still re-rendered with the reward model's template
    same = HFRewardTransform(_scorer(checkpoints.reward_model, tok))
    assert same.in_keys == [("history", "full")]
    tokens = HFRewardTransform(HFRewardModelWrapper.from_pretrained(
        checkpoints.reward_model, inference_mode=True, renderer=RewardRenderer(policy_tokenizer=tok, input_mode="tokens")))
    assert tokens.in_keys == [("tokens", "full"), ("masks", "all_attention_mask")]

    torch.manual_seed(0)
    policy = make_policy_wrapper(model, tok, max_new_tokens=6)
    prompts = History.from_chats([[{"role": "user", "content": r["query"]}] for r in ROWS])
    td = TensorDict({"history": ChatHistory(prompt=prompts, batch_size=[2])}, [2])
    out = TensorDictSequential(policy, tf)(td)
    rewards = out["next", "reward"]
    assert rewards.shape == (2, 1, 1)
    ref = _history_reference(path, layouts.read_history(out, "full"))
    torch.testing.assert_close(rewards.reshape(-1), ref, atol=1e-5, rtol=0)
    # standalone on the declared keys only
    again = tf(out.select(*tf.in_keys))
    torch.testing.assert_close(again["next", "reward"], rewards, atol=0, rtol=0)


def test_service_arguments_need_use_ray_service(checkpoints):
    """Service settings without the service are refused (no Ray needed to tell)."""
    path = str(checkpoints.reward_model)
    with pytest.raises(TypeError, match=r"HFRewardTransform: \['actor_name', 'num_gpus'\] apply with use_ray_service=True only"):
        HFRewardTransform(path, actor_name="rm", num_gpus=1)


def test_scorer_kinds(checkpoints):
    """A path or a loaded model is wrapped with the defaults (no gradients, step-shaped
    reward at ("next", "reward")); anything else is refused by type."""
    by_path = HFRewardTransform(str(checkpoints.reward_model))
    assert isinstance(by_path.scorer, HFRewardModelWrapper) and by_path.scorer.inference_mode
    assert by_path.reward_shape == "step" and by_path.out_keys == [("next", "reward")]
    model = AutoModelForSequenceClassification.from_pretrained(checkpoints.reward_model)
    by_model = HFRewardTransform(model)
    assert by_model.scorer.model is model and by_model.reward_shape == "step"
    with pytest.raises(TypeError, match="scorer must be"):
        HFRewardTransform(42)
    with pytest.raises(TypeError, match="use_ray_service=True serves the reward model from a local path"):
        HFRewardTransform(by_path.scorer, use_ray_service=True)


class _ResponseLength:
    """A scorer of the user's own: the four members RewardTransform reads, nothing else."""

    in_keys = [("tokens", "response")]
    out_keys = ["length_reward"]
    reward_shape = "step"

    def score_outputs(self, td, columns_td=None):
        return [torch.tensor([float(len(t)) for t in layouts.read_tokens(td.reshape(-1), "response").tolist()])]


def test_one_reward_transform_for_any_scorer(checkpoints, policy_and_tokenizer):
    """RewardTransform runs a reward model, reward functions and a scorer of the user's own
    the same way: in a ChatEnv's step (adding up with accumulate=True) and on a buffer's
    write, each value equal to the scorer applied to that rollout alone."""
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from torchrl_trl.rewards import RewardFunctionWrapper, RewardTransform

    def answer_in_response(prompts, completions, answer, **kwargs):
        return [float(a in c) for c, a in zip(completions, answer)]

    model, tok = policy_and_tokenizer
    path = checkpoints.reward_model_other_tokenizer
    env = make_chat_env(ROWS)
    env = env.append_transform(RewardTransform(_scorer(path, tok), reward_shape="step"))
    env = env.append_transform(RewardTransform(RewardFunctionWrapper(answer_in_response), accumulate=True))
    env = env.append_transform(RewardTransform(_ResponseLength()))
    assert {"reward", "length_reward"} <= set(env.full_reward_spec.keys())
    data = collect_rollouts(make_policy_wrapper(model, tok), env, total_turns=4)[:]
    responses = layouts.read_text(data, "response")
    model_part = _history_reference(path, layouts.read_history(data, "full"))
    function_part = torch.tensor([float(a in r) for r, a in zip(responses, layouts.read_column(data, "answer"))])
    rewards = torch.stack(data.get(("next", "reward"), as_list=True)).reshape(-1)
    torch.testing.assert_close(rewards, model_part + function_part, atol=1e-5, rtol=0)
    lengths = torch.stack(data.get(("next", "length_reward"), as_list=True))
    assert lengths.shape == (4, 1, 1)
    assert lengths.reshape(-1).tolist() == [float(len(t)) for t in layouts.read_tokens(data, "response").tolist()]

    rb = ReplayBuffer(storage=LazyStackStorage(8), batch_size=2)
    calls = []
    scorer = _ResponseLength()
    scorer.score_outputs = lambda td, columns_td=None: calls.append(len(td)) or _ResponseLength.score_outputs(scorer, td)
    rb.append_transform(RewardTransform(scorer, reward_key="again"))
    rb.extend(data.exclude(("next", "length_reward")))
    torch.testing.assert_close(torch.stack(rb[:].get(("next", "again"), as_list=True)), lengths)
    rb.sample()  # sampling does not score again
    assert calls == [4]
    with pytest.raises(TypeError, match=r"needs in_keys, out_keys, reward_shape, score_outputs.*no \['score_outputs'\]"):
        RewardTransform(type("Unfinished", (), {"in_keys": [], "out_keys": ["r"], "reward_shape": "flat"})())
