#!/usr/bin/env bash
# The compile-table device call (issues 14 part 3 and 15): times every pattern as Inductor compiles it
# against normkit's fused op (benchmarks/compile_table.py) and writes the table
# normkit/backends/triton/tuned/compile_<arch>.json that normkit.compile_fusion decides from.
#   bash benchmarks/device_compile_table.sh [budget seconds, default 400]
# Results (points-*.jsonl, compile_table.json/.md, the table) under $OUT/compile-table; commit the
# table json and the results folder. A run cut short keeps every finished point: run it again with
# the same folder copied back to resume (compile_table.py skips points already in points-*.jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${1:-400}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
mkdir -p "$OUT/compile-table"
[ -d benchmarks/results/compile-table-resume ] && cp benchmarks/results/compile-table-resume/points-*.jsonl "$OUT/compile-table/"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout $((budget + 100)) python3 benchmarks/compile_table.py --out "$OUT/compile-table" --jobs 8 \
    --budget-s "$budget" --write-table 2>&1 | grep -v -i "warn" | tail -20
cp normkit/backends/triton/tuned/compile_sm_*.json "$OUT/compile-table/" 2>/dev/null
head -60 "$OUT/compile-table/compile_table.md"
