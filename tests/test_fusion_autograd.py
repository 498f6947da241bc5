"""The fused options under autograd as torch's ops are (issue 13's contract, kept by issue 15):
double backward, torch.func (vmap over inputs, the residual, weights and the fp8 scale; grad, jacrev,
jvp), forward-mode AD, in-place ops on y and h, and the custom ops that torch.compile and dispatch
modes see (opcheck, fullgraph compile equal to eager).

Each case is checked against the same computation written in torch ops (x + residual, then
F.layer_norm / F.rms_norm with weight_offset + weight) in float64, as tests/test_autograd.py does.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad as fwAD

import normkit
from normkit import reference as ref
from conftest import DEVICE
from helpers import randn

BACKENDS = ["torch", "triton"]  # the CUDA and WebGPU backends have no fused epilogues (test_fusion.py)
ACT = {None: lambda z: z, "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}
TOL = 2e-4
OFFSET = 0.5


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def ours(op, backend, act=None, offset=OFFSET, **kw):
    """(x, r, w, b) -> (y, h): normkit with a residual and a weight offset."""
    if op == "layer_norm":
        return lambda x, r, w, b: normkit.layer_norm(x, x.shape[-1:], w, b, 1e-5, activation=act, residual=r,
                                                     prenorm=True, weight_offset=offset, backend=backend, **kw)
    return lambda x, r, w, b: normkit.rms_norm(x, x.shape[-1:], w, 1e-6, activation=act, residual=r, prenorm=True,
                                               weight_offset=offset, backend=backend, **kw)


def theirs(op, act=None, offset=OFFSET):
    """The same in torch ops; per-head weights ([H, D]) apply after an unweighted norm."""
    def f(x, r, w, b):
        h = x + r
        n = h.shape[-1:]
        if w.dim() > 1:
            z = F.layer_norm(h, n, None, None, 1e-5) if op == "layer_norm" else F.rms_norm(h, n, None, 1e-6)
            z = z * (w + offset) + (b if b is not None else 0)
        elif op == "layer_norm":
            z = F.layer_norm(h, n, w + offset, b, 1e-5)
        else:
            z = F.rms_norm(h, n, w + offset, 1e-6)
        return ACT[act](z), h
    return f


def _inputs(op, shape=(3, 5, 24), pshape=(24,), seed=0, grad=True):
    gen = torch.Generator().manual_seed(seed)
    x = randn(*shape, gen=gen, device=DEVICE).requires_grad_(grad)
    r = randn(*shape, gen=gen, device=DEVICE).requires_grad_(grad)
    w = (0.5 * randn(*pshape, gen=gen)).to(DEVICE).requires_grad_(grad)
    b = (0.3 * randn(*pshape, gen=gen)).to(DEVICE).requires_grad_(grad) if op == "layer_norm" else None
    return x, r, w, b


def _f64(*ts):
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts]


CASES = [(op, be) for op in ("layer_norm", "rms_norm") for be in BACKENDS]


@pytest.mark.parametrize("op,backend", CASES)
def test_double_backward_through_residual_and_offset(op, backend):
    """A gradient penalty on x and the residual, differentiated again for x, residual, weight, bias."""
    def penalty(f, x, r, w, b):
        y, h = f(x, r, w, b)
        loss = (y * y.detach().sin()).sum() + (h * h.detach().cos()).sum()
        gx, gr = torch.autograd.grad(loss, [x, r], create_graph=True)
        return gx.pow(2).sum() + (gr * gr.detach()).sum()

    x, r, w, b = _inputs(op)
    leaves = [t for t in (x, r, w, b) if t is not None]
    got = torch.autograd.grad(penalty(ours(op, backend, "silu"), x, r, w, b), leaves, allow_unused=True)
    x64, r64, w64, b64 = _f64(x, r, w, b)
    want = torch.autograd.grad(penalty(theirs(op, "silu"), x64, r64, w64, b64),
                               [t for t in (x64, r64, w64, b64) if t is not None], allow_unused=True)
    for g, e in zip(got, want):
        assert rel(g, e) < TOL


@pytest.mark.parametrize("op,backend", CASES)
def test_in_place_on_the_outputs_as_torch(op, backend):
    """y is an ordinary tensor: in-place ops on it (and on views of it) give torch's gradients. h is
    what the norm normalized, kept for its backward, as torch's norm keeps its input: modifying it in
    place before the backward is refused, as for torch's ops."""
    x, r, w, b = _inputs(op)

    def step(f, x, r, w, b):
        y, h = f(x, r, w, b)
        y[:, :2].mul_(2.0)
        return y.sin().sum() + (h * h).sum()

    got = torch.autograd.grad(step(ours(op, backend), x, r, w, b), [x, r, w])
    x64, r64, w64, b64 = _f64(x, r, w, b)
    want = torch.autograd.grad(step(theirs(op), x64, r64, w64, b64), [x64, r64, w64])
    for g, e in zip(got, want):
        assert rel(g, e) < 1e-4
    for f, args in ((ours(op, backend), (x, r, w, b)), (theirs(op), (x64, r64, w64, b64))):
        y, h = f(*args)
        h.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


@pytest.mark.parametrize("op,backend", CASES)
@pytest.mark.parametrize("dims", [(0, 0), (1, None), (None, 2)], ids=["both", "x_only", "residual_only"])
def test_vmap_with_a_residual(op, backend, dims):
    x, r, w, b = _inputs(op, grad=False)
    xd, rd = dims
    xb = torch.stack([x, 2 * x + 1, x.flip(0)], dim=xd) if xd is not None else x
    rb = torch.stack([r, r.flip(1), -r], dim=rd) if rd is not None else r
    f = ours(op, backend, "gelu")
    y, h = torch.func.vmap(lambda x_, r_: f(x_, r_, w, b), in_dims=(xd, rd))(xb, rb)
    g = theirs(op, "gelu")
    pick = lambda t, d, i: t if d is None else t.select(d, i)  # noqa: E731
    want = [g(pick(xb, xd, i).double(), pick(rb, rd, i).double(), w.double(), None if b is None else b.double())
            for i in range(3)]
    assert rel(y, torch.stack([e[0] for e in want])) < 1e-5 and rel(h, torch.stack([e[1] for e in want])) < 1e-6


@pytest.mark.parametrize("op,backend", CASES)
def test_vmap_over_weights_with_offset_amax_and_fp8_scales(op, backend):
    """A model ensemble: weights, and the fp8 scale, batched; the amax is one per member."""
    x, r, w, b = _inputs(op, grad=False)
    ws = torch.stack([w, 0.5 * w, -w])
    scales = torch.tensor([1.0, 4.0, 16.0], device=DEVICE)

    def member(w_, s_):
        return ours(op, backend, offset=1.0, out_dtype=torch.float8_e4m3fn, out_scale=s_, return_amax=True)(x, r, w_, b)

    y, h, amax = torch.func.vmap(member)(ws, scales)
    assert y.dtype == torch.float8_e4m3fn and amax.shape == (3,)
    for i in range(3):
        y64, h64 = theirs(op, offset=1.0)(x.double(), r.double(), ws[i].double(), None if b is None else b.double())
        assert rel(amax[i], y64.abs().amax()) < 1e-5
        assert rel(y[i].double(), (y64 * scales[i].double()).clamp(-448, 448)) < 0.05
        assert rel(h[i], h64) < 1e-6


@pytest.mark.parametrize("op,backend", CASES)
def test_jvp_and_forward_ad_with_residual(op, backend):
    x, r, w, b = _inputs(op, grad=False)
    tx, tr, tw = (randn(*t.shape, device=DEVICE) for t in (x, r, w))
    f, g = ours(op, backend, "gelu_tanh"), theirs(op, "gelu_tanh")
    prim, tang = (x, r, w), (tx, tr, tw)
    (y, h), (ty, th) = torch.func.jvp(lambda x_, r_, w_: f(x_, r_, w_, b), prim, tang)
    bd = None if b is None else b.double()
    (y64, h64), (ty64, th64) = torch.func.jvp(lambda x_, r_, w_: g(x_, r_, w_, bd), tuple(p.double() for p in prim),
                                              tuple(t.double() for t in tang))
    assert rel(y, y64) < 1e-5 and rel(ty, ty64) < 1e-4 and rel(th, th64) < 1e-6
    with fwAD.dual_level():
        yd, hd = f(fwAD.make_dual(x, tx), r, fwAD.make_dual(w, tw), b)  # the residual without a tangent
        ty_only = fwAD.unpack_dual(yd).tangent
        th_only = fwAD.unpack_dual(hd).tangent
    _, (ty64, th64) = torch.func.jvp(lambda x_, w_: g(x_, r.double(), w_, bd), (x.double(), w.double()),
                                     (tx.double(), tw.double()))
    assert rel(ty_only, ty64) < 1e-4 and rel(th_only, th64) < 1e-6


@pytest.mark.parametrize("op,backend", CASES)
def test_per_sample_gradients_and_jacrev_with_per_head_weights(op, backend):
    """q of a fused projection viewed as heads, one weight row per head: per-sample weight gradients
    (vmap of grad) and a Jacobian."""
    H, D = 3, 8
    gen = torch.Generator().manual_seed(1)
    qkv = randn(4, 2, 3 * H * D, gen=gen, device=DEVICE)
    q = qkv[..., :H * D].view(4, 2, H, D)
    r = randn(4, 2, H, D, gen=gen, device=DEVICE)
    w = (0.5 * randn(H, D, gen=gen)).to(DEVICE)
    b = (0.3 * randn(H, D, gen=gen)).to(DEVICE) if op == "layer_norm" else None
    f, g = ours(op, backend), theirs(op)

    def loss(fn, w_, qs, rs, b_):
        y, h = fn(qs.unsqueeze(0), rs.unsqueeze(0), w_, b_)
        return y.pow(2).sum() + h.sum()

    got = torch.func.vmap(torch.func.grad(lambda w_, qs, rs: loss(f, w_, qs, rs, b)), in_dims=(None, 0, 0))(w, q, r)
    bd = None if b is None else b.double()
    want = torch.func.vmap(torch.func.grad(lambda w_, qs, rs: loss(g, w_, qs, rs, bd)), in_dims=(None, 0, 0))(
        w.double(), q.double(), r.double())
    assert got.shape == (4, H, D) and rel(got, want) < 1e-4
    jac = torch.func.jacrev(lambda t: f(t, r[:1], w, b)[0])(q[:1])
    jac_ref = torch.func.jacrev(lambda t: g(t, r[:1].double(), w.double(), bd)[0])(q[:1].double())
    assert rel(jac, jac_ref) < 1e-4


# ----------------------------------------------------------------------------- custom ops, torch.compile

def _opcheck_samples():
    gen = torch.Generator().manual_seed(0)

    def t(*s, dt=torch.float32, grad=False):
        return randn(*s, dtype=dt, gen=gen).requires_grad_(grad)

    fwd = torch.ops.normkit.row_norm_fused_fwd.default
    bwd = torch.ops.normkit.row_norm_fused_bwd.default
    x, r, w, b = t(3, 4, 24), t(3, 4, 24), t(24), t(24)
    _, h, mean, rstd, _ = fwd(x, 1, w, b, 1e-5, False, None, "torch", r, None, 0.0, None, None, None, False)
    bf = torch.bfloat16
    return {
        "fwd_residual": (fwd, (t(3, 4, 24, grad=True), 1, t(24, grad=True), t(24, grad=True), 1e-5, False, "silu",
                               "torch", t(3, 4, 24, grad=True), torch.float32, 1.0, None, None, None, False)),
        "fwd_bf16_out_amax": (fwd, (t(5, 24, grad=True), 1, t(24, grad=True), None, 1e-6, True, None, "torch",
                                    None, None, 0.0, bf, None, None, True)),
        "fwd_fp8_scale_amax": (fwd, (t(5, 24, dt=bf, grad=True), 1, t(24, grad=True), None, 1e-6, True, None, "torch",
                                     None, None, 0.0, torch.float8_e4m3fn, torch.tensor([2.0]), None, True)),
        "fwd_per_head": (fwd, (t(2, 3, 4, 8, grad=True), 1, t(4, 8, grad=True), None, 1e-6, True, None, "torch",
                               t(2, 3, 4, 8, grad=True), None, 0.5, torch.float32, None, None, False)),
        "bwd_dh_dres": (bwd, (t(3, 4, 24), h, 1, w, b, mean, rstd, False, "gelu", torch.float32, torch.float32, "torch",
                              0.5, t(3, 4, 24), torch.float32, torch.bfloat16)),
    }


@pytest.mark.parametrize("sample", list(_opcheck_samples()))
def test_fused_ops_pass_opcheck(sample):
    op, args = _opcheck_samples()[sample]
    # AOT dispatch sums the outputs for a loss: torch has no sum for float8 tensors
    utils = ("test_schema", "test_autograd_registration", "test_faketensor") if "fp8" in sample else \
        torch.library._OPCHECK_DEFAULT_UTILS
    result = torch.library.opcheck(op, args, test_utils=utils)
    assert set(result.values()) == {"SUCCESS"}, result


def test_dispatch_modes_see_the_fused_op():
    from torch.fx.experimental.proxy_tensor import make_fx
    x, r, w, _ = _inputs("rms_norm", grad=False)
    gm = make_fx(lambda x_, r_, w_: normkit.rms_norm(x_, 24, w_, residual=r_, prenorm=True))(x, r, w)
    assert "normkit.row_norm_fused_fwd.default" in {str(n.target) for n in gm.graph.nodes}


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_fused_call_compiles_fullgraph_and_matches_eager(op):
    """A pre-norm block's add + norm under torch.compile: one graph, and exactly eager's values."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    norm = (normkit.LayerNorm if op == "layer_norm" else normkit.RMSNorm)(24, weight_offset=1.0,
                                                                          residual_dtype=torch.float32).to(DEVICE)

    # pointwise ops around the norm (a Linear would let cuBLAS pick another kernel for the traced
    # addmm than for eager's, and differ in the last bit for reasons that are not normkit's)
    def block(x, r):
        y, h = norm(torch.tanh(x), r)
        return y * 0.5 + h

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    x, r = randn(3, 5, 24, device=DEVICE).requires_grad_(), randn(3, 5, 24, device=DEVICE).requires_grad_()
    outs = []
    for fn in (compiled, block):
        out = fn(x, r)
        outs.append([out] + list(torch.autograd.grad(out.sum(), [x, r, norm.weight])))
    assert counter.frame_count == 1
    for i, (a, e) in enumerate(zip(*outs)):
        if DEVICE == "cpu":
            assert torch.equal(a, e), i
        else:
            # eager's dh (from sum()) is a stride-0 view, AOT's backward materializes it: Triton
            # specializes its kernel on strides, and the other build may contract multiply-adds
            # differently (dx and dresidual 1 ulp apart on an H200)
            assert ref.rel_err(a, e) <= 4 * torch.finfo(a.dtype).eps, (i, ref.rel_err(a, e))
    torch._dynamo.reset()


def test_dtensor_sharded_rows_with_residual_and_amax(tmp_path):
    """Sequence-parallel DTensors through the fused op's sharding rule: y and h sharded as x, the
    amax a Partial max over the shards, the weight gradient a Partial sum (one process, gloo)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x, r, w = (t.cpu() for t in _inputs("rms_norm", grad=False)[:3])  # a CPU mesh
        xd, rd = (distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (x, r))
        wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
        y, h, amax = normkit.rms_norm(xd, 24, wd, residual=rd, prenorm=True, weight_offset=1.0, return_amax=True,
                                      backend="torch")
        assert y.placements == h.placements == (Shard(1),) and amax.placements[0].is_partial()
        (y.sum() + h.sum()).backward()
        assert xd.grad.placements == rd.grad.placements == (Shard(1),)
        y0, h0 = theirs("rms_norm", offset=1.0)(x.double(), r.double(), w.double(), None)
        assert rel(y.full_tensor(), y0) < 1e-5 and rel(amax.full_tensor(), y0.abs().amax()) < 1e-6
    finally:
        dist.destroy_process_group()
