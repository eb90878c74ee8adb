"""TRL prompts into a TorchRL ``ChatEnv`` at each reset: what ``LLMCollector`` generates from.

TorchRL's ``DataLoadingPrimer`` rejects a batch of chats and serves a new batch at every reset.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase
from torchrl.envs import Transform

from .. import layouts
from .._checks import positive_int
from .episodes import GROUP_ID_KEY

__all__ = ["PromptPrimer", "PromptSourceEnded", "check_history_batch", "columns_td", "context_columns", "env_query"]


class PromptSourceEnded(Exception):
    """The prompt source of a :class:`PromptPrimer` has no more prompts."""


def env_query(prompts: list):
    """TRL prompts as a ``ChatEnv`` ``"query"``: a ``History`` for chats, a stack of strings for texts."""
    from ..rewards.trl_funcs import is_conversational

    if is_conversational(prompts):
        from torchrl.data.llm import History

        return History.from_chats([layouts.to_messages(p) for p in prompts])
    return NonTensorStack(*[str(p) for p in prompts])


def check_history_batch(prompts: list, owner: str) -> None:
    """Raise if the chats of one batch have different numbers of messages, which TorchRL's
    history-mode ``TransformersWrapper`` cannot generate."""
    lengths = sorted({len(layouts.to_messages(p)) for p in prompts})
    if len(lengths) > 1:
        raise ValueError(
            f"{owner}: expected chats of one length per batch (TorchRL's history mode), got chats of {lengths} "
            "messages; use input_mode='text', or batches of one prompt (prompts_per_batch=1)"
        )


def columns_td(columns: dict[str, Sequence[Any]], batch_size) -> TensorDict:
    """``{name: one value per sample}`` as a TensorDict (tensors stacked, others a ``NonTensorStack``)."""
    out = TensorDict(batch_size=batch_size)
    for name, values in columns.items():
        out.set(name, torch.stack(list(values)) if isinstance(values[0], torch.Tensor) else NonTensorStack(*values))
    return out


def context_columns(context_fn: Callable[[list], dict[str, Sequence[Any]]] | None, prompts: list, owner: str) -> dict:
    """``context_fn(prompts)`` (``{}`` without one), checked to give one value per prompt."""
    columns = context_fn(list(prompts)) if context_fn is not None else {}
    for name, values in columns.items():
        if len(values) != len(prompts):
            raise ValueError(
                f"{owner}: context_fn returned {len(values)} values for column {name!r}, expected {len(prompts)}"
            )
    return columns


class PromptPrimer(Transform):
    """Give a ``ChatEnv`` its prompts at each reset: ``"query"``, ``"group_id"`` (int64, shared
    by the ``repeats`` consecutive copies of a prompt) and the columns of ``context_fn``.

    Args:
        prompts (sequence or iterable): TRL prompts (texts or message lists): a sequence,
            cycled forever, or an iterator.

    Keyword Args:
        repeats (int, optional): copies of each prompt in a row (``GRPOConfig.num_generations``).
            Defaults to ``1``.
        context_fn (callable, optional): ``fn(prompts) -> {column: values}``, one value per env.
            Defaults to ``None``.
        raw_text (bool, optional): give plain-text prompts to a ``ChatEnv(input_mode="text")``
            as they are instead of through the tokenizer's chat template. Defaults to ``False``.

    A reset not followed by a step serves the same prompts again. When the source ends or
    raises, the next step raises :class:`PromptSourceEnded` (or the source's error), kept in
    :attr:`error`. A partial reset raises.

    Example:

    >>> from torchrl.envs.llm import ChatEnv
    >>> from torchrl_trl.testing import make_tokenizer
    >>> chats = [[{"role": "user", "content": q}] for q in ("hi", "hello")]
    >>> env = ChatEnv(batch_size=(2,), input_mode="history", tokenizer=make_tokenizer())
    >>> env = env.append_transform(PromptPrimer(chats, repeats=2))
    >>> td = env.reset()
    >>> [h["content"] for h in td["history", "prompt"][:, -1].tolist()], td["group_id"].tolist()
    (['hi', 'hi'], [0, 0])
    """

    def __init__(
        self, prompts: Sequence | Iterable, *, repeats: int = 1,
        context_fn: Callable[[list], dict[str, Sequence[Any]]] | None = None, raw_text: bool = False,
    ):
        super().__init__()
        if isinstance(prompts, Sequence) and not prompts:
            raise ValueError("PromptPrimer: expected prompts, prompts is empty")
        self.repeats = positive_int(repeats, "PromptPrimer: repeats")
        self.context_fn = context_fn
        self.raw_text = raw_text
        self.served_prompts = 0
        self.error: BaseException | None = None
        self._source = itertools.cycle(prompts) if isinstance(prompts, Sequence) else iter(prompts)
        self._stream = self._repeated()
        self._current: TensorDict | None = None
        self._stepped = True
        self._filler = False

    def _repeated(self) -> Iterator[tuple[Any, int]]:
        for group, prompt in enumerate(self._source):
            self.served_prompts += 1
            yield from itertools.repeat((prompt, group), self.repeats)

    def _next_batch(self, batch_size: torch.Size) -> TensorDict:
        n = batch_size.numel()
        try:
            items = list(itertools.islice(self._stream, n))
            if len(items) < n:
                raise PromptSourceEnded(
                    f"PromptPrimer: the prompt source ended ({len(items)} prompt copies left, expected the env's "
                    f"batch of {n})"
                )
            prompts = [p for p, _ in items]
            if getattr(self.parent, "input_mode", None) == "history":
                check_history_batch(prompts, "PromptPrimer")
        except Exception as err:
            if self._current is None:
                raise
            self.error, self._filler = err, True  # generate what was served, fail at the next step
            return self._current
        td = TensorDict({"query": env_query(prompts), GROUP_ID_KEY: torch.tensor([g for _, g in items])}, [n])
        td.update(columns_td(context_columns(self.context_fn, prompts, "PromptPrimer"), [n]))
        return td.reshape(batch_size)

    def _reset_env_preprocess(self, tensordict: TensorDictBase | None) -> TensorDictBase:
        partial = None if tensordict is None else tensordict.get("_reset", None)
        if partial is not None and not partial.all():
            raise ValueError(
                f"PromptPrimer: {int(partial.sum())} of {partial.numel()} envs reset while others go on; every "
                "episode of an env batch must end at the same turn (e.g. StepCounter(max_steps=k))"
            )
        if self._stepped:
            self._current = self._next_batch(self.parent.batch_size)
            self._stepped = False
        primed = self._current.clone(False)
        return primed if tensordict is None else tensordict.update(primed)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        for key in self._current.keys():
            if key != "query" and key not in tensordict_reset.keys():
                tensordict_reset.set(key, self._current.get(key))
        if self.raw_text and getattr(self.parent, "input_mode", None) == "text":
            queries = layouts.read_column(self._current, "query")
            if all(isinstance(q, str) for q in queries):
                tensordict_reset.set(layouts.text_key("prompt"), NonTensorStack(*queries))
        return tensordict_reset

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if self._filler:
            raise self.error
        self._stepped = True
        return next_tensordict
