#!/usr/bin/env bash
# Session 16 (issues 22, 24), one device call, files in one archive in $OUT (carry .whl):
#   bash benchmarks/device_s16.sh fwd       the wide forward's cluster shapes on the H200 (widefwd_sweep.py, bf16, 64K-256K,
#                                           both ops, oracle-checked: 1-3 stages, clusters walking rows, 128-512 threads,
#                                           registers), then the CUDA backend's test file without its cluster tests
#   (fetch and bwd-ab: runs S16-2 / S16-3; the knobs their variants set were removed after them, so on this tree
#   their variants time the same kernels)
#   bash benchmarks/device_s16.sh fetch     the wide forward's
#                                           affine parameters fetched ahead of the stores (widefwd_sweep.py
#                                           %-variants: NK_FETCH_BYTES, the reload kernels' register cap, an L1 prefetch),
#                                           bf16 64K-256K, both ops, oracle-checked; the CUDA backend's forward (the
#                                           same fetch in its warp and block kernels) next to torch at 1K-32K; its tests
#   bash benchmarks/device_s16.sh bwd-ab    the cluster backward's RECOMPUTE dx step with its parameters fetched ahead (default)
#                                           against NORMKIT_CUDA_DEFINES=NK_FETCH_BYTES=0 (each pack's next to its store):
#                                           normkit bench bwd 64K-256K bf16, A B A B; the CUDA backend's LayerNorm forward
#                                           (code as before session 16) next to torch; the backward cluster tests
#   bash benchmarks/device_s16.sh tests-c   the CUDA backend's cluster and push tests (the rest of that file; 480 s)
#   bash benchmarks/device_s16.sh gn        GroupNorm's NCHW forward (bf16) on the Triton plans' H100-chosen thresholds
#                                           against their alternatives (gn_sweep.py: split2 at more groups per SM, whole
#                                           groups in one tile, smaller looped tiles, the staged path), torch in the run;
#                                           then the GPU test files but the CUDA backend's
#   bash benchmarks/device_s16.sh tests-b   the other GPU test files (GPU_TEST_FILES without the CUDA backend's)
# (issue 22's eager model cases on this tree: `bash benchmarks/device_lead.sh models`)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
CLUSTER_TESTS="cluster or push or spills"
case "${1:-fwd}" in
fwd)
    timeout 290 python3 benchmarks/widefwd_sweep.py --out "$OUT/fwd" --parts check,time --checks variants \
        --dtypes bf16 --widths 65536,131072,262144 --budget 270 --repeat 2 \
        --variants normkit,256x8x2@1+1,256x8x2@2+1,256x8x2r@1+1,256x8x3@1+1,128x8+1,128x8x2@1+1,256x4+1,512x8x2@1+m1 \
        > "$OUT/fwd.log" 2>&1
    echo "fwd rc $?"; grep -E "CHECK|FAIL|total|copy ceiling|prebuilt" "$OUT/fwd.log" | cut -c1-160
    gpu_tests 240 tests-nc.log -n 15 --durations=15 tests/test_cuda_backend.py -k "not ($CLUSTER_TESTS)"
    ;;
fetch)
    timeout 300 python3 benchmarks/widefwd_sweep.py --out "$OUT/fetch" --parts check,time --checks variants \
        --dtypes bf16 --widths 65536,131072,262144 --budget 280 --repeat 2 \
        --variants normkit%f0,normkit,normkit%f128.t768,normkit%f128.t512,normkit%p1.f0,normkit%p1 \
        > "$OUT/fetch.log" 2>&1
    echo "fetch rc $?"; grep -E "CHECK|FAIL|total|copy ceiling|prebuilt" "$OUT/fetch.log" | cut -c1-160
    timeout 120 python3 -m normkit bench --no-plots --ops ln,rms --dirs fwd --dtypes bf16,fp32 \
        --widths 1024,2048,4096,8192,16384,32768 --normkit auto,cuda --peers torch --no-host --time-budget 105 \
        --out "$OUT/cuda-fwd" 2>&1 | grep -E "^\[|wrote" | cut -c1-160
    gpu_tests 200 tests-c.log -n 15 tests/test_cuda_backend.py \
        -k "push_forward or gn_cluster or gn_cl_cluster or spills or matches_oracle or every_forward or activations"
    ;;
bwd-ab)
    for r in 1 2; do
        for d in "" "NK_FETCH_BYTES=0"; do
            echo "== round $r defines '$d'"
            NORMKIT_CUDA_DEFINES="$d" timeout 110 python3 -m normkit bench --no-plots --ops ln,rms --dirs bwd \
                --dtypes bf16 --widths 65536,131072,262144 --peers none --no-host --time-budget 95 \
                --out "$OUT/bwd-r$r${d:+-f0}" 2>&1 | grep -E "^\[|wrote" | cut -c1-160
        done
    done
    timeout 80 python3 -m normkit bench --no-plots --ops ln --dirs fwd --dtypes bf16 --widths 2048,4096,8192,16384 \
        --normkit auto,cuda --peers torch --no-host --time-budget 65 --out "$OUT/cuda-ln-fwd" 2>&1 \
        | grep -E "^\[|wrote" | cut -c1-160
    gpu_tests 150 tests-bwd.log -n 15 tests/test_cuda_backend.py \
        -k "push_backward or spills or cluster_routes or persistent_wave or cluster_weight_gradients"
    ;;
tests-c)
    gpu_tests 480 tests-c.log -n 15 --durations=15 tests/test_cuda_backend.py -k "$CLUSTER_TESTS"
    ;;
gn)
    timeout 190 python3 benchmarks/gn_sweep.py --out "$OUT/gn" --dtypes bf16 --layouts nchw --dirs fwd --acts - \
        --act-variants default --peers torch --budget 170 \
        --variants default,s2-all,s2-4,s2-min1,one-32k,lt-4k,nchw-staged > "$OUT/gn.log" 2>&1
    echo "gn rc $?"; tail -30 "$OUT/gn.log" | cut -c1-170
    # shellcheck disable=SC2086
    gpu_tests 300 tests-b.log -n 15 $(echo $GPU_TEST_FILES | tr ' ' '\n' | grep -v test_cuda_backend)
    ;;
tests-b)
    # shellcheck disable=SC2086
    gpu_tests 510 tests.log -n 15 --durations=25 $(echo $GPU_TEST_FILES | tr ' ' '\n' | grep -v test_cuda_backend)
    ;;
esac
tar czf "/tmp/s16-${1:-fwd}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s16-${1:-fwd}.tgz" "$OUT/"
