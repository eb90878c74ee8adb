#!/usr/bin/env bash
# Set everything up in .venv and run the test suite, on TEST_WORKERS pytest-xdist workers
# (default 2: the suite waits on subprocesses and Ray a lot; 0 runs it in this process),
# each test module on one worker (its module fixtures are built once).
#   usage: bash scripts/test.sh [pytest args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
