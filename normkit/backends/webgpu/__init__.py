"""The WebGPU backend: seed 000's WGSL LayerNorm/RMSNorm kernels and a GroupNorm on the same
statistics, with the fused activations, run through wgpu-py.

Forward only, on CPU tensors (the data travels to whatever adapter wgpu picks: a GPU through
Vulkan/Metal/D3D12, or Mesa's lavapipe on the CPU). float32, and float16 where the adapter has
shader-f16; statistics and math are f32. It runs Welford with vec4 loads where the shape allows
(N % 4 == 0; GroupNorm: NCHW with spatial % 4 == 0) and the subgroup reduction where the adapter
has subgroups (see shaders.best_variant). GroupNorm reads NCHW and channels_last memory in place.

wgpu is imported on first use (runner.py), never at import: the CLI imports this package to build
its parser. The .wgsl sources, the variant list and the shader assembly live in shaders.py.
"""
from __future__ import annotations

import numpy as np
import torch

NAME = "webgpu"
HAS_BACKWARD = False  # normkit.functional raises a clear error when autograd would need a gradient
_TORCH_DTYPES = {torch.float32: "f32", torch.float16: "f16"}


def why_unavailable(x: torch.Tensor) -> str | None:
    """None if this backend can run on x, else one sentence saying why not."""
    if x.device.type != "cpu":
        return (f"it runs on CPU tensors (their data is copied to the WebGPU adapter), not on {x.device.type}; "
                "move x to the CPU or use backend='triton' for CUDA tensors")
    if x.dtype not in _TORCH_DTYPES:
        return f"it supports float32 and float16 inputs, not {x.dtype}"
    from .runner import runner, unavailable_reason

    why = unavailable_reason()
    if why is not None:
        return why
    if x.dtype == torch.float16 and not runner().has_f16:
        return f"float16 needs the adapter feature 'shader-f16', which {runner().summary} does not have; use float32"
    return None


def row_norm_fwd(x, weight, bias, eps: float, rms: bool, activation=None, store_stats: bool = True):
    """Returns (y [M, N] contiguous in x.dtype, mean [M] float32 or None for RMSNorm, rstd [M] float32);
    with store_stats=False the statistics are not read back and come as None."""
    from .runner import runner

    y, mean, rstd = runner().run(_numpy(x), _numpy(weight), _numpy(bias), eps, rms, stats=store_stats,
                                 activation=activation)
    if not store_stats:
        return torch.from_numpy(y), None, None
    return torch.from_numpy(y), (None if rms else torch.from_numpy(mean)), torch.from_numpy(rstd)


def group_norm_fwd(x, num_groups: int, weight, bias, eps: float, activation=None):
    """x: [B, C, S], NCHW (stride(2) == 1) or channels_last (stride(1) == 1). Returns (y with x's
    shape and memory layout, mean [B, G] float32, rstd [B, G] float32)."""
    from .runner import runner

    channels_last = x.dim() == 3 and x.stride(1) == 1 and x.stride(2) != 1
    memory = x.transpose(1, 2) if channels_last else x  # [B, S, C] or [B, C, S], contiguous after _numpy
    y, mean, rstd = runner().group_norm(_numpy(memory), num_groups, _numpy(weight), _numpy(bias), eps,
                                        channels_last=channels_last, activation=activation)
    y = torch.from_numpy(y)
    return (y.transpose(1, 2) if channels_last else y), torch.from_numpy(mean), torch.from_numpy(rstd)


def _numpy(t):
    if t is None:
        return None
    t = t.detach()
    if t.dtype not in _TORCH_DTYPES:  # weights of other float types (bf16) are used as float32
        t = t.float()
    return np.ascontiguousarray(t.contiguous().numpy())
