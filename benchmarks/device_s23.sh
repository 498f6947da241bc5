#!/usr/bin/env bash
# Session 23 (issues 22, 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s23.sh fwdcl   the wide forward's cluster kernels (RELOAD, the committed 16-bit shapes) compiled
#                                         for 4 / 5 / 6 CTAs of 256 threads per SM (NK_FWD_RELOAD_THREADS_PER_SM 1024 /
#                                         1280 / 1536: 56 / 47 / 38 registers for RMSNorm), `normkit bench` LN / RMS bf16
#                                         forward at 32K-256K, the three interleaved twice
#   bash benchmarks/device_s23.sh caps    the cluster tests on the GPU; the fp32 forward on the CUDA backend's clusters under
#                                         each register cap (NK_FWD_SM_THREADS 1024 / 1536 / 1280); the committed caps
#                                         (CLUSTER_FWD_SM_THREADS) in bf16 and fp16, auto and the CUDA backend
#   bash benchmarks/device_s23.sh decode  compiled Llama decode (`normkit bench --models llama --modes decode --exec
#                                         compile`) with the variants in the other order, then with 40 steps a round
#   bash benchmarks/device_s23.sh tests   the GPU test files, then issue 22's model cases as S22-4
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
case "${1:-fwdcl}" in
fwdcl)
    for rep in 1 2; do
        for n in 1024 1280 1536; do
            echo "== NK_FWD_RELOAD_THREADS_PER_SM=$n rep $rep"
            NORMKIT_CUDA_DEFINES="NK_FWD_RELOAD_THREADS_PER_SM=$n" bench 150 --ops ln,rms --dtypes bf16 --dirs fwd \
                --widths 32768,65536,131072,262144 --normkit auto --peers none --no-host --out "$OUT/fwdcl-$n-$rep"
            grep -v "^#" "$OUT/fwdcl-$n-$rep/results.csv" | cut -d, -f2,6,8,13,18,21 | grep -v "^op"
        done
    done
    ;;
caps)
    gpu_tests 150 cluster.log -n 8 tests/test_cuda_backend.py -k "cluster"
    for n in 1024 1536 1280; do  # fp32 (both ops on the CUDA backend's clusters from 32K) under one cap each
        echo "== fp32 NK_FWD_SM_THREADS=$n"
        NORMKIT_CUDA_DEFINES="NK_FWD_SM_THREADS=$n" bench 120 --ops ln,rms --dtypes fp32 --dirs fwd \
            --widths 32768,65536,131072,262144 --normkit cuda --peers none --no-host --out "$OUT/caps-fp32-$n"
    done
    echo "== the committed caps (CLUSTER_FWD_SM_THREADS), 16-bit"
    bench 150 --ops ln,rms --dtypes bf16,fp16 --dirs fwd --widths 32768,65536,131072,262144 --normkit auto,cuda \
        --peers none --no-host --out "$OUT/caps-16"
    ;;
decode)
    bench 130 --models llama --modes decode --exec compile --variants normkit,unpatched --steps 40 --rounds 10 \
        --time-budget 100 --out "$OUT/llama-compiled-rev"
    bench 160 --models llama --modes decode --exec compile --variants unpatched,normkit --steps 400 --rounds 10 \
        --time-budget 130 --out "$OUT/llama-compiled-40"
    for d in llama-compiled-rev llama-compiled-40; do grep -E "^\| llama" "$OUT/$d/models.md" | cut -c1-200; done
    ;;
tests)
    gpu_tests 450 tests.log -n 14 ${GPU_TEST_FILES/tests\/test_cuda_backend.py/} tests/test_row_norm.py \
        tests/test_fusion_autograd.py
    ;;
esac
tar czf "/tmp/s23-${1:-fwdcl}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s23-${1:-fwdcl}.tgz" "$OUT/"
