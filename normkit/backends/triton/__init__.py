"""The Triton backend: host wrappers that pick a configuration, size the grid and launch the
kernels in kernels.py. Inputs arrive checked and flattened by normkit.functional (see the
interface in normkit/backends/__init__.py). Everything per call that can be done once (device
properties, configurations, compiled kernels) is cached.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from . import configs

NAME = "triton"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MODULATION = True  # takes adaLN scale/shift tables (mod_scale=, mod_shift=)
GATE = True  # takes gate= (normalizes x * silu(gate); the backward returns dgate)
STRIDED_ROWS = True  # rows may come as [O, I, N] views with any strides (normkit._layout.row_view)
# every buffer a kernel must fully write is allocated through these names, so tests can poison it
_empty = torch.empty
_empty_like = torch.empty_like  # half the host time of torch.empty with a shape and dtype
_zeros = torch.zeros  # the one buffer a kernel accumulates into (the fp8 amax)


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def _kernels():
    """The kernels wrapped in fast launchers; imports triton on first use only."""
    from . import group_norm, kernels
    from .epilogue import ACT_CODES, FP8_CODES, FP8_HW, H_ROUND_CODES
    from .launch import Kernel

    class K:
        fwd = Kernel(kernels.row_norm_fwd_kernel)
        bwd = Kernel(kernels.row_norm_bwd_kernel)
        col_sum = Kernel(kernels.col_sum_kernel)
        gn_fwd = Kernel(group_norm.group_norm_fwd_kernel)
        gn_bwd = Kernel(group_norm.group_norm_bwd_kernel)
        gn_stats = Kernel(group_norm.group_norm_staged_stats_kernel)
        gn_finalize = Kernel(group_norm.group_norm_staged_finalize_kernel)
        gn_apply = Kernel(group_norm.group_norm_staged_apply_kernel)
        gn_split_stats = Kernel(group_norm.group_norm_split_stats_kernel)
        gn_split_apply = Kernel(group_norm.group_norm_split_apply_kernel)
        act_codes = ACT_CODES
        fp8_codes = FP8_CODES
        fp8_hw = FP8_HW
        h_round_codes = H_ROUND_CODES
        interpreted = fwd.interpreted
    return K


@functools.lru_cache(maxsize=None)
def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401  (only whether it imports)
    except ImportError:
        return "triton is not installed (pip install triton)"
    return None


def why_unavailable(x: torch.Tensor) -> str | None:
    """None if this backend can run on x, else one sentence saying why not."""
    if _triton_missing():
        return _triton_missing()
    if x.dtype not in DTYPES:
        return f"it supports float16, bfloat16 and float32 inputs, not {x.dtype} (use backend='torch')"
    if x.device.type == "cuda":
        return None
    if x.device.type == "cpu":
        if not _interpreter_requested():
            return ("x is a CPU tensor; set TRITON_INTERPRET=1 before importing triton to run the "
                    "Triton kernels under the Triton interpreter, or use backend='torch'")
        if not _kernels().interpreted:
            return ("TRITON_INTERPRET=1 was set after normkit's Triton kernels were compiled for the "
                    "GPU; set it before the first call")
        return None
    return f"it runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), not on {x.device.type}"


# ----------------------------------------------------------------------------- device facts, cached

@functools.lru_cache(maxsize=None)
def _device_facts(device: torch.device):
    """(device index, arch string, SM count) of a CUDA device, or (-1, "", programs) on the CPU."""
    if device.type != "cuda":
        return -1, "", configs.INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    p = torch.cuda.get_device_properties(index)
    return index, f"sm_{p.major}{p.minor}", p.multi_processor_count


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    """The CUDA device's name (configs' per-GPU exceptions), "" on the CPU."""
    return torch.cuda.get_device_name(index) if index >= 0 else ""


_sync_buffers: dict = {}


def _sync_buffer(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 counters for split-row groups ([arrivals, exits] per group). The kernels leave
    them zero when they finish, so one buffer per device is reused by every launch."""
    buf = _sync_buffers.get(device)
    if buf is None or buf.numel() < 2 * groups:
        buf = _sync_buffers[device] = torch.zeros(max(2 * groups, 8192), dtype=torch.int32, device=device)
    return buf


def _launch_persistent(kernel, cfg, args, constexprs, row_blocks: int, device_index: int, sms: int,
                       unit: int = 1) -> int:
    """Launch with programs_per_sm programs per SM, at most what can be resident at once (split
    rows wait on each other, so all their programs must run side by side), at most one group per
    row block, and a whole number of groups, a multiple of `unit` (per-head weight gradients:
    row_blocks is then per unit). Returns the number of programs."""
    from .launch import resident_programs_per_sm

    def grid(compiled):
        programs = sms
        if compiled is not None:
            per_sm = min(cfg.programs_per_sm, resident_programs_per_sm(compiled, cfg.num_warps, device_index))
            if per_sm < 1:
                raise RuntimeError(f"normkit: Triton config {cfg} does not fit on one SM of device {device_index}")
            programs = sms * per_sm
        return (max(1, min(programs // (cfg.split * unit), row_blocks)) * unit * cfg.split,)

    return kernel(grid, args, constexprs, cfg.options, device_index)[0]


# ----------------------------------------------------------------------------- row norm

@functools.lru_cache(maxsize=None)
def _plan(direction: str, n: int, itemsize: int, device: torch.device, flags: tuple, fusion: tuple = ()):
    """Everything about a launch that depends only on its kind, computed once:
    (config, constexprs, device index, SM count). itemsize: the widest element the launch moves
    (a bf16 -> fp32 launch is configured as fp32, so it runs exactly as fp32 -> fp32 does).
    flags: (rms, has_w, has_b, activation, extra[, per-head parameters]), extra the backward's
    (want dweight, want dbias) and None forward; fusion: the fused
    epilogue's constexprs."""
    device_index, arch, sms = _device_facts(device)
    rms, has_w, has_b, activation, extra, *per_row = flags
    cfg = configs.row_config(direction, n, itemsize, arch, device_index < 0, "rms" if rms else "ln")
    per_row = bool(per_row and per_row[0])
    # the backward's sample walk (modulation) has no split rows either
    sample_walk = direction == "bwd" and bool(fusion) and (fusion[2] or fusion[3])
    if (per_row or sample_walk) and cfg.split > 1:  # per-head weight rows: no split rows (their programs must not wait on heads)
        cfg = configs.looped_config(direction, cfg.block_n * cfg.split)
    constexprs = dict(IS_RMS=rms, HAS_W=has_w, HAS_B=has_b, PER_ROW_W=per_row)
    if direction == "bwd":
        constexprs["WANT_DW"], constexprs["WANT_DB"] = extra
    constexprs["ACT"] = _kernels().act_codes[activation]
    if direction == "fwd":
        has_res, store_h, h_dtype, out_dtype, scale_ptr, want_amax, has_ms, has_mt, has_gate = \
            fusion or _NO_FWD_FUSION
        k = _kernels()
        fp8 = k.fp8_codes.get(str(out_dtype), 0)
        if fp8 and configs.FP8_HW_CAST and not k.interpreted and int(arch[3:] or 0) >= 89:  # the GPU's own float8 conversion
            fp8 += k.fp8_hw
        constexprs.update(HAS_RES=has_res, STORE_H=store_h, H_ROUND=k.h_round_codes.get(str(h_dtype), 0),
                          FP8=fp8, SCALE_PTR=scale_ptr, WANT_AMAX=want_amax,
                          HAS_MS=has_ms, HAS_MT=has_mt, HAS_GATE=has_gate)
    else:
        (constexprs["HAS_DH"], constexprs["HAS_DRES"], constexprs["HAS_MS"], constexprs["HAS_MT"],
         constexprs["WANT_DS"], constexprs["WANT_DT"], constexprs["HAS_GATE"]) = fusion or _NO_BWD_FUSION
    constexprs.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=cfg.split, LOOPED=cfg.looped)
    if direction == "fwd":
        constexprs["PERSISTENT"] = cfg.programs_per_sm > 0
        # only looped configurations carry evict / static_n
        constexprs["LOOP_POLICY_1"], constexprs["LOOP_POLICY_2"] = ("evict_last", "evict_first") if cfg.evict else ("", "")
        constexprs["N_STATIC"] = n if cfg.static_n else 0
    else:
        constexprs["PREFETCH"] = cfg.prefetch
        constexprs["PREFETCH_STATS"] = configs.prefetch_stats(_device_name(device_index), "rms" if rms else "ln")
    return cfg, constexprs, device_index, sms


# called by clear_caches: what was derived from the configurations elsewhere (normkit._host registers
# forgetting its launch plans), so this backend needs no import of the layers above it
ON_CLEAR: list = []


def clear_caches() -> None:
    """Forget cached configurations and plans (after editing the configuration tables)."""
    configs.row_config.cache_clear()
    configs.tuned_table.cache_clear()
    configs.group_config.cache_clear()
    configs.staged_config.cache_clear()
    configs.col_sum_block.cache_clear()
    _col_sum_launch.cache_clear()
    _triton_missing.cache_clear()
    _plan.cache_clear()
    _gn_plan.cache_clear()
    if _cuda_cluster.cache_info().currsize:  # the cluster kernels' plans (the CUDA backend's tables)
        _cuda_cluster().prepare.cache_clear()
        _cuda_cluster().prepare_gn.cache_clear()
        _cuda_cluster().prepare_gn_cl.cache_clear()
    for forget in ON_CLEAR:  # e.g. the host path's launch plans, recorded with the old configurations
        forget()


def _scratch(cfg, groups_upper: int, device):
    """Split-row exchange buffers: counters and [groups, 2 parities, split, 2 values, block_m] fp32."""
    if cfg.split == 1:
        return None, None
    sync = _sync_buffer(device, groups_upper)
    scratch = torch.empty(groups_upper * 2 * cfg.split * 2 * cfg.block_m, dtype=torch.float32, device=device)
    return sync, scratch


def _strides(t):
    """(inner rows, outer stride, inner stride, column stride) of a [M, N] or [O, I, N] row view."""
    if t.dim() == 2:
        return 1, t.stride(0), 0, t.stride(1)
    return t.shape[1], t.stride(0), t.stride(1), t.stride(2)


def _out(x, dtype):
    """A dense [M, N] output for rows x ([M, N] or [O, I, N]) in `dtype`."""
    if dtype == x.dtype and x.is_contiguous():
        return _empty_like(x)
    return _empty(tuple(x.shape), dtype=dtype, device=x.device)


def row_norm_fwd(x, weight, bias, eps: float, rms: bool, activation=None, store_stats: bool = True):
    """(y [M, N] contiguous in x.dtype, mean [M] fp32 or None, rstd [M] fp32 or None)."""
    y, mean, rstd, _, _ = row_norm_fwd_fused(x, weight, bias, eps, rms, activation=activation, store_stats=store_stats)
    return y, mean, rstd


def row_norm_fwd_fused(x, weight, bias, eps: float, rms: bool, *, activation=None, store_stats: bool = True,
                       residual=None, h_dtype=None, store_h=False, weight_offset=0.0, out_dtype=None, out_scale=None,
                       want_amax=False, mod_scale=None, mod_shift=None, gate=None):
    """(y, mean, rstd, h or None, amax or None); see the backend interface (normkit.backends).
    gate (rows like x; not with a residual): normalizes x * silu(gate), the gate read as the residual is."""
    device = x.device
    N = x.shape[-1]
    M = x.numel() // N if N else math.prod(x.shape[:-1])
    out_dtype = out_dtype or x.dtype
    fp8 = out_dtype in _FP8
    y = _out(x, out_dtype)
    # the statistics are stored even where the caller drops them (store_stats=False, inference): the
    # kernel compiled without their stores rounds some rows of y an ulp differently (H100, session 8:
    # 3-8 of 256 rows), and the compiled ops and training calls always store them, so eager inference
    # would not be bitwise the compiled call. M floats (two for LayerNorm) per row of N elements.
    rstd = _empty(tuple(x.shape[:-1]), dtype=torch.float32, device=device)
    mean = _empty(tuple(x.shape[:-1]), dtype=torch.float32, device=device) if not rms else None
    has_res = residual is not None
    h_dtype = (h_dtype or residual.dtype) if has_res else None
    h = _out(x, h_dtype) if has_res and store_h else None
    amax = _zeros((1,), dtype=torch.int32, device=device) if want_amax else None
    mean_out, rstd_out = (mean, rstd) if store_stats else (None, None)
    if M == 0 or N == 0:  # no rows; or empty rows, whose statistics are 0/0 (the kernel would read x[row, 0])
        for s in (mean_out, rstd_out):
            if s is not None:
                s.fill_(math.nan)
        return y, mean_out, rstd_out, h, _amax_out(amax)
    scale_ptr = isinstance(out_scale, torch.Tensor)
    fusion = (has_res, h is not None, h_dtype, out_dtype if fp8 else None, scale_ptr, want_amax,
              mod_scale is not None, mod_shift is not None, gate is not None)
    itemsize = max(t.element_size() for t in (x, y, h, residual, gate) if t is not None)
    w_rows = _param_rows(weight, bias)
    cfg, constexprs, device_index, sms = _plan(
        "fwd", N, itemsize, device, (rms, weight is not None, bias is not None, activation, None, w_rows > 1),
        fusion if fusion != _NO_FWD_FUSION else ())
    # the widths the table routes to the CUDA backend's Hopper cluster kernels, for plain [M, N] rows
    cluster_ok = cfg.cuda and fusion == _NO_FWD_FUSION and w_rows == 1 and weight_offset == 0 and x.dim() == 2 \
        and y.dtype == x.dtype
    prepared = _on_clusters("fwd", x, (), weight, bias, activation, rms) if cluster_ok else None
    if prepared is not None:
        _cuda_cluster().launch_fwd(prepared, x, y, weight, bias, mean, rstd, eps)
        return y, mean_out, rstd_out, h, _amax_out(amax)
    row_blocks = -(-M // cfg.block_m)
    sync, scratch = _scratch(cfg, sms * 32 // cfg.split + 1, device)
    inner, sx_o, sx_i, sx_c = _strides(x)
    second = gate if gate is not None else residual  # the R operand: the residual, or the gate
    _, sr_o, sr_i, sr_c = _strides(second) if second is not None else (1, 0, 0, 0)
    scale = 1.0 if scale_ptr or out_scale is None else float(out_scale)
    args = (x, second, y.view(torch.uint8) if fp8 else y, h, weight, bias, mean, rstd, amax,
            out_scale if scale_ptr else None, sync, scratch, mod_scale, mod_shift, M, N, inner, sx_o, sx_i, sx_c,
            sr_o, sr_i, sr_c, eps, w_rows, float(weight_offset) if weight_offset else None, scale) + \
        _mod_rows(M, mod_scale, mod_shift)  # w_offset None: a constexpr, no add (kernels._load_params)
    if cfg.looped or cfg.programs_per_sm == 0:
        _kernels().fwd((row_blocks,), args, constexprs, cfg.options, device_index)
    else:
        _launch_persistent(_kernels().fwd, cfg, args, constexprs, row_blocks, device_index, sms)
    return y, mean_out, rstd_out, h, _amax_out(amax)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_NO_FWD_FUSION = (False, False, None, None, False, False, False, False, False)
_NO_BWD_FUSION = (False, False, False, False, False, False, False)


def _mod_rows(M: int, mod_scale, mod_shift) -> tuple:
    """(rows per sample, scale table row stride, shift table row stride): the kernels' modulation
    arguments (1, 0, 0 without modulation). Row r of x uses table row r // rows per sample."""
    table = mod_scale if mod_scale is not None else mod_shift
    if table is None:
        return 1, 0, 0
    S = table.shape[0]
    return (max(M // S, 1) if S else 1, 0 if mod_scale is None else mod_scale.stride(0),
            0 if mod_shift is None else mod_shift.stride(0))


def _sample_walk(M: int, S: int, block_m: int, groups_upper: int) -> tuple:
    """The backward's sample walk: (chunks per sample, blocks per chunk). Each sample's row blocks
    are cut into chunks so that samples x chunks items keep every group busy; each item writes
    one row of dscale/dshift partials, so the partials stay about [groups, N] in size."""
    blocks = -(-(M // S) // block_m)
    chunks = max(1, min(-(-groups_upper // S), blocks))
    per_chunk = -(-blocks // chunks)
    return -(-blocks // per_chunk), per_chunk


def _param_rows(weight, bias) -> int:
    """Rows of the weight/bias: 1, or the heads of per-head parameters ([heads, N]; row r of x uses
    parameter row r % heads)."""
    p = weight if weight is not None else bias
    return p.shape[0] if p is not None and p.dim() == 2 else 1


def _amax_out(bits):
    """The amax kernel buffer (int32 bits of a non-negative float32) as a 0-dim float32 tensor."""
    return None if bits is None else bits.view(torch.float32).view(())


def row_norm_bwd(dy, x, weight, mean, rstd, rms: bool, dweight_dtype, dbias_dtype, *, bias=None, activation=None):
    """(dx [M, N] in x.dtype, dweight [N] or None, dbias [N] or None); see the backend interface."""
    dx, _, dw, db = row_norm_bwd_fused(dy, x, weight, mean, rstd, rms, dweight_dtype, dbias_dtype, bias=bias,
                                       activation=activation)
    return dx, dw, db


def row_norm_bwd_fused(dy, x, weight, mean, rstd, rms: bool, dweight_dtype, dbias_dtype, *, bias=None, activation=None,
                       weight_offset=0.0, dh=None, dx_dtype=None, dres_dtype=None, mod_scale=None, mod_shift=None,
                       dmod_dtypes=(None, None), gate=None):
    """(dx, dres or None, dweight or None, dbias or None), then (dscale, dshift) (None where not
    asked) with modulation, or dgate with a gate (x is then the ungated input; no dh, no dres);
    see the backend interface."""
    device = x.device
    N = x.shape[-1]
    M = x.numel() // N if N else math.prod(x.shape[:-1])
    dx = _out(x, dx_dtype or x.dtype)
    dres = _out(x, dres_dtype) if dres_dtype is not None else None
    dgate = _out(x, gate.dtype) if gate is not None else None
    want_dw, want_db = dweight_dtype is not None, dbias_dtype is not None
    w_rows = _param_rows(weight, bias)
    pshape = (w_rows, N) if w_rows > 1 else (N,)
    dw = _empty(pshape, dtype=dweight_dtype, device=device) if want_dw else None
    db = _empty(pshape, dtype=dbias_dtype, device=device) if want_db else None
    table = mod_scale if mod_scale is not None else mod_shift
    dmod = ()
    if table is not None:
        dmod = tuple(None if d is None else _empty((table.shape[0], N), dtype=d, device=device) for d in dmod_dtypes)
    if M == 0 or N == 0:  # no rows, or empty ones: the weight gradients are exact zeros (empty for N = 0)
        return (dx, dres, (dw.zero_() if want_dw else None), (db.zero_() if want_db else None)) + \
            tuple(None if d is None else d.zero_() for d in dmod) + (() if gate is None else (dgate,))
    # the bias only matters to recompute the pre-activation, or yaff for dscale
    bias = bias if activation is not None or mod_scale is not None else None
    itemsize = max(t.element_size() for t in (x, dy, dx, dres, dh, gate) if t is not None)
    fusion = (dh is not None, dres is not None, mod_scale is not None, mod_shift is not None,
              bool(dmod) and dmod[0] is not None, bool(dmod) and dmod[1] is not None, gate is not None)
    cfg, constexprs, device_index, sms = _plan(
        "bwd", N, itemsize, device,
        (rms, weight is not None, bias is not None, activation, (want_dw, want_db), w_rows > 1),
        fusion if any(fusion) else ())
    cluster_ok = cfg.cuda and not any(fusion) and w_rows == 1 and weight_offset == 0 and x.dim() == 2 \
        and dy.dim() == 2 and dx.dtype == x.dtype
    prepared = _on_clusters("bwd", x, (dy,), weight, bias, activation, rms, want_dw or want_db) if cluster_ok else None
    if prepared is not None:
        parts = prepared.grid_clusters(M)
        dw_part, db_part = _weight_partials((parts, N), want_dw, want_db, device)
        _cuda_cluster().launch_bwd(prepared, dy, x, weight, bias, mean, rstd, dx, dw_part, db_part)
        _reduce_partials(dw_part, dw, db_part, db, parts, N, device_index)
        return dx, dres, dw, db
    row_blocks = -(-(M // w_rows) // cfg.block_m)  # per head: a group walks the rows of one head
    mod_args = (1, 1, 0, 0, 1, 1)
    if table is not None:  # the sample walk: items of whole row blocks of one sample
        S = table.shape[0]
        chunks, per_chunk = _sample_walk(M, S, cfg.block_m, max(1, sms * max(cfg.programs_per_sm, 1)))
        row_blocks = S * chunks
        mod_args = (S,) + _mod_rows(M, mod_scale, mod_shift) + (chunks, per_chunk)
    # the partial buffers need the group count, which needs the compiled kernel: size them for
    # the upper bound and hand the kernel exactly as many programs as groups fit
    groups_upper = max(1, min(sms * max(cfg.programs_per_sm, 1) // (cfg.split * w_rows), row_blocks)) * w_rows
    sync, scratch = _scratch(cfg, groups_upper, device)
    dw_part, db_part = _weight_partials((groups_upper, N), want_dw, want_db, device)
    inner, sdy_o, sdy_i, sdy_c = _strides(dy)
    _, sx_o, sx_i, sx_c = _strides(x)
    # the dh operand: dh, or the gate (and the dres output: dgate)
    second = gate if gate is not None else dh
    _, sdh_o, sdh_i, sdh_c = _strides(second) if second is not None else (1, 0, 0, 0)
    mod_parts = tuple(None if d is None else _empty((mod_args[4], mod_args[0] * N), dtype=torch.float32,
                                                    device=device) for d in dmod) or (None, None)
    args = (dy, x, second, weight, bias, mean, rstd, dx, dres if gate is None else dgate, dw_part, db_part, sync, scratch, mod_scale, mod_shift) + \
        mod_parts + (M, N, inner, sdy_o, sdy_i, sdy_c, sx_o, sx_i, sx_c, sdh_o, sdh_i, sdh_c, w_rows,
                     float(weight_offset)) + mod_args
    groups = _launch_persistent(_kernels().bwd, cfg, args, constexprs, row_blocks, device_index, sms,
                                w_rows) // cfg.split
    # partial row g belongs to head g % w_rows: [groups / heads, heads * N] sums to [heads, N]
    _reduce_partials(dw_part, dw, db_part, db, groups // w_rows, N * w_rows, device_index)
    if dmod:  # partial row c holds chunk c of every sample: [chunks, S * N] sums to [S, N]
        _reduce_partials(mod_parts[0], dmod[0], mod_parts[1], dmod[1], mod_args[4], mod_args[0] * N, device_index)
    return (dx, dres, dw, db) + dmod + (() if gate is None else (dgate,))


@functools.lru_cache(maxsize=None)
def _cuda_cluster():
    from ..cuda import cluster
    return cluster


def _on_clusters(direction, x, rows_like, weight, bias, activation, rms, want_params=False):
    """For widths the table routes to the CUDA backend's cluster kernels: the prepared kernel if
    this call can take it, else None (the Triton kernels run)."""
    cluster = _cuda_cluster()
    if cluster.why_not(x, rows_like, weight, bias, rms and direction == "fwd") is not None:
        return None
    wdtype = next((p.dtype for p in (weight, bias) if p is not None), x.dtype)
    return cluster.prepare(direction, x.shape[1], x.dtype, wdtype, activation, rms, want_params,
                           _device_facts(x.device)[0])


def _weight_partials(shape: tuple, want_dw: bool, want_db: bool, device):
    """(dweight partials, dbias partials), fp32 of `shape` each (None where not wanted): both halves of one
    allocation where both are wanted (the host path replays each allocation of a plan: one fewer per backward
    call, where LayerNorm's fwd+bwd host time is closest to torch's, run S25-5)."""
    if want_dw and want_db:
        both = _empty((2,) + shape, dtype=torch.float32, device=device)
        return both[0], both[1]
    part = _empty(shape, dtype=torch.float32, device=device) if want_dw or want_db else None
    return (part, None) if want_dw else (None, part)


def _reduce_partials(dw_part, dw, db_part, db, rows: int, n: int, device_index: int, block=None) -> None:
    """dw = sum of the first `rows` rows of dw_part (and db likewise), in a fixed order; block:
    (BLOCK_P, BLOCK_N, num_warps), the row norms' (configs.col_sum_block) if None."""
    first, first_out = (dw_part, dw) if dw is not None else (db_part, db)
    if first is not None:
        has_b = dw is not None and db is not None
        grid, constexprs, options = _col_sum_launch(rows, n, device_index, has_b, block)
        _kernels().col_sum(grid, (first, first_out, db_part, db, rows, n), constexprs, options, device_index)


@functools.lru_cache(maxsize=None)
def _col_sum_launch(rows: int, n: int, device_index: int, has_b: bool, block=None) -> tuple:
    sms = configs.INTERPRETER_PROGRAMS if device_index < 0 else _device_facts(torch.device("cuda", device_index))[2]
    block_p, block_n, warps = block or configs.col_sum_block(rows, n, sms)
    return (-(-n // block_n),), dict(HAS_B=has_b, BLOCK_P=block_p, BLOCK_N=block_n), (warps, 1)


# ----------------------------------------------------------------------------- group norm

@functools.lru_cache(maxsize=None)
def _gn_plan(direction: str, cg: int, s: int, dtype: torch.dtype, device: torch.device, flags: tuple,
             groups: int = 0, channels_last: bool = False):
    device_index, _, sms = _device_facts(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    cfg = configs.group_config(direction, cg, s, itemsize, device_index < 0, groups / sms, channels_last)
    has_w, has_b, activation, extra = flags
    constexprs = dict(HAS_W=has_w, HAS_B=has_b)
    if direction == "bwd":
        constexprs["WANT_DW"], constexprs["WANT_DB"] = extra
    constexprs.update(ACT=_kernels().act_codes[activation], BLOCK_R=cfg.block_r, BLOCK_S=cfg.block_s, KS=cfg.ks,
                      SPLIT=cfg.split, LOOPED=cfg.looped, SLOTS=cfg.slots)
    return cfg, constexprs, device_index, sms


def group_norm_fwd(x, num_groups, weight, bias, eps: float, activation=None):
    """x: [B, C, S] (NCHW or channels_last strides). (y with x's strides, mean [B, G], rstd [B, G])."""
    B, C, S = x.shape
    device = x.device
    y = _empty_like(x)  # x is NCHW or channels_last, both dense: y gets x's strides
    mean = _empty((B, num_groups), dtype=torch.float32, device=device)
    rstd = _empty((B, num_groups), dtype=torch.float32, device=device)
    if B == 0 or C * S == 0:
        return y, mean.fill_(float("nan")), rstd.fill_(float("nan"))
    cg = C // num_groups
    units = B * num_groups
    prepared = _gn_on_clusters("fwd", x, (), num_groups, weight, bias, activation)
    if prepared is not None:
        _cuda_cluster().launch_gn_fwd(prepared, x, y, weight, bias, mean, rstd, num_groups, eps)
        return y, mean, rstd
    staged, device_index = _staged_plan("fwd", x, cg)
    if staged is not None:
        _staged(staged, device_index, x, None, y, weight, bias, mean, rstd, num_groups, activation, eps)
        return y, mean, rstd
    cfg, constexprs, device_index, sms = _gn_plan("fwd", cg, S, x.dtype, device,
                                                  (weight is not None, bias is not None, activation, None), units,
                                                  _is_cl(x))
    if cfg.two_kernel:
        _split2(cfg, device_index, x, None, y, weight, bias, mean, rstd, num_groups, activation, eps)
        return y, mean, rstd
    sync, scratch = _scratch(cfg, min(units, sms * 32 // cfg.split + 1), device)
    args = (x, y, weight, bias, mean, rstd, sync, scratch, B, C, S, cg, num_groups,
            x.stride(0), x.stride(1), x.stride(2), eps)
    if cfg.looped:
        _kernels().gn_fwd((units,), args, constexprs, cfg.options, device_index)
    else:
        _launch_persistent(_kernels().gn_fwd, cfg, args, constexprs, units, device_index, sms)
    return y, mean, rstd


def group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation, dweight_dtype, dbias_dtype, *, eps=None):
    """(dx with x's strides, dweight [C] or None, dbias [C] or None); deterministic sums. eps: unused (the
    kernels recompute the activation's input from the statistics)."""
    B, C, S = x.shape
    device = x.device
    if dy.stride() != x.stride():  # the kernel walks dy with x's strides
        dy = torch.empty_strided(x.shape, x.stride(), dtype=dy.dtype, device=device).copy_(dy)
    dx = _empty_like(x)  # x's strides (x is dense)
    want_dw, want_db = dweight_dtype is not None, dbias_dtype is not None
    dw = _empty((C,), dtype=dweight_dtype, device=device) if want_dw else None
    db = _empty((C,), dtype=dbias_dtype, device=device) if want_db else None
    if B == 0 or C * S == 0:
        return dx, (dw.zero_() if want_dw else None), (db.zero_() if want_db else None)
    cg = C // num_groups
    bias = bias if activation is not None else None  # needed only to recompute the pre-activation
    units = B * num_groups
    prepared = _gn_on_clusters("bwd", x, (dy,), num_groups, weight, bias, activation, want_dw or want_db)
    if prepared is not None:
        dw_part, db_part = _weight_partials((B, C), want_dw, want_db, device)
        _cuda_cluster().launch_gn_bwd(prepared, dy, x, weight, bias, mean, rstd, dx, dw_part, db_part, num_groups)
        _reduce_partials(dw_part, dw, db_part, db, B, C, prepared.kernel.device, configs.GN_COL_SUM)
        return dx, dw, db
    staged, device_index = _staged_plan("bwd", x, cg)
    if staged is not None:
        parts = _staged(staged, device_index, x, dy, dx, weight, bias, mean, rstd, num_groups, activation)
        _reduce_partials(parts[0] if want_dw else None, dw, parts[1] if want_db else None, db,
                         parts[0].shape[0], C, device_index, configs.GN_COL_SUM)
        return dx, dw, db
    cfg, constexprs, device_index, sms = _gn_plan("bwd", cg, S, x.dtype, device,
                                                  (weight is not None, bias is not None, activation,
                                                   (want_dw, want_db)), units, _is_cl(x))
    if cfg.two_kernel:
        p1, p2 = _split2(cfg, device_index, x, dy, dx, weight, bias, mean, rstd, num_groups, activation)
        _reduce_partials(p1 if want_dw else None, dw, p2 if want_db else None, db, p1.shape[0], C, device_index,
                         configs.GN_COL_SUM)
        return dx, dw, db
    sync, scratch = _scratch(cfg, min(units, sms * 32 // cfg.split + 1), device)
    dw_part, db_part = _weight_partials((B * cfg.ks, C), want_dw, want_db, device)
    args = (dy, x, weight, bias, mean, rstd, dx, dw_part, db_part, sync, scratch, B, C, S, cg, num_groups,
            x.stride(0), x.stride(1), x.stride(2))
    if cfg.looped:
        _kernels().gn_bwd((units,), args, constexprs, cfg.options, device_index)
    else:
        _launch_persistent(_kernels().gn_bwd, cfg, args, constexprs, units, device_index, sms)
    _reduce_partials(dw_part, dw, db_part, db, B * cfg.ks, C, device_index, configs.GN_COL_SUM)
    return dx, dw, db


def _gn_on_clusters(direction, x, rows_like, num_groups, weight, bias, activation, want_params=False):
    """For dense groups the tables route to the CUDA backend's cluster kernels (NCHW: a group is a row,
    configs.GN_CLUSTER_ROUTE; channels_last: slabs of whole groups, configs.GN_CL_CLUSTER_ROUTE): the
    prepared kernel if this call can take it, else None."""
    B, C, S = x.shape
    cg = C // num_groups
    device_index, arch, _ = _device_facts(x.device)
    cl = _is_cl(x)
    if not configs.gn_cluster_routed(direction, cg, S, x.element_size(), arch, cl):
        return None
    cluster = _cuda_cluster()
    if (cluster.gn_cl_why_not if cl else cluster.gn_why_not)(x, rows_like, weight, bias) is not None:
        return None
    prepare = (functools.partial(cluster.prepare_gn_cl, direction, B, C, S, cg) if cl else
               functools.partial(cluster.prepare_gn, direction, cg, S))
    wdtype = next((p.dtype for p in (weight, bias) if p is not None), x.dtype)
    return prepare(x.dtype, wdtype, activation, want_params, device_index)


def _is_cl(x) -> bool:
    """Whether a [B, C, S] input has its channels innermost (channels_last)."""
    return x.shape[1] > 1 and x.shape[2] > 1 and x.stride(1) == 1


def _staged_plan(direction: str, x, cg: int):
    """(StagedConfig or None, device index) for a [B, C, S] input with groups of cg channels."""
    B, C, S = x.shape
    device_index, _, sms = _device_facts(x.device)
    channels_last = _is_cl(x)
    return configs.staged_config(direction, B, C, S, cg, x.element_size(), channels_last, sms), device_index


def _staged(cfg, device_index, x, dy, out, weight, bias, mean, rstd, num_groups, activation, eps=0.0):
    """The staged path (group_norm.py): stats, finalize, apply; the stats are cut into spans of
    cfg.n_sub tiles. Forward (dy None): out = y, and mean/rstd are written. Backward: out = dx;
    returns the per-sample channel sums of g*xhat and g ([B, C] fp32, from the finalize), which are
    the weight gradients' partials."""
    B, C, S = x.shape
    bwd = dy is not None
    cg = C // num_groups
    stats_c, stats_s = cfg.stats_tile
    n_cb, n_sb = -(-C // stats_c), -(-S // stats_s)
    n_sub = cfg.n_sub
    n_spans = -(-n_sb // n_sub)
    strides = (x.stride(0), x.stride(1), x.stride(2))
    k = _kernels()
    flags = dict(BWD=bwd, HAS_W=weight is not None, HAS_B=bias is not None, ACT=k.act_codes[activation])
    stats_flags = flags if bwd else dict(BWD=False, HAS_W=False, HAS_B=False, ACT=0)
    p1 = _empty((B * n_spans, C), dtype=torch.float32, device=x.device)
    p2 = _empty((B * n_spans, C), dtype=torch.float32, device=x.device)
    k.gn_stats((B * n_cb * n_spans,), (x, dy, weight, bias, mean, rstd, p1, p2, C, S, num_groups, cg, n_cb, n_sb,
                                       n_spans, n_sub) + strides,
               dict(**stats_flags, BLOCK_C=stats_c, BLOCK_S=stats_s, SLOTS=cfg.slots), cfg.stats_options, device_index)
    c1 = _empty((B, num_groups), dtype=torch.float32, device=x.device)  # forward: the shifted means
    c2 = _empty((B, num_groups), dtype=torch.float32, device=x.device) if bwd else None
    q1 = _empty((B, C), dtype=torch.float32, device=x.device) if bwd else None
    q2 = _empty((B, C), dtype=torch.float32, device=x.device) if bwd else None
    k.gn_finalize((B * num_groups,), (x, p1, p2, weight if bwd else None, mean, rstd, c1, c2, q1, q2, C, S,
                                      num_groups, cg, n_spans, n_sub * stats_s, strides[0], strides[1], eps),
                  dict(BWD=bwd, HAS_W=bwd and weight is not None, BLOCK_P=cfg.block_p, BLOCK_R=cfg.block_r),
                  (4, 1), device_index)
    n_cb, n_sb = -(-C // cfg.block_c), -(-S // cfg.block_s)
    k.gn_apply((B * n_cb * n_sb,), (x, dy, out, weight, bias, mean, rstd, c1, c2, C, S, num_groups, cg, n_cb, n_sb)
               + strides, dict(**flags, BLOCK_C=cfg.block_c, BLOCK_S=cfg.block_s), cfg.options, device_index)
    return q1, q2


def _split2(cfg, device_index, x, dy, out, weight, bias, mean, rstd, num_groups, activation, eps=0.0):
    """The two-kernel split (group_norm.py): split stats, then split apply, a program per slice of
    each group. Forward (dy None): out = y, and mean/rstd are written. Backward: out = dx; returns
    the per-(batch, spatial slice) channel sums of g*xhat and g ([B * n_ks, C] fp32), which are the
    weight gradients' partials."""
    B, C, S = x.shape
    bwd = dy is not None
    cg = C // num_groups
    n_ks = -(-S // cfg.block_s)
    n_tiles = -(-cg // cfg.block_r) * n_ks
    programs = B * num_groups * n_tiles
    shape = (B * n_ks, C) if bwd else (programs,)
    p1 = _empty(shape, dtype=torch.float32, device=x.device)
    p2 = _empty(shape, dtype=torch.float32, device=x.device)
    k = _kernels()
    args = (x, dy, weight, bias, mean, rstd, p1, p2, C, S, cg, num_groups, n_tiles, n_ks,
            x.stride(0), x.stride(1), x.stride(2))
    flags = dict(BWD=bwd, HAS_W=weight is not None, HAS_B=bias is not None, ACT=k.act_codes[activation])
    tiles = dict(BLOCK_R=cfg.block_r, BLOCK_S=cfg.block_s)
    k.gn_split_stats((programs,), args, dict(**(flags if bwd else dict(BWD=False, HAS_W=False, HAS_B=False, ACT=0)),
                                             **tiles), cfg.options, device_index)
    k.gn_split_apply((programs,), args[:2] + (out,) + args[2:] + (eps,),
                     dict(**flags, **tiles, BLOCK_T=_next_pow2(n_tiles), BLOCK_KS=_next_pow2(n_ks),
                          BLOCK_RG=_next_pow2(cg)), cfg.options, device_index)
    return p1, p2


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
