#!/usr/bin/env bash
# The device calls that produce the committed results, in two stages on one warm machine
# (the peers' wheels are too large for one call; see ../shared/device/README.md).
#   stage a (carry .peersA): Liger; GPU tests; tune the Triton configs; benchmark part 1
#   stage b (carry .peersB, .gl, .whl; within 30 s of stage a): quack; benchmark the rest; ladders
#   stage c: retune, then normkit against torch and torch.compile only (no staged peers)
# State lives in /tmp/nk between the stages; each stage tars what it has into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: device_final.sh a|b [bench budget seconds]}
budget=${2:-300}
export PYTHONUNBUFFERED=1 NK=/tmp/nk
mkdir -p "$NK" "$OUT"
export PYTHONPATH="$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
peers=torch,compile,liger,quack

if [ "$stage" = a ]; then
    bash .peersA/install.sh
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$NK/env.txt"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_launch.py tests/test_row_norm.py \
        tests/test_api.py tests/test_group_norm.py tests/test_gpu.py 2>&1 | tail -20 > "$NK/gpu_tests.log"
    tail -3 "$NK/gpu_tests.log"
    for i in $(seq 0 11); do timeout 80 python3 benchmarks/tune.py --out /tmp/x.json --compile-only "$i/12" \
        >/dev/null 2>&1 & done; wait
    timeout 150 python3 benchmarks/tune.py --out "$NK/sm_90.json" --budget-s 120 > "$NK/tune.log" 2>&1
    grep BEST "$NK/sm_90.json.log" | tail -60
    cp "$NK/sm_90.json" normkit/backends/triton/tuned/sm_90.json && mkdir -p "$NK/tuned" && cp "$NK/sm_90.json" "$NK/tuned/"
    timeout $((budget + 60)) python3 -m normkit bench --out "$NK/bench" --dtypes bf16 --peers torch,compile,liger \
        --suites sweep --no-host --time-budget "$budget" 2>&1 | tail -25
elif [ "$stage" = c ]; then  # normkit against torch and torch.compile, after a retune; no staged peers
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$NK/env.txt"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_group_norm.py tests/test_launch.py \
        tests/test_gpu.py -x 2>&1 | tail -20 > "$NK/gpu_tests.log"
    tail -3 "$NK/gpu_tests.log"
    for i in $(seq 0 11); do timeout 80 python3 benchmarks/tune.py --out /tmp/x.json --compile-only "$i/12" \
        >/dev/null 2>&1 & done; wait
    timeout 170 python3 benchmarks/tune.py --out "$NK/sm_90.json" --budget-s 150 > "$NK/tune.log" 2>&1
    grep BEST "$NK/sm_90.json.log" | tail -60
    cp "$NK/sm_90.json" normkit/backends/triton/tuned/sm_90.json
    timeout $((budget + 60)) python3 -m normkit bench --out "$NK/bench" --peers torch,compile \
        --time-budget "$budget" 2>&1 | tail -40
else
    bash .peersB/install.sh
    [ -f "$NK/tuned/sm_90.json" ] && cp "$NK/tuned/sm_90.json" normkit/backends/triton/tuned/sm_90.json
    timeout $((budget + 60)) python3 -m normkit bench --out "$NK/bench" --peers "$peers" --resume \
        --time-budget "$budget" 2>&1 | tail -40
    timeout 120 python3 -m normkit ladder --backend cuda --out "$NK/ladder-cuda" --plot 2>&1 | tail -30
    if [ -d .gl ] && [ -d .whl ]; then timeout 120 bash benchmarks/webgpu_device.sh > "$NK/webgpu.log" 2>&1; fi
    [ -d "$OUT/webgpu" ] && cp -r "$OUT/webgpu" "$NK/" && rm -rf "$OUT/webgpu"
fi
tar czf "$OUT/nk-$stage.tgz" -C /tmp nk
