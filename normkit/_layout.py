"""How user tensors become what the backends take, and back: rows for LayerNorm/RMSNorm ([M, N],
or [O, I, N] where the rows need two strides), [B, C, S] for GroupNorm. Views wherever the memory
layout allows, a copy only where none exists.

Shared by the eager autograd functions (_autograd.py) and the custom ops (_library.py).
"""
from __future__ import annotations

import math

import torch


def _merged(sizes, strides) -> list:
    """Adjacent dims merged where memory allows, size-1 dims dropped: [(size, stride)], outermost first."""
    out = []
    for size, stride in zip(sizes, strides):
        if size == 1:
            continue
        if out and out[-1][1] == stride * size:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def row_view(t: torch.Tensor, shape: tuple[int, ...], strided: bool = True, lead=None) -> torch.Tensor:
    """The rows of t (its trailing `shape` dims are a row) as a view wherever memory allows:
    [M, N] with one row stride, or, where the leading dims need two strides (q/k heads sliced out of
    a fused QKV projection: row r is (r // I, r % I)), [O, I, N]. With strided=True (backends that
    take any column stride) the column stride is free too (LayerNorm over the channels of an NCHW
    tensor); else the columns must be contiguous. `lead` forces the leading sizes ((M,) or (O, I)):
    the layout of another operand the kernel walks with the same row index. A copy is made only
    where no such view exists."""
    k = len(shape)
    if k == 1 and t.dim() == 2 and lead is None and (strided or t.stride(1) == 1 or shape[0] <= 1):
        return t  # already [M, N]: the common call, decided without the general walk below
    n = math.prod(shape)
    sizes, strides = tuple(t.shape), t.stride()
    cols = _merged(sizes[len(sizes) - k:], strides[len(strides) - k:])
    rows = _merged(sizes[: len(sizes) - k], strides[: len(strides) - k])
    col_stride = cols[0][1] if len(cols) == 1 else 1
    m = math.prod(sizes[: len(sizes) - k])
    want = lead if lead is not None else ((m,) if len(rows) <= 1 or not strided else tuple(r[0] for r in rows))
    view_strides = None
    if len(cols) <= 1 and (strided or col_stride == 1 or n <= 1):
        if len(want) == 1 and len(rows) <= 1:
            view_strides = (rows[0][1] if rows else n * col_stride,)
        elif len(want) == 2 and strided:
            if not rows:
                view_strides = (0, 0)
            elif len(rows) == 1:
                view_strides = (rows[0][1] * want[1], rows[0][1])
            elif len(rows) == 2 and rows[1][0] == want[1]:
                view_strides = (rows[0][1], rows[1][1])
    if view_strides is not None:  # view() computes exactly these strides (and works on tensor subclasses)
        return t.view(tuple(want) + (n,))
    return t.contiguous().view(tuple(lead if lead is not None else (m,)) + (n,))


def as_rows(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The rows of t (N = prod(shape) of its trailing dims) as the Triton and torch kernels take
    them: an [M, N] or [O, I, N] view with any strides (q/k heads, NCHW channels read in place),
    copying only when no such view exists. Backends that need [M, N] with unit column stride get
    row_view(t, shape, strided=False)."""
    return row_view(t, shape, strided=True)


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


# ----------------------------------------------------------------------------- adaLN modulation tables

def sample_rows(t_shape, x_shape, k: int):
    """(S, rows per sample) for a modulation tensor of shape t_shape (lead + the k normalized dims)
    applied per sample to x of shape x_shape: t's lead is aligned with x's leading dims from the
    left ((B, N) and (B, 1, N) both mean one row per sample of a (B, T, N) x), and must equal a
    prefix of them followed by ones only, so that rows r of x use table row r // (rows per sample).
    None where t's lead is not of that form (per token, or not broadcastable)."""
    lead, nt = tuple(x_shape[: len(x_shape) - k]), len(t_shape) - k
    if nt > len(lead):
        return None
    # plain loops over t's lead (dynamo traces them), no padded copy: asked at every modulated CPU call
    last = -1  # the last dim that is not broadcast (t's lead padded with ones)
    for i in range(nt):
        if t_shape[i] != 1:
            last = i
    for i in range(last + 1):
        if t_shape[i] != lead[i]:
            return None
    return math.prod(lead[: last + 1]), math.prod(lead[last + 1:])


def mod_table(t, n: int):
    """A modulation tensor (lead + normalized dims) as the kernels take it: [S, n] with unit column
    stride (a view where it is one, e.g. a chunk of diffusers' embedding; else a copy); None stays None."""
    if t is None:
        return None
    table = t.reshape(-1, n) if n else t.reshape(math.prod(t.shape[: t.dim() - 1]), 0)
    return table if table.stride(-1) == 1 or n <= 1 else table.contiguous()
