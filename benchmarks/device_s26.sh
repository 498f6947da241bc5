#!/usr/bin/env bash
# Session 26 (issue 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s26.sh ahead   the wide forward's weight / bias packs fetched ahead of their stores
#                                         (NK_PARAM_AHEAD packs, row_cluster.cu) against none, and with the RMSNorm
#                                         cap at 1280 threads per SM (NK_FWD_SM_THREADS), in turn twice: `normkit bench`
#                                         LN / RMS forward, 64K-256K, the CUDA backend forced (bf16; fp32 in round 1);
#                                         then the CUDA backend's row cluster tests on the default
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
# fwd_ab NAME DEFINES DTYPES: the wide forward under NORMKIT_CUDA_DEFINES=DEFINES into $OUT/NAME, its table lines
fwd_ab() {
    echo "== $1 ($2)"
    NORMKIT_CUDA_DEFINES="$2" NORMKIT_HOST=0 bench 80 --ops ln,rms --dtypes "$3" --dirs fwd \
        --widths 65536,131072,262144 --normkit cuda --peers none --no-host --out "$OUT/$1"
    grep -v "^#" "$OUT/$1/results.csv" | cut -d, -f2,4,6,8,13,16,18,21 | grep -v "^op"
}
case "${1:-ahead}" in
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
esac
tar czf "/tmp/s26-${1:-ahead}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s26-${1:-ahead}.tgz" "$OUT/"
