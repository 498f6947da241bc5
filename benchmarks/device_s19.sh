#!/usr/bin/env bash
# Session 19 (issue 22: size classes in the compile table replace its min_elements floor), one device call each
# (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s19.sh table    benchmarks/compile_table.py at 2^12 / 2^16 / 2^20 elements for the
#                                          pattern / dtype / mode / width classes whose plain (2^24) entry says
#                                          normkit; the GPU's table gets the new size-class entries (--write-table)
#   bash benchmarks/device_s19.sh models   compiled Llama decode and training, UNet2DModel training and inference,
#                                          unpatched vs normkit, with the table as committed (no floor)
#   bash benchmarks/device_s19.sh tests    the compile and wide-row GPU tests; eager DiT and SD3 (the eager cases below
#                                          1.00 at their medians in session 15)
#   bash benchmarks/device_s19.sh eager    the host table and the other eager model cases of issue 22 (device_lead.sh
#                                          models without DiT / SD3, Whisper and SD-1.5 batch 2, which eager2 runs)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
case "${1:-table}" in
table)
    timeout 520 python3 benchmarks/compile_table.py --out "$OUT/compile-table" --jobs 8 --budget-s 420 \
        --elements 4096,65536,1048576 --winners-of normkit/backends/triton/tuned/compile_sm_90.json \
        --widths 512,768,1024,2048,3584,4096,5120,8192,16384 \
        --patterns rms,ln,add_ln,gn_silu,gn,pw+gn_silu,add_rms,rms_cast,gn_mish,ln_gelu --write-table 2>&1 \
        | grep -v -i warn | tail -5
    cp normkit/backends/triton/tuned/compile_sm_90.json "$OUT/compile-table/table-written.json"
    grep -c "" "$OUT"/compile-table/points-*.jsonl | tail -3
    grep -E "\| (yes|no) \|" "$OUT/compile-table/compile_table.md" | head -80 | cut -c1-150
    ;;
models)
    bench 250 --models llama --modes decode,train --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 220 --out "$OUT/llama"
    bench 250 --models unet2d --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 220 --out "$OUT/unet2d"
    ;;
tests)
    gpu_tests 300 tests.log -n 12 tests/test_compile_fusion.py tests/test_compile.py tests/test_compile_cache.py \
        tests/test_host_gpu.py "tests/test_gpu.py::test_wide_rows"
    bench 170 --models dit,sd3 --exec eager --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 150 --out "$OUT/dit-sd3"
    ;;
eager)
    bench 60 --host-only --host-cases all --ops ln,rms,gn,rms+add+pre,ln+add+pre --peers torch --out "$OUT/host"
    steps="--steps 40 --rounds 10"
    bench 110 --models llama,qwen3,gemma --modes decode --exec eager --variants unpatched,normkit,liger $steps \
        --time-budget 90 --out "$OUT/llm"
    bench 60 --models sd15-unet --modes infer --exec eager --variants unpatched,normkit --batch 1 $steps \
        --time-budget 42 --out "$OUT/sd15-b1"
    ;;
eager2)
    steps="--steps 40 --rounds 10"
    bench 70 --models whisper-encoder --exec eager --variants unpatched,normkit $steps --time-budget 55 \
        --out "$OUT/whisper"
    bench 60 --models sd15-unet --modes infer --exec eager --variants unpatched,normkit --batch 2 $steps \
        --time-budget 42 --out "$OUT/sd15-b2"
    ;;
esac
tar czf "/tmp/s19-${1:-table}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s19-${1:-table}.tgz" "$OUT/"
