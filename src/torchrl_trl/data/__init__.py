"""TorchRL -> TRL data: replay buffers as datasets for TRL trainers.

- :class:`TorchRLBufferDataset`: a TorchRL replay buffer read as a ``datasets`` dataset
  in one of the registered formats (:func:`available_formats`, :func:`get_format`,
  :func:`register_format`, :class:`BufferFormat`).
- scored groups -> offline trainer rows: :func:`best_of_n`, :func:`preference_pairs`,
  :func:`kto_rows`; :func:`find_groups`, :class:`SkipStats`, :class:`SkippedRolloutsWarning`.

The public names are declared once, in ``__init__.pyi``, and imported on first use.
"""

from .._exports import attach

__getattr__, __dir__, __all__ = attach(__name__, __file__)
