"""The float64 oracle: every test and every benchmark compares against these functions.

They are written for clarity, not speed: upcast to float64, apply the textbook formula with
torch ops, and let float64 autograd produce the reference gradients.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = [
    "ACTIVATIONS",
    "layer_norm",
    "rms_norm",
    "group_norm",
    "layer_norm_backward",
    "rms_norm_backward",
    "group_norm_backward",
    "activation",
    "residual_sum",
    "modulate",
    "gated",
    "output_value",
    "amax",
    "FP8_MAX",
    "rel_err",
    "default_rms_eps",
]

_f64 = torch.float64


def default_rms_eps(dtype: torch.dtype) -> float:
    """The eps torch's F.rms_norm uses when eps=None: machine epsilon of the compute (opmath) type."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


ACTIVATIONS = ("silu", "mish", "gelu", "gelu_tanh", "relu")


def activation(y: torch.Tensor, name: Optional[str]) -> torch.Tensor:
    """The fused-epilogue activations, applied after the affine transform."""
    if name is None:
        return y
    if name == "relu":
        return torch.relu(y)
    if name == "silu":
        return y * torch.sigmoid(y)
    if name == "mish":
        return y * torch.tanh(torch.nn.functional.softplus(y))
    if name == "gelu":
        return 0.5 * y * (1.0 + torch.erf(y / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y**3)))
    raise ValueError(f"activation: unknown name {name!r}")


def _dims(x: torch.Tensor, normalized_shape: Sequence[int]) -> tuple[int, ...]:
    k = len(tuple(normalized_shape))
    return tuple(range(x.dim() - k, x.dim()))


# the largest finite value of each float8 output format: fp8 outputs saturate there
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def residual_sum(x, residual, residual_dtype=None):
    """h = x + residual, the tensor a fused residual add normalizes and returns: the exact sum
    rounded to residual_dtype (default: residual's dtype), as float64. The rounding is invisible to
    autograd (its gradient is the identity), as the kernels treat it."""
    h = x.to(_f64) + residual.to(_f64)
    return h + (h.to(residual_dtype or residual.dtype).to(_f64) - h).detach()


def gated(x, gate=None):
    """x * silu(gate) in float64, what a gated norm (Mamba-2's MambaRMSNormGated) normalizes; x
    alone where gate is None. No rounding in between: the kernels form it in fp32 and normalize it."""
    x = x.to(_f64)
    if gate is None:
        return x
    g = gate.to(_f64)
    return x * (g * torch.sigmoid(g))


def _affine(y, weight, bias, weight_offset):
    if weight is not None:
        y = y * (weight.to(_f64) + weight_offset)
    if bias is not None:
        y = y + bias.to(_f64)
    return y


def modulate(y, scale=None, shift=None, normalized_ndim: int = 1):
    """adaLN modulation y * (1 + scale) + shift in float64, scale and shift per sample: their lead dims
    are aligned with y's leading dims from the left ((B, N) and (B, 1, N) both act on every token of a
    (B, T, N) y), as normkit's scale=/shift= options take them."""
    def per_sample(t):
        lead = t.shape[: t.dim() - normalized_ndim]
        ones = (1,) * (y.dim() - normalized_ndim - len(lead))
        return t.to(_f64).reshape(tuple(lead) + ones + tuple(t.shape[t.dim() - normalized_ndim:]))
    if scale is not None:
        y = y * (1.0 + per_sample(scale))
    if shift is not None:
        y = y + per_sample(shift)
    return y


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, activation_name=None, *, residual=None,
               residual_dtype=None, weight_offset=0.0, scale=None, shift=None, gate=None):
    """float64 LayerNorm. Returns (y, mean, rstd); mean/rstd have x's leading shape.
    residual: normalizes h = residual_sum(x, residual, residual_dtype). weight_offset: y = xhat * (offset + w) + b.
    scale, shift: adaLN modulation (`modulate`) of the affine output, before the activation.
    gate: normalizes x * silu(gate) (`gated`)."""
    x = gated(x, gate) if residual is None else residual_sum(x, residual, residual_dtype)
    dims = _dims(x, normalized_shape)
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)  # two-pass: exact in float64
    rstd = torch.rsqrt(var + eps)
    y = _affine((x - mean) * rstd, weight, bias, weight_offset)
    y = activation(modulate(y, scale, shift, len(dims)), activation_name)
    lead = x.shape[: x.dim() - len(dims)]
    return y, mean.reshape(lead), rstd.reshape(lead)


def rms_norm(x, normalized_shape, weight=None, eps=None, activation_name=None, *, residual=None, residual_dtype=None,
             weight_offset=0.0, scale=None, shift=None, gate=None):
    """float64 RMSNorm. Returns (y, rstd); rstd has x's leading shape. residual, weight_offset, scale,
    shift, gate: as layer_norm."""
    if eps is None:
        eps = default_rms_eps(x.dtype)
    x = gated(x, gate) if residual is None else residual_sum(x, residual, residual_dtype)
    dims = _dims(x, normalized_shape)
    rstd = torch.rsqrt((x * x).mean(dim=dims, keepdim=True) + eps)
    y = activation(modulate(_affine(x * rstd, weight, None, weight_offset), scale, shift, len(dims)), activation_name)
    lead = x.shape[: x.dim() - len(dims)]
    return y, rstd.reshape(lead)


def output_value(y, out_dtype=None, out_scale=None):
    """What a normalized output y holds in out_dtype, in float64: y itself, or for float8 formats
    y * out_scale saturated to the format's largest finite value (NaN stays NaN), before rounding."""
    y = y.to(_f64)
    if out_dtype not in FP8_MAX:
        return y
    scale = float(out_scale) if not isinstance(out_scale, torch.Tensor) else out_scale.to(_f64).reshape(())
    return (y * scale).clamp(-FP8_MAX[out_dtype], FP8_MAX[out_dtype])


def amax(y):
    """max |y| over all elements (NaN if any is NaN): the statistic delayed fp8 scaling keeps."""
    return y.to(_f64).abs().amax() if y.numel() else torch.zeros((), dtype=_f64)


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, activation_name=None):
    """float64 GroupNorm over (C/G, *spatial) per group. Returns (y, mean, rstd) of shape (B, G)."""
    x = x.to(_f64)
    B, C = x.shape[0], x.shape[1]
    xg = x.reshape(B, num_groups, -1)
    mean = xg.mean(dim=-1, keepdim=True)
    var = ((xg - mean) ** 2).mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = ((xg - mean) * rstd).reshape(x.shape)
    affine_shape = (1, C) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.to(_f64).reshape(affine_shape)
    if bias is not None:
        y = y + bias.to(_f64).reshape(affine_shape)
    y = activation(y, activation_name)
    return y, mean.reshape(B, num_groups), rstd.reshape(B, num_groups)


def _grads(f, dy, x, params):
    """float64 autograd of y = f(x, *params); returns (dx, *dparams), None for absent params."""
    x64 = x.detach().to(_f64).requires_grad_(True)
    p64 = [None if p is None else p.detach().to(_f64).requires_grad_(True) for p in params]
    y = f(x64, *p64)
    live = [x64] + [p for p in p64 if p is not None]
    grads = iter(torch.autograd.grad(y, live, dy.to(_f64)))
    dx = next(grads)
    return (dx,) + tuple(None if p is None else next(grads) for p in p64)


def layer_norm_backward(dy, x, normalized_shape, weight=None, bias=None, eps=1e-5, activation_name=None, *,
                        weight_offset=0.0, scale=None, shift=None, gate=None):
    """float64 (dx, dweight, dbias) of layer_norm; None where weight/bias is None. With scale= or
    shift= (adaLN modulation): (dx, dweight, dbias, dscale, dshift), None where absent. With gate=:
    (dx, dweight, dbias, dgate)."""
    f = lambda x_, w_, b_, s_, t_, g_: layer_norm(x_, normalized_shape, w_, b_, eps, activation_name,  # noqa: E731
                                                  weight_offset=weight_offset, scale=s_, shift=t_, gate=g_)[0]
    grads = _grads(f, dy, x, [weight, bias, scale, shift, gate])
    if gate is not None:
        return grads[:3] + grads[5:]
    return grads[:5] if scale is not None or shift is not None else grads[:3]


def rms_norm_backward(dy, x, normalized_shape, weight=None, eps=None, activation_name=None, *, weight_offset=0.0,
                      scale=None, shift=None, gate=None):
    """float64 (dx, dweight) of rms_norm; dweight is None where weight is None. With scale= or
    shift=: (dx, dweight, dscale, dshift). With gate=: (dx, dweight, dgate)."""
    eps = default_rms_eps(x.dtype) if eps is None else eps
    f = lambda x_, w_, s_, t_, g_: rms_norm(x_, normalized_shape, w_, eps, activation_name,  # noqa: E731
                                            weight_offset=weight_offset, scale=s_, shift=t_, gate=g_)[0]
    grads = _grads(f, dy, x, [weight, scale, shift, gate])
    if gate is not None:
        return grads[:2] + grads[4:]
    return grads[:4] if scale is not None or shift is not None else grads[:2]


def group_norm_backward(dy, x, num_groups, weight=None, bias=None, eps=1e-5, activation_name=None):
    """float64 (dx, dweight, dbias) of group_norm; None where weight/bias is None."""
    f = lambda x_, w_, b_: group_norm(x_, num_groups, w_, b_, eps, activation_name)[0]
    return _grads(f, dy, x, [weight, bias])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 over finite reference entries.

    A NaN/inf in `out` where the reference is finite makes the error inf, so it can never pass.
    Entries where the reference itself is non-finite must match it exactly in kind (NaN for NaN).
    """
    out = out.detach().to("cpu", _f64)
    ref = ref.detach().to("cpu", _f64)
    if out.shape != ref.shape:
        raise ValueError(f"rel_err: shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isnan(out[~finite]), torch.isnan(ref[~finite])):
        return math.inf
    if not torch.equal(out[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)]):
        return math.inf
    o, r = out[finite], ref[finite]
    if not torch.isfinite(o).all():
        return math.inf
    denom = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom
