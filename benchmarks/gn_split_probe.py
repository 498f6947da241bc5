"""Issue 24 (session 28): the ceiling of a two-launch GroupNorm (a statistics pass over x, then an apply pass that
reads x again and writes y), with no GroupNorm arithmetic: can the second read come from L2 at diffusion sizes?

Per shape (bf16, the bytes of B x C x H x W), each timed on a ring of inputs over 4x L2 (every call starts cold), as
a fraction of a 1 GiB copy (forward bytes: x read + y written; backward: x, dy read + dx written):
  copy        one launch: y = x - p (p one float per block): the same-size copy
  read        the statistics pass alone: a sum per block of BLOCK elements
  read+apply  the two launches back to back, in block order
  rl+apply-r  the read with evict_last, then the apply last block first with evict_first (the order staged/split2 use)
  bwd copy2   dx = x + dy (two reads, one write); bwd read2+apply2 the backward's two launches the same way
  normkit     normkit.group_norm forward (and forward + backward's backward alone) NCHW and channels_last, committed
Run on a GPU: PYTHONPATH=. python benchmarks/gn_split_probe.py [8x320x64x64,...]
(After run S28-1 the loads and the timing went through one helper each, _load and timed: the same calls.)
"""
import functools
import sys

import torch
import triton
import triton.language as tl

import normkit
from normkit.bench.timing import CudaTimer, copy_ceiling_gbps

BLOCK = 8192


@triton.jit
def _load(P, offs, m, POLICY: tl.constexpr):
    """fp32 values of P at offs; POLICY 1: evict_last (kept in L2), 2: evict_first, else the default."""
    if POLICY == 1:
        v = tl.load(P + offs, mask=m, other=0.0, eviction_policy="evict_last")
    elif POLICY == 2:
        v = tl.load(P + offs, mask=m, other=0.0, eviction_policy="evict_first")
    else:
        v = tl.load(P + offs, mask=m, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _read(X, DY, P, n, BLOCK: tl.constexpr, TWO: tl.constexpr, KEEP: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = _load(X, offs, m, 1 if KEEP else 0)
    if TWO:
        x = x * _load(DY, offs, m, 1 if KEEP else 0)
    tl.store(P + pid, tl.sum(x, axis=0))


@triton.jit
def _apply(X, DY, Y, P, n, BLOCK: tl.constexpr, TWO: tl.constexpr, REVERSE: tl.constexpr, FIRST: tl.constexpr):
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = _load(X, offs, m, 2 if FIRST else 0)
    if TWO:
        x += _load(DY, offs, m, 2 if FIRST else 0)
    tl.store(Y + offs, (x - tl.load(P + pid)).to(Y.dtype.element_ty), mask=m)


def main():
    shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else
              "8x320x64x64,16x640x32x32,32x256x56x56,4x128x128x128,8x1280x16x16").split(",")]
    timer = CudaTimer()
    copy = copy_ceiling_gbps(timer, 25, 100)
    print(f"copy {copy:.0f} GB/s", flush=True)
    G, eps = 32, 1e-5

    def timed(name, calls, nbytes):
        """'name: us per call, fraction of copy' of calls rotating over the ring (the first one untimed)."""
        calls[0]()
        ms, _ = timer.median_ms(calls, 10, 60)
        return f"{name} {ms * 1e3:.1f} us {nbytes / (ms * 1e6) / copy:.3f}"

    for shape in shapes:
        B, C = shape[:2]
        n = torch.Size(shape).numel()
        nb = triton.cdiv(n, BLOCK)
        ring = max(2, -(-4 * 60 * 2**20 // (3 * n * 2)))
        sets = [(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
                 torch.randn(shape, device="cuda", dtype=torch.bfloat16)) for _ in range(ring)]
        p = torch.empty(nb, device="cuda")
        y = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(C, device="cuda")).to(torch.bfloat16)
        b = (0.1 * torch.randn(C, device="cuda")).to(torch.bfloat16)
        grid = (nb,)

        def read(x, dy, two, keep):
            _read[grid](x, dy, p, n, BLOCK, two, keep, num_warps=8)

        def apply(x, dy, two, rev, first):
            _apply[grid](x, dy, y, p, n, BLOCK, two, rev, first, num_warps=8)

        def gn_bwd(x, dy, cl):
            x = x.to(memory_format=torch.channels_last) if cl else x
            x.requires_grad_(True)
            out = normkit.group_norm(x, G, w, b, eps)
            return lambda: torch.autograd.grad(out, x, dy, retain_graph=True)

        fwd = {
            "copy": lambda x, dy: apply(x, dy, False, False, False),
            "read": lambda x, dy: read(x, dy, False, False),
            "read+apply": lambda x, dy: (read(x, dy, False, False), apply(x, dy, False, False, False)),
            "rl+apply-r": lambda x, dy: (read(x, dy, False, True), apply(x, dy, False, True, True)),
            "normkit nchw": lambda x, dy: normkit.group_norm(x, G, w, b, eps),
        }
        bwd = {
            "copy2": lambda x, dy: apply(x, dy, True, False, False),
            "read2": lambda x, dy: read(x, dy, True, False),
            "read2+apply2": lambda x, dy: (read(x, dy, True, False), apply(x, dy, True, False, False)),
            "rl2+apply2-r": lambda x, dy: (read(x, dy, True, True), apply(x, dy, True, True, True)),
        }
        cl_sets = [(x.to(memory_format=torch.channels_last), dy) for x, dy in sets]
        fwd_bytes, bwd_bytes = 2 * n * 2, 3 * n * 2
        line = [timed(name, [functools.partial(fn, x, dy) for x, dy in sets], fwd_bytes) for name, fn in fwd.items()]
        line.append(timed("normkit cl", [functools.partial(normkit.group_norm, x, G, w, b, eps) for x, _ in cl_sets],
                          fwd_bytes))
        print("x".join(map(str, shape)), "fwd:", "; ".join(line), flush=True)
        line = [timed(name, [functools.partial(fn, x, dy) for x, dy in sets], bwd_bytes) for name, fn in bwd.items()]
        line += [timed(f"normkit {'cl' if cl else 'nchw'} bwd", [gn_bwd(x, dy, cl) for x, dy in sets], bwd_bytes)
                 for cl in (False, True)]
        print("x".join(map(str, shape)), "bwd:", "; ".join(line), flush=True)
        del sets, cl_sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
