"""TRL's own reward-model scoring vs ``as_trl_reward_func(HFRewardModelWrapper(...))``.

One GRPO reward call on ``B*G`` long-tailed chat completions (log-normal lengths):

1. TRL: ``GRPOTrainer._calculate_rewards`` for a ``PreTrainedModel`` reward func, step by
   step: the reward tokenizer's chat template over ``prompt + completion``,
   ``tokenizer(texts, padding=True, padding_side="right", add_special_tokens=False)``, one
   forward under ``torch.inference_mode()``, ``logits[:, 0]``;
2. ours: the same call signature through ``as_trl_reward_func`` (same token ids,
   length-sorted token-budget micro-batches).

Prints time, peak memory (CUDA: max allocated; CPU: peak RSS growth) and the ratios
(target: peak memory >= 4x lower at equal or better speed).

    python benchmarks/bench_trl_reward_func.py            # B*G = 512, up to 1024 tokens
    python benchmarks/bench_trl_reward_func.py --small    # 64 completions, up to 256 tokens
"""

from __future__ import annotations

import argparse
import os
import random
import string
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reward_model import PeakMemory  # noqa: E402


def make_chat_batch(n: int, group: int, hi: int, seed: int = 0):
    """``n`` completions (``n // group`` prompts, each repeated ``group`` times as GRPO
    does), completion lengths log-normal in characters, clipped to [8, hi]."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.9 + 4.6).round().clamp(8, hi).long().tolist()

    def text(k):
        return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(k))

    questions = [text(rng.randint(16, 64)) for _ in range(n // group)]
    prompts = [[{"role": "user", "content": q}] for q in questions for _ in range(group)]
    completions = [[{"role": "assistant", "content": text(k)}] for k in lengths]
    return prompts, completions


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="64 completions, up to 256 characters")
    p.add_argument("--n", type=int, default=None, help="B*G completions (default 512)")
    p.add_argument("--group", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--max-tokens-per-batch", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=2, help="alternate runs; best time, max peak")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    n, hi = (64, 256) if args.small else (512, 1024)
    n = args.n or n
    device = torch.device(args.device)

    from transformers import LlamaConfig, LlamaForSequenceClassification

    from torchrl_trl.rewards import HFRewardModelWrapper, RewardBatching, RewardRenderer
    from torchrl_trl.rewards.trl_funcs import as_trl_reward_func
    from torchrl_trl.testing import BRACKET_TEMPLATE, make_tokenizer

    tok = make_tokenizer(chat_template=BRACKET_TEMPLATE, padding_side="right")
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, num_labels=1,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval().to(device)
    prompts, completions = make_chat_batch(n, args.group, hi)
    completion_ids = [tok(c[0]["content"], add_special_tokens=False)["input_ids"] for c in completions]

    def trl_path():
        texts = [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        inputs = tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        with torch.inference_mode():
            rewards = model(**inputs).logits[:, 0]
        return rewards.float().cpu(), int(inputs["attention_mask"].sum()), inputs["input_ids"].numel()

    scorer = HFRewardModelWrapper(
        model, renderer=RewardRenderer(tokenizer=tok), batching=RewardBatching(max_tokens_per_batch=args.max_tokens_per_batch)
    )
    func = as_trl_reward_func(scorer)

    def ours():
        before = scorer.processed_tokens
        rewards = func(prompts=prompts, completions=completions, completion_ids=completion_ids)
        return torch.tensor(rewards), None, scorer.processed_tokens - before

    with torch.inference_mode():  # warm-up, not timed
        for w in (64, 256):
            model(input_ids=torch.ones(4, w, dtype=torch.long, device=device))

    results = {}
    for _ in range(args.repeats):  # alternate the two, keep each one's best time
        for name, fn in (("ours", ours), ("trl", trl_path)):
            with PeakMemory(device) as mem:
                t0 = time.perf_counter()
                rewards, real, processed = fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            prev = results.get(name, dict(time=float("inf"), mem=0))
            results[name] = dict(
                rewards=rewards, time=min(dt, prev["time"]), mem=max(mem.peak, prev["mem"]), processed=processed
            )
            if real is not None:
                results["real"] = real

    real = results.pop("real")
    print(f"B*G = {n} chat completions ({n // args.group} prompts x {args.group}), {real} real tokens, "
          f"device {device}, token budget {args.max_tokens_per_batch}")
    print(f"{'method':<6} {'time s':>8} {'peak MiB':>9} {'tokens fed':>11} {'pad eff':>8}")
    for name, r in results.items():
        print(f"{name:<6} {r['time']:>8.2f} {r['mem'] / 2**20:>9.1f} {r['processed']:>11} "
              f"{real / r['processed']:>8.3f}")
    o, t = results["ours"], results["trl"]
    print(f"ours vs trl: peak memory /{t['mem'] / max(o['mem'], 1):.1f}, speed x{t['time'] / o['time']:.2f}, "
          f"max |reward diff| {float((o['rewards'] - t['rewards']).abs().max()):.2e}")


if __name__ == "__main__":
    main()
