"""The CPU fast path: plain LayerNorm / RMSNorm / GroupNorm calls on CPU tensors, straight to the
torch backend's functions.

normkit's general path (argument checks, flattening to rows, backend dispatch, the autograd.Functions
of _autograd.py with their statistics outputs) costs tens of microseconds of Python per call, more
than torch's CPU kernels take at model sizes: patched models ran 1.5-10x slower on the CPU (issue
#22). The public functions first offer a call here; it is served when every argument is of the
plain kinds checked below (cheap checks: they are most of the call's Python), and goes on to the
general path otherwise, which raises the errors for bad arguments. A served call runs the torch
backend's own entry points (backends/torch_backend.py: torch's CPU kernels, on shifted data where a
row's mean is far from zero; see there), the same ones the general path and the custom op run, so eager and compiled calls give the
same bits; with autograd, through slim autograd.Functions whose backward is RowNormFn's and
GroupNormFn's own (torch's backward kernels; the differentiable closed form for create_graph), except
GroupNorm on centred groups (with or without an activation other than relu), which records torch's
own autograd nodes: their backward is the one those Functions and the custom op run (see group_norm
below), without a Python backward.
Only the default backend (backend=None) is served: backend="torch" names the general path to the
same functions, which its tests exercise. Served: LayerNorm, RMSNorm with residual / prenorm /
residual_dtype, weight_offset, activation, out_dtype (not float8), and the adaLN modulation
(scale / shift of one row per sample, over one normalized dim: torch's kernel for the norm, the
modulation applied to its fp32 output; its backward RowNormFn's); GroupNorm of contiguous or
channels_last x with activation. Not served: float8 out, return_amax, gate, per-head
weights, empty tensors, one-element rows (LayerNorm) and groups, a backend named, torch.compile,
dispatch modes, tensor subclasses, torch.func transforms and forward AD, CPU autocast.
"""
from __future__ import annotations

import math

import torch

from . import _library
from ._autograd import PLAIN, GroupNormFn, RowNormFn, RowOptions, _differentiable_backward_wanted, needs_autograd, \
    transforms_active
from ._layout import mod_table, sample_rows
from .backends import torch_backend as _tb
from .reference import ACTIVATIONS, default_rms_eps

_FLOAT = _tb.DTYPES
# default_rms_eps calls torch.finfo (~0.5 us a call). Cached here, not there: that one is traced under torch.compile,
# where a float read from a module global becomes a symbolic input that dynamic=True specializes by restarting
_RMS_EPS = {t: default_rms_eps(t) for t in _FLOAT}
_PLAIN = _library._PLAIN
_is_compiling, _dispatch_modes = _library._is_compiling, _library._dispatch_modes


def _param(p, shape) -> bool:
    """None, or a plain CPU float tensor of that shape (a subclass, such as DTensor, takes the custom op)."""
    return p is None or (type(p) in _PLAIN and p.is_cpu and p.dtype in _FLOAT and p.shape == shape)


def offered(x, backend) -> bool:
    """Whether a call may try this fast path at all: the default backend and a plain CPU tensor, eagerly (the
    served functions check the rest). Callers ask it before gathering their arguments; on the GPU it is all they pay."""
    return backend is None and type(x) is torch.Tensor and x.is_cpu and not _is_compiling()


def _eligible(x, backend, activation, eps) -> bool:
    """An eager call of the default backend on a float x with elements, outside torch.compile, dispatch
    modes, torch.func transforms, forward AD and CPU autocast (x is a plain tensor, the parameters
    passed _param). One expression: at model sizes these checks are a good part of the call."""
    return backend is None and type(eps) is float and x.dtype in _FLOAT and \
        (activation is None or activation in ACTIVATIONS) and x.numel() > 0 and not _is_compiling() and \
        not _dispatch_modes() and not transforms_active() and not torch.is_autocast_enabled("cpu")


class CpuRowNorm(torch.autograd.Function):
    """RowNormFn without its statistics outputs and argument plumbing, for rows [..., N] (x, residual)
    and [N] parameters: the torch backend's forward, and RowNormFn's backward on the same saved
    tensors and arguments. Old-style forward(ctx, ...): apply binds no signature. The adaLN modulation
    tensors (one row per sample of x) come as inputs 11 and 12, where RowNormFn has them, so that its
    backward's gradients land in their places (8-10: unused)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, rms, activation, opts, _8=None, _9=None, _10=None,
                mod_scale=None, mod_shift=None):
        n = x.shape[-1]
        y, mean, rstd, h, _, ctx.centred = _tb._row_norm_fwd(
            x, weight, bias, eps, rms, activation=activation, residual=residual, h_dtype=opts.residual_dtype,
            store_h=residual is not None, weight_offset=opts.weight_offset, out_dtype=opts.out_dtype,
            mod_scale=mod_table(mod_scale, n), mod_shift=mod_table(mod_shift, n), with_centred=True)
        ctx.save_for_backward(x if h is None else h, weight, bias, mean, rstd, mod_scale, mod_shift, None)
        ctx.args = (1, eps, rms, activation, opts, _tb, x.dtype, None if residual is None else residual.dtype)
        ctx.set_materialize_grads(False)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        nx, nw, nb, nr = ctx.needs_input_grad[:4]
        if dy is None or dh is not None or nr or ctx.args[4].modulated or _differentiable_backward_wanted():
            return RowNormFn.backward(ctx, dy, dh, None, None, None)
        # no residual: the torch backend's backward with the arguments RowNormFn's would pass it, minus its plumbing
        z, weight, bias, mean, rstd = ctx.saved_tensors[:5]
        _, _, rms, activation, opts = ctx.args[:5]
        dx, _, dw, db = _tb._row_norm_bwd(dy, z, weight, mean, rstd, rms, weight.dtype if nw else None,
                                          bias.dtype if nb else None, bias=bias, activation=activation,
                                          weight_offset=opts.weight_offset, centred=ctx.centred)
        return dx if nx else None, dw, db, None, None, None, None, None


class CpuGroupNorm(torch.autograd.Function):
    """GroupNormFn without its statistics outputs, for x [B, C, S] (contiguous, or a channels_last x's view)."""

    @staticmethod
    def forward(ctx, x, weight, bias, num_groups, eps, activation, backend):
        y, mean, rstd, ctx.centred = _tb._group_norm_fwd(x, num_groups, weight, bias, eps, activation)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.args = (num_groups, eps, activation, backend)
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    def backward(ctx, dy):
        if dy is None or _differentiable_backward_wanted():
            return GroupNormFn.backward(ctx, dy, None, None)
        x, weight, bias, mean, rstd = ctx.saved_tensors  # as GroupNormFn's, minus its layout plumbing
        num_groups, eps, activation, _ = ctx.args
        nx, nw, nb = ctx.needs_input_grad[:3]
        dx, dw, db = _tb._group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation,
                                         weight.dtype if nw else None, bias.dtype if nb else None, ctx.centred, eps)
        return dx if nx else None, dw, db, None, None, None, None


# C++ apply: torch.autograd.Function.apply's Python (functorch checks) is for transforms, never served here
_row_apply = super(torch.autograd.Function, CpuRowNorm).apply
_group_apply = super(torch.autograd.Function, CpuGroupNorm).apply


# ----------------------------------------------------------------------------- entry points

_OPTIONS: dict = {}  # RowOptions by its fields: building the frozen dataclass costs ~1 us a call, a lookup ~0.1


def _options(h_dtype, weight_offset: float, out_dtype, mod_scale: bool, mod_shift: bool) -> RowOptions:
    key = (h_dtype, weight_offset, out_dtype, mod_scale, mod_shift)  # weight_offset: a finite float (-0.0 acts as 0.0)
    opts = _OPTIONS.get(key)
    if opts is None:
        opts = RowOptions(h_dtype, weight_offset, out_dtype, mod_scale=mod_scale, mod_shift=mod_shift)
        if len(_OPTIONS) < 256:  # a few combinations per model; bounded for callers that vary weight_offset
            _OPTIONS[key] = opts
    return opts

def _modulation_served(x, scale, shift, n: int) -> bool:
    """Whether the adaLN modulation tensors are served here: each None or a plain CPU float tensor of one row per
    sample of x (sample_rows), both of the same samples."""
    samples = shape = None
    for t in (scale, shift):
        if t is None:
            continue
        if not (type(t) in _PLAIN and t.is_cpu and t.dtype in _FLOAT and t.dim() >= 1 and t.shape[-1] == n):
            return False
        if t.shape == shape:  # shift of scale's shape (the common call): the same samples
            continue
        rows = sample_rows(t.shape, x.shape, 1)
        if rows is None or (samples is not None and rows != samples):
            return False
        samples, shape = rows, t.shape
    return True


def row_norm(x, normalized_shape, weight, bias, eps, rms, activation, backend, residual, prenorm, residual_dtype,
             weight_offset, out_dtype, scale=None, shift=None):
    """y (or (y, h) with prenorm) of a CPU LayerNorm/RMSNorm call, or None: not served here. scale / shift (the
    adaLN modulation) are served over one normalized dim."""
    # the checks as loops and single-dim special cases, not generators and slices: at model sizes they are a good
    # part of the call
    kind = type(normalized_shape)
    if kind is int:
        shape = (normalized_shape,)
    elif kind is tuple or kind is torch.Size:
        for s in normalized_shape:
            if type(s) is not int:
                return None
        shape = tuple(normalized_shape)
    else:
        return None
    k = len(shape)
    # x's trailing sizes (positive: _eligible asks for elements)
    if k == 1:
        if x.dim() < 1 or x.shape[-1] != shape[0]:
            return None
    elif not k or x.dim() < k or x.shape[x.dim() - k:] != shape:
        return None
    if rms:
        if eps is None:  # (None for a dtype not served: _eligible then declines)
            eps = _RMS_EPS.get(x.dtype)
    elif math.prod(shape) == 1:
        return None
    if not (_param(weight, shape) and _param(bias, shape) and _eligible(x, backend, activation, eps)):
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
    modulated = scale is not None or shift is not None
    if modulated and not (k == 1 and _modulation_served(x, scale, shift, shape[0])):
        return None
    if k > 1:  # rows of the flattened normalized dims, parameters flat, as the general path passes them
        x, residual = x.flatten(-k), None if residual is None else residual.flatten(-k)
        weight, bias = None if weight is None else weight.reshape(-1), None if bias is None else bias.reshape(-1)
    h_dtype = None if residual is None else (residual_dtype or residual.dtype)
    weight_offset, out_dtype = float(weight_offset), None if out_dtype == x.dtype else out_dtype
    if modulated and needs_autograd(x, weight, bias, residual, scale, shift):  # the modulation's gradients too
        opts = _options(h_dtype, weight_offset, out_dtype, scale is not None, shift is not None)
        y, h = _row_apply(x, weight, bias, residual, eps, rms, activation, opts, None, None, None, scale, shift)
    elif not modulated and needs_autograd(x, weight, bias, residual):  # RowOptions only here
        opts = PLAIN if h_dtype is None and not weight_offset and out_dtype is None else \
            _options(h_dtype, weight_offset, out_dtype, False, False)
        y, h = _row_apply(x, weight, bias, residual, eps, rms, activation, opts)
    else:  # no autograd: the general path's call to the same function (the modulation as [S, N] tables)
        y, _, _, h, _ = _tb._row_norm_fwd(x, weight, bias, eps, rms, activation=activation, store_stats=False,
                                          residual=residual, h_dtype=h_dtype, store_h=prenorm,
                                          weight_offset=weight_offset, out_dtype=out_dtype,
                                          mod_scale=mod_table(scale, shape[0]) if modulated else None,
                                          mod_shift=mod_table(shift, shape[0]) if modulated else None)
    if k > 1:
        y, h = y.unflatten(-1, shape), None if h is None else h.unflatten(-1, shape)
    return (y, h) if prenorm else y


def group_norm(x, num_groups, weight, bias, eps, activation, backend):
    """act(GroupNorm(x)) of a CPU call, or None: not served here."""
    if x.dim() < 2 or type(num_groups) is not int or num_groups <= 0 or x.shape[1] % num_groups:
        return None
    c = x.shape[1:2]
    # contiguous, or channels_last (its [B, C, H*W] view: channels innermost; the output keeps the format);
    # after _eligible: under vmap, is_contiguous(memory_format=) raises
    if not (_param(weight, c) and _param(bias, c) and _eligible(x, backend, activation, eps) and (
            x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)))) or \
            x.numel() <= x.shape[0] * num_groups:
        return None
    x3 = x if x.dim() == 3 else x.view(x.shape[0], x.shape[1], -1)
    if needs_autograd(x, weight, bias):
        # on centred groups, torch's own autograd nodes (native_group_norm, then the activation's), with
        # no Python backward: their backward is the calls group_norm_bwd makes on the same saved tensors
        # (native_group_norm_backward; the activation's backward op at its input, the kernel's output,
        # which group_norm_bwd recomputes by running the kernel again: given eps), so the same bits as
        # CpuGroupNorm and the custom op. Not relu (torch's saves its output: in-place ops on y would
        # break its backward), not off-centre groups (the shifted kernel: CpuGroupNorm), not a bias without
        # a weight (torch's backward kernel fails on it), and not for LayerNorm (torch's native_layer_norm
        # double backward is wrong at third order)
        out = None if activation == "relu" or (weight is None and bias is not None) else \
            _tb._group_norm_fwd(x3, num_groups, weight, bias, eps, activation, shift=False)
        y = _group_apply(x3, weight, bias, num_groups, eps, activation, _tb) if out is None else out[0]
    else:
        y = _tb._group_norm_fwd(x3, num_groups, weight, bias, eps, activation)[0]  # (group_norm_fwd wraps it)
    return y if x.dim() == 3 else y.view_as(x)
