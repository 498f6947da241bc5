"""adaLN modulation as a fused op (issue 23): layer_norm / rms_norm with scale= and shift=.

y = act((xhat * w + b) * (1 + scale) + shift), scale/shift one row per sample (DiT, PixArt, SD3,
Flux), computed in fp32 in the norm's pass; the backward gives dx, dweight, dbias and the
per-sample sums dscale, dshift, deterministically. Checked against the float64 oracle
(normkit.reference with scale=/shift=) by relative error on fresh random data, on the torch backend
and the Triton kernels (the interpreter on CPU, compiled on a GPU), for broadcast shapes, awkward
sizes, bf16/fp16 x with fp32 or bf16 modulation, combined with the other fused options; gradients
of every input through float64 gradcheck, double backward, forward AD and vmap; the custom op under
torch.compile (fullgraph) and opcheck; and errors that name the argument.
"""
import importlib

import pytest
import torch

import normkit
from normkit import reference as ref

from conftest import DEVICE, HAS_CUDA
from helpers import TOL, randn
from test_row_norm import looped  # noqa: F401  (the fixture: rows wider than 64 walked in chunks of 128)

BACKENDS = ["torch", "triton"]
OPS = ["layer_norm", "rms_norm"]
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
# per-sample sums of up to T products: fp32 accumulation, then rounded to the gradient's dtype
MOD_GRAD_TOL = {FP32: 2e-5, BF16: 1e-2, FP16: 2e-3, FP64: 1e-12}


def _call(op, x, n, w, b, backend, **kw):
    if op == "layer_norm":
        return normkit.layer_norm(x, n, w, b, 1e-5, backend=backend, **kw)
    return normkit.rms_norm(x, n, w, 1e-5, backend=backend, **kw)


def _oracle(op, x, n, w, b, dy, act=None, **kw):
    """float64 (y, [dx, dw, (db,) dscale, dshift]) from the oracle (dy None: y alone)."""
    shape = (n,) if isinstance(n, int) else tuple(n)
    if op == "layer_norm":
        y = ref.layer_norm(x, shape, w, b, 1e-5, act, **kw)[0]
        grads = None if dy is None else ref.layer_norm_backward(dy, x, shape, w, b, 1e-5, act, **kw)
    else:
        y = ref.rms_norm(x, shape, w, 1e-5, act, **kw)[0]
        grads = None if dy is None else ref.rms_norm_backward(dy, x, shape, w, 1e-5, act, **kw)
    return y, grads


def _inputs(x_shape, mod_shape, n_shape, dtype=FP32, mod_dtype=FP32, wdtype=FP32, op="layer_norm", seed=0,
            grad=True, has_scale=True, has_shift=True):
    gen = torch.Generator().manual_seed(seed)
    x = randn(*x_shape, dtype=dtype, gen=gen, device=DEVICE).requires_grad_(grad)
    w = (1 + 0.5 * randn(*n_shape, gen=gen)).to(DEVICE, wdtype).requires_grad_(grad)
    b = (0.3 * randn(*n_shape, gen=gen)).to(DEVICE, wdtype).requires_grad_(grad) if op == "layer_norm" else None
    sc = (0.5 * randn(*mod_shape, gen=gen)).to(DEVICE, mod_dtype).requires_grad_(grad) if has_scale else None
    sh = (0.5 * randn(*mod_shape, gen=gen)).to(DEVICE, mod_dtype).requires_grad_(grad) if has_shift else None
    return x, w, b, sc, sh


def _check(op, backend, x, n, w, b, sc, sh, act=None, tol=None, seed=1):
    """Forward and every gradient against the oracle; returns the gradients."""
    y = _call(op, x, n, w, b, backend, scale=sc, shift=sh, activation=act)
    assert y.dtype == x.dtype and y.shape == x.shape
    dy = randn(*y.shape, dtype=y.dtype, gen=torch.Generator().manual_seed(seed), device=DEVICE)
    y64, g64 = _oracle(op, x, n, w, b, dy, act, scale=sc, shift=sh)
    tol = tol or TOL[x.dtype]
    assert ref.rel_err(y, y64) <= tol, ("y", ref.rel_err(y, y64))
    params = [p for p in (x, w, b, sc, sh) if p is not None]
    grads = torch.autograd.grad(y, params, dy, allow_unused=True)
    want = [g for g in g64 if g is not None]
    names = [nm for nm, p in zip(("dx", "dw", "db", "dscale", "dshift"), (x, w, b, sc, sh)) if p is not None]
    for name, p, g, g_ref in zip(names, params, grads, want):
        assert g.dtype == p.dtype and g.shape == p.shape, name
        bound = tol if name == "dx" else max(MOD_GRAD_TOL[p.dtype], 2e-5 if x.dtype == FP32 else 0.0)
        if name != "dx" and x.dtype != FP32:  # sums of products of rounded inputs: the inputs' rounding
            bound = max(bound, TOL[x.dtype])
        if name == "dx" and x.shape[-1] == 1 and op == "rms_norm":
            # rows of one element: RMSNorm's dx is a difference that cancels to ~0; measure the
            # error against the size of its terms, rstd * w * (1 + scale) * dy (helpers.dx_scale_err)
            rstd = ref.rms_norm(x, (1,), None, 1e-5)[1]
            terms = dy.double() * rstd[..., None] * ref.modulate(w.double().expand(x.shape), sc, None, 1)
            err = (g.double() - g_ref).norm().item() / terms.norm().item()
            assert err <= bound, (name, err, bound)
            continue
        assert ref.rel_err(g, g_ref) <= bound, (name, ref.rel_err(g, g_ref), bound)
    return grads


# ----------------------------------------------------------------------------- shapes and dtypes

# (x shape, scale/shift shape, normalized shape)
SHAPES = {
    "BN": ((3, 5, 24), (3, 24), (24,)),
    "B1N": ((2, 7, 33), (2, 1, 33), (33,)),
    "one_for_all": ((2, 3, 16), (1, 16), (16,)),
    "N_only": ((4, 3, 8), (8,), (8,)),
    "per_row": ((3, 4, 12), (3, 4, 12), (12,)),
    "T1": ((5, 1, 20), (5, 20), (20,)),
    "B1": ((1, 9, 20), (1, 20), (20,)),
    "N1": ((3, 4, 1), (3, 1), (1,)),
    "prime_N": ((2, 6, 37), (2, 1, 37), (37,)),
    "N100": ((2, 3, 100), (2, 100), (100,)),  # not a power of two: a masked tail
    "4d_sample_prefix": ((2, 3, 4, 16), (2, 3, 1, 16), (16,)),
    "2d_normalized": ((2, 3, 4, 6), (2, 4, 6), (4, 6)),
}


@pytest.mark.parametrize("case", list(SHAPES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_match_the_oracle(backend, op, case, poison):
    x_shape, mod_shape, n = SHAPES[case]
    x, w, b, sc, sh = _inputs(x_shape, mod_shape, n, op=op)
    _check(op, backend, x, n, w, b, sc, sh)


# (x dtype, scale/shift dtype, weight dtype, activation)
DTYPE_CASES = {
    "bf16_fp32mod": (BF16, FP32, FP32, None),
    "bf16_bf16mod": (BF16, BF16, BF16, None),
    "fp16_fp32mod_silu": (FP16, FP32, FP32, "silu"),
    "fp32_bf16mod_gelu": (FP32, BF16, FP32, "gelu_tanh"),
}


@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dtypes_match_the_oracle(backend, op, case, poison):
    dtype, mod_dtype, wdtype, act = DTYPE_CASES[case]
    x, w, b, sc, sh = _inputs((3, 6, 40), (3, 1, 40), (40,), dtype, mod_dtype, wdtype, op=op, seed=2)
    _check(op, backend, x, 40, w, b, sc, sh, act=act)


@pytest.mark.parametrize("which", ["scale", "shift"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_or_shift_alone(backend, op, which, poison):
    x, w, b, sc, sh = _inputs((3, 4, 24), (3, 24), (24,), op=op, has_scale=which == "scale",
                              has_shift=which == "shift")
    _check(op, backend, x, 24, w, b, sc, sh)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_weight_and_bias(backend, poison):
    """diffusers' adaLN norms: LayerNorm(elementwise_affine=False), then the modulation."""
    x, _, _, sc, sh = _inputs((4, 5, 32), (4, 32), (32,))
    _check("layer_norm", backend, x, 32, None, None, sc, sh)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_chunked_modulation(backend, op, poison):
    """x rows that are a strided view (every other token of a wider buffer) and scale/shift that are
    chunks of one embedding (diffusers' emb.chunk(6, dim=1)): read in place, same values."""
    gen = torch.Generator().manual_seed(3)
    big = randn(3, 10, 48, gen=gen, device=DEVICE)
    x = big[:, ::2, :24].detach().requires_grad_()  # rows 96 elements apart, not contiguous
    emb = (0.5 * randn(3, 6 * 24, gen=gen, device=DEVICE)).requires_grad_()
    shift, scale = emb.chunk(6, dim=1)[:2]
    w = (1 + 0.5 * randn(24, gen=gen, device=DEVICE)).requires_grad_()
    b = (0.3 * randn(24, gen=gen, device=DEVICE)).requires_grad_() if op == "layer_norm" else None
    y = _call(op, x, 24, w, b, backend, scale=scale, shift=shift)
    dy = randn(*y.shape, gen=gen, device=DEVICE)
    y64, g64 = _oracle(op, x, 24, w, b, dy, scale=scale, shift=shift)
    assert ref.rel_err(y, y64) <= TOL[FP32]
    dx, demb = torch.autograd.grad(y, [x, emb], dy)
    assert ref.rel_err(dx, g64[0]) <= TOL[FP32]
    dscale, dshift = g64[-2], g64[-1]
    assert ref.rel_err(demb[:, 24:48], dscale) <= 2e-5 and ref.rel_err(demb[:, :24], dshift) <= 2e-5
    assert torch.count_nonzero(demb[:, 48:]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_empty_tokens(backend):
    for x_shape, mod_shape in (((0, 4, 16), (0, 16)), ((3, 0, 16), (3, 16))):
        x, w, b, sc, sh = _inputs(x_shape, mod_shape, (16,))
        y = normkit.layer_norm(x, 16, w, b, scale=sc, shift=sh, backend=backend)
        assert y.shape == x.shape
        dx, dw, dsc, dsh = torch.autograd.grad(y.sum(), [x, w, sc, sh])
        assert dx.shape == x.shape and dsc.shape == sc.shape and dsh.shape == sh.shape
        assert not dsc.any() and not dsh.any() and not dw.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_stays_in_its_row_and_sample(backend):
    """A NaN in one token's row makes that row (and its sample's dscale/dshift) NaN, nothing else."""
    x, w, b, sc, sh = _inputs((3, 4, 20), (3, 20), (20,), grad=False)
    x = x.clone()
    x[1, 2, 5] = float("nan")
    x.requires_grad_()
    sc.requires_grad_()
    sh.requires_grad_()
    y = normkit.layer_norm(x, 20, w, b, scale=sc, shift=sh, backend=backend)
    bad = torch.zeros(3, 4, dtype=torch.bool)
    bad[1, 2] = True
    assert torch.isnan(y[bad.to(DEVICE)]).all() and not torch.isnan(y[~bad.to(DEVICE)]).any()
    dx, dsc, dsh = torch.autograd.grad(y, [x, sc, sh], torch.ones_like(y))
    assert torch.isnan(dx[bad.to(DEVICE)]).all() and not torch.isnan(dx[~bad.to(DEVICE)]).any()
    assert torch.isnan(dsc[1]).any() and not torch.isnan(dsc[[0, 2]]).any()
    assert not torch.isnan(dsh).any()  # dshift sums dy alone


@pytest.mark.parametrize("op", OPS)
def test_looped_kernels(op, looped, poison):
    """Rows wider than the tile walked in chunks, forward and the backward's sample walk."""
    x, w, b, sc, sh = _inputs((2, 3, 300), (2, 300), (300,), BF16, FP32, FP32, op=op, seed=4)
    _check(op, "triton", x, 300, w, b, sc, sh, act="silu")


def test_sample_walk_with_many_chunks_and_samples(poison):
    """The backward cuts each sample's row blocks into chunks (more items than samples); dscale /
    dshift are then sums of several partial rows. Also more samples than programs."""
    for x_shape, mod_shape in (((2, 40, 1024), (2, 1024)), ((13, 2, 64), (13, 1, 64))):
        x, w, b, sc, sh = _inputs(x_shape, mod_shape, (x_shape[-1],), seed=5)
        _check("layer_norm", "triton", x, x_shape[-1], w, b, sc, sh)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dscale_dshift_are_deterministic(backend):
    x, w, b, sc, sh = _inputs((2, 40, 1024), (2, 1024), (1024,), seed=6)
    dy = randn(2, 40, 1024, device=DEVICE)
    runs = []
    for _ in range(2):
        y = normkit.layer_norm(x, 1024, w, b, scale=sc, shift=sh, backend=backend)
        runs.append(torch.autograd.grad(y, [x, w, b, sc, sh], dy))
    for a, e in zip(*runs):
        assert torch.equal(a, e)


# ----------------------------------------------------------------------------- with the other fused options

@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_with_residual_prenorm_offset_and_out_dtype(backend, op, poison):
    """The gate-free DiT pre-norm: h = x + residual normalized, modulated, written in another dtype."""
    x, w, b, sc, sh = _inputs((3, 5, 32), (3, 32), (32,), BF16, FP32, FP32, op=op, seed=7)
    r = randn(3, 5, 32, dtype=BF16, device=DEVICE).requires_grad_()
    y, h = _call(op, x, 32, w, b, backend, scale=sc, shift=sh, residual=r, prenorm=True, residual_dtype=FP32,
                 weight_offset=0.5, out_dtype=FP32, activation="gelu")
    assert y.dtype == FP32 and h.dtype == FP32
    h64 = ref.residual_sum(x, r, FP32)
    kw = dict(scale=sc, shift=sh, weight_offset=0.5)
    y64 = (ref.layer_norm(h64, (32,), w, b, 1e-5, "gelu", **kw) if op == "layer_norm" else
           ref.rms_norm(h64, (32,), w, 1e-5, "gelu", **kw))[0]
    assert ref.rel_err(y, y64) <= TOL[FP32] and ref.rel_err(h, h64) <= TOL[FP32]
    dy, dh = randn(3, 5, 32, device=DEVICE), randn(3, 5, 32, device=DEVICE)
    params = [x, r, w, sc, sh]
    grads = torch.autograd.grad([y, h], params, [dy, dh])
    # the oracle: y of h (rounding invisible to autograd) plus h's own gradient
    x64, r64 = x.detach().double().requires_grad_(), r.detach().double().requires_grad_()
    p64 = [t.detach().double().requires_grad_() for t in (w, sc, sh)]
    b64 = None if b is None else b.detach().double()
    hh = ref.residual_sum(x64, r64, FP32)
    f = ref.layer_norm if op == "layer_norm" else ref.rms_norm
    yy = (f(hh, (32,), p64[0], b64, 1e-5, "gelu", weight_offset=0.5, scale=p64[1], shift=p64[2]) if b is not None else
          f(hh, (32,), p64[0], 1e-5, "gelu", weight_offset=0.5, scale=p64[1], shift=p64[2]))[0]
    want = torch.autograd.grad([yy, hh], [x64, r64] + p64, [dy.double(), dh.double()])
    for name, g, e in zip(("dx", "dres", "dw", "dscale", "dshift"), grads, want):
        assert ref.rel_err(g, e) <= TOL[BF16], (name, ref.rel_err(g, e))


def test_modules_take_scale_and_shift():
    x, _, _, sc, sh = _inputs((2, 3, 16), (2, 16), (16,), grad=False)
    ln = normkit.LayerNorm(16, elementwise_affine=False).to(DEVICE)
    rms = normkit.RMSNorm(16).to(DEVICE)
    assert ref.rel_err(ln(x, scale=sc, shift=sh), ref.layer_norm(x, (16,), scale=sc, shift=sh)[0]) <= TOL[FP32]
    assert ref.rel_err(rms(x, scale=sc), ref.rms_norm(x, (16,), rms.weight, None, scale=sc)[0]) <= TOL[FP32]


# ----------------------------------------------------------------------------- autograd semantics

@pytest.mark.parametrize("op", OPS)
def test_gradcheck_float64_first_second_and_forward_ad(op):
    """Every input's gradient (x, w, b, scale, shift) against finite differences in float64; double
    backward (gradgradcheck) and forward-mode AD through the same op."""
    x, w, b, sc, sh = _inputs((2, 3, 6), (2, 6), (6,), FP64, FP64, FP64, op=op, seed=8)
    if op == "layer_norm":
        def f(x_, w_, b_, s_, t_):
            return normkit.layer_norm(x_, 6, w_, b_, scale=s_, shift=t_, activation="silu")
        args = (x, w, b, sc, sh)
    else:
        def f(x_, w_, s_, t_):
            return normkit.rms_norm(x_, 6, w_, 1e-5, scale=s_, shift=t_, activation="silu")
        args = (x, w, sc, sh)
    assert torch.autograd.gradcheck(f, args, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, args)


def test_vmap_over_samples_and_modulation():
    x, w, b, sc, sh = _inputs((4, 2, 3, 16), (4, 2, 16), (16,), grad=False)
    out = torch.func.vmap(lambda x_, s_, t_: normkit.layer_norm(x_, 16, w, b, scale=s_, shift=t_))(x, sc, sh)
    assert ref.rel_err(out, ref.layer_norm(x, (16,), w, b, scale=sc, shift=sh)[0]) <= TOL[FP32]
    # modulation not batched: the same rows for every batch entry
    out = torch.func.vmap(lambda x_: normkit.layer_norm(x_, 16, w, b, scale=sc[0], shift=sh[0]))(x)
    want = ref.layer_norm(x, (16,), w, b, scale=sc[0].expand(4, 2, 16), shift=sh[0].expand(4, 2, 16))[0]
    assert ref.rel_err(out, want) <= TOL[FP32]


def test_compiles_fullgraph_and_matches_eager():
    """A DiT-style modulated norm under torch.compile: one graph, eager's values and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    x, w, b, sc, sh = _inputs((2, 5, 24), (2, 24), (24,), seed=9)

    def block(x_, emb):
        shift, scale, gate = emb.chunk(3, dim=1)
        y = normkit.layer_norm(torch.tanh(x_), 24, w, b, scale=scale, shift=shift)
        return x_ + gate[:, None] * y

    emb = torch.cat([sh, sc, sc * 0.5], 1).detach().requires_grad_()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    outs = []
    for fn in (compiled, block):
        out = fn(x, emb)
        outs.append([out] + list(torch.autograd.grad(out.sum(), [x, w, b, emb])))
    assert counter.frame_count == 1
    for a, e in zip(*outs):
        assert ref.rel_err(a, e) <= 4 * torch.finfo(a.dtype).eps
    torch._dynamo.reset()


def test_compiles_with_inductor_on_cpu():
    torch._dynamo.reset()
    x, w, b, sc, sh = _inputs((2, 5, 24), (2, 1, 24), (24,), seed=10, grad=False)
    fn = torch.compile(lambda x_, s_, t_: normkit.layer_norm(x_, 24, w, b, scale=s_, shift=t_) * 2.0,
                       fullgraph=True)
    out = fn(x, sc, sh)
    assert ref.rel_err(out, 2.0 * ref.layer_norm(x, (24,), w, b, scale=sc, shift=sh)[0]) <= TOL[FP32]
    torch._dynamo.reset()


def test_fused_ops_pass_opcheck_with_modulation():
    gen = torch.Generator().manual_seed(11)
    t = lambda *s, grad=True: randn(*s, gen=gen).requires_grad_(grad)  # noqa: E731
    fwd = torch.ops.normkit.row_norm_fused_fwd.default
    bwd = torch.ops.normkit.row_norm_fused_bwd.default
    x, w, b, sc, sh = t(2, 3, 16), t(16), t(16), t(2, 16), t(2, 1, 16)
    torch.library.opcheck(fwd, (x, 1, w, b, 1e-5, False, "silu", "torch", None, None, 0.0, None, None, None, False,
                                sc, sh))
    _, _, mean, rstd, _ = fwd(x, 1, w, b, 1e-5, False, None, "torch", None, None, 0.0, None, None, None, False,
                              sc, sh)
    mean, rstd = mean.detach(), rstd.detach()
    torch.library.opcheck(bwd, (t(2, 3, 16, grad=False), x.detach(), 1, w.detach(), b.detach(), mean, rstd, False,
                                None, FP32, FP32, "torch", 0.0, None, FP32, None, sc.detach(), sh.detach(), FP32,
                                FP32))


def test_host_path_gets_the_modulation(host_path_calls):
    """Modulated calls reach the host path with their tables (its arguments 17 and 18, after the 16
    of a call without them); the Python path runs the calls it declines."""
    x, w, b, sc, sh = _inputs((2, 3, 16), (2, 16), (16,), grad=False)
    # on a backend the CPU fast path (torch's own kernels, normkit/_cpu.py) leaves to the host path: a
    # default-backend CPU call without autograd never reaches it, modulated or not
    y = normkit.layer_norm(x, 16, w, b, scale=sc, shift=sh, backend="triton")
    assert ref.rel_err(y, ref.layer_norm(x, (16,), w, b, 1e-5, scale=sc, shift=sh)[0]) <= TOL[FP32]
    normkit.rms_norm(x, 16, w, shift=sh, backend="triton")
    normkit.layer_norm(x, 16, w, b, backend="triton")
    first = host_path_calls[0]
    assert len(first) == 19 and first[16] is sc and first[17] is sh and first[18] is None
    assert any(len(a) == 19 and a[16] is None and a[17] is sh for a in host_path_calls)
    assert len(host_path_calls[-1]) == 16  # the plain call: the shorter argument list


# ----------------------------------------------------------------------------- errors

def _bad_calls():
    x = randn(2, 3, 16)
    good = randn(2, 16)
    return [
        (lambda: normkit.layer_norm(x, 16, scale=randn(2, 8)), "scale", "normalized_shape"),
        (lambda: normkit.layer_norm(x, 16, shift=randn(1, 3, 16)), "shift", "per sample"),
        (lambda: normkit.layer_norm(x, 16, scale=randn(3, 16)), "scale", "per sample"),
        (lambda: normkit.layer_norm(x, 16, scale=randn(1, 2, 3, 16)), "scale", "per sample"),
        (lambda: normkit.layer_norm(x, 16, scale=torch.ones(2, 16, dtype=torch.int32)), "scale", "floating"),
        (lambda: normkit.layer_norm(x, 16, scale=good.to("meta")), "scale", "device"),
        (lambda: normkit.rms_norm(x, 16, scale=good, shift=randn(1, 16)), "shift", "same samples"),
        (lambda: normkit.rms_norm(randn(2, 3, 4, 8), 8, randn(4, 8), scale=randn(2, 8)), "scale", "per-head"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_calls())))
def test_bad_modulation_names_the_argument(i):
    call, arg, what = _bad_calls()[i]
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"{arg}:") and what in msg, msg


def test_backends_without_modulation_say_so():
    name, x = ("cuda", randn(4, 16, device="cuda")) if DEVICE == "cuda" else ("webgpu", randn(4, 16))
    from normkit import backends
    why = backends.get(name).why_unavailable(x)
    for kw in (dict(scale=randn(4, 16, device=x.device)), dict(shift=randn(1, 16, device=x.device))):
        with pytest.raises(normkit.BackendUnavailableError) as info:
            normkit.layer_norm(x, 16, backend=name, **kw)
        if why is None:
            assert f"{next(iter(kw))}=" in str(info.value) and f"backend={name!r}" in str(info.value)


# ----------------------------------------------------------------------------- GPU sizes

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1152, 1536, 3072, 4096, 8192])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_gpu_dit_widths(n, dtype, poison):
    """DiT-XL (1152), SD3 (1536), Flux (3072) and wider rows (split-row forward; the backward's
    sample walk takes the looped kernels where the table splits rows), 2 x 256 tokens."""
    x, w, b, sc, sh = _inputs((2, 256, n), (2, n), (n,), dtype, FP32, FP32, seed=12)
    _check("layer_norm", "triton", x, n, None, None, sc, sh)
    _check("layer_norm", "triton", x, n, w, b, sc, sh)


# ----------------------------------------------------------------------------- patching diffusers models

def _g():
    return torch.Generator().manual_seed(1)


def _diffusers():
    """diffusers: part of the tested set (CI imports it); a GPU machine may lack it (the test then skips)."""
    return pytest.importorskip("diffusers") if HAS_CUDA else importlib.import_module("diffusers")


def _tiny_diffusers(name):
    diffusers = _diffusers()
    torch.manual_seed(0)
    if name == "dit":
        m = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2,
                                            sample_size=8, patch_size=2, num_embeds_ada_norm=10)
        return m, lambda: m(torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)),
                            timestep=torch.tensor([3, 7]), class_labels=torch.tensor([1, 4])).sample
    if name == "pixart":
        m = diffusers.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                               out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                               cross_attention_dim=16, caption_channels=12)
        return m, lambda: m(torch.randn(2, 4, 8, 8, generator=_g()), encoder_hidden_states=torch.randn(2, 5, 12, generator=_g()),
                            timestep=torch.tensor([3, 7]), added_cond_kwargs={"resolution": None,
                                                                             "aspect_ratio": None}).sample
    if name == "sd3":
        m = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                            caption_projection_dim=16, pooled_projection_dim=8, out_channels=4)
        return m, lambda: m(torch.randn(2, 4, 8, 8, generator=_g()), encoder_hidden_states=torch.randn(2, 5, 16, generator=_g()),
                            pooled_projections=torch.randn(2, 8, generator=_g()), timestep=torch.tensor([3, 7])).sample
    m = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                         pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    return m, lambda: m(torch.randn(2, 12, 16, generator=_g()), encoder_hidden_states=torch.randn(2, 5, 16, generator=_g()),
                        pooled_projections=torch.randn(2, 8, generator=_g()), timestep=torch.tensor([0.3, 0.7]),
                        img_ids=torch.zeros(12, 3), txt_ids=torch.zeros(5, 3)).sample


@pytest.mark.parametrize("name", ["dit", "pixart", "sd3", "flux"])
def test_patched_diffusers_models_match(name, monkeypatch):
    """fp32 models: patched (modulation fused, as the report says) vs unpatched, output and every
    parameter's gradient; the fused calls really run normkit's modulated kernels."""
    model, run = _tiny_diffusers(name)
    want = run()
    want_grads = torch.autograd.grad(want.square().mean(), list(model.parameters()), allow_unused=True)
    report = normkit.patch(model)
    fused = [n for n, what in report.fused.items() if "adaLN" in what]
    assert fused, (report.fused, report.unfused)
    from normkit.backends import torch_backend
    calls = []
    real = torch_backend._row_norm_fwd  # what row_norm_fwd_fused and the CPU fast path call
    monkeypatch.setattr(torch_backend, "_row_norm_fwd",
                        lambda *a, **k: calls.append(k.get("mod_scale", a[14] if len(a) > 14 else None) is not None)
                        or real(*a, **k))
    got = run()
    assert any(calls), "no modulated normkit call ran"
    got_grads = torch.autograd.grad(got.square().mean(), list(model.parameters()), allow_unused=True)
    assert ref.rel_err(got, want) <= 1e-5
    flat = lambda gs: torch.cat([g.reshape(-1) for g, e in zip(gs, want_grads) if e is not None])  # noqa: E731
    assert ref.rel_err(flat(got_grads), flat(want_grads)) <= 1e-5
    normkit.unpatch(model)
    assert ref.rel_err(run(), want) == 0.0


def test_bf16_modulation_runs_as_written_unless_relaxed():
    _diffusers()  # skips where diffusers is missing (a GPU machine); a submodule is an attribute once imported
    AdaLayerNormZero = importlib.import_module("diffusers.models.normalization").AdaLayerNormZero
    torch.manual_seed(0)
    m = AdaLayerNormZero(32).to(BF16)
    x, emb = randn(2, 5, 32, dtype=BF16), randn(2, 32, dtype=BF16)
    want = m(x, emb=emb)[0]
    normkit.patch(m)
    assert torch.equal(m(x, emb=emb)[0], want)  # not exact in bf16: the module's own roundings
    normkit.unpatch(m)
    normkit.patch(m, fuse="relaxed")
    got = m(x, emb=emb)[0]
    # normkit rounds once: within bf16 rounding of the module's value, and closer to float64
    e = m.linear(m.silu(emb)).float().chunk(6, dim=1)
    y64 = ref.layer_norm(x, (32,), None, None, 1e-6, scale=e[1], shift=e[0])[0]
    assert ref.rel_err(got, y64) <= ref.rel_err(want, y64) + 1e-3 and ref.rel_err(got, want) <= 2e-2
