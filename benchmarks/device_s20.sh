#!/usr/bin/env bash
# Session 20 (issues 22, 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s20.sh sweep   the looped forward with the width compiled in (fwd_sweep.py s<chunk>k<warps>),
#                                         LayerNorm's now summing shifted values per lane, 8K-128K, both ops, against
#                                         the table (tiles, CUDA clusters) and torch.compile; the compile and row GPU tests
#   bash benchmarks/device_s20.sh sweep2  the same sweep after the looped forward issues its next loads before each
#                                         CTA barrier (the shift's reduction, the row's statistics); the row GPU tests
#   bash benchmarks/device_s20.sh final   `normkit bench` fwd 8K-256K with torch and torch.compile on the final table;
#                                         the GPU test files but the CUDA backend's (its kernels unchanged)
#   bash benchmarks/device_s20.sh host    the host path's GPU tests (after test_host_gpu's route fix); the eager models
#                                         then run as `bash benchmarks/device_s19.sh eager` and `... eager2`
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
# the sweep both runs took (S20-1 before, S20-2 after the loads issued ahead of the barriers)
static_sweep() {
    timeout "$1" python3 benchmarks/fwd_sweep.py --out "$OUT/static" --widths 8192,16384,32768,65536,131072 \
        --variants table,s2k16,s4k16,s8k16,s4k32,s8k32,s16k32 > "$OUT/static.log" 2>&1
    echo "static rc $?"; grep -E "copy|FAIL|Error" "$OUT/static.log" | cut -c1-140
    python3 benchmarks/csv_table.py "$OUT/static/fwd.csv"
}
case "${1:-sweep}" in
sweep)
    static_sweep 290
    gpu_tests 250 tests.log -n 14 tests/test_compile_fusion.py tests/test_compile.py tests/test_compile_cache.py \
        tests/test_row_norm.py tests/test_gate.py tests/test_modulation.py tests/test_host_gpu.py
    ;;
sweep2)
    static_sweep 200
    gpu_tests 200 tests.log -n 14 tests/test_row_norm.py tests/test_gate.py tests/test_modulation.py \
        "tests/test_compile_fusion.py::test_a_graph_for_symbolic_sizes_is_decided_for_every_size"
    ;;
final)
    bench 160 --ops ln,rms --dirs fwd --dtypes bf16,fp16 --widths 8192,16384,32768,65536,131072,262144 \
        --peers torch,compile --no-host --out "$OUT/fwd"
    gpu_tests 330 tests.log -n 14 ${GPU_TEST_FILES/tests\/test_cuda_backend.py/}
    ;;
host)
    gpu_tests 120 tests.log -n 8 tests/test_host_gpu.py
    ;;
esac
tar czf "/tmp/s20-${1:-sweep}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s20-${1:-sweep}.tgz" "$OUT/"
