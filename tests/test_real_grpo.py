"""The online paths in a real ``GRPOTrainer.train()`` on SmolLM2-135M-Instruct (issue 33).

TorchRL's ``TransformersWrapper`` takes every token equal to its pad for padding: with the
shipped pad == eos it dropped each completion's EOS, so TRL logged ``completions/clipped_ratio``
1.0 whatever ended. Here every path generates greedily, and each completion TRL received is
compared with :func:`real_model.greedy_reply` (one sequence alone, EOS kept): a finished reply
ends with its EOS, a reply cut by ``max_completion_length`` does not, and TRL's clipped ratio is
the share of the reference replies that did not end.
"""

from __future__ import annotations

import copy

import pytest
from real_model import SAME_LENGTH_QUERIES, ended, greedy_reply

pytestmark = pytest.mark.real_model

#: the sky question's greedy reply ends (EOS) within this many tokens, the sea question's is cut
MAX_LEN = 8
PROMPTS = [[{"role": "user", "content": q}] for q in SAME_LENGTH_QUERIES]
#: greedy_reply of the session's (never trained) model per prompt's token ids
_REFERENCES: dict[tuple[int, ...], list[int]] = {}


class Recorded:
    """A rollout func that keeps what it returned to TRL."""

    def __init__(self, func):
        self.func, self.outputs, self.__name__ = func, [], "recorded"

    def __call__(self, prompts, trainer):
        out = self.func(prompts, trainer)
        self.outputs.append({k: out[k] for k in ("prompt_ids", "completion_ids", "logprobs")})
        return out


def _reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def _train(model, tok, rollout_func, tmp_path, **config):
    """One real GRPO step of ``model`` (4 completions: 2 prompts x 2); the trainer and TRL's logged metrics."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=1, num_generations=2, per_device_train_batch_size=2,
        generation_batch_size=4, max_completion_length=MAX_LEN, use_cpu=True, bf16=False, beta=0.0, report_to=[],
        logging_steps=1, save_strategy="no", seed=0, gradient_checkpointing=False, **config,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[_reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_func=rollout_func)
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "completions/clipped_ratio" in h]
    return trainer, logged


def _check_against_greedy(outputs, reference_model, tok, logged=None):
    """Every completion TRL got equals the model's greedy reply alone (EOS kept where generated, a
    reply cut at ``MAX_LEN`` not closed), and TRL's logged clipped ratio is the share that did not end."""
    (out,) = outputs
    assert len(out["completion_ids"]) == 4
    endings = []
    for prompt, completion, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        key = tuple(prompt)
        if key not in _REFERENCES:  # the same prompts, tokens and weights in every test here: computed once
            _REFERENCES[key] = greedy_reply(reference_model, tok, list(prompt), MAX_LEN)
        ref = _REFERENCES[key]
        assert completion == ref, (tok.decode(completion), tok.decode(ref))
        assert len(logprobs) == len(completion)
        endings.append(ended(ref, reference_model, tok))
        if not endings[-1]:
            assert len(completion) == MAX_LEN
    assert len(set(map(tuple, out["prompt_ids"]))) == 2 and any(endings) and not all(endings), endings  # both kinds
    if logged is not None:
        assert logged["completions/clipped_ratio"] == pytest.approx(1 - sum(endings) / len(endings))  # 0.5


def _safe_greedy_policy(model, tok, *, pad_output=False):
    from torchrl_trl import safe_policy_wrapper

    return safe_policy_wrapper(model, tok, input_mode="history", generate=True, return_log_probs=True,
                               pad_output=pad_output, generate_kwargs={"max_new_tokens": MAX_LEN, "do_sample": False})


def test_rollout_func_padded_policy_keeps_eos(smollm2_dir, smollm2_model):
    """Called directly (no trainer) with a ``pad_output=True`` policy, where the finished reply is padded
    after its EOS while the other goes on (the trainer tests below use ragged ones): ``completion_ids``
    are the greedy replies, EOS kept, the cut one not closed."""
    from torchrl_trl.online import TorchRLRolloutFunc
    from torchrl_trl.testing import smollm2_tokenizer

    tok = smollm2_tokenizer(smollm2_dir, pad="eos")
    policy = _safe_greedy_policy(smollm2_model, tok, pad_output=True)
    out = TorchRLRolloutFunc(policy, logprobs="generate")(PROMPTS * 2)
    _check_against_greedy([out], smollm2_model, tok)


def test_rollout_func_built_from_trainer_keeps_eos(smollm2_dir, smollm2_model, pad_setup, tmp_path):
    """``TorchRLRolloutFunc()`` builds its policy from the trainer's model and ``processing_class``
    as loaded with each pad set-up (TRL sets pad = eos where there is none): the EOS of each
    finished completion reaches TRL, and the user's tokenizer keeps its pad."""
    from torchrl_trl.online import TorchRLRolloutFunc
    from torchrl_trl.testing import smollm2_tokenizer

    tok = smollm2_tokenizer(smollm2_dir, pad=pad_setup)
    func = TorchRLRolloutFunc()
    recorded = Recorded(func)
    trainer, logged = _train(copy.deepcopy(smollm2_model), tok, recorded, tmp_path,
                             generation_kwargs={"do_sample": False})
    _check_against_greedy(recorded.outputs, smollm2_model, tok, logged)
    assert func.policy.model is trainer.model  # built around the trainer's model
    assert func.policy.tokenizer.pad_token_id != tok.eos_token_id == 2
    assert tok.pad_token_id == {"eos": 2, "none": 2, "own": 0}[pad_setup]  # "none": TRL's pad = eos, not ours


def test_rollout_func_with_safe_policy_keeps_eos(smollm2_dir, smollm2_model, tmp_path):
    """``TorchRLRolloutFunc(policy=safe_policy_wrapper(trainer's model, shipped tokenizer))``."""
    from torchrl_trl.online import TorchRLRolloutFunc
    from torchrl_trl.testing import smollm2_tokenizer

    tok = smollm2_tokenizer(smollm2_dir, pad="eos")
    model = copy.deepcopy(smollm2_model)
    recorded = Recorded(TorchRLRolloutFunc(_safe_greedy_policy(model, tok)))
    _, logged = _train(model, tok, recorded, tmp_path)
    _check_against_greedy(recorded.outputs, smollm2_model, tok, logged)


def test_llm_collector_rollout_func_keeps_eos(smollm2_dir, smollm2_model, tmp_path):
    """``TorchRLRolloutFunc(source=LLMCollector)``: a TorchRL ``LLMCollector`` over a ``ChatEnv`` with a
    safe policy of its own weights (the trainer's pushed into it first) writes the groups TRL trains on."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from torchrl_trl.online import RolloutOptions, TorchRLRolloutFunc
    from torchrl_trl.testing import make_chat_env, smollm2_tokenizer

    tok = smollm2_tokenizer(smollm2_dir, pad="eos")
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    collector = LLMCollector(
        env=make_chat_env([{"query": q} for q in SAME_LENGTH_QUERIES], batch_size=2, group_size=2),
        policy=_safe_greedy_policy(copy.deepcopy(smollm2_model), tok), dialog_turns_per_batch=2, replay_buffer=rb,
        track_policy_version=True, total_dialog_turns=-1,
    )
    with TorchRLRolloutFunc(source=collector, options=RolloutOptions(max_pending_groups=1)) as func:
        recorded = Recorded(func)
        _, logged = _train(copy.deepcopy(smollm2_model), tok, recorded, tmp_path)
    _check_against_greedy(recorded.outputs, smollm2_model, tok, logged)


def test_prompt_collector_rollout_func_keeps_eos(smollm2_dir, smollm2_model, tmp_path):
    """``TorchRLRolloutFunc`` over ``make_prompt_collector``: TRL's prompts generated in TorchRL's
    ``LLMCollector`` thread."""
    from torchrl_trl.online import RolloutOptions, TorchRLRolloutFunc, make_prompt_collector
    from torchrl_trl.testing import smollm2_tokenizer

    tok = smollm2_tokenizer(smollm2_dir, pad="eos")
    collector = make_prompt_collector(_safe_greedy_policy(copy.deepcopy(smollm2_model), tok), PROMPTS, group_size=2)
    with TorchRLRolloutFunc(source=collector, options=RolloutOptions(max_pending_groups=1)) as func:
        recorded = Recorded(func)
        _, logged = _train(copy.deepcopy(smollm2_model), tok, recorded, tmp_path)
    _check_against_greedy(recorded.outputs, smollm2_model, tok, logged)


def _plain_policy(model, tok):
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(model, tokenizer=tok, input_mode="history", generate=True, return_log_probs=True,
                               pad_output=False, generate_kwargs={"max_new_tokens": 4})


def test_plain_wrapper_refused_by_rollout_func(smollm2_dir, smollm2_model, pad_setup):
    """A plain ``TransformersWrapper`` on the real model loses tokens to padding in every set-up
    (pad == eos; no pad: TorchRL sets pad = eos; a pad of its own: ``generate`` still pads with the
    model's ``generation_config.pad_token_id``, the EOS): refused before anything generates."""
    from torchrl_trl.online import TorchRLRolloutFunc
    from torchrl_trl.testing import smollm2_tokenizer

    policy = _plain_policy(smollm2_model, smollm2_tokenizer(smollm2_dir, pad=pad_setup))
    is_eos = r"pad token '<\|im_end\|>' \(id 2\) is its EOS"
    cause = {"eos": is_eos, "none": is_eos, "own": r"generate pads finished sequences with id 2"}[pad_setup]
    with pytest.raises(ValueError, match=rf"^TorchRLRolloutFunc: .*{cause}.*safe_policy_wrapper"):
        TorchRLRolloutFunc(policy)


@pytest.mark.parametrize("where", ["TorchRLRolloutFunc", "make_prompt_collector", "CollectorCallback"])
def test_plain_wrapper_refused_where_a_policy_is_received(smollm2_dir, smollm2_model, where):
    """The other classes that receive a policy refuse the shipped pad == eos set-up the same way."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from torchrl_trl.online import CollectorCallback, TorchRLRolloutFunc, make_prompt_collector
    from torchrl_trl.testing import make_chat_env, smollm2_tokenizer

    policy = _plain_policy(smollm2_model, smollm2_tokenizer(smollm2_dir, pad="eos"))
    with pytest.raises(ValueError, match=rf"^{where}: .*is its EOS.*safe_policy_wrapper"):
        if where == "make_prompt_collector":
            make_prompt_collector(policy, PROMPTS, group_size=2)
        else:
            rb = ReplayBuffer(storage=LazyStackStorage(8))
            collector = LLMCollector(env=make_chat_env([{"query": "hi"}]), policy=policy, dialog_turns_per_batch=2,
                                     replay_buffer=rb, track_policy_version=True, total_dialog_turns=-1)
            if where == "TorchRLRolloutFunc":
                TorchRLRolloutFunc(source=collector)
            else:
                CollectorCallback(collector)
