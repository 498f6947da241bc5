"""The CPU fast path: plain LayerNorm / RMSNorm / GroupNorm calls on CPU tensors, in torch's own ops.

normkit's general path (argument checks, flattening to rows, backend dispatch, the autograd.Functions
of _autograd.py) costs tens of microseconds of Python per call, more than torch's CPU kernels take at
model sizes: patched models ran 1.5-10x slower on the CPU (issue #22). The public functions first
offer a call here; it is served when every argument is of the plain kinds checked below (cheap
checks: they are most of the call's Python), and goes on to the general path otherwise, which raises
the errors for bad arguments. Only the default backend (backend=None) is served: backend="torch"
names normkit's torch backend (normkit/backends/torch_backend.py), whose code its tests exercise. Served:
  RMSNorm    torch.rms_norm in fp32 (float64 for float64): x * rsqrt(mean(x^2) + eps) * w, as normkit
             computes (bitwise equal in fp32), differentiated by torch's autograd (composite ops: right
             at every order).
  LayerNorm, GroupNorm
             torch's kernels on data shifted by each row's (group's) first element, as normkit's
             kernels: alone, torch's CPU kernels lose 3e-4 on rows offset by 1e4 (they compute
             y = x * a + b, whose product rounds at x's magnitude). Gradients from torch's backward
             kernels on the shifted data; create_graph uses normkit's differentiable closed form
             (torch's LayerNorm is wrong at third order). Rows (groups) of one element are left to the
             general path: their dx is exactly 0, torch's backward leaves rounding error.
  with residual / prenorm / residual_dtype, weight_offset, activation, out_dtype (not float8) in torch
  ops around them. Not served: float8 out, return_amax, scale/shift, gate, per-head weights, empty
  tensors, channels_last GroupNorm (it keeps the memory format), a backend named, torch.compile,
  dispatch modes, tensor subclasses, torch.func transforms and forward AD, CPU autocast.
"""
from __future__ import annotations

import math

import torch

from . import _library
from ._autograd import _differentiable_backward_wanted, group_norm_vjp_differentiable, row_norm_vjp_differentiable, \
    transforms_active
from .backends.torch_backend import _ACTIVATION_GRADS, _ACTIVATIONS, _acc
from .reference import ACTIVATIONS, default_rms_eps

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PLAIN = _library._PLAIN
_needed = _library.needed
# torch's backward kernels have no torch.* binding; the overload's C++ callable skips its Python __call__
_ln_bwd = torch.ops.aten.native_layer_norm_backward.default._op
_gn_bwd = torch.ops.aten.native_group_norm_backward.default._op


def _to(t, dtype):
    """t in dtype; t itself when it has it (Tensor.to's call costs a microsecond even then)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _dense(t):
    """t contiguous, as normkit's outputs are (torch's elementwise ops keep a permuted input's layout)."""
    return t if t.is_contiguous() else t.contiguous()


def _param(p, shape) -> bool:
    return p is None or (type(p) in _PLAIN and p.is_cpu and p.dtype in _FLOAT and p.shape == shape)


def _eligible(x, backend, activation, eps, *tensors) -> bool:
    return backend is None and x.dtype in _FLOAT and type(eps) is float and \
        (activation is None or activation in ACTIVATIONS) and x.numel() > 0 and not _needed(x, *tensors) and \
        not transforms_active() and not torch.is_autocast_enabled("cpu")


def _grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------- the kernels' calls

def _ln(xf, shape, w, b, eps):
    """(shifted x, y, mean, rstd) of torch's LayerNorm on xf shifted by each row's first element."""
    xs = xf - xf[(Ellipsis,) + (slice(0, 1),) * len(shape)]
    y, mean, rstd = torch.native_layer_norm(xs, shape, w, b, eps)
    return xs, y, mean, rstd


def _gn(xf, groups, w, b, eps):
    """(shifted x, y, mean, rstd) of torch's GroupNorm on a contiguous xf shifted by each group's first element."""
    B, C = xf.shape[0], xf.shape[1]
    xg = xf.view(B, groups, -1)
    xs = (xg - xg[..., :1]).view_as(xf)
    y, mean, rstd = torch.native_group_norm(xs, w, b, B, C, xf.numel() // (B * C), groups, eps)
    return xs, y, mean, rstd


def _act(y, activation):
    return y if activation is None else _ACTIVATIONS[activation](y)


class _LayerNorm(torch.autograd.Function):
    """act(LayerNorm(xf)) on fp32/float64 tensors. Old-style forward(ctx, ...): apply binds no signature."""

    @staticmethod
    def forward(ctx, xf, w, b, shape, eps, activation):
        xs, z, mean, rstd = _ln(xf, shape, w, b, eps)
        ctx.save_for_backward(xf, w, b, xs, mean, rstd, None if activation is None else z)
        ctx.args = (shape, eps, activation)
        return _act(z, activation)

    @staticmethod
    def backward(ctx, dy):
        xf, w, b, xs, mean, rstd, z = ctx.saved_tensors
        shape, eps, activation = ctx.args
        needs = ctx.needs_input_grad[:3]
        if _differentiable_backward_wanted():
            dx, dw, db = row_norm_vjp_differentiable(dy, xf, w, b, len(shape), eps, False, activation, needs)
        else:
            if activation is not None:
                dy = _ACTIVATION_GRADS[activation](dy, z)
            dx, dw, db = _ln_bwd(dy, xs, shape, mean, rstd, w, b, list(needs))
        return dx, dw, db, None, None, None


class _GroupNorm(torch.autograd.Function):
    """act(GroupNorm(xf)) of a contiguous fp32/float64 tensor."""

    @staticmethod
    def forward(ctx, xf, w, b, groups, eps, activation):
        xs, z, mean, rstd = _gn(xf, groups, w, b, eps)
        ctx.save_for_backward(xf, w, b, xs, mean, rstd, None if activation is None else z)
        ctx.args = (groups, eps, activation)
        return _act(z, activation)

    @staticmethod
    def backward(ctx, dy):
        xf, w, b, xs, mean, rstd, z = ctx.saved_tensors
        groups, eps, activation = ctx.args
        needs = ctx.needs_input_grad[:3]
        if _differentiable_backward_wanted():
            dx, dw, db = group_norm_vjp_differentiable(dy, xf, w, b, groups, eps, activation, needs)
        else:
            if activation is not None:
                dy = _ACTIVATION_GRADS[activation](dy, z)
            B, C = xf.shape[0], xf.shape[1]
            dx, dw, db = _gn_bwd(dy.contiguous(), xs, mean, rstd, w, B, C, xf.numel() // (B * C), groups,
                                 list(needs))
        return dx, dw, db, None, None, None


# C++ apply: torch.autograd.Function.apply's Python (functorch checks) is for transforms, never served here
_ln_apply = super(torch.autograd.Function, _LayerNorm).apply
_gn_apply = super(torch.autograd.Function, _GroupNorm).apply


# ----------------------------------------------------------------------------- entry points

def row_norm(x, normalized_shape, weight, bias, eps, rms, activation, backend, residual, prenorm, residual_dtype,
             weight_offset, out_dtype):
    """y (or (y, h) with prenorm) of a CPU LayerNorm/RMSNorm call, or None: not served here."""
    if type(normalized_shape) is int:
        if x.dim() == 0 or not 0 < normalized_shape == x.shape[-1]:
            return None
        shape = (normalized_shape,)
    elif type(normalized_shape) in (tuple, torch.Size) and normalized_shape and \
            all(type(s) is int and s > 0 for s in normalized_shape) and x.dim() >= len(normalized_shape) and \
            x.shape[x.dim() - len(normalized_shape):] == normalized_shape:
        shape = tuple(normalized_shape)
    else:
        return None
    if rms and eps is None:
        eps = default_rms_eps(x.dtype)
    elif not rms and math.prod(shape) == 1:
        return None
    if not (_param(weight, shape) and _param(bias, shape) and _eligible(x, backend, activation, eps, weight, bias,
                                                                        residual)):
        return None
    if type(weight_offset) not in (int, float) or (weight_offset and (weight is None or
                                                                        not math.isfinite(weight_offset))):
        return None
    if out_dtype is not None and out_dtype not in _FLOAT:
        return None
    if residual is None:
        if prenorm is not False or residual_dtype is not None:
            return None
    elif not (_param(residual, x.shape) and type(prenorm) is bool and (residual_dtype is None or
                                                                        residual_dtype in _FLOAT)):
        return None
    acc = _acc(x)
    h = None
    if residual is not None:  # h = x + residual summed in fp32, rounded to h's dtype, then normalized
        h = _to(_to(x, acc) + _to(residual, acc), residual_dtype or residual.dtype)
        xf = _to(h, acc)
    else:
        xf = _to(x, acc)
    w, b = _to(weight, acc), _to(bias, acc)
    if weight_offset:
        w = w + weight_offset
    if rms:
        y = _act(torch.rms_norm(xf, shape, w, eps), activation)
    elif _grad(xf, w, b):
        y = _ln_apply(xf, w, b, shape, eps, activation)
    else:
        y = _act(_ln(xf, shape, w, b, eps)[1], activation)
    y = _dense(_to(y, out_dtype or x.dtype))
    return (y, _dense(h)) if prenorm else y


def group_norm(x, num_groups, weight, bias, eps, activation, backend):
    """act(GroupNorm(x)) of a CPU call, or None: not served here."""
    if x.dim() < 2 or type(num_groups) is not int or num_groups <= 0 or x.shape[1] % num_groups or \
            not (_param(weight, x.shape[1:2]) and _param(bias, x.shape[1:2]) and x.is_contiguous() and
                 _eligible(x, backend, activation, eps, weight, bias)) or x.numel() <= x.shape[0] * num_groups:
        return None
    acc = _acc(x)
    xf, w, b = _to(x, acc), _to(weight, acc), _to(bias, acc)
    if _grad(xf, w, b):
        y = _gn_apply(xf, w, b, num_groups, eps, activation)
    else:
        y = _act(_gn(xf, num_groups, w, b, eps)[1], activation)
    return _to(y, x.dtype)
