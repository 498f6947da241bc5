"""`normkit recognition`: what normkit.patch recognises in real model families, as installed.

Builds each model family at a tiny size on the CPU (random weights, nothing downloaded), runs
normkit.patch(model, dry_run=True) and prints, per model: the norms it would patch (by class, with
what normkit computes for them), the norm-like
modules it would leave alone and why, the blocks it would fuse, and the blocks holding a known norm
it would leave unfused and why. `make test-latest` prints it for the newest releases, so what a new
transformers or diffusers changed shows up case by case. `--strict` exits 1 where a family lost
something the tested releases have (a norm left alone, a model that no longer builds).
"""
from __future__ import annotations

import argparse
import importlib
from typing import Callable

import torch

from .model_zoo import _NOT_CONFIG, HF_TINY

# transformers: (config class, model class, extra config) at the tiny decoder size of the model zoo
_TINY_LM = {**{k: v for k, v in HF_TINY.items() if k not in _NOT_CONFIG}, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0}
TRANSFORMERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "bert": ("BertConfig", "BertModel", dict(max_position_embeddings=64)),
    "t5-encoder": ("T5Config", "T5EncoderModel", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)),
    "umt5-encoder": ("UMT5Config", "UMT5EncoderModel", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                            num_heads=4)),
    # gated norms (MambaRMSNormGated) over 128 channels in 2 groups of 64, and the RMSNorms around them
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(num_heads=8, head_dim=16, expand=2, n_groups=2,
                                                         state_size=16, chunk_size=16)),
}

# diffusers: (model class, kwargs)
DIFFUSERS = {
    "unet2d": ("UNet2DModel", dict(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                   block_out_channels=(16, 32), norm_num_groups=4,
                                   down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                   up_block_types=("AttnUpBlock2D", "UpBlock2D"))),
    "autoencoder-kl": ("AutoencoderKL", dict(in_channels=3, out_channels=3, block_out_channels=(16, 32),
                                             down_block_types=("DownEncoderBlock2D",) * 2,
                                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                                             latent_channels=4, norm_num_groups=4, sample_size=8)),
    "unet2d-condition": ("UNet2DConditionModel", dict(sample_size=8, in_channels=4, out_channels=4,
                                                      layers_per_block=1, block_out_channels=(16, 32),
                                                      norm_num_groups=4, cross_attention_dim=16,
                                                      attention_head_dim=4,
                                                      down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                                      up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))),
    "dit": ("DiTTransformer2DModel", dict(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                          num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)),
    "pixart": ("PixArtTransformer2DModel", dict(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                                out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                                cross_attention_dim=16, caption_channels=12)),
    "sd3": ("SD3Transformer2DModel", dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                          caption_projection_dim=16, pooled_projection_dim=8, out_channels=4)),
    "flux": ("FluxTransformer2DModel", dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                            pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))),
}


def _transformers_builder(name) -> Callable:
    def build():
        transformers = importlib.import_module("transformers")
        cfg_name, model_name, extra = TRANSFORMERS[name]
        cfg_cls, model_cls = getattr(transformers, cfg_name, None), getattr(transformers, model_name, None)
        if cfg_cls is None or model_cls is None:
            raise LookupError(f"transformers {transformers.__version__} has no {model_name}")
        return model_cls(cfg_cls(**{**_TINY_LM, **extra}))
    return build


def _diffusers_builder(name) -> Callable:
    def build():
        diffusers = importlib.import_module("diffusers")
        cls_name, kwargs = DIFFUSERS[name]
        cls = getattr(diffusers, cls_name, None)
        if cls is None:
            raise LookupError(f"diffusers {diffusers.__version__} has no {cls_name}")
        return cls(**kwargs)
    return build


def families() -> dict[str, Callable]:
    """name -> a function building the tiny model."""
    out = {f"transformers/{n}": _transformers_builder(n) for n in TRANSFORMERS}
    out.update({f"diffusers/{n}": _diffusers_builder(n) for n in DIFFUSERS})
    return out


def _grouped(names_to_text: dict, model) -> list[str]:
    groups: dict[tuple, list[str]] = {}
    for name, text in names_to_text.items():
        groups.setdefault((type(model.get_submodule(name)).__name__, text), []).append(name)
    return [f"{cls} x{len(names)}: {text}" for (cls, text), names in groups.items()]


def report(name: str, build: Callable) -> dict:
    """{'model', 'error' or the counts and lines} for one family."""
    import normkit

    torch.manual_seed(0)
    try:
        model = build()
    except Exception as e:  # noqa: BLE001 - a family that does not build is a line of the report
        return {"model": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    rep = normkit.patch(model, dry_run=True)
    return {"model": name, "patched": len(rep), "computes": _grouped(rep.computes, model),
            "skipped": _grouped(rep.skipped, model),
            "fused": _grouped(rep.fused, model), "unfused": _grouped(rep.unfused, model)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=None, help="comma-separated names (default: every family); see --list")
    p.add_argument("--list", action="store_true", help="list the families and exit")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if any family does not build or has a norm-like module normkit leaves alone")


def run(args) -> int:
    table = families()
    if args.list:
        print("\n".join(table))
        return 0
    names = list(table) if not args.models else [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; expected names from `normkit recognition --list`")
    import transformers
    try:
        import diffusers
        dv = diffusers.__version__
    except ImportError:
        dv = "not installed"
    print(f"normkit recognition: torch {torch.__version__}, transformers {transformers.__version__}, diffusers {dv}")
    short = 0
    for name in names:
        r = report(name, table[name])
        if "error" in r:
            short += 1
            print(f"{name}: does not build here ({r['error']})")
            continue
        short += bool(r["skipped"])
        print(f"{name}: {r['patched']} norms patched, {len(r['skipped'])} kinds left alone; "
              f"{len(r['fused'])} kinds of block fused, {len(r['unfused'])} left unfused")
        for label, key in (("patched", "computes"), ("skipped", "skipped"), ("fused", "fused"),
                           ("unfused", "unfused")):
            for line in r[key]:
                print(f"    {label:8} {line}")
    print(f"normkit recognition: {len(names)} families, {short} with a norm left alone or not building")
    return 1 if args.strict and short else 0
