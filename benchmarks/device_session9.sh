#!/usr/bin/env bash
# Session 9's lead device calls (one GPU; carry .whl), each under 10 minutes, results under $OUT.
#   bash benchmarks/device_session9.sh check   the model tests (verbose: a timeout still names each
#                                               failure), the eager-vs-compiled bitwise check
#   bash benchmarks/device_session9.sh final   the GPU test files of device_session8.sh tests, the model tests
#   bash benchmarks/device_session9.sh compile compiled Llama decode and training, unpatched vs normkit with the
#                                               compile table as shipped and without its min_elements floor
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
# models_tests SECONDS: the model/patch tests, each result on its own line
models_tests() {
    timeout "$1" python3 -m pytest -v -p no:cacheprovider -n 12 -rfE tests/test_models.py tests/test_patch.py \
        2>&1 | grep -v '^USDT' > "$OUT/tests-models.log"
    grep -E "FAILED|ERROR" "$OUT/tests-models.log" | cut -c1-220 | head -20; tail -1 "$OUT/tests-models.log"
}
case "${1:-check}" in
check)
    models_tests 230
    timeout 60 python3 benchmarks/debug_compiled_modulation.py 2>&1 | grep -v Warn | grep -v "compiled call [1-5]" | tail -14
    ;;
final)
    timeout 320 python3 -m pytest -q -p no:cacheprovider -n 12 -rfE $GPU_TEST_FILES 2>&1 | grep -v '^USDT' > "$OUT/tests.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-200 | head -30; tail -1 "$OUT/tests.log"
    models_tests 180
    ;;
compile)
    bench() { timeout "$1" python3 -m normkit bench --no-plots --models llama --modes decode,train --exec compile \
        --variants unpatched,normkit --steps 12 --time-budget "$2" --out "$3" 2>&1 | grep -E "^\[|wrote" | cut -c1-200; }
    python3 -c "import json; d = json.load(open('normkit/backends/triton/tuned/compile_sm_90.json')); d.pop('min_elements'); json.dump(d, open('/tmp/nofloor.json', 'w'))"
    bench 140 100 "$OUT/llama-floor"
    NORMKIT_COMPILE_TABLE=/tmp/nofloor.json bench 140 100 "$OUT/llama-nofloor"
    ;;
esac
tar czf "/tmp/session9-${1:-check}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/session9-${1:-check}.tgz" "$OUT/"
