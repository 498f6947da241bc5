#!/usr/bin/env bash
# Session 13 (issue 24): channels_last GroupNorm on Hopper clusters (row_cluster.cu gn_cl_fwd_cluster /
# gn_cl_bwd_cluster: a cluster per (sample, channel block of whole groups), [positions, channels] tiles held in
# shared memory, x (and dy) read once), one device call:
#   bash benchmarks/device_gn13.sh sweep   their GPU tests (and the NCHW cluster tests), then gn_sweep.py on
#                                         channels_last (bf16, fp32, both directions): the committed plans
#                                         (default) against the cluster kernels at six shapes, torch.compile and
#                                         same-size copies in the same run (run S13-1)
#   bash benchmarks/device_gn13.sh sweep2  after S13-1: the kernels with each thread's first pass on its loads as
#                                         they land and the forward's group sums in one warp step; their GPU
#                                         tests, then the channels_last sweep again (run S13-2)
#   bash benchmarks/device_gn13.sh final   the adopted routes: GroupNorm GPU tests (GroupNorm, CUDA backend and
#                                         host-path files), then the committed plans, both layouts and
#                                         directions, against torch.compile and same-size copies (S13-3)
#   bash benchmarks/device_gn13.sh ncu     (next session, not run yet) Nsight Compute of the committed forward and
#                                         backward kernels and a same-size copy at 8x320x64x64 bf16, both
#                                         layouts: DRAM throughput, occupancy, warp stalls (where a one-wave
#                                         GroupNorm kernel loses to the copy; notes/perf.md session 13)
# Files land in one archive in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
SHAPES=8x320x64x64,8x640x32x32,16x640x32x32,32x256x56x56,4x128x128x128,8x1280x16x16,32x1280x8x8,1x320x64x64
case "${1:-sweep}" in
sweep)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE tests/test_cuda_backend.py \
        -k "gn_cl_cluster or gn_cluster_kernels or refuses" 2>&1 | grep -v '^USDT' > "$OUT/tests-gn-cl.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-gn-cl.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests-gn-cl.log"
    grep -E "^E " "$OUT/tests-gn-cl.log" | head -12 | cut -c1-300
    timeout 330 python3 benchmarks/gn_sweep.py --out "$OUT/s" --dtypes bf16,fp32 --acts - --peers compile,copy \
        --layouts cl --shapes $SHAPES --variants default,clc,clc-512,clc-96k,clc-32k,clc-run128,clc-128 \
        --budget 300 > "$OUT/sweep.log" 2>&1
    echo "sweep rc $?"; grep -E "^(bf16|fp32|copy|budget)" "$OUT/sweep.log" | cut -c1-400
    ;;
sweep2)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE tests/test_cuda_backend.py -k "gn_cl_cluster" \
        2>&1 | grep -v '^USDT' > "$OUT/tests-gn-cl.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-gn-cl.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests-gn-cl.log"
    grep -E "^E " "$OUT/tests-gn-cl.log" | head -12 | cut -c1-300
    timeout 250 python3 benchmarks/gn_sweep.py --out "$OUT/s" --dtypes bf16,fp32 --acts - --peers compile,copy \
        --layouts cl --shapes $SHAPES --variants default,clc,clc-96k,clc-128,clc-run128 --budget 220 > "$OUT/sweep.log" 2>&1
    echo "sweep rc $?"; grep -E "^(bf16|fp32|copy|budget)" "$OUT/sweep.log" | cut -c1-400
    ;;
final)
    timeout 130 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE tests/test_group_norm.py tests/test_cuda_backend.py \
        tests/test_host_gpu.py -k "group_norm or gn_ or channels_last or cl_" 2>&1 | grep -v '^USDT' > "$OUT/tests.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests.log"
    timeout 200 python3 benchmarks/gn_sweep.py --out "$OUT/s" --dtypes bf16,fp32 --acts - --peers compile,copy \
        --layouts nchw,cl --shapes $SHAPES --variants default --budget 180 > "$OUT/sweep.log" 2>&1
    echo "sweep rc $?"; grep -E "^(bf16|fp32|copy|budget)" "$OUT/sweep.log" | cut -c1-300
    ;;
ncu)
    for layout in "" --cl; do
        timeout 120 ncu --kernel-name regex:'gn_|group_norm|col_sum|elementwise|copy' --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
            python3 benchmarks/gn_ncu.py 8x320x64x64 $layout --copy > "$OUT/ncu${layout/--/-}.txt" 2>&1
        echo "ncu $layout rc $?"; grep -E "gn_ncu|DRAM Throughput|Duration|Achieved Occupancy" "$OUT/ncu${layout/--/-}.txt" | head -40
    done
    ;;
esac
tar czf "/tmp/gn13-${1:-sweep}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/gn13-${1:-sweep}.tgz" "$OUT/"
