"""Backend registry and selection.

A backend is a module with NAME, why_unavailable(x) -> str | None, and the entry points it
provides. Modules are imported on first use, so `import normkit` does not pull in triton,
cuda-python or wgpu. The entry points (arguments arrive checked by normkit.functional):

row_norm_fwd(x, weight, bias, eps, rms, activation=None, store_stats=True) -> (y, mean | None, rstd)
    x: [M, N], unit column stride, rows may be strided. weight/bias: contiguous [N] or None.
    rms=True: RMSNorm (no centering; bias is None, mean is returned as None).
    activation: None or a name in normkit.reference.ACTIVATIONS, applied after the affine.
    y: contiguous [M, N] in x.dtype; mean/rstd: contiguous [M] float32 (float64 for float64 x).
    store_stats=False: the caller will not use mean/rstd (inference); a backend may skip them.
row_norm_bwd(dy, x, weight, mean, rstd, rms, dweight_dtype, dbias_dtype, *, bias=None, activation=None)
    -> (dx, dweight | None, dbias | None)
    dy: [M, N] like x. dweight is computed when dweight_dtype is given, dbias when dbias_dtype is,
    each returned in that dtype; the sums over rows are deterministic (no float atomics).
    bias is passed when an activation needs the pre-activation value recomputed.

Fused epilogues (backends that have them: torch, triton; functional.py raises "not supported by
backend=..." for the others), with the same rows conventions:
row_norm_fwd_fused(x, weight, bias, eps, rms, *, activation=None, store_stats=True, residual=None,
                   h_dtype=None, store_h=False, weight_offset=0.0, out_dtype=None, out_scale=None,
                   want_amax=False) -> (y, mean | None, rstd | None, h | None, amax | None)
    residual: rows like x; h = x + residual, summed in fp32 and rounded to h_dtype (default
    residual.dtype), is what is normalized; returned (contiguous) when store_h.
    weight_offset: y = xhat * (weight_offset + weight) + bias. out_dtype: y's dtype (None: x's);
    float8_e4m3fn / float8_e5m2 store y * out_scale (a float or a 1-element tensor) saturated to
    the format's largest finite value. want_amax: amax = max |y| before scaling, a 0-dim float32.
row_norm_bwd_fused(dy, x, weight, mean, rstd, rms, dweight_dtype, dbias_dtype, *, bias=None,
                   activation=None, weight_offset=0.0, dh=None, dx_dtype=None, dres_dtype=None,
                   mod_scale=None, mod_shift=None, dmod_dtypes=(None, None))
    -> (dx, dres | None, dweight | None, dbias | None)[ + (dscale | None, dshift | None)]
    x: what was normalized (h with a residual). dh: rows like x, added to dx. dx in dx_dtype (None:
    x's); dres, the same values in dres_dtype, when dres_dtype is given.
adaLN modulation (backends with MODULATION = True: torch, triton; check_backend refuses the others
by name): both fused entry points take mod_scale= / mod_shift=, [S, N] tables with unit column
stride (any row stride), row r of x using table row r // (M / S); the forward computes
act((xhat * w + b) * (1 + scale) + shift). The backward then also needs bias (to recompute
xhat * w + b) and returns (dscale, dshift) appended, [S, N] in dmod_dtypes (None: not computed),
the per-sample sums, deterministic.
Gated norms (backends with GATE = True: torch, triton; check_backend refuses the others by name):
both fused entry points take gate=, rows like x in any float dtype, never with a residual or
modulation; the forward normalizes z = x * silu(gate) (fp32, unrounded). The backward's x is then
the ungated input; it returns dgate appended, rows like x in the gate's dtype (dx = dz * silu(gate),
dgate = dz * x * silu'(gate), dz the norm's input gradient).
Backends with STRIDED_ROWS = True also take rows as [O, I, N] views with any strides (row r is
(r // I, r % I); normkit._layout.row_view); every row operand of one call has the same structure,
and outputs are dense in that shape. The others get [M, N] with unit column stride.

group_norm_fwd(x, num_groups, weight, bias, eps, activation=None) -> (y, mean, rstd)
    x: [B, C, S] (S = product of the spatial dims, 1 if none) in either layout: NCHW
    (stride(2) == 1) or channels_last (stride(1) == 1). y: same shape and strides as x.
    weight/bias: contiguous [C] or None. mean/rstd: contiguous [B, num_groups] float32.
group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation, dweight_dtype, dbias_dtype, *, eps=None)
    -> (dx, dweight | None, dbias | None); dy and dx have x's strides. eps: the forward's, or None; the
    torch backend's CPU kernel recomputes the activation's input with it (the forward's own bits), the
    others recompute it from the statistics.
"""
from __future__ import annotations

import importlib

import torch

# name -> module path; the order is the documented list of choices
_MODULES = {
    "torch": "normkit.backends.torch_backend",
    "triton": "normkit.backends.triton",
    "cuda": "normkit.backends.cuda",
    "webgpu": "normkit.backends.webgpu",
}
NAMES = tuple(_MODULES)


class BackendUnavailableError(RuntimeError):
    """A backend that was asked for by name cannot run this call."""


_loaded: dict = {}


def get(name: str):
    mod = _loaded.get(name)
    if mod is None:
        if name not in _MODULES:
            raise ValueError(f"backend: expected None or one of {', '.join(map(repr, NAMES))}, got {name!r}")
        try:
            mod = importlib.import_module(_MODULES[name])
        except ImportError as e:
            raise BackendUnavailableError(f"backend={name!r} could not be loaded: {e}") from e
        _loaded[name] = mod
    return mod


def _auto(x: torch.Tensor):
    """backend=None: the fastest correct backend for x's device and dtype."""
    if x.device.type == "cuda":
        triton_backend = get("triton")
        if triton_backend.why_unavailable(x) is None:
            return triton_backend
    return get("torch")


def resolve(name: str | None, x: torch.Tensor, op: str = "this op"):
    """The backend module to run `op` on x. A backend forced by name either runs or raises."""
    if name is None:
        return _auto(x)
    if not isinstance(name, str):
        raise TypeError(f"backend: expected None or a string, got {type(name).__name__}")
    mod = get(name)
    why = mod.why_unavailable(x)
    if why is not None:
        raise BackendUnavailableError(f"backend={name!r} cannot run {op}: {why}.")
    return mod
