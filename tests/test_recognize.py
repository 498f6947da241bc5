"""normkit.patch recognising norm modules by what their forward computes, not by their code (issue 23;
normkit/patch.py, "Recognising a forward by its computation"): each class below, from transformers and
diffusers or defined here, is traced on probe inputs and matched against the computations of normkit's
styles. Checked: the patched module computes what the module computes (outputs and gradients of x and
the parameters, in fp32/bf16/fp16 with fp32 and low-precision parameters); a renamed copy is
recognised; a subtly different computation is not patched, and the report says where it differs; a
call with dtypes that were not proven runs the module's own forward; tiny T5 encoders have every norm
patched. CPU, small shapes: all of it runs on CI.
"""
import copy
import importlib
import inspect
import re

import pytest
import torch
from torch import nn

import normkit
from normkit import reference as ref

from conftest import DEVICE, HAS_CUDA

patch_mod = importlib.import_module("normkit.patch")  # the module; normkit.patch is the function

_need = (lambda name: pytest.importorskip(name)) if HAS_CUDA else importlib.import_module
transformers = _need("transformers")
diffusers = _need("diffusers")

pytestmark = pytest.mark.usefixtures("exact_fp32")  # no TF32 on a GPU

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def _hf(module: str, name: str):
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def _df(module: str, name: str):
    return getattr(importlib.import_module(f"diffusers.{module}"), name)


# ----------------------------------------------------------------------------- the classes

# id -> (factory, the style patch must find, x's shape)
ROWS = (4, 16, 64)
CASES = {
    # the transformers families of the model zoo (tests/test_models.py) and the styles known before
    "llama": (lambda: _hf("llama.modeling_llama", "LlamaRMSNorm")(64), "llama", ROWS),
    "qwen2": (lambda: _hf("qwen2.modeling_qwen2", "Qwen2RMSNorm")(64), "llama", ROWS),
    "qwen3": (lambda: _hf("qwen3.modeling_qwen3", "Qwen3RMSNorm")(64), "llama", ROWS),
    "qwen3_head": (lambda: _hf("qwen3.modeling_qwen3", "Qwen3RMSNorm")(16), "llama", (2, 5, 4, 16)),
    "mistral": (lambda: _hf("mistral.modeling_mistral", "MistralRMSNorm")(64), "llama", ROWS),
    "mixtral": (lambda: _hf("mixtral.modeling_mixtral", "MixtralRMSNorm")(64), "llama", ROWS),
    "phi3": (lambda: _hf("phi3.modeling_phi3", "Phi3RMSNorm")(64), "llama", ROWS),
    "mamba2": (lambda: _hf("mamba2.modeling_mamba2", "Mamba2RMSNorm")(64), "llama", ROWS),
    "gemma": (lambda: _hf("gemma.modeling_gemma", "GemmaRMSNorm")(64), "gemma", ROWS),
    "gemma2": (lambda: _hf("gemma2.modeling_gemma2", "Gemma2RMSNorm")(64), "gemma", ROWS),
    "gemma3": (lambda: _hf("gemma3.modeling_gemma3", "Gemma3RMSNorm")(64), "gemma", ROWS),
    "olmo2": (lambda: _hf("olmo2.modeling_olmo2", "Olmo2RMSNorm")(64), "olmo2", ROWS),
    # new: T5 (Flan-T5 is T5), mT5, UMT5; Cohere (and its per-head q/k norms)
    "t5": (lambda: _hf("t5.modeling_t5", "T5LayerNorm")(64), "t5", ROWS),
    "mt5": (lambda: _hf("mt5.modeling_mt5", "MT5LayerNorm")(64), "t5", ROWS),
    "umt5": (lambda: _hf("umt5.modeling_umt5", "UMT5LayerNorm")(64), "t5", ROWS),
    "cohere": (lambda: _hf("cohere.modeling_cohere", "CohereLayerNorm")(64), "cohere", ROWS),
    "cohere_per_head": (lambda: _hf("cohere.modeling_cohere", "CohereLayerNorm")((4, 16)), "cohere", (2, 5, 4, 16)),
    # diffusers
    "diffusers_rms": (lambda: _df("models.normalization", "RMSNorm")(64, eps=1e-6), "t5", ROWS),
    "diffusers_rms_bias": (lambda: _df("models.normalization", "RMSNorm")(64, eps=1e-6, bias=True), "t5", ROWS),
    "diffusers_rms_no_affine": (lambda: _df("models.normalization", "RMSNorm")(64, eps=1e-6, elementwise_affine=False),
                                "llama", ROWS),
    "diffusers_mochi_rms": (lambda: _df("models.normalization", "MochiRMSNorm")(64, eps=1e-6), "olmo2", ROWS),
    "diffusers_t5_film": (lambda: _df("models.transformers.t5_film_transformer", "T5LayerNorm")(64), "t5", ROWS),
    "diffusers_fp32_layer_norm": (lambda: _df("models.normalization", "FP32LayerNorm")(64), "ln_fp32", ROWS),
    "diffusers_fp32_layer_norm_no_affine": (
        lambda: _df("models.normalization", "FP32LayerNorm")(64, elementwise_affine=False), "ln_fp32", ROWS),
    "diffusers_sd_cascade": (lambda: _df("models.unets.unet_stable_cascade", "SDCascadeLayerNorm")(64, eps=1e-6),
                             "ln_channels", (2, 64, 3, 5)),
}

# (x dtype, parameter dtype): fp32 and low-precision parameters
DTYPES = [(FP32, FP32), (BF16, FP32), (BF16, BF16), (FP16, FP32), (FP16, FP16), (FP32, BF16)]
_IDS = [f"x_{patch_mod._SHORT[x]}-w_{patch_mod._SHORT[w]}" for x, w in DTYPES]


def _build(case: str, p_dtype=FP32):
    factory, style, shape = CASES[case]
    torch.manual_seed(0)
    m = factory()
    with torch.no_grad():  # non-trivial parameters: 1 and 0 would hide a weight or bias applied wrongly
        for name, p in m.named_parameters():
            center = 0.0 if name == "bias" or style == "gemma" else 1.0
            p.copy_(center + 0.5 * torch.randn(p.shape))
    return m.to(DEVICE, p_dtype), style, shape


def _proven(m, x) -> bool:
    """Whether the patched module m runs normkit for x (not its own forward)."""
    plan = type(m)._normkit_plan
    ps = m._parameters
    key = (x.dtype, m.training, *[None if ps[n] is None else ps[n].dtype for n in plan.param_names])
    return key in plan.table and plan.fits(x)


def _assert_computes_like(ours, theirs, x, bitwise: bool, truth=None):
    """ours(x) is theirs(x): the same dtype; fp32 to 1e-6 (reduction order), bf16/fp16 up to a rare
    last-bit difference (tests/test_patch.py's contract); bitwise where asked. Gradients of x and of
    each parameter as close as their dtype allows; where the module's own gradient is rounded inside
    (torch's CPU layer_norm with a bf16/fp16 x and an fp32 weight), normkit's must be at least as close
    to `truth` (the module in float64) as the module's."""
    x = x.detach().requires_grad_(True)
    y, y_ref = ours(x), theirs(x)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    if bitwise:
        assert torch.equal(y, y_ref), f"{(y != y_ref).float().mean().item():.2%} of outputs differ"
    elif y.dtype == FP32:  # fp32 out (an fp32 weight with a bf16 x too): reduction order and rsqrt's last bit
        assert ref.rel_err(y, y_ref) <= 1e-6
    else:
        differ = (y != y_ref).float().mean().item()
        assert differ <= 0.002, f"{differ:.2%} of outputs differ"
        ulp = torch.finfo(y.dtype).eps * y_ref.detach().abs().float().clamp_min(1e-3)
        assert ((y - y_ref).detach().abs().float() <= ulp).all()
    dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(5)).to(y_ref)
    params = [n for n, p in theirs.named_parameters()]
    got = torch.autograd.grad(y, [x] + [p for _, p in ours.named_parameters()], dy)
    want = torch.autograd.grad(y_ref, [x] + [p for _, p in theirs.named_parameters()], dy)
    exact = dict(zip(["x"] + params, want))
    if truth is not None:
        t = copy.deepcopy(truth).double()
        xt = x.detach().double().requires_grad_(True)
        exact = dict(zip(["x"] + params, torch.autograd.grad(t(xt), [xt] + list(t.parameters()), dy.double())))
    for name, g, g_ref in zip(["x"] + params, got, want):
        assert g.dtype == g_ref.dtype, name
        tol = 1e-5 if (x.dtype if name == "x" else g.dtype) == FP32 else 1e-2
        err = ref.rel_err(g, g_ref)
        if truth is not None and err > tol:
            err_ours, err_theirs = ref.rel_err(g, exact[name]), ref.rel_err(g_ref, exact[name])
            assert err_ours <= 1.1 * err_theirs + 1e-6, f"gradient of {name}: {err_ours:.3g} from the truth, " \
                                                        f"the module's own {err_theirs:.3g}"
            continue
        assert err <= tol, f"gradient of {name}: {err:.3g}"


@pytest.mark.parametrize("x_dtype, p_dtype", DTYPES, ids=_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_recognised_class_computes_what_it_computes(case, x_dtype, p_dtype):
    theirs, style, shape = _build(case, p_dtype)
    ours = copy.deepcopy(theirs)
    report = normkit.patch(ours, fuse=False)
    assert report == {"": type(theirs)} and not report.skipped, str(report)
    assert type(ours).forward is patch_mod._recognised_forward
    assert {s.name for s, _ in type(ours)._normkit_plan.table.values()} == {style}
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(2))).to(DEVICE, x_dtype)
    try:
        theirs(x)
    except RuntimeError as e:  # torch's own layer_norm refuses fp32 x with a bf16 weight on the CPU:
        if DEVICE != "cpu" and _proven(ours, x):
            # proven on the CPU, where torch computes it (CUDA's layer_norm refuses bf16 x with an fp32
            # weight on a permuted view): normkit computes what the module computes on the CPU
            y = ours(x)
            y_cpu = copy.deepcopy(theirs).cpu()(x.cpu())
            assert y.dtype == y_cpu.dtype and ref.rel_err(y.cpu(), y_cpu) <= 1e-2
            return
        with pytest.raises(RuntimeError, match=re.escape(str(e)[:30])):  # the module's own forward refuses too
            ours(x)
        assert not _proven(ours, x)
        return
    assert _proven(ours, x)
    # the RMS styles run on the torch backend (the CPU) as the op sequence the module writes
    bitwise = DEVICE == "cpu" and style in ("llama", "gemma", "olmo2", "t5")
    # torch's layer_norm (a torch op inside the module) rounds a mixed-dtype weight gradient on the CPU
    truth = theirs if style == "ln_channels" and x_dtype != FP32 else None
    _assert_computes_like(ours, theirs, x, bitwise, truth)


_ONE_STYLE_CLASSES = ("llama", "gemma", "olmo2", "t5", "cohere", "diffusers_fp32_layer_norm")


@pytest.mark.parametrize("case", ["llama", "gemma", "olmo2", "t5", "cohere", "diffusers_rms", "diffusers_mochi_rms",
                                  "diffusers_fp32_layer_norm"])
def test_style_of_names_the_style_for_modules_and_classes(case):
    m, style, _ = _build(case)
    assert patch_mod._style_of(m) == style  # every dtype combination, train and eval: one style
    if case in _ONE_STYLE_CLASSES:  # a class answers from the modules of it probed, where they agree
        assert patch_mod._style_of(type(m)) == style
    assert patch_mod._eps_of(m) == getattr(m, "variance_epsilon", getattr(m, "eps", None))
    normkit.patch(m, fuse=False)
    assert patch_mod._style_of(m) == patch_mod._style_of(type(m)) == style  # patched: from its plan
    assert patch_mod._STYLE_OPS[style] in ("rms_norm", "layer_norm")


def test_torch_modules_keep_their_class_match():
    assert [patch_mod._style_of(c) for c in (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)] == ["ln", "rms", "gn"]
    assert patch_mod._style_of(nn.LayerNorm(8)) == "ln"
    report = normkit.patch(nn.Sequential(nn.LayerNorm(8), nn.RMSNorm(8)), fuse=False)
    assert all(not hasattr(type(m), "_normkit_plan") for m in report.values())


# ----------------------------------------------------------------------------- renamed copies

class TextEncoderRootMeanSquare(nn.Module):
    """T5LayerNorm's code under another name, with eps called `eps`."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class RewrittenLlamaNorm(nn.Module):
    """Llama's computation spelled otherwise: float(), a helper, the weight on the right, eps first."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-5

    def _rstd(self, h):
        return torch.rsqrt(self.variance_epsilon + torch.mean(h ** 2, dim=-1, keepdim=True))

    def forward(self, x):
        h = x.float()
        return (h * self._rstd(h)).type_as(x) * self.weight


class CopiedCohereNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight.to(torch.float32) * hidden_states
        return hidden_states.to(input_dtype)


@pytest.mark.parametrize("cls, style", [(TextEncoderRootMeanSquare, "t5"), (RewrittenLlamaNorm, "llama"),
                                        (CopiedCohereNorm, "cohere")])
@pytest.mark.parametrize("x_dtype, p_dtype", [(FP32, FP32), (BF16, FP32), (BF16, BF16), (FP16, FP16)],
                         ids=["fp32", "bf16-fp32w", "bf16", "fp16"])
def test_renamed_copy_is_recognised(cls, style, x_dtype, p_dtype):
    torch.manual_seed(1)
    theirs = cls(64)
    with torch.no_grad():
        theirs.weight.copy_(1 + 0.5 * torch.randn(64))
    theirs = theirs.to(DEVICE, p_dtype)
    ours = copy.deepcopy(theirs)
    # not named *Norm*: recognised all the same (a leaf with an eps whose forward computes a style)
    assert normkit.patch(ours, fuse=False) == {"": cls} and patch_mod._style_of(ours) == style
    x = (3 * torch.randn(ROWS)).to(DEVICE, x_dtype)
    _assert_computes_like(ours, theirs, x, bitwise=DEVICE == "cpu" and style != "cohere")


# ----------------------------------------------------------------------------- what is not patched

class _Base(nn.Module):
    def __init__(self, n=64):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-6


class EpsOutsideRMSNorm(_Base):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * (torch.rsqrt(variance) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class OtherDimRMSNorm(_Base):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-2, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RoundsVarianceRMSNorm(_Base):
    """Rounds the variance to bf16 before the rsqrt: a rounding no style has, at every dtype."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True).to(torch.bfloat16)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DetachedRMSNorm(_Base):
    """Llama's values, but no gradient through the statistics: the same forward, another backward."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True).detach()
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w):
        return w * h

    @staticmethod
    def backward(ctx, g):
        return g, None  # a custom backward that differs from autograd's


class CustomFunctionRMSNorm(_Base):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return _Scale.apply(hidden_states.to(input_dtype), self.weight)


class DataDependentRMSNorm(_Base):
    def forward(self, hidden_states):
        if hidden_states.abs().max() > 1e4:  # the probe cannot say what happens on other data
            hidden_states = hidden_states / 1e4
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class InPlaceRMSNorm(_Base):
    def forward(self, hidden_states):
        hidden_states.mul_(1.0)  # writes into its input
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(input_dtype)


@pytest.mark.parametrize("cls, why", [
    (EpsOutsideRMSNorm, r"computes add\(rsqrt\(mean\(pow\(x.to\(fp32\), 2\), \[-1\], True\)\), 1e-06\) where the "
                        r"closest style, llama, computes "
                        r"rsqrt\(add\(mean\(pow\(x.to\(fp32\), 2\), \[-1\], True\), 1e-06\)\)"),
    (OtherDimRMSNorm, r"computes mean\(pow\(x.to\(fp32\), 2\), \[-2\], True\) where the closest style, llama, computes "
                      r"mean\(pow\(x.to\(fp32\), 2\), \[-1\], True\)"),
    (RoundsVarianceRMSNorm, r"computes .*mean\(pow\(x.to\(fp32\), 2\), \[-1\], True\).to\(bf16\).* where the closest "
                            r"style, llama, computes"),
    (DetachedRMSNorm, r"computes .*detach\(mean.* where the closest style, llama, computes"),
    (CustomFunctionRMSNorm, r"\[grad disabled\]"),
    (DataDependentRMSNorm, r"reads a tensor's value"),
    (InPlaceRMSNorm, r"writes into its input"),
])
def test_a_different_computation_is_not_patched_and_the_report_says_where(cls, why):
    model = nn.Sequential(cls())
    report = normkit.patch(model, fuse=False)
    assert report == {} and type(model[0]) is cls
    assert "not one normkit knows" in report.skipped["0"]
    assert re.search(why, report.skipped["0"]), report.skipped["0"]
    assert patch_mod._style_of(model[0]) is None


class RoundsToBf16RMSNorm(_Base):
    """Llama's code with the rounding fixed to bf16: Llama's computation only where x is bf16."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(torch.bfloat16)


def test_a_computation_equal_for_some_dtypes_only_is_patched_for_those():
    theirs = RoundsToBf16RMSNorm().to(DEVICE)
    ours = copy.deepcopy(theirs)
    report = normkit.patch(ours, fuse=False)
    assert set(report) == {""} and patch_mod._style_of(ours) is None
    assert "[for x bf16 weight bf16; x bf16 weight fp16; x bf16 weight fp32]" in report.computes[""]
    assert "run its own forward" in report.computes[""]
    x = torch.randn(ROWS).to(DEVICE)
    for x_dtype in (FP32, FP16):  # not proven: the module's own forward, bitwise
        assert not _proven(ours, x.to(x_dtype)) and torch.equal(ours(x.to(x_dtype)), theirs(x.to(x_dtype)))
    assert _proven(ours, x.to(BF16))
    _assert_computes_like(ours, theirs, x.to(BF16), bitwise=DEVICE == "cpu")


class FixedDimRMSNorm(_Base):
    """The mean over dim 2: over the last dim of a 3-D x only."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(2, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def test_a_computation_that_depends_on_the_rank_is_patched_for_the_probed_rank_only():
    theirs = FixedDimRMSNorm().to(DEVICE)
    ours = copy.deepcopy(theirs)
    report = normkit.patch(ours, fuse=False)
    assert set(report) == {""} and "x with 3 dims only" in report.computes[""]
    x = torch.randn(ROWS).to(DEVICE)
    assert _proven(ours, x)
    _assert_computes_like(ours, theirs, x, bitwise=DEVICE == "cpu")
    x4 = torch.randn(2, 3, 4, 64).to(DEVICE)
    assert not _proven(ours, x4) and torch.equal(ours(x4), theirs(x4))  # its own forward (over dim 2)


class DropoutRMSNorm(_Base):
    """Dropout inside: Llama's computation in eval mode only."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return nn.functional.dropout(self.weight * hidden_states.to(input_dtype), 0.5, self.training)


def test_train_and_eval_mode_are_proven_separately():
    theirs = DropoutRMSNorm().to(DEVICE).train()
    ours = copy.deepcopy(theirs)
    report = normkit.patch(ours, fuse=False)  # patched in train mode, proven for eval mode
    assert set(report) == {""} and "in eval mode" in report.computes[""]
    x = torch.randn(ROWS).to(DEVICE)
    assert not _proven(ours, x)
    torch.manual_seed(7)
    y = ours(x)
    torch.manual_seed(7)
    assert torch.equal(y, theirs(x))  # its own forward (and dropout) in train mode
    ours.eval(), theirs.eval()
    assert _proven(ours, x)
    _assert_computes_like(ours, theirs, x, bitwise=DEVICE == "cpu")


GATED = {  # id -> (module, class, hidden, group size): MambaRMSNormGated and its copies
    "mamba2_one_group": ("mamba2.modeling_mamba2", "MambaRMSNormGated", 64, 64),
    "mamba2_groups": ("mamba2.modeling_mamba2", "MambaRMSNormGated", 64, 16),
    "bamba": ("bamba.modeling_bamba", "BambaRMSNormGated", 64, 32),
    "zamba2": ("zamba2.modeling_zamba2", "Zamba2RMSNormGated", 64, 16),
    "nemotron_h": ("nemotron_h.modeling_nemotron_h", "NemotronHRMSNormGated", 64, 32),
    "before_groups": (None, "GatedRMSNormBeforeGroups", 64, 64),
}


class GatedRMSNormBeforeGroups(nn.Module):
    """MambaRMSNormGated as transformers <= 5.17 has it: whole rows, no group view."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        if gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _gated_module(module, name, hidden, group):
    """(the gated norm, its group size): older transformers releases have no group_size (one group
    per row) or not the class at all (NemotronH's came later)."""
    cls = globals()[name] if module is None else \
        getattr(importlib.import_module(f"transformers.models.{module}"), name, None)
    if cls is None:
        import transformers
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    if "group_size" in inspect.signature(cls.__init__).parameters:
        return cls(hidden, group_size=group, eps=1e-6), group
    return cls(hidden, eps=1e-6), hidden


@pytest.mark.parametrize("x_dtype, w_dtype, g_dtype", [(FP32, FP32, FP32), (BF16, BF16, BF16), (FP32, BF16, BF16),
                                                       (FP16, FP16, FP32)], ids=["fp32", "bf16", "fp32_x_bf16_gate",
                                                                                 "fp16_fp32_gate"])
@pytest.mark.parametrize("case", list(GATED))
def test_gated_norms_are_patched_with_the_gate(case, x_dtype, w_dtype, g_dtype):
    """forward(x, gate=None): recognised by computation (probed without and with a gate), patched with
    normkit's gate= (groups as per-head weights); outputs and the gradients of x, gate and weight are
    the module's, with the gate passed positionally, by name, or not at all."""
    module, name, hidden, group = GATED[case]
    torch.manual_seed(0)
    theirs, group = _gated_module(module, name, hidden, group)
    with torch.no_grad():
        theirs.weight.copy_(1 + 0.5 * torch.randn(hidden))
    theirs = theirs.to(DEVICE, w_dtype)
    ours = copy.deepcopy(theirs)
    report = normkit.patch(ours, fuse=False)
    assert set(report) == {""}, report.skipped
    what = report.computes[""]
    assert "gated rms_norm" in what and "(gate=) fused" in what
    assert ("one group per row" in what) == (group == hidden)
    x = torch.randn(2, 5, hidden, device=DEVICE, dtype=x_dtype)
    g = 2 * torch.randn(2, 5, hidden, device=DEVICE, dtype=g_dtype)
    for call in (lambda m, a, b: m(a, b), lambda m, a, b: m(a, gate=b), lambda m, a, b: m(a)):
        outs = []
        for m in (ours, theirs):
            xa, ga = x.clone().requires_grad_(), g.clone().requires_grad_()
            y = call(m, xa, ga)
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
            grads = torch.autograd.grad(y, [xa, ga, m.weight], dy, allow_unused=True)
            outs.append((y, grads))
        (y, grads), (y_ref, grads_ref) = outs
        assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
        tol = 1e-6 if y.dtype == FP32 else 2 * torch.finfo(y.dtype).eps
        assert ref.rel_err(y, y_ref) <= tol
        for got, want in zip(grads, grads_ref):
            if want is None:
                assert got is None or not got.any()
                continue
            assert got.dtype == want.dtype
            assert ref.rel_err(got, want) <= (2e-5 if got.dtype == FP32 else 4 * torch.finfo(got.dtype).eps)


def test_gated_norm_calls_it_does_not_serve_run_its_own_forward(monkeypatch):
    m = _gated_module("mamba2.modeling_mamba2", "MambaRMSNormGated", 64, 16)[0].to(DEVICE)
    normkit.patch(m)
    seen = []
    # the patched forward's one entry into normkit (the C++ host path serves CUDA calls from there on)
    real = normkit.functional.row_norm_as_written
    monkeypatch.setattr(normkit.functional, "row_norm_as_written", lambda *a, **k: seen.append(1) or real(*a, **k))
    x = torch.randn(2, 3, 64, device=DEVICE)
    m(x, torch.randn(2, 3, 64, device=DEVICE))
    assert len(seen) == 1
    m(x.double(), torch.randn(2, 3, 64, device=DEVICE, dtype=torch.float64))  # float64: not proven
    m(x, torch.randn(1, 3, 64, device=DEVICE))  # a broadcast gate: not what was probed
    assert len(seen) == 1


def test_gated_norms_computing_otherwise_are_left_alone_with_the_reason():
    """FalconH1's gated norm multiplies the fp32 weight in before one rounding (and gates after the
    norm by default); Qwen3-Next's takes a gate with no default: left alone, saying why."""
    falcon = _hf("falcon_h1.modeling_falcon_h1", "FalconH1RMSNormGated")(64, eps=1e-6, n_groups=4)
    qwen = _hf("qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNormGated")(64)
    report = normkit.patch(nn.Sequential(falcon, qwen), fuse=False)
    assert report == {}
    assert "matches none of normkit's styles" in report.skipped["0"] and "gated" in report.skipped["0"]
    assert "takes more than its input (gate)" in report.skipped["1"]


def test_krea2_norm_is_patched_for_its_fp32_weight_only():
    """F.rms_norm of x in fp32 with weight + 1: Gemma's computation where the weight is fp32 (torch
    adds 1 in the weight's dtype, so a bf16 weight rounds there first: not Gemma's)."""
    cls = _df("models.transformers.transformer_krea2", "Krea2RMSNorm")
    theirs = cls(64)
    with torch.no_grad():
        theirs.weight.copy_(0.5 * torch.randn(64))
    ours = copy.deepcopy(theirs).to(DEVICE)
    theirs = theirs.to(DEVICE)
    report = normkit.patch(ours, fuse=False)
    assert set(report) == {""} and "Gemma" in report.computes[""] and "weight fp32]" in report.computes[""]
    for x_dtype in (FP32, BF16):
        x = torch.randn(ROWS).to(DEVICE, x_dtype)
        assert _proven(ours, x)
        _assert_computes_like(ours, theirs, x, bitwise=False)
    ours.to(BF16), theirs.to(BF16)
    x = torch.randn(ROWS).to(DEVICE, BF16)
    assert not _proven(ours, x) and torch.equal(ours(x), theirs(x))


def test_float64_and_more_arguments_run_the_modules_own_forward():
    theirs, _, _ = _build("t5", torch.float64)
    ours = copy.deepcopy(theirs)
    normkit.patch(ours, fuse=False)
    x = torch.randn(ROWS, dtype=torch.float64, device=DEVICE)
    assert not _proven(ours, x) and torch.equal(ours(x), theirs(x))
    ours.to(BF16)  # dtypes changed after patching: still a proven combination
    assert _proven(ours, x.to(BF16))


def test_probing_leaves_the_module_alone(monkeypatch):
    m, _, _ = _build("t5")
    calls = []
    m.register_forward_hook(lambda *a: calls.append(1))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    normkit.patch(m, dry_run=True)
    assert calls == [] and all(torch.equal(p, before[n]) for n, p in m.named_parameters())


def test_one_probe_per_class_and_attributes(monkeypatch):
    """100 norms of one class and size are probed once; patching another such model probes nothing."""
    traced = []
    real = patch_mod._trace
    monkeypatch.setattr(patch_mod, "_trace", lambda *a: traced.append(1) or real(*a))
    cls = type("HundredNormsRMSNorm", (TextEncoderRootMeanSquare,), {})  # a class no other test probed
    model = nn.Sequential(*[cls(48) for _ in range(100)])
    assert len(normkit.patch(model, fuse=False)) == 100
    first = len(traced)
    assert 0 < first <= 100  # module probes: 3 x dtypes x 3 parameter dtypes x 2 modes (+ references)
    assert len(normkit.patch(nn.Sequential(*[cls(48) for _ in range(100)]), fuse=False)) == 100
    assert len(traced) == first


def test_autocast_computes_what_the_module_computes():
    """Probes run without autocast; the HF-style computations are explicit fp32 ops that autocast
    leaves alone, and torch's layer_norm under autocast is what normkit's F.layer_norm follows."""
    for case in ("t5", "cohere", "diffusers_fp32_layer_norm", "diffusers_sd_cascade"):
        theirs, style, shape = _build(case)
        ours = copy.deepcopy(theirs)
        normkit.patch(ours, fuse=False)
        x = torch.randn(shape).to(DEVICE, BF16)
        with torch.autocast(DEVICE, dtype=BF16):
            y, y_ref = ours(x), theirs(x)
        assert y.dtype == y_ref.dtype, case
        if y.dtype == FP32:
            assert ref.rel_err(y, y_ref) <= 1e-6, case
        else:
            assert (y != y_ref).float().mean().item() <= 0.002, case


# ----------------------------------------------------------------------------- whole models

def _t5_encoder(cls_name="T5EncoderModel", config="T5Config", layers=2):
    cfg = getattr(transformers, config)(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=layers,
                                        num_heads=4, dropout_rate=0.0)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    return model


@pytest.mark.parametrize("cls_name, config", [("T5EncoderModel", "T5Config"), ("MT5EncoderModel", "MT5Config"),
                                              ("UMT5EncoderModel", "UMT5Config")])
def test_t5_encoder_has_every_norm_patched(cls_name, config):
    model = _t5_encoder(cls_name, config, layers=12)
    reference = copy.deepcopy(model)
    norms = {n for n, m in model.named_modules() if type(m).__name__.endswith("LayerNorm")}
    report = normkit.patch(model)
    assert len(norms) == 25 and set(report) == norms and not report.skipped, str(report)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out, expected = model(input_ids=ids).last_hidden_state, reference(input_ids=ids).last_hidden_state
    assert ref.rel_err(out, expected) <= 2e-6
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert ref.rel_err(p.grad, q.grad) <= 2e-5, name
    assert normkit.unpatch(model) == report and all(type(model.get_submodule(n)) is c for n, c in report.items())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, reference(input_ids=ids).last_hidden_state)


def test_ops_selects_the_recognised_styles_families():
    model = _t5_encoder()
    report = normkit.patch(model, ops=("layer_norm",))
    assert report == {} and set(report.skipped.values()) == {"rms_norm is not in ops=('layer_norm',)"}
    assert len(normkit.patch(model, ops=("rms_norm",))) == 5


def test_t5_encoder_in_bf16():
    """The whole encoder in bf16 (the norms: the t5 style with a bf16 weight)."""
    model = _t5_encoder().to(BF16)
    reference = copy.deepcopy(model)
    assert len(normkit.patch(model)) == 5
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        out, expected = model(input_ids=ids).last_hidden_state, reference(input_ids=ids).last_hidden_state
    assert out.dtype == expected.dtype == BF16
    if DEVICE == "cpu":  # the norms are bitwise T5's on the torch backend, so is the model
        assert torch.equal(out, expected)
    assert ref.rel_err(out, expected) <= 1e-2
