"""Benchmark results: rows, CSV files with their environment, the markdown summary, --compare.

A results CSV starts with `# key: value` lines (the environment: GPU, driver, versions, date,
copy ceiling, skipped implementations), then one row per (point, direction, implementation).
The derived columns (fraction of the copy ceiling, best peer, ratio to it) are recomputed by
finalize() whenever rows are written, so CSVs from several runs merge into one honest report.
"""
from __future__ import annotations

import csv
import io
import math
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

from .host_cases import HostRow, section as host_cases_section


@dataclass
class Row:
    suite: str
    op: str
    dir: str
    dtype: str
    M: int
    N: int
    shape: str
    impl: str
    device: str
    time_ms: Optional[float] = None
    gbps: Optional[float] = None
    copy_gbps: Optional[float] = None
    frac_of_copy: Optional[float] = None
    best_peer: str = ""
    ratio_to_best_peer: Optional[float] = None
    rel_err: Optional[float] = None
    tol: Optional[float] = None
    ok: str = ""  # "yes", "no" (wrong result), "" (did not run: see note)
    first_call_s: Optional[float] = None
    reps: Optional[int] = None
    note: str = ""

    @property
    def point(self) -> tuple:
        return (self.op, self.dir, self.dtype, self.shape)

    @property
    def is_normkit(self) -> bool:
        return self.impl.startswith("normkit")

    @property
    def wrong(self) -> bool:
        return self.ok == "no"

    @property
    def failed(self) -> bool:
        return self.ok == "" and self.note.startswith("error")


_INT_FIELDS = {"M", "N", "reps"}
_FLOAT_FIELDS = {"time_ms", "gbps", "copy_gbps", "frac_of_copy", "ratio_to_best_peer", "rel_err", "tol",
                 "first_call_s", "us_per_call", "latency_us"}


def _fmt(name: str, v) -> str:
    if v is None:
        return ""
    return repr(float(v)) if name in _FLOAT_FIELDS else str(v)  # repr: exact round trip


def _parse(name: str, s: str):
    if name in _INT_FIELDS:
        return int(s) if s != "" else None
    if name in _FLOAT_FIELDS:
        return float(s) if s != "" else None
    return s


# ----------------------------------------------------------------------------- derived columns

def finalize(rows: list[Row]) -> list[Row]:
    """Fill frac_of_copy, best_peer and ratio_to_best_peer from the measured columns.

    The best peer at a point is the fastest peer (any implementation not named normkit*) whose
    result was correct there; every row's ratio is its GB/s over that peer's.
    """
    best: dict = {}
    for r in rows:
        if not r.is_normkit and r.ok == "yes" and r.gbps is not None:
            if r.point not in best or r.gbps > best[r.point].gbps:
                best[r.point] = r
    for r in rows:
        r.frac_of_copy = r.gbps / r.copy_gbps if (r.gbps is not None and r.copy_gbps) else None
        b = best.get(r.point)
        r.best_peer = b.impl if b else ""
        r.ratio_to_best_peer = r.gbps / b.gbps if (b and r.gbps is not None) else None
    return rows


# ----------------------------------------------------------------------------- CSV

def _env_lines(env: dict) -> str:
    return "".join(f"# {k}: {str(v).replace(chr(10), ' ')}\n" for k, v in env.items())


def write_csv(path, rows: list, env: dict, cls=None) -> Path:
    """Rows (all of one dataclass: Row, HostRow, ...) with the environment as a `# key: value` header."""
    path = Path(path)
    cls = cls or (type(rows[0]) if rows else Row)
    names = [f.name for f in fields(cls)]
    if cls is Row:
        finalize(rows)
    buf = io.StringIO()
    buf.write(_env_lines(env))
    w = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt(k, v) for k, v in asdict(r).items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())
    return path


def _parse_typed(type_name: str, s: str):
    """A CSV cell by its dataclass field's (string) annotation: Optional[float], int, str, ..."""
    if "float" in type_name:
        return float(s) if s != "" else None
    if "int" in type_name:
        return int(s) if s != "" else None
    return s


def read_csv(path, cls=None) -> tuple[list, dict]:
    """(rows, env) of a CSV written by write_csv; rows are `cls`, or Row or HostRow by their columns."""
    path = Path(path)
    env, body = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("# ") and not body:
            key, _, value = line[2:].partition(": ")
            env[key] = value
        elif line.strip():
            body.append(line)
    if not body:
        raise ValueError(f"{path}: expected a CSV header after the environment lines, found none")
    reader = csv.DictReader(body)
    if cls is None:
        cls = HostRow if "us_per_call" in reader.fieldnames else Row
        parse = _parse
    else:
        types = {f.name: str(f.type) for f in fields(cls)}
        parse = lambda k, v: _parse_typed(types[k], v)  # noqa: E731
    wanted = {f.name for f in fields(cls)}
    missing = wanted - set(reader.fieldnames) - {"note"}
    if missing:
        raise ValueError(f"{path}: expected the columns of a normkit bench CSV, missing {sorted(missing)}")
    rows = [cls(**{k: parse(k, v) for k, v in rec.items() if k in wanted}) for rec in reader]
    return (finalize(rows) if cls is Row else rows), env


def load(paths) -> tuple[list[Row], list[HostRow], dict]:
    """Read result CSVs (files, or folders holding results.csv / host.csv) and merge them.

    A row met again in a later file replaces the earlier one. The merged environment keeps a
    value all sources agree on and joins differing values with ' | '.
    """
    results, host, envs = {}, {}, []
    for p in paths:
        p = Path(p)
        files = [f for f in (p / "results.csv", p / "host.csv") if f.exists()] if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"--report/--compare: {p} holds no results.csv or host.csv")
        for f in files:
            rows, env = read_csv(f)
            envs.append(env)
            for r in rows:
                key = (r.point + (r.impl,)) if isinstance(r, Row) else (r.op, r.dtype, r.shape, r.impl, r.mode)
                (results if isinstance(r, Row) else host)[key] = r
    return finalize(list(results.values())), list(host.values()), merge_env(envs)


def merge_env(envs: list[dict]) -> dict:
    merged: dict = {}
    for env in envs:
        for k, v in env.items():
            merged.setdefault(k, [])
            if str(v) not in merged[k]:
                merged[k].append(str(v))
    return {k: " | ".join(vs) for k, vs in merged.items()}


# ----------------------------------------------------------------------------- summary

def _num(v, spec=".0f") -> str:
    return "" if v is None else format(v, spec)


def fmt_gbps(v: Optional[float]) -> str:
    """GB/s to 3 significant digits below 100 (CPU runs, tiny points), whole numbers above."""
    return "" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.3g}")


def _median(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _worst(rows: list[Row], attr: str) -> Optional[Row]:
    rows = [r for r in rows if getattr(r, attr) is not None]
    return min(rows, key=lambda r: getattr(r, attr)) if rows else None


def groups(rows: list[Row]) -> dict:
    """{(op, dir, dtype): rows}, in the order first met."""
    out: dict = {}
    for r in rows:
        out.setdefault((r.op, r.dir, r.dtype), []).append(r)
    return out


def headline(rows: list[Row]) -> list[dict]:
    """Per op/dir/dtype and normkit implementation: worst and median fraction of the copy ceiling
    and ratio to the best peer, with the worst points named."""
    out = []
    for (op, d, dtype), grp in groups(rows).items():
        for impl in sorted({r.impl for r in grp if r.is_normkit}):
            mine = [r for r in grp if r.impl == impl and r.gbps is not None]
            wf, wr = _worst(mine, "frac_of_copy"), _worst(mine, "ratio_to_best_peer")
            out.append(dict(
                op=op, dir=d, dtype=dtype, impl=impl, points=len(mine),
                wrong=sum(r.wrong for r in grp if r.impl == impl),
                frac_worst=wf.frac_of_copy if wf else None, frac_worst_at=wf.shape if wf else "",
                frac_median=_median(r.frac_of_copy for r in mine),
                ratio_worst=wr.ratio_to_best_peer if wr else None, ratio_worst_at=wr.shape if wr else "",
                ratio_worst_peer=wr.best_peer if wr else "",
                ratio_median=_median(r.ratio_to_best_peer for r in mine),
            ))
    return out


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(b) + " |" for b in body]


def _point_table(grp: list[Row], impls: list[str]) -> list[str]:
    by_point: dict = {}
    for r in grp:
        by_point.setdefault((r.suite, r.M, r.N, r.shape), {})[r.impl] = r
    body = []
    for (suite, m, n, shape), cells in by_point.items():
        line = [suite, shape, str(m), str(n)]
        for impl in impls:
            r = cells.get(impl)
            line.append("" if r is None else ("WRONG " if r.wrong else "") + (fmt_gbps(r.gbps) if r.gbps is not None else "-"))
        any_row = next(iter(cells.values()))
        nk = [r for r in cells.values() if r.is_normkit and r.gbps is not None]
        line += [any_row.best_peer,
                 " / ".join(_num(r.ratio_to_best_peer, ".2f") for r in nk),
                 " / ".join(_num(r.frac_of_copy, ".2f") for r in nk)]
        body.append(line)
    return _table(["suite", "shape", "M", "N"] + impls + ["best peer", "normkit / best", "normkit / copy"], body)


ENV_KEYS = ("device", "gpu", "driver", "cuda", "torch", "triton", "liger", "quack", "normkit", "commit", "source_sha1",
            "date", "hostname", "copy_gbps", "timer", "warmup_ms", "rep_ms", "incomplete")


def summary_markdown(rows: list[Row], host_rows: list[HostRow], env: dict) -> str:
    """The report: environment, problems first (wrong results, errors, skipped implementations),
    normkit's headline per op/direction/dtype, the GB/s of every point, host overhead."""
    finalize(rows)
    out = [f"# normkit bench: {env.get('gpu') or env.get('device', '?')}", ""]
    if not (any(r.device == "cuda" for r in rows) or env.get("device") == "cuda"):
        out += ["**CPU run: the times are CPU timings at small sizes, not GPU bandwidth; there is no copy "
                "ceiling to compare with.**", ""]
    out += _table(["environment", ""], [[k, str(env[k])] for k in ENV_KEYS if env.get(k)])
    for section in (_problems, _headline_section, _points_section):
        out += [""] + section(rows, env)
    if host_rows:
        out += [""] + _host_section(host_rows) + [""] + host_cases_section(host_rows)
    return "\n".join(out) + "\n"


def _problems(rows: list[Row], env: dict) -> list[str]:
    out = ["## Wrong results (relative error against the float64 oracle above tolerance)", ""]
    out += [f"- **{r.impl}** {r.op} {r.dir} {r.dtype} {r.shape}: rel_err {r.rel_err:.3g} > {r.tol:.3g} {r.note}"
            for r in rows if r.wrong] or ["none"]
    out += ["", "## Not run at some points (errors and unsupported cases)", ""]
    out += [f"- {r.impl} {r.op} {r.dir} {r.dtype} {r.shape}: {r.note}" for r in rows if r.ok == "" and r.note] or ["none"]
    out += ["", "## Skipped implementations", ""]
    out += [f"- {k[len('skipped.'):]}: {v}" for k, v in env.items() if k.startswith("skipped.")] or ["none"]
    return out


def _headline_section(rows: list[Row], env: dict) -> list[str]:
    def worst(v, *where):
        return "n/a" if v is None else f"{v:.2f} ({', '.join(where)})"

    body = [[h["op"], h["dir"], h["dtype"], h["impl"], str(h["points"]), str(h["wrong"]),
             worst(h["frac_worst"], h["frac_worst_at"]), _num(h["frac_median"], ".2f") or "n/a",
             worst(h["ratio_worst"], h["ratio_worst_at"], h["ratio_worst_peer"]), _num(h["ratio_median"], ".2f") or "n/a"]
            for h in headline(rows)]
    return ["## normkit against the copy ceiling and the best peer", "",
            "Worst and median over the points of each op/direction/dtype; copy = GB/s over the device-to-device "
            "copy measured in the same run; vs best peer = GB/s over the fastest correct peer at the same point "
            "(above 1: normkit is faster). Points are named MxN.", ""] + _table(
        ["op", "dir", "dtype", "impl", "points", "wrong", "copy: worst (at)", "copy: median",
         "vs best peer: worst (at, peer)", "vs best peer: median"], body)


def _points_section(rows: list[Row], env: dict) -> list[str]:
    impls = list(dict.fromkeys(r.impl for r in rows))
    out = ["## GB/s per point", ""]
    for (op, d, dtype), grp in groups(rows).items():
        out += [f"### {op} {d} {dtype}", ""] + _point_table(grp, impls) + [""]
    return out


def _host_section(host_rows: list[HostRow]) -> list[str]:
    body = [[h.op, h.dtype, h.shape, h.impl, h.mode, _num(h.us_per_call, ".1f"), _num(h.latency_us, ".1f"), h.note]
            for h in host_rows]
    return ["## Host overhead per call (tiny decode-like input; GPU not the bottleneck)", "",
            "us/call: back-to-back calls timed by the host clock; latency: one call then synchronize.", ""] + _table(
        ["op", "dtype", "shape", "impl", "mode", "us/call", "latency us", "note"], body)


# ----------------------------------------------------------------------------- compare

def compare(old: list[Row], new: list[Row], threshold: float = 0.05, old_env=None, new_env=None) -> list[str]:
    """Lines saying what moved between two runs: GB/s changes beyond `threshold` (relative),
    correctness flips, and points present in only one run; normkit first, biggest moves first."""
    key = lambda r: r.point + (r.impl,)
    o, n = {key(r): r for r in old}, {key(r): r for r in new}
    lines = []
    if old_env is not None and new_env is not None:
        lines.append(f"copy ceiling: {old_env.get('copy_gbps', '?')} -> {new_env.get('copy_gbps', '?')} GB/s")
    moves = []
    for k in o.keys() & n.keys():
        a, b = o[k], n[k]
        if a.ok != b.ok:
            moves.append((not b.is_normkit, -math.inf, f"{_label(b)}: status {a.ok or 'not run'} -> {b.ok or 'not run'}"
                                                          f"{(' (' + b.note + ')') if b.note else ''}"))
        if a.gbps and b.gbps:
            change = b.gbps / a.gbps - 1
            if abs(change) >= threshold:
                moves.append((not b.is_normkit, -abs(change),
                              f"{_label(b)}: {a.gbps:.0f} -> {b.gbps:.0f} GB/s ({change:+.1%})"))
    lines += [m[2] for m in sorted(moves)]
    only_new, only_old = sorted(n.keys() - o.keys()), sorted(o.keys() - n.keys())
    if only_new:
        lines.append(f"{len(only_new)} rows only in the new run, e.g. {' '.join(map(str, only_new[0]))}")
    if only_old:
        lines.append(f"{len(only_old)} rows only in the old run, e.g. {' '.join(map(str, only_old[0]))}")
    if not moves:
        lines.append(f"no GB/s change of {threshold:.0%} or more and no correctness change in {len(o.keys() & n.keys())} common rows")
    return lines


def _label(r: Row) -> str:
    return f"{r.impl} {r.op} {r.dir} {r.dtype} {r.shape}"
