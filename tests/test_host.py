"""The C++ host path without a GPU: a real g++ build of the extension against this torch, the way
it reads a call (the cases it serves, the ones it leaves to Python, its plan keys, the row and
GroupNorm layouts it accepts), and the plan recorder on real runs of the Triton backend's host
functions under the Triton interpreter: every recorded kernel argument must come back, bit for bit,
when the plan's parameter buffers are rebuilt from its slots. GPU tests: test_host_gpu.py."""
import os
import struct
import subprocess
import sys
import threading

import pytest
import torch

import normkit
from normkit import _host
from normkit._host import plans
from normkit.backends import triton as tb

from conftest import DEVICE, HAS_CUDA


@pytest.fixture(scope="module")
def ext():
    return _host.load_extension()  # builds with g++ and ninja the first time


# ----------------------------------------------------------------------------- reading a call

def test_row_calls_it_serves(ext):
    x = torch.randn(4, 6, 8)
    w, b = torch.randn(8), torch.randn(8)
    ndim, M, N, row_stride, eps, act, grad, *_, key = ext._parse_row(x, 8, w, b, 1e-5, False, None, None)
    assert (ndim, M, N, row_stride, eps, act, grad) == (1, 24, 8, 8, 1e-5, 0, False)
    assert ext._parse_row(x, (6, 8), None, None, 0, False, "silu", "triton")[:6] == (2, 4, 48, 48, 0.0, 1)
    assert ext._parse_row(x, torch.Size([8]), w, None, None, True, None, None)[4] == torch.finfo(torch.float32).eps
    strided = x[:, ::2, :]  # rows 16 elements apart: a strided [12, 8] view, no copy
    assert ext._parse_row(strided, 8, None, None, 1e-5, False, None, None)[1:4] == (12, 8, 16)
    assert ext._parse_row(x, 8, torch.nn.Parameter(w), None, 1e-5, False, None, None) is not None
    xr = x.clone().requires_grad_()
    assert ext._parse_row(xr, 8, w, b, 1e-5, False, None, None)[6] is True
    with torch.no_grad():
        assert ext._parse_row(xr, 8, w, b, 1e-5, False, None, None)[6] is False
    empty = torch.randn(0, 8)
    assert ext._parse_row(empty, 8, w, b, 1e-5, False, None, None)[1:3] == (0, 8)


@pytest.mark.parametrize("case", [
    "numpy int shape", "bad activation", "backend cuda", "kwarg", "rms with bias", "nan eps", "negative eps",
    "bool eps", "shape mismatch", "weight shape", "weight strided", "rows need three strides", "columns not mergeable",
    "float64", "subclass", "forward-AD dual", "dispatch mode", "vmap", "bool rms", "jit trace",
])
def test_row_calls_it_leaves_to_python(ext, case):
    import numpy as np
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w, b = torch.randn(4, 6, 8), torch.randn(8), torch.randn(8)
    args = [x, 8, w, b, 1e-5, False, None, None]
    kwargs = {}
    mode = None
    if case == "numpy int shape":
        args[1] = np.int64(8)
    elif case == "bad activation":
        args[6] = "swish"
    elif case == "backend cuda":
        args[7] = "cuda"
    elif case == "kwarg":
        kwargs = {"residual": x}
    elif case == "rms with bias":
        args[5] = True
    elif case == "nan eps":
        args[4] = float("nan")
    elif case == "negative eps":
        args[4] = -1.0
    elif case == "bool eps":
        args[4] = True
    elif case == "shape mismatch":
        args[1] = 6
    elif case == "weight shape":
        args[2] = torch.randn(4)
    elif case == "weight strided":
        args[2] = torch.randn(16)[::2]
    elif case == "rows need three strides":  # the Python path copies
        args[0] = torch.randn(4, 6, 2, 8)[:, :5, :, :].permute(2, 0, 1, 3)
    elif case == "columns not mergeable":
        args[0] = torch.randn(4, 2, 3, 6).permute(0, 3, 2, 1)
        args[1], args[2], args[3] = (3, 2), None, None
    elif case == "float64":
        args[0] = x.double()
    elif case == "subclass":
        class Sub(torch.Tensor):
            pass
        args[0] = x.as_subclass(Sub)
    elif case == "forward-AD dual":
        import torch.autograd.forward_ad as fwAD
        with fwAD.dual_level():
            args[0] = fwAD.make_dual(x, torch.randn_like(x))
            assert ext._parse_row(*args) is None
        return
    elif case == "dispatch mode":
        mode = TorchDispatchMode()
    elif case == "vmap":
        seen = []
        torch.func.vmap(lambda r: seen.append(ext._parse_row(r, 8, w, b, 1e-5, False, None, None)) or r)(x)
        assert seen == [None]
        return
    elif case == "jit trace":  # the tracer records dispatcher ops; the C++ path launches kernels it would not see
        seen = []

        def f(t):
            seen.append(ext._parse_row(t, 8, w, b, 1e-5, False, None, None))
            return t * 2
        torch.jit.trace(f, (x,), check_trace=False)
        assert seen == [None]
        return
    elif case == "bool rms":
        args[5] = 1
    if mode is not None:
        with mode:
            assert ext._parse_row(*args, **kwargs) is None
    else:
        assert ext._parse_row(*args, **kwargs) is None


def test_autocast(ext):
    """Under CUDA autocast torch computes the norms in float32. LayerNorm/RMSNorm read x as it is and
    write float32 (out_dtype, as functional._autocast_rows does) where torch's autocast upcasts the op
    (rms_norm from torch 2.12 on), unless the caller says it applied the contract (autocast=False);
    GroupNorm calls already in float32 are served, others go to Python, which casts them."""
    from normkit.functional import _autocast_upcasts

    x, w = torch.randn(4, 8), torch.randn(8)
    opts = (None, False, None, 0, None, None, False)
    torch.set_autocast_enabled("cuda", True)  # the autocast state itself: CPU-only torch has no CUDA autocast
    try:
        assert ext._parse_row(x, 8, w, None, 1e-5, False, None, None)[9] is None
        assert ext._parse_gn(x.view(4, 8, 1), 2, w, None, 1e-5, None, None) is not None
        assert ext._parse_row(x.half(), 8, w, None, 1e-5, False, None, None)[9] == torch.float32
        assert ext._parse_row(x.half(), 8, w, None, 1e-5, False, None, None, *opts, False)[9] is None
        rms = ext._parse_row(x.bfloat16(), 8, w, None, None, True, None, None, *opts, True)[9]
        assert rms == (torch.float32 if _autocast_upcasts("rms_norm", "cuda") else None)
        assert ext._parse_row(x, 8, w.bfloat16(), None, 1e-5, False, None, None)[9] is None  # x float32: as is
        assert ext._parse_gn(x.view(4, 8, 1).bfloat16(), 2, None, None, 1e-5, None, None) is None
    finally:
        torch.set_autocast_enabled("cuda", False)
    assert ext._parse_row(x.half(), 8, w, None, 1e-5, False, None, None)[9] is None


def _fused(x, shape, w, b, rms=False, residual=None, prenorm=False, residual_dtype=None, weight_offset=0,
           out_dtype=None, out_scale=None, return_amax=False, autocast=True, eps=1e-5, act=None, scale=None,
           shift=None, gate=None):
    """The arguments functional._via_host hands the host path: 16, or 19 with the modulation or a gate."""
    extra = (scale, shift, gate) if (scale, shift, gate) != (None, None, None) else ()
    return (x, shape, w, b, eps, rms, act, None, residual, prenorm, residual_dtype, weight_offset, out_dtype, out_scale,
            return_amax, autocast) + extra


def test_fused_calls_it_serves(ext):
    """The fused options, per-head weights, aliased parameters and the layouts normkit reads in place
    are served, each under a key of its own."""
    x, r = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    w, b = torch.randn(8), torch.randn(8)

    def key(*args):
        got = ext._parse_row(*args)
        assert got is not None, args[4:]
        return tuple(got[-1])

    plain = key(*_fused(x, 8, w, b))
    assert plain == key(x, 8, w, b, 1e-5, False, None, None)  # the 8-argument form is the plain call
    fp8 = torch.float8_e4m3fn
    keys = [plain, key(*_fused(x, 8, w, b, residual=r)), key(*_fused(x, 8, w, b, residual=r, prenorm=True)),
            key(*_fused(x, 8, w, b, residual=r, residual_dtype=torch.bfloat16)),
            key(*_fused(x, 8, w, None, rms=True, weight_offset=1.0)), key(*_fused(x, 8, w, None, rms=True, weight_offset=2)),
            key(*_fused(x, 8, w, b, out_dtype=torch.bfloat16)), key(*_fused(x, 8, w, b, out_dtype=fp8, out_scale=2.0)),
            key(*_fused(x, 8, w, b, out_dtype=fp8, out_scale=4.0)),
            key(*_fused(x, 8, w, b, out_dtype=fp8, out_scale=torch.tensor([2.0]))),
            key(*_fused(x, 8, w, b, return_amax=True)), key(*_fused(x, 8, w, w)),  # weight and bias one tensor
            key(*_fused(x, 8, torch.randn(6, 8), torch.randn(6, 8))),  # per-head parameters
            key(*_fused(x.transpose(0, 1), 8, w, b)),  # rows with two strides
            key(*_fused(x.transpose(1, 2), 6, None, None)),  # columns 8 apart (a permuted NCHW tensor)
            key(*_fused(x, 8, w, b, residual=torch.randn(4, 6, 16)[..., :8]))]  # residual rows 16 apart
    assert len(set(keys)) == len(keys)
    assert key(*_fused(x, 8, w, b, out_dtype=x.dtype)) == plain  # out_dtype of x's dtype: no option
    got = ext._parse_row(*_fused(x, 8, torch.randn(6, 8), None, rms=True))
    assert got[8] == 6  # weight rows
    assert ext._parse_row(*_fused(x.transpose(0, 1), 8, w, b))[7] == 2  # an [O, I, N] view
    rr = r.clone().requires_grad_()
    assert ext._parse_row(*_fused(x, 8, w, b, residual=rr))[6] is True  # the residual's gradient: autograd


@pytest.mark.parametrize("case", [
    "prenorm without residual", "residual_dtype without residual", "residual shape", "residual float64",
    "residual subclass", "weight_offset without weight", "weight_offset bool", "weight_offset nan",
    "float8 without scale", "scale without float8", "scale of 2 elements", "scale float64", "out_dtype int",
    "prenorm int", "mixed per-head parameters", "per-head weight of wrong heads", "residual needs a copy",
])
def test_fused_calls_it_leaves_to_python(ext, case):
    x, r, w, b = torch.randn(4, 6, 8), torch.randn(4, 6, 8), torch.randn(8), torch.randn(8)
    kw = {}
    if case == "prenorm without residual":
        kw = dict(prenorm=True)
    elif case == "residual_dtype without residual":
        kw = dict(residual_dtype=torch.float32)
    elif case == "residual shape":
        kw = dict(residual=torch.randn(4, 6, 1).expand(4, 6, 8).contiguous()[:, :5])
    elif case == "residual float64":
        kw = dict(residual=r.double())
    elif case == "residual subclass":
        class Sub(torch.Tensor):
            pass
        kw = dict(residual=r.as_subclass(Sub))
    elif case == "weight_offset without weight":
        w, kw = None, dict(weight_offset=1.0)
    elif case == "weight_offset bool":
        kw = dict(weight_offset=True)
    elif case == "weight_offset nan":
        kw = dict(weight_offset=float("nan"))
    elif case == "float8 without scale":
        kw = dict(out_dtype=torch.float8_e4m3fn)
    elif case == "scale without float8":
        kw = dict(out_scale=2.0)
    elif case == "scale of 2 elements":
        kw = dict(out_dtype=torch.float8_e4m3fn, out_scale=torch.ones(2))
    elif case == "scale float64":
        kw = dict(out_dtype=torch.float8_e4m3fn, out_scale=torch.ones(1, dtype=torch.float64))
    elif case == "out_dtype int":
        kw = dict(out_dtype=torch.int8)
    elif case == "prenorm int":
        kw = dict(residual=r, prenorm=1)
    elif case == "mixed per-head parameters":  # Python expands the other: not a tensor the kernels read in place
        w = torch.randn(6, 8)
    elif case == "per-head weight of wrong heads":
        w = torch.randn(4, 8)
    elif case == "residual needs a copy":  # x's rows are [O, I, N]; this residual's rows are not walkable with them
        x = x.transpose(0, 1)
        kw = dict(residual=torch.randn(3, 2, 6, 4, 8)[0, 0].permute(1, 0, 2))
    assert ext._parse_row(*_fused(x, 8, w, b, **kw)) is None


def test_modulated_and_gated_calls_it_serves(ext):
    """The adaLN modulation (per-sample tables, broadcast leads, either alone, a chunk of a wider
    embedding read in place) and the gate (per-head weights too) are served, each under a key of its
    own: the tables' and the gate's dtypes, shapes and strides are in it."""
    B, T, N = 2, 6, 8
    x, w, b = torch.randn(B, T, N), torch.randn(N), torch.randn(N)
    emb = torch.randn(B, 6 * N)  # diffusers' adaLN embedding, chunked into shift/scale/gate rows
    sh, sc = emb[:, :N], emb[:, N:2 * N]

    def key(*args):
        got = ext._parse_row(*args)
        assert got is not None, args[16:]
        return tuple(got[-1])

    plain = key(*_fused(x, N, w, b))
    keys = [plain, key(*_fused(x, N, w, b, scale=torch.randn(B, N))),
            key(*_fused(x, N, w, b, scale=torch.randn(B, 1, N))),
            key(*_fused(x, N, None, None, scale=torch.randn(N))),
            key(*_fused(x, N, None, None, scale=torch.randn(1, N))),
            key(*_fused(x, N, w, b, shift=torch.randn(B, N))),
            key(*_fused(x, N, w, b, scale=torch.randn(B, N), shift=torch.randn(B, N))),
            key(*_fused(x, N, w, b, scale=sc, shift=sh)),  # rows 6N apart, read in place
            key(*_fused(x, N, w, b, scale=torch.randn(B, N, dtype=torch.bfloat16))),
            key(*_fused(x, N, w, b, scale=torch.randn(B, N, dtype=torch.float64))),
            key(*_fused(x, N, w, b, act="silu", scale=torch.randn(B, N), shift=torch.randn(B, N))),
            key(*_fused(x, N, w, None, rms=True, gate=torch.randn(B, T, N))),
            key(*_fused(x, N, w, None, rms=True, gate=torch.randn(B, T, N, dtype=torch.bfloat16))),
            key(*_fused(x, N, w, None, rms=True, gate=torch.randn(B, T, 2 * N)[..., :N])),  # gate rows 2N apart
            key(*_fused(x.view(B, T, 2, N // 2), N // 2, torch.randn(2, N // 2), None, rms=True,
                        gate=torch.randn(B, T, 2, N // 2))),  # per group: per-head weights
            key(*_fused(x, N, w, None, rms=True, gate=x)),  # the gate is x itself: aliased inputs
            key(*_fused(x, N, w, b, scale=sc, shift=sc))]  # scale and shift one tensor
    assert len(set(keys)) == len(keys)
    # alike calls share a key; all-None extras are the 16-argument call
    assert key(*_fused(x, N, w, b, scale=torch.randn(B, N))) == keys[1]
    assert key(*(_fused(x, N, w, b) + (None, None, None))) == plain
    got = ext._parse_row(*_fused(x, N, w, b, scale=torch.randn(B, N, requires_grad=True)))
    assert got[6] is True  # a table that requires grad: the call records its graph
    assert ext._parse_row(*_fused(x, N, w, None, rms=True, gate=torch.randn(B, T, N, requires_grad=True)))[6] is True


@pytest.mark.parametrize("case", [
    "per-token scale", "scale of wrong width", "scale lead not a prefix", "scale and shift of other samples",
    "scale with per-head weight", "scale int", "scale subclass", "scale column-strided", "scale rows need a copy",
    "scale not a tensor", "scale forward-AD dual", "gate shape", "gate with residual", "gate with scale",
    "gate int", "gate needs a copy",
])
def test_modulated_and_gated_calls_it_leaves_to_python(ext, case):
    """Where the Python path raises (functional._check_modulation / _check_gate) or copies a table."""
    B, T, N = 2, 6, 8
    x, w, b = torch.randn(B, T, N), torch.randn(N), torch.randn(N)
    kw = {}
    if case == "per-token scale":
        kw = dict(scale=torch.randn(1, T, N))  # one row per token, the same for every sample
    elif case == "scale of wrong width":
        kw = dict(scale=torch.randn(B, N // 2))
    elif case == "scale lead not a prefix":
        kw = dict(scale=torch.randn(T, N))
    elif case == "scale and shift of other samples":
        kw = dict(scale=torch.randn(B, N), shift=torch.randn(N))
    elif case == "scale with per-head weight":
        x, w, b = x.view(B, T, 2, N // 2), torch.randn(2, N // 2), None
        kw = dict(scale=torch.randn(B, N // 2))
        N = N // 2
    elif case == "scale int":
        kw = dict(scale=torch.ones(B, N, dtype=torch.int32))
    elif case == "scale subclass":
        class Sub(torch.Tensor):
            pass
        kw = dict(scale=torch.randn(B, N).as_subclass(Sub))
    elif case == "scale column-strided":  # mod_table copies it
        kw = dict(scale=torch.randn(B, 2 * N)[:, ::2])
    elif case == "scale rows need a copy":  # two sample dims that no one stride walks
        x, kw = torch.randn(2, 3, T, N), dict(scale=torch.randn(2, 4, N)[:, :3])
    elif case == "scale not a tensor":
        kw = dict(scale=[1.0] * N)
    elif case == "scale forward-AD dual":
        import torch.autograd.forward_ad as fwAD
        with fwAD.dual_level():
            s = fwAD.make_dual(torch.randn(B, N), torch.randn(B, N))
            assert ext._parse_row(*_fused(x, N, w, b, scale=s)) is None
        return
    elif case == "gate shape":
        kw = dict(gate=torch.randn(B, 1, N))
    elif case == "gate with residual":
        kw = dict(gate=torch.randn(B, T, N), residual=torch.randn(B, T, N))
    elif case == "gate with scale":
        kw = dict(gate=torch.randn(B, T, N), scale=torch.randn(B, N))
    elif case == "gate int":
        kw = dict(gate=torch.ones(B, T, N, dtype=torch.int32))
    elif case == "gate needs a copy":  # rows that no one stride walks, as x's are walked
        x, kw = torch.randn(3, 2, 4, N), dict(gate=torch.randn(3, 4, 2, N).permute(0, 2, 1, 3))
    assert ext._parse_row(*_fused(x, N, w, b, **kw)) is None


def test_via_host_passes_the_entry_arguments_in_their_order(host_path_calls):
    """functional._via_host calls the eager entry positionally: in normkit._op_args.HOST_ROW's order,
    whose positions host.cpp reads, and as long as HOST_ROW_LENGTHS says."""
    from normkit import functional
    from normkit._op_args import HOST_ROW, HOST_ROW_LENGTHS

    token = {name: object() for name in HOST_ROW}
    functional._via_host(**token)
    functional._via_host(**dict(token, mod_scale=None, mod_shift=None, gate=None))
    assert host_path_calls[0] == tuple(token[n] for n in HOST_ROW) and len(HOST_ROW) == HOST_ROW_LENGTHS[2]
    assert host_path_calls[1] == tuple(token[n] for n in HOST_ROW[: HOST_ROW_LENGTHS[1]])


@pytest.mark.parametrize("case", ["unknown name", "misplaced", "lengths"])
def test_setup_refuses_an_entry_it_does_not_read(ext, case):
    """An eager-entry argument host.cpp does not read, or one out of its place, fails the load (the
    Python path then serves every call) instead of being dropped; a failed _setup changes nothing."""
    from normkit._op_args import HOST_ROW, HOST_ROW_LENGTHS
    from normkit.functional import _autocast_upcasts
    from normkit.reference import ACTIVATIONS

    names, lengths = HOST_ROW, HOST_ROW_LENGTHS
    if case == "unknown name":
        names, lengths = HOST_ROW + ("new_option",), lengths[:2] + (lengths[2] + 1,)
    elif case == "misplaced":  # the gate among the plain call's arguments
        names = ("gate",) + HOST_ROW[1:-1] + ("x",)
    else:
        lengths = (8, 15, 19)
    upcasts = (_autocast_upcasts("layer_norm", "cuda"), _autocast_upcasts("rms_norm", "cuda"))
    with pytest.raises(RuntimeError, match="eager entry"):
        ext._setup(ACTIVATIONS, upcasts, names, lengths)
    x = torch.randn(4, 8)
    assert ext._parse_row(*_fused(x, 8, None, None, scale=torch.randn(4, 8))) is not None


@pytest.fixture
def cpu_calls(ext, monkeypatch):
    """The extension serving row calls on CPU tensors through its eager entry and autograd node,
    each call running the Python host functions (no plans: those need a GPU)."""
    ext._serve_cpu_calls(_host._callbacks(), True)
    monkeypatch.setattr(_host, "fast", ext)
    yield ext
    ext._serve_cpu_calls(_host._callbacks(), False)


def _cpu_cases():
    B, T, C = 2, 3, 32
    g = torch.Generator().manual_seed(0)
    t = lambda *s, dtype=torch.float32: (torch.randn(s, generator=g) * 0.7 + 0.2).to(dtype)  # noqa: E731
    x, w, b, sc, sh, gate, emb = t(B, T, C), t(C), t(C), t(B, C), t(B, 1, C), t(B, T, C), t(B, 3 * C)
    tb_ = dict(backend="triton")  # both paths on the Triton backend (interpreted), so bitwise alike
    return {
        "ln scale shift": ((x, w, b, sc, sh), lambda x, w, b, s, h: normkit.layer_norm(x, C, w, b, scale=s, shift=h,
                                                                                       **tb_)),
        "ln silu embedding chunks": ((x, w, b, emb), lambda x, w, b, e: normkit.layer_norm(
            x, C, w, b, scale=e[:, C:2 * C], shift=e[:, :C], activation="silu", **tb_)),
        "rms shift": ((x, w, sh), lambda x, w, h: normkit.rms_norm(x, C, w, shift=h, **tb_)),
        "ln scale is shift": ((x, sc), lambda x, s: normkit.layer_norm(x, C, scale=s, shift=s, **tb_)),
        "rms gate": ((x, gate, w), lambda x, g, w: normkit.rms_norm(x, C, w, gate=g, **tb_)),
        "rms gate groups": ((x, gate, t(4, C // 4)), lambda x, g, w: normkit.rms_norm(
            x.view(B, T, 4, C // 4), C // 4, w, gate=g.view(B, T, 4, C // 4), **tb_)),
        "ln bf16 gate": ((x, gate.bfloat16(), w, b), lambda x, g, w, b: normkit.layer_norm(x, C, w, b, gate=g, **tb_)),
    }


def _grads_of(fn, inputs, wanted, create_graph=False):
    leaves = [v.detach().clone().requires_grad_(i in wanted) for i, v in enumerate(inputs)]
    y = fn(*leaves)
    if not wanted:
        return [y]
    chosen = [leaves[i] for i in sorted(wanted)]
    grads = torch.autograd.grad(y, chosen, (y.detach() * 0.7 + 0.3).cos(), create_graph=create_graph)
    if create_graph:  # double backward: the node hands the backward to the differentiable torch ops
        grads = torch.autograd.grad(sum((g * g).sum() for g in grads), chosen, allow_unused=True)
    return [y, *grads]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the Triton interpreter, which a GPU "
                    "machine does not run; there tests/test_host_gpu.py drives the same entry and node with plans")
@pytest.mark.parametrize("name", list(_cpu_cases()))
def test_modulated_and_gated_calls_through_the_cpp_node(cpu_calls, name):
    """The eager entry and the C++ autograd node (seven edges: dscale, dshift, dgate) give the Python
    path's outputs and gradients bit for bit, for every requires_grad subset of one and two inputs and
    all of them, and with create_graph (the differentiable backward, called from C++)."""
    import itertools

    inputs, fn = _cpu_cases()[name]
    n = len(inputs)
    subsets = [set()] + [set(c) for k in (1, 2, n) for c in itertools.combinations(range(n), k)]
    for wanted in subsets:
        for create_graph in (False, True) if len(wanted) == n else (False,):
            with _host.python_path():
                want = _grads_of(fn, inputs, wanted, create_graph)
            s0 = cpu_calls._stats()
            got = _grads_of(fn, inputs, wanted, create_graph)
            s1 = cpu_calls._stats()
            what = (name, sorted(wanted), create_graph)
            assert s1["python_runs"] - s0["python_runs"] == (1 if not wanted or create_graph else 2), what
            assert (s1["differentiable_backwards"] > s0["differentiable_backwards"]) == create_graph, what
            assert len(got) == len(want), what
            for a, e in zip(got, want):
                assert (a is None) == (e is None), what
                if a is not None:
                    assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e), what


def test_row_view_mirrors_the_python_layout(ext):
    """Served exactly where the Python path reads the rows in place (normkit._layout.row_view makes
    a view, not a copy), for x and, walked with x's rows, the residual."""
    from normkit._layout import row_view

    g = torch.Generator().manual_seed(0)
    checked = [0, 0]
    for t in _random_layouts(g, 400, min_dim=2):
        d = t.dim()
        k = int(torch.randint(1, d, (1,), generator=g))
        shape = tuple(t.shape[d - k:])
        view = row_view(t, shape, True)
        in_place = view.data_ptr() == t.data_ptr() and view.untyped_storage().data_ptr() == \
            t.untyped_storage().data_ptr()
        got = ext._parse_row(*_fused(t, shape, None, None))
        assert (got is not None) == in_place, (t.shape, t.stride(), k)
        if got is None:
            continue
        checked[0] += 1
        assert got[7] == view.dim() - 1
        res = torch.randn(t.shape)[tuple(slice(None) for _ in range(d))]
        res = res.transpose(0, 1) if d > 2 and t.shape[0] == t.shape[1] else res
        lead = tuple(view.shape[:-1])
        rview = row_view(res, shape, True, lead)
        r_in_place = rview.untyped_storage().data_ptr() == res.untyped_storage().data_ptr()
        assert (ext._parse_row(*_fused(t, shape, None, None, residual=res)) is not None) == r_in_place
        checked[1] += r_in_place
    assert min(checked) > 50


def test_row_plan_keys(ext):
    """Calls that the Triton host function treats alike share a key; any difference it reads does not."""
    x = torch.randn(8, 64)
    w, b = torch.randn(64), torch.randn(64)

    def key(*args):
        return tuple(ext._parse_row(*args)[-1])

    base = key(x, 64, w, b, 1e-5, False, None, None)
    assert key(torch.randn(8, 64), 64, torch.randn(64), torch.randn(64), 1e-5, False, None, None) == base
    assert key(torch.randn(2, 4, 64), 64, w, b, 1e-5, False, None, None) == base  # same [M, N]
    others = [
        key(torch.randn(9, 64), 64, w, b, 1e-5, False, None, None),  # M
        key(torch.randn(8, 64, dtype=torch.bfloat16), 64, w, b, 1e-5, False, None, None),  # dtype
        key(x, 64, w.half(), b, 1e-5, False, None, None),  # weight dtype
        key(x, 64, w, None, 1e-5, False, None, None),  # no bias
        key(x, 64, w, b, 1e-6, False, None, None),  # eps
        key(x, 64, w, b, 1e-5, False, "gelu", None),  # activation
        key(torch.randn(8, 128)[:, :64], 64, w, b, 1e-5, False, None, None),  # row stride
        key(torch.randn(8, 65)[:, 1:], 64, w, b, 1e-5, False, None, None),  # x not 16-byte aligned (and stride)
        key(x, 64, torch.randn(65)[1:], b, 1e-5, False, None, None),  # weight not 16-byte aligned
    ]
    assert len(set(others) | {base}) == len(others) + 1
    xr = x.clone().requires_grad_()
    assert key(xr, 64, w, b, 1e-5, False, None, None) != base  # with grad the forward writes statistics


def _random_layouts(g, n: int, min_dim: int = 1):
    """n tensors of 1-4 dims (at least min_dim) with every other dim strided, permuted at random."""
    for _ in range(n):
        d = int(torch.randint(min_dim, 5, (1,), generator=g))
        sizes = [int(s) for s in torch.randint(1, 4, (d,), generator=g)]
        base = torch.randn(*[s * 2 for s in sizes])
        perm = torch.randperm(d, generator=g).tolist()
        yield base[tuple(slice(0, s * (1 + (i % 2)), 1 + (i % 2)) for i, s in enumerate(sizes))].permute(perm)


def test_rows_view_matches_torch_view(ext):
    """The [M, N] row view the C++ side accepts is the one torch's view() gives, unit column stride."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    checked = 0
    for t in _random_layouts(g, 300):
        for k in range(1, t.dim() + 1):
            ok, M, N, row_stride = ext._rows_view(t, k)
            lead, inner = t.shape[: t.dim() - k], t.shape[t.dim() - k:]
            m, n = int(torch.tensor(lead).prod()) if lead else 1, int(torch.tensor(inner).prod())
            assert (M, N) == (m, n)
            try:
                v = t.view(m, n)
                viewable = n <= 1 or v.stride(1) == 1
            except RuntimeError:
                viewable = False
            assert ok == viewable, (t.shape, t.stride(), k)
            if ok and m > 1:
                assert row_stride == v.stride(0)
            checked += ok
    assert checked > 50


def test_group_norm_layouts(ext):
    x = torch.randn(2, 8, 3, 5)
    assert ext._gn_layout(x) == 0
    assert ext._gn_layout(x.to(memory_format=torch.channels_last)) == 1
    assert ext._gn_layout(torch.randn(2, 7, 8).transpose(1, 2)) == 1  # [B, C, L] channels innermost
    assert ext._gn_layout(x.transpose(2, 3)) == -1
    assert ext._gn_layout(x[:, :, :, ::2]) == -1
    assert ext._gn_layout(torch.randn(2, 8)) == 0
    w = torch.randn(8)
    assert ext._parse_gn(x, 4, w, w.clone(), 1e-5, "mish", None)[:7] == (4, 2, 8, 15, 1e-5, 2, 0)
    # weight and bias one tensor (a plan's slots follow the aliasing): served, under a key of its own
    assert ext._parse_gn(x, 4, w, w, 1e-5, None, None)[-1] != ext._parse_gn(x, 4, w, w.clone(), 1e-5, None, None)[-1]
    assert ext._parse_gn(x.to(memory_format=torch.channels_last), 2, None, None, 1e-5, None, "triton")[6] == 1
    for bad in ((x, 3, None, None, 1e-5, None, None), (x, 4, torch.randn(4), None, 1e-5, None, None),
                (x, True, None, None, 1e-5, None, None), (x.transpose(2, 3), 4, None, None, 1e-5, None, None),
                (torch.randn(8), 4, None, None, 1e-5, None, None), (x, 4, None, None, 1e-5, "tanh", None)):
        assert ext._parse_gn(*bad) is None


# ----------------------------------------------------------------------------- the recorder

def _records(launches):
    """LaunchRecords of the recorded launches: from the CompiledKernel on a GPU, as host.cpp's
    plans get them; under the interpreter with the signature Triton's own specialization gives each
    argument (what CompiledKernel.src.signature holds when compiled)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    out = []
    for kernel, fn, grid, args, constexprs, options in launches:
        if kernel is not None:
            out.append(plans.LaunchRecord.from_compiled(kernel, grid, args, constexprs))
            continue
        sig = [native_specialize_impl(BaseBackend, a, False, True, True)[0] for a in args]
        out.append(plans.LaunchRecord(sig + ["constexpr"] * len(constexprs), tuple(args) + tuple(constexprs.values()),
                                      tuple(grid), options[0], function=id(fn)))
    return out


def _check_replay(plan, records, inputs, allocs):
    """Rebuild each launch's parameters from the plan with the recorded run's own buffers (what
    host.cpp does with a new call's buffers) and compare them with the arguments Triton got."""
    alloc_specs, persistent, launches = plan
    device = next(t.device for t in inputs if t is not None)
    allocs = [a for a in allocs if a.device == device]
    assert len(allocs) == len(alloc_specs)
    ptrs = [0 if t is None else t.data_ptr() for t in inputs] + [a.data_ptr() for a in allocs] + \
        [p.data_ptr() for p in persistent]
    assert len(launches) == len(records)
    for (fn, gx, gy, gz, block, shared, template, offsets, patches, cluster), rec in zip(launches, records):
        assert (gx, gy, gz) == tuple(rec.grid) + (1,) * (3 - len(rec.grid)) and block == 32 * rec.num_warps
        assert cluster == tuple(rec.cluster) and shared == rec.shared
        buf = bytearray(template)
        for off, slot, byte_offset, _ in patches:
            struct.pack_into("<Q", buf, off, ptrs[slot] + byte_offset)
        params = [(ty, a) for ty, a in zip(rec.signature, rec.args) if ty != "constexpr"]
        assert len(offsets) == len(params) + rec.null_pointers  # + Triton's global and profile scratch
        for (ty, a), off in zip(params, offsets):
            if ty.startswith("*"):
                assert struct.unpack_from("<Q", buf, off)[0] == (0 if a is None else a.data_ptr()) and off % 8 == 0
            else:
                fmt = plans._SCALAR[ty]
                assert off % struct.calcsize(fmt) == 0
                assert struct.unpack_from(fmt, buf, off)[0] == struct.unpack(fmt, struct.pack(fmt, a))[0]
        for off in offsets[len(params):]:
            assert struct.unpack_from("<Q", buf, off)[0] == 0


def _record(fn, inputs, n_out=3):
    with plans.Recorder() as rec:
        outs = fn()
    assert rec.watch.other == []
    records = _records(rec.launches)
    plan = plans.build_plan(records, inputs, rec.watch.allocs, list(zip(range(1, n_out + 1), outs[:n_out])))
    _check_replay(plan, records, inputs, rec.watch.allocs)
    return plan, outs


def _roles(plan):
    return [spec[0] for spec in plan[0]]


def test_record_row_norm_forward_and_backward():
    x = torch.randn(5, 33, device=DEVICE)
    w, b = torch.randn(33, device=DEVICE), torch.randn(33, device=DEVICE)
    tb.row_norm_fwd(x, w, b, 1e-5, False, "silu", True)  # the first run compiles and caches
    plan, (y, mean, rstd) = _record(lambda: tb.row_norm_fwd(x, w, b, 1e-5, False, "silu", True), (x, w, b))
    assert sorted(r for r in _roles(plan) if r) == [1, 2, 3] and plan[1] == ()
    # every pointer the kernel got is a slot: x, w, b are inputs 0-2, y/mean/rstd the run's buffers
    (_, _, _, _, _, _, _, _, patches, cluster), = plan[2]
    assert cluster == (0, 0, 0)  # a plain launch
    assert {slot for _, slot, _, _ in patches} == {0, 1, 2, 3, 4, 5}
    dy = torch.randn(5, 33, device=DEVICE)
    tb.row_norm_bwd(dy, x, w, mean, rstd, False, w.dtype, b.dtype, bias=b, activation="silu")
    plan, _ = _record(lambda: tb.row_norm_bwd(dy, x, w, mean, rstd, False, w.dtype, b.dtype, bias=b,
                                              activation="silu"), (dy, x, w, b, mean, rstd))
    assert len(plan[2]) == 2  # the backward, then the fixed-order sum of the weight-gradient partials
    # the weight-gradient partials are one temporary: dweight's and dbias's halves of a [2, rows, N] buffer
    temps = [buf for buf in plan[0] if buf[0] == 0]
    assert len(temps) == 1 and temps[0][2][0] == 2 and temps[0][2][2] == 33, temps


def test_record_fused_forward_and_backward():
    """The fused epilogues record as the plain call does; the amax (accumulated by the kernels into
    a zeroed buffer) is a zeroed output buffer of the plan, handed out as a 0-dim float32."""
    x, r = torch.randn(6, 32, device=DEVICE), torch.randn(6, 32, device=DEVICE)
    w = torch.randn(32, device=DEVICE)

    def fwd():
        y, mean, rstd, h, amax = tb.row_norm_fwd_fused(x, w, None, 1e-6, True, residual=r, store_h=True,
                                                       weight_offset=1.0, out_dtype=torch.float8_e4m3fn,
                                                       out_scale=2.0, want_amax=True)
        return y, mean, rstd, h, amax

    fwd()
    plan, (y, mean, rstd, h, amax) = _record(fwd, (x, w, None, r, None), n_out=5)
    specs = {spec[0]: spec for spec in plan[0] if spec[0]}
    assert sorted(specs) == [1, 3, 4, 5] and mean is None
    assert specs[5][4] is True and not any(spec[4] for role, spec in specs.items() if role != 5)
    dy, dh = torch.randn(6, 32, device=DEVICE), torch.randn(6, 32, device=DEVICE)

    def bwd():
        dx, dres, dw, db = tb.row_norm_bwd_fused(dy, h, w, None, rstd, True, w.dtype, None, weight_offset=1.0, dh=dh,
                                                 dx_dtype=torch.float32, dres_dtype=torch.bfloat16)
        return dx, dw, db, dres

    bwd()
    plan, _ = _record(bwd, (dy, h, w, None, None, rstd, dh), n_out=4)
    assert sorted(r for r in _roles(plan) if r) == [1, 2, 4]  # dx, dweight, dresidual (RMSNorm: no dbias)


def test_record_modulated_and_gated_runs():
    """The callbacks host.cpp makes for the modulation and the gate (plans.row_fwd / row_bwd) give the
    float64 oracle's values; the tables and the gate are inputs of the recorded plans (forward slots
    5-7, backward 7-9: never buffers a plan keeps), and dscale, dshift, dgate outputs (roles 5-7)."""
    from normkit import reference as ref

    B, T, N = 2, 3, 32
    x, w, b = torch.randn(B, T, N, device=DEVICE), torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    emb = torch.randn(B, 3 * N, device=DEVICE)
    sc, sh = emb[:, N:2 * N], emb[:, :N]  # chunks of diffusers' embedding, rows 3N apart
    fwd_args = (1, 1e-5, False, "silu", True, False, None, 0.0, None, None, False)

    def fwd():
        return plans.row_fwd(x, w, b, None, None, sc, sh, None, *fwd_args, False)[:5]

    fwd()
    plan, (y, mean, rstd, h, amax) = _record(fwd, (x, w, b, None, None, sc, sh, None), n_out=5)
    assert {slot for launch in plan[2] for _, slot, _, _ in launch[8]} >= {0, 1, 2, 5, 6} and plan[1] == ()
    y64, _, _ = ref.layer_norm(x, (N,), w, b, 1e-5, "silu", scale=sc, shift=sh)
    assert ref.rel_err(y, y64) < 1e-5
    dy = torch.randn(B, T, N, device=DEVICE)
    extra = (sc, sh, (torch.float32, torch.float32), None, False)

    def bwd():
        return plans.row_bwd(dy, None, x, w, b, mean, rstd, 1, False, "silu", (True, False), (w.dtype, b.dtype), 0.0,
                             x.dtype, None, False, *extra)[:7]

    bwd()
    plan, grads = _record(bwd, (dy, x, w, b, mean, rstd, None, sc, sh, None), n_out=7)
    assert sorted(r for r in _roles(plan) if r) == [1, 2, 3, 5, 6]  # dx, dweight, dbias, dscale, dshift
    want = ref.layer_norm_backward(dy, x, (N,), w, b, 1e-5, "silu", scale=sc, shift=sh)
    for got, exp in zip((grads[0], grads[1], grads[2], grads[4], grads[5]), want, strict=True):
        assert got.shape == exp.shape and ref.rel_err(got, exp) < 1e-4
    # the gate: RMSNorm of x * silu(gate), weights per group (per-head rows)
    xg, g, wg = torch.randn(B, T, 2, N // 2, device=DEVICE), torch.randn(B, T, 2, N // 2, device=DEVICE), \
        torch.randn(2, N // 2, device=DEVICE)
    gate_args = (1, 1e-6, True, None, True, False, None, 0.0, None, None, False)

    def gfwd():
        return plans.row_fwd(xg, wg, None, None, None, None, None, g, *gate_args, False)[:5]

    gfwd()
    plan, (y, _, rstd, _, _) = _record(gfwd, (xg, wg, None, None, None, None, None, g), n_out=5)
    assert 7 in {slot for launch in plan[2] for _, slot, _, _ in launch[8]}
    y64, _ = ref.rms_norm(xg, (N // 2,), wg, 1e-6, gate=g)
    assert ref.rel_err(y, y64) < 1e-5
    dyg = torch.randn_like(xg)

    def gbwd():
        return plans.row_bwd(dyg, None, xg, wg, None, None, rstd, 1, True, None, (True, False), (wg.dtype, None),
                             0.0, xg.dtype, None, False, None, None, (None, None), g, True)[:7]

    gbwd()
    plan, grads = _record(gbwd, (dyg, xg, wg, None, None, rstd, None, None, None, g), n_out=7)
    assert sorted(r for r in _roles(plan) if r) == [1, 2, 7]  # dx, dweight, dgate
    want = ref.rms_norm_backward(dyg, xg, (N // 2,), wg, 1e-6, gate=g)
    for got, exp in zip((grads[0], grads[1], grads[6]), want, strict=True):
        assert got.shape == exp.shape and ref.rel_err(got, exp) < 1e-4


def test_record_rms_inference_and_strided_rows():
    x = torch.randn(6, 40, device=DEVICE)[:, :32]  # rows 40 apart
    w = torch.randn(32, device=DEVICE)
    tb.row_norm_fwd(x, w, None, 1e-6, True, None, False)
    plan, (y, mean, rstd) = _record(lambda: tb.row_norm_fwd(x, w, None, 1e-6, True, None, False), (x, w, None))
    # y is the output; rstd a temporary the kernel stores and nobody returns (stored anyway: the
    # kernel without the statistics' stores rounds some rows differently, see row_norm_fwd_fused)
    assert mean is None and rstd is None and _roles(plan) == [1, 0]


@pytest.mark.parametrize("channels_last", [False, True])
def test_record_group_norm(channels_last):
    x = torch.randn(2, 8, 4, 4, device=DEVICE)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE)
    from normkit._layout import bcs

    x3 = bcs(x, channels_last)
    tb.group_norm_fwd(x3, 4, w, b, 1e-5, "mish")
    plan, (y3, mean, rstd) = _record(lambda: tb.group_norm_fwd(x3, 4, w, b, 1e-5, "mish"), (x3, w, b))
    dy3 = bcs(torch.randn_like(x), channels_last)
    tb.group_norm_bwd(dy3, x3, 4, w, b, mean, rstd, "mish", w.dtype, b.dtype)
    plan, _ = _record(lambda: tb.group_norm_bwd(dy3, x3, 4, w, b, mean, rstd, "mish", w.dtype, b.dtype),
                      (dy3, x3, w, b, mean, rstd))
    assert len(plan[2]) >= 2


# launches (forward, backward) of each forced staged path: stats, finalize, apply (and col_sum)
STAGED_LAUNCHES = {"staged-tiles": ((3, 4), (3, 4)), "staged": ((3, 4), (3, 4))}


@pytest.mark.parametrize("path", list(STAGED_LAUNCHES))
def test_record_group_norm_staged(path, monkeypatch):
    """The staged paths record as plans (allocations and launches only, no persistent state)."""
    from test_group_norm import FORCED_PATHS, channels_last

    from normkit.backends.triton import clear_caches, configs
    from normkit._layout import bcs
    for name, value in FORCED_PATHS[path].items():
        monkeypatch.setattr(configs, name, value)
    clear_caches()
    try:
        x3 = bcs(channels_last(torch.randn(3, 12, 5, 7, device=DEVICE)), True)
        w, b = torch.randn(12, device=DEVICE), torch.randn(12, device=DEVICE)
        dy3 = torch.randn_like(x3)
        want = STAGED_LAUNCHES[path][DEVICE != "cpu"]
        tb.group_norm_fwd(x3, 4, w, b, 1e-5, None)
        plan, (y3, mean, rstd) = _record(lambda: tb.group_norm_fwd(x3, 4, w, b, 1e-5, None), (x3, w, b))
        assert len(plan[2]) == want[0] and not plan[1]
        tb.group_norm_bwd(dy3, x3, 4, w, b, mean, rstd, None, w.dtype, b.dtype)
        plan, _ = _record(lambda: tb.group_norm_bwd(dy3, x3, 4, w, b, mean, rstd, None, w.dtype, b.dtype),
                          (dy3, x3, w, b, mean, rstd))
        assert len(plan[2]) == want[1] and not plan[1]
    finally:
        monkeypatch.undo()
        clear_caches()


def test_a_run_that_writes_memory_is_not_replayable():
    x = torch.randn(4, 16)
    with plans.Recorder() as rec:
        y = torch.empty_like(x).zero_()  # what a replay would not redo
    plan, why = rec.plan((x,), [(1, y)])
    assert plan is None and "zero_" in why


def test_a_second_recording_at_once_records_nothing():
    held = threading.Event()
    release = threading.Event()

    def other():
        with plans.Recorder():
            held.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    held.wait(10)
    try:
        with plans.Recorder() as rec:
            y = torch.empty(3)
        assert rec.plan((y,), []) == (None, None)
    finally:
        release.set()
        t.join()


def test_pointer_slots():
    x, w = torch.randn(4, 8), torch.randn(8)
    state = torch.zeros(16, dtype=torch.int32)  # backend state made before the run: kept, passed as is
    with plans.Recorder() as rec:
        y = torch.empty(4, 8)
        part = torch.empty(2, 8)
    allocs = rec.watch.allocs
    persistent = []
    assert plans.pointer_slot(x, (x, w), allocs, persistent) == (0, 0)
    assert plans.pointer_slot(x.view(32), (x, w), allocs, persistent) == (0, 0)
    assert plans.pointer_slot(y, (x, w), allocs, persistent) == (2, 0)
    assert plans.pointer_slot(part[1], (x, w), allocs, persistent) == (3, 32)  # byte offset into a buffer
    assert plans.pointer_slot(state, (x, w), allocs, persistent) == (4, 0) and persistent == [state]
    assert plans.pointer_slot(state, (x, w), allocs, persistent) == (4, 0) and len(persistent) == 1
    assert plans.pointer_slot(None, (x, w), allocs, persistent) == (-1, 0)
    with pytest.raises(plans.NotReplayable, match="view into an input"):
        plans.pointer_slot(x[1:], (x, w), allocs, persistent)


def test_parameter_packing():
    t = torch.randn(4)
    template, offsets, pointers = plans.pack_params(
        ["*fp32", "constexpr", "i32", "i64", "fp32", "*bf16", "constexpr", "u64", "fp64"],
        (t, None, 7, 2**40, 0.5, t, 1, 2**63, 0.25))
    # pointer 0, i32 8, i64 16, fp32 24, pointer 32, u64 40, fp64 48, scratch 56 and 64
    assert offsets == (0, 8, 16, 24, 32, 40, 48, 56, 64)
    assert struct.unpack_from("<i", template, 8)[0] == 7
    assert struct.unpack_from("<q", template, 16)[0] == 2**40 and struct.unpack_from("<f", template, 24)[0] == 0.5
    assert struct.unpack_from("<Qd", template, 40) == (2**63, 0.25)
    assert [off for off, _ in pointers] == [0, 32]
    for sig, args in ((["i1"], (True,)), (["fp16"], (0.5,)), ([("*fp32", "i32")], ((t, 1),)), (["i32"], (0.5,)),
                      (["*fp32"], (5,)), (["i32", "i32"], (1,))):
        with pytest.raises(plans.NotReplayable):
            plans.pack_params(sig, args)


def test_launch_attributes_it_does_not_replay():
    t = torch.randn(4)
    for extra in ({"num_ctas": 2}, {"cooperative": True}, {"pdl": True}, {"scratch": 256}, {"shared": 300_000},
                  {"cluster": (3, 1, 1)}, {"cluster": (32, 1, 1), "grid": (32,)}, {"cluster": (0, 1, 1)}):
        rec = plans.LaunchRecord(["*fp32"], (t,), extra.pop("grid", (4,)), 4, **extra)
        with pytest.raises(plans.NotReplayable):
            plans.build_plan([rec], (t,), [], [])


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_record_cuda_cluster_launches(direction, monkeypatch):
    """The CUDA backend's cluster kernels (what the Triton backend routes wide 16-bit rows to on
    sm_90) become plan launches with a cluster shape: cluster.launch_fwd / launch_bwd run through
    driver.Kernel.launch and driver.launch (the driver calls stood in for), and the plan must give
    back every argument the KernelSpec takes, with no Triton scratch pointers."""
    from types import SimpleNamespace

    from normkit.backends.cuda import cluster as cc, configs as cfg, driver, kernels as ck
    launched = []
    ok = SimpleNamespace(CUDA_SUCCESS=0)
    monkeypatch.setattr(driver, "bindings", lambda: SimpleNamespace(
        CUresult=ok, cuLaunchKernelEx=lambda config, *a: launched.append(config) or (0,),
        cuLaunchKernel=lambda *a: pytest.fail("a cluster kernel launched without its cluster")))
    monkeypatch.setattr(driver, "launch_config", lambda grid, block, smem, _, cluster: (grid, block, smem, cluster))
    monkeypatch.setattr(cc, "_use_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: SimpleNamespace(cuda_stream=0))
    M, N = 5, 131072
    plan = cfg.plan_cluster(direction, N, 2)
    assert plan.cluster == (8 if direction == "fwd" else 16)  # the backward's is a non-portable size
    kernel = driver.Kernel(ck.row_cluster(direction, torch.bfloat16, torch.bfloat16, None, False, plan, True), 0,
                           None, 0xC0FFEE, smem_granted=plan.smem, _nonportable=True)
    kernel.__dict__["static_smem"] = 0  # the opt-ins the first (Python) run made stay on the function
    prepared = cc.Prepared(plan, kernel, clusters=3)
    x, w, b, dy = (torch.randn(s, dtype=torch.bfloat16) for s in ((M, N), (N,), (N,), (M, N)))
    mean, rstd = torch.randn(M), torch.rand(M)
    with plans.Recorder() as rec:
        if direction == "fwd":
            y, mean, rstd = torch.empty(M, N, dtype=x.dtype), torch.empty(M), torch.empty(M)
            cc.launch_fwd(prepared, x, y, w, b, mean, rstd, 1e-5)
            inputs, outs = (x, w, b), (y, mean, rstd)
        else:
            dx, dw_part, db_part = torch.empty_like(x), torch.empty(3, N), torch.empty(3, N)
            assert cc.launch_bwd(prepared, dy, x, w, b, mean, rstd, dx, dw_part, db_part) == 3
            inputs, outs = (dy, x, w, b, mean, rstd), (dx,)
    grid = (3 * plan.cluster, 1, 1)
    assert launched == [(grid, (plan.threads, 1, 1), plan.smem, (plan.cluster, 1, 1))]
    (_, name, note), = rec.launches
    records = [plans.LaunchRecord.from_cuda(*note)]
    assert records[0].null_pointers == 0 and records[0].cluster == (plan.cluster, 1, 1)
    built = plans.build_plan(records, inputs, rec.watch.allocs, list(zip(range(1, len(outs) + 1), outs)))
    _check_replay(built, records, inputs, rec.watch.allocs)
    (fn, *grid_, threads, shared, _, offsets, patches, cluster), = built[2]
    assert (fn, tuple(grid_), threads, shared, cluster) == (0xC0FFEE, grid, plan.threads, plan.smem,
                                                            (plan.cluster, 1, 1))
    assert len(offsets) == len(kernel.spec.params)
    # the Recorder's own plan: the same launch
    again, why = rec.plan(inputs, list(zip(range(1, len(outs) + 1), outs)))
    assert why is None and again[2] == built[2]


def test_record_gn_cluster_launch_of_one_cta(monkeypatch):
    """A GroupNorm cluster kernel over groups that fit one CTA is still a cluster launch (of one CTA):
    the plan keeps the cluster shape (1, 1, 1), which host.cpp launches with cuLaunchKernelEx, since the
    kernel's cluster instructions are illegal in a plain launch (session 12, H200: replayed plain, it
    stopped with an illegal instruction); a plain launch is (0, 0, 0)."""
    from types import SimpleNamespace

    from normkit.backends.cuda import cluster as cc, configs as cfg, driver, kernels as ck
    monkeypatch.setattr(driver, "bindings", lambda: SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=0), cuLaunchKernelEx=lambda config, *a: (0,),
        cuLaunchKernel=lambda *a: pytest.fail("a cluster kernel launched without its cluster")))
    monkeypatch.setattr(driver, "launch_config", lambda grid, block, smem, _, cluster: (grid, block, smem, cluster))
    monkeypatch.setattr(cc, "_use_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: SimpleNamespace(cuda_stream=0))
    B, C, S, G = 2, 64, 64, 32
    plan = cfg.plan_gn_cluster("fwd", C // G, S, 2)
    assert plan.cluster == 1
    kernel = driver.Kernel(ck.gn_cluster("fwd", torch.bfloat16, torch.float32, None, plan), 0, None, 0xC0FFEE,
                           smem_granted=plan.smem)
    kernel.__dict__["static_smem"] = 0
    x, w, b = torch.randn(B, C, S, dtype=torch.bfloat16), torch.randn(C), torch.randn(C)
    with plans.Recorder() as rec:
        y, mean, rstd = torch.empty_like(x), torch.empty(B, G), torch.empty(B, G)
        cc.launch_gn_fwd(cc.Prepared(plan, kernel, clusters=8), x, y, w, b, mean, rstd, G, 1e-5)
    (_, name, note), = rec.launches
    record = plans.LaunchRecord.from_cuda(*note)
    assert record.cluster == (1, 1, 1)
    built = plans.build_plan([record], (x, w, b), rec.watch.allocs, [(1, y), (2, mean), (3, rstd)])
    assert built[2][0][-1] == (1, 1, 1)
    assert plans.LaunchRecord(["*fp32"], (x,), (4,), 4).cluster == (0, 0, 0)


def test_cuda_launches_without_arguments_are_not_replayable():
    from normkit.backends.triton import launch
    with plans.Recorder() as rec:
        launch.note_foreign_launch("some_kernel")
    plan, why = rec.plan((torch.randn(2),), [])
    assert plan is None and "some_kernel" in why


# ----------------------------------------------------------------------------- the package

def test_pending_host_path_ignores_cpu_tensors():
    fast = _host._Pending()
    assert fast.row_norm(torch.randn(2, 4), 4, None, None, 1e-5, False, None, None) is None
    assert fast.group_norm(torch.randn(2, 4, 3), 2, None, None, 1e-5, None, None) is None


def test_switched_off_by_environment():
    code = "import normkit._host as h, normkit.info as i; print(h.fast is None); print(i.host_path_line())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, NORMKIT_HOST="0"), capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == "True" and "NORMKIT_HOST=0" in out[1]


def test_info_says_which_host_path():
    from normkit.info import host_path_line

    line = host_path_line()
    assert ("C++ host path: active" in line) if HAS_CUDA else ("no CUDA device" in line)


# ----------------------------------------------------------------------------- the ops' dispatcher kernels

def test_op_kernels_are_registered_when_the_extension_loads(ext):
    for name in _host.OPS:
        for key in ("CUDA", "AutogradCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"normkit::{name}", key), (name, key)
    # the schemas stay those of normkit._library (one definition)
    assert "Tensor? residual" in str(torch.ops.normkit.row_norm_fused_fwd.default._schema)


def _op_row(x, ndim=1, w=None, b=None, eps=1e-5, rms=False, act=None, backend=None):
    return [x, ndim, w, b, eps, rms, act, backend]


def test_op_kernel_reads_calls_as_the_eager_path_does(ext):
    x, w, b = torch.randn(4, 6, 8), torch.randn(8), torch.randn(8)
    key = ext._parse_op("row_norm_fwd", *_op_row(x, 1, w, b, 1e-5))
    eager = ext._parse_row(x, 8, w, b, 1e-5, False, None, None)[-1]
    # the same key but for store_stats (position 11): the op always returns mean and rstd
    assert key[:11] == eager[:11] and key[12:] == eager[12:] and (key[11], eager[11]) == (1, 0)
    assert ext._parse_op("row_norm_fwd", *_op_row(x, 2, None, None, 0.0, True, "silu", "triton")) is not None
    assert ext._parse_op("row_norm_fwd", *_op_row(x[:, ::2, :], 1, w)) is not None  # strided rows: no copy
    r = torch.randn(4, 6, 8)
    fused = _op_row(x, 1, w, None, 1e-6, True) + [r, torch.float32, 1.0, None, None, None, True]
    assert ext._parse_op("row_norm_fused_fwd", *fused) is not None
    # the modulation and the gate: the eager path's keys (but for store_stats, position 11)
    sc, sh, g = torch.randn(4, 8), torch.randn(4, 1, 8), torch.randn(4, 6, 8)
    for extra, kw in (([sc, sh, None], dict(scale=sc, shift=sh)), ([None, None, g], dict(gate=g, rms=True))):
        rms = kw.pop("rms", False)
        op = ext._parse_op("row_norm_fused_fwd", *(_op_row(x, 1, w, None, 1e-5, rms) +
                                                  [None, None, 0.0, None, None, None, False] + extra))
        eager = ext._parse_row(*_fused(x, 8, w, None, rms=rms, autocast=False, **kw))[-1]
        assert op[:11] == eager[:11] and op[12:] == eager[12:] and (op[11], eager[11]) == (1, 0)
    gn = [torch.randn(2, 8, 3, 3), 4, torch.randn(8), torch.randn(8), 1e-5, "mish", None]
    assert ext._parse_op("group_norm_fwd", *gn) == ext._parse_gn(*gn)[-1]
    cl = torch.randn(2, 8, 3, 3).to(memory_format=torch.channels_last)
    assert ext._parse_op("group_norm_fwd", cl, 4, None, None, 1e-5, None, None) is not None


@pytest.mark.parametrize("case", ["float64", "backend torch", "backend cuda", "bad activation", "ndim 0",
                                  "rows need three strides", "weight shape", "residual dtype without residual",
                                  "fp8 without scale", "both scales", "per-token mod_scale", "gate with mod_shift",
                                  "an argument the kernels do not read", "gn groups", "gn layout", "gn float64"])
def test_op_kernel_leaves_calls_to_python(ext, case):
    x, w = torch.randn(4, 6, 8), torch.randn(8)
    name, args = "row_norm_fwd", _op_row(x, 1, w)
    fused_tail = [None, None, 0.0, None, None, None, False]
    if case == "float64":
        args[0] = x.double()
    elif case == "backend torch":
        args[7] = "torch"
    elif case == "backend cuda":
        args[7] = "cuda"
    elif case == "bad activation":
        args[6] = "swish"
    elif case == "ndim 0":
        args[1] = 0
    elif case == "rows need three strides":  # the Python path copies
        args[0] = torch.randn(4, 6, 2, 8)[:, :5, :, :].permute(2, 0, 1, 3)
    elif case == "weight shape":
        args[2] = torch.randn(4)
    elif case == "residual dtype without residual":
        name, args = "row_norm_fused_fwd", args + fused_tail
        args[9] = torch.float32
    elif case == "fp8 without scale":
        name, args = "row_norm_fused_fwd", args + fused_tail
        args[11] = torch.float8_e4m3fn
    elif case == "both scales":
        name, args = "row_norm_fused_fwd", args + fused_tail
        args[11], args[12], args[13] = torch.float8_e4m3fn, torch.ones(()), 2.0
    elif case == "per-token mod_scale":
        name, args = "row_norm_fused_fwd", args + fused_tail + [x[:1], None, None]
    elif case == "gate with mod_shift":
        name, args = "row_norm_fused_fwd", args + fused_tail + [None, torch.randn(4, 8), x]
    elif case == "an argument the kernels do not read":  # an option added to normkit._op_args later
        from normkit._op_args import ROW_FUSED_FWD

        args = args + fused_tail + [None, None, None]
        assert ext._parse_op("row_norm_fused_fwd", *args, None) is not None
        ext._set_op_args(ROW_FUSED_FWD.op, ROW_FUSED_FWD.names + ("new_option",))
        try:
            assert ext._parse_op("row_norm_fused_fwd", *args, None) is not None  # None: as without it
            assert ext._parse_op("row_norm_fused_fwd", *args, torch.randn(4, 8)) is None
        finally:
            ext._set_op_args(ROW_FUSED_FWD.op, ROW_FUSED_FWD.names)
        return
    elif case.startswith("gn"):
        name = "group_norm_fwd"
        xg = torch.randn(2, 6, 4, 4)
        args = [xg, 4 if case == "gn groups" else 3, None, None, 1e-5, None, None]
        if case == "gn layout":
            args[0] = xg[:, :, ::2]
        elif case == "gn float64":
            args[0] = xg.double()
    assert ext._parse_op(name, *args) is None


@pytest.mark.parametrize("case", ["served", "float64", "backend torch", "stats float64", "stats strided",
                                  "stats count", "dy shape", "dweight without weight", "rms with bias",
                                  "gate with dh", "dscale without mod_scale", "an argument the kernels do not read",
                                  "gn served", "gn groups", "gn stats", "gn dweight without weight", "gn layout"])
def test_backward_op_kernels_leave_calls_to_python(ext, case):
    """What the backward ops' kernels leave to the op's Python implementation (which raises, copies
    or runs another backend): each case is one change to a call they serve."""
    from normkit._op_args import ROW_BWD, ROW_FUSED_BWD

    x, w, dy = torch.randn(4, 6, 8), torch.randn(8), torch.randn(4, 6, 8)
    row = dict(dy=dy, x=x, normalized_ndim=1, weight=w, bias=None, mean=torch.randn(4, 6), rstd=torch.rand(4, 6),
               rms=False, activation=None, dweight_dtype=torch.float32, dbias_dtype=torch.float32, backend=None)
    fused = dict(weight_offset=0.0, dh=None, dx_dtype=torch.float32, dres_dtype=None)
    xg = torch.randn(2, 6, 4, 4)
    gn = [torch.randn_like(xg), xg, 3, torch.randn(6), None, torch.randn(2, 3), torch.rand(2, 3), None,
          torch.float32, torch.float32, None]
    name, args = ("group_norm_bwd", gn) if case.startswith("gn") else ("row_norm_bwd", None)
    edits = {"float64": dict(x=x.double(), dy=dy.double()), "backend torch": dict(backend="torch"),
             "stats float64": dict(rstd=torch.rand(4, 6, dtype=torch.float64)),
             "stats strided": dict(mean=torch.randn(6, 4).t()), "stats count": dict(rstd=torch.rand(4, 5)),
             "dy shape": dict(dy=torch.randn(4, 1, 8)), "dweight without weight": dict(weight=None),
             "rms with bias": dict(rms=True, bias=torch.randn(8))}
    if case == "served":
        assert ext._parse_op(name, *ROW_BWD.call(**row)) is not None
        assert ext._parse_op("row_norm_fused_bwd", *ROW_FUSED_BWD.call(**row, **fused)) is not None
        return
    if case in edits:
        args = ROW_BWD.call(**dict(row, **edits[case]))
    elif case == "gate with dh":
        name, args = "row_norm_fused_bwd", ROW_FUSED_BWD.call(**dict(row, rms=True), **dict(fused, dh=dy), gate=x)
    elif case == "dscale without mod_scale":
        name, args = "row_norm_fused_bwd", ROW_FUSED_BWD.call(**row, **fused, dscale_dtype=torch.float32)
    elif case == "an argument the kernels do not read":  # an option added to normkit._op_args later
        name, args = "row_norm_fused_bwd", ROW_FUSED_BWD.call(**row, **fused)
        ext._set_op_args(ROW_FUSED_BWD.op, ROW_FUSED_BWD.names + ("new_option",))
        try:
            assert ext._parse_op(name, *args, None) is not None  # None: as without it
            assert ext._parse_op(name, *args, torch.randn(4, 8)) is None
        finally:
            ext._set_op_args(ROW_FUSED_BWD.op, ROW_FUSED_BWD.names)
        return
    elif case == "gn served":
        assert ext._parse_op(name, *args) is not None
        cl = xg.to(memory_format=torch.channels_last)
        assert ext._parse_op(name, *([args[0], cl] + args[2:])) is not None  # dy in another layout: copied
        return
    elif case == "gn groups":
        args[2] = 4
    elif case == "gn stats":
        args[6] = torch.rand(2, 2)
    elif case == "gn dweight without weight":
        args[3] = None
    elif case == "gn layout":
        args[1] = xg[:, :, ::2]
        args[0] = torch.randn_like(args[1])
    assert ext._parse_op(name, *args) is None


@pytest.mark.parametrize("op", ["group_norm_fwd", "group_norm_bwd"])
def test_group_norm_op_kernels_read_arguments_by_name(ext, op):
    """The GroupNorm op kernels take their argument positions from normkit._op_args at load, as the row
    ops' do: a reordered table reads the same call the same way, an argument they do not read must be
    None to be served, and a table without one they read fails the load."""
    from normkit._op_args import OPS

    A = OPS[op]
    xg = torch.randn(2, 6, 4, 4)
    call = dict(x=xg, num_groups=3, weight=torch.randn(6), bias=torch.randn(6), eps=1e-5, activation="silu",
                backend=None)
    if op == "group_norm_bwd":
        call = dict(call, dy=torch.randn_like(xg), mean=torch.randn(2, 3), rstd=torch.rand(2, 3),
                    dweight_dtype=torch.float32, dbias_dtype=torch.float32)
    served = ext._parse_op(op, *A.call(**call))
    assert served is not None
    if op == "group_norm_bwd":  # eps (the forward's, which the plans do not need) given, None or left out
        assert ext._parse_op(op, *A.call(**dict(call, eps=None))) == served
        assert ext._parse_op(op, *A.call(**call)[:-1]) == served
    reordered = tuple(reversed(A.names))
    try:
        ext._set_op_args(op, reordered)
        assert ext._parse_op(op, *(call[n] for n in reordered)) == served
        ext._set_op_args(op, A.names + ("new_option",))
        assert ext._parse_op(op, *A.call(**call), None) == served  # None: as without it
        assert ext._parse_op(op, *A.call(**call), torch.randn(2, 6)) is None
        with pytest.raises(RuntimeError, match=f"{op} has no argument num_groups"):
            ext._set_op_args(op, tuple(n if n != "num_groups" else "groups" for n in A.names))
    finally:
        ext._set_op_args(op, A.names)
    assert ext._parse_op(op, *A.call(**call)) == served
    with pytest.raises(RuntimeError, match="no op kernel reads"):
        ext._set_op_args("group_norm_fused_fwd", A.names)


@pytest.fixture
def cpu_kernels(ext):
    """The same kernels registered for CPU tensors, which they never serve: every call takes the
    op's Python implementation (or its Python autograd) through them."""
    handle = ext._register_ops(_host.op_impls(), "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("normkit::row_norm_fwd", "CPU")
    yield ext
    del handle
    _host.dispatch_changed()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("normkit::row_norm_fwd", "CPU")


def _op_counts(ext):
    s = ext._stats()
    return {k: s[k] for k in ("op_served", "op_python", "op_autograd_python")}


def test_declined_calls_run_the_ops_python_implementation(cpu_kernels):
    import normkit

    ext = cpu_kernels
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    ops = torch.ops.normkit
    before = _op_counts(ext)
    with torch.no_grad():
        y = ops.row_norm_fwd.default(x, 1, w, b, 1e-5, False, None, "torch")
    ref = torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5)
    torch.testing.assert_close(y[0], ref)
    xg = torch.randn(2, 4, 3, 3)
    g = ops.group_norm_fwd.default(xg, 2, None, None, 1e-5, None, "torch")
    torch.testing.assert_close(g[0], torch.nn.functional.group_norm(xg, 2, eps=1e-5))
    after = _op_counts(ext)
    assert after["op_python"] - before["op_python"] == 2 and after["op_served"] == before["op_served"]
    # with grad: the op's Python autograd kernel, then the backward op (grad mode off) through the C++ kernels
    wl = w.clone().requires_grad_()
    y = ops.row_norm_fwd.default(x, 1, wl, None, 1e-5, True, None, "torch")[0]
    y.sum().backward()
    ref_w = w.clone().requires_grad_()
    torch.nn.functional.rms_norm(x, (8,), ref_w, 1e-5).sum().backward()
    torch.testing.assert_close(wl.grad, ref_w.grad)
    last = _op_counts(ext)
    assert last["op_autograd_python"] - after["op_autograd_python"] == 1
    assert last["op_python"] - after["op_python"] == 2  # the forward below autograd, and row_norm_bwd
    # compiled: Inductor's code calls the op through the dispatcher (the kernels, then Python here)
    torch._dynamo.reset()
    f = torch.compile(lambda t: normkit.rms_norm(t, (8,), w, 1e-6, backend="torch") * 2, fullgraph=True)
    torch.testing.assert_close(f(x), torch.nn.functional.rms_norm(x, (8,), w, 1e-6) * 2)
    assert _op_counts(ext)["op_python"] > last["op_python"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the Triton interpreter; on a GPU "
                    "tests/test_host_gpu.py calls the same ops with plans")
def test_backward_ops_are_served_through_the_autograd_nodes_core(cpu_calls, cpu_kernels):
    """The backward ops' kernels read the op's arguments and run the autograd nodes' core (row_backward,
    gn_backward): every call served (op_served, no op_python), the op's Python implementation's
    outputs bit for bit, and the float64 oracle's gradients."""
    from helpers import backward_op_cases

    from normkit import reference as ref

    for name, (op, args, oracle) in backward_op_cases("cpu").items():
        with _host.python_path():
            want = op(*args)
        before = _op_counts(cpu_calls)
        got = op(*args)
        after = _op_counts(cpu_calls)
        assert {k: after[k] - before[k] for k in after} == {"op_served": 1, "op_python": 0,
                                                            "op_autograd_python": 0}, name
        for i, (a, e) in enumerate(zip(got, want, strict=True)):
            assert (a.dtype, a.shape, a.stride()) == (e.dtype, e.shape, e.stride()) and torch.equal(a, e), (name, i)
        for i, exp in oracle():
            assert ref.rel_err(got[i], exp) < (2e-2 if got[i].dtype == torch.bfloat16 else 1e-4), (name, i)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the Triton interpreter; on a GPU "
                    "tests/test_host_gpu.py compiles the same training step")
def test_compiled_training_calls_every_op_in_cpp(cpu_calls, cpu_kernels):
    """A torch.compile'd training step (Inductor's forward and backward graphs) of a LayerNorm + SiLU,
    an RMSNorm with a residual (prenorm) and a GroupNorm: every op call of the step, forward and
    backward, is served by the C++ kernels (none by the op's Python implementation or autograd), and
    the gradients are the eager Python path's, bit for bit."""
    from normkit import compile_fusion as cf

    C = 32
    g = torch.Generator().manual_seed(5)
    t = lambda *s: torch.randn(s, generator=g) * 0.8 + 0.2  # noqa: E731
    inputs = [t(2, 3, C), t(2, 3, C), t(C), t(C), t(2, 8, 3, 5), t(8)]

    def fn(x, r, w, b, xg, wg):
        y = normkit.layer_norm(x, (C,), w, b, activation="silu", backend="triton")
        z, h = normkit.rms_norm(x, (C,), w, 1e-6, residual=r, prenorm=True, backend="triton")
        q = normkit.group_norm(xg, 4, wg, None, backend="triton")
        return y, z, h, q

    def step(f):
        leaves = [v.clone().requires_grad_() for v in inputs]
        outs = f(*leaves)
        return list(torch.autograd.grad(outs, leaves, [(o.detach() * 0.7 + 0.3).cos() for o in outs]))

    with _host.python_path():
        want = step(fn)
    torch._dynamo.reset()
    with cf.policy("normkit"):
        f = torch.compile(fn, fullgraph=True)
        step(f)  # compiles
        before = _op_counts(cpu_calls)
        got = step(f)
        after = _op_counts(cpu_calls)
    torch._dynamo.reset()
    assert {k: after[k] - before[k] for k in after} == {"op_served": 6, "op_python": 0, "op_autograd_python": 0}
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e), i


def test_python_path_switches_the_op_kernels_off(ext):
    with _host.python_path():
        assert not ext._ops_enabled()
    assert ext._ops_enabled()
