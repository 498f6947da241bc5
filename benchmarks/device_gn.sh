#!/usr/bin/env bash
# The GroupNorm device session (issue #5): GPU tests, the host-overhead profile and the GroupNorm
# suites (anchors, seed 004's 1D blocks, diffusion 2D blocks in both memory formats) against torch,
# torch.compile and Liger, in calls of at most 10 minutes that share one results folder:
#   bash benchmarks/device_gn.sh a RESULTS [budget]   (carry .peersA) tests, profile, bench bf16+fp32
#   bash benchmarks/device_gn.sh b RESULTS [budget]   (carry .peersA) the bench resumed; fp16; host rows; profile
# RESULTS is a folder in the working tree (copied back from $OUT between the calls), so a fresh
# machine can resume where the last one stopped.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: device_gn.sh a|b RESULTS [bench budget seconds]}
res=${2:?results folder}
budget=${3:-330}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site"
mkdir -p "$OUT" "$res"
bash .peersA/install.sh > /dev/null
peers=torch,compile,liger
if [ "$stage" = a ]; then
    python3 -c "import xdist" 2>/dev/null && par="-n 8" || par=""
    timeout 240 python3 -m pytest -q $par -p no:cacheprovider -rfEs tests/test_group_norm.py tests/test_gpu.py \
        tests/test_row_norm.py tests/test_bench.py tests/test_api.py tests/test_launch.py > "$OUT/gpu_tests.log" 2>&1
    grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
    timeout 90 python3 benchmarks/profile_host.py > "$OUT/profile_host.txt" 2>&1; head -22 "$OUT/profile_host.txt"
    timeout $((budget + 40)) python3 -m normkit bench --out "$res" --ops gn --suites gn-anchors,gn-1d,gn-2d \
        --dtypes bf16,fp32 --peers $peers --time-budget "$budget" --no-host 2>&1 | tail -4
else
    timeout $((budget + 40)) python3 -m normkit bench --out "$res" --ops gn --suites gn-anchors,gn-1d,gn-2d \
        --dtypes bf16,fp32 --peers $peers --time-budget "$budget" --resume --no-host 2>&1 | tail -4
    timeout 200 python3 -m normkit bench --out "$res" --ops gn,ln,rms --suites gn-anchors,gn-2d,llm.c \
        --dtypes fp16,fp32 --peers $peers --time-budget 150 --resume 2>&1 | tail -30
    timeout 90 python3 benchmarks/profile_host.py > "$OUT/profile_host.txt" 2>&1; head -22 "$OUT/profile_host.txt"
fi
cp -r "$res" "$OUT/"
