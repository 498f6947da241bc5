#!/usr/bin/env bash
# Session 8's device calls (one GPU; carry .whl: the diffusers and liger-kernel wheels), each under
# 10 minutes, results under $OUT.
#   bash benchmarks/device_session8.sh tests    GPU tests of the library (host path, fused options,
#                                                GroupNorm, CUDA backend, compiled ops), the model
#                                                tests of the patched families, the host table
#   bash benchmarks/device_session8.sh models   eager model cases of issues 22/23 (unpatched vs normkit,
#                                                Liger where it applies)
#   bash benchmarks/device_session8.sh profile  host profiles (unpatched next to patched) of the cases that ran
#                                                slower patched: Whisper training, SD3 inference, compiled Llama decode
#   bash benchmarks/device_session8.sh kernels  row-norm backward and GroupNorm (both layouts) with torch and
#                                                torch.compile in the same run (issue 24)
#   bash benchmarks/device_session8.sh compile  compiled Llama decode and UNet2DModel (issue 22's
#                                                compiled targets), unpatched vs normkit
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt  # (sourced with no argument it would take this script's $1)
# bench SECONDS ARGS...: normkit bench under a time limit, its progress lines shown
case "${1:-tests}" in
tests)
    timeout 400 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE $GPU_TEST_FILES 2>&1 | grep -v '^USDT' > "$OUT/tests.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-200 | head -30; tail -1 "$OUT/tests.log"
    timeout 120 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE tests/test_models.py tests/test_patch.py \
        2>&1 | grep -v '^USDT' > "$OUT/tests-models.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-models.log" | cut -c1-200 | head -20; tail -1 "$OUT/tests-models.log"
    ;;
models)
    timeout 60 python3 benchmarks/debug_compiled_modulation.py 2>&1 | grep -v Warn | tail -16
    bench 60 --host-only --host-cases all --ops ln,rms,gn,rms+add+pre,ln+add+pre --peers torch --out "$OUT/host"
    bench 120 --models llama,qwen3,gemma --modes decode --exec eager --variants unpatched,normkit,liger \
        --time-budget 95 --out "$OUT/llm"
    bench 75 --models whisper-encoder --exec eager --variants unpatched,normkit --steps 3 --time-budget 60 \
        --out "$OUT/whisper"
    bench 135 --models dit,sd3 --exec eager --variants unpatched,normkit,normkit-relaxed --steps 3 \
        --time-budget 110 --out "$OUT/dit-sd3"
    for b in 1 2; do
        bench 60 --models sd15-unet --modes infer --exec eager --variants unpatched,normkit --batch $b \
            --time-budget 40 --out "$OUT/sd15-b$b"
    done
    ;;
profile)
    for m in "whisper-encoder train" "sd3 infer" "llama decode --exec compile"; do
        timeout 200 python3 benchmarks/profile_model_host.py $m --out "$OUT" 2>&1 | grep -v Warning | tail -5
    done
    ;;
kernels)
    timeout 45 python3 benchmarks/debug_compiled_modulation.py 2>&1 | grep -v Warn | grep -v "compiled call [1-5]" | tail -14
    bench 255 --ops ln,rms --dirs bwd --dtypes bf16 --widths 1024,4096,8192,16384,32768,65536,262144 \
        --peers torch,compile --no-host --time-budget 225 --out "$OUT/rows"
    timeout 215 python3 benchmarks/gn_sweep.py --out "$OUT/gn" --dtypes bf16 --variants default --acts - \
        --act-variants default --peers torch,compile --layouts nchw,cl --budget 165 2>&1 | tail -25
    ;;
compile)
    bench 280 --models llama --modes decode,infer --exec compile --variants unpatched,normkit \
        --time-budget 250 --out "$OUT/llama"
    bench 280 --models unet2d --exec compile --variants unpatched,normkit --time-budget 250 --out "$OUT/unet2d"
    ;;
esac
# one archive: the device sends back at most 8 files
tar czf "/tmp/session8-${1:-tests}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/session8-${1:-tests}.tgz" "$OUT/"
