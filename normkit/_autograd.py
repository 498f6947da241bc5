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

Each op's first-order backward is one formula, `row_norm_grads` / `group_norm_grads` (torch ops or kernels,
the gradients' dtypes, which gradients are wanted), for RowNormFn / GroupNormFn (and normkit._cpu's
Functions, which fall back to them) and the custom ops' registered autograd. What differs is how the
kernels run, passed in: `row_norm_backward_fused` / `group_norm_backward`, whose arguments are the backward
ops' by name (so the ops' implementations pass their calls straight on), or the backward ops themselves
(_library.py), so that a compiled graph holds ops. host.cpp's native autograd node makes the same
decisions in C++.

LayerNorm/RMSNorm carry the fused options (RowOptions): a residual add whose sum h is normalized and
returned (the autograd output h, whose gradient joins dx and dresidual), a weight offset, the
output dtype (float8 with a scale; the backward treats the cast as the identity, as
TransformerEngine's fused norms do), the output's amax (not differentiable), and adaLN modulation:
y = act((xhat * w + b) * (1 + scale) + shift) with scale/shift tensors per sample (mod_scale /
mod_shift here; `scale` alone is the float8 output's scale tensor), whose gradients are the
per-sample sums of dy * (xhat * w + b) and dy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch._functorch.utils import unwrap_dead_wrappers

from .backends import torch_backend
from ._layout import acc_dtype, bcs, flat_param, fresh, from_bcs, is_channels_last, mod_table, row_view

_interpreter_stack = torch._C._functorch.peek_interpreter_stack


def transforms_active() -> bool:
    """A torch.func transform (vmap, grad, jvp, ...) is running, or forward-mode AD is on: the
    call must go through the autograd.Functions below, whose rules these need."""
    return _interpreter_stack() is not None or torch.autograd.forward_ad._current_level >= 0


def needs_autograd(*tensors) -> bool:
    """Grad mode is on and one of `tensors` (None allowed) requires a gradient."""
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(generator): asked at every eager call
            if t is not None and t.requires_grad:
                return True
    return False


@dataclass(frozen=True)
class RowOptions:
    """The fused options of a LayerNorm/RMSNorm call that are not tensors (hashable). The residual
    and a tensor out_scale travel as tensor inputs; residual_dtype is set exactly when there is a
    residual. out_dtype None means x's dtype."""
    residual_dtype: Optional[torch.dtype] = None
    weight_offset: float = 0.0
    out_dtype: Optional[torch.dtype] = None
    out_scale: Optional[float] = None  # a float scale for float8 outputs
    return_amax: bool = False
    mod_scale: bool = False  # adaLN modulation: set exactly when a scale= / shift= tensor travels with the call
    mod_shift: bool = False
    gate: bool = False  # a gated norm: set exactly when a gate= tensor travels with the call

    @property
    def modulated(self) -> bool:
        return self.mod_scale or self.mod_shift

    def named(self, residual) -> str:
        """The options that are set, by their argument names (for errors)."""
        names = [n for n, on in (("residual", residual is not None), ("weight_offset", self.weight_offset != 0.0),
                                 ("out_dtype", self.out_dtype is not None), ("return_amax", self.return_amax),
                                 ("scale", self.mod_scale), ("shift", self.mod_shift), ("gate", self.gate)) if on]
        return ", ".join(f"{n}=" for n in names)


PLAIN = RowOptions()
FP8_MAX = torch_backend.FP8_MAX


# ----------------------------------------------------------------------------- activations

_ACT = torch_backend._ACTIVATIONS  # torch's own activations, differentiable
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
                                needs, *, weight_offset: float = 0.0):
    """(dx, dweight, dbias), each None where `needs` says so, as a composition of differentiable
    torch ops on the saved inputs (statistics recomputed from x): autograd differentiates it again
    (double backward), vmap batches it, forward-mode AD runs through it. x is what was normalized
    (h when the forward added a residual); the weight acts as weight_offset + weight."""
    acc = acc_dtype(x)
    k = normalized_ndim
    lead = tuple(x.shape[: x.dim() - k])
    n = math.prod(x.shape[x.dim() - k:])
    flat = lambda p: None if p is None else p.to(acc).reshape(p.shape[: p.dim() - k] + (n,))  # noqa: E731
    w = flat(weight)
    with _no_autocast(x):
        dx, gx, g = _vjp_terms(x.to(acc).reshape(lead + (n,)), dy.to(acc).reshape(lead + (n,)),
                               w + weight_offset if weight_offset and w is not None else w,
                               flat(bias), -1, eps, rms, activation)

        def rows(t, p):
            """t summed over the rows; per-head parameters ([heads, *shape]) keep the heads dim."""
            dims = tuple(range(len(lead) - (p.dim() - k)))
            return t.sum(dims) if dims else t  # x of one row: nothing to sum (sum(()) would sum every dim)
        return (dx.reshape(x.shape).to(x.dtype) if needs[0] else None,
                rows(gx, weight).reshape(weight.shape).to(weight.dtype) if needs[1] else None,
                rows(g, bias).reshape(bias.shape).to(bias.dtype) if needs[2] and bias is not None else None)


def per_sample(t, ndim: int, normalized_ndim: int, n=None):
    """A modulation tensor (lead + normalized dims) viewed to broadcast per sample against a tensor of
    `ndim` dims: its lead aligned with the leading dims from the left (ones appended); with n, the
    normalized dims flattened to one of n."""
    k = normalized_ndim
    lead = tuple(t.shape[: t.dim() - k])
    tail = (n,) if n is not None else tuple(t.shape[t.dim() - k:])
    return t.reshape(lead + (1,) * (ndim - len(tail) - len(lead)) + tail)


def _sum_per_sample(t, like, k: int):
    """t (x-shaped, normalized dims flattened) summed over each sample's rows: like's shape."""
    target = per_sample(like, t.dim(), k, t.shape[-1])
    dims = [i for i in range(t.dim() - 1) if target.shape[i] == 1 and t.shape[i] != 1]
    return (t.sum(dims, keepdim=True) if dims else t).reshape(like.shape).to(like.dtype)


def modulation_vjp(dy, x, weight, bias, normalized_ndim: int, eps: float, rms: bool, activation, mod_scale, mod_shift,
                   needs, *, weight_offset: float = 0.0):
    """The backward of the modulation in differentiable torch ops: (g, dscale, dshift) where g is
    the gradient of the affine output xhat * w + b (to go through row_norm_vjp_differentiable with
    no activation), dscale/dshift None unless `needs` (scale, shift) asks."""
    acc = acc_dtype(x)
    k = normalized_ndim
    lead = tuple(x.shape[: x.dim() - k])
    n = math.prod(x.shape[x.dim() - k:])
    flat = lambda p: None if p is None else p.to(acc).reshape(p.shape[: p.dim() - k] + (n,))  # noqa: E731
    with _no_autocast(x):
        xhat, _ = _normalize(x.to(acc).reshape(lead + (n,)), -1, eps, rms)
        w = flat(weight)
        w = w + weight_offset if weight_offset and w is not None else w
        yaff = xhat * w if w is not None else xhat
        yaff = yaff + flat(bias) if bias is not None else yaff
        s1 = None if mod_scale is None else 1 + per_sample(mod_scale, len(lead) + 1, k, n).to(acc)
        g = dy.to(acc).reshape(lead + (n,))
        if activation is not None:
            z = yaff * s1 if s1 is not None else yaff
            z = z + per_sample(mod_shift, len(lead) + 1, k, n).to(acc) if mod_shift is not None else z
            g = g * _act_derivative(activation, z)
        dscale = _sum_per_sample(g * yaff, mod_scale, k) if needs[0] and mod_scale is not None else None
        dshift = _sum_per_sample(g, mod_shift, k) if needs[1] and mod_shift is not None else None
        g = g * s1 if s1 is not None else g
    return g.reshape(x.shape), dscale, dshift


def group_norm_vjp_differentiable(dy, x, weight, bias, num_groups: int, eps: float, activation, needs):
    """GroupNorm's (dx, dweight, dbias) in differentiable torch ops, as row_norm_vjp_differentiable."""
    acc = acc_dtype(x)
    B, C = x.shape[0], x.shape[1]
    per_channel = (B, num_groups, C // num_groups, math.prod(x.shape[2:]))  # not -1: ambiguous for empty x
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


def row_norm_jvp(x, weight, bias, mean, rstd, tx, tw, tb, normalized_ndim: int, rms: bool, activation, *,
                 weight_offset: float = 0.0, out_dtype=None, mod_scale=None, mod_shift=None, ts=None, tt=None):
    """Tangent of y from the tangents of x (what was normalized), weight, bias and the modulation's
    scale/shift (ts, tt); in out_dtype (default x's): a float8 output's tangent is the tangent of y
    itself (the cast is the identity)."""
    acc = acc_dtype(x)
    shape = tuple(x.shape[x.dim() - normalized_ndim:])
    n = math.prod(shape)
    lead = tuple(x.shape[: x.dim() - normalized_ndim])
    X = x.to(acc).reshape(lead + (n,))
    r = rstd.to(acc).reshape(lead + (1,))
    xhat = (X if rms else X - mean.to(acc).reshape(lead + (1,))) * r
    t_xhat = None if tx is None else _normalized_tangent(xhat, r, tx.to(acc).reshape(lead + (n,)), not rms)
    k = normalized_ndim
    flat = lambda p: None if p is None else p.to(acc).reshape(p.shape[: p.dim() - k] + (n,))  # noqa: E731
    w = flat(weight)
    w = w + weight_offset if weight_offset and w is not None else w
    if mod_scale is None and mod_shift is None:
        t = _affine_tangent(xhat, t_xhat, w, flat(bias), flat(tw), flat(tb), activation)
        return t.reshape(x.shape).to(out_dtype or x.dtype)
    t = _affine_tangent(xhat, t_xhat, w, flat(bias), flat(tw), flat(tb), None)  # of yaff = xhat * w + b
    yaff = xhat * w if w is not None else xhat
    yaff = yaff + flat(bias) if bias is not None else yaff
    mod = lambda m: None if m is None else per_sample(m, len(lead) + 1, normalized_ndim, n).to(acc)  # noqa: E731
    s1 = None if mod_scale is None else 1 + mod(mod_scale)
    z = yaff * s1 if s1 is not None else yaff
    if s1 is not None:
        t = t * s1
    if ts is not None:
        t = t + yaff * mod(ts)
    if tt is not None:
        t = t + mod(tt)
    if activation is not None:
        t = t * _act_derivative(activation, z + mod(mod_shift) if mod_shift is not None else z)
    return t.reshape(x.shape).to(out_dtype or x.dtype)


def group_norm_jvp(x, weight, bias, mean, rstd, tx, tw, tb, num_groups: int, activation):
    acc = acc_dtype(x)
    B, C = x.shape[0], x.shape[1]
    G = num_groups
    per_channel = (B, G, C // G, math.prod(x.shape[2:]))  # not -1: ambiguous for empty x
    per_group = (B, G, math.prod(per_channel[2:]))
    X = x.to(acc).reshape(per_channel)
    m = mean.to(acc).reshape(B, G, 1, 1)
    r = rstd.to(acc).reshape(B, G, 1, 1)
    xhat = ((X - m) * r).reshape(per_group)
    t_xhat = None
    if tx is not None:
        t_xhat = _normalized_tangent(xhat, r.reshape(B, G, 1), tx.to(acc).reshape(per_group), True)
    xhat, t_xhat = xhat.reshape(per_channel), None if t_xhat is None else t_xhat.reshape(per_channel)
    chan = lambda p: None if p is None else p.to(acc).reshape(1, G, C // G, 1)  # noqa: E731
    t = _affine_tangent(xhat, t_xhat, chan(weight), chan(bias), chan(tw), chan(tb), activation)
    return t.reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------- LayerNorm / RMSNorm

def _fused_entry(backend, name: str, opts: RowOptions, residual):
    fn = getattr(backend, name, None)
    if fn is None:
        from .backends import BackendUnavailableError
        raise BackendUnavailableError(f"{opts.named(residual)} not supported by backend={backend.NAME!r} (it has no "
                                      "fused epilogues); use backend='triton' or 'torch'")
    return fn


def check_backend(backend, opts: RowOptions, residual) -> None:
    """Raise now, naming the option, if `backend` cannot run these fused options."""
    if residual is not None or opts != PLAIN:
        _fused_entry(backend, "row_norm_fwd_fused", opts, residual)
        if opts.modulated and not getattr(backend, "MODULATION", False):
            from .backends import BackendUnavailableError
            names = ", ".join(n for n, on in (("scale=", opts.mod_scale), ("shift=", opts.mod_shift)) if on)
            raise BackendUnavailableError(f"{names} (adaLN modulation) not supported by backend={backend.NAME!r}; "
                                          "use backend='triton' or 'torch'")
        if opts.gate and not getattr(backend, "GATE", False):
            from .backends import BackendUnavailableError
            raise BackendUnavailableError(f"gate= (the gated norm of x * silu(gate)) not supported by "
                                          f"backend={backend.NAME!r}; use backend='triton' or 'torch'")


def param_rows(p, shape):
    """A weight/bias as the kernels take it: contiguous [N], or [heads, N] for per-head parameters
    of shape (heads, *shape)."""
    if p is None or p.dim() == len(shape):
        return flat_param(p)
    return p.reshape(p.shape[0], -1).contiguous()


def _per_head(weight, bias, shape) -> bool:
    return any(p is not None and p.dim() > len(shape) for p in (weight, bias))


def _rows(backend, t, shape, like=None):
    """t's rows as `backend` takes them (two-stride and column-strided views where it can)."""
    return row_view(t, shape, getattr(backend, "STRIDED_ROWS", False), None if like is None else like.shape[:-1])


def _mod_kwargs(mod_scale, mod_shift, n: int) -> dict:
    """The backends' modulation arguments: [S, N] tables, passed only when there is modulation."""
    if mod_scale is None and mod_shift is None:
        return {}
    return {"mod_scale": mod_table(mod_scale, n), "mod_shift": mod_table(mod_shift, n)}


def row_norm_forward_fused(backend, x, weight, bias, normalized_ndim: int, eps: float, rms: bool, activation, *,
                           residual=None, scale=None, opts: RowOptions = PLAIN, store_stats: bool = True,
                           store_h: bool = True, mod_scale=None, mod_shift=None, gate=None):
    """The kernels' forward on user-shaped tensors: (y, h, mean, rstd, amax), None where absent
    (h without a residual or store_h, mean for RMSNorm, amax unless asked), none of them a view.
    scale: the float8 output's scale tensor; mod_scale / mod_shift: the adaLN modulation tensors
    (lead + normalized dims, per sample of x); gate: x's shape, normalizes x * silu(gate)."""
    shape = tuple(x.shape[x.dim() - normalized_ndim:])
    lead = tuple(x.shape[: x.dim() - normalized_ndim])
    rows = _rows(backend, x, shape)
    if residual is None and scale is None and opts == PLAIN and not _per_head(weight, bias, shape):
        extra = {} if activation is None else {"activation": activation}
        y, mean, rstd = backend.row_norm_fwd(rows, flat_param(weight), flat_param(bias), eps, rms,
                                             store_stats=store_stats, **extra)
        h = amax = None
    else:
        y, mean, rstd, h, amax = _fused_entry(backend, "row_norm_fwd_fused", opts, residual)(
            rows, param_rows(weight, shape), param_rows(bias, shape), eps, rms, activation=activation,
            store_stats=store_stats,
            residual=None if residual is None else _rows(backend, residual, shape, rows),
            h_dtype=opts.residual_dtype, store_h=store_h, weight_offset=opts.weight_offset, out_dtype=opts.out_dtype,
            out_scale=scale if scale is not None else opts.out_scale, want_amax=opts.return_amax,
            **_mod_kwargs(mod_scale, mod_shift, rows.shape[-1]),
            **({} if gate is None else {"gate": _rows(backend, gate, shape, rows)}))
    view = lambda t, s: None if t is None else fresh(t.view(s))  # noqa: E731
    return view(y, x.shape), view(h, x.shape), view(mean, lead), view(rstd, lead), fresh(amax)


def row_norm_backward_fused(backend, dy, x, normalized_ndim: int, weight, bias, mean, rstd, rms: bool, activation,
                            dweight_dtype, dbias_dtype, *, weight_offset: float = 0.0, dh=None, dx_dtype=None,
                            dres_dtype=None, mod_scale=None, mod_shift=None, dscale_dtype=None, dshift_dtype=None,
                            gate=None):
    """The kernels' first-order backward. Its arguments are the backward ops' by name
    (normkit._op_args.ROW_FUSED_BWD, the backend resolved), so the ops' implementation passes its call on
    and row_norm_grads works them out once for every caller. Returns (dx, dres, dweight, dbias, dscale,
    dshift, dgate): x is what was normalized (h with a residual; with a gate the ungated input, normalized
    as x * silu(gate)); dh, the gradient of h, joins dx, which comes in dx_dtype (default x's); dres is the
    same gradient again in dres_dtype, None where that is None or dx_dtype; the parameter and modulation
    gradients None where their dtype is None; dgate (the gate's dtype) whenever there is a gate."""
    shape = tuple(x.shape[x.dim() - normalized_ndim:])
    modulated = mod_scale is not None or mod_shift is not None
    dx_dtype = dx_dtype or x.dtype
    dres_dtype = None if dres_dtype == dx_dtype else dres_dtype
    rows = _rows(backend, x, shape)
    mean_rows = None if rms else mean.reshape(-1)
    dmod = (None, None)
    dgate = None
    if dh is None and dres_dtype is None and weight_offset == 0.0 and dx_dtype == x.dtype and not modulated and \
            gate is None and not _per_head(weight, bias, shape):
        extra = {} if activation is None else {"bias": flat_param(bias), "activation": activation}
        dx, dw, db = backend.row_norm_bwd(_rows(backend, dy, shape, rows), rows, flat_param(weight), mean_rows,
                                          rstd.reshape(-1), rms, dweight_dtype, dbias_dtype, **extra)
        dres = None
    else:
        mod = _mod_kwargs(mod_scale, mod_shift, rows.shape[-1])
        if mod:
            mod["dmod_dtypes"] = (dscale_dtype, dshift_dtype)
        if gate is not None:
            mod["gate"] = _rows(backend, gate, shape, rows)
        dx, dres, dw, db, *dmod = _fused_entry(backend, "row_norm_bwd_fused", RowOptions(
            weight_offset=weight_offset, mod_scale=mod_scale is not None, mod_shift=mod_shift is not None,
            gate=gate is not None), dh)(
            _rows(backend, dy, shape, rows), rows, param_rows(weight, shape), mean_rows, rstd.reshape(-1), rms,
            dweight_dtype, dbias_dtype, bias=param_rows(bias, shape), activation=activation,
            weight_offset=weight_offset, dh=None if dh is None else _rows(backend, dh, shape, rows),
            dx_dtype=dx_dtype, dres_dtype=dres_dtype, **mod)
        if gate is not None:  # the backend writes dgate as its last output
            dgate = fresh(dmod.pop().view(x.shape))
        dmod = tuple(dmod) or (None, None)
        dmod = tuple(None if d is None else fresh(d.view(t.shape)) for d, t in zip(dmod, (mod_scale, mod_shift)))
    pshape = next((tuple(p.shape) for p in (weight, bias) if p is not None), shape)
    return fresh(dx.view(x.shape)), (None if dres is None else fresh(dres.view(x.shape))), \
        (None if dw is None else dw.view(pshape)), (None if db is None else db.view(pshape)), dmod[0], dmod[1], dgate


def grad_dtypes(need_dx: bool, need_dres: bool, x_dtype, residual_dtype):
    """The backward ops' (dx_dtype, dres_dtype) for the input gradients wanted: the kernel writes the gradient of
    what was normalized once, in the residual's dtype when only the residual wants it, and a second time where x
    and the residual want different dtypes."""
    first = residual_dtype if need_dres and not need_dx else x_dtype
    return first, (residual_dtype if need_dx and need_dres else None)


def gated_input(x, gate):
    """x * silu(gate) in the compute dtype, in differentiable torch ops: what a gated norm normalizes."""
    acc = acc_dtype(x)
    with _no_autocast(x):
        return x.to(acc) * F.silu(gate.to(acc))


def row_norm_vjp_fused(dy, dh, z, weight, bias, normalized_ndim, eps, rms, activation, opts: RowOptions, needs,
                       x_dtype, residual_dtype, mod_scale=None, mod_shift=None, mod_needs=(False, False), gate=None,
                       need_dgate=False):
    """The differentiable backward with the fused options: (dx, dresidual, dweight, dbias, dscale,
    dshift, dgate). With a gate, z is the ungated input x."""
    need_dx, need_dw, need_db, need_dr = needs
    if gate is not None:  # the norm's input gradient, chained through x * silu(gate)
        xz = z
        z = gated_input(xz, gate)
        dz, _, dw, db, _, _, _ = row_norm_vjp_fused(dy, None, z, weight, bias, normalized_ndim, eps, rms, activation,
                                                    opts, (need_dx or need_dgate, need_dw, need_db, False), z.dtype,
                                                    None)
        dx = dgate = None
        if dz is not None:
            with _no_autocast(xz):
                g = gate.to(z.dtype)
                sg = torch.sigmoid(g)
                dx = (dz * (g * sg)).to(x_dtype) if need_dx else None
                dgate = (dz * xz.to(z.dtype) * (sg * (1 + g * (1 - sg)))).to(gate.dtype) if need_dgate else None
        return dx, None, dw, db, None, None, dgate
    dscale = dshift = None
    if dy is None:
        dz = dw = db = None
    else:
        if mod_scale is not None or mod_shift is not None:  # dy becomes the gradient of the affine output
            dy, dscale, dshift = modulation_vjp(dy, z, weight, bias, normalized_ndim, eps, rms, activation, mod_scale,
                                                mod_shift, mod_needs, weight_offset=opts.weight_offset)
            activation = None
        dz, dw, db = row_norm_vjp_differentiable(dy, z, weight, bias, normalized_ndim, eps, rms, activation,
                                                 (need_dx or need_dr, need_dw, need_db), weight_offset=opts.weight_offset)
    if dh is not None:
        dz = dh if dz is None else dz + dh
    return (dz.to(x_dtype) if need_dx and dz is not None else None,
            dz.to(residual_dtype) if need_dr and dz is not None else None, dw, db, dscale, dshift, None)


def row_norm_grads(saved, args, needs, mod_needs, need_dgate, dy, dh, differentiable: bool,
                   kernels=row_norm_backward_fused):
    """The row norms' first-order backward, one formula for every autograd entry: RowNormFn (eager, and
    normkit._cpu.CpuRowNorm through it) and the custom ops' registered autograd (normkit._library).
    saved: (z, weight, bias, mean, rstd, mod_scale, mod_shift, gate) as the forward saved them (z is what was
    normalized: h with a residual, the ungated x with a gate); args: (normalized_ndim, eps, rms, activation,
    opts, backend, x_dtype, residual dtype or None); needs: (x, weight, bias, residual); mod_needs: (scale,
    shift). differentiable (a backward autograd can differentiate again), or no dy (only h's gradient): torch
    ops' vjp; else `kernels(backend, **the backward op's arguments)`: row_norm_backward_fused, or the custom
    ops' function that calls the backward ops, so that a compiled graph holds them (absent gradients may come
    back as empty tensors: what was not asked for is dropped here). Returns (dx, dresidual, dweight, dbias,
    dscale, dshift, dgate), None where not needed."""
    z, weight, bias, mean, rstd, mod_scale, mod_shift, gate = saved
    normalized_ndim, eps, rms, activation, opts, backend, x_dtype, r_dtype = args
    if dy is None and dh is None:
        return (None,) * 7
    if dy is None or differentiable:
        return row_norm_vjp_fused(dy, dh, z, weight, bias, normalized_ndim, eps, rms, activation, opts, needs, x_dtype,
                                  r_dtype, mod_scale, mod_shift, mod_needs, gate, need_dgate)
    need_dx, need_dw, need_db, need_dr = needs
    dx_dtype, dres_dtype = grad_dtypes(need_dx, need_dr, x_dtype, r_dtype)
    dx, dres, dw, db, ds, dt, dg = kernels(
        backend, dy=dy, x=z, normalized_ndim=normalized_ndim, weight=weight, bias=bias, mean=mean, rstd=rstd, rms=rms,
        activation=activation, dweight_dtype=weight.dtype if need_dw else None,
        dbias_dtype=bias.dtype if need_db else None, weight_offset=opts.weight_offset, dh=dh, dx_dtype=dx_dtype,
        dres_dtype=dres_dtype, mod_scale=mod_scale, mod_shift=mod_shift,
        dscale_dtype=mod_scale.dtype if mod_needs[0] else None, dshift_dtype=mod_shift.dtype if mod_needs[1] else None,
        gate=gate)
    # the residual's gradient is dx where it was written once
    dres = (dres if dres_dtype is not None and dres_dtype != dx_dtype else dx) if need_dr else None
    return (dx if need_dx else None), dres, (dw if need_dw else None), (db if need_db else None), \
        (ds if mod_needs[0] else None), (dt if mod_needs[1] else None), (dg if need_dgate else None)


class _Function(torch.autograd.Function):
    """torch.autograd.Function whose apply does not bind the forward's signature on every call:
    torch's apply runs inspect.signature(forward).bind(...) whenever setup_context is defined (tens of
    microseconds per call, more than the rest of a CPU call). normkit passes every argument
    positionally and its forwards have no defaults, so the binding changes nothing. Under torch.func
    transforms torch's own apply runs (it routes to custom_function_call)."""

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))


class RowNormFn(_Function):
    """LayerNorm (rms=False) / RMSNorm over the trailing normalized_ndim dims, with the fused
    options; outputs (y, h, mean, rstd, amax), None where absent. h (with a residual) is
    differentiable, its gradient joins dx and dresidual; the statistics and amax are not.
    mod_scale / mod_shift: the adaLN modulation tensors, differentiable; gate (last): a gated norm's
    gate (x * silu(gate) is normalized), differentiable."""

    @staticmethod
    def forward(x, weight, bias, residual, scale, normalized_ndim, eps, rms, activation, opts, backend,
                mod_scale=None, mod_shift=None, gate=None):
        return row_norm_forward_fused(backend, x, weight, bias, normalized_ndim, eps, rms, activation,
                                      residual=residual, scale=scale, opts=opts, mod_scale=mod_scale,
                                      mod_shift=mod_shift, gate=gate)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, residual, scale, normalized_ndim, eps, rms, activation, opts, backend = inputs[:11]
        mod_scale, mod_shift, gate = (tuple(inputs[11:14]) + (None, None, None))[:3]
        _, h, mean, rstd, amax = output
        # what was normalized (x, or h; with a gate x * silu(gate), recomputed): the backward needs
        # only it and the statistics
        z = x if h is None else h
        ctx.save_for_backward(z, weight, bias, mean, rstd, mod_scale, mod_shift, gate)
        ctx.save_for_forward(z, weight, bias, mean, rstd, mod_scale, mod_shift, gate)
        ctx.mark_non_differentiable(*(t for t in (mean, rstd, amax) if t is not None))
        ctx.set_materialize_grads(False)
        ctx.args = (normalized_ndim, eps, rms, activation, opts, backend, x.dtype,
                    None if residual is None else residual.dtype)

    @staticmethod
    def backward(ctx, dy, dh, _dmean, _drstd, _damax):
        n = tuple(ctx.needs_input_grad) + (False,) * (14 - len(ctx.needs_input_grad))
        dx, dres, dw, db, ds, dt, dg = row_norm_grads(ctx.saved_tensors, ctx.args, n[:4], n[11:13], n[13], dy, dh,
                                                      _differentiable_backward_wanted())
        return ((dx, dw, db, dres) + (None,) * 7 + (ds, dt, dg))[: len(ctx.needs_input_grad)]

    @staticmethod
    def jvp(ctx, tx, tw, tb, tr, *rest):
        z, weight, bias, mean, rstd, mod_scale, mod_shift, gate = ctx.saved_tensors
        normalized_ndim, eps, rms, activation, opts, backend, x_dtype, r_dtype = ctx.args
        if mean is None and not rms:
            raise RuntimeError("normkit: forward-mode AD needs the forward's statistics")
        ts, tt, tg = (tuple(rest[7:10]) + (None, None, None))[:3]
        tz = tx
        if gate is not None:  # the tangent of x * silu(gate), in the compute dtype
            acc = acc_dtype(z)
            g = gate.to(acc)
            sg = torch.sigmoid(g)
            parts = ([tx.to(acc) * (g * sg)] if tx is not None else []) + \
                ([z.to(acc) * (sg * (1 + g * (1 - sg))) * tg.to(acc)] if tg is not None else [])
            tz = None if not parts else (parts[0] if len(parts) == 1 else parts[0] + parts[1])
            z = gated_input(z, gate)
        if r_dtype is not None:  # the tangent of h = x + residual
            parts = [t.to(acc_dtype(z)) for t in (tx, tr) if t is not None]
            tz = None if not parts else (parts[0] if len(parts) == 1 else parts[0] + parts[1]).to(z.dtype)
        ty = row_norm_jvp(z, weight, bias, mean, rstd, tz, tw, tb, normalized_ndim, rms, activation,
                          weight_offset=opts.weight_offset, out_dtype=opts.out_dtype or x_dtype, mod_scale=mod_scale,
                          mod_shift=mod_shift, ts=ts, tt=tt)
        return ty, (tz if r_dtype is not None else None), None, None, None

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, residual, scale, normalized_ndim, eps, rms, activation, opts, backend,
             mod_scale=None, mod_shift=None, gate=None):
        xd, wd, bd, rd, sd = in_dims[:5]
        msd, mtd, gd = (tuple(in_dims[11:14]) + (None, None, None))[:3]
        V = info.batch_size
        move = lambda t, d: None if t is None else (t.movedim(d, 0) if d is not None  # noqa: E731
                                                     else t.expand((V,) + tuple(t.shape)))
        x, residual, gate = move(x, xd), move(residual, rd), move(gate, gd)
        # the batch dim is one more leading dim of x, and so one more sample dim of the modulation
        mod_scale, mod_shift = move(mod_scale, msd), move(mod_shift, mtd)
        if wd is None and bd is None and sd is None and not opts.return_amax:
            # the batch dim is one more leading dim: the kernels take it
            out = RowNormFn.apply(x, weight, bias, residual, scale, normalized_ndim, eps, rms, activation, opts,
                                  backend, mod_scale, mod_shift, gate)
            return out, tuple(None if t is None else 0 for t in out)
        return _row_norm_batched_params(x, weight, wd, bias, bd, residual, scale, sd, normalized_ndim, eps, rms,
                                        activation, opts, mod_scale, mod_shift, gate)


def _batched_param(p, bdim, like_ndim, inner_shape, batch):
    """A [V, *inner] parameter (batched or not) viewed to broadcast against [V, *lead, *inner].
    inner_shape None: the parameter's own (unbatched) shape."""
    if p is None:
        return None
    p = p.movedim(bdim, 0) if bdim is not None else p.expand((batch,) + tuple(p.shape))
    inner_shape = tuple(p.shape[1:]) if inner_shape is None else inner_shape
    return p.reshape((batch,) + (1,) * (like_ndim - 1 - len(inner_shape)) + tuple(inner_shape))


def _row_norm_batched_params(x, weight, wd, bias, bd, residual, scale, sd, normalized_ndim, eps, rms, activation,
                             opts: RowOptions, mod_scale=None, mod_shift=None, gate=None):
    """vmap over weight, bias or a tensor scale, or with the amax (one per sample): everything in
    torch ops, batch dim 0 everywhere."""
    acc = acc_dtype(x)
    V = x.shape[0]
    dims = tuple(range(x.dim() - normalized_ndim, x.dim()))
    h = None
    if residual is not None:
        h = (x.to(acc) + residual.to(acc)).to(opts.residual_dtype)
    xa = (x if h is None else h).to(acc) if gate is None else gated_input(x, gate)
    z, rstd = _normalize(xa, dims, eps, rms)
    w = _batched_param(weight, wd, x.dim(), None, V)
    b = _batched_param(bias, bd, x.dim(), None, V)
    if w is not None:
        z = z * (w.to(acc) + opts.weight_offset)
    if b is not None:
        z = z + b.to(acc)
    if mod_scale is not None:
        z = z * (1 + per_sample(mod_scale, x.dim(), normalized_ndim).to(acc))
    if mod_shift is not None:
        z = z + per_sample(mod_shift, x.dim(), normalized_ndim).to(acc)
    lead = tuple(x.shape[: x.dim() - normalized_ndim])
    y = _ACT[activation](z)
    amax = y.abs().amax(tuple(range(1, y.dim()))) if opts.return_amax else None
    out_dtype = opts.out_dtype or x.dtype
    if out_dtype in FP8_MAX:
        s = opts.out_scale
        if scale is not None:  # one scale per sample, or the same for all
            s = (scale.movedim(sd, 0).reshape(V) if sd is not None else scale.reshape(()).expand(V)).to(acc)
            s = s.reshape((V,) + (1,) * (y.dim() - 1))
        y = (y * s).clamp(-FP8_MAX[out_dtype], FP8_MAX[out_dtype])
    mean = None if rms else xa.mean(dims).reshape(lead)
    out = (y.to(out_dtype), h, mean, rstd.reshape(lead), amax)
    return out, tuple(None if t is None else 0 for t in out)


# ----------------------------------------------------------------------------- GroupNorm

def group_norm_forward(backend, x, weight, bias, num_groups: int, eps: float, activation):
    """The kernels' forward on [B, C, *spatial]: (y in x's memory format, mean [B, G], rstd [B, G])."""
    y3, mean, rstd = backend.group_norm_fwd(bcs(x, is_channels_last(x)), num_groups, weight, bias, eps, activation)
    return fresh(from_bcs(y3, x.shape)), fresh(mean), fresh(rstd)


def group_norm_backward(backend, dy, x, num_groups: int, weight, bias, mean, rstd, activation, dweight_dtype,
                        dbias_dtype, eps=None):
    """The kernels' backward, its arguments the backward op's by name (normkit._op_args.GN_BWD, the backend
    resolved): (dx, dweight, dbias), the last two None where their dtype is None (dbias needs no bias: the
    kernels read the bias only to recompute the activation's input). eps: the forward's, for the torch
    backend, whose CPU kernel then recomputes the activation's input with the forward's own bits (as torch's
    autograd nodes save it: normkit/_cpu.py); the other backends' kernels do not need it."""
    channels_last = is_channels_last(x)
    dx3, dw, db = backend.group_norm_bwd(bcs(dy, channels_last), bcs(x, channels_last), num_groups, weight, bias,
                                         mean, rstd, activation, dweight_dtype, dbias_dtype, eps=eps)
    return fresh(from_bcs(dx3, x.shape)), dw, db


def group_norm_grads(saved, args, needs, dy, differentiable: bool, kernels=group_norm_backward):
    """GroupNorm's first-order backward, one formula for GroupNormFn (and normkit._cpu.CpuGroupNorm through it)
    and the custom op's registered autograd, as row_norm_grads: `kernels(backend, **the backward op's
    arguments)`, group_norm_backward or the backward op. saved: (x, weight, bias, mean, rstd); args:
    (num_groups, eps, activation, backend); needs: (x, weight, bias). Returns (dx, dweight, dbias), None where
    not needed."""
    x, weight, bias, mean, rstd = saved
    num_groups, eps, activation, backend = args
    if dy is None:
        return None, None, None
    if differentiable:
        return group_norm_vjp_differentiable(dy, x, weight, bias, num_groups, eps, activation, needs)
    dx, dw, db = kernels(backend, dy=dy, x=x, num_groups=num_groups, weight=weight, bias=bias, mean=mean, rstd=rstd,
                         activation=activation, dweight_dtype=weight.dtype if needs[1] else None,
                         dbias_dtype=bias.dtype if needs[2] else None, eps=eps)
    return (dx if needs[0] else None), (dw if needs[1] else None), (db if needs[2] else None)


class GroupNormFn(_Function):
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
        return group_norm_grads(ctx.saved_tensors, ctx.args, ctx.needs_input_grad[:3], dy,
                                _differentiable_backward_wanted()) + (None,) * 4

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
        g = flat.to(acc).reshape(V, x.shape[1], num_groups, x.shape[2] // num_groups * math.prod(x.shape[3:]))
        mean = g.mean(-1)
        rstd = torch.rsqrt((g - mean[..., None]).square().mean(-1) + eps)
        return (_ACT[activation](z).to(x.dtype), mean, rstd), (0, 0, 0)
