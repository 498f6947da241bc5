"""The Triton backend: host wrappers that size grids and launch the kernels in kernels.py.

Inputs arrive already checked and flattened by normkit.functional: x is [M, N] with unit column
stride (rows may be strided), weight/bias are contiguous [N] or None.
"""
from __future__ import annotations

import functools
import os

import torch

from .configs import COL_SUM_BLOCK, BWD_PROGRAMS_PER_SM, INTERPRETER_PROGRAMS, row_config

NAME = "triton"
# every buffer a kernel must fully write is allocated through this name, so tests can poison it
_empty = torch.empty
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def _kernels():
    from . import kernels  # imports triton; deferred so `import normkit` stays light
    return kernels


def _kernels_interpreted() -> bool:
    return type(_kernels().row_norm_fwd_kernel).__name__ == "InterpretedFunction"


def why_unavailable(x: torch.Tensor) -> str | None:
    """None if this backend can run on x, else one sentence saying why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton)"
    if x.dtype not in DTYPES:
        return f"it supports float16, bfloat16 and float32 inputs, not {x.dtype} (use backend='torch')"
    if x.device.type == "cuda":
        return None
    if x.device.type == "cpu":
        if not _interpreter_requested():
            return ("x is a CPU tensor; set TRITON_INTERPRET=1 before importing triton to run the "
                    "Triton kernels under the Triton interpreter, or use backend='torch'")
        if not _kernels_interpreted():
            return ("TRITON_INTERPRET=1 was set after normkit's Triton kernels were compiled for the "
                    "GPU; set it before the first call")
        return None
    return f"it runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), not on {x.device.type}"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _persistent_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index) * BWD_PROGRAMS_PER_SM


def row_norm_fwd(x, weight, bias, eps: float, rms: bool):
    """Returns (y [M, N] contiguous in x.dtype, mean [M] fp32 or None, rstd [M] fp32)."""
    M, N = x.shape
    y = _empty((M, N), dtype=x.dtype, device=x.device)
    rstd = _empty((M,), dtype=torch.float32, device=x.device)
    mean = None if rms else _empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return y, mean, rstd
    cfg = row_config("fwd", N, x.element_size())
    grid = (triton_cdiv(M, cfg.block_m),)
    _kernels().row_norm_fwd_kernel[grid](
        x, y, weight, bias, mean, rstd,
        M, N, x.stride(0), y.stride(0), eps,
        IS_RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE_TILE=cfg.single_tile,
        num_warps=cfg.num_warps,
    )
    return y, mean, rstd


def row_norm_bwd(dy, x, weight, mean, rstd, rms: bool, dweight_dtype, dbias_dtype):
    """Returns (dx [M, N] in x.dtype, dweight [N] or None, dbias [N] or None).

    dweight is computed when dweight_dtype is given (needs weight), dbias when dbias_dtype is.
    """
    M, N = x.shape
    device = x.device
    dx = _empty((M, N), dtype=x.dtype, device=device)
    want_dw, want_db = dweight_dtype is not None, dbias_dtype is not None
    cfg = row_config("bwd", N, x.element_size())
    programs = max(1, min(_persistent_programs(device), triton_cdiv(M, cfg.block_m)))
    dw_part = _empty((programs, N), dtype=torch.float32, device=device) if want_dw else None
    db_part = _empty((programs, N), dtype=torch.float32, device=device) if want_db else None
    if M > 0:
        _kernels().row_norm_bwd_kernel[(programs,)](
            dy, x, weight, mean, rstd, dx, dw_part, db_part,
            M, N, dy.stride(0), x.stride(0), dx.stride(0),
            IS_RMS=rms, HAS_W=weight is not None, WANT_DW=want_dw, WANT_DB=want_db,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE_TILE=cfg.single_tile,
            num_warps=cfg.num_warps,
        )
    dw = _empty((N,), dtype=dweight_dtype, device=device) if want_dw else None
    db = _empty((N,), dtype=dbias_dtype, device=device) if want_db else None
    if M == 0:  # no rows: the weight gradients are exact zeros
        return dx, (dw.zero_() if want_dw else None), (db.zero_() if want_db else None)
    first, first_out = (dw_part, dw) if want_dw else (db_part, db)
    if first is not None:
        block_p, block_n = COL_SUM_BLOCK
        _kernels().col_sum_kernel[(triton_cdiv(N, block_n),)](
            first, first_out, db_part, db, programs, N,
            HAS_B=want_dw and want_db, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4,
        )
    return dx, dw, db


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
