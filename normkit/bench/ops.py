"""The benchmarked ops as data: shapes, parameters, the float64 oracle, suites and tolerances.

Adding an op is a table entry: an OpSpec that says how its x and parameters are shaped, how the
tensor reads as rows x columns (for the CSV and the plots), which oracle checks it, and which
shapes its sweep covers; then one call per implementation in impls.py.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DIRECTIONS = ("fwd", "bwd")
# relative error against the float64 oracle above which a result is flagged wrong; 16-bit outputs
# are bounded by their own rounding, fp32 by accumulation over long rows and long columns
TOL = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 2e-2}


@dataclass(frozen=True)
class Point:
    """One benchmarked input: x's shape (and GroupNorm's groups) for one op and dtype."""
    suite: str
    op: str
    dtype: str
    shape: tuple
    groups: Optional[int] = None
    channels_last: bool = False  # x (and dy) in channels-innermost memory order (GroupNorm)

    @property
    def spec(self) -> "OpSpec":
        return OPS[self.op]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows_cols(self) -> tuple[int, int]:
        return self.spec.rows_cols(self)

    @property
    def label(self) -> str:
        s = "x".join(map(str, self.shape))
        s = s if self.groups is None else f"{s}/g{self.groups}"
        return s + "/cl" if self.channels_last else s


# ----------------------------------------------------------------------------- row norms

def _rows_cols_last(p: Point) -> tuple[int, int]:
    return math.prod(p.shape[:-1]), p.shape[-1]


def _row_sweep(widths, numel: int, rows: Optional[int]) -> list:
    return [((rows if rows else max(1, numel // n), n), None) for n in widths]


def _ln_fwd(p, x, w, b):
    return reference.layer_norm(x, (p.shape[-1],), w, b, p.spec.eps)[0]


def _ln_bwd(p, dy, x, w, b):
    return reference.layer_norm_backward(dy, x, (p.shape[-1],), w, b, p.spec.eps)


def _rms_fwd(p, x, w, b):
    return reference.rms_norm(x, (p.shape[-1],), w, p.spec.eps)[0]


def _rms_bwd(p, dy, x, w, b):
    dx, dw = reference.rms_norm_backward(dy, x, (p.shape[-1],), w, p.spec.eps)
    return dx, dw, None


# ----------------------------------------------------------------------------- GroupNorm

# (channels, groups) of the GroupNorm sweep; spatial size 4096 where the size allows (seed 004)
GN_CHANNELS = ((256, 8), (320, 32))
GN_SPATIAL = 4096


def _gn_rows_cols(p: Point) -> tuple[int, int]:
    b, c = p.shape[0], p.shape[1]
    return b * p.groups, (c // p.groups) * math.prod(p.shape[2:])


def _gn_sweep(widths, numel: int, rows: Optional[int]) -> list:
    out = []
    for c, g in GN_CHANNELS:
        s = min(GN_SPATIAL, max(1, numel // c))
        out.append(((rows if rows else max(1, numel // (c * s)), c, s), g))
    return out


def _gn_fwd(p, x, w, b):
    return reference.group_norm(x, p.groups, w, b, p.spec.eps, p.spec.activation)[0]


def _gn_bwd(p, dy, x, w, b):
    return reference.group_norm_backward(dy, x, p.groups, w, b, p.spec.eps, p.spec.activation)


# ----------------------------------------------------------------------------- the table

@dataclass(frozen=True)
class OpSpec:
    name: str
    title: str
    eps: float
    has_bias: bool
    activation: Optional[str]
    param_shape: Callable[[Point], tuple]
    rows_cols: Callable[[Point], tuple]
    oracle_fwd: Callable  # (point, x, w, b) -> float64 y
    oracle_bwd: Callable  # (point, dy, x, w, b) -> float64 (dx, dw, db or None)
    sweep: Callable  # (widths, numel, rows) -> [(shape, groups)]
    tiny: tuple  # (shape, groups) of the decode-like input for host overhead
    fusion: Optional[object] = None  # fused.Fusion for the fused ops (residual add, fp8 output)


OPS = {
    "ln": OpSpec("ln", "LayerNorm", 1e-5, True, None, lambda p: (p.shape[-1],), _rows_cols_last,
                 _ln_fwd, _ln_bwd, _row_sweep, ((4, 4096), None)),
    "rms": OpSpec("rms", "RMSNorm", 1e-6, False, None, lambda p: (p.shape[-1],), _rows_cols_last,
                  _rms_fwd, _rms_bwd, _row_sweep, ((4, 4096), None)),
    "gn": OpSpec("gn", "GroupNorm + Mish", 1e-5, True, "mish", lambda p: (p.shape[1],), _gn_rows_cols,
                 _gn_fwd, _gn_bwd, _gn_sweep, ((2, 64, 64), 8)),
}


def pow2_range(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo to hi inclusive (lo and hi must be powers of two)."""
    return tuple(1 << k for k in range(lo.bit_length() - 1, hi.bit_length()))


# ----------------------------------------------------------------------------- suites

@dataclass(frozen=True)
class Suite:
    """A family of points: the op's sweep over widths and size, or the fixed shapes of a seed."""
    name: str
    ops: tuple
    dtypes: Optional[tuple]  # None: every dtype asked for
    shapes: Optional[object]  # ((shape, groups), ...), or {op: ((shape, groups), ...)}; None: the op's sweep
    about: str


# seed 004's 1D conv U-Net blocks: (batch, channels, length), 8 groups
GN_1D = tuple(((b, c, l), 8) for b in (1, 64) for c in (64, 512) for l in (16, 256, 4096)) + (((16, 256, 4096), 8),)
# diffusion U-Net / VAE 2D blocks, 32 groups (each also run channels_last)
GN_2D = tuple(((b, c, h, h), 32) for b, c, h in ((1, 320, 64), (8, 320, 64), (8, 640, 32), (8, 1280, 16),
                                                  (32, 1280, 8), (4, 128, 128), (1, 1280, 8)))

SUITES = {
    "sweep": Suite("sweep", ("ln", "rms", "gn"), None, None,
                   "every width, about 2^26 elements per input (128 MiB of 16-bit, 256 MiB of fp32)"),
    "llm.c": Suite("llm.c", ("ln",), ("fp32",), (((8 * 1024, 768), None),),
                   "llm.c's LayerNorm: B=8, T=1024, C=768, fp32"),
    "tutorial": Suite("tutorial", ("ln",), ("fp16",), tuple(((4096, n), None) for n in pow2_range(512, 16384)),
                      "the Triton tutorial's LayerNorm: M=4096, N=512..16384, fp16"),
    "quick": Suite("quick", ("ln", "rms", "gn"), None,
                   {"ln": (((16384, 4096), None), ((1024, 65536), None)),
                    "rms": (((16384, 4096), None), ((1024, 65536), None)),
                    "gn": (((16, 256, 4096), 8),)},
                   "--quick on a GPU: 2^26 elements at N = 4096 (one program per row block) and 65536 (rows split "
                   "across programs), and the seed-004 GroupNorm + Mish anchor"),
    "gn-anchors": Suite("gn-anchors", ("gn",), None, (((16, 256, 4096), 8), ((32, 320, 4096), 32)),
                        "the GroupNorm + Mish shapes of the peer anchors"),
    "gn-1d": Suite("gn-1d", ("gn",), None, GN_1D,
                   "seed 004's 1D blocks: batch 1-64, C 64-512, L 16-4096, 8 groups"),
    "gn-2d": Suite("gn-2d", ("gn",), None, GN_2D + tuple((s, g, True) for s, g in GN_2D),
                   "diffusion 2D blocks: B 1-32, C 128-1280, 8x8 to 128x128, 32 groups, NCHW and channels_last"),
}


def plan(ops, dtypes, suites, widths, numel_of: Callable[[str], int], rows: Optional[int] = None) -> list[Point]:
    """Every point to run, in order: suite, op, dtype, shape. A shape met twice runs once."""
    points, seen = [], set()
    for suite_name in suites:
        suite = SUITES[suite_name]
        for op in (o for o in ops if o in suite.ops):
            for dtype in (d for d in dtypes if suite.dtypes is None or d in suite.dtypes):
                shapes = suite.shapes.get(op, ()) if isinstance(suite.shapes, dict) else suite.shapes
                if shapes is None:
                    shapes = OPS[op].sweep(widths, numel_of(dtype), rows)
                for shape, groups, *layout in shapes:
                    cl = bool(layout and layout[0])
                    key = (op, dtype, tuple(shape), groups, cl)
                    if key not in seen:
                        seen.add(key)
                        points.append(Point(suite_name, op, dtype, tuple(shape), groups, cl))
    return points


# the fused ops (residual add + norm, norm + fp8 output) and their suites: fused.py
from . import fused as _fused  # noqa: E402

_fused.register(sys.modules[__name__])
