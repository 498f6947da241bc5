"""The user-facing contract: modules, kernel-level API, backend selection and bad-input errors."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import normkit
from normkit import reference as ref

from conftest import DEVICE
from helpers import TOL, assert_close, randn


# ----------------------------------------------------------------------------- modules

@pytest.mark.parametrize("kwargs", [{}, {"elementwise_affine": False}, {"bias": False}, {"eps": 1e-3}])
def test_layer_norm_module_is_a_torch_drop_in(kwargs):
    theirs = torch.nn.LayerNorm((3, 16), **kwargs)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(randn(*p.shape))
    ours = normkit.LayerNorm((3, 16), **kwargs)
    assert isinstance(ours, torch.nn.LayerNorm)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = randn(4, 3, 16)
    assert_close(ours.to(DEVICE)(x.to(DEVICE)), theirs(x).detach(), TOL[torch.float32], "module")


@pytest.mark.parametrize("kwargs", [{}, {"elementwise_affine": False}, {"eps": 1e-3}])
def test_rms_norm_module_is_a_torch_drop_in(kwargs):
    theirs = torch.nn.RMSNorm(16, **kwargs)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(randn(*p.shape))
    ours = normkit.RMSNorm(16, **kwargs)
    assert isinstance(ours, torch.nn.RMSNorm)
    ours.load_state_dict(theirs.state_dict())
    x = randn(4, 16)
    assert_close(ours.to(DEVICE)(x.to(DEVICE)), theirs(x).detach(), TOL[torch.float32], "module")


def test_module_gradients_flow_to_parameters():
    m = normkit.LayerNorm(32, device=DEVICE)
    with torch.no_grad():
        m.weight.copy_(randn(32))
        m.bias.copy_(randn(32))
    x = randn(6, 32, device=DEVICE, ).requires_grad_(True)
    dy = randn(6, 32, device=DEVICE)
    m(x).backward(dy)
    dx_ref, dw_ref, db_ref = ref.layer_norm_backward(dy, x, (32,), m.weight, m.bias)
    assert_close(x.grad, dx_ref, TOL[torch.float32], "dx")
    assert_close(m.weight.grad, dw_ref, TOL[torch.float32], "dweight")
    assert_close(m.bias.grad, db_ref, TOL[torch.float32], "dbias")


def test_module_constructor_dtype_and_backend():
    m = normkit.RMSNorm(8, dtype=torch.bfloat16, backend="torch")
    assert m.weight.dtype == torch.bfloat16 and m.backend == "torch"
    assert m(randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- semantics

def test_rms_norm_default_eps_is_torchs():
    # eps=None: torch uses the compute type's machine epsilon (float32's for bf16 input)
    x = randn(3, 64, dtype=torch.bfloat16) * 1e-3
    for backend in ("torch", "triton"):
        ours = normkit.rms_norm(x.to(DEVICE), (64,), backend=backend)
        assert_close(ours, F.rms_norm(x.float(), (64,)).to(torch.bfloat16), TOL[torch.bfloat16], backend)


def test_float64_runs_on_the_torch_path():
    x = randn(3, 50, dtype=torch.float64)
    w = randn(50, dtype=torch.float64)
    y = normkit.layer_norm(x, 50, w)
    assert y.dtype == torch.float64
    assert_close(y, ref.layer_norm(x, (50,), w)[0], 1e-13, "float64")
    y = normkit.rms_norm(x, [50], w, backend="torch")
    assert_close(y, ref.rms_norm(x, (50,), w)[0], 1e-13, "float64 rms")


def test_torch_path_matches_torch_functional():
    x, w, b = randn(7, 33), randn(33), randn(33)
    assert_close(normkit.layer_norm(x, (33,), w, b, backend="torch"), F.layer_norm(x, (33,), w, b), 1e-6, "ln")
    assert_close(normkit.rms_norm(x, (33,), w, 1e-6, backend="torch"), F.rms_norm(x, (33,), w, 1e-6), 1e-6, "rms")


# ----------------------------------------------------------------------------- kernel-level API

@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_layer_norm_kernel_api(backend):
    x = randn(2, 3, 40, dtype=torch.bfloat16, device=DEVICE)
    w, b = randn(40, device=DEVICE), randn(40, device=DEVICE)
    y, mean, rstd = normkit.layer_norm_fwd(x, 40, w, b, backend=backend)
    y_ref, mean_ref, rstd_ref = ref.layer_norm(x, (40,), w, b)
    assert mean.shape == rstd.shape == (2, 3) and mean.dtype == rstd.dtype == torch.float32
    assert_close(y, y_ref, TOL[torch.bfloat16], "y")
    assert_close(mean, mean_ref, 1e-6, "mean")
    assert_close(rstd, rstd_ref, 1e-6, "rstd")
    dy = randn(2, 3, 40, dtype=torch.bfloat16, device=DEVICE)
    dx, dw, db = normkit.layer_norm_bwd(dy, x, w, mean, rstd, backend=backend)
    dx_ref, dw_ref, db_ref = ref.layer_norm_backward(dy, x, (40,), w, b)
    assert dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32
    assert_close(dx, dx_ref, TOL[torch.bfloat16], "dx")
    assert_close(dw, dw_ref, 1e-5, "dweight")
    assert_close(db, db_ref, 1e-5, "dbias")
    dx2, dw2, db2 = normkit.layer_norm_bwd(dy, x, None, mean, rstd, backend=backend)
    assert dw2 is None
    assert_close(dx2, ref.layer_norm_backward(dy, x, (40,), None, None)[0], TOL[torch.bfloat16], "dx no weight")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rms_norm_kernel_api(backend):
    x = randn(5, 4, 6, device=DEVICE)
    w = randn(4, 6, device=DEVICE)
    y, rstd = normkit.rms_norm_fwd(x, (4, 6), w, 1e-6, backend=backend)
    y_ref, rstd_ref = ref.rms_norm(x, (4, 6), w, 1e-6)
    assert rstd.shape == (5,) and rstd.dtype == torch.float32
    assert_close(y, y_ref, TOL[torch.float32], "y")
    assert_close(rstd, rstd_ref, 1e-6, "rstd")
    dy = randn(5, 4, 6, device=DEVICE)
    dx, dw = normkit.rms_norm_bwd(dy, x, w, rstd, backend=backend)
    dx_ref, dw_ref = ref.rms_norm_backward(dy, x, (4, 6), w, 1e-6)
    assert dw.shape == (4, 6)
    assert_close(dx, dx_ref, TOL[torch.float32], "dx")
    assert_close(dw, dw_ref, TOL[torch.float32], "dweight")


# ----------------------------------------------------------------------------- bad input

x16 = randn(4, 16)


@pytest.mark.parametrize("call, arg", [
    (lambda: normkit.layer_norm(x16, 15), "normalized_shape"),
    (lambda: normkit.layer_norm(x16, (4, 16, 1)), "normalized_shape"),
    (lambda: normkit.layer_norm(x16, "16"), "normalized_shape"),
    (lambda: normkit.rms_norm(x16, (8,)), "normalized_shape"),
    (lambda: normkit.layer_norm(x16, 16, randn(15)), "weight"),
    (lambda: normkit.layer_norm(x16, 16, None, randn(4, 16)), "bias"),
    (lambda: normkit.rms_norm(x16, 16, randn(16, 1)), "weight"),
    (lambda: normkit.layer_norm(torch.ones(4, 16, dtype=torch.int32), 16), "x"),
    (lambda: normkit.layer_norm(torch.ones(4, 16, dtype=torch.complex64), 16), "x"),
    (lambda: normkit.layer_norm(x16, 16, torch.ones(16, dtype=torch.int64)), "weight"),
    (lambda: normkit.layer_norm(x16, 16, torch.empty(16, device="meta")), "weight"),
    (lambda: normkit.rms_norm(x16, 16, None, "1e-5"), "eps"),  # torch takes any real eps (negative, NaN), not a string
    (lambda: normkit.layer_norm(x16, 16, eps=None), "eps"),
    (lambda: normkit.layer_norm(x16, 16, backend="cudnn"), "backend"),
    (lambda: normkit.layer_norm([1.0, 2.0], 2), "x"),
    (lambda: normkit.layer_norm_bwd(x16, x16[:, :8], None, x16[:, 0], x16[:, 0]), "dy"),
    (lambda: normkit.rms_norm_bwd(x16, x16, None, x16[:3, 0]), "rstd"),
])
def test_bad_input_names_the_argument(call, arg):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert arg in str(info.value), str(info.value)


def test_forced_triton_on_cpu_without_interpreter_says_how():
    code = textwrap.dedent("""
        import torch, normkit
        try:
            normkit.layer_norm(torch.randn(2, 8), 8, backend="triton")
        except normkit.BackendUnavailableError as e:
            print("RAISED:", e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "RAISED:" in out.stdout, out.stdout + out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout


def test_forced_triton_rejects_float64_without_falling_back():
    with pytest.raises(normkit.BackendUnavailableError, match="float64"):
        normkit.layer_norm(randn(2, 8, dtype=torch.float64, device=DEVICE), 8, backend="triton")


# ----------------------------------------------------------------------------- backend interface

# the entry points of normkit.backends' docstring, parameter by parameter (name, kind)
_INTERFACE = {
    "row_norm_fwd": "x weight bias eps rms activation store_stats",
    "row_norm_bwd": "dy x weight mean rstd rms dweight_dtype dbias_dtype *bias *activation",
    "row_norm_fwd_fused": "x weight bias eps rms *activation *store_stats *residual *h_dtype *store_h *weight_offset "
                          "*out_dtype *out_scale *want_amax *mod_scale *mod_shift *gate",
    "row_norm_bwd_fused": "dy x weight mean rstd rms dweight_dtype dbias_dtype *bias *activation *weight_offset *dh "
                          "*dx_dtype *dres_dtype *mod_scale *mod_shift *dmod_dtypes *gate",
    "group_norm_fwd": "x num_groups weight bias eps activation",
    "group_norm_bwd": "dy x num_groups weight bias mean rstd activation dweight_dtype dbias_dtype *eps",
}


@pytest.mark.parametrize("name", ["torch", "triton", "cuda", "webgpu"])
def test_every_backend_has_the_interface_signatures(name):
    """functional.py calls every backend the same way (e.g. store_stats=False for inference), so a
    backend whose signature drifts fails here, on CPU, before a GPU run finds it."""
    import inspect
    from normkit import backends
    mod = backends.get(name)
    assert isinstance(mod.NAME, str) and callable(mod.why_unavailable)
    present = [f for f in _INTERFACE if hasattr(mod, f)]
    assert "row_norm_fwd" in present
    for f in present:
        params = inspect.signature(getattr(mod, f)).parameters.values()
        got = " ".join(("*" if p.kind is p.KEYWORD_ONLY else "") + p.name for p in params)
        assert got == _INTERFACE[f], f"backend {name!r}: {f}({got})"
