"""Public names of :mod:`torchrl_trl.online`: the one list (see :mod:`torchrl_trl._exports`)."""

from .async_rollouts import AsyncGroupCollector as AsyncGroupCollector
from .async_rollouts import AsyncTorchRLRolloutFunc as AsyncTorchRLRolloutFunc
from .async_rollouts import GroupReplay as GroupReplay
from .behaviour import BehaviourLogProbsMixin as BehaviourLogProbsMixin
from .behaviour import BehaviourLogProbsPostproc as BehaviourLogProbsPostproc
from .collector_rollouts import LLMCollectorRolloutFunc as LLMCollectorRolloutFunc
from .callback import CollectorCallback as CollectorCallback
from .callback import CollectorError as CollectorError
from .callback import wait_for_items as wait_for_items
from .metrics import CollectorMetricsCallback as CollectorMetricsCallback
from .checkpoint import BufferCheckpointCallback as BufferCheckpointCallback
from .checkpoint import BufferCheckpointError as BufferCheckpointError
from .checkpoint import load_buffer as load_buffer
from .checkpoint import save_buffer as save_buffer
from .priority import TensorPrioritizedSampler as TensorPrioritizedSampler
from .priority import update_priorities as update_priorities
from .ray import connect_ray_replay_buffer as connect_ray_replay_buffer
from .ray import make_ray_collector as make_ray_collector
from .ray import make_ray_replay_buffer as make_ray_replay_buffer
from .prompt_primer import PromptPrimer as PromptPrimer
from .rollout_func import TorchRLRolloutFunc as TorchRLRolloutFunc
from .staleness import StalenessFilter as StalenessFilter
from .staleness import read_policy_version as read_policy_version
from .trl_async_grpo import TorchRLRolloutWorker as TorchRLRolloutWorker
from .trl_async_grpo import TorchRLWeightTransfer as TorchRLWeightTransfer
