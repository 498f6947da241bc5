#!/usr/bin/env bash
# Session 9, helper gn9: the one device call (one H100, carry .whl and the worktree copy). GroupNorm
# bf16 on the diffusion shapes, NCHW and channels_last: the looped tiles (premise, wrong: 1 vs 2-3
# programs per SM), the per-slot looped first pass, NCHW staged, channels_last's fused finalize
# (sweep 1, with torch and torch.compile); the fused apply, whose programs wait on each other (sweep 2,
# its own timeout); ncu of the default and the halved looped tiles. Files (<= 8) land flat in $OUT.
# Call it as `cd .wt-gn9 && ln -sfn ../.whl .whl && bash benchmarks/device_gn9.sh [next]`: it sources device_env.sh
# itself (run S9-gn9 sourced it twice, ~60 s of the call lost and the sweep cut before 32x256x56x56).
# The run's fused variants (fuse, fuse-all, fused-apply, fused-apply-2k, nchw-fused; nchw-staged's fused
# finalize) were removed after 6c904fd, measured slower: run it as it ran from that commit.
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
if [ "${1:-}" = next ]; then  # the next run the notes ask for (not run in session 9)
    timeout 200 python3 benchmarks/gn_sweep.py --out "$OUT/s1" --dtypes bf16 --acts - --peers torch,compile \
        --layouts nchw --variants default,slots,lt-16k --profile --profile-variants default,lt-16k \
        --profile-shapes 8x320x64x64/g32,8x640x32x32/g32 --budget 170 > "$OUT/sweep1.log" 2>&1
    echo "sweep rc $?"; tail -2 "$OUT/sweep1.log"
    timeout 40 ncu --kernel-name regex:'group_norm|col_sum' --section SpeedOfLight --section Occupancy \
        --section LaunchStats python3 benchmarks/gn_ncu.py 8x640x32x32 --variant default,lt-16k > "$OUT/ncu.txt" 2>&1
    [ -f "$OUT/s1/gn_sweep.csv" ] && mv "$OUT/s1/gn_sweep.csv" "$OUT/sweep1.csv"; rm -rf "$OUT/s1"
    exit 0
fi
V1=default,old,lt-4k,lt-2k,lt-4k-slots,lt-4k-all,nchw-staged,fuse,fuse-all,stats-2k
timeout 180 python3 benchmarks/gn_sweep.py --out "$OUT/s1" --dtypes bf16 --acts - --peers torch,compile \
    --variants $V1 --profile --profile-variants default,lt-4k \
    --profile-shapes 8x320x64x64/g32,8x640x32x32/g32,8x320x64x64/g32/cl --budget 150 > "$OUT/sweep1.log" 2>&1
echo "sweep1 rc $?"; tail -2 "$OUT/sweep1.log"
timeout 45 python3 benchmarks/gn_sweep.py --out "$OUT/s2" --dtypes bf16 --acts - --peers '' \
    --variants default,fused-apply,fused-apply-2k,nchw-fused --budget 30 > "$OUT/sweep2.log" 2>&1
echo "sweep2 rc $?"; tail -2 "$OUT/sweep2.log"
timeout 35 ncu --kernel-name regex:'group_norm|col_sum' --section SpeedOfLight --section Occupancy \
    --section LaunchStats python3 benchmarks/gn_ncu.py 8x640x32x32 --variant default,lt-4k \
    > "$OUT/ncu.txt" 2>&1
echo "ncu rc $?"
for i in 1 2; do [ -f "$OUT/s$i/gn_sweep.csv" ] && mv "$OUT/s$i/gn_sweep.csv" "$OUT/sweep$i.csv"; rm -rf "$OUT/s$i"; done
ls -la "$OUT"
