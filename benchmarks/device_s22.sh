#!/usr/bin/env bash
# Session 22 (issues 22, 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s22.sh sweep   (run S22-1, on a49d85b) the looped LayerNorm forward's ways to its statistics
#                                         (then fwd_sweep.py s<chunk>k<warps>r<mode>, a knob since removed: one
#                                         cross-warp reduction a row instead of three) at 16K-256K against the table
#   bash benchmarks/device_s22.sh gn      GroupNorm's looped kernels built as the row forward's (gn_sweep.py ps-*: per-slot
#                                         sums, one reduction, the next tile's loads ahead) against the committed plans,
#                                         NCHW bf16 / fp32, forward and backward; the looped GroupNorm tests on the GPU
#   bash benchmarks/device_s22.sh tests   the GPU test files (the backward ops' arguments by name, merged from s21-autograd),
#                                         then a second look at the GroupNorm shapes where gn's ps-* won (S = 1024)
#   bash benchmarks/device_s22.sh models  `normkit bench --ops gn --suites gn-2d` bf16 forward with the peers (the slot kernels
#                                         taken at S <= 1024), then issue 22's model cases on the final tree as S21-5
#                                         (`device_s19.sh eager` and `eager2`, compiled Llama decode)
#   bash benchmarks/device_s22.sh guards  compiled Llama decode, unpatched against normkit: dynamo's guards (count, cold
#                                         latency) and the host time per step with the guards evaluated and skipped
#                                         (benchmarks/decode_guards.py)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
case "${1:-sweep}" in
sweep)
    gpu_tests 60 modes.log tests/test_row_norm.py -k "statistics_modes or looped"
    sweep 420 ln --ops ln --widths 16384,32768,65536,131072,262144 \
        --variants table,s4k16,s4k16r1,s4k16r2,s4k16r3,s8k32,s8k32r1,s8k32r3 --repeat 1
    ;;
gn)
    gpu_tests 90 gn-tests.log tests/test_group_norm.py -k "looped or offset or nan"
    timeout 420 python3 benchmarks/gn_sweep.py --out "$OUT/gn" --layouts nchw --dtypes bf16,fp32 --acts - \
        --act-variants default --peers compile --variants default,ps-4k16,ps-8k32,ps-2k8,ps-8k16,ps-4k16-all \
        --budget 330 2>&1 | grep -E "copy|bf16|fp32|done" | cut -c1-260
    ;;
tests)
    gpu_tests 450 tests.log -n 14 ${GPU_TEST_FILES/tests\/test_cuda_backend.py/} tests/test_row_norm.py \
        tests/test_fusion_autograd.py
    timeout 100 python3 benchmarks/gn_sweep.py --out "$OUT/gn2" --layouts nchw --dtypes bf16 --acts - --dirs fwd \
        --act-variants default --peers "" --variants default,ps-2k8,ps-4k16 \
        --shapes 8x640x32x32,16x640x32x32,8x320x64x64,32x256x56x56 2>&1 | grep -E "copy|bf16|done" | cut -c1-200
    ;;
models)
    bench 150 --ops gn --suites gn-2d --dtypes bf16 --dirs fwd --peers torch,compile --no-host --out "$OUT/gn-bench"
    issue22_eager_models
    bench 130 --models llama --modes decode --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 100 --out "$OUT/llama-compiled"
    ;;
guards)
    timeout 400 python3 benchmarks/decode_guards.py full cuda 2>/dev/null | tail -4
    ;;
esac
tar czf "/tmp/s22-${1:-sweep}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s22-${1:-sweep}.tgz" "$OUT/"
