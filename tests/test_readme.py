"""Every ```python block of README.md and of the guide pages (docs/source/*.md) runs as written.

One test per page. A page's blocks run in order in one namespace (a page may build its
models once and use them in later blocks, as a reader does); each page starts from a fresh
namespace, and ends as its script's process would (its objects freed, the Ray runtime it
left stopped). A block can opt out only when it needs what a test machine lacks, with a
first line ``# docs-test: skip (needs a GPU)`` (the reason must name a GPU, the network or
a cluster).
"""

from __future__ import annotations

import gc
import re
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "source").glob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"#\s*docs-test:\s*skip\s*\((.*)\)")
SKIP_REASONS = ("gpu", "network", "cluster")
TEXT_FENCE = re.compile(r"^```text\n(.*?)^```[ \t]*$", re.S | re.M)
# pages whose ```text block shows what their python blocks print: it must be what they print
OUTPUT_SHOWN = {"formats.md"}


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(first line number, code)`` of each ```python block of ``page``."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def _end_like_a_script(namespace: dict) -> None:
    """What the page's process exit would do: free its objects (a ``RayLLMCollector``'s
    ``__del__`` calls its actor, which starts Ray again after the page's
    ``ray.shutdown()``) and stop the Ray runtime it leaves behind."""
    namespace.clear()
    gc.collect()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def test_blocks_are_found():
    """The extraction itself: the README's two quickstart blocks, and fences of other
    languages left out."""
    readme = python_blocks(ROOT / "README.md")
    assert len(readme) >= 2
    assert all("import" in code for _, code in readme)
    assert not any("pip install" in code for _, code in readme)


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_page_runs(page: Path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # and tempfile.mkdtemp() too
    namespace: dict = {"__name__": "__docs_test__"}
    try:
        for line, code in python_blocks(page):
            skip = SKIP.search(code.splitlines()[0]) if code.strip() else None
            if skip:
                assert any(word in skip.group(1).lower() for word in SKIP_REASONS), (
                    f"{page.name}:{line}: a block may skip only for a GPU, the network or a cluster"
                )
                continue
            # padded so that a traceback names the page and its real line number
            exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
    finally:
        _end_like_a_script(namespace)
    if page.name in OUTPUT_SHOWN:
        (shown,) = TEXT_FENCE.findall(page.read_text())
        assert capsys.readouterr().out == shown, f"{page.name}: the output shown is not what the blocks print"


def test_install_page_versions_match_constraints():
    pins = dict(
        line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line
    )
    page = (ROOT / "docs" / "source" / "install.md").read_text()
    rows = re.findall(r"^\| ([\w-]+)(?: \(optional\))? \| ([\d.]+) \|$", page, re.M)
    assert {"torch", "torchrl", "tensordict", "trl", "transformers", "datasets", "accelerate"} <= {n for n, _ in rows}
    for name, pinned in rows:
        assert pins[name] == pinned, (name, pinned, pins[name])
