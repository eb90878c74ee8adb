"""Loading a Hugging Face reward model and its tokenizer from a local directory."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

__all__ = ["load_reward_model"]


def load_reward_model(
    path: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    load_tokenizer: bool = True,
    **model_kwargs,
) -> tuple[nn.Module, Any]:
    """Load ``AutoModelForSequenceClassification`` (safetensors only) and its tokenizer
    from a local directory, e.g. one written by ``trl.RewardTrainer.save_model``.

    Returns:
        ``(model in eval mode, tokenizer or None)``.

    Examples:
        >>> import tempfile
        >>> from torchrl_trl import testing
        >>> paths = testing.tiny_checkpoints(tempfile.mkdtemp())
        >>> model, tokenizer = load_reward_model(paths.reward_model)
        >>> model.training, model.config.num_labels
        (False, 1)
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.fspath(path)
    kwargs = dict(use_safetensors=True, trust_remote_code=trust_remote_code, **model_kwargs)
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    if device is not None:
        model = model.to(device)
    tokenizer = None
    if load_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer
