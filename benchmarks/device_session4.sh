#!/usr/bin/env bash
# Session 4's device calls (one H200, carry .whl with liger-kernel and diffusers wheels), each under
# 10 minutes, results under $OUT:
#   a  GPU tests of what changed this session (autograd contract, fused epilogues, host path, model
#      conformance, block fusion, compile pass, cluster routes), then the compile decision table
#      (benchmarks/compile_table.py: Inductor vs normkit's fused op per pattern/dtype/width class)
#   b  the model benchmark: every model eager (unpatched, normkit.patch, Liger), then compiled models
#   c  the kernel bench: fused points (residual, prenorm, fp8) on decoder shapes and the GroupNorm
#      diffusion suite against torch, torch.compile and Liger, then more compiled models
set -uo pipefail
stage=${1:?usage: device_session4.sh a|b|c}
source "$(dirname "$0")/device_env.sh" "env-$stage.txt"
start=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - start) )); }  # seconds left of a stage budget
case $stage in
a)
    timeout 250 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE tests/test_autograd.py tests/test_fusion.py \
        tests/test_fusion_autograd.py tests/test_fusion_bench.py tests/test_host_gpu.py tests/test_models.py \
        tests/test_blocks.py tests/test_compile.py tests/test_compile_fusion.py tests/test_distributed.py \
        tests/test_edge_cases.py tests/test_patch.py 2>&1 | grep -v '^USDT' > "$OUT/tests-a.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-a.log" | cut -c1-160 | head -30; tail -1 "$OUT/tests-a.log"
    OUT=$OUT bash benchmarks/device_compile_table.sh "$(left 440)" 2>&1 | tail -40
    ;;
b)
    OUT=$OUT BUDGET=${BUDGET:-330} bash benchmarks/device_models.sh eager 2>&1 | tail -30
    OUT=$OUT BUDGET=$(left 420) bash benchmarks/device_models.sh conv --variants unpatched,normkit 2>&1 | tail -20
    ;;
c)
    timeout 200 python3 -m normkit bench --out "$OUT/fused" --ops rms+add,rms+add+pre,ln+add+pre,rms+fp8 \
        --suites fused-llm --dtypes bf16 --peers torch,compile,liger --time-budget 160 --no-plots 2>&1 | tail -12
    timeout 150 python3 -m normkit bench --out "$OUT/gn" --ops gn --suites gn-2d --dtypes bf16 --peers torch,compile \
        --time-budget 120 --no-plots --no-host 2>&1 | tail -8
    OUT=$OUT BUDGET=$(left 420) bash benchmarks/device_models.sh llama --variants unpatched,normkit,liger 2>&1 | tail -20
    ;;
esac
