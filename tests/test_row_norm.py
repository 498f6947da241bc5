"""LayerNorm and RMSNorm, forward and backward, against the float64 oracle.

On a machine without a GPU the Triton kernels run under the Triton interpreter on CPU tensors;
with a GPU the same cases run compiled on CUDA tensors. Every test draws fresh random data.
"""
import pytest
import torch

import normkit
from normkit import reference as ref
from normkit.backends import triton as triton_backend
from normkit.backends.triton import configs

from conftest import DEVICE
from helpers import DTYPES, TOL, assert_close, check_fwd_bwd, oracle, oracle_grads, randn, run

WIDTHS = [1, 7, 64, 100, 1000, 4099, 8192]
OPS = ["layer_norm", "rms_norm"]
BACKENDS = ["triton", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("op", OPS)
def test_matches_oracle(op, n, dtype, backend, poison):
    # bf16 activations with fp32 parameters (mixed precision), fp16 with fp16 parameters
    p_dtype = torch.float32 if dtype != torch.float16 else torch.float16
    x = randn(5, n, dtype=dtype, device=DEVICE)
    w, b = randn(n, dtype=p_dtype, device=DEVICE), randn(n, dtype=p_dtype, device=DEVICE)
    check_fwd_bwd(op, x, (n,), w, b, backend=backend, what=f"{op} N={n} {dtype}")


@pytest.mark.parametrize("p_dtype", ["same", "fp32"])
@pytest.mark.parametrize("op, affine", [("layer_norm", a) for a in ("none", "weight", "bias", "both")]
                         + [("rms_norm", a) for a in ("none", "weight")])  # RMSNorm has no bias
def test_optional_and_mixed_dtype_params(op, affine, p_dtype):
    x = randn(4, 3, 100, dtype=torch.bfloat16, device=DEVICE)
    pd = torch.bfloat16 if p_dtype == "same" else torch.float32
    w = randn(100, dtype=pd, device=DEVICE) if affine in ("weight", "both") else None
    b = randn(100, dtype=pd, device=DEVICE) if affine in ("bias", "both") else None
    check_fwd_bwd(op, x, (100,), w, b, what=f"{op} {affine} {p_dtype}")


@pytest.mark.parametrize("op", OPS)
def test_many_rows_per_program_and_persistent_loop(op, poison):
    # N=7 puts hundreds of rows in one tile; 3000 rows make more tiles than persistent programs
    x = randn(3000, 7, device=DEVICE)
    check_fwd_bwd(op, x, (7,), randn(7, device=DEVICE), randn(7, device=DEVICE), what=f"{op} M=3000 N=7")


@pytest.mark.parametrize("op", OPS)
def test_multi_dim_normalized_shape(op):
    x = randn(2, 3, 4, 5, device=DEVICE)
    check_fwd_bwd(op, x, (4, 5), randn(4, 5, device=DEVICE), randn(4, 5, device=DEVICE), what=f"{op} (4, 5)")
    check_fwd_bwd(op, randn(2, 3, 4, 5, device=DEVICE), (3, 4, 5), what=f"{op} (3, 4, 5)")


@pytest.mark.parametrize("op", OPS)
def test_strided_rows_are_read_in_place(op):
    from normkit.functional import _as_rows

    wide = randn(6, 1000 + 37, device=DEVICE)
    for x in (wide[:, :1000], wide[1:5, :1000], wide[::2, :1000]):
        rows = _as_rows(x, (1000,))
        assert rows.data_ptr() == x.data_ptr() and rows.stride() == x.stride(), "strided rows were copied"
        w = randn(1000, device=DEVICE)
        check_fwd_bwd(op, x.detach(), (1000,), w, randn(1000, device=DEVICE), what=f"{op} strided {x.stride()}")
    x3 = randn(2, 3, 1000 + 5, device=DEVICE)[:, :, :1000]  # leading dims merge into one row stride
    assert _as_rows(x3, (1000,)).data_ptr() == x3.data_ptr()
    check_fwd_bwd(op, x3, (1000,), what=f"{op} 3-D strided")


@pytest.mark.parametrize("op", OPS)
def test_two_stride_and_column_strided_layouts_are_read_in_place(op):
    # batch slice of a 3-D tensor (leading dims need two strides), a transposed (column-major) x
    # (column stride), and three row strides, which no view covers: one copy
    from normkit.functional import _as_rows
    three = randn(5, 4, 3, 64, device=DEVICE).permute(2, 1, 0, 3)
    for x, copied in ((randn(6, 3, 64, device=DEVICE)[::2], False), (randn(64, 9, device=DEVICE).t(), False),
                      (three, True)):
        rows = _as_rows(x, (x.shape[-1],))
        assert (rows.data_ptr() == x.data_ptr()) != copied
        check_fwd_bwd(op, x.detach(), (x.shape[-1],), randn(x.shape[-1], device=DEVICE), what=f"{op} {x.stride()}")


@pytest.mark.parametrize("op", OPS)
def test_empty_batch(op):
    for shape in ((0, 64), (2, 0, 64)):
        x = randn(*shape, device=DEVICE).requires_grad_(True)
        w = randn(64, device=DEVICE).requires_grad_(True)
        y = run(op, x, (64,), w)
        assert y.shape == x.shape
        dx, dw = torch.autograd.grad(y, [x, w], torch.ones_like(y))
        assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("op", OPS)
def test_nan_stays_in_its_row(op):
    x = randn(6, 100, device=DEVICE)
    x[2, 17] = float("nan")
    w = randn(100, device=DEVICE).requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    y = run(op, xg, (100,), w)
    ok = torch.tensor([i != 2 for i in range(6)], device=DEVICE)
    assert torch.isnan(y[2]).all()
    assert_close(y[ok], oracle(op, x[ok], (100,), w), TOL[torch.float32], "rows without NaN")
    dy = randn(6, 100, device=DEVICE)
    dx, = torch.autograd.grad(y, [xg], dy)
    assert torch.isnan(dx[2]).all()
    assert_close(dx[ok], oracle_grads(op, dy[ok], x[ok], (100,), w)[0], TOL[torch.float32], "dx without NaN")


@pytest.mark.parametrize("backend", BACKENDS)
def test_offset_rows_keep_their_precision(backend):
    # E[x^2] - E[x]^2 would lose everything here; Welford / two-pass must not
    x = 1e4 + randn(4, 4096, device=DEVICE)
    w, b = randn(4096, device=DEVICE), randn(4096, device=DEVICE)
    y = normkit.layer_norm(x, (4096,), w, b, backend=backend)
    err = assert_close(y, oracle("layer_norm", x, (4096,), w, b), 1e-3, "offset rows")
    assert err < 1e-5, f"offset rows: {err:.3g} (shifted statistics should keep ~1e-7)"


@pytest.mark.parametrize("op", OPS)
def test_weight_gradients_are_bitwise_reproducible(op):
    x = randn(257, 1000, device=DEVICE).requires_grad_(True)
    w = randn(1000, device=DEVICE).requires_grad_(True)
    b = randn(1000, device=DEVICE).requires_grad_(True) if op == "layer_norm" else None
    dy = randn(257, 1000, device=DEVICE)
    leaves = [t for t in (x, w, b) if t is not None]
    first = torch.autograd.grad(run(op, x, (1000,), w, b), leaves, dy)
    second = torch.autograd.grad(run(op, x, (1000,), w, b), leaves, dy)
    for g1, g2 in zip(first, second):
        assert torch.equal(g1, g2)


@pytest.fixture
def looped(monkeypatch):
    """Force the looped (row walked in chunks) kernels at small widths."""
    monkeypatch.setattr(configs, "MAX_TILED_N", 64)
    monkeypatch.setitem(configs.LOOPED, "fwd", (128, 4))
    monkeypatch.setitem(configs.LOOPED, "bwd", (128, 4))
    triton_backend.clear_caches()
    yield
    triton_backend.clear_caches()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [100, 1000, 4099])
@pytest.mark.parametrize("op", OPS)
def test_looped_kernels(op, n, dtype, looped, poison):
    assert configs.row_config("fwd", n, 4).looped
    x = randn(3, n, dtype=dtype, device=DEVICE)
    check_fwd_bwd(op, x, (n,), randn(n, device=DEVICE), randn(n, device=DEVICE), what=f"looped {op} N={n}")


def test_looped_kernels_offset_rows(looped):
    x = 1e4 + randn(3, 4099, device=DEVICE)
    y = normkit.layer_norm(x, (4099,), backend="triton")
    assert_close(y, oracle("layer_norm", x, (4099,)), 1e-5, "looped offset rows")


@pytest.mark.parametrize("offset, rstd_tol", [(slice(0, 1), 2e-6), (slice(0, 128), 2e-5)],
                         ids=["first-element", "first-chunk"])
def test_looped_kernels_offset_first_values(looped, offset, rstd_tol):
    """The looped LayerNorm sums each row's values and squares shifted by its first chunk's mean (128 columns
    here). With the first element 1e4 away from the rest (the variance 1e8 / N), rstd keeps float32's precision
    (shifted by the first element, every shifted value would be near -1e4 and the sum of squares minus the squared
    sum would lose (1e4 / std)^2 ulps, ~1e-4). The shift's worst case, the whole first chunk 1e4 away, puts the
    shifted mean (chunks - 1) standard deviations from zero (the bound the kernel's comment gives): rstd within
    the sums' rounding times the chunk count (up to 5e-6 seen over runs; shifted by the first element: ~1e-4). y carries the rounding of x - 1e4 itself (~1e-5)."""
    x = randn(3, 4099, device=DEVICE)
    x[:, offset] += 1e4
    y, mean, rstd = normkit.layer_norm_fwd(x, (4099,), backend="triton")
    expected = (x.double().var(1, unbiased=False) + 1e-5).rsqrt()
    err = ((rstd.double() - expected).abs() / expected).max().item()
    assert err < rstd_tol, f"looped rstd with offset first values: relative error {err:.3g}"
    assert_close(y, oracle("layer_norm", x, (4099,)), 4e-5, "looped offset first values")


@pytest.mark.parametrize("n", [1000, 1024])
@pytest.mark.parametrize("knob", ["LOOPED_EVICT", "LOOPED_STATIC_N"])
@pytest.mark.parametrize("op", OPS)
def test_looped_hints_and_static_width_keep_the_bits(op, knob, n, looped, monkeypatch):
    """L2 hints on the looped forward's two passes (LOOPED_EVICT) and the width compiled in (LOOPED_STATIC_N,
    as the measured table's looped rows are) change no bit; a width not a multiple of the chunk (1000) and one
    that is (1024: compiled in, LayerNorm's first pass then selects no lane), rows offset by 1e4, a NaN row.
    (The interpreter ignores eviction policies: the bits are a GPU check; the plan's constexprs are checked here.)"""
    # LayerNorm's rows 1e4 off centre, spread wide enough for bfloat16's spacing of 64 there
    x = (randn(5, n, device=DEVICE) * (300.0 if op == "layer_norm" else 1.0) +
         (1e4 if op == "layer_norm" else 0.0)).to(torch.bfloat16)
    x[2, 17] = float("nan")
    w, b = randn(n, device=DEVICE), randn(n, device=DEVICE) if op == "layer_norm" else None
    plain = run(op, x, (n,), w, b)
    monkeypatch.setattr(configs, knob, True)
    triton_backend.clear_caches()
    constexprs = triton_backend._plan("fwd", n, 2, x.device, (op == "rms_norm", True, b is not None, None, None))[1]
    assert (constexprs["LOOP_POLICY_1"], constexprs["LOOP_POLICY_2"], constexprs["N_STATIC"]) == (
        ("evict_last", "evict_first", 0) if knob == "LOOPED_EVICT" else ("", "", n))
    y = run(op, x, (n,), w, b)
    keep = [0, 1, 3, 4]
    assert_close(y[keep], oracle(op, x[keep], (n,), w, b), 1e-2, f"looped {op} N={n} {knob}")
    assert torch.equal(y.nan_to_num(), plain.nan_to_num()) and bool(y[2].isnan().all())
    assert bool(torch.isfinite(y[[0, 1, 3, 4]]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_prefetched_backward(op, dtype):
    """The backward's persistent programs load their next tile before working on the current one
    (configs' 6th value; the GPU table turns it on at 512-8K columns): the oracle's results, and the
    same bits as without it, with the next tile's statistics prefetched too (PREFETCH_STATS) or not.
    300 rows of 100 columns make 10 row blocks, so each program walks several and its prefetch
    crosses blocks; the rows are strided and one holds a NaN."""
    full = randn(300, 130, dtype=dtype, device=DEVICE)
    full[150, 7] = float("nan")
    x = full[:, :100]
    w, b = randn(100, device=DEVICE), randn(100, device=DEVICE) if op == "layer_norm" else None
    dy = randn(300, 100, dtype=dtype, device=DEVICE)
    grads = {}
    saved = configs.PREFETCH_DEFAULT, configs.PREFETCH_STATS
    try:
        for prefetch, stats in ((False, False), (True, False), (True, True)):
            configs.PREFETCH_DEFAULT, configs.PREFETCH_STATS = prefetch, stats
            triton_backend.clear_caches()
            assert configs.row_config("bwd", 100, dtype.itemsize).prefetch == prefetch
            leaves = [t.detach().requires_grad_(True) for t in (x, w, b) if t is not None]
            grads[prefetch, stats] = torch.autograd.grad(run(op, leaves[0], (100,), *leaves[1:]), leaves, dy)
            check_fwd_bwd(op, x[1:150], (100,), w, b, what=f"prefetched {op}")  # dweight/dbias: rows without the NaN
    finally:
        configs.PREFETCH_DEFAULT, configs.PREFETCH_STATS = saved
        triton_backend.clear_caches()
    for other in ((True, False), (True, True)):
        for g0, g1 in zip(grads[False, False], grads[other]):
            assert torch.equal(g0.nan_to_num(), g1.nan_to_num())
    keep = torch.arange(300, device=DEVICE) != 150
    dx = grads[True, True][0]
    assert dx[150].isnan().any() and dx[keep].isfinite().all()
    dx_ref = oracle_grads(op, dy[keep], x[keep], (100,), w, b)[0]
    assert_close(dx[keep], dx_ref, TOL[dtype], f"prefetched {op} dx")


@pytest.mark.parametrize("op", OPS)
def test_inputs_are_not_modified(op):
    x, w, b = randn(5, 100, device=DEVICE), randn(100, device=DEVICE), randn(100, device=DEVICE)
    copies = [t.clone() for t in (x, w, b)]
    check_fwd_bwd(op, x, (100,), w, b)
    for t, c in zip((x, w, b), copies):
        assert torch.equal(t, c)
