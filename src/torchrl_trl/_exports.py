"""Lazy public names, declared once per package in its ``__init__.pyi`` stub.

A package's stub is its one list of public names, read by type checkers and IDEs as any
stub is, and parsed here at import time (the scheme of Scientific Python's SPEC 1 "lazy
loading of submodules and functions"):

- ``from .module import Name as Name`` declares ``Name``, defined in ``.module`` and
  imported from it on first access;
- ``from .subpackage import *`` re-exports every public name of ``.subpackage`` (read from
  its own stub), which is how the top level derives its list from the subpackages'.

Nothing but the stub's text is read until a name is used, so ``import torchrl_trl`` does
not import torch, torchrl, trl, datasets or ray.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_stub(package: str, init_file: str) -> dict[str, str]:
    """``{public name: absolute module that defines it}`` declared by the ``__init__.pyi``
    next to ``init_file`` (the package's ``__file__``); ``package`` is its ``__name__``.

    Raises ``ValueError`` naming the stub and line for anything that is not one of the two
    declaration forms (a stub that silently declared nothing would hide a name), and for a
    name declared twice.
    """
    stub = Path(init_file).with_suffix(".pyi")
    exports: dict[str, str] = {}
    for node in ast.parse(stub.read_text(), filename=str(stub)).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.AnnAssign):
            continue  # e.g. ``__version__: str``, defined in __init__.py itself
        if not (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module):
            raise ValueError(
                f"{stub}:{node.lineno}: expected 'from .module import Name as Name' or "
                "'from .subpackage import *'"
            )
        module = f"{package}.{node.module}"
        if [a.name for a in node.names] == ["*"]:
            names = dict.fromkeys(importlib.import_module(module).__all__, module)
        else:
            redundant = [a for a in node.names if a.asname == a.name]
            if len(redundant) != len(node.names):
                raise ValueError(f"{stub}:{node.lineno}: write each name as 'Name as Name' (PEP 484's re-export form)")
            names = {a.name: module for a in node.names}
        twice = sorted(set(names) & set(exports))
        if twice:
            raise ValueError(f"{stub}:{node.lineno}: {twice} declared twice")
        exports.update(names)
    return exports


def attach(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for the package ``package`` whose public names
    its ``__init__.pyi`` declares (see :func:`read_stub`). A name is imported from its
    module on first access and then cached in the package's namespace.

    >>> import torchrl_trl.online as online
    >>> "CollectorCallback" in online.__all__
    True
    >>> online.nope
    Traceback (most recent call last):
    AttributeError: module 'torchrl_trl.online' has no attribute 'nope'

    """
    exports = read_stub(package, init_file)
    public = sorted(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(public) | set(vars(importlib.import_module(package))))

    return __getattr__, __dir__, public
