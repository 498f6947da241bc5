"""The public functions: argument checks, flattening to rows, autograd, and backend dispatch.

Every op reduces to "normalize each row of an [M, N] matrix": the trailing normalized_shape dims
are the row, all leading dims are rows. Rows are passed to the kernels as a strided view when the
layout allows (unit stride inside a row, one stride between rows); otherwise x is copied once.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Optional, Sequence, Union

import torch

from . import _host, _library, backends
from ._autograd import GroupNormFn, RowNormFn, transforms_active
from ._layout import as_rows, bcs, flat_param, from_bcs, is_channels_last
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
    if type(eps) is float and 0.0 <= eps < math.inf:
        return eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps: expected a real number, got {eps!r}")
    eps = float(eps)
    if not eps >= 0.0 or math.isinf(eps):  # also rejects NaN
        raise ValueError(f"eps: expected a finite number >= 0, got {eps}")
    return eps


def _check_activation(activation) -> None:
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None or one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")


def _check_param(p, arg: str, shape, x: torch.Tensor, device) -> None:
    if p is None:
        return
    _check_tensor(p, arg)
    if p.shape != shape:
        raise ValueError(f"{arg}: expected shape {tuple(shape)}, got {tuple(p.shape)}")
    if p.device != device:
        raise ValueError(f"{arg}: expected a tensor on x's device {device}, got one on {p.device}")


def _check_inputs(x, normalized_shape, weight, bias, eps):
    _check_tensor(x, "x")
    shape = _normalized_shape(normalized_shape)
    if x.shape[x.dim() - len(shape):] != shape or x.dim() < len(shape):
        raise ValueError(f"normalized_shape: expected the trailing dims of x, whose shape is {tuple(x.shape)}, "
                         f"got {shape}")
    if weight is not None or bias is not None:
        device = x.device
        _check_param(weight, "weight", shape, x, device)
        _check_param(bias, "bias", shape, x, device)
    return shape, _check_eps(eps)


# ----------------------------------------------------------------------------- dispatch

# the layout helpers under their historical names (tests and the bench import them from here)
_as_rows, _flat_param, _bcs, _from_bcs, _is_channels_last = as_rows, flat_param, bcs, from_bcs, is_channels_last
_is_compiling = torch.compiler.is_compiling


def _param_grad_dtype(p, wanted: bool):
    return p.dtype if (p is not None and wanted) else None


def _needs_autograd(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _forward_only_check(backend, op, *tensors) -> None:
    if not getattr(backend, "HAS_BACKWARD", True) and _needs_autograd(*tensors):
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


@functools.lru_cache(maxsize=None)
def _autocast_upcasts(op: str, device_type: str) -> bool:
    """Whether this torch build gives aten::`op` an autocast kernel on `device_type` (the norms are
    only ever on autocast's float32 list): read from the dispatcher, so it follows torch's version.
    False for device types autocast does not know (meta, ...)."""
    if not torch.amp.autocast_mode.is_autocast_available(device_type):
        return False
    key = "Autocast" + {"cuda": "CUDA", "cpu": "CPU", "xpu": "XPU", "mps": "MPS"}.get(device_type, device_type.upper())
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)
    except RuntimeError:  # a dispatch key this build does not know
        return False


def _row_norm(x, shape, weight, bias, eps, rms, activation, backend_name, op):
    """Checked arguments -> y, through the custom op (compile, modes, subclasses), the autograd
    function (gradients, torch.func, forward AD) or straight to the kernels (inference). The host
    path is asked again here: the public functions ask it first, but a call it declined there may
    be its case now (inputs cast by autocast, or a row_norm_as_written call)."""
    fast = _host.fast
    if fast is not None and not _is_compiling():
        y = fast.row_norm(x, shape, weight, bias, eps, rms, activation, backend_name)
        if y is not None:
            return y
    if _library.needed(x, weight, bias):
        return _library.row_norm(x, len(shape), weight, bias, eps, rms, backend_name, activation=activation)
    backend = backends.resolve(backend_name, x, op)
    if _needs_autograd(x, weight, bias) or transforms_active():
        _forward_only_check(backend, op, x, weight, bias)
        return RowNormFn.apply(x, weight, bias, len(shape), eps, rms, activation, backend)[0]
    # inference: no statistics to keep, so the kernel need not write them
    y, _, _ = backend.row_norm_fwd(as_rows(x, shape), flat_param(weight), flat_param(bias), eps, rms,
                                   activation, store_stats=False)
    return y if x.dim() == 2 and len(shape) == 1 else y.view(x.shape)


def row_norm_as_written(x, normalized_shape, weight, bias, eps, rms: bool, *, activation=None, backend=None):
    """LayerNorm/RMSNorm without torch's autocast contract for F.layer_norm / F.rms_norm: computes in
    float32 and rounds to x's dtype whatever autocast says. For modules that write their norm out
    in explicit float32 ops (HF's RMSNorm classes), which autocast does not upcast as a whole."""
    if rms:
        _check_tensor(x, "x")
        eps = default_rms_eps(x.dtype) if eps is None else eps
    shape, eps = _check_inputs(x, normalized_shape, weight, None if rms else bias, eps)
    _check_activation(activation)
    return _row_norm(x, shape, weight, None if rms else bias, eps, rms, activation, backend,
                     "rms_norm" if rms else "layer_norm")


# ----------------------------------------------------------------------------- public API

def layer_norm(x: torch.Tensor, normalized_shape: ShapeLike, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, *, activation: Optional[str] = None,
               backend: Optional[str] = None) -> torch.Tensor:
    """LayerNorm over the trailing `normalized_shape` dims, as torch.nn.functional.layer_norm.

    activation: None, "silu", "mish", "gelu", "gelu_tanh" or "relu", applied after the affine
    transform in the same kernel (forward and backward).
    backend: None picks Triton for CUDA tensors and torch otherwise; a name forces that backend.
    Under CUDA autocast it computes in float32 and returns float32, as torch's layer_norm does.
    """
    fast = _host.fast
    if fast is not None and not _is_compiling():
        y = fast.row_norm(x, normalized_shape, weight, bias, eps, False, activation, backend)
        if y is not None:
            return y
    shape, eps = _check_inputs(x, normalized_shape, weight, bias, eps)
    _check_activation(activation)
    x, weight, bias = _autocast("layer_norm", x, weight, bias)
    return _row_norm(x, shape, weight, bias, eps, False, activation, backend, "layer_norm")


def rms_norm(x: torch.Tensor, normalized_shape: ShapeLike, weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None, *, activation: Optional[str] = None,
             backend: Optional[str] = None) -> torch.Tensor:
    """RMSNorm over the trailing `normalized_shape` dims, as torch.nn.functional.rms_norm.

    eps=None means torch's default: the machine epsilon of the compute type (float32, or float64).
    activation and backend are as in layer_norm; float32 under CUDA autocast, as torch's rms_norm.
    """
    fast = _host.fast
    if fast is not None and not _is_compiling():
        y = fast.row_norm(x, normalized_shape, weight, None, eps, True, activation, backend)
        if y is not None:
            return y
    _check_tensor(x, "x")
    shape, eps = _check_inputs(x, normalized_shape, weight, None, default_rms_eps(x.dtype) if eps is None else eps)
    _check_activation(activation)
    x, weight = _autocast("rms_norm", x, weight)
    return _row_norm(x, shape, weight, None, eps, True, activation, backend, "rms_norm")


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
        return _library.group_norm(x, num_groups, weight, bias, eps, backend, activation=activation)
    be = backends.resolve(backend, x, "group_norm")
    if _needs_autograd(x, weight, bias) or transforms_active():
        _forward_only_check(be, "group_norm", x, weight, bias)
        return GroupNormFn.apply(x, weight, bias, num_groups, eps, activation, be)[0]
    y3, _, _ = be.group_norm_fwd(bcs(x, is_channels_last(x)), num_groups, weight, bias, eps, activation)
    return from_bcs(y3, x.shape)


# ----------------------------------------------------------------------------- kernel-level API

def _stats_shape(x: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x.shape[: x.dim() - len(shape)])


def layer_norm_fwd(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, backend=None):
    """LayerNorm forward with its statistics: (y, mean, rstd).

    mean and rstd are float32 (float64 for float64 input) with x's leading shape. No autograd.
    """
    shape, eps = _check_inputs(x, normalized_shape, weight, bias, eps)
    if _library.needed(x, weight, bias):  # torch.compile, DTensor, dispatch modes: the custom op
        return _library.row_norm_with_stats(x, len(shape), weight, bias, eps, False, backend)
    be = backends.resolve(backend, x, "layer_norm_fwd")
    y, mean, rstd = be.row_norm_fwd(_as_rows(x, shape), _flat_param(weight), _flat_param(bias), eps, False)
    lead = _stats_shape(x, shape)
    return y.view(x.shape), mean.view(lead), rstd.view(lead)


def rms_norm_fwd(x, normalized_shape, weight=None, eps=None, *, backend=None):
    """RMSNorm forward with its statistic: (y, rstd). rstd is float32 with x's leading shape."""
    _check_tensor(x, "x")
    shape, eps = _check_inputs(x, normalized_shape, weight, None, default_rms_eps(x.dtype) if eps is None else eps)
    if _library.needed(x, weight):
        y, _, rstd = _library.row_norm_with_stats(x, len(shape), weight, None, eps, True, backend)
        return y, rstd
    be = backends.resolve(backend, x, "rms_norm_fwd")
    y, _, rstd = be.row_norm_fwd(_as_rows(x, shape), _flat_param(weight), None, eps, True)
    return y.view(x.shape), rstd.view(_stats_shape(x, shape))


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
    _check_param(weight, "weight", shape, x, x.device)
    return shape


def _stat_rows(s: torch.Tensor) -> torch.Tensor:
    return s.reshape(-1).to(torch.float64 if s.dtype == torch.float64 else torch.float32).contiguous()


def layer_norm_bwd(dy, x, weight, mean, rstd, *, backend=None):
    """LayerNorm backward from saved statistics: (dx, dweight, dbias).

    dweight is None when weight is None; dbias (the column sums of dy) is always returned, in
    weight's dtype (x's dtype without a weight). The dweight/dbias sums are deterministic.
    """
    shape = _check_bwd(dy, x, weight, {"mean": mean, "rstd": rstd})
    if _library.needed(dy, x, weight, mean, rstd):
        return _library.row_norm_grads(dy, x, len(shape), weight, _stat_rows(mean), _stat_rows(rstd), False,
                                       _param_grad_dtype(weight, True), weight.dtype if weight is not None else x.dtype,
                                       backend)
    be = backends.resolve(backend, x, "layer_norm_bwd")
    dx, dw, db = be.row_norm_bwd(_as_rows(dy, shape), _as_rows(x, shape), _flat_param(weight), _stat_rows(mean), _stat_rows(rstd), False,
                                 _param_grad_dtype(weight, True), weight.dtype if weight is not None else x.dtype)
    return dx.view(x.shape), (dw.view(shape) if dw is not None else None), db.view(shape)


def rms_norm_bwd(dy, x, weight, rstd, *, backend=None):
    """RMSNorm backward from the saved statistic: (dx, dweight); dweight is None without weight."""
    shape = _check_bwd(dy, x, weight, {"rstd": rstd})
    if _library.needed(dy, x, weight, rstd):
        dx, dw, _ = _library.row_norm_grads(dy, x, len(shape), weight, None, _stat_rows(rstd), True,
                                            _param_grad_dtype(weight, True), None, backend)
        return dx, dw
    be = backends.resolve(backend, x, "rms_norm_bwd")
    dx, dw, _ = be.row_norm_bwd(_as_rows(dy, shape), _as_rows(x, shape), _flat_param(weight), None, _stat_rows(rstd), True,
                                _param_grad_dtype(weight, True), None)
    return dx.view(x.shape), (dw.view(shape) if dw is not None else None)
