"""Behaviour log-probs: each generated token's log-prob under the weights that generated
it, for importance correction of stale GRPO groups.

- :class:`ResponseScorer`: TorchRL's scoring path (``generate=False``) on exact token
  sequences: ``scorer(prompt_ids, completion_ids) -> per-token log-probs``;
- :class:`BehaviourLogProbsPostproc`: ``LLMCollector(postproc=...)`` recording them at
  generation (``"behaviour_log_probs"``);
- :class:`BehaviourLogProbsMixin`: TRL's ``GRPOTrainer`` loss using them as the old
  log-probs.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from .. import layouts
from .episodes import BEHAVIOUR_KEY, per_sample

__all__ = ["BehaviourLogProbsMixin", "BehaviourLogProbsPostproc", "ResponseScorer"]


class ResponseScorer:
    """Per-token log-probs of completions given their prompts, by TorchRL's scoring path
    (``policy.get_new_version(generate=False, input_mode="tokens")``) on the exact token
    sequences, with ``policy``'s weights as they are.

    ``scorer(prompt_ids, completion_ids) -> [[float] * len(c) for c in completion_ids]``
    (lists of token ids in, one log-prob per completion token out).
    """

    def __init__(self, policy):
        self.policy, self.model = policy, policy.model
        # an explicit copy of tokenizer_kwargs: TorchRL 0.14.1's get_new_version(pad_output=...)
        # otherwise writes padding=False into the *original* policy's dict, and its text mode
        # then fails on prompts of different lengths
        self._scorer = policy.get_new_version(
            generate=False, input_mode="tokens", input_key=("tokens", "full"), pad_output=False,
            tokenizer_kwargs=dict(policy.tokenizer_kwargs),
        )

    def __call__(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        rows = [
            TensorDict({"tokens": {"full": torch.tensor(p + c, dtype=torch.long)}})
            for p, c in zip(prompt_ids, completion_ids)
        ]
        with torch.no_grad():
            scored = self._scorer(lazy_stack(rows))
        full = scored.get(("log_probs", "full"), as_list=True)
        return [lp[len(p) :].tolist() for lp, p in zip(full, prompt_ids)]


class BehaviourLogProbsPostproc:
    """``LLMCollector(postproc=...)`` that records the behaviour log-probs: each response
    token's log-prob under the weights that generated it, by TorchRL's scoring path
    (``generate=False``) on the exact sequence, in the collector's thread right after
    generation, written at ``"behaviour_log_probs"`` (float ``[n_response_tokens]`` per
    sample). :class:`LLMCollectorRolloutFunc` returns them as ``logprobs`` (no unknown
    first token), so :class:`~torchrl_trl.online.BehaviourLogProbsMixin` can correct stale
    groups.

    Args:
        policy: the collector's policy (the same object: its model holds the generating
            weights). For a collector that builds its policy (``RayLLMCollector`` with a
            ``policy_factory``), use :meth:`for_factory` instead.

    It runs in the collector's thread before the batch reaches its ``post_collect_hook``,
    where :meth:`LLMCollectorRolloutFunc.push` loads new weights: no score mixes two versions.

    Example (on one policy call, as the collector calls it after each rollout batch):

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl_trl.testing import make_policy, make_policy_wrapper, make_tokenizer
    >>> tok = make_tokenizer()
    >>> policy = make_policy_wrapper(make_policy(tok), tok, max_new_tokens=3, input_mode="text")
    >>> _ = torch.manual_seed(0)
    >>> out = BehaviourLogProbsPostproc(policy)(policy(TensorDict({"text": {"prompt": ["hi", "hello"]}}, [2])))
    >>> generated = out[0]["log_probs", "response"]  # TorchRL's: 0.0 for the first token
    >>> behaviour = out[0]["behaviour_log_probs"]
    >>> generated[0].item(), behaviour[0].item() < 0, torch.allclose(behaviour[1:], generated[1:], atol=1e-4)
    (0.0, True, True)
    """

    def __init__(self, policy):
        self.policy = policy
        self._scorer = ResponseScorer(policy)

    @classmethod
    def for_factory(cls, policy_factory):
        """``(policy_factory, postproc)`` for a collector that builds its policy where it
        runs (a Ray actor): the returned factory builds the policy with ``policy_factory``
        and hands it to the returned postproc, which scores with it. Pass both to the same
        collector (``make_ray_collector(env_factory, factory, rb, postproc=postproc, ...)``).
        There, a weight push is not serialised with scoring (the actor loads weights while
        it generates): keep ``max_staleness >= 1``."""
        import uuid

        token = uuid.uuid4().hex
        return _RecordingFactory(policy_factory, token), _DeferredPostproc(token)

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        td = per_sample(td)
        prompts = layouts.read_tokens(td, "prompt").tolist()
        responses = layouts.read_tokens(td, "response").tolist()
        scored = self._scorer(prompts, responses)
        for sample, lp in zip(td.tensordicts, scored):
            sample.set(BEHAVIOUR_KEY, torch.tensor(lp, dtype=torch.float32))
        return td


class BehaviourLogProbsMixin:
    """Mix into ``GRPOTrainer`` (``class Trainer(BehaviourLogProbsMixin, GRPOTrainer)``) so
    TRL's loss uses the rollout func's log-probs (the behaviour policy's, as recorded at
    generation) as ``old_per_token_logps``: the ratio in TRL's clipped objective becomes
    ``pi_theta / mu`` instead of 1 for samples generated by older weights.

    Left alone when TRL already corrects (``use_vllm`` with
    ``vllm_importance_sampling_correction``). Unknown (NaN) behaviour log-probs on trained
    tokens raise ``ValueError`` (use ``TorchRLRolloutFunc(logprobs="rescore")``); on masked
    tokens they are set to 0.

    Example (``Base`` stands in for ``GRPOTrainer``, whose loss then reads the old log-probs):

    >>> import torch
    >>> class Base:
    ...     def compute_loss(self, model, inputs):
    ...         return inputs["old_per_token_logps"]
    >>> class Trainer(BehaviourLogProbsMixin, Base):
    ...     pass
    >>> inputs = {"sampling_per_token_logps": torch.tensor([[-0.5, -1.0, float("nan")]]),
    ...           "completion_mask": torch.tensor([[1, 1, 0]])}
    >>> Trainer().compute_loss(None, inputs)  # the behaviour log-probs; NaN on a masked token -> 0
    tensor([[-0.5000, -1.0000,  0.0000]])
    """

    #: tells ``TorchRLRolloutFunc(logprobs="auto")`` to return exact log-probs
    reads_rollout_logprobs = True

    def compute_loss(self, model, inputs, *args, **kwargs):
        behaviour = inputs.get("sampling_per_token_logps")
        corrected_by_trl = getattr(self, "use_vllm", False) and getattr(
            self, "vllm_importance_sampling_correction", False
        )
        if behaviour is not None and not corrected_by_trl:
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            unknown = torch.isnan(behaviour)
            if (unknown & mask.bool()).any():
                raise ValueError(
                    "sampling_per_token_logps holds NaN on trained tokens: the behaviour log-probs are "
                    "unknown there; use TorchRLRolloutFunc(logprobs='rescore')"
                )
            inputs["old_per_token_logps"] = behaviour.masked_fill(unknown, 0.0)
        return super().compute_loss(model, inputs, *args, **kwargs)


#: policies built by :meth:`BehaviourLogProbsPostproc.for_factory` factories, in this process
_BUILT_POLICIES: dict = {}


class _RecordingFactory:
    def __init__(self, factory, token: str):
        self.factory, self.token = factory, token

    def __call__(self):
        policy = self.factory()
        _BUILT_POLICIES[self.token] = BehaviourLogProbsPostproc(policy)
        return policy


class _DeferredPostproc:
    def __init__(self, token: str):
        self.token = token

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        postproc = _BUILT_POLICIES.get(self.token)
        if postproc is None:
            raise RuntimeError(
                "BehaviourLogProbsPostproc.for_factory: the postproc runs in a process whose collector did not "
                "build its policy with the paired factory; give both to the same collector"
            )
        return postproc(td)
