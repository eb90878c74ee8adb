"""torchrl-trl: mix TorchRL and Hugging Face TRL one piece at a time.

The top level re-exports :mod:`torchrl_trl.data`, :mod:`torchrl_trl.rewards` and
:mod:`torchrl_trl.online` lazily (``import torchrl_trl`` imports neither ``torch`` nor ``trl``).
A new public name = one line in its subpackage's ``__init__.pyi``, an entry in
``docs/source/api.rst`` and a ``>>>`` example.
"""

from ._exports import attach

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = attach(__name__, __file__)
__all__ = [*__all__, "__version__"]
