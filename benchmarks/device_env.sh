# Sourced first by the benchmarks/device_session*.sh scripts, on the device: the repo root as the
# working directory, the wheels carried in .whl installed under /tmp/site (on PYTHONPATH), $OUT
# made, the GPU and library versions written to $OUT/${1:-env.txt}, the C++ host path built, GPU_TEST_FILES set,
# and the helpers gpu_tests, bench, sweep, issue22_eager_models and final_models defined.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site"
# the test files the session scripts run on the GPU (the model tests apart: their own time limit)
GPU_TEST_FILES="tests/test_modulation.py tests/test_gate.py tests/test_host_gpu.py tests/test_host.py
    tests/test_group_norm.py tests/test_cuda_backend.py tests/test_gpu.py tests/test_recognize.py tests/test_blocks.py
    tests/test_compile.py tests/test_compile_fusion.py tests/test_api.py tests/test_edge_cases.py tests/test_autograd.py"
mkdir -p "$OUT"
# gpu_tests SECONDS LOG ARGS...: pytest (quiet, no cache, failures reported) under a time limit into $OUT/LOG, then its
# exit status, its failures and its last line
gpu_tests() {
    local t=$1 log=$2; shift 2
    timeout "$t" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short "$@" > "$OUT/$log" 2>&1
    echo "pytest rc $? (124: cut by the time limit)"
    grep -E "^(FAILED|ERROR)" "$OUT/$log" | cut -c1-300 | head -20; tail -1 "$OUT/$log"
    grep -E "^E " "$OUT/$log" | head -12 | cut -c1-300
}
# bench SECONDS ARGS...: `normkit bench --no-plots ARGS` under a time limit, its progress lines
bench() { local t=$1; shift; timeout "$t" python3 -m normkit bench --no-plots "$@" 2>&1 | grep -E "^\[|wrote" | cut -c1-160; }
# sweep SECONDS OUT ARGS...: benchmarks/fwd_sweep.py into $OUT/OUT (log, csv), its oracle failures and its table
sweep() {
    local t=$1 out=$2; shift 2
    timeout "$t" python3 benchmarks/fwd_sweep.py --out "$OUT/$out" "$@" > "$OUT/$out.log" 2>&1
    echo "$out rc $?"; grep -E "copy|FAIL|Error" "$OUT/$out.log" | cut -c1-140
    python3 benchmarks/csv_table.py "$OUT/$out/fwd.csv"
}
# issue22_eager_models: issue 22's eager model cases, `device_s19.sh eager` and `eager2` (that script packs its own
# archive and empties $OUT: what is there is set aside for each and put back), their last lines
issue22_eager_models() {
    local part
    for part in eager eager2; do
        mkdir -p /tmp/keep && cp -r "$OUT/." /tmp/keep/
        bash benchmarks/device_s19.sh "$part" > "/tmp/s19-$part.log" 2>&1; tail -12 "/tmp/s19-$part.log"
        cp -r /tmp/keep/. "$OUT/"
    done
}
# final_models: the checks after a change, on the models' side: the CUDA backend's row cluster tests, issue 22's eager
# model cases (issue22_eager_models), compiled Llama decode (into $OUT/llama-compiled), their summary lines
final_models() {
    gpu_tests 200 cluster.log -n 14 tests/test_cuda_backend.py -k "cluster and not gn"
    issue22_eager_models
    bench 130 --models llama --modes decode --exec compile --variants unpatched,normkit --steps 40 --rounds 10 \
        --time-budget 100 --out "$OUT/llama-compiled"
    grep -E "^\| llama" "$OUT/llama-compiled/models.md" | cut -c1-200
}
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/site .whl/*.whl
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "
import importlib, sys
def version(name):
    try:
        return importlib.import_module(name).__version__
    except ImportError:
        return 'not installed'
print('python', sys.version.split()[0], *(f'{n} {version(n)}' for n in ('torch', 'triton', 'transformers', 'diffusers')))"
  date -u; } 2>&1 | tee "$OUT/${1:-env.txt}"
timeout 120 python3 -c "import normkit._host as h; h.activate(); print(h.status)" 2>&1 | tail -1
