"""Everything torch's norms support under autograd, normkit supports (issue 13), on every backend that
runs here: in-place ops on outputs, double backward, torch.func (vmap, grad, jacrev, jvp, hessian),
forward-mode AD, autocast dtypes, inference_mode / no_grad, requires_grad on any subset.

Each case is checked against torch's own op (F.layer_norm / F.rms_norm / F.group_norm and torch's
activations) evaluated in float64 on the same values: the contract is torch's behaviour, and float64
makes the comparison about normkit's error alone.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad as fwAD

import normkit
from conftest import DEVICE
from helpers import randn

BACKENDS = ["torch", "triton"] + (["cuda"] if DEVICE == "cuda" else [])
ACT = {None: lambda z: z, "silu": F.silu, "mish": F.mish, "gelu": F.gelu, "relu": F.relu,
       "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}
TOL = 2e-4  # float32 inputs against float64: first and second derivatives through rsqrt and products


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# one case per op: (normkit call, torch call in the same argument order, x shape, param shape)
def _ln(backend, act=None):
    return (lambda x, w, b: normkit.layer_norm(x, x.shape[-1:], w, b, 1e-5, activation=act, backend=backend),
            lambda x, w, b: ACT[act](F.layer_norm(x, x.shape[-1:], w, b, 1e-5)))


def _rms(backend, act=None):
    return (lambda x, w, b: normkit.rms_norm(x, x.shape[-1:], w, 1e-6, activation=act, backend=backend),
            lambda x, w, b: ACT[act](F.rms_norm(x, x.shape[-1:], w, 1e-6)))


def _gn(backend, act=None):
    return (lambda x, w, b: normkit.group_norm(x, 4, w, b, 1e-5, activation=act, backend=backend),
            lambda x, w, b: ACT[act](F.group_norm(x, 4, w, b, 1e-5)))


OPS = {"layer_norm": (_ln, (3, 5, 24), (24,)), "rms_norm": (_rms, (3, 5, 24), (24,)),
       "group_norm": (_gn, (2, 8, 3, 5), (8,))}
CASES = [(op, be) for op in OPS for be in BACKENDS]


def _inputs(op, seed=0, dtype=torch.float32, grad=(True, True, True)):
    gen = torch.Generator().manual_seed(seed)
    _, xs, ps = OPS[op]
    x = randn(*xs, gen=gen, dtype=dtype, device=DEVICE)
    w = (1 + 0.5 * randn(*ps, gen=gen)).to(DEVICE)
    b = None if op == "rms_norm" else (0.3 * randn(*ps, gen=gen)).to(DEVICE)
    for t, g in zip((x, w, b), grad):
        if t is not None:
            t.requires_grad_(g)
    return x, w, b


def _f64(*ts):
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts]


# ----------------------------------------------------------------------------- in-place on outputs

@pytest.mark.parametrize("op,backend", CASES)
@pytest.mark.parametrize("inplace", ["relu_", "add_residual", "view_mul_"])
def test_in_place_on_the_output_gives_torchs_gradients(op, backend, inplace):
    ours, theirs = OPS[op][0](backend)
    x, w, b = _inputs(op)
    resid = randn(*x.shape, device=DEVICE)

    def step(f, x, w, b, r):
        h = f(x, w, b)
        if inplace == "relu_":
            h.relu_()
        elif inplace == "add_residual":
            h += r  # h = norm(x); h += x: the pre-norm block pattern
        else:
            h[:, :2].mul_(2.0)  # in place on a view of the output
        return h

    h = step(ours, x, w, b, resid)
    assert not h._is_view()
    dh = randn(*x.shape, device=DEVICE)
    got = torch.autograd.grad(h, [t for t in (x, w, b) if t is not None], dh)
    x64, w64, b64 = _f64(x, w, b)
    h64 = step(theirs, x64, w64, b64, resid.double())
    want = torch.autograd.grad(h64, [t for t in (x64, w64, b64) if t is not None], dh.double())
    assert rel(h, h64) < 1e-5
    for g, e in zip(got, want):
        assert rel(g, e) < 1e-4


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm", "GroupNorm"])
def test_modules_allow_in_place_on_their_output(module):
    m = {"LayerNorm": lambda: normkit.LayerNorm(16), "RMSNorm": lambda: normkit.RMSNorm(16),
         "GroupNorm": lambda: normkit.GroupNorm(4, 16)}[module]().to(DEVICE)
    x = randn(2, 16, 16, device=DEVICE).requires_grad_()
    y = m(x)
    y.relu_()
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert m.weight.grad is not None


# ----------------------------------------------------------------------------- double backward

@pytest.mark.parametrize("op,backend", CASES)
@pytest.mark.parametrize("act", [None, "silu"])
def test_double_backward_matches_torch(op, backend, act):
    """Gradient penalty: d/d(x, w, b) of ||d(loss)/dx||^2, with create_graph=True."""
    ours, theirs = OPS[op][0](backend, act)

    def penalty(f, x, w, b):
        y = f(x, w, b)
        loss = (y * y.detach().sin()).sum()
        gx, = torch.autograd.grad(loss, x, create_graph=True)
        return gx.pow(2).sum()

    x, w, b = _inputs(op)
    params = [t for t in (x, w, b) if t is not None]
    # without an activation the bias does not reach dx: torch reports it unused, and so must we
    got = torch.autograd.grad(penalty(ours, x, w, b), params, allow_unused=True)
    x64, w64, b64 = _f64(x, w, b)
    want = torch.autograd.grad(penalty(theirs, x64, w64, b64), [t for t in (x64, w64, b64) if t is not None],
                               allow_unused=True)
    for g, e, t in zip(got, want, params):
        if e is None:
            assert g is None or not g.any()
            continue
        assert g is not None and g.dtype == t.dtype
        assert rel(g, e) < TOL, (op, backend, rel(g, e))


@pytest.mark.parametrize("op,backend", CASES)
def test_hessian_vector_product(op, backend):
    ours, theirs = OPS[op][0](backend)
    x, w, b = _inputs(op)
    v = randn(*x.shape, device=DEVICE)

    def hvp(f, x, w, b, v):
        g, = torch.autograd.grad(f(x, w, b).pow(3).sum(), x, create_graph=True)
        return torch.autograd.grad(g, x, v)[0]

    x64, w64, b64 = _f64(x, w, b)
    assert rel(hvp(ours, x, w, b, v), hvp(theirs, x64, w64, b64, v.double())) < TOL


def test_third_order_gradient():
    """Against the textbook composite in float64: torch's own layer_norm is wrong at third order (its
    double-backward formula is not differentiated correctly again: 0.22 relative error on this case)."""
    x = randn(2, 7, device=DEVICE).requires_grad_()
    x64 = x.detach().double().requires_grad_()

    def composite(t):
        m = t.mean(-1, keepdim=True)
        return (t - m) / torch.sqrt(((t - m) ** 2).mean(-1, keepdim=True) + 1e-5)

    out = []
    for f, t in ((lambda t: normkit.layer_norm(t, 7), x), (composite, x64)):
        g1, = torch.autograd.grad(f(t).pow(3).sum(), t, create_graph=True)
        g2, = torch.autograd.grad(g1.sin().sum(), t, create_graph=True)
        out.append(torch.autograd.grad(g2.pow(2).sum(), t)[0])
    assert rel(*out) < 1e-3


# ----------------------------------------------------------------------------- torch.func

def _func_case(op, backend, act=None):
    ours, theirs = OPS[op][0](backend, act)
    x, w, b = _inputs(op, grad=(False, False, False))
    return ours, theirs, x, w, b


@pytest.mark.parametrize("op,backend", CASES)
@pytest.mark.parametrize("in_dim", [0, 1, -1])
def test_vmap_over_any_batch_dim(op, backend, in_dim):
    """vmap with the batch dim anywhere in the physical tensor: at the front, among the leading dims,
    or last (inside the region the normalized dims occupy in memory)."""
    ours, theirs, x, w, b = _func_case(op, backend, "gelu")
    xb = torch.stack([x, 2 * x + 1, x.flip(0)], dim=in_dim if in_dim >= 0 else x.dim())
    got = torch.func.vmap(lambda t: ours(t, w, b), in_dims=in_dim)(xb)
    want = torch.stack([theirs(t.double(), w.double(), None if b is None else b.double())
                        for t in xb.unbind(in_dim)])
    assert got.shape == want.shape
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("op,backend", CASES)
def test_vmap_over_weights_model_ensemble(op, backend):
    ours, theirs, x, w, b = _func_case(op, backend, "silu")
    ws = torch.stack([w, w * 0.5, -w])
    bs = None if b is None else torch.stack([b, b + 1, -b])
    got = torch.func.vmap(lambda w_, b_: ours(x, w_, b_), in_dims=(0, None if b is None else 0))(ws, bs)
    want = torch.stack([theirs(x.double(), ws[i].double(), None if b is None else bs[i].double()) for i in range(3)])
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("op,backend", CASES)
def test_grad_and_jacrev(op, backend):
    ours, theirs, x, w, b = _func_case(op, backend, "mish")
    g = torch.func.grad(lambda t, w_: ours(t, w_, b).sin().sum(), argnums=(0, 1))(x, w)
    e = torch.func.grad(lambda t, w_: theirs(t, w_, None if b is None else b.double()).sin().sum(),
                        argnums=(0, 1))(x.double(), w.double())
    assert rel(g[0], e[0]) < 1e-4 and rel(g[1], e[1]) < 1e-4
    x1 = x[:1]  # one sample: the Jacobian is (numel x numel)
    jac = torch.func.jacrev(lambda t: ours(t, w, b))(x1)
    jac_ref = torch.func.jacrev(lambda t: theirs(t, w.double(), None if b is None else b.double()))(x1.double())
    assert rel(jac, jac_ref) < 1e-4


@pytest.mark.parametrize("op,backend", CASES)
def test_per_sample_gradients(op, backend):
    """Opacus-style per-sample weight gradients: vmap(grad) over the batch."""
    ours, theirs, x, w, b = _func_case(op, backend)

    def loss(f, w_, sample):
        return f(sample.unsqueeze(0), w_, None if b is None else b.to(w_.dtype)).pow(2).sum()

    got = torch.func.vmap(torch.func.grad(lambda w_, s: loss(ours, w_, s)), in_dims=(None, 0))(w, x)
    want = torch.func.vmap(torch.func.grad(lambda w_, s: loss(theirs, w_, s)), in_dims=(None, 0))(w.double(),
                                                                                                x.double())
    assert got.shape == (x.shape[0],) + w.shape
    assert rel(got, want) < 1e-4


@pytest.mark.parametrize("op,backend", CASES)
@pytest.mark.parametrize("act", [None, "gelu_tanh"])
def test_jvp_and_forward_ad(op, backend, act):
    ours, theirs, x, w, b = _func_case(op, backend, act)
    tx, tw = randn(*x.shape, device=DEVICE), randn(*w.shape, device=DEVICE)
    tb = None if b is None else randn(*b.shape, device=DEVICE)
    prim = (x, w) + (() if b is None else (b,))
    tang = (tx, tw) + (() if b is None else (tb,))
    f_ours = (lambda x_, w_, b_=None: ours(x_, w_, b_))
    f_theirs = (lambda x_, w_, b_=None: theirs(x_, w_, b_))
    y, ty = torch.func.jvp(f_ours, prim, tang)
    y_ref, ty_ref = torch.func.jvp(f_theirs, tuple(p.double() for p in prim), tuple(t.double() for t in tang))
    assert rel(y, y_ref) < 1e-5 and rel(ty, ty_ref) < 1e-4
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(prim, tang)]
        out = fwAD.unpack_dual(f_ours(*duals))
    assert out.tangent is not None and rel(out.tangent, ty_ref) < 1e-4


@pytest.mark.parametrize("op", list(OPS))
def test_hessian_forward_over_reverse(op):
    ours, theirs, x, w, b = _func_case(op, "torch")
    x1 = x[:1]
    h = torch.func.hessian(lambda t: ours(t, w, b).pow(3).sum())(x1)
    h_ref = torch.func.hessian(lambda t: theirs(t, w.double(), None if b is None else b.double()).pow(3).sum())(
        x1.double())
    assert rel(h, h_ref) < 1e-3


# ----------------------------------------------------------------------------- grad modes, subsets

SUBSETS = [(True, False, False), (False, True, False), (False, False, True), (False, True, True), (True, True, True)]


@pytest.mark.parametrize("op,backend,grad", [(op, be, g) for op, be in CASES for g in SUBSETS
                                             if op != "rms_norm" or g != (False, False, True)])  # RMSNorm: no bias
def test_requires_grad_on_any_subset(op, backend, grad):
    ours, theirs = OPS[op][0](backend)
    x, w, b = _inputs(op, grad=grad)
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    dy = randn(*x.shape, device=DEVICE)
    got = torch.autograd.grad(ours(x, w, b), leaves, dy)
    x64, w64, b64 = _f64(x, w, b)
    want = torch.autograd.grad(theirs(x64, w64, b64), [t for t in (x64, w64, b64) if t is not None and t.requires_grad],
                               dy.double())
    for g, e in zip(got, want):
        assert rel(g, e) < 1e-4


@pytest.mark.parametrize("op,backend", CASES)
def test_no_grad_and_inference_mode(op, backend):
    ours, theirs = OPS[op][0](backend)
    x, w, b = _inputs(op)
    want = theirs(*_f64(x, w, b))
    with torch.no_grad():
        y = ours(x, w, b)
    assert not y.requires_grad and y.grad_fn is None and rel(y, want) < 1e-5
    with torch.inference_mode():
        y = ours(x, w, b)
        assert y.is_inference() and rel(y, want) < 1e-5


def test_grad_only_through_a_later_in_place_op():
    """A norm output that needs no grad becomes part of the graph through an in-place add, and
    an input that gets requires_grad from an in-place copy is tracked from then on."""
    x = randn(3, 8, device=DEVICE)
    r = randn(3, 8, device=DEVICE).requires_grad_()
    y = normkit.layer_norm(x, 8)
    assert not y.requires_grad
    y.add_(r)
    y.sum().backward()
    assert torch.equal(r.grad, torch.ones_like(r))
    w = randn(8, device=DEVICE).requires_grad_()
    buf = torch.zeros(3, 8, device=DEVICE)
    buf[1].copy_(w)  # buf now requires grad through the in-place copy
    assert buf.requires_grad
    v = randn(3, 8, device=DEVICE)
    g, = torch.autograd.grad((normkit.rms_norm(buf + x, 8) * v).sum(), w, retain_graph=True)
    g_ref, = torch.autograd.grad((F.rms_norm((buf + x).double(), (8,)) * v).sum(), w)
    assert rel(g, g_ref) < 1e-4


# ----------------------------------------------------------------------------- autocast

@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_autocast_dtype_and_values_follow_torch(op, dtype):
    """The same output dtype and values as torch's op under the same autocast region: on CUDA the
    norms run in float32 and return float32; CPU autocast leaves them alone."""
    ours, theirs = OPS[op][0](None)
    x, w, b = _inputs(op, dtype=dtype, grad=(False, False, False))
    w = w.to(dtype)
    b = None if b is None else b.to(dtype)
    device_type = DEVICE if DEVICE == "cuda" else "cpu"
    with torch.autocast(device_type, dtype=torch.bfloat16):
        y = ours(x, w, b)
        y_ref = theirs(x, w, b)
    assert y.dtype == y_ref.dtype
    tol = 1e-5 if y.dtype == torch.float32 else 1e-2
    assert rel(y, y_ref) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_cuda_autocast_upcasts_bf16_and_grads_flow_back_in_bf16(op):
    ours, theirs = OPS[op][0](None)
    x, w, b = _inputs(op, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = ours(x, w, b)
        want = theirs(x, w, b).dtype  # float32, except rms_norm before torch 2.12 (not on autocast's list)
    assert y.dtype == want
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
