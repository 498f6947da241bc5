"""Issue 24 (session 24): is the wide forward's gap the parameters' traffic? At 64K-256K columns the cluster forward
(row_cluster.cu, one row per cluster, many clusters) reads each row's slice of weight (and bias) again from L2 for
every row: as many bytes as x itself (RMSNorm), twice as many (LayerNorm). Where the weight is held across rows (the
persistent programs at 1K-8K) the forward reaches 0.9+ of copy. This times the public forward at each width with
weight and bias, weight only and neither, in one process, interleaved, as `normkit bench` times (CudaTimer: a GPU
spin hides the host, input sets rotating over 4x L2, median), in fraction of a copy measured in the same run (x read
+ y written; the parameters not counted, as the bench counts). If the parameter-free forward is much faster, the
forward should reuse each parameter load over more than one row.

  PYTHONPATH=. python benchmarks/wide_params_probe.py [--widths 65536,131072,262144] [--reps 2]
  PYTHONPATH=. python benchmarks/wide_params_probe.py --ncu   (one call of each case at 128K, for ncu)
"""
import argparse
import functools

import torch

import normkit
from normkit.bench.timing import CudaTimer, copy_ceiling_gbps

ELEMS = 2**26
PARAMS = ("wb", "w", "none")


def call(op, x, w, b, n):
    if op == "ln":
        return normkit.layer_norm(x, (n,), w, b, 1e-5)
    return normkit.rms_norm(x, (n,), w, 1e-6)


def cases(op, n, dtype, ring):
    xs = [torch.randn(ELEMS // n, n, device="cuda", dtype=dtype) for _ in range(ring)]
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
    b = (0.1 * torch.randn(n, device="cuda")).to(dtype)
    out = {}
    for p in PARAMS if op == "ln" else ("w", "none"):
        out[p] = [functools.partial(call, op, x, w if p != "none" else None, b if p == "wb" else None, n) for x in xs]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="65536,131072,262144")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.ncu:
        for op in ("ln", "rms"):
            for p, calls in cases(op, 131072, dtype, 1).items():
                print(f"probe: {op} 128K {p}", flush=True)
                calls[0]()
                calls[0]()
                torch.cuda.synchronize()
        return
    timer = CudaTimer()
    copy = copy_ceiling_gbps(timer, 25, 100)
    print(f"copy {copy:.0f} GB/s", flush=True)
    nbytes = 2 * ELEMS * torch.finfo(dtype).bits // 8
    ring = max(2, -(-4 * 60 * 2**20 // nbytes))
    for n in map(int, args.widths.split(",")):
        for op in ("ln", "rms"):
            sets = cases(op, n, dtype, ring)
            for calls in sets.values():
                calls[0]()
            res = {p: [] for p in sets}
            for _ in range(args.reps):
                for p, calls in sets.items():
                    ms, _ = timer.median_ms(calls, 25, 100)
                    res[p].append(nbytes / (ms * 1e6) / copy)
            print(f"{op} {args.dtype} {n}: " + "; ".join(f"{p} " + " / ".join(f"{v:.3f}" for v in vs)
                                                       for p, vs in res.items()), flush=True)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
