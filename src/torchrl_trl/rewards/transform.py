"""The reward transform: any reward scorer as a TorchRL ``Transform`` (:class:`RewardTransform`),
and :class:`HFRewardTransform`, one with a reward-model scorer built for you. A scorer has
``in_keys``, ``out_keys`` (the reward first), ``reward_shape`` and
``score_outputs(td, columns_td=None) -> list[Tensor]`` (one ``[N]`` tensor per out key).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import nn
from torchrl.data import Composite, Unbounded
from torchrl.envs import EnvBase, Transform

from .._checks import key_tuple, strip_next
from .model import HFRewardModelWrapper
from .postprocess import RewardShape, trailing_dims, write_rewards
from .service import RewardServiceClient

__all__ = ["HFRewardTransform", "RewardTransform"]

_BUFFER = object()  # RewardTransform._holder() in a replay buffer
_SCORER_API = ("in_keys", "out_keys", "reward_shape", "score_outputs")


class RewardTransform(Transform):
    """Write a scorer's rewards as TorchRL rewards: into ``next`` on an env's step (a ``ChatEnv``),
    once on a replay buffer's write (append it *after* ``MCAdvantage``), or called as a module.

    Args:
        scorer (scorer): anything with ``in_keys``, ``out_keys``, ``reward_shape`` and
            ``score_outputs`` (see :mod:`torchrl_trl.rewards.transform`).

    Keyword Args:
        reward_key (NestedKey, optional): where the reward goes, *inside* ``"next"``. Defaults
            to ``None``: the scorer's key.
        reward_shape (str, optional): ``"step"`` (``[*B, 1, 1]``), ``"trailing"`` or ``"flat"``.
            Defaults to ``None``: the scorer's.
        accumulate (bool, optional): add to a reward already there instead of overwriting it.
            Defaults to ``False``.

    ``in_keys`` are the scorer's; ``out_keys`` the ``("next", ...)`` keys written, added to
    the env's reward spec. In an env it scores once per step.

    Examples:
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyStackStorage, ReplayBuffer
        >>> from torchrl_trl import RewardFunctionWrapper
        >>> def length(prompts, completions, **kwargs):
        ...     return [float(len(c)) for c in completions]
        >>> rb = ReplayBuffer(storage=LazyStackStorage(8), batch_size=2)
        >>> transform = RewardTransform(RewardFunctionWrapper(length), accumulate=True)
        >>> rb.append_transform(transform)  # doctest: +ELLIPSIS
        ReplayBuffer(...)
        >>> rb.extend(TensorDict({"text": {"prompt": ["q", "q"], "response": ["ab", "abc"]},
        ...                       ("next", "reward"): torch.ones(2, 1, 1)}, [2]))
        tensor([0, 1])
        >>> rb[:]["next", "reward"].flatten().tolist()  # scored on write, added to the 1.0
        [3.0, 4.0]
        >>> rb.sample()["next", "reward"].shape  # not scored again
        torch.Size([2, 1, 1])
    """

    def __init__(self, scorer, *, reward_key: NestedKey | None = None, reward_shape: RewardShape | None = None,
                 accumulate: bool = False) -> None:
        missing = [name for name in _SCORER_API if not hasattr(scorer, name)]
        if missing:
            raise TypeError(
                f"{type(self).__name__}: the scorer needs {', '.join(_SCORER_API)} (expected an HFRewardModelWrapper, "
                f"RewardServiceClient or RewardFunctionWrapper); a {type(scorer).__name__} has no {missing}"
            )
        if not isinstance(accumulate, bool):
            raise TypeError(f"{type(self).__name__}: accumulate must be a bool, got {accumulate!r}")
        keys = [("next", *key_tuple(strip_next(key_tuple(k)))) for k in scorer.out_keys]
        if reward_key is not None:
            keys[0] = ("next", *key_tuple(reward_key))
        self.reward_shape = scorer.reward_shape if reward_shape is None else reward_shape
        trailing_dims(self.reward_shape, type(self).__name__)  # checks the name
        self.accumulate = accumulate
        super().__init__(in_keys=list(scorer.in_keys), out_keys=keys)
        self.scorer = scorer

    def _score_into(self, source: TensorDictBase, dest: TensorDictBase, *, inside_next: bool,
                    columns_td=None) -> TensorDictBase:
        """Score ``source`` into ``dest`` (an env step's ``next`` when ``inside_next``)."""
        for key, value in zip(self.out_keys, self.scorer.score_outputs(source, columns_td)):
            key = strip_next(key) if inside_next else key
            write_rewards(dest, value, key, self.reward_shape, accumulate=self.accumulate)
        return dest

    # env: the policy's output is in the root tensordict, the rewards go to "next"
    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self._score_into(tensordict, next_tensordict, inside_next=True, columns_td=next_tensordict)

    # replay buffer: score once on write ... (an env runs the inverse pass on the policy's output
    # before its step too: _step scores there, so scoring here as well ran the model twice)
    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict is None or isinstance(self._holder(), EnvBase):
            return tensordict
        return self._score_into(tensordict, tensordict, inside_next=False)

    # ... and pass through on sample (and on an env's observations)
    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Score ``tensordict`` and write the reward keys (in a replay buffer: pass the sample
        through, it was scored on write)."""
        if self._holder() is _BUFFER:
            return tensordict
        return self._score_into(tensordict, tensordict, inside_next=False)

    def _holder(self):
        """The env holding this transform, :data:`_BUFFER` in a replay buffer's Compose (no env
        holds it: ``container`` raises ``ValueError``), ``None`` when never attached."""
        try:
            return self.container
        except ValueError:
            return _BUFFER
        except AttributeError:  # never attached
            return None

    def transform_output_spec(self, output_spec: Composite) -> Composite:
        # out_keys are rollout keys ("next", ...); the env's reward spec is relative to "next"
        output_spec = output_spec.clone()
        if "full_reward_spec" in output_spec.keys():
            output_spec["full_reward_spec"] = self.transform_reward_spec(output_spec["full_reward_spec"])
        return output_spec

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        shape = reward_spec.shape + trailing_dims(self.reward_shape, type(self).__name__)
        for key in self.out_keys:
            reward_spec[key[1:]] = Unbounded(shape, dtype=torch.get_default_dtype())
        return reward_spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scorer!r})"


class HFRewardTransform(RewardTransform):
    """A :class:`RewardTransform` of reward-model scores, its scorer built from a path or a model.

    Args:
        scorer (HFRewardModelWrapper, RewardServiceClient, nn.Module, str or os.PathLike): a
            scorer, or a local path / a loaded reward model (wrapped with ``inference_mode=True``).

    Keyword Args:
        reward_key (NestedKey, optional): reward key *inside* ``"next"``. Defaults to ``None``:
            the scorer's without a leading ``"next"``.
        reward_shape (str, optional): ``"step"`` (``[*B, 1, 1]``), ``"trailing"`` or ``"flat"``
            (the scorer's own ``reward_shape`` is not used). Defaults to ``"step"``.
        accumulate (bool, optional): add to a reward already there instead of overwriting it.
            Defaults to ``False``.
        use_ray_service (bool, optional): serve ``scorer`` (a local path) from a Ray actor, a
            :class:`~torchrl_trl.rewards.service.RewardServiceClient`. Defaults to ``False``.
        actor_name (str, optional): the service's name, shared by every transform given it
            (``use_ray_service=True`` only, as the next two). Defaults to ``None`` (a private actor).
        num_cpus (float, optional): the service's Ray CPUs. Defaults to ``None``.
        num_gpus (float, optional): the service's Ray GPUs. Defaults to ``None``.

    Examples:
        >>> import tempfile
        >>> from tensordict import TensorDict
        >>> from torchrl_trl import testing
        >>> transform = HFRewardTransform(testing.tiny_checkpoints(tempfile.mkdtemp()).reward_model)
        >>> rollouts = TensorDict({"text": {"full": ["a nice answer", "no"]}}, batch_size=[2])
        >>> transform(rollouts)["next", "reward"].shape
        torch.Size([2, 1, 1])
    """

    def __init__(
        self, scorer: Any, *, reward_key: NestedKey | None = None, reward_shape: RewardShape = "step",
        accumulate: bool = False, use_ray_service: bool = False,
        actor_name: str | None = None, num_cpus: float | None = None, num_gpus: float | None = None,
    ) -> None:
        service = {"actor_name": actor_name, "num_cpus": num_cpus, "num_gpus": num_gpus}
        service = {k: v for k, v in service.items() if v is not None}
        if service and not use_ray_service:
            raise TypeError(f"HFRewardTransform: {sorted(service)} apply with use_ray_service=True only: "
                            "expected it set")
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
