"""The C++ host path on a GPU: every call it serves must give the Python path's results bit for bit
(the same kernels with the same configurations, launched from a recorded plan), forward and
backward, for every requires_grad subset, strided and misaligned rows, empty batches, in-place ops
on the output, double backward, side streams and CUDA graph capture. Each case runs three times:
the first call of a shape takes the Python host function, the second records its plan, the third
replays it."""
import pytest
import torch

import normkit
from normkit import _host
from normkit.backends.triton import configs

pytestmark = pytest.mark.gpu

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def fast():
    ext = _host.activate()
    assert ext is not None, _host.status
    return ext


def _replays():
    return _host.stats()["replays"]


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride(), what
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num()), what


def _grads(fn, inputs, wanted):
    """(outputs, grads of the wanted inputs) of one call on fresh leaves (clones keep the memory
    format; fn makes any strided view of them); each output's gradient is a function of it."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(i in wanted) for i, t in enumerate(inputs)]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    if not wanted:
        return outs, []
    diff = [o for o in outs if o.requires_grad]
    dys = [(o.detach().float() * 0.7 + 0.3).cos().to(o.dtype) for o in diff]
    return outs, list(torch.autograd.grad(diff, [leaves[i] for i in sorted(wanted)], dys))


def _check(fast, fn, inputs, wanted):
    """Three calls through the C++ path (Python run, record, replay) against the Python path; the
    number of plan replays they made."""
    with _host.python_path():
        ref = _grads(fn, inputs, wanted)
    before = _replays()
    for i in range(3):
        got = _grads(fn, inputs, wanted)
        assert len(got[0]) == len(ref[0]) and len(got[1]) == len(ref[1])
        for k, (o, r) in enumerate(zip(got[0], ref[0])):
            _same(o, r, f"output {k}, call {i}")
        for k, (g, r) in enumerate(zip(got[1], ref[1])):
            _same(g, r, f"grad {k}, call {i}")
    return _replays() - before


ROW_CASES = [
    # (x shape, normalized dims, dtype, weight dtype, affine, activation, rms)
    ((4, 4096), 1, bf16, bf16, "wb", None, False),
    ((3, 5, 768), 1, fp16, fp16, "wb", "silu", False),
    ((2, 3, 4, 8), 2, fp32, fp32, "w", None, True),
    ((7, 1000), 1, bf16, fp32, "wb", "gelu_tanh", False),
    # split rows (the plan keeps the exchange counters): fp32 LayerNorm at 256K runs Triton's split path
    # both ways on sm_90
    ((4, 262144), 1, fp32, fp32, "wb", None, False),
    # 16-bit rows from 64K run the CUDA backend's cluster kernels on sm_90 (tuned/sm_90.json "cuda"):
    # plan launches with a cluster shape (the LayerNorm backward's at 128K: 16 CTAs, a non-portable size);
    # RMSNorm's 64K forward runs Triton's looped kernel compiled for the width (its backward the clusters)
    ((4, 65536), 1, bf16, bf16, "wb", None, False),
    ((2, 65536), 1, bf16, bf16, "w", None, True),
    ((2, 131072), 1, bf16, bf16, "w", None, True),
    ((3, 131072), 1, fp16, fp32, "wb", None, False),
    ((5, 1), 1, fp32, fp32, "wb", None, False),
    ((33, 128), 1, fp16, fp16, "", None, True),
    ((1, 8192), 1, bf16, bf16, "w", "mish", True),
]


def _row_inputs(shape, ndim, dtype, wdtype, affine):
    x = torch.randn(shape, device="cuda", dtype=dtype) * 2 + 0.5
    pshape = shape[len(shape) - ndim:]
    w = torch.randn(pshape, device="cuda", dtype=wdtype) if "w" in affine else None
    b = torch.randn(pshape, device="cuda", dtype=wdtype) if "b" in affine else None
    return x, w, b


def _row_fn(ndim, act, rms, pshape):
    if rms:
        return lambda x, w, b: normkit.rms_norm(x, pshape, w, activation=act)
    return lambda x, w, b: normkit.layer_norm(x, pshape, w, b, activation=act)


@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: f"{'rms' if c[6] else 'ln'}-{'x'.join(map(str, c[0]))}-"
                         f"{str(c[2])[6:]}-{c[4] or 'noaffine'}-{c[5]}")
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_row_norm_matches_the_python_path(fast, case, grad):
    shape, ndim, dtype, wdtype, affine, act, rms = case
    x, w, b = _row_inputs(shape, ndim, dtype, wdtype, affine)
    fn = _row_fn(ndim, act, rms, shape[len(shape) - ndim:])
    wanted = {i for i, t in enumerate((x, w, b)) if t is not None} if grad else set()
    # the forward on the table's cluster route (sm_90)
    wide = x.element_size() == 2 and torch.cuda.get_device_capability() >= (9, 0) and \
        configs.row_config("fwd", shape[-1], 2, "sm_90", False, "rms" if rms else "ln").cuda
    if wide:
        _host.clear()  # the plans of this case's other test start afresh too
    failures = _host.stats()["record_failures"]
    replays = _check(fast, fn, (x, w, b), wanted)
    assert replays >= 1  # the third call replayed its plan(s)
    if wide:
        assert _cluster_launches(fn, (x, w, b)) >= 1, "the case was meant to run the cluster kernels"
        assert replays >= (2 if grad else 1) and _host.stats()["record_failures"] == failures, \
            f"the forward{' and backward' if grad else ''} should replay plans: {_host.stats()['last_failure']}"


def _cluster_launches(fn, inputs) -> int:
    """CUDA-backend (cluster) kernels one forward on the Python path launches."""
    from normkit._host import plans
    with _host.python_path(), torch.no_grad(), plans.Recorder() as rec:
        fn(*inputs)
    return sum(e[0] == "foreign" for e in rec.launches)


@pytest.mark.parametrize("wanted", [{0}, {1}, {2}, {0, 1}, {1, 2}, {0, 2}], ids=str)
def test_requires_grad_subsets(fast, wanted):
    x, w, b = _row_inputs((6, 1024), 1, bf16, bf16, "wb")
    _check(fast, lambda x, w, b: normkit.layer_norm(x, 1024, w, b), (x, w, b), wanted)


def test_strided_and_misaligned_rows(fast):
    base = torch.randn(8, 5000, device="cuda", dtype=bf16)
    w, b = torch.randn(4096, device="cuda", dtype=bf16), torch.randn(4096, device="cuda", dtype=bf16)
    strided = base[:, :4096]  # rows 5000 apart, read in place
    misaligned = torch.randn(4 * 4096 + 1, device="cuda", dtype=bf16)[1:].view(4, 4096)  # 2 bytes off 16
    assert misaligned.data_ptr() % 16
    for x in (strided, misaligned):
        assert _check(fast, lambda x, w, b: normkit.layer_norm(x, 4096, w, b), (x, w, b), {0, 1, 2}) >= 1


def test_empty_batch(fast):
    x, w, b = _row_inputs((0, 64), 1, bf16, bf16, "wb")
    _check(fast, lambda x, w, b: normkit.layer_norm(x, 64, w, b), (x, w, b), set())
    _check(fast, lambda x, w, b: normkit.layer_norm(x, 64, w, b), (x, w, b), {0, 1, 2})


def test_plan_cache(fast):
    x, w, b = _row_inputs((3, 2048), 1, fp16, fp16, "wb")
    _host.clear()
    s0 = _host.stats()
    for _ in range(3):
        normkit.layer_norm(x, 2048, w, b)
    s1 = _host.stats()
    assert s1["plans"] == 1 and s1["python_runs"] - s0["python_runs"] == 2
    assert s1["records"] - s0["records"] == 1 and s1["replays"] - s0["replays"] == 1
    normkit.layer_norm(x[:2], 2048, w, b)  # another shape: another plan
    assert _host.stats()["plans"] == 2
    _host.clear()
    assert _host.stats()["plans"] == 0


def test_output_is_fresh_and_in_place_ops_work(fast):
    x, w, b = _row_inputs((4, 512), 1, bf16, bf16, "wb")
    dy = torch.randn(4, 512, device="cuda", dtype=bf16)

    def run():
        xl, wl, bl = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y = normkit.layer_norm(xl, 512, wl, bl)
        assert not y._is_view() and y.grad_fn is not None
        y.mul_(2).relu_()  # in place on the output, as ResNets do
        return [y.detach()] + list(torch.autograd.grad(y, (xl, wl, bl), dy))

    with _host.python_path():
        ref = run()
    for _ in range(3):
        for g, r in zip(run(), ref):
            _same(g, r, "in-place")
    y = normkit.layer_norm(x.clone().requires_grad_(), 512, w, b)
    assert y.grad_fn.name() == "NormkitRowNormBackward"


def test_gradient_of_a_reduction_has_stride_zero(fast):
    x, w, b = _row_inputs((4, 256), 1, fp32, fp32, "wb")

    def run():
        xl = x.detach().clone().requires_grad_()
        normkit.layer_norm(xl, 256, w, b).sum().backward()  # dy is an expanded scalar
        return xl.grad

    with _host.python_path():
        ref = run()
    # the Python path hands the kernel dy as a stride-0 row view, the C++ path a contiguous copy: two
    # specializations of the same kernel, equal up to the rounding of a different instruction order
    for _ in range(3):
        got = run()
        assert (got - ref).norm() <= 1e-6 * ref.norm(), "sum().backward()"


def test_double_backward_takes_the_differentiable_path(fast):
    x, w, b = _row_inputs((4, 64), 1, fp32, fp32, "wb")
    v = torch.randn(4, 64, device="cuda")
    dy = torch.randn(4, 64, device="cuda")

    def run():
        xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = normkit.layer_norm(xl, 64, wl, b, activation="silu")
        g, = torch.autograd.grad(y, xl, dy, create_graph=True)
        return torch.autograd.grad((g * v).sum(), (xl, wl))

    with _host.python_path():
        ref = run()
    before = _host.stats()["differentiable_backwards"]
    for _ in range(2):
        for g, r in zip(run(), ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert _host.stats()["differentiable_backwards"] - before == 2


def test_side_stream(fast):
    x, w, b = _row_inputs((4, 1024), 1, bf16, bf16, "wb")
    new = torch.randn_like(x)
    for _ in range(3):
        normkit.layer_norm(x, 1024, w, b)
    with _host.python_path():
        want = normkit.layer_norm(new, 1024, w, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # the copy below waits for this; a launch on another stream would not
        x.copy_(new)
        y = normkit.layer_norm(x, 1024, w, b)
    s.synchronize()
    _same(y, want, "side stream")


def test_cuda_graph_capture(fast):
    x, w, b = _row_inputs((8, 2048), 1, bf16, bf16, "wb")
    w.requires_grad_()
    x.requires_grad_()
    dy = torch.randn(8, 2048, device="cuda", dtype=bf16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # Python run, record, replay: plans exist before the capture
            torch.autograd.grad(normkit.layer_norm(x, 2048, w, b), (x, w), dy)
            normkit.group_norm(x.detach().view(8, 64, 32), 8, None, None, activation="silu")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    replays = _replays()
    with torch.cuda.graph(g):
        y = normkit.layer_norm(x, 2048, w, b)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        yg = normkit.group_norm(x.detach().view(8, 64, 32), 8, None, None, activation="silu")
    assert _replays() - replays == 3  # captured from the plans, not the Python path
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        dy.copy_(torch.randn_like(dy))
    g.replay()
    torch.cuda.synchronize()
    with _host.python_path():
        ry = normkit.layer_norm(x, 2048, w, b)
        rdx, rdw = torch.autograd.grad(ry, (x, w), dy)
        ryg = normkit.group_norm(x.detach().view(8, 64, 32), 8, None, None, activation="silu")
    for a, r in ((y, ry), (dx, rdx), (dw, rdw), (yg, ryg)):
        _same(a.detach(), r.detach(), "graph replay")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_another_device_than_the_current_one(fast):
    x, w, b = (t.to("cuda:1") for t in _row_inputs((4, 1024), 1, bf16, bf16, "wb"))
    assert _check(fast, lambda x, w, b: normkit.layer_norm(x, 1024, w, b), (x, w, b), {0, 1, 2}) >= 1
    assert torch.cuda.current_device() == 0


GN_CASES = [
    # (x shape, groups, dtype, activation, channels_last)
    ((2, 64, 8, 8), 8, bf16, "mish", False),
    ((2, 64, 8, 8), 8, bf16, None, True),
    ((4, 320, 16, 16), 32, fp16, "silu", True),  # the staged channels_last path: three launches
    ((1, 64, 4096), 8, fp32, "mish", False),  # seed 004's 1D block
    ((3, 32), 4, bf16, "relu", False),
    ((2, 48, 5, 7), 6, fp32, "gelu", False),
]


@pytest.mark.parametrize("case", GN_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-g{c[1]}-{str(c[2])[6:]}-"
                         f"{c[3]}{'-cl' if c[4] else ''}")
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_group_norm_matches_the_python_path(fast, case, grad):
    shape, groups, dtype, act, cl = case
    x = torch.randn(shape, device="cuda", dtype=dtype) + 1.0
    if cl:
        x = x.to(memory_format=torch.channels_last)  # kept by the clones _check makes
    w = torch.randn(shape[1], device="cuda", dtype=dtype)
    b = torch.randn(shape[1], device="cuda", dtype=dtype)
    wanted = {0, 1, 2} if grad else set()
    fn = lambda x, w, b: normkit.group_norm(x, groups, w, b, activation=act)  # noqa: E731
    assert _check(fast, fn, (x, w, b), wanted) >= 1


def test_modes_and_transforms_take_the_python_path(fast):
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w, b = _row_inputs((4, 256), 1, bf16, bf16, "wb")
    assert fast.row_norm(x, 256, w, b, 1e-5, False, None, None) is not None
    with TorchDispatchMode():
        assert fast.row_norm(x, 256, w, b, 1e-5, False, None, None) is None
    with torch.autocast("cuda", dtype=torch.bfloat16):  # float32 out, read from bf16 in one pass
        assert fast.row_norm(x, 256, w, b, 1e-5, False, None, None).dtype == torch.float32
        assert normkit.layer_norm(x, 256, w, b).dtype == torch.float32  # torch's autocast contract
        assert fast.row_norm(x.float(), 256, w.float(), b.float(), 1e-5, False, None, None).dtype == torch.float32
    out = torch.func.vmap(lambda r: normkit.layer_norm(r, 256, w, b))(x.view(2, 2, 256))
    with _host.python_path():
        _same(out, normkit.layer_norm(x.view(2, 2, 256), 256, w, b), "vmap")
    assert fast.row_norm(x.cpu(), 256, w.cpu(), b.cpu(), 1e-5, False, None, None) is None
    assert fast.row_norm(x.double(), 256, None, None, 1e-5, False, None, None) is None


# ----------------------------------------------------------------------------- fused options and layouts
# Each case: (inputs, fn(*inputs) -> the public call's result, the inputs that may require grad).
# fn makes the strided views (head rows of a fused QKV projection, column-strided rows) from
# contiguous leaves, so their gradients reach the leaves through the views, as in a model.

B, T, C, H, D = 2, 24, 256, 4, 64


def _t(*shape, dtype=bf16, scale=1.0):
    return torch.randn(shape, device="cuda", dtype=dtype) * scale + 0.25


def _fused_cases():
    """The cases by name (FUSED lists them: tensors are made on the GPU, not at collection)."""
    f8 = torch.float8_e4m3fn
    x, r = _t(B, T, C), _t(B, T, C)
    w, b, wf = _t(C), _t(C), _t(C, dtype=fp32)
    qkv, wq, wqh = _t(B, T, 3 * H * D), _t(D), _t(H, D)
    return {
        "rms residual prenorm": ((x, w, r), lambda x, w, r: normkit.rms_norm(x, C, w, residual=r, prenorm=True),
                                 {0, 1, 2}),
        "rms residual": ((x, w, r), lambda x, w, r: normkit.rms_norm(x, C, w, 1e-6, residual=r), {0, 1, 2}),
        "ln residual prenorm silu": ((x, w, b, r), lambda x, w, b, r: normkit.layer_norm(
            x, C, w, b, residual=r, prenorm=True, activation="silu"), {0, 1, 2, 3}),
        "rms residual fp32 stream": ((x, w, r.float()), lambda x, w, r: normkit.rms_norm(
            x, C, w, residual=r, prenorm=True), {0, 1, 2}),
        "rms residual_dtype fp32": ((x, w, r), lambda x, w, r: normkit.rms_norm(
            x, C, w, residual=r, prenorm=True, residual_dtype=torch.float32), {0, 1, 2}),
        "rms weight_offset": ((x, w), lambda x, w: normkit.rms_norm(x, C, w, weight_offset=1.0), {0, 1}),
        "rms weight_offset fp32 weight": ((x, wf), lambda x, w: normkit.rms_norm(x, C, w, weight_offset=1), {0, 1}),
        "rms q head rows": ((qkv, wq), lambda qkv, w: normkit.rms_norm(
            qkv[..., :H * D].view(B, T, H, D), D, w), {0, 1}),
        "rms k head rows per-head weight": ((qkv, wqh), lambda qkv, w: normkit.rms_norm(
            qkv[..., H * D:2 * H * D].view(B, T, H, D), D, w), {0, 1}),
        "ln column-strided rows": ((x.transpose(1, 2).contiguous(), w, b), lambda xt, w, b: normkit.layer_norm(
            xt.transpose(1, 2), C, w, b), {0, 1, 2}),  # Whisper's [B, T, C] with strides (T*C, 1, T)
        "ln channels_last rows": ((_t(B, C, 6, 8), w, b), lambda x, w, b: normkit.layer_norm(
            x.permute(0, 2, 3, 1), C, w, b), {0, 1, 2}),
        "ln weight is bias": ((x, w), lambda x, w: normkit.layer_norm(x, C, w, w), {0, 1}),
        "rms fp8 out float scale amax": ((x, w), lambda x, w: normkit.rms_norm(
            x, C, w, out_dtype=f8, out_scale=4.0, return_amax=True), set()),
        "ln fp8 out tensor scale": ((x, w, b, torch.tensor([2.0], device="cuda")), lambda x, w, b, s: normkit.layer_norm(
            x, C, w, b, out_dtype=f8, out_scale=s), set()),
        "rms amax bf16 out": ((x, w), lambda x, w: normkit.rms_norm(x, C, w, return_amax=True), {0, 1}),
        "ln out_dtype fp32": ((x, w, b), lambda x, w, b: normkit.layer_norm(x, C, w, b, out_dtype=torch.float32),
                              {0, 1, 2}),
        "ln autocast": ((x, w, b), lambda x, w, b: _autocast(normkit.layer_norm, x, C, w, b), {0, 1, 2}),
        "rms autocast residual": ((x, w, r), lambda x, w, r: _autocast(normkit.rms_norm, x, C, w, residual=r,
                                                                         prenorm=True), {0, 1, 2}),
        "module RMSNorm residual": ((x, w, r), lambda x, w, r: _rms_module(w)(x, r), {0, 2}),
        "row_norm_as_written residual": ((x, w, r), lambda x, w, r: normkit.functional.row_norm_as_written(
            x, w.shape, w, None, 1e-6, True, residual=r, prenorm=True, residual_dtype=torch.bfloat16), {0, 1, 2}),
        **_modulated_cases(x, w, b), **_gated_cases(),
    }


def _modulated_cases(x, w, b):
    """adaLN modulation: per-sample tables (B, C) and (B, 1, C), broadcast (C,), either alone, chunks of
    diffusers' embedding (rows 6C apart, read in place), weightless LN (DiT), an activation after it."""
    sc, sh = _t(B, C, scale=0.3), _t(B, 1, C, scale=0.3)
    emb = _t(B, 6 * C, scale=0.3)
    return {
        "ln mod scale shift": ((x, w, b, sc, sh), lambda x, w, b, s, t: normkit.layer_norm(x, C, w, b, scale=s, shift=t),
                               {0, 1, 2, 3, 4}),
        "ln mod weightless chunks": ((x, emb), lambda x, e: normkit.layer_norm(
            x, C, None, None, 1e-6, scale=e[:, C:2 * C], shift=e[:, :C]), {0, 1}),
        "ln mod broadcast scale silu": ((x, w, b, _t(C, scale=0.3)), lambda x, w, b, s: normkit.layer_norm(
            x, C, w, b, scale=s, activation="silu"), {0, 1, 2, 3}),
        "rms mod shift only": ((x, w, sh), lambda x, w, t: normkit.rms_norm(x, C, w, shift=t), {0, 1, 2}),
        "rms mod fp32 tables": ((x, w, sc.float(), sh.float()), lambda x, w, s, t: normkit.rms_norm(
            x, C, w, 1e-6, scale=s, shift=t), {0, 1, 2, 3}),
        "ln mod scale is shift": ((x, sc), lambda x, s: normkit.layer_norm(x, C, scale=s, shift=s), {0, 1}),
    }


def _gated_cases():
    """The gated norm: RMSNorm (Mamba-2), per-group weights (per-head rows), LayerNorm, a gate of
    another dtype, gate rows strided (a slice of a wider projection)."""
    G = 4
    x, g, w = _t(B, T, C), _t(B, T, C), _t(C)
    zx = _t(B, T, 2 * C)  # Mamba-2's in_proj output: the gate and x are slices of one tensor
    return {
        "rms gate": ((x, g, w), lambda x, g, w: normkit.rms_norm(x, C, w, 1e-5, gate=g), {0, 1, 2}),
        "rms gate per-group weights": ((x, g, w.view(G, C // G)), lambda x, g, w: normkit.rms_norm(
            x.view(B, T, G, C // G), C // G, w, 1e-5, gate=g.view(B, T, G, C // G)), {0, 1, 2}),
        "ln gate weightless": ((x, g), lambda x, g: normkit.layer_norm(x, C, gate=g), {0, 1}),
        "rms gate fp32 gate": ((x, g.float(), w), lambda x, g, w: normkit.rms_norm(x, C, w, gate=g), {0, 1, 2}),
        "rms gate slices of one projection": ((zx, w), lambda zx, w: normkit.rms_norm(
            zx[..., C:], C, w, 1e-5, gate=zx[..., :C]), {0, 1}),
    }


def _autocast(fn, *args, **kwargs):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return fn(*args, **kwargs)


def _rms_module(w):
    m = normkit.RMSNorm(C, eps=1e-6, device="cuda", dtype=bf16)
    with torch.no_grad():
        m.weight.copy_(w)
    return m


FUSED = ["rms residual prenorm", "rms residual", "ln residual prenorm silu", "rms residual fp32 stream",
         "rms residual_dtype fp32", "rms weight_offset", "rms weight_offset fp32 weight", "rms q head rows",
         "rms k head rows per-head weight", "ln column-strided rows", "ln channels_last rows", "ln weight is bias",
         "rms fp8 out float scale amax", "ln fp8 out tensor scale", "rms amax bf16 out", "ln out_dtype fp32",
         "ln autocast", "rms autocast residual", "module RMSNorm residual", "row_norm_as_written residual"]
MODULATED = ["ln mod scale shift", "ln mod weightless chunks", "ln mod broadcast scale silu", "rms mod shift only",
             "rms mod fp32 tables", "ln mod scale is shift"]
GATED = ["rms gate", "rms gate per-group weights", "ln gate weightless", "rms gate fp32 gate",
         "rms gate slices of one projection"]


@pytest.mark.parametrize("name", FUSED + MODULATED + GATED)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_fused_options_and_layouts_match_the_python_path(fast, name, grad):
    inputs, fn, wanted = _fused_cases()[name]
    if grad and not wanted:
        pytest.skip("float8 outputs: gradients take the Python path")
    s0 = _host.stats()
    assert _check(fast, fn, inputs, wanted if grad else set()) >= (2 if grad else 1), _host.stats()["last_failure"]
    s1 = _host.stats()
    assert s1["record_failures"] == s0["record_failures"], s1["last_failure"]


@pytest.mark.parametrize("wanted", [{0}, {1}, {2}, {0, 2}, {1, 2}, {0, 1}], ids=str)
def test_residual_requires_grad_subsets(fast, wanted):
    inputs, fn, _ = _fused_cases()["rms residual prenorm"]
    assert _check(fast, fn, inputs, wanted) >= 2
    inputs, fn, _ = _fused_cases()["rms residual fp32 stream"]
    assert _check(fast, fn, inputs, wanted) >= 2


@pytest.mark.parametrize("wanted", [{0}, {3}, {4}, {3, 4}, {0, 3}, {1, 2}, {1, 4}], ids=str)
def test_modulation_requires_grad_subsets(fast, wanted):
    """Every subset of (x, weight, bias, scale, shift) that requires grad: dscale and dshift come
    from the C++ node exactly where the Python path gives them."""
    inputs, fn, _ = _fused_cases()["ln mod scale shift"]
    assert _check(fast, fn, inputs, wanted) >= 2


@pytest.mark.parametrize("wanted", [{0}, {1}, {2}, {0, 1}, {1, 2}], ids=str)
def test_gate_requires_grad_subsets(fast, wanted):
    inputs, fn, _ = _fused_cases()["rms gate"]
    assert _check(fast, fn, inputs, wanted) >= 2


@pytest.mark.parametrize("name", ["ln mod scale shift", "rms gate"])
def test_double_backward_with_modulation_or_gate(fast, name):
    """create_graph=True: the C++ node hands the backward to the differentiable torch ops (dscale,
    dshift, dgate included), which autograd differentiates again."""
    inputs, fn, wanted = _fused_cases()[name]
    inputs = tuple(t.float() for t in inputs)

    def run():
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        v = torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        g = torch.autograd.grad((y * v).sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum((gi * gi).sum() for gi in g), leaves, allow_unused=True)

    with _host.python_path():
        ref = run()
    before = _host.stats()["differentiable_backwards"]
    for _ in range(2):
        for g, e in zip(run(), ref, strict=True):
            assert (g is None) == (e is None)
            if g is not None:
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    assert _host.stats()["differentiable_backwards"] > before


def test_gradient_of_h_only(fast):
    """Only h = x + r reaches the loss: the backward gets no dy (as torch's, it sums dh into both)."""
    x, w, r = _t(B, T, C), _t(C), _t(B, T, C)

    def run():
        xl, rl = x.clone().requires_grad_(), r.clone().requires_grad_()
        _, h = normkit.rms_norm(xl, C, w, residual=rl, prenorm=True)
        return torch.autograd.grad(h, (xl, rl), torch.ones_like(h))

    with _host.python_path():
        ref = run()
    for _ in range(3):
        for g, e in zip(run(), ref):
            _same(g, e, "dh only")


def test_double_backward_through_h(fast):
    x, w, r = _t(4, 64, dtype=fp32), _t(64, dtype=fp32), _t(4, 64, dtype=fp32)
    v = torch.randn(4, 64, device="cuda")

    def run():
        xl, wl, rl = (t.clone().requires_grad_() for t in (x, w, r))
        y, h = normkit.rms_norm(xl, 64, wl, residual=rl, prenorm=True, weight_offset=1.0)
        g, = torch.autograd.grad((y * v).sum() + (h * h).sum(), xl, create_graph=True)
        return torch.autograd.grad((g * v).sum(), (xl, wl, rl))

    with _host.python_path():
        ref = run()
    before = _host.stats()["differentiable_backwards"]
    for _ in range(2):
        for g, e in zip(run(), ref):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert _host.stats()["differentiable_backwards"] > before


def test_group_norm_weight_is_bias(fast):
    x, w = _t(2, 64, 8, 8), _t(64)
    x = x.to(memory_format=torch.channels_last)
    for wanted in ({0, 1}, {1}, set()):
        assert _check(fast, lambda x, w: normkit.group_norm(x, 8, w, w, activation="silu"), (x, w), wanted) >= 1


def test_fused_calls_are_served_by_cpp(fast):
    """The calls of the issue's host table run on plans: a run of each adds replays and no Python runs."""
    cases = _fused_cases()
    for name in ("rms residual prenorm", "ln column-strided rows", "rms weight_offset", "rms q head rows",
                 "rms fp8 out float scale amax", "ln weight is bias", "ln mod weightless chunks", "ln mod scale shift",
                 "rms gate", "rms gate per-group weights"):
        inputs, fn, wanted = cases[name]
        for _ in range(3):
            _grads(fn, inputs, wanted)
        s0 = _host.stats()
        _grads(fn, inputs, wanted)
        s1 = _host.stats()
        assert s1["python_runs"] == s0["python_runs"] and s1["replays"] > s0["replays"], name


# ----------------------------------------------------------------------------- compiled calls
# Inductor's generated code calls normkit's ops through the dispatcher, which reaches the C++
# kernels (host.cpp, "the dispatcher's kernels"): the same plans as eager calls, no Python per call.

def _op_delta(before, after):
    return {k: after[k] - before[k] for k in ("op_served", "op_python", "op_autograd_python", "python_runs", "replays")}


def _compiled_matches_eager(fn, args, calls: int) -> dict:
    """fn compiled (fullgraph, normkit's ops kept), run without grad until its ops replay plans, then
    `calls` times: its outputs must be the eager call's, bit for bit; the counters of those calls."""
    from normkit import compile_fusion as cf

    torch._dynamo.reset()
    with cf.policy("normkit"), torch.no_grad():
        eager = fn(*args)
        f = torch.compile(fn, fullgraph=True)
        for _ in range(3):  # per op: the Python host function, its recording, then replays
            f(*args)
        before = _host.stats()
        for _ in range(calls):
            got = f(*args)
        d = _op_delta(before, _host.stats())
    for i, (a, e) in enumerate(zip(got, eager, strict=True)):
        _same(a, e, f"output {i}: compiled vs eager")
    return d


def test_compiled_calls_replay_plans_in_cpp(fast):
    x = torch.randn(8, 4096, device="cuda", dtype=bf16)
    r, w = torch.randn_like(x), torch.randn(4096, device="cuda", dtype=bf16)
    b = torch.randn(4096, device="cuda", dtype=bf16)
    xg = torch.randn(2, 64, 8, 8, device="cuda", dtype=fp16)

    def fn(x, r, xg):
        y = normkit.rms_norm(x, (4096,), w, 1e-6)
        y2, h = normkit.rms_norm(x, (4096,), w, 1e-6, residual=r, prenorm=True)
        z = normkit.layer_norm(x, (4096,), w, b, 1e-5)
        g = normkit.group_norm(xg, 8, None, None, 1e-5, activation="silu")
        return y, y2, h, z, g

    d = _compiled_matches_eager(fn, (x, r, xg), 5)
    assert d["op_python"] == 0 and d["python_runs"] == 0 and d["op_autograd_python"] == 0, d
    assert d["op_served"] >= 5 * 4 and d["op_served"] % 5 == 0 and d["replays"] >= d["op_served"], d


def test_compiled_modulated_and_gated_calls_are_served_in_cpp(fast):
    """torch.compile (fullgraph) of a modulated and a gated call: Inductor's code calls
    normkit::row_norm_fused_fwd with mod_scale/mod_shift/gate, which the C++ kernel serves from plans."""
    x, g = torch.randn(4, 64, 1152, device="cuda", dtype=bf16), torch.randn(4, 64, 1152, device="cuda", dtype=bf16)
    emb = torch.randn(4, 6 * 1152, device="cuda", dtype=bf16)
    w = torch.randn(1152, device="cuda", dtype=bf16)

    def fn(x, emb, g):
        shift, scale = emb[:, :1152], emb[:, 1152:2304]
        y = normkit.layer_norm(x, (1152,), None, None, 1e-6, scale=scale, shift=shift)
        z = normkit.rms_norm(x, (1152,), w, 1e-5, gate=g)
        return y, z

    d = _compiled_matches_eager(fn, (x, emb, g), 4)
    assert d["op_python"] == 0 and d["python_runs"] == 0 and d["op_served"] >= 4 * 2 and d["op_served"] % 4 == 0, d


def test_compiled_training_step_matches_eager(fast):
    from normkit import compile_fusion as cf

    torch._dynamo.reset()
    x0 = torch.randn(16, 1024, device="cuda", dtype=bf16)
    w0 = torch.randn(1024, device="cuda", dtype=bf16)

    def step(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w)
        y.backward((y.detach().float() * 0.7).cos().to(y.dtype))
        return y.detach(), x.grad, w.grad

    def fn(x, w):
        return normkit.rms_norm(x, (1024,), w, 1e-6)

    with cf.policy("normkit"):
        eager = step(fn)
        f = torch.compile(fn, fullgraph=True)
        for _ in range(3):
            step(f)
        before = _host.stats()
        got = step(f)
        d = _op_delta(before, _host.stats())
    for a, e in zip(got, eager):
        _same(a, e, "compiled training step vs eager")
    # the compiled forward runs with grad mode off: the C++ autograd kernel goes on in C++; the
    # backward graph's row_norm_bwd is served in C++ too
    assert d["op_autograd_python"] == 0 and d["op_python"] == 0 and d["op_served"] >= 2, d


def test_compiled_training_serves_every_op_in_cpp(fast):
    """A compiled training step of every kind of op (LayerNorm + SiLU, RMSNorm with a residual,
    RMSNorm with per-head weights, the adaLN modulation, a gate, GroupNorm NCHW and channels_last):
    after warm-up, every op call of the forward and backward graphs replays a plan in C++ (no
    Python run, no op left to Python) and the gradients are eager's, bit for bit."""
    from normkit import compile_fusion as cf

    torch._dynamo.reset()
    C = 1024
    t = lambda *s, dtype=bf16: (torch.randn(*s, device="cuda") * 0.8 + 0.2).to(dtype)  # noqa: E731
    # each op its own leaves: a gradient summed over several ops would be rounded differently by
    # Inductor's fused sum than by eager autograd's accumulation
    inputs = [t(4, 16, C), t(C), t(C), t(4, 16, C), t(4, 16, C), t(C), t(4, 16, C), t(8, 128), t(4, 16, C), t(4, C),
              t(4, 16, C), t(4, 16, C), t(C), t(2, 64, 16, 16, dtype=fp16), t(64, dtype=fp16),
              t(2, 64, 16, 16, dtype=fp16), t(64, dtype=fp16)]

    def fn(x1, w1, b1, x2, r2, w2, x3, w3, x4, s4, x5, g5, w5, x6, w6, x7, w7):
        y = normkit.layer_norm(x1, (C,), w1, b1, activation="silu")
        z, h = normkit.rms_norm(x2, (C,), w2, 1e-6, residual=r2, prenorm=True)
        q = normkit.rms_norm(x3.view(4, 16, 8, 128), (128,), w3, 1e-6)  # per-head weights
        m = normkit.layer_norm(x4, (C,), None, None, 1e-6, scale=s4, shift=s4)
        u = normkit.rms_norm(x5, (C,), w5, 1e-5, gate=g5)
        n = normkit.group_norm(x6, 8, w6, w6, 1e-5, activation="silu")
        o = normkit.group_norm(x7.to(memory_format=torch.channels_last), 8, w7, None, 1e-5)
        return y, z, h, q, m, u, n, o

    def step(f):
        leaves = [v.clone().requires_grad_() for v in inputs]
        outs = f(*leaves)
        return list(torch.autograd.grad(outs, leaves, [(o.detach().float() * 0.7 + 0.3).cos().to(o.dtype)
                                                       for o in outs]))

    with cf.policy("normkit"):
        eager = step(fn)
        f = torch.compile(fn, fullgraph=True)
        for _ in range(3):  # per op: the Python host function, its recording, then replays
            step(f)
        before = _host.stats()
        got = step(f)
        d = _op_delta(before, _host.stats())
    for i, (a, e) in enumerate(zip(got, eager, strict=True)):  # values (Inductor may pick another layout)
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e), f"grad {i}: compiled vs eager"
    assert d["op_python"] == 0 and d["op_autograd_python"] == 0 and d["python_runs"] == 0, d
    assert d["op_served"] >= 14 and d["replays"] >= 14, d  # 7 forward, 7 backward


def test_backward_ops_called_directly(fast):
    """The backward ops as the autograd formulas and the kernel-level API call them (dbias without
    the bias, per-head weights, dh and dres, weight_offset, modulation, gate, GroupNorm in both
    layouts): the Python implementation's results bit for bit, three calls each (Python run,
    record, replay), and the float64 oracle's gradients."""
    from helpers import backward_op_cases

    from normkit import reference as ref

    for name, (op, args, oracle) in backward_op_cases("cuda").items():
        with _host.python_path():
            want = op(*args)
        before = _host.stats()
        for i in range(3):
            got = op(*args)
            for k, (a, e) in enumerate(zip(got, want, strict=True)):
                _same(a, e, f"{name}: output {k}, call {i}")
        d = _op_delta(before, _host.stats())
        assert d["op_served"] == 3 and d["op_python"] == 0 and d["replays"] >= 1, (name, d)
        for k, exp in oracle():
            assert ref.rel_err(got[k], exp) < (2e-2 if got[k].dtype == bf16 else 1e-4), (name, k)


def test_declined_compiled_calls_take_the_python_implementation(fast):
    from normkit import compile_fusion as cf

    torch._dynamo.reset()
    x = torch.randn(4, 6, 2, 64, device="cuda")[:, :5].permute(2, 0, 1, 3)  # rows the kernels cannot walk
    f = torch.compile(lambda t: normkit.rms_norm(t, (64,), None, 1e-6), fullgraph=True)
    with cf.policy("normkit"), torch.no_grad():
        before = _host.stats()
        y = f(x)
        d = _op_delta(before, _host.stats())
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (64,), None, 1e-6))
    assert d["op_python"] + d["op_served"] >= 1, d  # Inductor may hand the op a contiguous copy


def test_a_process_that_compiles_before_any_eager_call_gets_the_kernels(fast):
    import os
    import subprocess
    import sys

    code = """
import torch, normkit
from normkit import _host, compile_fusion as cf
x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
f = torch.compile(lambda x: normkit.rms_norm(x, (512,), w, 1e-6), fullgraph=True)
with cf.policy("normkit"), torch.no_grad():
    for _ in range(4):
        y = f(x)
s = _host.stats()
assert _host.fast is not None and s["op_served"] == 4 and s["replays"] >= 2, (_host.status, s)
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
