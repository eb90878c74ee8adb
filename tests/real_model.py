"""Independent references for the real-model tier (SmolLM2-135M-Instruct): what the model
emits and what a reward model scores for ONE sequence alone, with no padding and none of
torchrl_trl's code. Tests compare our paths against these, never against our own readers."""

from __future__ import annotations

import torch

#: Prompts of equal token length under TorchRL's ChatML rendering, so a batch of them needs no
#: padding and greedy generation matches each prompt generated alone bit for bit.
SAME_LENGTH_QUERIES = ("Answer with one word: is the sky blue?", "Answer with one word: is the sea blue?")


def eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids | {tokenizer.eos_token_id}


@torch.no_grad()
def greedy_reply(model, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The token ids ``model.generate`` emits greedily after ``prompt_ids`` (one sequence, no
    padding): the EOS kept where it was generated, nothing after it."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    reply = out[0, len(prompt_ids):].tolist()
    stops = eos_ids(model, tokenizer)
    for i, t in enumerate(reply):
        if t in stops:
            return reply[: i + 1]
    return reply


def ended(reply_ids: list[int], model, tokenizer) -> bool:
    """Whether a reply was closed by an EOS (a finished turn), not cut by ``max_new_tokens``."""
    return bool(reply_ids) and reply_ids[-1] in eos_ids(model, tokenizer)


def reply_text(reply_ids: list[int], model, tokenizer) -> str:
    """The assistant content of a reply: decoded, the closing EOS left out."""
    body = reply_ids[:-1] if ended(reply_ids, model, tokenizer) else reply_ids
    return tokenizer.decode(body, skip_special_tokens=False)


@torch.no_grad()
def reward_alone(reward_model, rm_tokenizer, messages: list[dict[str, str]]) -> float:
    """A one-label reward model's score of one chat, rendered with the reward model's own
    chat template, tokenised without added special tokens, forwarded alone (no padding)."""
    text = rm_tokenizer.apply_chat_template(messages, tokenize=False)
    ids = rm_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return float(reward_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, 0])
