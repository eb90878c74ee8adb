"""TorchRL -> TRL data: replay buffers as datasets for TRL trainers (:class:`TorchRLBufferDataset`,
formats), and scored groups as offline trainer rows. Public names: ``__init__.pyi``, loaded on first use."""

from .._exports import attach

__getattr__, __dir__, __all__ = attach(__name__, __file__)
