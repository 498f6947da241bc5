"""Which host work a forward + backward call costs: torch.profiler's CPU events (count and self CPU time per
call) for normkit's and torch's LayerNorm / RMSNorm 4 x 4096 bf16, profile_host.py's cases, torch.autograd.grad
of x, weight (and bias). Session 25: the host table's plain LayerNorm fwd+bwd at 1.03x torch's while RMSNorm's
is at 0.88x: what does LayerNorm's backward add?

Run on a GPU: PYTHONPATH=.:benchmarks python benchmarks/host_ops_profile.py [--calls 200] [--ops ln,rms]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from normkit import _host
from profile_host import cases, inputs, per_call_us


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--ops", default="ln,rms")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    _host.activate()
    print(f"host path: {_host.status}", flush=True)
    for op, shape, nk, th, _ in cases():
        if op not in args.ops.split(","):
            continue
        x, w, b = inputs(op, shape)
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
        lx, lw, lb = leaves + [None] * (3 - len(leaves))
        dy = torch.randn(shape, device="cuda", dtype=x.dtype)
        for name, fn in (("normkit", nk), ("torch", th)):
            call = lambda fn=fn: torch.autograd.grad(fn(lx, lw, lb), leaves, dy)  # noqa: E731
            us = per_call_us(call, 0.2)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.calls):
                    call()
                torch.cuda.synchronize()
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
            print(f"== {op} {name} fwd+bwd: {us:.1f} us a call unprofiled; per call under the profiler:")
            for e in events:
                print(f"   {e.key[:70]:70} {e.count / args.calls:5.2f}x  self {e.self_cpu_time_total / args.calls:7.2f} us")


if __name__ == "__main__":
    main()
