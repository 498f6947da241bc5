"""Issue 24 device sweep (session 17): the Triton forward's rows at 16K-32K against torch.compile, which runs
at 0.88-0.92 of copy there on the H200 (run S17-6) where normkit's one 16-warp program per row makes
0.82-0.88. Variants are configuration rows (configs.OVERRIDES, keyed ("fwd", elem bytes, padded width)),
each checked against the float64 oracle (offset 1e4 included) and timed as bwd_sweep.py times (input sets
rotating over more than 4x L2, a GPU spin hiding the host, median); torch.compile is timed in the same run
(run it under TORCH_LOGS=output_code to see Inductor's kernels and launch configuration for these shapes).

  PYTHONPATH=.:benchmarks python benchmarks/fwd_sweep.py --out DIR [--widths 16384,32768] [--variants ...]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

from normkit import reference as ref
from normkit.backends import triton as tb
from normkit.backends.triton import configs as tc
from normkit.bench.timing import CudaTimer, copy_ceiling_gbps

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwd_sweep import WARM_MS, REP_MS, _sets, log, write_csv  # noqa: E402

# name -> {padded width: (block_m, split, num_warps, programs_per_sm[, num_stages])}; "table": the committed rows
VARIANTS = {
    "table": {},
    "triton": {32768: (1, 1, 16, 0)},  # LayerNorm's 32K runs on the clusters in the table: Triton's row for it
    "w32": {16384: (1, 1, 32, 0), 32768: (1, 1, 32, 0)},
    "w8": {16384: (1, 1, 8, 0)},
    "w16": {8192: (1, 1, 16, 0)},
    "tile": {8192: (1, 1, 8, 0), 32768: (1, 1, 16, 0)},  # RMSNorm's tiles before the looped rows (S18-5)
    "p1": {16384: (1, 1, 16, 1), 32768: (1, 1, 16, 1)},
    "w32p1": {16384: (1, 1, 32, 1), 32768: (1, 1, 32, 1)},
}
# after S17-8 (Inductor's kernels there: a looped reduction, one program per row, its first pass loading x with
# evict_last and its second with evict_first): normkit's looped forward at 8K-32K, chunk x warps, with the hints
# ("e": configs.LOOPED_EVICT) or without. Run S17-9 measured the looped kernel of then (a row sum per chunk: a CTA
# barrier between each chunk's loads and the next's) at LN 0.64-0.71 / 0.54-0.66, RMS 0.68-0.81 / 0.61-0.73 at
# 16K / 32K; session 18's kernel sums per lane and reduces across the row once, after the loop, as Inductor's does
# (run S18-1), then (S18-3) loads the next chunk before working on the current one (S18-2's SASS: the chunk's own
# loads had waited on each other).
# name -> configs attributes set (every width above MAX_TILED_N loops)
KNOBS = {f"vl{c // 1024}k{w}{'e' if e else ''}": dict(MAX_TILED_N=4096, LOOPED={**tc.LOOPED, "fwd": (c, w)},
                                                      LOOPED_EVICT=e)
         for c, w in ((1024, 4), (2048, 4), (2048, 8), (2048, 16), (4096, 8), (4096, 16), (8192, 16), (2048, 32),
                     (4096, 32), (8192, 32))
         for e in (False, True)}
# S18-5: the looped kernel compiled for the exact width (LOOPED_STATIC_N), with the hints, as the table's looped rows run
KNOBS.update({f"s{c // 1024}k{w}": dict(MAX_TILED_N=4096, LOOPED={**tc.LOOPED, "fwd": (c, w)}, LOOPED_EVICT=True,
                                        LOOPED_STATIC_N=True)
              for c, w in ((2048, 16), (4096, 16), (8192, 16), (4096, 32), (8192, 32), (16384, 32))})
# session 20: the looped LayerNorm sums shifted values per lane (no Welford update): its static rows at 8K-128K too,
# against the table's tiles (8K-16K) and the CUDA backend's cluster kernels (32K-128K)
# session 21: offline ptxas (triton 3.6, sm_90) gives the looped LayerNorm 46-64 registers where RMSNorm's takes 30-32
# (two per-lane sums instead of one; bias loads): one program of 32 warps per SM (s8k32) or two of 16 (s4k16) against
# RMSNorm's two / four, so half the bytes in flight. `p<n>`: compiled under the register cap for n programs per SM
# (configs.reg_cap_for; ptxas spills 8-128 bytes for LayerNorm at 32 registers, none at 40)
KNOBS.update({f"s{c // 1024}k{w}p{p}": dict(MAX_TILED_N=4096, LOOPED={**tc.LOOPED, "fwd": (c, w, p)},
                                            LOOPED_EVICT=True, LOOPED_STATIC_N=True)
              for c, w, p in ((4096, 16, 3), (4096, 16, 4), (8192, 32, 2), (2048, 16, 4), (4096, 32, 2), (2048, 8, 8))})
# S21-1 measured those no faster. Next hypothesis: the second pass reads x, w and b from L2 (3 row-sized streams
# against RMSNorm's 2): two rows per program (`m2`) share each parameter chunk's loads
KNOBS.update({f"s{c // 1024}k{w}m2": dict(MAX_TILED_N=4096, LOOPED={**tc.LOOPED, "fwd": (c, w)}, LOOPED_EVICT=True,
                                          LOOPED_STATIC_N=True, LOOPED_BLOCK_M=2)
              for c, w in ((2048, 16), (4096, 16), (4096, 32), (8192, 32))})
# session 22: S21-7's stall samples put LayerNorm's waits on its cross-warp reductions (three a row, each two CTA
# barriers). Run S22-1 measured the ways to fewer (a knob then, removed): both sums in one reduction (adopted: 0.70 ->
# 0.78 at 16K, level at 32K-256K), per-lane shifts merged by one Chan reduction and the row's first value as the shift
# (0.59-0.65 at 16K-32K: slower)
VARIANTS.update({name: {8192: None, 16384: None, 32768: None, 65536: None, 131072: None, 262144: None}
                 for name in KNOBS})


def _row(eb, v):
    return {("fwd", eb, n): row for n, row in v.items() if row is not None}


@functools.lru_cache(maxsize=None)
def _compiled(rms):
    def f(x, w, b):
        return F.rms_norm(x, x.shape[-1:], w, 1e-5) if rms else F.layer_norm(x, x.shape[-1:], w, b, 1e-5)
    return torch.compile(f, dynamic=False)


def check(dtype, rms, N, eb, v, knobs=None):
    """Oracle at an awkward row count, offset 1e4 (LayerNorm), a NaN confined to its row."""
    M = 37
    x = ((torch.randn(M, N, device="cuda") * 2 + 0.5 + (0.0 if rms else 1e4))).to(dtype)
    x[M // 2, N // 3] = float("nan")
    w = (torch.randn(N, device="cuda") * 0.5 + 1).to(dtype)
    b = None if rms else (torch.randn(N, device="cuda") * 0.5).to(dtype)
    with applied(eb, v, knobs):
        y = tb.row_norm_fwd(x, w, b, 1e-5, rms)[0]
    keep = torch.arange(M, device="cuda") != M // 2
    e = (ref.rms_norm(x[keep].double(), (N,), w.double(), 1e-5) if rms else
         ref.layer_norm(x[keep].double(), (N,), w.double(), b.double(), 1e-5))
    e = e[0] if isinstance(e, tuple) else e
    err = ref.rel_err(y[keep].double(), e)
    return err <= 1e-2 and bool(y[M // 2].isnan().any()) and bool(torch.isfinite(y[keep]).all()), err


class applied:
    """A variant's rows (and configs attributes, KNOBS) for the block; any variant but the table's runs on Triton
    (the CUDA route off)."""

    def __init__(self, eb, v, knobs=None):
        self.rows, self.eb, self.knobs = _row(eb, v), eb, knobs or {}

    def __enter__(self):
        self.saved = dict(tc.OVERRIDES), dict(tc.CUDA_OVERRIDES)
        self.saved_knobs = {k: getattr(tc, k) for k in self.knobs}
        tc.OVERRIDES.update(self.rows)
        for k, value in self.knobs.items():
            setattr(tc, k, value)
        if self.rows or self.knobs:
            tc.CUDA_OVERRIDES[("fwd", self.eb)] = ()
        tb.clear_caches()

    def __exit__(self, *a):
        for table, saved in zip((tc.OVERRIDES, tc.CUDA_OVERRIDES), self.saved):
            table.clear()
            table.update(saved)
        for k, value in self.saved_knobs.items():
            setattr(tc, k, value)
        tb.clear_caches()


def inductor_configs() -> list:
    """The launch configuration Inductor's autotuner kept for each Triton kernel it has run in this process
    (its output code's kernels: CachingAutotuner objects, one launcher left after autotuning)."""
    from torch._inductor.codecache import PyCodeCache
    mods = getattr(PyCodeCache, "modules", None) or list(getattr(PyCodeCache, "cache", {}).values())
    out = []
    for mod in mods:
        for name, obj in vars(mod).items():
            launchers = getattr(obj, "launchers", None)
            if launchers and hasattr(launchers[0], "config"):
                c = launchers[0].config
                out.append(f"{mod.__name__}.{name}: {c.kwargs} num_warps={c.num_warps} num_stages={c.num_stages}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--widths", default="16384,32768")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ops", default="ln,rms")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    widths = [int(n) for n in args.widths.split(",")]
    names = args.variants.split(",")
    timer, rows, dtype, eb = CudaTimer(), [], torch.bfloat16, 2
    copy = copy_ceiling_gbps(timer, WARM_MS, REP_MS)
    log(f"copy ceiling {copy:.0f} GB/s")
    for N in widths:
        M = 2**26 // N
        for op in args.ops.split(","):
            rms = op == "rms"
            ss = [s[:3] for s in _sets(dtype, M, N, rms)]  # (x, w, b) of input sets rotating over > 4x L2
            impls = [(n, VARIANTS[n]) for n in names if N in VARIANTS[n] or n == "table"] + [("compile", None)]
            for rep in range(args.repeat):
                for name, v in impls:
                    row = dict(op=op, N=N, M=M, variant=name, rep=rep)
                    try:
                        if v is None:
                            f = _compiled(rms)
                            calls = [functools.partial(f, *s) for s in ss]
                            calls[0]()
                            ms, _ = timer.median_ms(calls, WARM_MS, REP_MS)
                        else:
                            if rep == 0:
                                ok, err = check(dtype, rms, N, eb, v, KNOBS.get(name))
                                row.update(ok=ok, err=f"{err:.2e}")
                                if not ok:
                                    log("CHECK FAIL", op, N, name, err)
                            with applied(eb, v, KNOBS.get(name)):
                                calls = [functools.partial(tb.row_norm_fwd, s[0], s[1], s[2], 1e-5, rms) for s in ss]
                                calls[0]()
                                ms, _ = timer.median_ms(calls, WARM_MS, REP_MS)
                        gbps = 2 * M * N * eb / (ms * 1e6)
                        row.update(us=f"{ms * 1e3:.1f}", gbps=f"{gbps:.0f}", frac=f"{gbps / copy:.3f}")
                    except Exception as e:  # noqa: BLE001
                        row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                    rows.append(row)
                    log(f"{op} N={N} {name:<8} rep{rep} {row.get('frac', row.get('error'))} {row.get('err', '')}")
                    write_csv(os.path.join(args.out, "fwd.csv"), rows)
                    if name == "compile" and rep == 0:
                        for line in inductor_configs():
                            log(f"inductor {op} N={N}: {line}")
            del ss
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
