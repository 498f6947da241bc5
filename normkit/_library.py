"""normkit's ops as torch.library custom ops: what torch.compile, DTensor and dispatch modes see.

Each op is opaque to the compiler (the same backend kernels run under torch.compile as in eager, so
results are bitwise equal), has a fake implementation (shapes/dtypes/strides only, for tracing with
dynamic shapes), an autograd formula (register_autograd), and a DTensor sharding rule, so a
sequence-parallel norm (rows sharded across ranks, weight replicated) returns its weight gradient
as a Partial sum that DTensor reduces across ranks.

Plain eager calls do not come here: they use the autograd.Functions of _autograd.py, which call the
same backend entry points with less host overhead and carry the torch.func rules (see `needed`).
The ops mutate nothing. Their autograd is the eager formula (_autograd.row_norm_grads /
group_norm_grads), given kernels that call the backward ops; so a backward that autograd records
(create_graph=True) is taken through the differentiable backward of _autograd.py, as in eager. The
backward ops' implementations pass their arguments by name to the eager kernels' functions.

Ops (namespace normkit), on tensors in their user-facing shapes, so sharded dims stay visible (their
argument lists are defined once, in normkit._op_args, which their schemas come from):
  row_norm_fwd(x, normalized_ndim, weight?, bias?, eps, rms, activation?, backend?) -> (y, mean, rstd)
  row_norm_bwd(dy, x, normalized_ndim, weight?, bias?, mean, rstd, rms, activation?,
               dweight_dtype?, dbias_dtype?, backend?) -> (dx, dweight, dbias)
  row_norm_fused_fwd(x, normalized_ndim, weight?, bias?, eps, rms, activation?, backend?, residual?,
                     residual_dtype?, weight_offset, out_dtype?, out_scale?, out_scale_value?, want_amax,
                     mod_scale?, mod_shift?, gate?)
      -> (y, h, mean, rstd, amax)     the fused epilogues (residual add, weight offset, output
                                      dtype / float8 with a scale, amax, adaLN modulation by
                                      per-sample mod_scale / mod_shift, the gated norm of
                                      x * silu(gate)); the plain ops are the same code with every
                                      option off
  row_norm_fused_bwd(dy, x, normalized_ndim, weight?, bias?, mean, rstd, rms, activation?,
                     dweight_dtype?, dbias_dtype?, backend?, weight_offset, dh?, dx_dtype, dres_dtype?,
                     mod_scale?, mod_shift?, dscale_dtype?, dshift_dtype?, gate?)
      -> (dx, dres, dweight, dbias, dscale, dshift, dgate)
                                      x is what was normalized (h), or with a gate the ungated x;
                                      dh joins dx; dres is dx in another dtype (absent when not
                                      asked or the same dtype); dscale/dshift absent unless their
                                      dtype is given; dgate (the gate's dtype) absent without a gate
  group_norm_fwd(x, num_groups, weight?, bias?, eps, activation?, backend?) -> (y, mean, rstd)
  group_norm_bwd(dy, x, num_groups, weight?, bias?, mean, rstd, activation?,
                 dweight_dtype?, dbias_dtype?, backend?, eps?) -> (dx, dweight, dbias)
                                      eps: the forward's (the autograd formula passes it), with
                                      which the torch backend's CPU kernel recomputes the
                                      activation's input bitwise as the forward computed it
`backend` is the user's choice (None: automatic), resolved inside the op on the real tensors: so
tracing never imports a backend, and a forced backend that cannot run raises when the op runs.
A custom op cannot return None, so an absent result (RMSNorm's mean, a gradient nobody asked for)
is an empty tensor; the Python wrappers below turn it back into None.
"""
import functools
import sys
from typing import Optional

import torch
from torch import Tensor

from . import _autograd, _host, _op_args, backends
from ._layout import bcs, fresh, from_bcs, is_channels_last

__all__ = ["needed", "row_norm", "row_norm_fused", "row_norm_with_stats", "row_norm_grads", "group_norm"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# bound once: the check below runs on every eager call (dynamo still sees is_compiling itself)
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack


def needed(*tensors) -> bool:
    """True when a call must go through the custom ops instead of the eager autograd.Function:
    under torch.compile / torch.export tracing, under a dispatch mode (FakeTensorMode, make_fx,
    FlopCounterMode, ...), or with tensor subclasses such as DTensor. A few attribute checks, so the
    plain eager call keeps its low overhead."""
    if _is_compiling() or _dispatch_modes():
        return True
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            _register_sharding()
            return True
    return False


def _resolve(backend: Optional[str], x: Tensor, op: str, backward: bool = False):
    be = backends.resolve(backend, x, op)
    if backward and not getattr(be, "HAS_BACKWARD", True):
        raise backends.BackendUnavailableError(
            f"backend={be.NAME!r} cannot run {op}: it has no backward; use backend='torch' or another backend")
    return be


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _absent(like: Tensor, dtype=None) -> Tensor:
    return like.new_empty((0,), dtype=dtype if dtype is not None else like.dtype)


# ----------------------------------------------------------------------------- row norm (LN / RMS)
# The ops' arguments are defined once, in normkit._op_args: their schemas come from there, and their
# Python implementations, fakes, autograd and sharding rules read a call's arguments by name
# (`A.read(*args)`).

A_FWD, A_FUSED, A_BWD, A_FUSED_BWD = _op_args.ROW_FWD, _op_args.ROW_FUSED_FWD, _op_args.ROW_BWD, \
    _op_args.ROW_FUSED_BWD
A_GN, A_GN_BWD = _op_args.GN_FWD, _op_args.GN_BWD


def _op(args: "_op_args.OpArgs", impl):
    """The custom op normkit::<args.op>, its schema from its argument table."""
    return torch.library.custom_op(f"normkit::{args.op}", impl, mutates_args=(), schema=args.schema())


def _options(a):
    """The fused forward's RowOptions from its arguments (a: A_FUSED.read)."""
    return _autograd.RowOptions(a.residual_dtype, a.weight_offset, a.out_dtype, a.out_scale_value, a.want_amax,
                                a.mod_scale is not None, a.mod_shift is not None, a.gate is not None)


def _fwd(x, normalized_ndim, weight, bias, eps, rms, activation, backend, residual=None, scale=None,
         opts=_autograd.PLAIN, mod_scale=None, mod_shift=None, gate=None):
    """Both forward ops: the eager code (_autograd.row_norm_forward_fused) on the op's tensors."""
    be = _resolve(backend, x, "rms_norm" if rms else "layer_norm")
    _autograd.check_backend(be, opts, residual)
    y, h, mean, rstd, amax = _autograd.row_norm_forward_fused(be, x, weight, bias, normalized_ndim, eps, rms,
                                                              activation, residual=residual, scale=scale, opts=opts,
                                                              mod_scale=mod_scale, mod_shift=mod_shift, gate=gate)
    return y, (_absent(x) if h is None else h), (_absent(rstd) if mean is None else mean), rstd, \
        (_absent(rstd) if amax is None else amax)


def _fwd_fake(x, normalized_ndim, weight, bias, eps, rms, residual=None, opts=_autograd.PLAIN):
    _host.prepare_for_compile(x)  # the compiled call's C++ kernel (normkit._host)
    lead = x.shape[: x.dim() - normalized_ndim]
    rstd = x.new_empty(lead, dtype=_stat_dtype(x))
    mean = _absent(rstd) if rms else x.new_empty(lead, dtype=_stat_dtype(x))
    h = _absent(x) if residual is None else x.new_empty(x.shape, dtype=opts.residual_dtype)
    amax = x.new_empty((), dtype=_stat_dtype(x)) if opts.return_amax else _absent(rstd)
    return x.new_empty(x.shape, dtype=opts.out_dtype or x.dtype), h, mean, rstd, amax


def _row_norm_fwd_impl(*args):
    a = A_FWD.read(*args)
    y, _, mean, rstd, _ = _fwd(a.x, a.normalized_ndim, a.weight, a.bias, a.eps, a.rms, a.activation, a.backend)
    return y, mean, rstd


def _row_norm_fwd_fake(*args):
    a = A_FWD.read(*args)
    y, _, mean, rstd, _ = _fwd_fake(a.x, a.normalized_ndim, a.weight, a.bias, a.eps, a.rms)
    return y, mean, rstd


def _row_norm_fused_fwd_impl(*args):
    a = A_FUSED.read(*args)
    return _fwd(a.x, a.normalized_ndim, a.weight, a.bias, a.eps, a.rms, a.activation, a.backend, a.residual,
                a.out_scale, _options(a), a.mod_scale, a.mod_shift, a.gate)


def _row_norm_fused_fwd_fake(*args):
    a = A_FUSED.read(*args)
    return _fwd_fake(a.x, a.normalized_ndim, a.weight, a.bias, a.eps, a.rms, a.residual, _options(a))


_row_norm_fwd = _op(A_FWD, _row_norm_fwd_impl)
_row_norm_fwd.register_fake(_row_norm_fwd_fake)
_row_norm_fused_fwd = _op(A_FUSED, _row_norm_fused_fwd_impl)
_row_norm_fused_fwd.register_fake(_row_norm_fused_fwd_fake)


def _bwd(a):
    """Both backward ops (a: A_BWD.read or A_FUSED_BWD.read): the eager kernels, which take the op's arguments by
    name; absent gradients as empty tensors: (dx, dres, dweight, dbias, dscale, dshift, dgate)."""
    kw = a._asdict()
    x = a.x
    be = _resolve(kw.pop("backend"), x, "rms_norm backward" if a.rms else "layer_norm backward", backward=True)
    mod_scale, mod_shift, gate = kw.get("mod_scale"), kw.get("mod_shift"), kw.get("gate")
    if mod_scale is not None or mod_shift is not None or gate is not None:
        _autograd.check_backend(be, _autograd.RowOptions(mod_scale=mod_scale is not None,
                                                         mod_shift=mod_shift is not None, gate=gate is not None), None)
    dx, *grads = _autograd.row_norm_backward_fused(be, **kw)
    dtypes = (None, a.dweight_dtype, a.dbias_dtype, kw.get("dscale_dtype"), kw.get("dshift_dtype"), None)
    return (dx,) + tuple(_absent(x, d) if g is None else fresh(g) for g, d in zip(grads, dtypes))


def _bwd_fake(x, normalized_ndim, weight, bias, dweight_dtype, dbias_dtype, dx_dtype=None, dres_dtype=None,
              mod_scale=None, mod_shift=None, dmod_dtypes=(None, None), gate=None):
    shape = next((p.shape for p in (weight, bias) if p is not None), x.shape[x.dim() - normalized_ndim:])
    dw = _absent(x, dweight_dtype) if dweight_dtype is None else x.new_empty(shape, dtype=dweight_dtype)
    db = _absent(x, dbias_dtype) if dbias_dtype is None else x.new_empty(shape, dtype=dbias_dtype)
    dx_dtype = dx_dtype or x.dtype
    dres = _absent(x) if dres_dtype in (None, dx_dtype) else x.new_empty(x.shape, dtype=dres_dtype)
    dmod = tuple(_absent(x, d) if d is None or t is None else t.new_empty(t.shape, dtype=d)
                 for t, d in zip((mod_scale, mod_shift), dmod_dtypes))
    dg = _absent(x) if gate is None else gate.new_empty(x.shape)
    return (x.new_empty(x.shape, dtype=dx_dtype), dres, dw, db) + dmod + (dg,)


def _row_norm_bwd_impl(*args):
    dx, _, dw, db, _, _, _ = _bwd(A_BWD.read(*args))
    return dx, dw, db


def _row_norm_bwd_fake(*args):
    a = A_BWD.read(*args)
    dx, _, dw, db, _, _, _ = _bwd_fake(a.x, a.normalized_ndim, a.weight, a.bias, a.dweight_dtype, a.dbias_dtype)
    return dx, dw, db


def _row_norm_fused_bwd_fake(*args):
    a = A_FUSED_BWD.read(*args)
    return _bwd_fake(a.x, a.normalized_ndim, a.weight, a.bias, a.dweight_dtype, a.dbias_dtype, a.dx_dtype,
                     a.dres_dtype, a.mod_scale, a.mod_shift, (a.dscale_dtype, a.dshift_dtype), a.gate)


_row_norm_bwd = _op(A_BWD, _row_norm_bwd_impl)
_row_norm_bwd.register_fake(_row_norm_bwd_fake)
def _row_norm_fused_bwd_impl(*args):
    return _bwd(A_FUSED_BWD.read(*args))


_row_norm_fused_bwd = _op(A_FUSED_BWD, _row_norm_fused_bwd_impl)
_row_norm_fused_bwd.register_fake(_row_norm_fused_bwd_fake)


def _row_norm_setup(ctx, inputs, output):
    ctx.fused = len(output) == 5  # the fused op (its inputs may leave the trailing defaults out)
    a = (A_FUSED if ctx.fused else A_FWD).read(*inputs)
    if ctx.fused:
        residual, opts, mod_scale, mod_shift, gate = a.residual, _options(a), a.mod_scale, a.mod_shift, a.gate
        _, h, mean, rstd, _ = output
    else:
        residual, opts, mod_scale, mod_shift, gate = None, _autograd.PLAIN, None, None, None
        (_, mean, rstd), h = output, None
    # RowNormFn's saved tensors and arguments (backend: the user's name, which the backward ops resolve)
    ctx.save_for_backward(a.x if residual is None else h, a.weight, a.bias, mean, rstd, mod_scale, mod_shift, gate)
    ctx.args = (a.normalized_ndim, a.eps, a.rms, a.activation, opts, a.backend, a.x.dtype,
                None if residual is None else residual.dtype)


def _grads_by_op(fused: bool, backend, **kw):
    """row_norm_grads' kernels through the backward op that goes with the forward op (the plain forward's
    options are all defaults), so that a compiled graph holds it. kw: the backward op's arguments; the bias
    only where the backward reads it (an activation's or the modulation's input, the gate, per-head biases)."""
    bias = kw["bias"]
    if kw["activation"] is None and kw["mod_scale"] is None and kw["gate"] is None and \
            (bias is None or bias.dim() <= kw["normalized_ndim"]):
        kw["bias"] = None
    if fused:
        return _row_norm_fused_bwd(*A_FUSED_BWD.call(backend=backend, **kw))
    dx, dw, db = _row_norm_bwd(*A_BWD.call(backend=backend, **{k: kw[k] for k in A_BWD.names if k != "backend"}))
    return dx, None, dw, db, None, None, None


def _row_norm_backward(ctx, dy, *grads):
    """Both forward ops' autograd (grads: (dmean, drstd) or (dh, dmean, drstd, damax)): the formula RowNormFn
    uses, its kernels through the backward ops."""
    dh = grads[0] if ctx.fused and ctx.args[7] is not None else None  # an absent h (empty) has an empty gradient
    A = A_FUSED if ctx.fused else A_FWD
    n = dict(zip(A.names, ctx.needs_input_grad))  # by argument name
    # create_graph=True: a backward autograd can differentiate again
    dx, dres, dw, db, ds, dt, dg = _autograd.row_norm_grads(
        ctx.saved_tensors, ctx.args, (n["x"], n["weight"], n["bias"], n.get("residual", False)),
        (n.get("mod_scale", False), n.get("mod_shift", False)), n.get("gate", False), dy, dh,
        torch.is_grad_enabled(), functools.partial(_grads_by_op, ctx.fused))
    fused = dict(residual=dres, mod_scale=ds, mod_shift=dt, gate=dg) if ctx.fused else {}
    return A.by_position(len(ctx.needs_input_grad), x=dx, weight=dw, bias=db, **fused)


_row_norm_fwd.register_autograd(_row_norm_backward, setup_context=_row_norm_setup)
_row_norm_fused_fwd.register_autograd(_row_norm_backward, setup_context=_row_norm_setup)


def row_norm(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
             rms: bool, backend: Optional[str], activation: Optional[str] = None) -> Tensor:
    """LayerNorm (rms=False) or RMSNorm over the trailing normalized_ndim dims of x, through the op.
    Arguments arrive checked by normkit.functional; backend is the user's (None: automatic)."""
    return _row_norm_fwd(x, normalized_ndim, weight, bias, eps, rms, activation, backend)[0]


def row_norm_fused(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                   rms: bool, backend: Optional[str], activation: Optional[str], residual: Optional[Tensor],
                   scale: Optional[Tensor], opts, mod_scale: Optional[Tensor] = None,
                   mod_shift: Optional[Tensor] = None, gate: Optional[Tensor] = None) -> tuple:
    """The fused forward through the op: (y, h, mean, rstd, amax), None where absent. scale: the
    float8 output's scale tensor; mod_scale / mod_shift: the adaLN modulation; gate: the gated norm's."""
    y, h, mean, rstd, amax = _row_norm_fused_fwd(*A_FUSED.call(
        x=x, normalized_ndim=normalized_ndim, weight=weight, bias=bias, eps=eps, rms=rms, activation=activation,
        backend=backend, residual=residual, residual_dtype=opts.residual_dtype, weight_offset=opts.weight_offset,
        out_dtype=opts.out_dtype, out_scale=scale, out_scale_value=opts.out_scale, want_amax=opts.return_amax,
        mod_scale=mod_scale, mod_shift=mod_shift, gate=gate))
    return y, (h if residual is not None else None), (None if rms else mean), rstd, \
        (amax if opts.return_amax else None)


def row_norm_with_stats(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor],
                        eps: float, rms: bool, backend: Optional[str]):
    """The kernel-level forward through the op: (y, mean or None for RMSNorm, rstd)."""
    y, mean, rstd = _row_norm_fwd(x, normalized_ndim, weight, bias, eps, rms, None, backend)
    return y, (None if rms else mean), rstd


def row_norm_grads(dy: Tensor, x: Tensor, normalized_ndim: int, weight: Optional[Tensor], mean: Optional[Tensor],
                   rstd: Tensor, rms: bool, dweight_dtype, dbias_dtype, backend: Optional[str], *, bias=None,
                   activation=None, weight_offset=0.0, dh=None, dres_dtype=None):
    """The kernel-level backward through the op: (dx, dweight or None, dbias or None, dres or None)."""
    mean = _absent(rstd) if mean is None else mean
    bias = bias if activation is not None else None
    plain = dict(dy=dy, x=x, normalized_ndim=normalized_ndim, weight=weight, bias=bias, mean=mean, rstd=rstd, rms=rms,
                 activation=activation, dweight_dtype=dweight_dtype, dbias_dtype=dbias_dtype, backend=backend)
    if dh is None and dres_dtype is None and weight_offset == 0.0:
        dx, dw, db = _row_norm_bwd(*A_BWD.call(**plain))
        dres = None
    else:
        dx, dres, dw, db, _, _, _ = _row_norm_fused_bwd(*A_FUSED_BWD.call(
            **plain, weight_offset=weight_offset, dh=dh, dx_dtype=x.dtype, dres_dtype=dres_dtype))
        dres = None if dres_dtype is None else (dx if dres_dtype == x.dtype else dres)
    return dx, (dw if dweight_dtype is not None else None), (db if dbias_dtype is not None else None), dres

# ----------------------------------------------------------------------------- group norm
# x is [B, C, *spatial]; the backends take [B, C, S] in NCHW or channels_last layout, and the
# output keeps that layout (_layout.bcs / from_bcs, shared with the eager path).

def _like_layout(x: Tensor, channels_last: bool, dtype=None) -> Tensor:
    """An empty tensor of x's shape in the layout the kernels write: NCHW or channels innermost."""
    if not channels_last:
        return x.new_empty(x.shape, dtype=dtype)
    perm = (0,) + tuple(range(2, x.dim())) + (1,)
    inner = x.new_empty(tuple(x.shape[i] for i in perm), dtype=dtype)
    return inner.permute((0, x.dim() - 1) + tuple(range(1, x.dim() - 1)))


def _group_norm_fwd_impl(*args):
    a = A_GN.read(*args)
    x = a.x
    y3, mean, rstd = _resolve(a.backend, x, "group_norm").group_norm_fwd(
        bcs(x, is_channels_last(x)), a.num_groups, a.weight, a.bias, a.eps, a.activation)
    return fresh(from_bcs(y3, x.shape)), fresh(mean), fresh(rstd)


def _group_norm_fwd_fake(*args):
    a = A_GN.read(*args)
    x = a.x
    _host.prepare_for_compile(x)
    stats = (x.shape[0], a.num_groups)
    return _like_layout(x, is_channels_last(x)), x.new_empty(stats, dtype=_stat_dtype(x)), \
        x.new_empty(stats, dtype=_stat_dtype(x))


def _group_norm_bwd_impl(*args):
    a = A_GN_BWD.read(*args)
    kw = a._asdict()
    be = _resolve(kw.pop("backend"), a.x, "group_norm backward", backward=True)
    dx, dw, db = _autograd.group_norm_backward(be, **kw)
    return dx, (_absent(a.x, a.dweight_dtype) if dw is None else fresh(dw)), \
        (_absent(a.x, a.dbias_dtype) if db is None else fresh(db))


def _group_norm_bwd_fake(*args):
    a = A_GN_BWD.read(*args)
    x, c = a.x, a.x.shape[1]
    dw = _absent(x, a.dweight_dtype) if a.dweight_dtype is None else x.new_empty((c,), dtype=a.dweight_dtype)
    db = _absent(x, a.dbias_dtype) if a.dbias_dtype is None else x.new_empty((c,), dtype=a.dbias_dtype)
    return _like_layout(x, is_channels_last(x)), dw, db


_group_norm_fwd = _op(A_GN, _group_norm_fwd_impl)
_group_norm_fwd.register_fake(_group_norm_fwd_fake)
_group_norm_bwd = _op(A_GN_BWD, _group_norm_bwd_impl)
_group_norm_bwd.register_fake(_group_norm_bwd_fake)


def _group_norm_setup(ctx, inputs, output):
    a = A_GN.read(*inputs)
    _, mean, rstd = output
    ctx.save_for_backward(a.x, a.weight, a.bias, mean, rstd)  # GroupNormFn's saved tensors and arguments
    ctx.args = (a.num_groups, a.eps, a.activation, a.backend)


def _group_grads_by_op(backend, **kw):
    """group_norm_grads' kernels: the backward op (the bias only where the activation's input needs it)."""
    if kw["activation"] is None:
        kw["bias"] = None
    return _group_norm_bwd(*A_GN_BWD.call(backend=backend, **kw))


def _group_norm_backward(ctx, dy, _dmean, _drstd):
    n = dict(zip(A_GN.names, ctx.needs_input_grad))  # by argument name
    # create_graph=True: a backward autograd can differentiate again
    dx, dw, db = _autograd.group_norm_grads(ctx.saved_tensors, ctx.args, (n["x"], n["weight"], n["bias"]), dy,
                                            torch.is_grad_enabled(), _group_grads_by_op)
    return A_GN.by_position(len(ctx.needs_input_grad), x=dx, weight=dw, bias=db)


_group_norm_fwd.register_autograd(_group_norm_backward, setup_context=_group_norm_setup)


def group_norm(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
               backend: Optional[str], activation: Optional[str] = None) -> Tensor:
    """GroupNorm of x [B, C, *spatial] through the op; arguments arrive checked by functional."""
    return _group_norm_fwd(*A_GN.call(x=x, num_groups=num_groups, weight=weight, bias=bias, eps=eps,
                                      activation=activation, backend=backend))[0]


# ----------------------------------------------------------------------------- DTensor sharding

_sharding_registered = False


def _register_sharding() -> None:
    """Sharding rules: any leading (non-normalized) dim may be sharded, parameters are replicated,
    and the parameter gradients of row-sharded inputs are Partial sums (reduced by DTensor).

    Registered on the first tensor subclass seen, and only if DTensor is already imported: importing
    torch.distributed.tensor takes seconds, which `import normkit` must not pay."""
    global _sharding_registered
    if _sharding_registered or "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding
    _sharding_registered = True

    def rep_or(placement, present: bool):
        return placement if present else Replicate()

    def p(t):  # an optional parameter: replicated, or no placement when absent
        return None if t is None else Replicate()

    # the rules read their arguments and place their inputs by name (normkit._op_args)
    @register_sharding(torch.ops.normkit.row_norm_fwd.default)
    def _(*args):
        a = A_FWD.read(*args)

        def inputs(xp):
            return list(A_FWD.by_position(len(args), x=xp, weight=p(a.weight), bias=p(a.bias)))

        rules = [([Replicate()] * 3, inputs(Replicate()))]
        for d in range(a.x.ndim - a.normalized_ndim):
            rules.append(([Shard(d), rep_or(Shard(d), not a.rms), Shard(d)], inputs(Shard(d))))
        return rules

    @register_sharding(torch.ops.normkit.row_norm_bwd.default)
    def _(*args):
        a = A_BWD.read(*args)

        def inputs(xp, stat):
            return list(A_BWD.by_position(len(args), dy=xp, x=xp, weight=p(a.weight), bias=p(a.bias), mean=stat,
                                          rstd=xp))

        rules = [([Replicate()] * 3, inputs(Replicate(), Replicate()))]
        for d in range(a.x.ndim - a.normalized_ndim):
            rules.append(([Shard(d), rep_or(Partial(), a.dweight_dtype is not None),
                           rep_or(Partial(), a.dbias_dtype is not None)], inputs(Shard(d), rep_or(Shard(d), not a.rms))))
        return rules

    @register_sharding(torch.ops.normkit.row_norm_fused_fwd.default)
    def _(*args):
        a = A_FUSED.read(*args)

        # outputs (y, h, mean, rstd, amax): the amax of row shards is their max (a Partial max)
        def inputs(xp):
            return list(A_FUSED.by_position(len(args), x=xp, weight=p(a.weight), bias=p(a.bias),
                                            residual=None if a.residual is None else xp, out_scale=p(a.out_scale),
                                            mod_scale=p(a.mod_scale), mod_shift=p(a.mod_shift),
                                            gate=None if a.gate is None else xp))

        rules = [([Replicate()] * 5, inputs(Replicate()))]
        # modulation (per-sample tables): replicated only
        for d in range(a.x.ndim - a.normalized_ndim if a.mod_scale is None and a.mod_shift is None else 0):
            rules.append(([Shard(d), rep_or(Shard(d), a.residual is not None), rep_or(Shard(d), not a.rms), Shard(d),
                           rep_or(Partial("max"), a.want_amax)], inputs(Shard(d))))
        return rules

    @register_sharding(torch.ops.normkit.row_norm_fused_bwd.default)
    def _(*args):
        a = A_FUSED_BWD.read(*args)

        def inputs(xp):
            return list(A_FUSED_BWD.by_position(len(args), dy=xp, x=xp, weight=p(a.weight), bias=p(a.bias),
                                                mean=Replicate() if a.rms else xp, rstd=xp,
                                                dh=None if a.dh is None else xp, mod_scale=p(a.mod_scale),
                                                mod_shift=p(a.mod_shift), gate=None if a.gate is None else xp))

        dres = a.dres_dtype is not None and a.dres_dtype != a.dx_dtype
        rules = [([Replicate()] * 7, inputs(Replicate()))]
        for d in range(a.x.ndim - a.normalized_ndim if a.mod_scale is None and a.mod_shift is None else 0):
            rules.append(([Shard(d), rep_or(Shard(d), dres), rep_or(Partial(), a.dweight_dtype is not None),
                           rep_or(Partial(), a.dbias_dtype is not None), Replicate(), Replicate(),
                           rep_or(Shard(d), a.gate is not None)], inputs(Shard(d))))
        return rules

    @register_sharding(torch.ops.normkit.group_norm_fwd.default)
    def _(*args):  # samples (dim 0) may be sharded; a group spans channels and space
        a = A_GN.read(*args)

        def inputs(xp):
            return list(A_GN.by_position(len(args), x=xp, weight=p(a.weight), bias=p(a.bias)))

        return [([Replicate()] * 3, inputs(Replicate())), ([Shard(0)] * 3, inputs(Shard(0)))]

    @register_sharding(torch.ops.normkit.group_norm_bwd.default)
    def _(*args):
        a = A_GN_BWD.read(*args)

        def inputs(xp):
            return list(A_GN_BWD.by_position(len(args), dy=xp, x=xp, weight=p(a.weight), bias=p(a.bias), mean=xp,
                                             rstd=xp))

        grads = [rep_or(Partial(), a.dweight_dtype is not None), rep_or(Partial(), a.dbias_dtype is not None)]
        return [([Replicate()] * 3, inputs(Replicate())), ([Shard(0)] + grads, inputs(Shard(0)))]


_register_sharding()  # now if DTensor is already imported; else on the first tensor subclass seen


def _op_impls() -> dict:
    """{op name: (its Python implementation, its Python autograd kernel)} for normkit._host.op_impls."""
    from torch._library.autograd import make_autograd_impl

    out = {}
    for name in _op_args.OPS:
        opdef = globals()["_" + name]
        out[name] = (opdef._init_fn, make_autograd_impl(opdef._opoverload, opdef))  # (keyset, *args)
    return out


_host._op_impls = _op_impls  # the host path reaches the ops through this, without importing this module
