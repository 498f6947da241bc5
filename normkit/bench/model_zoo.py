"""The models of `normkit bench --models`, as data: each from its own library with random weights,
a size per preset, its inputs, its loss and its output.

A spec builds the model on the device (`build(size, device)`), makes one step's inputs
(`batch(size, device, dtype, gen)`), and says how a training step's loss (`loss(model, batch)`) and
an inference step's output (`output(model, batch)`) are computed; HF causal LMs also decode.
Presets: "full" (the GPU default: realistic widths, few layers so that a step takes tens of ms),
"tiny" (the CPU default and the CI test). A missing library is an Unavailable with the reason.

Why these sizes: the HF models keep their real widths (Llama: TinyLlama-1.1B; Qwen3: Qwen3-1.7B;
Gemma: Gemma-2B) at 4 layers and a 32000-token vocabulary, so that the layers, not the output
head, dominate a step as they do at full depth; 4 x 2048 tokens per training step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

F = nn.functional


class Unavailable(Exception):
    """This model cannot be built here (a library is missing or too old); the message says why."""


def _require(module: str, dist: str):
    import importlib
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - an import that fails for any reason is a skip reason
        raise Unavailable(f"{module} is not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          f"pip install {dist}") from None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    about: str
    library: str  # where the model comes from
    modes: tuple  # of "train", "infer", "decode"
    dtype: str  # default on a GPU ("bf16", "fp32"); the CPU runs fp32
    sizes: dict  # preset -> dict of sizes
    build: Callable  # (size, device) -> nn.Module
    batch: Callable  # (size, device, dtype, gen) -> dict of input tensors
    loss: Callable  # (model, batch) -> scalar loss of a training step
    output: Callable  # (model, batch) -> the output tensor of an inference step
    items: Callable  # size -> items per train/infer step (tokens, images, samples)
    unit: str
    decode_shape: Callable = field(default=lambda size: "")
    liger: Optional[str] = None  # liger_kernel.transformers.apply_liger_kernel_to_<this>, if Liger patches it
    channels_last: bool = False
    shape: Callable = field(default=lambda size: "")  # size -> a short label of the step's input
    fuse: object = True  # normkit.patch's fuse= ("relaxed": the adaLN modulation fused in bf16 too)


# ----------------------------------------------------------------------------- HF causal LMs

HF_FULL = dict(vocab_size=32000, num_hidden_layers=4, max_position_embeddings=4096, batch=4, seq=2048,
               prompt=128, new_tokens=64)
HF_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128, batch=2, seq=32, prompt=8,
               new_tokens=8)
_NOT_CONFIG = ("batch", "seq", "prompt", "new_tokens")

HF_MODELS = {  # name -> (config class, model class, the real model's widths at full size)
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4, head_dim=64)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1, head_dim=256)),
}


def _hf_build(name: str):
    def build(size, device):
        transformers = _require("transformers", "transformers")
        cfg_name, model_name, _ = HF_MODELS[name]
        cfg_cls, model_cls = getattr(transformers, cfg_name, None), getattr(transformers, model_name, None)
        if cfg_cls is None or model_cls is None:
            raise Unavailable(f"transformers {transformers.__version__} has no {model_name}")
        cfg = cfg_cls(**{k: v for k, v in size.items() if k not in _NOT_CONFIG}, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, attention_dropout=0.0, use_cache=False)
        with torch.device(device):
            return model_cls(cfg)
    return build


def _hf_batch(size, device, dtype, gen):
    ids = torch.randint(3, size["vocab_size"], (size["batch"], size["seq"]), generator=gen, device=device)
    return {"input_ids": ids}


def _hf_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss


def _hf_output(model, batch):
    return model(input_ids=batch["input_ids"], use_cache=False).logits


def _hf_spec(name: str, about: str) -> ModelSpec:
    return ModelSpec(
        name, about, "transformers", ("train", "infer", "decode"), "bf16",
        {"full": {**HF_FULL, **HF_MODELS[name][2]}, "tiny": HF_TINY},
        _hf_build(name), _hf_batch, _hf_loss, _hf_output, lambda s: s["batch"] * s["seq"], "tokens",
        liger=name, shape=lambda s: f"{s['batch']}x{s['seq']} tok, h{s['hidden_size']}, {s['num_hidden_layers']}L",
        decode_shape=lambda s: f"batch 1, {s['prompt']}+{s['new_tokens']} tok, h{s['hidden_size']}, {s['num_hidden_layers']}L")


class Decoder:
    """Batch-1 greedy decoding with a static KV cache: a step feeds the last token and takes the
    argmax of the logits (no host sync); `prepare` starts a new round at the end of the prompt
    when the cache is full. The same static cache serves eager and torch.compile (HF's compile path).
    """

    def __init__(self, model, size: dict, device, gen):
        transformers = _require("transformers", "transformers")
        self.model, self.prompt_len, self.new_tokens = model, size["prompt"], size["new_tokens"]
        try:
            self.cache = transformers.StaticCache(config=model.config, max_cache_len=self.prompt_len + self.new_tokens)
        except TypeError as e:
            raise Unavailable(f"transformers {transformers.__version__}: StaticCache(config, max_cache_len) "
                              f"failed: {e}") from None
        prompt = torch.randint(3, size["vocab_size"], (1, self.prompt_len), generator=gen, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.first = prompt[:, -1:].clone()  # every round, and every variant, starts from the same token
        self.tok = torch.empty(1, 1, dtype=torch.long, device=device).copy_(self.first)
        self.done = 0
        # transformers 5.24 renamed past_key_values to cache (the old name is deprecated until 5.40)
        import inspect
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, cache_position=torch.arange(self.prompt_len, device=device),
                  **{self.cache_arg: self.cache})
        self.fn = self.step_logits  # torch.compile replaces it

    def step_logits(self, tok, pos):
        return self.model(input_ids=tok, cache_position=pos, position_ids=pos[None], use_cache=True,
                          **{self.cache_arg: self.cache}).logits

    def _rewind(self):
        """Back to the end of the prompt. transformers >= 5.2x's static layers count the tokens they
        hold in a tensor of their own (and ignore cache_position): set it in place too."""
        self.pos.fill_(self.prompt_len)
        self.tok.copy_(self.first)
        for layer in getattr(self.cache, "layers", ()):
            held = getattr(layer, "cumulative_length", None)
            if isinstance(held, torch.Tensor):
                held.fill_(self.prompt_len)

    def prepare(self):
        if self.done % self.new_tokens == 0:  # a new round: overwrite the generated part of the cache
            self._rewind()

    def step(self):
        with torch.no_grad():
            logits = self.fn(self.tok, self.pos)
            self.tok.copy_(logits[:, -1:].argmax(-1))  # the same input tensor every step: no recompile
            self.pos.add_(1)
        self.done += 1

    def reference(self):
        """The logits of the first generated token: what a patched model must reproduce."""
        self._rewind()
        with torch.no_grad():
            out = self.fn(self.tok, self.pos).float().clone()
        self.done = 0
        return out


# ----------------------------------------------------------------------------- timm vision models

def _timm_build(name: str):
    def build(size, device):
        timm = _require("timm", "timm")
        kwargs = {k: v for k, v in size.items() if k not in ("batch", "img")}
        with torch.device(device):
            return timm.create_model(name, pretrained=False, num_classes=1000, **kwargs)
    return build


def _image_batch(size, device, dtype, gen):
    x = torch.randn(size["batch"], 3, size["img"], size["img"], generator=gen, device=device).to(dtype)
    y = torch.randint(0, 1000, (size["batch"],), generator=gen, device=device)
    return {"x": x, "y": y}


def _classifier_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def _classifier_output(model, batch):
    return model(batch["x"])


def _timm_spec(name, model_name, about, full, tiny, channels_last=False) -> ModelSpec:
    return ModelSpec(name, about, "timm", ("train", "infer"), "bf16", {"full": full, "tiny": tiny}, _timm_build(model_name),
                     _image_batch, _classifier_loss, _classifier_output, lambda s: s["batch"], "images",
                     channels_last=channels_last, shape=lambda s: f"{s['batch']}x3x{s['img']}x{s['img']}")


# ----------------------------------------------------------------------------- diffusion U-Nets

class ResnetBlock2D(nn.Module):
    """diffusers' ResnetBlock2D without the time embedding: GroupNorm -> SiLU -> conv3x3, twice, plus
    the input. The stand-in where diffusers cannot be imported, and the issue's 4-block example."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(groups, channels, eps=1e-6), nn.GroupNorm(groups, channels, eps=1e-6)
        self.conv1, self.conv2 = nn.Conv2d(channels, channels, 3, padding=1), nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


class ResnetBlocks(nn.Module):
    def __init__(self, channels: int, groups: int, blocks: int):
        super().__init__()
        self.blocks = nn.Sequential(*(ResnetBlock2D(channels, groups) for _ in range(blocks)))

    def forward(self, sample, timestep=None):
        return self.blocks(sample)


def _resblocks_build(size, device):
    with torch.device(device):
        return ResnetBlocks(size["channels"], size["groups"], size["blocks"])


def _unet2d_build(size, device):
    try:
        diffusers = _require("diffusers", "diffusers")
        cls = diffusers.UNet2DModel
    except (Unavailable, AttributeError) as e:
        raise Unavailable(f"{e}; the benchmark's ResnetBlock2D stack ('resnet-blocks') stands in") from None
    kwargs = {k: v for k, v in size.items() if k not in ("batch",)}
    with torch.device(device):
        return cls(**kwargs)


def _unet_batch(channels_key: str, spatial: Callable):
    def batch(size, device, dtype, gen):
        shape = (size["batch"], size[channels_key]) + spatial(size)
        x = torch.randn(shape, generator=gen, device=device).to(dtype)
        noise = torch.randn(shape, generator=gen, device=device).to(dtype)
        t = torch.randint(0, 1000, (size["batch"],), generator=gen, device=device)
        return {"x": x, "t": t, "noise": noise}
    return batch


def _denoiser_output(model, batch):
    out = model(batch["x"], batch["t"])
    return getattr(out, "sample", out)  # diffusers returns an output object, the stand-ins a tensor


def _noise_loss(output: Callable) -> Callable:
    """A denoiser's training loss: the MSE of its prediction (output(model, batch)) to the noise."""
    return lambda model, batch: F.mse_loss(output(model, batch), batch["noise"])


_denoiser_loss = _noise_loss(_denoiser_output)


# ----------------------------------------------------------------------------- seed 004's 1D U-Net

class Conv1dBlock(nn.Module):
    """Seed 004's block: Conv1d -> GroupNorm(8) -> Mish."""

    def __init__(self, cin: int, cout: int, kernel: int = 5, groups: int = 8):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, padding=kernel // 2)
        self.norm = nn.GroupNorm(groups, cout)
        self.act = nn.Mish()

    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


class Residual1d(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.blocks = nn.Sequential(Conv1dBlock(cin, cout, groups=groups), Conv1dBlock(cout, cout, groups=groups))
        self.skip = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        return self.blocks(x) + self.skip(x)


class UNet1d(nn.Module):
    """The 1D conv U-Net of seed 004's series (Diffusion Policy's ConditionalUnet1D without its
    conditioning): per level two residual blocks of Conv1d -> GroupNorm(8) -> Mish, stride-2
    downsampling, transposed-conv upsampling with skip connections."""

    def __init__(self, in_channels: int, dims: tuple, groups: int = 8):
        super().__init__()
        chans = (in_channels,) + tuple(dims)
        self.down = nn.ModuleList()
        for i, (cin, cout) in enumerate(zip(chans[:-1], chans[1:])):
            last = i == len(dims) - 1
            self.down.append(nn.ModuleList([Residual1d(cin, cout, groups), Residual1d(cout, cout, groups),
                                            nn.Identity() if last else nn.Conv1d(cout, cout, 3, 2, 1)]))
        self.mid = nn.Sequential(Residual1d(dims[-1], dims[-1], groups), Residual1d(dims[-1], dims[-1], groups))
        self.up = nn.ModuleList()
        for cin, cout in zip(reversed(dims[1:]), reversed(dims[:-1])):
            self.up.append(nn.ModuleList([Residual1d(2 * cin, cout, groups), Residual1d(cout, cout, groups),
                                          nn.ConvTranspose1d(cout, cout, 4, 2, 1)]))
        self.final = nn.Sequential(Conv1dBlock(dims[0], dims[0], groups=groups), nn.Conv1d(dims[0], in_channels, 1))

    def forward(self, sample, timestep=None):
        x, skips = sample, []
        for res1, res2, down in self.down:
            x = res2(res1(x))
            skips.append(x)
            x = down(x)
        x = self.mid(x)
        for res1, res2, up in self.up:
            x = up(res2(res1(torch.cat([x, skips.pop()], dim=1))))
        return self.final(x)


def _unet1d_build(size, device):
    with torch.device(device):
        return UNet1d(size["channels"], tuple(size["dims"]))


# ----------------------------------------------------------------------------- encoders and diffusion transformers

def _whisper_build(size, device):
    transformers = _require("transformers", "transformers")
    from transformers.models.whisper import modeling_whisper
    cfg = transformers.WhisperConfig(d_model=size["d_model"], encoder_layers=size["layers"],
                                     encoder_attention_heads=size["heads"], encoder_ffn_dim=4 * size["d_model"],
                                     num_mel_bins=size["mels"], max_source_positions=size["frames"] // 2,
                                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    with torch.device(device):
        return modeling_whisper.WhisperEncoder(cfg)


def _mel_batch(size, device, dtype, gen):
    x = torch.randn(size["batch"], size["mels"], size["frames"], generator=gen, device=device).to(dtype)
    return {"x": x}


def _encoder_output(model, batch):
    key = "input_features" if "x" in batch else "input_ids"
    return model(**{key: batch.get("x", batch.get("input_ids"))}).last_hidden_state


def _encoder_loss(model, batch):
    return _encoder_output(model, batch).float().square().mean()


def _t5_build(size, device):
    transformers = _require("transformers", "transformers")
    cfg = transformers.T5Config(vocab_size=size["vocab_size"], d_model=size["d_model"], d_kv=size["d_model"] // size["heads"],
                                d_ff=size["d_ff"], num_layers=size["layers"], num_heads=size["heads"], dropout_rate=0.0)
    with torch.device(device):
        return transformers.T5EncoderModel(cfg)


def _diffusers_class(name: str):
    diffusers = _require("diffusers", "diffusers")
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise Unavailable(f"diffusers {diffusers.__version__} has no {name}")
    return cls


def _dit_build(size, device):
    cls = _diffusers_class("DiTTransformer2DModel")
    with torch.device(device):
        return cls(num_attention_heads=size["heads"], attention_head_dim=size["hidden"] // size["heads"],
                   in_channels=size["channels"], num_layers=size["layers"], sample_size=size["latent"],
                   patch_size=2, num_embeds_ada_norm=1000)


def _dit_batch(size, device, dtype, gen):
    batch = _unet_batch("channels", lambda s: (s["latent"],) * 2)(size, device, dtype, gen)
    batch["labels"] = torch.randint(0, 1000, (size["batch"],), generator=gen, device=device)
    return batch


def _dit_output(model, batch):
    return model(batch["x"], timestep=batch["t"], class_labels=batch["labels"]).sample


def _sd3_build(size, device):
    cls = _diffusers_class("SD3Transformer2DModel")
    with torch.device(device):
        return cls(sample_size=size["latent"], patch_size=2, in_channels=size["channels"], num_layers=size["layers"],
                   attention_head_dim=size["hidden"] // size["heads"], num_attention_heads=size["heads"],
                   joint_attention_dim=size["text_dim"], caption_projection_dim=size["hidden"],
                   pooled_projection_dim=size["pooled"], out_channels=size["channels"])


def _sd3_batch(size, device, dtype, gen):
    batch = _unet_batch("channels", lambda s: (s["latent"],) * 2)(size, device, dtype, gen)
    batch["text"] = torch.randn(size["batch"], size["text_tokens"], size["text_dim"], generator=gen,
                                device=device).to(dtype)
    batch["pooled"] = torch.randn(size["batch"], size["pooled"], generator=gen, device=device).to(dtype)
    return batch


def _sd3_output(model, batch):
    return model(batch["x"], encoder_hidden_states=batch["text"], pooled_projections=batch["pooled"],
                 timestep=batch["t"]).sample


def _sd_unet_build(size, device):
    diffusers = _require("diffusers", "diffusers")
    kwargs = {k: v for k, v in size.items() if k not in ("batch", "text_tokens")}
    with torch.device(device):
        return diffusers.UNet2DConditionModel(**kwargs)


def _sd_batch(size, device, dtype, gen):
    batch = _unet_batch("in_channels", lambda s: (s["sample_size"],) * 2)(size, device, dtype, gen)
    batch["text"] = torch.randn(size["batch"], size["text_tokens"], size["cross_attention_dim"], generator=gen,
                                device=device).to(dtype)
    return batch


def _sd_output(model, batch):
    return model(batch["x"], batch["t"], encoder_hidden_states=batch["text"]).sample


# ----------------------------------------------------------------------------- the table

SPECS = {s.name: s for s in (
    _hf_spec("llama", "HF LlamaForCausalLM (RMSNorm, Llama style)"),
    _hf_spec("qwen3", "HF Qwen3ForCausalLM (RMSNorm + per-head QK-norm)"),
    _hf_spec("gemma", "HF GemmaForCausalLM (RMSNorm with a (1 + weight) offset)"),
    _timm_spec("vit", "vit_base_patch16_224", "timm ViT-B/16 (LayerNorm)",
               dict(batch=128, img=224), dict(batch=2, img=32, img_size=32, depth=2, embed_dim=64, num_heads=2)),
    _timm_spec("convnext", "convnext_tiny", "timm ConvNeXt-T, channels_last (LayerNorm2d, LayerNorm)",
               dict(batch=64, img=224), dict(batch=2, img=32, depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)),
               channels_last=True),
    _timm_spec("resnet50-gn", "resnet50_gn", "timm ResNet-50-GN (GroupNorm(32) + in-place ReLU)",
               dict(batch=64, img=224), dict(batch=2, img=32, layers=(1, 1, 1, 1))),
    ModelSpec("unet2d", "diffusers UNet2DModel (GroupNorm(32) + SiLU, attention at 32x32)", "diffusers",
              ("train", "infer"), "bf16",
              {"full": dict(batch=8, sample_size=64, in_channels=3, out_channels=3, layers_per_block=2,
                            block_out_channels=(128, 256, 256, 256),
                            down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
                            up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D")),
               "tiny": dict(batch=2, sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                            block_out_channels=(32, 32), norm_num_groups=8, down_block_types=("DownBlock2D",) * 2,
                            up_block_types=("UpBlock2D",) * 2)},
              _unet2d_build, _unet_batch("in_channels", lambda s: (s["sample_size"],) * 2),
              _denoiser_loss, _denoiser_output, lambda s: s["batch"], "images",
              shape=lambda s: f"{s['batch']}x{s['in_channels']}x{s['sample_size']}x{s['sample_size']}"),
    ModelSpec("resnet-blocks", "4 ResnetBlock2D (GroupNorm(32) + SiLU + conv3x3), the issue's example",
              "normkit's benchmark", ("train", "infer"), "bf16",
              {"full": dict(batch=8, channels=320, hw=64, groups=32, blocks=4),
               "tiny": dict(batch=2, channels=32, hw=8, groups=8, blocks=2)},
              _resblocks_build, _unet_batch("channels", lambda s: (s["hw"],) * 2),
              _denoiser_loss, _denoiser_output, lambda s: s["batch"], "images",
              shape=lambda s: f"{s['batch']}x{s['channels']}x{s['hw']}x{s['hw']}"),
    ModelSpec("unet1d", "seed 004's 1D conv U-Net (Conv1d -> GroupNorm(8) -> Mish), batch 1, fp32 as in the seed",
              "normkit's benchmark", ("train", "infer"), "fp32",
              {"full": dict(batch=1, channels=32, length=256, dims=(128, 256, 512)),
               "tiny": dict(batch=1, channels=4, length=32, dims=(16, 32))},
              _unet1d_build, _unet_batch("channels", lambda s: (s["length"],)),
              _denoiser_loss, _denoiser_output, lambda s: s["batch"], "samples",
              shape=lambda s: f"{s['batch']}x{s['channels']}x{s['length']}, dims {'/'.join(map(str, s['dims']))}"),
    ModelSpec("whisper-encoder", "HF WhisperEncoder, Whisper-small widths (LayerNorm on column-strided rows: the "
              "conv output is permuted)", "transformers", ("train", "infer"), "bf16",
              {"full": dict(batch=8, mels=80, frames=3000, d_model=768, layers=12, heads=12),
               "tiny": dict(batch=2, mels=16, frames=32, d_model=64, layers=2, heads=4)},
              _whisper_build, _mel_batch, _encoder_loss, _encoder_output, lambda s: s["batch"], "clips",
              shape=lambda s: f"{s['batch']}x{s['mels']}x{s['frames']} mel, d{s['d_model']}, {s['layers']}L"),
    ModelSpec("t5-encoder", "HF T5EncoderModel, T5-base widths (T5LayerNorm: recognised by computation)",
              "transformers", ("train", "infer"), "bf16",
              {"full": dict(batch=8, seq=512, vocab_size=32128, d_model=768, d_ff=3072, layers=12, heads=12),
               "tiny": dict(batch=2, seq=16, vocab_size=128, d_model=64, d_ff=128, layers=2, heads=4)},
              _t5_build, _hf_batch, _encoder_loss, _encoder_output, lambda s: s["batch"] * s["seq"], "tokens",
              shape=lambda s: f"{s['batch']}x{s['seq']} tok, d{s['d_model']}, {s['layers']}L"),
    ModelSpec("dit", "diffusers DiTTransformer2DModel, DiT-XL widths, 12 layers (adaLN-Zero: LayerNorm without "
              "affine, then the modulation: fused by normkit.patch in fp32; in bf16 with the normkit-relaxed variant)",
              "diffusers", ("train", "infer"), "bf16",
              {"full": dict(batch=16, channels=4, latent=32, hidden=1152, heads=16, layers=12),
               "tiny": dict(batch=2, channels=4, latent=8, hidden=64, heads=4, layers=2)},
              _dit_build, _dit_batch, _noise_loss(_dit_output), _dit_output, lambda s: s["batch"], "images",
              shape=lambda s: f"{s['batch']}x{s['channels']}x{s['latent']}x{s['latent']}, h{s['hidden']}, {s['layers']}L"),
    ModelSpec("sd3", "diffusers SD3Transformer2DModel, SD3-medium widths (1536, 24 heads), 6 joint blocks "
              "(AdaLayerNormZero / AdaLayerNormContinuous; the modulation fused in bf16 with the normkit-relaxed "
              "variant)", "diffusers",
              ("train", "infer"), "bf16",
              {"full": dict(batch=4, channels=16, latent=64, hidden=1536, heads=24, layers=6, text_dim=4096,
                            text_tokens=154, pooled=2048),
               "tiny": dict(batch=2, channels=4, latent=8, hidden=16, heads=2, layers=2, text_dim=16, text_tokens=5,
                            pooled=8)},
              _sd3_build, _sd3_batch, _noise_loss(_sd3_output), _sd3_output, lambda s: s["batch"], "images",
              shape=lambda s: f"{s['batch']}x{s['channels']}x{s['latent']}x{s['latent']}, text {s['text_tokens']}, "
                              f"h{s['hidden']}, {s['layers']}L"),
    ModelSpec("sd15-unet", "diffusers UNet2DConditionModel, Stable Diffusion 1.5 config (GroupNorm + SiLU, "
              "transformer blocks' LayerNorms), fp16", "diffusers", ("train", "infer"), "fp16",
              {"full": dict(batch=2, sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                            block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
                            text_tokens=77),
               "tiny": dict(batch=1, sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                            block_out_channels=(16, 32), norm_num_groups=4, cross_attention_dim=16,
                            attention_head_dim=4, text_tokens=5,
                            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))},
              _sd_unet_build, _sd_batch, _noise_loss(_sd_output), _sd_output, lambda s: s["batch"], "images",
              shape=lambda s: f"{s['batch']}x4x{s['sample_size']}x{s['sample_size']} latents, text {s['text_tokens']}"),
)}

# what `--models` runs without a list: the models ("resnet-blocks" is unet2d's stand-in,
# and runs in its place when diffusers is missing)
DEFAULT_MODELS = ("llama", "qwen3", "gemma", "vit", "convnext", "resnet50-gn", "unet2d", "unet1d")
MODES = ("train", "infer", "decode")


def size_of(spec: ModelSpec, preset: str, batch: Optional[int] = None, seq: Optional[int] = None) -> dict:
    size = dict(spec.sizes[preset])
    if batch is not None:
        size["batch"] = batch
    if seq is not None and "seq" in size:
        size["seq"] = seq
    return size


_NORM_CLASS = ("norm", "norm1d", "norm2d", "norm3d", "norm1")


def is_norm_module(m: nn.Module) -> bool:
    """A normalization layer, by its class name (LayerNorm, LlamaRMSNorm, GroupNorm1, LayerNorm2d,
    NormkitLlamaRMSNorm, ...): what the profile attributes kernels to and what 'norms' counts."""
    name = type(m).__name__.lower()
    return any(name.endswith(s) for s in _NORM_CLASS) and not any(is_norm_module(c) for c in m.children())


def randomize_norms(model: nn.Module, gen: torch.Generator) -> None:
    """Nudge every norm's weight and bias off their initial ones and zeros, so that a weight or
    bias applied wrongly by a patch shows in the loss and gradient differences."""
    with torch.no_grad():
        for m in model.modules():
            if is_norm_module(m):
                for p in m.parameters(recurse=False):
                    p.add_(0.1 * torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).to(p.dtype))

