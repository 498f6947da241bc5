#!/usr/bin/env bash
# Session 10, helper hostclu10: the one device call (one H100; carry .wt-hostclu10 and .whl), under 330 s.
# Plans that launch thread-block clusters (issue 22): the before/after host time of a 4 x 131072 bf16 call
# (Python path vs the C++ plan, with torch), its replayed outputs checked bit for bit; the GPU tests of the
# C++ host path and the CUDA backend; the bench's host table with the wide-row cases. Everything under
# $OUT, archived as one .tgz. Call it as
#   cd .wt-hostclu10 && ln -sfn ../.whl .whl && bash benchmarks/device_hostclu10.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
echo "== before/after"
timeout 60 python3 benchmarks/hostclu10_host.py --out "$OUT" > "$OUT/hostclu10.log" 2>&1
echo "rc $?"; cut -c1-420 "$OUT/hostclu10.log" | tail -8
echo "== tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE tests/test_host_gpu.py tests/test_cuda_backend.py \
    2>&1 | grep -v '^USDT' > "$OUT/tests.log"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-240 | head -30; tail -1 "$OUT/tests.log"
echo "== host table"
timeout 55 python3 -m normkit bench --no-plots --host-only --host-cases all --ops ln,rms --peers torch \
    --out "$OUT/host" 2>&1 | grep -E "^\[|wrote" | cut -c1-160
grep -iE "wide rows" "$OUT/host/summary.md" 2>/dev/null | head -12
tar czf /tmp/hostclu10.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/hostclu10.tgz "$OUT/"
