#!/usr/bin/env bash
# Session 18 (issue 24), one device call, files in $OUT (carry .whl):
#   bash benchmarks/device_s18.sh loop  the looped forward (session 18: per-lane sums reduced once after the loop, as
#                                       Inductor's looped reductions do) at 8K-32K, chunk x warps, with and without L2
#                                       hints (fwd_sweep.py vl*), against the table and torch.compile (whose kept launch
#                                       configs the sweep logs); the row-norm GPU tests (the looped kernels included)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
bench() { local t=$1; shift; timeout "$t" python3 -m normkit bench --no-plots "$@" 2>&1 | grep -E "^\[|wrote" | cut -c1-160; }
case "${1:-loop}" in
loop)
    timeout 330 python3 benchmarks/fwd_sweep.py --out "$OUT/loop" --widths 8192,16384,32768 > "$OUT/loop.log" 2>&1
    echo "loop rc $?"; grep -E "copy|FAIL|Error" "$OUT/loop.log" | cut -c1-140
    python3 - "$OUT/loop/fwd.csv" <<'PY'
import csv, sys, collections
t = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    t[(r["op"], r["N"], r["variant"])].append(r.get("frac") or "err")
for (op, n, v), f in t.items():
    print(op, n, v, " ".join(f))
PY
    grep -E "inductor" "$OUT/loop.log" | cut -c1-220 | head -20
    gpu_tests 200 tests-rows.log -n 15 tests/test_row_norm.py tests/test_gate.py tests/test_modulation.py \
        tests/test_fusion.py
    ;;
esac
