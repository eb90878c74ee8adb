"""``RewardFunctionTransform``: TRL-style reward functions inside a TorchRL env's step or a
replay buffer's write: a :class:`~torchrl_trl.rewards.reward_transform.RewardTransform`
whose scorer, a :class:`~torchrl_trl.rewards.functions.RewardFunctionWrapper`, is built
from the functions (on a ``ChatEnv`` the step's columns, ``"answer"``..., are read too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .functions import RewardFunctionWrapper
from .reward_transform import RewardTransform

__all__ = ["RewardFunctionTransform"]


class RewardFunctionTransform(RewardTransform):
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
        super().__init__(scorer)
