"""The byte model: the bytes a perfect kernel must move, which every GB/s figure is counted against.

Forward reads x and writes y (2 passes over the tensor); backward reads x and dy and writes dx
(3 passes). A fused residual adds one read and one write. Weights, biases and the per-row (or
per-group) statistics are not counted: they are small next to the tensor, and leaving them out
makes the number comparable across implementations that store different statistics.
GroupNorm counts the same passes over its (B, C, *spatial) tensor; a fused activation adds none.
"""
from __future__ import annotations

PASSES = {"fwd": 2, "bwd": 3}
RESIDUAL_PASSES = 2  # read the residual, write the sum


def passes(direction: str, residual: bool = False) -> int:
    """How many times a perfect kernel streams the tensor through memory."""
    if direction not in PASSES:
        raise ValueError(f"direction: expected one of {', '.join(PASSES)}, got {direction!r}")
    return PASSES[direction] + (RESIDUAL_PASSES if residual else 0)


def bytes_moved(numel: int, elem_bytes: int, direction: str, residual: bool = False) -> int:
    """Bytes of one call on a tensor of `numel` elements of `elem_bytes` bytes each."""
    if numel < 0 or elem_bytes <= 0:
        raise ValueError(f"numel, elem_bytes: expected numel >= 0 and elem_bytes > 0, got {numel}, {elem_bytes}")
    return passes(direction, residual) * numel * elem_bytes


def gbps(nbytes: float, ms: float) -> float:
    """Effective bandwidth in GB/s (10^9 bytes per second) of moving nbytes in ms milliseconds."""
    if not ms > 0:
        raise ValueError(f"ms: expected a positive time, got {ms}")
    return nbytes / (ms * 1e6)
