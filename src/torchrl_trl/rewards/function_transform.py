"""``RewardFunctionTransform``: TRL-style reward functions inside a TorchRL env's step or a
replay buffer's write.

A thin ``Transform`` around the scorer,
:class:`~torchrl_trl.rewards.functions.RewardFunctionWrapper`, which does the work:

- **On a ``ChatEnv``** (``TransformedEnv(env, RewardFunctionTransform(f))`` or
  ``env.append_transform(...)``): every ``env.step`` scores the policy's output (in the
  root tensordict) with the columns of the step (``"answer"``...) and writes the reward
  into ``next`` (``("next", "reward")`` of the rollout, ``[*B, 1, 1]``).
- **On a replay buffer** (``rb.append_transform(...)``): rollouts are scored once, when
  written (``extend``); sampling does not score again. The buffer runs its transforms'
  write path from the last appended to the first, so append it *after* ``MCAdvantage``.
- **Called directly** (``transform(td)``), standalone or while attached to an env: scores
  ``td`` like the scorer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tensordict import TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

from torchrl_trl._checks import key_tuple, strip_next

from .functions import RewardFunctionWrapper
from .shape import trailing_dims

__all__ = ["RewardFunctionTransform"]


class RewardFunctionTransform(Transform):
    """Write the rewards of TRL-style reward functions as TorchRL rewards, inside an env's
    step or a replay buffer's write.

    Args:
        funcs: a configured :class:`~torchrl_trl.rewards.functions.RewardFunctionWrapper`
            (used as it is: its keys, shape, executor and counters; no other argument may
            be given), or one reward function or a list of them.

    Keyword Args:
        **kwargs: with functions, any :class:`~torchrl_trl.rewards.functions.RewardFunctionWrapper`
            argument (``weights``, ``columns``, ``reward_key``, ``reward_shape``,
            ``executor``, ``timeout``...).

    The scorer is :attr:`scorer` (its counters: ``none_counts``, ``failure_counts``...;
    ``shutdown()`` stops its workers). ``in_keys``/``out_keys`` are the scorer's: the
    keys it reads from a rollout, and ``("next", "reward")`` (plus the per-function keys);
    the env's reward spec gains those keys, shaped per ``reward_shape``.

    Examples:
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyStackStorage, ReplayBuffer
        >>> def length(prompts, completions, **kwargs):
        ...     return [float(len(c)) for c in completions]
        >>> rb = ReplayBuffer(storage=LazyStackStorage(8), batch_size=2)
        >>> transform = RewardFunctionTransform(length)
        >>> rb.append_transform(transform)  # doctest: +ELLIPSIS
        ReplayBuffer(...)
        >>> rb.extend(TensorDict({"text": {"prompt": ["q", "q"], "response": ["ab", "abc"]}}, [2]))
        tensor([0, 1])
        >>> rb[:]["next", "reward"].flatten().tolist()  # scored on write
        [2.0, 3.0]
        >>> transform.scorer.none_counts
        {'length': 0}
        >>> rb.sample()["next", "reward"].shape  # not scored again
        torch.Size([2, 1, 1])
        >>> # called directly (not by a buffer) it scores, like its scorer
        >>> RewardFunctionTransform(length)(TensorDict({"text": {"prompt": ["q"], "response": ["abcd"]}}, [1]))["next", "reward"].flatten()
        tensor([4.])
    """

    def __init__(self, funcs: RewardFunctionWrapper | Callable | Sequence[Callable], **kwargs) -> None:
        if isinstance(funcs, RewardFunctionWrapper):
            if kwargs:
                raise TypeError(
                    f"pass either a configured RewardFunctionWrapper or reward functions with "
                    f"RewardFunctionWrapper arguments, not both (got {sorted(kwargs)}); the "
                    "wrapper's own settings are used"
                )
            scorer = funcs
        else:
            scorer = RewardFunctionWrapper(funcs, **kwargs)
        super().__init__(in_keys=list(scorer.in_keys), out_keys=list(scorer.out_keys))
        self.scorer = scorer

    # env: the policy's output is in the root tensordict, the reward goes to "next"
    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        rewards, per_func = self.scorer.score(tensordict, next_tensordict)
        return self.scorer.write(next_tensordict, rewards, per_func, inside_next=True)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return tensordict_reset

    # replay buffer: score once on write ...
    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.scorer(tensordict)

    # ... and pass through on sample (and on an env's observations)
    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Score ``tensordict`` and write the reward keys, standalone or attached to an
        env. In a replay buffer this is the sampling path, and it passes the sample
        through: the rollouts were scored when written."""
        if self._in_replay_buffer():
            return tensordict
        return self.scorer(tensordict)

    def _in_replay_buffer(self) -> bool:
        # TorchRL's public ``container`` is the env holding the transform (None when
        # standalone); for a transform in a Compose that no env holds, i.e. a replay
        # buffer's transforms, it raises ValueError (torchrl 0.14.1)
        try:
            self.container
        except ValueError:
            return True
        except AttributeError:  # never attached
            return False
        return False

    def transform_output_spec(self, output_spec: Composite) -> Composite:
        # out_keys are rollout keys ("next", ...); the env's reward spec is relative to "next"
        output_spec = output_spec.clone()
        if "full_reward_spec" in output_spec.keys():
            output_spec["full_reward_spec"] = self.transform_reward_spec(output_spec["full_reward_spec"])
        return output_spec

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        shape = reward_spec.shape + trailing_dims(self.scorer.reward_shape)
        for key in self.out_keys:
            key = strip_next(key_tuple(key))
            if len(key) == 1:
                reward_spec.set(key[0], Unbounded(shape))
            else:
                reward_spec.update(Composite({key: Unbounded(shape)}, shape=reward_spec.shape))
        return reward_spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scorer!r})"
