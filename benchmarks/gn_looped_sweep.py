"""GroupNorm forward on the peer anchors' shapes: the split (register) path against the looped path
at a few tile sizes and warp counts, in GB/s (read x + write y) and as a fraction of a copy.
Run on a GPU: PYTHONPATH=. python benchmarks/gn_looped_sweep.py"""
import itertools

import torch
import triton.testing

import normkit
from normkit.backends.triton import clear_caches, configs

SHAPES = [(16, 256, 64, 64, 8), (64, 256, 64, 64, 8), (32, 320, 64, 64, 32), (51, 320, 64, 64, 32)]


def gbps(fn, nbytes):
    return nbytes / (triton.testing.do_bench(fn, warmup=25, rep=100) * 1e-3) / 1e9


def main():
    big = torch.empty(2**28, device="cuda", dtype=torch.float32)
    copy = gbps(lambda: big.clone(), 2 * big.numel() * 4)
    print(f"copy {copy:.0f} GB/s")
    variants = [("split", None, None, 1)] + [("looped", t, w, st) for (t, w), st in itertools.product(
        ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)), (1,))]
    for dtype in (torch.bfloat16, torch.float32):
        for B, C, H, W, G in SHAPES:
            x = torch.randn(B, C, H, W, device="cuda", dtype=dtype)
            wt, bs = torch.randn(C, device="cuda"), torch.randn(C, device="cuda")
            line = []
            for kind, tile, warps, stages in variants:
                saved = (dict(configs.GN_LOOPED_TILE), configs.GN_LOOPED_WARPS, configs.GN_LOOPED_MIN_GROUPS_PER_SM,
                         configs.GN_LOOPED_STAGES)
                if kind == "split":
                    configs.GN_LOOPED_MIN_GROUPS_PER_SM = 1e9
                else:
                    configs.GN_LOOPED_TILE = {2: tile, 4: tile // 2}
                    configs.GN_LOOPED_WARPS, configs.GN_LOOPED_MIN_GROUPS_PER_SM, configs.GN_LOOPED_STAGES = warps, 0, stages
                clear_caches()
                try:
                    g = gbps(lambda: normkit.group_norm(x, G, wt, bs, activation="mish"), 2 * x.numel() * x.element_size())
                    line.append(f"{kind}{'' if tile is None else f'/{tile}/{warps}w/{stages}s'} {g:.0f} ({g / copy:.2f})")
                except Exception as e:  # noqa: BLE001
                    line.append(f"{kind}/{tile}/{warps}w error {type(e).__name__}")
                finally:
                    (configs.GN_LOOPED_TILE, configs.GN_LOOPED_WARPS, configs.GN_LOOPED_MIN_GROUPS_PER_SM,
                     configs.GN_LOOPED_STAGES) = saved
                    clear_caches()
            print(f"{str(dtype)[6:]} {B}x{C}x{H}x{W}/g{G}: " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
