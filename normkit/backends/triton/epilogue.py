"""Fused activation epilogue shared by the row- and group-normalization kernels.

ACT is a constexpr code, so each activation compiles into its own kernel with no branches:
0 none, 1 relu, 2 silu, 3 mish, 4 gelu (erf), 5 gelu_tanh. The forward applies act(z) to the
affine output z; the backward multiplies the incoming gradient by act'(z), with z recomputed
from x and the saved statistics (so only x and the fp32 statistics are saved).
"""
import triton
import triton.language as tl

ACT_CODES = {None: 0, "relu": 1, "silu": 2, "mish": 3, "gelu": 4, "gelu_tanh": 5}

# The constants are written inline: compiled Triton rejects plain float globals in a @triton.jit
# function, and the interpreter mishandles tl.constexpr ones.
# sqrt(1/2) = 0.7071067811865476, 1/sqrt(2 pi) = 0.3989422804014327,
# sqrt(2/pi) = 0.7978845608028654, and GELU's tanh-approximation cubic coefficient 0.044715.


@triton.jit
def _tanh(u):
    # 1 - 2/(e^{2u} + 1): saturates correctly at both ends (inf -> 1, 0 -> -1)
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _mish_tanh(z):
    """(tanh(softplus(z)), e^z) from one exponential: with n = e^z (e^z + 2),
    tanh(log(1 + e^z)) = n / (n + 2). Above z = 20 it is 1 in fp32 (e^z is clamped to stay finite).
    Instead of exp, log, exp and a division: mish is otherwise the costliest part of GroupNorm+Mish."""
    e = tl.exp(tl.minimum(z, 20.0))
    n = e * (e + 2.0)
    return tl.where(z > 20.0, 1.0, n / (n + 2.0)), e


@triton.jit
def act_fwd(z, ACT: tl.constexpr):
    if ACT == 1:
        z = tl.maximum(z, 0.0)
    elif ACT == 2:
        z = z * tl.sigmoid(z)
    elif ACT == 3:
        t, _ = _mish_tanh(z)
        z = z * t
    elif ACT == 4:
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACT == 5:
        z = 0.5 * z * (1.0 + _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)))
    return z


@triton.jit
def act_grad(z, g, ACT: tl.constexpr):
    """g * act'(z)."""
    if ACT == 1:
        g = tl.where(z > 0.0, g, 0.0)
    elif ACT == 2:
        s = tl.sigmoid(z)
        g = g * (s * (1.0 + z * (1.0 - s)))
    elif ACT == 3:
        t, e = _mish_tanh(z)
        g = g * (t + z * (e / (1.0 + e)) * (1.0 - t * t))  # e / (1 + e) = sigmoid(z)
    elif ACT == 4:
        g = g * (0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z))
    elif ACT == 5:
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        g = g * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z))
    return g
