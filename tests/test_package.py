"""Package-level promises: light imports and a complete public API."""

import subprocess
import sys

import pytest


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    return set(out.stdout.split())


def test_import_does_not_pull_trl_datasets_or_ray():
    loaded = _imported_after("import torchrl_trl")
    assert not {"trl", "datasets", "ray", "torchrl"} & loaded


@pytest.mark.parametrize("name", ["TorchRLBufferDataset", "HFRewardModelWrapper"])
def test_public_classes_load_without_trl_or_datasets(name):
    loaded = _imported_after(f"from torchrl_trl import {name}")
    assert not {"trl", "datasets"} & loaded


def test_every_public_name_resolves():
    import torchrl_trl

    for name in torchrl_trl.__all__:
        assert getattr(torchrl_trl, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        torchrl_trl.nope
