"""Public names of :mod:`torchrl_trl.online`: the one list (see :mod:`torchrl_trl._exports`)."""

from .async_rollouts import (
    AsyncGroupCollector as AsyncGroupCollector,
    AsyncTorchRLRolloutFunc as AsyncTorchRLRolloutFunc,
    GroupReplay as GroupReplay,
)
from .behaviour import (
    BehaviourLogProbsMixin as BehaviourLogProbsMixin,
    BehaviourLogProbsPostproc as BehaviourLogProbsPostproc,
)
from .collector_rollouts import LLMCollectorRolloutFunc as LLMCollectorRolloutFunc
from .callback import CollectorCallback as CollectorCallback, CollectorError as CollectorError, wait_for_items as wait_for_items
from .metrics import CollectorMetricsCallback as CollectorMetricsCallback
from .checkpoint import (
    BufferCheckpointCallback as BufferCheckpointCallback,
    BufferCheckpointError as BufferCheckpointError,
    load_buffer as load_buffer,
    save_buffer as save_buffer,
)
from .priority import TensorPrioritizedSampler as TensorPrioritizedSampler, update_priorities as update_priorities
from .ray import (
    connect_ray_replay_buffer as connect_ray_replay_buffer,
    make_ray_collector as make_ray_collector,
    make_ray_replay_buffer as make_ray_replay_buffer,
)
from .prompt_primer import PromptPrimer as PromptPrimer
from .rollout_func import TorchRLRolloutFunc as TorchRLRolloutFunc
from .staleness import StalenessFilter as StalenessFilter, read_policy_version as read_policy_version
from .trl_async_grpo import TorchRLRolloutWorker as TorchRLRolloutWorker, TorchRLWeightTransfer as TorchRLWeightTransfer
