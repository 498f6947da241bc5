"""Fused epilogues of LayerNorm and RMSNorm (issue 15) against the float64 oracle.

Every option and their combinations, forward and backward, on the torch backend and the Triton
kernels (the interpreter on CPU, compiled on a GPU): a residual add (prenorm's h, residual_dtype),
a weight offset, the output dtype (float8 with a scale and saturation), the amax, activations,
rows addressed by two strides (q/k heads sliced out of a fused QKV projection, with one weight per
head or per head dim) and by a column stride (the channels of an NCHW tensor), read in place.
Gradients of x, the residual, the weight and the bias come from one backward that takes the
gradients of y and h. Also: bad combinations raise errors naming the argument, the autocast path
(read bf16, write fp32) gives the values of casting first, modules and the kernel-level API.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import normkit
from normkit import functional as nkf
from normkit import reference as ref
from normkit._layout import row_view
from normkit.backends import torch_backend, triton as triton_backend

from conftest import DEVICE
from helpers import TOL, TOL_PARAM_GRAD, missing_tool, randn
from test_row_norm import looped  # noqa: F401  (the fixture: rows wider than 64 walked in chunks of 128)

BACKENDS = ["torch", "triton"]
OPS = ["layer_norm", "rms_norm"]
FP8_TOL = {torch.float8_e4m3fn: 0.05, torch.float8_e5m2: 0.1}  # their rounding: 2**-4, 2**-3 per element
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# name -> options. layout: "rows" x [3, 5, N]; "qk" q of a fused QKV projection [B, T, H, D];
# "qk_heads" the same with weight/bias of shape (H, D); "nchw" channels of an NCHW tensor (x is its
# [B, H, W, C] permute: column stride H*W); "wide" rows of 300 walked in chunks (the looped kernels).
CASES = {
    "residual": dict(dtype=BF16, res=BF16, prenorm=True),
    "residual_fp32_stream": dict(dtype=BF16, res=BF16, residual_dtype=FP32, prenorm=True, act="silu"),
    "residual_fp32_tensor": dict(dtype=BF16, res=FP32, prenorm=True, wdtype=FP32),
    "residual_not_returned": dict(dtype=FP32, res=FP32, act="gelu"),
    "offset_gemma": dict(dtype=FP32, offset=1.0, wdtype=BF16),
    "offset_residual_act": dict(dtype=FP16, res=FP16, offset=0.5, act="gelu_tanh", prenorm=True),
    "out_fp32": dict(dtype=BF16, out=FP32),
    "out_bf16_act": dict(dtype=FP32, out=BF16, act="mish"),
    "fp8_e4m3": dict(dtype=BF16, out=E4M3, scale=8.0, amax=True),
    "fp8_e5m2_all": dict(dtype=BF16, res=BF16, residual_dtype=FP32, prenorm=True, offset=1.0, out=E5M2,
                         scale="tensor", amax=True, act="relu"),
    "amax_bf16": dict(dtype=FP32, out=BF16, amax=True),
    "qk": dict(dtype=BF16, layout="qk"),
    "qk_heads_offset": dict(dtype=FP32, layout="qk_heads", offset=1.0, out=FP32),
    "qk_residual_fp8": dict(dtype=BF16, layout="qk", res=BF16, prenorm=True, out=E4M3, scale=2.0, amax=True),
    "nchw": dict(dtype=FP32, layout="nchw"),
    "nchw_residual": dict(dtype=BF16, layout="nchw", res=FP32, prenorm=True, act="silu"),
    "wide_everything": dict(dtype=BF16, layout="wide", res=BF16, residual_dtype=FP32, prenorm=True, offset=1.0,
                            out=E4M3, scale="tensor", amax=True, act="gelu"),
    "wide_heads": dict(dtype=FP32, layout="qk_heads_wide", res=FP32, prenorm=True, offset=0.25),
}


def _inputs(case, op, gen):
    """(base leaf, x as a view of it, residual or None, weight, bias or None, normalized shape)."""
    dt = case["dtype"]
    layout = case.get("layout", "rows")
    H, D = 4, 24
    if layout in ("qk", "qk_heads", "qk_heads_wide"):
        D = 300 if layout == "qk_heads_wide" else D
        base = randn(2, 3, 3 * H * D, dtype=dt, device=DEVICE, gen=gen).requires_grad_()
        view = lambda t: t[..., H * D: 2 * H * D].view(2, 3, H, D)  # noqa: E731  (k: the middle third)
        pshape = (H, D) if layout.startswith("qk_heads") else (D,)
    elif layout == "nchw":
        D = 12
        base = randn(2, D, 3, 5, dtype=dt, device=DEVICE, gen=gen).requires_grad_()
        view = lambda t: t.permute(0, 2, 3, 1)  # noqa: E731
        pshape = (D,)
    else:
        D = 300 if layout == "wide" else 40
        base = randn(3, 5, D, dtype=dt, device=DEVICE, gen=gen).requires_grad_()
        view = lambda t: t  # noqa: E731
        pshape = (D,)
    x = view(base)
    res = None
    if case.get("res") is not None:
        res = randn(*x.shape, dtype=case["res"], device=DEVICE, gen=gen).requires_grad_()
    wdt = case.get("wdtype", dt)
    w = (1 + 0.5 * randn(*pshape, gen=gen)).to(DEVICE, wdt).requires_grad_()
    b = (0.3 * randn(*pshape, gen=gen)).to(DEVICE, wdt).requires_grad_() if op == "layer_norm" else None
    return base, view, x, res, w, b, (D,)


def _scale(case):
    s = case.get("scale")
    return torch.tensor([4.0], device=DEVICE) if s == "tensor" else s


def _call(op, x, shape, w, b, case, backend, res):
    kw = dict(activation=case.get("act"), residual=res, prenorm=case.get("prenorm", False),
              residual_dtype=case.get("residual_dtype"), weight_offset=case.get("offset", 0),
              out_dtype=case.get("out"), out_scale=_scale(case), return_amax=case.get("amax", False), backend=backend)
    if op == "layer_norm":
        return normkit.layer_norm(x, shape, w, b, 1e-5, **kw)
    return normkit.rms_norm(x, shape, w, 1e-5, **kw)


def _oracle(op, x, shape, w, b, case, res):
    kw = dict(residual=res, residual_dtype=case.get("residual_dtype"), weight_offset=case.get("offset", 0.0))
    if op == "layer_norm":
        return ref.layer_norm(x, shape, w, b, 1e-5, case.get("act"), **kw)[0]
    return ref.rms_norm(x, shape, w, 1e-5, case.get("act"), **kw)[0]


def _unpack(out, case):
    out = out if isinstance(out, tuple) else (out,)
    y = out[0]
    h = out[1] if case.get("prenorm") else None
    amax = out[-1] if case.get("amax") else None
    assert len(out) == 1 + bool(case.get("prenorm")) + bool(case.get("amax"))
    return y, h, amax


def _rel(a, b):
    return ref.rel_err(a.double(), b)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_fused_forward_and_backward_match_the_oracle(op, backend, case, poison, request):
    c = CASES[case]
    if c.get("layout", "").endswith("wide"):
        request.getfixturevalue("looped")
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    base, view, x, res, w, b, shape = _inputs(c, op, gen)
    h_dtype = None if res is None else (c.get("residual_dtype") or res.dtype)
    y, h, amax = _unpack(_call(op, x, shape, w, b, c, backend, res), c)

    # forward: y (the stored value: float8 holds y * scale, saturated), h, amax
    out_dtype = c.get("out") or x.dtype
    assert y.dtype == out_dtype and y.shape == x.shape and y.is_contiguous()
    y64 = _oracle(op, x, shape, w, b, c, res)
    slack = TOL[h_dtype] if h_dtype is not None else 0.0  # y is the norm of h rounded to its dtype
    tol = FP8_TOL[out_dtype] if out_dtype in FP8_TOL else max(TOL[out_dtype], slack)
    assert _rel(y, ref.output_value(y64, c.get("out"), _scale(c))) < tol, "y"
    if h is not None:
        assert h.dtype == h_dtype and h.shape == x.shape
        assert _rel(h, ref.residual_sum(x, res, h_dtype)) < TOL[h_dtype], "h"
    if amax is not None:
        assert amax.dtype == torch.float32 and amax.dim() == 0
        assert abs(amax.item() - ref.amax(y64).item()) <= max(TOL[FP32], slack) * ref.amax(y64).item(), "amax"

    # backward: gradients of y and h together, against float64 autograd of the oracle
    dy = randn(*x.shape, device=DEVICE, gen=gen).to(out_dtype)  # what autograd hands over, float8 included
    dh = None if h is None else randn(*x.shape, dtype=h_dtype, device=DEVICE, gen=gen)
    leaves = [t for t in (base, res, w, b) if t is not None]
    grads = torch.autograd.grad([y] + ([h] if h is not None else []), leaves, [dy] + ([dh] if h is not None else []))
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(leaves64)
    base64, res64 = next(it), (next(it) if res is not None else None)
    w64, b64 = next(it), (next(it) if b is not None else None)
    y64 = _oracle(op, view(base64), shape, w64, b64, c, res64)
    outs64 = [y64] + ([ref.residual_sum(view(base64), res64, h_dtype)] if h is not None else [])
    want = torch.autograd.grad(outs64, leaves64, [dy.double()] + ([dh.double()] if h is not None else []))
    for name, g, e, leaf in zip(("x", "residual", "weight", "bias") if res is not None else ("x", "weight", "bias"),
                                grads, want, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        own = TOL_PARAM_GRAD[x.dtype] if name in ("weight", "bias") else TOL[g.dtype]
        if name in ("weight", "bias") and leaf.dtype != FP32:
            own = max(own, TOL[leaf.dtype])
        assert _rel(g, e) < max(own, slack), f"d{name}: {_rel(g, e):.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_output_is_torchs_cast_of_the_fp32_output(backend, fmt):
    """The float8 bits are exactly torch's (y * scale).clamp(+-max).to(float8) of the same y in
    fp32, saturation and NaN included, and the amax is exactly max |y| of that y."""
    x = randn(6, 33, device=DEVICE) * 3
    w = randn(33, device=DEVICE)
    y32 = normkit.rms_norm(x, 33, w, backend=backend)
    scale = 2 * ref.FP8_MAX[fmt] / y32.abs().max().item()  # the largest values saturate
    y8, amax = normkit.rms_norm(x, 33, w, out_dtype=fmt, out_scale=scale, return_amax=True, backend=backend)
    expect = (y32 * scale).clamp(-ref.FP8_MAX[fmt], ref.FP8_MAX[fmt]).to(fmt)
    assert torch.equal(y8.view(torch.uint8), expect.view(torch.uint8))
    assert (y8.float().abs() == ref.FP8_MAX[fmt]).any(), "nothing saturated: the case does not test it"
    assert amax.item() == y32.abs().max().item()
    x[2, 0] = float("nan")
    y8, amax = normkit.rms_norm(x, 33, w, out_dtype=fmt, out_scale=torch.tensor(scale, device=DEVICE),
                                return_amax=True, backend=backend)
    assert torch.isnan(y8[2].float()).all() and not torch.isnan(y8[[0, 1, 3, 4, 5]].float()).any()
    assert math.isnan(amax.item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_weight_gradients_stay_bitwise_reproducible(op, backend):
    gen = torch.Generator().manual_seed(3)
    c = dict(dtype=BF16, layout="qk_heads", res=BF16, prenorm=True, offset=1.0)
    base, view, x, res, w, b, shape = _inputs(c, op, gen)
    dy, dh = randn(*x.shape, dtype=BF16, device=DEVICE), randn(*x.shape, dtype=BF16, device=DEVICE)
    leaves = [t for t in (base, res, w, b) if t is not None]
    runs = []
    for _ in range(2):
        y, h = _call(op, x, shape, w, b, c, backend, res)
        runs.append(torch.autograd.grad([y, h], leaves, [dy, dh]))
    for g1, g2 in zip(*runs):
        assert torch.equal(g1, g2)


# ----------------------------------------------------------------------------- rows read in place

def _spy(monkeypatch, backend_module):
    """Record the row tensors the backend's entry points receive (on the Python host path: the C++
    one replays its launches without calling them)."""
    from normkit import _host
    monkeypatch.setattr(_host, "fast", None)
    seen = {}
    for name in ("row_norm_fwd", "row_norm_fwd_fused", "row_norm_bwd", "row_norm_bwd_fused"):
        real = getattr(backend_module, name)

        def wrapper(*a, _real=real, _name=name, **k):
            seen.setdefault(_name, []).append(a[:2])
            return _real(*a, **k)
        monkeypatch.setattr(backend_module, name, wrapper)
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_q_and_k_heads_of_a_fused_qkv_are_read_in_place(backend, monkeypatch):
    """q and k, sliced out of a fused QKV projection and viewed as (B, T, heads, head_dim), reach the
    kernels as [B*T, heads, head_dim] views of the projection's memory (two row strides), forward
    and backward, with a weight per head dim or per head."""
    B, T, H, D = 2, 5, 4, 32
    qkv = randn(B, T, 3 * H * D, device=DEVICE).requires_grad_()
    mod = {"torch": torch_backend, "triton": triton_backend}[backend]
    for wshape in ((D,), (H, D)):
        seen = _spy(monkeypatch, mod)
        w = randn(*wshape, device=DEVICE).requires_grad_()
        q, k = qkv[..., :H * D].view(B, T, H, D), qkv[..., H * D:2 * H * D].view(B, T, H, D)
        yq, yk = normkit.rms_norm(q, D, w, backend=backend), normkit.rms_norm(k, D, w, backend=backend)
        torch.autograd.grad(yq.sum() + yk.sum(), [qkv, w])
        for direction, arg in (("fwd", 0), ("bwd", 1)):  # the rows normalized: x forward, x backward
            xs = [a[arg] for n, calls in seen.items() if direction in n for a in calls]
            assert xs and all(r.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr() for r in xs), \
                f"{direction}: a copy of q or k reached the kernels"
            assert {r.data_ptr() for r in xs} == {q.data_ptr(), k.data_ptr()}
            assert all(r.shape == (B * T, H, D) and r.stride() == (3 * H * D, D, 1) for r in xs)
        assert row_view(q, (D,)).data_ptr() == q.data_ptr()
        y64 = ref.rms_norm(q, (D,), w)[0]
        assert _rel(yq, y64) < TOL[FP32]
        monkeypatch.undo()


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_over_nchw_channels_reads_in_place(backend, monkeypatch):
    """timm's LayerNorm2d: layer_norm(x.permute(0, 2, 3, 1), C) on an NCHW tensor reads the channels
    with column stride H*W, no copy; y is contiguous in the permuted shape, as torch's."""
    x = randn(2, 16, 3, 7, device=DEVICE)
    w, b = randn(16, device=DEVICE), randn(16, device=DEVICE)
    seen = _spy(monkeypatch, {"torch": torch_backend, "triton": triton_backend}[backend])
    xp = x.permute(0, 2, 3, 1)
    y = normkit.layer_norm(xp, 16, w, b, backend=backend)
    rows = seen["row_norm_fwd"][0][0]
    assert rows.data_ptr() == x.data_ptr() and rows.shape == (2, 21, 16) and rows.stride() == (336, 1, 21)
    assert y.is_contiguous() and y.shape == xp.shape
    assert _rel(y, F.layer_norm(xp.double(), (16,), w.double(), b.double())) < TOL[FP32]


def test_two_stride_views_and_their_fallbacks():
    qkv = torch.randn(2, 5, 3 * 4 * 8)
    q = qkv[..., :32].view(2, 5, 4, 8)
    v = row_view(q, (8,))
    assert v.shape == (10, 4, 8) and v.stride() == (96, 8, 1) and v.data_ptr() == q.data_ptr()
    assert torch.equal(v.reshape(-1, 8), q.reshape(-1, 8))
    # the same structure for another operand (a contiguous residual), and a copy where none exists
    r = torch.randn(2, 5, 4, 8)
    assert row_view(r, (8,), lead=(10, 4)).stride() == (32, 8, 1)
    assert row_view(torch.randn(4, 2, 5, 8).permute(1, 2, 0, 3), (8,)).stride() == (8, 80, 1)
    odd = torch.randn(5, 4, 3, 8).permute(2, 1, 0, 3)  # three strides: no view, one copy
    assert row_view(odd, (8,)).shape == (60, 8) and row_view(odd, (8,)).is_contiguous()
    # backends without strided rows get [M, N] with unit column stride
    assert row_view(q, (8,), strided=False).is_contiguous()
    nchw = torch.randn(2, 6, 3, 5)
    cols = row_view(nchw.permute(0, 2, 3, 1), (6,))
    assert cols.stride() == (90, 1, 15) and cols.data_ptr() == nchw.data_ptr()


# ----------------------------------------------------------------------------- autocast in one pass

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_out_dtype_fp32_equals_casting_first(op, backend):
    """Reading bf16 and writing fp32 in one pass gives the values of x.float() first: y and the weight
    gradient bitwise; dx bitwise where the store rounds to nearest (the interpreter truncates its
    bf16 stores: there within one bf16 step)."""
    x = randn(7, 96, dtype=BF16, device=DEVICE)
    w = randn(96, device=DEVICE)
    b = randn(96, device=DEVICE) if op == "layer_norm" else None
    dy = randn(7, 96, device=DEVICE)
    f = getattr(normkit, op)
    args = (96, w, b) if op == "layer_norm" else (96, w)
    out = []
    for one_pass in (True, False):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        a = (args[0], wl) + args[2:]
        y = f(xl, *a, out_dtype=FP32, backend=backend) if one_pass else f(xl.float(), *a, backend=backend)
        out.append((y,) + torch.autograd.grad(y, [xl, wl], dy))
    (y1, dx1, dw1), (y2, dx2, dw2) = out
    assert y1.dtype == y2.dtype == FP32 and dx1.dtype == BF16
    if backend == "torch" or DEVICE != "cuda":
        assert torch.equal(y1, y2) and torch.equal(dw1, dw2)
    else:  # compiled, a bf16 and an fp32 load get different register layouts: another summation order
        assert _rel(y1, y2) < 1e-6 and _rel(dw1, dw2) < 1e-6
    if backend == "torch":
        assert torch.equal(dx1, dx2)
    else:  # one bf16 step (the interpreter truncates its bf16 stores; compiled: the order above)
        assert ((dx1.float() - dx2.float()).abs() <= dx2.float().abs() * 2 ** -7).all()


@pytest.mark.parametrize("op", OPS)
def test_autocast_contract_runs_in_one_pass(op, monkeypatch):
    """Under CUDA autocast (here: CPU autocast given CUDA's rule when there is no GPU) y is float32 with
    the values of torch's op on x.float(), and x is not cast first: the kernels get bf16 rows."""
    if DEVICE != "cuda":
        monkeypatch.setattr(nkf, "_autocast_upcasts", lambda op, device_type: True)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    seen = _spy(monkeypatch, triton_backend)
    x = randn(4, 64, dtype=BF16, device=DEVICE).requires_grad_()
    w = randn(64, device=DEVICE).requires_grad_()
    if not nkf._autocast_upcasts(op, device_type):
        pytest.skip(f"torch {torch.__version__} runs {op} under {device_type} autocast as written (no float32 contract)")
    with torch.autocast(device_type, dtype=BF16):
        y = getattr(normkit, op)(x, 64, w, backend="triton")
    assert y.dtype == FP32
    assert seen["row_norm_fwd_fused"][0][0].dtype == BF16
    want = (F.layer_norm if op == "layer_norm" else F.rms_norm)(x.detach().double(), (64,), w.detach().double(),
                                                                eps=1e-5 if op == "layer_norm" else None)
    assert _rel(y, want) < TOL[FP32]
    y.sum().backward()
    assert x.grad.dtype == BF16 and w.grad.dtype == FP32


# ----------------------------------------------------------------------------- errors

x16 = randn(4, 16)
r16 = randn(4, 16)
w16 = randn(16)


@pytest.mark.parametrize("call, arg", [
    (lambda: normkit.rms_norm(x16, 16, w16, prenorm=True), "prenorm"),
    (lambda: normkit.rms_norm(x16, 16, w16, residual=r16, prenorm=1), "prenorm"),
    (lambda: normkit.layer_norm(x16, 16, residual=randn(4, 15)), "residual"),
    (lambda: normkit.layer_norm(x16, 16, residual=randn(2, 4, 16)), "residual"),
    (lambda: normkit.layer_norm(x16, 16, residual=torch.empty(4, 16, device="meta")), "residual"),
    (lambda: normkit.layer_norm(x16, 16, residual=torch.ones(4, 16, dtype=torch.int32)), "residual"),
    (lambda: normkit.rms_norm(x16, 16, residual_dtype=FP32), "residual_dtype"),
    (lambda: normkit.rms_norm(x16, 16, residual=r16, residual_dtype=torch.int32), "residual_dtype"),
    (lambda: normkit.rms_norm(x16, 16, w16, out_dtype=E4M3), "out_scale"),
    (lambda: normkit.rms_norm(x16, 16, w16, out_dtype=BF16, out_scale=2.0), "out_scale"),
    (lambda: normkit.rms_norm(x16, 16, w16, out_scale=2.0), "out_scale"),
    (lambda: normkit.rms_norm(x16, 16, w16, out_dtype=E5M2, out_scale=torch.ones(2)), "out_scale"),
    (lambda: normkit.rms_norm(x16, 16, w16, out_dtype=E5M2, out_scale=float("nan")), "out_scale"),
    (lambda: normkit.rms_norm(x16, 16, w16, out_dtype=E5M2, out_scale="2"), "out_scale"),
    (lambda: normkit.rms_norm(x16, 16, w16, out_dtype=torch.int8), "out_dtype"),
    (lambda: normkit.rms_norm(x16, 16, out_dtype="bf16"), "out_dtype"),
    (lambda: normkit.rms_norm(x16, 16, weight_offset=1.0), "weight_offset"),
    (lambda: normkit.layer_norm(x16, 16, w16, weight_offset="1"), "weight_offset"),
    (lambda: normkit.layer_norm(x16, 16, w16, weight_offset=float("inf")), "weight_offset"),
    (lambda: normkit.rms_norm(x16, 16, w16, return_amax=1), "return_amax"),
    (lambda: normkit.rms_norm(randn(2, 3, 4, 8), 8, randn(5, 8)), "weight"),
    (lambda: normkit.layer_norm(randn(2, 3, 4, 8), 8, None, randn(3, 8)), "bias"),
    (lambda: normkit.rms_norm(randn(2, 3, 4, 8), 8, randn(2, 4, 8)), "weight"),
    (lambda: normkit.rms_norm_bwd(x16, x16, w16, x16[:, 0], dh=randn(4, 8)), "dh"),
    (lambda: normkit.layer_norm_bwd(x16, x16, w16, x16[:, 0], x16[:, 0], dresidual_dtype="fp32"), "dresidual_dtype"),
    (lambda: normkit.rms_norm_fwd(x16, 16, w16, residual=randn(4, 15)), "residual"),
    (lambda: normkit.layer_norm_fwd(x16, 16, w16, out_dtype=E4M3), "out_scale"),
])
def test_bad_combinations_name_the_argument(call, arg):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert arg in str(info.value), str(info.value)


def test_backends_without_fused_epilogues_say_so():
    """The WebGPU backend (and the CUDA one on a GPU) runs plain norms; a fused option is refused by
    name, never dropped."""
    name, x = ("cuda", randn(4, 16, device="cuda")) if DEVICE == "cuda" else ("webgpu", randn(4, 16))
    from normkit import backends
    why = backends.get(name).why_unavailable(x)
    for kw in (dict(residual=x.clone()), dict(weight_offset=1.0), dict(out_dtype=BF16), dict(return_amax=True)):
        with pytest.raises(normkit.BackendUnavailableError) as info:
            normkit.rms_norm(x, 16, torch.ones(16, device=x.device), backend=name, **kw)
        if why is None:
            option = next(iter(kw))
            assert f"{option}=" in str(info.value) and f"backend={name!r}" in str(info.value), str(info.value)


# ----------------------------------------------------------------------------- modules, kernel-level API

def test_modules_carry_the_options():
    rms = normkit.RMSNorm(24, weight_offset=1.0).to(DEVICE)
    assert torch.equal(rms.weight, torch.zeros(24, device=DEVICE))  # Gemma: offset + w starts at one
    assert "weight_offset=1.0" in repr(rms)
    x, r = randn(3, 24, device=DEVICE), randn(3, 24, device=DEVICE)
    assert _rel(rms(x), ref.rms_norm(x, (24,))[0]) < TOL[FP32]
    y, h = rms(x, r)
    assert _rel(h, ref.residual_sum(x, r)) < TOL[FP32] and _rel(y, ref.rms_norm(x + r, (24,))[0]) < 1e-5
    assert torch.equal(rms(x, r, prenorm=False), y)
    ln = normkit.LayerNorm(24, out_dtype=BF16, residual_dtype=FP32, activation="silu").to(DEVICE)
    y, h = ln(x.to(BF16), r.to(BF16))
    assert y.dtype == BF16 and h.dtype == FP32
    y.float().sum().backward()
    assert ln.weight.grad is not None and ln.bias.grad is not None
    sd = torch.nn.RMSNorm(24).state_dict()
    rms.load_state_dict(sd)  # torch's state_dict loads unchanged


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_level_api_with_residual(backend):
    x, r = randn(3, 5, 40, dtype=BF16, device=DEVICE), randn(3, 5, 40, dtype=BF16, device=DEVICE)
    w, b = randn(40, device=DEVICE), randn(40, device=DEVICE)
    y, mean, rstd, h, amax = normkit.layer_norm_fwd(x, 40, w, b, residual=r, residual_dtype=FP32,
                                                    weight_offset=1.0, activation="silu", return_amax=True,
                                                    backend=backend)
    y64 = ref.layer_norm(x, (40,), w, b, 1e-5, "silu", residual=r, residual_dtype=FP32, weight_offset=1.0)[0]
    assert h.dtype == FP32 and _rel(y, y64) < TOL[BF16] and _rel(h, ref.residual_sum(x, r, FP32)) < 1e-7
    assert abs(amax.item() - ref.amax(y64).item()) < 1e-5 * ref.amax(y64).item()
    dy, dh = randn(3, 5, 40, dtype=BF16, device=DEVICE), randn(3, 5, 40, dtype=FP32, device=DEVICE)
    dx, dw, db, dres = normkit.layer_norm_bwd(dy, h, w, mean, rstd, bias=b, activation="silu", weight_offset=1.0,
                                              dh=dh, dresidual_dtype=BF16, backend=backend)
    h64 = ref.residual_sum(x, r, FP32).requires_grad_()
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    e = torch.autograd.grad(ref.layer_norm(h64, (40,), w64, b64, 1e-5, "silu", weight_offset=1.0)[0],
                            [h64, w64, b64], dy.double())
    assert dx.dtype == FP32 and dres.dtype == BF16
    assert _rel(dx, e[0] + dh.double()) < TOL[FP32] and _rel(dres, e[0] + dh.double()) < TOL[BF16]
    assert _rel(dw, e[1]) < 1e-5 and _rel(db, e[2]) < 1e-5
    y2, rstd2, h2 = normkit.rms_norm_fwd(x, 40, w, residual=r, backend=backend)
    dx2, dw2 = normkit.rms_norm_bwd(dy, h2, w, rstd2, backend=backend)
    h64 = ref.residual_sum(x, r).requires_grad_()
    e = torch.autograd.grad(ref.rms_norm(h64, (40,), w64)[0], [h64, w64], dy.double())
    assert h2.dtype == BF16 and _rel(dx2, e[0]) < TOL[BF16] and _rel(dw2, e[1]) < TOL[BF16]


# ----------------------------------------------------------------------------- compiled for the GPU

def _compile_for_sm90(pythonpath=None):
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath)] + [p for p in [env.get("PYTHONPATH")] if p])
    script = Path(__file__).with_name("triton_sm90.py")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_kernels_compile_for_sm90_with_every_fused_flag():
    """The interpreter accepts code the compiler may not: every fused flag and path of the row-norm
    kernels is compiled for sm_90 here, without a GPU (tests/triton_sm90.py, Triton's own ptxas)."""
    _compile_for_sm90()


def test_kernels_compile_for_sm90_under_the_devices_triton():
    """The same under the Triton release of the GPU machine (the Makefile's DEVICE_TRITON, unpacked beside the
    venv's packages): a default value on a helper's constexpr argument compiled on triton 3.9 and failed every
    Triton forward on the device's 3.6 (session 17)."""
    import sys
    from pathlib import Path
    site = Path(sys.prefix) / "device-triton" / "site"
    if not site.is_dir():
        missing_tool(f"{site} is missing (`make test` unpacks the device's Triton there)")
    version = next(site.glob("triton-*.dist-info")).name.removesuffix(".dist-info").split("-")[1]
    assert f"(triton {version}, sm_90)" in _compile_for_sm90(site)
