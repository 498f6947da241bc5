"""normkit's ops as torch.library custom ops: what torch.compile, DTensor and dispatch modes see.

Each op is opaque to the compiler (the same backend kernels run under torch.compile as in eager, so
results are bitwise equal), has a fake implementation (shapes/dtypes/strides only, for tracing with
dynamic shapes), an autograd formula (register_autograd), and a DTensor sharding rule, so a
sequence-parallel norm (rows sharded across ranks, weight replicated) returns its weight gradient
as a Partial sum that DTensor reduces across ranks.

Plain eager calls do not come here: they use the autograd.Functions of _autograd.py, which call the
same backend entry points with less host overhead and carry the torch.func rules (see `needed`).
The ops mutate nothing. A backward that autograd records (create_graph=True) is taken through the
differentiable backward of _autograd.py, as in eager.

Ops (namespace normkit), on tensors in their user-facing shapes, so sharded dims stay visible:
  row_norm_fwd(x, normalized_ndim, weight?, bias?, eps, rms, activation?, backend?) -> (y, mean, rstd)
  row_norm_bwd(dy, x, normalized_ndim, weight?, bias?, mean, rstd, rms, activation?,
               dweight_dtype?, dbias_dtype?, backend?) -> (dx, dweight, dbias)
  group_norm_fwd(x, num_groups, weight?, bias?, eps, activation?, backend?) -> (y, mean, rstd)
  group_norm_bwd(dy, x, num_groups, weight?, bias?, mean, rstd, activation?,
                 dweight_dtype?, dbias_dtype?, backend?) -> (dx, dweight, dbias)
`backend` is the user's choice (None: automatic), resolved inside the op on the real tensors: so
tracing never imports a backend, and a forced backend that cannot run raises when the op runs.
A custom op cannot return None, so an absent result (RMSNorm's mean, a gradient nobody asked for)
is an empty tensor; the Python wrappers below turn it back into None.
"""
import sys
from typing import Optional

import torch
from torch import Tensor

from . import _autograd, backends
from ._layout import as_rows, bcs, flat_param, fresh, from_bcs, is_channels_last

__all__ = ["needed", "row_norm", "row_norm_with_stats", "row_norm_grads", "group_norm"]

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


def _extra_fwd(activation):
    # passed only when set, so a backend without fused activations still serves the plain ops
    return {} if activation is None else {"activation": activation}


def _extra_bwd(bias, activation):
    return {} if activation is None else {"bias": bias, "activation": activation}


def _absent(like: Tensor, dtype=None) -> Tensor:
    return like.new_empty((0,), dtype=dtype if dtype is not None else like.dtype)


# ----------------------------------------------------------------------------- row norm (LN / RMS)

@torch.library.custom_op("normkit::row_norm_fwd", mutates_args=())
def _row_norm_fwd(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                  rms: bool, activation: Optional[str], backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    shape = tuple(x.shape[x.dim() - normalized_ndim:])
    lead = tuple(x.shape[: x.dim() - normalized_ndim])
    y, mean, rstd = _resolve(backend, x, "rms_norm" if rms else "layer_norm").row_norm_fwd(
        as_rows(x, shape), flat_param(weight), flat_param(bias), eps, rms, **_extra_fwd(activation))
    mean = _absent(rstd) if mean is None else fresh(mean.view(lead))
    return fresh(y.view(x.shape)), mean, fresh(rstd.view(lead))


@_row_norm_fwd.register_fake
def _(x, normalized_ndim, weight, bias, eps, rms, activation, backend):
    lead = x.shape[: x.dim() - normalized_ndim]
    rstd = x.new_empty(lead, dtype=_stat_dtype(x))
    mean = _absent(rstd) if rms else x.new_empty(lead, dtype=_stat_dtype(x))
    return x.new_empty(x.shape), mean, rstd


@torch.library.custom_op("normkit::row_norm_bwd", mutates_args=())
def _row_norm_bwd(dy: Tensor, x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor],
                  mean: Tensor, rstd: Tensor, rms: bool, activation: Optional[str],
                  dweight_dtype: Optional[torch.dtype], dbias_dtype: Optional[torch.dtype],
                  backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    shape = tuple(x.shape[x.dim() - normalized_ndim:])
    be = _resolve(backend, x, "rms_norm backward" if rms else "layer_norm backward", backward=True)
    dx, dw, db = be.row_norm_bwd(
        as_rows(dy, shape), as_rows(x, shape), flat_param(weight),
        None if rms else mean.reshape(-1), rstd.reshape(-1), rms, dweight_dtype, dbias_dtype,
        **_extra_bwd(flat_param(bias), activation))
    dw = _absent(x, dweight_dtype) if dw is None else fresh(dw.view(shape))
    db = _absent(x, dbias_dtype) if db is None else fresh(db.view(shape))
    return fresh(dx.view(x.shape)), dw, db


@_row_norm_bwd.register_fake
def _(dy, x, normalized_ndim, weight, bias, mean, rstd, rms, activation, dweight_dtype, dbias_dtype, backend):
    shape = x.shape[x.dim() - normalized_ndim:]
    dw = _absent(x, dweight_dtype) if dweight_dtype is None else x.new_empty(shape, dtype=dweight_dtype)
    db = _absent(x, dbias_dtype) if dbias_dtype is None else x.new_empty(shape, dtype=dbias_dtype)
    return x.new_empty(x.shape), dw, db


def _row_norm_setup(ctx, inputs, output):
    x, normalized_ndim, weight, bias, eps, rms, activation, backend = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.args = (normalized_ndim, eps, rms, activation, backend,
                None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _row_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    normalized_ndim, eps, rms, activation, backend, w_dtype, b_dtype = ctx.args
    need_dx, _, need_dw, need_db = ctx.needs_input_grad[:4]
    if torch.is_grad_enabled():  # create_graph=True: a backward autograd can differentiate again
        dx, dw, db = _autograd.row_norm_vjp_differentiable(dy, x, weight, bias, normalized_ndim, eps, rms, activation,
                                                      (need_dx, need_dw, need_db))
        return (dx, None, dw, db, None, None, None, None)
    dx, dw, db = _row_norm_bwd(dy, x, normalized_ndim, weight, bias if activation is not None else None, mean, rstd,
                               rms, activation, w_dtype if need_dw else None, b_dtype if need_db else None, backend)
    return (dx, None, dw if need_dw else None, db if need_db else None, None, None, None, None)


_row_norm_fwd.register_autograd(_row_norm_backward, setup_context=_row_norm_setup)


def row_norm(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
             rms: bool, backend: Optional[str], activation: Optional[str] = None) -> Tensor:
    """LayerNorm (rms=False) or RMSNorm over the trailing normalized_ndim dims of x, through the op.
    Arguments arrive checked by normkit.functional; backend is the user's (None: automatic)."""
    return _row_norm_fwd(x, normalized_ndim, weight, bias, eps, rms, activation, backend)[0]


def row_norm_with_stats(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor],
                        eps: float, rms: bool, backend: Optional[str]):
    """The kernel-level forward through the op: (y, mean or None for RMSNorm, rstd)."""
    y, mean, rstd = _row_norm_fwd(x, normalized_ndim, weight, bias, eps, rms, None, backend)
    return y, (None if rms else mean), rstd


def row_norm_grads(dy: Tensor, x: Tensor, normalized_ndim: int, weight: Optional[Tensor], mean: Optional[Tensor],
                   rstd: Tensor, rms: bool, dweight_dtype, dbias_dtype, backend: Optional[str]):
    """The kernel-level backward through the op: (dx, dweight or None, dbias or None)."""
    dx, dw, db = _row_norm_bwd(dy, x, normalized_ndim, weight, None,
                               _absent(rstd) if mean is None else mean, rstd, rms, None, dweight_dtype, dbias_dtype,
                               backend)
    return dx, (dw if dweight_dtype is not None else None), (db if dbias_dtype is not None else None)


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


@torch.library.custom_op("normkit::group_norm_fwd", mutates_args=())
def _group_norm_fwd(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                    activation: Optional[str], backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    y3, mean, rstd = _resolve(backend, x, "group_norm").group_norm_fwd(
        bcs(x, is_channels_last(x)), num_groups, weight, bias, eps, activation)
    return fresh(from_bcs(y3, x.shape)), fresh(mean), fresh(rstd)


@_group_norm_fwd.register_fake
def _(x, num_groups, weight, bias, eps, activation, backend):
    stats = (x.shape[0], num_groups)
    return _like_layout(x, is_channels_last(x)), x.new_empty(stats, dtype=_stat_dtype(x)), \
        x.new_empty(stats, dtype=_stat_dtype(x))


@torch.library.custom_op("normkit::group_norm_bwd", mutates_args=())
def _group_norm_bwd(dy: Tensor, x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
                    mean: Tensor, rstd: Tensor, activation: Optional[str], dweight_dtype: Optional[torch.dtype],
                    dbias_dtype: Optional[torch.dtype], backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    channels_last = is_channels_last(x)
    dx3, dw, db = _resolve(backend, x, "group_norm backward", backward=True).group_norm_bwd(
        bcs(dy, channels_last), bcs(x, channels_last), num_groups, weight, bias, mean, rstd,
        activation, dweight_dtype, dbias_dtype)
    dw = _absent(x, dweight_dtype) if dw is None else fresh(dw)
    db = _absent(x, dbias_dtype) if db is None else fresh(db)
    return fresh(from_bcs(dx3, x.shape)), dw, db


@_group_norm_bwd.register_fake
def _(dy, x, num_groups, weight, bias, mean, rstd, activation, dweight_dtype, dbias_dtype, backend):
    c = x.shape[1]
    dw = _absent(x, dweight_dtype) if dweight_dtype is None else x.new_empty((c,), dtype=dweight_dtype)
    db = _absent(x, dbias_dtype) if dbias_dtype is None else x.new_empty((c,), dtype=dbias_dtype)
    return _like_layout(x, is_channels_last(x)), dw, db


def _group_norm_setup(ctx, inputs, output):
    x, num_groups, weight, bias, eps, activation, backend = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.args = (num_groups, eps, activation, backend,
                None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _group_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    num_groups, eps, activation, backend, w_dtype, b_dtype = ctx.args
    need_dx, _, need_dw, need_db = ctx.needs_input_grad[:4]
    if torch.is_grad_enabled():  # create_graph=True: a backward autograd can differentiate again
        dx, dw, db = _autograd.group_norm_vjp_differentiable(dy, x, weight, bias, num_groups, eps, activation,
                                                        (need_dx, need_dw, need_db))
        return (dx, None, dw, db, None, None, None)
    dx, dw, db = _group_norm_bwd(dy, x, num_groups, weight, bias if activation is not None else None, mean, rstd,
                                 activation, w_dtype if need_dw else None, b_dtype if need_db else None, backend)
    return (dx, None, dw if need_dw else None, db if need_db else None, None, None, None)


_group_norm_fwd.register_autograd(_group_norm_backward, setup_context=_group_norm_setup)


def group_norm(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
               backend: Optional[str], activation: Optional[str] = None) -> Tensor:
    """GroupNorm of x [B, C, *spatial] through the op; arguments arrive checked by functional."""
    return _group_norm_fwd(x, num_groups, weight, bias, eps, activation, backend)[0]


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

    @register_sharding(torch.ops.normkit.row_norm_fwd.default)
    def _(x, normalized_ndim, weight, bias, eps, rms, activation, backend):
        rules = [([Replicate()] * 3, [Replicate(), None, p(weight), p(bias), None, None, None, None])]
        for d in range(x.ndim - normalized_ndim):
            rules.append(([Shard(d), rep_or(Shard(d), not rms), Shard(d)],
                          [Shard(d), None, p(weight), p(bias), None, None, None, None]))
        return rules

    @register_sharding(torch.ops.normkit.row_norm_bwd.default)
    def _(dy, x, normalized_ndim, weight, bias, mean, rstd, rms, activation, dw_dtype, db_dtype, backend):
        tail = [None, None, None, None, None]
        rules = [([Replicate()] * 3,
                  [Replicate(), Replicate(), None, p(weight), p(bias), Replicate(), Replicate()] + tail)]
        for d in range(x.ndim - normalized_ndim):
            rules.append(([Shard(d), rep_or(Partial(), dw_dtype is not None), rep_or(Partial(), db_dtype is not None)],
                          [Shard(d), Shard(d), None, p(weight), p(bias), rep_or(Shard(d), not rms), Shard(d)] + tail))
        return rules

    @register_sharding(torch.ops.normkit.group_norm_fwd.default)
    def _(x, num_groups, weight, bias, eps, activation, backend):
        return [([Replicate()] * 3, [Replicate(), None, p(weight), p(bias), None, None, None]),
                ([Shard(0)] * 3, [Shard(0), None, p(weight), p(bias), None, None, None])]

    @register_sharding(torch.ops.normkit.group_norm_bwd.default)
    def _(dy, x, num_groups, weight, bias, mean, rstd, activation, dw_dtype, db_dtype, backend):
        tail = [None, None, None, None]
        rep = Replicate()
        return [([rep] * 3, [rep, rep, None, p(weight), p(bias), rep, rep] + tail),
                ([Shard(0), rep_or(Partial(), dw_dtype is not None), rep_or(Partial(), db_dtype is not None)],
                 [Shard(0), Shard(0), None, p(weight), p(bias), Shard(0), Shard(0)] + tail)]


_register_sharding()  # now if DTensor is already imported; else on the first tensor subclass seen
