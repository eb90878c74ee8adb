"""The end-to-end demo on a CPU: the policy and a reward model learn a task from data, and a true
score the reward model never sees says whether they did (the tasks: :mod:`.demo_tasks`).

Steps: 1. the models (``model="tiny"``: tiny random ones; ``"smollm2"``: SmolLM2-135M-Instruct);
2. ``trl.RewardTrainer`` on preference pairs written by a rule; 3. TorchRL GRPO with that reward
model; 4. ``trl.SFTTrainer`` on step 3's best-of-n rollouts from the TorchRL buffer, from the initial
policy; 5. TRL's ``GRPOTrainer`` generating through :class:`TorchRLRolloutFunc` (``trl_grpo=False``
skips it). Writes a table, ``results.json``, ``reward_curve.png`` and both trained policies.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .._checks import positive_int
from .demo_output import plot_reward_curve, quiet_libraries, say, summary_table, write_outputs
from .demo_tasks import TASKS, DemoTask
from .model_paths import resolve_model_dir

__all__ = ["PRESETS", "DemoConfig", "plot_reward_curve", "run_demo", "run_trl_grpo"]

#: SmolLM2's chat template opens every chat with this line when none is given; TorchRL's ChatEnv does
#: not, so the demo gives it explicitly: the policy trains on the prompts it is measured on
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

#: each model's settings; a :class:`DemoConfig` field left ``None`` takes its model's value
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        task="vowels", iterations=25, group_size=4, prompts_per_batch=4, updates_per_iteration=4,
        max_new_tokens=12, lr=3e-3, reward_pairs=1200, reward_epochs=2, reward_lr=3e-3, reward_head_only=False,
        sft_steps=20, sft_lr=1e-2, eval_samples=4, system_prompt=None,
    ),
    # measured to fit 10 minutes on 2 idle CPU cores; see README "The demo on a real model"
    "smollm2": dict(
        task="arithmetic", iterations=10, group_size=4, prompts_per_batch=4, updates_per_iteration=1,
        max_new_tokens=12, lr=2e-5, reward_pairs=256, reward_epochs=1, reward_lr=1e-2, reward_head_only=True,
        sft_steps=8, sft_lr=2e-5, eval_samples=0, system_prompt=SMOLLM2_SYSTEM_PROMPT,
    ),
}


@dataclass
class DemoConfig:
    """Settings of :func:`run_demo`. ``model`` picks the models and the task (:data:`PRESETS`); every field
    left ``None`` takes that model's value. ``eval_samples=0``: true score of greedy answers, else of
    ``eval_samples`` sampled answers per prompt."""

    output_dir: Path = Path("torchrl_trl_demo")
    model: str = "tiny"
    seed: int = 0
    device: str = "cpu"
    policy: Path | None = None
    reward_model: Path | None = None
    quick: bool = False
    trl_grpo: bool = True
    progress: bool = True
    task: str | None = None
    iterations: int | None = None
    group_size: int | None = None
    prompts_per_batch: int | None = None
    updates_per_iteration: int | None = None
    max_new_tokens: int | None = None
    lr: float | None = None
    reward_pairs: int | None = None
    reward_epochs: int | None = None
    reward_lr: float | None = None
    reward_head_only: bool | None = None
    sft_steps: int | None = None
    sft_lr: float | None = None
    eval_samples: int | None = None
    system_prompt: str | None = None

    def __post_init__(self):
        self.output_dir = Path(self.output_dir)
        if self.model not in PRESETS:
            raise ValueError(f"DemoConfig: model must be one of {sorted(PRESETS)}, got {self.model!r}")
        for name, value in PRESETS[self.model].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.task not in TASKS:
            raise ValueError(f"DemoConfig: task must be one of {sorted(TASKS)}, got {self.task!r}")
        for name in ("iterations", "group_size", "prompts_per_batch", "updates_per_iteration", "max_new_tokens",
                     "reward_pairs", "reward_epochs", "sft_steps"):
            positive_int(getattr(self, name), f"DemoConfig: {name}")
        if self.quick:
            self.iterations = min(self.iterations, 12)
            self.reward_pairs = min(self.reward_pairs, 400)
            self.reward_epochs = 1
            self.sft_steps = min(self.sft_steps, 6)

    def as_json(self) -> dict:
        """The settings as JSON values (paths as strings), for ``results.json``."""
        return {f.name: str(v) if isinstance(v := getattr(self, f.name), Path) else v for f in fields(self)}


def run_demo(cfg: DemoConfig) -> dict:
    """Run the whole demo; returns (and writes to ``output_dir/results.json``) the numbers."""
    from tensordict import set_list_to_stack

    policy_arg = None if cfg.policy is None else resolve_model_dir(cfg.policy, "policy")
    rm_arg = None if cfg.reward_model is None else resolve_model_dir(cfg.reward_model, "reward_model")
    set_list_to_stack(True).set()
    quiet_libraries()
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    task = TASKS[cfg.task]()
    results: dict = {"config": cfg.as_json(), "task": task.name, "score_label": task.score_label}
    timings: dict[str, float] = {}

    def timed(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        timings[name] = time.perf_counter() - t0
        return out

    policy_init, rm_init = timed("build", _initial_checkpoints, cfg)
    policy_path, rm_init_path = policy_arg or policy_init, rm_arg or rm_init
    n_steps = 5 if cfg.trl_grpo else 4
    say(f"[1/{n_steps}] models ready ({cfg.model}, task {task.name}): policy={policy_path}, reward model={rm_init_path}")

    rm = results["reward_model"] = timed("reward_model", train_reward_model, rm_init_path, task, cfg)
    say(f"[2/{n_steps}] RewardTrainer done: held-out pairwise accuracy {_span(rm['heldout_pairwise_accuracy'])}")

    grpo, model, tokenizer, archive = timed("grpo", run_grpo, policy_path, Path(rm["path"]), task, cfg)
    results["grpo"] = grpo
    grpo["policy_path"] = str(_save_policy(model, tokenizer, cfg.output_dir / "policy_grpo"))
    say(f"[3/{n_steps}] GRPO done: true score {_before_after(grpo)}, reward-model score {_span(grpo['rm_score'])}")

    sft = results["sft_best_of_n"] = timed("sft", run_best_of_n_sft, policy_path, archive, task, cfg)
    sft["policy_path"] = str(_save_policy(sft.pop("model"), tokenizer, cfg.output_dir / "policy_sft"))
    say(f"[4/{n_steps}] SFTTrainer on best-of-n from the TorchRL buffer, initial policy: true score {_before_after(sft)}")

    if cfg.trl_grpo:
        trl = results["trl_grpo"] = timed("trl_grpo", run_trl_grpo, policy_path, Path(rm["path"]), task, cfg)
        say(f"[5/5] TRL GRPOTrainer on TorchRL rollouts: true score {_before_after(trl)} (training samples {_span(trl['true_score'])})")

    results["timings_s"] = timings
    write_outputs(results, cfg.output_dir)
    say(summary_table(results))
    say(
        f"wrote {cfg.output_dir / 'results.json'}, {cfg.output_dir / 'reward_curve.png'} and the trained "
        f"policies {grpo['policy_path']}, {sft['policy_path']} ({sum(timings.values()):.0f} s)"
    )
    return results


def _initial_checkpoints(cfg: DemoConfig) -> tuple[Path, Path]:
    """The policy and the reward model's starting point: tiny ones, or SmolLM2-135M-Instruct for both."""
    from .. import testing

    if cfg.model == "smollm2":
        path = testing.smollm2_checkpoint()
        return path, path
    checkpoints = testing.tiny_checkpoints(cfg.output_dir / "checkpoints", seed=cfg.seed)
    return checkpoints.policy, checkpoints.reward_model


def train_reward_model(init_path: Path, task: DemoTask, cfg: DemoConfig) -> dict:
    """Step 2: ``trl.RewardTrainer`` on ``task``'s pairs from ``init_path`` (only the score head when
    ``cfg.reward_head_only``). Returns its dir and held-out pairwise accuracy before and after."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from torchrl_trl.rewards.model import load_reward_model

    torch.manual_seed(cfg.seed)
    model, tokenizer = load_reward_model(init_path, num_labels=1)  # a new score head on a policy checkpoint
    model.config.pad_token_id = tokenizer.pad_token_id
    if cfg.reward_head_only:
        model.base_model.requires_grad_(False)  # the head learns from the backbone's features: seconds on a CPU
    dataset = Dataset.from_list(task.preference_pairs(tokenizer, cfg.reward_pairs, cfg.seed))
    heldout = task.preference_pairs(tokenizer, 100, cfg.seed + 10_000, heldout=True)
    before = _pairwise_accuracy(model.eval(), tokenizer, heldout)
    out_dir = cfg.output_dir / "reward_model"
    args = RewardConfig(
        **_quiet_trainer_args(cfg, out_dir), per_device_train_batch_size=16, num_train_epochs=cfg.reward_epochs,
        learning_rate=cfg.reward_lr,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    _train_quietly(trainer)
    trainer.save_model(str(out_dir))  # with its processing_class, the tokenizer
    after = _pairwise_accuracy(model.eval(), tokenizer, heldout)
    return {"path": str(out_dir), "heldout_pairwise_accuracy": [before, after]}


def _pairwise_accuracy(model, tokenizer, pairs: list[dict]) -> float:
    """Share of ``pairs`` whose chosen chat the reward ``model`` scores above the rejected one."""
    from torchrl_trl import HFRewardModelWrapper, RewardRenderer

    scorer = HFRewardModelWrapper(model, inference_mode=True, renderer=RewardRenderer(tokenizer=tokenizer))
    chosen = scorer.score_messages([p["prompt"] + p["chosen"] for p in pairs])
    rejected = scorer.score_messages([p["prompt"] + p["rejected"] for p in pairs])
    return float((chosen > rejected).float().mean())


def run_grpo(policy_path: Path, rm_path: Path, task: DemoTask, cfg: DemoConfig) -> tuple[dict, Any, Any, Any]:
    """Step 3, TorchRL GRPO (``LLMCollector`` over ``ChatEnv`` + ``HFRewardTransform`` -> ``MCAdvantage``
    -> ``GRPOLoss``): ``(scores, model, tokenizer, archive)``, ``archive`` a buffer of every scored rollout."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
    from torchrl.objectives.llm.grpo import GRPOLoss, MCAdvantage
    from tqdm.auto import tqdm

    from torchrl_trl import HFRewardModelWrapper, HFRewardTransform, RewardRenderer, layouts, testing

    model, tokenizer = _load_policy(policy_path, cfg)
    before = measure_true_score(model, tokenizer, task, cfg)
    env = testing.make_chat_env([{"query": p} for p in task.train_prompts], batch_size=cfg.prompts_per_batch,
                                group_size=cfg.group_size, system_prompt=cfg.system_prompt)
    scorer = HFRewardModelWrapper.for_grpo(str(rm_path), renderer=RewardRenderer(policy_tokenizer=tokenizer))
    env = env.append_transform(HFRewardTransform(scorer))
    sampler = testing.make_policy_wrapper(model, tokenizer, max_new_tokens=cfg.max_new_tokens, device=cfg.device)
    learner = testing.make_policy_wrapper(model, tokenizer, generate=False, device=cfg.device)
    loss_fn = GRPOLoss(learner, entropy_coeff=0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)

    batch_size = cfg.prompts_per_batch * cfg.group_size
    turns_per_iteration = batch_size * cfg.updates_per_iteration
    buffer = ReplayBuffer(
        storage=LazyStackStorage(turns_per_iteration * 2), sampler=SamplerWithoutReplacement(), batch_size=batch_size,
    )
    buffer.append_transform(MCAdvantage(grpo_size=cfg.group_size))
    archive = ReplayBuffer(storage=LazyStackStorage(turns_per_iteration * cfg.iterations))
    collector = LLMCollector(
        env=env, policy=sampler, dialog_turns_per_batch=turns_per_iteration,
        total_dialog_turns=turns_per_iteration * cfg.iterations,
    )
    rm_scores, true_scores = [], []
    for rollouts in tqdm(collector, total=cfg.iterations, desc="GRPO", disable=not cfg.progress):
        archive.extend(rollouts.clone())  # as collected: MCAdvantage's regrouping drops the prompt/reply split
        buffer.extend(rollouts)
        rm_scores.append(float(layouts.read_column(rollouts, layouts.REWARD_KEY, stack=True).float().mean()))
        prompts = layouts.read_column(rollouts, "query")
        true_scores.append(_mean_true_score(task, prompts, layouts.read_text(rollouts, "response")))
        for batch in buffer:
            with torch.no_grad():
                batch = learner(batch)  # ("log_probs", "full") of the sampling policy
            loss = loss_fn(batch).loss_objective
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        buffer.empty()
    collector.shutdown()
    after = measure_true_score(model.eval(), tokenizer, task, cfg)
    scores = {"rm_score": rm_scores, "true_score": true_scores, "true_score_before": before, "true_score_after": after}
    return scores, model, tokenizer, archive


def run_best_of_n_sft(policy_path: Path, archive, task: DemoTask, cfg: DemoConfig) -> dict:
    """Step 4: each prompt group's best-rewarded reply in ``archive`` trains the initial policy with
    ``trl.SFTTrainer``. Returns the true scores before and after, the rows and the trained ``model``."""
    from trl import SFTConfig, SFTTrainer

    from torchrl_trl import TorchRLBufferDataset, best_of_n

    model, tokenizer = _load_policy(policy_path, cfg)
    best = best_of_n(archive, k=1, group_size=cfg.group_size)
    dataset = TorchRLBufferDataset(best, batch_size=min(8, len(best)), format="sft_conversational", reading="epoch")
    before = measure_true_score(model, tokenizer, task, cfg)
    args = SFTConfig(
        **_quiet_trainer_args(cfg, cfg.output_dir / "sft"), per_device_train_batch_size=8, max_steps=cfg.sft_steps,
        learning_rate=cfg.sft_lr,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset.as_hf_dataset(), processing_class=tokenizer)
    _train_quietly(trainer)
    after = measure_true_score(model.eval(), tokenizer, task, cfg)
    return {"rows": len(best), "true_score_before": before, "true_score_after": after, "model": model}


def run_trl_grpo(policy_path: Path, rm_path: Path, task: DemoTask, cfg: DemoConfig) -> dict:
    """Step 5, TRL's ``GRPOTrainer`` generating through :class:`TorchRLRolloutFunc`, iterations as in step 3.
    Returns each iteration's mean true score of its samples, and of fresh answers before and after."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from torchrl_trl import HFRewardModelWrapper, as_trl_reward_func, testing
    from torchrl_trl.online import TorchRLRolloutFunc

    torch.manual_seed(cfg.seed)
    model, tokenizer = _load_policy(policy_path, cfg)
    before = measure_true_score(model, tokenizer, task, cfg)
    policy = testing.make_policy_wrapper(model, tokenizer, max_new_tokens=cfg.max_new_tokens, device=cfg.device)
    rollout = TorchRLRolloutFunc(policy)  # shares the trainer's weights: on-policy
    true_scores: list[float] = []

    def rollout_func(prompts, trainer):
        batch = rollout(prompts, trainer)
        replies = tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
        true_scores.append(_mean_true_score(task, [p[-1]["content"] for p in prompts], replies))
        return batch

    reward = as_trl_reward_func(HFRewardModelWrapper.from_pretrained(rm_path, inference_mode=True, device=cfg.device))
    args = GRPOConfig(
        **_quiet_trainer_args(cfg, cfg.output_dir / "trl_grpo"), steps_per_generation=cfg.updates_per_iteration,
        num_generations=cfg.group_size, per_device_train_batch_size=cfg.prompts_per_batch * cfg.group_size,
        max_completion_length=cfg.max_new_tokens, max_steps=cfg.updates_per_iteration * cfg.iterations,
        learning_rate=cfg.lr, beta=0.0, gradient_checkpointing=False,
    )
    _train_quietly(GRPOTrainer(
        model=model, reward_funcs=[reward], args=args, processing_class=tokenizer, rollout_func=rollout_func,
        train_dataset=Dataset.from_dict({"prompt": [_chat(p, cfg) for p in task.train_prompts]}),
    ))
    after = measure_true_score(model.eval(), tokenizer, task, cfg)
    return {
        "true_score": true_scores, "true_score_before": before, "true_score_after": after,
        "rollout_calls": rollout.calls, "samples": rollout.samples,
    }


def measure_true_score(model, tokenizer, task: DemoTask, cfg: DemoConfig) -> float:
    """Mean true score of fresh answers to ``task.heldout_prompts`` (see ``DemoConfig.eval_samples``)."""
    conversations = [_chat(p, cfg) for p in task.heldout_prompts]
    inputs = tokenizer.apply_chat_template(  # left padding: generate continues the last column
        conversations, add_generation_prompt=True, return_tensors="pt", padding=True,
        tokenizer_kwargs={"padding_side": "left"},
    ).to(cfg.device)
    samples = cfg.eval_samples or 1
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the caller's CPU generator is left as it was
        torch.manual_seed(cfg.seed + 1)
        out = model.generate(
            **inputs, max_new_tokens=cfg.max_new_tokens, do_sample=cfg.eval_samples > 0,
            num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id,
        )
    replies = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return _mean_true_score(task, [p for p in task.heldout_prompts for _ in range(samples)], replies)


def _chat(prompt: str, cfg: DemoConfig) -> list[dict]:
    """``prompt`` as a chat's messages, after ``cfg.system_prompt`` if any."""
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return [*system, {"role": "user", "content": prompt}]


def _mean_true_score(task: DemoTask, prompts: list[str], replies: list[str]) -> float:
    if len(prompts) != len(replies):
        raise ValueError(f"_mean_true_score: {len(prompts)} prompts for {len(replies)} replies")
    return sum(map(task.true_score, prompts, replies)) / max(len(replies), 1)


def _span(scores: list[float]) -> str:
    return f"{scores[0]:.3f} -> {scores[-1]:.3f}"


def _before_after(scores: dict) -> str:
    return f"{scores['true_score_before']:.3f} -> {scores['true_score_after']:.3f}"


def _load_policy(path: Path, cfg: DemoConfig):
    """``(model, tokenizer)`` of the causal LM at ``path``, on ``cfg.device``, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, trust_remote_code=False)
    return model.to(cfg.device).eval(), tokenizer


def _save_policy(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _quiet_trainer_args(cfg: DemoConfig, output_dir: Path) -> dict:
    """TRL config arguments of the demo's trainers: constant LR, no checkpoints or loggers, float32."""
    return dict(
        output_dir=str(output_dir), lr_scheduler_type="constant", logging_steps=1000, save_strategy="no",
        report_to=[], use_cpu=cfg.device == "cpu", bf16=False, seed=cfg.seed, disable_tqdm=True,
    )


def _train_quietly(trainer) -> None:
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
