"""Lazy public names, declared once per package in its ``__init__.pyi`` stub (SPEC 1):
``from .module import Name as Name`` (imported on first access) or ``from .subpackage import *``."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_stub(package: str, init_file: str) -> dict[str, str]:
    """``{public name: module that defines it}`` declared by the ``__init__.pyi`` next to
    ``init_file``; ``ValueError`` naming the stub and line for any other statement or a name declared twice."""
    stub = Path(init_file).with_suffix(".pyi")
    exports: dict[str, str] = {}
    for node in ast.parse(stub.read_text(), filename=str(stub)).body:
        if isinstance(node, ast.AnnAssign) or isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring, ``__version__: str``
        if not (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module):
            forms = "'from .module import Name as Name' or 'from .subpackage import *'"
            raise ValueError(f"{stub}:{node.lineno}: expected {forms}")
        module = f"{package}.{node.module}"
        if [a.name for a in node.names] == ["*"]:
            names = dict.fromkeys(importlib.import_module(module).__all__, module)
        else:
            if any(a.asname != a.name for a in node.names):
                raise ValueError(f"{stub}:{node.lineno}: write each name as 'Name as Name' (PEP 484's re-export form)")
            names = {a.name: module for a in node.names}
        if twice := sorted(set(names) & set(exports)):
            raise ValueError(f"{stub}:{node.lineno}: {twice} declared twice")
        exports.update(names)
    return exports


def attach(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``: a name is imported on first access, then cached.

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
