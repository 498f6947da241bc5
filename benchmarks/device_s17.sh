#!/usr/bin/env bash
# Session 17 (issue 24), one device call, files in one archive in $OUT (carry .whl):
#   bash benchmarks/device_s17.sh bwd   the Triton backward at 1K-8K with the next tile's row statistics prefetched with
#                                       it (configs.PREFETCH_STATS, now the default) against without, each also at 128
#                                       registers (bwd_sweep.py stats / nostats / stats-cap / nostats-cap, bf16, oracle
#                                       checks bf16 + fp32, timed twice); `normkit bench` bwd 1K-8K and the fused fp8
#                                       forward (fused-llm) with torch and torch.compile in the run; the CUDA backend's
#                                       RMSNorm forward at 16K-32K next to torch; the Triton row tests on the GPU
#   bash benchmarks/device_s17.sh final the table's 16-bit 1K-8K backward rows at 128 registers (S17-1's -cap, adopted),
#                                       stats / nostats, LayerNorm's 2K and 8K on Triton's tiles (tri), two other 1K tiles;
#                                       fp32 (split rows prefetch too) stats / nostats; `normkit bench` bwd 1K-8K with
#                                       torch and torch.compile; the Triton row tests on the GPU
#   bash benchmarks/device_s17.sh confirm  `normkit bench` bwd 1K-8K (bf16, fp16) on the final table (LayerNorm's 2K / 8K on
#                                       Triton's tiles again), torch and torch.compile in the run; the GPU test files
#   bash benchmarks/device_s17.sh cuda  the CUDA backend against torch eager, forward and backward, bf16 / fp32, 1K-32K
#                                       (issue 24's last item, not measured on the H200 for the backward); its route tests
#   bash benchmarks/device_s17.sh fwd32 the 16-bit forward at 16K-32K (LayerNorm 0.69 of copy at 32K on Triton's one program
#                                       per row): the push cluster shapes with ONE_PASS / MERGE against the table
#                                       (widefwd_sweep.py, both ops, oracle-checked, 2 interleaved reps)
#   bash benchmarks/device_s17.sh tiles the backward's 1K / 8K tiles with more warps per SM (bwd_sweep 1k-w16, 8k-w32);
#                                       `normkit bench` fwd 16K-64K after LayerNorm's 32K forward moved to the clusters
#                                       (ONE_PASS, 2 CTAs), torch and torch.compile in the run; the push forward tests
#   bash benchmarks/device_s17.sh fwd16 the Triton forward's rows at 16K-32K (fwd_sweep.py: 32 / 8 warps, persistent)
#                                       against torch.compile (0.88-0.92 of copy there in S17-6), with Inductor's kernels
#   bash benchmarks/device_s17.sh loop  the looped forward at 16K-32K as Inductor runs it (one program per row, chunks)
#                                       against the table (run S17-9 ran it with L2 eviction hints in the kernel, since removed)
#   bash benchmarks/device_s17.sh last  the final tree: `normkit bench` fwd + bwd at 8K-32K (RMSNorm's 16K forward on 8 warps,
#                                       its 8K backward on 32), torch and torch.compile in the run; the GPU test files
#   bash benchmarks/device_s17.sh h100  (on an H100: the sm_90 table is shared) the backward at 1K-8K with and without the
#                                       statistics prefetched, and `normkit bench` 1K-32K fwd + bwd with torch in the run
#   bash benchmarks/device_s17.sh h100-final  (on an H100) the backward at 1K-8K once RMSNorm's prefetch is off there
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
case "${1:-bwd}" in
bwd)
    timeout 150 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd" --parts check,time --dtypes bf16 \
        --check-dtypes bf16,fp32 --check-variants stats,nostats,stats-cap --widths 1024,2048,4096,8192 \
        --variants nostats,stats,nostats-cap,stats-cap > "$OUT/bwd.log" 2>&1
    echo "bwd rc $?"; grep -E "^(dt|bf16|checks|FAIL)|N=" "$OUT/bwd.log" | cut -c1-140
    timeout 90 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd2" --parts time --dtypes bf16 --widths 1024,2048,4096,8192 \
        --variants stats-cap,nostats-cap,stats,nostats > "$OUT/bwd2.log" 2>&1
    echo "bwd2 rc $?"; grep -E "N=" "$OUT/bwd2.log" | cut -c1-140
    bench 150 --ops ln,rms --dirs bwd --dtypes bf16 --widths 1024,2048,4096,8192 --peers torch,compile --no-host \
        --time-budget 130 --out "$OUT/bench-bwd"
    bench 170 --ops rms+fp8,rms+fp8+amax,ln+fp8 --suites fused-llm --dtypes bf16 --dirs fwd --peers torch,compile \
        --no-host --time-budget 150 --out "$OUT/fp8"
    bench 60 --ops rms --dirs fwd --dtypes bf16 --widths 16384,32768 --normkit auto,cuda --peers torch --no-host \
        --time-budget 45 --out "$OUT/cuda-rms-fwd"
    gpu_tests 200 tests-rows.log -n 15 tests/test_row_norm.py tests/test_gpu.py tests/test_autograd.py
    ;;
final)
    timeout 140 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd" --parts check,time --dtypes bf16 \
        --check-dtypes bf16,fp32 --check-variants stats,tri,1k-p3,1k-p4 --widths 1024,2048,4096,8192 \
        --variants stats,nostats,tri,1k-p3,1k-p4 > "$OUT/bwd.log" 2>&1
    echo "bwd rc $?"; grep -E "^(dt|bf16|checks|FAIL)" "$OUT/bwd.log" | cut -c1-140
    timeout 100 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd32" --parts time --dtypes fp32 \
        --widths 1024,4096,8192,16384,32768,65536,262144 --variants stats,nostats > "$OUT/bwd32.log" 2>&1
    echo "bwd32 rc $?"; grep -E "^(dt|fp32)" "$OUT/bwd32.log" | cut -c1-140
    bench 150 --ops ln,rms --dirs bwd --dtypes bf16 --widths 1024,2048,4096,8192 --peers torch,compile --no-host \
        --time-budget 130 --out "$OUT/bench-bwd"
    gpu_tests 200 tests-rows.log -n 15 tests/test_row_norm.py tests/test_gpu.py tests/test_autograd.py \
        tests/test_edge_cases.py tests/test_api.py
    ;;
confirm)
    bench 170 --ops ln,rms --dirs bwd --dtypes bf16,fp16 --widths 1024,2048,4096,8192 --peers torch,compile --no-host \
        --time-budget 150 --out "$OUT/bench-bwd"
    # shellcheck disable=SC2086
    gpu_tests 330 tests-b.log -n 15 $(echo $GPU_TEST_FILES | tr ' ' '\n' | grep -v test_cuda_backend) \
        tests/test_row_norm.py tests/test_fusion.py
    gpu_tests 60 tests-routes.log -n 15 tests/test_cuda_backend.py -k "routes or launches or backward_matches"
    ;;
cuda)
    bench 250 --ops ln,rms --dtypes bf16,fp32 --widths 1024,2048,4096,8192,16384,32768 --normkit auto,cuda \
        --peers torch --no-host --time-budget 230 --out "$OUT/cuda-vs-torch"
    gpu_tests 200 tests-routes.log -n 15 tests/test_cuda_backend.py -k "routes or launches or backward_matches"
    ;;
fwd32)
    timeout 300 python3 benchmarks/widefwd_sweep.py --out "$OUT/fwd32" --parts check,time --checks variants \
        --dtypes bf16 --widths 16384,32768 --budget 280 --repeat 2 \
        --variants normkit,push,push+1,push+m1,128x8+1,256x8+1,128x4+1,256x4+1,64x8+1 > "$OUT/fwd32.log" 2>&1
    echo "fwd32 rc $?"; grep -E "CHECK|FAIL|total|copy ceiling|prebuilt" "$OUT/fwd32.log" | cut -c1-160
    tail -25 "$OUT/fwd32.log" | cut -c1-170
    ;;
tiles)
    timeout 120 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd" --parts check,time --dtypes bf16 \
        --check-dtypes bf16,fp32 --check-variants 1k-w16,8k-w32 --widths 1024,8192 \
        --variants stats,1k-w16,8k-w32 > "$OUT/bwd.log" 2>&1
    echo "bwd rc $?"; grep -E "^(dt|bf16|checks|FAIL)" "$OUT/bwd.log" | cut -c1-140
    timeout 60 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd2" --parts time --dtypes bf16 --widths 1024,8192 \
        --variants 8k-w32,1k-w16,stats > "$OUT/bwd2.log" 2>&1
    echo "bwd2 rc $?"; grep -E "^(dt|bf16)" "$OUT/bwd2.log" | cut -c1-140
    bench 120 --ops ln,rms --dirs fwd --dtypes bf16 --widths 16384,32768,65536 --normkit auto,cuda \
        --peers torch,compile --no-host --time-budget 100 --out "$OUT/fwd-32k"
    gpu_tests 150 tests-fwd.log -n 15 tests/test_cuda_backend.py -k "push_forward or routes or launches"
    ;;
fwd16)
    TORCH_LOGS=output_code timeout 200 python3 benchmarks/fwd_sweep.py --out "$OUT/fwd16" > "$OUT/fwd16.log" \
        2> "$OUT/inductor-code.log"
    echo "fwd16 rc $?"; grep -E "copy|N=|FAIL" "$OUT/fwd16.log" | cut -c1-140
    grep -E "num_warps|R0_BLOCK|RBLOCK|XBLOCK|eviction_policy|def triton_|@triton_heuristics" "$OUT/inductor-code.log" \
        | sort | uniq -c | sort -rn | head -30 | cut -c1-200
    ;;
loop)
    timeout 240 python3 benchmarks/fwd_sweep.py --out "$OUT/loop" \
        --variants table,w8,loop2k4,loop4k8,loop8k16 > "$OUT/loop.log" 2>&1
    echo "loop rc $?"; grep -E "copy|N=|FAIL|Error" "$OUT/loop.log" | cut -c1-140
    ;;
last)
    bench 100 --ops ln,rms --dtypes bf16 --widths 8192,16384,32768 --peers torch,compile --no-host --time-budget 85 \
        --out "$OUT/bench"
    # shellcheck disable=SC2086
    gpu_tests 300 tests-b.log -n 15 $(echo $GPU_TEST_FILES | tr ' ' '\n' | grep -v test_cuda_backend) \
        tests/test_row_norm.py
    ;;
h100)
    timeout 80 python3 benchmarks/bwd_sweep.py --out "$OUT/bwd" --parts time --dtypes bf16 --widths 1024,2048,4096,8192 \
        --variants stats,nostats > "$OUT/bwd.log" 2>&1
    echo "bwd rc $?"; grep -E "^(dt|bf16)" "$OUT/bwd.log" | cut -c1-140
    bench 130 --ops ln,rms --dtypes bf16 --widths 1024,2048,4096,8192,16384,32768 --peers torch --no-host \
        --time-budget 115 --out "$OUT/bench"
    ;;
h100-final)
    bench 50 --ops ln,rms --dirs bwd --dtypes bf16 --widths 1024,2048,4096,8192 --peers none --no-host \
        --time-budget 40 --out "$OUT/bench"
    gpu_tests 45 tests.log -n 15 tests/test_launch.py tests/test_row_norm.py -k "prefetch or backward or per_gpu"
    ;;
esac
tar czf "/tmp/s17-${1:-bwd}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s17-${1:-bwd}.tgz" "$OUT/"
