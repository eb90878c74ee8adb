"""Public names of :mod:`torchrl_trl`: every subpackage's (see :mod:`torchrl_trl._exports`)."""

from .data import *
from .online import *
from .rewards import *
from .padding import safe_policy_wrapper as safe_policy_wrapper

__version__: str
