#!/usr/bin/env bash
# Session 7's device calls (one GPU; carry .whl: the diffusers and liger-kernel wheels), each under
# 10 minutes, results under $OUT.
#   bash benchmarks/device_session7.sh tests   GPU tests of what changed (host path for fused calls,
#                                               adaLN modulation, gated RMSNorm, GroupNorm, CUDA
#                                               backend, compiled op), then the host table's cases
#   bash benchmarks/device_session7.sh models  the eager model cases of issues 22/23 (unpatched vs
#                                               normkit, Liger where it applies)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
case "${1:-tests}" in
tests)
    timeout 330 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE tests/test_modulation.py tests/test_gate.py tests/test_host_gpu.py \
        tests/test_host.py tests/test_group_norm.py tests/test_cuda_backend.py tests/test_gpu.py \
        tests/test_recognize.py tests/test_blocks.py tests/test_compile.py tests/test_compile_fusion.py \
        tests/test_api.py tests/test_edge_cases.py tests/test_autograd.py 2>&1 | grep -v '^USDT' > "$OUT/tests.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-200 | head -30; tail -1 "$OUT/tests.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE tests/test_models.py tests/test_patch.py \
        -k "mamba or dit or sd3 or pixart or flux or whisper or llama" 2>&1 | grep -v '^USDT' > "$OUT/tests-models.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-models.log" | cut -c1-200 | head -20; tail -1 "$OUT/tests-models.log"
    timeout 150 python3 -m normkit bench --host-only --host-cases all --ops ln,rms,gn,rms+add+pre,ln+add+pre \
        --peers torch --out "$OUT/host" --no-plots 2>&1 | tail -3
    ;;
models)
    timeout 190 python3 -m normkit bench --models llama,qwen3,gemma --modes decode --exec eager \
        --variants unpatched,normkit,liger --time-budget 150 --out "$OUT/llm" --no-plots 2>&1 | grep -E "^\[|wrote" | cut -c1-160
    timeout 240 python3 -m normkit bench --models whisper-encoder,dit,sd3 --exec eager --variants unpatched,normkit \
        --steps 3 --time-budget 200 --out "$OUT/enc" --no-plots 2>&1 | grep -E "^\[|wrote" | cut -c1-160
    timeout 110 python3 -m normkit bench --models sd15-unet --modes infer --exec eager --variants unpatched,normkit \
        --batch 2 --time-budget 80 --out "$OUT/sd15-b2" --no-plots 2>&1 | grep -E "^\[|wrote" | cut -c1-160
    ;;
sd)
    for b in 1 2; do
        timeout 200 python3 -m normkit bench --models sd15-unet --modes infer --exec eager --variants unpatched,normkit \
            --batch $b --out "$OUT/sd15-b$b" --no-plots 2>&1 | grep -E "^\[|wrote" | cut -c1-160
    done
    ;;
esac
