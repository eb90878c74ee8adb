"""One reward model served by a named Ray actor, shared by many collectors and env workers.

Each caller renders its samples locally and sends flat int64 ids + lengths; the actor scores
requests arriving within ``max_wait_ms`` of each other together, one float32 per sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._checks import config_or_default
from .._token_ids import check_integer_ids, check_token_ids
from ..layouts import Ragged
from .batching import RewardBatching
from .model import HFRewardModelWrapper, RenderingScorer, load_reward_model
from .postprocess import RewardOutput
from .render import RewardRenderer

__all__ = ["RewardModelService", "RewardServiceClient", "RewardServiceError"]


class RewardServiceError(RuntimeError):
    """A :class:`RewardServiceClient` call's service did not answer within ``timeout``, or died."""


def _require_ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is an optional dependency
        raise ImportError("RewardServiceClient: expected Ray installed: pip install 'ray>=2.50'") from e
    return ray


@dataclass
class _Request:
    ids: Ragged
    where: str
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class RewardModelService:
    """The actor body: one :class:`HFRewardModelWrapper` (the model-side settings: ``batching``,
    ``output``'s head and non-finite policy, ``model_kwargs`` of :func:`load_reward_model`; no
    gradients) and a coalescer holding a first request ``max_wait_ms`` for others to join."""

    def __init__(self, model_path: str, *, batching: RewardBatching, output: RewardOutput, model_kwargs: dict,
                 max_wait_ms: float = 5.0) -> None:  # fmt: skip
        self.model_path = os.fspath(model_path)
        # as asked: what attaching callers are compared with
        self.settings = dict(batching=batching, output=output, model_kwargs=model_kwargs)
        self.max_wait = float(max_wait_ms) / 1000.0
        if "device" not in model_kwargs and torch.cuda.is_available():
            model_kwargs = {**model_kwargs, "device": "cuda"}  # the GPUs Ray gave this actor
        model, tokenizer = load_reward_model(self.model_path, **model_kwargs)
        self.wrapper = HFRewardModelWrapper(model, inference_mode=True, renderer=RewardRenderer(tokenizer=tokenizer),
                                            batching=batching, output=output)  # fmt: skip
        model = self.wrapper.model
        get_emb = getattr(model, "get_input_embeddings", None)
        embedding = get_emb() if callable(get_emb) else None
        # the embedding runs once per forward, padded or packed
        (model if embedding is None else embedding).register_forward_hook(self._count_forward, with_kwargs=True)
        self._pending: list[_Request] = []
        self._worker: asyncio.Task | None = None
        # one scoring thread: the event loop keeps accepting requests during a forward
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-service")
        self._stats = dict(requests=0, sequences=0, flushes=0, forwards=0, max_forward_tokens=0,
                           max_requests_per_flush=0)  # fmt: skip

    def _count_forward(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._stats["forwards"] += 1
        if isinstance(ids, torch.Tensor):
            self._stats["max_forward_tokens"] = max(self._stats["max_forward_tokens"], ids.numel())

    def info(self) -> dict:
        """The model path, settings, EOS id, ``max_length``, device and pid callers check."""
        w = self.wrapper
        return dict(model_path=self.model_path, settings=self.settings, eos_token_id=w.renderer.eos_token_id,
                    max_length=w.max_length, device=str(next(iter(w.model.parameters())).device), pid=os.getpid())

    def stats(self) -> dict:
        """Counters since the actor started (requests, sequences, flushes, forwards, tokens,
        padding efficiency, truncations, non-finite rewards, largest forward, peak RSS MiB,
        CPU seconds, torch threads) and ``pending``, the requests held now."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        counters = ("real_tokens", "processed_tokens", "padding_efficiency", "truncated_count", "nonfinite_count")
        out = {**self._stats, **{name: getattr(self.wrapper, name) for name in counters}}
        out.update(pending=len(self._pending), peak_rss_mib=usage.ru_maxrss / 1024.0, pid=os.getpid(),
                   cpu_seconds=usage.ru_utime + usage.ru_stime, torch_threads=torch.get_num_threads())
        if torch.cuda.is_available():
            out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
        return out

    async def score(self, values: Any, lengths: Any, where: str = "reward-model input"):
        """Scores ``float32 [len(lengths)]`` for the flat ids ``values`` cut at ``lengths``."""
        ids = _as_ragged(values, lengths, where)
        if len(ids) == 0:
            return np.zeros(0, dtype=np.float32)
        request = _Request(ids, where, asyncio.get_running_loop().create_future())
        self._pending.append(request)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._run())
        return await request.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            # only an idle service waits: under load the oldest request waited for the last batch
            left = self._pending[0].arrived + self.max_wait - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)
            batch, self._pending = self._pending, []
            try:
                results = await loop.run_in_executor(self._executor, self._score_batch, batch)
            except Exception as e:  # never leave a caller waiting on a future nobody sets
                results = [e] * len(batch)
            for request, result in zip(batch, results):
                if request.future.done():  # the caller went away (cancelled)
                    continue
                if isinstance(result, BaseException):
                    request.future.set_exception(result)
                else:
                    request.future.set_result(result)

    def _score_batch(self, batch: list[_Request]) -> list:
        """One flush: the requests scored together, else one by one (an error reaches its caller only)."""
        st = self._stats
        st["flushes"] += 1
        st["requests"] += len(batch)
        st["max_requests_per_flush"] = max(st["max_requests_per_flush"], len(batch))
        st["sequences"] += sum(len(r.ids) for r in batch)
        results: list = [self._check_range(r) for r in batch]
        todo = [i for i, r in enumerate(results) if r is None]
        if len(todo) > 1:
            try:
                parts = [batch[i].ids for i in todo]
                ids = Ragged(torch.cat([p.values for p in parts]), torch.cat([p.lengths for p in parts]))
                scores = self.wrapper.score_ids(ids, where=f"{len(todo)} coalesced requests")
                cuts = np.cumsum([len(p) for p in parts])[:-1]
                for i, part in zip(todo, np.split(scores.float().cpu().numpy(), cuts)):
                    results[i] = part
                return results
            except Exception:  # rescored one by one below
                st["coalesced_failures"] = st.get("coalesced_failures", 0) + 1
        for i in todo:
            try:
                results[i] = self.wrapper.score_ids(batch[i].ids, where=batch[i].where).float().cpu().numpy()
            except Exception as e:  # routed to its caller
                results[i] = e
        return results

    def _check_range(self, request: _Request) -> Exception | None:
        try:
            self.wrapper.check_ids(request.ids, request.where)
        except ValueError as e:
            return e
        return None


def _as_ragged(values: Any, lengths: Any, where: str) -> Ragged:
    values = torch.as_tensor(np.asarray(values)).reshape(-1)
    lengths = torch.as_tensor(np.asarray(lengths)).reshape(-1)
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError(f"RewardModelService: {where}: expected integer lengths, got dtype {lengths.dtype}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"RewardModelService: {where}: expected lengths >= 0, got {int(lengths.min())}")
    if int(lengths.sum()) != values.numel():
        raise ValueError(f"RewardModelService: {where}: expected lengths summing to the {values.numel()} ids sent, "
                         f"got {int(lengths.sum())}")
    check_integer_ids(values.dtype, where)
    return check_token_ids(Ragged(values.long(), lengths.long()), where)


class RewardServiceClient(RenderingScorer):
    """A caller of a shared :class:`RewardModelService` (a Ray actor): renders locally, scores remotely.

    Args:
        model (str or os.PathLike): local path of the reward model, loaded once by the actor.

    Keyword Args:
        renderer (RewardRenderer, optional): applied by the caller (its tokenizer, else the one
            saved at ``model``). Defaults to ``RewardRenderer()``.
        batching (RewardBatching, optional): applied in the service. Defaults to ``RewardBatching()``.
        output (RewardOutput, optional): its head and non-finite policy apply in the service,
            its shape here. Defaults to ``RewardOutput()``.
        model_kwargs (dict, optional): keyword arguments of :func:`load_reward_model` in the
            service. Defaults to ``None``: the model on the GPU Ray gives the actor, if any.
        remote_config (dict, optional): the actor's Ray options (``name``, ``num_gpus``, ...). A
            named actor is shared: created by the first caller, later ones must ask for the same
            path and service-side settings (else ``ValueError``). Defaults to ``None``: a private
            actor.
        timeout (float, optional): finite seconds a call may take (the actor's start included)
            before :class:`RewardServiceError`. Defaults to ``600.0``.
        max_wait_ms (float, optional): how long the service holds a first request for others.
            Defaults to ``5.0``.

    Scores come back without gradients, written at ``"reward"``.

    Examples:
        Starting the actor needs Ray (``HFRewardTransform(RewardServiceClient(path, ...))`` on an
        env); arguments are checked before Ray is touched:

        >>> RewardServiceClient("rm_dir", timeout=float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: RewardServiceClient: timeout must be a finite number of seconds > 0, got inf
    """

    def __init__(
        self, model: str | os.PathLike, *, renderer: RewardRenderer | None = None,
        batching: RewardBatching | None = None, output: RewardOutput | None = None,
        model_kwargs: dict[str, Any] | None = None, remote_config: dict[str, Any] | None = None,
        timeout: float = 600.0, max_wait_ms: float = 5.0,
    ) -> None:  # fmt: skip
        name = type(self).__name__
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(
                f"{name}: expected a local path (the service loads the model, safetensors), got a "
                f"{type(model).__name__}: save it with save_pretrained and pass the directory"
            )
        renderer = config_or_default(renderer, RewardRenderer, "renderer", name)
        batching = config_or_default(batching, RewardBatching, "batching", name)
        output = config_or_default(output, RewardOutput, "output", name)
        if model_kwargs is not None and not isinstance(model_kwargs, dict):
            raise TypeError(f"{name}: model_kwargs must be a dict or None, got {type(model_kwargs).__name__}")
        if "load_tokenizer" in (model_kwargs or {}):
            raise TypeError(f"{name}: model_kwargs takes load_reward_model's loading arguments: expected no "
                            "load_tokenizer")
        if not _is_number(timeout) or not 0 < timeout < float("inf"):
            raise ValueError(f"{name}: timeout must be a finite number of seconds > 0, got {timeout!r}")
        if not _is_number(max_wait_ms) or max_wait_ms < 0:
            raise ValueError(f"{name}: max_wait_ms must be a number >= 0, got {max_wait_ms!r}")
        options = _actor_options(remote_config)
        self.model_path = os.path.abspath(os.fspath(model))
        self.actor_name, self.timeout = options.get("name"), float(timeout)
        self.namespace = options.get("namespace")
        self.reward_shape, self.inference_mode = output.shape, True
        # what the service applies: callers that differ only in what they render and write share it
        settings = dict(batching=batching, output=dataclasses.replace(output, shape="flat"),
                        model_kwargs=dict(model_kwargs or {}))  # fmt: skip
        ray = _require_ray()
        if not ray.is_initialized():
            ray.init()
        remote = ray.remote(RewardModelService).options(**options)
        self.actor = remote.remote(self.model_path, **settings, max_wait_ms=float(max_wait_ms))  # Ray handle
        info = self._call("info")
        if info["model_path"] != self.model_path or info["settings"] != settings:
            differ = [k for k in settings if info["settings"][k] != settings[k]]
            raise ValueError(
                f"{name}: the reward service {self.actor_name!r} serves {info['model_path']!r} (differing settings: "
                f"{differ}), this caller asks for {self.model_path!r}: expected the same, or another name"
            )
        loaded = None
        if renderer.tokenizer is None:
            from transformers import AutoTokenizer

            trust = bool(settings["model_kwargs"].get("trust_remote_code", False))
            loaded = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust)
        self._bind_renderer(renderer, loaded, eos_token_id=info["eos_token_id"])

    def _call(self, method: str, *args):
        """``actor.method(*args)``, waited for at most :attr:`timeout`."""
        ray = _require_ray()
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout, owner = self.timeout, type(self).__name__
        name = f"reward service {self.actor_name!r}" if self.actor_name else "the private reward service"
        try:
            ref = getattr(self.actor, method).remote(*args)
        except RayActorError as e:  # pragma: no cover - submitting to a dead handle
            raise RewardServiceError(f"{owner}: expected a live actor, {name} is gone: {e}") from e
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError as e:
            ray.cancel(ref)
            raise RewardServiceError(
                f"{owner}: {name} did not answer {method}() within timeout={timeout}s (busy, hung or still "
                "loading the model): expected a larger timeout= or a responsive actor"
            ) from e
        except RayActorError as e:
            raise RewardServiceError(
                f"{owner}: {name} died or cannot be reached ({type(e).__name__}): expected a live actor (remote_config="
                f"{{'max_restarts': n}} restarts it). Cause: {str(e).splitlines()[0][:60] if str(e) else e!r}"
            ) from e

    def stats(self) -> dict:
        """The service's counters (see :meth:`RewardModelService.stats`)."""
        return self._call("stats")

    def info(self) -> dict:
        return self._call("info")

    def shutdown(self) -> None:
        """Kill the actor (every caller attached to it loses it)."""
        _require_ray().kill(self.actor, no_restart=True)

    def score_ids(self, ids: Ragged, *, where: str = "reward-model input") -> torch.Tensor:
        """Rewards ``float32 [N]`` (CPU) for reward-model token ids, one per row."""
        check_token_ids(ids, where)
        if len(ids) == 0:
            return torch.zeros(0)
        scores = self._call("score", ids.values.long().numpy(), ids.lengths.long().numpy(), where)
        return torch.from_numpy(np.asarray(scores, dtype=np.float32).copy())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_path!r}, actor_name={self.actor_name!r})"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _actor_options(remote_config: dict | None) -> dict:
    """The actor's Ray options: ``remote_config`` over the defaults (a named actor: shared,
    ``get_if_exists``, detached)."""
    if remote_config is not None and not isinstance(remote_config, dict):
        raise TypeError(
            f"RewardServiceClient: remote_config must be a dict of Ray actor options, got {remote_config!r}"
        )
    given = dict(remote_config or {})
    named = given.get("name") is not None
    options = {"max_restarts": 0, "max_concurrency": 1000}
    if named:
        options.update(get_if_exists=True, lifetime="detached")
    options.update(given)
    options.setdefault("max_task_retries", -1 if options["max_restarts"] else 0)
    if not named:
        options.pop("lifetime", None)  # an unnamed actor dies with its creator
    return {k: v for k, v in options.items() if v is not None}
