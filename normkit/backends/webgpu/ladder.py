"""`normkit ladder --backend webgpu`: seed 000's table on the adapter at hand.

Every WGSL variant, for LayerNorm and RMSNorm, float32 and (with shader-f16) float16: its time,
its throughput (x read + y written, as GiB/s and as a share of a buffer copy timed in the same
run), and the seed's closeness line against the float64 oracle, on random rows and on the same rows
offset by 1e4, where E[x^2]-E[x]^2 (onepass) cancels catastrophically and the others must not.
Writes webgpu_ladder.csv and webgpu_ladder.md (and webgpu_ladder.png with --plot) under --out.
"""
from __future__ import annotations

import csv
import datetime
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

from . import shaders

SHAPES = {"full": [(4096, 768), (2048, 4096), (1024, 4099)], "quick": [(64, 768), (16, 4099)]}
TIMING = {"full": dict(repeats=7, budget_s=0.05), "quick": dict(repeats=3, budget_s=0.005)}
OFFSET = 1e4
# per-element closeness, as torch.allclose: |y - ref| <= atol + rtol * |ref|
TOLERANCE = {"f32": (1e-5, 1e-5), "f16": (2e-3, 2e-3)}
NP_DTYPES = {"f32": np.float32, "f16": np.float16}
EPS = 1e-5


def add_arguments(parser) -> None:
    """The shared ladder options (--out, --quick, --plot) are all this ladder uses."""


def closeness(y: np.ndarray, ref: np.ndarray, dtype: str) -> dict:
    """The seed's line: 'All close' or 'K samples not close', the mean and max absolute error, and
    where the max is."""
    rtol, atol = TOLERANCE[dtype]
    err = np.abs(y.astype(np.float64) - ref)
    err[~np.isfinite(err)] = np.inf
    bad = int(np.count_nonzero(~(err <= atol + rtol * np.abs(ref))))
    at = np.unravel_index(int(np.argmax(err)), err.shape)
    avge, mae = float(err.mean()), float(err.max())
    head = "All close" if bad == 0 else f"{bad} samples not close"
    return {"ok": bad == 0, "bad": bad, "avge": avge, "mae": mae, "at": [int(i) for i in at],
            "line": f"{head} - AVGE={avge:.3g} MAE={mae:.3g} at {[int(i) for i in at]}"}


def _oracle(x, w, b, op):
    import torch

    from ... import reference as ref

    n = x.shape[1]
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    if op == "layer_norm":
        return ref.layer_norm(xt, (n,), wt, torch.from_numpy(b), EPS)[0].numpy()
    return ref.rms_norm(xt, (n,), wt, EPS)[0].numpy()


def _rows_for(r, op, dtype, m, n, timing, rng, ceiling_s):
    """One table row per variant for one (op, dtype, shape)."""
    np_dtype = NP_DTYPES[dtype]
    x = rng.standard_normal((m, n), dtype=np.float32).astype(np_dtype)
    x_off = (x.astype(np.float32) + OFFSET).astype(np_dtype)
    w = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32) if op == "layer_norm" else None
    rms = op == "rms_norm"
    ref, ref_off = _oracle(x, w, b, op), _oracle(x_off, w, b, op)
    moved = 2 * x.nbytes  # a perfect kernel reads x once and writes y once
    for variant in shaders.VARIANTS.values():
        row = {"op": op, "dtype": dtype, "M": m, "N": n, "variant": variant.name}
        try:
            r.check_variant(variant, n)
        except Exception as e:  # not runnable here: say why in the table
            yield {**row, "note": f"n/a: {e}"}
            continue
        times = r.time(x, w, b, EPS, rms, variant, **timing)
        t = statistics.median(times)
        check = closeness(r.run(x, w, b, EPS, rms, variant)[0], ref, dtype)
        check_off = closeness(r.run(x_off, w, b, EPS, rms, variant)[0], ref_off, dtype)
        yield {**row, "time_us": t * 1e6, "time_us_min": min(times) * 1e6, "time_us_max": max(times) * 1e6,
               "gib_s": moved / t / 2**30, "of_copy": ceiling_s / t,
               "check": check["line"], "check_ok": check["ok"],
               "offset_check": check_off["line"], "offset_ok": check_off["ok"], "exact": variant.exact, "note": ""}


def _markdown(rows) -> list[str]:
    lines = ["| op | dtype | M x N | variant | time us [min, max] | GiB/s | of copy | check vs float64 oracle | rows + 1e4 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        shape = f"{row['M']} x {row['N']}"
        if "time_us" not in row:
            lines.append(f"| {row['op']} | {row['dtype']} | {shape} | {row['variant']} | {row['note']} | | | | |")
            continue
        lines.append(
            f"| {row['op']} | {row['dtype']} | {shape} | {row['variant']} | "
            f"{row['time_us']:.1f} [{row['time_us_min']:.1f}, {row['time_us_max']:.1f}] | {row['gib_s']:.1f} | "
            f"{row['of_copy']:.0%} | {row['check']} | {row['offset_check']} |")
    return lines


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "time_us" in r]
    groups = sorted({(r["op"], r["dtype"], r["M"], r["N"]) for r in timed}, key=str)
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 2.2 * len(groups)), squeeze=False)
    for ax, g in zip(axes[:, 0], groups):
        sel = [r for r in timed if (r["op"], r["dtype"], r["M"], r["N"]) == g]
        ax.barh([r["variant"] for r in sel], [r["gib_s"] for r in sel],
                color=["tab:red" if not r["offset_ok"] else "tab:blue" for r in sel])
        ax.set_title(f"{g[0]} {g[1]} {g[2]} x {g[3]} (red: fails the rows offset by 1e4)", fontsize=9)
        ax.set_xlabel("GiB/s")
        ax.invert_yaxis()  # the ladder reads top-down, as in the table
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args) -> int:
    from .runner import WebGPUUnavailable, runner

    try:
        r = runner()
    except WebGPUUnavailable as e:
        print(f"normkit ladder --backend webgpu: {e}", file=sys.stderr)
        return 2
    import wgpu

    mode = "quick" if getattr(args, "quick", False) else "full"
    timing = TIMING[mode]
    dtypes = ["f32"] + (["f16"] if r.has_f16 else [])
    subgroups = f"subgroup size {r.subgroup_size}" if r.has_subgroups else f"no subgroups ({r.subgroups_off})"
    head = [f"# normkit ladder --backend webgpu ({mode})", "",
            f"- adapter: {r.summary}; {subgroups}; shader-f16: {'yes' if r.has_f16 else 'no'}",
            f"- wgpu {wgpu.__version__}, python {platform.python_version()}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; workgroup {shaders.WORKGROUP_SIZE}, one per row",
            "- time: median wall time per kernel over back-to-back dispatches [min, max of samples]; GiB/s counts "
            "x read + y written; 'of copy': that time against a buffer copy of the same bytes timed in this run",
            "- closeness: |y - ref| <= atol + rtol |ref| per element against the float64 oracle "
            f"({', '.join(f'{d}: rtol=atol={t[0]:g}' for d, t in TOLERANCE.items())}); "
            "'rows + 1e4': the same rows offset by 1e4, which onepass (E[x^2]-E[x]^2) is expected to fail", ""]
    print("\n".join(head), flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for m, n in SHAPES[mode]:
        for dtype in dtypes:
            nbytes = m * n * np.dtype(NP_DTYPES[dtype]).itemsize
            ceiling_s = statistics.median(r.time_copy(nbytes, **timing))
            for op in shaders.ROW_OPS:
                for row in _rows_for(r, op, dtype, m, n, timing, rng, ceiling_s):
                    rows.append(row)
                    print(_markdown([row])[-1], flush=True)
    table = _markdown(rows)
    out = Path(getattr(args, "out", "ladder-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "webgpu_ladder.md").write_text("\n".join(head + table) + "\n")
    fields = ["op", "dtype", "M", "N", "variant", "time_us", "time_us_min", "time_us_max", "gib_s", "of_copy",
              "check", "check_ok", "offset_check", "offset_ok", "exact", "note"]
    with open(out / "webgpu_ladder.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    if getattr(args, "plot", False):
        try:
            _plot(rows, out / "webgpu_ladder.png")
        except ImportError as e:
            print(f"--plot: matplotlib is needed for the PNG ({e})", file=sys.stderr)
    print(f"\nwrote {out / 'webgpu_ladder.md'} and {out / 'webgpu_ladder.csv'}")
    # the exact variants must pass both checks; onepass failing the offset rows is the lesson, not an error
    broken = [f"{x['variant']} {x['op']} {x['dtype']} {x['M']}x{x['N']}" for x in rows
              if "time_us" in x and x["exact"] and not (x["check_ok"] and x["offset_ok"])]
    if broken:
        print("FAILED closeness: " + "; ".join(broken), file=sys.stderr)
        return 1
    return 0
