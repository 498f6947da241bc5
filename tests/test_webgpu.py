"""The WebGPU backend (seed 000): every WGSL variant against the float64 oracle, on a real adapter,
for LayerNorm, RMSNorm and GroupNorm (NCHW and channels_last) with the fused activations.

In CI the adapter is Mesa's lavapipe (software Vulkan, apt package mesa-vulkan-drivers), whose
subgroup size is 8; test_lavapipe_subgroup_size_4_rerun runs the subgroup tests again in a fresh
process with LP_NATIVE_VECTOR_WIDTH=128, where it is 4. The device is created once per process.
Without wgpu or an adapter that has subgroups and f16 (say a machine without Mesa's Vulkan driver,
where wgpu picks llvmpipe through OpenGL) these tests skip with the reason; under CI=true that is
a failure.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import normkit
from normkit import reference as ref
from normkit.backends import BackendUnavailableError
from normkit.backends.webgpu import shaders

from helpers import TOL, assert_close, missing_tool, onepass_conditioning, randn

OPS = shaders.ROW_OPS
ACTS = [a for a in shaders.activation_codes() if a]
VARIANTS = list(shaders.VARIANTS.values())
N_SCALAR = (1, 31, 129, 768, 4099)
N_VEC4 = (4, 132, 768, 4100)  # the same classes, rounded to whole vec4s


def _rows(n):  # M from 1 to 256; fewer long rows keep lavapipe's share of CI short
    return (1, 256) if n <= 1024 else (1, 64)
TORCH_DTYPE = {"f32": torch.float32, "f16": torch.float16}
STATS_TOL = 2e-5  # mean and rstd are f32 whatever x's type
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def gpu():
    from normkit.backends.webgpu.runner import WebGPUUnavailable, runner

    try:
        gpu = runner()
    except WebGPUUnavailable as e:
        missing_tool(f"the WebGPU tests need an adapter: {e}")
    # wgpu falls back to llvmpipe through OpenGL where Mesa's Vulkan driver is missing: an adapter
    # without subgroups or f16 cannot run what these tests test
    lacks = [why for has, why in ((gpu.has_subgroups, gpu.subgroups_off), (gpu.has_f16, f"the adapter ({gpu.summary}) has no f16"))
             if not has]
    if lacks:
        missing_tool(f"the WebGPU tests need an adapter with subgroups and f16 (Mesa's lavapipe Vulkan driver, "
                     f"apt package mesa-vulkan-drivers, or a real GPU): {'; '.join(lacks)}")
    return gpu


@pytest.fixture
def poison(monkeypatch):
    """Output buffers start as NaN (all bits set, in f32 and f16), so an unwritten element shows."""
    from normkit.backends.webgpu import runner as runner_mod

    def nan_output(self, nbytes):
        return self.device.create_buffer_with_data(data=b"\xff" * runner_mod._padded(nbytes), usage=self._storage)

    monkeypatch.setattr(runner_mod.Runner, "_output", nan_output)


def _eps(op):
    return 1e-5 if op == "layer_norm" else ref.default_rms_eps(torch.float32)


def _oracle(op, x, w, b, eps):
    """(y, mean or None, rstd) in float64."""
    n = x.shape[-1]
    if op == "layer_norm":
        return ref.layer_norm(x, (n,), w, b, eps)
    y, rstd = ref.rms_norm(x, (n,), w, eps)
    return y, None, rstd


def _run(gpu, op, x, w, b, variant):
    """The runner on numpy arrays: (y, mean, rstd) as torch tensors."""
    rms = op == "rms_norm"
    np_b = None if (rms or b is None) else b.numpy()
    y, mean, rstd = gpu.run(x.numpy(), None if w is None else w.numpy(), np_b, _eps(op), rms, variant)
    return torch.from_numpy(y), torch.from_numpy(mean), torch.from_numpy(rstd)


def _needs_missing_feature(gpu, variant, dtype):
    """The exception a run must raise on this adapter, or None when it must run."""
    from normkit.backends.webgpu.runner import FeatureMissing

    if (variant.subgroup and not gpu.has_subgroups) or (dtype == "f16" and not gpu.has_f16):
        return FeatureMissing
    return None


def _cases():
    for v in VARIANTS:
        for n in N_VEC4 if v.width == 4 else N_SCALAR:
            for m in _rows(n):
                yield pytest.param(v, n, m, id=f"{v.name}-N{n}-M{m}")


# ----------------------------------------------------------------------------- kernels vs oracle

@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("variant,n,m", list(_cases()))
def test_variant_matches_oracle(gpu, poison, variant, n, m, op, dtype):
    x = randn(m, n, dtype=TORCH_DTYPE[dtype])
    w, b = randn(n), randn(n)
    missing = _needs_missing_feature(gpu, variant, dtype)
    if missing is not None:  # an adapter without the feature must say so, not run something else
        with pytest.raises(missing):
            _run(gpu, op, x, w, b, variant.name)
        return
    y, mean, rstd = _run(gpu, op, x, w, b, variant.name)
    y_ref, mean_ref, rstd_ref = _oracle(op, x, w, b if op == "layer_norm" else None, _eps(op))
    what = f"{op} {variant.name} {dtype} {m}x{n}"
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, y_ref, TOL[x.dtype], f"{what} y")
    assert_close(rstd, rstd_ref, STATS_TOL, f"{what} rstd")
    if mean_ref is not None:
        _assert_mean_close(mean, mean_ref, rstd_ref, f"{what} mean")


def _assert_mean_close(mean, mean_ref, rstd_ref, what):
    # judged in units of the row's spread (the error it puts into x - mean): a mean near 0 comes
    # from data of size 1, so its own relative error says nothing
    err = ((mean.double() - mean_ref) * rstd_ref).abs().max().item()
    assert err <= STATS_TOL, f"{what}: error {err:.3g} standard deviations > {STATS_TOL:.3g}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("variant", [v.name for v in VARIANTS])
def test_offset_rows_break_only_onepass_layer_norm(gpu, variant, op):
    # rows offset by 1e4 with unit variance: E[x^2]-E[x]^2 loses every significant bit of the
    # variance, so the one-pass LayerNorm must fail; RMSNorm and every other variant must not
    x = randn(8, 768) + 1e4
    y, _, _ = _run(gpu, op, x, None, None, variant)
    err = ref.rel_err(y, _oracle(op, x, None, None, _eps(op))[0])
    if variant == "onepass" and op == "layer_norm":
        assert err > 1e-2, f"onepass LayerNorm on offset rows: expected a large error, got {err:.3g}"
    else:
        assert err <= TOL[torch.float32], f"{variant} {op} on offset rows: relative error {err:.3g}"


@pytest.mark.parametrize("variant", [v.name for v in VARIANTS if v.subgroup])
def test_subgroup_kernels_are_deterministic(gpu, variant):
    # the symmetric merge makes every lane and every subgroup end with the same bits
    x = randn(64, 4100).numpy()
    first = gpu.run(x, None, None, 1e-5, False, variant)
    second = gpu.run(x, None, None, 1e-5, False, variant)
    for a, b in zip(first, second):
        assert np.array_equal(a, b)


def test_subgroup_size_is_the_one_expected(gpu):
    """lavapipe: 8, or what NORMKIT_EXPECT_SUBGROUP_SIZE says (4 in the rerun); elsewhere 4..64."""
    assert gpu.has_subgroups, gpu.subgroups_off
    size = gpu.subgroup_size
    if "llvmpipe" in gpu.summary:
        assert size == int(os.environ.get("NORMKIT_EXPECT_SUBGROUP_SIZE", "8"))
    else:
        assert 4 <= size <= 64 and size & (size - 1) == 0


def test_lavapipe_subgroup_size_4_rerun(gpu):
    """The subgroup tests again in a fresh process where lavapipe's subgroups have 4 lanes."""
    if "llvmpipe" not in gpu.summary:
        pytest.skip(f"LP_NATIVE_VECTOR_WIDTH only changes lavapipe's subgroup size; the adapter is {gpu.summary}")
    env = {**os.environ, "LP_NATIVE_VECTOR_WIDTH": "128", "NORMKIT_EXPECT_SUBGROUP_SIZE": "4"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(Path(__file__)),
           "-k", "subgroup and not rerun and not group_norm"]  # GroupNorm shares the reduction; keep the rerun short
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 40, tail
    assert not re.search(r"\d+ (failed|error|skipped)", done.stdout), tail


# ----------------------------------------------------------------------------- the backend through normkit

@pytest.mark.parametrize("affine", ["none", "weight", "both"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("op", OPS)
def test_backend_matches_oracle(gpu, op, dtype, affine):
    if op == "rms_norm" and affine == "both":
        affine = "weight"
    dt = TORCH_DTYPE[dtype]
    base = randn(3, 5, 800, dtype=dt)
    x = base[..., :768]  # rows with a stride larger than their length
    w = randn(768) if affine != "none" else None
    b = randn(768, dtype=torch.bfloat16) if affine == "both" else None  # parameters of another dtype
    if op == "layer_norm":
        y = normkit.layer_norm(x, (768,), w, b, backend="webgpu")
        y_ref = ref.layer_norm(x, (768,), w, b)[0]
    else:
        y = normkit.rms_norm(x, (768,), w, backend="webgpu")
        y_ref = ref.rms_norm(x, (768,), w)[0]
    assert y.dtype == dt and y.shape == x.shape
    assert_close(y, y_ref, TOL[dt], f"{op} {dtype} {affine}")


def test_kernel_level_api_returns_statistics(gpu):
    x = randn(4, 6, 31)
    y, mean, rstd = normkit.layer_norm_fwd(x, (6, 31), backend="webgpu")
    y_ref, mean_ref, rstd_ref = ref.layer_norm(x, (6, 31))
    assert mean.shape == rstd.shape == (4,) and mean.dtype == rstd.dtype == torch.float32
    assert_close(y, y_ref, TOL[torch.float32], "y")
    _assert_mean_close(mean, mean_ref, rstd_ref, "mean")
    assert_close(rstd, rstd_ref, STATS_TOL, "rstd")
    y, rstd = normkit.rms_norm_fwd(x, (31,), backend="webgpu")
    assert_close(rstd, ref.rms_norm(x, (31,))[1], STATS_TOL, "rms rstd")


def test_more_rows_than_one_grid_dimension(gpu):
    # 65535 workgroups per dimension at most: the host folds the rows into a 2-D grid
    x = randn(65535 + 300, 4)
    assert_close(normkit.layer_norm(x, (4,), backend="webgpu"), ref.layer_norm(x, (4,))[0], TOL[torch.float32], "2-D grid")


def test_backend_picks_welford_for_the_row_length(gpu):
    sub = "_subgroup" if gpu.has_subgroups else ""
    assert gpu.best_variant(768).name == "welford_vec4" + sub
    assert gpu.best_variant(31).name == "welford" + sub


def test_empty_rows_and_empty_batches(gpu):
    assert normkit.layer_norm(randn(0, 8), (8,), backend="webgpu").shape == (0, 8)
    y, mean, rstd = normkit.layer_norm_fwd(randn(3, 0), (0,), backend="webgpu")
    assert y.shape == (3, 0) and torch.isnan(mean).all() and torch.isnan(rstd).all()


def test_requires_grad_is_refused_not_dropped(gpu):
    x = randn(4, 8).requires_grad_()
    with pytest.raises(BackendUnavailableError, match="requires grad"):
        normkit.layer_norm(x, (8,), backend="webgpu")
    w = randn(8).requires_grad_()
    with pytest.raises(BackendUnavailableError, match="requires grad"):
        normkit.rms_norm(randn(4, 8), (8,), w, backend="webgpu")
    with torch.no_grad():  # no gradient wanted: it runs
        normkit.layer_norm(x, (8,), backend="webgpu")


# ----------------------------------------------------------------------------- GroupNorm and activations

# (B, C, S, G): one value per channel, primes, whole vec4s, one channel per group, groups longer than a workgroup
GN_SHAPES = [(1, 4, 1, 2), (2, 6, 7, 3), (2, 32, 64, 8), (2, 8, 12, 8), (2, 64, 256, 4)]


def _group_oracle(x_mem, groups, w, b, eps, channels_last, activation=None):
    """float64 (y in x's memory order, mean [B, G], rstd [B, G]) of x given in memory order."""
    x = torch.from_numpy(x_mem)
    y, mean, rstd = ref.group_norm(x.transpose(1, 2) if channels_last else x, groups, w, b, eps, activation)
    return (y.transpose(1, 2) if channels_last else y), mean, rstd


def _gn_cases():
    for v in VARIANTS:
        for layout in ("nchw", "nhwc"):
            for shape in GN_SHAPES:
                yield pytest.param(v, layout, shape, id=f"{v.name}-{layout}-{'x'.join(map(str, shape))}")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("variant,layout,shape", list(_gn_cases()))
def test_group_norm_variant_matches_oracle(gpu, poison, variant, layout, shape, dtype):
    B, C, S, G = shape
    channels_last = layout == "nhwc"
    offset = 0.0 if variant.name == "onepass" else 3.0  # E[x^2]-E[x]^2 loses digits to any offset
    x = (randn(*((B, S, C) if channels_last else (B, C, S))) + offset).to(TORCH_DTYPE[dtype]).numpy()
    w, b = randn(C), randn(C)
    blocked = shaders.vec4_blocker(variant, "group_norm", 0, S, channels_last)
    if blocked is not None:  # vec4 loads need NCHW and S % 4 == 0: a forced variant says so
        with pytest.raises(ValueError, match=re.escape(blocked)):
            gpu.group_norm(x, G, w.numpy(), b.numpy(), 1e-5, variant.name, channels_last=channels_last)
        return
    missing = _needs_missing_feature(gpu, variant, dtype)
    if missing is not None:
        with pytest.raises(missing):
            gpu.group_norm(x, G, w.numpy(), b.numpy(), 1e-5, variant.name, channels_last=channels_last)
        return
    y, mean, rstd = gpu.group_norm(x, G, w.numpy(), b.numpy(), 1e-5, variant.name, channels_last=channels_last)
    y_ref, mean_ref, rstd_ref = _group_oracle(x, G, w, b, 1e-5, channels_last)
    what = f"group_norm {variant.name} {layout} {shape} {dtype}"
    assert y.dtype == x.dtype and y.shape == x.shape and mean.shape == rstd.shape == (B, G)
    kappa = onepass_conditioning(mean_ref, rstd_ref) if variant.name == "onepass" else 1.0  # its known bound
    assert_close(torch.from_numpy(y), y_ref, TOL[TORCH_DTYPE[dtype]] * kappa, f"{what} y")
    assert_close(torch.from_numpy(rstd), rstd_ref, STATS_TOL * kappa, f"{what} rstd")
    _assert_mean_close(torch.from_numpy(mean), mean_ref, rstd_ref, f"{what} mean")


@pytest.mark.parametrize("activation", ACTS)
def test_activations_match_oracle(gpu, activation):
    """Each activation after the affine, in the row norms (scalar and vec4) and GroupNorm (both layouts);
    inputs scaled so the activations see large positive and negative values too."""
    for op in OPS:
        for n in (37, 768):
            x = randn(5, n) * 4
            w, b = randn(n) * 3, (randn(n) if op == "layer_norm" else None)
            y, _, _ = gpu.run(x.numpy(), w.numpy(), None if b is None else b.numpy(), _eps(op), op == "rms_norm",
                              activation=activation)
            y_ref = (ref.layer_norm(x, (n,), w, b, _eps(op), activation)[0] if op == "layer_norm"
                     else ref.rms_norm(x, (n,), w, _eps(op), activation)[0])
            assert_close(torch.from_numpy(y), y_ref, TOL[torch.float32], f"{op} N={n} {activation}")
    for channels_last, S in ((False, 16), (False, 9), (True, 16)):
        x = randn(2, 12, S) * 4 if not channels_last else randn(2, S, 12) * 4
        w, b = randn(12) * 3, randn(12)
        y, _, _ = gpu.group_norm(x.numpy(), 4, w.numpy(), b.numpy(), 1e-5, channels_last=channels_last,
                                 activation=activation)
        y_ref = _group_oracle(x.numpy(), 4, w, b, 1e-5, channels_last, activation)[0]
        assert_close(torch.from_numpy(y), y_ref, TOL[torch.float32], f"group_norm S={S} cl={channels_last} {activation}")


@pytest.mark.parametrize("variant", [v.name for v in VARIANTS if v.exact])
def test_group_norm_offset_groups_stay_exact(gpu, variant):
    x = (randn(2, 8, 64) + 1e4).numpy()
    y, _, _ = gpu.group_norm(x, 4, variant=variant)
    assert_close(torch.from_numpy(y), _group_oracle(x, 4, None, None, 1e-5, False)[0], TOL[torch.float32], variant)


@pytest.mark.parametrize("memory_format", ["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_backend_group_norm_matches_oracle(gpu, dtype, memory_format):
    """normkit.group_norm(backend="webgpu") on 3-D, 4-D and 5-D inputs; the output keeps the input's
    memory format, and parameters of another dtype are used as float32."""
    dt = TORCH_DTYPE[dtype]
    for shape, G in (((2, 6, 33), 3), ((2, 32, 9, 8), 8), ((1, 8, 3, 4, 5), 2)):
        x = randn(*shape, dtype=dt) + 2
        if memory_format == "channels_last":
            perm = (0,) + tuple(range(2, x.dim())) + (1,)
            x = x.permute(perm).contiguous().permute(tuple(perm.index(i) for i in range(x.dim())))
        w, b = randn(shape[1]), randn(shape[1], dtype=torch.bfloat16)
        for activation in (None, "silu", "mish"):
            y = normkit.group_norm(x, G, w, b, activation=activation, backend="webgpu")
            assert y.dtype == dt and y.shape == x.shape and y.stride() == x.stride()
            what = f"{shape} {dtype} {memory_format} {activation}"
            assert_close(y, ref.group_norm(x, G, w, b, 1e-5, activation)[0], TOL[dt], what)


def test_group_norm_empty_batch(gpu):
    # (past 65535 groups the grid folds as for rows: test_more_rows_than_one_grid_dimension here,
    # and GroupNorm itself in tests/test_web.py, on the same WGSL)
    y, mean, rstd = gpu.group_norm(np.empty((0, 4, 3), np.float32), 2)
    assert y.shape == (0, 4, 3) and mean.shape == rstd.shape == (0, 2)


def test_group_norm_requires_grad_is_refused_and_bad_input_named(gpu):
    with pytest.raises(BackendUnavailableError, match="requires grad"):
        normkit.group_norm(randn(2, 4, 3).requires_grad_(), 2, backend="webgpu")
    with pytest.raises(ValueError, match=r"groups: expected a positive divisor of the channel count C=6, got 4"):
        gpu.group_norm(randn(2, 6, 3).numpy(), 4)
    with pytest.raises(ValueError, match=r"x: expected a 3-D numpy array"):
        gpu.group_norm(randn(2, 6).numpy(), 2)
    with pytest.raises(ValueError, match=r"weight: expected 6 values \(x's channel count\)"):
        gpu.group_norm(randn(2, 6, 3).numpy(), 2, np.ones(3, np.float32))


# ----------------------------------------------------------------------------- clear errors

def test_unsupported_inputs_say_why(gpu):
    with pytest.raises(BackendUnavailableError, match="float32 and float16 inputs, not torch.float64"):
        normkit.layer_norm(randn(2, 8, dtype=torch.float64), (8,), backend="webgpu")
    with pytest.raises(BackendUnavailableError, match="CPU tensors"):
        normkit.layer_norm(torch.empty(2, 8, device="meta"), (8,), backend="webgpu")
    x = randn(2, 31).numpy()
    with pytest.raises(ValueError, match="activation: expected None or one of silu, mish, gelu, gelu_tanh, relu"):
        gpu.run(x, activation="tanh")
    with pytest.raises(ValueError, match=r"x: variant 'welford_vec4' .* divisible by 4, got N=31"):
        gpu.run(x, variant="welford_vec4")
    with pytest.raises(ValueError, match="variant: expected one of"):
        gpu.run(x, variant="threepass")
    with pytest.raises(ValueError, match="x: expected a 2-D numpy array"):
        gpu.run(x[0])
    with pytest.raises(TypeError, match="x: expected float32 or float16"):
        gpu.run(x.astype(np.float64))
    with pytest.raises(ValueError, match=r"weight: expected 31 values"):
        gpu.run(x, np.ones(30, np.float32))


def test_shader_error_is_one_clear_message(gpu):
    from normkit.backends.webgpu.runner import ShaderError

    with pytest.raises(ShaderError, match=r"^WGSL kernel 'broken' failed to compile on .*\n(.|\n)*") as info:
        gpu.compile("broken", "@compute @workgroup_size(1) fn main() { let a: f32 = undefined_name; }")
    assert "undefined_name" in str(info.value)


def test_naga_rejects_the_browser_enable_line(gpu):
    # why the runner and the export differ by exactly one line
    from normkit.backends.webgpu.runner import ShaderError

    with pytest.raises(ShaderError, match="subgroups"):
        gpu.compile("browser", shaders.source("welford_subgroup", "layer_norm", "f32", for_browser=True))


def test_adapter_without_subgroups(gpu):
    """A device made without the subgroup feature: the backend falls back, a forced variant says why."""
    from normkit.backends.webgpu.runner import FeatureMissing, Runner

    plain = Runner(gpu.adapter, features=(shaders.F16_FEATURE,))
    assert not plain.has_subgroups and "'subgroup'" in plain.subgroups_off
    assert plain.best_variant(768).name == "welford_vec4"
    x = randn(3, 768)
    y, _, _ = plain.run(x.numpy())
    assert_close(torch.from_numpy(y), ref.layer_norm(x, (768,))[0], TOL[torch.float32], "no subgroups")
    with pytest.raises(FeatureMissing, match=r"variant 'welford_subgroup' needs subgroups, but the adapter .* has no 'subgroup' feature"):
        plain.run(x.numpy(), variant="welford_subgroup")


def test_no_adapter_is_one_sentence_and_importing_needs_no_wgpu(tmp_path):
    # one fresh process for both (each costs a torch import): building the CLI's parser and
    # importing the backend must not import wgpu; then, with no Vulkan driver, one clear sentence
    code = ("import sys, torch, normkit, normkit.cli, normkit.backends.webgpu.ladder\n"
            "normkit.cli.build_parser()\n"
            "assert 'wgpu' not in sys.modules, 'wgpu was imported'\n"
            "from normkit.backends import webgpu\n"
            "print('WHY', webgpu.why_unavailable(torch.ones(1)))\n"
            "try:\n"
            "    normkit.layer_norm(torch.ones(2, 3), (3,), backend='webgpu')\n"
            "except normkit.BackendUnavailableError as e:\n"
            "    print('ERR', e)\n")
    missing = str(tmp_path / "no_such_icd.json")
    env = {**os.environ, "VK_ICD_FILENAMES": missing, "VK_DRIVER_FILES": missing, "WGPU_BACKEND_TYPE": "Vulkan"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines() if " " in line}
    if importlib.util.find_spec("wgpu") is None:  # (a machine without wgpu: the other reason, as clearly)
        assert "wgpu is not installed (pip install wgpu)" in lines["WHY"]
    else:
        assert "no WebGPU adapter" in lines["WHY"] and "mesa-vulkan-drivers" in lines["WHY"]
    assert lines["ERR"] == f"backend='webgpu' cannot run layer_norm: {lines['WHY']}."



# ----------------------------------------------------------------------------- export and ladder

def test_export_wgsl_writes_what_the_runner_compiles(gpu, tmp_path):
    from normkit.cli import main

    assert main(["export-wgsl", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.glob("*.wgsl"))
    assert len(files) == len(VARIANTS) * len(shaders.OPS) * len(shaders.DTYPES)
    for v in VARIANTS:
        for op in shaders.OPS:
            for dtype in shaders.DTYPES:
                text = (tmp_path / f"{op}_{v.name}_{dtype}.wgsl").read_text()
                lines = text.splitlines(keepends=True)
                assert ("enable subgroups;\n" in lines) == v.subgroup
                assert ("enable f16;\n" in lines) == (dtype == "f16")
                # the export is the tested shader plus the browser's enable line, nothing else
                assert "".join(line for line in lines if line != "enable subgroups;\n") == shaders.source(v, op, dtype)
    readme = (tmp_path / "README.md").read_text()
    for needle in ("binding", "dispatchWorkgroups", "65535", str(shaders.WORKGROUP_SIZE), "shader-f16", '"subgroups"'):
        assert needle in readme


def test_ladder_quick_table(gpu, tmp_path, capsys):
    import argparse

    from normkit.backends.webgpu import ladder

    args = argparse.Namespace(backend="webgpu", quick=True, plot=False, out=str(tmp_path))
    assert ladder.run(args) == 0
    out = capsys.readouterr().out
    assert gpu.summary in out
    rows = [line for line in out.splitlines() if line.startswith("| layer_norm | f32 | 64 x 768 |")]
    assert [r.split(" | ")[3] for r in rows] == [v.name for v in VARIANTS]
    for r in rows:
        cells = r.split(" | ")
        if shaders.VARIANTS[cells[3]].subgroup and not gpu.has_subgroups:
            assert "n/a: variant" in cells[4]
            continue
        assert "All close - AVGE=" in cells[7]
        assert ("samples not close" in cells[8]) == (cells[3] == "onepass"), r
    csv_text = (tmp_path / "webgpu_ladder.csv").read_text()
    assert csv_text.startswith("op,dtype,M,N,variant,time_us") and (tmp_path / "webgpu_ladder.md").exists()
