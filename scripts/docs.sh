#!/usr/bin/env bash
# Set everything up in .venv and build the docs (tutorials executed, warnings are errors).
#   output: docs/_build/html/index.html
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/../docs"
rm -rf _build source/tutorials source/sg_execution_times.rst
exec python -m sphinx -b html -W --keep-going -q source _build/html
