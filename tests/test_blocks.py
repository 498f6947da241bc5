"""normkit.blocks (applied by normkit.patch): the blocks around the norms of real models, fused in
eager mode. Tiny models from their own libraries (transformers, diffusers; seed 004's Conv1d
blocks written as the seed's code base writes them), patched + fused against unpatched: outputs,
loss and every parameter's gradient; that the fusion happened, from patch's report and by counting
the fused calls that reach the backend; that a variant, a hook or a dtype where the block rounds
differently is left to the block's own code; and that unpatch undoes it all.
"""
import copy
import importlib

import pytest
import torch
from torch import nn

import normkit
from normkit import backends, blocks
from normkit import reference as ref

from conftest import DEVICE, HAS_CUDA

transformers = pytest.importorskip("transformers") if HAS_CUDA else importlib.import_module("transformers")


pytestmark = pytest.mark.usefixtures("exact_fp32")  # conftest: no TF32 on a GPU


class FusedCalls:
    """Counts the fused calls reaching the backend: row norms with a residual, group norms with an
    activation (and records the row operands, to check q/k rows are read in place)."""

    def __init__(self, monkeypatch):
        # the Python host path: the C++ one (CUDA) replays recorded launches without calling the backend
        monkeypatch.setattr("normkit._host.fast", None)
        self.residual = self.activation = 0
        self.row_ptrs = []
        be = backends.resolve(None, torch.empty(1, device=DEVICE), "layer_norm")
        # the torch backend's row_norm_fwd(_fused) and the CPU fast path all call its _row_norm_fwd
        row_name = "_row_norm_fwd" if hasattr(be, "_row_norm_fwd") else "row_norm_fwd_fused"
        fused, plain = getattr(be, row_name), be.row_norm_fwd

        def row_fused(x, *a, **k):  # residual: a keyword, or _row_norm_fwd's 8th argument
            self.residual += k.get("residual", a[6] if len(a) > 6 else None) is not None
            self.row_ptrs.append(x.data_ptr())
            return fused(x, *a, **k)

        def row_plain(x, *a, **k):
            self.row_ptrs.append(x.data_ptr())
            return plain(x, *a, **k)

        # the torch backend's group_norm_fwd and the CPU fast path (normkit/_cpu.py) both call its _group_norm_fwd;
        # the fast path's first call, for torch's autograd nodes, returns None where a group is off-centre
        # (then normkit's Function computes it): the calls that return a value are the ones counted
        gn_name = "_group_norm_fwd" if hasattr(be, "_group_norm_fwd") else "group_norm_fwd"
        gn = getattr(be, gn_name)

        def group(x, num_groups, weight, bias, eps, activation=None, **k):
            out = gn(x, num_groups, weight, bias, eps, activation, **k)
            self.activation += activation is not None and out is not None
            return out

        monkeypatch.setattr(be, row_name, row_fused)
        monkeypatch.setattr(be, "row_norm_fwd", row_plain)
        monkeypatch.setattr(be, gn_name, group)


@pytest.fixture
def calls(monkeypatch):
    return FusedCalls(monkeypatch)


def _randomize_norms(model, center=1.0):
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.copy_(center + 0.3 * torch.randn(p.shape, generator=gen))


def _step(model, inputs, loss_of):
    model.zero_grad(set_to_none=True)
    out, loss = loss_of(model, inputs)
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compare(model, reference, inputs, loss_of, tol_out, tol_grad):
    out, loss, grads = _step(model, inputs, loss_of)
    out_r, loss_r, grads_r = _step(reference, inputs, loss_of)
    assert ref.rel_err(out, out_r) <= tol_out
    assert abs(loss.item() - loss_r.item()) <= tol_out * max(1.0, abs(loss_r.item()))
    total = sum(g.double().square().sum() for g in grads_r.values() if g is not None).sqrt().item()
    assert grads.keys() == grads_r.keys()
    for name, g in grads.items():
        g_r = grads_r[name]
        assert (g is None) == (g_r is None), name
        if g is None:
            continue
        err = (g.double() - g_r.double()).norm().item() / max(g_r.double().norm().item(), 1e-4 * total)
        assert err <= tol_grad, f"{name}: gradient differs by {err:.3g} (relative)"


# ----------------------------------------------------------------------------- transformers

_HF = {  # kind -> (config, model, the blocks fused per layer: (suffix, what))
    "llama": ("LlamaConfig", "LlamaForCausalLM", ("",)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", ("",)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", ("",)),
    "mistral": ("MistralConfig", "MistralForCausalLM", ("",)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", ("",)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", ("",)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", ("",)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", ("",)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", ("", ".self_attn")),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", ()),  # post-norm residual adds: nothing to fuse
}
LAYERS = 2


def _causal_lm(kind, dtype=torch.float32):
    cfg_name, model_name, _ = _HF[kind]
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    if kind == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).to(DEVICE)
    center = 0.0 if kind.startswith("gemma") else 1.0  # Gemma's weight acts as 1 + w
    _randomize_norms(model, center)
    return model.to(dtype)


def _lm_loss(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    return out.logits, out.loss


def _ids():
    return torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(2)).to(DEVICE)


@pytest.mark.parametrize("kind", list(_HF))
def test_hf_decoder_layers_fused(kind, calls):
    model = _causal_lm(kind)
    reference = copy.deepcopy(model)
    report = normkit.patch(model)
    suffixes = _HF[kind][2]
    expected = {f"model.layers.{i}{s}" for i in range(LAYERS) for s in suffixes}
    assert set(report.fused) == expected
    assert all(type(model.get_submodule(n)).__name__ == type(reference.get_submodule(n)).__name__ for n in expected)
    _compare(model, reference, _ids(), _lm_loss, 2e-6, 2e-5)
    adds = sum(s == "" for s in suffixes) * LAYERS
    assert calls.residual == adds, "the residual adds did not reach the backend as fused calls"
    # unpatch undoes the fusion too: the very same computation as the reference again
    normkit.unpatch(model)
    assert not any(hasattr(type(m), "_normkit_fused_original") or hasattr(type(m), "_normkit_original")
                   for m in model.modules())
    assert not any(hasattr(m, "_normkit_backend") for m in model.modules())
    with torch.no_grad():
        assert torch.equal(_lm_loss(model, _ids())[0], _lm_loss(reference, _ids())[0])


@pytest.mark.parametrize("kind", ["llama", "gemma2", "phi3"])
def test_hf_fused_in_bf16_rounds_h_as_hf(kind, calls):
    """bf16: HF adds in bf16 (h rounded) and normalizes that rounded h; so does the fused call. The
    forward and every gradient match the unpatched model to bf16's rounding."""
    model = _causal_lm(kind, torch.bfloat16)
    reference = copy.deepcopy(model)
    assert normkit.patch(model).fused
    _compare(model, reference, _ids(), _lm_loss, 2e-2, 5e-2)
    assert calls.residual == LAYERS


def test_hf_add_norm_matches_the_written_out_block_bitwise_in_fp32():
    """One layer's add + norm on CPU: normkit's residual sum and normalization are the same fp32
    operations HF does, in the same order."""
    model = _causal_lm("llama")
    layer = model.model.layers[0]
    x, r = torch.randn(3, 5, 64, device=DEVICE), torch.randn(3, 5, 64, device=DEVICE)
    y, h = blocks.add_norm(layer.post_attention_layernorm, x, r, "torch")
    assert torch.equal(h, r + x)
    assert ref.rel_err(y, layer.post_attention_layernorm(r + x)) <= 1e-6


def test_mixed_residual_dtype_is_promoted_as_torch_adds():
    """An fp32 residual stream and a bf16 branch: torch's add gives fp32 h, and HF's norm of fp32 h
    returns fp32; the fused call keeps both."""
    model = _causal_lm("llama")
    norm = model.model.layers[0].post_attention_layernorm
    x = torch.randn(2, 4, 64, device=DEVICE).to(torch.bfloat16)
    r = torch.randn(2, 4, 64, device=DEVICE)
    y, h = blocks.add_norm(norm, x, r)
    h_ref = r + x
    assert h.dtype == h_ref.dtype == torch.float32 and torch.equal(h, h_ref)
    y_ref = norm(h_ref)
    assert y.dtype == y_ref.dtype and ref.rel_err(y, y_ref) <= 1e-6


def test_hooks_on_the_norm_keep_it_called(calls):
    model = _causal_lm("llama")
    reference = copy.deepcopy(model)
    assert normkit.patch(model).fused
    seen = []
    for layer in model.model.layers:
        layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    _compare(model, reference, _ids(), _lm_loss, 2e-6, 2e-5)
    assert len(seen) == LAYERS and calls.residual == 0


class _ScaledBranchLayer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    """Llama's layer written another way (another class name and signature, as a new release or a
    copied model would), with the attention branch scaled by 0.5 before the residual add."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, position_embeddings=position_embeddings, **kwargs)
        hidden_states = residual + 0.5 * hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class _ScaledSumLayer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    """The same, but 0.5 * (residual + branch) reaches the norm: no add feeds it."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, position_embeddings=position_embeddings, **kwargs)
        hidden_states = 0.5 * (residual + hidden_states)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


def _llama_variant(layer_class):
    model = _causal_lm("llama")
    for layer in model.model.layers:
        layer.__class__ = layer_class
    return model


def test_the_computation_is_recognised_not_the_code(calls):
    """Fusion follows what the forward computes: an add of any branch feeding the norm (here a
    scaled one) is fused into exactly that computation; a forward whose norm reads something else
    is left as written, and the report says why."""
    model = _llama_variant(_ScaledBranchLayer)
    reference = copy.deepcopy(model)
    assert set(normkit.patch(model).fused) == {"model.layers.0", "model.layers.1"}
    _compare(model, reference, _ids(), _lm_loss, 2e-6, 2e-5)
    assert calls.residual == LAYERS

    model = _llama_variant(_ScaledSumLayer)
    report = normkit.patch(model, fuse=False)
    unfused = {}
    assert blocks.fuse(model, unfused=unfused) == {}
    assert "residual add" in unfused["model.layers.0"] and "model.layers.1" in unfused
    assert blocks.fuse(_causal_lm("olmo2"), dry_run=True) == {}  # OLMo 2 adds after its norms


def test_fuse_entry_point_dry_run_ops_and_opt_out():
    model = _causal_lm("llama")
    would = blocks.fuse(model, dry_run=True)
    assert set(would) == {"model.layers.0", "model.layers.1"}
    assert not any(hasattr(type(m), "_normkit_fused_original") for m in model.modules())
    assert normkit.patch(model, ops=("layer_norm",)).fused == {}  # the RMSNorms are not normkit's here
    normkit.unpatch(model)
    report = normkit.patch(model, fuse=False)
    assert report and report.fused == {}
    normkit.unpatch(model)
    assert blocks.fuse(model) == would
    assert blocks.fuse(model) == {}  # already fused
    assert set(blocks.unfuse(model)) == set(would)
    with pytest.raises(ValueError, match="fuse"):
        normkit.patch(model, fuse="yes")
    with pytest.raises(TypeError, match="ops"):
        blocks.fuse(model, ops="rms_norm")


def test_gradient_checkpointing_runs_the_fused_forward(calls):
    model = _causal_lm("llama")
    reference = copy.deepcopy(model)
    normkit.patch(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable()
        m.train()
    _compare(model, reference, _ids(), _lm_loss, 2e-6, 2e-5)
    assert calls.residual == 2 * LAYERS  # the forward and its recomputation in the backward


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_qk_norm_rows_are_read_in_place(kind, calls):
    """Qwen3 normalizes q_proj(x).view(..., heads, head_dim); Gemma 3 (after fusion) too, before its
    transpose: the rows normkit's kernel gets are the projection's output, not a copy."""
    model = _causal_lm(kind)
    normkit.patch(model)
    attn = model.model.layers[0].self_attn
    outs = {}  # the projections' outputs, kept alive so no later tensor reuses their memory
    for name in ("q", "k"):
        getattr(attn, f"{name}_proj").register_forward_hook(lambda m, i, o, name=name: [outs.setdefault(name, o)][1:]
                                                            or None)
    with torch.no_grad():
        _lm_loss(model, _ids())
    assert outs["q"].data_ptr() in calls.row_ptrs and outs["k"].data_ptr() in calls.row_ptrs


# ----------------------------------------------------------------------------- diffusers

diffusers = pytest.importorskip("diffusers") if HAS_CUDA else importlib.import_module("diffusers")


def _unet():
    torch.manual_seed(0)
    return diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                 up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4).to(DEVICE)


def _vae():
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
                                   layers_per_block=1, latent_channels=4, norm_num_groups=4,
                                   sample_size=8).to(DEVICE)


def _image(dtype=torch.float32):
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)


def _unet_loss(model, x):
    out = model(x, 3).sample
    return out, out.float().square().mean()


def _vae_loss(model, x):
    out = model(x, sample_posterior=False).sample
    return out, out.float().square().mean()


def _resnets(model):
    return [n for n, m in model.named_modules() if type(m).__name__ == "ResnetBlock2D"]


def _norm_out_tails(model):
    """Modules whose forward ends `x = self.conv_norm_out(x); x = self.conv_act(x)`, recognised from
    their code: GroupNorm + SiLU in one call too (the VAE's Decoder picks its norm in an if/else
    branch first: left as written)."""
    return [n for n, m in model.named_modules() if type(m).__name__ in ("Encoder", "UNet2DModel")]


@pytest.mark.parametrize("which", ["unet", "vae"])
def test_diffusers_resnet_blocks_fused(which, calls):
    model = _unet() if which == "unet" else _vae()
    _randomize_norms(model)
    reference = copy.deepcopy(model)
    report = normkit.patch(model)
    resnets, tails = _resnets(reference), _norm_out_tails(reference)
    assert resnets and tails and set(report.fused) == set(resnets) | set(tails)
    _compare(model, reference, _image(), _unet_loss if which == "unet" else _vae_loss, 2e-6, 2e-5)
    assert calls.activation == 2 * len(resnets) + len(tails)
    normkit.unpatch(model)
    assert not any(hasattr(type(m), "_normkit_fused_original") for m in model.modules())


def test_diffusers_bf16_rounds_before_the_activation_unless_relaxed(calls):
    """In bf16 the block rounds GroupNorm's output before SiLU: strict fusion leaves it unfused
    (bitwise the patched-only model), relaxed fusion fuses it within bf16's rounding."""
    base = _unet().to(torch.bfloat16)
    _randomize_norms(base)
    strict, relaxed, patched_only = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    assert normkit.patch(strict).fused and normkit.patch(relaxed, fuse="relaxed").fused
    normkit.patch(patched_only, fuse=False)
    x = _image(torch.bfloat16)
    with torch.no_grad():
        y_strict, y_plain = _unet_loss(strict, x)[0], _unet_loss(patched_only, x)[0]
        assert calls.activation == 0
        assert torch.equal(y_strict, y_plain)
    _compare(relaxed, base, x, _unet_loss, 3e-2, 1e-1)
    assert calls.activation > 0


# ----------------------------------------------------------------------------- seed 004's Conv1d blocks

def _seed004_block(cin, cout, rearrange: bool):
    """Conv1d -> GroupNorm(8) -> Mish, as Diffusion Policy writes it (nn.Sequential), or with
    einops' Rearrange around the norm, as Janner's diffuser does."""
    if not rearrange:
        return nn.Sequential(nn.Conv1d(cin, cout, 5, padding=2), nn.GroupNorm(8, cout), nn.Mish())
    Rearrange = pytest.importorskip("einops.layers.torch").Rearrange if HAS_CUDA else \
        importlib.import_module("einops.layers.torch").Rearrange
    return nn.Sequential(nn.Conv1d(cin, cout, 5, padding=2), Rearrange("b c h -> b c 1 h"), nn.GroupNorm(8, cout),
                         Rearrange("b c 1 h -> b c h"), nn.Mish())


class _ConvNormAct(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, 5, padding=2)
        self.norm = nn.GroupNorm(8, cout)
        self.act = nn.Mish()

    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


@pytest.mark.parametrize("style", ["sequential", "rearrange", "expression"])
def test_seed004_conv1d_blocks_fused(style, calls):
    torch.manual_seed(0)
    if style == "expression":
        model = nn.Sequential(_ConvNormAct(4, 16), _ConvNormAct(16, 16)).to(DEVICE)
    else:
        model = nn.Sequential(_seed004_block(4, 16, style == "rearrange"),
                              _seed004_block(16, 16, style == "rearrange")).to(DEVICE)
    _randomize_norms(model)
    reference = copy.deepcopy(model)
    report = normkit.patch(model)
    assert set(report.fused) == {"0", "1"}
    x = torch.randn(3, 4, 24, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    _compare(model, reference, x, lambda m, x: (m(x), m(x).square().mean()), 2e-6, 2e-5)
    assert calls.activation == 2 * 2  # two forward calls of the two blocks in the loss helper
    normkit.unpatch(model)
    assert all(type(m) in (nn.Sequential, nn.Conv1d, nn.GroupNorm, nn.Mish, _ConvNormAct) or
               type(m).__name__ == "Rearrange" for m in model.modules())


def test_sequential_without_a_norm_then_activation_is_left_alone():
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.Mish(), nn.GroupNorm(2, 8))
    assert blocks.fuse(model, dry_run=True) == {}
    model = nn.Sequential(nn.GroupNorm(2, 8), nn.Dropout(0.1), nn.SiLU())  # dropout is not a pure move
    assert blocks.fuse(model, dry_run=True) == {}
