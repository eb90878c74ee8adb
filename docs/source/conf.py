"""Sphinx configuration for torchrl-trl. Build with ``make -C docs html`` (warnings are errors)."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torchrl_trl

project = "torchrl-trl"
author = "torchrl-trl contributors"
release = torchrl_trl.__version__

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
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3
intersphinx_mapping = {}  # no network at build time
html_theme = "furo"
html_title = "torchrl-trl"
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
