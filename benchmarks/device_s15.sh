#!/usr/bin/env bash
# Session 15 (issues 22, 24), one device call, files in one archive in $OUT (carry .whl):
# (issue 22's eager model cases on this tree: `bash benchmarks/device_lead.sh models`)
#   bash benchmarks/device_s15.sh overlap   the push backward's tests (cl::cluster_allreduce now holds the push
#                                           exchange; OVERLAP: two rows in flight), bwd_sweep.py at 16K-256K (bf16,
#                                           both ops): the committed table against cl-o3 / cl-o4 (OVERLAP on 3 / 4
#                                           stages), oracle-checked; then compiled Llama decode
#   bash benchmarks/device_s15.sh regs      the two-rows-in-flight tests (both kinds), bwd_sweep.py at 16K-128K: the committed
#                                           table against cl-or2 / cl-or3 (the two rows' xhat and g in registers, 2 / 3
#                                           stages), oracle-checked; then compiled UNet2DModel
#   bash benchmarks/device_s15.sh final     the adopted routes: the push and overlap tests, then normkit bench's rows
#                                           (bwd 1K-256K, bf16, both ops) with torch and torch.compile in the run
#   bash benchmarks/device_s15.sh mid       bwd_sweep.py at 32K-64K: the committed table against p3, pm, or3-256, or4
#   bash benchmarks/device_s15.sh confirm   after S15-8's adoption at 32K-64K: the route / launch / no-spill / overlap tests and
#                                           normkit bench's backward rows at 32K-64K with torch and torch.compile
#   bash benchmarks/device_s15.sh compile   the compiled cases: Llama decode and training, UNet2DModel
#   bash benchmarks/device_s15.sh tests-a   the CUDA backend's GPU test file (510 s; the set-up takes ~55 s of the call)
#   bash benchmarks/device_s15.sh tests-b   the other GPU test files (GPU_TEST_FILES without it)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
# sweep SECONDS ARGS...: benchmarks/bwd_sweep.py (bf16, checked and timed) under a time limit into $OUT/bwd, its table
sweep() {
    local t=$1; shift
    timeout "$t" python3 benchmarks/bwd_sweep.py --out "$OUT/bwd" --parts check,time --dtypes bf16 --check-variants "" \
        "$@" > "$OUT/bwd.log" 2>&1
    echo "bwd rc $?"; grep -E "^(dt|bf16|checks|FAIL)" "$OUT/bwd.log" | cut -c1-140
}
case "${1:-compile}" in
overlap)
    gpu_tests 130 tests-push.log -n 14 tests/test_cuda_backend.py \
        -k "push_backward or cluster_kernels_match or gn_cluster or cluster_launches"
    sweep 190 --widths 16384,32768,65536,131072,262144 --variants new,cl-o3,cl-o4 --check-wide cl-o3,cl-o4
    bench 170 --models llama --modes decode --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 150 --out "$OUT/llama"
    ;;
regs)
    gpu_tests 150 tests-overlap.log -n 14 tests/test_cuda_backend.py -k "push_backward and (overlap or persistent)"
    sweep 160 --widths 16384,32768,65536,131072 --variants new,cl-or2,cl-or3 --check-wide cl-or2,cl-or3
    bench 190 --models unet2d --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 170 --out "$OUT/unet2d"
    ;;
final)
    gpu_tests 160 tests-final.log -n 14 tests/test_cuda_backend.py \
        -k "push_backward_matches_oracle or persistent_wave or cluster_launches or cluster_routes or spills"
    bench 200 --ops ln,rms --dirs bwd --dtypes bf16 --widths 1024,4096,8192,16384,32768,65536,131072,262144 \
        --peers torch,compile --no-host --time-budget 180 --out "$OUT/rows-bwd"
    ;;
mid)
    sweep 200 --widths 32768,65536 --variants new,p3,pm,or3-256,or4 --check-wide p3,pm,or3-256,or4
    ;;
confirm)
    gpu_tests 130 tests-confirm.log -n 14 tests/test_cuda_backend.py \
        -k "cluster_routes or spills or cluster_launches or persistent_wave or (push_backward_matches_oracle and bf16)"
    bench 90 --ops ln,rms --dirs bwd --dtypes bf16 --widths 16384,32768,65536 --peers torch,compile --no-host \
        --time-budget 75 --out "$OUT/rows-bwd"
    ;;
compile)
    bench 200 --models llama --modes decode,train --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 175 --out "$OUT/llama"
    bench 200 --models unet2d --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 175 --out "$OUT/unet2d"
    ;;
tests-a)
    gpu_tests 510 tests.log -n 15 --durations=25 tests/test_cuda_backend.py
    ;;
tests-b)
    # shellcheck disable=SC2086
    gpu_tests 510 tests.log -n 15 --durations=25 $(echo $GPU_TEST_FILES | tr ' ' '\n' | grep -v test_cuda_backend)
    ;;
esac
tar czf "/tmp/s15-${1:-compile}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s15-${1:-compile}.tgz" "$OUT/"
