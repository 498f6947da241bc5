"""Issue 24 (session 23): why `normkit bench --suites gn-2d` times GroupNorm lower than gn_sweep.py. One process,
one timer (bench.timing.CudaTimer), the same ring of inputs: the Triton backend's function (gn_sweep's call), the
public `normkit.group_norm` (the bench's call), torch.compile's (both harnesses' peer) and a same-size copy, each
timed twice in turn with the bench's and gn_sweep's warm-up / repetition budgets; then the kernels each launches
(torch.profiler). Run on a GPU:
  PYTHONPATH=. python benchmarks/gn_entry_probe.py [8x320x64x64,8x640x32x32]
"""
import functools
import sys

import torch
import torch.nn.functional as F

import normkit
from normkit.backends import triton as tb
from normkit.bench.timing import CudaTimer, copy_ceiling_gbps


def main():
    shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else
                                                             "8x320x64x64,8x640x32x32").split(",")]
    timer = CudaTimer()
    copy = copy_ceiling_gbps(timer, 25, 100)
    print(f"copy {copy:.0f} GB/s")
    G, eps = 32, 1e-5
    compiled = torch.compile(lambda x, w, b: F.group_norm(x, G, w, b, eps), dynamic=False)
    for shape in shapes:
        B, C = shape[:2]
        numel = torch.Size(shape).numel()
        nbytes = 2 * numel * 2
        ring = max(2, -(-4 * 60 * 2**20 // nbytes))
        xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(ring)]
        w = (1 + 0.1 * torch.randn(C, device="cuda")).to(torch.bfloat16)
        b = (0.1 * torch.randn(C, device="cuda")).to(torch.bfloat16)
        impls = {
            "backend": lambda x: tb.group_norm_fwd(x.view(B, C, -1), G, w, b, eps, None),
            "public": lambda x: normkit.group_norm(x, G, w, b, eps),
            "compile": lambda x: compiled(x, w, b),
            "copy": lambda x: x.clone(),
        }
        for budgets in ((25, 100), (10, 30)):
            for rep in range(2):
                line = []
                for name, fn in impls.items():
                    calls = [functools.partial(fn, x) for x in xs]
                    if rep == 0 and budgets == (25, 100):
                        calls[0]()
                    torch.cuda.synchronize()
                    ms, n = timer.median_ms(calls, *budgets)
                    line.append(f"{name} {ms * 1e3:.1f} us ({nbytes / (ms * 1e6) / copy:.3f}, {n} reps)")
                print("x".join(map(str, shape)), f"warm/rep {budgets} #{rep}:", "; ".join(line), flush=True)
        from torch.profiler import ProfilerActivity, profile
        for name, fn in impls.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(10):
                    fn(xs[i % ring])
                torch.cuda.synchronize()
            rows = [(e.key[:50], e.device_time_total / 10, e.count) for e in prof.key_averages() if e.device_time_total > 0]
            print(f"  kernels {name}: " + "; ".join(f"{k} {t:.1f}us x{c // 10}" for k, t, c in sorted(rows, key=lambda r: -r[1])))


if __name__ == "__main__":
    main()
