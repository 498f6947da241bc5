#!/usr/bin/env bash
# Session 28 (issues 22, 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s28.sh probe   the ceiling of a two-launch GroupNorm (benchmarks/gn_split_probe.py: a read
#                                         pass then a read-and-write pass, against the same-size copy and normkit's
#                                         committed GroupNorm); eager DiT / SD3 (the models whose LayerNorm rows,
#                                         1152 / 1536 wide, took session 27's 2K backward route)
#   bash benchmarks/device_s28.sh gblock  the group-block GroupNorm path (two launches over tiles of whole groups) on
#                                         the GPU: its forced-path tests, then gn_sweep.py against the committed routes
#                                         and the same-size copy, bf16 then fp32, both layouts, forward and backward,
#                                         with per-kernel profiles. Slower everywhere (S28-3 / S28-4), not adopted: the
#                                         path, its tests and its gn_sweep.py variants are in the tree at c437b39 only
#   bash benchmarks/device_s28.sh measure LayerNorm / RMSNorm's 16-bit backward at 1K on the push clusters against Triton's
#                                         tiles (bwd_sweep.py cl-p / new, twice in turn); the host table; compiled Llama
#                                         decode
#   bash benchmarks/device_s28.sh models  the GPU files that run the default backward (the weight-gradient partials in
#                                         one buffer), then issue 22's eager model cases and host table on the final
#                                         tree (device_env.sh issue22_eager_models)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
case "${1:-probe}" in
probe)
    timeout 240 python3 benchmarks/gn_split_probe.py > "$OUT/gn-split-probe.txt" 2>&1
    echo "probe rc $?"; cut -c1-400 "$OUT/gn-split-probe.txt" | tail -20
    bench 200 --models dit,sd3 --exec eager --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 170 --out "$OUT/dit-sd3"
    grep -E "^\| (dit|sd3)" "$OUT/dit-sd3/models.md" | cut -c1-220
    ;;
gblock)
    gpu_tests 120 gblock-tests.log tests/test_group_norm.py -k "gblock or group_blocks"
    timeout 420 python3 benchmarks/gn_sweep.py --out "$OUT/gblock" --dtypes bf16,fp32 --budget 330 \
        --variants default,gblock,gblock-big,gblock-a1,gblock-a8,gblock-s64 --peers copy --acts - \
        --profile --profile-variants default,gblock \
        --profile-shapes 8x320x64x64/g32,8x320x64x64/g32/cl,16x640x32x32/g32/cl,4x128x128x128/g32/cl \
        --shapes 8x320x64x64,16x640x32x32,32x256x56x56,4x128x128x128,8x1280x16x16,1x320x64x64 \
        > "$OUT/gblock.log" 2>&1
    echo "gn_sweep rc $?"; grep -E "^(bf16|fp32|copy|done|budget)|Error|profile" "$OUT/gblock.log" | cut -c1-330
    ;;
measure)
    for rep in 1 2; do
        timeout 100 python3 benchmarks/bwd_sweep.py --out "$OUT/clp1k-$rep" --parts check,time --variants new,cl-p \
            --widths 1024 --dtypes bf16 --check-dtypes bf16 --check-variants cl-p > "$OUT/clp1k-$rep.log" 2>&1
        echo "clp1k-$rep rc $?"; grep -E "FAIL|rror" "$OUT/clp1k-$rep.log" | head -5; tail -6 "$OUT/clp1k-$rep.log" | cut -c1-160
    done
    bench 70 --host-only --host-cases all --ops ln,rms,gn,rms+add+pre,ln+add+pre --peers torch --out "$OUT/host"
    grep -E "^\|" "$OUT/host/summary.md" 2>/dev/null | head -45 | cut -c1-160
    bench 150 --models llama --modes decode --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 120 --out "$OUT/llama-compiled"
    grep -E "^\| llama" "$OUT/llama-compiled/models.md" | cut -c1-200
    ;;
models)
    gpu_tests 200 tests.log -n 14 tests/test_host_gpu.py tests/test_host.py tests/test_gpu.py tests/test_group_norm.py \
        tests/test_row_norm.py tests/test_autograd.py tests/test_api.py tests/test_edge_cases.py
    issue22_eager_models
    ;;
esac
tar czf "/tmp/s28-${1:-probe}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s28-${1:-probe}.tgz" "$OUT/"
