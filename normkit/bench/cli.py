"""`normkit bench`: the command line of the benchmark (also `python -m normkit bench`, `make bench`).

    normkit bench                          the full default sweep into bench-out/ (CPU: a small run)
    normkit bench --quick                  a few widths, fewer repetitions
    normkit bench --ops ln --dtypes bf16 --dirs fwd --widths 1024-65536 --peers torch,quack
    normkit bench --report A/ B/results.csv --out merged/    merge runs: CSV, summary, plots
    normkit bench --report new/ --compare old/results.csv   what moved between two runs
    normkit bench --resume --time-budget 450   continue the sweep in --out where the last call stopped
"""
from __future__ import annotations

import argparse
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from . import host_cases
from .cli_args import _list_of, _positive, _Progress  # noqa: F401  (models.py and tests use them from here too)
from .host_cases import CASES as HOST_CASES
from .ops import DIRECTIONS, DTYPES, OPS, SUITES, pow2_range

NO_GPU_LINE = ("no CUDA GPU: running the CPU paths at small sizes; numbers are CPU timings, "
               "not GPU bandwidth")
PEER_NAMES = ("torch", "compile", "liger", "quack")


@dataclass(frozen=True)
class Profile:
    widths: tuple
    numel: int  # elements per input of a sweep point
    suites: tuple
    warmup_ms: float
    rep_ms: float
    dtypes: tuple = tuple(DTYPES)
    host_peers: tuple = PEER_NAMES  # peers whose host overhead is measured (normkit's always is)


# (device, --quick) -> defaults, which the options override. --quick on a GPU must take about a
# minute: one dtype, five points, short timings, and no compile peer in the host section (each of
# its points costs a torch.compile; the first calls of compile, Triton, Liger and quack dominate)
PROFILES = {
    ("cuda", False): Profile(pow2_range(32, 262144), 1 << 26, ("sweep", "llm.c", "tutorial", "gn-anchors", "gn-1d", "gn-2d"), 25, 100),
    ("cuda", True): Profile((4096, 65536), 1 << 26, ("quick",), 5, 20, ("bf16",), ("torch", "liger", "quack")),
    ("cpu", False): Profile((256, 4096), 1 << 16, ("sweep",), 1, 5),
    ("cpu", True): Profile((256, 1024), 1 << 13, ("sweep",), 1, 3),
}


# ----------------------------------------------------------------------------- arguments

def _widths(text: str) -> tuple:
    """'256,768,1024-65536': single widths, and ranges of powers of two."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        lo, sep, hi = item.partition("-")
        try:
            lo_i, hi_i = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            lo_i = hi_i = 0
        if lo_i < 1 or hi_i < lo_i or (sep and (lo_i & (lo_i - 1) or hi_i & (hi_i - 1))):
            raise argparse.ArgumentTypeError(
                f"expected widths like 256,768 or ranges of powers of two like 32-262144, got {item!r}")
        out += pow2_range(lo_i, hi_i) if sep else [lo_i]
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one width, got {text!r}")
    return tuple(dict.fromkeys(out))


def add_arguments(parser) -> None:
    from ..backends import NAMES
    g = parser.add_argument_group("what to run")
    g.add_argument("--ops", type=_list_of(tuple(OPS), "ops"),
                   help="ops (default: ln,rms, and gn once normkit.group_norm exists)")
    g.add_argument("--dirs", type=_list_of(DIRECTIONS, "directions"), default=DIRECTIONS, help="default: fwd,bwd")
    g.add_argument("--dtypes", type=_list_of(tuple(DTYPES), "dtypes"), help="default: bf16,fp16,fp32 (GPU --quick: bf16)")
    g.add_argument("--widths", type=_widths,
                   help="row widths N of the sweep, e.g. 256,768 or 32-262144 (default GPU: 32-262144)")
    g.add_argument("--rows", type=_positive(int), help="rows M of every sweep point (default: from the size per input)")
    g.add_argument("--mib", type=_positive(float),
                   help="MiB of x per sweep point (default: 2^26 elements, i.e. 128 MiB of 16-bit, 256 MiB of fp32)")
    g.add_argument("--suites", type=_list_of(tuple(SUITES), "suites"),
                   help="; ".join(f"{s.name}: {s.about}" for s in SUITES.values()) + " (default GPU: all, CPU: sweep)")
    g.add_argument("--normkit", type=_list_of(("auto",) + NAMES, "normkit backends"), default=("auto",),
                   help="normkit backends to time: auto (backend=None) or forced ones, e.g. auto,cuda")
    g.add_argument("--peers", type=_list_of(PEER_NAMES, "peers", allow_none=True), default=PEER_NAMES,
                   help="default: torch,compile,liger,quack")
    g.add_argument("--quick", action="store_true", help="a few widths, the sweep suite only, fewer repetitions")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    g.add_argument("--no-host", action="store_true", help="skip the host-overhead measurement")
    g.add_argument("--host-cases", type=_list_of(tuple(HOST_CASES) + ("all",), "host cases", allow_none=True),
                   help="host-cost rows of fused options and strided layouts against torch's unfused calls "
                        "(normkit.bench.host_cases): names, all or none (default GPU: all, CPU: none)")
    g.add_argument("--host-only", action="store_true", help="run no GB/s point: only the host-overhead rows")
    g.add_argument("--time-budget", type=_positive(float), metavar="SECONDS",
                   help="start no new point after this long from the start (the summary says how many are left)")
    g.add_argument("--resume", action="store_true",
                   help="keep the rows already in --out and run only what is missing or failed there")
    t = parser.add_argument_group("timing")
    t.add_argument("--warmup-ms", type=_positive(float), help="warm-up per timing (default GPU 25, quick 10)")
    t.add_argument("--rep-ms", type=_positive(float), help="timed duration per timing (default GPU 100, quick 30)")
    t.add_argument("--seed", type=int, default=0)
    o = parser.add_argument_group("output")
    o.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--report", nargs="+", metavar="CSV_OR_DIR",
                   help="run nothing: merge these results (CSVs or folders) into --out")
    o.add_argument("--compare", metavar="OLD", help="print what moved against an older results CSV or folder")
    o.add_argument("--threshold", type=_positive(float), default=0.05,
                   help="relative GB/s change that --compare reports (default 0.05)")
    from . import models
    models.add_arguments(parser)


# ----------------------------------------------------------------------------- running

def _task_line(rows) -> str:
    from . import report
    r0 = rows[0]
    cells = []
    for r in rows:
        if r.gbps is None:
            cells.append(f"{r.impl} {'unsupported' if r.note.startswith('unsupported') else 'error'}")
            continue
        cell = f"{r.impl} {report.fmt_gbps(r.gbps)}"
        if r.is_normkit and r.frac_of_copy is not None:
            cell += f" ({r.frac_of_copy:.2f} of copy)"
        if r.is_normkit and r.ratio_to_best_peer is not None:
            cell += f" ({r.ratio_to_best_peer:.2f}x {r.best_peer})"
        if r.wrong:
            cell += f" WRONG rel_err {r.rel_err:.2g}"
        cells.append(cell)
    unit = "GB/s" if r0.device == "cuda" else "GB/s (CPU)"
    return f"{r0.op} {r0.dir} {r0.dtype} {r0.shape}: " + " | ".join(cells) + f"  {unit}"


def _default_ops() -> tuple:
    import normkit
    return ("ln", "rms") + (("gn",) if hasattr(normkit, "group_norm") else ())


def _device(args) -> str:
    import torch
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: expected a visible CUDA GPU, found none")
    return args.device


def _seed(base: int, p, direction: str) -> int:
    """A seed per point, so a point gets the same inputs however the sweep is split."""
    return (base + zlib.crc32(f"{p.op}/{p.dtype}/{p.label}/{direction}".encode())) % 2**63


def run(args) -> int:
    start = time.time()  # --time-budget counts from here
    if args.models is not None:
        from . import models
        if args.report:
            return models.report_only(args)
        device = _device(args)
        if device == "cpu":
            print(models.NO_GPU_LINE, flush=True)
        return models.run(args, device, start)
    if args.report:
        return _report_only(args)
    from . import report, runner
    from .environment import collect
    from .ops import plan
    from .timing import make_timer

    device = _device(args)
    if device == "cpu":
        print(NO_GPU_LINE, flush=True)
    prof = PROFILES[(device, args.quick)]
    ops = args.ops or _default_ops()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = collect(device)
    rows, host_rows = _resume(args, out, env) if args.resume else ([], [])
    runnable = _available_impls(args, device, env)
    timer = make_timer(device)
    settings = runner.Settings(device, args.warmup_ms or prof.warmup_ms, args.rep_ms or prof.rep_ms)
    env.update(timer=timer.about, warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms)
    if device == "cuda":
        _measure_ceiling(timer, settings, env)

    def numel_of(dtype: str) -> int:
        return int(args.mib * 2**20) // DTYPES[dtype].itemsize if args.mib else prof.numel

    suites = args.suites or prof.suites
    if suites == ("quick",) and (args.widths or args.rows or args.mib):  # sizes asked for: the sweep at those
        suites = ("sweep",)
    points = [] if args.host_only else plan(ops, args.dtypes or prof.dtypes, suites, args.widths or prof.widths,
                                            numel_of, args.rows)
    done = {r.point + (r.impl,) for r in rows}
    tasks = [(p, d, todo) for p in points for d in args.dirs
             if (todo := [i for i in runnable if (p.op, d, p.dtype, p.label, i.name) not in done])]
    progress = _Progress(sum(len(t[2]) for t in tasks))
    for i, (p, d, todo) in enumerate(tasks):
        if args.time_budget and time.time() - start > args.time_budget:
            env["incomplete"] = (f"{len(tasks) - i} of {len(tasks)} point-directions not run (time budget); "
                                 f"run again with --resume to continue")
            print(f"time budget spent: {env['incomplete']}", flush=True)
            break
        task_rows = report.finalize(runner.run_task(p, d, todo, timer, settings, _seed(args.seed, p, d)))
        rows += task_rows
        progress.step(len(todo), _task_line(task_rows))
        report.write_csv(out / "results.csv", rows, env)  # a run cut short still leaves its rows
    progress.close()
    if not args.no_host:
        measured = {(h.op, h.impl) for h in host_rows}
        host_impls = [i for i in runnable if i.is_normkit or i.name in prof.host_peers]
        todo = [op for op in ops if any((op, i.name) not in measured for i in host_impls)]
        host_rows += [h for h in runner.run_host(todo, host_impls, timer, device) if (h.op, h.impl) not in measured]
        cases = args.host_cases if args.host_cases is not None else (("all",) if device == "cuda" else ())
        cases = tuple(HOST_CASES) if "all" in cases else cases
        host_rows += host_cases.run([c for c in cases if (c, "normkit") not in measured], timer, device)
    _finish(args, out, rows, host_rows, env)
    compiles = [r.first_call_s for r in rows if r.impl == "compile" and r.first_call_s]
    if compiles:
        print(f"torch.compile: {len(compiles)} first calls took {sum(compiles):.0f} s in all (outside the timings)")
    bad = [r for r in rows if r.is_normkit and (r.wrong or r.failed)]
    if bad:
        print(f"{len(bad)} normkit rows are wrong or failed; see {out / 'summary.md'}", file=sys.stderr)
    return 1 if bad else 0


def _available_impls(args, device: str, env: dict) -> list:
    """The implementations that can run here; the others go into env as skipped, with the reason."""
    from . import impls
    runnable = []
    for impl in impls.make(args.normkit, args.peers):
        try:
            why = impl.why_unavailable(device)
        except Exception as e:  # noqa: BLE001 - a broken backend or peer is a skip reason, not a crash
            why = f"failed to load: {impls.first_line(e)}"
        if why is None:
            runnable.append(impl)
        else:
            env[f"skipped.{impl.name}"] = why
            print(f"skipped {impl.name}: {why}", flush=True)
    return runnable


def _measure_ceiling(timer, settings, env: dict) -> None:
    import torch

    from .timing import COPY_BYTES, copy_ceiling_gbps
    settings.l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    settings.copy_gbps = copy_ceiling_gbps(timer, settings.warmup_ms, settings.rep_ms)
    env["copy_gbps"] = f"{settings.copy_gbps:.0f}"
    print(f"copy ceiling: {settings.copy_gbps:.0f} GB/s ({COPY_BYTES // 2**20} MiB device-to-device copy, "
          f"read + write)", flush=True)


def _resume(args, out: Path, env: dict) -> tuple[list, list]:
    """The rows of an earlier run into the same --out, which this run continues. Its environment
    is kept (differing values joined) except what this run re-establishes."""
    from . import report
    if not (out / "results.csv").exists():
        return [], []
    rows, host_rows, old_env = report.load([out])
    here, there = env.get("gpu", env["device"]), old_env.get("gpu", old_env.get("device"))
    if here != there:
        raise SystemExit(f"--resume: {out / 'results.csv'} was measured on {there}, this is {here}; "
                         f"use another --out")
    kept = {k: v for k, v in old_env.items() if k != "incomplete" and not k.startswith("skipped.")}
    env.update(report.merge_env([kept, dict(env)]))
    ran = [r for r in rows if not r.failed]  # errors (a sticky CUDA fault, out of memory) run again
    print(f"resuming {out}: {len(ran)} rows kept, {len(rows) - len(ran)} failed ones to run again", flush=True)
    return ran, host_rows


def _finish(args, out: Path, rows, host_rows, env) -> None:
    """Write results.csv, host.csv, summary.md and the plots; print the headline and --compare."""
    from . import report
    report.write_csv(out / "results.csv", rows, env)
    if host_rows:
        report.write_csv(out / "host.csv", host_rows, env)
    (out / "summary.md").write_text(report.summary_markdown(rows, host_rows, env))
    written = [out / "results.csv", out / "summary.md"]
    if not args.no_plots and rows:
        from .plots import plot_all
        try:
            written += plot_all(rows, out / "plots")
        except ImportError as e:  # matplotlib is an optional dependency (pip install normkit[bench])
            print(f"plots skipped: {e}")
    for h in report.headline(rows):
        frac = (f"copy worst {h['frac_worst']:.2f} median {h['frac_median']:.2f}"
                if h["frac_worst"] is not None else "copy n/a")
        ratio = (f"vs best peer worst {h['ratio_worst']:.2f} ({h['ratio_worst_at']}, {h['ratio_worst_peer']}) "
                 f"median {h['ratio_median']:.2f}") if h["ratio_worst"] is not None else "vs best peer n/a"
        print(f"{h['impl']} {h['op']} {h['dir']} {h['dtype']}: {frac}; {ratio}; wrong {h['wrong']}")
    if args.compare:
        written += _compare(args, out, rows, env)
    print(f"wrote {len(written)} files under {out}/ (summary: {out / 'summary.md'})")


def _compare(args, out: Path, rows, env) -> list:
    from . import report
    try:
        old_rows, _, old_env = report.load([args.compare])
    except (OSError, ValueError) as e:
        print(f"--compare: {e}", file=sys.stderr)
        return []
    lines = report.compare(old_rows, rows, args.threshold, old_env, env)
    (out / "compare.md").write_text("".join(f"- {line}\n" for line in lines))
    print(f"compared with {args.compare}:\n" + "".join(f"  {line}\n" for line in lines), end="")
    return [out / "compare.md"]


def _report_only(args) -> int:
    from . import report
    try:
        rows, host_rows, env = report.load(args.report)
    except (OSError, ValueError) as e:
        print(f"--report: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _finish(args, out, rows, host_rows, env)
    return 0
