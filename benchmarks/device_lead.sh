#!/usr/bin/env bash
# The lead's device calls (one GPU; carry .whl: the diffusers and liger-kernel wheels), each under
# 10 minutes, results under $OUT in one archive. Sessions 10-11 ran it (named device_session10.sh in session 10).
#   bash benchmarks/device_lead.sh models   issue 22's eager model cases on the merged tree (unpatched vs
#                                                 normkit, Liger where it applies) and the host table
#   bash benchmarks/device_lead.sh tests    the GPU test files (GPU_TEST_FILES)
#   bash benchmarks/device_lead.sh mtests   the model/patch tests, each result on its own line
#   bash benchmarks/device_lead.sh compile  compiled Llama decode and training, UNet2DModel, unpatched vs normkit
#   bash benchmarks/device_lead.sh kernels  normkit bench's row sweep (fwd and bwd, bf16) and the GroupNorm
#                                                 suite with torch and torch.compile in the same run (issue 24)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt  # (sourced with no argument it would take this script's $1)
# bench SECONDS ARGS...: normkit bench under a time limit, its progress lines shown
case "${1:-models}" in
models)
    bench 60 --host-only --host-cases all --ops ln,rms,gn,rms+add+pre,ln+add+pre --peers torch --out "$OUT/host"
    # 10 rounds of 4 timed steps: session 9's 5 rounds of 1 left host-bound cases' medians to chance
    steps="--steps 40 --rounds 10"
    bench 110 --models llama,qwen3,gemma --modes decode --exec eager --variants unpatched,normkit,liger $steps \
        --time-budget 90 --out "$OUT/llm"
    bench 70 --models whisper-encoder --exec eager --variants unpatched,normkit $steps --time-budget 55 \
        --out "$OUT/whisper"
    bench 150 --models dit,sd3 --exec eager --variants unpatched,normkit,normkit-relaxed $steps \
        --time-budget 125 --out "$OUT/dit-sd3"
    for b in 1 2; do
        bench 60 --models sd15-unet --modes infer --exec eager --variants unpatched,normkit --batch $b $steps \
            --time-budget 42 --out "$OUT/sd15-b$b"
    done
    ;;
tests)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE $GPU_TEST_FILES 2>&1 | grep -v '^USDT' > "$OUT/tests.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-200 | head -30; tail -1 "$OUT/tests.log"
    ;;
mtests)
    timeout 400 python3 -m pytest -v -p no:cacheprovider -n 12 -rfE tests/test_models.py tests/test_patch.py \
        2>&1 | grep -v '^USDT' > "$OUT/tests-models.log"
    grep -E "FAILED|ERROR" "$OUT/tests-models.log" | cut -c1-220 | head -20; tail -1 "$OUT/tests-models.log"
    ;;
compile)
    bench 250 --models llama --modes decode,train --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 220 --out "$OUT/llama"
    bench 250 --models unet2d --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 220 --out "$OUT/unet2d"
    ;;
kernels)
    bench 300 --ops ln,rms --dirs fwd,bwd --dtypes bf16 --widths 1024,4096,8192,16384,32768,65536,131072,262144 \
        --peers torch,compile --no-host --time-budget 270 --out "$OUT/rows"
    timeout 215 python3 benchmarks/gn_sweep.py --out "$OUT/gn" --dtypes bf16 --variants default --acts - \
        --act-variants default --peers torch,compile --layouts nchw,cl --budget 165 2>&1 | tail -25
    ;;
esac
# one archive: the device sends back at most 8 files
tar czf "/tmp/lead-${1:-models}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/lead-${1:-models}.tgz" "$OUT/"
