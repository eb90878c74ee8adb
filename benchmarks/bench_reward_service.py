"""N concurrent callers scoring with one shared reward-model service vs N private copies.

Each caller stands for a collector: it sends ``--requests`` requests of ``--batch``
sequences (one env step each; lengths log-normal in [lo, hi]) one after the other, waiting
for each answer. Two set-ups, on a local Ray cluster, same callers (threads here), same
sequences:

- **shared**: one named ``RewardModelService`` actor (``HFRewardTransform(...,
  use_ray_service=True, actor_name=...)``'s service); requests from all callers that meet
  within ``--max-wait-ms`` are scored together in token-budget micro-batches;
- **private**: each caller has its own service actor (a private model copy in its own
  process) and scores its requests alone (no waiting).

Prints sequences/s, forwards, forwards per sequence, padding efficiency (real / processed
tokens), peak RSS per model process and in total, and shared / private ratios. Every
caller's scores are checked to agree between the two set-ups.

    python benchmarks/bench_reward_service.py                 # 4 callers, ~1 minute on 2 cores
    python benchmarks/bench_reward_service.py --callers 8 --hidden 512 --layers 6
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from torchrl_trl import testing  # noqa: E402
from torchrl_trl.layouts import Ragged  # noqa: E402


def build_checkpoint(root: str, hidden: int, layers: int, max_len: int) -> str:
    """A randomly initialised Llama reward model saved with safetensors under ``root``."""
    tok = testing.make_tokenizer()
    model = testing.make_reward_model(
        tok, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=max_len,
    )  # fmt: skip
    path = os.path.join(root, "rm")
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def make_workload(callers: int, requests: int, batch: int, lo: int, hi: int, vocab: int, seed: int = 0):
    """``[caller][request]`` -> ``Ragged`` of ``batch`` random non-special token ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(callers):
        reqs = []
        for _ in range(requests):
            lengths = torch.exp(torch.randn(batch, generator=g) * 0.7 + 4.6).round().clamp(lo, hi).long()
            reqs.append(Ragged.from_list([torch.randint(5, vocab, (n,), generator=g) for n in lengths.tolist()]))
        out.append(reqs)
    return out


def _in_threads(fn, n):
    results, errors = [None] * n, []
    barrier = threading.Barrier(n)

    def run(i):
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def run(mode: str, path: str, workload, args) -> dict:
    from torchrl_trl.rewards import RewardBatching
    from torchrl_trl.rewards.service import RewardServiceClient

    n = len(workload)
    batching = dict(max_tokens_per_batch=args.budget)
    if args.min_fill != "default":
        batching["min_fill"] = args.min_fill
    settings = dict(batching=RewardBatching(**batching))
    if mode == "shared":
        # every caller builds its own client, as each collector builds its own transform;
        # the first creates the actor, the others attach by name
        first = RewardServiceClient(path, remote_config={"name": "bench-reward-service", "num_cpus": args.threads},
                                    max_wait_ms=args.max_wait_ms, **settings)  # fmt: skip
        clients = [first] + [
            RewardServiceClient(path, remote_config={"name": "bench-reward-service"}, **settings)
            for _ in range(n - 1)
        ]
        services = [first]
    else:
        clients = _in_threads(
            lambda i: RewardServiceClient(path, remote_config={"num_cpus": 0.5}, max_wait_ms=0,
                                          **settings),
            n,
        )
        services = clients
    for c in clients:  # warm-up, not measured
        c.score_ids(workload[0][0])
    before = [s.stats() for s in services]
    t0 = time.perf_counter()
    scores = _in_threads(lambda i: [clients[i].score_ids(r) for r in workload[i]], n)
    wall = time.perf_counter() - t0
    after = [s.stats() for s in services]
    for s in services:
        s.shutdown()

    def total(key):
        return sum(a[key] - b[key] for a, b in zip(after, before))

    seqs = total("sequences")
    return dict(
        scores=scores,
        wall=wall,
        seqs_per_s=seqs / wall,
        sequences=seqs,
        forwards=total("forwards"),
        forwards_per_seq=total("forwards") / seqs,
        padding_efficiency=total("real_tokens") / total("processed_tokens"),
        requests_per_flush=total("requests") / max(total("flushes"), 1),
        cpu_ms_per_seq=1000 * total("cpu_seconds") / seqs,
        peak_rss_mib=[a["peak_rss_mib"] for a in after],
        torch_threads=[a["torch_threads"] for a in after],
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--callers", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="requests per caller")
    p.add_argument("--batch", type=int, default=4, help="sequences per request (one env step)")
    p.add_argument("--lo", type=int, default=16)
    p.add_argument("--hi", type=int, default=384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget", type=int, default=4096, help="max_tokens_per_batch")
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--min-fill", type=lambda v: v if v == "default" else None if v == "none" else float(v),
                   default="default",
                   help="the planner's min_fill (a float, or 'none': pack by the budget alone); "
                        "default: RewardBatching's")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the shared service (each private copy gets 1); on a busy "
                        "2-core machine 2 threads were 10x slower than 1")
    args = p.parse_args(argv)

    import ray

    ray.init(num_cpus=max(args.threads, 1) + args.callers, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as root:
            path = build_checkpoint(root, args.hidden, args.layers, args.hi + 8)
            workload = make_workload(args.callers, args.requests, args.batch, args.lo, args.hi,
                                     vocab=len(testing.make_tokenizer()))  # fmt: skip
            res = {mode: run(mode, path, workload, args) for mode in ("shared", "private")}
    finally:
        ray.shutdown()

    diff = max(
        float((a - b).abs().max())
        for ca, cb in zip(res["shared"]["scores"], res["private"]["scores"])
        for a, b in zip(ca, cb)
    )
    n_tok = sum(int(r.lengths.sum()) for c in workload for r in c)
    print(f"{args.callers} callers x {args.requests} requests x {args.batch} sequences "
          f"({n_tok} tokens, lengths {args.lo}..{args.hi}); model hidden={args.hidden} "
          f"layers={args.layers}; budget {args.budget} tokens, min_fill {args.min_fill}; "
          f"max wait {args.max_wait_ms} ms")  # fmt: skip
    print(f"{'':10s} {'seq/s':>8s} {'forwards':>9s} {'fwd/seq':>8s} {'pad eff':>8s} {'req/flush':>9s} "
          f"{'CPU ms/seq':>10s} {'RSS/process MiB':>16s} {'RSS total MiB':>14s} threads")  # fmt: skip
    for mode, r in res.items():
        rss = r["peak_rss_mib"]
        print(f"{mode:10s} {r['seqs_per_s']:8.1f} {r['forwards']:9d} {r['forwards_per_seq']:8.3f} "
              f"{r['padding_efficiency']:8.3f} {r['requests_per_flush']:9.2f} {r['cpu_ms_per_seq']:10.2f} "
              f"{max(rss):16.0f} "
              f"{sum(rss):14.0f} {r['torch_threads']}")  # fmt: skip
    s, q = res["shared"], res["private"]
    print("shared / private:")
    print(f"  sequences/s          {s['seqs_per_s'] / q['seqs_per_s']:.2f}x")
    print(f"  forwards per seq     {s['forwards_per_seq'] / q['forwards_per_seq']:.2f}x")
    print(f"  padding efficiency   {s['padding_efficiency'] / q['padding_efficiency']:.2f}x")
    print(f"  model CPU per seq    {s['cpu_ms_per_seq'] / q['cpu_ms_per_seq']:.2f}x")
    print(f"  model memory (total) {sum(s['peak_rss_mib']) / sum(q['peak_rss_mib']):.2f}x")
    print(f"max |score shared - score private| = {diff:.2e}")


if __name__ == "__main__":
    main()
