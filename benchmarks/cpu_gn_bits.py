"""Census of CPU GroupNorm bits: the default eager path (torch's nodes for centred groups, CpuGroupNorm
off-centre) against the general path (GroupNormFn, backend="torch") and the custom op compiled
(aot_eager), output and gradients compared bitwise, over activations, dtypes, x layouts, affine
parameters, offsets and dy layouts (x's format, channels_last, transposed, a sum's expanded ones).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/cpu_gn_bits.py [mish,silu,gelu,gelu_tanh,relu,none]

Prints each case that differs, then how many were checked and differed, and the default path's
grad_fn names. (A bias without a weight is left out: torch's native_group_norm_backward raises there.)
"""
from __future__ import annotations

import itertools
import sys

import torch

import normkit


def grads(fn, x, w, b, dy, mode):
    y = fn(x, w, b)
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    g = torch.autograd.grad(y.sum(), leaves) if mode == "sum" else torch.autograd.grad(y, leaves, dy)
    return [y.detach()] + list(g), y.grad_fn.name()


def main():
    acts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mish", "silu", "gelu", "gelu_tanh", "relu", "none"]
    torch.manual_seed(0)
    bad = n = 0
    nodes = {}
    for shape, act, dtype, layout, affine, off, mode in itertools.product(
            [(1, 32, 16), (2, 16, 7), (3, 8, 5, 7), (2, 32, 16, 16), (1, 12, 33)], acts,
            [torch.float32, torch.bfloat16, torch.float16, torch.float64], [None, torch.channels_last],
            ["wb", "w", "none"], [0.0, 3.0], ["contig", "cl", "transposed", "sum"]):
        act = None if act == "none" else act
        if (layout is not None or mode == "cl") and len(shape) != 4:
            continue
        x = (torch.randn(shape) + off).to(dtype)
        x = (x if layout is None else x.contiguous(memory_format=layout)).requires_grad_()
        pd = torch.float32 if dtype == torch.bfloat16 else dtype
        w = torch.randn(shape[1], dtype=pd).requires_grad_() if "w" in affine else None
        b = torch.randn(shape[1], dtype=pd).requires_grad_() if "b" in affine else None
        dy = torch.randn(shape).to(dtype)
        if mode == "cl":
            dy = dy.contiguous(memory_format=torch.channels_last)
        if mode == "transposed":
            dy = torch.randn(shape[::-1]).to(dtype).permute(*range(len(shape) - 1, -1, -1))
        eager, node = grads(lambda x, w, b: normkit.group_norm(x, 4, w, b, activation=act), x, w, b, dy, mode)
        nodes[node] = nodes.get(node, 0) + 1
        general, _ = grads(lambda x, w, b: normkit.group_norm(x, 4, w, b, activation=act, backend="torch"),
                           x, w, b, dy, mode)
        torch._dynamo.reset()
        compiled, _ = grads(torch.compile(lambda x, w, b: normkit.group_norm(x, 4, w, b, activation=act),
                                          backend="aot_eager", fullgraph=True), x, w, b, dy, mode)
        for what, other in (("general", general), ("compiled", compiled)):
            n += 1
            if not all(a.dtype == c.dtype and torch.equal(a, c) for a, c in zip(eager, other)):
                bad += 1
                print("DIFF", what, shape, act, dtype, layout, affine, off, mode, node,
                      [float((a.double() - c.double()).abs().max()) for a, c in zip(eager, other)], flush=True)
    print("checked", n, "differ", bad, nodes)


if __name__ == "__main__":
    main()
