"""nn.Module drop-ins: subclasses of the torch modules, so parameters, state_dict keys,
constructor arguments and repr are torch's; only forward runs normkit's kernels."""
from __future__ import annotations

from typing import Optional

import torch

from .functional import group_norm, layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm"]


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm computed by normkit; `activation` and `backend` as in normkit.layer_norm."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, activation: Optional[str] = None, backend: Optional[str] = None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.activation, self.backend = activation, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                          activation=self.activation, backend=self.backend)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm computed by normkit; `activation` and `backend` as in normkit.rms_norm."""

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, activation: Optional[str] = None, backend: Optional[str] = None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.activation, self.backend = activation, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, activation=self.activation,
                        backend=self.backend)


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
