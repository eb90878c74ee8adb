"""TorchRL -> TRL data: replay buffers as datasets for TRL trainers."""

from .dataset import TorchRLBufferDataset
from .formats import BufferFormat, available_formats, get_format, register_format

__all__ = ["BufferFormat", "TorchRLBufferDataset", "available_formats", "get_format", "register_format"]
from . import offline_formats  # noqa: E402,F401  registers the dpo/reward/kto/rloo formats
