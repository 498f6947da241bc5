"""normkit.patch / unpatch and the report they return, on small randomly initialised models built
from config objects (no downloads) and single norm modules: the patched model keeps its Parameter
objects, state_dict keys and devices, unpatch restores it, each recognised norm class computes what
it computes itself, and what is not recognised is left alone and listed with a reason. Training
whole model families patched vs unpatched is tests/test_models.py.

transformers is a test dependency on CI (CPU); missing on the GPU machine it skips.
"""
import collections
import copy
import importlib
import pathlib
import re

import pytest
import torch
from torch import nn

import normkit
from normkit import reference as ref

from conftest import DEVICE, HAS_CUDA

patch_mod = importlib.import_module("normkit.patch")  # the module; normkit.patch is the function

transformers = pytest.importorskip("transformers") if HAS_CUDA else importlib.import_module("transformers")


# fp32 end to end: the forward differs from torch by reduction order only (more so for the Triton
# kernels on a GPU than for the torch backend on CPU); gradients go through a different (analytic)
# backward formula and a few layers, hence the looser bound
FWD_TOL = 2e-6 if DEVICE == "cpu" else 1e-5
GRAD_TOL = 2e-5


pytestmark = pytest.mark.usefixtures("exact_fp32")  # no TF32 on a GPU


# ----------------------------------------------------------------------------- model builders

def _causal_lm(kind: str):
    T = transformers
    cfg_cls, model_cls = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        "mistral": (T.MistralConfig, T.MistralForCausalLM),
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM),
        "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM),
    }[kind]
    cfg = cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    return model_cls(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1,
                                  eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _randomize_norms(model: nn.Module, center: float) -> None:
    """Fresh non-trivial norm weights/biases (models initialise them to 1 and 0, which would hide a
    weight or bias applied wrongly)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or "ln" in name.lower():
                p.copy_(center + 0.3 * torch.randn(p.shape, generator=gen))


def _build(factory, center=1.0):
    torch.manual_seed(0)
    model = factory().to(DEVICE)
    _randomize_norms(model, center)
    return model


# ----------------------------------------------------------------------------- comparisons

def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def _compare_training_step(model, reference, inputs: dict, out_key="logits"):
    out, expected = model(**inputs), reference(**inputs)
    assert ref.rel_err(out[out_key], expected[out_key]) <= FWD_TOL
    out["loss"].backward()
    expected["loss"].backward()
    grads, expected_grads = _grads(model), _grads(reference)
    assert grads.keys() == expected_grads.keys()
    # some gradients are zero in exact arithmetic (BERT's key bias: softmax ignores it) and only
    # rounding noise in practice: judge each against the whole model's gradient size as well
    total = sum(g.double().square().sum() for g in expected_grads.values()).sqrt().item()
    for name, g in grads.items():
        assert g is not None, f"{name}: no gradient"
        g_ref = expected_grads[name].double()
        err = (g.double() - g_ref).norm().item() / max(g_ref.norm().item(), 1e-4 * total)
        assert err <= GRAD_TOL, f"{name}: gradient differs by {err:.3g} (relative)"
    return out


def _check_patch_roundtrip(model, inputs, expected_classes: set, out_key="logits", **patch_kw):
    """patch -> same outputs/grads, identity, keys; unpatch -> original classes and outputs."""
    reference = copy.deepcopy(model)
    params_before = [id(p) for p in model.parameters()]
    keys_before = list(model.state_dict().keys())
    modules_before = dict(model.named_modules())

    replaced = normkit.patch(model, **patch_kw)

    assert replaced, "nothing was patched"
    assert {c.__name__ for c in replaced.values()} == expected_classes
    # every module of those classes was patched, and nothing else
    expected_names = {n for n, m in reference.named_modules() if type(m).__name__ in expected_classes}
    assert set(replaced) == expected_names
    for name in replaced:
        m = modules_before[name]
        assert isinstance(m, replaced[name]) and type(m) is not replaced[name]
    assert [id(p) for p in model.parameters()] == params_before
    assert list(model.state_dict().keys()) == keys_before
    again = normkit.patch(model, **patch_kw)  # idempotent: the second time, all are already patched
    assert again == {} and again.skipped == {n: "already patched" for n in replaced}

    _compare_training_step(model, reference, inputs, out_key)

    restored = normkit.unpatch(model)
    assert restored == replaced
    for name, cls in replaced.items():
        assert type(modules_before[name]) is cls
    assert not any(hasattr(m, "_normkit_backend") for m in model.modules())
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    with torch.no_grad():  # unpatched again: the very same computation as the reference
        assert torch.equal(model(**inputs)[out_key], reference(**inputs)[out_key])


def _lm_inputs(vocab=128, batch=2, seq=16):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (batch, seq), generator=gen).to(DEVICE)
    return {"input_ids": ids, "labels": ids}


# ----------------------------------------------------------------------------- transformers

@pytest.mark.parametrize("factory, norm_class", [(lambda: _causal_lm("llama"), "LlamaRMSNorm"),
                                                 (_gpt2, "LayerNorm")], ids=["llama", "gpt2"])
def test_patch_keeps_the_model_and_unpatch_restores_it(factory, norm_class):
    _check_patch_roundtrip(_build(factory), _lm_inputs(), {norm_class})


def test_patch_with_forced_backend_runs_that_backend(monkeypatch):
    model = _build(lambda: _causal_lm("llama"))
    calls = []
    backend = normkit.backends.get("torch")
    real = backend.row_norm_fwd
    monkeypatch.setattr(backend, "row_norm_fwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_fused = backend.row_norm_fwd_fused  # the post-attention norms, fused with their residual add
    monkeypatch.setattr(backend, "row_norm_fwd_fused",
                        lambda *a, **k: (k.get("residual") is not None and calls.append(1)) or real_fused(*a, **k))
    replaced = normkit.patch(model, backend="torch")
    model(**_lm_inputs())
    assert len(calls) == len(replaced) == 5


def test_patched_llama_on_triton_kernels():
    """The same model on the Triton kernels (the interpreter on CPU)."""
    model = _build(lambda: _causal_lm("llama"))
    reference = copy.deepcopy(model)
    normkit.patch(model, backend="triton")
    _compare_training_step(model, reference, _lm_inputs(seq=8))


def test_patch_state_dict_round_trip():
    model = _build(lambda: _causal_lm("gemma"), center=0.0)
    fresh = _build(lambda: _causal_lm("gemma"))  # same init, norms centered elsewhere
    normkit.patch(model)
    fresh.load_state_dict(model.state_dict())  # patched keys load into an unpatched model
    normkit.patch(fresh)
    model.load_state_dict(fresh.state_dict())  # and the other way round
    with torch.no_grad():
        assert torch.equal(model(**_lm_inputs()).logits, fresh(**_lm_inputs()).logits)


def test_optimizer_keeps_training_the_patched_parameters():
    model = _build(lambda: _causal_lm("llama"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the Parameters from before patching
    normkit.patch(model)
    norm = model.model.norm
    before = norm.weight.detach().clone()
    model(**_lm_inputs()).loss.backward()
    opt.step()
    assert not torch.equal(norm.weight.detach(), before)


# ----------------------------------------------------------------------------- HF semantics, module level

def _hf_norm(kind, hidden, dtype_w):
    T = transformers.models
    cls = {"llama": T.llama.modeling_llama.LlamaRMSNorm, "gemma": T.gemma.modeling_gemma.GemmaRMSNorm,
           "olmo2": T.olmo2.modeling_olmo2.Olmo2RMSNorm}[kind]
    m = cls(hidden, eps=1e-6).to(DEVICE, dtype_w)
    with torch.no_grad():
        m.weight.copy_((0.0 if kind == "gemma" else 1.0) + 0.5 * torch.randn(hidden))
    return m


@pytest.mark.parametrize("kind", ["llama", "gemma", "olmo2"])
@pytest.mark.parametrize("x_dtype, w_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
])
def test_hf_rms_norm_semantics_exactly(kind, x_dtype, w_dtype):
    """Same dtype as HF (Llama promotes: bf16 x with an fp32 weight gives fp32) and the same
    roundings: where HF rounds the normalized value before the weight multiply (Llama) and where it
    does not (Gemma, OLMo 2). Computing the other way flips the last bit of a large fraction of
    bf16 outputs; done HF's way, only a rare fp32 rounding difference of rstd can."""
    torch.manual_seed(3)
    theirs = _hf_norm(kind, 256, w_dtype)
    ours = copy.deepcopy(theirs)
    normkit.patch(ours)
    assert type(ours).forward is patch_mod._recognised_forward and patch_mod._style_of(ours) == kind
    assert patch_mod._style_of(theirs) == kind and patch_mod._style_of(type(theirs)) == kind
    _assert_computes_like(ours, theirs, x_dtype)


def _assert_computes_like(ours, theirs, x_dtype, n=256):
    """ours(x) is theirs(x) up to a rare last-bit difference; gradients as close as the dtype allows."""
    x = (3 * torch.randn(64, n)).to(DEVICE, x_dtype).requires_grad_(True)
    y, y_ref = ours(x), theirs(x)
    assert y.dtype == y_ref.dtype
    differ = (y != y_ref).float().mean().item()
    if y.dtype == torch.float32 and x_dtype == torch.float32:
        assert ref.rel_err(y, y_ref) <= 1e-6
    else:
        assert differ <= 0.002, f"{differ:.1%} of outputs differ from HF's"
        ulp = torch.finfo(y.dtype).eps * y_ref.detach().abs().float().clamp_min(1e-3)
        assert ((y - y_ref).detach().abs().float() <= ulp).all()
    dy = torch.randn_like(y_ref)
    gx, gw = torch.autograd.grad(y, (x, ours.weight), dy)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, theirs.weight), dy)
    assert gx.dtype == gx_ref.dtype and gw.dtype == gw_ref.dtype
    assert ref.rel_err(gx, gx_ref) <= (1e-5 if x_dtype == torch.float32 else 1e-2)
    assert ref.rel_err(gw, gw_ref) <= (1e-5 if theirs.weight.dtype == torch.float32 else 1e-2)


def _transformers_norm_classes():
    """Every nn.Module class named *Norm* defined in transformers' modeling files (those that
    define one; a module whose optional dependency is missing here cannot be checked)."""
    root = pathlib.Path(transformers.models.__path__[0])
    for path in sorted(root.glob("*/modeling_*.py")):
        if not re.search(r"class \w*Norm\w*\(nn\.Module\)", path.read_text(encoding="utf-8")):
            continue
        try:
            module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        except ImportError:
            continue
        for name, cls in vars(module).items():
            if (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == module.__name__
                    and "Norm" in name):
                yield cls


def test_every_transformers_norm_that_patch_recognises_computes_the_same():
    """The Llama, Gemma and OLMo 2 RMSNorm code is copied into some 160 transformers families (and
    T5's and Cohere's into a few more); each class that patch recognises by its computation computes
    with normkit what it computes itself (fp32 and bf16), and every other RMSNorm/LayerNorm/GroupNorm
    class is left alone and listed with a reason."""
    checked, skipped, failures = collections.Counter(), [], []
    for cls in _transformers_norm_classes():
        try:
            theirs = cls(64)
        except Exception:  # classes built from a config object
            continue
        report = normkit.patch(theirs, dry_run=True)
        if "" not in report:
            if re.search(r"(RMS|Layer|Group)Norm$", cls.__name__):
                # either a reason for the class itself, or it wraps a torch norm that is patched
                assert report.skipped.get("") or report, f"{cls.__qualname__}: {report}"
                skipped.append(cls.__name__)
            continue
        assert set(report) == {""}, f"{cls.__qualname__}: {report}"
        ours = copy.deepcopy(theirs)
        normkit.patch(ours)
        plan = getattr(type(ours), "_normkit_plan", None)  # the style proven for each (x dtype, mode, parameter dtypes)
        if plan is None:  # torch's own module re-exported, patched by its class
            continue
        style = patch_mod._style_of(ours) or next(iter(plan.table.values()))[0].name
        torch.manual_seed(4)
        with torch.no_grad():
            for name, p in theirs.named_parameters():
                p.copy_((0.0 if style == "gemma" or name != "weight" else 1.0) + 0.5 * torch.randn(p.shape))
        for dtype in (torch.float32, torch.bfloat16):
            key = (dtype, ours.training, *[None if p is None else dtype for p in ours._parameters.values()])
            if key not in plan.table:  # proven for some dtypes only (the report says which): its own forward
                continue
            ours.load_state_dict(theirs.state_dict())
            try:
                _assert_computes_like(ours.to(DEVICE, dtype), theirs.to(DEVICE, dtype), dtype, n=64)
            except AssertionError as e:
                failures.append(f"{cls.__module__}.{cls.__qualname__} {dtype}: {e}")
        checked[style] += 1
    assert not failures, "\n".join(failures)
    # every family of the conformance suite, and the copies of each style are there
    assert sum(checked.values()) >= 100 and {"llama", "gemma", "olmo2", "t5", "cohere", "ln_fp32"} <= set(checked), \
        checked
    assert len(skipped) >= 10, skipped


def test_hf_float64_input_keeps_hf_computation():
    """HF computes float64 input in fp32; normkit would not, so the original forward runs."""
    theirs = _hf_norm("llama", 32, torch.float64)
    ours = copy.deepcopy(theirs)
    assert normkit.patch(ours)
    x = torch.randn(4, 32, dtype=torch.float64, device=DEVICE)
    assert torch.equal(ours(x), theirs(x))


# ----------------------------------------------------------------------------- what is not patched

class _LlamaLikeButCastsLater(nn.Module):
    """Looks like LlamaRMSNorm (weight, variance_epsilon) but multiplies before the cast."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype) + 0


class _MyLayerNorm(nn.LayerNorm):
    def forward(self, x):  # its own semantics: not torch's LayerNorm any more
        return super().forward(x) * 2


class _SameLayerNorm(nn.LayerNorm):
    """A subclass that keeps torch's forward: normkit stands in for it."""


def test_only_known_forwards_are_patched():
    model = nn.Sequential(_LlamaLikeButCastsLater(8), _MyLayerNorm(8), _SameLayerNorm(8), nn.LayerNorm(8),
                          nn.RMSNorm(8), nn.Linear(8, 8))
    model[3].forward = lambda x: x  # a per-instance forward: unknown, left alone
    replaced = normkit.patch(model)
    assert replaced == {"2": _SameLayerNorm, "4": nn.RMSNorm}
    assert isinstance(model[2], _SameLayerNorm) and type(model[2]).__name__ == "Normkit_SameLayerNorm"
    x = torch.randn(3, 8)
    assert ref.rel_err(model[2](x), nn.functional.layer_norm(x, (8,), model[2].weight, model[2].bias)) <= 1e-6


def test_ops_selects_families_and_rejects_unknown_names():
    model = nn.Sequential(nn.LayerNorm(8), nn.RMSNorm(8), nn.GroupNorm(2, 8))
    assert set(normkit.patch(model, ops=("rms_norm",))) == {"1"}
    assert set(normkit.patch(model, ops=["layer_norm", "group_norm"])) == {"0", "2"}
    assert normkit.patch(model) == {}
    with pytest.raises(ValueError, match="ops: expected names from"):
        normkit.patch(model, ops=("layernorm",))
    with pytest.raises(TypeError, match="ops: expected a collection"):
        normkit.patch(model, ops="layer_norm")
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        normkit.patch(lambda x: x)


def test_patching_the_norm_itself_and_hooks_survive():
    ln = nn.LayerNorm(8)
    seen = []
    ln.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert normkit.patch(ln) == {"": nn.LayerNorm}
    ln(torch.randn(2, 8))
    assert seen == [torch.Size([2, 8])]
    assert normkit.unpatch(ln) == {"": nn.LayerNorm} and type(ln) is nn.LayerNorm


# ----------------------------------------------------------------------------- the report, dry runs

class _CastsLaterRMSNorm(_LlamaLikeButCastsLater):
    """Named like a norm, with an eps: norm-like, so its being left alone is reported."""


def _mixed_model():
    model = nn.Sequential(nn.LayerNorm(8), _MyLayerNorm(8), nn.GroupNorm(2, 8), _CastsLaterRMSNorm(8),
                          nn.RMSNorm(8), nn.Linear(8, 8), normkit.LayerNorm(8), nn.BatchNorm1d(8))
    model[4].forward = lambda x: x  # a per-instance forward
    return model


def test_dry_run_reports_without_changing_anything():
    model = _mixed_model()
    classes = [type(m) for m in model.modules()]
    report = normkit.patch(model, dry_run=True)
    assert [type(m) for m in model.modules()] == classes and not hasattr(model[0], "_normkit_backend")
    assert report.dry_run and isinstance(report, patch_mod.PatchReport)
    assert report == report.patched == {"0": nn.LayerNorm, "2": nn.GroupNorm}
    assert report.computes == {"0": "layer_norm", "2": "group_norm"}
    # every norm-like module not patched is listed with its reason; Linear and BatchNorm are not norm-like
    assert set(report.skipped) == {"1", "3", "4", "6"}
    assert "LayerNorm subclass with its own forward" in report.skipped["1"]
    assert "not one normkit knows" in report.skipped["3"]
    assert "per-instance forward" in report.skipped["4"]
    assert report.skipped["6"] == "already a normkit module"
    text = str(report)
    assert text.startswith("normkit.patch (dry run): would patch 2 modules, would skip 4")
    for name, why in report.skipped.items():
        assert why in text and type(model[int(name)]).__name__ in text

    real = normkit.patch(model)  # the dry run said what the real one does
    assert real == report and real.skipped == report.skipped and not real.dry_run
    assert str(real).startswith("normkit.patch: patched 2 modules, skipped 4")


def test_report_lists_op_families_left_out_and_groups_by_class():
    model = nn.Sequential(*[nn.LayerNorm(8) for _ in range(5)], nn.GroupNorm(2, 8))
    report = normkit.patch(model, ops=("group_norm",))
    assert report == {"5": nn.GroupNorm}
    assert report.skipped == {str(i): "layer_norm is not in ops=('group_norm',)" for i in range(5)}
    assert "skipped 5 LayerNorm: 0, 1, 2, ... (2 more)" in str(report)
    with pytest.raises(TypeError, match="dry_run: expected a bool"):
        normkit.patch(model, dry_run="yes")


def test_report_names_a_patched_model_itself():
    report = normkit.patch(nn.GroupNorm(2, 4), dry_run=True)
    assert report == {"": nn.GroupNorm} and "(the model)" in str(report)
