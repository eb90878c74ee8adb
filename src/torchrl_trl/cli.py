"""Command line: ``torchrl-trl demo`` (also ``python -m torchrl_trl demo``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrl-trl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="end-to-end demo on tiny built-in models (no downloads)",
        description=(
            "Train a reward model with trl.RewardTrainer on a hidden rule, run TorchRL GRPO "
            "with it (LLMCollector + ChatEnv + HFRewardTransform -> MCAdvantage -> GRPOLoss), "
            "then train further with trl.SFTTrainer on best-of-n rollouts read from the "
            "TorchRL buffer. Prints a table and writes results.json and reward_curve.png."
        ),
    )
    demo.add_argument("--quick", action="store_true", help="a short run (well under a minute), as the tests use")
    demo.add_argument("--iterations", type=int, default=25, help="GRPO iterations (default: 25; --quick caps it at 12)")
    demo.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same numbers")
    demo.add_argument("--device", default="cpu", help="torch device for the policy and reward model (default: cpu)")
    demo.add_argument("--policy", type=Path, default=None, help="local causal-LM checkpoint dir to use instead of the tiny built-in policy")
    demo.add_argument("--reward-model", type=Path, default=None, help="local sequence-classification checkpoint dir to start the reward model from")
    demo.add_argument("--output-dir", type=Path, default=Path("torchrl_trl_demo"), help="where results.json, reward_curve.png and checkpoints go (default: ./torchrl_trl_demo)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "demo":
        from .demo import DemoConfig, run_demo

        run_demo(
            DemoConfig(
                output_dir=args.output_dir,
                iterations=args.iterations,
                seed=args.seed,
                device=args.device,
                policy=args.policy,
                reward_model=args.reward_model,
                quick=args.quick,
                progress=not args.no_progress,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
