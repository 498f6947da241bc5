"""GroupNorm configuration sweep: each variant (a set of overrides of the GroupNorm entries in
normkit/backends/triton/configs.py) checked against the float64 oracle and timed forward and
backward on the diffusion shapes (the bench's gn-2d suite plus two anchor shapes), NCHW and
channels_last, next to torch eager and torch.compile in the same run. Kernels are timed as the
bench times them (a GPU spin hides the host; input sets rotate over 4x L2; median), in GB/s and as
a fraction of a device-to-device copy measured in the same run. A variant whose launch plan at a
point equals one already timed there is not timed again (its row says which it equals).
For choosing the table's values; the bench (`normkit bench --ops gn`) is what reports them.
Run on a GPU:
  PYTHONPATH=. python benchmarks/gn_sweep.py --out DIR [--dtypes bf16,fp32] [--variants a,b]
      [--acts -,silu] [--act-variants default,old] [--peers torch,compile,copy] [--layouts nchw,cl]
      [--profile [--profile-variants default,old] [--profile-shapes 8x320x64x64/g32,...]]
Writes DIR/gn_sweep.csv (one row per point, implementation, activation, direction) and prints a
short table of fractions of copy last."""
import argparse
import csv
import functools
import os
import sys
import time

import torch
import torch.nn.functional as F

from normkit import reference as ref
from normkit.backends import triton as tb
from normkit.backends.cuda import cluster as cuda_cluster, configs as cuda_configs
from normkit.backends.triton import clear_caches, configs
from normkit.bench.ops import DTYPES, SUITES
from normkit.bench.timing import CudaTimer, copy_ceiling_gbps

NEVER = 1e9
WARM_MS, REP_MS = 10, 30
RING_BYTES = 4 * 50 * 2**20  # 4x the H100's L2
NO_SPLIT2 = {"GN_SPLIT2_LAYOUTS": {k: () for k in configs.GN_SPLIT2_LAYOUTS}}
S2 = configs.GN_SPLIT2_TILE
VARIANTS = {  # module attribute -> value; "default" is the committed table
    "default": {},
    "old": NO_SPLIT2,  # session 3's choice: looped / split with waits / staged
    "s2-all": {"GN_SPLIT2_MAX_GROUPS_PER_SM": {"fwd": NEVER, "bwd": NEVER}, "GN_SPLIT2_MIN_S": {"fwd": 0, "bwd": 0},
               "GN_SPLIT2_LAYOUTS": {k: ("nchw", "cl") for k in configs.GN_SPLIT2_LAYOUTS}},
    "s2-big": {"GN_SPLIT2_TILE": {k: (2 * t, 8) for k, (t, w) in S2.items()}},
    "s2-small": {"GN_SPLIT2_TILE": {k: (t // 2, 4) for k, (t, w) in S2.items()}},
    "s2-min1": {"GN_SPLIT2_MIN_GROUPS_PER_SM": {"fwd": 1.0, "bwd": 1.0}},
    "cl-split2": {"GN_STAGED_CL_MAX_GROUP_CHANNELS": {"fwd": 0, "bwd": 0}},
    "colsum-narrow": {"GN_COL_SUM": (64, 32, 4)},
    "staged-sub1": {"GN_STAGED_MAX_SUB": 1},
    "staged-tile-2x": {"GN_STAGED_TILE": {2: 8192, 4: 4096}, "GN_STAGED_WARPS": 8},
    "staged-cl-all": {"GN_STAGED_CL_MAX_GROUP_CHANNELS": {"fwd": NEVER, "bwd": NEVER}},
    # session 8: the stats launch without per-slot accumulation (session 7's), and the slot stats' tile/span
    "staged-tiles": {"GN_STAGED_SLOTS": {"fwd": False, "bwd": False}, "GN_STAGED_MAX_SUB": 8},
    "stats-2k": {"GN_STAGED_STATS_TILE": {2: (2048, 4), 4: (1024, 4)}},
    "stats-8k": {"GN_STAGED_STATS_TILE": {2: (8192, 8), 4: (4096, 8)}},
    "stats-2waves": {"GN_STAGED_PROGRAMS_PER_SM": {"fwd": 8, "bwd": 6}},
    "stats-half": {"GN_STAGED_PROGRAMS_PER_SM": {"fwd": 2, "bwd": 1.5}},
}
# session 9 (run S9-gn9, H100): the looped tiles halved (lt-4k), quartered (lt-2k), with the per-slot first
# pass (lt-4k-slots), for every NCHW group (lt-4k-all), and NCHW staged: none faster beyond the run's
# noise (~5%) except lt-4k on 16x640x32x32 fwd (+7%). ncu 8x640x32x32 (triton 3.6): the default looped
# kernel has 78 registers (fwd; 72 bwd), 3 programs per SM possible but 256 groups give ~2: 16 warps
# per SM, achieved occupancy 22%, DRAM 21% (fwd) / 32% (bwd): one tile in flight per program. Not
# measured yet: slots on the default tiles (gn_regs.py: 128 registers, at the 2-per-SM edge), and lt-16k.
LT = configs.GN_LOOPED_TILE
LT_4K = {"GN_LOOPED_TILE": {**LT, ("fwd", 2): (4096, 8), ("bwd", 2): (2048, 8)}}


def _slots_on(tiles):
    """The slot kernels for every looped group, on tiles {(direction, element bytes): (tile elements, num_warps)}
    (GN_LOOPED_SLOTS' format)."""
    return {"GN_LOOPED_SLOTS": {k: (1 << 30, t) for k, t in tiles.items()}}


# (the slot kernels as session 9 measured them are gone: these now run session 22's)
SLOTS = _slots_on(LT)
NO_SLOTS = {"GN_LOOPED_SLOTS": {}}
VARIANTS.update({
    "lt-4k": LT_4K,  # bf16 looped tiles halved (from a wrong premise: offline ptxas without the launch's
    # specialization gave 140-187 registers; the device's compile has 72-78)
    # twice the tiles at 8 warps (64 elements a thread): at ~2 groups per SM, twice the bytes in flight
    # per SM if the registers stay <= 128 (gn_regs.py: 103-122 for sm_90 offline; 2 programs of 32 warps
    # would need <= 32); a group that fits one such tile (8x1280x16x16 fwd) takes the one-tile path
    # (GN_TILE): held in registers, read once
    "lt-16k": {"GN_LOOPED_TILE": {**LT, ("fwd", 2): (16384, 8), ("bwd", 2): (8192, 8)},
               "GN_TILE": {**configs.GN_TILE, ("fwd", 2): 16384, ("bwd", 2): 8192}},
    "lt-2k": {"GN_LOOPED_TILE": {**LT, ("fwd", 2): (2048, 8), ("bwd", 2): (1024, 4)}},
    "slots": SLOTS,  # the looped first pass per element slot (no reductions per tile)
    "lt-4k-slots": _slots_on(LT_4K["GN_LOOPED_TILE"]),
    # every NCHW group looped from half a group per SM (the two-kernel split off): one launch
    "lt-4k-all": {**LT_4K, **NO_SPLIT2, "GN_LOOPED_MIN_GROUPS_PER_SM": {"fwd": 0.5, "bwd": 0.5}},
    # NCHW with under one group per SM (4x128x128x128, batch 1) staged (S9-gn9 measured it with the
    # finalize in the stats launch, removed after 6c904fd: this is the three-launch staged path)
    "nchw-staged": {"GN_STAGED_NCHW_MAX_GROUPS_PER_SM": 1.0},
})
# session 10 (run S10-gn10, H100, helper gn10): the looped walks and the staged stats span pipelined through
# shared memory (tl.range num_stages: cp.async, 2-3 tiles in flight per program; device triton 3.6 emitted
# the cp.async, 78 -> 98 registers fwd) were no faster: looped fwd 8x320x64x64 20.5 -> 19.9 us, 8x640x32x32
# 11.6 -> 13.3 us; staged stats 14.4 -> 15.1 us; the code is in commit 312ad62 (pipe2, pipe3, st-pipe2,
# st-pipe3), removed. The two-kernel split up to 4.5 groups per SM (s2-4) lost too. Adopted from lt-16k:
# the NCHW bf16 forward holds groups of up to 16384 padded elements in one tile (8x1280x16x16 0.32 -> 0.40),
# the bf16 looped backward takes 8192-element tiles with the least-padding channel block (32x256x56x56
# 0.52 -> 0.60). s9-default: the table before that, to compare against. Variants override the current table;
# since session 10 the bound between one tile and looped is GN_ONE_TILE_MAX, no longer the looped tile.
VARIANTS.update({
    "s2-4": {"GN_SPLIT2_MAX_GROUPS_PER_SM": {"fwd": 4.5, "bwd": 4.5}, "GN_SPLIT2_MIN_S": {"fwd": 0, "bwd": 0}},
    "s9-default": {"GN_TILE": {**configs.GN_TILE, ("fwd", 2): 8192},
                   "GN_LOOPED_TILE": {**LT, ("bwd", 2): (4096, 8)}, "GN_LOOPED_MIN_BLOCK_FRACTION": {},
                   "GN_ONE_TILE_MAX": {**configs.GN_ONE_TILE_MAX, ("fwd", 2): {"nchw": 8192, "cl": 8192}}},
    # next (not run): more NCHW groups read once, whole in one tile (the one change that won in S10-gn10).
    # gn_regs.py --split (sm_90 offline, triton 3.9): fwd [32, 1024] x 16 warps 127 registers (8x640x32x32 and
    # 16x640x32x32: 1 program per SM, 2 and 4 waves; [64, 256] x 16 warps, the adopted one, is 80: also 1 per
    # SM offline and still won); bwd [64, 256] x 16 warps 128 registers, 8 B stack (8x1280x16x16)
    "one-32k": {"GN_ONE_TILE_MAX": {**configs.GN_ONE_TILE_MAX, ("fwd", 2): {"nchw": 32768, "cl": 8192}},
                "GN_TILE": {**configs.GN_TILE, ("fwd", 2): 32768}},
    "one-16k-bwd": {"GN_ONE_TILE_MAX": {**configs.GN_ONE_TILE_MAX, ("bwd", 2): {"nchw": 16384, "cl": 4096}},
                    "GN_TILE": {**configs.GN_TILE, ("bwd", 2): 16384}},
})
# session 12 (issue 24): dense NCHW groups on the CUDA backend's Hopper cluster kernels (row_cluster.cu
# gn_fwd_cluster / gn_bwd_cluster: a group is a row spread over a cluster's CTAs, held on chip, read once;
# the forward with the push exchange, the backward's weight gradients per (sample, channel) from slices of
# whole channels). "cuda.NAME" keys set normkit.backends.cuda.configs.NAME. Shapes as GN_CLUSTER_KERNELS':
# (threads, items, stages, reload/recompute, push, merge, one_pass).
ALL_ROUTED = {"GN_CLUSTER_ROUTE": {"sm_90": {(d, b): ((0, 1 << 40),) for d in ("fwd", "bwd") for b in (2, 4)}}}


def _gn_shapes(fwd, bwd):
    return {"cuda.GN_CLUSTER_KERNELS": {("fwd", 2): fwd, ("fwd", 4): fwd, ("bwd", 2): bwd, ("bwd", 4): bwd}}


VARIANTS.update({
    "cluster": ALL_ROUTED,  # fwd (256, 8) reload push one_pass; bwd (256, 4) two stages, xhat and g held
    "cluster-128": {**ALL_ROUTED, **_gn_shapes((128, 8, 1, True, True, False, True), (128, 8, 2, False))},
    "cluster-regs": {**ALL_ROUTED, **_gn_shapes((256, 8, 1, False, True, False, True), (256, 4, 2, True))},
    "cluster-16": {**ALL_ROUTED, **_gn_shapes((256, 16, 1, True, True, False, True), (512, 4, 1, False))},
    "cluster-512": {**ALL_ROUTED, **_gn_shapes((512, 8, 1, True, True, False, True), (512, 2, 2, False))},
    # after run S12-1 (H200): the one-wave shapes (cluster-16 won the forward where it made one wave); groups of
    # up to 64K bf16 elements in one CTA's shared memory (2 CTAs per SM), no exchange between CTAs
    "cluster-32": {**ALL_ROUTED, **_gn_shapes((256, 32, 1, True, True, False, True), (128, 8, 2, False))},
    "cluster-128r": {**ALL_ROUTED, **_gn_shapes((128, 16, 1, True, True, False, True), (128, 8, 2, True))},
    # session 14: the backward's group sums by the push exchange (st.async onto mbarriers) instead of a cluster barrier
    # per group; the forward as committed (cluster-p routes only the backward). Run S14-4 launched it on many clusters,
    # a group each (slower than cluster-b nearly everywhere); since then it keeps the barrier kernel's persistent wave
    "cluster-p": {"GN_CLUSTER_ROUTE": {"sm_90": {("bwd", b): ((0, 1 << 40),) for b in (2, 4)}},
                  "cuda.GN_CLUSTER_KERNELS": {**cuda_configs.GN_CLUSTER_KERNELS,
                                              ("bwd", 2): (128, 8, 2, False, True), ("bwd", 4): (128, 8, 2, False, True)}},
    "cluster-b": {"GN_CLUSTER_ROUTE": {"sm_90": {("bwd", b): ((0, 1 << 40),) for b in (2, 4)}}},  # the same, barrier
    # session 25: the table before run S25-2 widened it (triton/configs.py GN_CLUSTER_ROUTE), for A/B runs
    "s24-routes": {"GN_CLUSTER_ROUTE": {"sm_90": {("fwd", 4): ((8192, 49152),), ("bwd", 4): ((16384, 49152),),
                                                  ("bwd", 2): ((16384, 32768),)}}},
})
# session 13 (issue 24): channels_last groups on a cluster per (sample, channel block of whole groups), its CTAs
# holding [positions, channels] tiles in shared memory (row_cluster.cu gn_cl_fwd_cluster / gn_cl_bwd_cluster).
# Shapes as GN_CL_CLUSTER_KERNELS': (threads, most bytes of each tile, bytes of a position's run, CTAs per SM wanted).
CL_ROUTED = {"GN_CL_CLUSTER_ROUTE": {"sm_90": {(d, b): ((0, 1 << 40),) for d in ("fwd", "bwd") for b in (2, 4)}}}
S13_CL_SHAPES = {("fwd", 2): (256, 64 * 1024, 64, 2), ("fwd", 4): (256, 64 * 1024, 64, 2),  # S13-1 / S13-2's "clc"
                 ("bwd", 2): (256, 48 * 1024, 64, 2), ("bwd", 4): (256, 48 * 1024, 64, 2)}


def _cl_shapes(fwd, bwd):
    return {**CL_ROUTED, "cuda.GN_CL_CLUSTER_KERNELS": {("fwd", 2): fwd, ("fwd", 4): fwd, ("bwd", 2): bwd,
                                                         ("bwd", 4): bwd}}


VARIANTS.update({
    "clc": {**CL_ROUTED, "cuda.GN_CL_CLUSTER_KERNELS": S13_CL_SHAPES},  # fwd (256, 64 KB, 64 B, 2), bwd 48 KB
    "clc-512": _cl_shapes((512, 64 * 1024, 64, 2), (512, 48 * 1024, 64, 2)),
    "clc-96k": _cl_shapes((256, 96 * 1024, 64, 2), (256, 80 * 1024, 64, 1)),
    "clc-32k": _cl_shapes((256, 32 * 1024, 64, 4), (256, 24 * 1024, 64, 4)),
    "clc-run128": _cl_shapes((256, 64 * 1024, 128, 2), (256, 48 * 1024, 128, 2)),
    "clc-128": _cl_shapes((128, 32 * 1024, 64, 4), (128, 24 * 1024, 64, 4)),
})
# session 22: the looped kernels built as the row norms' looped forward (SLOTS now: per-slot shifted sums, one
# reduction after the first pass, the next tile's loads issued before the current tile's work in both passes, L2
# kept for the second pass), at ~8 elements a thread (offline ptxas, triton 3.6: [1, 4096] x 16 warps 61 / 80
# registers fwd / bwd at [1, 2048] x 8; 16 elements a thread 122 / 127; 32 elements 212 / 227)
def _ps_tiles(bf16, fp32):
    """The slot kernels on these tiles for every looped group (S22-2 / S22-3 ran them so, before GN_LOOPED_SLOTS
    took them for the bf16 forward at S <= 1024)."""
    return _slots_on({("fwd", 2): bf16, ("bwd", 2): bf16, ("fwd", 4): fp32, ("bwd", 4): fp32})


VARIANTS.update({
    "no-slots": NO_SLOTS,  # the table before GN_LOOPED_SLOTS took the bf16 forward at S <= 1024
    "ps-4k16": _ps_tiles((4096, 16), (2048, 8)),
    "ps-8k32": _ps_tiles((8192, 32), (4096, 16)),
    "ps-2k8": _ps_tiles((2048, 8), (1024, 4)),
    "ps-8k16": _ps_tiles((8192, 16), (4096, 16)),
    # every NCHW group looped from half a group per SM (4x128x128x128 too; the two-kernel split off)
    "ps-4k16-all": {**_ps_tiles((4096, 16), (2048, 8)), **NO_SPLIT2,
                    "GN_LOOPED_MIN_GROUPS_PER_SM": {"fwd": 0.5, "bwd": 0.5}},
})
EXTRA_SHAPES = (((16, 640, 32, 32), 32), ((32, 256, 56, 56), 32))  # the anchors' third look


def shapes(layouts=("nchw", "cl"), order=None):
    """Each shape NCHW then channels_last (of those asked for): in `order` (BxCxHxW strings, G = 32),
    or the suite's first (the bigger ones, then batch 1 last)."""
    suite = [(tuple(s), g) for s, g, *cl in SUITES["gn-2d"].shapes if not (cl and cl[0])]
    order = ([(tuple(int(v) for v in spec.split("x")), 32) for spec in order] if order else
             sorted(suite + list(EXTRA_SHAPES), key=lambda sg: (sg[0][0] == 1, sg in EXTRA_SHAPES)))
    for shape, groups in order:
        for cl in (False, True):
            if ("cl" if cl else "nchw") in layouts:
                yield shape, groups, cl


def log(*a):
    print(*a, flush=True)


class Overrides:
    """Set a variant's configuration values for the duration of a with-block."""

    def __init__(self, values):
        self.values = values

    @staticmethod
    def _where(key):
        """(module, attribute) of a variant's key: "cuda.NAME" is the CUDA backend's configs."""
        return (cuda_configs, key[5:]) if key.startswith("cuda.") else (configs, key)

    def __enter__(self):
        self.saved = {k: getattr(*self._where(k)) for k in self.values}
        for k, v in self.values.items():
            setattr(*self._where(k), v)
        self._clear()

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(*self._where(k), v)
        self._clear()

    @staticmethod
    def _clear():
        clear_caches()
        cuda_cluster.prepare_gn.cache_clear()
        cuda_cluster.prepare_gn_cl.cache_clear()


def as3(t, cl):
    B, C = t.shape[:2]
    return t.view(B, C, -1) if not cl else t.permute(0, 2, 3, 1).reshape(B, -1, C).transpose(1, 2)


def plan_signature(x3, G, act):
    """What the host functions would launch for this input (staged config, group config), both directions."""
    B, C, S = x3.shape
    sig = []
    for direction, extra in (("fwd", None), ("bwd", (True, True))):
        routed = tb._gn_on_clusters(direction, x3, (x3,) if direction == "bwd" else (), G, None, None, act,
                                    direction == "bwd")
        if routed is not None:
            sig.append(("cluster", routed.plan))
            continue
        staged = tb._staged_plan(direction, x3, C // G)[0]
        cfg = None if staged else tb._gn_plan(direction, C // G, S, x3.dtype, x3.device, (True, True, act, extra),
                                              B * G, tb._is_cl(x3))[0]
        sig.append((staged, cfg, configs.GN_COL_SUM if direction == "bwd" else None))
    return tuple(sig)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(x, x3, w, b, dy, dy3, G, act):
    """Relative errors of y, dx, dw, db against the float64 oracle."""
    y, mean, rstd = tb.group_norm_fwd(x3, G, w, b, 1e-5, act)
    dx, dw, db = tb.group_norm_bwd(dy3, x3, G, w, b, mean, rstd, act, w.dtype, b.dtype)
    yr = ref.group_norm(x, G, w, b, 1e-5, act)[0]
    dxr, dwr, dbr = ref.group_norm_backward(dy, x, G, w, b, 1e-5, act)
    shape3 = x3.shape
    return max(rel(y, yr.reshape(shape3)), rel(dx, dxr.reshape(shape3))), max(rel(dw, dwr), rel(db, dbr))


ACT = {None: lambda t: t, "silu": F.silu, "mish": F.mish}


def torch_impls(G, act, compiled):
    def fwd_fn(x, w, b):
        return ACT[act](F.group_norm(x, G, w, b, 1e-5))
    fn = fwd_fn
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fwd_fn, dynamic=False)
    cache = {}

    def fwd(x, x3, w, b, dy, dy3):
        return fn(x, w, b)

    def bwd(x, x3, w, b, dy, dy3):
        key = x.data_ptr()
        if key not in cache:
            xr, wr, br = (t.detach().requires_grad_(True) for t in (x, w, b))
            cache[key] = (fn(xr, wr, br), (xr, wr, br))
        y, inputs = cache[key]
        return torch.autograd.grad(y, inputs, dy, retain_graph=True)
    return fwd, bwd


def copy_impls():
    """The memory system's speed at this size: the forward's traffic (read x, write y) as a copy, the
    backward's (read x and dy, write dx) as an add; timed like the kernels, so fraction-of-copy rows of the
    same shape read against what moving those bytes alone reaches (the ceiling is a 1 GiB copy)."""
    def fwd(x, x3, w, b, dy, dy3):
        return x.clone(memory_format=torch.preserve_format)

    def bwd(x, x3, w, b, dy, dy3):
        return torch.add(x, dy)
    return fwd, bwd


def nk_impls(G, act, dtype):
    stats = {}

    def fwd(x, x3, w, b, dy, dy3):
        return tb.group_norm_fwd(x3, G, w, b, 1e-5, act)

    def bwd(x, x3, w, b, dy, dy3):
        key = x3.data_ptr()
        if key not in stats:
            stats[key] = tb.group_norm_fwd(x3, G, w, b, 1e-5, act)[1:]
        mean, rstd = stats[key]
        return tb.group_norm_bwd(dy3, x3, G, w, b, mean, rstd, act, dtype, dtype)
    return fwd, bwd


def timed_gbps(timer, sets, call, nbytes):
    calls = [functools.partial(call, *s) for s in sets]
    calls[0]()
    torch.cuda.synchronize()
    ms, _ = timer.median_ms(calls, WARM_MS, REP_MS)
    return ms, nbytes / (ms * 1e6)


def profile(sets, impls, label):
    """Per-kernel GPU time (us per call) of each implementation, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile as tprof
    for name, call in impls:
        for s in sets[:2]:
            call(*s)
        torch.cuda.synchronize()
        with tprof(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(20):
                call(*sets[i % len(sets)])
            torch.cuda.synchronize()
        rows = [(e.key[:60], e.device_time_total / 20) for e in prof.key_averages() if e.device_time_total > 0]
        log(f"  profile {label} {name}: " + "; ".join(f"{k} {t:.1f}us" for k, t in
                                                       sorted(rows, key=lambda r: -r[1])[:5]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--acts", default="-,silu", help="activations timed for --act-variants and the peers")
    ap.add_argument("--act-variants", default="default,old")
    ap.add_argument("--peers", default="torch,compile")
    ap.add_argument("--peer-acts", default="-", help="activations the peers are timed with")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of --profile-variants on 3 shapes")
    ap.add_argument("--profile-variants", default="default,old")
    ap.add_argument("--profile-shapes", default="8x320x64x64/g32,8x320x64x64/g32/cl,4x128x128x128/g32/cl",
                    help="labels of the points --profile covers (bf16)")
    ap.add_argument("--layouts", default="nchw,cl")
    ap.add_argument("--shapes", default="", help="BxCxHxW,... in the order to run (G = 32); default: the suite's")
    ap.add_argument("--cl-variants", default="", help="variants timed on channels_last points (default: --variants)")
    ap.add_argument("--dirs", default="fwd,bwd", help="directions timed")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; stop starting new points after it")
    args = ap.parse_args()
    t_start = time.time()
    torch._dynamo.config.cache_size_limit = 1 << 10
    torch._dynamo.config.accumulated_cache_size_limit = 1 << 12
    timer = CudaTimer()
    copy = copy_ceiling_gbps(timer, WARM_MS, REP_MS)
    log(f"copy {copy:.0f} GB/s  ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gn_sweep.csv")
    rows = []
    names = args.variants.split(",")
    acts = [None if a == "-" else a for a in args.acts.split(",")]
    act_variants = set(args.act_variants.split(","))
    peers = [p for p in args.peers.split(",") if p]
    dirs = args.dirs.split(",")
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        eb = torch.empty((), dtype=dtype).element_size()
        for shape, G, cl in shapes(args.layouts.split(","), [s for s in args.shapes.split(",") if s]):
            if time.time() - t_start > args.budget:
                log(f"budget reached: stopping before {dname} {shape}")
                break
            B, C = shape[:2]
            numel = torch.Size(shape).numel()
            fmt = torch.channels_last if cl else torch.contiguous_format
            label = "x".join(map(str, shape)) + f"/g{G}" + ("/cl" if cl else "")

            def make():
                x = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
                dy = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
                w, b = torch.randn(C, device="cuda", dtype=dtype), torch.randn(C, device="cuda", dtype=dtype)
                return x, as3(x, cl), w, b, dy, as3(dy, cl)
            sets = [make() for _ in range(max(2, -(-RING_BYTES // (3 * numel * eb))))]
            for act in [None] + [a for a in acts if a is not None]:
                seen = {}
                for name in (args.cl_variants.split(",") if cl and args.cl_variants else names):
                    if act is not None and name not in act_variants:
                        continue
                    with Overrides(VARIANTS[name]):
                        sig = plan_signature(sets[0][1], G, act)
                        base = dict(dtype=dname, shape=label, act=act or "-", impl=name, copy=f"{copy:.0f}")
                        if sig in seen:
                            for direction in ("fwd", "bwd"):
                                rows.append(dict(base, dir=direction, same_as=seen[sig]))
                            continue
                        seen[sig] = name
                        try:
                            err, perr = check(*sets[0], G, act)
                            fwd, bwd = nk_impls(G, act, dtype)
                            for direction, call in (("fwd", fwd), ("bwd", bwd)):
                                if direction not in dirs:
                                    continue
                                ms, gbps = timed_gbps(timer, sets, call, (2 if direction == "fwd" else 3) * numel * eb)
                                rows.append(dict(base, dir=direction, ms=f"{ms:.4f}", gbps=f"{gbps:.0f}",
                                                 frac=f"{gbps / copy:.3f}", relerr=f"{err:.1e}",
                                                 param_relerr=f"{perr:.1e}", plan=str(sig[0 if direction == 'fwd' else 1])))
                        except Exception as e:  # noqa: BLE001
                            rows.append(dict(base, dir="-", error=f"{type(e).__name__}: {str(e)[:300]}"))
                for peer in (peers if (act or "-") in args.peer_acts.split(",") else []):
                    base = dict(dtype=dname, shape=label, act=act or "-", impl=peer, copy=f"{copy:.0f}")
                    try:
                        fwd, bwd = copy_impls() if peer == "copy" else torch_impls(G, act, peer == "compile")
                        for direction, call in (("fwd", fwd), ("bwd", bwd)):
                            if direction not in dirs:
                                continue
                            ms, gbps = timed_gbps(timer, sets, call, (2 if direction == "fwd" else 3) * numel * eb)
                            rows.append(dict(base, dir=direction, ms=f"{ms:.4f}", gbps=f"{gbps:.0f}",
                                             frac=f"{gbps / copy:.3f}"))
                        if peer == "compile" and len(rows) >= 2:
                            frames = torch._dynamo.utils.counters["frames"]["ok"]
                            rows[-1]["compiled_frames"] = rows[-2]["compiled_frames"] = str(frames)
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(base, dir="-", error=f"{type(e).__name__}: {str(e)[:300]}"))
                here = [r for r in rows if r["shape"] == label and r["dtype"] == dname and r["act"] == (act or "-")]
                log(f"{dname} {label} {act or '-'}: " + "  ".join(
                    f"{r['impl']}:{r['dir']}={r.get('frac', r.get('same_as', r.get('error', '?'))[:60])}"
                    + (f"[{r['relerr']}]" if r.get("relerr") and float(r["relerr"]) > 2e-2 else "")
                    for r in here))
            if args.profile and label in args.profile_shapes.split(",") and dname == "bf16":
                for name in args.profile_variants.split(","):
                    with Overrides(VARIANTS[name]):
                        fwd, bwd = nk_impls(G, None, dtype)
                        profile(sets, [(f"{name} fwd", fwd), (f"{name} bwd", bwd)], label)
            del sets
            torch.cuda.empty_cache()
            write_csv(path, rows)
    write_csv(path, rows)
    log(f"done in {time.time() - t_start:.0f} s; {path}")


def write_csv(path, rows):
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
