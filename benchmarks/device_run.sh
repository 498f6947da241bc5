#!/usr/bin/env bash
# One device call: environment, the GPU test suite, then the benchmark. Writes logs under $OUT.
# Usage on the device: bash benchmarks/device_run.sh [pytest files...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/env.txt"
tests=${*:-tests}
python3 -m pytest -q -p no:cacheprovider $tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
