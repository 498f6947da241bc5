"""Where the host time of a tiny normkit call goes (the bench's host-overhead case, 4 x 4096 bf16):
microseconds per call of each layer, then a cProfile of forward + backward with autograd's
backward run in this thread (so the profiler sees it). Run on a GPU: python benchmarks/profile_host.py"""
import cProfile
import pstats
import time

import torch

import normkit
from normkit.backends import triton as tb


def per_call(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    M, N = 4, 4096
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    xd = x.detach()
    _, mean, rstd = tb.row_norm_fwd(xd, w.detach(), b.detach(), 1e-5, False)
    cases = {
        "triton row_norm_fwd": lambda: tb.row_norm_fwd(xd, w.detach(), b.detach(), 1e-5, False),
        "triton row_norm_bwd": lambda: tb.row_norm_bwd(dy, xd, w.detach(), mean, rstd, False, w.dtype, b.dtype),
        "normkit fwd (no grad)": lambda: normkit.layer_norm(xd, (N,), w.detach(), b.detach()),
        "normkit fwd (autograd)": lambda: normkit.layer_norm(x, (N,), w, b),
        "normkit fwd+bwd": lambda: torch.autograd.grad(normkit.layer_norm(x, (N,), w, b), (x, w, b), dy),
        "torch fwd+bwd": lambda: torch.autograd.grad(torch.nn.functional.layer_norm(x, (N,), w, b), (x, w, b), dy),
        "torch empty x4": lambda: [torch.empty(N, device="cuda") for _ in range(4)],
    }
    for name, fn in cases.items():
        print(f"{name:28s} {per_call(fn):8.1f} us/call")
    with torch.autograd.set_multithreading_enabled(False):
        print(f"{'fwd+bwd, backward inline':28s} {per_call(cases['normkit fwd+bwd']):8.1f} us/call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            cases["normkit fwd+bwd"]()
        torch.cuda.synchronize()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
