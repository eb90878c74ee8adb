"""Recipe: a Hugging Face reward model scores TorchRL GRPO, with a real policy and reward model.

Each iteration: an ``LLMCollector`` samples ``group_size`` completions per prompt with a
``TransformersWrapper`` over a ``ChatEnv``; ``HFRewardTransform`` on the env scores each
finished chat with a one-label ``AutoModelForSequenceClassification`` reward model
(re-rendered with its own chat template) into ``("next", "reward")`` ``[B, 1, 1]``;
``MCAdvantage`` on the replay buffer turns each group's rewards into advantages; TorchRL's
``GRPOLoss`` is minimised with AdamW over micro-batches (gradients accumulated, one
optimizer step per iteration). The trained policy is saved under ``output_dir/policy_grpo``.

Run on a GPU machine (downloads the models and prompts from the hub)::

    python examples/recipes/hf_reward_to_torchrl_grpo.py --config examples/recipes/hf_reward_to_torchrl_grpo.yaml

Check that it still builds and runs, offline on CPU with tiny models (one step)::

    python examples/recipes/hf_reward_to_torchrl_grpo.py --dry-run
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402


def main() -> None:
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
    from torchrl.objectives.llm.grpo import GRPOLoss, MCAdvantage

    args = _common.parse_args(__doc__.splitlines()[0], "hf_reward_to_torchrl_grpo.yaml")
    cfg = _common.load_config(args)
    torch.manual_seed(cfg["seed"])
    c, g = cfg["collect"], cfg["grpo"]
    model, tokenizer = _common.load_policy(cfg)

    env = _common.make_chat_env(_common.load_prompts(cfg["prompts"]), prompts_per_batch=c["prompts_per_batch"],
                                group_size=c["group_size"], system_prompt=cfg.get("system_prompt"))
    env = env.append_transform(_common.reward_transform(cfg, tokenizer))
    sampler = _common.make_sampler(model, tokenizer, cfg)
    # the same weights, scoring the sampled sequences: ("log_probs", "full") for GRPOLoss
    learner = _common.policy_wrapper(model, tokenizer, cfg, generate=False, return_log_probs=True, pad_output=False)
    loss_fn = GRPOLoss(learner, clip_epsilon=g["clip_epsilon"], entropy_coeff=g["entropy_coeff"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=g["learning_rate"], weight_decay=g["weight_decay"])

    turns = c["prompts_per_batch"] * c["group_size"]
    buffer = ReplayBuffer(storage=LazyStackStorage(turns), sampler=SamplerWithoutReplacement(),
                          batch_size=g["micro_batch_size"])
    buffer.append_transform(MCAdvantage(grpo_size=c["group_size"]))  # group-normalised advantage
    collector = LLMCollector(env=env, policy=sampler, dialog_turns_per_batch=turns, replay_buffer=buffer,
                             total_dialog_turns=turns * g["iterations"])
    start = time.perf_counter()
    for it, _ in enumerate(collector):
        rollouts = buffer[:]
        reward = rollouts.get(("next", "reward")).float().mean().item()
        model.train()
        optimizer.zero_grad()
        n_micro = -(-len(buffer) // g["micro_batch_size"])
        total_loss = 0.0
        for batch in buffer:  # micro-batches without replacement: every rollout once
            with torch.no_grad():
                batch = learner(batch)  # log-probs of the sampling policy (same weights)
            loss = loss_fn(batch).loss_objective / n_micro
            loss.backward()
            total_loss += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), g["max_grad_norm"]).item()
        optimizer.step()
        model.eval()
        buffer.empty()
        print(f"iteration {it + 1}/{g['iterations']}: reward mean {reward:.3f}, loss {total_loss:.4f}, "
              f"grad norm {grad_norm:.3g}, "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    collector.shutdown()
    out = Path(cfg["output_dir"]) / "policy_grpo"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"GRPO: {g['iterations']} optimizer steps; policy saved to {out}")


if __name__ == "__main__":
    main()
