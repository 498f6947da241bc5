"""Registers of the GroupNorm per-group kernels (looped / one-tile) for sm_90, without a GPU: compiles
with Triton for an sm_90 target and reads the cubin's resource usage (cuobjdump). Specialized as a
launch is (pointers and C, S, stride_b, stride_c divisible by 16, NCHW stride_s == 1): without that
the loads are not vectorized and the counts come out ~2x (session 9 predicted 140-187 registers
this way; the device had 72-78). Calibration against ncu (H100, triton 3.6 there, 3.9 here),
8x640x32x32 bf16: fwd [8, 1024] x 8 warps 64 here / 78 ncu, [4, 1024] 48 / 48; bwd [4, 1024] 73 / 72,
[2, 1024] 48 / 48. Programs per SM = 65536 // (256-rounded registers * 32 * warps).
  python benchmarks/gn_regs.py fwd 8x1024 8 [--slots] [--split] [--fp32]
  python benchmarks/gn_regs.py bwd 2x4096 32"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from normkit.backends.triton import group_norm as gn  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INTS = ("Bn", "C", "S", "Cg", "G", "stride_b", "stride_c", "stride_s")
ALIGNED = ("C", "S", "stride_b", "stride_c")


def registers(direction, block_r, block_s, num_warps, slots=False, looped=True, dtype="bf16"):
    """(registers, stack bytes) of one specialization of group_norm_{fwd,bwd}_kernel."""
    t, p = ("*bf16" if dtype == "bf16" else "*fp32"), "*fp32"
    if direction == "fwd":
        fn = gn.group_norm_fwd_kernel
        ptrs = dict(X=t, Y=t, W=t, B=t, MEAN=p, RSTD=p, SYNC="*i32", SCRATCH=p)
        flags = dict(HAS_W=True, HAS_B=True, ACT=0)
    else:
        fn = gn.group_norm_bwd_kernel
        ptrs = dict(DY=t, X=t, W=t, B=t, MEAN=p, RSTD=p, DX=t, DW_PART=p, DB_PART=p, SYNC="*i32", SCRATCH=p)
        flags = dict(HAS_W=True, HAS_B=True, WANT_DW=True, WANT_DB=True, ACT=0)
    sig = dict(ptrs, **{k: "i32" for k in INTS}, **({"eps": "fp32"} if direction == "fwd" else {}))
    constexprs = dict(flags, stride_s=1, BLOCK_R=block_r, BLOCK_S=block_s, KS=1, SPLIT=1, LOOPED=looped,
                      SLOTS=slots)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if k in ptrs or k in ALIGNED}
    sig.update({k: "constexpr" for k in constexprs})
    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=1))
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("direction", choices=("fwd", "bwd"))
    ap.add_argument("tile", help="BLOCK_RxBLOCK_S")
    ap.add_argument("warps", type=int)
    ap.add_argument("--slots", action="store_true", help="the looped first pass per element slot")
    ap.add_argument("--split", action="store_true", help="the one-tile persistent path instead of looped")
    ap.add_argument("--fp32", action="store_true")
    args = ap.parse_args()
    block_r, block_s = (int(v) for v in args.tile.split("x"))
    regs, stack = registers(args.direction, block_r, block_s, args.warps, args.slots, not args.split,
                            "fp32" if args.fp32 else "bf16")
    per_sm = 65536 // (-(-regs * 32 // 256) * 256 * args.warps)
    print(f"{args.direction} [{block_r}, {block_s}] x {args.warps} warps: {regs} registers, {stack} B stack, "
          f"{min(per_sm, 64 // args.warps)} programs per SM")


if __name__ == "__main__":
    main()
