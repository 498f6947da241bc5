"""Session 10, helper hostclu10: host time per call of wide 16-bit rows (4 x 131072 bf16, which sm_90
runs on the CUDA backend's cluster kernels) on the Python host path (what these calls took before
plans could launch clusters) vs the C++ host path's plan replay, with torch's norm beside them; and
the replayed outputs / gradients bit for bit against the Python path's.

Two numbers per row: "host" is the host's own time per call (a GPU spin queued first keeps the
device busy, so no call waits on it), "loop" the back-to-back loop of normkit.bench's host table
(max of host and device time per call).

    python benchmarks/hostclu10_host.py --out DIR [--device cpu --n 4096]   # cpu: a dry run
"""
from __future__ import annotations

import argparse
import csv
import time

import torch
import torch.nn.functional as F

import normkit
from normkit import _host
from normkit.bench.timing import host_overhead

CALLS = 100  # per host-only measurement: a few hundred launches stay within the launch queue (~1024)


def host_only_us(call, device: str, trials: int = 5) -> float:
    """Median over trials of the host's time per call with the GPU kept busy by a spin."""
    out = []
    for _ in range(trials):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # ~100 ms at 2 GHz: longer than CALLS calls take the host
        t0 = time.perf_counter()
        for _ in range(CALLS):
            call()
        out.append((time.perf_counter() - t0) / CALLS * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
    return sorted(out)[len(out) // 2]


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--n", type=int, default=131072)
    args = ap.parse_args()
    dev, M, N = args.device, args.m, args.n
    ext = _host.activate() if dev == "cuda" else None
    print("host path:", _host.status if dev == "cuda" else "cpu dry run")
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.manual_seed(0)
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    w, b = torch.randn(N, device=dev, dtype=torch.bfloat16), torch.randn(N, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    ops = {"ln": (lambda x, w, b: normkit.layer_norm(x, N, w, b), lambda x, w, b: F.layer_norm(x, (N,), w, b), 3),
           "rms": (lambda x, w: normkit.rms_norm(x, N, w, 1e-6), lambda x, w: F.rms_norm(x, (N,), w, 1e-6), 2)}
    rows = []
    for op, (nk, pt, k) in ops.items():
        leaves = tuple(t.detach().clone().requires_grad_() for t in (x, w, b)[:k])
        for mode in ("fwd", "fwd+bwd"):
            def call(fn=None, nk=nk, leaves=leaves, mode=mode):
                fn = fn or nk
                if mode == "fwd":
                    with torch.no_grad():
                        return (fn(*leaves),)
                y = fn(*leaves)
                return (y.detach(),) + torch.autograd.grad(y, leaves, dy)

            with _host.python_path():
                ref = call()
                py_host = host_only_us(call, dev)
                py_loop, _ = host_overhead(call, sync)
            call(), call()  # the key's Python run, then its recording
            s0 = _host.stats()
            got = call()
            s1 = _host.stats()
            replays = s1.get("replays", 0) - s0.get("replays", 0)
            bitwise = all(same(g, r) for g, r in zip(got, ref)) and len(got) == len(ref)
            cpp_host = host_only_us(call, dev)
            cpp_loop, _ = host_overhead(call, sync)
            torch_host = host_only_us(lambda: call(pt), dev)
            torch_loop, _ = host_overhead(lambda: call(pt), sync)
            row = dict(op=op, shape=f"{M}x{N}", dtype="bf16", mode=mode, replays_per_call=replays,
                       python_runs=s1.get("python_runs", 0) - s0.get("python_runs", 0), bitwise_equal=bitwise,
                       python_host_us=round(py_host, 2), cpp_host_us=round(cpp_host, 2),
                       torch_host_us=round(torch_host, 2), python_loop_us=round(py_loop, 2),
                       cpp_loop_us=round(cpp_loop, 2), torch_loop_us=round(torch_loop, 2),
                       last_failure=s1.get("last_failure", ""))
            rows.append(row)
            print(row, flush=True)
    with open(f"{args.out}/hostclu10.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    if dev == "cuda" and ext is not None:
        print("stats:", _host.stats())


if __name__ == "__main__":
    main()
