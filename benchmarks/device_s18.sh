#!/usr/bin/env bash
# Session 18 (issue 24), one device call, files in $OUT (carry .whl):
#   bash benchmarks/device_s18.sh loop  the looped forward (session 18: per-lane sums reduced once after the loop, as
#                                       Inductor's looped reductions do) at 8K-32K, chunk x warps, with and without L2
#                                       hints (fwd_sweep.py vl*), against the table and torch.compile (whose kept launch
#                                       configs the sweep logs); the row-norm GPU tests (the looped kernels included)
#   bash benchmarks/device_s18.sh ncu   Nsight Compute of the 8K-32K forward: the table's tile, looped variants and
#                                       torch.compile's kernel (bytes read from DRAM, occupancy: loop_ncu.py); fwd_sweep
#                                       of the tile on 16 warps at 8K and the looped kernel on (2048, 16)
#   bash benchmarks/device_s18.sh loop3 the looped forward with the next chunk loaded ahead in both passes, chunk x warps
#                                       (up to 32 warps, as Inductor's 32K kernel), against the table and torch.compile
#   bash benchmarks/device_s18.sh probe Inductor's looped RMSNorm written out by hand (ind_probe.py), with and without
#                                       normkit's 64-bit row offsets and runtime width, 8K-32K
#   bash benchmarks/device_s18.sh static the looped forward compiled for the exact width (as the table's looped rows run),
#                                       with L2 hints, chunk x warps at 8K-32K, against the table and torch.compile
#   bash benchmarks/device_s18.sh final `normkit bench` fwd 8K-32K (bf16, fp16) with torch and torch.compile on the final
#                                       table; the GPU test files but the CUDA backend's, plus the row and fusion files
#   bash benchmarks/device_s18.sh h100  (on an H100: the sm_90 table serves it too) RMSNorm's 8K / 32K forward, the
#                                       table's looped rows against the tiles they replaced
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
case "${1:-loop}" in
loop)
    timeout 330 python3 benchmarks/fwd_sweep.py --out "$OUT/loop" --widths 8192,16384,32768 > "$OUT/loop.log" 2>&1
    echo "loop rc $?"; grep -E "copy|FAIL|Error" "$OUT/loop.log" | cut -c1-140
    python3 benchmarks/csv_table.py "$OUT/loop/fwd.csv"
    grep -E "inductor" "$OUT/loop.log" | cut -c1-220 | head -20
    gpu_tests 200 tests-rows.log -n 15 tests/test_row_norm.py tests/test_gate.py tests/test_modulation.py \
        tests/test_fusion.py
    ;;
ncu)
    timeout 150 python3 benchmarks/fwd_sweep.py --out "$OUT/loop2" --widths 8192,16384,32768 \
        --variants table,w16,vl2k16,vl2k16e > "$OUT/loop2.log" 2>&1
    echo "loop2 rc $?"; grep -E "copy|FAIL|Error" "$OUT/loop2.log" | cut -c1-140
    python3 benchmarks/csv_table.py "$OUT/loop2/fwd.csv"
    M="gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,l1tex__t_sector_hit_rate.pct,launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size"
    for spec in "8192 rms table,vl8k16,vl8k16e,vl2k8e,compile" "16384 ln table,vl4k8e,compile" "32768 rms table,vl4k16e,compile"; do
        set -- $spec
        timeout 150 ncu --kernel-name regex:'row_norm_fwd|triton_red' --launch-skip 0 --metrics "$M" --csv \
            python3 benchmarks/loop_ncu.py "$1" "$2" "$3" > "$OUT/ncu-$1-$2.csv" 2> "$OUT/ncu-$1-$2.err"
        echo "ncu $1 $2 rc $?"
        python3 - "$OUT/ncu-$1-$2.csv" <<'PY'
import csv, sys, io, collections
text = open(sys.argv[1]).read()
tag, rows = None, collections.OrderedDict()
lines = text.splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
tags = [l.split("loop_ncu: ")[1] for l in lines if "loop_ncu: " in l]
if start is None:
    print(text[-2000:]); sys.exit()
for r in csv.DictReader(io.StringIO("\n".join(l for l in lines[start:] if l.startswith('"')))):
    rows.setdefault(r["ID"], {"name": r["Kernel Name"][:24]})[r["Metric Name"]] = r["Metric Value"]
print("tags in order:", tags)
for i, (k, v) in enumerate(rows.items()):
    print(k, " ".join(f"{m.split('__')[1][:22]}={val}" for m, val in v.items() if m != "name"), v["name"])
PY
    done
    ;;
loop3)
    timeout 330 python3 benchmarks/fwd_sweep.py --out "$OUT/loop3" --widths 8192,16384,32768 \
        --variants table,vl2k8,vl2k16,vl4k16,vl8k16,vl2k32,vl4k32,vl8k32,vl2k16e,vl4k16e,vl4k32e,vl8k32e \
        > "$OUT/loop3.log" 2>&1
    echo "loop3 rc $?"; grep -E "copy|FAIL|Error" "$OUT/loop3.log" | cut -c1-140
    python3 benchmarks/csv_table.py "$OUT/loop3/fwd.csv"
    gpu_tests 200 tests-rows.log -n 15 tests/test_row_norm.py tests/test_gate.py tests/test_modulation.py \
        tests/test_fusion.py
    ;;
probe)
    timeout 200 python3 benchmarks/ind_probe.py --out "$OUT/probe" > "$OUT/probe.log" 2>&1
    echo "probe rc $?"; grep -E "copy|N=|Error" "$OUT/probe.log" | cut -c1-120
    ;;
static)
    timeout 260 python3 benchmarks/fwd_sweep.py --out "$OUT/static" --widths 8192,16384,32768 \
        --variants table,s2k16,s4k16,s8k16,s4k32,s8k32 > "$OUT/static.log" 2>&1
    echo "static rc $?"; grep -E "copy|FAIL|Error" "$OUT/static.log" | cut -c1-140
    python3 benchmarks/csv_table.py "$OUT/static/fwd.csv"
    gpu_tests 150 tests-rows.log -n 15 tests/test_row_norm.py tests/test_gate.py tests/test_modulation.py
    ;;
final)
    bench 120 --ops ln,rms --dirs fwd --dtypes bf16,fp16 --widths 8192,16384,32768 --peers torch,compile --no-host \
        --time-budget 100 --out "$OUT/bench-fwd"
    # shellcheck disable=SC2086
    gpu_tests 300 tests-b.log -n 15 $(echo $GPU_TEST_FILES | tr ' ' '\n' | grep -v test_cuda_backend) \
        tests/test_row_norm.py tests/test_fusion.py
    ;;
h100)
    timeout 150 python3 benchmarks/fwd_sweep.py --out "$OUT/h100" --widths 8192,32768 --ops rms \
        --variants table,tile > "$OUT/h100.log" 2>&1
    echo "h100 rc $?"; grep -E "copy|FAIL|Error" "$OUT/h100.log" | cut -c1-140
    python3 benchmarks/csv_table.py "$OUT/h100/fwd.csv"
    ;;
esac
