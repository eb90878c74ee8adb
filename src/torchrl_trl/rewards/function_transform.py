"""``RewardFunctionTransform``: a :class:`~torchrl_trl.rewards.reward_transform.RewardTransform`
whose scorer is a :class:`~torchrl_trl.rewards.functions.RewardFunctionWrapper` of TRL-style
reward functions.
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
            (used as it is, no other argument allowed), or one reward function or a list.

    Keyword Args:
        **kwargs: with functions, any ``RewardFunctionWrapper`` argument.

    The scorer is :attr:`scorer` (its counters; ``shutdown()`` stops its workers).

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
        ready = isinstance(funcs, RewardFunctionWrapper)
        if ready and kwargs:
            raise TypeError(
                "pass either a configured RewardFunctionWrapper or reward functions with RewardFunctionWrapper "
                f"arguments, not both (got {sorted(kwargs)}); the wrapper's own settings are used"
            )
        super().__init__(funcs if ready else RewardFunctionWrapper(funcs, **kwargs))
