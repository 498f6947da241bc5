"""The CUDA C++ backend: OneFlow-style kernels (.cu sources in this folder) built at run time with
NVRTC and launched on torch tensors, on torch's current stream.

Host wrappers only: they pick the pack size and implementation (configs.py), name the kernel
(kernels.py), size the grid, and launch (driver.py). Inputs arrive checked by normkit.functional,
as the interface in normkit.backends describes. cuda-python is imported on first use.
"""
from __future__ import annotations

import functools
import math

import torch

from . import configs, kernels
from .nvrtc import CudaBackendError, NvrtcError  # noqa: F401  (re-exported for callers)

NAME = "cuda"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# every buffer a kernel must fully write is allocated through these names, so tests can poison them
_empty = torch.empty
_empty_like = torch.empty_like


def why_unavailable(x: torch.Tensor) -> str | None:
    """None if this backend can run on x, else one sentence saying why not."""
    if x.device.type != "cuda":
        return f"it runs on CUDA tensors, and x is on {x.device.type} (use backend='torch' or 'triton')"
    if x.dtype not in DTYPES:
        return f"it supports float16, bfloat16 and float32 inputs, not {x.dtype} (use backend='torch')"
    try:
        from . import driver
        driver.arch_for(_index(x))  # loads NVRTC and the driver; says so if this GPU is too old
    except CudaBackendError as e:
        return str(e).rstrip(".")
    return None


# ----------------------------------------------------------------------------- helpers

def _index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    from . import driver
    return driver.sm_count(index)


def _begin(x: torch.Tensor) -> int:
    """Device index of x, with its context current in this thread."""
    from . import driver
    index = _index(x)
    driver.use_device(index)
    return index


def _load(spec, index):
    from . import driver
    return driver.load(spec, index)


def _params(x, *params):
    """The parameters as the kernels read them, and their element type: x's dtype or float32 as
    given; any other mix is cast to float32 (small [N] or [C] tensors)."""
    present = [p for p in params if p is not None]
    if not present:
        return params, x.dtype
    dtypes = {p.dtype for p in present}
    if len(dtypes) == 1 and next(iter(dtypes)) in (x.dtype, torch.float32):
        return params, next(iter(dtypes))
    return tuple(None if p is None else p.float() for p in params), torch.float32


def _aligned(*tensors_and_strides):
    """(byte address or byte stride, element size) pairs for pick_pack."""
    out = []
    for t, stride in tensors_and_strides:
        if t is None:
            continue
        e = t.element_size()
        out.append((t.data_ptr(), e))
        if stride is not None:
            out.append((stride * e, e))
    return out


def _out_dtype_ok(dtype) -> bool:
    return dtype in kernels.CTYPE


def prebuild(specs, device=None, threads: int | None = None) -> None:
    """Compile kernels ahead of use, in parallel, for `device`'s GPU (default: the current one);
    e.g. prebuild(kernels.row_specs(4096, torch.bfloat16, torch.float32)). Later calls load them
    from the in-memory and disk caches."""
    from . import driver
    from .nvrtc import build_specs

    index = torch.device(device).index if device is not None else None
    index = torch.cuda.current_device() if index is None else index
    build_specs(list(specs), driver.arch_for(index), threads=threads)


# ----------------------------------------------------------------------------- row norms

@functools.lru_cache(maxsize=4096)
def _row_setup(direction, n, pack, dtype, wdtype, activation, rms, want_params, index, force=None):
    """(plan, kernel, resident blocks per SM) for one row-norm configuration; cached, so a call
    costs the planning (compiles, occupancy queries) once."""
    from . import driver

    def spec_for(plan):
        if direction == "fwd":
            return kernels.row_fwd(dtype, wdtype, activation, rms, plan)
        return kernels.row_bwd(dtype, wdtype, activation, rms, plan, want_params and not plan.param_kernel
                               and (plan.impl in ("warp", "regs") or plan.acc_packs > 0))

    def occupancy(cached, block, smem, acc_packs):
        plan = configs.RowPlan("block", pack, block, cached=cached, smem=smem, acc_packs=acc_packs)
        return _load(spec_for(plan), index).occupancy(block, smem)

    plan = configs.plan_rows(direction, n, pack, dtype.itemsize, driver.max_smem_optin(index), occupancy,
                             want_params=want_params, force=force)
    kernel = _load(spec_for(plan), index)
    return plan, kernel, kernel.occupancy(plan.block, plan.smem)


def _row_fwd(x, weight, bias, eps, rms, activation=None, *, force=None, pack=None):
    """row_norm_fwd with the ladder's knobs: force an implementation ("warp", "block-smem",
    "block-uncached") and/or a pack size. Returns (y, mean, rstd, plan)."""
    M, N = x.shape
    y = _empty((M, N), dtype=x.dtype, device=x.device)
    rstd = _empty((M,), dtype=torch.float32, device=x.device)
    mean = None if rms else _empty((M,), dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:  # no rows; or empty rows, whose statistics are 0/0
        for s in (mean, rstd):
            if s is not None:
                s.fill_(math.nan)
        return y, mean, rstd, None
    index = _begin(x)
    (w, b), wdtype = _params(x, weight, bias)
    if pack is None:
        pack = configs.pick_pack(N, x.element_size(), _aligned((x, x.stride(0)), (y, N), (w, None), (b, None)))
    plan, kernel, resident = _row_setup("fwd", N, pack, x.dtype, wdtype, activation, rms, False, index, force)
    grid = configs.grid_blocks(configs.cdiv(M, plan.rows_per_block), _sms(index), resident, configs.FWD_WAVES)
    kernel.launch((grid,), (plan.block,), [x, x.stride(0), y, N, w, b, mean, rstd, M, N, float(eps)], smem=plan.smem)
    return y, mean, rstd, plan


def _on_clusters(direction, x, rows_like, weight, bias, activation, rms, want_params=False):
    """The prepared cluster kernel (cluster.py) when configs.CLUSTER_WIDTHS sends rows of this
    width there and it can take these tensors; else None (the OneFlow-style kernels run)."""
    M, N = x.shape
    lo, hi = configs.CLUSTER_WIDTHS.get((direction, "rms" if rms else "ln", x.element_size()), (1, 0))
    if M == 0 or not lo <= configs.next_pow2(N) <= hi:
        return None
    from . import cluster
    if cluster.why_not(x, rows_like, weight, bias, rms and direction == "fwd") is not None:
        return None
    wdtype = next((p.dtype for p in (weight, bias) if p is not None), x.dtype)
    return cluster.prepare(direction, N, x.dtype, wdtype, activation, rms, want_params, _begin(x))


def row_norm_fwd(x, weight, bias, eps: float, rms: bool, activation=None, store_stats: bool = True):
    """Returns (y [M, N] contiguous in x.dtype, mean [M] fp32 or None, rstd [M] fp32 or None).
    Without store_stats (inference) the OneFlow-style kernels still write the 8 bytes of
    statistics per row, which are dropped: a flag in every kernel would cost more template
    instantiations than it saves."""
    prepared = _on_clusters("fwd", x, (), weight, bias, activation, rms)
    if prepared is not None:
        from . import cluster
        M, N = x.shape
        y = _empty((M, N), dtype=x.dtype, device=x.device)
        rstd = _empty((M,), dtype=torch.float32, device=x.device) if store_stats else None
        mean = _empty((M,), dtype=torch.float32, device=x.device) if store_stats and not rms else None
        cluster.launch_fwd(prepared, x, y, weight, bias, mean, rstd, eps)
        return y, mean, rstd
    y, mean, rstd, _ = _row_fwd(x, weight, bias, eps, rms, activation)
    return (y, mean, rstd) if store_stats else (y, None, None)


def row_norm_bwd(dy, x, weight, mean, rstd, rms: bool, dweight_dtype, dbias_dtype, *, bias=None,
                 activation=None):
    """Returns (dx [M, N] in x.dtype, dweight [N] or None, dbias [N] or None); the weight sums are
    fp32 partials per block, added in a fixed order (deterministic)."""
    M, N = x.shape
    device = x.device
    dx = _empty((M, N), dtype=x.dtype, device=device)
    want_dw, want_db = dweight_dtype is not None, dbias_dtype is not None
    if M == 0 or N == 0:
        return (dx, torch.zeros(N, dtype=dweight_dtype, device=device) if want_dw else None,
                torch.zeros(N, dtype=dbias_dtype, device=device) if want_db else None)
    mean = None if rms else mean.contiguous()
    rstd = rstd.contiguous()
    b_act = bias if activation is not None else None  # the bias only matters to recompute z
    prepared = _on_clusters("bwd", x, (dy,), weight, b_act, activation, rms, want_dw or want_db)
    if prepared is not None:
        from . import cluster
        parts = prepared.grid_clusters(M)
        dw_part = _empty((parts, N), dtype=torch.float32, device=device) if want_dw else None
        db_part = _empty((parts, N), dtype=torch.float32, device=device) if want_db else None
        cluster.launch_bwd(prepared, dy, x, weight, b_act, mean, rstd, dx, dw_part, db_part)
        dw, db = _col_sum(_index(x), dw_part, dweight_dtype, db_part, dbias_dtype, parts, N, device)
        return dx, dw, db
    index = _begin(x)
    (w, b), wdtype = _params(x, weight, bias)
    pack = configs.pick_pack(N, x.element_size(),
                             _aligned((x, x.stride(0)), (dy, dy.stride(0)), (dx, N), (w, None), (b, None)))
    want = want_dw or want_db
    plan, kernel, resident = _row_setup("bwd", N, pack, x.dtype, wdtype, activation, rms, want, index)
    sms = _sms(index)
    # persistent grid: one wave, so the partial buffers stay [a few x SMs, N]
    grid = parts = configs.grid_blocks(configs.cdiv(M, plan.rows_per_block), sms,
                                       min(resident, configs.BWD_MAX_BLOCKS_PER_SM), 1)
    if plan.param_kernel:
        parts, rows_per_split = configs.param_splits(M, sms)
    dw_part = _empty((parts, N), dtype=torch.float32, device=device) if want_dw else None
    db_part = _empty((parts, N), dtype=torch.float32, device=device) if want_db else None
    fused = not plan.param_kernel
    kernel.launch((grid,), (plan.block,),
                  [dy, dy.stride(0), x, x.stride(0), w, b, mean, rstd, dx, N,
                   dw_part if fused else None, db_part if fused else None, M, N], smem=plan.smem)
    if plan.param_kernel:
        tile_cols, tile_rows = configs.PARAM_TILE
        _load(kernels.row_param_grad(x.dtype, wdtype, activation, rms), index).launch(
            (configs.cdiv(N, tile_cols), parts), (tile_cols, tile_rows),
            [dy, dy.stride(0), x, x.stride(0), w, b, mean, rstd, dw_part, db_part, M, N, rows_per_split])
    dw, db = _col_sum(index, dw_part, dweight_dtype, db_part, dbias_dtype, parts, N, device)
    return dx, dw, db


def _col_sum(index, a_part, a_dtype, b_part, b_dtype, parts, cols, device):
    """Fixed-order sums of [parts, cols] fp32 partials into [cols] outputs of the given dtypes."""
    if a_part is None and b_part is None:
        return None, None
    kern_a = a_dtype if _out_dtype_ok(a_dtype) else torch.float32
    kern_b = b_dtype if _out_dtype_ok(b_dtype) else torch.float32
    a = _empty((cols,), dtype=kern_a, device=device) if a_part is not None else None
    b = _empty((cols,), dtype=kern_b, device=device) if b_part is not None else None
    block = configs.COL_SUM_BLOCK
    _load(kernels.col_sum(kern_a if a is not None else None, kern_b if b is not None else None), index).launch(
        (configs.cdiv(cols, block[0]),), block, [a_part, a, b_part, b, parts, cols])
    a = a.to(a_dtype) if a is not None and a.dtype != a_dtype else a
    b = b.to(b_dtype) if b is not None and b.dtype != b_dtype else b
    return a, b


# ----------------------------------------------------------------------------- GroupNorm

def _gn_layout(x) -> bool:
    """True for channels_last (unit stride over C), False for NCHW (unit stride over S). Any
    strides are read correctly; the layout only decides which axis the lanes walk."""
    _, C, S = x.shape
    return C > 1 and x.stride(1) == 1 and not (S > 1 and x.stride(2) == 1)


def _gn_check(x, num_groups):
    B, C, S = x.shape
    tile = configs.GN_REDUCE_BLOCK[1] if not _gn_layout(x) else configs.GN_REDUCE_BLOCK[0]
    if configs.cdiv(C, tile) > 65535:
        raise ValueError(f"x: the CUDA GroupNorm takes at most {65535 * tile} channels, got {C}")
    if S >= 2**31 or B * num_groups >= 2**31 // 32:
        raise ValueError(f"x: shape {tuple(x.shape)} is beyond the CUDA GroupNorm's int32 sizes")


def _gn_strides(t):
    return list(t.stride()) if t is not None else [0, 0, 0]


def _gn_apply(index, x, dy, out, w, b, mean, rstd, coef, num_groups, activation, wdtype, cl, backward):
    B, C, S = x.shape
    kernel = _load(kernels.gn_apply(x.dtype, wdtype, activation, cl, backward), index)
    tx, ty = configs.gn_apply_block(C if cl else S)
    work = configs.cdiv(B * (S if cl else C), ty)
    grid = configs.grid_blocks(work, _sms(index), kernel.occupancy(tx * ty), configs.GN_APPLY_WAVES)
    kernel.launch((grid,), (tx, ty), [x, *_gn_strides(x), dy, *_gn_strides(dy), out, *_gn_strides(out),
                                      w, b, mean, rstd, coef, B, C, S, num_groups])


def _gn_reduce(index, x, dy, w, b, mean, rstd, coef, num_groups, activation, wdtype, cl, backward):
    B, C, S = x.shape
    chunk, chunks = configs.gn_chunks(B, C, S, cl, _sms(index))
    p1 = _empty((B * chunks, C), dtype=torch.float32, device=x.device)
    p2 = _empty((B * chunks, C), dtype=torch.float32, device=x.device)
    tx, ty = configs.GN_REDUCE_BLOCK
    tile = tx if cl else ty
    _load(kernels.gn_reduce(x.dtype, wdtype, activation, cl, backward), index).launch(
        (B * chunks, configs.cdiv(C, tile)), (tx, ty),
        [x, *_gn_strides(x), dy, *_gn_strides(dy), w, b, mean, rstd, p1, p2, coef, C, S, num_groups, chunk, chunks])
    return p1, p2, chunk, chunks


def _gn_group(index, p1, p2, w, mean, rstd, coef, B, C, S, G, chunk, chunks, eps, wdtype, backward):
    threads = configs.GN_GROUP_THREADS
    _load(kernels.gn_group(wdtype, backward), index).launch(
        (configs.cdiv(B * G * 32, threads),), (threads,),
        [p1, p2, w, mean, rstd, coef, B, C, S, G, chunk, chunks, float(eps)])


def group_norm_fwd(x, num_groups, weight, bias, eps, activation=None):
    """x [B, C, S] (NCHW or channels_last) -> (y like x, mean [B, G] fp32, rstd [B, G] fp32)."""
    B, C, S = x.shape
    G = num_groups
    y = _empty_like(x)
    mean = _empty((B, G), dtype=torch.float32, device=x.device)
    rstd = _empty((B, G), dtype=torch.float32, device=x.device)
    if B == 0:
        return y, mean, rstd
    if S == 0 or C == 0:  # empty groups: statistics are 0/0
        return y, mean.fill_(math.nan), rstd.fill_(math.nan)
    _gn_check(x, G)
    index = _begin(x)
    (w, b), wdtype = _params(x, weight, bias)
    cl = _gn_layout(x)
    shifts = _empty((B * G * 2,), dtype=torch.float32, device=x.device)  # (shift, shifted mean) per group
    p1, p2, chunk, chunks = _gn_reduce(index, x, None, None, None, None, None, shifts, G, None, wdtype, cl, False)
    _gn_group(index, p1, p2, None, mean, rstd, shifts, B, C, S, G, chunk, chunks, eps, wdtype, False)
    _gn_apply(index, x, None, y, w, b, mean, rstd, shifts, G, activation, wdtype, cl, False)
    return y, mean, rstd


def group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation, dweight_dtype, dbias_dtype, *, eps=None):
    """-> (dx with x's strides, dweight [C] or None, dbias [C] or None), deterministic sums. eps: unused (the
    kernels recompute the activation's input from the statistics)."""
    B, C, S = x.shape
    G = num_groups
    device = x.device
    dx = _empty_like(x)
    want_dw, want_db = dweight_dtype is not None, dbias_dtype is not None
    if B == 0 or S == 0 or C == 0:
        return (dx.zero_(), torch.zeros(C, dtype=dweight_dtype, device=device) if want_dw else None,
                torch.zeros(C, dtype=dbias_dtype, device=device) if want_db else None)
    _gn_check(x, G)
    index = _begin(x)
    (w, b), wdtype = _params(x, weight, bias)
    mean, rstd = mean.float().contiguous(), rstd.float().contiguous()
    cl = _gn_layout(x)
    p1, p2, chunk, chunks = _gn_reduce(index, x, dy, w, b, mean, rstd, None, G, activation, wdtype, cl, True)
    coef = _empty((B * G * 2,), dtype=torch.float32, device=device)
    _gn_group(index, p1, p2, w, None, None, coef, B, C, S, G, chunk, chunks, 0.0, wdtype, True)
    dw, db = _col_sum(index, p1 if want_dw else None, dweight_dtype, p2 if want_db else None, dbias_dtype,
                      B * chunks, C, device)
    _gn_apply(index, x, dy, dx, w, b, mean, rstd, coef, G, activation, wdtype, cl, True)
    return dx, dw, db
