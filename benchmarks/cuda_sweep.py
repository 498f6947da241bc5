"""Issue 24 (the CUDA point): the CUDA C++ backend against torch eager (and the Triton backend) at
every width of the bench's row suite, bf16/fp16/fp32, LayerNorm and RMSNorm, forward and backward,
M = 2^26 / N rows (the bench's sweep), in one run.

  PYTHONPATH=. python benchmarks/cuda_sweep.py --out DIR [--impls cuda,torch,triton,variants]
      [--dtypes bf16,fp16,fp32] [--widths 256,...] [--budget SECONDS]

Impls: cuda (normkit.backends.cuda as dispatched), triton (normkit.backends.triton as dispatched,
its routes to the cluster kernels included), torch (F.layer_norm / F.rms_norm; backward through
autograd.grad, dweight and dbias included as ours), and with `variants` the CUDA backend with its
configuration tables changed (configs as data): cuda-old (no regs impl: the block/cluster
dispatch before this change), cuda-regs (the regs impl where the cluster kernels take the width),
regs-cK (K columns per thread). Every CUDA variant's first call is checked against torch's output
(rel. error of y, or of dx and dweight) in the same run. Timing: normkit.bench.timing's spin timer
(host hidden) over a ring of input sets > 4x L2, median. Bytes: forward reads x and writes y,
backward reads x and dy and writes dx. Writes DIR/env.txt and DIR/sweep.csv (after every point),
prints a table of cuda / torch ratios last.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import functools
import platform
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from normkit import reference as ref
from normkit.backends import cuda as cb
from normkit.backends import triton as tb
from normkit.backends.cuda import cluster, configs as cc, kernels, nvrtc
from normkit.bench.timing import CudaTimer, copy_ceiling_gbps

from speed_sweep import _torch_bwd  # noqa: E402  (beside this script: torch's timed backward, written once)

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WIDTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
# the widths the change is about first, so a run cut short by its budget has them
ORDER = [2048, 4096, 8192, 16384, 32768, 1024, 256, 512, 262144, 65536, 131072]
WARM_MS, REP_MS = 3, 15
VARIANTS: set = set()  # "regs-variants": also the other regs shapes (cuda-regs, regs-cK)
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def log(*a):
    print(*a, flush=True)


def env_text(argv) -> str:
    p = torch.cuda.get_device_properties(0)
    from importlib.metadata import version
    return "\n".join([f"date {datetime.datetime.now().isoformat(timespec='seconds')}",
                      f"gpu {p.name} sms {p.multi_processor_count} l2 {p.L2_cache_size / 2**20:.0f} MiB",
                      f"torch {torch.__version__} triton {__import__('triton').__version__} "
                      f"python {platform.python_version()}",
                      f"nvrtc {'.'.join(map(str, nvrtc.version()))} cuda-bindings {version('cuda-bindings')}",
                      f"command {' '.join(argv)}"])


class Tables:
    """Context: the CUDA backend's configuration tables changed as a variant says, restored after."""

    NAMES = ("REG_ROW_MAX", "REG_COLS", "REG_SHAPES", "CLUSTER_WIDTHS", "CLUSTER_SHAPES")

    def __init__(self, **changes):
        self.changes = changes

    def __enter__(self):
        self.saved = {n: dict(getattr(cc, n)) for n in self.NAMES}
        for name, value in self.changes.items():
            getattr(cc, name).clear()
            getattr(cc, name).update(value)
        _clear()
        return self

    def __exit__(self, *exc):
        for name, saved in self.saved.items():
            getattr(cc, name).clear()
            getattr(cc, name).update(saved)
        _clear()


def _clear():
    cb._row_setup.cache_clear()
    cluster.prepare.cache_clear()


# the dispatch before issue 24 (no regs impl; these cluster widths and shapes): "cuda-old"
OLD_CLUSTER_WIDTHS = {("fwd", 2): (16384, 262144), ("fwd", 4): (16384, 131072), ("bwd", 2): (16384, 262144),
                      ("bwd", 4): (8192, 131072)}


def old_tables():
    return Tables(REG_ROW_MAX={}, CLUSTER_WIDTHS=OLD_CLUSTER_WIDTHS,
                  CLUSTER_SHAPES={k: v for k, v in cc.CLUSTER_SHAPES.items() if k != ("bwd", 4, 262144)})


def _route(direction, eb, n, reg_max, widths):
    lo, hi = widths.get((direction, eb), (1, 0))
    if lo <= n <= hi:
        return "cluster"
    return "regs" if cc.WARP_MAX_COLS < n <= reg_max else "other"


def variants(direction, eb, n):
    """(name, Tables) of the CUDA backend's variants worth timing at this point."""
    key = (direction, eb)
    out = []
    reg_max = cc.REG_ROW_MAX.get(key, 0)
    lo, hi = cc.CLUSTER_WIDTHS.get(key, (1, 0))
    on_clusters = lo <= n <= hi
    if _route(direction, eb, n, reg_max, cc.CLUSTER_WIDTHS) != _route(direction, eb, n, 0, OLD_CLUSTER_WIDTHS) \
            or (direction, eb, n) == ("bwd", 4, 262144):
        out.append(("cuda-old", old_tables()))
    if cc.WARP_MAX_COLS < n <= reg_max and "regs-variants" in VARIANTS:
        if on_clusters:
            out.append(("cuda-regs", Tables(CLUSTER_WIDTHS={k: v for k, v in cc.CLUSTER_WIDTHS.items() if k != key})))
        if n <= 16384:
            cols = cc.REG_COLS[key]
            no_clusters = {k: v for k, v in cc.CLUSTER_WIDTHS.items() if k != key}
            for k in (cols // 2, cols * 2):
                out.append((f"regs-c{k}", Tables(REG_COLS={**cc.REG_COLS, key: k}, CLUSTER_WIDTHS=no_clusters)))
    return out


def prebuild(dtypes, widths):
    """Compile the NVRTC kernels the run loads, in parallel (every core)."""
    specs = []
    for dname in dtypes:
        dtype = DT[dname]
        eb = dtype.itemsize
        for n in widths:
            for rms in (False, True):
                specs += kernels.row_specs(n, dtype, dtype, None, rms)
                for direction in ("fwd", "bwd"):
                    for _, tables in [("cuda", Tables())] + variants(direction, eb, n):
                        with tables:
                            specs += kernels.row_specs(n, dtype, dtype, None, rms)
                            plan = cc.plan_cluster(direction, n, eb)
                            if plan is not None:
                                specs.append(kernels.row_cluster(direction, dtype, dtype, None, rms, plan,
                                                                 direction == "bwd"))
        specs.append(kernels.col_sum(dtype, dtype))
        specs.append(kernels.col_sum(dtype, None))
    t0 = time.time()
    cb.prebuild(list(dict.fromkeys(specs)))
    log(f"prebuilt {len(set(specs))} NVRTC kernels in {time.time() - t0:.0f} s")


def impls(direction, n, rms, dtype, wanted):
    """(name, Tables or None, call) per implementation timed at this point."""
    eb = dtype.itemsize
    out = []
    if direction == "fwd":
        def cuda(x, w, b, dy, mean, rstd):
            return cb.row_norm_fwd(x, w, b, 1e-5, rms)[0]

        def triton(x, w, b, dy, mean, rstd):
            return tb.row_norm_fwd(x, w, b, 1e-5, rms)[0]

        def torch_(x, w, b, dy, mean, rstd):
            return F.rms_norm(x, (n,), w, 1e-5) if rms else F.layer_norm(x, (n,), w, b, 1e-5)
    else:
        def cuda(x, w, b, dy, mean, rstd):
            return cb.row_norm_bwd(dy, x, w, mean, rstd, rms, dtype, None if rms else dtype)

        def triton(x, w, b, dy, mean, rstd):
            return tb.row_norm_bwd(dy, x, w, mean, rstd, rms, dtype, None if rms else dtype)
        torch_ = _torch_bwd(n, rms)
    if "cuda" in wanted:
        out.append(("cuda", Tables(), cuda))
    if "variants" in wanted:
        out += [(name, tables, cuda) for name, tables in variants(direction, eb, n)]
    if "triton" in wanted:
        out.append(("triton", None, triton))
    if "torch" in wanted:
        out.append(("torch", None, torch_))
    return out


def rel_err(out, expected, rows=512) -> float:
    """normkit.reference.rel_err over the first rows (it works on the CPU: the whole tensor took ~1 s)"""
    return ref.rel_err(out[:rows], expected[:rows])


def run(args):
    timer = CudaTimer()
    copy = copy_ceiling_gbps(timer, 10, 50)
    log(f"copy ceiling {copy:.0f} GB/s")
    ring_bytes = 4 * torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    t_start = time.time()
    left = 0
    points = [(n, d) for n in [w for w in ORDER if w in args.widths] + [w for w in args.widths if w not in ORDER]
              for d in args.dtypes]
    for n, dname in points:
        if time.time() - t_start > args.budget:
            left += 1
            continue
        dtype = DT[dname]
        M = max(1, 2**26 // n)
        for op in ("ln", "rms"):
            rms = op == "rms"

            def make():
                x = torch.randn(M, n, device="cuda", dtype=dtype)
                w = (torch.randn(n, device="cuda") * 0.5 + 1).to(dtype)
                b = None if rms else (torch.randn(n, device="cuda") * 0.5).to(dtype)
                dy = torch.randn(M, n, device="cuda", dtype=dtype)
                xf = x.float()
                rstd = torch.rsqrt((xf.square().mean(-1) if rms else xf.var(-1, unbiased=False)) + 1e-5)
                mean = None if rms else xf.mean(-1)
                return x, w, b, dy, mean, rstd
            sets = [make() for _ in range(max(2, -(-ring_bytes // (3 * M * n * dtype.itemsize))))]
            for direction in ("fwd", "bwd"):
                nbytes = (2 if direction == "fwd" else 3) * M * n * dtype.itemsize
                expected = None
                for name, tables, call in impls(direction, n, rms, dtype, args.impls):
                    row = dict(op=op, dtype=dname, M=M, N=n, dir=direction, impl=name)
                    try:
                        if tables is not None:
                            tables.__enter__()
                        try:
                            first = call(*sets[0])
                            torch.cuda.synchronize()
                            if name == "cuda" or name.startswith(("cuda-", "regs-")):
                                if expected is None:
                                    expected = impls(direction, n, rms, dtype, ("torch",))[0][2](*sets[0])
                                if direction == "fwd":
                                    err, tol = rel_err(first, expected), TOL[dtype]
                                else:
                                    err = max(rel_err(first[0], expected[0]), rel_err(first[1], expected[1]))
                                    tol = 2 * TOL[dtype]
                                row.update(err=f"{err:.1e}", ok=err <= tol)
                                row["path"] = _plan_name(direction, n, rms, dtype, sets[0])
                            calls = [functools.partial(call, *s) for s in sets]
                            ms, _ = timer.median_ms(calls, WARM_MS, REP_MS)
                        finally:
                            if tables is not None:
                                tables.__exit__()
                        gbps = nbytes / (ms * 1e6)
                        row.update(ms=f"{ms:.4f}", gbps=f"{gbps:.0f}", frac=f"{gbps / copy:.3f}")
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        traceback.print_exc()
                    rows.append(row)
                    log(f"{op:3} {dname} N={n:<6} {direction} {name:<10} {row.get('path', ''):<14} "
                        f"{row.get('frac', row.get('error'))} {row.get('err', '')}")
            del sets
            torch.cuda.empty_cache()
        write_csv(args.out, rows, copy)
    write_csv(args.out, rows, copy)
    if left:
        log(f"budget reached: {left} (width, dtype) points not run")
    summary(rows)


def _plan_name(direction, n, rms, dtype, s):
    """Which path the CUDA backend takes here: cluster, or the row plan's name."""
    x, w, b, dy, mean, rstd = s
    if cb._on_clusters(direction, x, (dy,) if direction == "bwd" else (), w, None, None, rms,
                       direction == "bwd") is not None:
        return "cluster"
    pack = cc.pick_pack(n, x.element_size(), cb._aligned((x, x.stride(0)), (w, None)))
    index = cb._index(x)
    plan = cb._row_setup(direction, n, pack, x.dtype, w.dtype, None, rms, direction == "bwd", index)[0]
    return plan.name + (f"/{plan.width}x{plan.cols_per_thread}" if plan.impl == "regs" else f"/{plan.block}")


def write_csv(out, rows, copy):
    import os
    os.makedirs(out, exist_ok=True)
    keys = ["op", "dtype", "M", "N", "dir", "impl", "path", "ms", "gbps", "frac", "err", "ok", "error"]
    with open(os.path.join(out, "sweep.csv"), "w", newline="") as f:
        f.write(f"# copy ceiling {copy:.0f} GB/s\n")
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def summary(rows):
    """cuda / torch (and triton / torch) time ratios as speedups: > 1 means faster than torch."""
    t = {}
    for r in rows:
        if "ms" in r:
            t[(r["op"], r["dtype"], r["N"], r["dir"], r["impl"])] = float(r["ms"])
    log("\nspeedup over torch eager (torch ms / impl ms); cuda [triton]; * = cuda below torch")
    for dname in ("bf16", "fp16", "fp32"):
        for op in ("ln", "rms"):
            for d in ("fwd", "bwd"):
                cells = []
                for n in WIDTHS:
                    tt = t.get((op, dname, n, d, "torch"))
                    tc = t.get((op, dname, n, d, "cuda"))
                    tr = t.get((op, dname, n, d, "triton"))
                    if tt is None or (tc is None and tr is None):
                        continue
                    cell = f"{n}:" + (f"{tt / tc:.2f}" + ("*" if tc > tt else "") if tc else "-") \
                        + (f"[{tt / tr:.2f}]" if tr else "")
                    cells.append(cell)
                if cells:
                    log(f"{dname} {op:3} {d}: " + " ".join(cells))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--impls", default="cuda,torch,triton")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--budget", type=float, default=1e9, help="start no new (width, dtype) after this many s")
    args = ap.parse_args(argv)
    args.impls = tuple(args.impls.split(","))
    VARIANTS.update(i for i in args.impls if i.endswith("-variants"))
    args.dtypes = args.dtypes.split(",")
    args.widths = [int(w) for w in args.widths.split(",")]
    import os
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "env.txt"), "w") as f:
        f.write(env_text(sys.argv) + "\n")
    log(env_text(sys.argv))
    if {"cuda", "variants"} & set(args.impls):
        prebuild(args.dtypes, args.widths)
    run(args)


if __name__ == "__main__":
    main()
