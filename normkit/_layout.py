"""How user tensors become what the backends take, and back: rows for LayerNorm/RMSNorm,
[B, C, S] for GroupNorm. Views wherever the memory layout allows, a copy only where none exists.

Shared by the eager autograd functions (_autograd.py) and the custom ops (_library.py).
"""
from __future__ import annotations

import math

import torch


def as_rows(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[M, N] view of t (N = prod(shape) of its trailing dims) with unit column stride,
    copying only when no such view exists."""
    if len(shape) == 1 and t.dim() == 2 and (t.stride(1) == 1 or shape[0] <= 1):
        return t
    m, n = math.prod(t.shape[: t.dim() - len(shape)]), math.prod(shape)
    try:
        rows = t.view(m, n)
    except RuntimeError:  # leading dims cannot merge into one row stride
        rows = t.reshape(m, n)
    if n > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def flat_param(p):
    """A weight/bias of the normalized shape as a contiguous 1-D tensor (a view when it already is one)."""
    if p is None or (p.dim() == 1 and p.is_contiguous()):
        return p
    return p.reshape(-1).contiguous()


def fresh(t):
    """t as a tensor autograd does not see as a view. Outputs of an autograd.Function that are views
    of tensors made inside it cannot be modified in place (autograd forbids it), so every output
    reshaped from the kernels' [M, N] buffers goes through here. detach() shares the storage and
    costs no copy."""
    return t.detach() if t is not None and t._is_view() else t


def bcs(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """[B, C, S] view of a [B, C, *spatial] tensor in the given layout, copying only if t is in
    neither: NCHW ([B, C, S] contiguous) or channels_last (channels innermost)."""
    B, C = t.shape[0], t.shape[1]
    S = math.prod(t.shape[2:])  # explicit: a -1 is ambiguous for an empty batch
    if not channels_last:
        return t.contiguous().view(B, C, S)
    perm = (0,) + tuple(range(2, t.dim())) + (1,)
    return t.permute(perm).contiguous().view(B, S, C).transpose(1, 2)


def is_channels_last(x: torch.Tensor) -> bool:
    """Channels innermost in memory (torch's channels_last for 4-D, its analogue for any rank)."""
    if x.dim() < 3 or x.is_contiguous() or x.shape[1] == 1:
        return False
    return x.permute((0,) + tuple(range(2, x.dim())) + (1,)).is_contiguous()


def from_bcs(y3: torch.Tensor, shape) -> torch.Tensor:
    """Back from [B, C, S] to [B, C, *spatial], keeping y3's memory layout."""
    if y3.is_contiguous():
        return y3.view(shape)
    B, C = shape[0], shape[1]
    nhwc = y3.transpose(1, 2).view((B,) + tuple(shape[2:]) + (C,))
    return nhwc.permute((0, nhwc.dim() - 1) + tuple(range(1, nhwc.dim() - 1)))


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The compute (and statistics) dtype for x: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
