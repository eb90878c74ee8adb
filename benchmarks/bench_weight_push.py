"""Push a trainer's weights into a ``RayLLMCollector`` actor that is generating, in one process:

1. baseline: ``collector.update_policy_weights_(TensorDict({"model": weights}))``, TorchRL's
   documented call, which pickles every tensor through Ray's object store;
2. ours: ``torchrl_trl.online.weights.push_weights(collector, model)``, which (Ray on one
   machine) copies them into memory-mapped files the actor reads in place.

Pushes alternate between the two; prints each one's median seconds per push and the ratio.
The actor keeps generating meanwhile (one core), as in an async GRPO run.

    python benchmarks/bench_weight_push.py                    # SmolLM2-135M-Instruct, 540 MB of float32
    python benchmarks/bench_weight_push.py --policy tiny      # the test suite's policy
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def _env():  # runs in the collector actor
    from torchrl_trl.testing import make_chat_env

    return make_chat_env([{"query": f"what is {i} plus {i}?"} for i in range(8)], batch_size=4, group_size=2)


def _policy(ckpt):  # runs in the collector actor: one thread there
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_trl.testing import make_policy_wrapper

    torch.set_num_threads(1)
    return make_policy_wrapper(AutoModelForCausalLM.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt),
                               max_new_tokens=32)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", choices=("tiny", "smollm2"), default="smollm2")
    p.add_argument("--pushes", type=int, default=5, help="pushes per way (after one warm-up each)")
    args = p.parse_args()

    import ray
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM

    from torchrl_trl import testing
    from torchrl_trl.online import make_ray_collector, make_ray_replay_buffer
    from torchrl_trl.online.weights import push_weights, weights_td

    ckpt = testing.smollm2_checkpoint() if args.policy == "smollm2" else testing.tiny_checkpoints(tempfile.mkdtemp()).policy
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rb = make_ray_replay_buffer(100_000)
    collector = make_ray_collector(_env, partial(_policy, ckpt), rb, dialog_turns_per_batch=4, num_cpus=1)
    collector.start()

    def baseline():
        collector.update_policy_weights_(TensorDict({"model": weights_td(model).cpu()}, batch_size=[]))

    def ours():
        push_weights(collector, model)

    times = {"baseline": [], "ours": []}
    try:
        for i in range(args.pushes + 1):
            for name, push in (("baseline", baseline), ("ours", ours)):
                with torch.no_grad():  # the trainer's step: new weights before each push
                    next(model.parameters()).add_(1e-3)
                start = time.perf_counter()
                push()
                if i:  # the first of each is a warm-up (ours makes its files then)
                    times[name].append(time.perf_counter() - start)
    finally:
        collector.shutdown()
        rb.close()
        ray.shutdown()
    base, mine = (statistics.median(times[k]) for k in ("baseline", "ours"))
    print(f"{args.policy}: {nbytes / 2**20:.0f} MiB of weights, {args.pushes} pushes each, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"baseline update_policy_weights_ {base:.3f} s/push (min {min(times['baseline']):.3f})")
    print(f"ours push_weights               {mine:.3f} s/push (min {min(times['ours']):.3f})")
    print(f"ratio baseline/ours={base / mine:.2f}")


if __name__ == "__main__":
    main()
