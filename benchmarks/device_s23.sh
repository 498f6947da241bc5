#!/usr/bin/env bash
# Session 23 (issues 22, 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s23.sh fwdcl   the wide forward's cluster kernels (RELOAD, the committed 16-bit shapes) compiled
#                                         for 4 / 5 / 6 CTAs of 256 threads per SM (NK_FWD_SM_THREADS 1024 /
#                                         1280 / 1536: 56 / 47 / 38 registers for RMSNorm), `normkit bench` LN / RMS bf16
#                                         forward at 32K-256K, the three interleaved twice
#   bash benchmarks/device_s23.sh caps    the cluster tests on the GPU; the fp32 forward on the CUDA backend's clusters under
#                                         each register cap (NK_FWD_SM_THREADS 1024 / 1536 / 1280); the committed caps
#                                         (CLUSTER_FWD_SM_THREADS) in bf16 and fp16, auto and the CUDA backend
#   bash benchmarks/device_s23.sh tests   the GPU test files (the CUDA backend's apart); the fp32 forward at 64K-256K, auto
#                                         against the CUDA backend; compiled Llama decode with normkit timed first
#   bash benchmarks/device_s23.sh models  the CUDA backend's cluster tests; issue 22's model cases as S22-4
#   bash benchmarks/device_s23.sh host    the host table twice (the second with LayerNorm's rows not first)
#   bash benchmarks/device_s23.sh gnprobe benchmarks/gn_entry_probe.py: GroupNorm's backend function, the public entry,
#                                         torch.compile and a copy under one timer (the gn-2d vs gn_sweep gap)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
case "${1:-fwdcl}" in
fwdcl)
    for rep in 1 2; do
        for n in 1024 1280 1536; do
            echo "== NK_FWD_SM_THREADS=$n rep $rep"
            NORMKIT_CUDA_DEFINES="NK_FWD_SM_THREADS=$n" bench 150 --ops ln,rms --dtypes bf16 --dirs fwd \
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
tests)
    gpu_tests 320 tests.log -n 14 ${GPU_TEST_FILES/tests\/test_cuda_backend.py/} tests/test_row_norm.py \
        tests/test_fusion_autograd.py
    echo "== fp32 forward at 64K-256K: the Triton backend's route (auto) against the CUDA backend's capped clusters"
    bench 90 --ops ln,rms --dtypes fp32 --dirs fwd --widths 65536,131072,262144 --normkit auto,cuda --peers none \
        --no-host --out "$OUT/fp32-routes"
    echo "== compiled Llama decode, the variants in the other order (S22-4 timed unpatched first)"
    bench 130 --models llama --modes decode --exec compile --variants normkit,unpatched --steps 40 --rounds 10 \
        --time-budget 100 --out "$OUT/llama-compiled-rev"
    grep -E "^\| llama" "$OUT/llama-compiled-rev/models.md" | cut -c1-200
    ;;
models)
    final_models
    ;;
host)  # the host table twice: as device_s19.sh eager runs it, then with LayerNorm's rows not first
    bench 80 --host-only --host-cases all --ops ln,rms,gn,rms+add+pre,ln+add+pre --peers torch --out "$OUT/host"
    bench 80 --host-only --host-cases all --ops rms,gn,ln,rms+add+pre,ln+add+pre --peers torch --out "$OUT/host-b"
    for d in host host-b; do grep -E "^\| (ln|rms) \| bf16 \| 4x4096 \| (normkit|torch) \| fwd \|" "$OUT/$d/summary.md"; done
    ;;
gnprobe)  # why the bench's gn-2d suite reads GroupNorm lower than gn_sweep.py: both entries and peers in one process
    timeout 200 python3 benchmarks/gn_entry_probe.py 8x320x64x64,8x640x32x32 2>&1 | grep -v -i warn
    ;;
esac
tar czf "/tmp/s23-${1:-fwdcl}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s23-${1:-fwdcl}.tgz" "$OUT/"
