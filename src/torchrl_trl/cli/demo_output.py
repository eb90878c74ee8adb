"""What the demo prints and writes: its messages (the libraries' own chatter silenced), the
summary table, ``results.json`` and the reward curve (``reward_curve.png``)."""

from __future__ import annotations

import functools
import json
import logging
import warnings
from pathlib import Path

__all__ = ["plot_reward_curve", "quiet_libraries", "say", "summary_table", "write_outputs"]


def summary_table(results: dict) -> str:
    """The before/after table the demo prints, one row per phase, from ``run_demo``'s results."""
    grpo, sft, label = results["grpo"], results["sft_best_of_n"], results.get("score_label", "true score")
    rm_accuracy = results["reward_model"]["heldout_pairwise_accuracy"]
    rows = [
        ("reward model held-out pairwise accuracy", rm_accuracy[0], rm_accuracy[-1]),
        ("GRPO reward-model score (its samples)", grpo["rm_score"][0], grpo["rm_score"][-1]),
        (f"GRPO true score ({label})", grpo["true_score_before"], grpo["true_score_after"]),
        ("SFT best-of-n true score", sft["true_score_before"], sft["true_score_after"]),
    ]
    if "trl_grpo" in results:
        trl = results["trl_grpo"]
        rows.append(("TRL GRPO (TorchRL rollouts) true score", trl["true_score_before"], trl["true_score_after"]))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'start':>7}  {'end':>7}", "-" * (width + 18)]
    lines += [f"{name:{width}}  {start:>7.3f}  {end:>7.3f}" for name, start, end in rows]
    return "\n".join(lines)


def write_outputs(results: dict, output_dir: Path) -> None:
    """``results.json`` and (with matplotlib) ``reward_curve.png`` into ``output_dir``."""
    (output_dir / "results.json").write_text(json.dumps(results, indent=2))
    try:
        import matplotlib
    except ImportError:
        say("matplotlib is not installed (pip install 'torchrl-trl[demo]'): no reward_curve.png")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_reward_curve(results)
    fig.savefig(output_dir / "reward_curve.png", dpi=100)
    plt.close(fig)


def plot_reward_curve(results: dict):
    """The demo's ``reward_curve.png`` from ``run_demo``'s ``results``: per GRPO iteration, the true score
    of its samples and of held-out answers before and after (left axis), and the reward model's score
    (right axis). Returns the pyplot figure (needs ``matplotlib``).

    >>> fig = plot_reward_curve({"grpo": {"true_score": [0.18, 0.43], "rm_score": [-1.1, 1.4]}})
    >>> [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    ['true score of its samples, TorchRL GRPO', 'reward-model score, TorchRL GRPO']
    >>> import matplotlib.pyplot as plt; plt.close(fig)
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.6))
    phases = [("grpo", "tab:blue", "TorchRL GRPO"), ("trl_grpo", "tab:green", "TRL GRPO on TorchRL rollouts")]
    for key, color, name in phases:
        if key not in results:
            continue
        scores = results[key]
        ax.plot(scores["true_score"], color=color, label=f"true score of its samples, {name}")
        if "true_score_after" in scores:  # fresh answers to the held-out prompts, first and last iteration
            ends = [0, len(scores["true_score"]) - 1]
            ax.plot(ends, [scores["true_score_before"], scores["true_score_after"]], "o--", color=color, alpha=0.6,
                    label=f"held-out true score before/after, {name}")
    ax2 = ax.twinx()
    ax2.plot(results["grpo"]["rm_score"], color="tab:orange", label="reward-model score, TorchRL GRPO")
    ax.set(xlabel="GRPO iteration", ylabel=f"true score ({results.get('score_label', 'hidden rule')})")
    ax2.set_ylabel("reward-model score")
    # under the axes: inside, it hides the curves' ends
    fig.legend(loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.25, 1, 1))
    return fig


#: one line of the demo's output, flushed at once
say = functools.partial(print, flush=True)


def quiet_libraries() -> None:
    """Silence the libraries' own warnings, logs and progress bars; torchrl_trl's stay."""
    for module in ("torch", "torchrl", "tensordict", "transformers", "trl", "datasets", "accelerate"):
        # anchored: a bare "torch" also matches, and hid, torchrl_trl's own warnings
        pattern = rf"{module}(\.|$)"
        warnings.filterwarnings("ignore", category=UserWarning, module=pattern)
        warnings.filterwarnings("ignore", category=FutureWarning, module=pattern)
    # TRL's notice on every GRPOTrainer with a rollout_func (attributed to the caller's module)
    warnings.filterwarnings("ignore", message=r"You are using 'rollout_func', which is an experimental", category=UserWarning)
    logging.getLogger("torchrl").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
