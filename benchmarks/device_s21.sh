#!/usr/bin/env bash
# Session 21 (issue 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s21.sh sweep   the looped forward compiled under a register cap (fwd_sweep.py s<chunk>k<warps>p<programs
#                                         per SM>): LayerNorm 16K-256K, RMSNorm 128K-256K, against the table (tiles, CUDA
#                                         clusters, looped rows) and torch.compile
#   bash benchmarks/device_s21.sh sweep2  two rows per looped program (fwd_sweep.py s<chunk>k<warps>m2: the parameters' loads
#                                         shared), LayerNorm 32K-256K, RMSNorm 128K-256K; Nsight Compute of the looped forward
#                                         at 32K, LayerNorm against RMSNorm (s4k16: throughputs, warp states, stalls)
#   bash benchmarks/device_s21.sh sweep3  after the forward's instruction cuts (no select in LayerNorm's looped first pass at
#                                         widths compiled in, one FFMA for xhat, no weight-offset add when it is 0): the
#                                         looped rows against S21-1 / S21-2, and `normkit bench` fwd 1K-256K with the peers
#   bash benchmarks/device_s21.sh tests   the GPU test files (after the backward formulas' merge)
#   bash benchmarks/device_s21.sh models  issue 22's cases on the final tree: `device_s19.sh eager` and `eager2` (the host
#                                         table, batch-1 decode with Liger, SD-1.5 UNet inference at batch 1 and 2, the
#                                         Whisper encoder), then compiled Llama decode
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
case "${1:-sweep}" in
sweep)
    sweep 330 ln --ops ln --widths 16384,32768,65536,131072,262144 \
        --variants table,s4k16,s8k32,s4k16p3,s4k16p4,s8k32p2,s2k16p4,s4k32p2,s2k8p8
    sweep 150 rms --ops rms --widths 131072,262144 --variants table,s4k16,s8k32,s16k32,s2k16p4
    ;;
sweep2)
    sweep 200 ln --ops ln --widths 32768,65536,131072,262144 --variants table,s4k16,s2k16m2,s4k16m2,s4k32m2,s8k32m2
    sweep 100 rms --ops rms --widths 131072,262144 --variants table,s16k32,s4k32m2,s8k32m2
    # shellcheck disable=SC2086
    timeout 120 ncu --kernel-name regex:'row_norm_fwd' --launch-skip 1 --launch-count 2 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats \
        --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python3 benchmarks/loop_ncu.py 32768 ln s4k16 > "$OUT/ncu-ln.txt" 2>&1
    timeout 120 ncu --kernel-name regex:'row_norm_fwd' --launch-skip 1 --launch-count 2 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats \
        --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python3 benchmarks/loop_ncu.py 32768 rms s4k16 > "$OUT/ncu-rms.txt" 2>&1
    echo "ncu rc $?"
    for f in ln rms; do
        echo "== $f"; grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Memory Throughput|Achieved Occupancy|Registers Per|issue_stalled" "$OUT/ncu-$f.txt" \
            | awk '$NF+0 > 0.05 || !/issue_stalled/' | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' \
            | cut -c1-110 | head -40
    done
    ;;
sweep3)
    sweep 150 ln --ops ln --widths 16384,32768,65536,131072,262144 --variants table,s4k16,s8k32 --repeat 1
    sweep 90 rms --ops rms --widths 32768,65536,131072,262144 --variants table,s16k32 --repeat 1
    bench 200 --ops ln,rms --dirs fwd --dtypes bf16 --widths 1024,2048,4096,8192,16384,32768,65536,131072,262144 \
        --peers torch,compile --no-host --out "$OUT/fwd"
    ;;
tests)
    gpu_tests 450 tests.log -n 14 ${GPU_TEST_FILES/tests\/test_cuda_backend.py/} tests/test_row_norm.py \
        tests/test_fusion_autograd.py
    ;;
models)
    # session 19's eager cases as they are (its script packs its own archive and empties $OUT: each set aside in turn)
    for part in eager eager2; do
        bash benchmarks/device_s19.sh "$part" > "/tmp/s19-$part.log" 2>&1; tail -12 "/tmp/s19-$part.log"
        mv "$OUT/s19-$part.tgz" "/tmp/keep-s19-$part.tgz"
    done
    mv /tmp/keep-s19-*.tgz "$OUT/"
    bench 130 --models llama --modes decode --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 100 --out "$OUT/llama-compiled"
    ;;
esac
tar czf "/tmp/s21-${1:-sweep}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s21-${1:-sweep}.tgz" "$OUT/"
