"""Issue 16 device sweep: the Hopper cluster kernels (normkit/backends/cuda/row_cluster.cu) against
the current paths, checked against the float64 oracle and timed in one run.

  PYTHONPATH=. python benchmarks/speed_sweep.py --out DIR [--parts check,rows,small,gn] [--dtypes bf16,fp32]

Parts: check (oracle + determinism of every new path, awkward shapes), rows (LN/RMS fwd/bwd at
M = 2^26 / N: the Triton kernels (CUDA routes off), cluster kernel shape variants, the CUDA
backend's OneFlow-style kernels, torch eager), gn (GroupNorm NCHW/channels_last: Triton, torch
eager). Runs S4-1/S4-2 also timed a GroupNorm NCHW forward on the cluster kernel (a group as a
row; removed after measuring slower than the Triton looped path: commit 5d3a120 has it). Kernels are timed behind a GPU spin (normkit.bench.timing)
over a ring of inputs > 4x L2, backend entry points called directly; the copy ceiling is measured
in the same run. Writes DIR/{env.txt,check.csv,rows.csv,gn.csv} and prints a short table last.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import functools
import os
import platform
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from normkit import reference as ref
from normkit.backends import cuda as cb
from normkit.backends import triton as tb
from normkit.backends.cuda import cluster, configs as cc, nvrtc
from normkit.backends.triton import configs as tc
from normkit.bench.timing import CudaTimer, copy_ceiling_gbps

import gn_sweep  # noqa: E402  (beside this script: GroupNorm's timed calls, written once)

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WARM_MS, REP_MS = 10, 40
RING_BYTES = 4 * 60 * 2**20
# cluster kernel shapes (threads, items, stages) tried per (direction, element bytes); the first is the default
SHAPES = {
    ("fwd", 2): [(128, 8, 3), (128, 8, 4), (128, 4, 4), (256, 8, 3), (512, 4, 4)],
    ("fwd", 4): [(128, 8, 3), (128, 16, 3), (128, 8, 4), (128, 4, 4)],
    ("bwd", 2): [(128, 4, 3, True), (128, 2, 4), (128, 2, 4, True), (256, 4, 3, True), (512, 2, 2)],
    ("bwd", 4): [(128, 8, 3, True), (128, 4, 4, True), (128, 4, 3), (512, 2, 3)],
}
NEVER: tuple = ()


def log(*a):
    print(*a, flush=True)


def env_text() -> str:
    p = torch.cuda.get_device_properties(0)
    lines = [f"date {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"gpu {p.name} sms {p.multi_processor_count} l2 {p.L2_cache_size / 2**20:.0f} MiB cc {p.major}.{p.minor}",
             f"torch {torch.__version__} triton {__import__('triton').__version__} python {platform.python_version()}",
             f"nvrtc {'.'.join(map(str, nvrtc.version()))} cuda-bindings {_version('cuda-bindings')}",
             f"command {' '.join(sys.argv)}"]
    return "\n".join(lines)


def _version(dist):
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001
        return "?"


class Routing:
    """Context: the Triton backend's routing and the cluster kernel shape, as a variant says."""

    def __init__(self, cuda_rows=None, shapes=None, cluster_widths=None, triton_rows=None):
        self.cuda_rows, self.shapes = cuda_rows, shapes
        self.cluster_widths, self.triton_rows = cluster_widths, triton_rows
        self.tables = (tc.CUDA_OVERRIDES, cc.CLUSTER_KERNELS, cc.CLUSTER_SHAPES, cc.CLUSTER_WIDTHS, tc.OVERRIDES,
                       cc.CLUSTER_FWD_HOLD)

    def __enter__(self):
        self.saved = [dict(t) for t in self.tables]
        if self.cuda_rows is not None:
            tc.CUDA_OVERRIDES.update(self.cuda_rows)
        if self.shapes is not None:  # this shape at every width
            cc.CLUSTER_KERNELS.update(self.shapes)
            cc.CLUSTER_SHAPES.clear()
            cc.CLUSTER_FWD_HOLD.clear()  # (its shapes would come first)
        if self.cluster_widths is not None:
            cc.CLUSTER_WIDTHS.clear()
            cc.CLUSTER_WIDTHS.update(self.cluster_widths)
        if self.triton_rows is not None:
            tc.OVERRIDES.update(self.triton_rows)
        _clear()
        return self

    def __exit__(self, *exc):
        for target, saved in zip(self.tables, self.saved):
            target.clear()
            target.update(saved)
        _clear()


def _clear():
    tb.clear_caches()
    cluster.prepare.cache_clear()


def all_routes(direction, eb, n):
    return {(direction, eb): (triton_key(n),)}


def triton_key(n):
    return max(32, 1 << (n - 1).bit_length())


# ----------------------------------------------------------------------------- correctness

def rel(out, expected):
    return ref.rel_err(out.double().cpu(), expected.double().cpu())


def check_rows(rows_out):
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}
    cases = [(3, 16384), (37, 16392), (5, 24576), (64, 65536), (2, 131072), (3, 262144), (301, 2048), (7, 4104),
             (1, 8192), (133, 32768)]
    for dname in ("bf16", "fp16", "fp32"):
        dtype = DT[dname]
        for op in ("ln", "rms"):
            rms = op == "rms"
            for M, N in cases:
                for act in ((None, "silu") if (M, N) == (5, 24576) else (None,)):
                    for wd in ((dtype, torch.float32) if dtype != torch.float32 else (dtype,)):
                        _check_row_case(rows_out, dname, dtype, op, rms, M, N, act, wd, tol[dtype], offset=0.0)
        _check_row_case(rows_out, dname, dtype, "ln", False, 9, 16384, None, torch.float32,
                        tol[dtype] if dtype != torch.float32 else 1e-4, offset=1e4)


def prebuild(dtypes, widths):
    """Compile the cluster kernels the run will load, in parallel (NVRTC on every core)."""
    from normkit.backends.cuda import kernels
    specs = []
    for dname in dtypes:
        dtype = DT[dname]
        eb = torch.empty((), dtype=dtype).element_size()
        for direction in ("fwd", "bwd"):
            for shape in SHAPES[(direction, eb)]:
                for n in widths:
                    plan = cc.plan_cluster(direction, n, eb, shape)
                    if plan is None:
                        continue
                    for rms in (False, True):
                        specs.append(kernels.row_cluster(direction, dtype, dtype, None, rms, plan, direction == "bwd"))
    t0 = time.time()
    cb.prebuild(specs)
    log(f"prebuilt {len(set(specs))} cluster kernels in {time.time() - t0:.0f} s")


def _check_row_case(out, dname, dtype, op, rms, M, N, act, wd, tol, offset):
    label = dict(part="rows", dtype=dname, op=op, M=M, N=N, act=act or "-", wdtype=str(wd).split(".")[-1],
                 offset=offset)
    x = (torch.randn(M, N, device="cuda") * 2 + 0.5 + offset).to(dtype)
    w = (torch.randn(N, device="cuda") * 0.5 + 1).to(wd)
    b = None if rms else (torch.randn(N, device="cuda") * 0.5).to(wd)
    dy = torch.randn(M, N, device="cuda").to(dtype)
    eps = 1e-5
    if rms:
        y_ref = ref.rms_norm(x, (N,), w, eps, act)[0]
        dx_ref, dw_ref = ref.rms_norm_backward(dy, x, (N,), w, eps, act)[:2]
        db_ref = None
    else:
        y_ref = ref.layer_norm(x, (N,), w, b, eps, act)[0]
        dx_ref, dw_ref, db_ref = ref.layer_norm_backward(dy, x, (N,), w, b, eps, act)
    for route in ("cuda", "triton-routed"):
        try:
            with Routing(cuda_rows={("fwd", x.element_size()): (triton_key(N),),
                                    ("bwd", x.element_size()): (triton_key(N),)}):
                if route == "cuda":
                    y, mean, rstd = cb.row_norm_fwd(x, w, b, eps, rms, act)
                    res = [cb.row_norm_bwd(dy, x, w, mean, rstd, rms, torch.float32, None if rms else torch.float32,
                                           bias=b, activation=act) for _ in range(2)]
                    took = cb._on_clusters("fwd", x, (), w, b, act, rms) is not None
                    took_b = cb._on_clusters("bwd", x, (dy,), w, b if act else None, act, rms, True) is not None
                else:
                    y, mean, rstd = tb.row_norm_fwd(x, w, b, eps, rms, act)
                    res = [tb.row_norm_bwd(dy, x, w, mean, rstd, rms, torch.float32, None if rms else torch.float32,
                                           bias=b, activation=act) for _ in range(2)]
                    took = tb._plan("fwd", N, x.element_size(), x.device, (rms, True, b is not None, act, True))[0].cuda
                    took_b = took
            torch.cuda.synchronize()
            (dx, dw, db), (dx2, dw2, db2) = res
            e_y, e_dx, e_dw = rel(y, y_ref), rel(dx, dx_ref), rel(dw, dw_ref)
            e_db = rel(db, db_ref) if db_ref is not None else 0.0
            # dx and dweight use the stored fp32 mean (as torch's do), rounded at the offset's scale:
            # half an fp32 ulp of 1e4 is 5e-4 of x's unit std, so ~2e-4 of dweight at offset 1e4
            dx_tol = 2 * tol if offset == 0 else 2e-3
            dw_tol = 1e-4 if offset == 0 else 1e-3
            ok = (e_y <= tol and e_dx <= dx_tol and e_dw <= dw_tol and e_db <= 1e-4
                  and bool(torch.isfinite(y).all()) and torch.equal(dw, dw2) and torch.equal(dx, dx2)
                  and (db is None or torch.equal(db, db2)))
            row = dict(label, route=route, cluster_fwd=took, cluster_bwd=took_b, err_y=f"{e_y:.2e}",
                       err_dx=f"{e_dx:.2e}", err_dw=f"{e_dw:.2e}", err_db=f"{e_db:.2e}", ok=ok)
        except Exception as e:  # noqa: BLE001
            row = dict(label, route=route, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        CHECKS.append(row)
        if not row["ok"]:
            log("CHECK FAIL", row)


def check_gn():
    tol = {torch.bfloat16: 1e-2, torch.float32: 2e-5}
    for dname in ("bf16", "fp32"):
        dtype = DT[dname]
        for (B, C, H, W), G in [((2, 64, 32, 32), 32), ((3, 40, 16, 64), 4), ((1, 320, 64, 64), 32),
                                ((2, 128, 128, 128), 32)]:
            for act in (None, "silu"):
                x = (torch.randn(B, C, H, W, device="cuda") * 2 + 1).to(dtype)
                w, b = torch.randn(C, device="cuda").to(dtype), torch.randn(C, device="cuda").to(dtype)
                y_ref = ref.group_norm(x, G, w, b, 1e-5, act)[0]
                label = dict(part="gn", dtype=dname, op="gn", M=B, N=C * H * W, act=act or "-", shape=f"{B}x{C}x{H}x{W}/g{G}")
                try:
                    x3 = x.view(B, C, H * W)
                    y, mean, rstd = tb.group_norm_fwd(x3, G, w, b, 1e-5, act)
                    torch.cuda.synchronize()
                    e = rel(y.view_as(x), y_ref)
                    m_ref = x.double().view(B, G, -1).mean(-1)
                    e_m = rel(mean, m_ref)
                    ok = e <= tol[dtype] and e_m <= 1e-5
                    row = dict(label, route="triton", err_y=f"{e:.2e}", err_mean=f"{e_m:.2e}", ok=ok)
                except Exception as ex:  # noqa: BLE001
                    row = dict(label, ok=False, error=f"{type(ex).__name__}: {str(ex)[:300]}")
                    traceback.print_exc()
                CHECKS.append(row)
                if not row["ok"]:
                    log("CHECK FAIL", row)


def check_oneflow():
    """The CUDA backend's OneFlow-style kernels after the vectorized store change."""
    for dname in ("bf16", "fp16", "fp32"):
        dtype = DT[dname]
        for N in (64, 1000, 4096, 8192, 32768):
            for op in ("ln", "rms"):
                rms = op == "rms"
                x = (torch.randn(33, N, device="cuda") * 2 + 0.5).to(dtype)
                w = torch.randn(N, device="cuda").to(dtype)
                b = None if rms else torch.randn(N, device="cuda").to(dtype)
                dy = torch.randn(33, N, device="cuda").to(dtype)
                try:
                    with Routing(cluster_widths={}):
                        y, mean, rstd = cb.row_norm_fwd(x, w, b, 1e-5, rms)
                        dx, dw, db = cb.row_norm_bwd(dy, x, w, mean, rstd, rms, dtype, None if rms else dtype)
                    if rms:
                        y_ref = ref.rms_norm(x, (N,), w, 1e-5)[0]
                        dx_ref = ref.rms_norm_backward(dy, x, (N,), w, 1e-5)[0]
                    else:
                        y_ref = ref.layer_norm(x, (N,), w, b, 1e-5)[0]
                        dx_ref = ref.layer_norm_backward(dy, x, (N,), w, b, 1e-5)[0]
                    e_y, e_dx = rel(y, y_ref), rel(dx, dx_ref)
                    t = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}[dtype]
                    row = dict(part="oneflow", dtype=dname, op=op, M=33, N=N, err_y=f"{e_y:.2e}", err_dx=f"{e_dx:.2e}",
                               ok=e_y <= t and e_dx <= 2 * t)
                except Exception as ex:  # noqa: BLE001
                    row = dict(part="oneflow", dtype=dname, op=op, M=33, N=N, ok=False, error=str(ex)[:300])
                CHECKS.append(row)
                if not row["ok"]:
                    log("CHECK FAIL", row)


CHECKS: list = []


# ----------------------------------------------------------------------------- timing

def timed(timer, calls):
    ms, _ = timer.median_ms(calls, WARM_MS, REP_MS)
    return ms


def measure(timer, copy, routing, sets, call, nbytes, label) -> dict:
    """One timed implementation: the label with ms, GB/s and fraction of copy (or the error)."""
    try:
        with routing:
            calls = [functools.partial(call, *s) for s in sets]
            calls[0]()
            torch.cuda.synchronize()
            ms = timed(timer, calls)
        gbps = nbytes / (ms * 1e6)
        return dict(label, ms=f"{ms:.4f}", gbps=f"{gbps:.0f}", frac=f"{gbps / copy:.3f}")
    except Exception as e:  # noqa: BLE001
        return dict(label, error=f"{type(e).__name__}: {str(e)[:200]}")


def ring(make, nbytes):
    return [make() for _ in range(max(2, -(-RING_BYTES // max(nbytes, 1))))]


def row_set(dtype, M, N, rms):
    """One input set of the row norms: x, w, b (None for RMSNorm), dy, and the forward's mean, rstd."""
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = torch.randn(N, device="cuda", dtype=dtype)
    b = None if rms else torch.randn(N, device="cuda", dtype=dtype)
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    _, mean, rstd = tb.row_norm_fwd(x, w, b, 1e-5, rms)
    return x, w, b, dy, mean, rstd


def time_rows(timer, copy, out, dtypes, widths, ops=("ln", "rms"), path=None):
    for dname in dtypes:
        dtype = DT[dname]
        eb = torch.empty((), dtype=dtype).element_size()
        for N in widths:
            M = max(1, 2**26 // N)
            for op in ops:
                rms = op == "rms"

                sets = ring(functools.partial(row_set, dtype, M, N, rms), 3 * M * N * eb)
                for direction in ("fwd", "bwd"):
                    passes = 2 if direction == "fwd" else 3
                    nbytes = passes * M * N * eb
                    for impl, routing, call in _row_impls(direction, eb, N, rms, dtype):
                        r = measure(timer, copy, routing, sets, call, nbytes,
                                    dict(op=op, dtype=dname, M=M, N=N, dir=direction, impl=impl))
                        out.append(r)
                        log(f"{op} {dname} N={N} {direction} {impl:<28} {r.get('gbps', r.get('error'))} {r.get('frac', '')}")
                del sets
                torch.cuda.empty_cache()
                if path:
                    write_csv(path, out)  # a run cut short keeps what it measured


def _row_impls(direction, eb, N, rms, dtype):
    key = triton_key(N)
    off = Routing(cuda_rows={(direction, eb): NEVER})
    if direction == "fwd":
        yield "triton", off, lambda x, w, b, dy, mean, rstd: tb.row_norm_fwd(x, w, b, 1e-5, rms)
        for shape in SHAPES[(direction, eb)]:
            if cc.plan_cluster(direction, N, eb, shape) is None:
                continue
            yield (f"cluster{shape}".replace(" ", ""), Routing(cuda_rows=all_routes(direction, eb, N),
                                                               shapes={(direction, eb): shape}),
                   lambda x, w, b, dy, mean, rstd: tb.row_norm_fwd(x, w, b, 1e-5, rms))
        yield ("oneflow", Routing(cluster_widths={}),
               lambda x, w, b, dy, mean, rstd: cb.row_norm_fwd(x, w, b, 1e-5, rms))
        if N in (16384, 32768):
            for warps in (16, 32):
                yield (f"triton-1prog-{warps}w", Routing(cuda_rows={(direction, eb): NEVER},
                                                         triton_rows={(direction, eb, key): (1, 1, warps, 0)}),
                       lambda x, w, b, dy, mean, rstd: tb.row_norm_fwd(x, w, b, 1e-5, rms))
        if rms:
            yield "torch", off, lambda x, w, b, dy, mean, rstd: F.rms_norm(x, (N,), w, 1e-5)
        else:
            yield "torch", off, lambda x, w, b, dy, mean, rstd: F.layer_norm(x, (N,), w, b, 1e-5)
    else:
        def nk(x, w, b, dy, mean, rstd):
            return tb.row_norm_bwd(dy, x, w, mean, rstd, rms, dtype, None if rms else dtype)
        yield "triton", off, nk
        for shape in SHAPES[(direction, eb)]:
            if cc.plan_cluster(direction, N, eb, shape) is None:
                continue
            yield (f"cluster{shape}".replace(" ", ""), Routing(cuda_rows=all_routes(direction, eb, N),
                                                               shapes={(direction, eb): shape}), nk)
        yield ("oneflow", Routing(cluster_widths={}),
               lambda x, w, b, dy, mean, rstd: cb.row_norm_bwd(dy, x, w, mean, rstd, rms, dtype,
                                                               None if rms else dtype))
        yield "torch", off, _torch_bwd(N, rms)


def _torch_bwd(N, rms):
    cache = {}

    def call(x, w, b, dy, mean, rstd):
        key = x.data_ptr()
        if key not in cache:
            xr = x.detach().requires_grad_(True)
            wr = w.detach().requires_grad_(True)
            br = None if b is None else b.detach().requires_grad_(True)
            y = F.rms_norm(xr, (N,), wr, 1e-5) if rms else F.layer_norm(xr, (N,), wr, br, 1e-5)
            cache[key] = (y, [t for t in (xr, wr, br) if t is not None])
        y, inputs = cache[key]
        return torch.autograd.grad(y, inputs, dy, retain_graph=True)
    return call


GN_SHAPES = [((8, 320, 64, 64), 32), ((4, 128, 128, 128), 32), ((16, 640, 32, 32), 32), ((32, 256, 56, 56), 32),
             ((8, 640, 32, 32), 32), ((8, 1280, 16, 16), 32), ((1, 320, 64, 64), 32), ((32, 320, 64, 64), 32)]


def time_gn(timer, copy, out, dtypes, path=None):
    for dname in dtypes:
        dtype = DT[dname]
        for shape, G in GN_SHAPES:
            B, C = shape[0], shape[1]
            numel = torch.Size(shape).numel()
            eb = torch.empty((), dtype=dtype).element_size()
            for cl in (False, True):
                fmt = torch.channels_last if cl else torch.contiguous_format

                def make():
                    x = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
                    w, b = torch.randn(C, device="cuda", dtype=dtype), torch.randn(C, device="cuda", dtype=dtype)
                    dy = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
                    x3 = x.view(B, C, -1) if not cl else x.permute(0, 2, 3, 1).reshape(B, -1, C).transpose(1, 2)
                    dy3 = dy.view(B, C, -1) if not cl else dy.permute(0, 2, 3, 1).reshape(B, -1, C).transpose(1, 2)
                    return x, x3, w, b, dy, dy3
                sets = ring(make, 3 * numel * eb)
                label = "x".join(map(str, shape)) + f"/g{G}" + ("/cl" if cl else "")
                for act in (None, "silu"):
                    nk_fwd, nk_bwd = gn_sweep.nk_impls(G, act, dtype)
                    torch_fwd, torch_bwd = gn_sweep.torch_impls(G, act, compiled=False)
                    impls = [("triton", Routing(), "fwd", nk_fwd), ("torch", Routing(), "fwd", torch_fwd),
                             ("triton", Routing(), "bwd", nk_bwd), ("torch", Routing(), "bwd", torch_bwd)]
                    for impl, routing, direction, call in impls:
                        passes = 2 if direction == "fwd" else 3
                        out.append(measure(timer, copy, routing, sets, call, passes * numel * eb,
                                           dict(op="gn" if act is None else f"gn+{act}", dtype=dname, shape=label,
                                                mib=f"{numel * eb / 2**20:.1f}", dir=direction, impl=impl)))
                        r = out[-1]
                        log(f"{r['op']} {dname} {label} {direction} {impl:<22} {r.get('gbps', r.get('error'))} "
                            f"{r.get('frac', '')}")
                del sets
                torch.cuda.empty_cache()
                if path:
                    write_csv(path, out)


# ----------------------------------------------------------------------------- main

def write_csv(path, rows):
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def summary_rows(rows, copy):
    """Per point: triton, best cluster variant, oneflow, torch (GB/s and fraction)."""
    points = {}
    for r in rows:
        if "gbps" not in r:
            continue
        k = (r.get("op"), r.get("dtype"), r.get("N", r.get("shape")), r.get("dir"))
        impl = r["impl"]
        fam = "cluster" if impl.startswith("cluster") else impl
        g = float(r["gbps"])
        cur = points.setdefault(k, {})
        if g > cur.get(fam, (0, ""))[0]:
            cur[fam] = (g, impl)
    lines = []
    for k, v in points.items():
        cells = " ".join(f"{fam}={g / copy:.2f}" + (f"[{impl[7:]}]" if fam == "cluster" else "")
                         for fam, (g, impl) in sorted(v.items()))
        lines.append(f"{k[0]:>7} {k[1]} {str(k[2]):>22} {k[3]}  {cells}")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="check,rows,gn")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--widths", default="4096,8192,16384,32768,65536,131072,262144")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = args.parts.split(",")
    text = env_text()
    log(text)
    t0 = time.time()
    timer = CudaTimer()
    copy = copy_ceiling_gbps(timer, WARM_MS, REP_MS)
    log(f"copy ceiling {copy:.0f} GB/s")
    with open(os.path.join(args.out, "env.txt"), "w") as f:
        f.write(text + f"\ncopy {copy:.1f} GB/s\n")
    widths = [int(w) for w in args.widths.split(",")]
    prebuild(args.dtypes.split(","), widths)
    if "check" in parts:
        check_rows(None)
        check_gn()
        check_oneflow()
        write_csv(os.path.join(args.out, "check.csv"), CHECKS)
        n_ok = sum(1 for r in CHECKS if r.get("ok"))
        log(f"checks: {n_ok}/{len(CHECKS)} ok ({time.time() - t0:.0f} s)")
    rows: list = []
    if "rows" in parts:
        time_rows(timer, copy, rows, args.dtypes.split(","), widths, path=os.path.join(args.out, "rows.csv"))
    gn: list = []
    if "gn" in parts:
        time_gn(timer, copy, gn, args.dtypes.split(","), path=os.path.join(args.out, "gn.csv"))
    log(f"total {time.time() - t0:.0f} s; copy {copy:.0f} GB/s")
    fails = [r for r in CHECKS if not r.get("ok")]
    log(f"CHECKS {len(CHECKS) - len(fails)}/{len(CHECKS)} ok" + "".join(f"\n  FAIL {r}" for r in fails[:8]))
    for line in summary_rows(rows, copy) + summary_rows(gn, copy):
        log(line)


if __name__ == "__main__":
    main()
