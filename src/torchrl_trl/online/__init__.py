"""Online and distributed: a TorchRL collector feeding a TRL trainer.

- beside the trainer: :class:`CollectorCallback`, :class:`CollectorMetricsCallback`,
  :class:`BufferCheckpointCallback` (:func:`save_buffer`, :func:`load_buffer`);
- on the trainer's reads: :class:`StalenessFilter`, :func:`update_priorities`, :class:`TensorPrioritizedSampler`;
- TRL's GRPO on TorchRL rollouts: :class:`TorchRLRolloutFunc`, :class:`LLMCollectorRolloutFunc`,
  :class:`AsyncTorchRLRolloutFunc`, :class:`BehaviourLogProbsMixin`, :class:`TorchRLRolloutWorker`;
- Ray (:mod:`torchrl_trl.online.ray`, imports ``ray`` on use): :func:`make_ray_replay_buffer`,
  :func:`connect_ray_replay_buffer`, :func:`make_ray_collector`.

The public names are declared once, in ``__init__.pyi``, and imported on first use.
"""

from .._exports import attach

__getattr__, __dir__, __all__ = attach(__name__, __file__)
