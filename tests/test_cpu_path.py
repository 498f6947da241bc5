"""The CPU fast path (normkit/_cpu.py): plain CPU calls run torch's own ops, against the float64
oracle, forward and backward, with rows and groups offset by 1e4; calls it does not serve (and
every bad argument) take the general path with its errors."""
import itertools
import math

import pytest
import torch

import normkit
from normkit import _cpu
from normkit import reference as ref

from helpers import TOL, assert_close, param_tol, randn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def _tol(dtype, offset):
    """TOL, and for float64 data offset by 1e4 the oracle's own rounding (offset * 2**-53 on values of size 1)."""
    return max(TOL[dtype], 1e-10) if offset and dtype == torch.float64 else TOL[dtype]


@pytest.fixture
def served(monkeypatch):
    """Counts the calls the fast path served (returned a value for)."""
    count = {"row": 0, "group": 0}
    for name, key in (("row_norm", "row"), ("group_norm", "group")):
        real = getattr(_cpu, name)

        def spy(*args, _real=real, _key=key):
            out = _real(*args)
            count[_key] += out is not None
            return out
        monkeypatch.setattr(_cpu, name, spy)
    return count


def _grads(out, leaves, dy):
    return torch.autograd.grad(out, [t for t in leaves if t is not None], dy)


@pytest.mark.parametrize("offset", [0.0, 1e4], ids=["centred", "offset1e4"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", ["plain", "silu", "residual+prenorm", "weight_offset", "out_dtype", "2d shape"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_row_norms_match_the_oracle(op, case, dtype, offset, served):
    shape = (4, 6) if case == "2d shape" else (96,)
    x = (offset + randn(3, 5, *shape, dtype=torch.float64)).to(dtype).requires_grad_()
    p_dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # mixed precision, as models run bf16
    w = randn(*shape, dtype=p_dtype).requires_grad_()
    b = randn(*shape, dtype=p_dtype).requires_grad_() if op == "layer_norm" else None
    r = randn(*x.shape, dtype=dtype).requires_grad_() if case == "residual+prenorm" else None
    kw = {"silu": dict(activation="silu"), "residual+prenorm": dict(residual=r, prenorm=True),
          "weight_offset": dict(weight_offset=1.0), "out_dtype": dict(out_dtype=torch.float32)}.get(case, {})
    args = (x, shape, w, b, 1e-5) if op == "layer_norm" else (x, shape, w, 1e-5)
    out = getattr(normkit, op)(*args, **kw)
    y, h = out if r is not None else (out, None)
    assert served["row"] == 1
    assert y.dtype == kw.get("out_dtype", dtype) and y.is_contiguous()
    oracle = {"layer_norm": ref.layer_norm, "rms_norm": ref.rms_norm}[op]
    oracle_kw = dict(residual=r, weight_offset=kw.get("weight_offset", 0.0))
    h_ref = None if r is None else ref.residual_sum(x, r)
    if h is not None:
        assert h.dtype == dtype
        assert_close(h, h_ref, _tol(dtype, offset), "h")
    # the oracle normalizes what normkit normalized: h rounded to its dtype
    z = x if h is None else h.detach()
    y_ref = oracle(z, shape, w, *((b,) if op == "layer_norm" else ()), 1e-5, kw.get("activation"),
                   weight_offset=oracle_kw["weight_offset"])[0]
    err = assert_close(y, y_ref, max(_tol(dtype, offset), TOL[y.dtype]), f"{op} {case} y")
    if offset and dtype == torch.float32 and case not in ("residual+prenorm",):
        assert err < 1e-5, f"offset rows: {err:.3g} (shifted statistics keep ~1e-7)"
    dy = randn(*x.shape, dtype=y.dtype)
    leaves = [x, w, b] if r is None else [x, w, b, r]
    got = _grads(y, leaves, dy)
    backward = {"layer_norm": ref.layer_norm_backward, "rms_norm": ref.rms_norm_backward}[op]
    dz, dw, *db = backward(dy, z, shape, w, *((b,) if op == "layer_norm" else ()), 1e-5, kw.get("activation"),
                           weight_offset=oracle_kw["weight_offset"])
    assert_close(got[0], dz, _tol(dtype, offset), f"{op} {case} dx")
    assert_close(got[1], dw, max(param_tol(w.dtype, dtype), _tol(dtype, offset)), f"{op} {case} dweight")
    if b is not None:
        assert_close(got[2], db[0], max(param_tol(b.dtype, dtype), _tol(dtype, offset)), f"{op} {case} dbias")
    if r is not None:  # dresidual = dx: h = x + r
        assert_close(got[-1], dz, _tol(dtype, offset), f"{op} {case} dresidual")


@pytest.mark.parametrize("offset", [0.0, 1e4], ids=["centred", "offset1e4"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("activation", [None, "mish"])
@pytest.mark.parametrize("shape, layout", [((2, 32, 16), None), ((3, 8, 5, 7), None),
                                           ((3, 8, 5, 7), torch.channels_last), ((2, 16), None)],
                         ids=["1d", "2d", "2d-channels-last", "no-spatial"])
def test_group_norm_matches_the_oracle(shape, layout, activation, dtype, offset, served):
    # each group at its own offset: a shift by one value per sample would not keep them exact
    g = torch.arange(4, dtype=torch.float64).repeat_interleave(shape[1] // 4).reshape(1, shape[1], *[1] * (len(shape) - 2))
    x = (offset * (1 + g) + randn(*shape, dtype=torch.float64)).to(dtype)
    x = (x if layout is None else x.contiguous(memory_format=layout)).requires_grad_()
    p_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    w, b = randn(shape[1], dtype=p_dtype).requires_grad_(), randn(shape[1], dtype=p_dtype).requires_grad_()
    y = normkit.group_norm(x, 4, w, b, 1e-5, activation=activation)
    assert served["group"] == 1 and y.dtype == dtype
    assert y.is_contiguous(memory_format=layout or torch.contiguous_format), "the memory format is kept"
    err = assert_close(y, ref.group_norm(x, 4, w, b, 1e-5, activation)[0], _tol(dtype, offset), "y")
    if offset and dtype == torch.float32:
        assert err < 1e-5, f"offset groups: {err:.3g} (shifted statistics keep ~1e-7)"
    dy = randn(*shape, dtype=dtype)
    dx, dw, db = _grads(y, [x, w, b], dy)
    dx_ref, dw_ref, db_ref = ref.group_norm_backward(dy, x, 4, w, b, 1e-5, activation)
    assert_close(dx, dx_ref, _tol(dtype, offset), "dx")
    assert_close(dw, dw_ref, max(param_tol(w.dtype, dtype), _tol(dtype, offset)), "dweight")
    assert_close(db, db_ref, max(param_tol(b.dtype, dtype), _tol(dtype, offset)), "dbias")


@pytest.mark.parametrize("op", ["layer_norm", "group_norm"])
def test_one_offset_row_or_group_among_centred_ones(op, served):
    """The centring check looks at every row (group): one offset by 1e4 among centred ones still gets
    the shifted kernel, forward and backward (the unshifted kernel loses 3e-4 on it)."""
    if op == "layer_norm":
        x, w, b = randn(64, 96), randn(96), randn(96)
        x[37] += 1e4
        fn = lambda t: normkit.layer_norm(t, 96, w, b)  # noqa: E731
        ref_fn = lambda t: ref.layer_norm(t, (96,), w, b)[0]  # noqa: E731
    else:
        x, w, b = randn(3, 16, 40), randn(16), randn(16)
        x[2, 8:12] += 1e4  # sample 2's group 2
        fn = lambda t: normkit.group_norm(t, 4, w, b, activation="mish")  # noqa: E731
        ref_fn = lambda t: ref.group_norm(t, 4, w, b, 1e-5, "mish")[0]  # noqa: E731
    x.requires_grad_()
    x64 = x.detach().double().requires_grad_()
    y, y_ref = fn(x), ref_fn(x64)
    assert served["row" if op == "layer_norm" else "group"] == 1
    assert_close(y, y_ref, 1e-5, f"{op} y")
    dy = randn(*x.shape)
    assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(y_ref, x64, dy.double())[0], 1e-5, f"{op} dx")


def test_nan_stays_in_its_row_and_group():
    x = randn(6, 50)
    x[2, 7] = float("nan")
    y = normkit.layer_norm(x, 50)
    assert torch.isnan(y[2]).all() and not torch.isnan(y[torch.arange(6) != 2]).any()
    xg = randn(2, 8, 10)
    xg[1, 3, 4] = float("nan")  # group 1 of sample 1 (channels 2-3)
    yg = normkit.group_norm(xg, 4)
    nan = torch.isnan(yg)
    assert nan[1, 2:4].all() and nan.sum() == 20


def test_create_graph_uses_the_differentiable_backward(served):
    """Third order through the fast path's LayerNorm and GroupNorm matches the float64 oracle's
    (torch's own LayerNorm is 0.2 off there: its double backward is not differentiated correctly)."""
    for op, x, f in (("row", randn(3, 9, dtype=torch.float64), lambda t: normkit.layer_norm(t, 9)),
                     ("group", randn(2, 8, 3, dtype=torch.float64), lambda t: normkit.group_norm(t, 2, activation="silu"))):
        x.requires_grad_()
        x64 = x.detach().clone().requires_grad_()
        ref_f = (lambda t: ref.layer_norm(t, (9,))[0]) if op == "row" else \
            (lambda t: ref.group_norm(t, 2, activation_name="silu")[0])
        out = []
        for fn, t in ((f, x), (ref_f, x64)):
            g1, = torch.autograd.grad(fn(t).pow(3).sum(), t, create_graph=True)
            g2, = torch.autograd.grad(g1.sin().sum(), t, create_graph=True)
            out.append(torch.autograd.grad(g2.pow(2).sum(), t)[0])
        assert_close(out[0], out[1], 1e-9, f"{op} third order")
    assert served == {"row": 1, "group": 1}


def test_non_contiguous_rows_give_contiguous_outputs():
    x = randn(8, 6, 32).transpose(0, 1)  # last dim contiguous, rows permuted
    for y in (normkit.rms_norm(x, 32), normkit.layer_norm(x, 32), normkit.rms_norm(x, 32, residual=x, prenorm=True)[1]):
        assert y.is_contiguous()
    assert_close(normkit.rms_norm(x, 32), ref.rms_norm(x, (32,))[0], TOL[torch.float32], "rms of permuted rows")


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w: normkit.layer_norm(x, (True,)), TypeError, "normalized_shape"),
    (lambda x, w: normkit.layer_norm(x, 16, w[:8]), ValueError, "weight: expected shape"),
    (lambda x, w: normkit.layer_norm(x, 16, eps="1e-5"), TypeError, "eps"),
    (lambda x, w: normkit.rms_norm(x, 16, w, activation="tanh"), ValueError, "activation"),
    (lambda x, w: normkit.rms_norm(x, 16, None, weight_offset=1.0), ValueError, "weight_offset"),
    (lambda x, w: normkit.rms_norm(x, 16, w, prenorm=True), ValueError, "prenorm"),
    (lambda x, w: normkit.rms_norm(x, 16, w, residual=x[:, :8]), ValueError, "residual"),
    (lambda x, w: normkit.layer_norm(x, 16, backend="nope"), ValueError, "backend"),
    (lambda x, w: normkit.group_norm(x, True), ValueError, "num_groups"),
    (lambda x, w: normkit.group_norm(x, 3), ValueError, "num_groups"),
    (lambda x, w: normkit.group_norm(x, 4, w[:4]), ValueError, "weight"),
])
def test_bad_arguments_raise_the_general_paths_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(randn(4, 16), randn(16))


def test_calls_it_does_not_serve_take_the_general_path(served):
    x, w = randn(4, 2, 16), randn(16)
    normkit.rms_norm(x, 16, w, return_amax=True)
    normkit.layer_norm(x, 16, randn(2, 16))  # per-head weight
    normkit.layer_norm(x.view(4, 2, 4, 4), (4, 4), randn(4, 4), scale=randn(4, 4, 4))  # two normalized dims
    normkit.group_norm(randn(2, 8, 4, 4).permute(0, 1, 3, 2), 4)  # neither contiguous nor channels_last
    assert served == {"row": 0, "group": 0}


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("offset", [0.0, 1e4], ids=["centred", "offset1e4"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["scale+shift", "scale", "shift (B, 1, N)", "silu+residual"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_modulated_calls_are_served_as_the_general_path_computes_them(op, case, dtype, offset, grad, served):
    """adaLN modulation: torch's kernel for the norm, then the modulation in fp32 and one rounding; the same
    bits as the general path (backend="torch": the same function on the same rows), within the oracle's bound;
    with autograd, every gradient (x, weight, bias, residual, scale, shift) the general path's, bitwise."""
    dt = DTYPES[dtype]
    x = (offset + randn(3, 5, 32, dtype=torch.float64)).to(dt)
    w = randn(32, dtype=torch.float32)
    b = randn(32, dtype=torch.float32) if op == "layer_norm" else None
    table = (3, 1, 32) if case.startswith("shift (B, 1") else (3, 32)
    sc = None if case.startswith("shift") else randn(*table, dtype=dt)
    sh = None if case == "scale" else randn(*table, dtype=dt)
    r = randn(3, 5, 32, dtype=dt) if case == "silu+residual" else None
    kw = dict(scale=sc, shift=sh, residual=r, activation="silu" if r is not None else None)
    args = (x, 32, w, b) if op == "layer_norm" else (x, 32, w)
    named = [(n, t) for n, t in zip(("x", "weight", "bias", "residual", "scale", "shift"), (x, w, b, r, sc, sh))
             if t is not None]
    leaves = [t for _, t in named]
    for t in leaves:
        t.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        y = getattr(normkit, op)(*args, **kw)
        assert served["row"] == 1
        general = getattr(normkit, op)(*args, backend="torch", **kw)
    assert torch.equal(y, general)
    if grad:
        dy = randn(*y.shape, dtype=y.dtype)
        for got, want, (name, _) in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(general, leaves, dy),
                                        named):
            assert torch.equal(got, want), name
        x, w, b, r, sc, sh = (None if t is None else t.detach() for t in (x, w, b, r, sc, sh))
        y = y.detach()
    z = x if r is None else ref.residual_sum(x, r)
    oracle = {"layer_norm": ref.layer_norm, "rms_norm": ref.rms_norm}[op]
    y_ref = oracle(z, (32,), w, *((b,) if op == "layer_norm" else ()), 1e-5, kw["activation"], scale=sc, shift=sh)[0]
    assert_close(y, y_ref, _tol(dt, offset), f"{op} {case} y")


def _nodes(t) -> set:
    """The names of the autograd nodes t's graph holds."""
    seen, todo = {}, [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = node.name()
            todo.extend(n for n, _ in node.next_functions)
    return set(seen.values())


def test_plain_centred_group_norm_takes_torchs_autograd_node():
    """Centred groups record torch's own nodes, with an activation too (its backward is the kernel calls
    normkit's backward makes: the same bits, no Python); an off-centre group or relu (whose node saves
    its output: in-place ops on y would break it) keeps normkit's Function (the shifted backward)."""
    w, b = randn(16).requires_grad_(), randn(16).requires_grad_()
    centred = randn(2, 16, 5).requires_grad_()
    offset = (randn(2, 16, 5) + torch.arange(4.0).repeat_interleave(4).reshape(1, 16, 1) * 1e4).requires_grad_()
    assert normkit.group_norm(centred, 4, w, b).grad_fn.name() == "NativeGroupNormBackward0"
    assert normkit.group_norm(offset, 4, w, b).grad_fn.name() == "CpuGroupNormBackward"
    for act, node in (("silu", "SiluBackward0"), ("mish", "MishBackward0"), ("gelu", "GeluBackward0")):
        nodes = _nodes(normkit.group_norm(centred, 4, w, b, activation=act))
        assert {node, "NativeGroupNormBackward0"} <= nodes and "CpuGroupNormBackward" not in nodes, (act, nodes)
    assert normkit.group_norm(offset, 4, w, b, activation="silu").grad_fn.name() == "CpuGroupNormBackward"
    assert normkit.group_norm(centred, 4, w, b, activation="relu").grad_fn.name() == "CpuGroupNormBackward"
    dy = randn(2, 16, 5)
    got = _grads(normkit.group_norm(centred, 4, w, b), [centred, w, b], dy)
    want = normkit.backends.torch_backend.group_norm_bwd(
        dy, centred.detach(), 4, w.detach(), b.detach(), *normkit.backends.torch_backend.group_norm_fwd(
            centred.detach(), 4, w.detach(), b.detach(), 1e-5)[1:], None, torch.float32, torch.float32)
    for g, e in zip(got, want):
        assert torch.equal(g, e), "torch's node and the torch backend's backward differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
@pytest.mark.parametrize("dy_layout", ["x's", "expanded"])
@pytest.mark.parametrize("shape, x_layout", [((3, 8, 5, 7), None), ((3, 8, 5, 7), torch.channels_last),
                                             ((2, 32, 16), None)], ids=["nchw", "channels-last", "1d"])
@pytest.mark.parametrize("activation", ["mish", "silu", "gelu", "gelu_tanh"])
def test_group_norm_activation_nodes_match_the_ops_backward_bitwise(activation, shape, x_layout, dy_layout, dtype):
    """torch's nodes (centred groups) give the bits of the custom op's backward (group_norm_bwd with the
    forward's eps: torch's kernel again for the activation's input) and of the general path's
    GroupNormFn, for dy in x's memory format (what torch.compile's tangents have) or, for an NCHW x,
    expanded (a sum's); off-centre groups (normkit's CpuGroupNorm) too. (dy in another layout can move
    the last bit, as it did on the Functions before: torch's activation kernels round their vectorized
    and scalar loops differently, and the operands' strides decide which elements take which.)"""
    from normkit import _library
    if dy_layout == "expanded" and x_layout is not None:
        pytest.skip("an expanded dy is not in channels_last format")
    for offset in (0.0, 1e4):
        x = (randn(*shape, dtype=torch.float64) + offset).to(dtype)
        x = (x if x_layout is None else x.contiguous(memory_format=x_layout)).requires_grad_()
        p_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        w, b = randn(shape[1], dtype=p_dtype).requires_grad_(), randn(shape[1], dtype=p_dtype).requires_grad_()
        dy = randn(*shape, dtype=dtype)
        dy = dy if x_layout is None else dy.contiguous(memory_format=x_layout)
        out = []
        for fn in (lambda: normkit.group_norm(x, 4, w, b, activation=activation),
                   lambda: normkit.group_norm(x, 4, w, b, activation=activation, backend="torch"),
                   lambda: _library.group_norm(x, 4, w, b, 1e-5, None, activation=activation)):
            y = fn()
            if not out:  # the default path: torch's nodes for centred groups, CpuGroupNorm off-centre
                nodes = _nodes(y)
                assert ("CpuGroupNormBackward" in nodes) == bool(offset), nodes
                assert ("NativeGroupNormBackward0" in nodes) == (not offset), nodes
            out.append([y.detach()] + list(torch.autograd.grad(y, [x, w, b], dy) if dy_layout == "x's" else
                                           torch.autograd.grad(y.sum(), [x, w, b])))
        for name, other in zip(("the general path", "the custom op"), out[1:]):
            for i, (g, e) in enumerate(zip(out[0], other)):
                assert g.dtype == e.dtype and torch.equal(g, e), f"offset {offset}: {name} [{i}] differs"


@pytest.mark.parametrize("activation", [None, "mish", "relu"])
@pytest.mark.parametrize("offset", [0.0, 1e4], ids=["centred", "offset1e4"])
@pytest.mark.parametrize("shape", [(2, 16, 5), (2, 16, 3, 3)])
def test_group_norm_outputs_take_in_place_ops(shape, offset, activation):
    """In-place ops on the output and its views work on every route (torch's nodes, CpuGroupNorm; relu
    too, whose torch node would refuse them), with the gradients of the same ops on a float64 copy of
    torch's GroupNorm's output."""
    x = (randn(*shape) + offset).requires_grad_()
    w, b = randn(16).requires_grad_(), randn(16).requires_grad_()
    acts = {None: lambda t: t, "mish": torch.nn.functional.mish, "relu": torch.nn.functional.relu}
    grads = []
    for y in (normkit.group_norm(x, 4, w, b, activation=activation),
              acts[activation](torch.nn.functional.group_norm(x.double(), 4, w.double(), b.double())).clone()):
        y.add_(1)
        y[0].mul_(2)
        grads.append(torch.autograd.grad((y * y).sum(), [x, w, b]))
    for got, want, name in zip(*grads, ("dx", "dweight", "dbias")):
        assert_close(got, want, 1e-4 if offset else 1e-5, name)


# ----------------------------------------------------------------------------- per-call shortcuts (session 20)

@pytest.mark.parametrize("offset", [0.0, 1e4], ids=["centred", "offset1e4"])
def test_patched_modules_go_straight_to_the_fast_path(offset, monkeypatch):
    """A patched torch LayerNorm / RMSNorm / GroupNorm hands a plain CPU call to _cpu itself, not through
    normkit.functional, with the public function's bits (output and gradients); with a backend named, and
    for a call _cpu declines (a one-element LayerNorm row), the public function runs."""
    from normkit import functional as F
    mods = [torch.nn.LayerNorm(24), torch.nn.RMSNorm(24), torch.nn.GroupNorm(4, 16)]
    for m in mods:
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(randn(*p.shape))
    xs = [randn(3, 5, 24) + offset, randn(3, 5, 24) + offset, randn(2, 16, 6) + offset]
    calls = [lambda m, x: normkit.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps),
             lambda m, x: normkit.rms_norm(x, m.normalized_shape, m.weight, m.eps),
             lambda m, x: normkit.group_norm(x, m.num_groups, m.weight, m.bias, m.eps)]
    want = []
    for m, x, call in zip(mods, xs, calls):
        xr = x.clone().requires_grad_()
        y = call(m, xr)
        want.append([y.detach(), *torch.autograd.grad(y, [xr, *m.parameters()], torch.ones_like(y))])
    patched = torch.nn.Sequential(*mods)
    normkit.patch(patched)
    public = {"layer_norm": 0, "rms_norm": 0, "group_norm": 0}
    for name in public:
        def spy(*a, _real=getattr(F, name), _name=name, **k):
            public[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(F, name, spy)
    for m, x, w in zip(mods, xs, want):
        xr = x.clone().requires_grad_()
        y = m(xr)
        got = [y.detach(), *torch.autograd.grad(y, [xr, *m.parameters()], torch.ones_like(y))]
        assert all(torch.equal(g, e) for g, e in zip(got, w)), type(m).__name__
    assert public == {"layer_norm": 0, "rms_norm": 0, "group_norm": 0}
    for m in mods:
        m._normkit_backend = "torch"
    for m, x in zip(mods, xs):
        m(x)
    assert public == {"layer_norm": 1, "rms_norm": 1, "group_norm": 1}
    one = torch.nn.LayerNorm(1)
    normkit.patch(one)
    one(randn(4, 1))
    assert public["layer_norm"] == 2


def test_norm_modulate_goes_straight_to_the_fast_path(monkeypatch):
    """blocks.norm_modulate hands a CPU call to _cpu itself, with row_norm_as_written's bits; shift of
    scale's shape is taken as checked, a shift of another shape is still checked."""
    from normkit import blocks, functional as F
    norm = torch.nn.LayerNorm(16)
    x, scale, shift = randn(2, 5, 16), randn(2, 1, 16), randn(2, 1, 16)
    want = F.row_norm_as_written(x, (16,), norm.weight, norm.bias, norm.eps, False, scale=scale, shift=shift,
                                 out_dtype=torch.float32)
    real = F.row_norm_as_written
    calls = []
    monkeypatch.setattr(F, "row_norm_as_written", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.equal(blocks.norm_modulate(norm, x, scale, shift), want) and not calls
    # per token: not one row per sample, as written (torch's ops), whichever of the two it is
    per_token = randn(2, 5, 16)[:, :, :1].expand(2, 5, 16)
    for s, t in ((scale, per_token[:1]), (per_token[:1], shift)):
        got = blocks.norm_modulate(norm, x, s, t)
        assert torch.equal(got, norm(x) * (1 + s) + t) and not calls


def test_modulation_check_of_a_shift_shaped_unlike_scale():
    """_modulation_served takes a shift of scale's shape as checked, and checks one of another shape."""
    x = randn(2, 5, 16)
    assert _cpu._modulation_served(x, randn(2, 1, 16), randn(2, 1, 16), 16)
    assert _cpu._modulation_served(x, randn(2, 1, 16), randn(2, 16), 16)
    assert not _cpu._modulation_served(x, randn(2, 1, 16), randn(1, 5, 16), 16)  # per token
    assert not _cpu._modulation_served(x, randn(2, 5, 16), randn(2, 1, 16), 16)  # other samples than scale's


@pytest.mark.parametrize("offset", [0.0, 1e4], ids=["centred", "offset1e4"])
def test_layer_norm_backward_takes_the_forwards_centring_result(offset, monkeypatch):
    """With autograd, the LayerNorm backward skips the centring check where the forward found the rows
    centred (one check per call), and checks again where it shifted (two): the general path's bits."""
    from normkit.backends import torch_backend as tb
    x = (randn(3, 7, 32) + offset).requires_grad_()
    w, b = randn(32).requires_grad_(), randn(32).requires_grad_()
    dy = randn(3, 7, 32)
    want = torch.autograd.grad(normkit.layer_norm(x, 32, w, b, backend="torch"), [x, w, b], dy)
    real, checks = tb._centred, []
    monkeypatch.setattr(tb, "_centred", lambda m, r: checks.append(1) or real(m, r))
    got = torch.autograd.grad(normkit.layer_norm(x, 32, w, b), [x, w, b], dy)
    assert len(checks) == (2 if offset else 1)
    assert all(torch.equal(g, e) for g, e in zip(got, want))


def test_torchs_layer_norm_backward_reads_no_bias_values():
    """The torch backend passes torch's LayerNorm backward kernel the bias itself (zeros only without one):
    the kernel asks only whether there is one, so any bias gives the same gradients."""
    x, dy, w = randn(9, 40), randn(9, 40), randn(40)
    _, mean, rstd = torch.native_layer_norm(x, [40], w, None, 1e-5)
    mask = [True, True, True]
    ln_bwd = torch.ops.aten.native_layer_norm_backward
    a = ln_bwd(dy, x, [40], mean, rstd, w, torch.zeros(40), mask)
    b = ln_bwd(dy, x, [40], mean, rstd, w, randn(40) * 7, mask)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_row_options_are_reused():
    """_options gives RowOptions equal to the constructed ones, the same object for the same fields."""
    from normkit._autograd import RowOptions
    a = _cpu._options(torch.float32, 1.0, None, True, False)
    assert a == RowOptions(torch.float32, 1.0, None, mod_scale=True, mod_shift=False)
    assert _cpu._options(torch.float32, 1.0, None, True, False) is a
    assert _cpu._options(torch.float32, 1.0, None, False, True) != a


def _sample_rows_as_written(t_shape, x_shape, k):
    """sample_rows' rule spelled out: t's lead padded with ones on the right must equal a prefix of x's lead
    followed by broadcast ones; (S, rows per sample), else None."""
    lead, slead = tuple(x_shape[: len(x_shape) - k]), tuple(t_shape[: len(t_shape) - k])
    if len(slead) > len(lead):
        return None
    padded = slead + (1,) * (len(lead) - len(slead))
    last = max([i for i, s in enumerate(padded) if s != 1], default=-1)
    if padded[: last + 1] != lead[: last + 1]:
        return None
    return math.prod(lead[: last + 1]), math.prod(lead[last + 1:])


def test_sample_rows_follows_its_rule():
    """_layout.sample_rows (loops without a padded copy) against the rule spelled out, on every lead of up to
    three dims of sizes 1-3 for t, against x leads of up to three dims."""
    from normkit._layout import sample_rows
    leads = [()] + [tuple(s) for n in (1, 2, 3) for s in itertools.product((1, 2, 3), repeat=n)]
    for x_lead in ((2, 3), (3,), (2, 1, 3), (1, 2), ()):
        for t_lead in leads:
            for k in (1, 2):
                x_shape, t_shape = x_lead + (4,) * k, t_lead + (4,) * k
                assert sample_rows(t_shape, x_shape, k) == _sample_rows_as_written(t_shape, x_shape, k), \
                    (t_shape, x_shape, k)


def test_norm_act_goes_straight_to_the_fast_path(monkeypatch):
    """blocks.norm_act hands a CPU call to _cpu itself, with normkit.group_norm's bits (forward and gradients);
    with a backend named it calls normkit.group_norm."""
    from normkit import blocks, functional as F
    norm, act = torch.nn.GroupNorm(4, 16), torch.nn.Mish()
    x = randn(2, 16, 9).requires_grad_()
    y = normkit.group_norm(x, 4, norm.weight, norm.bias, norm.eps, activation="mish")
    want = [y.detach(), *torch.autograd.grad(y, [x, norm.weight, norm.bias], torch.ones_like(y))]
    real, calls = F.group_norm, []
    monkeypatch.setattr(F, "group_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = blocks.norm_act(norm, act, x)
    got = [y.detach(), *torch.autograd.grad(y, [x, norm.weight, norm.bias], torch.ones_like(y))]
    assert all(torch.equal(g, e) for g, e in zip(got, want)) and not calls
    blocks.norm_act(norm, act, x, backend="torch")
    assert calls == [1]
