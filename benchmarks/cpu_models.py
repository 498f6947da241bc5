"""CPU model steps, unpatched next to normkit, in process time: the model bench's models, modes and
steps (normkit.bench.models.Work, tiny sizes, fp32), timed with time.process_time so that a loaded
shared machine (other processes taking the cores) does not add its waits to a step, which the
bench's wall clock does. Run it with one thread (OMP_NUM_THREADS=1): process time then counts the
one thread that runs the step. Rounds alternate the variants in one process; per round the median
step, then the median and spread over rounds.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/cpu_models.py [--models llama,unet1d] [--rounds 7] [--steps 15]

Prints per model and mode: ms per step unpatched, normkit, and unpatched / normkit [min-max over rounds].
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from normkit.bench import model_zoo
from normkit.bench.models import Work, apply_variant

MODELS = ("llama", "qwen3", "gemma", "unet2d", "unet1d", "dit", "sd3")  # dit, sd3: the adaLN models (session 16)


def build(name: str, mode: str, variant: str) -> Work:
    spec = model_zoo.SPECS[name]
    size = model_zoo.size_of(spec, "tiny")
    torch.manual_seed(0)
    model = spec.build(size, "cpu").to(torch.float32)
    apply_variant(variant, spec, model)
    return Work(spec, model, mode, spec.batch(size, "cpu", torch.float32, torch.Generator().manual_seed(1)), size,
                "cpu", torch.Generator().manual_seed(2))


def step_ms(work: Work, steps: int) -> float:
    times = []
    for _ in range(steps):
        work.prepare()
        t0 = time.process_time()
        work.step()
        times.append((time.process_time() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args()
    for name in a.models.split(","):
        for mode in model_zoo.SPECS[name].modes:
            works = {v: build(name, mode, v) for v in ("unpatched", "normkit")}
            for w in works.values():
                step_ms(w, 3)  # warm-up
            ms = {v: [] for v in works}
            for _ in range(a.rounds):
                for v, w in works.items():
                    ms[v].append(step_ms(w, a.steps))
            ratios = sorted(u / n for u, n in zip(ms["unpatched"], ms["normkit"]))
            print(f"{name:8s} {mode:7s} unpatched {statistics.median(ms['unpatched']):7.3f} ms  normkit "
                  f"{statistics.median(ms['normkit']):7.3f} ms  speedup {statistics.median(ratios):.2f} "
                  f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]", flush=True)


if __name__ == "__main__":
    main()
