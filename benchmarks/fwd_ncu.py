"""Issue 24 (session 27): one launch of each wide-forward variant (widefwd_sweep.py's syntax: `normkit`,
`TxIxS@W+FLAGS%DEFINES`; run S27-5 used a4fb261's `~s` held variants too) at one width, for ncu to profile side by
side: why does LayerNorm on one wave of persistent clusters (0.45-0.53 of copy at 128K) run so far behind RMSNorm on
the same kernel (0.84) and LayerNorm on many waves of clusters that each take about one row (0.67)?

  ncu --kernel-name regex:row_fwd_cluster ... python benchmarks/fwd_ncu.py --width 131072 --cases ln:normkit,...
"""
import argparse

import torch

from normkit.backends import triton as tb

from speed_sweep import Routing, all_routes
from widefwd_sweep import _both, compiled_with, push_waves, variant_defines, variant_shape


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=131072)
    ap.add_argument("--cases", required=True, help="OP:VARIANT,... (OP ln or rms)")
    args = ap.parse_args()
    n = args.width
    m = 2**26 // n
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for case in args.cases.split(","):
        op, _, v = case.partition(":")
        rms = op == "rms"
        ctx = compiled_with(variant_defines(v))
        if v.partition("%")[0] != "normkit":
            waves = v.partition("%")[0].partition("~")[0].partition("+")[0].partition("@")[2]
            ctx = _both(_both(Routing(cuda_rows=all_routes("fwd", 2, n), shapes={("fwd", 2): variant_shape(v, 2, n)}),
                              push_waves(int(waves) if waves else None)), ctx)
        with ctx:
            print(f"case: {case}", flush=True)
            tb.row_norm_fwd(x, w, None if rms else b, 1e-5, rms)
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
