"""A target for Nsight Compute (session 18): the 16-bit row forward at one width under fwd_sweep's variants (the
table's tile, the looped kernels vl*), then torch.compile's kernel for the same call, each launched twice after a
warm-up (ncu picks them by name: row_norm_fwd_kernel, triton_red_). The question it answers: does a looped kernel's
second pass over x read DRAM again (bytes read ~2x the row's), and what occupancy each runs at. On a GPU:
  ncu --kernel-name regex:'row_norm_fwd|triton_red' --metrics ... python benchmarks/loop_ncu.py 8192 rms table,vl8k16"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fwd_sweep import KNOBS, VARIANTS, _compiled, applied  # noqa: E402

from normkit.backends import triton as tb  # noqa: E402


def main():
    N, op, names = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    rms = op == "rms"
    M = 2**26 // N
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    b = None if rms else torch.randn(N, device="cuda", dtype=torch.bfloat16)
    for name in names:
        if name == "compile":
            f = _compiled(rms)
            call = lambda: f(x, w, b)  # noqa: E731
        else:
            call = None
        with applied(2, VARIANTS.get(name, {}), KNOBS.get(name)):
            call = call or (lambda: tb.row_norm_fwd(x, w, b, 1e-5, rms))
            call()
            torch.cuda.synchronize()
            print(f"loop_ncu: {op} {N} {name}", flush=True)
            for _ in range(2):
                call()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
