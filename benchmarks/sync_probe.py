"""Where does a model step synchronize with the GPU, and does patching add a synchronization? (session 14: the
SD-1.5 UNet's step waits for the GPU in both variants, and its host time from an idle GPU read 52 ms patched
against 30 ms unpatched while the step itself was faster patched.)

  PYTHONPATH=. python benchmarks/sync_probe.py [--model sd15-unet] [--batch 1] [--trials 5]

For each variant (unpatched, normkit): one inference step under torch.cuda.set_sync_debug_mode("warn"), the
synchronizing calls' Python locations counted; then the host ms of a step queued from an idle GPU and behind a GPU
spin (medians of --trials), and the step's wall time with a synchronize."""
import argparse
import collections
import statistics
import time
import warnings

import torch

import normkit
from normkit.bench import model_zoo


def step_ms(fn, spin_ms=0.0):
    torch.cuda.synchronize()
    if spin_ms:
        torch.cuda._sleep(int(spin_ms * 1.4e6))  # ~1.4-1.98 GHz: roughly spin_ms of GPU time
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sd15-unet")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--trials", type=int, default=5)
    a = ap.parse_args()
    spec = model_zoo.SPECS[a.model]
    size = model_zoo.size_of(spec, "full", a.batch)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[spec.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for variant in ("unpatched", "normkit"):
        model = spec.build(size, "cuda").to(dtype).eval()
        if variant == "normkit":
            normkit.patch(model)
        batch = spec.batch(size, "cuda", dtype, gen)
        with torch.no_grad():
            run = lambda: spec.output(model, batch)  # noqa: E731
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run()
                torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(0)
            where = collections.Counter(f"{w.filename}:{w.lineno}: {str(w.message)[:80]}" for w in caught)
            print(f"{variant}: {sum(where.values())} synchronizing calls in one step")
            for k, n in where.most_common(12):
                print(f"  {n} x {k}")
            idle = [step_ms(run) for _ in range(a.trials)]
            spun = [step_ms(run, 120.0) for _ in range(a.trials)]
            print(f"{variant}: host ms from an idle GPU {statistics.median(h for h, _ in idle):.1f} "
                  f"(wall {statistics.median(w for _, w in idle):.1f}); behind a ~120 ms spin host "
                  f"{statistics.median(h for h, _ in spun):.1f}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
