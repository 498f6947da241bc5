"""Launch configurations as data: one table per direction, keyed by row width (and element size),
looked up once per (direction, N, dtype) and cached.

A row of the table reads: "for rows up to `n_max` columns, put `tile_elems` elements in a
program's register tile and run it with `num_warps` warps". Several rows go into one program when
a row is narrower than the tile (BLOCK_M = tile_elems // next_pow2(N)), so narrow rows still move
enough bytes per program. Above `max_single_tile` columns the row no longer fits in registers and
the looped kernels walk it in chunks of `chunk` columns.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class RowConfig:
    block_m: int  # rows per tile
    block_n: int  # columns per tile: the whole (padded) row, or one chunk of a looped row
    num_warps: int
    single_tile: bool


# (n_max, tile_elems, num_warps), ascending n_max. Keys are padded widths (powers of two).
FWD_TABLE = (
    (1024, 4096, 4),
    (2048, 4096, 4),
    (4096, 4096, 8),
    (8192, 8192, 8),
    (16384, 16384, 16),
    (32768, 32768, 32),
)
BWD_TABLE = (
    (1024, 4096, 4),
    (2048, 4096, 8),
    (4096, 4096, 8),
    (8192, 8192, 16),
    (16384, 16384, 32),
)
# widest row kept whole in registers, per element size in bytes, and the looped chunk
MAX_SINGLE_TILE = {"fwd": {2: 32768, 4: 16384}, "bwd": {2: 16384, 4: 8192}}
LOOPED = {"fwd": (8192, 16), "bwd": (4096, 16)}  # (chunk columns, num_warps)
# backward: persistent programs per SM (partial-sum buffer is programs x N fp32)
BWD_PROGRAMS_PER_SM = 1
# column reduction of the partial sums
COL_SUM_BLOCK = (32, 128)  # (BLOCK_P, BLOCK_N)
# programs when there is no GPU to size the grid from (Triton interpreter on CPU)
INTERPRETER_PROGRAMS = 4

_TABLES = {"fwd": FWD_TABLE, "bwd": BWD_TABLE}


@functools.lru_cache(maxsize=None)
def row_config(direction: str, n: int, elem_bytes: int) -> RowConfig:
    padded = triton.next_power_of_2(max(n, 1))
    if padded <= MAX_SINGLE_TILE[direction][min(elem_bytes, 4)]:
        for n_max, tile_elems, num_warps in _TABLES[direction]:
            if padded <= n_max:
                return RowConfig(max(1, tile_elems // padded), padded, num_warps, True)
    chunk, num_warps = LOOPED[direction]
    return RowConfig(1, min(chunk, padded), num_warps, False)
