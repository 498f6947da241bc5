#!/usr/bin/env bash
# Session 26 (issue 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s26.sh ahead   the wide forward's weight / bias packs fetched ahead of their stores
#                                         (NK_PARAM_AHEAD packs, row_cluster.cu) against none, and with the RMSNorm
#                                         cap at 1280 threads per SM (NK_FWD_SM_THREADS), in turn twice: `normkit bench`
#                                         LN / RMS forward, 64K-256K, the CUDA backend forced (bf16; fp32 in round 1);
#                                         then the CUDA backend's row cluster tests on the default
#   bash benchmarks/device_s26.sh tests   the GPU test files (the CUDA backend's apart) and its row cluster tests
#   bash benchmarks/device_s26.sh table   `normkit bench`: the bf16 backward at 16K-256K, the bf16 / fp32 forward at
#                                         64K-256K, against torch and torch.compile
#   bash benchmarks/device_s26.sh hold    RMSNorm's bf16 forward at 128K / 256K on persistent clusters (one or two waves)
#                                         holding each CTA's weight slice in registers over its rows (NK_FWD_HOLD=1),
#                                         against the committed kernel and the same shapes without it (widefwd_sweep.py)
#   bash benchmarks/device_s26.sh measure the row backward's clusters with each CTA's weight slice held in registers
#                                         over its rows (NK_BWD_HOLD_W=1) against read at each use (=0), rounds A B B A:
#                                         `normkit bench` LN / RMS backward, bf16 and fp32, 16K-256K; fp32 RMSNorm's
#                                         forward with its parameters ahead (S26-1's pick) against none, A B B A; NCHW
#                                         GroupNorm's cluster forward with its channels' parameters ahead (NK_GN_AHEAD
#                                         0 / 1 / 2) at the routed shapes (gn_sweep.py, default routes)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
# cuda_ab NAME DEFINES SECONDS ARGS...: `normkit bench ARGS` on the CUDA backend (no peers, no host table) under
# NORMKIT_CUDA_DEFINES=DEFINES into $OUT/NAME, its table lines
cuda_ab() {
    local name=$1 defines=$2 t=$3; shift 3
    echo "== $name ($defines)"
    NORMKIT_CUDA_DEFINES="$defines" NORMKIT_HOST=0 bench "$t" "$@" --normkit cuda --peers none --no-host \
        --out "$OUT/$name"
    grep -v "^#" "$OUT/$name/results.csv" | cut -d, -f2,4,6,8,13,16,18,21 | grep -v "^op"
}
# fwd_ab NAME DEFINES DTYPES: the wide forward; bwd_ab NAME DEFINES: the row backward
fwd_ab() { cuda_ab "$1" "$2" 80 --ops ln,rms --dtypes "$3" --dirs fwd --widths 65536,131072,262144; }
bwd_ab() { cuda_ab "$1" "$2" 100 --ops ln,rms --dtypes bf16,fp32 --dirs bwd --widths 16384,32768,131072,262144; }
case "${1:-ahead}" in
tests)  # after session 26's kernel changes: the GPU test files, the CUDA backend's row cluster tests
    gpu_tests 320 tests.log -n 14 ${GPU_TEST_FILES/tests\/test_cuda_backend.py/} tests/test_row_norm.py \
        tests/test_fusion_autograd.py
    gpu_tests 170 cluster.log -n 14 tests/test_cuda_backend.py \
        -k "(cluster and not gn) or bias_at_cluster or launches or held or spills"
    ;;
table)  # the 16-bit backward at 16K-256K and forward at 64K-256K against torch and torch.compile; the spill checks again
    gpu_tests 60 spills.log tests/test_cuda_backend.py -k "spills"
    bench 200 --ops ln,rms --dtypes bf16 --dirs bwd --widths 16384,32768,65536,131072,262144 --peers torch,compile \
        --no-host --out "$OUT/bwd"
    grep -v "^#" "$OUT/bwd/results.csv" | cut -d, -f2,4,6,8,13,16 | grep -v "^op"
    bench 150 --ops ln,rms --dtypes bf16,fp32 --dirs fwd --widths 65536,131072,262144 --peers torch,compile \
        --no-host --out "$OUT/fwd"
    grep -v "^#" "$OUT/fwd/results.csv" | cut -d, -f2,4,6,8,13,16 | grep -v "^op"
    ;;
ahead)
    for rep in 1 2; do
        dtypes=bf16; [ "$rep" = 1 ] && dtypes=bf16,fp32
        fwd_ab "a0-$rep" "NK_PARAM_AHEAD=0" "$dtypes"
        fwd_ab "a2-$rep" "NK_PARAM_AHEAD=2" "$dtypes"
        fwd_ab "a2c-$rep" "NK_PARAM_AHEAD=2 NK_FWD_SM_THREADS=1280" "$dtypes"
        fwd_ab "a1-$rep" "NK_PARAM_AHEAD=1" "$dtypes"
    done
    gpu_tests 150 cluster.log -n 14 tests/test_cuda_backend.py -k "cluster and not gn"
    ;;
hold)  # the wide forward on persistent clusters holding their parameters over the rows (NK_FWD_HOLD), RMSNorm bf16
    H="NK_FWD_HOLD=1.NK_FWD_SM_THREADS=1024" C="NK_FWD_SM_THREADS=1024"
    timeout 420 python3 benchmarks/widefwd_sweep.py --out "$OUT/hold" --budget 360 --parts check,time \
        --checks variants --ops rms --dtypes bf16 --widths 131072,262144 --repeat 2 \
        --variants "normkit,256x4x1@1%$H,256x4x2@1%$H,256x4x2@1%$C,256x4x1%$H,256x4x2@2%$H" > "$OUT/hold.log" 2>&1
    echo "hold rc $?"; grep -E "CHECKS|FAIL|rror|N=" "$OUT/hold.log" | cut -c1-200
    ;;
measure)
    for v in h0-1:0 h1-1:1 h1-2:1 h0-2:0; do bwd_ab "bwd-${v%%:*}" "NK_BWD_HOLD_W=${v##*:}"; done
    for v in a0-1:0 a2-1:2 a2-2:2 a0-2:0; do
        cuda_ab "fwd-${v%%:*}" "NK_PARAM_AHEAD=${v##*:}" 60 --ops rms --dtypes fp32 --dirs fwd \
            --widths 32768,65536,131072,262144
    done
    # (NK_GN_AHEAD is in the kernels of 53a4c5c, where S26-2 ran; 7f5b609 removed it: on a later tree the three
    # runs below time the same kernel)
    for g in 0 1 2; do
        NORMKIT_CUDA_DEFINES="NK_GN_AHEAD=$g" timeout 70 python3 benchmarks/gn_sweep.py --out "$OUT/gn-ahead$g" --acts - \
            --peers copy --variants default --dtypes bf16,fp32 --layouts nchw --dirs fwd --budget 55 \
            --shapes 32x256x56x56,8x640x32x32,16x640x32x32,4x128x128x128,8x320x64x64 > "$OUT/gn-ahead$g.log" 2>&1
        echo "gn-ahead$g rc $?"; grep -E "^(bf16|fp32|copy|budget)|FAIL|rror" "$OUT/gn-ahead$g.log" | cut -c1-300
    done
    ;;
esac
tar czf "/tmp/s26-${1:-ahead}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s26-${1:-ahead}.tgz" "$OUT/"
