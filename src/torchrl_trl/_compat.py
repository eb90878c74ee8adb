"""The few places where torchrl-trl relies on another library's private internals.

Each function wraps exactly one private use that has no public equivalent, names the
library versions it was checked against, and is covered by ``tests/test_compat.py``, so an
upgrade that breaks it fails in one obvious place instead of deep inside a trainer.
"""
from __future__ import annotations
