"""Online and distributed: a TorchRL collector feeding a TRL trainer.

- :class:`CollectorCallback` (``transformers.TrainerCallback``): collect between optimizer
  steps or in the background, push weights; :class:`CollectorMetricsCallback`: log buffer
  size / throughput / staleness (a second callback beside it: ``CollectorMetricsCallback(cb)``).
- :class:`StalenessFilter`: drop or down-weight rows older than ``max_staleness`` versions.
- :func:`update_priorities`, :class:`TensorPrioritizedSampler`: priority feedback.
- :class:`BufferCheckpointCallback`, :func:`save_buffer`, :func:`load_buffer`: the buffer
  saved with, and restored from, the trainer's checkpoints.
- :class:`TorchRLRolloutFunc`: TorchRL (policy, ``ChatEnv``, replay buffer) as the
  ``rollout_func`` of TRL's ``GRPOTrainer``; :class:`LLMCollectorRolloutFunc`: the same
  with TorchRL's ``LLMCollector`` running ahead, bounded staleness and reuse;
  :class:`AsyncGroupCollector` + :class:`AsyncTorchRLRolloutFunc`: that collector built from
  TRL prompts (:class:`PromptPrimer` feeds them to a ``ChatEnv``); :class:`BehaviourLogProbsMixin`: TRL's GRPO loss corrected with the
  behaviour log-probs; :class:`TorchRLRolloutWorker`, :class:`TorchRLWeightTransfer`:
  the same collector behind ``trl.experimental.async_grpo.AsyncGRPOTrainer``'s protocols.
- :func:`make_ray_replay_buffer`, :func:`connect_ray_replay_buffer`, :func:`make_ray_collector`:
  Ray buffers and collectors (:mod:`torchrl_trl.online.ray`, imports ``ray`` on use);
  :func:`read_policy_version`: the policy version of each row.

The public names are declared once, in ``__init__.pyi``, and imported on first use.
"""

from .._exports import attach

__getattr__, __dir__, __all__ = attach(__name__, __file__)
