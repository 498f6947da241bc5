"""A target for Nsight Compute: one GroupNorm forward then one backward (Triton backend) of each
shape under each of gn_sweep's variants (shapes outer, variants inner, in the order given); ncu
picks the kernels by name. On a GPU:
  ncu --kernel-name regex:'group_norm|col_sum' --section SpeedOfLight ... \
      python benchmarks/gn_ncu.py 8x320x64x64[,8x640x32x32] --cl [--variant default,staged-tiles] [--dtype bf16]
--copy adds a copy of the same bytes per shape (x.clone(), and torch.add(x, dy) for the backward's), the
ceiling of these sizes (gn_sweep's `copy` peer)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gn_sweep import VARIANTS, Overrides, as3  # noqa: E402

from normkit.backends import triton as tb  # noqa: E402
from normkit.bench.ops import DTYPES  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="BxCxHxW, or several joined by commas")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--cl", action="store_true", help="channels_last")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--variant", default="default", help="one of gn_sweep.VARIANTS, or several joined by commas")
    ap.add_argument("--copy", action="store_true", help="also a copy of the same bytes (clone, add) per shape")
    args = ap.parse_args()
    fmt = torch.channels_last if args.cl else torch.contiguous_format
    dtype = DTYPES[args.dtype]
    for spec in args.shape.split(","):
        shape = tuple(int(v) for v in spec.split("x"))
        x = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
        dy = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
        w, b = (torch.randn(shape[1], device="cuda", dtype=dtype) for _ in range(2))
        if args.copy:
            print(f"gn_ncu: {spec}{'/cl' if args.cl else ''} copy", flush=True)
            x.clone()
            torch.add(x, dy)
            torch.cuda.synchronize()
        for variant in args.variant.split(","):
            print(f"gn_ncu: {spec}{'/cl' if args.cl else ''} {variant}", flush=True)
            with Overrides(VARIANTS[variant]):
                x3, dy3 = as3(x, args.cl), as3(dy, args.cl)
                _, mean, rstd = tb.group_norm_fwd(x3, args.groups, w, b, 1e-5)
                tb.group_norm_bwd(dy3, x3, args.groups, w, b, mean, rstd, None, dtype, dtype)
                torch.cuda.synchronize()


if __name__ == "__main__":
    main()
