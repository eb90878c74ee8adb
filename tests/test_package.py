"""Package-level promises: light imports, one list of public names, each documented with a
runnable example."""

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchrl_trl
from torchrl_trl._exports import read_stub

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("data", "rewards", "online")
PUBLIC = sorted(set(torchrl_trl.__all__) - {"__version__"})


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    return set(out.stdout.split())


def test_import_does_not_pull_trl_datasets_or_ray():
    loaded = _imported_after("import torchrl_trl, torchrl_trl.data, torchrl_trl.rewards, torchrl_trl.online")
    assert not {"trl", "datasets", "ray", "torchrl", "torch"} & loaded


@pytest.mark.parametrize("name", ["TorchRLBufferDataset", "HFRewardModelWrapper"])
def test_public_classes_load_without_trl_or_datasets(name):
    loaded = _imported_after(f"from torchrl_trl import {name}")
    assert not {"trl", "datasets"} & loaded


def test_every_public_name_resolves():
    for name in torchrl_trl.__all__:
        assert getattr(torchrl_trl, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        torchrl_trl.nope


def test_top_level_is_the_union_of_the_subpackages():
    """One list per subpackage (its stub); the top level derives its names from theirs, adds
    those of its own modules (``padding``), and hands out the very same objects."""
    owners = {name: module.rsplit(".", 1)[-1] for name, module in read_stub("torchrl_trl", torchrl_trl.__file__).items()
              if module.rsplit(".", 1)[-1] not in SUBPACKAGES}
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"torchrl_trl.{sub}")
        assert module.__all__ == sorted(read_stub(module.__name__, module.__file__))
        for name in module.__all__:
            assert name not in owners, f"{name} exported by both {owners[name]} and {sub}"
            owners[name] = sub
            assert getattr(torchrl_trl, name) is getattr(module, name)
    assert sorted(owners) == PUBLIC
    assert set(dir(torchrl_trl)) >= set(torchrl_trl.__all__)


def test_a_malformed_stub_is_refused(tmp_path):
    (tmp_path / "__init__.pyi").write_text("from .m import A\n")
    with pytest.raises(ValueError, match=r"__init__.pyi:1: write each name as 'Name as Name'"):
        read_stub("pkg", str(tmp_path / "__init__.py"))
    (tmp_path / "__init__.pyi").write_text("import os\n")
    with pytest.raises(ValueError, match=r"__init__.pyi:1: expected 'from .module import Name as Name'"):
        read_stub("pkg", str(tmp_path / "__init__.py"))
    (tmp_path / "__init__.pyi").write_text("from .m import A as A\nfrom .n import A as A\n")
    with pytest.raises(ValueError, match=r"\['A'\] declared twice"):
        read_stub("pkg", str(tmp_path / "__init__.py"))


def test_api_reference_lists_every_export():
    api = (ROOT / "docs" / "source" / "api.rst").read_text()
    documented = set(re.findall(r"^\.\. auto(?:class|function|exception):: [\w.]+\.(\w+)$", api, re.M))
    missing = sorted(set(PUBLIC) - documented)
    assert not missing, f"exported but not in docs/source/api.rst: {missing}"


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_has_a_runnable_example(name):
    """A ``>>>`` example in the name's own docstring (pytest --doctest-modules runs it)."""
    doc = inspect.getdoc(getattr(torchrl_trl, name)) or ""
    assert ">>>" in doc, f"{name}: no >>> example in its docstring"


def test_contributing_names_every_module():
    """CONTRIBUTING.md's layout says what each module does: a new module gets a line there."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    src = ROOT / "src" / "torchrl_trl"
    modules = sorted(p.relative_to(src) for p in src.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    missing = [str(m) for m in modules if m.name not in text]
    assert not missing, f"modules not described in CONTRIBUTING.md's layout: {missing}"
