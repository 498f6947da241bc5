"""The plain torch backend: the same row-normalization math as the kernels, in torch ops.

It runs wherever torch runs (CPU, CUDA, float64 included) and computes in float32, or in float64
for float64 inputs. Same interface as every backend: x is [M, N] with unit column stride.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NAME = "torch"
# torch's own activations (independent of the oracle's formulas); backward through autograd
_ACTIVATIONS = {
    None: lambda z: z,
    "relu": F.relu,
    "silu": F.silu,
    "mish": F.mish,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
}
# their derivatives as aten's own backward ops (g * act'(z)): no autograd needed, which matters
# inside a custom op, where autograd is switched off at the dispatcher
_aten = torch.ops.aten
# (the overloads' C++ callables: an op packet's Python __call__ costs microseconds per CPU call)
_threshold_bwd, _gelu_bwd = _aten.threshold_backward.default._op, _aten.gelu_backward.default._op
_ACTIVATION_GRADS = {
    "relu": lambda g, z: _threshold_bwd(g, z, 0),
    "silu": _aten.silu_backward.default._op,
    "mish": _aten.mish_backward.default._op,
    "gelu": lambda g, z: _gelu_bwd(g, z),
    "gelu_tanh": lambda g, z: _gelu_bwd(g, z, approximate="tanh"),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


MODULATION = True  # takes adaLN scale/shift tables (mod_scale=, mod_shift=)
GATE = True  # takes gate= (normalizes x * silu(gate); the backward returns dgate)
STRIDED_ROWS = True  # rows may come as [O, I, N] views with any strides (normkit._layout.row_view)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def why_unavailable(x: torch.Tensor) -> str | None:
    if x.dtype not in DTYPES:
        return f"it supports floating-point inputs, not {x.dtype}"
    return None


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _xhat(x, mean, rstd):
    """xhat of rows x; with a mean (LayerNorm), from the data shifted by each row's first element and
    that data's own mean: the stored mean rounds at x's magnitude (5e-4 on rows offset by 1e4)."""
    xf = _to(x, _acc(x))
    if mean is None:
        return xf * rstd[..., None]
    xs = xf - xf[..., :1]
    return (xs - xs.mean(-1, keepdim=True)) * rstd[..., None]


def _param(p, like, acc):
    """A weight/bias laid out to broadcast against rows `like`: [N], or per-head [H, N] (row r uses
    row r % H) repeated over the rows."""
    if p is None or p.dim() == 1:
        return None if p is None else p.to(acc)
    return p.to(acc).repeat(like[..., 0].numel() // p.shape[0], 1).view(like.shape)


def _affine(xhat, weight, bias, acc, weight_offset=0.0):
    z = xhat
    if weight is not None:
        w = _param(weight, xhat, acc)
        z = z * (w + weight_offset if weight_offset else w)
    if bias is not None:
        z = z + _param(bias, xhat, acc)
    return z


def _per_sample(t, table):
    """t (rows, any leading shape) as [S, rows per sample, N] for a modulation table [S, N]."""
    S, n = table.shape
    # the row count from the shape: t[..., 0].numel() builds a view (a microsecond a CPU call)
    return t.reshape(S, math.prod(t.shape[:-1]) // S if S else 0, n)


def _modulate(z, mod_scale, mod_shift):
    """z * (1 + scale) + shift with one table row per sample (row r uses row r // (M / S))."""
    if mod_scale is None and mod_shift is None:
        return z
    zs = _per_sample(z, mod_scale if mod_scale is not None else mod_shift)
    # unsqueeze, not [:, None]: the same view without Python indexing's cost
    if mod_scale is not None:
        zs = zs * (1 + _to(mod_scale, z.dtype).unsqueeze(1))
    if mod_shift is not None:
        zs = zs + _to(mod_shift, z.dtype).unsqueeze(1)
    return zs.reshape(z.shape)


def _param_sum(t, heads: int):
    """Sum of t over its rows, per parameter row: [N], or [heads, N] for per-head parameters."""
    rows = t.flatten(0, -2)  # not reshape(-1, n): ambiguous when t is empty
    return rows.sum(0) if heads == 1 else rows.unflatten(0, (-1, heads)).sum(0)


# ----------------------------------------------------------------------------- torch's own CPU kernels
# On the CPU, LayerNorm and GroupNorm run torch's own kernels (many times faster than the composite
# ops below, which stay for what torch lacks: float8 outputs, amax, modulation, gates, per-head
# weights) and RMSNorm torch's rms_norm where the composite is not needed (the same ops, bitwise).
# They run in fp32 (float64 for float64), as normkit computes. torch's CPU kernels compute
# y = x * a + b, whose product rounds at x's magnitude: rows offset by 1e4 lose 3e-4. So where a
# row's (group's) mean is more than one standard deviation from zero, by the kernel's own statistics
# (a check on the [rows] statistics: no pass over x, and no device to sync on the CPU), the kernel
# runs again on data shifted by each row's first element, as normkit's kernels do; within one
# standard deviation the unshifted kernel rounds no worse than on shifted data (measured against
# the float64 oracle: 5.8e-8 vs 6.0e-8 at |mean| = std, 8e-8 vs 6e-8 at 2 std, 3.6e-4 vs 5e-8 at
# 1e4). The backward makes the same decision from the saved statistics (the shifted backward takes
# the shifted data's own mean: the stored mean rounds at x's magnitude). torch's kernels also round
# bf16 dweight products to bf16, hence fp32. Both eager paths (normkit/_cpu.py, the
# autograd.Functions) and the custom op reach these same functions: the same bits either way.
_ln_bwd = torch.ops.aten.native_layer_norm_backward.default._op  # the overload's C++ callable: no Python __call__
_gn_bwd = torch.ops.aten.native_group_norm_backward.default._op
# rms_norm's (y, rstd); torch < 2.8 has none: RMSNorm with statistics then takes the composite below
_fused_rms_norm = getattr(getattr(torch.ops.aten, "_fused_rms_norm", None), "default", None)
_fused_rms_norm = None if _fused_rms_norm is None else _fused_rms_norm._op


def _to(t, dtype):
    """t in dtype; t itself when it has it (Tensor.to's call costs a microsecond even then)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _native_cpu(x, weight, bias) -> bool:
    return x.is_cpu and x.numel() > 0 and (weight is None or weight.dim() == 1) and (bias is None or bias.dim() == 1)


def _centred(mean, rstd) -> bool:
    """Every row's (group's) mean within one standard deviation of zero (False for NaN statistics):
    torch's kernel on the unshifted data is then as exact as on shifted data. aminmax: one pass, and
    cheaper than vector_norm's inf-norm (3.2 vs 3.6 us at 64 rows, 4.3 vs 14.6 at 4096)."""
    lo, hi = torch.aminmax(mean * rstd)
    return -1.0 <= lo.item() and hi.item() <= 1.0


def _shifted(xf):
    """xf minus its first element along the last dim, and that element."""
    shift = xf[..., :1]
    return xf - shift, shift


def _native_layer_norm(x, weight, bias, eps, store_stats=True, weight_offset=0.0):
    """(y in the compute dtype, mean, rstd, centred) of rows x [..., N]; no statistics unless store_stats;
    centred: the kernel ran on x unshifted (the backward's check on these statistics would say so again)."""
    acc = _acc(x)
    xf, w, b, n = _to(x, acc), _to(weight, acc), _to(bias, acc), (x.shape[-1],)
    w = w + weight_offset if weight_offset else w
    y, mean, rstd = torch.native_layer_norm(xf, n, w, b, eps)
    centred = _centred(mean, rstd)
    if not centred:
        xs, shift = _shifted(xf)
        y, mean_s, rstd = torch.native_layer_norm(xs, n, w, b, eps)
        if not store_stats:  # (the mean's add only where it is kept)
            return y, None, None, centred
        mean = shift + mean_s
    if not store_stats:
        return y, None, None, centred
    return y, mean.squeeze(-1), rstd.squeeze(-1), centred


def _param_grads(dw, db, dweight_dtype, dbias_dtype):
    """torch's fp32 weight/bias gradients in the dtypes asked for (None where not asked)."""
    return (None if dweight_dtype is None else _to(dw, dweight_dtype),
            None if dbias_dtype is None else _to(db, dbias_dtype))


def _centred_or_shifted(xf, mean, rstd, dims, centred=False):
    """(x, its mean) for torch's backward kernels: as given where _centred (or `centred`: the forward
    found these statistics centred), else shifted by each row's (group's) first element with that
    data's own mean. xf and the statistics are [rows, n] and [rows, 1] views."""
    if centred or _centred(mean, rstd):
        return xf, mean
    xs = xf - xf[..., :1]
    return xs, xs.mean(dims, keepdim=True)


def _native_layer_norm_bwd(dy, x, weight, mean, rstd, dweight_dtype, dbias_dtype, weight_offset=0.0, centred=False,
                           bias=None):
    N, acc = x.shape[-1], _acc(x)
    rstd = _to(rstd, acc).unsqueeze(-1)
    xs, mean = _centred_or_shifted(_to(x, acc), _to(mean, acc).unsqueeze(-1), rstd, -1, centred)
    w = _to(weight, acc)
    # torch's backward only asks whether there is a bias (its values never enter): the bias where there is one (no
    # allocation), zeros where dbias is asked for without one
    b = None if dbias_dtype is None else xs.new_zeros(N) if bias is None else _to(bias, acc)
    dx, dw, db = _ln_bwd(_to(dy, acc), xs, [N], mean, rstd, w + weight_offset if weight_offset else w, b,
                         [True, dweight_dtype is not None, dbias_dtype is not None])
    return (dx, *_param_grads(dw, db, dweight_dtype, dbias_dtype))


def _native_group_norm(x, num_groups, weight, bias, eps, shift=True):
    """(y in the compute dtype, contiguous, mean, rstd, centred) of x [B, C, S] in any layout (torch's
    kernel reads [B, C, S] contiguously: a channels_last x is copied once, as it copies it itself);
    centred: the kernel ran on x unshifted. None where a group is off-centre and not shift."""
    B, C, S = x.shape
    acc = _acc(x)
    xf, w, b = _to(x, acc).contiguous(), _to(weight, acc), _to(bias, acc)
    y, mean, rstd = torch.native_group_norm(xf, w, b, B, C, S, num_groups, eps)
    if _centred(mean, rstd):
        return y, mean, rstd, True
    if not shift:
        return None
    xs, shift = _shifted(xf.view(B, num_groups, -1))
    y, mean_s, rstd = torch.native_group_norm(xs.view_as(x), w, b, B, C, S, num_groups, eps)
    return y, shift.view(B, num_groups) + mean_s, rstd, False


def _like(x, t):
    """t with x's strides (GroupNorm keeps the memory format; a [B, C, 1] view is ambiguous)."""
    if t.stride() == x.stride():
        return t
    out = torch.empty_like(x, dtype=t.dtype)
    return out.copy_(t)


def _channel_affine(z, weight, bias):
    """z [B, C, S] times a per-channel weight plus a per-channel bias."""
    if weight is not None:
        z = z * weight.to(z.dtype)[:, None]
    return z + bias.to(z.dtype)[:, None] if bias is not None else z


def _native_group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation, dweight_dtype, dbias_dtype,
                           centred, eps=None):
    B, C, S = x.shape
    acc = _acc(x)
    rstd = _to(rstd, acc)
    rstd_g = rstd.unsqueeze(-1)
    xs, mean_s = _centred_or_shifted(_to(x, acc).contiguous().view(B, num_groups, -1), _to(mean, acc).unsqueeze(-1),
                                     rstd_g, -1, centred)
    dy, w = _to(dy, acc), _to(weight, acc)
    if activation is not None:  # dy through the activation at the pre-activation value
        if eps is not None:
            # the forward kernel's own bits: torch's kernel again, on the data it ran on (x, or x shifted:
            # xs is that same tensor), with the same weight, bias and eps. So this backward is the one
            # torch's autograd nodes give (native_group_norm, then the activation, which saves its
            # input): normkit/_cpu.py records those for centred groups, and this op must match them
            z = torch.native_group_norm(xs.view_as(x), w, _to(bias, acc), B, C, S, num_groups, eps)[0]
        else:  # recomputed from the statistics (no eps: the backend interface's call)
            z = ((xs - mean_s) * rstd_g).view_as(x)
            if w is not None:
                z = z * w.unsqueeze(-1) if bias is None else torch.addcmul(_to(bias, acc).unsqueeze(-1), z,
                                                                           w.unsqueeze(-1))
            elif bias is not None:
                z = z + _to(bias, acc).unsqueeze(-1)
        # dy as it comes (x's layout): torch's activation node gets the incoming gradient as it comes
        # too, so the two agree where it has x's memory format (always under torch.compile, whose
        # tangents do; another layout can move the last bit: torch's activation kernels round their
        # vectorized and scalar loops differently, and which elements take which depends on strides)
        dy = _ACTIVATION_GRADS[activation](dy, z)
    # torch's kernel fails asking for the bias gradient without a weight ("tensor does not have a device";
    # F.group_norm's own backward too): then the bias gradient is dy's per-channel sum, taken here
    bias_apart = w is None and dbias_dtype is not None
    dx, dw, db = _gn_bwd(dy.contiguous(), xs.view_as(x), mean_s.view_as(rstd), rstd, w, B, C, S, num_groups,
                         [True, dweight_dtype is not None, dbias_dtype is not None and not bias_apart])
    if bias_apart:
        db = dy.sum(dim=(0, 2))
    return (_to(dx, x.dtype), *_param_grads(dw, db, dweight_dtype, dbias_dtype))


def row_norm_fwd(x, weight, bias, eps: float, rms: bool, activation=None, store_stats: bool = True):
    y, mean, rstd, _, _ = _row_norm_fwd(x, weight, bias, eps, rms, activation, store_stats)
    return y, mean, rstd


def row_norm_fwd_fused(x, weight, bias, eps: float, rms: bool, *, activation=None, store_stats: bool = True,
                       residual=None, h_dtype=None, store_h=False, weight_offset=0.0, out_dtype=None, out_scale=None,
                       want_amax=False, mod_scale=None, mod_shift=None, gate=None):
    return _row_norm_fwd(x, weight, bias, eps, rms, activation, store_stats, residual, h_dtype, store_h, weight_offset,
                         out_dtype, out_scale, want_amax, mod_scale, mod_shift, gate)


def _row_norm_fwd(x, weight, bias, eps, rms, activation=None, store_stats=True, residual=None, h_dtype=None,
                  store_h=False, weight_offset=0.0, out_dtype=None, out_scale=None, want_amax=False, mod_scale=None,
                  mod_shift=None, gate=None, with_centred=False):
    """row_norm_fwd_fused (the interface's keyword-only arguments by position too: the CPU fast path calls it
    directly). with_centred (the fast path's autograd Function): a sixth output, True where torch's LayerNorm
    kernel ran on the rows unshifted (_row_norm_bwd's centred= then skips its check of the statistics)."""
    acc = _acc(x)
    xf = _to(x, acc) if gate is None else _gated(x, gate, acc)
    h = None
    if residual is not None:
        hs = _to(xf + _to(residual, acc), h_dtype or residual.dtype)
        h = hs.contiguous() if store_h else None
        xf = _to(hs, acc)
    # torch's CPU kernels where they compute the norm (the adaLN modulation then applied to their fp32 output, as
    # the composite below applies it, before the one rounding)
    if gate is None and out_dtype not in FP8_MAX and not want_amax and \
            (not rms or not store_stats or _fused_rms_norm is not None) and _native_cpu(xf, weight, bias):
        centred = False
        if rms:  # torch's rms_norm (with rstd: its _fused_rms_norm): the ops below, bitwise
            w = _to(weight, acc)
            w = w + weight_offset if weight_offset else w
            mean = None
            if store_stats:
                y, rstd = _fused_rms_norm(xf, [xf.shape[-1]], w, eps)
                rstd = rstd.squeeze(-1)
            else:
                y, rstd = torch.rms_norm(xf, (xf.shape[-1],), w, eps), None
        else:
            y, mean, rstd, centred = _native_layer_norm(xf, weight, bias, eps, store_stats, weight_offset)
        y = _modulate(y, mod_scale, mod_shift)
        if activation is not None:  # y in fp32: one rounding to the output's dtype
            y = _ACTIVATIONS[activation](y)
        y = _to(y, out_dtype or x.dtype).contiguous()
        return (y, mean, rstd, h, None, centred) if with_centred else (y, mean, rstd, h, None)
    if rms:
        mean, xc = None, xf
    else:
        # two passes over data shifted by each row's first element, as the kernels do; y comes
        # from the shifted data too, so the rounding of the stored mean never reaches it
        shift = xf[..., :1] if xf.shape[-1] else xf.new_zeros(xf.shape[:-1] + (1,))  # empty rows: stats 0/0
        xs = xf - shift
        mean_s = xs.mean(dim=-1, keepdim=True)
        xc = xs - mean_s
        mean = (shift + mean_s).squeeze(-1)
    rstd = torch.rsqrt(xc.square().mean(dim=-1) + eps)
    y = _affine(xc * rstd[..., None], weight, bias, acc, weight_offset)
    y = _ACTIVATIONS[activation](_modulate(y, mod_scale, mod_shift))
    amax = (y.abs().amax() if y.numel() else y.new_zeros(())) if want_amax else None
    out_dtype = out_dtype or x.dtype
    if out_dtype in FP8_MAX:  # y * scale saturated to the format's range (NaN stays NaN), then rounded
        scale = out_scale.to(acc).reshape(()) if isinstance(out_scale, torch.Tensor) else out_scale
        y = (y * scale).clamp(-FP8_MAX[out_dtype], FP8_MAX[out_dtype])
    y = y.to(out_dtype).contiguous()
    out = y, (None if mean is None else mean.contiguous()), rstd.contiguous(), h, amax
    return out + (False,) if with_centred else out


def _gated(x, gate, acc):
    """x * silu(gate) in the compute dtype: what a gated norm normalizes."""
    return x.to(acc) * torch.nn.functional.silu(gate.to(acc))


def row_norm_bwd(dy, x, weight, mean, rstd, rms: bool, dweight_dtype, dbias_dtype, *, bias=None, activation=None):
    dx, _, dw, db = _row_norm_bwd(dy, x, weight, mean, rstd, rms, dweight_dtype, dbias_dtype, bias, activation)
    return dx, dw, db


def row_norm_bwd_fused(dy, x, weight, mean, rstd, rms: bool, dweight_dtype, dbias_dtype, *, bias=None, activation=None,
                       weight_offset=0.0, dh=None, dx_dtype=None, dres_dtype=None, mod_scale=None, mod_shift=None,
                       dmod_dtypes=(None, None), gate=None):
    """With gate: x is the ungated input, and (dx, dres, dw, db, dgate) comes back."""
    return _row_norm_bwd(dy, x, weight, mean, rstd, rms, dweight_dtype, dbias_dtype, bias, activation, weight_offset,
                         dh, dx_dtype, dres_dtype, mod_scale, mod_shift, dmod_dtypes, gate)


def _row_norm_bwd(dy, x, weight, mean, rstd, rms, dweight_dtype, dbias_dtype, bias=None, activation=None,
                  weight_offset=0.0, dh=None, dx_dtype=None, dres_dtype=None, mod_scale=None, mod_shift=None,
                  dmod_dtypes=(None, None), gate=None, centred=False):
    """row_norm_bwd_fused (its keyword-only arguments by position too). centred: the forward found these
    statistics centred (_row_norm_fwd's with_centred output): torch's LayerNorm backward kernel then skips
    the check, whose answer on them is the same."""
    acc = _acc(x)
    N = x.shape[-1]
    modulated = mod_scale is not None or mod_shift is not None
    if gate is not None:
        xg = x
        x = _gated(x, gate, acc)
    if not rms and activation is None and gate is None and not modulated and dh is None and dres_dtype is None and \
            N > 1 and _native_cpu(x, weight, bias):  # N = 1: dx is exactly 0 below
        dx, dw, db = _native_layer_norm_bwd(dy, x, weight, mean, rstd, dweight_dtype, dbias_dtype, weight_offset,
                                            centred, bias)
        return _to(dx, dx_dtype or x.dtype).contiguous(), None, dw, db
    lead = x.shape[:-1]  # the statistics come flat, one per row
    rstd = rstd.reshape(lead)
    xhat = _xhat(x, None if rms else mean.reshape(lead).to(acc), rstd.to(acc))
    dyf = dy.to(acc)
    dmod = ()
    if modulated:
        yaff = _affine(xhat, weight, bias, acc, weight_offset)
        if activation is not None:
            dyf = _ACTIVATION_GRADS[activation](dyf, _modulate(yaff, mod_scale, mod_shift))
        table = mod_scale if mod_scale is not None else mod_shift
        ds_dtype, dt_dtype = dmod_dtypes
        dmod = (None if ds_dtype is None else _per_sample(dyf * yaff, table).sum(1).to(ds_dtype),
                None if dt_dtype is None else _per_sample(dyf, table).sum(1).to(dt_dtype))
        dyf = _modulate(dyf, mod_scale, None) if mod_scale is not None else dyf  # dy * (1 + scale)
    elif activation is not None:  # dy through the activation's derivative at the pre-activation value
        dyf = _ACTIVATION_GRADS[activation](dyf, _affine(xhat, weight, bias, acc, weight_offset))
    wdy = _affine(dyf, weight, None, acc, weight_offset)
    c1 = (xhat * wdy).sum(dim=-1, keepdim=True) / N
    dx = wdy - xhat * c1
    if not rms:
        dx = dx - wdy.sum(dim=-1, keepdim=True) / N
    dx = dx * rstd.to(acc)[..., None]
    if dh is not None:  # the residual stream's own gradient joins dx
        dx = dx + dh.to(acc)
    p = weight if weight is not None else bias
    heads = p.shape[0] if p is not None and p.dim() == 2 else 1
    dw = _param_sum(dyf * xhat, heads).to(dweight_dtype) if dweight_dtype is not None else None
    db = _param_sum(dyf, heads).to(dbias_dtype) if dbias_dtype is not None else None
    dres = dx.to(dres_dtype).contiguous() if dres_dtype is not None else None
    if gate is not None:  # dx is the gradient of x * silu(g): chain it to x and to the gate
        g = gate.to(acc)
        sg = torch.sigmoid(g)
        dgate = (dx * xg.to(acc) * (sg * (1 + g * (1 - sg)))).to(gate.dtype).contiguous()
        return (dx * (g * sg)).to(dx_dtype or xg.dtype).contiguous(), dres, dw, db, dgate
    return (dx.to(dx_dtype or x.dtype).contiguous(), dres, dw, db) + dmod


# ----------------------------------------------------------------------------- group norm

def _groups(t, num_groups, acc):
    """[B, G, Cg * S] float view/copy of a [B, C, S] tensor in any layout."""
    B, C, S = t.shape
    return t.to(acc).reshape(B, num_groups, (C // num_groups) * S)


def _channel_vec(p, num_groups, S, acc):
    """A per-channel [C] parameter laid out along a group's [Cg * S] elements: [1, G, Cg * S]."""
    C = p.shape[0]
    return p.to(acc).reshape(1, num_groups, C // num_groups, 1).expand(1, num_groups, C // num_groups, S).reshape(
        1, num_groups, -1)


def group_norm_fwd(x, num_groups, weight, bias, eps, activation=None):
    return _group_norm_fwd(x, num_groups, weight, bias, eps, activation)[:3]


def _group_norm_fwd(x, num_groups, weight, bias, eps, activation=None, shift=True):
    """group_norm_fwd's (y, mean, rstd) and whether torch's CPU kernel ran on unshifted data (the
    eager backward then skips its check); None where that needs the shift and not shift (torch's
    autograd records the unshifted kernel: see normkit/_cpu.py)."""
    acc = _acc(x)
    B, C, S = x.shape
    if _native_cpu(x, weight, bias):
        out = _native_group_norm(x, num_groups, weight, bias, eps, shift)
        if out is None:
            return None
        y, mean, rstd, centred = out
        if activation is not None:  # in fp32: one rounding to x's dtype
            y = _ACTIVATIONS[activation](y)
        return _like(x, _to(y, x.dtype)), mean, rstd, centred
    xg = _groups(x, num_groups, acc)
    # shifted two-pass statistics, as the kernels (empty groups: statistics 0/0)
    shift = xg[:, :, :1] if xg.shape[2] else xg.new_zeros(B, num_groups, 1)
    xs = xg - shift
    mean_s = xs.mean(dim=2, keepdim=True)
    xc = xs - mean_s
    rstd = torch.rsqrt(xc.square().mean(dim=2, keepdim=True) + eps)
    z = xc * rstd
    if weight is not None:
        z = z * _channel_vec(weight, num_groups, S, acc)
    if bias is not None:
        z = z + _channel_vec(bias, num_groups, S, acc)
    y = torch.empty_like(x)  # x's strides: the memory format is kept
    y.copy_(_ACTIVATIONS[activation](z).reshape(B, C, S))
    return y, (shift + mean_s).squeeze(2), rstd.squeeze(2), False


def group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation, dweight_dtype, dbias_dtype, *, eps=None):
    return _group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation, dweight_dtype, dbias_dtype,
                           eps=eps)


def _group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation, dweight_dtype, dbias_dtype,
                    centred=False, eps=None):
    """group_norm_bwd; centred: the forward ran torch's kernel on unshifted data (_group_norm_fwd's
    flag: the check on these statistics would say so again). eps: the forward's; given, torch's CPU
    kernel recomputes the activation's input with the forward's bits (the custom op's and the eager
    Functions' calls pass it), else it is recomputed from the statistics."""
    acc = _acc(x)
    B, C, S = x.shape
    if C // num_groups * S > 1 and _native_cpu(x, weight, bias):
        dx, dw, db = _native_group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation, dweight_dtype,
                                            dbias_dtype, centred, eps)
        return _like(x, dx), dw, db
    xg = _groups(x, num_groups, acc)
    xs = xg - xg[:, :, :1]  # shifted, with its own mean: the stored mean rounds at x's magnitude
    xhat = (xs - xs.mean(2, keepdim=True)) * rstd.to(acc)[:, :, None]
    g = _groups(dy, num_groups, acc)
    w = _channel_vec(weight, num_groups, S, acc) if weight is not None else None
    if activation is not None:
        z = xhat * w if w is not None else xhat
        if bias is not None:
            z = z + _channel_vec(bias, num_groups, S, acc)
        g = _ACTIVATION_GRADS[activation](g, z)
    wg = g * w if w is not None else g
    dx = (wg - xhat * (xhat * wg).mean(dim=2, keepdim=True) - wg.mean(dim=2, keepdim=True)) * rstd.to(acc)[:, :, None]
    out = torch.empty_like(x)
    out.copy_(dx.reshape(B, C, S))
    per_channel = lambda t: t.reshape(B, C, S).sum(dim=(0, 2))  # noqa: E731
    dw = per_channel(g * xhat).to(dweight_dtype) if dweight_dtype is not None else None
    db = per_channel(g).to(dbias_dtype) if dbias_dtype is not None else None
    return out, dw, db
