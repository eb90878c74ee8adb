"""Shared pieces of the recipes: the config file, the ``--dry-run`` stand-ins, prompts,
the TorchRL ``ChatEnv`` and the policy wrapper. Everything TorchRL is built with TorchRL's
own API (its ``TransformersWrapper`` through ``torchrl_trl.safe_policy_wrapper``, for a pad
token that never occurs in a chat); nothing here is specific to one direction."""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent


def parse_args(description: str, default_config: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=str(HERE / default_config),
                        help="YAML (or JSON) config; default: %(default)s")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny offline models from torchrl_trl.testing instead of the hub ids, "
                             "the config's dry_run: sizes, CPU, float32, one step; downloads nothing")
    parser.add_argument("--output-dir", default=None, help="overrides the config's output_dir")
    return parser.parse_args()


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config file as a dict; with ``--dry-run`` its ``dry_run:`` section is merged over
    it and the model ids are replaced by tiny checkpoints saved in a temp dir."""
    path = Path(args.config)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    text = path.read_text()
    if path.suffix == ".json":
        import json

        cfg = json.loads(text)
    else:
        import yaml

        cfg = yaml.safe_load(text)
    overrides = cfg.pop("dry_run", {}) or {}
    if args.dry_run:
        from torchrl_trl.testing import tiny_checkpoints

        cfg = _merge(cfg, overrides)
        ckpts = tiny_checkpoints(tempfile.mkdtemp(prefix="recipe_dry_run_"))
        cfg["policy"] = str(ckpts.policy)
        # the tiny RM has its own tokenizer and chat template, as a real RM of another family
        cfg["reward_model"] = str(ckpts.reward_model_other_tokenizer)
        cfg.update(device="cpu", dtype="float32", generator="transformers")
        cfg["output_dir"] = tempfile.mkdtemp(prefix="recipe_dry_run_out_")
    if args.output_dir:
        cfg["output_dir"] = args.output_dir
    return cfg


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype (expected e.g. 'bfloat16', 'float32')")
    return dtype


def load_prompts(spec: dict) -> list[str]:
    """Prompt strings from ``{"texts": [...]}`` or ``{"dataset": id, "split", "column", "limit",
    "data_files"}`` (``datasets.load_dataset`` arguments, e.g. ``"parquet"`` + ``data_files``);
    a conversational column (a list of ``{"role", "content"}``) gives its last user turn."""
    if "texts" in spec:
        return [str(t) for t in spec["texts"]]
    from datasets import load_dataset

    rows = load_dataset(spec["dataset"], data_files=spec.get("data_files"), split=spec.get("split", "train"))
    if spec.get("limit"):
        rows = rows.select(range(min(int(spec["limit"]), len(rows))))
    prompts = []
    column = spec.get("column", "prompt")
    if column not in rows.column_names:
        raise KeyError(f"prompts.column {column!r} is not a column of {spec['dataset']!r}: {rows.column_names}")
    for i, value in enumerate(rows[column]):
        if isinstance(value, list):
            users = [m["content"] for m in value if m.get("role") == "user"]
            if not users:
                raise ValueError(f"prompts: row {i} of {spec['dataset']!r} has no user turn: {value!r:.200}")
            value = users[-1]
        prompts.append(value)
    return prompts


def make_chat_env(prompts: list[str], *, prompts_per_batch: int, group_size: int, system_prompt=None):
    """A TorchRL ``ChatEnv`` (history mode) over ``prompts``, each repeated ``group_size``
    times in a row (a GRPO group), one assistant turn per episode."""
    from tensordict import set_list_to_stack
    from torch.utils.data import DataLoader
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv

    set_list_to_stack(True).set()  # TorchRL's LLM stack stores chat turns as stacks
    loader = DataLoader(prompts, batch_size=prompts_per_batch, shuffle=True, drop_last=True,
                        collate_fn=lambda qs: {"query": list(qs)})
    env = ChatEnv.from_dataloader(dataloader=loader, batch_size=prompts_per_batch, repeats=group_size,
                                  input_mode="history", system_prompt=system_prompt)
    return env.append_transform(StepCounter(max_steps=1))


def load_policy(cfg: dict):
    """``(model, tokenizer)`` of ``cfg["policy"]`` (safetensors, no remote code) on ``cfg["device"]``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg["policy"])
    model = AutoModelForCausalLM.from_pretrained(
        cfg["policy"], dtype=torch_dtype(cfg.get("policy_dtype", cfg["dtype"])), use_safetensors=True,
        trust_remote_code=False,
    )
    return model.to(cfg["device"]), tokenizer


def policy_wrapper(model, tokenizer, cfg: dict, **kwargs):
    """TorchRL's ``TransformersWrapper`` around ``model`` (history mode, on ``cfg["device"]``),
    built by ``torchrl_trl.safe_policy_wrapper``: a pad token that never occurs in a chat
    (``cfg["pad_token"]``, or one it picks), so no end-of-turn token is taken for padding."""
    from torchrl_trl import safe_policy_wrapper

    return safe_policy_wrapper(model, tokenizer, pad_token=cfg.get("pad_token"), input_mode="history",
                               device=cfg["device"], **kwargs)


def make_sampler(model, tokenizer, cfg: dict):
    """TorchRL's generating policy: :func:`policy_wrapper` around ``model``, or a
    ``vLLMWrapper`` around a vLLM engine on ``cfg["policy"]`` when ``generator: vllm``."""
    gen = dict(cfg["generation"])
    if cfg.get("generator", "transformers") == "vllm":
        from torchrl.modules.llm import vLLMWrapper
        from vllm import LLM  # only when asked: vLLM is not a dependency

        from torchrl_trl.padding import safe_pad_tokenizer

        engine = LLM(model=cfg["policy"], dtype=cfg["dtype"],
                     gpu_memory_utilization=cfg.get("vllm_gpu_memory_utilization", 0.3))
        # TorchRL's vLLMWrapper finds padding as tokens != pad_token_id too: the same safe pad
        return vLLMWrapper(engine, tokenizer=safe_pad_tokenizer(tokenizer, pad_token=cfg.get("pad_token")),
                           input_mode="history", generate=True, return_log_probs=True, generate_kwargs=gen)
    return policy_wrapper(model, tokenizer, cfg, generate=True, return_log_probs=True, generate_kwargs=gen)


def reward_transform(cfg: dict, policy_tokenizer):
    """``HFRewardTransform`` with the config's reward model, re-rendering each chat with the
    reward model's own chat template, writing ``("next", "reward")`` ``[B, 1, 1]``."""
    from torchrl_trl import HFRewardModelWrapper, HFRewardTransform, RewardBatching, RewardRenderer

    rm = cfg["reward"]
    scorer = HFRewardModelWrapper.for_grpo(
        cfg["reward_model"], device=cfg["device"], dtype=torch_dtype(rm.get("dtype", cfg["dtype"])),
        renderer=RewardRenderer(policy_tokenizer=policy_tokenizer),
        batching=RewardBatching(max_tokens_per_batch=rm["max_tokens_per_batch"], max_length=rm.get("max_length"),
                                pad_token_id=rm.get("pad_token_id")),
    )
    return HFRewardTransform(scorer)
