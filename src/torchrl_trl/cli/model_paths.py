"""Model checkpoints given by path or hub id (downloaded when online), checked to hold
safetensors weights before anything is loaded. Used by the CLI and the demo."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["CLIError", "resolve_model_dir"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class CLIError(Exception):
    """A user error: printed as ``torchrl-trl: error: ...`` with exit status 2, no traceback."""


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_model_dir(value: str | os.PathLike, what: str) -> Path:
    """A local checkpoint directory for ``value`` (a directory, or a hub id downloaded when
    online) holding safetensors weights; pickle-only checkpoints are refused unloaded.
    Raises :class:`CLIError` naming ``what`` (e.g. ``"--policy"``) and what was expected."""
    text = os.fspath(value)
    path = Path(text).expanduser()
    if not path.exists():
        looks_like_hub_id = _HUB_ID.match(text) is not None and not text.startswith((".", "~"))
        if not looks_like_hub_id:
            raise CLIError(f"{what}: no such directory: {text!r}")
        if _offline():
            raise CLIError(
                f"{what}: expected a local directory, {text!r} is a hub id and the hub is offline "
                f"(HF_HUB_OFFLINE): 'hf download {text} --local-dir DIR' where online, and pass DIR"
            )
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError

        try:  # the weights, config and tokenizer files only
            patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
            path = Path(snapshot_download(text, allow_patterns=patterns))
        except (HfHubHTTPError, OSError, ValueError) as err:
            raise CLIError(f"{what}: could not download {text!r} from the Hugging Face hub: {err}") from err
    if not path.is_dir():
        raise CLIError(f"{what}: {text!r} is a file; expected a checkpoint directory (config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise CLIError(f"{what}: {text!r} holds no config.json; expected a directory written by save_pretrained")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        found = f" (found {', '.join(pickles)}: pickle, which can run code when loaded)" if pickles else ""
        raise CLIError(
            f"{what}: expected *.safetensors weights, {text!r} holds none{found}; convert where the file is "
            "trusted: from_pretrained(DIR).save_pretrained(DIR)"
        )
    return path
