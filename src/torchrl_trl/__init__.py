"""torchrl-trl: mix TorchRL and Hugging Face TRL one piece at a time.

The top level re-exports the public names of its subpackages (``torchrl_trl.X`` is
``torchrl_trl.<subpackage>.X``), each imported on first use, so ``import torchrl_trl``
stays light and never imports ``torch``, ``trl``, ``datasets`` or ``ray``:

- :mod:`torchrl_trl.data`: TorchRL -> TRL data (:class:`TorchRLBufferDataset`, the
  format registry, scored groups -> offline trainer rows);
- :mod:`torchrl_trl.rewards`: HF reward models and TRL reward functions in TorchRL, and
  TorchRL rewards as TRL ``reward_funcs``;
- :mod:`torchrl_trl.online`: a TorchRL collector alongside a TRL trainer, buffer
  checkpoints, Ray, and TRL's GRPO on TorchRL rollouts.

Each subpackage declares its names once, in its ``__init__.pyi`` (which type checkers read
too); this package's stub star-imports them. Adding a public name = one line in the
subpackage's stub, one entry in ``docs/source/api.rst``, a ``>>>`` example in its
docstring (``tests/test_package.py`` checks all three).
"""

from ._exports import attach

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = attach(__name__, __file__)
__all__ = [*__all__, "__version__"]
