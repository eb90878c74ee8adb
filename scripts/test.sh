#!/usr/bin/env bash
# Set everything up in .venv and run the test suite.
#   usage: bash scripts/test.sh [pytest args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python -m pytest -q "$@"
