#!/usr/bin/env bash
# Set everything up in .venv and run the end-to-end demo on tiny built-in models.
#   usage: bash scripts/demo.sh [demo flags, e.g. --quick --output-dir DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec torchrl-trl demo "$@"
