#!/usr/bin/env bash
# Run upstream's own TRL-interop tests and tutorial against torchrl_trl, with only the
# import lines changed ("switching is an import change").
#   usage: bash scripts/check_upstream_dropin.sh PATH_TO_PYTORCH_RL
# PATH_TO_PYTORCH_RL is a pytorch/rl clone (a work tree, or a bare git directory); the
# files are read from its HEAD. Not part of CI (it needs that checkout); prints pytest's
# summary for TestTRLInterop, then "tutorial: ok" if the tutorial runs to the end.
set -euo pipefail
RL="${1:?usage: $0 PATH_TO_PYTORCH_RL}"
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [ -d "$RL/.git" ]; then GIT=(git -C "$RL"); else GIT=(git --git-dir="$RL"); fi

"${GIT[@]}" show HEAD:test/llm/test_wrapper.py \
    | sed 's/^from torchrl.modules.llm.trl_interop import /from torchrl_trl import /' > "$WORK/test_wrapper.py"
"${GIT[@]}" show HEAD:tutorials/sphinx-tutorials/trl_interop.py \
    | sed -E 's/^from torchrl.modules.llm import (TorchRLBufferDataset|HFRewardModelWrapper)$/from torchrl_trl import \1/' \
    > "$WORK/tutorial.py"
for f in test_wrapper.py tutorial.py; do
    grep -q "^from torchrl_trl import" "$WORK/$f" || { echo "no upstream import replaced in $f" >&2; exit 1; }
done

cd "$WORK"
python -m pytest -q -p no:cacheprovider test_wrapper.py -k TestTRLInterop
python tutorial.py > tutorial.log 2>&1 && echo "tutorial: ok" || { tail -20 tutorial.log; exit 1; }
