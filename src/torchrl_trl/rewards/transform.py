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

Scoring runs under ``torch.no_grad()`` unless ``inference_mode=False``.

**Shared service** (``use_ray_service=True, actor_name="rm"``): the reward model runs
once, in a named Ray actor shared by every transform (collector, env worker) built with
that name; each transform renders its samples locally and sends token ids (see
:mod:`torchrl_trl.rewards.service`).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

from .model import HFRewardModelWrapper
from .service import SERVICE_ARGS, RewardServiceClient

__all__ = ["HFRewardTransform"]


def _as_tuple(key: NestedKey) -> tuple:
    return (key,) if isinstance(key, str) else tuple(key)


class HFRewardTransform(Transform):
    """Write reward-model scores as TorchRL rewards.

    Args:
        model: a reward model, a local path (loaded with its tokenizer), or an
            :class:`HFRewardModelWrapper` already configured — then it is used exactly
            as configured (its key, shape and gradient mode; e.g. build it with
            :meth:`HFRewardModelWrapper.for_grpo`) and no other argument may be given.

    Keyword Args:
        reward_key: reward key *inside* ``"next"`` (env: ``next_tensordict[reward_key]``;
            buffer: ``td["next", reward_key]``). Defaults to ``"reward"``.
        reward_shape: ``"step"`` (default, ``[*B, 1, 1]`` as ``GSM8KRewardParser`` writes),
            ``"trailing"`` or ``"flat"``.
        accumulate: add to a reward already there (e.g. another parser's) instead of
            overwriting it. Defaults to ``False``.
        inference_mode: score without gradients. Defaults to ``True``.
        use_ray_service: score with a reward model served by a Ray actor, shared by
            every transform given the same ``actor_name`` (TorchRL's ``ModuleTransform`` /
            ``RayRetrieveKL`` idiom). ``model`` must then be a local path. Defaults to
            ``False`` (the model lives in this transform).
        service_backend: ``"ray"`` is the same as ``use_ray_service=True`` (TorchRL
            0.14's newer spelling); ``"direct"``/``None``: in-process.
        actor_name, num_cpus, num_gpus, timeout, max_restarts, max_wait_ms, namespace,
            lifetime: the service's settings, see
            :class:`~torchrl_trl.rewards.service.RewardServiceClient` (only with the
            service).
        **kwargs: any other :class:`HFRewardModelWrapper` argument (``tokenizer``,
            ``policy_tokenizer``, ``max_tokens_per_batch``, ``max_length``,
            ``truncation``, ``head_index``, ``scale``, ...).

    The wrapped scorer is :attr:`scorer` (its counters: ``truncated_count``,
    ``nonfinite_count``, ``padding_efficiency``); with the service it is a
    :class:`~torchrl_trl.rewards.service.RewardServiceClient` (counters:
    ``scorer.stats()``).
    """

    def __init__(
        self,
        model: Any,
        *,
        reward_key: NestedKey | None = None,
        reward_shape: str | None = None,
        accumulate: bool | None = None,
        inference_mode: bool | None = None,
        use_ray_service: bool = False,
        service_backend: str | None = None,
        **kwargs,
    ) -> None:
        if service_backend not in (None, "direct", "ray"):
            raise ValueError(f"service_backend must be 'ray', 'direct' or None, got {service_backend!r}")
        if use_ray_service and service_backend == "direct":
            raise ValueError("use_ray_service=True conflicts with service_backend='direct'")
        use_ray_service = bool(use_ray_service) or service_backend == "ray"
        service_given = sorted(k for k in kwargs if k in SERVICE_ARGS)
        if service_given and not use_ray_service:
            raise TypeError(f"{service_given} only apply with use_ray_service=True")
        if use_ray_service and isinstance(model, HFRewardModelWrapper):
            raise TypeError(
                "use_ray_service=True loads the reward model from a local path inside the "
                "service; pass the path and the wrapper arguments, not a configured "
                "HFRewardModelWrapper"
            )
        if isinstance(model, HFRewardModelWrapper):
            # a configured scorer is used exactly as configured: any setting given here
            # too would be ambiguous
            given = {"reward_key": reward_key, "reward_shape": reward_shape, "accumulate": accumulate,
                     "inference_mode": inference_mode, **kwargs}  # fmt: skip
            given = sorted(k for k, v in given.items() if v is not None)
            if given:
                raise TypeError(
                    f"pass either a configured HFRewardModelWrapper or wrapper arguments, not both "
                    f"(got {given}); the wrapper's own settings are used"
                )
            scorer = model
            reward_key = _as_tuple(scorer.reward_key)
            if reward_key[0] == "next" and len(reward_key) > 1:
                reward_key = reward_key[1:]
        else:
            reward_key = "reward" if reward_key is None else reward_key
            # the service client renders here and scores in the shared actor
            scorer = (RewardServiceClient if use_ray_service else HFRewardModelWrapper)(
                model,
                reward_key=reward_key,
                reward_shape="step" if reward_shape is None else reward_shape,
                accumulate=bool(accumulate),
                inference_mode=True if inference_mode is None else inference_mode,
                **kwargs,
            )
        self._next_reward_key = _as_tuple(reward_key)
        super().__init__(in_keys=list(scorer.in_keys), out_keys=[("next", *self._next_reward_key)])
        self.scorer = scorer

    # env: the policy output is in the root tensordict, the reward goes to "next"
    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        rewards = self.scorer.score(tensordict)
        key = self._next_reward_key
        return self.scorer.write(next_tensordict, rewards, key[0] if len(key) == 1 else key)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return tensordict_reset

    # replay buffer: score once on write ...
    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict is None:
            return tensordict
        rewards = self.scorer.score(tensordict)
        return self.scorer.write(tensordict, rewards, ("next", *self._next_reward_key))

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
        trailing = {"flat": (), "trailing": (1,), "step": (1, 1)}[self.scorer.reward_shape]
        key = self._next_reward_key
        reward_spec[key[0] if len(key) == 1 else key] = Unbounded(
            reward_spec.shape + trailing, dtype=self.scorer.reward_dtype or torch.get_default_dtype()
        )
        return reward_spec
