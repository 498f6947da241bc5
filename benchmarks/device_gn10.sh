#!/usr/bin/env bash
# Session 10, helper gn10: the one device call (one H100; carry .whl and the worktree copy .wt-gn10).
# GroupNorm bf16, G = 32, on the diffusion shapes, NCHW and channels_last, fwd and bwd, torch and
# torch.compile in the same run: default vs the pipelined walks (tl.range num_stages: the looped kernels'
# tiles, pipe2 / pipe3 / pipe3-looped; the staged stats span, st-pipe2 / st-pipe3), the two-kernel split up
# to 4.5 groups per SM (s2-4), and session 9's named next run (slots, lt-16k). Shapes in the order that
# matters (the 2-groups-per-SM ones first, batch 1 and 32x1280x8x8 last) under a time budget. Then the
# device's own Triton compiles the looped kernels offline (gn_regs.py): registers, shared memory, and
# whether the loads became cp.async; and the pipelined paths' tests. Files land flat in $OUT (<= 8).
#   cd .wt-gn10 && ln -sfn ../.whl .whl && bash benchmarks/device_gn10.sh [next]
# Run S10-gn10 ran it from commit 312ad62; its pipe2 / pipe3 / pipe3-looped / st-pipe2 / st-pipe3 variants (and
# the kernels' STAGES) were removed after it, measured no faster: run it from that commit to repeat it.
# `next`: the confirmation run of what was adopted (default against s9-default, the table before it), and
# more NCHW groups read once in one tile (one-32k forward, one-16k-bwd).
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
SHAPES=8x320x64x64,8x640x32x32,16x640x32x32,32x256x56x56,4x128x128x128,8x1280x16x16,1x320x64x64,32x1280x8x8,1x1280x8x8
if [ "${1:-}" = next ]; then
    timeout 200 python3 benchmarks/gn_sweep.py --out "$OUT/s1" --dtypes bf16 --acts - --peers torch,compile \
        --shapes $SHAPES --variants default,s9-default,one-32k,one-16k-bwd --cl-variants default --budget 170 > "$OUT/sweep.log" 2>&1
    echo "sweep rc $?"; tail -2 "$OUT/sweep.log"
    [ -f "$OUT/s1/gn_sweep.csv" ] && mv "$OUT/s1/gn_sweep.csv" "$OUT/sweep.csv"; rm -rf "$OUT/s1"
    exit 0
fi
timeout 232 python3 benchmarks/gn_sweep.py --out "$OUT/s1" --dtypes bf16 --acts - --peers torch,compile \
    --shapes $SHAPES --variants default,pipe2,pipe3,pipe3-looped,s2-4,slots,lt-16k \
    --cl-variants default,st-pipe2,st-pipe3,pipe3 --profile --profile-variants default,pipe3,st-pipe2 \
    --profile-shapes 8x320x64x64/g32,8x640x32x32/g32,8x320x64x64/g32/cl --budget 200 > "$OUT/sweep.log" 2>&1
echo "sweep rc $?"; tail -2 "$OUT/sweep.log"
[ -f "$OUT/s1/gn_sweep.csv" ] && mv "$OUT/s1/gn_sweep.csv" "$OUT/sweep.csv"; rm -rf "$OUT/s1"
timeout 20 python3 - > "$OUT/regs.txt" 2>&1 <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from gn_regs import registers
for d, r, s, st in (("fwd", 8, 1024, 1), ("fwd", 8, 1024, 2), ("fwd", 8, 1024, 3), ("bwd", 4, 1024, 1), ("bwd", 4, 1024, 3)):
    print(d, [r, s], "8 warps", st, "stages: (registers, stack, shared, cp.async) =", registers(d, r, s, 8, stages=st), flush=True)
PY
echo "regs rc $?"
# the pipelined paths' tests (forced on small ragged inputs, HW = 1, prime HW, NaN, offset) compiled for real
timeout 40 python3 -m pytest -q -x -p no:cacheprovider tests/test_group_norm.py -k pipe > "$OUT/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$OUT/tests.log"
ls -la "$OUT"
