#!/usr/bin/env bash
# One device call: the WebGPU kernels (seed 000) on the NVIDIA GPU through Vulkan, via wgpu-py.
# The GPU machine has no Vulkan loader and no wgpu, and no network: both are carried from here.
#   .gl/  : loader debs (libvulkan1, ...), fetched with apt-get download as the device README says
#   .whl/ : wgpu 0.32.0 (manylinux x86_64) and what it needs there: cffi (cp312), pycparser, rendercanvas
# Usage (device tool, carry [".gl", ".whl"]): bash benchmarks/webgpu_device.sh
# Writes $OUT/webgpu/{webgpu_ladder.md,csv,png, ladder.log, tests.log}.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-webgpu-out}
mkdir -p "$OUT/webgpu"
log() { echo "webgpu_device.sh: $*" >&2; }

# the loaders, unpacked into / (only these debs: others can break the system)
ls .gl/*.deb >/dev/null 2>&1 || { log "no .gl/*.deb: carry .gl (see the header)"; exit 2; }
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
# wgpu and its needs into a private site folder (torch, numpy are already there)
wheels=$(ls .whl/wgpu-*.whl .whl/cffi-*.whl .whl/pycparser-*.whl .whl/rendercanvas-*.whl 2>/dev/null) \
  || { log "missing wheels in .whl: carry .whl (see the header)"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
  || { log "pip could not install the carried wheels"; exit 2; }
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"

# the NVIDIA driver's Vulkan ICD lives with the read-only driver mount; Vulkan only, never GL
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES="$icd" VK_ICD_FILENAMES="$icd"
export WGPU_BACKEND_TYPE=Vulkan

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/webgpu/env.txt"
python3 -c "import wgpu; a = wgpu.gpu.request_adapter_sync(power_preference='high-performance'); \
print('wgpu', wgpu.__version__, '|', a.summary, '|', sorted(a.features))" 2>&1 | tee -a "$OUT/webgpu/env.txt"

# the same tests as CI, on this adapter (the lavapipe-only rerun skips itself), then the ladder
python3 -m pytest -q -p no:cacheprovider tests/test_webgpu.py 2>&1 | tee "$OUT/webgpu/tests.log" | tail -15
tests_rc=${PIPESTATUS[0]}
python3 -m normkit ladder --backend webgpu --out "$OUT/webgpu" --plot 2>&1 | tee "$OUT/webgpu/ladder.log"
ladder_rc=${PIPESTATUS[0]}
log "tests rc=$tests_rc ladder rc=$ladder_rc"
exit $(( tests_rc || ladder_rc ))
