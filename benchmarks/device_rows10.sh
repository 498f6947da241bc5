#!/usr/bin/env bash
# Session 10, helper rows10 (issue 24): its one device call (H100, <= 330 s), results in $OUT/rows10.tgz.
#   1. benchmarks/widefwd_sweep.py: the push forward's MERGE (one value per CTA in the exchange) and
#      ONE_PASS (LayerNorm moments in one read) flags, oracle-checked (bf16, fp32: the flagged shapes,
#      NaN rows, walking clusters), then timed against the shipped kernel at 64K-256K (both ops, bf16,
#      twice interleaved).
#   2. benchmarks/bwd_sweep.py: the backward table against the register-capped split rows (reg_cap,
#      session 9's one-run command) and the cluster kernels at every wide width without / with MERGE
#      (cl, cl-m), 16K-256K, bf16.
# Each step under its own timeout (a hung kernel costs that step only); the archive is written last.
#   cd .wt-rows10 && ln -sfn ../.whl .whl && bash benchmarks/device_rows10.sh
set -uo pipefail
export NORMKIT_HOST=0  # neither step uses the C++ host path: skip its build
source "$(dirname "$0")/device_env.sh" env.txt
R=$OUT/rows10
mkdir -p "$R"
cp "$OUT/env.txt" "$R/"
export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks"
timeout "${FWD_S:-135}" python3 benchmarks/widefwd_sweep.py --out "$R/fwd" --budget "${FWD_BUDGET:-120}" \
    --parts check,time --checks flags --dtypes bf16,fp32 --time-dtypes bf16 --widths 65536,131072,262144 --ops ln,rms \
    --variants normkit,push+m,push+1,push+m1,256x8+m1 --repeat 2 2>&1 | tee "$R/fwd.log" | \
    grep -E "CHECK|CHECKS|total|FAIL|Error|error" | cut -c1-220
echo "fwd rc ${PIPESTATUS[0]}" | tee -a "$R/fwd.log"
timeout "${BWD_S:-160}" python3 benchmarks/bwd_sweep.py --out "$R/bwd" --parts check,time --dtypes bf16 \
    --widths 16384,32768,65536,131072,262144 --variants new,m1c4kw8-cap,m2c2kw8-cap,m2c2kw8,cl,cl-m \
    --check-variants "" --check-wide m1c4kw8-cap,m2c2kw8-cap,cl-m > "$R/bwd.log" 2>&1
echo "bwd rc $?" | tee -a "$R/bwd.log"
tar -C "$OUT" -czf "$OUT/rows10.tgz" rows10 && rm -rf "$R"
# the short tables last (the reply carries the end of the output)
tar -xzf "$OUT/rows10.tgz" -O rows10/bwd.log | grep -E "^(dt|bf16|checks)" | cut -c1-120
python3 - "$OUT/rows10.tgz" <<'EOF'
import csv, io, sys, tarfile
from collections import defaultdict
rows = list(csv.DictReader(io.TextIOWrapper(tarfile.open(sys.argv[1]).extractfile("rows10/fwd/rows.csv"))))
cells = defaultdict(list)
for r in rows:
    if r.get("frac"):
        cells[(r["op"], r["N"], r["impl"])].append(r["frac"])
for key, v in sorted(cells.items(), key=lambda kv: (kv[0][0], int(kv[0][1]), kv[0][2])):
    print(*key, *v)
EOF
