"""Autograd for normkit's ops, as torch's own norms have it: first and higher-order gradients,
torch.func transforms (vmap, grad, jacrev, jvp) and forward-mode AD.

RowNormFn (LayerNorm/RMSNorm) and GroupNormFn are autograd.Functions with setup_context, a vmap rule
and a jvp rule; their forward and first-order backward run the backend kernels. Three cases leave
the kernels for differentiable torch ops, where the kernels cannot give what autograd needs:
- a backward that is itself being recorded (create_graph=True: double backward, gradient penalties,
  Hessian-vector products) or that runs under a torch.func transform (vmap of a backward, jacrev):
  the vector-Jacobian product is the closed-form backward written in torch ops on upcast inputs,
  statistics recomputed from x (`*_vjp_differentiable`), which autograd differentiates to any order;
- forward-mode AD: the jvp rule is the closed-form tangent (`*_jvp`) computed from the saved
  statistics;
- a vmap over weights (model ensembles): the batched affine is applied with torch ops.
The differentiable backward serves the custom ops' autograd (_library.py) and the C++ host path too.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._layout import acc_dtype, as_rows, bcs, flat_param, fresh, from_bcs, is_channels_last

_interpreter_stack = torch._C._functorch.peek_interpreter_stack


def transforms_active() -> bool:
    """A torch.func transform (vmap, grad, jvp, ...) is running, or forward-mode AD is on: the
    call must go through the autograd.Functions below, whose rules these need."""
    return _interpreter_stack() is not None or torch.autograd.forward_ad._current_level >= 0


# ----------------------------------------------------------------------------- activations

_ACT = {
    None: lambda z: z,
    "relu": F.relu,
    "silu": F.silu,
    "mish": F.mish,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _act_derivative(name, z):
    """d act(z) / dz, in elementwise torch ops (differentiable, vmappable, forward-AD capable)."""
    if name == "relu":
        return (z > 0).to(z.dtype)
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if name == "mish":
        t = torch.tanh(F.softplus(z))
        return t + z * (1 - t * t) * torch.sigmoid(z)
    if name == "gelu":
        return 0.5 * (1 + torch.erf(z / math.sqrt(2.0))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    if name == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z ** 3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z)
    raise ValueError(f"activation: unknown name {name!r}")


def _no_autocast(x):
    return torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu") else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- differentiable backward

def _normalize(X, dims, eps: float, rms: bool):
    """(xhat, rstd) of X over `dims`, statistics recomputed from X so they carry its gradient."""
    if rms:
        rstd = torch.rsqrt(X.square().mean(dims, keepdim=True) + eps)
        return X * rstd, rstd
    xc = X - X.mean(dims, keepdim=True)
    rstd = torch.rsqrt(xc.square().mean(dims, keepdim=True) + eps)
    return xc * rstd, rstd


def _vjp_terms(X, G, w, b, dims, eps, rms, activation):
    """The backward of act(xhat * w + b) over `dims`, in torch ops on compute-dtype tensors:
    (dx, g * xhat, g) where g is dy through the activation; the weight/bias gradients are sums of
    the last two over the non-normalized dims."""
    xhat, rstd = _normalize(X, dims, eps, rms)
    if activation is not None:
        z = xhat * w if w is not None else xhat
        G = G * _act_derivative(activation, z + b if b is not None else z)
    wg = G * w if w is not None else G
    dx = wg - xhat * (wg * xhat).mean(dims, keepdim=True)
    if not rms:
        dx = dx - wg.mean(dims, keepdim=True)
    return dx * rstd, G * xhat, G


def row_norm_vjp_differentiable(dy, x, weight, bias, normalized_ndim: int, eps: float, rms: bool, activation,
                                needs):
    """(dx, dweight, dbias), each None where `needs` says so, as a composition of differentiable
    torch ops on the saved inputs (statistics recomputed from x): autograd differentiates it again
    (double backward), vmap batches it, forward-mode AD runs through it."""
    acc = acc_dtype(x)
    k = normalized_ndim
    lead = tuple(x.shape[: x.dim() - k])
    n = math.prod(x.shape[x.dim() - k:])
    flat = lambda p: None if p is None else p.to(acc).reshape(n)  # noqa: E731
    with _no_autocast(x):
        dx, gx, g = _vjp_terms(x.to(acc).reshape(lead + (n,)), dy.to(acc).reshape(lead + (n,)), flat(weight),
                               flat(bias), -1, eps, rms, activation)
        rows = tuple(range(len(lead)))
        return (dx.reshape(x.shape).to(x.dtype) if needs[0] else None,
                gx.sum(rows).reshape(weight.shape).to(weight.dtype) if needs[1] else None,
                g.sum(rows).reshape(bias.shape).to(bias.dtype) if needs[2] and bias is not None else None)


def group_norm_vjp_differentiable(dy, x, weight, bias, num_groups: int, eps: float, activation, needs):
    """GroupNorm's (dx, dweight, dbias) in differentiable torch ops, as row_norm_vjp_differentiable."""
    acc = acc_dtype(x)
    B, C = x.shape[0], x.shape[1]
    per_channel = (B, num_groups, C // num_groups, -1)
    chan = lambda p: None if p is None else p.to(acc).reshape(1, num_groups, C // num_groups, 1)  # noqa: E731
    with _no_autocast(x):
        dx, gx, g = _vjp_terms(x.to(acc).reshape(per_channel), dy.to(acc).reshape(per_channel), chan(weight),
                               chan(bias), (2, 3), eps, False, activation)
        return (dx.reshape(x.shape).to(x.dtype) if needs[0] else None,
                gx.sum((0, 3)).reshape(C).to(weight.dtype) if needs[1] else None,
                g.sum((0, 3)).reshape(C).to(bias.dtype) if needs[2] and bias is not None else None)


def _differentiable_backward_wanted() -> bool:
    return torch.is_grad_enabled() or _interpreter_stack() is not None


# ----------------------------------------------------------------------------- jvp formulas

def _normalized_tangent(xhat, rstd, tx, centered: bool):
    """Tangent of xhat = (x - mean) * rstd (or x * rstd) along the last dim, from tx:
    rstd * (t - xhat * mean(xhat * t)), t = tx minus its mean when centered."""
    if centered:
        tx = tx - tx.mean(-1, keepdim=True)
    return rstd * (tx - xhat * (xhat * tx).mean(-1, keepdim=True))


def _affine_tangent(xhat, t_xhat, w, b, tw, tb, activation):
    """Tangent of act(xhat * w + b) given the tangents of xhat, w and b (any may be None)."""
    t = t_xhat if t_xhat is not None else torch.zeros_like(xhat)
    if w is not None:
        t = t * w
    if tw is not None:
        t = t + xhat * tw
    if tb is not None:
        t = t + tb
    if activation is not None:
        z = xhat * w if w is not None else xhat
        if b is not None:
            z = z + b
        t = t * _act_derivative(activation, z)
    return t


def row_norm_jvp(x, weight, bias, mean, rstd, tx, tw, tb, normalized_ndim: int, rms: bool, activation):
    acc = acc_dtype(x)
    shape = tuple(x.shape[x.dim() - normalized_ndim:])
    n = math.prod(shape)
    lead = tuple(x.shape[: x.dim() - normalized_ndim])
    X = x.to(acc).reshape(lead + (n,))
    r = rstd.to(acc).reshape(lead + (1,))
    xhat = (X if rms else X - mean.to(acc).reshape(lead + (1,))) * r
    t_xhat = None if tx is None else _normalized_tangent(xhat, r, tx.to(acc).reshape(lead + (n,)), not rms)
    flat = lambda p: None if p is None else p.to(acc).reshape(n)  # noqa: E731
    t = _affine_tangent(xhat, t_xhat, flat(weight), flat(bias), flat(tw), flat(tb), activation)
    return t.reshape(x.shape).to(x.dtype)


def group_norm_jvp(x, weight, bias, mean, rstd, tx, tw, tb, num_groups: int, activation):
    acc = acc_dtype(x)
    B, C = x.shape[0], x.shape[1]
    G = num_groups
    per_channel = (B, G, C // G, -1)
    X = x.to(acc).reshape(per_channel)
    m = mean.to(acc).reshape(B, G, 1, 1)
    r = rstd.to(acc).reshape(B, G, 1, 1)
    xhat = ((X - m) * r).reshape(B, G, -1)
    t_xhat = None
    if tx is not None:
        t_xhat = _normalized_tangent(xhat, r.reshape(B, G, 1), tx.to(acc).reshape(B, G, -1), True)
    xhat, t_xhat = xhat.reshape(per_channel), None if t_xhat is None else t_xhat.reshape(per_channel)
    chan = lambda p: None if p is None else p.to(acc).reshape(1, G, C // G, 1)  # noqa: E731
    t = _affine_tangent(xhat, t_xhat, chan(weight), chan(bias), chan(tw), chan(tb), activation)
    return t.reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------- LayerNorm / RMSNorm

def row_norm_forward(backend, x, weight, bias, normalized_ndim: int, eps: float, rms: bool, activation):
    """The kernels' forward on user-shaped tensors: (y, mean or None, rstd), none of them a view."""
    shape = tuple(x.shape[x.dim() - normalized_ndim:])
    lead = tuple(x.shape[: x.dim() - normalized_ndim])
    extra = {} if activation is None else {"activation": activation}
    y, mean, rstd = backend.row_norm_fwd(as_rows(x, shape), flat_param(weight), flat_param(bias), eps, rms, **extra)
    return fresh(y.view(x.shape)), (None if mean is None else fresh(mean.view(lead))), fresh(rstd.view(lead))


def row_norm_backward(backend, dy, x, weight, bias, mean, rstd, normalized_ndim: int, rms: bool, activation, needs):
    """The kernels' first-order backward: (dx, dweight, dbias), each None where not needed."""
    shape = tuple(x.shape[x.dim() - normalized_ndim:])
    need_dx, need_dw, need_db = needs
    extra = {} if activation is None else {"bias": flat_param(bias), "activation": activation}
    dx, dw, db = backend.row_norm_bwd(
        as_rows(dy, shape), as_rows(x, shape), flat_param(weight), None if mean is None else mean.reshape(-1),
        rstd.reshape(-1), rms, weight.dtype if need_dw else None, bias.dtype if need_db else None, **extra)
    return (fresh(dx.view(x.shape)) if need_dx else None, None if dw is None else dw.view(shape),
            None if db is None else db.view(shape))


class RowNormFn(torch.autograd.Function):
    """LayerNorm (rms=False) / RMSNorm over the trailing normalized_ndim dims; outputs (y, mean, rstd)."""

    @staticmethod
    def forward(x, weight, bias, normalized_ndim, eps, rms, activation, backend):
        return row_norm_forward(backend, x, weight, bias, normalized_ndim, eps, rms, activation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, normalized_ndim, eps, rms, activation, backend = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.save_for_forward(x, weight, bias, mean, rstd)
        ctx.mark_non_differentiable(*(t for t in (mean, rstd) if t is not None))
        ctx.set_materialize_grads(False)
        ctx.args = (normalized_ndim, eps, rms, activation, backend)

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        normalized_ndim, eps, rms, activation, backend = ctx.args
        needs = ctx.needs_input_grad[:3]
        if dy is None:
            grads = (None, None, None)
        elif _differentiable_backward_wanted():
            grads = row_norm_vjp_differentiable(dy, x, weight, bias, normalized_ndim, eps, rms, activation, needs)
        else:
            grads = row_norm_backward(backend, dy, x, weight, bias, mean, rstd, normalized_ndim, rms, activation, needs)
        return grads + (None,) * 5

    @staticmethod
    def jvp(ctx, tx, tw, tb, *_):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        normalized_ndim, eps, rms, activation, backend = ctx.args
        if mean is None and not rms:
            raise RuntimeError("normkit: forward-mode AD needs the forward's statistics")
        ty = row_norm_jvp(x, weight, bias, mean, rstd, tx, tw, tb, normalized_ndim, rms, activation)
        return ty, None, None

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, normalized_ndim, eps, rms, activation, backend):
        xd, wd, bd = in_dims[:3]
        x = x.movedim(xd, 0) if xd is not None else x.expand((info.batch_size,) + tuple(x.shape))
        if wd is None and bd is None:  # the batch dim is one more leading dim: the kernels take it
            y, mean, rstd = RowNormFn.apply(x, weight, bias, normalized_ndim, eps, rms, activation, backend)
            return (y, mean, rstd), (0, None if mean is None else 0, 0)
        return _row_norm_batched_params(x, weight, wd, bias, bd, normalized_ndim, eps, rms, activation)


def _batched_param(p, bdim, like_ndim, inner_shape, batch):
    """A [V, *inner] parameter (batched or not) viewed to broadcast against [V, *lead, *inner]."""
    if p is None:
        return None
    p = p.movedim(bdim, 0) if bdim is not None else p.expand((batch,) + tuple(p.shape))
    return p.reshape((batch,) + (1,) * (like_ndim - 1 - len(inner_shape)) + tuple(inner_shape))


def _row_norm_batched_params(x, weight, wd, bias, bd, normalized_ndim, eps, rms, activation):
    """vmap over weight or bias: statistics and affine in torch ops, batch dim 0 everywhere."""
    acc = acc_dtype(x)
    V = x.shape[0]
    dims = tuple(range(x.dim() - normalized_ndim, x.dim()))
    shape = tuple(x.shape[d] for d in dims)
    xa = x.to(acc)
    z, rstd = _normalize(xa, dims, eps, rms)
    w = _batched_param(weight, wd, x.dim(), shape, V)
    b = _batched_param(bias, bd, x.dim(), shape, V)
    if w is not None:
        z = z * w.to(acc)
    if b is not None:
        z = z + b.to(acc)
    lead = tuple(x.shape[: x.dim() - normalized_ndim])
    y = _ACT[activation](z).to(x.dtype)
    mean = None if rms else xa.mean(dims).reshape(lead)
    return (y, mean, rstd.reshape(lead)), (0, None if rms else 0, 0)


# ----------------------------------------------------------------------------- GroupNorm

def group_norm_forward(backend, x, weight, bias, num_groups: int, eps: float, activation):
    """The kernels' forward on [B, C, *spatial]: (y in x's memory format, mean [B, G], rstd [B, G])."""
    y3, mean, rstd = backend.group_norm_fwd(bcs(x, is_channels_last(x)), num_groups, weight, bias, eps, activation)
    return fresh(from_bcs(y3, x.shape)), fresh(mean), fresh(rstd)


def group_norm_backward(backend, dy, x, weight, bias, mean, rstd, num_groups: int, activation, needs):
    need_dx, need_dw, need_db = needs
    channels_last = is_channels_last(x)
    dx3, dw, db = backend.group_norm_bwd(bcs(dy, channels_last), bcs(x, channels_last), num_groups, weight,
                                         bias, mean, rstd, activation, weight.dtype if need_dw else None,
                                         bias.dtype if need_db else None)
    return (fresh(from_bcs(dx3, x.shape)) if need_dx else None), dw, db


class GroupNormFn(torch.autograd.Function):
    """GroupNorm of [B, C, *spatial] then `activation`; outputs (y, mean, rstd)."""

    @staticmethod
    def forward(x, weight, bias, num_groups, eps, activation, backend):
        return group_norm_forward(backend, x, weight, bias, num_groups, eps, activation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, num_groups, eps, activation, backend = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.save_for_forward(x, weight, bias, mean, rstd)
        ctx.mark_non_differentiable(mean, rstd)
        ctx.set_materialize_grads(False)
        ctx.args = (num_groups, eps, activation, backend)

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        num_groups, eps, activation, backend = ctx.args
        needs = ctx.needs_input_grad[:3]
        if dy is None:
            grads = (None, None, None)
        elif _differentiable_backward_wanted():
            grads = group_norm_vjp_differentiable(dy, x, weight, bias, num_groups, eps, activation, needs)
        else:
            grads = group_norm_backward(backend, dy, x, weight, bias, mean, rstd, num_groups, activation, needs)
        return grads + (None,) * 4

    @staticmethod
    def jvp(ctx, tx, tw, tb, *_):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        num_groups, eps, activation, backend = ctx.args
        return group_norm_jvp(x, weight, bias, mean, rstd, tx, tw, tb, num_groups, activation), None, None

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, num_groups, eps, activation, backend):
        xd, wd, bd = in_dims[:3]
        V = info.batch_size
        x = x.movedim(xd, 0) if xd is not None else x.expand((V,) + tuple(x.shape))
        flat = x.reshape((V * x.shape[1],) + tuple(x.shape[2:]))  # the batch dim merges with B
        if wd is None and bd is None:
            y, mean, rstd = GroupNormFn.apply(flat, weight, bias, num_groups, eps, activation, backend)
            stats = (V, x.shape[1], num_groups)
            return (y.reshape(x.shape), mean.reshape(stats), rstd.reshape(stats)), (0, 0, 0)
        acc = acc_dtype(x)
        z = F.group_norm(flat.to(acc), num_groups, None, None, eps).reshape(x.shape)
        C = x.shape[2]
        w = _batched_param(weight, wd, x.dim(), (C,) + (1,) * (x.dim() - 3), V)
        b = _batched_param(bias, bd, x.dim(), (C,) + (1,) * (x.dim() - 3), V)
        if w is not None:
            z = z * w.to(acc)
        if b is not None:
            z = z + b.to(acc)
        g = flat.to(acc).reshape(V, x.shape[1], num_groups, -1)
        mean = g.mean(-1)
        rstd = torch.rsqrt((g - mean[..., None]).square().mean(-1) + eps)
        return (_ACT[activation](z).to(x.dtype), mean, rstd), (0, 0, 0)
