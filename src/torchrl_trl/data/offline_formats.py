"""Formats for TRL's offline trainers (DPO, RewardTrainer, KTO) and RLOO.

Preference formats read rows made by :func:`~torchrl_trl.data.preference.preference_pairs`:
``"chosen"`` and ``"rejected"`` sub-tensordicts (two rollouts of one prompt) and a float
``"margin"``. KTO formats read rows made by :func:`~torchrl_trl.data.preference.kto_rows`:
a rollout plus a bool ``"label"``. Registered when :mod:`torchrl_trl.data` is imported.

==============================  ==============================================  ===============
name                            columns                                         trainer
==============================  ==============================================  ===============
``"dpo"``                       ``prompt``, ``chosen``, ``rejected`` (str)      DPO, Reward
``"dpo_conversational"``        the same as role/content messages               DPO, Reward
``"reward"``                    ``"dpo"`` + ``margin`` (float)                  RewardTrainer
``"reward_conversational"``     ``"dpo_conversational"`` + ``margin``           RewardTrainer
``"reward_tokenized"``          ``chosen_ids``, ``rejected_ids`` (prompt +      RewardTrainer
                                response token ids, no padding), ``margin``
``"kto"``                       ``prompt``, ``completion`` (str), ``label``     KTOTrainer
``"kto_conversational"``        ``prompt``, ``completion`` (messages), ``label``  KTOTrainer
``"rloo"``                      ``prompt`` (str), as ``"grpo"``                 RLOOTrainer
``"rloo_conversational"``       ``prompt`` (messages), as ``"grpo_conversational"``  RLOOTrainer
==============================  ==============================================  ===============

Text prompts are ``("text", "prompt")`` (the chat template already applied) and
completions ``("text", "response")`` as TorchRL stores them (a generated EOS kept; TRL adds
one only when missing). Conversational columns come from ``("history", ...)``. DPOTrainer
always tokenizes itself (it has no pre-tokenized input), so there is no ``dpo_tokenized``.
Without ``margin``, RewardTrainer trains on the ``"dpo*"`` formats.
"""

from __future__ import annotations

from tensordict import TensorDictBase

from .. import layouts
from . import features as F
from .columns import array_rows, prompt_response_ids
from .registry import BufferFormat, register_format

__all__ = ["CHOSEN_KEY", "LABEL_KEY", "MARGIN_KEY", "REJECTED_KEY"]

CHOSEN_KEY, REJECTED_KEY, MARGIN_KEY, LABEL_KEY = "chosen", "rejected", "margin", "label"


def _float():
    from datasets import Value

    return Value("float32")


def _bool():
    from datasets import Value

    return Value("bool")


def _sides(td: TensorDictBase):
    return td.get(CHOSEN_KEY), td.get(REJECTED_KEY)


def _same_prompts(chosen: list, rejected: list) -> None:
    for i, (a, b) in enumerate(zip(chosen, rejected)):
        if a != b:
            raise ValueError(
                f"preference row {i}: the chosen and rejected rollouts have different prompts "
                f"({a!r} vs {b!r}); pairs must share their prompt (group by the prompt)"
            )


def _pairs_text(td: TensorDictBase) -> dict[str, list]:
    chosen, rejected = _sides(td)
    prompt = layouts.read_text(chosen, "prompt")
    _same_prompts(prompt, layouts.read_text(rejected, "prompt"))
    return {
        "prompt": prompt,
        "chosen": layouts.read_text(chosen, "response"),
        "rejected": layouts.read_text(rejected, "response"),
    }


def _pairs_conversational(td: TensorDictBase) -> dict[str, list]:
    chosen, rejected = _sides(td)
    prompt = layouts.read_history(chosen, "prompt")
    _same_prompts(prompt, layouts.read_history(rejected, "prompt"))
    return {
        "prompt": prompt,
        "chosen": layouts.read_history(chosen, "response"),
        "rejected": layouts.read_history(rejected, "response"),
    }


def _margin(td: TensorDictBase) -> list[float]:
    return td.get(MARGIN_KEY).reshape(-1).tolist()


def _prompt_response_ids(td: TensorDictBase) -> list[list[int]]:
    return array_rows(prompt_response_ids(td)[0])


def _reward_tokenized(td: TensorDictBase) -> dict[str, list]:
    chosen, rejected = _sides(td)
    return {
        "chosen_ids": _prompt_response_ids(chosen),
        "rejected_ids": _prompt_response_ids(rejected),
        "margin": _margin(td),
    }


def _labels(td: TensorDictBase) -> list[bool]:
    return [bool(v) for v in td.get(LABEL_KEY).reshape(-1).tolist()]


def _kto_text(td: TensorDictBase) -> dict[str, list]:
    return {
        "prompt": layouts.read_text(td, "prompt"),
        "completion": layouts.read_text(td, "response"),
        "label": _labels(td),
    }


def _kto_conversational(td: TensorDictBase) -> dict[str, list]:
    return {
        "prompt": layouts.read_history(td, "prompt"),
        "completion": layouts.read_history(td, "response"),
        "label": _labels(td),
    }


def _side_keys(key_fn, parts_chosen, parts_rejected):
    return tuple((CHOSEN_KEY, *key_fn(p)) for p in parts_chosen) + tuple(
        (REJECTED_KEY, *key_fn(p)) for p in parts_rejected
    )


_TEXT_KEYS = _side_keys(layouts.text_key, ("prompt", "response"), ("prompt", "response"))
_HISTORY_KEYS = _side_keys(layouts.history_key, ("prompt", "response"), ("prompt", "response"))
_TOKEN_KEYS = _side_keys(layouts.token_key, ("prompt", "response"), ("prompt", "response"))


def _text_features():
    return {"prompt": F.string(), "chosen": F.string(), "rejected": F.string()}


def _messages_features():
    return {"prompt": F.messages(), "chosen": F.messages(), "rejected": F.messages()}


for _fmt in (
    BufferFormat("dpo", _TEXT_KEYS, _pairs_text, _text_features,
                 "prompt/chosen/rejected text from preference pairs (DPOTrainer, RewardTrainer)"),
    BufferFormat("dpo_conversational", _HISTORY_KEYS, _pairs_conversational, _messages_features,
                 "prompt/chosen/rejected messages from preference pairs (DPOTrainer, RewardTrainer)"),
    BufferFormat("reward", (*_TEXT_KEYS, MARGIN_KEY), lambda td: {**_pairs_text(td), "margin": _margin(td)},
                 lambda: {**_text_features(), "margin": _float()},
                 "prompt/chosen/rejected text and the reward gap as margin (RewardTrainer)"),
    BufferFormat("reward_conversational", (*_HISTORY_KEYS, MARGIN_KEY),
                 lambda td: {**_pairs_conversational(td), "margin": _margin(td)},
                 lambda: {**_messages_features(), "margin": _float()},
                 "prompt/chosen/rejected messages and the reward gap as margin (RewardTrainer)"),
    BufferFormat("reward_tokenized", (*_TOKEN_KEYS, MARGIN_KEY), _reward_tokenized,
                 lambda: {"chosen_ids": F.token_list(), "rejected_ids": F.token_list(), "margin": _float()},
                 "pre-tokenized chosen_ids/rejected_ids (prompt + response) and margin (RewardTrainer)"),
    BufferFormat("kto", (layouts.text_key("prompt"), layouts.text_key("response"), LABEL_KEY), _kto_text,
                 lambda: {"prompt": F.string(), "completion": F.string(), "label": _bool()},
                 "prompt/completion text and a desirable label (KTOTrainer, unpaired)"),
    BufferFormat("kto_conversational", (layouts.history_key("prompt"), layouts.history_key("response"), LABEL_KEY),
                 _kto_conversational,
                 lambda: {"prompt": F.messages(), "completion": F.messages(), "label": _bool()},
                 "prompt/completion messages and a desirable label (KTOTrainer, unpaired)"),
):
    register_format(_fmt)
del _fmt
