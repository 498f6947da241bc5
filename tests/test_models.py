"""Conformance on real models: every model family built from its own library with a tiny random
configuration (no downloads), patched with normkit.patch, must train like the unpatched model.

For each family and mode four copies of one model run side by side, in the mode's dtype: `patched`;
`plain`, unpatched; `control`, unpatched on the same batch in reverse order (the same loss, other
roundings); and `truth`, unpatched in a wider dtype (fp64 for fp32 mode, fp32 for bf16 and bf16
autocast). The dtype's tolerance is measured, not guessed: the patched model must be as close to the
truth as torch's own runs are (the farther of plain and control), within a factor SLACK, plus a
FLOOR that matters only where torch's error happens to be tiny. That is checked for the output and
the loss, every parameter's gradient, the output after each of three AdamW steps, all parameters
after them, and each patched norm's own parameters. The report patch() returns must name exactly the
norms expected for the family (so nothing passes by patching nothing), and each patched norm must
return what the original returns: the same dtype (autocast included), shape and memory layout.

transformers and diffusers are test dependencies (`make test` installs them): never skipped. timm
needs torchvision, whose PyPI wheels link against CUDA torch (libtorch_cuda.so) and cannot be
imported beside the CPU torch that CI pins (see _timm()); there, and only there, the timm families
skip. They run wherever timm imports (the GPU machine).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import importlib
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as TF
from torch import nn

import normkit
from normkit import reference as ref

from conftest import DEVICE

# test dependencies (the GPU machine gets diffusers as a wheel): missing is a failure, never a skip
transformers = importlib.import_module("transformers")

# ----------------------------------------------------------------------------- modes and tolerances

MODES = {  # name -> (parameter/input dtype, autocast dtype or None, truth dtype)
    "fp32": (torch.float32, None, torch.float64),
    "bf16": (torch.bfloat16, None, torch.float32),
    "autocast": (torch.float32, torch.bfloat16, torch.float32),  # fp32 weights, bf16 compute
}
# SLACK: which side of the truth two runs land on is chance, and so is which one lands nearer.
# FLOOR (relative): fp32 2**-17, 128 units of its rounding; measured on CPU, the most any check needed
# beyond SLACK x torch's error was 2.2e-6 (ResNet-50-GN's 20 logits after 2 AdamW steps), 1e-7
# elsewhere. bf16 2**-7, two units of its rounding; the most needed was 1.5e-3 (the VAE's
# conv_out bias gradient, a sum over all pixels).
SLACK = 2.0
FLOOR = {"fp32": 2.0 ** -17, "bf16": 2.0 ** -7, "autocast": 2.0 ** -7}
STEPS = 3
# Every comparison is one draw of chance (each model's initial weights fix which roundings happen), and
# a draw can land beyond SLACK: on an H100, MaskFormer bf16's FPN conv weight gradients at seed 0 were
# 2.3-2.5x torch's distance from the truth, at seeds 1-4 within it, and normkit's GroupNorm dx alone is
# nearer the truth than torch's CUDA kernel (benchmarks/debug_maskformer_*.py). A family that fails at
# seed 0 is drawn again at REDRAWS other seeds and fails unless all of them pass: a systematic error
# (a wrong formula, a lost rounding) fails every draw.
REDRAWS = (1, 2)
# AdamW's first steps move every weight by about lr whatever its gradient: at 1e-3 these tiny
# over-parameterised models jump around (ResNet-50's loss goes 3.3, 0.7, 8.0) and two unpatched runs
# that differ only in the order of the batch end 20% apart; at 1e-4 they descend smoothly
LR = 1e-4


@pytest.fixture(autouse=True)
def one_thread_on_cpu():
    """pytest -n 2 on 2 cores: a second intra-op thread per worker only oversubscribes the cores
    (these models are too small to gain from it)."""
    saved = torch.get_num_threads()
    if DEVICE == "cpu":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


pytestmark = pytest.mark.usefixtures("exact_fp32")  # fp32 mode must compute in fp32 on a GPU


# ----------------------------------------------------------------------------- the zoo

@dataclasses.dataclass
class Family:
    build: Callable[[], nn.Module]                    # fp32, on the CPU, from a tiny config
    inputs: Callable[[torch.Generator], dict]         # tensors on the CPU; float ones in fp32
    run: Callable[[nn.Module, dict], tuple]           # (output tensor, scalar loss)
    norms: dict                                       # class name -> how many modules patch must replace
    weight_center: float = 1.0                        # Gemma stores its scale as an offset from 1
    channels_last: bool = False                       # model and float inputs in channels_last


def _lm_config(cls, **extra):
    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(extra)
    return cls(**kw)


def _causal_lm(config_cls, model_cls, **extra):
    def build():
        model = getattr(transformers, model_cls)(_lm_config(getattr(transformers, config_cls), **extra))
        return model.train()
    return build


def _wide(t):
    """Losses are computed by the test in fp32, or fp64 for the fp64 truth (HF's own loss would
    round the truth's to fp32)."""
    return t.double() if t.dtype == torch.float64 else t.float()


def _token_inputs(gen, vocab=96, batch=2, seq=12):
    return {"input_ids": torch.randint(3, vocab, (batch, seq), generator=gen)}


def _causal_run(model, inputs):  # next-token prediction
    logits, ids = model(**inputs).logits, inputs["input_ids"]
    return logits, TF.cross_entropy(_wide(logits[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _masked_run(model, inputs):  # BERT's masked-LM head, predicting every token
    logits, ids = model(**inputs).logits, inputs["input_ids"]
    return logits, TF.cross_entropy(_wide(logits).flatten(0, 1), ids.flatten())


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(cfg).train()


def _bert():
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg).train()


def _maskformer():
    """Swin backbone (LayerNorm), FPN pixel decoder (GroupNorm then ReLU(inplace=True)), DETR decoder."""
    swin = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1],
                                   num_heads=[1, 1, 2, 2], window_size=2, drop_path_rate=0.0)
    detr = transformers.DetrConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                   decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=4,
                                   dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    cfg = transformers.MaskFormerConfig(backbone_config=swin, decoder_config=detr, fpn_feature_size=32,
                                        mask_feature_size=32)
    return transformers.MaskFormerModel(cfg).train()  # the segmentation head's loss needs scipy


def _maskformer_run(model, inputs):
    out = model(pixel_values=inputs["x"])
    y = torch.cat([out.pixel_decoder_last_hidden_state.flatten(1),
                   out.transformer_decoder_last_hidden_state.flatten(1)], dim=1)
    return y, _wide(y).square().mean()


def _image_inputs(channels=3, size=16, out_channels=None):
    def make(gen):
        x = torch.randn(2, channels, size, size, generator=gen)
        return {"x": x, "target": torch.randn(2, out_channels or channels, size, size, generator=gen)}
    return make


def _unet():
    return importlib.import_module("diffusers").UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4, attention_head_dim=8).train()


def _unet_run(model, inputs):
    out = model(inputs["x"], timestep=7).sample
    return out, TF.mse_loss(_wide(out), _wide(inputs["target"]))


def _vae():
    return importlib.import_module("diffusers").AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=16).train()


def _vae_run(model, inputs):
    posterior = model.encode(inputs["x"]).latent_dist
    out = model.decode(posterior.mode()).sample
    return out, TF.mse_loss(_wide(out), _wide(inputs["x"])) + 1e-3 * _wide(posterior.kl()).mean()


def _timm():
    """timm, or a skip where it cannot be imported for the documented reason only: it imports
    torchvision, whose PyPI wheels link against CUDA torch (libc10_cuda.so, libtorch_cuda.so), so
    beside a CPU build of torch their ops fail to load and `import torchvision` then fails
    (its _meta_registrations registers a fake kernel for the missing torchvision::nms); CPU wheels
    exist only on PyTorch's own index, which CI cannot reach. So CI does not install timm at all."""
    try:
        return importlib.import_module("timm")
    except ImportError as e:
        missing = getattr(e, "name", None) in ("timm", "torchvision")
        if torch.version.cuda is None and missing:
            pytest.skip(f"timm cannot run beside CPU torch {torch.__version__} ({e}): it needs torchvision, whose "
                        "PyPI wheels link against CUDA torch (libtorch_cuda.so); CPU wheels exist only on PyTorch's "
                        "own index")
        raise
    except RuntimeError as e:  # timm installed, torchvision's import failing as described
        if torch.version.cuda is None and "torchvision::" in str(e):
            pytest.skip(f"torchvision cannot be imported beside CPU torch {torch.__version__}: {e}")
        raise


def _timm_model(name, **kw):
    def build():
        timm = _timm()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return timm.create_model(name, pretrained=False, num_classes=10, **kw).train()
    return build


def _classify_inputs(size=32):
    def make(gen):
        return {"x": torch.randn(2, 3, size, size, generator=gen), "labels": torch.tensor([1, 7])}
    return make


def _classify_run(model, inputs):
    logits = model(inputs["x"])
    return logits, TF.cross_entropy(_wide(logits), inputs["labels"])


_LM = dict(inputs=_token_inputs, run=_causal_run)
FAMILIES = {
    "llama": Family(_causal_lm("LlamaConfig", "LlamaForCausalLM", head_dim=8), norms={"LlamaRMSNorm": 5}, **_LM),
    "qwen2": Family(_causal_lm("Qwen2Config", "Qwen2ForCausalLM"), norms={"Qwen2RMSNorm": 5}, **_LM),
    # Qwen3: also q_norm/k_norm over each head's 8 channels
    "qwen3": Family(_causal_lm("Qwen3Config", "Qwen3ForCausalLM", head_dim=8), norms={"Qwen3RMSNorm": 9}, **_LM),
    "mistral": Family(_causal_lm("MistralConfig", "MistralForCausalLM", head_dim=8), norms={"MistralRMSNorm": 5},
                      **_LM),
    # every token goes to both experts, so the router's top-k has no ties that rounding could flip;
    # the eager experts run in fp64 too (the grouped matmul does not)
    "mixtral": Family(_causal_lm("MixtralConfig", "MixtralForCausalLM", head_dim=8, num_local_experts=2,
                                 num_experts_per_tok=2, experts_implementation="eager"),
                      norms={"MixtralRMSNorm": 5}, **_LM),
    "phi3": Family(_causal_lm("Phi3Config", "Phi3ForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0),
                   norms={"Phi3RMSNorm": 5}, **_LM),
    "gemma": Family(_causal_lm("GemmaConfig", "GemmaForCausalLM", head_dim=8), norms={"GemmaRMSNorm": 5},
                    weight_center=0.0, **_LM),
    # Gemma 2/3: pre/post attention and feed-forward norms, softcapping, sliding window (Gemma 3: q/k norms)
    "gemma2": Family(_causal_lm("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, query_pre_attn_scalar=8,
                                sliding_window=4), norms={"Gemma2RMSNorm": 9}, weight_center=0.0, **_LM),
    "gemma3": Family(_causal_lm("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, query_pre_attn_scalar=8,
                                sliding_window=4), norms={"Gemma3RMSNorm": 13}, weight_center=0.0, **_LM),
    # OLMo 2: norms after attention and MLP, and q/k norms over the whole projection
    "olmo2": Family(_causal_lm("Olmo2Config", "Olmo2ForCausalLM"), norms={"Olmo2RMSNorm": 9}, **_LM),
    # Mamba-2: the gated norm of each mixer (MambaRMSNormGated, x * silu(gate) normalized in 2 groups of
    # 32 channels: normkit's gate= with per-group weights), and the RMSNorms around the mixers
    "mamba2": Family(_causal_lm("Mamba2Config", "Mamba2ForCausalLM", num_heads=8, head_dim=8, expand=2, n_groups=2,
                                state_size=8, chunk_size=8),
                     norms={"Mamba2RMSNorm": 3, "MambaRMSNormGated": 2}, **_LM),
    "gpt2": Family(_gpt2, norms={"LayerNorm": 5}, **_LM),
    "bert": Family(_bert, _token_inputs, _masked_run, norms={"LayerNorm": 6}),
    # GroupNorm then ReLU(inplace=True) in a transformers model: the in-place case on every CI run
    "maskformer": Family(_maskformer, _image_inputs(size=32), _maskformer_run, norms={"LayerNorm": 21, "GroupNorm": 7}),
    "unet2d": Family(_unet, _image_inputs(), _unet_run, norms={"GroupNorm": 21}),
    "autoencoder_kl": Family(_vae, _image_inputs(), _vae_run, norms={"GroupNorm": 24}),
    "vit": Family(_timm_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2),
                  _classify_inputs(16), _classify_run, norms={"LayerNorm": 5}),
    # ConvNeXt blocks: LayerNorm2d (NCHW) in the stem and downsampling layers, timm's LayerNorm on the
    # blocks' channels-last permuted activations; with conv_mlp, LayerNorm2d everywhere, here on
    # channels_last tensors (the copy-free path)
    "convnext": Family(_timm_model("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), conv_mlp=False),
                       _classify_inputs(), _classify_run, norms={"LayerNorm2d": 5, "LayerNorm": 4}),
    "convnext_channels_last": Family(_timm_model("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32),
                                                 conv_mlp=True),
                                     _classify_inputs(), _classify_run, norms={"LayerNorm2d": 9}, channels_last=True),
    # GroupNorm, then ReLU(inplace=True); bottlenecks add the shortcut in place (x += shortcut)
    "resnet50_gn": Family(_timm_model("resnet50_gn"), _classify_inputs(), _classify_run, norms={"GroupNorm": 53}),
}


# ----------------------------------------------------------------------------- the comparison

def _randomize_norm_params(model: nn.Module, names, weight_center: float) -> None:
    """Models initialise norm weights to 1 (or 0) and biases to 0, which would hide a weight or
    bias applied wrongly: draw them afresh."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in names:
            for pname, p in model.get_submodule(name).named_parameters(recurse=False):
                center = weight_center if pname == "weight" else 0.0
                p.copy_(center + 0.3 * torch.randn(p.shape, generator=gen))


def _to(model_or_inputs, dtype, channels_last=False):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if isinstance(model_or_inputs, nn.Module):
        return model_or_inputs.to(device=DEVICE, dtype=dtype, memory_format=fmt)
    return {k: (v.to(DEVICE, dtype).contiguous(memory_format=fmt if v.dim() == 4 else torch.contiguous_format)
                if v.is_floating_point() else v.to(DEVICE)) for k, v in model_or_inputs.items()}


def _channels_last(t) -> bool:
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _record_norm_outputs(model, names):
    """What each norm module returns, in call order: dtype, shape, layout, requires_grad."""
    seen = []

    def hook(module, args, out):
        layout = _channels_last(out)
        if isinstance(module, nn.GroupNorm) and out.is_cuda:
            # the documented difference: normkit keeps a channels_last input's format, torch's CUDA kernel
            # returns NCHW; the layers after it then pass that format on to the next GroupNorm's input
            layout = None
        seen.append((module._conformance_name, out.dtype, tuple(out.shape), layout, out.requires_grad))

    for name in names:
        m = model.get_submodule(name)
        m._conformance_name = name
        m.register_forward_hook(hook)
    return seen


class _Check:
    """Collects the comparisons of one run and reports every failure at once. Each takes the same
    quantity from the four models: patched, plain, control, truth."""

    def __init__(self, mode):
        self.floor, self.failures = FLOOR[mode], []

    def close(self, what, patched, plain, control, truth, one_sample_noise=0.0):
        e_patched = ref.rel_err(patched, truth)
        e_torch = max(ref.rel_err(plain, truth), ref.rel_err(control, truth))
        if torch.equal(plain, control):  # the control rounded exactly as plain: one sample of torch's noise
            e_torch = max(e_torch, one_sample_noise)
        bound = SLACK * e_torch + self.floor
        if not e_patched <= bound:
            self.failures.append(f"{what}: patched is {e_patched:.3g} from the truth, unpatched up to {e_torch:.3g} "
                                 f"(bound {bound:.3g})")

    def grads(self, models):
        """Every parameter's gradient: present exactly where torch's is, and as close as torch's.
        A gradient that is zero in exact arithmetic (an attention key bias: softmax ignores it) is
        rounding noise in every model, and the noise of two models is not comparable: there the
        patched gradient must be within FLOOR of the size such a gradient would have at the model's
        RMS gradient (the truth is below 1e-5 of it; real gradients here are above 5e-5)."""
        grads = [dict((n, p.grad) for n, p in m.named_parameters()) for m in models]
        assert all(list(g) == list(grads[-1]) for g in grads)
        present = [g for g in grads[-1].values() if g is not None]
        rms = torch.cat([g.detach().reshape(-1).double().cpu() for g in present]).square().mean().sqrt().item()
        # Where the control's flipped batch rounds a gradient exactly as plain does (a bias summed over
        # a batch of two: a + b == b + a), torch's noise on it is one sample, which can be far below its
        # typical size (AutoencoderKL bf16, quant_conv.bias: torch 0.0021 from the truth at seed 0, but
        # 0.002-0.058, median 0.018 over seeds 0-11, where normkit's is 0.007-0.056, median 0.012): there
        # the bound uses the median of torch's own errors over the model's gradients instead
        noise = sorted(ref.rel_err(grads[1][n], g) for n, g in grads[-1].items()
                       if g is not None and g.detach().double().norm().item() > 0)
        one_sample_noise = noise[len(noise) // 2] if noise else 0.0
        for n, g_truth in grads[-1].items():
            if any((g[n] is None) != (g_truth is None) for g in grads):
                self.failures.append(f"{n}: gradient is None in one model and not in another")
                continue
            if g_truth is None:
                continue
            scale = rms * g_truth.numel() ** 0.5
            err = (grads[0][n].detach().double().cpu() - g_truth.detach().double().cpu()).norm().item()
            if g_truth.detach().double().norm().item() >= 1e-5 * scale:
                self.close(f"gradient of {n}", *(g[n] for g in grads), one_sample_noise=one_sample_noise)
            elif not err <= self.floor * scale:
                self.failures.append(f"gradient of {n} (zero in exact arithmetic): patched is "
                                     f"{err / scale:.3g} of the model's gradient scale")


def _flat_params(model):
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for p in model.parameters()])


def _check_family(name: str, mode: str):
    try:
        _check_draw(name, mode, seed=0)
    except AssertionError as first:
        for seed in REDRAWS:
            try:
                _check_draw(name, mode, seed)
            except AssertionError as again:
                raise AssertionError(f"seed 0: {first}\nseed {seed}: {again}") from None
        warnings.warn(f"{name} {mode}: seed 0 failed, seeds {REDRAWS} passed: {first}")


def _check_draw(name: str, mode: str, seed: int):
    fam = FAMILIES[name]
    dtype, autocast_dtype, truth_dtype = MODES[mode]
    torch.manual_seed(seed)
    base = fam.build()
    expected = [n for n, m in base.named_modules() if type(m).__name__ in fam.norms]
    dry = normkit.patch(base, dry_run=True)
    assert set(dry) == set(expected) and dry.dry_run, f"dry run: {dry}"
    assert not any(type(m).__name__.startswith("Normkit") for m in base.modules()), "dry_run patched something"
    _randomize_norm_params(base, expected, fam.weight_center)
    # control: torch again, on the batch in reverse order (the same loss, other roundings): with plain
    # it gives two samples of torch's own distance from the truth
    models = [_to(copy.deepcopy(base), d, fam.channels_last) for d in (dtype, dtype, dtype, truth_dtype)]
    patched, plain, control, truth = models

    if DEVICE == "cuda":
        # torch's CUDA GroupNorm returns NCHW where normkit keeps the input's strides (channels_last, or
        # ambiguous ones such as MaskFormer's [2, 32, 1, 1] stem that interpolate() then reads as
        # channels_last), and the convolutions after it run in the other layout (other algorithms,
        # other roundings: bf16 weight gradients 2.5x farther from the truth seen on an H200): the
        # control keeps the input's strides too, so torch's distance from the truth includes that
        for m in control.modules():
            if isinstance(m, nn.GroupNorm):
                m.register_forward_hook(lambda m, i, o: torch.empty_like(i[0], dtype=o.dtype).copy_(o)
                                        if i[0].stride() != o.stride() else None)

    report = normkit.patch(patched)
    # exactly the expected norms, and all of them: a test cannot pass by patching nothing
    assert collections.Counter(c.__name__ for c in report.values()) == fam.norms, str(report)
    assert set(report) == set(expected) and report.skipped == {}, str(report)
    for n in expected:
        assert type(patched.get_submodule(n)) is not type(plain.get_submodule(n))

    seen_patched, seen_plain = _record_norm_outputs(patched, expected), _record_norm_outputs(plain, expected)
    raw = fam.inputs(torch.Generator().manual_seed(2))
    flipped = {k: v.flip(0) for k, v in raw.items()}
    batches = [_to(b, d, fam.channels_last) for b, d in ((raw, dtype), (raw, dtype), (flipped, dtype),
                                                          (raw, truth_dtype))]
    autocast = [autocast_dtype is not None] * 3 + [False]
    with torch.no_grad():  # no dropout or other randomness left on, or the comparisons mean nothing
        assert ref.rel_err(fam.run(truth, batches[3])[0], fam.run(truth, batches[3])[0]) <= 1e-9, "not deterministic"
    optims = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    check = _Check(mode)
    for i in range(STEPS + 1):
        outs, losses = [], []
        for model, batch, amp in zip(models, batches, autocast):
            with torch.autocast(DEVICE, dtype=autocast_dtype or torch.bfloat16, enabled=amp):
                out, loss = fam.run(model, batch)
            if i < STEPS:
                loss.backward()
            outs.append(out.detach())
            losses.append(loss.detach())
        outs[2] = outs[2].flip(0)  # the control's batch back in order
        check.close(f"output after {i} steps", *outs)
        if i == 0:
            assert seen_patched == seen_plain, "the patched norms return other dtypes, shapes or layouts"
            assert len(seen_patched) >= len(expected)
            check.close("loss", *losses)
            check.grads(models)
        if i == STEPS:
            break
        for opt in optims:
            opt.step()
            opt.zero_grad(set_to_none=True)
    # After AdamW steps a parameter whose gradient is zero in exact arithmetic (e.g. an attention key
    # bias: softmax ignores it) has moved by +-lr per element at random, in every model; so do the
    # losses, scalars made from a few outputs: the outputs after each step, the parameters as a
    # whole and the patched norms' parameters one by one are compared
    check.close(f"all parameters after {STEPS} steps", *(_flat_params(m) for m in models))
    for n in expected:
        for pname, _ in patched.get_submodule(n).named_parameters(recurse=False):
            check.close(f"{n}.{pname} after {STEPS} steps", *(m.get_submodule(n).get_parameter(pname) for m in models))
    assert not check.failures, f"{name} {mode}: " + "; ".join(check.failures[:8]) + \
        (f" (+{len(check.failures) - 8} more)" if len(check.failures) > 8 else "")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_patched_model_trains_like_the_original(name, mode):
    _check_family(name, mode)


# ----------------------------------------------------------------------------- timm's norm layers

@pytest.mark.parametrize("name, args", [("LayerNorm", (24,)), ("LayerNorm2d", (24,)), ("GroupNorm", (24, 4)),
                                        ("GroupNorm1", (24,)), ("RmsNorm", (24,))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_timm_norm_layers_compute_what_timm_computes(name, args, dtype):
    """Each timm layer patch stands in for gives timm's output and gradients, in both layouts: as
    close to timm's layer run in fp64 as timm's own (bf16: within SLACK of it, plus one rounding)."""
    layers = _timm().layers
    torch.manual_seed(5)
    theirs = getattr(layers, name)(*args)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p is theirs.weight else 0.0))
    truth = copy.deepcopy(theirs).to(DEVICE, torch.float64)
    theirs = theirs.to(DEVICE, dtype)
    ours = copy.deepcopy(theirs)
    assert set(normkit.patch(ours)) == {""}
    shape = (3, 24) if name in ("LayerNorm", "RmsNorm") else (2, 24, 5, 7)
    floor = 1e-6 if dtype == torch.float32 else 2.0 ** -8
    for fmt in (torch.contiguous_format, torch.channels_last) if len(shape) == 4 else (torch.contiguous_format,):
        x = (2 * torch.randn(shape) + 1).to(DEVICE, dtype).contiguous(memory_format=fmt)
        dy = torch.randn(shape).to(DEVICE, dtype)
        results = []
        for m in (ours, theirs, truth):
            xm = x.to(torch.float64 if m is truth else dtype).requires_grad_(True)
            y = m(xm)
            results.append([y, *torch.autograd.grad(y, [xm, *m.parameters()], dy.to(y.dtype))])
        assert results[0][0].dtype == results[1][0].dtype
        # torch's CUDA GroupNorm returns NCHW for channels_last input; normkit keeps the input's format
        kept = "GroupNorm" in name and x.is_cuda and fmt == torch.channels_last
        assert results[0][0].stride() == (x.stride() if kept else results[1][0].stride())
        for what, o, t, r in zip(["y", "dx", "dweight", "dbias"], *results):
            err, err_timm = ref.rel_err(o, r), ref.rel_err(t, r)
            assert err <= SLACK * err_timm + floor, f"{name} {fmt} {what}: {err:.3g} vs timm's {err_timm:.3g}"


def test_timm_layer_norm_2d_reads_channels_last_input_in_place(monkeypatch):
    """LayerNorm2d normalizes dim 1: on a channels_last tensor the channels of each pixel are a
    contiguous row, and normkit's kernel reads them where they are (no copy)."""
    norm = _timm().layers.LayerNorm2d(16).to(DEVICE)
    normkit.patch(norm)
    from normkit import _host
    monkeypatch.setattr(_host, "fast", None)  # the Python path, where the backend's entry point can be watched
    backend = normkit.backends.get("torch" if DEVICE == "cpu" else "triton")
    seen, real = [], backend.row_norm_fwd
    monkeypatch.setattr(backend, "row_norm_fwd", lambda x, *a, **k: seen.append(x) or real(x, *a, **k))
    x = torch.randn(2, 16, 5, 3, device=DEVICE).contiguous(memory_format=torch.channels_last)
    norm(x)
    assert len(seen) == 1 and seen[0].data_ptr() == x.data_ptr() and seen[0].shape == (30, 16)


def test_timm_fast_norm_layers_are_left_alone_and_listed():
    timm = _timm()
    timm.layers.set_fast_norm(True)
    try:
        model = timm.create_model("convnext_atto", pretrained=False, depths=(1, 1, 1, 1), dims=(8, 16, 24, 32))
    finally:
        timm.layers.set_fast_norm(False)
    report = normkit.patch(model)
    assert report == {} and len(report.skipped) == 9
    assert all("fast-norm mode" in why for why in report.skipped.values()), str(report)
