"""Launch configurations as data, and the small pure functions that read them.

Nothing here touches a GPU: the occupancy of a kernel comes in as a function, so CI checks the
dispatch (which implementation, pack and block size each row width gets) with a model of it.

Row norms (OneFlow's dispatch, seed 003):
  N <= WARP_MAX_COLS    warp impl: a group of `width` lanes holds a row in registers, `cols_per_thread`
                        columns per lane; narrow rows get narrow groups, so a warp holds several rows
  N <= REG_ROW_MAX      regs impl (the warp kernels with 64..1024 threads per row): the row in
                        registers, about REG_COLS columns per thread (reg_layout; REG_SHAPES holds
                        measured exceptions)
  row fits shared mem.  block impl, CACHED: the row parked in shared memory between the two passes;
                        block size by occupancy (choose_block_size)
  otherwise             block impl, uncached: the second pass re-reads global memory
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

# ---- row norms
WARP_MAX_COLS = 1024  # widest row a warp keeps in registers (OneFlow's bound)
WARP_BLOCK_THREADS = 128  # warp-impl blocks: 4 warps
COLS_PER_THREAD_STEP = 4  # a lane's columns are rounded up to a multiple of this (or of the pack), so
#                          few template instantiations cover every width; padded columns are masked
# regs impl, per (direction, element bytes): the widest row (columns) held in registers, and the
# columns per thread aimed at. Sized by bytes in flight: a thread issues all its loads before the
# row's one barrier, so REG_COLS * element bytes (x and dy in the backward) are in flight per
# thread; ~64 B per thread at 1000+ resident threads is 64 KB per SM, what HBM3 needs (the block
# impl kept one batch of packs per thread in flight, ~20 KB per SM at N = 2K-4K bf16). The widest
# rows are bounded by registers: 1024 threads leave 64 registers each.
# Run S7-2 (H100): the 16-bit backward at 8192 is faster on the block impl (0.78-0.85 of copy vs
# 0.75-0.77: 1024 threads of 64 registers hold one row per SM), so the regs backward stops at 4096.
REG_ROW_MAX = {("fwd", 2): 32768, ("fwd", 4): 16384, ("bwd", 2): 4096, ("bwd", 4): 8192}
REG_COLS = {("fwd", 2): 32, ("fwd", 4): 16, ("bwd", 2): 8, ("bwd", 4): 8}  # run S7-1 at N = 2048
REG_SHAPES: dict = {}  # (direction, element bytes, padded width) -> threads per row: measured exceptions
REG_MIN_THREADS, REG_MAX_THREADS = 64, 1024  # a row of 32 threads or fewer is the warp impl's
BLOCK_SIZES = (128, 256, 512)  # block-impl candidates, smallest first (row_norm.cu kMaxBlockThreads)
UNCACHED_BLOCK = 512  # OneFlow: the biggest block, so fewer rows compete for L2 at a time
FWD_WAVES = 32  # forward grids stop at this many waves of resident blocks; kernels loop over the rest
BWD_MAX_BLOCKS_PER_SM = 8  # backward grids are one wave of at most this many blocks per SM: each
#                            block writes a partial row of dweight/dbias, so fewer is cheaper to add
BWD_ACC_ELEMS = 16  # dweight/dbias register accumulators per thread in the block backward
#                     (so the fused sums reach N = 512 * 16; wider rows use row_param_grad)
PARAM_TILE = (32, 8)  # row_param_grad's block (columns, rows): row_norm.cu kParamTileCols/Rows
PARAM_SPLITS_PER_SM = 4  # row_param_grad: row splits (partial rows) per SM
COL_SUM_BLOCK = (32, 8)  # col_sum: 32 columns x 8 lanes over the partial rows (row_norm.cu kColSum*)

# ---- rows on Hopper thread-block clusters (row_cluster.cu, cluster.py)
CLUSTER_MIN_CAPABILITY = (9, 0)
CLUSTER_MAX = 16  # CTAs per cluster (above 8 the kernel opts in to non-portable sizes)
# (direction, element bytes) -> (threads, items, stages[, recompute]): a CTA holds threads * items
# packs of 16 bytes of a row (its slice); a row wider than that is spread over a cluster, and
# past CLUSTER_MAX CTAs the CTAs grow (threads x 2). Backward with recompute: the dx step reads
# the stage again instead of keeping xhat and g in registers. CLUSTER_SHAPES: the shape measured
# best per padded width (H200, benchmarks/speed_sweep.py runs S4-1/S4-2), over these defaults.
# The forward: the push exchange with the stage read again (quack's design), one stage, many
# clusters. Run S9-w (H100, benchmarks/results/2026-11-25-h100-session9-widefwd9/), bf16 RMS / LN:
# 0.89 / 0.83 at 64K, 0.87 / 0.79 at 128K, 0.83 / 0.71 at 256K, where the persistent barrier
# kernel made 0.71 / 0.58, 0.68 / 0.53, 0.67 / 0.53. Session 10 (run R10, 16-bit): LayerNorm's moments in
# one read (ONE_PASS, 7th value) 0.82 -> 0.85 at 64K, 0.80 -> 0.82 at 128K, 0.72 -> 0.75 at 256K (RMSNorm
# ignores it); 32K and fp32 are left as measured in S9-w. Session 14 (H200, run S14-3): 256K on 16 CTAs of 8
# warps with MERGE and ONE_PASS, LN 0.575 -> 0.60, RMS 0.69 -> 0.71 (H100, R10: LN 0.75 -> 0.76, RMS 0.83 -> 0.82).
# The 16-bit backward with the push exchange (5th value; run S14-3, H200, bf16 LN / RMS): 0.60 / 0.62 -> 0.75 /
# 0.78 at 16K, 0.56 / 0.58 -> 0.71 / 0.72 at 32K, 0.53 / 0.56 -> 0.63 / 0.65 at 64K, 0.44 / 0.47 -> 0.47 / 0.50
# at 128K, 0.38 / 0.43 -> 0.40 / 0.45 at 256K against the barrier exchange; fp32 not measured with it. Rows of one
# CTA (run S14-6, the Triton backend's route): LN 0.73 -> 0.82 at 2K, 0.69 -> 0.78 at 8K (4K and RMSNorm: Triton's);
# no longer routed since session 17 (run S17-2: Triton's tiles with the next tile's statistics prefetched, 0.87 / 0.81).
# Session 17 (H200, run S17-5, widefwd_sweep.py at 16K-32K, bf16): the 32K forward on 2 CTAs of 8 warps with ONE_PASS
# (0.72-0.73 of copy; 4 CTAs of 4 warps the same) where the 4-CTA shape without it made 0.68 and Triton's one program
# per row 0.69: LayerNorm's 32K forward is routed here since; RMSNorm's stays on Triton (0.85 against 0.80), and at
# 16K both stay on Triton (LN 0.82, RMS 0.88 against the clusters' 0.73 / 0.81).
# Two rows in flight at 128K-256K (OVERLAP, 7th value of a backward shape; run S15-3, H200, bf16 LN / RMS): 0.47 /
# 0.50 -> 0.58 / 0.63 at 128K, 0.41 / 0.45 (Triton's capped split rows) -> 0.48 / 0.54 at 256K; on four stages
# 0.50 / 0.52 and 0.41 / 0.45; at 16K-64K (with the stage read again) 0.02-0.08 slower than the registers' push.
# Then with the two rows' xhat and g in two register sets (recompute off, 3 stages; run S15-5): 64K 0.62 / 0.65 ->
# 0.64 / 0.70, 128K 0.57 / 0.62 (the stage read again, as adopted from S15-3) -> 0.63 / 0.69; 16K-32K 0.02-0.06 slower
# than one row in flight; on 2 stages 0.47-0.54 everywhere (a stage refilled only once its row's sums are taken
# leaves the next row's loads exposed). 256K keeps the stage read again (512 threads: no registers for two sets).
# Run S15-8 (bwd_sweep at 32K-64K, LN / RMS): 32K one row in flight on 3 stages 0.69 / 0.73 -> 0.71 / 0.77; 64K the
# register sets on 256-thread CTAs (4 packs a thread) 0.64 / 0.70 -> 0.68 / 0.71; MERGE 0.61-0.66, 4 stages 0.63-0.74.
CLUSTER_KERNELS = {("fwd", 2): (256, 8, 1, True, True, False, True), ("fwd", 4): (256, 8, 1, True, True),
                   ("bwd", 2): (512, 2, 2, False, True), ("bwd", 4): (512, 4, 2)}
CLUSTER_SHAPES = {
    ("fwd", 2, 32768): (256, 8, 1, True, True, False, True), ("fwd", 2, 65536): (128, 8, 1, True, True, False, True),
    ("fwd", 2, 262144): (256, 8, 1, True, True, True, True), ("fwd", 4, 32768): (128, 8, 1, True, True),
    ("bwd", 2, 32768): (512, 2, 3, False, True), ("bwd", 2, 65536): (256, 4, 3, False, True, False, True),
    ("bwd", 2, 131072): (256, 4, 3, False, True, False, True),
    ("bwd", 2, 262144): (256, 4, 3, True, True, False, True),
    ("bwd", 4, 8192): (512, 2, 3), ("bwd", 4, 16384): (512, 2, 3), ("bwd", 4, 32768): (512, 2, 3),
    # fp32 backward at 256K: 16 CTAs of 512 x 8 packs (16K columns), one stage of 128 KB, dx from the
    # stage again (121 registers, no spills). Run S7-3 (H100): LN 0.59 / RMS 0.61 of copy, where the
    # block impl made 0.27 / 0.23 (each row's x and dy read twice plus the row_param_grad pass).
    ("bwd", 4, 262144): (512, 8, 1, True),
}
# The RELOAD forward's register cap, as the threads per SM it is compiled to fit (__launch_bounds__' second value is
# this over the CTA's threads), per (op, element bytes, padded width); else 1024 (4 CTAs of 256 threads). Run S23-1
# (H200, `bash benchmarks/device_s23.sh fwdcl`, `normkit bench` bf16 forward, two interleaved reps): RMSNorm 56 / 47 /
# 38 registers at 1024 / 1280 / 1536 (no spills): 128K 0.76 / 0.80 / 0.81, 256K 0.71 / 0.76 / 0.78 of copy (six
# CTAs of 32 KB stages is the shared memory's limit too); LayerNorm 61 / 48 / 40 (spills of 12 / 44 bytes from 1280):
# 128K 0.66 / 0.68 / 0.64, 256K 0.60 / 0.63 / 0.61, but 32K level at 1280 and 64K (128-thread CTAs) 0.72 / 0.68 / 0.65.
# fp32 (run S23-2, `... caps`, the CUDA backend, 40 registers at 1536, no spills), 1024 / 1536: LN 64K 0.75 / 0.81,
# 128K 0.63 / 0.75, 256K 0.57 / 0.66; RMS 64K 0.86 / 0.91, 128K 0.74 / 0.78, 256K 0.69 / 0.76; 32K level (0.80-0.90)
# (RMSNorm's 16-bit 128K-256K: CLUSTER_FWD_HOLD's plans since session 26, with their own caps)
CLUSTER_FWD_SM_THREADS = {("ln", 2, 131072): 1280, ("ln", 2, 262144): 1280,
                          **{(op, 4, n): 1536 for op in ("ln", "rms") for n in (65536, 131072, 262144)}}
# The push forward's parameters fetched ahead: each pack's weight (and bias) loaded that many packs before its store, the
# first ones before the row's sums (row_cluster.cu AHEAD), per (op, element bytes); else 0 (next to its store). Run
# S26-1 (H200, `bash benchmarks/device_s26.sh ahead`, `normkit bench` forward, the CUDA backend, against 0): fp32
# RMSNorm 64K / 128K / 256K 0.905 / 0.795 / 0.780 -> 0.933 / 0.879 / 0.805 of copy; bf16 RMSNorm level (0.81-0.83 /
# 0.78-0.80 both ways: its L2 reads of the parameters are not waited on one by one); LayerNorm 0.01-0.15 slower
# (48 registers at its cap: spills)
CLUSTER_FWD_PARAM_AHEAD = {("rms", 4): 2}
# The row backward's weight held in registers (row_cluster.cu HOLD_W): the clusters are persistent, each CTA on the
# same columns every row, so its slice of the weight is read once instead of once a row (from L2 / L1: a third more
# bytes through L2 than x, dy and dx in 16-bit rows). Run S26-2 (H200, `bash benchmarks/device_s26.sh measure`,
# `normkit bench` backward, the CUDA backend, rounds A B B A against reading it at each use): bf16 LN 16K / 32K /
# 128K / 256K 0.76 / 0.71 / 0.63 / 0.47 -> 0.80 / 0.77 / 0.71 / 0.50, RMS 0.78 / 0.77 / 0.66 / 0.52 -> 0.84 / 0.83 /
# 0.77 / 0.59; fp32 LN 0.63 / 0.59 / 0.53 / 0.49 -> 0.65 / 0.59 / 0.72 / 0.53, RMS 128K / 256K 0.54 / 0.52 -> 0.73 /
# 0.57-0.62. Everywhere but the widths below, where fp32 RMSNorm's 512-thread CTAs go from 64 to 72 registers: one
# CTA per SM instead of two (16K / 32K 0.88 / 0.82 -> 0.67 / 0.61).
CLUSTER_BWD_HOLD_W_OFF = {("rms", 4, n) for n in (8192, 16384, 32768)}
# The push forward on one wave of persistent clusters holding each CTA's parameters in registers over its rows
# (row_cluster.cu HOLD), per (op, element bytes, padded width): (shape, SM_THREADS cap). 4 packs a thread (16 more
# registers for the weight), two stages so the next row loads during this one's stores. Runs S26-3 / S26-4 (H200,
# `bash benchmarks/device_s26.sh hold` and its variants, widefwd_sweep.py, two rounds each): RMSNorm bf16 128K
# 0.819-0.826 -> 0.850-0.854 (768 threads per SM; 1024: 0.834-0.839), 256K 0.787-0.792 -> 0.844-0.855 (512-thread
# CTAs, 1024); the same shapes without holding 0.79 / 0.75-0.76, one stage 0.70 / 0.62. LayerNorm (weight and bias,
# 32 registers) spills at every cap that keeps 3 CTAs per SM: 0.35-0.43 against 0.62-0.68, not used.
CLUSTER_FWD_HOLD = {("rms", 2, 131072): ((256, 4, 2, True, True), 768),
                    ("rms", 2, 262144): ((256, 4, 2, True, True), 1024)}
CLUSTER_SMEM_MAX = 220 * 1024
# PUSH kernels launch up to this many waves of resident clusters (each cluster walks rows past
# that): at 64K-256K rows of 2^26 elements this is one row per cluster
CLUSTER_PUSH_WAVES = 64
CLUSTER_MIN_THREADS = 128
CLUSTER_MAX_THREADS = 512  # block kernels: 128 registers per thread at most (see row_norm.cu)  # dynamic shared memory of the stages (the kernel has ~7 KB static)
# the widths (padded to a power of two) the CUDA backend runs on clusters rather than on the
# OneFlow-style kernels, per (direction, op, element bytes): where the clusters measured faster (S4-1/S4-2)
# Run S7-2 (H100): the regs impl beats the cluster forward at 16K-32K (RMSNorm 0.91-0.97 vs 0.75-0.83);
# the forward clusters start where the regs impl stops.
# Run S9-w (push forward): from 32K in both dtypes and to 256K in fp32 (fp32 256K: 0.84 / 0.73 vs 0.63 /
# 0.62), but 16-bit 32K is LN 0.84 vs the regs impl's 0.62 and RMS 0.89 vs 0.92: RMS from 64K there.
CLUSTER_WIDTHS = {
    ("fwd", "ln", 2): (32768, 262144), ("fwd", "rms", 2): (65536, 262144),
    ("fwd", "ln", 4): (32768, 262144), ("fwd", "rms", 4): (32768, 262144),
    ("bwd", "ln", 2): (16384, 262144), ("bwd", "rms", 2): (16384, 262144),
    ("bwd", "ln", 4): (8192, 262144), ("bwd", "rms", 4): (8192, 262144),
}

# ---- GroupNorm
GN_REDUCE_BLOCK = (32, 8)  # gn_reduce: 32 lanes along the unit-stride axis
GN_TARGET_BLOCKS_PER_SM = 4  # split S into chunks until gn_reduce has about this many blocks per SM
GN_MIN_CHUNK = 256  # ... but no chunk shorter than this many positions
GN_GROUP_THREADS = 128  # gn_group: 4 warps, a warp per (batch, group)
GN_APPLY_THREADS = 256
GN_APPLY_WAVES = 8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pick_pack(n: int, elem_bytes: int, aligned: Iterable[tuple[int, int]]) -> int:
    """Elements per vector access: the largest P (16 bytes of x's type at most) that divides the row
    width and to which every (byte address or byte stride, element size of that tensor) pair in
    `aligned` is aligned. A pack of P elements of size e needs min(16, P * e)-byte alignment."""
    aligned = list(aligned)
    p = 16 // elem_bytes
    while p > 1:
        if n % p == 0 and all(v % min(16, p * e) == 0 for v, e in aligned):
            return p
        p //= 2
    return 1


def warp_layout(n: int, pack: int) -> tuple[int, int]:
    """(group width in lanes, columns per lane) for a row of n <= WARP_MAX_COLS columns."""
    if not 0 <= n <= WARP_MAX_COLS:
        raise ValueError(f"warp_layout: n must be in 0..{WARP_MAX_COLS}, got {n}")
    packs = max(1, cdiv(n, pack))
    if packs <= 32:
        return next_pow2(packs), pack  # one pack per lane, as few lanes as cover the row
    step = max(1, COLS_PER_THREAD_STEP // pack)
    packs_per_lane = cdiv(cdiv(packs, 32), step) * step
    return 32, packs_per_lane * pack


def reg_layout(direction: str, n: int, pack: int, elem_bytes: int) -> tuple[int, int] | None:
    """(threads per row, columns per thread) of the regs impl for rows of n columns, or None when
    the row is wider than REG_ROW_MAX for this direction and element size."""
    key = (direction, elem_bytes)
    if n > REG_ROW_MAX.get(key, 0):
        return None
    packs = max(1, cdiv(n, pack))
    threads = REG_SHAPES.get((direction, elem_bytes, next_pow2(n)))
    if threads is None:
        target = max(1, REG_COLS[key] // pack)  # packs per thread aimed at
        threads = next_pow2(cdiv(packs, target))
    threads = max(REG_MIN_THREADS, min(REG_MAX_THREADS, threads))
    step = max(1, COLS_PER_THREAD_STEP // pack)
    return threads, cdiv(cdiv(packs, threads), step) * step * pack


def choose_block_size(occupancy: Callable[[int], int], candidates: Iterable[int] = BLOCK_SIZES) -> int | None:
    """OneFlow's rule: the largest block size that keeps as many blocks resident per SM as the
    smallest candidate does (a block-per-row kernel limited by shared memory gets more threads for
    free); None when even the smallest cannot be resident (the row does not fit)."""
    candidates = sorted(candidates)
    if not candidates:
        return None
    base = occupancy(candidates[0])
    if base <= 0:
        return None
    for block in reversed(candidates):
        if occupancy(block) == base:
            return block
    return candidates[0]


@dataclass(frozen=True)
class RowPlan:
    impl: str  # "warp", "regs" (the warp kernels, 64..1024 threads per row) or "block"
    pack: int
    block: int  # threads per block
    width: int = 0  # warp impl: lanes per row
    cols_per_thread: int = 0  # warp impl: columns per lane
    cached: bool = False  # block impl: row in shared memory
    smem: int = 0  # dynamic shared memory bytes
    acc_packs: int = 0  # block backward: packs per thread accumulated in registers (0: none)
    param_kernel: bool = False  # backward: dweight/dbias by row_param_grad instead of in the dx kernel

    @property
    def name(self) -> str:
        if self.impl in ("warp", "regs"):
            return self.impl
        return "block-smem" if self.cached else "block-uncached"

    @property
    def rows_per_block(self) -> int:
        return self.block // self.width if self.impl in ("warp", "regs") else 1


def plan_rows(direction: str, n: int, pack: int, elem_bytes: int, smem_optin: int,
              occupancy: Callable[[bool, int, int, int], int], want_params: bool = False,
              force: str | None = None) -> RowPlan:
    """The implementation for rows of n columns. occupancy(cached, block, smem, acc_packs) gives
    the resident blocks per SM of the block kernel so configured. force: "warp", "regs",
    "block-smem" or "block-uncached" (the ladder runs each); None picks by width: OneFlow's
    dispatch with the regs impl between the warp and block impls."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction: expected 'fwd' or 'bwd', got {direction!r}")
    if force not in (None, "warp", "regs", "block-smem", "block-uncached"):
        raise ValueError(f"force: expected None, 'warp', 'regs', 'block-smem' or 'block-uncached', got {force!r}")
    want_params = want_params and direction == "bwd"
    if force == "warp" and n > WARP_MAX_COLS:
        raise ValueError(f"the warp impl holds rows of at most {WARP_MAX_COLS} columns, not {n}")
    if force == "warp" or (force is None and n <= WARP_MAX_COLS):
        width, cols = warp_layout(n, pack)
        return RowPlan("warp", pack, WARP_BLOCK_THREADS, width, cols)
    if force in (None, "regs"):
        layout = reg_layout(direction, n, pack, elem_bytes)
        if layout is None and force == "regs":
            raise ValueError(f"the regs impl holds rows of at most {REG_ROW_MAX.get((direction, elem_bytes))} "
                             f"columns ({direction}, {elem_bytes}-byte elements), not {n}")
        if layout is not None:
            width, cols = layout
            return RowPlan("regs", pack, max(width, WARP_BLOCK_THREADS), width, cols)
    packs = cdiv(n, pack)
    acc_packs = max(1, BWD_ACC_ELEMS // pack) if want_params else 0
    candidates = BLOCK_SIZES
    if acc_packs:
        candidates = tuple(b for b in BLOCK_SIZES if b * acc_packs >= packs)
        if not candidates:  # too wide for the register accumulators
            acc_packs, candidates = 0, BLOCK_SIZES
    param_kernel = want_params and acc_packs == 0
    smem = n * elem_bytes * (1 if direction == "fwd" else 2)
    if force in (None, "block-smem") and smem <= smem_optin:
        block = choose_block_size(lambda b: occupancy(True, b, smem, acc_packs), candidates)
        if block is not None:
            return RowPlan("block", pack, block, cached=True, smem=smem, acc_packs=acc_packs,
                           param_kernel=param_kernel)
    if force == "block-smem":
        raise ValueError(f"block-smem cannot hold a row of {n} columns ({smem} B) on this GPU")
    # uncached: UNCACHED_BLOCK is among the candidates whenever acc_packs > 0
    return RowPlan("block", pack, UNCACHED_BLOCK, cached=False, acc_packs=acc_packs, param_kernel=param_kernel)


@dataclass(frozen=True)
class ClusterPlan:
    threads: int
    items: int  # 16-byte packs per thread
    stages: int
    cluster: int  # CTAs per row
    slice: int  # columns per CTA (a multiple of the pack)
    smem: int  # dynamic shared memory bytes (the stages)
    recompute: bool = False  # read the stage again (backward: dx, RECOMPUTE; forward: every pass, RELOAD)
    push: bool = False  # partials pushed by st.async to mbarriers (PUSH); the forward's: many clusters
    merge: bool = False  # the CTA's warps merged first, one value per CTA in each exchange (MERGE)
    one_pass: bool = False  # push LayerNorm: moments from one read of the slice (ONE_PASS)
    overlap: bool = False  # push backward: two rows in flight (OVERLAP)
    sm_threads: int = 1024  # RELOAD forward: the threads per SM its registers are capped for (SM_THREADS)
    ahead: int = 0  # push forward: the packs whose weight and bias are fetched ahead of their stores (AHEAD)
    hold_w: bool = False  # the CTA's weight slice held in registers over its rows (backward: HOLD_PLAN; push
    #                       forward: HOLD, with its bias, on one wave of persistent clusters)


def plan_cluster(direction: str, cols: int, elem_bytes: int, shape=None, op: str = "ln") -> ClusterPlan | None:
    """The cluster kernel's plan for rows of `cols` columns of op "ln" or "rms", or None when they cannot take it
    (not a whole number of 16-byte packs, more than CLUSTER_MAX CTAs, stages too big).
    shape: (threads, items, stages[, recompute[, push[, merge[, one_pass (forward) / overlap (backward)]]]]);
    default: CLUSTER_FWD_HOLD's for the (op, width) (the forward holding its parameters), else CLUSTER_SHAPES' for the
    width, else CLUSTER_KERNELS'."""
    hold = CLUSTER_FWD_HOLD.get((op, elem_bytes, next_pow2(cols))) if direction == "fwd" and not shape else None
    shape = shape or (hold[0] if hold else None) or CLUSTER_SHAPES.get((direction, elem_bytes, next_pow2(cols))) \
        or CLUSTER_KERNELS[(direction, elem_bytes)]
    threads, items, stages, *rest = shape
    recompute = bool(rest and rest[0])
    push = len(rest) > 1 and bool(rest[1])  # the backward's: the exchange alone (one persistent wave)
    merge = len(rest) > 2 and bool(rest[2])
    one_pass = push and direction == "fwd" and len(rest) > 3 and bool(rest[3])
    # the backward's two rows in flight (push exchange): with the stage read again, rows it and it + 1 stay in
    # their stages (3 stages or more), else in two register sets (2 or more)
    overlap = push and direction == "bwd" and len(rest) > 3 and bool(rest[3])
    if overlap and stages < (3 if recompute else 2):
        raise ValueError(f"cluster shape {shape}: the backward's overlap needs {3 if recompute else 2} stages or more")
    pack = 16 // elem_bytes
    if cols < 1 or cols % pack:
        return None
    cluster = cdiv(cols, threads * items * pack)
    while cluster > CLUSTER_MAX and threads < CLUSTER_MAX_THREADS:
        threads *= 2  # wider CTAs rather than more of them
        cluster = cdiv(cols, threads * items * pack)
    if cluster > CLUSTER_MAX:
        return None
    while cluster == 1 and threads > CLUSTER_MIN_THREADS and (threads // 2) * items * pack >= cols:
        threads //= 2  # narrow rows: smaller CTAs, more of them per SM
    slice_ = cdiv(cdiv(cols, cluster), pack) * pack
    arrays = 1 if direction == "fwd" else 2
    smem = stages * arrays * cdiv(slice_ * elem_bytes, 128) * 128
    if smem > CLUSTER_SMEM_MAX:
        return None
    reload_fwd = direction == "fwd" and recompute  # the cap is RELOAD's (the registers kernel holds the slice)
    sm_threads = CLUSTER_FWD_SM_THREADS.get((op, elem_bytes, next_pow2(cols)), 1024) if reload_fwd else 1024
    if hold:
        sm_threads = hold[1]
    ahead = CLUSTER_FWD_PARAM_AHEAD.get((op, elem_bytes), 0) if push and direction == "fwd" and not hold else 0
    hold_w = bool(hold) if direction == "fwd" else (op, elem_bytes, next_pow2(cols)) not in CLUSTER_BWD_HOLD_W_OFF
    return ClusterPlan(threads, items, stages, cluster, slice_, smem, recompute, push, merge, one_pass, overlap,
                       sm_threads, ahead, hold_w)


# GroupNorm over dense NCHW groups on the same cluster kernels (row_cluster.cu gn_*_cluster; issue 24): a group
# of Cg x S contiguous elements is a row. (direction, element bytes) -> the shape tuple of CLUSTER_KERNELS,
# whose items is the most packs a thread holds: the plan takes the fewest CTAs per group that fit, and sizes
# items to the slice. The backward's weight gradients need each CTA's slice to be whole channels, so there
# the CTAs per group divide Cg. Runs S12-1 / S12-2 (H200, gn_sweep.py's cluster variants): CTAs of 128
# threads (more of them per SM) won the routed points (triton/configs.py GN_CLUSTER_ROUTE); the bf16 forward
# keeps the row forward's shape (routed since S25-2, where 128 threads won 3 of 7 shapes by 0.01 and lost
# 32x256x56x56 by 0.04).
# Session 14 (run S14-5, H200): the bf16 backward with the push exchange (5th value) on one persistent wave, at the
# routed groups 0.335 -> 0.343 (8x640x32x32), 0.393 -> 0.427 (16x640x32x32), 0.544 -> 0.570 (32x256x56x56); fp32 not
# measured with it (S14-4 measured both dtypes on many waves, slower).
GN_CLUSTER_KERNELS = {("fwd", 2): (256, 8, 1, True, True, False, True), ("fwd", 4): (128, 8, 1, True, True, False, True),
                      ("bwd", 2): (128, 8, 2, False, True), ("bwd", 4): (128, 8, 2, False)}


def plan_gn_cluster(direction: str, cg: int, spatial: int, elem_bytes: int, want_params: bool = False,
                    shape=None) -> ClusterPlan | None:
    """The GroupNorm cluster kernel's plan for groups of cg channels of `spatial` positions, or None
    when they cannot take it (positions not whole 16-byte packs, more than CLUSTER_MAX CTAs, stages
    too big). shape: as GN_CLUSTER_KERNELS' values (the default)."""
    threads, items, stages, *rest = shape or GN_CLUSTER_KERNELS[(direction, elem_bytes)]
    recompute = bool(rest and rest[0])
    push = len(rest) > 1 and bool(rest[1])  # the backward's: the exchange alone (its partials are per sample)
    merge = direction == "fwd" and len(rest) > 2 and bool(rest[2])  # gn_bwd_cluster has no MERGE
    one_pass = push and direction == "fwd" and len(rest) > 3 and bool(rest[3])
    pack = 16 // elem_bytes
    if cg < 1 or spatial < 1 or spatial % pack:
        return None
    cols = cg * spatial
    if cols * spatial >= 1 << 32:  # the kernels' channel of a column, col / spatial, is exact below this (DivBy)
        return None
    whole_channels = direction == "bwd" and want_params
    while True:
        cluster = cdiv(cols, threads * items * pack)
        if whole_channels:  # the fewest CTAs, at least that many, whose slices are whole channels
            cluster = next((c for c in range(cluster, min(cg, CLUSTER_MAX) + 1) if cg % c == 0), CLUSTER_MAX + 1)
        if cluster <= CLUSTER_MAX or threads >= CLUSTER_MAX_THREADS:
            break
        threads *= 2  # wider CTAs rather than more of them
    if cluster > CLUSTER_MAX:
        return None
    while cluster == 1 and threads > CLUSTER_MIN_THREADS and (threads // 2) * items * pack >= cols:
        threads //= 2  # small groups: smaller CTAs, more of them per SM
    slice_ = cdiv(cdiv(cols, cluster), pack) * pack
    items = cdiv(slice_, threads * pack)  # the packs a thread holds (registers)
    arrays = 1 if direction == "fwd" else 2
    smem = stages * arrays * cdiv(slice_ * elem_bytes, 128) * 128
    if smem > CLUSTER_SMEM_MAX:
        return None
    return ClusterPlan(threads, items, stages, cluster, slice_, smem, recompute, push, merge, one_pass)


# GroupNorm over channels_last groups (row_cluster.cu gn_cl_fwd_cluster / gn_cl_bwd_cluster; issue 24): a cluster
# per (sample, channel block of whole groups), its CTAs splitting the positions, each holding its [positions,
# channels] tile (x; x and dy) in shared memory. (direction, element bytes) -> (threads, most bytes of each tile,
# bytes a position's run of the block's channels should reach (a 32-byte sector or more where whole groups
# allow), CTAs per SM wanted: batch-1 shapes take more CTAs per slab until the grid fills that many).
# Runs S13-1 / S13-2 (H200, gn_sweep.py's clc variants): the shapes that won where the Triton backend routes
# (triton/configs.py GN_CL_CLUSTER_ROUTE).
GN_CL_CLUSTER_KERNELS = {("fwd", 2): (128, 32 * 1024, 64, 4), ("fwd", 4): (256, 64 * 1024, 128, 2),
                         ("bwd", 2): (256, 80 * 1024, 64, 1), ("bwd", 4): (256, 48 * 1024, 64, 2)}
GN_CL_MAX_GROUPS = 16  # groups per channel block (the kernels' kMaxClGroups)
GN_CL_MIN_SLICE = 32  # positions per CTA below which batch-1 slabs are not cut further


@dataclass(frozen=True)
class GnClPlan:
    threads: int
    cluster: int  # CTAs per slab
    slice: int  # positions per CTA
    block_c: int  # channels per slab: whole groups, whole 16-byte packs, dividing C
    smem: int  # dynamic shared memory bytes: the tile(s), then the per-channel partials (and slots)
    push: bool = False  # (cluster.Prepared's field: not a push kernel)


def plan_gn_cl_cluster(direction: str, batch: int, C: int, S: int, cg: int, elem_bytes: int, sms: int,
                       shape=None) -> GnClPlan | None:
    """The channels_last GroupNorm cluster kernel's plan, or None when it cannot take the call (channels
    not whole 16-byte packs, no block of whole groups that is, a slab too big for CLUSTER_MAX CTAs'
    shared memory).
    shape: as GN_CL_CLUSTER_KERNELS' values (the default)."""
    threads, tile_bytes, run_bytes, per_sm = shape or GN_CL_CLUSTER_KERNELS[(direction, elem_bytes)]
    pack = 16 // elem_bytes
    arrays = 1 if direction == "fwd" else 2
    if batch < 1 or cg < 1 or S < 1 or C % cg or C % pack:
        return None
    groups = C // cg
    # the backward's cluster sums take a thread per (channel, sum)
    blocks = [k for k in range(1, min(groups, GN_CL_MAX_GROUPS) + 1)
              if groups % k == 0 and (k * cg) % pack == 0 and k * cg // pack <= threads
              and (arrays == 1 or 2 * k * cg <= threads)]
    if not blocks:
        return None
    k = next((k for k in blocks if k * cg * elem_bytes >= run_bytes), blocks[-1])
    block_c = k * cg
    slabs = batch * (C // block_c)
    cluster = min(CLUSTER_MAX, cdiv(S * block_c * elem_bytes, tile_bytes))  # (bigger tiles past CLUSTER_MAX CTAs)
    while cluster < CLUSTER_MAX and S >= 2 * cluster * GN_CL_MIN_SLICE and slabs * cluster < per_sm * sms:
        cluster = min(CLUSTER_MAX, cluster * 2)  # few slabs (batch 1): more, smaller CTAs
    slice_ = cdiv(S, cluster)
    cluster = cdiv(S, slice_)  # no CTA without positions
    ty = threads // (block_c // pack)
    # the tile(s), then the per-thread partials [arrays][ty][block_c] and per-channel sums [arrays][block_c] (the
    # forward leaves the latter unused: the measured plans kept it)
    smem = arrays * cdiv(slice_ * block_c * elem_bytes, 16) * 16 + arrays * (ty + 1) * block_c * 4
    if direction == "bwd":
        smem += cluster * 2 * block_c * 4  # the cluster's slots
    if smem > CLUSTER_SMEM_MAX:
        return None
    return GnClPlan(threads, cluster, slice_, block_c, smem)


def grid_blocks(work_blocks: int, sms: int, resident: int, waves: int) -> int:
    """Blocks to launch: the work, capped at `waves` waves of resident blocks (kernels loop)."""
    return max(1, min(work_blocks, sms * max(1, resident) * waves))


def param_splits(rows: int, sms: int) -> tuple[int, int]:
    """row_param_grad: (splits, rows per split); splits = partial rows for col_sum."""
    splits = max(1, min(cdiv(rows, PARAM_TILE[1]), sms * PARAM_SPLITS_PER_SM))
    per = cdiv(rows, splits)
    return cdiv(rows, per), per


def gn_chunks(B: int, C: int, S: int, channels_last: bool, sms: int) -> tuple[int, int]:
    """(chunk, chunks): gn_reduce splits S into `chunks` chunks of `chunk` positions so that about
    GN_TARGET_BLOCKS_PER_SM blocks per SM run, none on fewer than GN_MIN_CHUNK positions."""
    tile = GN_REDUCE_BLOCK[0] if channels_last else GN_REDUCE_BLOCK[1]
    base = max(1, B * cdiv(C, tile))
    want = cdiv(GN_TARGET_BLOCKS_PER_SM * sms, base)
    chunks = max(1, min(want, cdiv(S, GN_MIN_CHUNK)))
    chunk = max(1, cdiv(S, chunks))
    return chunk, cdiv(max(S, 1), chunk)


def gn_apply_block(inner: int) -> tuple[int, int]:
    """gn_apply's block (TX, TY): TX lanes along the unit-stride axis of `inner` elements."""
    tx = min(GN_APPLY_THREADS, next_pow2(max(1, inner)))
    return tx, GN_APPLY_THREADS // tx
