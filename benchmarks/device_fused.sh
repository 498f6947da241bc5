#!/usr/bin/env bash
# The fused-epilogue device session (issue 15): the GPU tests of the fused options, then the fused
# points (residual add, prenorm, fp8 output; normkit/bench/fused.py) against torch (x + r, the norm,
# the cast), torch.compile of that, Liger's fused add-RMSNorm and quack's rmsnorm(residual=, prenorm=),
# in calls of at most 10 minutes that share one results folder:
#   bash benchmarks/device_fused.sh a RESULTS [budget]   (carry .peersA) tests, bench: decoder shapes
#   bash benchmarks/device_fused.sh b RESULTS [budget]   (carry .peersA) bench: the width sweep, host rows
# RESULTS is a folder in the working tree (copied back from $OUT between the calls), so a fresh
# machine can resume where the last one stopped. Without .peersA, Liger and quack are listed as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: device_fused.sh a|b RESULTS [bench budget seconds]}
res=${2:?results folder}
budget=${3:-330}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site"
mkdir -p "$OUT" "$res"
[ -f .peersA/install.sh ] && bash .peersA/install.sh > /dev/null
ops=rms+add,rms+add+pre,ln+add,ln+add+pre,rms+fp8,ln+fp8
peers=torch,compile,liger,quack
if [ "$stage" = a ]; then
    python3 -c "import xdist" 2>/dev/null && par="-n 8" || par=""
    timeout 240 python3 -m pytest -q $par -p no:cacheprovider -rfEs tests/test_fusion.py tests/test_fusion_autograd.py \
        tests/test_fusion_bench.py tests/test_row_norm.py tests/test_autograd.py > "$OUT/gpu_tests.log" 2>&1
    grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
    timeout $((budget + 40)) python3 -m normkit bench --out "$res" --ops $ops --suites fused-llm --dtypes bf16 \
        --peers $peers --time-budget "$budget" --no-host 2>&1 | tail -14
else
    timeout $((budget + 40)) python3 -m normkit bench --out "$res" --ops $ops --suites fused-llm,fused-sweep \
        --dtypes bf16 --widths 256-65536 --peers $peers --time-budget "$budget" --resume 2>&1 | tail -14
fi
cp -r "$res" "$OUT/"
