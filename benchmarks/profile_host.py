"""Where the host time of a tiny normkit call goes (the bench's host-overhead cases: LayerNorm
4 x 4096 bf16, GroupNorm+Mish 2x64x64/g8): microseconds per call of each layer, from the bare
allocation and launch up to the public function, beside torch; then a cProfile of forward +
backward with autograd's backward run in this thread (so the profiler sees it).
Run on a GPU: PYTHONPATH=. python benchmarks/profile_host.py"""
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import normkit
from normkit.backends import triton as tb
from normkit.backends.triton import launch


def per_call(fn, n=3000):
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
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    _, mean, rstd = tb.row_norm_fwd(xd, wd, bd, 1e-5, False)
    dev = xd.device
    flags = (False, True, True, None, False)
    cfg, constexprs, device_index, sms = tb._plan("fwd", N, xd.dtype, dev, flags)
    y = torch.empty_like(xd)
    args = (xd, y, wd, bd, None, None, None, None, M, N, N, N, 1e-5)
    K = tb._kernels().fwd
    kernel = K.compiled(args, constexprs, cfg.options, device_index)
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    cvals = tuple(constexprs.values())

    def raw_run():
        kernel.run(1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *cvals)

    g = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    gw, gb = torch.randn(64, device="cuda", dtype=torch.bfloat16), torch.randn(64, device="cuda", dtype=torch.bfloat16)
    cases = {
        "torch.empty(M, N)": lambda: torch.empty((M, N), dtype=xd.dtype, device=dev),
        "torch.empty_like(x)": lambda: torch.empty_like(xd),
        "x.device": lambda: xd.device,
        "tb._plan (cached)": lambda: tb._plan("fwd", N, xd.dtype, dev, flags),
        "launch.spec_key(13 args)": lambda: launch.spec_key(args),
        "Kernel.compiled (lookup)": lambda: K.compiled(args, constexprs, cfg.options, device_index),
        "CompiledKernel.run (bare)": raw_run,
        "Kernel.__call__": lambda: K((M,), args, constexprs, cfg.options, device_index),
        "triton row_norm_fwd (no stats)": lambda: tb.row_norm_fwd(xd, wd, bd, 1e-5, False, store_stats=False),
        "triton row_norm_fwd": lambda: tb.row_norm_fwd(xd, wd, bd, 1e-5, False),
        "triton row_norm_bwd": lambda: tb.row_norm_bwd(dy, xd, wd, mean, rstd, False, w.dtype, b.dtype),
        "normkit ln fwd (no grad)": lambda: normkit.layer_norm(xd, (N,), wd, bd),
        "torch ln fwd (no grad)": lambda: F.layer_norm(xd, (N,), wd, bd),
        "normkit ln fwd (autograd)": lambda: normkit.layer_norm(x, (N,), w, b),
        "torch ln fwd (autograd)": lambda: F.layer_norm(x, (N,), w, b),
        "normkit ln fwd+bwd": lambda: torch.autograd.grad(normkit.layer_norm(x, (N,), w, b), (x, w, b), dy),
        "torch ln fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(x, (N,), w, b), (x, w, b), dy),
        "normkit gn+mish fwd (no grad)": lambda: normkit.group_norm(g, 8, gw, gb, activation="mish"),
        "triton group_norm_fwd": lambda: tb.group_norm_fwd(g, 8, gw, gb, 1e-5, "mish"),
        "torch mish(gn) fwd (no grad)": lambda: F.mish(F.group_norm(g, 8, gw, gb)),
    }
    for name, fn in cases.items():
        print(f"{name:32s} {per_call(fn):8.2f} us/call", flush=True)
    with torch.autograd.set_multithreading_enabled(False):
        print(f"{'ln fwd+bwd, backward inline':32s} {per_call(cases['normkit ln fwd+bwd']):8.2f} us/call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            cases["normkit ln fwd (no grad)"]()
            cases["normkit ln fwd+bwd"]()
        torch.cuda.synchronize()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
