#!/usr/bin/env bash
# Session 21 (issue 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s21.sh sweep   the looped forward compiled under a register cap (fwd_sweep.py s<chunk>k<warps>p<programs
#                                         per SM>): LayerNorm 16K-256K, RMSNorm 128K-256K, against the table (tiles, CUDA
#                                         clusters, looped rows) and torch.compile
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
bench() { local t=$1; shift; timeout "$t" python3 -m normkit bench --no-plots "$@" 2>&1 | grep -E "^\[|wrote" | cut -c1-160; }
sweep() {  # timeout, out dir, fwd_sweep arguments
    local t=$1 out=$2; shift 2
    timeout "$t" python3 benchmarks/fwd_sweep.py --out "$OUT/$out" "$@" > "$OUT/$out.log" 2>&1
    echo "$out rc $?"; grep -E "copy|FAIL|Error" "$OUT/$out.log" | cut -c1-140
    python3 benchmarks/csv_table.py "$OUT/$out/fwd.csv"
}
case "${1:-sweep}" in
sweep)
    sweep 330 ln --ops ln --widths 16384,32768,65536,131072,262144 \
        --variants table,s4k16,s8k32,s4k16p3,s4k16p4,s8k32p2,s2k16p4,s4k32p2,s2k8p8
    sweep 150 rms --ops rms --widths 131072,262144 --variants table,s4k16,s8k32,s16k32,s2k16p4
    ;;
esac
tar czf "/tmp/s21-${1:-sweep}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s21-${1:-sweep}.tgz" "$OUT/"
