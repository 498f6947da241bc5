"""GPU-only cases: full-size shapes, the widest rows, a tensor above 2**31 elements, and
bitwise reproducibility across many persistent programs. The CPU suite runs the same checks on
small shapes; these run them where only a GPU has the memory and the speed."""
import pytest
import torch

import normkit
from normkit import reference as ref

from helpers import DTYPES, TOL, assert_close, check_fwd_bwd, oracle, randn

pytestmark = pytest.mark.gpu
OPS = ["layer_norm", "rms_norm"]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("n", [5000, 8192, 16384, 32768, 65536, 131072, 262144])  # 5000, 8192, 32768: looped rows
@pytest.mark.parametrize("op", OPS)
def test_wide_rows(op, n, dtype, poison):
    x = randn(37, n, dtype=dtype, device="cuda")
    check_fwd_bwd(op, x, (n,), randn(n, device="cuda"), randn(n, device="cuda"), what=f"{op} N={n}")


@pytest.mark.parametrize("n", [32, 256, 768, 4096])
@pytest.mark.parametrize("op", OPS)
def test_rows_to_fill_the_gpu(op, n, poison):
    m = (1 << 24) // n  # 16M elements: every SM busy for many waves
    x = randn(m, n, dtype=torch.bfloat16, device="cuda")
    check_fwd_bwd(op, x, (n,), randn(n, device="cuda"), randn(n, device="cuda"), what=f"{op} M={m} N={n}")


@pytest.mark.parametrize("op", OPS)
def test_more_than_2_31_elements(op):
    n = 65536
    m = (1 << 31) // n + 3  # the last rows start beyond element 2**31
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    w = randn(n, device="cuda")
    y = normkit.layer_norm(x, (n,), w) if op == "layer_norm" else normkit.rms_norm(x, (n,), w)
    for rows in (slice(0, 4), slice(m - 4, m)):
        assert_close(y[rows], oracle(op, x[rows], (n,), w), TOL[torch.bfloat16], f"rows {rows}")
    # backward: dx of the last rows and dweight over all rows
    dy = torch.randn_like(x)
    xg, wg = x.requires_grad_(True), w.requires_grad_(True)
    y = normkit.layer_norm(xg, (n,), wg) if op == "layer_norm" else normkit.rms_norm(xg, (n,), wg)
    dx, dw = torch.autograd.grad(y, [xg, wg], dy)
    del y
    tail = slice(m - 4, m)
    grads_ref = ref.layer_norm_backward if op == "layer_norm" else ref.rms_norm_backward
    dx_ref = grads_ref(dy[tail], x[tail].detach(), (n,), w.detach())[0]
    assert_close(dx[tail], dx_ref, TOL[torch.bfloat16], "dx beyond 2**31")
    with torch.no_grad():
        dw_ref = torch.zeros(n, dtype=torch.float64, device="cuda")
        for start in range(0, m, 2048):  # dweight = sum over rows of dy * xhat, in float64 chunks
            rows = slice(start, min(start + 2048, m))
            xr = x[rows].double()
            if op == "layer_norm":
                xr = xr - xr.mean(-1, keepdim=True)
            xhat = xr * torch.rsqrt(xr.square().mean(-1, keepdim=True) + (1e-5 if op == "layer_norm" else torch.finfo(torch.float32).eps))
            dw_ref += (dy[rows].double() * xhat).sum(0)
        assert_close(dw, dw_ref, 1e-4, "dweight over 2**31 elements")


@pytest.mark.parametrize("n", [256, 4096, 65536])
@pytest.mark.parametrize("op", OPS)
def test_gradients_bitwise_reproducible_at_scale(op, n):
    m = (1 << 23) // n
    x = randn(m, n, dtype=torch.bfloat16, device="cuda").requires_grad_(True)
    w = randn(n, device="cuda").requires_grad_(True)
    dy = randn(m, n, dtype=torch.bfloat16, device="cuda")
    f = normkit.layer_norm if op == "layer_norm" else normkit.rms_norm
    g1 = torch.autograd.grad(f(x, (n,), w), [x, w], dy)
    g2 = torch.autograd.grad(f(x, (n,), w), [x, w], dy)
    assert torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1])
