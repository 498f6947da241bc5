"""nn.Module drop-ins: subclasses of the torch modules, so parameters, state_dict keys,
constructor arguments and repr are torch's; only forward runs normkit's kernels."""
from __future__ import annotations

from typing import Optional

import torch

from .functional import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm computed by normkit. `backend` is as in normkit.layer_norm."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, backend: Optional[str] = None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, backend=self.backend)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm computed by normkit. `backend` is as in normkit.rms_norm."""

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, backend: Optional[str] = None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, backend=self.backend)
