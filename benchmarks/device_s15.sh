#!/usr/bin/env bash
# Session 15 (issues 22, 24), one device call, files in one archive in $OUT (carry .whl):
# (issue 22's eager model cases on this tree: `bash benchmarks/device_lead.sh models`)
#   bash benchmarks/device_s15.sh compile   the push backward's tests (cl::cluster_allreduce now holds the push
#                                           exchange), then the compiled cases: Llama decode and training, UNet2DModel
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
bench() { local t=$1; shift; timeout "$t" python3 -m normkit bench --no-plots "$@" 2>&1 | grep -E "^\[|wrote" | cut -c1-160; }
case "${1:-compile}" in
compile)
    timeout 110 python3 -m pytest -q -p no:cacheprovider -n 14 -rfE --tb=short tests/test_cuda_backend.py \
        -k "push_backward or cluster_kernels_match or gn_cluster" > "$OUT/tests-push.log" 2>&1
    grep -E "^(FAILED|ERROR)" "$OUT/tests-push.log" | cut -c1-300 | head -20; tail -1 "$OUT/tests-push.log"
    bench 200 --models llama --modes decode,train --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 175 --out "$OUT/llama"
    bench 200 --models unet2d --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 175 --out "$OUT/unet2d"
    ;;
esac
tar czf "/tmp/s15-${1:-compile}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s15-${1:-compile}.tgz" "$OUT/"
