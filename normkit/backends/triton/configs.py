"""Launch configurations as data.

A configuration is looked up by (direction, element size in bytes, padded row width) and says:
  block_m          rows per tile (several for narrow rows, so each program moves enough bytes)
  split            programs sharing one row (1: the whole row is one program's tile)
  num_warps        warps per program
  programs_per_sm  persistent programs per SM (0: one program per row block, not persistent)
  num_stages       optional 5th value, Triton's software-pipelining depth (default 1: none)
  prefetch         optional 6th value, backward only: a persistent program loads its next tile (in
                   x's dtype) before working on the current one (default PREFETCH_DEFAULT; split
                   rows always do)
  reg_cap          optional 7th value (default False): compile with ptxas's maxnreg at what leaves
                   room for programs_per_sm programs of num_warps on an SM (reg_cap_for), where
                   ptxas would otherwise take a few more registers and halve the programs per SM
The tile is block_m x (padded_n / split). Rows wider than MAX_TILED_N are walked in chunks by the
looped kernels, and so are the widths a measured table's "looped" section lists (its rows: chunk
columns, num_warps, whether the forward's two passes take L2 eviction hints, and optionally the programs
per SM whose register cap ptxas compiles at (reg_cap_for: one program per row, so the registers decide
how many share an SM); the forward is then compiled for the exact width). The tables below are the defaults; measured tables for a GPU architecture, written
by benchmarks/tune.py, live in tuned/<arch>.json next to this file and take precedence over the
defaults (a width's row there may be {"ln": row, "rms": row} where the ops were measured apart);
OVERRIDES (used by the tuner to try candidates) take precedence over both.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class RowConfig:
    block_m: int
    block_n: int
    split: int
    num_warps: int
    programs_per_sm: int
    looped: bool = False
    num_stages: int = 1  # 1: no software pipelining (it would stage tiles through shared memory)
    cuda: bool = False  # rows go to the CUDA backend's Hopper cluster kernels when the call allows
    prefetch: bool = False  # backward: the next tile's loads in flight while this one is worked on
    reg_cap: int = 0  # ptxas maxnreg (0: its own choice)
    evict: bool = False  # looped forward: L2 keeps the row for the second pass, which then drops it
    static_n: bool = False  # looped forward: compiled for the exact width (a kernel per width)

    @property
    def options(self):
        return (self.num_warps, self.num_stages) + ((self.reg_cap,) if self.reg_cap else ())


# default rows: padded_n -> (block_m, split, num_warps, programs_per_sm), per (direction, elem bytes)
_FWD_16 = {32: (128, 1, 4, 0), 64: (64, 1, 4, 0), 128: (32, 1, 4, 0), 256: (16, 1, 4, 0), 512: (8, 1, 4, 0),
           1024: (4, 1, 4, 0), 2048: (2, 1, 4, 0), 4096: (1, 1, 8, 0), 8192: (1, 1, 8, 0),
           16384: (1, 2, 8, 2), 32768: (1, 4, 8, 2), 65536: (1, 8, 8, 2), 131072: (1, 16, 8, 2),
           262144: (1, 32, 8, 2)}
_FWD_32 = {**_FWD_16, 8192: (1, 1, 16, 0), 16384: (1, 4, 8, 2), 32768: (1, 8, 8, 2), 65536: (1, 16, 8, 2),
           131072: (1, 32, 8, 2), 262144: (1, 64, 8, 2)}
_BWD_16 = {32: (128, 1, 4, 4), 64: (64, 1, 4, 4), 128: (32, 1, 4, 4), 256: (16, 1, 4, 4), 512: (8, 1, 4, 4),
           1024: (4, 1, 4, 4), 2048: (2, 1, 4, 4), 4096: (1, 1, 8, 2), 8192: (1, 2, 8, 2),
           16384: (1, 4, 8, 2), 32768: (1, 8, 8, 2), 65536: (1, 16, 8, 2), 131072: (1, 32, 8, 2),
           262144: (1, 64, 8, 2)}
_BWD_32 = {**_BWD_16, 4096: (1, 2, 8, 2), 8192: (1, 4, 8, 2), 16384: (1, 8, 8, 2), 32768: (1, 16, 8, 2),
           65536: (1, 32, 8, 2), 131072: (1, 64, 8, 2), 262144: (1, 128, 8, 2)}
DEFAULTS = {("fwd", 2): _FWD_16, ("fwd", 4): _FWD_32, ("bwd", 2): _BWD_16, ("bwd", 4): _BWD_32}

PREFETCH_DEFAULT = False
# a prefetching backward loads the next tile's row statistics with it (False: as the tile is worked
# on, everywhere; kept for A/B runs: benchmarks/bwd_sweep.py's nostats), except for the ops that
# PREFETCH_STATS_OFF lists for a GPU (a substring of its name). One table serves every sm_90 GPU, and
# the two measured disagree: on an H200 both ops gain (runs S17-1 / S17-2, bf16, 1K-8K: RMSNorm
# 0.86-0.88 -> 0.89-0.90, 8K 0.82 -> 0.88; LayerNorm 4K 0.83 -> 0.87); on an H100 (run S17-11, the
# same rows with and without) RMSNorm loses (0.93-0.94 -> 0.89-0.90 at 1K-8K) and LayerNorm gains
# (8K 0.84 -> 0.91, 1K-2K +0.01) except at 4K (0.92 -> 0.88).
PREFETCH_STATS = True
PREFETCH_STATS_OFF = {"H100": ("rms",)}


def prefetch_stats(device_name: str, op: str) -> bool:
    """Whether the backward of `op` ("ln" / "rms") on this GPU prefetches the next tile's statistics."""
    return PREFETCH_STATS and not any(gpu in device_name and op in ops for gpu, ops in PREFETCH_STATS_OFF.items())


# float8 outputs by the GPU's conversion instruction (sm_89+) rather than the integer encoding the
# interpreter runs (epilogue.py: same bits); False: the encoding everywhere (the bench's old variant)
FP8_HW_CAST = True

MAX_TILED_N = 262144
LOOPED = {"fwd": (8192, 16), "bwd": (4096, 16)}  # (chunk columns, num_warps[, programs per SM: a register cap])
LOOPED_PROGRAMS_PER_SM = 1
# the looped forward's L2 hints where no table row says (above MAX_TILED_N): its first pass asks L2 to keep the
# row, its second to drop it (Inductor's looped reductions do; measured in benchmarks/fwd_sweep.py)
LOOPED_EVICT = False
# ... and whether they compile the forward for the exact width (the table's looped rows always do: run S18-4 measured
# Inductor's looped kernel 0.03-0.13 of copy slower with the width at run time); rows past MAX_TILED_N keep one kernel
LOOPED_STATIC_N = False
# ... and how many rows one looped program walks side by side (the sweeps' knob: the parameters' chunk loads, from L2,
# then serve every row of the block)
LOOPED_BLOCK_M = 1
# column reduction of the weight-gradient partials (col_sum_kernel): BLOCK_N the widest in
# COL_SUM_BLOCK_N that still gives every SM a program (a few wide programs walking hundreds of
# partial rows wait on one L2 round trip per step), BLOCK_P so a step loads COL_SUM_TILE elements
COL_SUM_BLOCK_N = (16, 128)  # (narrowest, widest)
COL_SUM_TILE = 4096
COL_SUM_WARPS = 4
# persistent programs when there is no GPU to size the grid from (Triton interpreter on CPU)
INTERPRETER_PROGRAMS = 4

_TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
# (direction, elem bytes, padded n) -> row; wins over everything (the tuner's candidates go here)
OVERRIDES: dict = {}
# (direction, elem bytes) -> padded widths whose rows run on the CUDA backend's thread-block
# cluster kernels (normkit/backends/cuda/cluster.py) when the call can take them (16-byte aligned
# rows, x's dtype or fp32 parameters). A measured table lists them under "cuda", per direction,
# element bytes and op ("ln", "rms"); CUDA_OVERRIDES (the bench's variants; both ops) wins over it.
# sm_90's 16-bit LayerNorm backward at 2K runs there (one CTA a row, the push kernel holding its weight over its rows
# since session 26): run S27-7 (H200, `bash benchmarks/device_s27.sh clp`, bwd_sweep.py cl-p against the Triton
# tiles, twice) 0.865 -> 0.891 / 0.894 of copy; at 4K 0.866 -> 0.870 / 0.871, RMSNorm 2K / 4K +0.004-0.007 (noise
# level, not routed); LayerNorm 8K a tie (0.815 / 0.812 -> 0.817 / 0.819), RMSNorm 8K slower (0.89 -> 0.85).
CUDA_OVERRIDES: dict = {}


@functools.lru_cache(maxsize=None)
def tuned_table(arch: str) -> dict:
    """Measured configurations for an architecture (e.g. "sm_90"), or {} if none were committed."""
    path = os.path.join(_TUNED_DIR, f"{arch}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    table = {}
    for d, by_bytes in raw["configs"].items():
        for b, by_n in by_bytes.items():
            for n, v in by_n.items():
                if isinstance(v, dict):  # rows per op ("ln", "rms") where the ops were measured apart
                    table.update({(d, int(b), int(n), op): tuple(r) for op, r in v.items()})
                else:
                    table[(d, int(b), int(n))] = tuple(v)
    for d, by_bytes in raw.get("looped", {}).items():  # widths walked in chunks: (chunk, num_warps, evict[, programs per SM])
        for b, by_n in by_bytes.items():
            for n, v in by_n.items():
                rows = v.items() if isinstance(v, dict) else [(None, v)]
                table.update({("looped", d, int(b), int(n)) + ((op,) if op else ()): tuple(r) for op, r in rows})
    for d, by_bytes in raw.get("cuda", {}).items():
        for b, by_op in by_bytes.items():
            for op, widths in by_op.items():
                table[("cuda", d, int(b), op)] = frozenset(int(n) for n in widths)
    return table


def _cuda_route(direction: str, elem_bytes: int, key: int, arch: str, op: str) -> bool:
    widths = CUDA_OVERRIDES.get((direction, elem_bytes))
    if widths is None:
        widths = tuned_table(arch).get(("cuda", direction, elem_bytes, op), ()) if arch else ()
    return key in widths


@functools.lru_cache(maxsize=None)
def row_config(direction: str, n: int, elem_bytes: int, arch: str = "", interpreted: bool = False,
               op: str = "") -> RowConfig:
    """The configuration for rows of n columns; op ("ln" or "rms") selects the CUDA route and the
    measured table's per-op rows."""
    padded = triton.next_power_of_2(max(n, 1))
    elem_bytes = 2 if elem_bytes <= 2 else 4
    key = max(padded, 32)  # the narrowest tabulated width; narrower rows pack more rows per tile
    row = None
    cuda = not interpreted and _cuda_route(direction, elem_bytes, key, arch, op)
    if padded <= MAX_TILED_N:
        row = OVERRIDES.get((direction, elem_bytes, key))
        if arch and not row:
            tuned = tuned_table(arch)
            loop = tuned.get(("looped", direction, elem_bytes, key, op)) or tuned.get(("looped", direction, elem_bytes, key))
            if loop:
                chunk, num_warps, evict, *per_sm = loop
                return looped_config(direction, padded, cuda, (chunk, num_warps, *per_sm), bool(evict), True)
            row = tuned.get((direction, elem_bytes, key, op)) or tuned.get((direction, elem_bytes, key))
        row = row or DEFAULTS[(direction, elem_bytes)].get(key)
    if row is not None:
        block_m, split, num_warps, programs_per_sm, *rest = row
        num_stages = rest[0] if rest else 1
        prefetch = rest[1] if len(rest) > 1 else PREFETCH_DEFAULT
        reg_cap = reg_cap_for(num_warps, programs_per_sm) if len(rest) > 2 and rest[2] else 0
        block_m *= key // padded
        # a split row needs its programs running side by side; the interpreter runs them in turn
        if not (interpreted and split > 1):
            return RowConfig(block_m, padded // split, split, num_warps, programs_per_sm, False, num_stages,
                             cuda=cuda, prefetch=bool(prefetch), reg_cap=reg_cap)
    return looped_config(direction, padded, cuda)


def looped_config(direction: str, padded: int, cuda: bool = False, shape=None, evict=None,
                  static_n=None) -> RowConfig:
    """The looped kernels' configuration for rows of `padded` columns: `shape` (chunk columns, num_warps[, programs
    per SM to cap the registers for]), evict and static_n from a table's looped row, else LOOPED and the
    LOOPED_EVICT / LOOPED_STATIC_N / LOOPED_BLOCK_M knobs (read now)."""
    chunk, num_warps, *per_sm = shape or LOOPED[direction]
    reg_cap = reg_cap_for(num_warps, per_sm[0]) if per_sm else 0
    return RowConfig(LOOPED_BLOCK_M, min(chunk, padded), 1, num_warps, LOOPED_PROGRAMS_PER_SM, looped=True, cuda=cuda,
                     reg_cap=reg_cap, evict=LOOPED_EVICT if evict is None else evict,
                     static_n=LOOPED_STATIC_N if static_n is None else static_n)


REGS_PER_SM = 65536  # every NVIDIA GPU from sm_70 to sm_120


def reg_cap_for(num_warps: int, programs_per_sm: int) -> int:
    """The most registers per thread that let programs_per_sm programs of num_warps be resident
    (allocated per warp in units of 256: a multiple of 8), at most ptxas's 255 (0: no cap needed)."""
    cap = REGS_PER_SM // (max(programs_per_sm, 1) * num_warps * 32) // 8 * 8
    return cap if cap < 248 else 0


@functools.lru_cache(maxsize=None)
def col_sum_block(rows: int, n: int, sms: int) -> tuple:
    """(BLOCK_P, BLOCK_N, num_warps) of the reduction of `rows` partial rows of n columns."""
    lo, hi = COL_SUM_BLOCK_N
    block_n = hi
    while block_n > lo and -(-n // block_n) < sms:
        block_n //= 2
    block_p = max(1, min(triton.next_power_of_2(max(rows, 1)), COL_SUM_TILE // block_n))
    return block_p, block_n, COL_SUM_WARPS


# ----------------------------------------------------------------------------- group norm
# elements of one program's [channels x spatial] tile, per (direction, element bytes); a group
# larger than this is split over several programs
GN_TILE = {("fwd", 2): 16384, ("fwd", 4): 4096, ("bwd", 2): 4096, ("bwd", 4): 2048}
GN_ELEMS_PER_THREAD = 16
GN_WARPS_PER_SM = 32  # persistent programs per SM = this / num_warps (at most 8)
# with many groups: a program per group walks [BLOCK_R, BLOCK_S] tiles of this many elements
# twice (forward: statistics, then normalize; backward: the two group sums, then dx), the second
# pass mostly from L2, instead of splitting the group over programs that wait on each other;
# chosen when there are at least GN_LOOPED_MIN_GROUPS_PER_SM groups per SM and the group, padded, is
# larger than GN_ONE_TILE_MAX. The tile's channel block is the one, down to GN_LOOPED_MIN_BLOCK_FRACTION of
# the tile's, that pads the group's channels least (ties: the larger).
# (direction, element bytes) -> (tile elements, num_warps)
GN_LOOPED_TILE = {("fwd", 2): (8192, 8), ("fwd", 4): (4096, 8), ("bwd", 2): (8192, 8), ("bwd", 4): (4096, 8)}
# H100, run S10-gn10 (bf16 backward): [2, 4096] tiles for 32x256x56x56 (8 channels a group) 0.52 -> 0.60 of
# copy over [1, 4096]; [32, 256] for 8x1280x16x16's 40 channels 0.33 -> 0.31 (64 rows padded) where
# [16, 256] pads to 48; [8, 1024] vs [4, 1024] for 20 channels within noise (16x640x32x32 0.46 / 0.49,
# 8x640x32x32 0.43 / 0.43): the least padding keeps [4, 1024]. The forward keeps the full tile (session 9:
# halving it was slower). (direction, element bytes) -> fraction; 1.0 where absent
GN_LOOPED_MIN_BLOCK_FRACTION = {("bwd", 2): 0.5}
# the most elements (padded) of a group that, with at least GN_LOOPED_MIN_GROUPS_PER_SM groups per SM, is
# held in one tile (GN_TILE, read once, registers) rather than looped; per (direction, element bytes), per
# layout. H100, S10-gn10: 8x1280x16x16 NCHW bf16 forward ([64, 256] groups) one tile of 16 warps, 2
# programs per SM: 0.32 -> 0.40 of copy over looped [32, 256] tiles (channels_last not measured: looped)
GN_ONE_TILE_MAX = {("fwd", 2): {"nchw": 16384, "cl": 8192}, ("fwd", 4): {"nchw": 4096, "cl": 4096},
                   ("bwd", 2): {"nchw": 4096, "cl": 4096}, ("bwd", 4): {"nchw": 4096, "cl": 4096}}
GN_LOOPED_STAGES = 1
GN_LOOPED_MIN_GROUPS_PER_SM = {"fwd": 1, "bwd": 1}
# the looped kernels as the row norms' looped forward is built (group_norm._gn_fwd_looped_slots): the first
# pass (forward: statistics; backward: the two group sums) sums per element slot and reduces across the
# program's threads once, not twice per tile (each reduction a barrier that the next tile's loads wait
# behind), and both passes load the next tile before working on the current one.
# (direction, element bytes) -> (most spatial positions, (tile elements, num_warps)): looped groups of at most that
# many positions take them, on that tile. H200, bf16 forward, runs S22-2 / S22-3 / S22-6, fraction of copy, committed
# plan -> slots on [2, 1024] x 8 warps: 16x640x32x32 0.421 / 0.424 -> 0.488 / 0.477 / 0.489, 8x640x32x32 0.332 / 0.338
# -> 0.351 / 0.352 / 0.334 ([4, 1024] x 16 warps: 0.428 / 0.443 / 0.443, 0.364 / 0.384 / 0.380: better at 8x640, worse
# at 16x640). Not at more positions, where they lost:
# 32x256x56x56 (S = 3136, padded to 4096) 0.586 / 0.589 -> 0.42-0.45, 8x320x64x64 0.49-0.50 -> 0.40 (0.49 on
# [1, 4096] x 16 warps). The backward measured level (0.41 / 0.34 / 0.42 at 8x320x64x64 / 8x640x32x32 /
# 16x640x32x32): not taken. (Until session 22 the slots kept a Welford state each, without the loads ahead, and
# were never taken: H100 S9-gn9, halved tiles, +5-12% at ~2 groups per SM, -20% at 16x640x32x32.)
GN_LOOPED_SLOTS: dict = {("fwd", 2): (1024, (2048, 8))}
# two-kernel split (group_norm.py: split stats, split apply): a group larger than one tile is cut
# into [BLOCK_R, BLOCK_S] slices, one program each; `stats` reduces each slice to partials, `apply`
# merges its group's partials (fixed order) and normalizes its slice (forward) or writes its dx
# (backward), last slice first so that its re-read comes from L2. No program waits on another.
# Taken for the layouts listed, for groups of at least GN_SPLIT2_MIN_TILES slices and
# GN_SPLIT2_MIN_S positions, with GN_SPLIT2_MIN_GROUPS_PER_SM <= groups per SM < GN_SPLIT2_MAX_GROUPS_PER_SM.
# Measured on the H100 (runs S7-1/S7-3): bf16 forward beats the looped path only below ~1 group
# per SM (4x128x128x128: 0.52 vs 0.43 of copy; 1x320x64x64 0.17 vs 0.15) and loses from 2
# (8x320x64x64: 0.53 vs 0.60); the bf16 backward wins at 4096+ positions (8x320x64x64: 0.50 vs
# 0.44) and loses at 1024 or fewer (8x640x32x32: 0.38 vs 0.43). fp32 loses (4x128x128x128 fwd 0.58
# vs 0.65, bwd 0.48 vs 0.60; 8x320x64x64 bwd 0.52 vs 0.56): off. Layouts per (direction, element bytes).
# (direction, element bytes) -> (tile elements, num_warps)
GN_SPLIT2_TILE = {("fwd", 2): (8192, 4), ("fwd", 4): (4096, 4), ("bwd", 2): (4096, 4), ("bwd", 4): (2048, 4)}
GN_SPLIT2_LAYOUTS = {("fwd", 2): ("nchw", "cl"), ("bwd", 2): ("nchw", "cl"), ("fwd", 4): (), ("bwd", 4): ()}
GN_SPLIT2_MIN_TILES = {"fwd": 2, "bwd": 2}
GN_SPLIT2_MIN_S = {"fwd": 0, "bwd": 4096}
GN_SPLIT2_MIN_GROUPS_PER_SM = {"fwd": 0.0, "bwd": 0.0}
GN_SPLIT2_MAX_GROUPS_PER_SM = {"fwd": 1.5, "bwd": float("inf")}
# the GroupNorm backward's reduction of its weight-gradient partials: (BLOCK_P, BLOCK_N, num_warps)
GN_COL_SUM = (32, 128, 4)
# Dense NCHW groups that run on the CUDA backend's Hopper cluster kernels (cuda/cluster.py prepare_gn: the
# group held on chip across a cluster's CTAs and read once) when the call can take them (positions a whole
# number of 16-byte packs): arch -> (direction, element bytes) -> ((fewest, most) elements per group (Cg x S),
# ...), the same shape as GN_CL_CLUSTER_ROUTE's; absent: not routed. Runs S12-1 / S12-2 (H200, benchmarks/results/2026-11-27-h200-session12-gn/), with the
# GN_CLUSTER_KERNELS shapes of cuda/configs.py, fraction of copy before -> after (both runs):
# fp32 fwd 32x256x56x56 0.59 -> 0.72, 8x320x64x64 0.51 -> 0.56, 16x640x32x32 0.58 -> 0.62, 8x1280x16x16 0.36 -> 0.39;
# fp32 bwd 32x256x56x56 0.57 -> 0.69, 8x320x64x64 0.53 -> 0.56, 16x640x32x32 0.52 -> 0.56; bf16 bwd 32x256x56x56
# 0.48 -> 0.54, 16x640x32x32 0.37 -> 0.39 (8x640x32x32 a tie). Not routed where they lost: the bf16 forward
# (8x320x64x64 0.49 -> 0.42-0.47), groups of 64K (4x128x128x128) and small groups (8x1280x16x16's backward,
# 32x1280x8x8: Triton's one-tile path is faster).
# Session 25 (run S25-2, after S24-6 took the divisions out of the cluster kernels' NCHW stores), gn_sweep.py
# default -> cluster, one call: the bf16 forward now wins at groups of 10K-25K and 64K (8x1280x16x16 0.247 -> 0.266,
# 16x640x32x32 0.490 -> 0.505, 8x640x32x32 0.351 -> 0.378, 32x256x56x56 0.580 -> 0.634, 4x128x128x128 0.429 ->
# 0.440) and still loses at 40960 (8x320x64x64 0.487 -> 0.463); the bf16 backward wins at 40K-64K too
# (8x320x64x64 0.411 -> 0.453, 1x320x64x64 0.139 -> 0.161, 4x128x128x128 0.397 -> 0.406); the fp32 forward at 64K
# (4x128x128x128 0.534 -> 0.595). The fp32 backward at 64K is a tie (0.469 / 0.472) and 8x1280x16x16's backward
# still loses in both dtypes. Session 24's table is gn_sweep.py's variant "s24-routes".
GN_CLUSTER_ROUTE: dict = {"sm_90": {("fwd", 4): ((8192, 65536),), ("bwd", 4): ((16384, 49152),),
                                    ("fwd", 2): ((8192, 32768), (49152, 65536)), ("bwd", 2): ((16384, 65536),)}}


# channels_last groups that run on the CUDA backend's cluster kernels (cuda/cluster.py prepare_gn_cl: a cluster per
# (sample, channel block of whole groups), the block's [positions, channels] slab held on chip and read once): arch ->
# (direction, element bytes) -> ((fewest, most) elements per group (Cg x S), ...); absent: not routed. Runs S13-1 /
# S13-2 (H200, benchmarks/results/2026-11-27-h200-session13/), cuda/configs.py's GN_CL_CLUSTER_KERNELS shapes
# against Triton's staged / looped kernels, fraction of copy (S13-2): bf16 fwd 8x640x32x32 0.203 -> 0.213,
# 16x640x32x32 0.313 -> 0.327, 32x256x56x56 0.412 -> 0.473, 4x128x128x128 0.286 -> 0.324 (8x320x64x64's groups of
# 40960 stay: 0.319 -> 0.295); bf16 bwd 8x640x32x32 0.239 -> 0.277, 16x640x32x32 0.292 -> 0.314, 8x1280x16x16
# 0.152 -> 0.178 (32x256x56x56 stays: 0.390 -> 0.331); fp32 fwd 8x320x64x64 0.364 -> 0.460, 16x640x32x32 0.351 ->
# 0.500, 32x256x56x56 0.419 -> 0.632, 4x128x128x128 0.338 -> 0.362, 1x320x64x64 0.151 -> 0.173; fp32 bwd
# 0.29-0.43 -> 0.38-0.58 at groups of 10K-64K (8x1280x16x16 0.243 -> 0.287). Small groups (32x1280x8x8's 2560
# elements) stay on the Triton kernels in every case.
GN_CL_CLUSTER_ROUTE: dict = {"sm_90": {("fwd", 2): ((16384, 32768), (49152, 65536)), ("fwd", 4): ((16384, 65536),),
                                       ("bwd", 2): ((8192, 20480),), ("bwd", 4): ((8192, 65536),)}}


def gn_cluster_routed(direction: str, cg: int, s: int, elem_bytes: int, arch: str, channels_last: bool = False) -> bool:
    """Whether groups of cg x s elements in this layout go to the CUDA cluster kernels on `arch`
    (GN_CL_CLUSTER_ROUTE for channels_last, else GN_CLUSTER_ROUTE; arch "" under the interpreter)."""
    table = GN_CL_CLUSTER_ROUTE if channels_last else GN_CLUSTER_ROUTE
    ranges = table.get(arch, {}).get((direction, 2 if elem_bytes <= 2 else 4), ())
    return any(lo <= cg * s <= hi for lo, hi in ranges)


@dataclass(frozen=True)
class GroupConfig:
    block_r: int  # channels per tile
    block_s: int  # spatial positions per tile
    ks: int  # spatial slices per group (the group is split into kr * ks = split slices)
    split: int
    num_warps: int
    programs_per_sm: int
    block_m: int = 1  # (shared with RowConfig by the persistent launcher and scratch sizing)
    num_stages: int = 1
    looped: bool = False  # a program per group, two passes over its tiles
    slots: bool = False  # looped: the first pass accumulates per element slot (GN_LOOPED_SLOTS)
    two_kernel: bool = False  # a program per slice in two launches (split stats, split apply)

    @property
    def options(self):
        return self.num_warps, self.num_stages


@functools.lru_cache(maxsize=None)
def group_config(direction: str, cg: int, s: int, elem_bytes: int, interpreted: bool = False,
                 groups_per_sm: float = 0.0, channels_last: bool = False) -> GroupConfig:
    r_pad, s_pad = triton.next_power_of_2(max(cg, 1)), triton.next_power_of_2(max(s, 1))
    elem_bytes = 2 if elem_bytes <= 2 else 4
    two = _split2_tile(direction, cg, s, elem_bytes)
    if ("cl" if channels_last else "nchw") in GN_SPLIT2_LAYOUTS[(direction, elem_bytes)] \
            and GN_SPLIT2_MIN_GROUPS_PER_SM[direction] <= groups_per_sm < GN_SPLIT2_MAX_GROUPS_PER_SM[direction] \
            and s >= GN_SPLIT2_MIN_S[direction] \
            and -(-cg // two[0]) * -(-s // two[1]) >= GN_SPLIT2_MIN_TILES[direction]:
        return GroupConfig(two[0], two[1], -(-s // two[1]), 1, two[2], 0, two_kernel=True)
    looped_tile, looped_warps = GN_LOOPED_TILE[(direction, elem_bytes)]
    slots = GN_LOOPED_SLOTS.get((direction, elem_bytes))
    # NCHW groups only: the slot kernels address a group by int32 offsets from its first element, which a dense
    # NCHW group (cg * s elements) keeps below 2^31; a channels_last group spans its sample (measured: NCHW only)
    slots = slots is not None and s <= slots[0] and not channels_last and cg * s < 2**31
    if slots:
        looped_tile, looped_warps = GN_LOOPED_SLOTS[(direction, elem_bytes)][1]
    one_tile_max = GN_ONE_TILE_MAX[(direction, elem_bytes)]["cl" if channels_last else "nchw"]
    if groups_per_sm >= GN_LOOPED_MIN_GROUPS_PER_SM[direction] and r_pad * s_pad > one_tile_max:
        block_s = min(s_pad, looped_tile)
        hi = min(r_pad, max(1, looped_tile // block_s))
        block_r = _least_padding(cg, max(1, int(hi * GN_LOOPED_MIN_BLOCK_FRACTION.get((direction, elem_bytes), 1.0))), hi)
        return GroupConfig(block_r, block_s, 1, 1, looped_warps, 0, num_stages=GN_LOOPED_STAGES, looped=True,
                           slots=slots)
    # under the interpreter a group is never split (its programs run one after another)
    tile = 1 << 62 if interpreted else GN_TILE[(direction, elem_bytes)]
    block_s = min(s_pad, tile)
    block_r = min(r_pad, max(1, tile // block_s))
    kr, ks = r_pad // block_r, s_pad // block_s  # powers of two, so the split is one as well
    num_warps = min(16, max(1, block_r * block_s // (32 * GN_ELEMS_PER_THREAD)))
    return GroupConfig(block_r, block_s, ks, kr * ks, num_warps, max(1, min(8, GN_WARPS_PER_SM // num_warps)))


def _split2_tile(direction: str, cg: int, s: int, elem_bytes: int) -> tuple:
    """(block_r, block_s, num_warps) of the two-kernel split: the whole spatial extent (up to the
    tile), then the channel block, of at least a quarter of the tile, that pads the group's
    channels least (40 channels: 5 blocks of 8 rather than 2 of 32)."""
    tile, warps = GN_SPLIT2_TILE[(direction, elem_bytes)]
    block_s = min(triton.next_power_of_2(max(s, 1)), tile)
    hi = min(triton.next_power_of_2(max(cg, 1)), max(1, tile // block_s))
    return _least_padding(cg, min(hi, max(1, (tile // 4) // block_s)), hi), block_s, warps


def _least_padding(cg: int, lo: int, hi: int) -> int:
    """The power-of-two channel block in [lo, hi] that pads cg channels least (ties: the larger)."""
    candidates = [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]
    return min(candidates, key=lambda br: (-(-cg // br) * br, -br))


# staged path (group_norm.py: stats, finalize, apply launches) for inputs of at least
# GN_STAGED_MIN_NUMEL elements: channels_last ones with groups of fewer than
# GN_STAGED_CL_MAX_GROUP_CHANNELS[direction] channels (a group is a short run inside each spatial
# position, so per-group tiles waste most of each memory sector; measured on the H200: the forward
# of 40-channel groups is faster per group, every backward is faster staged), and NCHW ones with
# fewer than GN_STAGED_NCHW_MAX_GROUPS_PER_SM groups per SM (measured: a gain only for huge groups; off)
GN_STAGED_MIN_NUMEL = 1 << 18
GN_STAGED_CL_MAX_GROUP_CHANNELS = {"fwd": 32, "bwd": 1 << 30}
GN_STAGED_NCHW_MAX_GROUPS_PER_SM = 0.0  # 0: NCHW never takes the staged path
GN_STAGED_TILE = {2: 4096, 4: 2048}  # elements of an apply [BLOCK_C, BLOCK_S] tile, per element bytes
GN_STAGED_WARPS = 4
# the stats launch's own tile: (elements, num_warps) per element bytes (its channel blocks need not
# be apply's: the partials are per channel)
GN_STAGED_STATS_TILE = {2: (4096, 4), 4: (2048, 4)}
# stats accumulate per element slot over a span's tiles (forward: Welford per slot; backward: sums)
# and reduce across the slots once per program, instead of two cross-thread reductions per tile
GN_STAGED_SLOTS = {"fwd": True, "bwd": True}
GN_STAGED_MAX_SUB = 1 << 16  # most tiles per stats program (a span)
# stats programs resident per SM: the spans are cut so that the stats grid is one wave of these.
# ncu (H100, run S8-1): the slot stats kernel takes 128 registers forward, 150 backward at 4 warps,
# so 4 / 3 programs per SM; a grid of 1.2-1.6 waves (session 7's spans) ran its last wave mostly empty
# One wave measured (S9-gn9 against S8-1, two H100 runs, bf16 channels_last fwd / bwd): 8x320x64x64
# 0.35 / 0.38 -> 0.42 / 0.38, 8x640x32x32 0.24 / 0.27 -> 0.27 / 0.30, 4x128x128x128 0.34 / 0.32 -> 0.36 / 0.35,
# 16x640x32x32 0.33 / 0.31 -> 0.37 / 0.35
GN_STAGED_PROGRAMS_PER_SM = {"fwd": 4, "bwd": 3}
GN_STAGED_FINALIZE_TILE = 2048  # partials a finalize program holds per step


@dataclass(frozen=True)
class StagedConfig:
    block_c: int  # apply: channels per tile (need not divide into groups)
    block_s: int  # apply: spatial positions per tile
    n_sub: int  # stats tiles per stats program (a span)
    num_warps: int  # apply
    block_p: int  # spans per step of the finalize program
    block_r: int  # channels of a group, padded
    stats_block_c: int = 0  # the stats tile (0: apply's)
    stats_block_s: int = 0
    stats_warps: int = 0
    slots: bool = False  # stats accumulate per element slot (GN_STAGED_SLOTS)

    @property
    def options(self):
        return self.num_warps, 1

    @property
    def stats_options(self):
        return self.stats_warps or self.num_warps, 1

    @property
    def stats_tile(self):
        return self.stats_block_c or self.block_c, self.stats_block_s or self.block_s


def _staged_tile(tile: int, c: int, s: int, channels_last: bool) -> tuple:
    """(block_c, block_s) of a staged tile of `tile` elements."""
    if channels_last:  # contiguous along channels: the channel block with the fewest padded lanes
        block_c = min((128, 64, 32, 16), key=lambda bc: (-(-c // bc) * bc - c, -bc))
        block_c = min(block_c, triton.next_power_of_2(c))
        return block_c, max(1, tile // block_c)
    block_s = min(triton.next_power_of_2(s), 1024, tile)  # contiguous along positions
    return max(1, min(triton.next_power_of_2(c), tile // block_s)), block_s


def staged_tiles_per_span(n_sb: int, blocks: int, programs: float) -> int:
    """Stats tiles per program for `blocks` (sample, channel block) pairs of n_sb tiles each, so
    that the stats grid is at most `programs` (one wave) where it can be."""
    spans = max(1, int(programs) // blocks)  # per (sample, channel block)
    return max(1, min(GN_STAGED_MAX_SUB, n_sb, -(-n_sb // spans)))


@functools.lru_cache(maxsize=None)
def staged_config(direction: str, b: int, c: int, s: int, cg: int, elem_bytes: int, channels_last: bool, sms: int):
    """The staged path's tiles for x = [b, c, s] with groups of cg channels, or None when the
    input takes the per-group paths."""
    if channels_last:
        wanted = cg < GN_STAGED_CL_MAX_GROUP_CHANNELS[direction]
    else:
        wanted = b * (c // cg) / sms < GN_STAGED_NCHW_MAX_GROUPS_PER_SM
    if not wanted or b * c * s < GN_STAGED_MIN_NUMEL:
        return None
    eb = 2 if elem_bytes <= 2 else 4
    block_c, block_s = _staged_tile(GN_STAGED_TILE[eb], c, s, channels_last)
    stats_tile, stats_warps = GN_STAGED_STATS_TILE[eb]
    stats_c, stats_s = _staged_tile(stats_tile, c, s, channels_last)
    n_cb, n_sb = -(-c // stats_c), -(-s // stats_s)
    n_sub = staged_tiles_per_span(n_sb, b * n_cb, GN_STAGED_PROGRAMS_PER_SM[direction] * sms)
    n_spans = -(-n_sb // n_sub)
    block_r = triton.next_power_of_2(cg)
    block_p = max(1, min(triton.next_power_of_2(n_spans), GN_STAGED_FINALIZE_TILE // block_r))
    return StagedConfig(block_c, block_s, n_sub, GN_STAGED_WARPS, block_p, block_r, stats_c, stats_s, stats_warps,
                        GN_STAGED_SLOTS[direction])
