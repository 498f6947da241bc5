"""nn.Module drop-ins: subclasses of the torch modules, so parameters, state_dict keys,
constructor arguments and repr are torch's; only forward runs normkit's kernels.

LayerNorm and RMSNorm take the fused options that belong to the layer as attributes
(`weight_offset`, `out_dtype`, `residual_dtype`, `activation`) and the residual stream as a
forward argument: `norm(x, residual)` returns (y, h), h = x + residual being the new residual
stream (the add-norm of a pre-norm transformer block, as flash-attention's and Liger's fused
add-norm modules); `norm(x, residual, prenorm=False)` returns y alone. The adaLN modulation is a
forward argument too: `norm(x, scale=scale, shift=shift)` (per sample, as normkit.layer_norm), and so
is a gated norm's gate: `norm(x, gate=g)` normalizes x * silu(g).
"""
from __future__ import annotations

from typing import Optional

import torch

from .functional import group_norm, layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm"]


class _RowNormOptions:
    """The fused options of a LayerNorm/RMSNorm module, and the weight init they imply."""

    def _set_options(self, activation, weight_offset, out_dtype, residual_dtype, backend):
        self.activation, self.backend = activation, backend
        self.weight_offset, self.out_dtype, self.residual_dtype = weight_offset, out_dtype, residual_dtype
        if self.weight_offset:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        offset = getattr(self, "weight_offset", 0.0)
        if offset and self.weight is not None:  # the effective weight offset + w starts at one
            with torch.no_grad():
                self.weight.sub_(offset)

    def _fused(self, residual, prenorm, scale=None, shift=None, gate=None):
        kw = {}
        if gate is not None:
            kw["gate"] = gate
        if scale is not None:
            kw["scale"] = scale
        if shift is not None:
            kw["shift"] = shift
        if self.weight_offset:
            kw["weight_offset"] = self.weight_offset
        if self.out_dtype is not None:
            kw["out_dtype"] = self.out_dtype
        if residual is not None:
            kw.update(residual=residual, prenorm=prenorm, residual_dtype=self.residual_dtype)
        return kw

    def _extra(self) -> str:
        return "".join(f", {k}={getattr(self, k)!r}" for k, default in
                       (("activation", None), ("weight_offset", 0.0), ("out_dtype", None), ("residual_dtype", None))
                       if getattr(self, k, default) != default)


class LayerNorm(_RowNormOptions, torch.nn.LayerNorm):
    """torch.nn.LayerNorm computed by normkit; `activation`, `weight_offset`, `out_dtype`,
    `residual_dtype` and `backend` as in normkit.layer_norm. forward(x, residual=None, prenorm=True, *,
    scale=None, shift=None)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, activation: Optional[str] = None, weight_offset: float = 0,
                 out_dtype: Optional[torch.dtype] = None, residual_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self._set_options(activation, weight_offset, out_dtype, residual_dtype, backend)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, prenorm: bool = True, *,
                scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None,
                gate: Optional[torch.Tensor] = None):
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, activation=self.activation,
                          backend=self.backend, **self._fused(residual, prenorm, scale, shift, gate))

    def extra_repr(self) -> str:
        return super().extra_repr() + self._extra()


class RMSNorm(_RowNormOptions, torch.nn.RMSNorm):
    """torch.nn.RMSNorm computed by normkit; `activation`, `weight_offset` (Gemma: 1.0, the weight
    then starts at zero), `out_dtype`, `residual_dtype` and `backend` as in normkit.rms_norm.
    forward(x, residual=None, prenorm=True, *, scale=None, shift=None)."""

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, activation: Optional[str] = None, weight_offset: float = 0,
                 out_dtype: Optional[torch.dtype] = None, residual_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._set_options(activation, weight_offset, out_dtype, residual_dtype, backend)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, prenorm: bool = True, *,
                scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None,
                gate: Optional[torch.Tensor] = None):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, activation=self.activation,
                        backend=self.backend, **self._fused(residual, prenorm, scale, shift, gate))

    def extra_repr(self) -> str:
        return super().extra_repr() + self._extra()


class GroupNorm(torch.nn.GroupNorm):
    """torch.nn.GroupNorm computed by normkit, with an optional fused activation (as in
    normkit.group_norm); NCHW and channels_last inputs are read in place."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None, *, activation: Optional[str] = None, backend: Optional[str] = None):
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        self.activation, self.backend = activation, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps, activation=self.activation,
                          backend=self.backend)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "")
