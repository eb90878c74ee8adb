"""Public names of :mod:`torchrl_trl.online`: the one list (see :mod:`torchrl_trl._exports`)."""

from .episodes import BehaviourLogProbsPostproc as BehaviourLogProbsPostproc
from .episodes import make_prompt_collector as make_prompt_collector
from .trl_async_grpo import BehaviourLogProbsMixin as BehaviourLogProbsMixin
from .rollout_func import RolloutOptions as RolloutOptions
from .rollout_func import TorchRLRolloutFunc as TorchRLRolloutFunc
from .callback import CollectorCallback as CollectorCallback
from .callback import CollectorError as CollectorError
from .callback import wait_for_items as wait_for_items
from .metrics import CollectorMetricsCallback as CollectorMetricsCallback
from .checkpoint import BufferCheckpointCallback as BufferCheckpointCallback
from .checkpoint import load_buffer as load_buffer
from .checkpoint import save_buffer as save_buffer
from .priority import TensorPrioritizedSampler as TensorPrioritizedSampler
from .priority import update_priorities as update_priorities
from .ray import make_ray_collector as make_ray_collector
from .ray import make_ray_replay_buffer as make_ray_replay_buffer
from .staleness import StalenessFilter as StalenessFilter
from .trl_async_grpo import TorchRLRolloutWorker as TorchRLRolloutWorker
from .trl_async_grpo import TorchRLWeightTransfer as TorchRLWeightTransfer
