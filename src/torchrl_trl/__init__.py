"""torchrl-trl: mix TorchRL and Hugging Face TRL one piece at a time.

The top level re-exports, lazily, the public names of :mod:`torchrl_trl.data` (TorchRL ->
TRL data), :mod:`torchrl_trl.rewards` (reward models and functions, both ways) and
:mod:`torchrl_trl.online` (a collector alongside a trainer), so ``import torchrl_trl`` never
imports ``torch``, ``trl``, ``datasets`` or ``ray``. A new public name = one line in its
subpackage's ``__init__.pyi``, an entry in ``docs/source/api.rst`` and a ``>>>`` example.
"""

from ._exports import attach

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = attach(__name__, __file__)
__all__ = [*__all__, "__version__"]
