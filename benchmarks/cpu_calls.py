"""Per-call CPU cost of normkit's GroupNorm / LayerNorm / RMSNorm against torch's own, in process time
(hot loops; one thread). Run one tree's normkit per process, alternating trees, e.g.

    for t in base branch base branch; do OMP_NUM_THREADS=1 PYTHONPATH=/path/to/$t python benchmarks/cpu_calls.py; done

Prints per case: us per call, fwd (no grad) and fwd + backward(dy), medians over --rounds rounds of
--calls calls; the torch rows are torch's modules / functions (nn.GroupNorm + F.mish, ...).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import normkit

ACT = {None: lambda t: t, "mish": F.mish, "silu": F.silu}


def cases():
    g = torch.Generator().manual_seed(0)

    def t(*s, grad=True):
        return torch.randn(*s, generator=g).requires_grad_(grad)

    out = []
    for shape, groups, act, cl in (((1, 32, 16), 8, "mish", False), ((1, 16, 32), 8, "mish", False),
                                   ((2, 32, 16, 16), 8, "silu", False), ((2, 32, 8, 8), 8, "silu", True),
                                   ((2, 32, 64), 8, None, False)):
        x, w, b = t(*shape), t(shape[1]), t(shape[1])
        if cl:
            x = x.detach().to(memory_format=torch.channels_last).requires_grad_()
        name = f"GN{'+' + act if act else ''} {'x'.join(map(str, shape))}{' cl' if cl else ''}"
        out.append((name, x, w, b,
                    lambda x, w, b, G=groups, a=act: normkit.group_norm(x, G, w, b, activation=a),
                    lambda x, w, b, G=groups, a=act: ACT[a](F.group_norm(x, G, w, b))))
    x, w, b = t(64, 64), t(64), t(64)
    out.append(("LN 64x64", x, w, b, lambda x, w, b: normkit.layer_norm(x, 64, w, b),
                lambda x, w, b: F.layer_norm(x, (64,), w, b)))
    return out


def per_call_us(fn, args, dy, calls, grad):
    if grad:
        t0 = time.process_time()
        for _ in range(calls):
            fn(*args).backward(dy)
    else:
        with torch.no_grad():
            t0 = time.process_time()
            for _ in range(calls):
                fn(*args)
    return (time.process_time() - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--torch", action="store_true", help="also time torch's own ops")
    a = ap.parse_args()
    print(f"normkit from {normkit.__file__}; threads {torch.get_num_threads()}")
    for name, x, w, b, nk, ref in cases():
        dy = torch.randn_like(x)
        variants = {"normkit": nk} | ({"torch": ref} if a.torch else {})
        res = {}
        for v, fn in variants.items():
            for grad in (False, True):
                per_call_us(fn, (x, w, b), dy, 20, grad)  # warm-up
                res[v, grad] = [per_call_us(fn, (x, w, b), dy, a.calls, grad) for _ in range(a.rounds)]
        line = f"{name:24s}"
        for v in variants:
            line += f"  {v}: fwd {statistics.median(res[v, False]):7.1f}  fwd+bwd {statistics.median(res[v, True]):7.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
