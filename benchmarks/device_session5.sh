#!/usr/bin/env bash
# Session 5's device call (one GPU; carry .whl with the diffusers wheel), under 10 minutes, results
# under $OUT: the GPU tests of what changed (code-level block recognition, recognition by computation,
# edge cases, compile cache), the model benchmark of the HF LLMs eager (unpatched vs normkit, with the
# fused blocks now found from the forward's source), and the compile-cache timings (issue 25).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE tests/test_blocks.py tests/test_patch.py \
    tests/test_recognize.py tests/test_edge_cases.py tests/test_models.py tests/test_compile_cache.py \
    tests/test_api.py 2>&1 | grep -v '^USDT' > "$OUT/tests.log"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-200 | head -30; tail -1 "$OUT/tests.log"
timeout 200 python3 -m normkit recognition > "$OUT/recognition.txt" 2>&1; tail -1 "$OUT/recognition.txt"
timeout 150 python3 benchmarks/compile_cache.py --device cuda > "$OUT/compile_cache.csv" 2> "$OUT/compile_cache.err"
cat "$OUT/compile_cache.csv"; tail -3 "$OUT/compile_cache.err"
timeout 200 python3 -m normkit bench --models llama,qwen3,gemma --exec eager --variants unpatched,normkit \
    --out "$OUT/models" --no-plots 2>&1 | grep -E "^\[|wrote" | cut -c1-160
