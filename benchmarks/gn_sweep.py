"""GroupNorm + Mish configuration sweep: each variant (a set of overrides of the GroupNorm entries
in normkit/backends/triton/configs.py) timed forward and backward on the bench's GroupNorm suites,
in GB/s and as a fraction of a copy measured in the same run. For choosing the table's values;
the bench (`normkit bench --ops gn`) is what reports them.
Run on a GPU: PYTHONPATH=. python benchmarks/gn_sweep.py [--dtypes bf16,fp32] [--variants name,...]"""
import argparse

import torch
import triton.testing

from normkit.backends import triton as tb
from normkit.backends.triton import clear_caches, configs
from normkit.bench.ops import DTYPES, SUITES

NEVER = 1e9
T = configs.GN_LOOPED_TILE if isinstance(next(iter(configs.GN_LOOPED_TILE.values())), tuple) else {}
VARIANTS = {  # module attribute -> value; "default" is the committed table
    "default": {},
    "split-only": {"GN_LOOPED_MIN_GROUPS_PER_SM": {"fwd": NEVER, "bwd": NEVER}, "GN_STAGED_MIN_NUMEL": 1 << 62},
    "staged-off": {"GN_STAGED_MIN_NUMEL": 1 << 62},
    "staged-cl-all": {"GN_STAGED_CL_MAX_GROUP_CHANNELS": {"fwd": NEVER, "bwd": NEVER}},
    "staged-tile-2x": {"GN_STAGED_TILE": {2: 8192, 4: 4096}, "GN_STAGED_WARPS": 8},
    "looped-bwd-half": {"GN_LOOPED_TILE": {**T, ("bwd", 2): (2048, 4), ("bwd", 4): (2048, 4)}},
}
KNOBS = ("GN_LOOPED_MIN_GROUPS_PER_SM", "GN_LOOPED_TILE", "GN_STAGED_MIN_NUMEL", "GN_STAGED_NCHW_MAX_GROUPS_PER_SM",
         "GN_STAGED_TILE", "GN_STAGED_WARPS", "GN_STAGED_MAX_SUB", "GN_STAGED_CL_MAX_GROUP_CHANNELS")


def gbps(fn, nbytes):
    return nbytes / (triton.testing.do_bench(fn, warmup=10, rep=40) * 1e-3) / 1e9


def shapes():
    for name in ("gn-anchors", "gn-1d", "gn-2d"):
        for shape, groups, *cl in SUITES[name].shapes:
            yield shape, groups, bool(cl and cl[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    big = torch.empty(2**28, device="cuda", dtype=torch.float32)
    copy = gbps(lambda: big.clone(), 2 * big.numel() * 4)
    big = None  # free it before the sweep
    print(f"copy {copy:.0f} GB/s")
    names = args.variants.split(",")
    print("shape," + ",".join(f"{n} fwd,{n} bwd" for n in names))
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for shape, G, cl in shapes():
            x = torch.randn(shape, device="cuda", dtype=dtype)
            x = x.to(memory_format=torch.channels_last) if cl else x
            C = shape[1]
            x3 = x.view(shape[0], C, -1) if not cl else x.permute(0, 2, 3, 1).reshape(shape[0], -1, C).transpose(1, 2)
            dy = torch.randn_like(x3)
            wt, bs = torch.randn(C, device="cuda", dtype=dtype), torch.randn(C, device="cuda", dtype=dtype)
            cells = []
            for name in names:
                saved = {k: getattr(configs, k) for k in KNOBS if hasattr(configs, k)}
                for k, v in VARIANTS[name].items():
                    setattr(configs, k, v)
                clear_caches()
                try:
                    _, mean, rstd = tb.group_norm_fwd(x3, G, wt, bs, 1e-5, "mish")
                    f = gbps(lambda: tb.group_norm_fwd(x3, G, wt, bs, 1e-5, "mish"), 2 * x.numel() * x.element_size())
                    b = gbps(lambda: tb.group_norm_bwd(dy, x3, G, wt, bs, mean, rstd, "mish", dtype, dtype),
                             3 * x.numel() * x.element_size())
                    cells += [f"{f:.0f} ({f / copy:.2f})", f"{b:.0f} ({b / copy:.2f})"]
                except Exception as e:  # noqa: BLE001
                    cells += [f"error {type(e).__name__}"] * 2
                finally:
                    for k, v in saved.items():
                        setattr(configs, k, v)
                    clear_caches()
            label = "x".join(map(str, shape)) + f"/g{G}" + ("/cl" if cl else "")
            print(f"{dname} {label}," + ",".join(cells), flush=True)


if __name__ == "__main__":
    main()
