"""Tiny, offline models and tokenizers for tests, docs and the demo.

Everything here is built in-process (no network), saved with ``save_pretrained`` and
loaded back with ``from_pretrained``, so the real Hugging Face loading code runs.

- :func:`make_tokenizer` -> a character-level BPE ``PreTrainedTokenizerFast`` with pad/eos
  tokens and a ChatML chat template (the template TorchRL's ``History`` uses by default).
- :func:`make_policy` -> a tiny ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``.
- :func:`make_reward_model` -> a tiny one-label ``*ForSequenceClassification``.
- :func:`tiny_checkpoints` -> all three saved to a directory and loaded back.
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Literal

import torch

__all__ = [
    "BRACKET_TEMPLATE",
    "CHATML_TEMPLATE",
    "TinyCheckpoints",
    "collect_rollouts",
    "make_chat_env",
    "make_policy",
    "make_policy_wrapper",
    "make_reward_model",
    "make_tokenizer",
    "prompt_dataloader",
    "tiny_checkpoints",
]

PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<|unk|>"

#: ChatML, the same text as TorchRL's ``chatml_format`` template, so the policy's
#: tokenizer and TorchRL's ``History`` render conversations identically. The generation
#: tags also cover the assistant's ``<|im_end|>``, so SFT with ``assistant_only_loss``
#: learns to stop.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}{% generation %}{{ message['content'] }}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

#: A different template for reward models, so tests can check re-rendering.
BRACKET_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '[' + message['role'] + '] ' + message['content'] + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt -%}{{ '[assistant] ' }}{%- endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "user assistant system you are a helpful assistant",
    "what is two plus two? the answer is four.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000",
    "hello world! how are you today? i am fine, thank you.",
]


def make_tokenizer(
    *,
    vocab_size: int = 160,
    chat_template: str = CHATML_TEMPLATE,
    padding_side: Literal["left", "right"] = "left",
    eos_token: str = IM_END,
):
    """Build a small character-level BPE tokenizer with ``<|pad|>`` and ``<|im_end|>`` (eos).

    Args:
        vocab_size: total vocabulary size (>= 104: 100 printable characters + 4 special
            tokens);
            the remainder are BPE merges learned on a fixed tiny corpus, so two
            tokenizers with different sizes tokenise text differently.
        chat_template: Jinja chat template (ChatML by default).
        padding_side: the tokenizer's padding side.
        eos_token: the EOS token; another one than ``<|im_end|>`` (e.g. ``"</s>"``, as
            Llama-2-style tokenizers with a ChatML template have) is added as a special token.

    Returns:
        a ``transformers.PreTrainedTokenizerFast``; ``decode(encode(s)) == s`` for any text.
    """
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    # Printable ASCII only (plus an unk token): every token decodes to valid text, so
    # what a random tiny policy generates survives decode -> re-encode as the same text.
    special = [PAD_TOKEN, IM_START, IM_END, UNK_TOKEN]
    if eos_token not in special:
        special.append(eos_token)
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=list(string.printable),
        limit_alphabet=len(string.printable),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=eos_token,
        bos_token=None,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side=padding_side,
    )
    hf_tok.chat_template = chat_template
    return hf_tok


def _small_config(kind: str, vocab_size: int, pad_id: int, eos_id: int, **overrides):
    from transformers import LlamaConfig, Qwen2Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    if kind == "llama":
        return LlamaConfig(**kwargs)
    if kind == "qwen2":
        return Qwen2Config(**kwargs)
    raise ValueError(f"kind must be 'llama' or 'qwen2', got {kind!r}")


def make_policy(tokenizer, *, kind: str = "llama", seed: int = 0, **config_overrides):
    """A tiny randomly initialised causal LM matching ``tokenizer`` (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _small_config(
        kind, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, **config_overrides
    )
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # a random policy must not emit padding or a new turn marker: TorchRL masks generated
    # pad tokens out of the rollouts, which makes text and tokens disagree
    model.generation_config.suppress_tokens = [
        tokenizer.pad_token_id,
        tokenizer.convert_tokens_to_ids(IM_START),
        tokenizer.unk_token_id,
    ]
    return model.eval()


def make_reward_model(
    tokenizer, *, kind: str = "llama", num_labels: int = 1, seed: int = 0, **config_overrides
):
    """A tiny randomly initialised ``*ForSequenceClassification`` (one label by default)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = _small_config(
        kind,
        len(tokenizer),
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        num_labels=num_labels,
        **config_overrides,
    )
    return AutoModelForSequenceClassification.from_config(config).eval()


@dataclass
class TinyCheckpoints:
    """Paths of saved tiny checkpoints; each directory loads with ``from_pretrained``."""

    policy: Path
    reward_model: Path
    reward_model_other_tokenizer: Path


def tiny_checkpoints(root: str | os.PathLike, *, seed: int = 0) -> TinyCheckpoints:
    """Save a tiny policy, a reward model sharing its tokenizer, and a reward model
    with its own tokenizer (other merges, other chat template, right padding) under ``root``.

    Directories already present are reused, so this is cheap to call repeatedly.
    """
    root = Path(root)
    paths = TinyCheckpoints(
        policy=root / "policy",
        reward_model=root / "reward_model",
        reward_model_other_tokenizer=root / "reward_model_other_tokenizer",
    )
    policy_tok = make_tokenizer()
    rm_tok = make_tokenizer(vocab_size=140, chat_template=BRACKET_TEMPLATE, padding_side="right")
    builds = [
        (paths.policy, policy_tok, lambda: make_policy(policy_tok, seed=seed)),
        (paths.reward_model, policy_tok, lambda: make_reward_model(policy_tok, seed=seed + 1)),
        (
            paths.reward_model_other_tokenizer,
            rm_tok,
            lambda: make_reward_model(rm_tok, kind="qwen2", seed=seed + 2),
        ),
    ]
    for path, tok, build in builds:
        if (path / "config.json").exists():
            continue
        build().save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
    return paths


def prompt_dataloader(rows: Sequence[dict[str, Any]], batch_size: int):
    """A ``torch.utils.data.DataLoader`` over dict rows (e.g. ``{"query": ..., "answer": ...}``)
    that collates to a dict of lists, the shape ``ChatEnv.from_dataloader`` reads."""
    from torch.utils.data import DataLoader

    def collate(batch):
        return {k: [row[k] for row in batch] for k in batch[0]}

    return DataLoader(list(rows), batch_size=batch_size, collate_fn=collate)


def make_chat_env(
    rows: Sequence[dict[str, Any]],
    *,
    batch_size: int = 2,
    group_size: int = 2,
    max_turns: int = 1,
    input_mode: str = "history",
):
    """A ``ChatEnv`` fed from ``rows`` (each with a ``"query"``), every prompt repeated
    ``group_size`` times (GRPO groups), episodes ending after ``max_turns`` turns.

    Extra row fields (e.g. ``"answer"``) are carried in the rollouts as columns.
    """
    from tensordict import set_list_to_stack
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv

    set_list_to_stack(True).set()
    env = ChatEnv.from_dataloader(
        dataloader=prompt_dataloader(rows, batch_size),
        batch_size=batch_size,
        repeats=group_size,
        input_mode=input_mode,
    )
    return env.append_transform(StepCounter(max_steps=max_turns))


def make_policy_wrapper(
    model,
    tokenizer,
    *,
    pad_output: bool = False,
    max_new_tokens: int = 8,
    input_mode: str = "history",
    generate: bool = True,
    **kwargs,
):
    """A TorchRL ``TransformersWrapper`` around a tiny policy, sampling ``max_new_tokens``."""
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode=input_mode,
        generate=generate,
        return_log_probs=True,
        pad_output=pad_output,
        generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": True} if generate else None,
        **kwargs,
    )


def collect_rollouts(
    policy,
    env,
    *,
    total_turns: int,
    replay_buffer=None,
    seed: int = 0,
    transform=None,
):
    """Run a real ``LLMCollector`` over ``env`` with ``policy`` until ``total_turns`` turns
    are written into ``replay_buffer`` (a new ``ReplayBuffer(LazyStackStorage)`` by default,
    with ``transform`` appended if given). Returns the buffer."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer

    torch.manual_seed(seed)
    if replay_buffer is None:
        replay_buffer = ReplayBuffer(storage=LazyStackStorage(max(total_turns * 2, 16)))
        if transform is not None:
            replay_buffer.append_transform(transform)
    collector = LLMCollector(
        env=env,
        policy=policy,
        dialog_turns_per_batch=env.batch_size.numel(),
        replay_buffer=replay_buffer,
        total_dialog_turns=total_turns,
    )
    for _ in collector:
        pass
    collector.shutdown()
    return replay_buffer
