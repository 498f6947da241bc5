"""Issue 24, wide-row forward (session 9, helper widefwd9): the PUSH cluster forward
(row_cluster.cu: quack's exchange, many clusters of about a row each) against normkit's current
paths, the barrier cluster kernel, torch and torch.compile, checked against the float64 oracle and
timed in one run; plus the exchange alone (clusters of 2 KB slices: push vs barrier).

  PYTHONPATH=.:benchmarks python benchmarks/widefwd_sweep.py --out DIR [--budget 240]

Writes DIR/{env.txt,check.csv,rows.csv,exchange.csv}; steps run in order of priority and none
starts past the budget (a cut run keeps what it measured). Helpers are speed_sweep.py's.

Session 10 (helper rows10): the push kernel's MERGE (one value per CTA in the exchange) and ONE_PASS
(LayerNorm's moments from one read of the slice) flags. `--variants normkit,push+m,push+1,push+m1`
times the shipped shape of each width with those flags (or `256x8+m1`: that shape, reload, push);
`--checks flags` checks only the flagged shapes (`--checks variants`: the TxI[xS] variants' shapes);
`--parts check,time` skips the rest. Session 16: `TxIxS@W` names a shape with S stages on W waves of resident
clusters (each walks rows: its next rows load while it works on this one); `TxIxSr`: registers, no reload.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import time
import traceback

import torch
import torch.nn.functional as F

from normkit import reference as ref
from normkit.backends import cuda as cb
from normkit.backends import triton as tb
from normkit.backends.cuda import cluster, configs as cc, kernels
from normkit.bench.timing import CudaTimer, copy_ceiling_gbps

from speed_sweep import (DT, NEVER, WARM_MS, REP_MS, Routing, all_routes, env_text, log, measure, rel, ring,
                         row_set, triton_key, write_csv)

# push shapes (threads, items, stages, reload, push): the cluster size follows (cols / slice)
PUSH = {2: [(256, 8, 1, True, True), (256, 8, 1, False, True), (128, 8, 1, True, True), (512, 8, 1, True, True),
            (256, 4, 1, True, True)],
        4: [(256, 8, 1, True, True), (256, 8, 1, False, True), (128, 8, 1, True, True), (256, 4, 1, True, True)]}
WALK = (256, 8, 2, True, True)  # clusters walking rows: 2 waves of resident clusters, 2 stages
FLAGS = {"": (), "m": (True,), "1": (False, True), "m1": (True, True)}  # (merge, one_pass) suffixes
# the flagged shapes checked (the registers path, 16 CTAs of 8 warps, 8 of 16, walking rows)
FLAGGED = [(256, 8, 1, True, True) + f for f in FLAGS.values() if f] + \
    [(256, 8, 1, False, True, True, True), (512, 8, 1, True, True, True, True), (128, 8, 1, True, True, True, True),
     WALK + (True, True)]
CHECK_CASES = [(37, 16392, 0.0), (5, 24576, 0.0), (1, 65536, 0.0), (700, 65536, 0.0), (3, 262144, 0.0),
               (9, 32768, 1e4)]
WIDTHS = [65536, 131072, 262144, 32768]
START = time.time()


def left(budget):
    return budget - (time.time() - START)


@contextlib.contextmanager
def _swapped(module, attr: str, value):
    """module.attr = value for the block, the prepared cluster plans (cached by call kind) forgotten around it."""
    saved = getattr(module, attr)
    setattr(module, attr, value)
    cluster.prepare.cache_clear()
    try:
        yield
    finally:
        setattr(module, attr, saved)
        cluster.prepare.cache_clear()


def push_waves(waves):
    return _swapped(cc, "CLUSTER_PUSH_WAVES", waves if waves is not None else cc.CLUSTER_PUSH_WAVES)


def name(shape, waves=None):
    t, i, s, reload, push, *flags = shape
    suffix = next((k for k, f in FLAGS.items() if f and tuple(flags) == f), "")
    return f"push{t}x{i}x{s}" + ("r" if reload else "") + (f"+{suffix}" if suffix else "") + \
        (f"-w{waves}" if waves else "")


def variant_defines(variant) -> tuple:
    """A variant's %-suffix as compile-time defines for its kernels: NAME=VALUE pairs joined by dots
    (`normkit%NK_X=1.NK_Y=2`). Run S16-2 measured the forward's store loop this way with knobs since removed:
    its affine parameters fetched ahead of the stores (NK_FETCH_BYTES 64 / 128), the reload kernels' register
    cap raised (768 / 512 threads per SM) and an L1 prefetch of the parameters: none gained (notes/perf.md,
    session 16)."""
    _, _, spec = variant.partition("%")
    return tuple(part for part in spec.split(".") if part)


def compiled_with(defines: tuple):
    """The cluster kernels built with these defines (kernels.row_cluster's specs gain them)."""
    if not defines:
        return contextlib.nullcontext()
    spec = kernels.row_cluster
    return _swapped(kernels, "row_cluster", lambda *a, **k: dataclasses.replace(spec(*a, **k), defines=defines))


def variant_shape(variant, eb, N):
    """push+FLAGS: the width's shipped shape with FLAGS; TxI[xS]+FLAGS: that shape (reload, push, S stages: 1
    unless given)."""
    base, _, suffix = variant.partition("%")[0].partition("+")
    base = base.partition("@")[0]
    if base == "push":
        shape = cc.CLUSTER_SHAPES.get(("fwd", eb, triton_key(N))) or cc.CLUSTER_KERNELS[("fwd", eb)]
    else:  # a trailing r: the slice held in registers (no reload)
        t, i, *stages = map(int, base.rstrip("r").split("x"))
        shape = (t, i, stages[0] if stages else 1, not base.endswith("r"), True)
    return tuple(shape[:5]) + FLAGS[suffix]


def prebuild(dtypes, variants=(), only_variants=False, widths=WIDTHS):
    """Compiles (in parallel) the kernels the run will load: every shape timed or checked at the widths timed and
    checked (only_variants: the variants' alone)."""
    specs = []
    for dtype in dtypes:
        eb = dtype.itemsize
        more = [n for _, n, _ in CHECK_CASES] if only_variants else [1024 * c for c in (4, 8, 16)] + [16392, 24576]
        for n in dict.fromkeys(list(widths) + more):
            timed = [(None if v.partition("%")[0] == "normkit" else variant_shape(v, eb, n), variant_defines(v))
                     for v in variants]
            fixed = [] if only_variants else PUSH[eb] + FLAGGED + [WALK, (128, 1, 1, True, True), (128, 1, 1)]
            if only_variants:  # the checks run the committed 256K shape at every width
                timed += [(cc.CLUSTER_SHAPES.get(("fwd", eb, 262144), cc.CLUSTER_KERNELS[("fwd", eb)]), d) for v, (sh, d) in zip(variants, timed) if sh is None]
            for shape, defs in [(s, ()) for s in fixed] + timed + [(None, ())]:
                plan = cc.plan_cluster("fwd", n, eb, shape)
                if plan is not None:
                    for rms in (False, True):
                        for wdtype in (dtype, torch.float32):
                            spec = kernels.row_cluster("fwd", dtype, wdtype, None, rms, plan)
                            specs.append(dataclasses.replace(spec, defines=defs) if defs else spec)
    t0 = time.time()
    cb.prebuild(list(dict.fromkeys(specs)))
    log(f"prebuilt {len(set(specs))} kernels in {time.time() - t0:.0f} s")


def check(out, dtype, shape, waves, defines=()):
    eb = dtype.itemsize
    tol = {torch.bfloat16: 1e-2, torch.float32: 2e-5}[dtype]
    for op in ("ln", "rms"):
        rms = op == "rms"
        for m, n, offset in CHECK_CASES:
            label = dict(dtype=str(dtype)[6:], op=op, M=m, N=n, offset=offset,
                         impl=name(shape, waves) + "".join(f" {d}" for d in defines))
            try:
                with Routing(cluster_widths={("fwd", op, eb): (16384, 262144)}, shapes={("fwd", eb): shape}), \
                        push_waves(waves):
                    x = (torch.randn(m, n, device="cuda") * 2 + 0.5 + offset).to(dtype)
                    if m >= 3:
                        x[m // 2, n // 3] = float("nan")  # confined to its row
                    w, b = torch.randn(n, device="cuda"), None if rms else torch.randn(n, device="cuda")
                    p = cb._on_clusters("fwd", x, (), w, b, None, rms)
                    y, mean, rstd = cb.row_norm_fwd(x, w, b, 1e-5, rms)
                    y2 = cb.row_norm_fwd(x, w, b, 1e-5, rms)[0]
                    torch.cuda.synchronize()
                if rms:
                    y_ref, rstd_ref = ref.rms_norm(x, (n,), w, 1e-5)
                    e_m = 0.0
                else:
                    y_ref, mean_ref, rstd_ref = ref.layer_norm(x, (n,), w, b, 1e-5)
                    e_m = rel(mean, mean_ref)
                e_y, e_r = rel(y, y_ref), rel(rstd, rstd_ref)
                flags = (p.plan.merge, p.plan.one_pass) if p is not None else ()
                ok = (p is not None and p.plan.push and flags == (tuple(shape[5:]) + (False, False))[:2]
                      and e_y <= tol and e_m <= 1e-6 and e_r <= (1e-4 if offset else 2e-5)
                      and torch.equal(y.nan_to_num(), y2.nan_to_num()))
                row = dict(label, cluster=p.plan.cluster if p else 0, err_y=f"{e_y:.2e}", err_mean=f"{e_m:.2e}",
                           err_rstd=f"{e_r:.2e}", ok=ok)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row = dict(label, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            out.append(row)
            if not row["ok"]:
                log("CHECK FAIL", row)


def impls(eb, N, rms, compiled, variants=None):
    """(label, context, call) of every forward timed at one point (variants: those named only)."""
    def nk(x, w, b, dy, mean, rstd):
        return tb.row_norm_fwd(x, w, b, 1e-5, rms)
    routed = all_routes("fwd", eb, N)
    if variants:
        for v in variants:
            defs = compiled_with(variant_defines(v))
            if v.partition("%")[0] == "normkit":
                yield v, defs, nk
            else:  # TxI[xS][@W]+FLAGS: W waves of resident clusters (walking rows), else CLUSTER_PUSH_WAVES
                waves = v.partition("%")[0].partition("+")[0].partition("@")[2]
                yield v, _both(_both(Routing(cuda_rows=routed, shapes={("fwd", eb): variant_shape(v, eb, N)}),
                                     push_waves(int(waves) if waves else None)), defs), nk
        return
    yield "normkit", contextlib.nullcontext(), nk  # the shipped table
    yield "triton", Routing(cuda_rows={("fwd", eb): NEVER}), nk
    yield "barrier", Routing(cuda_rows=routed), nk  # the persistent cluster kernel, its measured shape
    yield "cuda-backend", contextlib.nullcontext(), lambda x, w, b, dy, mean, rstd: cb.row_norm_fwd(x, w, b, 1e-5, rms)
    for shape in PUSH[eb]:
        yield name(shape), Routing(cuda_rows=routed, shapes={("fwd", eb): shape}), nk
    yield name(WALK, 2), _both(Routing(cuda_rows=routed, shapes={("fwd", eb): WALK}), push_waves(2)), nk
    if rms:
        yield "torch", contextlib.nullcontext(), lambda x, w, b, dy, mean, rstd: F.rms_norm(x, (N,), w, 1e-5)
    else:
        yield "torch", contextlib.nullcontext(), lambda x, w, b, dy, mean, rstd: F.layer_norm(x, (N,), w, b, 1e-5)
    if compiled:
        torch._dynamo.reset()
        if rms:
            fn = torch.compile(lambda x, w: F.rms_norm(x, (N,), w, 1e-5), dynamic=False)
            yield "compile", contextlib.nullcontext(), lambda x, w, b, dy, mean, rstd: fn(x, w)
        else:
            fn = torch.compile(lambda x, w, b: F.layer_norm(x, (N,), w, b, 1e-5), dynamic=False)
            yield "compile", contextlib.nullcontext(), lambda x, w, b, dy, mean, rstd: fn(x, w, b)


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def time_rows(timer, copy, out, dtype, budget, path, compiled, widths=WIDTHS, ops=("rms", "ln"), variants=None,
              repeat=1):
    eb = dtype.itemsize
    for N in widths:
        M = 2**26 // N
        for op in ops:
            if left(budget) < 20:
                log(f"budget: skipped {dtype} N={N} {op}")
                continue
            rms = op == "rms"
            sets = ring(functools.partial(row_set, dtype, M, N, rms), 3 * M * N * eb)
            for rep, (impl, routing, call) in ((r, i) for r in range(repeat)
                                               for i in impls(eb, N, rms, compiled, variants)):
                if left(budget) < 8:
                    break
                r = measure(timer, copy, routing, sets, call, 2 * M * N * eb,
                            dict(op=op, dtype=str(dtype)[6:], M=M, N=N, dir="fwd", impl=impl, rep=rep))
                out.append(r)
                log(f"{op} {str(dtype)[6:]} N={N} {impl:<18} {r.get('gbps', r.get('error'))} {r.get('frac', '')}")
            del sets
            torch.cuda.empty_cache()
            write_csv(path, out)


def time_exchange(timer, out, budget, path):
    """The exchange alone: 2 KB slices (128 threads x 1 pack of bf16) so a row is mostly its
    exchange; us per row per resident cluster = time x resident clusters / rows."""
    for C in (4, 8, 16):
        N = 1024 * C
        M = 2**22 // N
        for rms in (True, False):
            sets = ring(functools.partial(row_set, torch.bfloat16, M, N, rms), 3 * M * N * 2)
            for label, shape in (("push", (128, 1, 1, True, True)), ("barrier", (128, 1, 1))):
                if left(budget) < 5:
                    return
                routing = Routing(cuda_rows=all_routes("fwd", 2, N), shapes={("fwd", 2): shape})
                r = measure(timer, 1.0, routing, sets, lambda x, w, b, dy, mean, rstd: tb.row_norm_fwd(x, w, b, 1e-5, rms),
                            2 * M * N * 2, dict(op="rms" if rms else "ln", cluster=C, M=M, N=N, impl=label))
                with routing:
                    p = cluster.prepare("fwd", N, torch.bfloat16, torch.bfloat16, None, rms, False, 0)
                resident = p.clusters // (cc.CLUSTER_PUSH_WAVES if p.plan.push else 1)
                if "ms" in r:
                    r["resident_clusters"] = resident
                    r["us_per_row_per_cluster"] = f"{float(r['ms']) * 1e3 * min(resident, M) / M:.2f}"
                out.append(r)
                log("exchange", r)
            del sets
    write_csv(path, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=240)
    ap.add_argument("--parts", default="check,time,exchange,compile")
    ap.add_argument("--checks", default="all",
                    help="all, flags (the flagged shapes only) or variants (the timed TxI[xS] variants' shapes only)")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--ops", default="rms,ln")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--time-dtypes", default="", help="the dtypes timed (default: --dtypes)")
    ap.add_argument("--variants", default="", help="timed variants (default: every path and push shape)")
    ap.add_argument("--repeat", type=int, default=1, help="time the variants this many times, interleaved")
    args = ap.parse_args()
    parts = args.parts.split(",")
    widths = [int(n) for n in args.widths.split(",")]
    ops = tuple(args.ops.split(","))
    dtypes = [DT[d] for d in args.dtypes.split(",")]
    time_dtypes = [DT[d] for d in (args.time_dtypes or args.dtypes).split(",")]
    variants = [v for v in args.variants.split(",") if v]
    os.makedirs(args.out, exist_ok=True)
    text = env_text()
    timer = CudaTimer()
    copy = copy_ceiling_gbps(timer, WARM_MS, REP_MS)
    log(text, f"\ncopy ceiling {copy:.0f} GB/s")
    with open(os.path.join(args.out, "env.txt"), "w") as f:
        f.write(text + f"\ncopy {copy:.1f} GB/s\n")
    prebuild(dtypes, variants, only_variants=args.checks == "variants", widths=WIDTHS if args.checks != "variants" else widths)
    checks: list = []
    for dtype in dtypes if "check" in parts else ():
        if args.checks == "variants":  # (shape, defines) of each variant (normkit: the committed 256K shape)
            shapes = list(dict.fromkeys(
                (variant_shape(v, dtype.itemsize, 0) if v.partition("%")[0] != "normkit" else
                 cc.CLUSTER_SHAPES.get(("fwd", dtype.itemsize, 262144), cc.CLUSTER_KERNELS[("fwd", dtype.itemsize)]), variant_defines(v))
                for v in variants if not v.startswith("push")))
        else:
            shapes = [(s, ()) for s in (PUSH[dtype.itemsize] if args.checks == "all" else []) + FLAGGED]
        for shape, defs in shapes:
            with compiled_with(defs):  # walking rows (stages): the barriers' phases
                check(checks, dtype, shape, 1 if shape[2] > 1 else None, defs)
        if args.checks == "all":
            check(checks, dtype, WALK, 1)
    write_csv(os.path.join(args.out, "check.csv"), checks)
    fails = [r for r in checks if not r.get("ok")]
    log(f"CHECKS {len(checks) - len(fails)}/{len(checks)} ok ({time.time() - START:.0f} s)")
    rows: list = []
    path = os.path.join(args.out, "rows.csv")
    timed = dict(widths=widths, ops=ops, variants=variants, repeat=args.repeat)
    later = {"exchange", "compile"} & set(parts) or torch.float32 in time_dtypes  # time left for them
    if "time" in parts and torch.bfloat16 in time_dtypes:
        time_rows(timer, copy, rows, torch.bfloat16, args.budget - (60 if later else 0), path, compiled=False,
                  **timed)
    exch: list = []
    if "exchange" in parts:
        time_exchange(timer, exch, args.budget - 45, os.path.join(args.out, "exchange.csv"))
    if "time" in parts and torch.float32 in time_dtypes:
        time_rows(timer, copy, rows, torch.float32, args.budget - 40, path, compiled=False, **timed)
    # torch.compile last (a compile per point): bf16
    for N in (WIDTHS[:3] if "compile" in parts else ()):
        for op in ("rms", "ln"):
            if left(args.budget) < 12:
                break
            rms = op == "rms"
            sets = ring(functools.partial(row_set, torch.bfloat16, 2**26 // N, N, rms), 3 * 2**26 * 2)
            *_, (impl, routing, call) = impls(2, N, rms, True)
            r = measure(timer, copy, routing, sets, call, 2 * 2**26 * 2,
                        dict(op=op, dtype="bfloat16", M=2**26 // N, N=N, dir="fwd", impl=impl))
            rows.append(r)
            log(f"{op} bf16 N={N} compile {r.get('gbps', r.get('error'))} {r.get('frac', '')}")
            del sets
    write_csv(path, rows)
    log(f"total {time.time() - START:.0f} s; copy {copy:.0f} GB/s; checks {len(checks) - len(fails)}/{len(checks)}")
    for r in fails[:10]:
        log("  FAIL", r)


if __name__ == "__main__":
    main()
