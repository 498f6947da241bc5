"""One PNG per op/direction/dtype: effective GB/s against the row width N, one line per
implementation, the copy ceiling as a horizontal line, wrong results marked with a red cross.

Only the group's main suite is drawn (the one with most points, normally the sweep at a fixed
size per input), so every point on a line moves the same number of bytes; the seeds' shapes
are in the summary tables.
"""
from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from .report import Row, groups


def _main_suite(grp: list[Row]) -> str:
    return Counter(r.suite for r in grp).most_common(1)[0][0]


def plot_all(rows: list[Row], out_dir) -> list[Path]:
    """Write the PNGs into out_dir; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for (op, d, dtype), grp in groups(rows).items():
        suite = _main_suite(grp)
        pts = [r for r in grp if r.suite == suite and r.gbps is not None]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        fig.subplots_adjust(left=0.1, right=0.97, top=0.92, bottom=0.15)  # cheaper than tight_layout
        for impl in dict.fromkeys(r.impl for r in pts):
            mine = sorted((r for r in pts if r.impl == impl), key=lambda r: r.N)
            style = dict(linewidth=2.5) if mine[0].is_normkit else dict(linewidth=1.2)
            ax.plot([r.N for r in mine], [r.gbps for r in mine], marker="o", markersize=3, label=impl, **style)
            bad = [r for r in mine if r.wrong]
            if bad:
                ax.scatter([r.N for r in bad], [r.gbps for r in bad], marker="x", s=80, color="red", zorder=5,
                           label=f"{impl}: wrong result")
        ceilings = [r.copy_gbps for r in grp if r.copy_gbps]
        if ceilings:
            c = statistics.median(ceilings)
            ax.axhline(c, color="black", linestyle="--", linewidth=1, label=f"copy ceiling {c:.0f} GB/s")
        ax.set_xscale("log", base=2)
        widths = sorted({r.N for r in pts})
        ax.set_xticks(widths, [str(n) for n in widths], rotation=45, fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("N (row width)" if op != "gn" else "N (elements per group)")
        ax.set_ylabel("effective GB/s")
        cpu = all(r.device == "cpu" for r in pts)
        ax.set_title(f"{op} {d} {dtype} ({suite}){' - CPU timings, not GPU bandwidth' if cpu else ''}")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        path = out_dir / f"{op}_{d}_{dtype}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
