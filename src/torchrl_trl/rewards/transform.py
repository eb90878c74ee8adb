"""``HFRewardTransform``: score with a Hugging Face reward model inside TorchRL.

Two places to put it:

- **On a ``ChatEnv``** (``env.append_transform(HFRewardTransform(...))``): every
  ``env.step`` scores the conversation so far (the policy output in the root tensordict:
  tokens / text / history ``"full"``) and writes ``("next", "reward")`` ``[*B, 1, 1]``.
  Works turn by turn in multi-turn envs. Put ``KLRewardTransform`` after it: it reads
  ``next["reward"]`` and subtracts the KL term (``RetrieveKL`` on a buffer does the same).
- **On a replay buffer**, to score once when rollouts are written: the buffer runs its
  transforms' ``inv`` from the last appended to the first on ``extend``, so append it
  *after* ``MCAdvantage`` (``rb.append_transform(MCAdvantage(...));
  rb.append_transform(HFRewardTransform(...))``) and it runs first. Sampling from the
  buffer does not score again.
- **Called as a module** (``transform(td)``, or in a ``TensorDictSequential``): scores
  ``td`` and writes ``("next", reward_key)``, as on a buffer write.

``in_keys`` are the keys the scorer reads (tokens + mask, text or history: see
:attr:`HFRewardModelWrapper.in_keys`); ``out_keys`` is ``[("next", reward_key)]``.

The transform composes a scorer and decides where and how the reward is written; the
scorer decides what the model sees and how it is fed:

- an :class:`~torchrl_trl.rewards.HFRewardModelWrapper` (built with its renderer and
  batching objects, or :meth:`~torchrl_trl.rewards.HFRewardModelWrapper.from_pretrained`);
- a :class:`~torchrl_trl.rewards.service.RewardServiceClient`: one reward model in a named
  Ray actor shared by every transform (collector, env worker) attached to that name; each
  renders its samples locally and sends token ids (see :mod:`torchrl_trl.rewards.service`).
  ``HFRewardTransform(path, use_ray_service=True, actor_name="rm", num_gpus=1)`` builds one
  with its defaults (TorchRL's ``ModuleTransform`` spelling);
- a local path or a loaded reward model: wrapped with the defaults, without gradients.

Post-processing composes after it: ``env.append_transform(RewardScaling(loc, scale))``,
``RewardClipping``, :class:`~torchrl_trl.rewards.RunningRewardNorm`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform
from torch import nn

from .._checks import key_tuple, strip_next
from .model import HFRewardModelWrapper, moved_arguments_error
from .service import RewardServiceClient
from .shape import RewardShape, trailing_dims
from .writing import write_rewards

__all__ = ["HFRewardTransform"]


class HFRewardTransform(Transform):
    """Write reward-model scores as TorchRL rewards.

    Args:
        scorer: what scores: an :class:`HFRewardModelWrapper`, a
            :class:`~torchrl_trl.rewards.service.RewardServiceClient`, or a local path / a
            loaded reward model (wrapped with the defaults, ``inference_mode=True``; with
            ``use_ray_service=True`` a path is served by a
            :class:`~torchrl_trl.rewards.service.RewardServiceClient`).

    Keyword Args:
        reward_key: reward key *inside* ``"next"`` (env: ``next_tensordict[reward_key]``;
            buffer: ``td["next", reward_key]``). Defaults to the scorer's ``reward_key``
            without a leading ``"next"`` (``"reward"`` unless it was configured).
        reward_shape: ``"step"`` (default: ``[*B, 1, 1]`` as ``GSM8KRewardParser`` writes
            and ``MCAdvantage`` reads), ``"trailing"`` or ``"flat"``. The transform writes
            the reward: the scorer's own ``reward_shape`` (for its standalone use) is not
            used.
        accumulate: add to a reward already there (e.g. another parser's) instead of
            overwriting it. Defaults to ``False``.
        use_ray_service: serve ``scorer`` (a local path) from a named Ray actor shared by
            every transform given the same ``actor_name`` (TorchRL's ``ModuleTransform`` /
            ``RayRetrieveKL`` idiom). Defaults to ``False``.
        service_backend: ``"ray"`` is the same as ``use_ray_service=True`` (TorchRL
            0.14's newer spelling); ``"direct"``/``None``: in-process.
        actor_name, num_cpus, num_gpus: the service's name and Ray resources (only with
            ``use_ray_service=True``); for its other settings build the
            :class:`~torchrl_trl.rewards.service.RewardServiceClient` and pass it.

    The scorer is :attr:`scorer` (counters: ``truncated_count``, ``nonfinite_count``,
    ``padding_efficiency``; a service client's: ``scorer.stats()``).

    Examples:
        A reward model with a batching policy, scoring rollouts when they are written to a
        buffer-like tensordict, then scaled by TorchRL's ``RewardScaling``:

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
        self,
        scorer: Any,
        *,
        reward_key: NestedKey | None = None,
        reward_shape: RewardShape = "step",
        accumulate: bool = False,
        use_ray_service: bool = False,
        service_backend: str | None = None,
        actor_name: str | None = None,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        **removed,
    ) -> None:
        if removed:
            raise _removed_error(removed)
        if service_backend not in (None, "direct", "ray"):
            raise ValueError(f"service_backend must be 'ray', 'direct' or None, got {service_backend!r}")
        if use_ray_service and service_backend == "direct":
            raise ValueError("use_ray_service=True conflicts with service_backend='direct'")
        use_ray_service = bool(use_ray_service) or service_backend == "ray"
        service = {"actor_name": actor_name, "num_cpus": num_cpus, "num_gpus": num_gpus}
        service = {k: v for k, v in service.items() if v is not None}
        if service and not use_ray_service:
            raise TypeError(f"{sorted(service)} only apply with use_ray_service=True")
        if not isinstance(accumulate, bool):
            raise TypeError(f"accumulate must be a bool, got {accumulate!r}")
        if use_ray_service:
            if not isinstance(scorer, (str, os.PathLike)):
                raise TypeError(
                    "use_ray_service=True serves the reward model from a local path: pass the path, "
                    f"or a RewardServiceClient itself (without use_ray_service), not a {type(scorer).__name__}"
                )
            scorer = RewardServiceClient(scorer, **service)
        elif isinstance(scorer, (str, os.PathLike)) or (
            isinstance(scorer, nn.Module) and not isinstance(scorer, HFRewardModelWrapper)
        ):
            scorer = HFRewardModelWrapper(scorer, inference_mode=True)
        elif not isinstance(scorer, (HFRewardModelWrapper, RewardServiceClient)):
            raise TypeError(
                "scorer must be an HFRewardModelWrapper, a RewardServiceClient, a reward model or a "
                f"local path, got {type(scorer).__name__}"
            )
        if reward_key is None:
            reward_key = strip_next(scorer.reward_key)
        trailing_dims(reward_shape)  # checks the name
        self._next_reward_key = key_tuple(reward_key)
        self.reward_shape, self.accumulate = reward_shape, accumulate
        super().__init__(in_keys=list(scorer.in_keys), out_keys=[("next", *self._next_reward_key)])
        self.scorer = scorer

    def _write(self, tensordict: TensorDictBase, rewards: torch.Tensor, key: NestedKey) -> TensorDictBase:
        return write_rewards(tensordict, rewards, key, self.reward_shape, accumulate=self.accumulate)

    # env: the policy output is in the root tensordict, the reward goes to "next"
    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        rewards = self.scorer.score(tensordict)
        key = self._next_reward_key
        return self._write(next_tensordict, rewards, key[0] if len(key) == 1 else key)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return tensordict_reset

    # replay buffer: score once on write ...
    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict is None:
            return tensordict
        rewards = self.scorer.score(tensordict)
        return self._write(tensordict, rewards, ("next", *self._next_reward_key))

    # ... and pass through on sample
    def _call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Standalone: score ``tensordict`` and write ``("next", reward_key)``. Inside a
        replay buffer this is the sampling path (rollouts were scored when written): a
        no-op."""
        if self.__dict__.get("_container") is not None:
            return tensordict
        return self._inv_call(tensordict)

    def transform_output_spec(self, output_spec):
        # out_keys are rollout keys ("next", ...); the env's reward spec is relative to "next"
        output_spec = output_spec.clone()
        if "full_reward_spec" in output_spec.keys():
            output_spec["full_reward_spec"] = self.transform_reward_spec(output_spec["full_reward_spec"])
        return output_spec

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        key = self._next_reward_key
        reward_spec[key[0] if len(key) == 1 else key] = Unbounded(
            reward_spec.shape + trailing_dims(self.reward_shape), dtype=torch.get_default_dtype()
        )
        return reward_spec


def _removed_error(given: dict) -> TypeError:
    """Arguments the transform no longer forwards: each named with where it goes now."""
    from .service import MODEL_SIDE_ARGS, SERVICE_ARGS

    lines = []
    for name in sorted(given):
        if name in SERVICE_ARGS:
            lines.append(f"{name} moved to RewardServiceClient(path, {name}=...): pass the client as the scorer")
        elif name in MODEL_SIDE_ARGS or name in ("tokenizer", "token_key", "attention_mask_key",
                                                 "inference_mode", "renderer", "batching"):
            lines.append(f"{name} moved to the scorer: HFRewardTransform(HFRewardModelWrapper."
                         f"from_pretrained(path, {name}=...))")
        else:
            lines.append(str(moved_arguments_error("HFRewardTransform", {name: None})).split(": ", 1)[1])
    return TypeError("HFRewardTransform composes a scorer: " + "; ".join(lines))
