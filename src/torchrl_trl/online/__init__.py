"""Online and distributed: a TorchRL collector feeding a TRL trainer (callbacks, staleness, priorities,
buffer checkpoints, GRPO rollout functions, Ray buffers and collectors).

The public names are declared once, in ``__init__.pyi``, and imported on first use.
"""

from .._exports import attach

__getattr__, __dir__, __all__ = attach(__name__, __file__)
