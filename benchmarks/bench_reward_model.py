"""Score one long-tailed batch with a reward model three ways, in one process:

1. upstream ``torchrl.modules.llm.trl_interop.HFRewardModelWrapper`` on the left-padded
   batch (the only input it accepts);
2. TRL's GRPO reward-model path (``GRPOTrainer`` with a ``PreTrainedModel`` reward func:
   ``tokenizer(texts, padding=True, padding_side="right", add_special_tokens=False)``, one
   forward under ``torch.inference_mode()``, ``logits[:, 0]``), reproduced here;
3. ours: ``torchrl_trl.HFRewardModelWrapper`` on the ragged tokens (length-sorted
   token-budget micro-batches).

Prints tokens/s, padding efficiency (real / processed tokens) and peak memory (CUDA: max
allocated; CPU: peak RSS growth sampled every millisecond) and the ratios.

    python benchmarks/bench_reward_model.py            # 256 seqs, 32..1024 tokens
    python benchmarks/bench_reward_model.py --small    # quick run
"""

from __future__ import annotations

import argparse
import gc
import os
import threading
import time

import torch
from tensordict import TensorDict, lazy_stack


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory growth during the block (bytes)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        self.base, self._top, self._stop = _rss(), _rss(), False

        def sample():
            while not self._stop:
                self._top = max(self._top, _rss())
                time.sleep(0.001)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self._stop = True
            self._thread.join()
            self.peak = max(self._top, _rss()) - self.base


def make_batch(tok, n, lo, hi, seed=0):
    """``n`` token sequences, lengths log-normal clipped to [lo, hi], each ending with
    EOS, tokenised from text so that decode -> encode gives the same ids back."""
    import random
    import string

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.9 + 5.0).round().clamp(lo, hi).long()
    seqs = []
    for target in lengths.tolist():
        text = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(2 * target))
        ids = tok(text, add_special_tokens=False)["input_ids"][: target - 1]
        ids = tok(tok.decode(ids), add_special_tokens=False)["input_ids"]  # canonical
        seqs.append(torch.tensor(ids + [tok.eos_token_id]))
    return seqs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="64 sequences, 32..256 tokens")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--max-tokens-per-batch", type=int, default=8192)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    n, hi = (64, 256) if args.small else (256, 1024)
    n = args.n or n
    device = torch.device(args.device)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    from transformers import LlamaConfig, LlamaForSequenceClassification
    from torchrl.modules.llm.trl_interop import HFRewardModelWrapper as Upstream

    from torchrl_trl.rewards import HFRewardModelWrapper
    from torchrl_trl.testing import make_tokenizer

    tok = make_tokenizer(padding_side="right")
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, num_labels=1,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval().to(device)

    seqs = make_batch(tok, n, 32, hi)  # all end with EOS: every method scores the same ids
    real = sum(len(s) for s in seqs)
    width = max(len(s) for s in seqs)
    padded = torch.full((n, width), tok.pad_token_id)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, s in enumerate(seqs):  # left-padded, as TransformersWrapper writes
        padded[i, width - len(s) :] = s
        mask[i, width - len(s) :] = True
    td_padded = TensorDict({"tokens": {"full": padded}, "masks": {"all_attention_mask": mask}}, [n])
    td_ragged = lazy_stack([TensorDict({"tokens": {"full": s}}, []) for s in seqs])
    texts = tok.batch_decode([s.tolist() for s in seqs], skip_special_tokens=False)

    def upstream():
        return Upstream(model, inference_mode=True)(td_padded.clone())["reward"], n * width

    def trl_path():
        inputs = tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        with torch.inference_mode():
            r = model(**inputs).logits[:, 0]
        return r.float().cpu(), inputs["input_ids"].numel()

    ours_scorer = HFRewardModelWrapper(
        model, attention_mask_key=None, inference_mode=True, max_tokens_per_batch=args.max_tokens_per_batch
    )

    def ours():
        before = ours_scorer.processed_tokens
        r = ours_scorer(td_ragged.clone())["reward"]
        return r, ours_scorer.processed_tokens - before

    # warm-up (kernels, thread pools), not timed
    with torch.inference_mode():
        for w in (64, 256):
            model(input_ids=padded[:4, -w:], attention_mask=mask[:4, -w:].long())

    results = {}
    for name, fn in (("ours", ours), ("trl_grpo", trl_path), ("upstream", upstream)):
        with PeakMemory(device) as mem:
            t0 = time.perf_counter()
            rewards, processed = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        results[name] = dict(rewards=rewards.detach().float().cpu(), time=dt, processed=processed, mem=mem.peak)

    print(f"batch: {n} sequences, {real} real tokens, longest {width}, device {device}, "
          f"threads {torch.get_num_threads()}, token budget {args.max_tokens_per_batch}")
    print(f"{'method':<10} {'tokens/s':>10} {'pad eff':>8} {'peak MiB':>9} {'time s':>8}")
    for name, r in results.items():
        print(f"{name:<10} {real / r['time']:>10.0f} {real / r['processed']:>8.3f} "
              f"{r['mem'] / 2**20:>9.1f} {r['time']:>8.2f}")
    o = results["ours"]
    for base in ("upstream", "trl_grpo"):
        b = results[base]
        print(f"ours vs {base}: throughput x{b['time'] / o['time']:.2f}, "
              f"peak memory /{b['mem'] / max(o['mem'], 1):.1f}, "
              f"max |reward diff| {float((o['rewards'] - b['rewards']).abs().max()):.2e}")


if __name__ == "__main__":
    main()
