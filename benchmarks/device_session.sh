#!/usr/bin/env bash
# One device session's calls (see ../shared/device/README.md for why the peers take two calls):
#   stage a (carry .peersA): Liger; the GPU tests (Triton, CUDA backend, compile/patch); the CUDA
#           ladder; the benchmark sweep against torch, torch.compile and Liger, until the budget
#   stage b (carry .peersB; within the warm window of stage a): quack; the sweep resumed with
#           every peer; run again with b to finish it
# State lives in /tmp/nk between the stages; each stage tars it into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: device_session.sh a|b [bench budget seconds]}
budget=${2:-420}
export PYTHONUNBUFFERED=1 NK=/tmp/nk
mkdir -p "$NK" "$OUT"
export PYTHONPATH="$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
if [ "$stage" = a ]; then
    bash .peersA/install.sh
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$NK/env.txt"
    python3 -c "import xdist" 2>/dev/null && par="-n 8" || par=""
    timeout 260 python3 -m pytest -q $par -p no:cacheprovider -rfEs tests/test_cuda_backend.py tests/test_gpu.py \
        tests/test_group_norm.py tests/test_compile.py tests/test_patch.py > "$NK/gpu_tests.log" 2>&1
    grep -E "passed|failed" "$NK/gpu_tests.log" | tail -3; grep -E "^(FAILED|ERROR)" "$NK/gpu_tests.log" | head -30
    timeout 150 python3 -m normkit ladder --backend cuda --out "$NK/ladder-cuda" --plot > "$NK/ladder.log" 2>&1
    tail -5 "$NK/ladder.log"
    timeout $((budget + 30)) python3 -m normkit bench --out "$NK/bench" --peers torch,compile,liger \
        --time-budget "$budget" 2>&1 | tail -8
else
    [ -f /tmp/site/quack/__init__.py ] || bash .peersB/install.sh
    timeout $((budget + 60)) python3 -m normkit bench --out "$NK/bench" --peers torch,compile,liger,quack \
        --resume --time-budget "$budget" 2>&1 | tail -40
fi
tar czf "$OUT/nk-$stage.tgz" -C /tmp nk
