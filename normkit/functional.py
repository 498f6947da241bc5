"""The public functions: argument checks, flattening to rows, autograd, and backend dispatch.

Every op reduces to "normalize each row of an [M, N] matrix": the trailing normalized_shape dims
are the row, all leading dims are rows. Rows are passed to the kernels as a strided view when the
layout allows (one stride between rows, or two: q/k heads of a fused QKV projection; the Triton and
torch backends also take a column stride: the channels of an NCHW tensor); otherwise x is copied once.

LayerNorm and RMSNorm take fused epilogues (keyword-only):
  residual=r          normalize h = x + r (summed in fp32, rounded to residual_dtype); prenorm=True
                      also returns h, the new residual stream. The backward takes the gradients of
                      y and h and returns dx and dresidual from one pass.
  residual_dtype=     h's dtype; default residual.dtype (flash-attention's and quack's rule): with
                      an fp32 residual stream and bf16 x, h stays fp32.
  weight_offset=c     y = xhat * (c + weight) + bias (Gemma: 1.0); weight gets autograd's gradient.
  out_dtype=          y's dtype (default x's): float16/bfloat16/float32/float64, or float8_e4m3fn /
                      float8_e5m2 with out_scale= (a float, or a 1-element tensor on x's device):
                      the stored value is y * out_scale saturated to the format's largest finite
                      value. The backward treats the cast as the identity (dy is the gradient of y).
  return_amax=True    also return max |y| (before scaling; a 0-dim fp32 tensor, NaN if y has one),
                      computed deterministically, for delayed fp8 scaling.
  scale=, shift=      adaLN modulation (DiT, PixArt, SD3, Flux): y = act((xhat * w + b) * (1 + scale)
                      + shift), computed in fp32 in the same pass and rounded once. Per sample: shape
                      lead + normalized_shape, lead aligned with x's leading dims from the left and
                      equal to a prefix of them ((B, N) or (B, 1, N) for x of (B, T, N); (N,) or
                      (1, N): one row for all). Any float dtype; differentiable (dscale, dshift are
                      per-sample sums, deterministic). Either may be given alone.
  gate=g              the gated norm of Mamba-2-style layers: normalizes z = x * silu(g), formed in
                      fp32 in the kernel and not rounded (g: x's shape and device, any float dtype,
                      read in place like a residual). The backward returns dx = dz * silu(g) and
                      dgate = dz * x * silu'(g) (g's dtype) from one pass. Combines with weight_offset,
                      out_dtype (float8 too), return_amax, activation and per-head weights (groups of
                      a grouped gated norm: x.view(..., G, group), weight.view(G, group)); not with
                      residual/prenorm (which would come first is ambiguous) nor scale=/shift=.
Returns y, or the tuple (y[, h][, amax]) when prenorm / return_amax ask for more.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Optional, Sequence, Union

import torch

from . import _cpu, _host, _library, backends, compile_fusion
from ._autocast import _autocast_upcasts
from ._autograd import PLAIN, GroupNormFn, RowNormFn, RowOptions, check_backend, needs_autograd, param_rows, \
    row_norm_forward_fused, transforms_active
from ._layout import as_rows, bcs, flat_param, from_bcs, is_channels_last, row_view, sample_rows
from .reference import ACTIVATIONS, default_rms_eps

__all__ = [
    "layer_norm",
    "rms_norm",
    "group_norm",
    "layer_norm_fwd",
    "layer_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
]

ShapeLike = Union[int, Sequence[int], torch.Size]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------- argument checks

def _check_tensor(t, arg: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{arg}: expected a floating-point tensor (float16, bfloat16, float32 or float64), "
                        f"got dtype {t.dtype}")


def _normalized_shape(normalized_shape: ShapeLike) -> tuple[int, ...]:
    if type(normalized_shape) is int:  # the common cases first: they run on every call
        shape = (normalized_shape,)
    elif type(normalized_shape) in (tuple, torch.Size, list) and all(type(s) is int for s in normalized_shape):
        shape = tuple(normalized_shape)
    elif isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape = (int(normalized_shape),)
    else:
        try:
            shape = tuple(normalized_shape)
        except TypeError:
            raise TypeError(f"normalized_shape: expected an int or a sequence of ints, got {normalized_shape!r}") from None
        if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in shape):
            raise TypeError(f"normalized_shape: expected an int or a sequence of ints, got {normalized_shape!r}")
        shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise ValueError("normalized_shape: expected at least one dimension, got ()")
    if min(shape) < 0:
        raise ValueError(f"normalized_shape: expected non-negative sizes, got {shape}")
    return shape


def _check_eps(eps) -> float:
    """eps as torch's norms take it (their `float` argument): a float or an int (bool included), a
    NumPy scalar, or a 0-dim real tensor that does not require grad. Any value: negative, inf and
    NaN are computed with, as torch does (rsqrt(var + eps) is NaN where var + eps < 0)."""
    if type(eps) is float:
        return eps
    if isinstance(eps, torch.Tensor):
        if eps.dim() != 0 or eps.requires_grad or eps.is_complex():
            raise TypeError(f"eps: expected a float (a 0-dim real tensor that does not require grad is taken, as "
                            f"torch takes it), got a tensor of shape {tuple(eps.shape)} and dtype {eps.dtype}"
                            f"{' that requires grad' if eps.requires_grad else ''}")
        return float(eps.item())
    numpy_scalar = type(eps).__module__ == "numpy" and (isinstance(eps, numbers.Real) or type(eps).__name__ in
                                                          ("bool", "bool_"))
    if not isinstance(eps, (float, int)) and not numpy_scalar:
        raise TypeError(f"eps: expected a float (or an int, a NumPy scalar or a 0-dim tensor), got "
                        f"{type(eps).__name__} {eps!r}")
    try:
        return float(eps)
    except OverflowError:
        raise ValueError(f"eps: expected a number that fits a float, got {eps!r}") from None


def _check_activation(activation) -> None:
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None or one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")


def _check_param(p, arg: str, shape, x: torch.Tensor, device, heads=None) -> None:
    if p is None:
        return
    _check_tensor(p, arg)
    if p.shape != shape and (heads is None or p.shape != heads):
        also = f" or, one row per head, {heads}" if heads is not None else ""
        raise ValueError(f"{arg}: expected shape {tuple(shape)}{also}, got {tuple(p.shape)}")
    if p.device != device:
        raise ValueError(f"{arg}: expected a tensor on x's device {device}, got one on {p.device}")


def _check_inputs(x, normalized_shape, weight, bias, eps, per_head: bool = False):
    """(normalized shape, eps). per_head: weight/bias may also have shape (x.shape[-k-1], *shape),
    one row of parameters per index of the dim before the normalized ones (per-head q/k norms of
    (..., heads, head_dim) tensors; x needs a dim before the heads)."""
    _check_tensor(x, "x")
    shape = _normalized_shape(normalized_shape)
    if x.shape[x.dim() - len(shape):] != shape or x.dim() < len(shape):
        raise ValueError(f"normalized_shape: expected the trailing dims of x, whose shape is {tuple(x.shape)}, "
                         f"got {shape}")
    if weight is not None or bias is not None:
        device = x.device
        heads = _heads(x, shape) if per_head else None
        _check_param(weight, "weight", shape, x, device, heads)
        _check_param(bias, "bias", shape, x, device, heads)
    return shape, _check_eps(eps)


# ----------------------------------------------------------------------------- dispatch

# the layout helpers under their historical names (tests and the bench import them from here)
_as_rows, _flat_param, _bcs, _from_bcs, _is_channels_last = as_rows, flat_param, bcs, from_bcs, is_channels_last
_is_compiling = torch.compiler.is_compiling


def _param_grad_dtype(p, wanted: bool):
    return p.dtype if (p is not None and wanted) else None


def _forward_only_check(backend, op, *tensors) -> None:
    if not getattr(backend, "HAS_BACKWARD", True) and needs_autograd(*tensors):
        raise backends.BackendUnavailableError(
            f"backend={backend.NAME!r} cannot run {op} with autograd: it has no backward, and x, weight or "
            "bias requires grad; call it under torch.no_grad() or on detached tensors, or use backend='torch'")


def _autocast(op: str, *tensors):
    """torch's autocast contract for the norms: where torch registers an autocast kernel for the op on
    x's device type (CUDA: layer_norm, group_norm, and rms_norm from torch 2.12 on), it runs in float32
    (every floating input that is not float64 is cast) and returns float32; elsewhere (CPU) autocast
    leaves the op alone. Returns the tensors, cast where torch casts them."""
    x = tensors[0]
    device_type = x.device.type
    if not _autocast_upcasts(op, device_type) or not torch.is_autocast_enabled(device_type):
        return tensors
    return tuple(t.float() if (t is not None and t.is_floating_point() and t.dtype != torch.float64
                               and t.device.type == device_type) else t for t in tensors)


# ----------------------------------------------------------------------------- fused options

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_REAL = (numbers.Real, torch.SymInt, torch.SymFloat)  # the latter: traced by torch.compile with dynamic shapes
_OUT_DTYPES = _FLOAT_DTYPES + _FP8


def _check_dtype_arg(d, arg: str, allowed) -> None:
    if d is not None and d not in allowed:
        raise TypeError(f"{arg}: expected None or one of {', '.join(str(a) for a in allowed)}, got {d!r}")


def _check_fusion(x, shape, weight, residual, prenorm, residual_dtype, weight_offset, out_dtype, out_scale,
                  return_amax):
    """(RowOptions, tensor scale or None) from the fused options, checked; errors name the argument."""
    if residual is not None:
        _check_tensor(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual: expected x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.device != x.device:
            raise ValueError(f"residual: expected a tensor on x's device {x.device}, got one on {residual.device}")
    if type(prenorm) is not bool:
        raise TypeError(f"prenorm: expected a bool, got {prenorm!r}")
    if prenorm and residual is None:
        raise ValueError("prenorm: returns the new residual stream h = x + residual, so it needs residual=; "
                         "got residual=None")
    _check_dtype_arg(residual_dtype, "residual_dtype", _FLOAT_DTYPES)
    if residual_dtype is not None and residual is None:
        raise ValueError(f"residual_dtype: is the dtype of h = x + residual and needs residual=; got residual=None "
                         f"with residual_dtype={residual_dtype}")
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, _REAL) or \
            (isinstance(weight_offset, numbers.Real) and not math.isfinite(weight_offset)):
        raise TypeError(f"weight_offset: expected a finite real number, got {weight_offset!r}")
    if weight_offset != 0 and weight is None:
        raise ValueError(f"weight_offset: scales by weight_offset + weight and needs a weight; got weight=None "
                         f"with weight_offset={weight_offset}")
    _check_dtype_arg(out_dtype, "out_dtype", _OUT_DTYPES)
    scale = None
    if out_dtype in _FP8 and out_scale is None:
        raise ValueError(f"out_scale: out_dtype={out_dtype} stores y * out_scale and needs out_scale= (a float or a "
                         "1-element tensor); got out_scale=None")
    if out_scale is not None:
        if out_dtype not in _FP8:
            raise ValueError(f"out_scale: scales float8 outputs only (out_dtype=torch.float8_e4m3fn or "
                             f"torch.float8_e5m2); got out_dtype={out_dtype}")
        if isinstance(out_scale, torch.Tensor):
            if out_scale.numel() != 1 or not out_scale.is_floating_point():
                raise ValueError(f"out_scale: expected a float or a 1-element floating tensor, got a tensor of shape "
                                 f"{tuple(out_scale.shape)} and dtype {out_scale.dtype}")
            if out_scale.device != x.device:
                raise ValueError(f"out_scale: expected a tensor on x's device {x.device}, got one on {out_scale.device}")
            scale, out_scale = out_scale, None
        elif isinstance(out_scale, bool) or not isinstance(out_scale, numbers.Real) or not math.isfinite(out_scale):
            raise TypeError(f"out_scale: expected a finite float or a 1-element tensor, got {out_scale!r}")
        else:
            out_scale = float(out_scale)
    if type(return_amax) is not bool:
        raise TypeError(f"return_amax: expected a bool, got {return_amax!r}")
    opts = RowOptions(None if residual is None else (residual_dtype or residual.dtype), float(weight_offset),
                      None if out_dtype == x.dtype else out_dtype, out_scale, return_amax)
    return (PLAIN if opts == PLAIN else opts), scale


def _check_modulation(x, shape, weight, bias, scale, shift, opts):
    """The adaLN modulation tensors, checked; returns opts with their flags set. Errors name the argument."""
    for t, arg in ((scale, "scale"), (shift, "shift")):
        if t is None:
            continue
        _check_tensor(t, arg)
        k = len(shape)
        if t.dim() < k or tuple(t.shape[t.dim() - k:]) != shape:
            raise ValueError(f"{arg}: expected shape (..., {', '.join(map(str, shape))}) ending in normalized_shape "
                             f"{shape} (per sample: (B, {', '.join(map(str, shape))}) for x of shape (B, T, "
                             f"{', '.join(map(str, shape))})), got {tuple(t.shape)}")
        if sample_rows(t.shape, x.shape, k) is None:
            lead = tuple(x.shape[: x.dim() - k])
            raise ValueError(f"{arg}: expected one row per sample: leading dims equal to a prefix of x's leading dims "
                             f"{lead} (aligned from the left, then ones), got {tuple(t.shape[: t.dim() - k])}; "
                             f"per-token modulation is not fused")
        if t.device != x.device:
            raise ValueError(f"{arg}: expected a tensor on x's device {x.device}, got one on {t.device}")
        if any(p is not None and p.dim() > len(shape) for p in (weight, bias)):
            raise ValueError(f"{arg}: adaLN modulation with per-head weight/bias is not supported; got a weight/bias "
                             f"of shape {tuple((weight if weight is not None else bias).shape)}")
    if scale is not None and shift is not None and \
            sample_rows(scale.shape, x.shape, len(shape)) != sample_rows(shift.shape, x.shape, len(shape)):
        raise ValueError(f"shift: expected the same samples as scale {tuple(scale.shape)}, got {tuple(shift.shape)}")
    return dataclasses.replace(opts, mod_scale=scale is not None, mod_shift=shift is not None)


def _check_gate(x, gate, residual, scale, shift, opts):
    """The gated norm's gate, checked; returns opts with its flag set. Errors name the argument."""
    _check_tensor(gate, "gate")
    if gate.shape != x.shape:
        raise ValueError(f"gate: expected x's shape {tuple(x.shape)} (the norm of x * silu(gate)), got "
                         f"{tuple(gate.shape)}")
    if gate.device != x.device:
        raise ValueError(f"gate: expected a tensor on x's device {x.device}, got one on {gate.device}")
    if residual is not None:
        raise ValueError("gate: a gated norm with residual= (or prenorm=) is not fused: whether the gate applies "
                         "before or after the residual add is ambiguous; add the residual first, then call with gate=")
    if scale is not None or shift is not None:
        raise ValueError("gate: a gated norm with adaLN modulation (scale=/shift=) is not fused; got both")
    return dataclasses.replace(opts, gate=True)


def _same_param_rows(weight, bias, shape):
    """With one parameter per head and the other not, the other is expanded to per head (autograd
    sums its gradient back): the kernels take both in one layout."""
    if weight is None or bias is None or weight.dim() == bias.dim():
        return weight, bias
    if weight.dim() > bias.dim():
        return weight, bias.expand(weight.shape)
    return weight.expand(bias.shape), bias


def _outputs(y, h, amax, prenorm: bool, return_amax: bool):
    if not prenorm and not return_amax:
        return y
    return (y,) + ((h,) if prenorm else ()) + ((amax,) if return_amax else ())


_FUSED_BACKENDS = (None, "triton", "torch")  # the backend names whose kernels have fused epilogues


def _autocast_rows(x, weight, bias, opts, backend_name, op):
    """torch's CUDA autocast contract (float32 out) for LayerNorm/RMSNorm: in one pass, reading x's
    dtype and writing float32 (out_dtype), on backends with fused epilogues; values are those of
    casting first, which the other backends do. An explicit out_dtype is kept."""
    if not _autocast_upcasts(op, x.device.type) or not torch.is_autocast_enabled(x.device.type) or \
            x.dtype in (torch.float32, torch.float64) or opts.out_dtype is not None:
        return x, weight, bias, opts
    if backend_name in _FUSED_BACKENDS:
        return x, weight, bias, dataclasses.replace(opts, out_dtype=torch.float32)
    x, weight, bias = _autocast(op, x, weight, bias)
    return x, weight, bias, opts


def _row_norm(x, shape, weight, bias, eps, rms, activation, backend_name, op, residual=None, scale=None,
              opts=PLAIN, prenorm=False, mod_scale=None, mod_shift=None, gate=None):
    """Checked arguments -> y (or the tuple of _outputs), through the custom op (compile, modes,
    subclasses), the autograd function (gradients, torch.func, forward AD) or straight to the
    kernels (inference). The host path is asked again here: the public functions ask it first, but a
    call it declined there may be its case now (arguments normalized, autocast applied)."""
    plain = residual is None and scale is None and opts is PLAIN and (weight is None or weight.dim() == len(shape)) \
        and (bias is None or bias.dim() == len(shape))  # not per-head parameters
    y = _via_host(x, shape, weight, bias, eps, rms, activation, backend_name, residual, prenorm, opts.residual_dtype,
                  opts.weight_offset, opts.out_dtype, scale if scale is not None else opts.out_scale,
                  opts.return_amax, False, mod_scale, mod_shift, gate)
    if y is not None:
        return y
    if _library.needed(x, weight, bias, residual, scale, mod_scale, mod_shift, gate):
        if _is_compiling():
            compile_fusion.traced()  # Inductor decides, op by op, whether normkit's op stays (compile_fusion.py)
        if plain:
            return _library.row_norm(x, len(shape), weight, bias, eps, rms, backend_name, activation=activation)
        y, h, _, _, amax = _library.row_norm_fused(x, len(shape), weight, bias, eps, rms, backend_name, activation,
                                                   residual, scale, opts, mod_scale, mod_shift, gate)
        return _outputs(y, h, amax, prenorm, opts.return_amax)
    backend = backends.resolve(backend_name, x, op)
    if needs_autograd(x, weight, bias, residual, mod_scale, mod_shift, gate) or transforms_active():
        _forward_only_check(backend, op, x, weight, bias, mod_scale, mod_shift, gate)
        check_backend(backend, opts, residual)
        y, h, _, _, amax = RowNormFn.apply(x, weight, bias, residual, scale, len(shape), eps, rms, activation, opts,
                                           backend, mod_scale, mod_shift, gate)
        return _outputs(y, h, amax, prenorm, opts.return_amax)
    if plain:  # inference: no statistics to keep, so the kernel need not write them
        rows = row_view(x, shape, getattr(backend, "STRIDED_ROWS", False))
        y, _, _ = backend.row_norm_fwd(rows, flat_param(weight), flat_param(bias), eps, rms, activation,
                                       store_stats=False)
        return y if y.shape == x.shape else y.view(x.shape)
    check_backend(backend, opts, residual)
    y, h, _, _, amax = row_norm_forward_fused(backend, x, weight, bias, len(shape), eps, rms, activation,
                                              residual=residual, scale=scale, opts=opts, store_stats=False,
                                              store_h=prenorm, mod_scale=mod_scale, mod_shift=mod_shift, gate=gate)
    return _outputs(y, h, amax, prenorm, opts.return_amax)


def _plain(residual, prenorm, residual_dtype, weight_offset, out_dtype, out_scale, return_amax, scale=None,
           shift=None, gate=None) -> bool:
    """No fused option asked for (the defaults; weight_offset's is the int 0: a float default would
    be a symbolic input that torch.compile(dynamic=True) specializes by restarting its trace)."""
    return residual is None and prenorm is False and residual_dtype is None and weight_offset == 0 and \
        out_dtype is None and out_scale is None and return_amax is False and scale is None and shift is None and \
        gate is None


def _via_host(x, normalized_shape, weight, bias, eps, rms, activation, backend, residual, prenorm, residual_dtype,
              weight_offset, out_dtype, out_scale, return_amax, autocast: bool, mod_scale=None, mod_shift=None,
              gate=None):
    """The output (y, or the tuple of _outputs) of the CPU fast path (plain CPU calls: torch's own ops,
    normkit/_cpu.py) or of the C++ host path, or None where neither serves the call. The adaLN
    modulation (mod_scale, mod_shift) and the gate are passed only when given: the common call keeps
    the shorter argument list."""
    if _cpu.offered(x, backend) and gate is None and out_scale is None and return_amax is False:
        # first: the host path serves no CPU call outside tests (_cpu checks the options too; asked here, a trace
        # need not read its checks, and guard them)
        y = _cpu.row_norm(x, normalized_shape, weight, bias, eps, rms, activation, backend, residual, prenorm,
                          residual_dtype, weight_offset, out_dtype, mod_scale, mod_shift)
        if y is not None:
            return y
    fast = _host.fast
    if fast is None or _is_compiling():
        return None
    if mod_scale is None and mod_shift is None and gate is None:
        return fast.row_norm(x, normalized_shape, weight, bias, eps, rms, activation, backend, residual, prenorm,
                             residual_dtype, weight_offset, out_dtype, out_scale, return_amax, autocast)
    return fast.row_norm(x, normalized_shape, weight, bias, eps, rms, activation, backend, residual, prenorm,
                         residual_dtype, weight_offset, out_dtype, out_scale, return_amax, autocast, mod_scale,
                         mod_shift, gate)


def _fused_row_norm(x, normalized_shape, weight, bias, eps, rms, activation, backend, residual, prenorm,
                    residual_dtype, weight_offset, out_dtype, out_scale, return_amax, autocast: bool, scale=None,
                    shift=None, gate=None):
    op = "rms_norm" if rms else "layer_norm"
    if rms:
        _check_tensor(x, "x")
        eps = default_rms_eps(x.dtype) if eps is None else eps
    shape, eps = _check_inputs(x, normalized_shape, weight, bias, eps, per_head=True)
    weight, bias = _same_param_rows(weight, bias, shape)
    _check_activation(activation)
    if _plain(residual, prenorm, residual_dtype, weight_offset, out_dtype, out_scale, return_amax, scale, shift,
              gate):
        opts, fp8_scale = PLAIN, None  # the common call: nothing fused, nothing more to check
    else:
        opts, fp8_scale = _check_fusion(x, shape, weight, residual, prenorm, residual_dtype, weight_offset, out_dtype,
                                        out_scale, return_amax)
        if gate is not None:
            opts = _check_gate(x, gate, residual, scale, shift, opts)
        if scale is not None or shift is not None:
            opts = _check_modulation(x, shape, weight, bias, scale, shift, opts)
    if autocast:
        x, weight, bias, opts = _autocast_rows(x, weight, bias, opts, backend, op)
    return _row_norm(x, shape, weight, bias, eps, rms, activation, backend, op, residual, fp8_scale, opts, prenorm,
                     scale, shift, gate)


def row_norm_as_written(x, normalized_shape, weight, bias, eps, rms: bool, *, activation=None, backend=None,
                        residual=None, prenorm=False, residual_dtype=None, weight_offset=0, out_dtype=None,
                        out_scale=None, return_amax=False, scale=None, shift=None, gate=None):
    """LayerNorm/RMSNorm without torch's autocast contract for F.layer_norm / F.rms_norm: computes in
    float32 and rounds to x's dtype (or out_dtype) whatever autocast says. For modules that write
    their norm out in explicit float32 ops (HF's RMSNorm classes), which autocast does not upcast as
    a whole. The fused options are layer_norm's."""
    y = _via_host(x, normalized_shape, weight, None if rms else bias, eps, rms, activation, backend, residual, prenorm,
                  residual_dtype, weight_offset, out_dtype, out_scale, return_amax, False, scale, shift, gate)
    if y is not None:
        return y
    return _fused_row_norm(x, normalized_shape, weight, None if rms else bias, eps, rms, activation, backend,
                           residual, prenorm, residual_dtype, weight_offset, out_dtype, out_scale, return_amax,
                           autocast=False, scale=scale, shift=shift, gate=gate)


# ----------------------------------------------------------------------------- public API

def layer_norm(x: torch.Tensor, normalized_shape: ShapeLike, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, *, activation: Optional[str] = None,
               residual: Optional[torch.Tensor] = None, prenorm: bool = False,
               residual_dtype: Optional[torch.dtype] = None, weight_offset: float = 0,
               out_dtype: Optional[torch.dtype] = None, out_scale=None, return_amax: bool = False,
               scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None,
               gate: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """LayerNorm over the trailing `normalized_shape` dims, as torch.nn.functional.layer_norm.

    activation: None, "silu", "mish", "gelu", "gelu_tanh" or "relu", applied after the affine
    transform in the same kernel (forward and backward).
    residual, prenorm, residual_dtype, weight_offset, out_dtype, out_scale, return_amax: the fused
    epilogues (see the module docstring); returns y, or (y[, h][, amax]).
    scale, shift: adaLN modulation, y = act((xhat * w + b) * (1 + scale) + shift) in one pass, one
    scale/shift row per sample ((B, N) or (B, 1, N) for x of (B, T, N)); see the module docstring.
    gate: the gated norm, normalizes x * silu(gate) (gate of x's shape); see the module docstring.
    backend: None picks Triton for CUDA tensors and torch otherwise; a name forces that backend.
    Under CUDA autocast it returns float32, as torch's layer_norm does (read x's dtype, write fp32).
    """
    y = _via_host(x, normalized_shape, weight, bias, eps, False, activation, backend, residual, prenorm, residual_dtype,
                  weight_offset, out_dtype, out_scale, return_amax, True, scale, shift, gate)
    if y is not None:
        return y
    return _fused_row_norm(x, normalized_shape, weight, bias, eps, False, activation, backend, residual, prenorm,
                           residual_dtype, weight_offset, out_dtype, out_scale, return_amax, autocast=True,
                           scale=scale, shift=shift, gate=gate)


def rms_norm(x: torch.Tensor, normalized_shape: ShapeLike, weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None, *, activation: Optional[str] = None, residual: Optional[torch.Tensor] = None,
             prenorm: bool = False, residual_dtype: Optional[torch.dtype] = None, weight_offset: float = 0,
             out_dtype: Optional[torch.dtype] = None, out_scale=None, return_amax: bool = False,
             scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None,
             gate: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """RMSNorm over the trailing `normalized_shape` dims, as torch.nn.functional.rms_norm.

    eps=None means torch's default: the machine epsilon of the compute type (float32, or float64).
    activation, the fused epilogues (scale=/shift= modulation included) and backend are as in
    layer_norm; under autocast the dtype torch's rms_norm returns there (float32 from torch 2.12;
    torch 2.11 keeps x's dtype).
    """
    y = _via_host(x, normalized_shape, weight, None, eps, True, activation, backend, residual, prenorm, residual_dtype,
                  weight_offset, out_dtype, out_scale, return_amax, True, scale, shift, gate)
    if y is not None:
        return y
    return _fused_row_norm(x, normalized_shape, weight, None, eps, True, activation, backend, residual, prenorm,
                           residual_dtype, weight_offset, out_dtype, out_scale, return_amax, autocast=True,
                           scale=scale, shift=shift, gate=gate)


# ----------------------------------------------------------------------------- group norm

def _check_group_inputs(x, num_groups, weight, bias, eps):
    _check_tensor(x, "x")
    if x.dim() < 2:
        raise ValueError(f"x: expected at least 2 dims (batch, channels, *spatial), got shape {tuple(x.shape)}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral) or num_groups <= 0:
        raise ValueError(f"num_groups: expected a positive int, got {num_groups!r}")
    C = x.shape[1]
    if C % num_groups:
        raise ValueError(f"num_groups: expected a divisor of the channel count C={C}, got {num_groups}")
    device = x.device
    _check_param(weight, "weight", (C,), x, device)
    _check_param(bias, "bias", (C,), x, device)
    return int(num_groups), _check_eps(eps)


def group_norm(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, *, activation: Optional[str] = None,
               backend: Optional[str] = None) -> torch.Tensor:
    """GroupNorm of x (B, C, *spatial) as torch.nn.functional.group_norm, then `activation`
    (None, "silu", "mish", "gelu", "gelu_tanh", "relu") in the same kernel. NCHW and channels_last
    inputs are read in place, and the output keeps the input's memory format. Under CUDA autocast it
    computes in float32 and returns float32, as torch's group_norm does."""
    if _cpu.offered(x, backend):  # torch's own ops for plain arguments
        y = _cpu.group_norm(x, num_groups, weight, bias, eps, activation, backend)
        if y is not None:
            return y
    fast = _host.fast
    if fast is not None and not _is_compiling():
        y = fast.group_norm(x, num_groups, weight, bias, eps, activation, backend)
        if y is not None:
            return y
    num_groups, eps = _check_group_inputs(x, num_groups, weight, bias, eps)
    _check_activation(activation)
    cast, weight, bias = _autocast("group_norm", x, weight, bias)
    x, was_cast = cast, cast is not x
    if fast is not None and was_cast and not _is_compiling():  # a call the host path may serve now
        y = fast.group_norm(x, num_groups, weight, bias, eps, activation, backend)
        if y is not None:
            return y
    if _library.needed(x, weight, bias):
        if _is_compiling():
            compile_fusion.traced()
        return _library.group_norm(x, num_groups, weight, bias, eps, backend, activation=activation)
    be = backends.resolve(backend, x, "group_norm")
    if needs_autograd(x, weight, bias) or transforms_active():
        _forward_only_check(be, "group_norm", x, weight, bias)
        return GroupNormFn.apply(x, weight, bias, num_groups, eps, activation, be)[0]
    y3, _, _ = be.group_norm_fwd(bcs(x, is_channels_last(x)), num_groups, weight, bias, eps, activation)
    return from_bcs(y3, x.shape)


# ----------------------------------------------------------------------------- kernel-level API

def _stats_shape(x: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x.shape[: x.dim() - len(shape)])


def _fwd_with_stats(x, normalized_shape, weight, bias, eps, rms, activation, residual, residual_dtype, weight_offset,
                    out_dtype, out_scale, return_amax, backend, op):
    """The kernel-level forward: (y, mean or None, rstd, h or None, amax or None)."""
    shape, eps = _check_inputs(x, normalized_shape, weight, bias, eps, per_head=True)
    weight, bias = _same_param_rows(weight, bias, shape)
    _check_activation(activation)
    opts, scale = _check_fusion(x, shape, weight, residual, False, residual_dtype, weight_offset, out_dtype, out_scale,
                                return_amax)
    if _library.needed(x, weight, bias, residual, scale):  # torch.compile, DTensor, dispatch modes: the custom op
        if residual is None and scale is None and opts is PLAIN and activation is None:
            y, mean, rstd = _library.row_norm_with_stats(x, len(shape), weight, bias, eps, rms, backend)
            return y, mean, rstd, None, None
        y, h, mean, rstd, amax = _library.row_norm_fused(x, len(shape), weight, bias, eps, rms, backend, activation,
                                                         residual, scale, opts)
        return y, mean, rstd, h, amax
    be = backends.resolve(backend, x, op)
    check_backend(be, opts, residual)
    y, h, mean, rstd, amax = row_norm_forward_fused(be, x, weight, bias, len(shape), eps, rms, activation,
                                                    residual=residual, scale=scale, opts=opts)
    return y, mean, rstd, h, amax


def layer_norm_fwd(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, activation=None, residual=None,
                   residual_dtype=None, weight_offset=0, out_dtype=None, out_scale=None, return_amax=False,
                   backend=None):
    """LayerNorm forward with its statistics: (y, mean, rstd), then h if residual is given (what was
    normalized: layer_norm_bwd takes it as x), then amax if return_amax. No autograd.

    mean and rstd are float32 (float64 for float64 input) with x's leading shape. The fused options
    are layer_norm's (h is always returned with a residual: the backward needs it).
    """
    y, mean, rstd, h, amax = _fwd_with_stats(x, normalized_shape, weight, bias, eps, False, activation, residual,
                                             residual_dtype, weight_offset, out_dtype, out_scale, return_amax,
                                             backend, "layer_norm_fwd")
    return (y, mean, rstd) + ((h,) if residual is not None else ()) + ((amax,) if return_amax else ())


def rms_norm_fwd(x, normalized_shape, weight=None, eps=None, *, activation=None, residual=None, residual_dtype=None,
                 weight_offset=0, out_dtype=None, out_scale=None, return_amax=False, backend=None):
    """RMSNorm forward with its statistic: (y, rstd), then h and amax as layer_norm_fwd. rstd is
    float32 with x's leading shape."""
    _check_tensor(x, "x")
    y, _, rstd, h, amax = _fwd_with_stats(x, normalized_shape, weight, None, default_rms_eps(x.dtype) if eps is None
                                          else eps, True, activation, residual, residual_dtype, weight_offset,
                                          out_dtype, out_scale, return_amax, backend, "rms_norm_fwd")
    return (y, rstd) + ((h,) if residual is not None else ()) + ((amax,) if return_amax else ())


def _check_bwd(dy, x, weight, stats: dict):
    _check_tensor(x, "x")
    _check_tensor(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"dy: expected x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    if dy.device != x.device:
        raise ValueError(f"dy: expected a tensor on x's device {x.device}, got one on {dy.device}")
    lead = None
    for arg, s in stats.items():
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{arg}: expected the tensor returned by the forward, got {type(s).__name__}")
        if s.device != x.device:
            raise ValueError(f"{arg}: expected a tensor on x's device {x.device}, got one on {s.device}")
        if s.dim() > x.dim() or tuple(x.shape[: s.dim()]) != tuple(s.shape):
            raise ValueError(f"{arg}: expected x's leading dims (the forward's statistics shape), got {tuple(s.shape)}")
        if lead is not None and s.shape != lead:
            raise ValueError(f"{arg}: expected the same shape as the other statistic {tuple(lead)}, got {tuple(s.shape)}")
        lead = s.shape
    shape = tuple(x.shape[len(lead):])
    if not shape:
        raise ValueError(f"{', '.join(stats)}: expected one value per row of x, got x's full shape {tuple(x.shape)}")
    _check_param(weight, "weight", shape, x, x.device, _heads(x, shape))
    return shape


def _heads(x, shape):
    """The per-head parameter shape (heads, *shape) x allows, or None."""
    return tuple(x.shape[x.dim() - len(shape) - 1:]) if x.dim() > len(shape) + 1 else None


def _stat_rows(s: torch.Tensor) -> torch.Tensor:
    return s.reshape(-1).to(torch.float64 if s.dtype == torch.float64 else torch.float32).contiguous()


def _bwd_from_stats(dy, x, weight, mean, rstd, rms, bias, activation, weight_offset, dh, dresidual_dtype, backend,
                    op):
    """The kernel-level backward: (dx, dweight or None, dbias or None (LayerNorm: always), dresidual or None)."""
    stats = {"rstd": rstd} if rms else {"mean": mean, "rstd": rstd}
    shape = _check_bwd(dy, x, weight, stats)
    _check_activation(activation)
    _check_param(bias, "bias", shape, x, x.device, _heads(x, shape))
    if dh is not None:
        _check_tensor(dh, "dh")
        if dh.shape != x.shape or dh.device != x.device:
            raise ValueError(f"dh: expected a tensor of x's shape {tuple(x.shape)} on {x.device}, got "
                             f"{tuple(dh.shape)} on {dh.device}")
    _check_dtype_arg(dresidual_dtype, "dresidual_dtype", _FLOAT_DTYPES)
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, numbers.Real):
        raise TypeError(f"weight_offset: expected a finite real number, got {weight_offset!r}")
    if weight_offset != 0 and weight is None:
        raise ValueError("weight_offset: scales by weight_offset + weight and needs a weight; got weight=None")
    dw_dtype = _param_grad_dtype(weight, True)
    db_dtype = None if rms else (weight.dtype if weight is not None else x.dtype)
    mean_rows = None if rms else _stat_rows(mean)
    pshape = tuple(weight.shape) if weight is not None else shape  # per-head weights: (heads, *shape)
    fused = activation is not None or weight_offset != 0 or dh is not None or dresidual_dtype is not None or \
        pshape != shape
    if _library.needed(dy, x, weight, mean, rstd, dh, bias):
        return _library.row_norm_grads(dy, x, len(shape), weight, mean_rows, _stat_rows(rstd), rms, dw_dtype, db_dtype,
                                       backend, bias=bias, activation=activation, weight_offset=float(weight_offset),
                                       dh=dh, dres_dtype=dresidual_dtype)
    be = backends.resolve(backend, x, op)
    rows = row_view(x, shape, getattr(be, "STRIDED_ROWS", False))
    like = lambda t: row_view(t, shape, getattr(be, "STRIDED_ROWS", False), rows.shape[:-1])  # noqa: E731
    if not fused:
        dx, dw, db = be.row_norm_bwd(like(dy), rows, _flat_param(weight), mean_rows, _stat_rows(rstd), rms, dw_dtype,
                                     db_dtype)
        dres = None
    else:
        if not hasattr(be, "row_norm_bwd_fused"):
            raise backends.BackendUnavailableError(f"activation=, weight_offset=, dh=, dresidual_dtype= are not "
                                                   f"supported by backend={be.NAME!r}; use backend='triton' or 'torch'")
        dres_dtype = None if dresidual_dtype in (None, x.dtype) else dresidual_dtype
        dx, dres, dw, db = be.row_norm_bwd_fused(
            like(dy), rows, param_rows(weight, shape), mean_rows, _stat_rows(rstd), rms, dw_dtype, db_dtype,
            bias=param_rows(bias, shape), activation=activation, weight_offset=float(weight_offset),
            dh=None if dh is None else like(dh), dres_dtype=dres_dtype)
        dres = None if dresidual_dtype is None else (dx if dres is None else dres).view(x.shape)
    return dx.view(x.shape), (dw.view(pshape) if dw is not None else None), \
        (db.view(pshape) if db is not None else None), dres


def layer_norm_bwd(dy, x, weight, mean, rstd, *, bias=None, activation=None, weight_offset=0, dh=None,
                   dresidual_dtype=None, backend=None):
    """LayerNorm backward from saved statistics: (dx, dweight, dbias), then dresidual if
    dresidual_dtype is given.

    x is what the forward normalized: h when it took a residual. dh, the gradient of h (prenorm's
    second output), is added to dx, which is then the gradient of both x and the residual; with
    dresidual_dtype it is also returned in that dtype. bias is needed only with an activation (to
    recompute its input). dweight is None when weight is None; dbias (the column sums of dy through
    the activation) is always returned, in weight's dtype (x's dtype without a weight). The
    dweight/dbias sums are deterministic.
    """
    dx, dw, db, dres = _bwd_from_stats(dy, x, weight, mean, rstd, False, bias, activation, weight_offset, dh,
                                       dresidual_dtype, backend, "layer_norm_bwd")
    return (dx, dw, db) + ((dres,) if dresidual_dtype is not None else ())


def rms_norm_bwd(dy, x, weight, rstd, *, activation=None, weight_offset=0, dh=None, dresidual_dtype=None,
                 backend=None):
    """RMSNorm backward from the saved statistic: (dx, dweight), then dresidual if dresidual_dtype
    is given; dweight is None without weight. x, dh, dresidual_dtype: as layer_norm_bwd."""
    dx, dw, _, dres = _bwd_from_stats(dy, x, weight, None, rstd, True, None, activation, weight_offset, dh,
                                      dresidual_dtype, backend, "rms_norm_bwd")
    return (dx, dw) + ((dres,) if dresidual_dtype is not None else ())
