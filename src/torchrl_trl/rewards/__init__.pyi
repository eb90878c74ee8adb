"""Public names of :mod:`torchrl_trl.rewards`: the one list (see :mod:`torchrl_trl._exports`)."""

from .functions import RewardFunctionWrapper as RewardFunctionWrapper
from .executors import RewardExecutor as RewardExecutor
from .batching import RewardBatching as RewardBatching
from .model import HFRewardModelWrapper as HFRewardModelWrapper
from .postprocess import RewardOutput as RewardOutput, RunningRewardNorm as RunningRewardNorm
from .render import RewardRenderer as RewardRenderer
from .service import RewardServiceClient as RewardServiceClient
from .transform import HFRewardTransform as HFRewardTransform, RewardTransform as RewardTransform
from .trl_funcs import as_trl_reward_func as as_trl_reward_func
