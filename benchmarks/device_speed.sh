#!/usr/bin/env bash
# Issue 16 device call: the cluster kernels checked against the oracle, then timed against the
# current paths and torch (benchmarks/speed_sweep.py), each part in its own process under a time
# limit so a hang or a crash in one part still leaves the others' CSVs.
#   bash benchmarks/device_speed.sh TAG "PARTS_AND_LIMITS" [extra speed_sweep args]
# e.g. bash benchmarks/device_speed.sh r1 "check:150 rows:300 gn:120" --dtypes bf16,fp32
set -uo pipefail
cd "$(dirname "$0")/.."
tag=${1:?tag}
plan=${2:?parts}
shift 2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NORMKIT_CACHE_DIR=/tmp/normkit-cache
mkdir -p "$OUT/$tag"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for item in $plan; do
    part=${item%%:*}
    limit=${item##*:}
    if [ "$part" = pytest ]; then
        timeout "$limit" python3 -m pytest -q -x -p no:cacheprovider -rfEs -m gpu tests/test_cuda_backend.py \
            tests/test_row_norm.py tests/test_group_norm.py -k "not ladder" > "$OUT/$tag/pytest.log" 2>&1
        echo "pytest rc=$?"; grep -E "passed|failed" "$OUT/$tag/pytest.log" | tail -2
        grep -E "^(FAILED|ERROR)" "$OUT/$tag/pytest.log" | head -20
        continue
    fi
    timeout "$limit" python3 benchmarks/speed_sweep.py --out "$OUT/$tag" --parts "$part" "$@" > "$OUT/$tag/$part.log" 2>&1
    echo "== $part rc=$?"
    grep -E "CHECK FAIL|^checks|^CHECKS|Error|error" "$OUT/$tag/$part.log" | head -12
done
for item in $plan; do
    part=${item%%:*}
    [ -f "$OUT/$tag/$part.log" ] && sed -n '/^total/,$p' "$OUT/$tag/$part.log"
done
