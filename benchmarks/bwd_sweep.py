"""Issue 24 device sweep: the row-norm backward at N = 1K-8K (Triton tile path), variants checked
against the float64 oracle and timed in one run, with a per-kernel breakdown.

  PYTHONPATH=. python benchmarks/bwd_sweep.py --out DIR [--parts check,time,profile] [--dtypes bf16]
  PYTHONPATH=. python benchmarks/bwd_sweep.py --ncu   (one call per (op, width, variant) in --ncu-cases, for ncu)

A variant is a set of configuration values (configs.OVERRIDES rows, the cluster routes, the column
reduction's block), applied for its calls and restored after; the CUDA cluster route is
off (these widths are Triton's). Timed as `normkit bench` does (normkit.bench.timing: a GPU spin
hides the host, input sets rotate over more than 4x L2, median), the backend's row_norm_bwd called
directly, M = 2^26 / N; the copy ceiling is measured in the same run. Writes DIR/{env.txt,
check.csv, time.csv, profile.txt} and prints a short table last.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import os
import sys
import traceback

import torch

from normkit import reference as ref
from normkit.backends import triton as tb
from normkit.backends.cuda import configs as cc
from normkit.backends.triton import configs as tc
from normkit.bench.timing import CudaTimer, copy_ceiling_gbps

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WARM_MS, REP_MS = 10, 40
WIDTHS = (1024, 2048, 4096, 8192)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the check part under TRITON_INTERPRET=1
_OLD_COL_SUM = (32, 128, 4)  # the fixed block before this change
_OLD_CUDA = {2: (16384, 32768, 65536, 131072, 262144)}  # both ops' cluster routes before this change
# split-row candidates (rows per tile, columns per program, warps, programs per SM)
WIDE_ROWS = ((2, 2048, 8, 2), (2, 4096, 16, 1), (4, 2048, 16, 1), (2, 1024, 4, 4))
WIDE_ROWS_CAPPED = ((1, 4096, 8, 2), (2, 2048, 8, 2))


def _rows(eb, table):
    """OVERRIDES entries {(bwd, eb, n): row} for the widths in table."""
    return {("bwd", eb, n): row for n, row in table.items()}


def _committed(eb: int, n: int) -> tuple:
    """The library's cluster shape for the backward at width n (CLUSTER_SHAPES', else CLUSTER_KERNELS')."""
    return tuple(cc.CLUSTER_SHAPES.get(("bwd", eb, n)) or cc.CLUSTER_KERNELS[("bwd", eb)])


def _on_clusters(eb: int, shapes: dict) -> dict:
    """A variant that routes the widths of `shapes` (width -> cluster shape) to the cluster kernels with those shapes
    and is timed at them only."""
    at = tuple(shapes)
    return dict(rows={}, col_sum=None, cuda_off=False, only=at, cuda=at,
                cluster_shapes={("bwd", eb, n): shape for n, shape in shapes.items()})


def variants(eb: int, widths=WIDTHS) -> dict:
    """name -> dict(rows=OVERRIDES, col_sum=block or None (configs.col_sum_block), cuda=routes or None,
    cuda_off=bool (the cluster route off), only=widths the variant is timed at (None: all)).
    old: before this change (no prefetch, the fixed column-sum block, the clusters at every 16-bit
    backward width from 16K; LayerNorm's two row sums were two reductions then, runs R1/R2 measured
    that too, and are one paired reduction now in every variant);
    new: the library's defaults; pf: prefetch at every unsplit width; tri*: Triton split rows
    (prefetched) where the table routes to the CUDA cluster kernels."""
    base = {n: tc.row_config("bwd", n, eb, "sm_90") for n in widths}
    base = {n: (c.block_m, c.split, c.num_warps, c.programs_per_sm, c.num_stages) for n, c in base.items()
            if not c.looped}
    unsplit = {n: r for n, r in base.items() if r[1] == 1}
    wide = [n for n in widths if n >= 16384]
    out = {
        "old": dict(rows=_rows(eb, {n: r + (False,) for n, r in unsplit.items()}),
                    col_sum=_OLD_COL_SUM, cuda_off=False, only=None, cuda=_OLD_CUDA.get(eb)),
        "new": dict(rows={}, col_sum=None, cuda_off=False, only=None),
        "pf": dict(rows=_rows(eb, {n: r + (True,) for n, r in unsplit.items()}), col_sum=None,
                   cuda_off=False, only=tuple(unsplit)),
        "tri-table": dict(rows={}, col_sum=None, cuda_off=True, only=tuple(wide)),
    }
    for cols, warps, per_sm in ((8192, 16, 1), (4096, 8, 2)):
        out[f"tri{cols // 1024}k"] = dict(rows=_rows(eb, {n: (1, n // cols, warps, per_sm, 1, True) for n in wide}),
                                          col_sum=None, cuda_off=True, only=tuple(wide))
    # session 9: several rows per exchange (the split path's weight-gradient sums are [1, BLOCK_N]
    # now, so a 2-row tile of LayerNorm fits two 8-warp programs per SM): m{rows}c{cols}w{warps}
    for rows, cols, warps, per_sm in WIDE_ROWS:
        out[f"m{rows}c{cols // 1024}kw{warps}"] = dict(
            rows=_rows(eb, {n: (rows, n // cols, warps, per_sm, 1, True) for n in wide}), col_sum=None,
            cuda_off=True, only=tuple(wide))
    # the same with ptxas's maxnreg at what per_sm programs leave (configs.reg_cap_for; offline
    # ptxas: LayerNorm 1x4096x8 warps 160 -> 128, 2x2048x8 warps at 64K-256K 139 -> 121, no spills)
    for rows, cols, warps, per_sm in WIDE_ROWS_CAPPED:
        out[f"m{rows}c{cols // 1024}kw{warps}-cap"] = dict(
            rows=_rows(eb, {n: (rows, n // cols, warps, per_sm, 1, True, True) for n in wide}), col_sum=None,
            cuda_off=True, only=tuple(wide))
    # session 10: the cluster kernels at every wide width, both ops (cl), and with MERGE (cl-m: the
    # CTA's warps' row sums merged first, one value per CTA in the exchange: 16 values merged per
    # row at 128K-256K instead of 128-256)
    # session 14: cl-p, the row sums pushed by st.async onto the peers' mbarriers (the push forward's
    # exchange, PUSH) instead of remote stores and a cluster barrier per row
    # (cl-p also from 2K: rows of one CTA, no exchange, the row's tiles loaded by bulk copies; run S14-6)
    for name, merge, push in (("cl", False, False), ("cl-m", True, False), ("cl-p", False, True)):
        at = [n for n in widths if n >= 2048] if push else wide
        out[name] = _on_clusters(eb, {n: (_committed(eb, n) + (False,) * 4)[:4] + (push, merge) for n in at})
    # session 15: cl-o{stages}, two rows in flight (OVERLAP: the next row's first pass while this row's sums travel;
    # the push exchange, the stage read again), at the committed shapes' threads and items
    for stages in (3, 4):
        out[f"cl-o{stages}"] = _on_clusters(eb, {n: _committed(eb, n)[:2] + (max(stages, _committed(eb, n)[2]), True,
                                                                           True, False, True) for n in wide})
    # and cl-or{stages}: the two rows' xhat and g in two register sets instead (no recompute; a stage refilled once
    # its row's sums are taken), at the committed shapes' threads and items, 16K-128K
    for stages in (2, 3):
        out[f"cl-or{stages}"] = _on_clusters(eb, {n: _committed(eb, n)[:2] + (stages, False, True, False, True)
                                                  for n in wide if n <= 131072})
    # after S15-5, at 32K-64K (LN 0.70 / 0.64 against 0.75 / 0.65): one row in flight on 3 stages (p3), with MERGE
    # (pm), and the register-set overlap on 256-thread CTAs (or3-256) or on 4 stages (or4)
    for name, shape in (("p3", (512, 2, 3, False, True)), ("pm", (512, 2, 2, False, True, True)),
                        ("or3-256", (256, 4, 3, False, True, False, True)), ("or4", (512, 2, 4, False, True, False, True))):
        out[name] = _on_clusters(eb, {n: shape for n in wide if n in (32768, 65536)})
    # session 17: the next tile's row statistics prefetched with it (configs.PREFETCH_STATS, the default now) against
    # without (nostats; split rows prefetch, so at every width), each with the unsplit rows compiled at 128 registers
    # (-cap: two 8-warp programs per SM, or one of 16; offline ptxas put LayerNorm's 1K / 2K tiles at 135-137 registers
    # with the statistics held: one per SM). S17-1 measured them; the table's 16-bit rows at 1K-8K are -cap's since
    capped = _rows(eb, {n: (r[0], r[1], r[2], 2 if r[2] == 8 else 1, r[4], True, True) for n, r in unsplit.items()
                        if r[2] in (8, 16)})
    for name, stats in (("stats", True), ("nostats", False)):
        out[name] = dict(rows={}, col_sum=None, cuda_off=False, only=None, stats=stats)
        out[name + "-cap"] = dict(rows=capped, col_sum=None, cuda_off=False, only=tuple(unsplit), stats=stats)
    # after S17-1: LayerNorm's 2K and 8K on Triton's tiles (the table's rows) instead of the push clusters, and two
    # other 1K tiles: 2 x 1024 x 8 warps, 3 per SM (80 registers) or 4 per SM at 64 registers (48 bytes spilled)
    out["tri"] = dict(rows={}, col_sum=None, cuda_off=True, only=tuple(n for n in (2048, 8192) if n in widths))
    # and (after S17-2, LN 1K / 8K at 0.84 / 0.81) more warps per SM: 1K as 2 x 1024 x 16 warps, two per SM (62
    # registers offline), 8K as one 32-warp program (64 registers, no spills)
    for name, n, row in (("1k-p3", 1024, (2, 1, 8, 3, 1, True)), ("1k-p4", 1024, (2, 1, 8, 4, 1, True, True)),
                         ("1k-w16", 1024, (2, 1, 16, 2, 1, True, True)), ("8k-w32", 8192, (1, 1, 32, 1, 1, True, True))):
        out[name] = dict(rows=_rows(eb, {n: row}), col_sum=None, cuda_off=False, only=(n,) if n in widths else ())
    return out


def _forget_cluster_plans():
    """cluster.prepare caches plans by call kind, not by CLUSTER_SHAPES (it loads the CUDA bindings:
    only where a GPU runs the cluster kernels)."""
    if DEV == "cuda":
        from normkit.backends.cuda import cluster
        cluster.prepare.cache_clear()


@contextlib.contextmanager
def applied(v):
    saved = (dict(tc.OVERRIDES), dict(tc.CUDA_OVERRIDES), tc.col_sum_block, dict(cc.CLUSTER_SHAPES), tc.PREFETCH_STATS)
    tc.OVERRIDES.update(v["rows"])
    tc.PREFETCH_STATS = v.get("stats", saved[4])
    cc.CLUSTER_SHAPES.update(v.get("cluster_shapes", {}))
    _forget_cluster_plans()
    for eb in ((2, 4) if v["cuda_off"] else ()):
        tc.CUDA_OVERRIDES[("bwd", eb)] = ()
    if v.get("cuda") is not None:
        tc.CUDA_OVERRIDES[("bwd", 2)] = v["cuda"]
    if v["col_sum"] is not None:
        fixed = v["col_sum"]
        tc.col_sum_block = functools.lru_cache(maxsize=None)(lambda rows, n, sms: fixed)
    tb.clear_caches()
    try:
        yield
    finally:
        tc.OVERRIDES.clear()
        tc.OVERRIDES.update(saved[0])
        tc.CUDA_OVERRIDES.clear()
        tc.CUDA_OVERRIDES.update(saved[1])
        tc.col_sum_block = saved[2]
        cc.CLUSTER_SHAPES.clear()
        cc.CLUSTER_SHAPES.update(saved[3])
        tc.PREFETCH_STATS = saved[4]
        _forget_cluster_plans()
        tb.clear_caches()


def log(*a):
    print(*a, flush=True)


def write_csv(path, rows):
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)


def bwd(x, w, b, dy, mean, rstd, rms):
    return tb.row_norm_bwd(dy, x, w, mean, rstd, rms, torch.float32, None if rms else torch.float32)


# ----------------------------------------------------------------------------- correctness

def check(out, dtypes, names, shapes=None):
    """Each named variant: oracle at the timed widths and awkward shapes, offset 1e4, a NaN row
    confined to its row, dx/dweight/dbias bitwise equal across two runs."""
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}
    shapes = shapes or [(1, 1), (1, 1024), (7, 1000), (301, 2048), (3, 4099), (33, 8192), (2, 1031), (1000, 4096),
                        (4000, 1024), (129, 8192)]
    for dname in dtypes:
        eb = torch.empty((), dtype=DT[dname]).element_size()
        vs = variants(eb, tuple(sorted({max(32, 1 << (n - 1).bit_length()) for _, n in shapes})))
        for vname in names:
            v = vs[vname]
            dtype = DT[dname]
            for op in ("ln", "rms"):
                rms = op == "rms"
                for (M, N) in shapes:
                    for offset in ((0.0,) if rms else (0.0, 1e4)):
                        for strided in ((False, True) if (M, N) == (1000, 4096) else (False,)):
                            row = dict(variant=vname, dtype=dname, op=op, M=M, N=N, offset=offset, strided=strided)
                            try:
                                with applied(v):
                                    row.update(_check_case(dtype, rms, M, N, offset, strided, tol[dtype]))
                            except Exception as e:  # noqa: BLE001
                                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                                traceback.print_exc()
                            out.append(row)
                            if not row["ok"]:
                                log("CHECK FAIL", row)


def _check_case(dtype, rms, M, N, offset, strided, tol):
    full = (torch.randn(M, N + 64 if strided else N, device=DEV) * 2 + 0.5 + offset).to(dtype)
    nan_row = M // 2 if M >= 3 else None
    if nan_row is not None:
        full[nan_row, N // 2] = float("nan")
    x = full[:, :N]
    w = (torch.randn(N, device=DEV) * 0.5 + 1).to(dtype)
    b = None if rms else (torch.randn(N, device=DEV) * 0.5).to(dtype)
    dy = torch.randn(M, N, device=DEV).to(dtype)
    y, mean, rstd = tb.row_norm_fwd(x, w, b, 1e-5, rms)
    (dx, dw, db), (dx2, dw2, db2) = [bwd(x, w, b, dy, mean, rstd, rms) for _ in range(2)]
    if DEV == "cuda":
        torch.cuda.synchronize()
    keep = torch.ones(M, dtype=torch.bool, device=DEV)
    if nan_row is not None:
        keep[nan_row] = False
    xk, dyk = x[keep], dy[keep]
    if rms:
        dx_ref, dw_ref = ref.rms_norm_backward(dyk, xk, (N,), w, 1e-5)[:2]
        db_ref = None
    else:
        dx_ref, dw_ref, db_ref = ref.layer_norm_backward(dyk, xk, (N,), w, b, 1e-5)
    # with a NaN row, dweight/dbias are NaN (the row contributes): check the other rows' dx only
    rel = lambda a, e: ref.rel_err(a.double().cpu(), e.double().cpu())  # noqa: E731
    e_dx = rel(dx[keep], dx_ref)
    if N == 1:  # dx = rstd * w*dy * (1 - xhat^2) cancels to ~eps: relative to the terms that cancel
        scale = (dyk.double() * w.double() * rstd[keep].double()[:, None]).norm()
        e_dx = float((dx[keep].double() - dx_ref.double()).norm() / scale.clamp_min(1e-30))
    dx_tol = max(2 * tol, 2e-3 if offset else 0.0)  # at 1e4 the stored fp32 mean's rounding
    ok = e_dx <= dx_tol and bool(torch.isfinite(dx[keep]).all())
    e_dw = e_db = 0.0
    if nan_row is None:
        e_dw = rel(dw, dw_ref)
        e_db = rel(db, db_ref) if db_ref is not None else 0.0
        ok = ok and e_dw <= (1e-4 if offset == 0 else 1e-3) and e_db <= 1e-4
    else:
        ok = ok and bool(torch.isnan(dx[nan_row]).any())
    same = torch.equal(dx.nan_to_num(), dx2.nan_to_num()) and torch.equal(dw.nan_to_num(), dw2.nan_to_num()) and \
        (db is None or torch.equal(db.nan_to_num(), db2.nan_to_num()))
    return dict(err_dx=f"{e_dx:.2e}", err_dw=f"{e_dw:.2e}", err_db=f"{e_db:.2e}", same=same, ok=ok and same)


# ----------------------------------------------------------------------------- timing

def _sets(dtype, M, N, rms):
    """Input sets (speed_sweep's) rotating over more than 4x L2."""
    import speed_sweep  # beside this script; loads the CUDA backend, so only where timing runs
    eb = torch.empty((), dtype=dtype).element_size()
    return speed_sweep.ring(functools.partial(speed_sweep.row_set, dtype, M, N, rms), 3 * M * N * eb)


def time_all(out, dtypes, widths, names, copy, path):
    timer = CudaTimer()
    for dname in dtypes:
        dtype = DT[dname]
        eb = torch.empty((), dtype=dtype).element_size()
        vs = variants(eb, widths)
        for N in widths:
            M = 2**26 // N
            for op in ("ln", "rms"):
                rms = op == "rms"
                sets = _sets(dtype, M, N, rms)
                nbytes = 3 * M * N * eb
                for vname in names:
                    v = vs[vname]
                    if v["only"] is not None and N not in v["only"]:
                        continue
                    row = dict(dtype=dname, op=op, N=N, M=M, variant=vname)
                    try:
                        with applied(v):
                            cfg = tb._plan("bwd", N, eb, torch.device("cuda"), (rms, True, False, None,
                                                                                 (True, not rms)))[0]
                            calls = [functools.partial(bwd, *s[:3], s[3], s[4], s[5], rms) for s in sets]
                            calls[0]()
                            torch.cuda.synchronize()
                            ms, _ = timer.median_ms(calls, WARM_MS, REP_MS)
                        gbps = nbytes / (ms * 1e6)
                        row.update(cfg="cuda" if cfg.cuda else f"{cfg.block_m}x{cfg.block_n}/s{cfg.split}/w{cfg.num_warps}"
                                   f"/p{cfg.programs_per_sm}{'/pf' if cfg.prefetch else ''}", us=f"{ms * 1e3:.1f}", gbps=f"{gbps:.0f}",
                                   frac=f"{gbps / copy:.3f}")
                    except Exception as e:  # noqa: BLE001
                        row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                    out.append(row)
                    log(f"{op} {dname} N={N} {vname:<8} {row.get('cfg', '')} {row.get('us', '')} us "
                        f"{row.get('frac', row.get('error'))}")
                    write_csv(path, out)
                del sets
                torch.cuda.empty_cache()


def profile(dtypes, vs, path, widths=(1024, 8192)):
    """Per-kernel device time of one call (torch.profiler), per variant: where the time goes."""
    lines = []
    for dname in dtypes[:1]:
        dtype = DT[dname]
        for N in widths:
            M = 2**26 // N
            for op in ("ln", "rms"):
                rms = op == "rms"
                s = _sets(dtype, M, N, rms)[0]
                for vname in ("old", "new"):
                    with applied(vs[vname]):
                        for _ in range(3):
                            bwd(*s, rms)
                        torch.cuda.synchronize()
                        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                            for _ in range(5):
                                bwd(*s, rms)
                            torch.cuda.synchronize()
                    for e in prof.key_averages():
                        if e.device_time_total > 0:
                            lines.append(f"{dname} {op} N={N} {vname:<6} {e.key[:40]:<40} "
                                         f"{e.device_time_total / max(e.count, 1):8.1f} us x{e.count}")
                torch.cuda.empty_cache()
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))


def ncu_cases(cases):
    """One backward per case after a warm-up call (ncu --launch-skip/-count picks)."""
    vs = variants(2, tuple(sorted({int(c.split(":")[1]) for c in cases.split(",")})))  # the cases' widths
    for case in cases.split(","):
        op, n, vname = case.split(":")
        N, rms = int(n), op == "rms"
        s = _sets(torch.bfloat16, 2**26 // N, N, rms)[0]
        with applied(vs[vname]):
            bwd(*s, rms)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(case)
            bwd(*s, rms)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bwd_sweep_out")
    ap.add_argument("--parts", default="check,time,profile")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--check-dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--variants", default="old,new,pf,tri-table,tri8k,tri4k")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--check-variants", default="old,new")
    ap.add_argument("--check-wide", default="", help="variants checked at 16K-256K too")
    ap.add_argument("--ncu", default="")
    ap.add_argument("--bench", default="", help="run `normkit bench` with these arguments under --bench-variant")
    ap.add_argument("--bench-variant", default="old")
    a = ap.parse_args()
    if a.ncu:
        ncu_cases(a.ncu)
        return
    if a.bench:  # the bench as it ran before this change (cluster routes as the table says)
        from normkit.cli import main as normkit_main
        with applied(variants(2)[a.bench_variant]):
            sys.exit(normkit_main(["bench"] + a.bench.split()))
    os.makedirs(a.out, exist_ok=True)
    p = torch.cuda.get_device_properties(0)
    env = (f"date {datetime.datetime.now().isoformat(timespec='seconds')}\ngpu {p.name} sms {p.multi_processor_count}"
           f"\ntorch {torch.__version__} triton {__import__('triton').__version__}\ncommand {' '.join(sys.argv)}\n")
    timer = CudaTimer()
    copy = copy_ceiling_gbps(timer, WARM_MS, REP_MS)
    env += f"copy {copy:.0f} GB/s\n"
    open(os.path.join(a.out, "env.txt"), "w").write(env)
    log(env)
    dtypes = a.dtypes.split(",")
    parts = a.parts.split(",")
    names = a.variants.split(",")
    widths = tuple(int(n) for n in a.widths.split(","))
    table = []
    for part in parts:  # in the order asked: a run cut short keeps the first
        if part == "check":
            rows = []
            if a.check_variants:  # "": only the wide checks
                check(rows, a.check_dtypes.split(","), a.check_variants.split(","))
            if a.check_wide:
                check(rows, ["bf16"], a.check_wide.split(","), [(3, 16384), (37, 16392), (5, 32768), (4, 65536),
                                                               (3, 131072), (2, 262144)])
            write_csv(os.path.join(a.out, "check.csv"), rows)
            log(f"checks: {sum(r['ok'] for r in rows)}/{len(rows)} ok")
        elif part == "profile":
            profile(dtypes, variants(2), os.path.join(a.out, "profile.txt"))
        elif part == "time":
            rows = []
            time_all(rows, dtypes, widths, names, copy, os.path.join(a.out, "time.csv"))
            table.append("dt   op  N      " + " ".join(f"{k:>9}" for k in names))
            for dname in dtypes:
                for op in ("ln", "rms"):
                    for N in widths:
                        got = {r["variant"]: r.get("frac", "err") for r in rows
                               if r["op"] == op and r["N"] == N and r["dtype"] == dname}
                        table.append(f"{dname:<4} {op:<3} {N:<6} " + " ".join(f"{got.get(k, '-'):>9}" for k in names))
    log("\n".join(table))


if __name__ == "__main__":
    main()
