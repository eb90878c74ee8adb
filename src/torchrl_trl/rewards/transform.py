"""``HFRewardTransform``: a :class:`~torchrl_trl.rewards.reward_transform.RewardTransform`
scoring with a Hugging Face reward model, built from a path or a model when not given ready.
"""

from __future__ import annotations

import os
from typing import Any

from tensordict.utils import NestedKey
from torch import nn

from .model import HFRewardModelWrapper
from .reward_transform import RewardTransform
from .service import RewardServiceClient
from .shape import RewardShape

__all__ = ["HFRewardTransform"]


class HFRewardTransform(RewardTransform):
    """Write reward-model scores as TorchRL rewards (on an env's step, a buffer's write, or
    called on a tensordict).

    Args:
        scorer (HFRewardModelWrapper, RewardServiceClient, nn.Module, str or os.PathLike): an
            :class:`HFRewardModelWrapper`, a :class:`~torchrl_trl.rewards.service.RewardServiceClient`,
            or a local path / a loaded reward model (wrapped with ``inference_mode=True``; with
            ``use_ray_service=True`` a path is served by a ``RewardServiceClient``).

    Keyword Args:
        reward_key (NestedKey, optional): reward key *inside* ``"next"``. Defaults to ``None``:
            the scorer's without a leading ``"next"``.
        reward_shape (str, optional): ``"step"`` (``[*B, 1, 1]``), ``"trailing"`` or ``"flat"``
            (the scorer's own ``reward_shape`` is not used). Defaults to ``"step"``.
        accumulate (bool, optional): add to a reward already there instead of overwriting it.
            Defaults to ``False``.
        use_ray_service (bool, optional): serve ``scorer`` (a local path) from a named Ray actor
            shared by every transform given the same ``actor_name``. Defaults to ``False``.
        actor_name (str, optional): the service's name (``use_ray_service=True`` only).
            Defaults to ``None`` (a private actor).
        num_cpus (float, optional): the service's Ray CPUs (``use_ray_service=True`` only).
            Defaults to ``None``.
        num_gpus (float, optional): the service's Ray GPUs (``use_ray_service=True`` only).
            Defaults to ``None``.

    The scorer is :attr:`scorer` (with its counters, or a client's ``stats()``).

    Examples:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> from torchrl.envs import RewardScaling
        >>> from torchrl_trl import testing
        >>> from torchrl_trl.rewards import HFRewardModelWrapper, RewardBatching
        >>> paths = testing.tiny_checkpoints(tempfile.mkdtemp())
        >>> scorer = HFRewardModelWrapper.from_pretrained(
        ...     paths.reward_model, inference_mode=True, batching=RewardBatching(max_tokens_per_batch=256))
        >>> transform = HFRewardTransform(scorer, reward_shape="step")
        >>> rollouts = TensorDict({"text": {"full": ["a nice answer", "no"]}}, batch_size=[2])
        >>> rollouts = transform(rollouts)
        >>> rollouts["next", "reward"].shape
        torch.Size([2, 1, 1])
        >>> scaled = RewardScaling(loc=1.0, scale=2.0, in_keys=[("next", "reward")])(rollouts.clone())
        >>> torch.allclose(scaled["next", "reward"], 2 * rollouts["next", "reward"] + 1)
        True
    """

    def __init__(
        self, scorer: Any, *, reward_key: NestedKey | None = None, reward_shape: RewardShape = "step",
        accumulate: bool = False, use_ray_service: bool = False,
        actor_name: str | None = None, num_cpus: float | None = None, num_gpus: float | None = None,
    ) -> None:
        service = {"actor_name": actor_name, "num_cpus": num_cpus, "num_gpus": num_gpus}
        service = {k: v for k, v in service.items() if v is not None}
        if service and not use_ray_service:
            raise TypeError(f"HFRewardTransform: {sorted(service)} apply with use_ray_service=True only")
        if use_ray_service:
            if not isinstance(scorer, (str, os.PathLike)):
                raise TypeError(
                    "HFRewardTransform: use_ray_service=True serves the reward model from a local path: expected the "
                    f"path (or a RewardServiceClient, without use_ray_service), got a {type(scorer).__name__}"
                )
            service["name"] = service.pop("actor_name", None)
            scorer = RewardServiceClient(scorer, remote_config=service)
        elif isinstance(scorer, (str, os.PathLike, nn.Module)) and not isinstance(scorer, HFRewardModelWrapper):
            scorer = HFRewardModelWrapper(scorer, inference_mode=True)
        elif not isinstance(scorer, (HFRewardModelWrapper, RewardServiceClient)):
            raise TypeError(
                "HFRewardTransform: scorer must be an HFRewardModelWrapper, a RewardServiceClient, a reward model "
                f"or a local path, got {type(scorer).__name__}"
            )
        super().__init__(scorer, reward_key=reward_key, reward_shape=reward_shape, accumulate=accumulate)
