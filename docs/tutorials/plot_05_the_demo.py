"""
The demo: both directions on a task that learns
===============================================

``torchrl-trl demo --quick``, run as the docs build, and its reward curve. Nobody tells the
policy or the reward model the hidden rule (an answer is better the larger its share of
vowels); they learn it from data:

1. ``trl.RewardTrainer`` learns it from synthetic preference pairs (TRL -> TorchRL);
2. TorchRL GRPO with that reward model: ``LLMCollector`` over a ``ChatEnv`` carrying
   :class:`~torchrl_trl.HFRewardTransform` -> a replay buffer with ``MCAdvantage`` ->
   ``GRPOLoss``;
3. the best rollout of each group, read back out of the TorchRL buffer with
   :func:`~torchrl_trl.best_of_n` and :class:`~torchrl_trl.TorchRLBufferDataset`, trains
   the policy further with ``trl.SFTTrainer`` (TorchRL -> TRL);
4. TRL's ``GRPOTrainer`` trains the same initial policy with TorchRL generating its
   completions (:class:`~torchrl_trl.TorchRLRolloutFunc`) and the same reward model as a
   TRL reward function (:func:`~torchrl_trl.as_trl_reward_func`).

The demo is the command line's example, not library API: the tutorials before this one
take each piece apart.
"""

# %%
# Run it
# ------
# ``torchrl-trl demo --quick --no-progress --output-dir DIR``, called in this process
# through the command's own entry point (the demo silences the libraries' progress bars
# and deprecation warnings itself; our own warnings stay visible). It prints each step and
# a summary table, and writes ``results.json``, ``reward_curve.png`` and the two trained
# policies to ``DIR``.
import json
import tempfile
from pathlib import Path

from torchrl_trl.cli import main

out = Path(tempfile.mkdtemp())
assert main(["demo", "--quick", "--no-progress", "--output-dir", str(out)]) == 0
print(sorted(p.name for p in out.iterdir()))
print(sorted(json.loads((out / "results.json").read_text())))

# %%
# The reward curve
# ----------------
# ``reward_curve.png`` as the demo drew it: the reward model's score (right axis) and the
# hidden rule's true score (left axis) rise together, so the policy learned the rule, not a
# flaw of the reward model; TRL's GRPO fed by TorchRL rollouts (green) learns it too.
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(8, 4.5))
ax.imshow(plt.imread(out / "reward_curve.png"))
ax.set_axis_off()
fig.tight_layout()
