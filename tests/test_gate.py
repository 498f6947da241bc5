"""The gated norm as a fused op (issue 23): rms_norm / layer_norm with gate=.

y = norm(x * silu(gate)) with x * silu(gate) formed in fp32 in the norm's pass (Mamba-2's
MambaRMSNormGated and its copies); the backward gives dx = dz * silu(gate) and dgate = dz * x *
silu'(gate) in the same pass, dz being the norm's input gradient. Checked against the float64
oracle (normkit.reference with gate=) by relative error on fresh random data, on the torch backend
and the Triton kernels (the interpreter on CPU, compiled on a GPU), for awkward sizes, strided rows,
bf16/fp16/fp32 x with a gate of another dtype, per-group (per-head) weights, the looped kernels, the
other fused options it combines with; gradients through float64 gradcheck, double backward,
forward AD and vmap; the custom op under torch.compile (fullgraph) and opcheck; errors that name the
argument; and the host path stepping aside.
"""
import pytest
import torch

import normkit
from normkit import reference as ref

from conftest import DEVICE
from helpers import TOL, dx_scale_err, randn
from test_row_norm import looped  # noqa: F401  (the fixture: rows wider than 64 walked in chunks of 128)

BACKENDS = ["torch", "triton"]
OPS = ["layer_norm", "rms_norm"]
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
EPS = 1e-5


def _call(op, x, n, w, b, backend, **kw):
    if op == "layer_norm":
        return normkit.layer_norm(x, n, w, b, EPS, backend=backend, **kw)
    return normkit.rms_norm(x, n, w, EPS, backend=backend, **kw)


def _oracle(op, x, n, w, b, dy, act=None, **kw):
    """float64 (y, (dx, dw, [db,] dgate)) from the oracle."""
    shape = (n,) if isinstance(n, int) else tuple(n)
    if op == "layer_norm":
        return ref.layer_norm(x, shape, w, b, EPS, act, **kw)[0], ref.layer_norm_backward(dy, x, shape, w, b, EPS,
                                                                                         act, **kw)
    return ref.rms_norm(x, shape, w, EPS, act, **kw)[0], ref.rms_norm_backward(dy, x, shape, w, EPS, act, **kw)


def _inputs(x_shape, w_shape, dtype=FP32, gate_dtype=FP32, wdtype=FP32, op="rms_norm", seed=0, grad=True):
    gen = torch.Generator().manual_seed(seed)
    x = randn(*x_shape, dtype=dtype, gen=gen, device=DEVICE).requires_grad_(grad)
    g = (1.5 * randn(*x_shape, gen=gen)).to(DEVICE, gate_dtype).requires_grad_(grad)
    w = (1 + 0.5 * randn(*w_shape, gen=gen)).to(DEVICE, wdtype).requires_grad_(grad)
    b = (0.3 * randn(*w_shape, gen=gen)).to(DEVICE, wdtype).requires_grad_(grad) if op == "layer_norm" else None
    return x, g, w, b


def _check(op, backend, x, n, g, w, b, act=None, seed=1, **kw):
    """Forward and every gradient (dgate included) against the oracle; returns the gradients."""
    y = _call(op, x, n, w, b, backend, gate=g, activation=act, **kw)
    out_dtype = kw.get("out_dtype") or x.dtype
    assert y.dtype == out_dtype and y.shape == x.shape
    dy = randn(*y.shape, dtype=y.dtype, gen=torch.Generator().manual_seed(seed), device=DEVICE)
    y64, g64 = _oracle(op, x, n, w, b, dy, act, gate=g, weight_offset=kw.get("weight_offset", 0.0))
    tol = TOL[out_dtype] if out_dtype != x.dtype else TOL[x.dtype]
    assert ref.rel_err(y, y64) <= max(tol, TOL[x.dtype]), ("y", ref.rel_err(y, y64))
    params = [p for p in (x, w, b, g) if p is not None]
    names = [nm for nm, p in zip(("dx", "dw", "db", "dgate"), (x, w, b, g)) if p is not None]
    grads = torch.autograd.grad(y, params, dy)
    for name, p, got, want in zip(names, params, grads, [t for t in g64 if t is not None]):
        assert got.dtype == p.dtype and got.shape == p.shape, name
        # dx and dgate: elementwise values rounded to their dtype, from inputs rounded to x's; the
        # weight gradients are fp32 sums rounded to their dtype
        bound = max(TOL[p.dtype], TOL[x.dtype]) if name in ("dx", "dgate") else max(2e-5, TOL[x.dtype]
                                                                                      if x.dtype != FP32 else 0.0)
        if name in ("dx", "dgate") and x.shape[-1] == 1 and op == "rms_norm":
            # rows of one element: RMSNorm's dz is a difference that cancels to ~0; measure the error
            # against the size of its terms, rstd * w * dy, times silu(g) (dx) or x * silu'(g) (dgate)
            g64 = g.double()
            s = torch.sigmoid(g64)
            chain = g64 * s if name == "dx" else x.double() * s * (1 + g64 * (1 - s))
            err = dx_scale_err(got, want, dy, w.double() * chain, ref.rms_norm(x, (1,), None, EPS, gate=g)[1])
            assert err <= bound, (name, err, bound)
            continue
        assert ref.rel_err(got, want) <= bound, (name, ref.rel_err(got, want), bound)
    return grads


# ----------------------------------------------------------------------------- shapes and dtypes

# (x shape, normalized shape)
SHAPES = {
    "N1_row": ((1, 24), (24,)),
    "prime_rows_prime_N": ((7, 37), (37,)),
    "N100_masked_tail": ((2, 3, 100), (100,)),
    "N1": ((3, 4, 1), (1,)),
    "3d": ((2, 5, 64), (64,)),
    "2d_normalized": ((2, 3, 4, 6), (4, 6)),
}


@pytest.mark.parametrize("case", list(SHAPES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_match_the_oracle(backend, op, case, poison):
    x_shape, n = SHAPES[case]
    x, g, w, b = _inputs(x_shape, n, op=op)
    _check(op, backend, x, n, g, w, b)


# (x dtype, gate dtype, weight dtype, activation)
DTYPE_CASES = {
    "bf16_fp32gate": (BF16, FP32, FP32, None),
    "bf16_bf16gate_bf16w": (BF16, BF16, BF16, None),
    "fp16_fp32gate_silu": (FP16, FP32, FP32, "silu"),
    "fp32_bf16gate": (FP32, BF16, FP32, None),
    "fp32_fp16gate_gelu": (FP32, FP16, FP32, "gelu_tanh"),
}


@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dtypes_match_the_oracle(backend, op, case, poison):
    dtype, gdtype, wdtype, act = DTYPE_CASES[case]
    x, g, w, b = _inputs((3, 6, 40), (40,), dtype, gdtype, wdtype, op=op, seed=2)
    _check(op, backend, x, 40, g, w, b, act=act)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_weight(backend, poison):
    x, g, _, _ = _inputs((4, 32), (32,))
    _check("rms_norm", backend, x, 32, g, None, None)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_as_per_head_weights(backend, dtype, poison):
    """Mamba-2's groups (group_size < hidden): x and the gate viewed as (..., G, group_size) and the
    weight as (G, group_size) with normalized_shape (group_size,), per-head weights."""
    G, gs = 4, 24
    x, g, w, _ = _inputs((2, 5, G * gs), (G * gs,), dtype=dtype, seed=4)
    wg = w.detach().view(G, gs).requires_grad_()
    _check("rms_norm", backend, x.view(2, 5, G, gs), gs, g.view(2, 5, G, gs), wg, None)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows(backend, op, poison):
    """x and the gate as strided views of wider buffers (Mamba-2's gate is a slice of the in-projection):
    read in place, same values as contiguous rows."""
    gen = torch.Generator().manual_seed(3)
    big = randn(3, 10, 96, gen=gen, device=DEVICE)
    x = big[:, ::2, :40].detach().requires_grad_()
    g = big[:, 1::2, 50:90].detach().requires_grad_()
    w = (1 + 0.5 * randn(40, gen=gen, device=DEVICE)).requires_grad_()
    b = (0.3 * randn(40, gen=gen, device=DEVICE)).requires_grad_() if op == "layer_norm" else None
    _check(op, backend, x, 40, g, w, b)


@pytest.mark.parametrize("op", OPS)
def test_looped_kernels(op, looped, poison):
    """Rows wider than the (forced) tile width: the forward and backward walk them in chunks."""
    x, g, w, b = _inputs((3, 300), (300,), BF16, FP32, op=op, seed=5)
    _check(op, "triton", x, 300, g, w, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_weight_offset_out_dtype_and_amax(backend, poison):
    x, g, w, _ = _inputs((4, 48), (48,), BF16, FP32, seed=6)
    y, amax = normkit.rms_norm(x, 48, w, EPS, gate=g, weight_offset=1.0, out_dtype=FP32, return_amax=True,
                               backend=backend)
    y64 = ref.rms_norm(x, (48,), w, EPS, gate=g, weight_offset=1.0)[0]
    assert y.dtype == FP32 and ref.rel_err(y, y64) <= 2e-5
    assert abs(amax.item() - y64.abs().max().item()) <= 2e-5 * y64.abs().max().item()
    _check("rms_norm", backend, x, 48, g, w, None, weight_offset=1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    x, g, w, _ = _inputs((0, 4, 16), (16,))
    y = normkit.rms_norm(x, 16, w, gate=g, backend=backend)
    assert y.shape == x.shape
    dx, dw, dg = torch.autograd.grad(y.sum(), [x, w, g])
    assert dx.shape == x.shape and dg.shape == g.shape and not dw.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_stays_in_its_row(backend):
    """A NaN in one row's gate makes that row (and its dx, dgate) NaN, nothing else."""
    x, g, w, _ = _inputs((3, 4, 20), (20,), grad=False)
    g = g.clone()
    g[1, 2, 5] = float("nan")
    x.requires_grad_()
    g.requires_grad_()
    y = normkit.rms_norm(x, 20, w, gate=g, backend=backend)
    bad = torch.zeros(3, 4, dtype=torch.bool, device=DEVICE)
    bad[1, 2] = True
    assert torch.isnan(y[bad]).all() and not torch.isnan(y[~bad]).any()
    dx, dg = torch.autograd.grad(y, [x, g], torch.ones_like(y))
    assert torch.isnan(dx[bad]).all() and not torch.isnan(dx[~bad]).any()
    assert torch.isnan(dg[bad]).all() and not torch.isnan(dg[~bad]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_gradient_is_deterministic(backend):
    x, g, w, _ = _inputs((64, 48), (48,), BF16, BF16, seed=7)
    dy = randn(64, 48, dtype=BF16, device=DEVICE)
    runs = [torch.autograd.grad(normkit.rms_norm(x, 48, w, gate=g, backend=backend), [w, g], dy) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


# ----------------------------------------------------------------------------- autograd

@pytest.mark.parametrize("op", OPS)
def test_gradcheck_gradgradcheck_forward_ad(op):
    gen = torch.Generator().manual_seed(8)
    t = lambda *s: randn(*s, dtype=FP64, gen=gen).requires_grad_()  # noqa: E731
    x, g, w, b = t(3, 12), t(3, 12), t(12), t(12)

    def f(x_, w_, b_, g_):
        return _call(op, x_, 12, w_, b_ if op == "layer_norm" else None, "torch", gate=g_)
    assert torch.autograd.gradcheck(f, (x, w, b, g), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, (x, w, b, g))


def test_vmap_over_x_and_gate():
    x, g, w, _ = _inputs((5, 3, 16), (16,), grad=False)
    out = torch.func.vmap(lambda a, c: normkit.rms_norm(a, 16, w, EPS, gate=c, backend="torch"))(x, g)
    assert ref.rel_err(out, ref.rms_norm(x, (16,), w, EPS, gate=g)[0]) <= TOL[FP32]


def test_compile_fullgraph():
    x, g, w, _ = _inputs((3, 5, 24), (24,), grad=False)
    torch._dynamo.reset()
    fn = torch.compile(lambda x_, g_: normkit.rms_norm(x_, 24, w, EPS, gate=g_) * 2.0, fullgraph=True)
    assert ref.rel_err(fn(x, g), 2.0 * ref.rms_norm(x, (24,), w, EPS, gate=g)[0]) <= TOL[FP32]
    xg, gg = x.clone().requires_grad_(), g.clone().requires_grad_()
    fn(xg, gg).sum().backward()
    dy = torch.full(x.shape, 2.0, dtype=FP32, device=DEVICE)
    dx, _, dg = ref.rms_norm_backward(dy, x, (24,), w, EPS, gate=g)
    assert ref.rel_err(xg.grad, dx) <= TOL[FP32] and ref.rel_err(gg.grad, dg) <= TOL[FP32]
    torch._dynamo.reset()


def test_fused_ops_pass_opcheck_with_gate():
    gen = torch.Generator().manual_seed(11)
    t = lambda *s, grad=True: randn(*s, gen=gen).requires_grad_(grad)  # noqa: E731
    fwd = torch.ops.normkit.row_norm_fused_fwd.default
    bwd = torch.ops.normkit.row_norm_fused_bwd.default
    x, w, b, g = t(2, 3, 16), t(16), t(16), t(2, 3, 16)
    torch.library.opcheck(fwd, (x, 1, w, b, 1e-5, False, "silu", "torch", None, None, 0.0, None, None, None, False,
                                None, None, g))
    _, _, mean, rstd, _ = fwd(x, 1, w, b, 1e-5, False, None, "torch", None, None, 0.0, None, None, None, False,
                              None, None, g)
    torch.library.opcheck(bwd, (t(2, 3, 16, grad=False), x.detach(), 1, w.detach(), b.detach(), mean.detach(),
                                rstd.detach(), False, None, FP32, FP32, "torch", 0.0, None, FP32, None, None, None,
                                None, None, g.detach()))


# ----------------------------------------------------------------------------- errors and paths

def test_errors_name_the_argument():
    x, g, w, _ = _inputs((2, 16), (16,), grad=False)
    with pytest.raises(ValueError, match="gate: expected x's shape"):
        normkit.rms_norm(x, 16, w, gate=g[:, :8])
    with pytest.raises(ValueError, match="gate: a gated norm with residual="):
        normkit.rms_norm(x, 16, w, gate=g, residual=x)
    with pytest.raises(ValueError, match="gate: a gated norm with adaLN modulation"):
        normkit.rms_norm(x, 16, w, gate=g, scale=torch.zeros(2, 16, device=DEVICE))
    with pytest.raises(TypeError, match="gate"):
        normkit.rms_norm(x, 16, w, gate=torch.ones(2, 16, dtype=torch.int32, device=DEVICE))


def test_backends_without_the_gate_say_so():
    name = "cuda" if DEVICE == "cuda" else "webgpu"
    from normkit import backends
    x, g, w, _ = _inputs((2, 16), (16,), grad=False)
    why = backends.get(name).why_unavailable(x)
    with pytest.raises(normkit.BackendUnavailableError) as info:
        normkit.rms_norm(x, 16, w, gate=g, backend=name)
    if why is None:
        assert "gate=" in str(info.value) and f"backend={name!r}" in str(info.value)


def test_host_path_gets_the_gate(host_path_calls):
    """Gated calls reach the host path with their gate (its argument 19); the Python path runs the
    calls it declines."""
    x, g, w, _ = _inputs((2, 3, 16), (16,), grad=False)
    y = normkit.rms_norm(x, 16, w, gate=g)
    assert ref.rel_err(y, ref.rms_norm(x, (16,), w, gate=g)[0]) <= TOL[FP32]
    normkit.layer_norm(x, 16, w, gate=g)
    # each call asks twice: first as the user passed it, then with its arguments checked (functional._row_norm)
    assert len(host_path_calls) == 4 and all(len(a) == 19 and a[18] is g for a in host_path_calls)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wanted", ["x", "weight", "x weight"])
def test_gradients_with_a_gate_that_wants_none(backend, wanted):
    """The gate does not require grad (dgate not asked, though the kernels write it): the other
    gradients are the oracle's (the Triton path once failed to set the unwanted dgate aside)."""
    x, g, w, _ = _inputs((2, 3, 16), (16,), grad=False)
    leaves = [p.requires_grad_() for p, name in ((x, "x"), (w, "weight")) if name in wanted.split()]
    y = normkit.rms_norm(x, 16, w, EPS, gate=g, backend=backend)
    dy = randn(*y.shape, gen=torch.Generator().manual_seed(1), device=DEVICE)
    dx64, dw64, _ = ref.rms_norm_backward(dy, x, (16,), w, EPS, gate=g)
    want = [t for t, name in ((dx64, "x"), (dw64, "weight")) if name in wanted.split()]
    for got, exp in zip(torch.autograd.grad(y, leaves, dy), want, strict=True):
        assert ref.rel_err(got, exp) <= 2e-5


def test_module_takes_the_gate():
    x, g, w, _ = _inputs((2, 3, 16), (16,), grad=False)
    m = normkit.RMSNorm(16, eps=EPS).to(DEVICE)
    with torch.no_grad():
        m.weight.copy_(w)
    assert ref.rel_err(m(x, gate=g), ref.rms_norm(x, (16,), w, EPS, gate=g)[0]) <= TOL[FP32]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 4096, 16384, 65536])
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_gpu_widths(n, dtype, poison):
    """Tile, split-row and looped kernels compiled on the GPU (the split path cannot run interpreted)."""
    x, g, w, _ = _inputs((8, n), (n,), dtype, FP32, seed=9)
    _check("rms_norm", "triton", x, n, g, w, None)
    x, g, w, b = _inputs((8, n), (n,), dtype, BF16, op="layer_norm", seed=10)
    _check("layer_norm", "triton", x, n, g, w, b)
