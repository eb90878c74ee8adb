"""Score one long-tailed batch with a reward model, in one process:

1. upstream ``torchrl.modules.llm.trl_interop.HFRewardModelWrapper`` on the left-padded
   batch (the only input it accepts);
2. TRL's GRPO reward-model path (``GRPOTrainer`` with a ``PreTrainedModel`` reward func:
   ``tokenizer(texts, padding=True, padding_side="right", add_special_tokens=False)``, one
   forward under ``torch.inference_mode()``, ``logits[:, 0]``), reproduced here;
3. ours: ``torchrl_trl.HFRewardModelWrapper`` on the ragged tokens (length-sorted
   token-budget micro-batches), and ``RewardBatching(packing=True)`` (sequences back to back, one row per
   forward, ``--pack-tokens`` per pack);
4. the zero-padding limit: the same model on the same token ids with no padding at all,
   two ways -- one forward per sequence (``limit_single``), and sequences of identical
   length batched together up to the token budget (``limit_grouped``: every length bucket
   exactly full). The faster one is the limit; ``ours / limit`` is its time over ours.

Prints tokens/s, padding efficiency (real / processed tokens), peak memory (CUDA: max
allocated; CPU: peak RSS growth sampled every millisecond), wall and CPU time and the
ratios. Ours, packed and the limits are timed in ``--repeat`` interleaved rounds after a
warm-up round (best round kept: the machine may be shared); the two baselines once,
during the memory pass, which runs last.
CPU time (``time.process_time``) is steadier than wall time on a loaded machine,
especially with ``--threads 1``.

    python benchmarks/bench_reward_model.py            # 256 seqs, 32..1024 tokens
    python benchmarks/bench_reward_model.py --small    # quick run
    python benchmarks/bench_reward_model.py --small --threads 1 --repeat 5
    python benchmarks/bench_reward_model.py --skip-baselines   # ours / limit only (no 1024-wide padding)
    python benchmarks/bench_reward_model.py --model smollm2 --repeat 1   # the real 135M backbone, 256 chats

``--model smollm2`` scores 256 chats (a user turn and a long-tailed reply, rendered with
SmolLM2's chat template, 32..512 tokens on a CPU, 32..1024 on CUDA) with
SmolLM2-135M-Instruct as a one-label reward model (its score head seeded), in float32 on a
CPU and bfloat16 on CUDA (``--dtype``). Its tokenizer pads with its EOS, as shipped.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import threading
import time

import torch
from tensordict import TensorDict, lazy_stack


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


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
        _malloc_trim()  # hand freed heap back to the OS, or a later method reuses it unseen
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


def make_chats(tok, n, lo, hi, seed=0):
    """``n`` chats (a short user turn, a reply of random words) rendered with ``tok``'s chat
    template, lengths log-normal clipped to [lo, hi]; decode -> encode gives the same ids."""
    import random

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.9 + 5.0).round().clamp(lo, hi).long()
    words = ["the", "answer", "is", "a", "number", "we", "add", "two", "and", "then", "check", "it", "again", "so"]
    seqs = []
    for target in lengths.tolist():
        reply = " ".join(rng.choice(words) for _ in range(target))
        chat = [{"role": "user", "content": f"Tell me about {rng.choice(words)}."}, {"role": "assistant", "content": reply}]
        ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
        ids = ids[: target - 2] if len(ids) > target else ids[:-2]  # cut inside the reply, then close the turn
        text = tok.decode(ids) + "<|im_end|>\n"
        seqs.append(torch.tensor(tok(text, add_special_tokens=False)["input_ids"]))
    return seqs


def limit_single(model, seqs, device):
    """Zero padding: one forward per sequence."""
    with torch.inference_mode():
        return torch.stack([model(input_ids=s[None].to(device)).logits[0, 0] for s in seqs]).float().cpu()


def limit_grouped(model, seqs, device, budget):
    """Zero padding: sequences of identical length stacked, up to ``budget`` tokens a forward."""
    groups = {}
    for i, s in enumerate(seqs):
        groups.setdefault(len(s), []).append(i)
    out = torch.empty(len(seqs))
    with torch.inference_mode():
        for length, index in groups.items():
            rows = max(1, budget // length)
            for k in range(0, len(index), rows):
                sub = index[k : k + rows]
                ids = torch.stack([seqs[i] for i in sub]).to(device)
                out[sub] = model(input_ids=ids).logits[:, 0].float().cpu()
    return out


def print_limits(results: dict, timed: dict, o: dict) -> None:
    """The lines comparing ours (``o``) and packing with the zero-padding limits."""
    limit_name = min(("limit_single", "limit_grouped"), key=lambda k: results[k]["time"])
    lim = results[limit_name]
    ref = results["limit_single"]["rewards"]
    print(f"ours / limit ({limit_name}): wall x{lim['time'] / o['time']:.3f}, "
          f"cpu x{lim['cpu_time'] / o['cpu_time']:.3f} (best limit by cpu: "
          f"x{min(results[k]['cpu_time'] for k in ('limit_single', 'limit_grouped')) / o['cpu_time']:.3f}), "
          f"max |reward diff| {float((o['rewards'] - ref).abs().max()):.2e}")
    for name in (k for k in timed if k.startswith("packed")):
        pk = results[name]
        print(f"{name} / ours (padded micro-batches): wall x{o['time'] / pk['time']:.3f}, "
              f"cpu x{o['cpu_time'] / pk['cpu_time']:.3f}; {name} / limit: cpu "
              f"x{lim['cpu_time'] / pk['cpu_time']:.3f}; max |reward diff| vs limit_single "
              f"{float((pk['rewards'] - ref).abs().max()):.2e}")


def build_model(name: str, dtype: torch.dtype):
    """``(reward model, tokenizer)``: a random 4-layer Llama on the test tokenizer, or the real
    SmolLM2-135M-Instruct as a one-label sequence classifier (score head seeded)."""
    torch.manual_seed(0)
    if name == "smollm2":
        from transformers import AutoModelForSequenceClassification

        from torchrl_trl.testing import smollm2_checkpoint, smollm2_tokenizer

        path = smollm2_checkpoint()
        tok = smollm2_tokenizer(path)  # pad == eos, as shipped
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, torch_dtype=dtype)
        model.config.pad_token_id = tok.pad_token_id
        return model, tok
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from torchrl_trl.testing import make_tokenizer

    tok = make_tokenizer(padding_side="right")
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, num_labels=1,
    )
    return LlamaForSequenceClassification(config).to(dtype), tok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="64 sequences, 32..256 tokens")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--max-tokens-per-batch", type=int, default=8192)
    p.add_argument("--pack-tokens", default=None,
                   help="packing=True token budgets, comma-separated ('' for none; default: half and twice the longest)")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds of ours / packed / limits (>= 1)")
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--skip-baselines", action="store_true", help="only ours, packed and the limits")
    p.add_argument("--skip-limits", action="store_true",
                   help="only ours and the baselines (no limits; packing only at the --pack-tokens given)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                   help="tiny: a random 4-layer Llama; smollm2: the real SmolLM2-135M-Instruct backbone")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: bfloat16 on CUDA, else float32")
    args = p.parse_args()
    n, hi = (64, 256) if args.small else (256, 1024)
    if args.model == "smollm2" and not args.small and args.device == "cpu":
        hi = 512  # a 1024-wide padded batch of a 135M model takes minutes per pass on a CPU
    n = args.n or n
    pack_tokens = args.pack_tokens
    if pack_tokens is None:
        pack_tokens = "" if args.skip_limits else f"{hi // 2},{2 * hi}"
    pack_budgets = [int(x) for x in pack_tokens.split(",") if x]
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    from torchrl.modules.llm.trl_interop import HFRewardModelWrapper as Upstream

    from torchrl_trl.rewards import HFRewardModelWrapper, RewardBatching

    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model, tok = build_model(args.model, dtype)
    model = model.eval().to(device)

    # all end with EOS (tiny) or the closed turn (smollm2): every method scores the same ids
    seqs = make_batch(tok, n, 32, hi) if args.model == "tiny" else make_chats(tok, n, 32, hi)
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

    def scorer_fn(**batching):
        scorer = HFRewardModelWrapper(
            model, attention_mask_key=None, inference_mode=True, batching=RewardBatching(**batching)
        )

        def run():
            before = scorer.processed_tokens
            r = scorer(td_ragged.clone())["reward"]
            return r, scorer.processed_tokens - before

        return run

    timed = {
        "ours": scorer_fn(max_tokens_per_batch=args.max_tokens_per_batch),
        **{f"packed{b}": scorer_fn(max_tokens_per_batch=b, packing=True) for b in pack_budgets},
    }
    limits = {
        "limit_single": lambda: (limit_single(model, seqs, device), real),
        "limit_grouped": lambda: (limit_grouped(model, seqs, device, args.max_tokens_per_batch), real),
    }
    if not args.skip_limits:
        timed.update(limits)
    baselines = {} if args.skip_baselines else {"trl_grpo": trl_path, "upstream": upstream}

    # warm-up (kernels, thread pools), not timed
    with torch.inference_mode():
        for w in (64, 256):
            model(input_ids=padded[:4, -w:], attention_mask=mask[:4, -w:].long())

    def clock(fn):
        t0, c0 = time.perf_counter(), time.process_time()
        rewards, processed = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return rewards, processed, time.perf_counter() - t0, time.process_time() - c0

    rounds = {name: dict(wall=[], cpu=[]) for name in timed}
    for r in range(args.repeat + 1):  # round 0 warms every path up and is not kept
        for name, fn in timed.items():
            _, _, wall, cpu = clock(fn)
            if r:
                rounds[name]["wall"].append(wall)
                rounds[name]["cpu"].append(cpu)
    results = {}
    for name, fn in {**timed, **baselines}.items():  # memory pass (the baselines' only timing)
        with PeakMemory(device) as mem:
            rewards, processed, wall, cpu = clock(fn)
        results[name] = dict(rewards=rewards.detach().float().cpu(), processed=processed, mem=mem.peak,
                             **(rounds.get(name) or dict(wall=[wall], cpu=[cpu])))
    for r in results.values():
        r["time"], r["cpu_time"] = min(r["wall"]), min(r["cpu"])

    print(f"model {args.model} ({dtype}), batch: {n} sequences, {real} real tokens, longest {width}, device {device}, "
          f"threads {torch.get_num_threads()}, token budget {args.max_tokens_per_batch}, "
          f"timed rounds {args.repeat} (best kept), load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'method':<14} {'tokens/s':>10} {'pad eff':>8} {'peak MiB':>9} {'wall s':>8} {'cpu s':>8}  rounds (wall s)")
    for name, r in results.items():
        rounds = " ".join(f"{t:.2f}" for t in r["wall"])
        print(f"{name:<14} {real / r['time']:>10.0f} {real / r['processed']:>8.3f} "
              f"{r['mem'] / 2**20:>9.1f} {r['time']:>8.2f} {r['cpu_time']:>8.2f}  {rounds}")
    o = results["ours"]
    if not args.skip_limits:
        print_limits(results, timed, o)
    for base in baselines:
        b = results[base]
        for name in (k for k in timed if k not in limits):  # ours, then each packing budget
            r = results[name]
            print(f"{name} vs {base}: throughput x{b['time'] / r['time']:.2f}, "
                  f"peak memory /{b['mem'] / max(r['mem'], 1):.1f}, "
                  f"max |reward diff| {float((r['rewards'] - b['rewards']).abs().max()):.2e}")


if __name__ == "__main__":
    main()
