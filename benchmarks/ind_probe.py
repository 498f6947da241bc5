"""Session 18 probe: torch.compile's looped RMSNorm kernel, written out by hand (Inductor's code for
F.rms_norm at these shapes: one program per row, a per-lane sum of squares over R0_BLOCK chunks, then a
second pass re-reading x), timed like fwd_sweep.py next to normkit's looped kernel, in forms that add one
normkit trait at a time: 64-bit row offsets (I64), the width as a runtime argument (RUNTIME_N: masks and
trip count unknown at compile time). Which trait costs the 0.2-0.3 of copy that normkit's looped kernel
loses to Inductor's at the same chunk and warps (runs S18-1 / S18-3)?

  PYTHONPATH=.:benchmarks python benchmarks/ind_probe.py --out DIR"""
import argparse
import functools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwd_sweep import REP_MS, WARM_MS, _sets, log, write_csv  # noqa: E402

from normkit.bench.timing import CudaTimer, copy_ceiling_gbps  # noqa: E402


@triton.jit
def ind_rms(X, W, Y, RSTD, n_rt, R0_BLOCK: tl.constexpr, RN: tl.constexpr, I64: tl.constexpr,
            RUNTIME_N: tl.constexpr):
    if RUNTIME_N:
        n = n_rt
    else:
        n = RN
    row = tl.program_id(0)
    if I64:
        row = row.to(tl.int64)
    base = row * n
    lanes = tl.arange(0, R0_BLOCK)
    acc = tl.zeros([R0_BLOCK], tl.float32)
    for off in range(0, n, R0_BLOCK):
        cols = off + lanes
        m = cols < n
        x = tl.load(X + base + cols, m, eviction_policy="evict_last", other=0.0).to(tl.float32)
        acc = tl.where(m, acc + x * x, acc)
    r = tl.rsqrt(tl.sum(acc, 0) / n + 1e-5)
    tl.store(RSTD + row, r)
    for off in range(0, n, R0_BLOCK):
        cols = off + lanes
        m = cols < n
        x = tl.load(X + base + cols, m, eviction_policy="evict_first", other=0.0).to(tl.float32)
        w = tl.load(W + cols, m, eviction_policy="evict_last", other=0.0).to(tl.float32)
        tl.store(Y + base + cols, (x * r * w).to(Y.dtype.element_ty), m)


def run(x, w, chunk, warps, i64, runtime_n):
    M, N = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    ind_rms[(M,)](x, w, y, rstd, N, R0_BLOCK=chunk, RN=N, I64=i64, RUNTIME_N=runtime_n, num_warps=warps)
    return y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--widths", default="8192,16384,32768")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    timer, rows = CudaTimer(), []
    copy = copy_ceiling_gbps(timer, WARM_MS, REP_MS)
    log(f"copy ceiling {copy:.0f} GB/s")
    for N in [int(v) for v in args.widths.split(",")]:
        M = 2**26 // N
        ss = [s[:2] for s in _sets(torch.bfloat16, M, N, True)]
        x0, w0 = ss[0]
        ref = (x0.float() * torch.rsqrt(x0.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w0.float())
        for chunk, warps in ((2048, 16), (4096, 16), (8192, 16), (4096, 32), (8192, 32)):
            if chunk > N:
                continue
            for i64, rt in ((False, False), (True, False), (False, True), (True, True)):
                name = f"ind{chunk // 1024}k{warps}{'-i64' if i64 else ''}{'-rtN' if rt else ''}"
                f = functools.partial(run, chunk=chunk, warps=warps, i64=i64, runtime_n=rt)
                err = ((f(x0, w0).float() - ref).norm() / ref.norm()).item()
                calls = [functools.partial(f, *s) for s in ss]
                ms, _ = timer.median_ms(calls, WARM_MS, REP_MS)
                gbps = 2 * M * N * 2 / (ms * 1e6)
                rows.append(dict(op="rms", N=N, variant=name, err=f"{err:.1e}", frac=f"{gbps / copy:.3f}"))
                log(f"rms N={N} {name:<18} {gbps / copy:.3f} err {err:.1e}")
                write_csv(os.path.join(args.out, "ind.csv"), rows)
        del ss
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
