#!/usr/bin/env bash
# The host-path device run (issue 14, part 2): build the C++ host path (normkit/_host), run its GPU
# tests, the GPU suite with it active, and time the host per call next to torch eager. Writes $OUT.
#   bash benchmarks/device_host.sh          # everything
#   bash benchmarks/device_host.sh quick    # build, host-path tests and timing only
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  g++ --version | head -1; ninja --version; } 2>&1 | tee "$OUT/env.txt"
timeout 240 python3 -c "import time, normkit._host as h; t = time.time(); h.activate(); print(h.status, f'({time.time() - t:.0f} s)')" \
    2>&1 | tee "$OUT/build.log"
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_host.py tests/test_host_gpu.py 2>&1 \
    | tail -60 > "$OUT/host_tests.log"
tail -4 "$OUT/host_tests.log"
if [ "${1:-}" != quick ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_gpu.py tests/test_autograd.py \
        tests/test_row_norm.py tests/test_group_norm.py tests/test_api.py tests/test_compile.py tests/test_launch.py \
        tests/test_patch.py 2>&1 | tail -40 > "$OUT/gpu_suite.log"
    tail -4 "$OUT/gpu_suite.log"
fi
if [ "${1:-}" != quick ]; then  # the bench's own host section (normkit vs torch), on one width per op
    timeout 240 python3 -m normkit bench --ops ln,rms,gn --dtypes bf16 --widths 4096 --peers torch --quick \
        --no-plots --out "$OUT/bench" 2>&1 | tail -30 > "$OUT/bench.log"
    tail -4 "$OUT/bench.log"
fi
timeout 200 python3 benchmarks/profile_host.py --out "$OUT/host" --rounds 15 2>&1 | tee "$OUT/profile_host.log"
