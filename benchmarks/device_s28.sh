#!/usr/bin/env bash
# Session 28 (issues 22, 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s28.sh probe   the ceiling of a two-launch GroupNorm (benchmarks/gn_split_probe.py: a read
#                                         pass then a read-and-write pass, against the same-size copy and normkit's
#                                         committed GroupNorm); eager DiT / SD3 (the models whose LayerNorm rows,
#                                         1152 / 1536 wide, took session 27's 2K backward route)
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
esac
tar czf "/tmp/s28-${1:-probe}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s28-${1:-probe}.tgz" "$OUT/"
