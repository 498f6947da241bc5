"""torch.compile, tracing and CUDA graphs.

Every normkit op is a torch.library custom op (normkit/_library.py): dynamo traces it as one opaque
node, so `fullgraph=True` holds, and a changing batch size costs one dynamic recompile, not one per
shape. Inductor then decides op by op (normkit/compile_fusion.py): where normkit's op is measured
faster (its table, or policy("normkit")), the op stays and the very same kernels run as in eager
(results bitwise equal); where it is not (no table entry: every CPU test, by default), normkit steps
aside, the compiled code holds no normkit op, and results match eager within tolerance.

CPU tests compile with "aot_eager" (dynamo + fake tensors + AOT autograd, the parts that see the
custom ops; no pass runs there, so the op stays) where that suffices, and with inductor where the
generated code matters; the GPU tests use inductor and the Triton kernels, and capture CUDA graphs.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import normkit
from normkit import _library
from normkit import compile_fusion
from normkit import reference as ref

from conftest import DEVICE, HAS_CUDA
from helpers import randn

NORMKIT_OPS = {"normkit.row_norm_fwd.default", "normkit.row_norm_bwd.default", "normkit.row_norm_fused_fwd.default",
               "normkit.row_norm_fused_bwd.default", "normkit.group_norm_fwd.default", "normkit.group_norm_bwd.default"}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


pytestmark = pytest.mark.usefixtures("exact_fp32")  # conftest: no TF32 on a GPU


# ----------------------------------------------------------------------------- cases

def _case(name, device=DEVICE, dtype=torch.float32, backend=None, batch=4):
    """(fn, args): a normkit call on fresh inputs; args that are floating tensors get gradients."""
    gen = torch.Generator().manual_seed(0)
    H = 48

    def t(*shape, dt=dtype):
        return randn(*shape, dtype=dt, device=device, gen=gen).requires_grad_(True)

    if name == "layer_norm":
        return (lambda x, w, b: normkit.layer_norm(x, H, w, b, backend=backend)), (t(batch, 5, H), t(H), t(H))
    if name == "layer_norm_no_affine":
        return (lambda x: normkit.layer_norm(x, (5, H), eps=1e-3, backend=backend)), (t(batch, 5, H),)
    if name == "layer_norm_act":
        return ((lambda x, w, b: normkit.layer_norm(x, H, w, b, activation="silu", backend=backend)),
                (t(batch, 5, H), t(H), t(H)))
    if name == "rms_norm":
        return (lambda x, w: normkit.rms_norm(x, H, w, backend=backend)), (t(batch, 5, H), t(H))
    if name == "rms_norm_fp32_weight":  # bf16/fp16 activations with an fp32 weight
        return (lambda x, w: normkit.rms_norm(x, H, w, 1e-6, backend=backend)), (t(batch, 5, H), t(H, dt=torch.float32))
    if name == "group_norm":
        return ((lambda x, w, b: normkit.group_norm(x, 4, w, b, backend=backend)),
                (t(batch, 16, 3, 5), t(16), t(16)))
    if name == "group_norm_mish":  # the fusion of seed 004
        return ((lambda x, w, b: normkit.group_norm(x, 4, w, b, activation="mish", backend=backend)),
                (t(batch, 16, 7), t(16), t(16)))
    if name == "group_norm_channels_last":
        x = randn(batch, 16, 3, 5, dtype=dtype, device=device, gen=gen).to(memory_format=torch.channels_last)
        return ((lambda x, w, b: normkit.group_norm(x, 4, w, b, backend=backend)),
                (x.requires_grad_(True), t(16), t(16)))
    raise ValueError(name)


CASES = ["layer_norm", "layer_norm_no_affine", "layer_norm_act", "rms_norm", "rms_norm_fp32_weight", "group_norm",
         "group_norm_mish", "group_norm_channels_last"]


def _fwd_bwd(fn, args, seed=1):
    """Output and gradients w.r.t. every input, for a fixed fresh dy."""
    y = fn(*args)
    dy = randn(*y.shape, dtype=y.dtype, device=y.device, gen=torch.Generator().manual_seed(seed))
    return [y.detach()] + list(torch.autograd.grad(y, args, dy))


def _assert_equal(got, expected, what):
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, f"{what}[{i}]"
        assert torch.equal(g, e), f"{what}[{i}]: differs from eager (max {(g.float() - e.float()).abs().max():.3g})"


def _normkit_nodes(counter) -> set:
    return {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"} & NORMKIT_OPS


def _fresh_batch(args, batch):
    """args with a new leading size (same dtype/layout, fresh values), gradients on."""
    out = []
    for a in args:
        if a.dim() > 1:
            shape = (batch,) + tuple(a.shape[1:])
            t = randn(*shape, dtype=a.dtype, device=a.device)
            if a.dim() == 4 and a.is_contiguous(memory_format=torch.channels_last) and not a.is_contiguous():
                t = t.to(memory_format=torch.channels_last)
            out.append(t.requires_grad_(True))
        else:
            out.append(a)
    return out


# ----------------------------------------------------------------------------- CPU (and GPU) tests

@pytest.mark.parametrize("case", CASES)
def test_fullgraph_matches_eager_bitwise(case):
    fn, args = _case(case)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    _assert_equal(_fwd_bwd(compiled, args), _fwd_bwd(fn, args), case)
    assert counter.frame_count == 1
    assert _normkit_nodes(counter), "the normkit op is not in the graph: dynamo traced into the backend"


def _assert_close(got, expected, what, tol=1e-5):
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, f"{what}[{i}]"
        assert ref.rel_err(g, e) <= tol, f"{what}[{i}]: relative error {ref.rel_err(g, e):.3g}"


@pytest.mark.parametrize("case", ["layer_norm", "rms_norm", "group_norm"])
@pytest.mark.parametrize("policy", ["normkit", "torch"])
def test_inductor_dynamic_batch_compiles_once_more_then_never(case, policy):
    """The first call compiles for its shape, the first new batch size recompiles with a symbolic
    batch, and no later batch size compiles again. Where normkit's op stays, results are bitwise
    eager's; where it steps aside, Inductor's code matches eager within tolerance."""
    fn, args = _case(case)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    with compile_fusion.policy(policy):
        for batch in (4, 3, 7, 1 + 8, 16):
            args = _fresh_batch(args, batch)
            got, expected = _fwd_bwd(compiled, args), _fwd_bwd(fn, args)
            (_assert_equal if policy == "normkit" else _assert_close)(got, expected, f"{case} batch {batch}")
    assert counter.frame_count == 2


def test_inductor_code_holds_a_normkit_op_only_where_it_stays():
    """Patched modules under Inductor (on the test device): where normkit steps aside (no table
    entry) the generated code calls no normkit op and matches eager within tolerance; under
    policy("normkit") it calls the op and is bitwise eager's."""
    from torch._inductor.utils import run_and_get_code
    ln = torch.nn.LayerNorm(48).to(DEVICE)
    normkit.patch(ln)
    x = randn(4, 5, 48, device=DEVICE).requires_grad_(True)
    for policy in ("table", "normkit"):
        torch._dynamo.reset()
        with compile_fusion.policy(policy), compile_fusion.use_table({}):
            out, code = run_and_get_code(torch.compile(ln, fullgraph=True), x)
        assert ("normkit.row_norm_fwd" in "\n".join(code)) == (policy == "normkit"), policy
        (_assert_equal if policy == "normkit" else _assert_close)([out.detach()], [ln(x).detach()], policy)


def test_dynamic_true_compiles_once_for_all_shapes():
    fn, args = _case("rms_norm")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for batch in (2, 5, 11):
        args = _fresh_batch(args, batch)
        _assert_equal(_fwd_bwd(compiled, args), _fwd_bwd(fn, args), f"batch {batch}")
    assert counter.frame_count == 1


class _Block(torch.nn.Module):
    """A small pre-norm transformer MLP block plus a conv stem with GroupNorm."""

    def __init__(self, dim=32):
        super().__init__()
        self.ln = normkit.LayerNorm(dim)
        self.rms = normkit.RMSNorm(dim, eps=1e-6)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)
        self.gn = normkit.GroupNorm(4, 8)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        with torch.no_grad():
            for m in (self.ln, self.rms, self.gn):
                for p in m.parameters():
                    p.copy_(1 + 0.3 * torch.randn(p.shape))

    def forward(self, x, img):
        h = x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))
        return self.rms(h).square().mean() + self.gn(self.conv(img)).square().mean()


def _model_step(model, x, img):
    loss = model(x, img)
    grads = torch.autograd.grad(loss, [x, img] + list(model.parameters()))
    return [loss.detach()] + list(grads)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_model_with_normkit_modules_fullgraph(backend):
    torch.manual_seed(0)
    model = _Block().to(DEVICE)
    x = randn(3, 7, 32, device=DEVICE).requires_grad_(True)
    img = randn(3, 8, 5, 5, device=DEVICE).requires_grad_(True)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with compile_fusion.policy("torch"):
        got, expected = _model_step(compiled, x, img), _model_step(model, x, img)
    assert counter.frame_count == 1
    if backend == "aot_eager":  # the same aten ops and the same normkit kernels: bitwise
        assert _normkit_nodes(counter)  # no pass runs there: the ops stay, opaque
        _assert_equal(got, expected, "model")
    else:  # normkit stepped aside: Inductor's code (test_inductor_code_holds_a_normkit_op_only_where_it_stays)
        for g, e in zip(got, expected):
            assert ref.rel_err(g, e) <= 1e-5


def test_kernel_level_api_fullgraph():
    gen = torch.Generator().manual_seed(0)
    x, dy = randn(6, 40, device=DEVICE, gen=gen), randn(6, 40, device=DEVICE, gen=gen)
    w, b = randn(40, device=DEVICE, gen=gen), randn(40, device=DEVICE, gen=gen)

    def f(x, w, b, dy):
        y, mean, rstd = normkit.layer_norm_fwd(x, 40, w, b)
        y2, rstd2 = normkit.rms_norm_fwd(x, 40, w)
        return (y, mean, rstd, y2, rstd2) + normkit.layer_norm_bwd(dy, x, w, mean, rstd) + \
            normkit.rms_norm_bwd(dy, x, w, rstd2)

    counter = CompileCounterWithBackend("aot_eager")
    _assert_equal(torch.compile(f, backend=counter, fullgraph=True)(x, w, b, dy), f(x, w, b, dy), "kernel API")
    assert _normkit_nodes(counter) == {"normkit.row_norm_fwd.default", "normkit.row_norm_bwd.default"}


def test_triton_kernels_under_compile():
    """backend="triton" (the interpreter on CPU): the op runs the same Triton kernels as eager."""
    fn, args = _case("layer_norm", backend="triton", batch=2)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    _assert_equal(_fwd_bwd(compiled, args), _fwd_bwd(fn, args), "triton")


def test_forced_unavailable_backend_still_raises_under_compile():
    x = randn(2, 8, dtype=torch.float64)
    compiled = torch.compile(lambda x: normkit.layer_norm(x, 8, backend="triton"), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="backend='triton' cannot run layer_norm"):
        compiled(x)


def _patched_llama(device):
    transformers = pytest.importorskip("transformers") if HAS_CUDA else __import__("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    report = normkit.patch(model)
    assert len(report) == 3 and list(report.fused) == ["model.layers.0"]
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


def _hf_step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    return [out.logits.detach()] + list(grads)


def _check_patched_llama_compiles(backend, device, exact):
    """The complaint in Liger's issues 174/871: a patched HF model must compile with no graph
    break and give eager's results."""
    model, ids = _patched_llama(device)
    counter = CompileCounterWithBackend(backend)
    got = _hf_step(torch.compile(model, backend=counter, fullgraph=True), ids)
    expected = _hf_step(model, ids)
    # the norms, and the post-attention norm fused with its residual add (normkit.blocks)
    assert counter.frame_count == 1 and \
        _normkit_nodes(counter) == {"normkit.row_norm_fwd.default", "normkit.row_norm_fused_fwd.default"}
    if exact:
        _assert_equal(got, expected, "patched Llama")
    else:
        for g, e in zip(got, expected):
            assert ref.rel_err(g, e) <= 1e-5


def test_patched_hf_llama_fullgraph():
    # bitwise on CPU; on a GPU aot_eager's decompositions of the model's other ops (attention,
    # matmuls) round differently from eager (1e-7 seen on an H200), so there it is a tolerance
    _check_patched_llama_compiles("aot_eager", DEVICE, exact=DEVICE == "cpu")


# ----------------------------------------------------------------------------- routing and op contracts

def test_plain_eager_calls_keep_the_fast_path():
    fn, args = _case("layer_norm")
    # the autograd.Function's node, the C++ host path's (normkit._host) where it is active (CUDA), or
    # the CPU fast path's (normkit._cpu) on CPU tensors
    assert fn(*args).grad_fn.name() in ("RowNormFnBackward", "NormkitRowNormBackward", "CpuRowNormBackward")


def test_dispatch_modes_see_the_custom_op():
    from torch.fx.experimental.proxy_tensor import make_fx
    fn, args = _case("rms_norm")
    gm = make_fx(fn)(*[a.detach() for a in args])
    assert {str(n.target) for n in gm.graph.nodes} & NORMKIT_OPS == {"normkit.row_norm_fwd.default"}


def _opcheck_samples() -> dict:
    """name -> (op, args): each op with and without optional tensors and options."""
    gen = torch.Generator().manual_seed(0)

    def t(*s, dt=torch.float32, grad=False):
        return randn(*s, dtype=dt, gen=gen).requires_grad_(grad)

    fwd, bwd = torch.ops.normkit.row_norm_fwd.default, torch.ops.normkit.row_norm_bwd.default
    gfwd, gbwd = torch.ops.normkit.group_norm_fwd.default, torch.ops.normkit.group_norm_bwd.default
    x, w, b, xg = t(3, 4, 24), t(24), t(24), t(2, 8, 3, 3)
    _, mean, rstd = fwd(x, 1, w, b, 1e-5, False, None, "torch")
    _, _, rstd_r = fwd(x, 2, None, None, 1e-5, True, None, "torch")
    _, g_mean, g_rstd = gfwd(xg, 4, None, None, 1e-5, None, "torch")
    return {
        "ln_fwd": (fwd, (t(3, 4, 24, grad=True), 1, t(24, grad=True), t(24, grad=True), 1e-5, False, None, "torch")),
        "rms_fwd_2d_no_weight": (fwd, (x, 2, None, None, 1e-5, True, None, None)),
        "rms_fwd_bf16_fp32_weight": (fwd, (t(5, 24, dt=torch.bfloat16), 1, t(24, grad=True), None, 1e-6, True, None,
                                           "torch")),
        "ln_fwd_gelu": (fwd, (t(3, 4, 24, grad=True), 1, w, b, 1e-5, False, "gelu", "torch")),
        "ln_bwd": (bwd, (t(3, 4, 24), x, 1, w, None, mean, rstd, False, None, torch.float32, torch.float32, "torch")),
        "rms_bwd_no_weight": (bwd, (t(3, 4, 24), x, 2, None, None, torch.empty(0), rstd_r, True, None, None, None,
                                    "torch")),
        "gn_fwd": (gfwd, (t(2, 8, 3, 3, grad=True), 4, t(8, grad=True), t(8), 1e-5, None, "torch")),
        "gn_fwd_channels_last": (gfwd, (xg.to(memory_format=torch.channels_last), 2, None, None, 1e-5, None, None)),
        "gn_fwd_mish": (gfwd, (t(2, 8, 5, grad=True), 2, t(8), t(8, grad=True), 1e-5, "mish", "torch")),
        "gn_bwd": (gbwd, (t(2, 8, 3, 3), xg, 4, t(8), None, g_mean, g_rstd, None, torch.float32, torch.float32,
                          "torch")),
        # with the forward's eps: the torch backend's CPU kernel recomputes the activation's input
        "gn_bwd_mish_eps": (gbwd, (t(2, 8, 3, 3), xg, 4, t(8), t(8), g_mean, g_rstd, "mish", torch.float32,
                                   torch.float32, "torch", 1e-5)),
    }


@pytest.mark.parametrize("sample", list(_opcheck_samples()))
def test_opcheck(sample):
    """torch.library.opcheck: schema, fake (meta) implementation against the real one, autograd
    registration, and AOT dispatch with dynamic shapes."""
    op, args = _opcheck_samples()[sample]
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_needed_routes_plain_tensors_eagerly_and_fake_ones_to_the_op():
    x = torch.randn(2, 3)
    assert not _library.needed(x, torch.nn.Parameter(torch.randn(3)), None)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        assert _library.needed(mode.from_tensor(x))


# ----------------------------------------------------------------------------- GPU: Triton, inductor, CUDA graphs

GPU_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_gpu_inductor_fullgraph_matches_eager_bitwise(case, dtype):
    fn, args = _case(case, device="cuda", dtype=dtype)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    with compile_fusion.policy("normkit"):  # the op stays: normkit's kernels, bitwise
        for batch in (4, 6, 9):
            args = _fresh_batch(args, batch)
            _assert_equal(_fwd_bwd(compiled, args), _fwd_bwd(fn, args), f"{case} batch {batch}")
    assert counter.frame_count == 2 and _normkit_nodes(counter)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_gpu_inductor_steps_aside_and_matches_eager(case, dtype):
    """policy("torch"): Inductor's own code for the norm, no normkit op, eager's values."""
    from torch._inductor.utils import run_and_get_code
    fn, args = _case(case, device="cuda", dtype=dtype)
    with compile_fusion.policy("torch"):
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    assert "normkit" not in "\n".join(code)
    assert ref.rel_err(out, fn(*args)) <= (1e-5 if dtype == torch.float32 else 1e-2)


def _graph_step(fn, args, dy):
    y = fn(*args)
    return [y] + list(torch.autograd.grad(y, args, dy))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_gpu_cuda_graph_capture_and_replay(case, dtype):
    """Forward and backward captured in one CUDA graph, replayed on new data written into the
    static inputs: bitwise equal to eager (same kernels, deterministic reductions)."""
    fn, args = _case(case, device="cuda", dtype=dtype)
    static = [a.detach().clone().requires_grad_(True) for a in args]
    static_dy = torch.zeros_like(fn(*static))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile kernels, allocate lazily-made buffers
        for _ in range(3):
            _graph_step(fn, static, static_dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _graph_step(fn, static, static_dy)
    for seed in (1, 2):
        fresh = _fresh_batch(args, args[0].shape[0])
        dy = randn(*static_dy.shape, dtype=dtype, device="cuda", gen=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
            static_dy.copy_(dy)
        graph.replay()
        expected = _graph_step(fn, [f.detach().requires_grad_(True) for f in fresh], dy)
        _assert_equal([o.detach() for o in outs], [e.detach() for e in expected], f"{case} replay {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["layer_norm", "rms_norm", "group_norm"])
def test_gpu_compile_reduce_overhead_uses_cuda_graphs(case):
    fn, args = _case(case, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    counters.clear()
    with compile_fusion.policy("normkit"):  # normkit's op inside the graphs: bitwise eager below
        for _ in range(3):  # cudagraph trees record on the second or third call
            got = [g.clone() for g in _fwd_bwd(compiled, args)]
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor did not use CUDA graphs"
    _assert_equal(got, _fwd_bwd(fn, args), case)


@pytest.mark.gpu
def test_gpu_patched_hf_llama_inductor_fullgraph():
    # normkit's ops kept in Inductor's graph (policy "normkit"), whatever the measured table says
    with compile_fusion.policy("normkit"):
        _check_patched_llama_compiles("inductor", "cuda", exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_hot_path_has_no_sync_and_no_device_query(case, monkeypatch):
    fn, args = _case(case, device="cuda", dtype=torch.bfloat16)
    _fwd_bwd(fn, args)  # warm-up: compile, cache device facts

    def no_query(*a, **k):
        raise AssertionError("device properties queried on the hot path")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_query)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            y = fn(*args)
            torch.autograd.grad(y, args, torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
