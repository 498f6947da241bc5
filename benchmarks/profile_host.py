"""Host time per call of normkit's eager path next to torch eager's, on the bench's tiny inputs
(the GPU finishes each call before the host has queued the next, so a back-to-back loop measures
what the host spends): LayerNorm and RMSNorm 4 x 4096, GroupNorm 2 x 64 x 64 with 8 groups, alone
and with Mish (torch: group_norm then mish), bf16; forward without grad, and forward + backward
(torch.autograd.grad of x, weight, bias).

Implementations, interleaved round by round in one process:
  normkit         normkit's public functions with the C++ host path (normkit._host)
  normkit-python  the same calls with the C++ host path off (the Python path: autograd.Function)
  torch           torch.nn.functional
  normkit-direct  (forward only) the C++ entry point called directly, without normkit.functional

Run on a GPU: PYTHONPATH=. python benchmarks/profile_host.py [--out DIR] [--rounds 9]
Writes DIR/host.csv and DIR/host.md (medians over rounds, with the min-max spread).
"""
import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import normkit
from normkit import _host

DTYPE = torch.bfloat16


def per_call_us(fn, budget_s: float) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    while n < 50 or time.perf_counter() - t0 < budget_s:
        for _ in range(50):
            fn()
        n += 50
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def cases():
    """(op, shape, normkit fn, torch fn, direct fn or None); each fn(x, w, b) -> y."""
    N = 4096
    ext = _host.fast if _host.fast is not None and not isinstance(_host.fast, _host._Pending) else None
    mish = "mish"
    return [
        ("ln", (4, N), lambda x, w, b: normkit.layer_norm(x, N, w, b), lambda x, w, b: F.layer_norm(x, (N,), w, b),
         ext and (lambda x, w, b: ext.row_norm(x, N, w, b, 1e-5, False, None, None))),
        ("rms", (4, N), lambda x, w, b: normkit.rms_norm(x, N, w, 1e-6), lambda x, w, b: F.rms_norm(x, (N,), w, 1e-6),
         ext and (lambda x, w, b: ext.row_norm(x, N, w, None, 1e-6, True, None, None))),
        ("gn", (2, 64, 64), lambda x, w, b: normkit.group_norm(x, 8, w, b), lambda x, w, b: F.group_norm(x, 8, w, b),
         ext and (lambda x, w, b: ext.group_norm(x, 8, w, b, 1e-5, None, None))),
        ("gn+mish", (2, 64, 64), lambda x, w, b: normkit.group_norm(x, 8, w, b, activation=mish),
         lambda x, w, b: F.mish(F.group_norm(x, 8, w, b)),
         ext and (lambda x, w, b: ext.group_norm(x, 8, w, b, 1e-5, mish, None))),
    ]


def inputs(op, shape):
    x = torch.randn(shape, device="cuda", dtype=DTYPE)
    C = shape[-1] if op in ("ln", "rms") else shape[1]
    w = torch.randn(C, device="cuda", dtype=DTYPE)
    b = None if op == "rms" else torch.randn(C, device="cuda", dtype=DTYPE)
    return x, w, b


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per timing")
    args = ap.parse_args()
    _host.activate()
    print(f"host path: {_host.status}", flush=True)
    rows = []
    for op, shape, nk, th, direct in cases():
        x, w, b = inputs(op, shape)
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
        lx, lw, lb = leaves + [None] * (3 - len(leaves))
        dy = torch.randn(shape, device="cuda", dtype=DTYPE)
        impls = {"normkit": nk, "normkit-python": nk, "torch": th}
        if direct is not None:
            impls["normkit-direct"] = direct
        for mode in ("fwd", "fwd+bwd"):
            calls = {}
            for name, fn in impls.items():
                if mode == "fwd":
                    calls[name] = (lambda fn=fn: fn(x, w, b))
                elif name != "normkit-direct":
                    calls[name] = (lambda fn=fn: torch.autograd.grad(fn(lx, lw, lb), leaves, dy))
            times = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    if name == "normkit-python":
                        with _host.python_path():
                            times[name].append(per_call_us(call, args.budget))
                    else:
                        times[name].append(per_call_us(call, args.budget))
            for name, ts in times.items():
                rows.append(dict(op=op, shape="x".join(map(str, shape)), dtype="bf16", mode=mode, impl=name,
                                 us_per_call=statistics.median(ts), us_min=min(ts), us_max=max(ts)))
                print(f"{op:8s} {mode:8s} {name:15s} {statistics.median(ts):8.2f} us/call "
                      f"({min(ts):.2f}-{max(ts):.2f})", flush=True)
    stats = _host.stats()
    print(f"host path counters: {stats}")
    if args.out:
        import triton

        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "host path": _host.status, "command": "PYTHONPATH=. python benchmarks/profile_host.py --out DIR"}
        write(args.out, rows, stats, env)


def write(out: Path, rows, stats, env: dict):
    """host.csv and host.md from the rows (dicts of op, shape, dtype, mode, impl, us_per_call, us_min, us_max)."""
    out.mkdir(parents=True, exist_ok=True)
    header = "".join(f"# {k}: {v}\n" for k, v in env.items())
    cols = list(rows[0])
    (out / "host.csv").write_text(header + ",".join(cols) + "\n" + "".join(
        ",".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + "\n" for r in rows))
    by = {(r["op"], r["mode"], r["impl"]): r for r in rows}
    md = ["# Host time per call: normkit vs torch eager", "", *(f"- {k}: {v}" for k, v in env.items()), "",
          "Microseconds per call (median of rounds, min-max in brackets), back-to-back calls on tiny bf16 inputs.",
          "", "| op | shape | mode | normkit (C++ host path) | normkit Python path | torch eager | normkit / torch |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["impl"] != "normkit":
            continue
        key = (r["op"], r["mode"])
        cell = lambda impl: (lambda q: f"{q['us_per_call']:.1f} ({q['us_min']:.1f}-{q['us_max']:.1f})")(  # noqa: E731
            by[key + (impl,)])
        md.append(f"| {r['op']} | {r['shape']} | {r['mode']} | {cell('normkit')} | {cell('normkit-python')} | "
                  f"{cell('torch')} | {r['us_per_call'] / by[key + ('torch',)]['us_per_call']:.2f} |")
    direct = [r for r in rows if r["impl"] == "normkit-direct"]
    if direct:
        md += ["", "The C++ entry point alone (without normkit.functional's Python function), forward: " + ", ".join(
            f"{r['op']} {r['us_per_call']:.1f} us" for r in direct) + "."]
    md += ["", f"Host path counters after the run: {stats}"]
    (out / "host.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
