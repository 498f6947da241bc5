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
bench() { local t=$1; shift; timeout "$t" python3 -m normkit bench --no-plots "$@" 2>&1 | grep -E "^\[|wrote" | cut -c1-160; }
case "${1:-compile}" in
overlap)
    timeout 130 python3 -m pytest -q -p no:cacheprovider -n 14 -rfE --tb=short tests/test_cuda_backend.py \
        -k "push_backward or cluster_kernels_match or gn_cluster or cluster_launches" > "$OUT/tests-push.log" 2>&1
    grep -E "^(FAILED|ERROR)" "$OUT/tests-push.log" | cut -c1-300 | head -20; tail -1 "$OUT/tests-push.log"
    grep -E "^E " "$OUT/tests-push.log" | head -12 | cut -c1-300
    timeout 190 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd" --parts check,time --dtypes bf16 \
        --widths 16384,32768,65536,131072,262144 --variants new,cl-o3,cl-o4 --check-variants "" \
        --check-wide cl-o3,cl-o4 > "$OUT/bwd.log" 2>&1
    echo "bwd rc $?"; grep -E "^(dt|bf16|checks|FAIL)" "$OUT/bwd.log" | cut -c1-140
    bench 170 --models llama --modes decode --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 150 --out "$OUT/llama"
    ;;
regs)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 14 -rfE --tb=short tests/test_cuda_backend.py \
        -k "push_backward and (overlap or persistent)" > "$OUT/tests-overlap.log" 2>&1
    echo "pytest rc $? (124: cut by the time limit)"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-overlap.log" | cut -c1-300 | head -20; tail -1 "$OUT/tests-overlap.log"
    grep -E "^E " "$OUT/tests-overlap.log" | head -12 | cut -c1-300
    timeout 160 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd" --parts check,time --dtypes bf16 \
        --widths 16384,32768,65536,131072 --variants new,cl-or2,cl-or3 --check-variants "" \
        --check-wide cl-or2,cl-or3 > "$OUT/bwd.log" 2>&1
    echo "bwd rc $?"; grep -E "^(dt|bf16|checks|FAIL)" "$OUT/bwd.log" | cut -c1-140
    bench 190 --models unet2d --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 170 --out "$OUT/unet2d"
    ;;
final)
    timeout 160 python3 -m pytest -q -p no:cacheprovider -n 14 -rfE --tb=short tests/test_cuda_backend.py \
        -k "push_backward_matches_oracle or persistent_wave or cluster_launches or cluster_routes or spills" > "$OUT/tests-final.log" 2>&1
    echo "pytest rc $? (124: cut by the time limit)"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-final.log" | cut -c1-300 | head -20; tail -1 "$OUT/tests-final.log"
    grep -E "^E " "$OUT/tests-final.log" | head -12 | cut -c1-300
    bench 200 --ops ln,rms --dirs bwd --dtypes bf16 --widths 1024,4096,8192,16384,32768,65536,131072,262144 \
        --peers torch,compile --no-host --time-budget 180 --out "$OUT/rows-bwd"
    ;;
mid)
    timeout 200 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd" --parts check,time --dtypes bf16 \
        --widths 32768,65536 --variants new,p3,pm,or3-256,or4 --check-variants "" \
        --check-wide p3,pm,or3-256,or4 > "$OUT/bwd.log" 2>&1
    echo "bwd rc $?"; grep -E "^(dt|bf16|checks|FAIL)" "$OUT/bwd.log" | cut -c1-140
    ;;
confirm)
    timeout 130 python3 -m pytest -q -p no:cacheprovider -n 14 -rfE --tb=short tests/test_cuda_backend.py \
        -k "cluster_routes or spills or cluster_launches or persistent_wave or (push_backward_matches_oracle and bf16)" \
        > "$OUT/tests-confirm.log" 2>&1
    echo "pytest rc $? (124: cut by the time limit)"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-confirm.log" | cut -c1-300 | head -20; tail -1 "$OUT/tests-confirm.log"
    grep -E "^E " "$OUT/tests-confirm.log" | head -12 | cut -c1-300
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
    timeout 510 python3 -m pytest -q -p no:cacheprovider -n 15 -rfE --tb=short --durations=25 \
        tests/test_cuda_backend.py > "$OUT/tests.log" 2>&1
    echo "pytest rc $? (124: cut by the time limit)"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-300 | head -20; tail -1 "$OUT/tests.log"
    grep -E "^E " "$OUT/tests.log" | head -12 | cut -c1-300
    ;;
tests-b)
    # shellcheck disable=SC2086
    timeout 510 python3 -m pytest -q -p no:cacheprovider -n 15 -rfE --tb=short --durations=25 \
        $(echo $GPU_TEST_FILES | tr ' ' '\n' | grep -v test_cuda_backend) > "$OUT/tests.log" 2>&1
    echo "pytest rc $? (124: cut by the time limit)"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-300 | head -20; tail -1 "$OUT/tests.log"
    grep -E "^E " "$OUT/tests.log" | head -12 | cut -c1-300
    ;;
esac
tar czf "/tmp/s15-${1:-compile}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s15-${1:-compile}.tgz" "$OUT/"
