"""Where a model step's host time goes, unpatched next to patched: for one bench model and mode,
the Python functions (cProfile, by own time) and the torch ops (torch.profiler, CPU self time) of
a few steps each, so a patched model that queues more host time than unpatched shows which calls
add it. The steps are the model bench's (normkit.bench.models.Work: train, infer or decode, eager
or torch.compile).

    PYTHONPATH=. python benchmarks/profile_model_host.py whisper-encoder train [--exec compile] [--steps 5] [--out DIR]

Writes DIR/<model>-<mode>-<exec>-host.txt (DIR default: .). On a CPU it runs tiny sizes (a dry run).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

import normkit
from normkit.bench import model_zoo
from normkit.bench.models import DTYPES, Work, apply_variant


def build(name: str, mode: str, exe: str, variant: str):
    spec = model_zoo.SPECS[name]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    size = model_zoo.size_of(spec, "full" if dev == "cuda" else "tiny")
    dtype = DTYPES[spec.dtype] if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    model = spec.build(size, dev).to(dtype)
    apply_variant(variant, spec, model)
    work = Work(spec, model, mode, spec.batch(size, dev, dtype, torch.Generator(device=dev).manual_seed(1)), size,
                dev, torch.Generator(device=dev).manual_seed(2))
    if exe == "compile":
        work.compile("inductor")

    def step():
        work.prepare()
        work.step()
    return step


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile(step, steps: int) -> str:
    for _ in range(3):  # past the host path's record-then-replay warm-up
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) / steps * 1e3  # queueing only: the GPU runs behind
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    sync()
    stats = pstats.Stats(pr).stats  # (file, line, function) -> (calls, ncalls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:30]
    text = io.StringIO()
    text.write(f"{'us/step own':>12} {'us/step cum':>12} {'calls/step':>10}  function\n")
    for (file, line, fn), (_, n, own, cum, _) in rows:
        text.write(f"{own / steps * 1e6:12.1f} {cum / steps * 1e6:12.1f} {n / steps:10.1f}  {fn} "
                   f"({'/'.join(file.split('/')[-2:])}:{line})\n")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync()
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    return f"host ms per step (queueing, no profiler): {host:.2f}\n\n-- cProfile, top by own time, {steps} steps\n" \
           f"{text.getvalue()}\n-- torch.profiler, CPU self time, {steps} steps\n{ops}\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("mode", choices=("train", "infer", "decode"))
    ap.add_argument("--exec", dest="exe", choices=("eager", "compile"), default="eager")
    ap.add_argument("--variants", default="unpatched,normkit")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    report = [f"{a.model} {a.mode} {a.exe}: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
              f"torch {torch.__version__}, host path {normkit._host.status}\n"]
    for variant in a.variants.split(","):
        torch._dynamo.reset()
        report.append(f"==================== {variant}\n")
        report.append(profile(build(a.model, a.mode, a.exe, variant), a.steps))
    out = Path(a.out) / f"{a.model}-{a.mode}-{a.exe}-host.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(report))
    for chunk in report[1:]:
        print(chunk.splitlines()[0])
    print("wrote", out)


if __name__ == "__main__":
    main()
