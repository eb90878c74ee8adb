"""TRL reward-function arguments -> TorchRL rollouts: :func:`rollouts_from_trl`, the
tensordict a TorchRL reward module or parser reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import NonTensorData, TensorDict, TensorDictBase, lazy_stack

__all__ = ["as_messages", "is_conversational", "rollouts_from_trl"]


def is_conversational(prompts: Sequence[Any]) -> bool:
    """Whether TRL reads these prompts as chat (``trl.data_utils.is_conversational``).

    >>> is_conversational([[{"role": "user", "content": "hi"}]]), is_conversational(["hi"])
    (True, False)
    """
    from trl.data_utils import is_conversational as trl_is_conversational

    if not prompts or (isinstance(prompts[0], list) and not prompts[0]):
        return False
    return trl_is_conversational({"prompt": prompts[0]})


def as_messages(completion: Any) -> list[dict]:
    """A completion as chat messages (a string is one assistant message)."""
    return [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)


def _completion_text(completion: Any) -> str:
    return completion if isinstance(completion, str) else "".join(m.get("content") or "" for m in completion)


def rollouts_from_trl(
    prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None = None,
    *, columns: dict[str, Sequence[Any]] | None = None, tokenizer=None,
) -> TensorDictBase:
    """TorchRL rollouts (a lazy stack of ``N`` TensorDicts) from TRL's reward-function
    arguments: ``("history", "prompt" | "response" | "full")`` for chat;
    ``("text", "response")``, and ``("text", "prompt" | "full")`` for text (for chat with
    ``tokenizer``: its chat template); ``("tokens", "response")`` from ``completion_ids``,
    ``("tokens", "prompt" | "full")`` with ``tokenizer``; each column at the top level.

    >>> td = rollouts_from_trl(["2+2="], ["4"], [[19]], columns={"answer": ["4"]})
    >>> list(td["text", "full"]), td["tokens", "response"][0].tolist(), list(td["answer"])
    (['2+2=4'], [19], ['4'])
    """
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"rollouts_from_trl: expected one completion per prompt, got {n} prompts and "
                         f"{len(completions)} completions")
    if completion_ids is not None and len(completion_ids) != n:
        raise ValueError(f"rollouts_from_trl: expected one completion_ids per prompt, got {n} prompts and "
                         f"{len(completion_ids)} completion_ids")
    columns = columns or {}
    for name, values in columns.items():
        if len(values) != n:
            raise ValueError(
                f"rollouts_from_trl: column {name!r} has {len(values)} values, expected {n} (one per completion)"
            )
    chat = is_conversational(prompts)
    if chat:
        from torchrl.data.llm import History

    rows = []
    for i in range(n):
        prompt, completion = prompts[i], completions[i]
        row: dict[str, Any] = {}
        text = {"response": _completion_text(completion)}
        prompt_text = None if chat else prompt
        if chat:
            completion = as_messages(completion)
            row["history"] = {
                "prompt": History.from_chats([prompt])[0],
                "response": History.from_chats([completion])[0],
                "full": History.from_chats([list(prompt) + list(completion)])[0],
            }
            if tokenizer is not None:
                prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        if prompt_text is not None:
            text.update(prompt=prompt_text, full=prompt_text + text["response"])
        row["text"] = {k: NonTensorData(v) for k, v in text.items()}
        tokens = {}
        if completion_ids is not None:
            tokens["response"] = torch.as_tensor(list(completion_ids[i]), dtype=torch.long)
        if tokenizer is not None and prompt_text is not None:
            prompt_ids = tokenizer(str(prompt_text), add_special_tokens=False)["input_ids"]
            tokens["prompt"] = torch.as_tensor(prompt_ids, dtype=torch.long)
            if "response" in tokens:
                tokens["full"] = torch.cat([tokens["prompt"], tokens["response"]])
        if tokens:
            row["tokens"] = tokens
        for name, values in columns.items():
            value = values[i]
            row[name] = value if isinstance(value, torch.Tensor) else NonTensorData(value)
        rows.append(TensorDict(row, batch_size=[]))
    return lazy_stack(rows)
