"""Sphinx configuration for torchrl-trl. Build with ``make -C docs html`` (warnings are errors)."""

import datetime
import os
import re
import tomllib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torchrl_trl

_root = Path(__file__).resolve().parents[2]
_pyproject = tomllib.loads((_root / "pyproject.toml").read_text())["project"]
#: the project's links, from pyproject.toml's [project.urls] (e.g. Repository = "https://...")
_urls = {k.lower(): v for k, v in _pyproject.get("urls", {}).items()}
REPOSITORY_URL = _urls.get("repository") or _urls.get("source") or _urls.get("homepage")

project = "torchrl-trl"
author = "torchrl-trl contributors"
copyright = f"{datetime.date.today().year}, {author} ({_pyproject.get('license', {}).get('text', 'MIT')} license)"
release = torchrl_trl.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
# types in the signature only: "description" listed every keyword argument twice (types
# under "Parameters", the text under "Keyword Arguments")
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3
intersphinx_mapping = {}  # no network at build time
html_theme = "furo"
html_title = f"torchrl-trl {release}"
html_theme_options = {
    "footer_icons": [
        {"name": "TorchRL", "url": "https://github.com/pytorch/rl", "html": "TorchRL", "class": ""},
        {"name": "TRL", "url": "https://github.com/huggingface/trl", "html": "TRL", "class": ""},
    ],
}
if REPOSITORY_URL:
    html_theme_options.update(source_repository=REPOSITORY_URL, source_branch="main", source_directory="docs/source/")
    html_theme_options["footer_icons"].insert(0, {"name": "repository", "url": REPOSITORY_URL, "html": "source", "class": ""})
html_context = {"repository_url": REPOSITORY_URL}
exclude_patterns = ["_build"]
# cross-references into torch/tensordict/transformers cannot be resolved offline
nitpicky = False
suppress_warnings = ["config.cache"]

_here = Path(__file__).parent
sphinx_gallery_conf = {
    "examples_dirs": str(_here.parent / "tutorials"),
    "gallery_dirs": "tutorials",
    "filename_pattern": r"/plot_",
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "within_subsection_order": "FileNameSortKey",
    "show_memory": False,
    "min_reported_time": 1_000_000,
}


# Google-style "a, b: text" entries (two arguments sharing one description) render as
# "b (a,)": split them into one entry per name.
_SHARED_ARG = re.compile(r"^(\s+)([A-Za-z_]\w*), ([A-Za-z_]\w*): (.*)$")


def _split_shared_args(app, what, name, obj, options, lines):
    out, i = [], 0
    while i < len(lines):
        m = _SHARED_ARG.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent, first, second, text = m.groups()
        block = [f"{indent}{first}: {text}"]
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > len(indent):
            block.append(lines[i])
            i += 1
        out += block + [f"{indent}{second}: see ``{first}``."]
    lines[:] = out


def setup(app):
    # before napoleon (priority 500) turns the sections into fields
    app.connect("autodoc-process-docstring", _split_shared_args, priority=100)
