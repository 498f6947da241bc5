#!/usr/bin/env bash
# Session 24 (issue 24), one device call each, files in one archive in $OUT:
#   bash benchmarks/device_s24.sh probe   the wide forward with weight and bias / weight / neither (wide_params_probe.py:
#                                         is it the parameters' L2 traffic?), ncu of its 128K cluster kernels, ncu of the
#                                         channels_last GroupNorm cluster forward at 16x640x32x32 and 32x256x56x56 bf16 with
#                                         a copy of the same bytes (DRAM bytes against the ideal: over-fetch of 80-byte runs?)
#   bash benchmarks/device_s24.sh gncl    channels_last GroupNorm's cluster forward, this tree against session 13's code
#                                         (NK_GN_CL_OLD) in turn, gn_sweep.py with torch.compile and a copy; its GPU tests
#   bash benchmarks/device_s24.sh gncl2   the same after the partials' 16-byte stores, both directions, the GPU tests in full
#   bash benchmarks/device_s24.sh gnnchw  NCHW GroupNorm's cluster kernels without runtime divisions per pack, against them
#   (the A/B defines of gncl / gncl2 (NK_GN_CL_OLD) and gnnchw (NK_GN_OLD_DIV) were in the device runs' working trees
#   only, never committed: today both sides run this tree's kernels. Their "old" side is the kernels of 69e6e50 (gncl,
#   gncl2) and 6eecb9f (gnnchw). groups and wait measure knobs removed after runs S24-2 / S24-3: they run at commit
#   ef88313, which has them)
#   bash benchmarks/device_s24.sh wait    the cluster kernels' barrier waits: try_wait with a suspend-time hint
#                                         (NK_WAIT_HINT_NS) or a nanosleep between tries (NK_WAIT_SLEEP_NS) against the
#                                         spin, the forward at 32K-256K (widefwd_sweep) and the backward at 16K-256K (bench)
#   bash benchmarks/device_s24.sh groups  the wide forward's row groups (widefwd_sweep.py TxIgR variants: R rows a cluster
#                                         step, each pack's weight and bias loaded once for them) against the committed
#                                         shapes, bf16 64K-256K, checked against the oracle, two interleaved reps
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks"
NCU_SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats
    --section LaunchStats --section SchedulerStats"
NCU_BYTES="--metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum"
GROUPS_VARIANTS="normkit,256x4g2+1,256x4g2+m1,256x8g2+1%NK_FWD_SM_THREADS=768,128x8g2+1%NK_FWD_SM_THREADS=768"
GROUPS_VARIANTS="$GROUPS_VARIANTS,256x4g4+1%NK_FWD_SM_THREADS=768,256x4g2+1%NK_FWD_SM_THREADS=1280"
# gn_ab NAME DEFINE REPS SECONDS BUDGET ARGS...: gn_sweep.py's default plans with ARGS, this tree then the tree built with
# -D DEFINE (NORMKIT_CUDA_DEFINES), REPS times in turn, into $OUT/NAME-i-{new,DEFINE}, its table lines
gn_ab() {
    local name=$1 define=$2 reps=$3 t=$4 budget=$5 i=0 d rep; shift 5
    for rep in $(seq "$reps"); do
        for d in "" "$define"; do
            i=$((i + 1))
            NORMKIT_CUDA_DEFINES="$d" timeout "$t" python3 benchmarks/gn_sweep.py --out "$OUT/$name-$i-${d:-new}" \
                --acts - --peers compile,copy --variants default --budget "$budget" "$@" > "$OUT/$name-$i.log" 2>&1
            echo "$name $i '${d:-new}' rc $?"
            grep -E "^(bf16|fp32|copy|budget)|FAIL|rror" "$OUT/$name-$i.log" | cut -c1-300
        done
    done
}
case "${1:-probe}" in
probe)
    timeout 150 python3 benchmarks/wide_params_probe.py --reps 2 2>&1 | grep -v -i warn | tee "$OUT/params.txt"
    timeout 120 ncu --kernel-name regex:'row_fwd_cluster' --launch-skip 0 $NCU_SECTIONS $NCU_BYTES \
        python3 benchmarks/wide_params_probe.py --ncu > "$OUT/ncu-wide.txt" 2>&1
    echo "ncu wide rc $?"; grep -E "probe:|row_fwd_cluster|DRAM Throughput|L2 Cache Throughput|Duration|Achieved Occupancy|dram__bytes|lts__t_bytes|Registers Per" \
        "$OUT/ncu-wide.txt" | cut -c1-150 | head -80
    timeout 120 ncu --kernel-name regex:'gn_cl|elementwise|copy' $NCU_SECTIONS $NCU_BYTES \
        python3 benchmarks/gn_ncu.py 16x640x32x32,32x256x56x56 --cl --copy > "$OUT/ncu-gncl.txt" 2>&1
    echo "ncu gncl rc $?"; grep -E "gn_ncu|gn_cl|elementwise_kernel|copy|DRAM Throughput|Duration|Achieved Occupancy|dram__bytes|Registers Per" \
        "$OUT/ncu-gncl.txt" | cut -c1-150 | head -80
    timeout 60 ncu --kernel-name regex:'gn_cl_fwd' --launch-count 1 --section PmSampling \
        python3 benchmarks/gn_ncu.py 16x640x32x32 --cl > "$OUT/ncu-gncl-pm.txt" 2>&1
    echo "ncu pm rc $?"; tail -40 "$OUT/ncu-gncl-pm.txt" | cut -c1-160
    ;;
groups)  # row groups (ROWS): each pack's parameters loaded once for 2-4 rows; checked against the oracle, timed twice
    timeout 330 python3 benchmarks/widefwd_sweep.py --out "$OUT/groups" --parts check,time --checks variants \
        --dtypes bf16 --widths 131072,262144,65536 --variants "$GROUPS_VARIANTS" --repeat 2 --budget 310 \
        > "$OUT/groups.log" 2>&1
    echo "groups rc $?"; grep -E "CHECK|copy ceiling|prebuilt|Error" "$OUT/groups.log" | cut -c1-200
    python3 benchmarks/csv_table.py "$OUT/groups/rows.csv" 2>&1 | head -40
    timeout 60 python3 benchmarks/wide_params_probe.py --widths 131072 --reps 1 2>&1 | grep -v -i warn
    ;;
gncl)  # channels_last GroupNorm's cluster forward: the group sums without a division per element and y as one FMA,
    # against session 13's code (NK_GN_CL_OLD) in turn; the GroupNorm GPU tests; ncu's hot spots of the new forward
    gpu_tests 170 gn-tests.log -n 12 tests/test_group_norm.py tests/test_cuda_backend.py tests/test_host_gpu.py \
        -k "group_norm or gn_ or channels_last or cl_"
    gn_ab gncl NK_GN_CL_OLD 2 110 95 --dtypes bf16,fp32 --layouts cl --dirs fwd \
        --shapes 16x640x32x32,8x640x32x32,32x256x56x56,8x320x64x64,4x128x128x128,8x1280x16x16,1x320x64x64
    timeout 90 ncu --kernel-name regex:'gn_cl_fwd' --launch-count 1 --section SourceCounters --section InstructionStats \
        --section WarpStateStats --section SpeedOfLight python3 benchmarks/gn_ncu.py 16x640x32x32 --cl \
        > "$OUT/ncu-gncl-src.txt" 2>&1
    echo "ncu rc $?"; grep -E "Duration|Issued|Executed Ipc|Warp Cycles|Stall|^\s+[0-9a-f]{4}" "$OUT/ncu-gncl-src.txt" | head -40
    ;;
gncl2)  # the same with the partials' 16-byte stores (forward and backward): the GroupNorm GPU tests in full, then this
    # tree and session 13's code (NK_GN_CL_OLD) once each, both directions
    gpu_tests 250 gn-tests.log -n 14 tests/test_group_norm.py tests/test_cuda_backend.py tests/test_host_gpu.py \
        -k "group_norm or gn_ or channels_last or cl_"
    gn_ab gncl2 NK_GN_CL_OLD 1 125 110 --dtypes bf16,fp32 --layouts cl --dirs fwd,bwd \
        --shapes 16x640x32x32,8x640x32x32,32x256x56x56,4x128x128x128,8x320x64x64
    ;;
gnnchw)  # NCHW GroupNorm's cluster kernels: a pack's channel by a multiply-high (DivBy) and the row's group in 32 bits,
    # against the runtime divisions (NK_GN_OLD_DIV); the GroupNorm GPU tests first
    gpu_tests 180 gn-tests.log -n 14 tests/test_group_norm.py tests/test_cuda_backend.py -k "group_norm or gn"
    gn_ab nchw NK_GN_OLD_DIV 1 95 80 --dtypes fp32,bf16 --layouts nchw --dirs fwd,bwd \
        --shapes 16x640x32x32,8x640x32x32,32x256x56x56,8x320x64x64
    ;;
wait)  # the barrier waits' spin (try_wait again at once) against a suspend-time hint / a nanosleep between tries
    V="normkit,normkit%NK_WAIT_HINT_NS=1000,normkit%NK_WAIT_HINT_NS=10000,normkit%NK_WAIT_HINT_NS=100000"
    V="$V,normkit%NK_WAIT_SLEEP_NS=32,normkit%NK_WAIT_SLEEP_NS=128"
    timeout 250 python3 benchmarks/widefwd_sweep.py --out "$OUT/wait" --parts time --dtypes bf16 \
        --widths 131072,262144,65536,32768 --variants "$V" --repeat 2 --budget 230 > "$OUT/wait.log" 2>&1
    echo "wait rc $?"; grep -a -E "copy ceiling|prebuilt|Error" "$OUT/wait.log" | cut -c1-200
    python3 benchmarks/csv_table.py "$OUT/wait/rows.csv" 2>&1 | head -60
    i=0
    for d in "" NK_WAIT_HINT_NS=10000 "" NK_WAIT_HINT_NS=10000; do
        i=$((i + 1)); echo "== backward, NORMKIT_CUDA_DEFINES='$d'"
        NORMKIT_CUDA_DEFINES="$d" bench 80 --ops ln,rms --dtypes bf16 --dirs bwd --widths 16384,32768,65536,131072,262144 \
            --normkit auto --peers none --no-host --out "$OUT/bwd-$i-${d:-base}"
    done
    for d in $OUT/bwd-*; do echo "$d"; grep -v "^#" "$d/results.csv" | cut -d, -f2,6,8,13,18,21 | grep -v "^op"; done
    ;;
esac
tar czf "/tmp/s24-${1:-probe}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s24-${1:-probe}.tgz" "$OUT/"
