#!/usr/bin/env bash
# The whole test suite on the device (every test runs on the GPU there), with the host path built
# first and diffusers / Liger installed from wheels carried in .whl/. Writes $OUT/tests.log.
#   bash benchmarks/device_tests.sh [seconds] [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
limit=${1:-480}; shift || true
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers, timm; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'timm', timm.__version__)"
  git log -1 --format='commit %H %s' 2>/dev/null | cut -c1-120; date -u; } 2>&1 | tee "$OUT/env.txt"
timeout 200 python3 -c "import time, normkit._host as h; t = time.time(); h.activate(); print(h.status, f'({time.time() - t:.0f} s)')" 2>&1 | tail -3
timeout "$limit" python3 -m pytest -q -p no:cacheprovider -n 8 -rfE "$@" tests 2>&1 | grep -v '^USDT' > "$OUT/tests.log"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-200 | head -60
tail -3 "$OUT/tests.log"
