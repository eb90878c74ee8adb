"""The end-to-end demo on a CPU: the policy and the reward model learn a hidden rule (an
answer is better the larger its fraction of vowels) from data. Steps: 1. tiny models
(:mod:`torchrl_trl.testing`); 2. ``trl.RewardTrainer`` on synthetic preference pairs;
3. TorchRL GRPO with that reward model; 4. ``trl.SFTTrainer`` on step 3's best-of-n rollouts
from the TorchRL buffer, from the initial policy; 5. TRL's ``GRPOTrainer`` generating through
:class:`TorchRLRolloutFunc` (``trl_grpo=False`` skips it). Writes a table, ``results.json``,
``reward_curve.png`` and both trained policies (safetensors) to ``output_dir``.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._checks import positive_int
from .model_paths import resolve_model_dir
from .demo_output import quiet_libraries, say, plot_reward_curve, summary_table, write_outputs

__all__ = ["DemoConfig", "plot_reward_curve", "run_demo", "run_trl_grpo", "true_score"]

#: how every checkpoint is loaded (with ``use_safetensors=True`` for weights)
SAFE_LOADING = {"trust_remote_code": False}


def true_score(text: str) -> float:
    """The hidden rule: the fraction of ``text``'s characters that are vowels (0 if empty)."""
    return sum(c in "aeiouAEIOU" for c in text) / len(text) if text else 0.0


@dataclass
class DemoConfig:
    """Settings of :func:`run_demo`; the CLI flags map one to one."""

    output_dir: Path = Path("torchrl_trl_demo")
    iterations: int = 25
    seed: int = 0
    device: str = "cpu"
    policy: Path | None = None
    reward_model: Path | None = None
    quick: bool = False
    group_size: int = 4
    prompts_per_batch: int = 4
    max_new_tokens: int = 12
    lr: float = 3e-3
    reward_pairs: int = 1200
    reward_epochs: int = 2
    sft_steps: int = 20
    trl_grpo: bool = True
    progress: bool = True
    results: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.output_dir = Path(self.output_dir)
        for name in ("iterations", "group_size", "prompts_per_batch", "max_new_tokens", "reward_pairs", "reward_epochs", "sft_steps"):
            positive_int(getattr(self, name), name)
        if self.quick:
            self.iterations = min(self.iterations, 12)
            self.reward_pairs = min(self.reward_pairs, 400)
            self.reward_epochs = 1
            self.sft_steps = min(self.sft_steps, 6)


PROMPTS = [f"say something nice about {thing}" for thing in (
    "cats", "dogs", "the sea", "trees", "music", "bread", "rain", "books",
    "the moon", "coffee", "bikes", "snow", "friends", "tea", "maps", "clocks",
)]


def run_demo(cfg: DemoConfig) -> dict:
    """Run the whole demo; returns (and writes to ``output_dir/results.json``) the numbers."""
    from tensordict import set_list_to_stack

    from . import testing

    policy_arg = None if cfg.policy is None else resolve_model_dir(cfg.policy, "policy")
    rm_arg = None if cfg.reward_model is None else resolve_model_dir(cfg.reward_model, "reward_model")
    set_list_to_stack(True).set()
    quiet_libraries()
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items() if k != "results"}
    results: dict = {"config": config}
    timings: dict[str, float] = {}

    def timed(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        timings[name] = time.perf_counter() - t0
        return out

    checkpoints = timed("build", testing.tiny_checkpoints, cfg.output_dir / "checkpoints", seed=cfg.seed)
    policy_path = policy_arg or checkpoints.policy
    rm_init_path = rm_arg or checkpoints.reward_model
    n_steps = 5 if cfg.trl_grpo else 4
    say(f"[1/{n_steps}] tiny models ready: policy={policy_path}, reward model={rm_init_path}")

    rm_path, rm_accuracy = timed("reward_model", train_reward_model, rm_init_path, cfg)
    results["reward_model"] = {"path": str(rm_path), "heldout_pairwise_accuracy": rm_accuracy}
    say(f"[2/{n_steps}] RewardTrainer done: held-out pairwise accuracy {rm_accuracy:.3f}")

    grpo, model, tokenizer, archive = timed("grpo", run_grpo, policy_path, rm_path, cfg)
    results["grpo"] = grpo
    grpo["policy_path"] = str(_save_policy(model, tokenizer, cfg.output_dir / "policy_grpo"))
    rm_span = _span(grpo["rm_score"])
    say(f"[3/{n_steps}] GRPO done: true score {_span(grpo['true_score'])}, reward-model score {rm_span}")

    sft = results["sft_best_of_n"] = timed("sft", run_best_of_n_sft, policy_path, archive, cfg)
    sft["policy_path"] = str(_save_policy(sft.pop("model"), tokenizer, cfg.output_dir / "policy_sft"))
    sft_span = _span([sft["true_score_before"], sft["true_score_after"]])
    say(f"[4/{n_steps}] SFTTrainer on best-of-n from the TorchRL buffer, initial policy: true score {sft_span}")

    if cfg.trl_grpo:
        trl = timed("trl_grpo", run_trl_grpo, policy_path, rm_path, cfg)
        results["trl_grpo"] = trl
        fresh = _span([trl["true_score_before"], trl["true_score_after"]])
        say(f"[5/5] TRL GRPOTrainer on TorchRL rollouts: true score {_span(trl['true_score'])} (fresh samples {fresh})")

    results["timings_s"] = timings
    write_outputs(results, cfg.output_dir)
    say(summary_table(results))
    say(
        f"wrote {cfg.output_dir / 'results.json'}, {cfg.output_dir / 'reward_curve.png'} and the trained "
        f"policies {grpo['policy_path']}, {sft['policy_path']}"
    )
    cfg.results = results
    return results


def preference_pairs(tokenizer, n: int, seed: int, max_tokens: int) -> list[dict]:
    """``n`` conversational pairs (``prompt``/``chosen``/``rejected``) of random non-special
    tokens, as the untrained policy writes, ranked by the hidden rule (near-ties skipped)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]

    def answer() -> str:
        while True:
            text = tokenizer.decode([rng.choice(vocab) for _ in range(rng.randint(3, max_tokens))])
            if text.strip():
                return text

    pairs = []
    while len(pairs) < n:
        a, b = answer(), answer()
        sa, sb = true_score(a), true_score(b)
        if abs(sa - sb) < 0.05:
            continue
        chosen, rejected = (a, b) if sa > sb else (b, a)
        pairs.append({
            "prompt": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        })
    return pairs


def train_reward_model(init_path: Path, cfg: DemoConfig) -> tuple[Path, float]:
    """Step 2: train ``init_path`` with ``trl.RewardTrainer``; its output dir and held-out accuracy."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from torchrl_trl import HFRewardModelWrapper

    tokenizer = AutoTokenizer.from_pretrained(init_path, **SAFE_LOADING)
    model = AutoModelForSequenceClassification.from_pretrained(init_path, use_safetensors=True, **SAFE_LOADING)
    dataset = Dataset.from_list(preference_pairs(tokenizer, cfg.reward_pairs, cfg.seed, cfg.max_new_tokens))
    heldout = preference_pairs(tokenizer, 200, cfg.seed + 10_000, cfg.max_new_tokens)
    out_dir = cfg.output_dir / "reward_model"
    args = RewardConfig(
        **_quiet_trainer_args(cfg, out_dir), per_device_train_batch_size=16, num_train_epochs=cfg.reward_epochs,
        learning_rate=3e-3,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    _train_quietly(trainer)
    trainer.save_model(str(out_dir))
    tokenizer.save_pretrained(out_dir)

    scorer = HFRewardModelWrapper.from_pretrained(out_dir, inference_mode=True, device=cfg.device)
    chosen = scorer.score_messages([p["prompt"] + p["chosen"] for p in heldout])
    rejected = scorer.score_messages([p["prompt"] + p["rejected"] for p in heldout])
    return out_dir, float((chosen > rejected).float().mean())


def run_grpo(policy_path: Path, rm_path: Path, cfg: DemoConfig) -> tuple[dict, Any, Any, Any]:
    """Step 3, TorchRL GRPO (``LLMCollector`` over ``ChatEnv`` + ``HFRewardTransform`` ->
    ``MCAdvantage`` -> ``GRPOLoss``): ``(per-iteration scores, model, tokenizer, archive)``,
    ``archive`` a buffer of every scored rollout."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
    from torchrl.objectives.llm.grpo import GRPOLoss, MCAdvantage
    from tqdm.auto import tqdm

    from torchrl_trl import HFRewardModelWrapper, HFRewardTransform, RewardRenderer, layouts, testing

    model, tokenizer = _load_policy(policy_path, cfg)
    rows = [{"query": p} for p in PROMPTS]
    env = testing.make_chat_env(rows, batch_size=cfg.prompts_per_batch, group_size=cfg.group_size)
    scorer = HFRewardModelWrapper.for_grpo(str(rm_path), renderer=RewardRenderer(policy_tokenizer=tokenizer))
    env = env.append_transform(HFRewardTransform(scorer))
    sampler = testing.make_policy_wrapper(model, tokenizer, max_new_tokens=cfg.max_new_tokens, device=cfg.device)
    learner = testing.make_policy_wrapper(model, tokenizer, generate=False, device=cfg.device)
    loss_fn = GRPOLoss(learner, entropy_coeff=0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)

    turns_per_iteration = cfg.prompts_per_batch * cfg.group_size * 4
    buffer = ReplayBuffer(
        storage=LazyStackStorage(turns_per_iteration * 2), sampler=SamplerWithoutReplacement(),
        batch_size=cfg.prompts_per_batch * cfg.group_size,
    )
    buffer.append_transform(MCAdvantage(grpo_size=cfg.group_size))
    archive = ReplayBuffer(storage=LazyStackStorage(turns_per_iteration * cfg.iterations))
    collector = LLMCollector(
        env=env, policy=sampler, dialog_turns_per_batch=turns_per_iteration, replay_buffer=buffer,
        total_dialog_turns=turns_per_iteration * cfg.iterations,
    )
    rm_scores, true_scores = [], []
    for _ in tqdm(collector, total=cfg.iterations, desc="GRPO", disable=not cfg.progress):
        rollouts = buffer[:]
        archive.extend(rollouts)
        rewards = torch.stack(layouts.read_column(rollouts, layouts.REWARD_KEY)).float()
        rm_scores.append(float(rewards.mean()))
        true_scores.append(_mean_true_score(layouts.read_text(rollouts, "response")))
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
    return {"rm_score": rm_scores, "true_score": true_scores}, model, tokenizer, archive


def run_trl_grpo(policy_path: Path, rm_path: Path, cfg: DemoConfig) -> dict:
    """Step 5, TRL's ``GRPOTrainer`` generating through :class:`TorchRLRolloutFunc`: one
    iteration = ``prompts_per_batch * group_size * 4`` completions and 4 optimizer steps, as
    in step 3. Returns each iteration's mean true score and before/after samples'."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from torchrl_trl import HFRewardModelWrapper, as_trl_reward_func, testing
    from torchrl_trl.online import TorchRLRolloutFunc

    torch.manual_seed(cfg.seed)
    model, tokenizer = _load_policy(policy_path, cfg)
    before = measure_true_score(model, tokenizer, cfg)
    policy = testing.make_policy_wrapper(model, tokenizer, max_new_tokens=cfg.max_new_tokens, device=cfg.device)
    rollout = TorchRLRolloutFunc(policy)  # shares the trainer's weights: on-policy
    true_scores: list[float] = []

    def rollout_func(prompts, trainer):
        batch = rollout(prompts, trainer)
        texts = tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
        true_scores.append(_mean_true_score(texts))
        return batch

    reward = as_trl_reward_func(HFRewardModelWrapper.from_pretrained(rm_path, inference_mode=True, device=cfg.device))
    args = GRPOConfig(
        **_quiet_trainer_args(cfg, cfg.output_dir / "trl_grpo"), steps_per_generation=4, num_generations=cfg.group_size,
        per_device_train_batch_size=cfg.prompts_per_batch * cfg.group_size, max_completion_length=cfg.max_new_tokens,
        max_steps=4 * cfg.iterations, learning_rate=cfg.lr, beta=0.0, gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=args, processing_class=tokenizer, rollout_func=rollout_func,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]}),
    )
    _train_quietly(trainer)
    after = measure_true_score(model.eval(), tokenizer, cfg)
    return {
        "true_score": true_scores, "true_score_before": before, "true_score_after": after,
        "rollout_calls": rollout.calls, "samples": rollout.samples,
    }


def _span(scores: list[float]) -> str:
    return f"{scores[0]:.3f} -> {scores[-1]:.3f}"


def _mean_true_score(texts: list[str]) -> float:
    return sum(map(true_score, texts)) / max(len(texts), 1)


def run_best_of_n_sft(policy_path: Path, archive, cfg: DemoConfig) -> dict:
    """Step 4: each prompt group's best-rewarded reply in ``archive`` trains the initial
    policy with ``trl.SFTTrainer``. Returns the true score of fresh samples before and after,
    the number of rows and the trained ``model``."""
    from trl import SFTConfig, SFTTrainer

    from torchrl_trl import TorchRLBufferDataset, best_of_n

    model, tokenizer = _load_policy(policy_path, cfg)
    best = best_of_n(archive, k=1)
    # MCAdvantage's regrouping keeps ("history", "full") but not the prompt/response
    # split, so train on whole chats and let the template's generation tags mask the prompt
    dataset = TorchRLBufferDataset(best, batch_size=8, format="sft_messages", reading="epoch")
    before = measure_true_score(model, tokenizer, cfg)
    args = SFTConfig(
        **_quiet_trainer_args(cfg, cfg.output_dir / "sft"), per_device_train_batch_size=8, max_steps=cfg.sft_steps,
        learning_rate=1e-2, assistant_only_loss=True,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset.as_hf_dataset(), processing_class=tokenizer)
    _train_quietly(trainer)
    after = measure_true_score(model.eval(), tokenizer, cfg)
    return {"rows": len(best), "true_score_before": before, "true_score_after": after, "model": model}


def measure_true_score(model, tokenizer, cfg: DemoConfig, samples_per_prompt: int = 4) -> float:
    """Mean hidden-rule score of freshly sampled answers to every demo prompt."""
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    inputs = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
    ).to(cfg.device)
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the caller's CPU generator is left as it was
        torch.manual_seed(cfg.seed + 1)
        out = model.generate(
            **inputs, max_new_tokens=cfg.max_new_tokens, do_sample=True, num_return_sequences=samples_per_prompt
        )
    texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return _mean_true_score(texts)


def _load_policy(path: Path, cfg: DemoConfig):
    """``(model, tokenizer)`` of the causal LM at ``path``, on ``cfg.device``, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **SAFE_LOADING)
    model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, **SAFE_LOADING)
    return model.to(cfg.device).eval(), tokenizer


def _save_policy(model, tokenizer, path: Path) -> Path:
    """``save_pretrained`` (safetensors) of ``model`` and its tokenizer; returns ``path``."""
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _quiet_trainer_args(cfg: DemoConfig, output_dir: Path) -> dict:
    """TRL config arguments shared by the demo's trainers: constant LR, no checkpoints or loggers, float32."""
    return dict(
        output_dir=str(output_dir), lr_scheduler_type="constant", logging_steps=1000, save_strategy="no",
        report_to=[], use_cpu=cfg.device == "cpu", bf16=False, seed=cfg.seed, disable_tqdm=True,
    )


def _train_quietly(trainer) -> None:
    """``trainer.train()`` without the per-log metric dicts printed to stdout."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
