"""Shapes at the edges, through the public functions and autograd, on every backend that runs here."""
import pytest
import torch
import torch.nn.functional as F

import normkit
from normkit import reference as ref
from conftest import DEVICE
from helpers import assert_close, randn

BACKENDS = ["torch", "triton"] + (["cuda"] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_of_an_empty_batch(backend, channels_last):
    x = torch.empty(0, 8, 3, 3, device=DEVICE)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    w = randn(8, device=DEVICE).requires_grad_()
    y = normkit.group_norm(x, 4, w, None, backend=backend)
    assert y.shape == F.group_norm(x.detach(), 4).shape
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_row_norm_of_an_empty_batch(backend, op):
    x = torch.empty(0, 5, 16, device=DEVICE, requires_grad=True)
    w = randn(16, device=DEVICE).requires_grad_()
    y = getattr(normkit, op)(x, 16, w, backend=backend)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


# ----------------------------------------------------------------------------- eps as torch takes it

OPS = ["layer_norm", "rms_norm", "group_norm"]


def _spread(device):
    """x [4, 8] whose rows have variance (and mean square) 0.09 or 4 exactly enough: with eps=-0.5
    half the rows have var + eps < 0 (NaN, as torch) and half do not."""
    z = torch.randn(4, 8, dtype=torch.float64)
    z = (z - z.mean(1, keepdim=True)) / z.std(1, unbiased=False, keepdim=True)
    return (z * torch.tensor([0.3, 2.0, 0.3, 2.0], dtype=torch.float64)[:, None]).float().to(device)


def _norm_call(op, x, w, b, eps, backend=None):
    """(normkit's call, torch's call) of op on x [4, 8] (GroupNorm: as [4, 2, 4] in one group)."""
    if op == "group_norm":
        xg = x.view(4, 2, 4)
        return (lambda: normkit.group_norm(xg, 1, w[:2], b[:2], eps, backend=backend),
                lambda: F.group_norm(xg, 1, w[:2], b[:2], eps))
    if op == "rms_norm":
        return lambda: normkit.rms_norm(x, 8, w, eps, backend=backend), lambda: F.rms_norm(x, (8,), w, eps)
    return lambda: normkit.layer_norm(x, 8, w, b, eps, backend=backend), lambda: F.layer_norm(x, (8,), w, b, eps)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eps", [-0.5, -1, float("nan"), float("inf"), -float("inf"), True, "np.float32(0.25)",
                                 "tensor(-0.5)"])
@pytest.mark.parametrize("op", OPS)
def test_any_eps_torch_takes_computes_as_torch(op, eps, backend):
    """torch's norms take any value of their float argument (negative too: torch's OpInfo samples use
    eps=-0.5) and compute rsqrt(var + eps), NaN where var + eps < 0; normkit gives the same values,
    forward and backward, NaN where torch has NaN."""
    import numpy as np
    eps = {"np.float32(0.25)": np.float32(0.25), "tensor(-0.5)": torch.tensor(-0.5)}.get(eps, eps)
    x = _spread(DEVICE).requires_grad_()
    w, b = randn(8, device=DEVICE).requires_grad_(), randn(8, device=DEVICE).requires_grad_()
    ours, theirs = _norm_call(op, x, w, b, eps, backend)
    leaves = [x, w] + ([b] if op != "rms_norm" else [])
    y, y_ref = ours(), theirs()
    assert_close(y, y_ref, 2e-5, "y")
    dy = randn(*y.shape, device=DEVICE)
    grads, grads_ref = torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy)
    for name, g, g_ref in zip(("dx", "dweight", "dbias"), grads, grads_ref):
        assert_close(g, g_ref, 2e-5, name)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_negative_eps_in_the_kernel_level_api_and_the_oracle(op):
    x, w = _spread(DEVICE), randn(8, device=DEVICE)
    var = x.double().var(1, unbiased=False) if op == "layer_norm" else x.double().square().mean(1)
    expected = torch.rsqrt(var - 0.5)  # NaN in the two rows where var - 0.5 < 0
    assert expected.isnan().sum() == 2
    if op == "layer_norm":
        rstd, oracle_rstd = normkit.layer_norm_fwd(x, 8, w, None, -0.5)[2], ref.layer_norm(x, (8,), w, None, -0.5)[2]
    else:
        rstd, oracle_rstd = normkit.rms_norm_fwd(x, 8, w, -0.5)[1], ref.rms_norm(x, (8,), w, -0.5)[1]
    assert_close(rstd, expected, 2e-5, "rstd")
    assert_close(oracle_rstd, expected, 1e-12, "the oracle's rstd")


@pytest.mark.parametrize("eps", [None, "1e-5", 1 + 0j, "Fraction", "1-element tensor", "tensor requiring grad",
                                 10 ** 400])
@pytest.mark.parametrize("op", OPS)
def test_eps_torch_rejects_is_rejected_naming_eps(op, eps):
    import fractions
    if eps is None and op == "rms_norm":
        return  # rms_norm's eps=None: torch's default (the compute type's machine epsilon)
    eps = {"Fraction": fractions.Fraction(1, 10), "1-element tensor": torch.tensor([1e-5]),
           "tensor requiring grad": torch.tensor(1e-5, requires_grad=True)}.get(eps, eps)
    x, w, b = _spread("cpu"), randn(8), randn(8)
    ours, theirs = _norm_call(op, x, w, b, eps)
    with pytest.raises((TypeError, ValueError, OverflowError, RuntimeError)):
        theirs()
    with pytest.raises((TypeError, ValueError)) as info:
        ours()
    assert str(info.value).startswith("eps: "), str(info.value)


def test_host_plans_pack_a_float_beyond_float32_as_infinity():
    """eps=1e39 (taken by torch, inf in float32): a recorded launch packs it as the launcher casts it."""
    import struct
    from normkit._host import plans
    template, _, _ = plans.pack_params(["fp32", "fp32"], (1e39, -1e39))
    assert template[:8] == struct.pack("<ff", float("inf"), float("-inf"))


# ----------------------------------------------------------------------------- empty batches, every path

_ROW_EMPTY = [((0, 16), (16,)), ((0, 5, 16), (16,)), ((0, 3, 4, 4), (4, 4)), ((2, 0, 16), (16,)),
              ((3, 0), (0,)), ((2, 3, 0), (3, 0)), ((0, 0), (0,)), ((0,), (0,))]
_ROW_FUSED = {
    "plain": ({}, lambda y, x, r: y),
    "residual, prenorm, activation": (dict(prenorm=True, activation="silu"), lambda y, x, r: (F.silu(y), x + r)),
    "out_dtype": (dict(out_dtype=torch.bfloat16), lambda y, x, r: y.bfloat16()),
    "weight_offset, return_amax": (dict(weight_offset=1.0, return_amax=True), lambda y, x, r: (y, None)),
}


def _leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("create_graph", [False, True], ids=["backward", "create_graph"])
@pytest.mark.parametrize("fused", list(_ROW_FUSED))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape, normalized", _ROW_EMPTY, ids=[str(s) for s, _ in _ROW_EMPTY])
def test_row_norms_of_empty_tensors_as_torch(shape, normalized, op, backend, fused, create_graph):
    """Empty batches ((0, N), (0, L, N), (B, 0, N)) and empty rows (N = 0, which torch allows): the
    outputs torch gives, and gradients of the inputs' shapes (weight/bias: zeros, never None)."""
    kwargs, finish = _ROW_FUSED[fused]
    if backend == "cuda" and fused != "plain":
        pytest.skip("the CUDA backend has no fused epilogues")
    x, r = randn(*shape, device=DEVICE), randn(*shape, device=DEVICE)
    w, b = randn(*normalized, device=DEVICE), randn(*normalized, device=DEVICE)
    residual = "residual" in fused
    theirs = [_leaf(t) for t in (x, w, b, r)]
    ours = [_leaf(t) for t in (x, w, b, r)]

    def torch_op(x, w, b, r):
        h = x + r if residual else x
        w = w + 1.0 if "weight_offset" in fused else w
        y = F.layer_norm(h, normalized, w, b) if op == "layer_norm" else F.rms_norm(h, normalized, w)
        return finish(y, x, r)

    def normkit_op(x, w, b, r):
        extra = dict(kwargs, residual=r) if residual else kwargs
        if op == "layer_norm":
            return normkit.layer_norm(x, normalized, w, b, backend=backend, **extra)
        return normkit.rms_norm(x, normalized, w, backend=backend, **extra)

    out, out_ref = normkit_op(*ours), torch_op(*theirs)
    out, out_ref = (out, out_ref) if isinstance(out, tuple) else ((out,), (out_ref,))
    for o, o_ref in zip(out, out_ref):
        if o_ref is None:  # the amax of nothing
            assert o.shape == () and o.item() == 0
            continue
        assert o.shape == o_ref.shape and o.dtype == o_ref.dtype and o.device == o_ref.device
    used = [0, 1] + ([2] if op == "layer_norm" else []) + ([3] if residual else [])
    total = sum(o.float().sum() for o in out if o.requires_grad)
    grads = torch.autograd.grad(total, [ours[i] for i in used], create_graph=create_graph)
    for i, g in zip(used, grads):
        assert g is not None and g.shape == ours[i].shape and g.dtype == ours[i].dtype
        if i in (1, 2):
            assert torch.equal(g, torch.zeros_like(g)), f"{('dweight', 'dbias')[i - 1]}: {g}"


_GN_EMPTY = [((0, 2), 1), ((0, 2), 2), ((0, 4, 3), 2), ((0, 8, 3, 3), 4), ((0, 4, 2, 2, 2), 2), ((2, 4, 0), 2),
             ((2, 4, 0, 3), 4), ((0, 4, 0), 2), ((2, 0), 1), ((0, 0), 1), ((2, 0, 3), 1)]


@pytest.mark.parametrize("create_graph", [False, True], ids=["backward", "create_graph"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, groups", _GN_EMPTY, ids=[f"{s}-G{g}" for s, g in _GN_EMPTY])
def test_group_norm_of_empty_tensors_as_torch(shape, groups, backend, activation, create_graph):
    """Empty batches and empty groups: torch's output shape and dtype, dx of x's shape, and
    dweight/dbias exact zeros of shape (C,). (Empty groups with B > 0: torch's CPU kernel returns
    NaN for dweight, rsqrt(0/0) times an empty sum; an empty sum is 0.)"""
    x = randn(*shape, device=DEVICE)
    if x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    C = shape[1]
    x, w, b = _leaf(x), _leaf(randn(C, device=DEVICE)), _leaf(randn(C, device=DEVICE))
    y = normkit.group_norm(x, groups, w, b, activation=activation, backend=backend)
    # torch's on the CPU: its CUDA kernel fails with C = 0 (CUDA error: invalid argument, torch 2.11)
    y_ref = F.group_norm(x.detach().cpu(), groups, w.detach().cpu(), b.detach().cpu())
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    dx, dw, db = torch.autograd.grad(y.sum(), [x, w, b], create_graph=create_graph)
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, normalized", _ROW_EMPTY, ids=[str(s) for s, _ in _ROW_EMPTY])
def test_kernel_level_api_of_empty_tensors(shape, normalized, backend):
    """layer_norm_fwd/bwd, rms_norm_fwd/bwd: statistics of the leading shape (NaN for empty rows,
    0/0, as torch's native_layer_norm's rstd), dx of x's shape, dweight/dbias zeros."""
    x, dy = randn(*shape, device=DEVICE), randn(*shape, device=DEVICE)
    w, b = randn(*normalized, device=DEVICE), randn(*normalized, device=DEVICE)
    lead = shape[: len(shape) - len(normalized)]
    y, mean, rstd = normkit.layer_norm_fwd(x, normalized, w, b, backend=backend)
    assert y.shape == x.shape and mean.shape == lead and rstd.shape == lead and rstd.isnan().all()
    dx, dw, db = normkit.layer_norm_bwd(dy, x, w, mean, rstd, backend=backend)
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))
    y, rstd = normkit.rms_norm_fwd(x, normalized, w, backend=backend)
    assert y.shape == x.shape and rstd.shape == lead and rstd.isnan().all()
    dx, dw = normkit.rms_norm_bwd(dy, x, w, rstd, backend=backend)
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w))
    if backend != "cuda":  # fused options: the Triton and torch backends
        y, mean, rstd, h = normkit.layer_norm_fwd(x, normalized, w, b, residual=dy, activation="gelu",
                                                  backend=backend)
        dx, dw, db, dres = normkit.layer_norm_bwd(dy, h, w, mean, rstd, bias=b, activation="gelu", dh=dy,
                                                  dresidual_dtype=torch.bfloat16, backend=backend)
        assert dx.shape == dres.shape == x.shape and dres.dtype == torch.bfloat16
        assert torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_double_backward_of_a_single_row(op, backend):
    """x with no leading dims (one row): the differentiable backward sums the weight gradient over no
    dims (sum(()) would sum them all)."""
    x, w = randn(16, device=DEVICE), randn(16, device=DEVICE)
    grads = []
    for fn in (getattr(normkit, op), getattr(F, op)):
        xl, wl = _leaf(x), _leaf(w)
        y = fn(xl, (16,), wl, **({"backend": backend} if fn is getattr(normkit, op) else {}))
        dx, dw = torch.autograd.grad((y * y).sum(), [xl, wl], create_graph=True)
        grads.append((dx, dw) + torch.autograd.grad((dx * dx).sum() + dw.sum(), [xl, wl]))
    for name, g, g_ref in zip(("dx", "dweight", "ddx", "ddweight"), *grads):
        assert g.shape == g_ref.shape
        assert_close(g, g_ref, 1e-4, name)


# ----------------------------------------------------------------------------- exact zeros

def _one_element_grads(op_call, leaves, dy):
    out = op_call()
    outs = out if isinstance(out, tuple) else (out,)
    return torch.autograd.grad(outs, leaves, dy[: len(outs)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["weight, bias", "no weight", "activation", "activation, no weight", "weight_offset",
                                  "residual, prenorm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_over_one_element_has_dx_exactly_zero(backend, case, dtype, rows=(64, 3)):
    """normalized_shape (1,): y is the bias whatever x is, so dx is exactly 0, as torch gives it (with
    a residual and prenorm=True: dx = dh exactly). The kernels form dx = rstd * (w*dy - xhat * c1 - c2)
    with xhat = 0 and c2 = w*dy here: a GPU compiler that fuses w*dy into the subtraction (an FMA)
    leaves w*dy's rounding error times rstd (~300 at eps=1e-5), 4e-5 on an H100 before the kernels
    rounded w*dy by itself."""
    if backend == "cuda" and case in ("weight_offset", "residual, prenorm"):
        pytest.skip("the CUDA backend has no fused epilogues")
    x, r = (randn(*rows, 1, dtype=dtype, device=DEVICE).requires_grad_() for _ in range(2))
    w, b = (randn(1, device=DEVICE).requires_grad_() for _ in range(2))
    dy = [randn(*rows, 1, dtype=dtype, device=DEVICE) for _ in range(2)]
    kwargs = {"activation": dict(activation="gelu"), "activation, no weight": dict(activation="silu"),
              "weight_offset": dict(weight_offset=1.0), "residual, prenorm": dict(residual=r, prenorm=True)}
    kwargs = kwargs.get(case, {})
    weight = None if "no weight" in case else w
    dx = _one_element_grads(lambda: normkit.layer_norm(x, (1,), weight, b, backend=backend, **kwargs), [x], dy)[0]
    expected = dy[1] if case == "residual, prenorm" else torch.zeros_like(x)
    assert torch.equal(dx, expected), f"dx: max |error| {(dx.float() - expected.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("activation", [None, "mish"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_norm_of_one_element_per_group_has_dx_exactly_zero(backend, activation, channels_last, batch=4):
    """One element per group (x [B, 16, 1, 1] in 16 groups): y = act(bias), so dx is exactly 0."""
    x = randn(batch, 16, 1, 1, device=DEVICE)
    x = (x.to(memory_format=torch.channels_last) if channels_last else x).requires_grad_()
    w, b = randn(16, device=DEVICE), randn(16, device=DEVICE)
    dx = torch.autograd.grad(normkit.group_norm(x, 16, w, b, activation=activation, backend=backend), x,
                             randn(batch, 16, 1, 1, device=DEVICE))[0]
    assert torch.equal(dx, torch.zeros_like(x)), f"dx: max |error| {dx.abs().max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_one_element_rows_and_groups_have_dx_exactly_zero_at_size(backend):
    """The same on the GPU with many rows and groups (persistent, split and staged launches)."""
    for case in ("weight, bias", "activation"):
        test_layer_norm_over_one_element_has_dx_exactly_zero(backend, case, torch.float32, rows=(64, 1024))
        test_layer_norm_over_one_element_has_dx_exactly_zero(backend, case, torch.bfloat16, rows=(8, 4096))
    for channels_last in (False, True):
        test_group_norm_of_one_element_per_group_has_dx_exactly_zero(backend, "mish", channels_last, batch=512)
        test_group_norm_of_one_element_per_group_has_dx_exactly_zero(backend, None, channels_last, batch=2)
