#!/usr/bin/env bash
# Session 12 (issue 24): GroupNorm NCHW on the Hopper cluster kernels (row_cluster.cu gn_fwd_cluster /
# gn_bwd_cluster), one device call:
#   bash benchmarks/device_gn12.sh sweep   the cluster kernels' GPU tests, then gn_sweep.py on NCHW (bf16 and
#                                         fp32): the committed table (default) against the cluster route with
#                                         five kernel shapes, torch and torch.compile in the same run (run S12-1)
#   bash benchmarks/device_gn12.sh sweep2  the host-path GPU tests and the cluster GPU tests, then the sweep again
#                                         with the one-wave shapes and same-size copy rows (run S12-2)
#   bash benchmarks/device_gn12.sh final   the adopted table: GPU tests (GroupNorm, CUDA backend, host path) and
#                                         the committed plans against torch.compile and copies, both layouts (S12-3)
# Files land in one archive in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
SHAPES=8x320x64x64,8x640x32x32,16x640x32x32,32x256x56x56,4x128x128x128,8x1280x16x16,32x1280x8x8,1x320x64x64
case "${1:-sweep}" in
sweep)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE tests/test_cuda_backend.py -k "gn_cluster" \
        2>&1 | grep -v '^USDT' > "$OUT/tests-gn-cluster.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-gn-cluster.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests-gn-cluster.log"
    grep -E "^E " "$OUT/tests-gn-cluster.log" | head -12 | cut -c1-300
    timeout 300 python3 benchmarks/gn_sweep.py --out "$OUT/s" --dtypes bf16,fp32 --acts - --peers torch,compile \
        --layouts nchw --shapes $SHAPES --variants default,cluster,cluster-128,cluster-regs,cluster-16,cluster-512 \
        --budget 270 > "$OUT/sweep.log" 2>&1
    echo "sweep rc $?"; grep -E "^(bf16|fp32|copy|budget)" "$OUT/sweep.log" | cut -c1-400
    ;;
sweep2)  # after S12-1: cluster launches of one CTA replayed as clusters; same-size copy rows; one-wave shapes
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE tests/test_host_gpu.py \
        "tests/test_cuda_backend.py::test_gn_cluster_kernels_match_oracle" 2>&1 | grep -v '^USDT' > "$OUT/tests.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests.log"
    grep -E "^E " "$OUT/tests.log" | head -8 | cut -c1-300
    timeout 260 python3 benchmarks/gn_sweep.py --out "$OUT/s" --dtypes bf16,fp32 --acts - --peers compile,copy \
        --layouts nchw --shapes $SHAPES --variants default,cluster,cluster-128,cluster-16,cluster-32,cluster-128r \
        --budget 230 > "$OUT/sweep.log" 2>&1
    echo "sweep rc $?"; grep -E "^(bf16|fp32|copy|budget)" "$OUT/sweep.log" | cut -c1-400
    ;;
final)  # the adopted table (GN_CLUSTER_ROUTE, GN_CLUSTER_KERNELS): GPU tests of GroupNorm, the CUDA backend and the
    # host path, then the committed plans (default) against torch.compile and same-size copies, both layouts
    timeout 330 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE tests/test_group_norm.py tests/test_cuda_backend.py \
        tests/test_host_gpu.py 2>&1 | grep -v '^USDT' > "$OUT/tests.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests.log"
    timeout 200 python3 benchmarks/gn_sweep.py --out "$OUT/s" --dtypes bf16,fp32 --acts - --peers compile,copy \
        --layouts nchw,cl --shapes $SHAPES --variants default --cl-variants default --budget 180 > "$OUT/sweep.log" 2>&1
    echo "sweep rc $?"; grep -E "^(bf16|fp32|copy|budget)" "$OUT/sweep.log" | cut -c1-300
    ;;
esac
tar czf "/tmp/gn12-${1:-sweep}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/gn12-${1:-sweep}.tgz" "$OUT/"
