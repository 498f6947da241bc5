#!/usr/bin/env bash
# Session 10, helper gn10 (one H100; carry .whl and the worktree copy .wt-gn10):
#   cd .wt-gn10 && ln -sfn ../.whl .whl && bash benchmarks/device_gn10.sh
# Run S10-gn10 was this script at commit 312ad62: default vs the pipelined walks (pipe2 / pipe3 / pipe3-looped,
# st-pipe2 / st-pipe3), s2-4, slots and lt-16k on every diffusion shape, both layouts, with torch and
# torch.compile, then the device Triton's registers and the pipelined paths' GPU tests. The pipelined kernels
# were removed after it (no faster): run it from that commit to repeat it.
# Now the next run: the adopted table against s9-default (the table before it), and more NCHW groups held
# whole in one tile and read once (one-32k forward, one-16k-bwd); GroupNorm bf16, G = 32, NCHW and
# channels_last, fwd and bwd, torch and torch.compile in the same run, shapes in the order that matters
# under a time budget. Files land flat in $OUT (<= 8).
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
SHAPES=8x320x64x64,8x640x32x32,16x640x32x32,32x256x56x56,4x128x128x128,8x1280x16x16,1x320x64x64,32x1280x8x8,1x1280x8x8
timeout 200 python3 benchmarks/gn_sweep.py --out "$OUT/s1" --dtypes bf16 --acts - --peers torch,compile \
    --shapes $SHAPES --variants default,s9-default,one-32k,one-16k-bwd --cl-variants default --budget 170 \
    > "$OUT/sweep.log" 2>&1
echo "sweep rc $?"; tail -2 "$OUT/sweep.log"
[ -f "$OUT/s1/gn_sweep.csv" ] && mv "$OUT/s1/gn_sweep.csv" "$OUT/sweep.csv"; rm -rf "$OUT/s1"
ls -la "$OUT"
