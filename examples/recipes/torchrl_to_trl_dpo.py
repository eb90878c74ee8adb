"""Recipe: TorchRL rollouts -> TRL ``DPOTrainer``, with a real policy and reward model.

1. TorchRL generates: an ``LLMCollector`` runs a ``TransformersWrapper`` (or a
   ``vLLMWrapper``, ``generator: vllm``) over a ``ChatEnv`` that repeats each prompt
   ``group_size`` times; ``HFRewardTransform`` on the env scores every completion with a
   Hugging Face reward model (re-rendered with the reward model's own chat template) and the
   scored chats land in a TorchRL ``ReplayBuffer(LazyStackStorage)``.
2. ``preference_pairs`` turns each group into chosen/rejected pairs (by reward).
3. ``TorchRLBufferDataset(format="dpo_conversational")`` serves the pairs to TRL's
   ``DPOTrainer``, which trains the policy; it is saved under ``output_dir/policy_dpo``.

Run on a GPU machine (downloads the models and prompts from the hub)::

    python examples/recipes/torchrl_to_trl_dpo.py --config examples/recipes/torchrl_to_trl_dpo.yaml

Check that it still builds and runs, offline on CPU with tiny models (one step)::

    python examples/recipes/torchrl_to_trl_dpo.py --dry-run
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402


def collect(cfg: dict, model, tokenizer):
    """Scored rollouts: a TorchRL ``LLMCollector`` fills a ``ReplayBuffer``. Returns it."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer

    c = cfg["collect"]
    env = _common.make_chat_env(_common.load_prompts(cfg["prompts"]), prompts_per_batch=c["prompts_per_batch"],
                                group_size=c["group_size"], system_prompt=cfg.get("system_prompt"))
    env = env.append_transform(_common.reward_transform(cfg, tokenizer))
    turns_per_batch = c["prompts_per_batch"] * c["group_size"]
    total = turns_per_batch * c["batches"]
    buffer = ReplayBuffer(storage=LazyStackStorage(total))
    collector = LLMCollector(env=env, policy=_common.make_sampler(model, tokenizer, cfg),
                             dialog_turns_per_batch=turns_per_batch, replay_buffer=buffer,
                             total_dialog_turns=total)
    start = time.perf_counter()
    model.eval()
    with torch.no_grad():
        for i, _ in enumerate(collector):
            print(f"collected batch {i + 1}/{c['batches']}: {len(buffer)} scored completions", flush=True)
    collector.shutdown()
    rewards = buffer[:].get(("next", "reward")).float().reshape(-1)
    print(f"{len(buffer)} completions in {time.perf_counter() - start:.0f} s; reward mean "
          f"{rewards.mean():.3f} std {rewards.std():.3f}")
    return buffer


def train_dpo(cfg: dict, model, tokenizer, buffer):
    """``preference_pairs`` -> ``TorchRLBufferDataset`` -> ``trl.DPOTrainer``. Returns the trainer."""
    from trl import DPOConfig, DPOTrainer

    from torchrl_trl import EpochPass, TorchRLBufferDataset
    from torchrl_trl.data.preference import preference_pairs

    p = cfg["pairs"]
    pairs = preference_pairs(buffer, strategy=p["strategy"], margin=p["margin"],
                             group_size=cfg["collect"]["group_size"])
    print(f"{len(pairs)} preference pairs; skipped: {pairs.build_stats}")
    d = dict(cfg["dpo"])
    dataset = TorchRLBufferDataset(pairs, batch_size=d["per_device_train_batch_size"],
                                   format="dpo_conversational", reading=EpochPass(shuffle=True, seed=cfg["seed"]))
    on_cpu = cfg["device"] == "cpu"
    args = DPOConfig(
        output_dir=str(Path(cfg["output_dir"]) / "dpo"), seed=cfg["seed"],
        use_cpu=on_cpu, bf16=not on_cpu and d.pop("bf16", True), report_to=d.pop("report_to", []),
        save_strategy="no", **d,
    )
    model.train()
    # ref_model=None: TRL loads the reference from model.config._name_or_path (the hub id)
    trainer = DPOTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=dataset.as_hf_dataset(map_style=True))
    trainer.train()
    return trainer


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], "torchrl_to_trl_dpo.yaml")
    cfg = _common.load_config(args)
    torch.manual_seed(cfg["seed"])
    model, tokenizer = _common.load_policy(cfg)
    buffer = collect(cfg, model, tokenizer)
    gc.collect()  # the reward model went with the env; free its memory before training
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trainer = train_dpo(cfg, model, tokenizer, buffer)
    out = Path(cfg["output_dir"]) / "policy_dpo"
    trainer.save_model(str(out))
    print(f"DPO: {trainer.state.global_step} optimizer steps; policy saved to {out}")


if __name__ == "__main__":
    main()
