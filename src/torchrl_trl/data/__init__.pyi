"""Public names of :mod:`torchrl_trl.data`: the one list (see :mod:`torchrl_trl._exports`)."""

from .columns import RowColumns as RowColumns
from .dataset import TorchRLBufferDataset as TorchRLBufferDataset
from .formats import BufferFormat as BufferFormat, register_format as register_format
from .groups import SkippedRolloutsWarning as SkippedRolloutsWarning
from .reading import EpochPass as EpochPass, OnlineSampling as OnlineSampling
from .sharding import Sharding as Sharding
from .preference import best_of_n as best_of_n, kto_rows as kto_rows, preference_pairs as preference_pairs
