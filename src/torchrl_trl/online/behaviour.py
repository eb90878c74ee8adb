"""Behaviour log-probs (each token's under the weights that generated it), to correct stale groups."""

from __future__ import annotations

import functools
import uuid

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from .. import layouts
from .episodes import BEHAVIOUR_KEY, per_sample

__all__ = ["BehaviourLogProbsMixin", "BehaviourLogProbsPostproc", "ResponseScorer", "trl_corrects_logprobs"]


class ResponseScorer:
    """Per-token log-probs of completions by TorchRL's scoring path (``generate=False``) on
    the exact token sequences: ``scorer(prompt_ids, completion_ids) -> [[float] * len(c)]``."""

    def __init__(self, policy):
        self.policy, self.model = policy, policy.model
        # a copy of tokenizer_kwargs: get_new_version(pad_output=...) writes into the original's
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
    """``LLMCollector(postproc=...)`` recording each response token's log-prob under the
    weights that generated it (by :class:`ResponseScorer`, in the collector's thread right
    after generation) at ``"behaviour_log_probs"`` (float ``[n_response_tokens]`` per sample).

    Args:
        policy (TransformersWrapper): the collector's policy (the same object); a Ray actor's:
            :meth:`for_factory`.

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
        runs (a Ray actor): the postproc scores with the policy the factory built. Pass both
        to the same collector; keep ``max_staleness >= 1`` (weights load while it scores)."""
        token = uuid.uuid4().hex
        factory = functools.partial(_recording_factory, policy_factory, token)
        return factory, functools.partial(_deferred_postproc, token)

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        td = per_sample(td)
        prompts = layouts.read_tokens(td, "prompt").tolist()
        responses = layouts.read_tokens(td, "response").tolist()
        scored = self._scorer(prompts, responses)
        for sample, lp in zip(td.tensordicts, scored):
            sample.set(BEHAVIOUR_KEY, torch.tensor(lp, dtype=torch.float32))
        return td


class BehaviourLogProbsMixin:
    """Mix into ``GRPOTrainer`` (``class Trainer(BehaviourLogProbsMixin, GRPOTrainer)``) so TRL's
    loss uses the rollout func's log-probs as ``old_per_token_logps`` (ratio ``pi_theta / mu``),
    unless TRL corrects them itself (``use_vllm`` with ``vllm_importance_sampling_correction``). NaN behaviour log-probs raise
    ``ValueError`` on trained tokens and are set to 0 on masked ones.

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
        if behaviour is not None and not trl_corrects_logprobs(self):
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            unknown = torch.isnan(behaviour)
            if (unknown & mask.bool()).any():
                raise ValueError(
                    "BehaviourLogProbsMixin: expected behaviour log-probs on trained tokens, sampling_per_token_logps "
                    "holds NaN; use TorchRLRolloutFunc(logprobs='rescore')"
                )
            inputs["old_per_token_logps"] = behaviour.masked_fill(unknown, 0.0)
        return super().compute_loss(model, inputs, *args, **kwargs)


def trl_corrects_logprobs(trainer) -> bool:
    """Whether TRL's own vLLM importance-sampling correction is on for ``trainer``."""
    return bool(getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False))


#: postprocs of the policies :meth:`BehaviourLogProbsPostproc.for_factory` factories built, in this process
_BUILT_POLICIES: dict = {}


def _recording_factory(factory, token: str):
    policy = factory()
    _BUILT_POLICIES[token] = BehaviourLogProbsPostproc(policy)
    return policy


def _deferred_postproc(token: str, td: TensorDictBase) -> TensorDictBase:
    postproc = _BUILT_POLICIES.get(token)
    if postproc is None:
        raise RuntimeError(
            "BehaviourLogProbsPostproc.for_factory: the postproc runs in a process whose collector did not "
            "build its policy with the paired factory; give both to the same collector"
        )
    return postproc(td)
