"""Measure, per pattern, dtype, width and mode, Inductor's code against normkit's fused op, and write
the table normkit.compile_fusion decides from (backends/triton/tuned/compile_<arch>.json).

Each point is a small function written in torch's ops (the pattern as an unpatched model has it:
add -> norm, norm -> activation, norm -> cast, a pointwise producer before GroupNorm + SiLU),
compiled twice on the same inputs: under policy("torch") (Inductor's own code) and under
policy("normkit") with enable_compile_fusion() (the pass folds the pattern into normkit's op). The
key is the one the pass computes for it (so table and pass agree by construction); a point wins
when normkit's median GPU time (host hidden behind a GPU spin) is at most WIN_RATIO of Inductor's;
a width class wins only if every point measured in it wins. Absent entries mean Inductor. A point's key
has the size class of its own input (below): a GroupNorm shape of GN_SHAPES under 2^22 elements files
under "|e16" / "|e20" even in the default run.

--elements also measures smaller inputs (decoding, small batches, late UNet stages): a point of fewer
than 2^22 elements goes under its size class's key ("...|e16", compile_fusion.size_class), and there
the host counts too: it wins only if normkit's GPU time wins as above and its back-to-back call
(host and GPU, a loop of calls as a host-bound step makes them) is no slower than Inductor's.

Compiling dominates: --jobs worker processes compile in parallel and take turns at the GPU (a lock
around the timing), and the run stops at --budget-s with what it has (every finished point is in
points-*.jsonl; --merge rebuilds the table from them). On a machine without a GPU (CI), --tiny runs a
few points on the CPU with the pass followed by aot_eager, which checks the plumbing, not speed.

    python benchmarks/compile_table.py --out DIR [--jobs 8] [--budget-s 420] [--write-table]
    python benchmarks/compile_table.py --out DIR --tiny
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIN_RATIO = 0.97          # normkit must be at least 3% faster to take a pattern from Inductor
ELEMENTS = 1 << 24        # elements per input tensor for the row patterns (a training-size step)
ROW_PATTERNS = ("rms", "ln", "add_rms", "add_ln", "ln_gelu", "rms_cast")
GN_PATTERNS = ("gn", "gn_silu", "gn_mish", "pw+gn_silu")
ROW_WIDTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
MODEL_WIDTHS = (768, 3584, 5120)  # ViT-B, Qwen-7B, Llama-13B: classes the powers of two also cover
# (batch, channels, spatial, groups): diffusion 2D blocks (spatial H*W) and seed 004's 1D blocks
GN_SHAPES = ((8, 320, 64 * 64, 32), (8, 640, 32 * 32, 32), (8, 1280, 16 * 16, 32), (8, 128, 128 * 128, 32),
             (1, 64, 1024, 8), (1, 256, 256, 8), (64, 512, 256, 8), (16, 256, 1024, 8))
DTYPES = ("bfloat16", "float32")
MODES = ("fwd", "train")


def plan(args) -> list[dict]:
    from normkit.compile_fusion import size_class
    pts = []
    for elements in args.elements:
        cls = size_class(elements)
        # GroupNorm below 2^22 elements: the same shapes with fewer samples, where that reaches the class
        gn_shapes = args.gn_shapes if cls is None or args.tiny else \
            [s for s in ((max(1, elements // (c * sp)), c, sp, g) for _, c, sp, g in args.gn_shapes)
             if size_class(s[0] * s[1] * s[2]) == cls]
        extra = {} if elements == ELEMENTS else {"elements": elements}
        for dtype in args.dtypes:
            for mode in args.modes:
                for pattern in args.patterns:
                    if pattern.startswith(("gn", "pw+gn")):
                        pts += [dict(pattern=pattern, dtype=dtype, mode=mode, shape=list(s)) for s in gn_shapes]
                    else:
                        pts += [dict(pattern=pattern, dtype=dtype, mode=mode, width=w, **extra) for w in args.widths]
    if args.winners is not None:  # only the classes whose plain entry says normkit
        pts = [p for p in pts if _plain_key(p) in args.winners]
    # the order a run cut short keeps: dtypes, then patterns as given, each key's points together
    order = {name: i for i, name in enumerate(args.dtypes + args.patterns)}
    pts.sort(key=lambda p: (order[p["dtype"]], order[p["pattern"]], _width(p), p["mode"]))
    seen, out = set(), []
    for p in pts:  # one point per input (a wide row at a small --elements is one row whatever it asked)
        k = (p["pattern"], p["dtype"], p["mode"], p.get("width"), tuple(p.get("shape", ())), _input_size(p))
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


def _rows(p) -> int:
    """A row pattern's row count: its --elements in rows of its width, at least one."""
    return max(1, p.get("elements", ELEMENTS) // p["width"])


def _input_size(p) -> int:
    """Elements of the point's input x."""
    return p["shape"][0] * p["shape"][1] * p["shape"][2] if "shape" in p else _rows(p) * p["width"]


def _width(p) -> int:
    """The point's width class: the row's, or the group's size."""
    from normkit.compile_fusion import width_class
    return width_class(p["width"] if "width" in p else p["shape"][1] // p["shape"][3] * p["shape"][2])


def _plain_key(p) -> str:
    """The point's key without layout or size class."""
    return f"{p['pattern']}|{p['dtype']}|{p['mode']}|{_width(p)}"


def _function(p):
    """(fn, inputs, params): the pattern as an unpatched model writes it."""
    import torch
    import torch.nn.functional as F
    dt, dev = getattr(torch, p["dtype"]), p["device"]
    grad = p["mode"] == "train"
    gen = torch.Generator().manual_seed(0)

    def t(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=gen)).to(dev, dt).requires_grad_(grad)

    pattern = p["pattern"]
    if "width" in p:
        n = p["width"]
        m = _rows(p)
        x, r, w, b = t(m, n), t(m, n), t(n, shift=1.0, scale=0.3), t(n, scale=0.3)
        norm = (lambda h: F.rms_norm(h, (n,), w, 1e-6)) if "rms" in pattern else \
            (lambda h: F.layer_norm(h, (n,), w, b, 1e-5))
        if pattern.startswith("add_"):
            return (lambda x, r: norm(x + r)), (x, r), (w, b)
        if pattern.endswith("_gelu"):
            return (lambda x: F.gelu(norm(x))), (x,), (w, b)
        if pattern.endswith("_cast"):  # an fp32 norm handing a bf16 matmul its input
            if dt != torch.float32:
                return None
            return (lambda x: norm(x).to(torch.bfloat16)), (x,), (w, b)
        return (lambda x: norm(x)), (x,), (w, b)
    B, C, S, G = p["shape"]
    x, r, w, b = t(B, C, S), t(B, C, S), t(C, shift=1.0, scale=0.3), t(C, scale=0.3)
    act = {"gn": None, "gn_silu": F.silu, "gn_mish": F.mish, "pw+gn_silu": F.silu}[pattern]
    gn = (lambda h: F.group_norm(h, G, w, b, 1e-5)) if act is None else (lambda h: act(F.group_norm(h, G, w, b, 1e-5)))
    if pattern.startswith("pw+"):
        return (lambda x, r: gn(x + r)), (x, r), (w, b)
    return (lambda x: gn(x)), (x,), (w, b)


def _own_code(fn, side):
    """fn with a code object of its own: Dynamo keeps compiled code per code object, so two
    torch.compile wrappers of one function would run whichever side compiled last."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{side}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _compiled(fn, policy, backend):
    import torch
    from normkit import compile_fusion as cf
    cf.decisions(clear=True)
    if backend == "inductor":
        compiled = torch.compile(fn, fullgraph=True)
    else:  # the pass, then aot_eager: the CPU check of this script
        from torch._dynamo.backends.common import aot_autograd

        def rewrite_then_eager(gm, example_inputs):
            cf.rewrite(gm.graph)
            gm.recompile()
            return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)
        compiled = torch.compile(fn, backend=rewrite_then_eager, fullgraph=True)
    return compiled


def _call(compiled, inputs, params, train):
    import torch
    if not train:  # the inputs need no grad: nothing is recorded
        return lambda: compiled(*inputs)
    leaves = list(inputs) + [q for q in params if q is not None]

    def step():
        out = compiled(*inputs)
        torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
    return step


def measure(p, lock, backend, warmup_ms, rep_ms) -> dict:
    import contextlib

    import torch
    from normkit import compile_fusion as cf
    from normkit.bench.timing import host_overheads, make_timer
    made = _function(p)
    if made is None:
        return dict(p, skipped="pattern not meaningful for this dtype")
    fn, inputs, params = made
    train = p["mode"] == "train"
    out = dict(p)
    runs = {}
    torch._dynamo.reset()
    for side, policy in (("inductor", "torch"), ("normkit", "normkit")):
        with cf.policy(policy), cf.enable_compile_fusion():
            compiled = _compiled(_own_code(fn, side), policy, backend)
            step = _call(compiled, inputs, params, train)
            if train:
                step()
            else:
                with torch.no_grad():
                    step()  # compiles
            made = cf.decisions()
        runs[side] = step
        out[f"{side}_decisions"] = made
    keys = {k for k, _ in out["normkit_decisions"]}
    if len(keys) != 1 or out["normkit_decisions"][0][1] != "normkit":
        return dict(out, skipped=f"the pass did not make one normkit op of it: {out['normkit_decisions']}")
    out["key"] = keys.pop()
    cls = cf.size_class(inputs[0].numel())
    out["key"] = cf.sized_key(out["key"], cls)  # the pass looks this size up under its class first
    timer = make_timer(p["device"])
    with lock:
        for side in ("inductor", "normkit", "inductor", "normkit"):  # interleaved, best of two medians
            if train:
                ms, _ = timer.median_ms([runs[side]], warmup_ms, rep_ms)
            else:
                with torch.no_grad():
                    ms, _ = timer.median_ms([runs[side]], warmup_ms, rep_ms)
            out[f"{side}_ms"] = min(ms, out.get(f"{side}_ms", float("inf")))
        if cls is not None:  # a small input: the back-to-back call, host included
            with contextlib.nullcontext() if train else torch.no_grad():
                loops = host_overheads({side: runs[side] for side in ("inductor", "normkit")}, timer.sync,
                                       budget_s=0.2)
            for side in ("inductor", "normkit"):
                out[f"{side}_call_us"] = loops[side][0]
            out["call_ratio"] = out["normkit_call_us"] / out["inductor_call_us"]
    out["ratio"] = out["normkit_ms"] / out["inductor_ms"]
    out["wins"] = out["ratio"] <= WIN_RATIO and out.get("call_ratio", 0.0) <= 1.0
    torch._dynamo.reset()
    return out


def _worker(k, jobs, points, out_dir, lock, backend, deadline, warmup_ms, rep_ms):
    if jobs > 1:  # the jobs compile side by side: a few of Inductor's compile threads each
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")
    import torch
    torch._dynamo.config.cache_size_limit = 64
    path = Path(out_dir) / f"points-{k}.jsonl"
    done = {json.dumps(json.loads(line)["point"], sort_keys=True) for line in path.read_text().splitlines()} \
        if path.exists() else set()
    for i, p in enumerate(points):
        if i % jobs != k or json.dumps(p, sort_keys=True) in done:
            continue
        if time.time() > deadline:
            break
        try:
            row = measure(p, lock, backend, warmup_ms, rep_ms)
        except Exception as e:  # a point that fails is recorded, and the table leaves it to Inductor
            row = dict(p, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        with path.open("a") as f:
            f.write(json.dumps({"point": p, "row": row}, default=str) + "\n")


def _environment(device: str, argv) -> dict:
    import torch
    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "command": "python benchmarks/compile_table.py " + " ".join(argv), "win_ratio": WIN_RATIO,
           "elements_per_row_input": ELEMENTS}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        env.update(gpu=torch.cuda.get_device_name(), arch=f"sm_{major}{minor}")
    else:
        env.update(gpu="none (CPU check run)", arch="cpu")
    return env


ABOUT = ("normkit.compile_fusion's table: keys pattern|dtype|mode|width class[|layout][|e<size class>]; wins = "
         "normkit's fused op measured faster than Inductor's code at every point of the class "
         "(benchmarks/compile_table.py); a key without a size class was measured at 2^22 elements or more, one "
         "with one (inputs below 2^22 elements) also with the back-to-back call (host included), which must not be "
         "slower either; a size without an entry takes the nearest size measured (compile_fusion._lookup)")


def merge(out_dir: Path, env: dict) -> dict:
    """The table from every points-*.jsonl under out_dir: one entry per key, winning only if every
    point of its width class wins."""
    rows = [json.loads(line)["row"] for path in sorted(out_dir.glob("points-*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]
    entries: dict = {}
    for r in rows:
        if "key" not in r or "ratio" not in r:
            continue
        e = entries.setdefault(r["key"], {"wins": True, "points": []})
        e["points"].append({k: r[k] for k in ("width", "shape", "elements", "normkit_ms", "inductor_ms", "ratio",
                                              "normkit_call_us", "inductor_call_us", "call_ratio") if k in r})
        e["wins"] = e["wins"] and r["wins"]
    for e in entries.values():
        e["ratio_worst"] = max(pt["ratio"] for pt in e["points"])
        calls = [pt["call_ratio"] for pt in e["points"] if "call_ratio" in pt]
        if calls:
            e["call_ratio_worst"] = max(calls)
    skipped = [r for r in rows if "key" not in r]
    return {"about": ABOUT, "environment": env, "entries": dict(sorted(entries.items())),
            "not_measured": [{k: r.get(k) for k in ("pattern", "dtype", "mode", "width", "shape", "skipped", "error")}
                             for r in skipped]}


def write_table(path: Path, table: dict, old) -> None:
    """The GPU's table: this run's entries, and the old table's entries of keys this run did not
    measure (a run of some patterns or sizes adds to the table); each run's environment kept."""
    out = dict(table)
    if old:
        out["entries"] = dict(sorted({**old.get("entries", {}), **table["entries"]}.items()))
        runs = old.get("runs", [old["environment"]] if "environment" in old else [])
        out["runs"] = runs + [table["environment"]]
    path.write_text(json.dumps(out, indent=1) + "\n")


def markdown(table: dict) -> str:
    env = table["environment"]
    lines = [f"# normkit vs Inductor per pattern ({env.get('gpu')}, torch {env.get('torch')}, "
             f"triton {env.get('triton', '-')}, {env.get('date')})", "",
             f"`{env.get('command')}`; wins: normkit's median GPU time <= {env.get('win_ratio')} x Inductor's at every "
             "point of the width class (and, in a size class, its back-to-back call no slower).", "",
             "| pattern | dtype | mode | width class | layout, size class | points | worst normkit/Inductor GPU | "
             "worst call | normkit? |", "|---|---|---|---|---|---|---|---|---|"]
    for k, e in table["entries"].items():
        pattern, dtype, mode, width, *rest = k.split("|")
        call = e.get("call_ratio_worst")
        lines.append(f"| {pattern} | {dtype} | {mode} | {width} | {' '.join(rest) or '-'} | {len(e['points'])} | "
                     f"{e['ratio_worst']:.2f} | {'-' if call is None else f'{call:.2f}'} | "
                     f"{'yes' if e['wins'] else 'no'} |")
    if table["not_measured"]:
        lines += ["", f"Not measured ({len(table['not_measured'])}):", ""]
        lines += [f"- {r}" for r in table["not_measured"][:40]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tiny", action="store_true", help="a few CPU points through the pass and aot_eager (CI)")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--patterns", default=",".join(ROW_PATTERNS + GN_PATTERNS))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--widths", default=",".join(map(str, ROW_WIDTHS + MODEL_WIDTHS)))
    ap.add_argument("--elements", default=str(ELEMENTS),
                    help="elements per input, comma-separated: 2^24 (the plain keys) and smaller sizes (their classes)")
    ap.add_argument("--winners-of", type=Path, default=None,
                    help="a table file: measure only the pattern / dtype / mode / width classes its plain entries "
                         "say normkit wins (at --elements: where a size has no entry of its own, the nearest measured size decides)")
    ap.add_argument("--write-table", action="store_true",
                    help="also write normkit/backends/triton/tuned/compile_<arch>.json: this run's entries replace "
                         "those of the same keys, the others stay")
    ap.add_argument("--merge", action="store_true", help="only rebuild the table from OUT's points")
    args = ap.parse_args(argv)
    args.patterns, args.dtypes, args.modes = (args.patterns.split(","), args.dtypes.split(","), args.modes.split(","))
    args.widths = [int(w) for w in args.widths.split(",")]
    args.elements = [int(e) for e in args.elements.split(",")]
    args.winners = None if args.winners_of is None else \
        {k for k, e in json.loads(args.winners_of.read_text())["entries"].items() if e.get("wins") and k.count("|") == 3}
    args.gn_shapes = GN_SHAPES
    import torch
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    backend = "inductor" if device == "cuda" else "rewrite+aot_eager"
    warmup_ms, rep_ms = (25, 100) if device == "cuda" else (1, 5)
    if args.tiny:
        args.patterns, args.dtypes, args.widths, args.jobs = ["add_rms", "ln_gelu", "pw+gn_silu"], ["float32"], [64], 1
        args.gn_shapes, args.elements = ((2, 16, 12, 4),), [64 * 64]
    args.out.mkdir(parents=True, exist_ok=True)
    env = _environment(device, argv)
    if not args.merge:
        points = [dict(p, device=device) for p in plan(args)]
        print(f"compile_table: {len(points)} points on {env['gpu']}, {args.jobs} jobs, budget {args.budget_s:.0f} s",
              flush=True)
        deadline = time.time() + args.budget_s
        ctx = mp.get_context("spawn")
        lock = ctx.Lock()
        if args.jobs == 1:
            _worker(0, 1, points, str(args.out), lock, backend, deadline, warmup_ms, rep_ms)
        else:
            procs = [ctx.Process(target=_worker, args=(k, args.jobs, points, str(args.out), lock, backend, deadline,
                                                       warmup_ms, rep_ms)) for k in range(args.jobs)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(max(1.0, deadline + 60 - time.time()))
                if proc.is_alive():  # a point past the budget: what it finished is on disk
                    proc.terminate()
    table = merge(args.out, env)
    (args.out / "compile_table.json").write_text(json.dumps(table, indent=1) + "\n")
    (args.out / "compile_table.md").write_text(markdown(table))
    if args.write_table and env["arch"] != "cpu":
        from normkit.compile_fusion import table_path
        path = table_path(env["arch"])
        write_table(path, table, json.loads(path.read_text()) if path.exists() else None)
    n = sum(len(e["points"]) for e in table["entries"].values())
    print(f"compile_table: {n} points measured, {len(table['entries'])} keys "
          f"({sum(e['wins'] for e in table['entries'].values())} normkit), {len(table['not_measured'])} not measured; "
          f"{args.out / 'compile_table.md'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
