"""The reward-function paths on SmolLM2-135M-Instruct (issue 33): what a TRL-style reward
function receives through :class:`RewardFunctionWrapper` (TorchRL side: a transform of a real
``ChatEnv``, rollouts collected by TorchRL's ``LLMCollector``) and through
:func:`as_trl_reward_func` (TRL side: a real ``GRPOTrainer`` step), compared with an independent
reference: each prompt generated alone, greedy and unpadded (``tests/real_model.py``).

Greedy, one reply ends with its EOS within the token budget and the other is cut there
(``MAX_NEW`` under TorchRL's rendering, ``MAX_TRL`` under the model's own template, TRL's), so
both kinds are checked. TRL hands a reward function the reply decoded without special tokens
(no EOS) and its ids with the EOS where it was generated.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from real_model import SAME_LENGTH_QUERIES, ended, greedy_reply, reply_text

pytestmark = pytest.mark.real_model

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

MAX_NEW = 12
#: the same under the model's own template (TRL's rendering, a system line): the sky reply is cut, the sea one ends
MAX_TRL = 8
CHATS = [[{"role": "user", "content": q}] for q in SAME_LENGTH_QUERIES]


class Recorder:
    """A TRL reward function that keeps the arguments of its last call."""

    def __init__(self, name: str):
        self.__name__, self.seen = name, None

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.seen = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        return [float(len(ids)) for ids in completion_ids]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from torchrl_trl.testing import smollm2_tokenizer

    return smollm2_tokenizer(smollm2_dir, pad="eos")  # as shipped: pad == eos


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _torchrl_prompts(tok) -> tuple[list[str], list[list[int]]]:
    """The prompts as ChatEnv renders them for the policy (TorchRL's ChatML, no system line)."""
    from torchrl.data.llm import History

    rendered = History.from_chats(CHATS).apply_chat_template(tokenizer=tok, add_generation_prompt=True, tokenize=False)
    return list(rendered), [tok(t, add_special_tokens=False)["input_ids"] for t in rendered]


def _references(model, tok, prompt_ids, max_new: int = MAX_NEW) -> list[list[int]]:
    refs = [greedy_reply(model, tok, ids, max_new) for ids in prompt_ids]
    endings = [ended(r, model, tok) for r in refs]
    assert any(endings) and not all(endings), endings  # a reply that ended and one cut: or the check is moot
    return refs


@pytest.fixture(scope="module")
def torchrl_refs(smollm2_model, tok):
    """``(prompt texts, prompt ids, reference replies)`` under TorchRL's rendering, generated once."""
    prompt_texts, prompt_ids = _torchrl_prompts(tok)
    return prompt_texts, prompt_ids, _references(smollm2_model, tok, prompt_ids)


def _collect(model, tok, mode: str, *scorers):
    """One ChatEnv step of both prompts, the policy from safe_policy_wrapper (greedy), each scorer a
    transform of the env; the rollouts TorchRL's LLMCollector wrote."""
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv

    from torchrl_trl import safe_policy_wrapper
    from torchrl_trl.testing import collect_rollouts, prompt_dataloader

    rows = [{"query": q} for q in SAME_LENGTH_QUERIES]
    env = ChatEnv.from_dataloader(dataloader=prompt_dataloader(rows, 2), batch_size=2, repeats=1, input_mode=mode,
                                  tokenizer=None if mode == "history" else tok)
    env = env.append_transform(StepCounter(max_steps=1))
    for scorer in scorers:
        env = env.append_transform(scorer.as_transform())
    # tokens mode pads the output: TorchRL's ChatEnv._step_tokens stacks ("tokens", "full"), which
    # fails on ragged replies of different lengths (TorchRL 0.14.1, whatever the pad token)
    policy = safe_policy_wrapper(model, tok, input_mode=mode, generate=True, return_log_probs=True,
                                 pad_output=mode == "tokens",
                                 generate_kwargs={"max_new_tokens": MAX_NEW, "do_sample": False})
    return collect_rollouts(policy, env, total_turns=2)[:]


@pytest.mark.parametrize("mode", ["history", "text", "tokens"])
def test_reward_function_in_a_chat_env_gets_the_reference_replies(smollm2_model, tok, torchrl_refs, mode):
    """RewardFunctionWrapper as a ChatEnv transform, in each input mode. With tokenizer= every
    mode hands the function TRL's arguments for the reference reply: the text without its EOS
    (one assistant message for history) and the ids with it. Without tokenizer it reads what
    TorchRL stored: history's assistant message is the same; text.response keeps the EOS string
    where the reply ended; tokens-only rollouts cannot be read without a tokenizer."""
    from torchrl_trl.rewards import RewardFunctionWrapper

    prompt_texts, _, refs = torchrl_refs
    replies = [reply_text(r, smollm2_model, tok) for r in refs]
    decoded = RewardFunctionWrapper(Recorder("decoded"), tokenizer=tok, out_keys=["decoded"])
    scorers = [decoded]
    if mode != "tokens":
        stored = RewardFunctionWrapper(Recorder("stored"), out_keys=["stored"])
        scorers.append(stored)
    data = _collect(smollm2_model, tok, mode, *scorers)

    prompts = CHATS if mode == "history" else prompt_texts
    completions = [_assistant(r) for r in replies] if mode == "history" else replies
    assert decoded.funcs[0].seen == {"prompts": prompts, "completions": completions, "completion_ids": refs}
    if mode == "history":
        assert stored.funcs[0].seen == decoded.funcs[0].seen
    elif mode == "text":  # as TorchRL wrote text.response: the EOS string kept where the reply ended
        kept = [tok.decode(r, skip_special_tokens=False) for r in refs]
        assert stored.funcs[0].seen == {"prompts": prompts, "completions": kept, "completion_ids": refs}
        assert kept != replies
    else:
        with pytest.raises(KeyError, match="only tokens.*pass tokenizer="):
            RewardFunctionWrapper(Recorder("no_tokenizer"))(data)
        with pytest.raises(ValueError, match=r"input_mode='tokens'.*expected tokenizer="):
            RewardFunctionWrapper(Recorder("no_tokenizer"), input_mode="tokens")
    # and the rewards written are the function's, per rollout
    assert data.get(("next", "decoded"), as_padded_tensor=True).reshape(-1).tolist() == [float(len(r)) for r in refs]


@pytest.mark.parametrize("pad_output", [False, True], ids=["ragged", "padded"])
def test_torchrl_wrapper_with_pad_eos_is_refused_or_read_from_tokens(smollm2_model, tok, torchrl_refs, pad_output):
    """TorchRL's own TransformersWrapper on the shipped tokenizer (pad == eos): ragged rows lost
    the prompt's end-of-turn tokens and the reply's EOS for good (History holds "" for each
    reply): refused, naming the fix. Padded rows kept their tokens under a mask with holes:
    refused without a tokenizer, decoded from the tokens with one."""
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm import TransformersWrapper

    from torchrl_trl.rewards import RewardFunctionWrapper

    policy = TransformersWrapper(smollm2_model, tokenizer=tok, input_mode="history", generate=True,
                                 return_log_probs=True, pad_output=pad_output,
                                 generate_kwargs={"max_new_tokens": MAX_NEW, "do_sample": False})
    out = policy(TensorDict({"history": {"prompt": History.from_chats(CHATS)}}, batch_size=[2]))
    if not pad_output:  # what TorchRL wrote: the replies cut to ""
        assert [h[-1]["content"] for h in out["history", "response"].tolist()] == ["", ""]

    with pytest.raises(ValueError, match="safe_policy_wrapper"):
        RewardFunctionWrapper(Recorder("stored"))(out.clone())
    decoded = RewardFunctionWrapper(Recorder("decoded"), tokenizer=tok)
    if not pad_output:
        with pytest.raises(ValueError, match="safe_policy_wrapper"):
            decoded(out.clone())
        return
    decoded(out.clone())
    refs = torchrl_refs[2]
    assert decoded.funcs[0].seen == {
        "prompts": CHATS, "completions": [_assistant(reply_text(r, smollm2_model, tok)) for r in refs],
        "completion_ids": refs,
    }


def test_as_trl_reward_func_in_a_grpo_trainer_gets_the_reference_replies(smollm2_model, tok, tmp_path):
    """TRL side: as_trl_reward_func(RewardFunctionWrapper(f)) as a reward of a real GRPOTrainer
    step (greedy, 2 prompts x 2): f receives what TRL gives a reward function, the reference
    reply of each prompt rendered with the model's own chat template, with and without tokenizer=."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from torchrl_trl import as_trl_reward_func
    from torchrl_trl.rewards import RewardFunctionWrapper

    stored = RewardFunctionWrapper(Recorder("stored"))
    decoded = RewardFunctionWrapper(Recorder("decoded"), tokenizer=tok)
    reward_funcs = [as_trl_reward_func(stored, name="stored"), as_trl_reward_func(decoded, name="decoded")]
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=1, num_generations=2, per_device_train_batch_size=2,
        generation_batch_size=4, max_completion_length=MAX_TRL, use_cpu=True, bf16=False, beta=0.0, report_to=[],
        logging_steps=1, save_strategy="no", seed=0, generation_kwargs={"do_sample": False},
    )
    trainer = GRPOTrainer(model=copy.deepcopy(smollm2_model), reward_funcs=reward_funcs, args=args,
                          processing_class=tok, train_dataset=Dataset.from_dict({"prompt": CHATS}))
    trainer.train()

    rendered = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CHATS]
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in rendered]
    refs = dict(zip(SAME_LENGTH_QUERIES, _references(smollm2_model, tok, prompt_ids, MAX_TRL)))
    seen = stored.funcs[0].seen
    assert len(seen["prompts"]) == 4 and decoded.funcs[0].seen == seen
    for prompt, completion, ids in zip(seen["prompts"], seen["completions"], seen["completion_ids"]):
        ref = refs[prompt[-1]["content"]]
        assert (completion, ids) == (_assistant(reply_text(ref, smollm2_model, tok)), ref)
    assert torch.isfinite(torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])).all()
