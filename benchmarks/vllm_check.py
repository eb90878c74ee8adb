"""SmolLM2-135M-Instruct generating through TorchRL's ``vLLMWrapper`` on a CUDA GPU, beside
``safe_policy_wrapper``'s ``TransformersWrapper`` on the same prompts: generated tokens/s of
each, and whether the library reads vLLM's rollouts (every reply decoded alone equals the
text read back; finished replies keep their EOS). Needs ``pip install vllm``; run by
``benchmarks/gpu_check.sh``. Not run by CI (no GPU there).

    python benchmarks/vllm_check.py [--batches 4 --prompts 16 --group 4 --max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch


def collect(policy, prompts, args) -> tuple[float, object]:
    """``(generated tokens/s, buffer)`` of ``--batches`` LLMCollector batches over ``prompts``."""
    from torchrl_trl import layouts, testing

    env = testing.make_chat_env([{"query": q} for q in prompts], batch_size=args.prompts, group_size=args.group)
    turns = args.batches * args.prompts * args.group
    testing.collect_rollouts(policy, env, total_turns=args.prompts * args.group)  # warm-up
    start = time.perf_counter()
    buffer = testing.collect_rollouts(policy, env, total_turns=turns)
    wall = time.perf_counter() - start
    generated = sum(len(t) for t in layouts.read_tokens(buffer[:], "response"))
    return generated / wall, buffer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    from tensordict import set_list_to_stack
    from torchrl.modules.llm import vLLMWrapper
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM

    from torchrl_trl import layouts, safe_pad_tokenizer, safe_policy_wrapper
    from torchrl_trl.cli.demo_tasks import arithmetic_task
    from torchrl_trl.testing import smollm2_checkpoint

    set_list_to_stack(True).set()
    path = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = arithmetic_task().train_prompts
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).to("cuda")
    hf = safe_policy_wrapper(
        model, tok, input_mode="history", generate=True, return_log_probs=True, pad_output=False, device="cuda",
        generate_kwargs={"max_new_tokens": args.max_new_tokens, "do_sample": True},
    )
    hf_rate, _ = collect(hf, prompts, args)
    del model, hf
    torch.cuda.empty_cache()

    llm = LLM(model=str(path), dtype="bfloat16", gpu_memory_utilization=0.4, seed=0)
    vllm_policy = vLLMWrapper(
        llm, tokenizer=safe_pad_tokenizer(tok), input_mode="history", generate=True, return_log_probs=True,
        pad_output=False, generate_kwargs={"max_tokens": args.max_new_tokens, "temperature": 1.0},
    )
    vllm_rate, buffer = collect(vllm_policy, prompts, args)

    rows = buffer[:]
    tokens, texts = layouts.read_tokens(rows, "response"), layouts.read_text(rows, "response")
    same = sum(tok.decode(t, skip_special_tokens=True).strip() == x.strip() for t, x in zip(tokens, texts))
    finished = [t for t in tokens if len(t) < args.max_new_tokens]
    with_eos = sum(int(t[-1]) == tok.eos_token_id for t in finished)
    print(f"TransformersWrapper {hf_rate:.0f} generated tokens/s; vLLMWrapper {vllm_rate:.0f} tokens/s "
          f"(x{vllm_rate / hf_rate:.1f}); {len(tokens)} vLLM rollouts read: {same} texts equal their tokens decoded, "
          f"{with_eos} of {len(finished)} finished replies end with EOS")


if __name__ == "__main__":
    main()
