"""The plain torch backend: the same row-normalization math as the kernels, in torch ops.

It runs wherever torch runs (CPU, CUDA, float64 included) and computes in float32, or in float64
for float64 inputs. Same interface as every backend: x is [M, N] with unit column stride.
"""
from __future__ import annotations

import torch

NAME = "torch"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def why_unavailable(x: torch.Tensor) -> str | None:
    if x.dtype not in DTYPES:
        return f"it supports floating-point inputs, not {x.dtype}"
    return None


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _xhat(x, mean, rstd):
    xf = x.to(_acc(x))
    return (xf if mean is None else xf - mean[:, None]) * rstd[:, None]


def row_norm_fwd(x, weight, bias, eps: float, rms: bool):
    acc = _acc(x)
    xf = x.to(acc)
    if rms:
        mean, xc = None, xf
    else:
        # two passes over data shifted by each row's first element, as the kernels do; y comes
        # from the shifted data too, so the rounding of the stored mean never reaches it
        shift = xf[:, :1]
        xs = xf - shift
        mean_s = xs.mean(dim=1, keepdim=True)
        xc = xs - mean_s
        mean = (shift + mean_s).squeeze(1)
    rstd = torch.rsqrt(xc.square().mean(dim=1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype), mean, rstd


def row_norm_bwd(dy, x, weight, mean, rstd, rms: bool, dweight_dtype, dbias_dtype):
    acc = _acc(x)
    N = x.shape[1]
    xhat = _xhat(x, None if rms else mean.to(acc), rstd.to(acc))
    dyf = dy.to(acc)
    wdy = dyf * weight.to(acc) if weight is not None else dyf
    c1 = (xhat * wdy).sum(dim=1, keepdim=True) / N
    dx = wdy - xhat * c1
    if not rms:
        dx = dx - wdy.sum(dim=1, keepdim=True) / N
    dx = (dx * rstd.to(acc)[:, None]).to(x.dtype)
    dw = (dyf * xhat).sum(dim=0).to(dweight_dtype) if dweight_dtype is not None else None
    db = dyf.sum(dim=0).to(dbias_dtype) if dbias_dtype is not None else None
    return dx, dw, db
