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


# ----------------------------------------------------------------------------- output and residual epilogues
# Codes: H_ROUND 0 none (fp32 h), 1 bfloat16, 2 float16: the dtype the residual sum h is rounded to
# (and stored in) before it is normalized. FP8 0 none, 1 float8_e4m3fn, 2 float8_e5m2 (the integer
# encoding below), 3 and 4 the same two by the GPU's own conversion (sm_89+, compiled kernels only:
# the host adds FP8_HW to the code; the interpreter's float8 casts round wrongly).
H_ROUND_CODES = {"torch.float32": 0, "torch.bfloat16": 1, "torch.float16": 2}
FP8_CODES = {"torch.float8_e4m3fn": 1, "torch.float8_e5m2": 2}
FP8_HW = 2


@triton.jit
def round_h(h, H_ROUND: tl.constexpr):
    """h rounded to its storage dtype (and back to fp32): what is normalized is what is stored."""
    if H_ROUND == 1:
        h = h.to(tl.bfloat16).to(tl.float32)
    elif H_ROUND == 2:
        h = h.to(tl.float16).to(tl.float32)
    return h


@triton.jit
def _fp8_encode(v, MBITS: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr, MIN_NORMAL: tl.constexpr,
                MAX: tl.constexpr):
    """The float8 bits of v: saturated to +-MAX (NaN stays NaN), rounded to nearest even.
    Integer and exact float ops only, so the compiled kernel and the Triton interpreter (whose
    float8 casts round wrongly) write the same bits as torch's .to(float8)."""
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.abs(v)
    a = tl.where(a > MAX, MAX, a)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)  # binade, subnormals share EMIN's
    ulp = ((127 + e - MBITS) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - e + MBITS) << 23).to(tl.float32, bitcast=True)
    q = (a * inv_ulp + 12582912.0) - 12582912.0  # a / ulp < 2**(MBITS + 1): + 1.5 * 2**23 rounds it half-even
    r = q * ulp
    normal = (r.to(tl.int32, bitcast=True) >> (23 - MBITS)) - ((127 - BIAS) << MBITS)
    nan = a != a
    code = tl.where(r < MIN_NORMAL, tl.where(nan, 0.0, q).to(tl.int32), normal)
    code = tl.where(nan, 0x7F, code)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _fp8_convert(v, FP8_TY: tl.constexpr):
    """_fp8_encode's bits by the GPU's conversion (cvt.rn.satfinite, one per two elements, instead of
    ~20 integer and float ops per element, which made the float8 forward ALU-bound): rounded to
    nearest even and saturated to +-max by the instruction itself (an explicit clamp or NaN fix-up
    in Triton tripled the instruction count). One difference: a NaN is written as 0x7F whatever its
    sign (torch's cast and the encoding keep the sign bit); it is a NaN either way."""
    return v.to(FP8_TY).to(tl.uint8, bitcast=True)


@triton.jit
def out_value(y, scale, OUT_TY: tl.constexpr, FP8: tl.constexpr):
    """What is stored for y: y in the output dtype, or the float8 bits of y * scale."""
    if FP8 == 1:
        return _fp8_encode(y * scale, 3, 7, -6, 0.015625, 448.0)
    elif FP8 == 2:
        return _fp8_encode(y * scale, 2, 15, -14, 6.103515625e-05, 57344.0)
    elif FP8 == 3:
        return _fp8_convert(y * scale, tl.float8e4nv)
    elif FP8 == 4:
        return _fp8_convert(y * scale, tl.float8e5)
    else:
        return y.to(OUT_TY)


@triton.jit
def amax_bits(y, mask):
    """max |y| over a tile as the int32 bits of a float32: non-negative floats order as their bits
    (NaN above infinity), so an integer max, exact and order-free, gives the same amax every run."""
    bits = tl.where(mask, tl.abs(y), 0.0).to(tl.int32, bitcast=True)
    return tl.max(tl.max(bits, axis=1), axis=0)
