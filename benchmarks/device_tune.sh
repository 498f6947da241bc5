#!/usr/bin/env bash
# One device call: GPU tests, host overhead, then the config tuner (parallel compile, then timing).
# Writes tuned/sm_XX.json and logs under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_launch.py tests/test_row_norm.py 2>&1 | tail -15 | tee $OUT/tests.log
timeout 40 python3 - <<'PY' 2>&1 | tee $OUT/overhead.log
import time, torch, torch.nn.functional as F, normkit
x = torch.randn(4, 4096, dtype=torch.bfloat16, device="cuda"); w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
for name, f in [("normkit ln", lambda: normkit.layer_norm(x, (4096,), w)), ("torch ln", lambda: F.layer_norm(x, (4096,), w)),
                ("normkit rms", lambda: normkit.rms_norm(x, (4096,), w)), ("torch rms", lambda: F.rms_norm(x, (4096,), w))]:
    for _ in range(200): f()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(5000): f()
    t1 = time.perf_counter(); torch.cuda.synchronize()
    print(f"host {name}: {(t1-t0)/5000*1e6:.1f} us/call")
PY
for i in $(seq 0 11); do timeout 150 python3 benchmarks/tune.py --out /tmp/x.json --compile-only $i/12 >/dev/null 2>&1 & done; wait
echo compiled; ls ~/.triton/cache | wc -l
timeout 360 python3 benchmarks/tune.py --out $OUT/sm_90.json --budget-s 330 > $OUT/tune_stdout.log 2>&1
grep BEST $OUT/sm_90.json.log
