"""Shared test helpers: dtypes, tolerances, fresh random inputs, and oracle comparisons."""
import math

import torch

from normkit import reference as ref

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# relative-error bounds against the float64 oracle; bf16/fp16 outputs are bounded by their own
# rounding (2**-9 and 2**-12 relative per element), fp32 by accumulation over the row
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}
# weight gradients are fp32 sums over rows of exactly-representable products
TOL_PARAM_GRAD = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5, torch.float64: 1e-12}


def randn(*shape, dtype=torch.float32, device="cpu", gen=None):
    """Fresh standard-normal data (never zeros), made in fp32 and cast."""
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def assert_close(out, expected, tol, what):
    err = ref.rel_err(out, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"
    return err


def param_tol(p_dtype, x_dtype):
    """Bound for a parameter gradient returned in p_dtype (rounded there) from x_dtype inputs."""
    return max(TOL_PARAM_GRAD[x_dtype], TOL[p_dtype] if p_dtype != torch.float32 else 0.0)


def dx_scale_err(dx, dx_ref, dy, w, rstd):
    """||dx - ref|| / ||rstd * w * dy||: dx is a difference of terms of that size, so this is the
    error that matters where the difference itself cancels (RMSNorm at N=1)."""
    scale = dy.double() * rstd.double().reshape(rstd.shape + (1,) * (dy.dim() - rstd.dim()))
    if w is not None:
        scale = scale * w.double()
    return (dx.double().cpu() - dx_ref.cpu()).norm().item() / max(scale.norm().item(), 1e-300)
