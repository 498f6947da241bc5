"""Fuse the blocks around the norms of an existing model (eager mode), in place, and back.

    fused = normkit.blocks.fuse(model)              # {module name: what is fused there}
    normkit.blocks.fuse(model, dry_run=True)        # what would be fused; nothing changes
    normkit.blocks.unfuse(model)                    # {module name: original class} restored

normkit.patch(model) calls fuse() after swapping the norms (patch(model, fuse=False) does not) and
lists the result as its report's `.fused`; normkit.unpatch(model) calls unfuse().

A block is fused as patch.py patches a norm: its module gets a subclass of its own class (same
name) whose forward is the block's code with the norm and its neighbour computed by one normkit call.
A block class is recognised by the bytecode of its forward (parameter names and defaults included),
compared with the library code written out below, so every copy transformers' modular generator
makes matches and a variant does not. What is fused, and only where the result is what the block
computes, rounding points included:

- HF decoder layers (transformers 5.x): the residual add before the post-attention norm (Llama,
  Qwen2/3, Mistral, Gemma, DeepSeek-V2/V3, GLM and the other copies of Llama's layer; Mixtral's and
  Phi-3's layers), and before the pre-feedforward norm of Gemma 2/3: h = residual + x and norm(h) in
  one kernel (normkit's residual= / prenorm=True), h summed in fp32 and rounded to the dtype torch's
  add gives (the promoted dtype), then normalized from that rounded value, as HF does. OLMo 2's
  layers add *after* their norms (post-norm residual): nothing to fuse there.
- Gemma 3's attention normalizes q and k after the transpose to (batch, heads, tokens, head_dim),
  rows normkit would copy; the fused forward normalizes before the transpose (the same rows, read in
  place). Qwen3's and OLMo 2's attention already hand the patched norms rows in place
  (q_proj(x).view(..., heads, head_dim), contiguous): nothing to change there.
- GroupNorm then an activation (SiLU, Mish, ReLU, GELU): diffusers' ResnetBlock2D (norm1/norm2 +
  nonlinearity; UNet2DModel, AutoencoderKL), nn.Sequential(..., GroupNorm, [Rearrange | Identity
  ...], activation, ...) as seed 004's Conv1d blocks are written (Diffusion Policy, Janner's
  diffuser), and a block whose forward is `return self.act(self.norm(self.conv(x)))`. The fused
  kernel applies the activation to the fp32 normalized value; where the block would round the
  norm's output first (a bf16/fp16 norm output outside autocast) the two differ by that rounding, so
  those calls run unfused unless fuse(relaxed=True), which accepts it (torch.compile's Inductor
  skips the same rounding when it fuses the two).

Every fused forward checks at each call what it relies on (the norm's class, dtypes, no hooks on
the modules it calls through normkit) and otherwise runs the block's own computation.
"""
from __future__ import annotations

import functools
import importlib
import types
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Optional

import torch
from torch import nn

from . import functional as F

_patch = importlib.import_module("normkit.patch")  # the module: normkit.patch is the function

__all__ = ["fuse", "unfuse", "add_norm", "norm_act"]

OPS = _patch.OPS
_KERNEL_DTYPES, _LOW_PRECISION = _patch._KERNEL_DTYPES, _patch._LOW_PRECISION


# ----------------------------------------------------------------------------- what a norm module computes

def _same_forward(cls, reference, names=("forward",)) -> bool:
    key = _patch._methods_key(reference, names)
    return key is not None and _patch._methods_key(cls, names) == key


_STYLES: dict = {}  # class -> style; a plain dict: torch.compile traces a lookup, not the bytecode walk


def _style(cls) -> Optional[str]:
    """The computation of a norm class (its own or, once patched, its original's): "ln", "rms",
    "gn" (torch's modules), "llama", "gemma", "olmo2" (HF's RMSNorm code, see normkit.patch)."""
    if cls not in _STYLES:
        _STYLES[cls] = _find_style(cls)
    return _STYLES[cls]


def _find_style(cls) -> Optional[str]:
    original = getattr(cls, "_normkit_original", None) or cls
    for torch_cls, style in ((nn.LayerNorm, "ln"), (nn.RMSNorm, "rms"), (nn.GroupNorm, "gn")):
        if issubclass(original, torch_cls):
            return style if original.forward is torch_cls.forward else None
    for style, ref, names in (("llama", _patch._LlamaReference, ("forward",)),
                              ("gemma", _patch._GemmaReference, ("forward", "_norm")),
                              ("olmo2", _patch._Olmo2Reference, ("forward",))):
        if _same_forward(original, ref, names):
            return style
    return None


_OP = {"ln": "layer_norm", "rms": "rms_norm", "llama": "rms_norm", "gemma": "rms_norm", "olmo2": "rms_norm",
       "gn": "group_norm"}


def _norm_style(module) -> Optional[str]:
    style = _style(type(module))
    if style is None or "forward" in module.__dict__:
        return None
    return style


def _act_name(module) -> Optional[str]:
    """normkit's name for an activation module computing exactly that activation, else None."""
    if "forward" in getattr(module, "__dict__", {}):
        return None
    t = type(module)
    if t is nn.SiLU:
        return "silu"
    if t is nn.Mish:
        return "mish"
    if t is nn.ReLU:
        return "relu"
    if t is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    return None


def _hooked(*modules) -> bool:
    """Hooks on a module normkit would call around (or global hooks): then it must be called."""
    g = nn.modules.module
    if g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks or \
            g._global_backward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in modules)


def _autocast_fp32(x: torch.Tensor) -> bool:
    """torch's group_norm returns float32 here (autocast's float32 list), as normkit's does."""
    return F._autocast_upcasts("group_norm", x.device.type) and torch.is_autocast_enabled(x.device.type)


# ----------------------------------------------------------------------------- the fused pieces

def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor, backend: Optional[str] = None):
    """(norm(residual + x), residual + x), the add in normkit's norm kernel where that computes
    exactly what `residual + x` then `norm` compute; else those two, as written."""
    style = _norm_style(norm)
    h_dtype = torch.promote_types(x.dtype, residual.dtype)
    w = getattr(norm, "weight", None)
    if style is None or style == "gn" or x.shape != residual.shape or x.device != residual.device or \
            x.dtype not in _KERNEL_DTYPES or residual.dtype not in _KERNEL_DTYPES or _hooked(norm) or \
            (w is not None and w.dtype not in _KERNEL_DTYPES):
        h = residual + x
        return norm(h), h
    fused = dict(residual=residual, prenorm=True, residual_dtype=h_dtype, backend=backend)
    if h_dtype != x.dtype:  # torch's norm returns h's dtype, normkit's x's by default
        fused["out_dtype"] = h_dtype
    if style == "ln":
        return F.layer_norm(x, norm.normalized_shape, w, norm.bias, norm.eps, **fused)
    if style == "rms":
        return F.rms_norm(x, norm.normalized_shape, w, norm.eps, **fused)
    # HF's RMSNorm code: explicit fp32 ops, which autocast leaves alone; normalizes the last dim
    if w is None or w.dim() != 1 or x.shape[-1] != w.shape[0]:
        h = residual + x
        return norm(h), h
    as_written = functools.partial(F.row_norm_as_written, x, w.shape, rms=True, **fused)
    if style == "gemma":  # (normed(h in fp32) * (1 + w.float())).type_as(h)
        return as_written(w, None, norm.eps, weight_offset=1.0)
    if style == "olmo2":  # (w * normed(h in fp32)).to(h.dtype)
        return as_written(w, None, norm.variance_epsilon)
    # llama: w * normed(h in fp32).to(h.dtype): rounded before the weight, unless h is fp32
    if h_dtype == torch.float32:
        return as_written(w, None, norm.variance_epsilon)
    y, h = as_written(None, None, norm.variance_epsilon)
    return w * y, h


def norm_act(norm: nn.Module, act: nn.Module, x: torch.Tensor, backend: Optional[str] = None,
             relaxed: bool = False) -> Optional[torch.Tensor]:
    """act(norm(x)) from one normkit GroupNorm call with the activation fused, or None where that
    is not exactly what the modules compute (or, relaxed, only one rounding away: the norm's output
    in bf16/fp16), in which case the caller runs them."""
    name = _act_name(act)
    if name is None or _norm_style(norm) != "gn" or x.dtype not in _KERNEL_DTYPES or _hooked(norm, act):
        return None
    if not (relaxed or x.dtype == torch.float32 or _autocast_fp32(x)):
        return None  # the norm's output would be rounded to x's dtype before the activation
    return F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, activation=name, backend=backend)


def _norm_then_act(norm, act, x, backend, relaxed):
    y = norm_act(norm, act, x, backend, relaxed)
    return act(norm(x)) if y is None else y


# ----------------------------------------------------------------------------- library code (recognised)
# Verbatim forwards of transformers 5.x and diffusers 0.3x, never run. Parameter annotations are not
# part of a function's bytecode, but an annotated local assignment compiles differently: kept.

if TYPE_CHECKING:  # never runs; CPython compiles `name.method(...)` differently when `name` is imported, as here
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: F401


class _HFLlamaLayer(nn.Module):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class _HFMixtralLayer(nn.Module):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                past_key_values=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class _HFPhi3Layer(nn.Module):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)

        hidden_states, self_attn_weights = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + self.resid_attn_dropout(hidden_states)  # main diff with Llama

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + self.resid_mlp_dropout(hidden_states)  # main diff with Llama
        return hidden_states


class _HFGemma2Layer(nn.Module):  # Gemma 2 and Gemma 3
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                past_key_values=None, **kwargs):
        residual = hidden_states

        hidden_states = self.input_layernorm(hidden_states)

        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            **kwargs,
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        return hidden_states


class _HFGemma3Attention(nn.Module):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)  # noqa: F821

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward  # noqa: F821
        )

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class _DiffusersResnetBlock2D(nn.Module):
    def forward(self, input_tensor, temb, *args, **kwargs):
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecation_message = "The `scale` argument is deprecated and will be ignored. Please remove it, as passing it will raise an error in the future. `scale` should directly be passed while calling the underlying pipeline component i.e., via `cross_attention_kwargs`."  # noqa: E501
            deprecate("scale", "1.0.0", deprecation_message)  # noqa: F821

        hidden_states = input_tensor

        hidden_states = self.norm1(hidden_states)
        hidden_states = self.nonlinearity(hidden_states)

        if self.upsample is not None:
            # upsample_nearest_nhwc fails with large batch sizes. see https://github.com/huggingface/diffusers/issues/984
            if hidden_states.shape[0] >= 64:
                input_tensor = input_tensor.contiguous()
                hidden_states = hidden_states.contiguous()
            input_tensor = self.upsample(input_tensor)
            hidden_states = self.upsample(hidden_states)
        elif self.downsample is not None:
            input_tensor = self.downsample(input_tensor)
            hidden_states = self.downsample(hidden_states)

        hidden_states = self.conv1(hidden_states)

        if self.time_emb_proj is not None:
            if not self.skip_time_act:
                temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]

        if self.time_embedding_norm == "default":
            if temb is not None:
                hidden_states = hidden_states + temb
            hidden_states = self.norm2(hidden_states)
        elif self.time_embedding_norm == "scale_shift":
            if temb is None:
                raise ValueError(
                    f" `temb` should not be None when `time_embedding_norm` is {self.time_embedding_norm}"
                )
            time_scale, time_shift = torch.chunk(temb, 2, dim=1)
            hidden_states = self.norm2(hidden_states)
            hidden_states = hidden_states * (1 + time_scale) + time_shift
        else:
            hidden_states = self.norm2(hidden_states)

        hidden_states = self.nonlinearity(hidden_states)

        hidden_states = self.dropout(hidden_states)
        hidden_states = self.conv2(hidden_states)

        if self.conv_shortcut is not None:
            # Only use contiguous() during training to avoid DDP gradient stride mismatch warning.
            # In inference mode (eval or no_grad), skip contiguous() for better performance, especially on CPU.
            # Issue: https://github.com/huggingface/diffusers/issues/12975
            if self.training:
                input_tensor = input_tensor.contiguous()
            input_tensor = self.conv_shortcut(input_tensor)

        output_tensor = (input_tensor + hidden_states) / self.output_scale_factor

        return output_tensor


class _ConvNormAct(nn.Module):  # seed 004's Conv1d -> GroupNorm -> Mish block written as one expression
    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


# ----------------------------------------------------------------------------- the fused forwards
# Each is the library code above with the fused lines changed. They run with the library module's
# globals (apply_rotary_pos_emb, deprecate, ...: see _rebind) and reach normkit through the
# class attributes _normkit_add_norm, _normkit_norm_act (falls back to the modules) and
# _normkit_try_norm_act (None where it cannot fuse).

def _llama_layer_fused(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                       use_cache=False, position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    hidden_states, residual = self._normkit_add_norm(self.post_attention_layernorm, hidden_states, residual,
                                                     self._normkit_backend)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _mixtral_layer_fused(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                         past_key_values=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_values=past_key_values, **kwargs)
    hidden_states, residual = self._normkit_add_norm(self.post_attention_layernorm, hidden_states, residual,
                                                     self._normkit_backend)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _phi3_layer_fused(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                      use_cache=False, position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, self_attn_weights = self.self_attn(
        hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    hidden_states, residual = self._normkit_add_norm(self.post_attention_layernorm,
                                                     self.resid_attn_dropout(hidden_states), residual,
                                                     self._normkit_backend)
    hidden_states = self.mlp(hidden_states)
    return residual + self.resid_mlp_dropout(hidden_states)


def _gemma2_layer_fused(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                        past_key_values=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_values=past_key_values, **kwargs)
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states, residual = self._normkit_add_norm(self.pre_feedforward_layernorm, hidden_states, residual,
                                                     self._normkit_backend)
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    return residual + hidden_states


def _gemma3_attention_fused(self, hidden_states, position_embeddings=None, attention_mask=None,
                            past_key_values=None, **kwargs):
    if self._normkit_hooked(self.q_norm, self.k_norm):  # hooks see the norms' inputs: keep them as written
        return self._normkit_fused_original.forward(self, hidden_states, position_embeddings, attention_mask,
                                                          past_key_values, **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    # normalized per head before the transpose: the same rows, read in place instead of copied
    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)  # noqa: F821

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(  # noqa: F821
        self.config._attn_implementation, eager_attention_forward  # noqa: F821
    )
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
        sliding_window=self.sliding_window, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


def _resnet_block_2d_fused(self, input_tensor, temb, *args, **kwargs):
    if len(args) > 0 or kwargs.get("scale", None) is not None:
        deprecation_message = "The `scale` argument is deprecated and will be ignored. Please remove it, as passing it will raise an error in the future. `scale` should directly be passed while calling the underlying pipeline component i.e., via `cross_attention_kwargs`."  # noqa: E501
        deprecate("scale", "1.0.0", deprecation_message)  # noqa: F821

    hidden_states = self._normkit_norm_act(self.norm1, self.nonlinearity, input_tensor, self._normkit_backend,
                                           self._normkit_relaxed)

    if self.upsample is not None:
        if hidden_states.shape[0] >= 64:
            input_tensor = input_tensor.contiguous()
            hidden_states = hidden_states.contiguous()
        input_tensor = self.upsample(input_tensor)
        hidden_states = self.upsample(hidden_states)
    elif self.downsample is not None:
        input_tensor = self.downsample(input_tensor)
        hidden_states = self.downsample(hidden_states)

    hidden_states = self.conv1(hidden_states)

    if self.time_emb_proj is not None:
        if not self.skip_time_act:
            temb = self.nonlinearity(temb)
        temb = self.time_emb_proj(temb)[:, :, None, None]

    if self.time_embedding_norm == "scale_shift":
        if temb is None:
            raise ValueError(f" `temb` should not be None when `time_embedding_norm` is {self.time_embedding_norm}")
        time_scale, time_shift = torch.chunk(temb, 2, dim=1)
        hidden_states = self.norm2(hidden_states)
        hidden_states = hidden_states * (1 + time_scale) + time_shift
        hidden_states = self.nonlinearity(hidden_states)
    else:
        if self.time_embedding_norm == "default" and temb is not None:
            hidden_states = hidden_states + temb
        hidden_states = self._normkit_norm_act(self.norm2, self.nonlinearity, hidden_states, self._normkit_backend,
                                               self._normkit_relaxed)

    hidden_states = self.dropout(hidden_states)
    hidden_states = self.conv2(hidden_states)

    if self.conv_shortcut is not None:
        if self.training:
            input_tensor = input_tensor.contiguous()
        input_tensor = self.conv_shortcut(input_tensor)

    return (input_tensor + hidden_states) / self.output_scale_factor


def _conv_norm_act_fused(self, x):
    return self._normkit_norm_act(self.norm, self.act, self.conv(x), self._normkit_backend, self._normkit_relaxed)


# nn.Sequential: GroupNorm, then modules that only move elements (einops' Rearrange, Identity), then
# an activation: the activation commutes with the moves, so act(norm(x)) is computed first.

def _moves_only(module) -> bool:
    t = type(module)
    return t is nn.Identity or (t.__name__ == "Rearrange" and t.__module__.startswith("einops"))


def _fusable_run(mods, i) -> Optional[int]:
    """Index of the activation that closes a GroupNorm -> moves* -> activation run starting at i."""
    if _norm_style(mods[i]) != "gn":
        return None
    j = i + 1
    while j < len(mods) and _moves_only(mods[j]):
        j += 1
    return j if j < len(mods) and _act_name(mods[j]) is not None else None


def _sequential_fused(self, input):
    mods = list(self._modules.values())
    i = 0
    while i < len(mods):
        j = _fusable_run(mods, i)
        y = None
        if j is not None and not _hooked(*mods[i + 1:j]):
            y = self._normkit_try_norm_act(mods[i], mods[j], input, self._normkit_backend, self._normkit_relaxed)
        if y is None:
            input = mods[i](input)
            i += 1
            continue
        for mover in mods[i + 1:j]:
            y = mover(y)
        input, i = y, j + 1
    return input


# ----------------------------------------------------------------------------- the registry

class _Block(NamedTuple):
    reference: Optional[Callable]   # the library forward it must equal (None: see `matches`)
    fused: Callable
    norms: tuple                    # attributes holding the norms fused (each must be a known style)
    acts: tuple                     # attributes holding the activation fused after them
    what: str


_BLOCKS = (
    _Block(_HFLlamaLayer.forward, _llama_layer_fused, ("post_attention_layernorm",), (),
           "residual add + post_attention_layernorm in one normkit call (residual=, prenorm=True)"),
    _Block(_HFMixtralLayer.forward, _mixtral_layer_fused, ("post_attention_layernorm",), (),
           "residual add + post_attention_layernorm in one normkit call (residual=, prenorm=True)"),
    _Block(_HFPhi3Layer.forward, _phi3_layer_fused, ("post_attention_layernorm",), (),
           "residual add (of the dropped-out attention output) + post_attention_layernorm in one normkit call"),
    _Block(_HFGemma2Layer.forward, _gemma2_layer_fused, ("pre_feedforward_layernorm",), (),
           "residual add + pre_feedforward_layernorm in one normkit call (residual=, prenorm=True)"),
    _Block(_HFGemma3Attention.forward, _gemma3_attention_fused, ("q_norm", "k_norm"), (),
           "q_norm/k_norm per head before the transpose: rows read in place, no copy"),
    _Block(_DiffusersResnetBlock2D.forward, _resnet_block_2d_fused, ("norm1", "norm2"), ("nonlinearity",),
           "norm1 + nonlinearity and norm2 + nonlinearity: GroupNorm with the activation fused"),
    _Block(_ConvNormAct.forward, _conv_norm_act_fused, ("norm",), ("act",),
           "norm + act: GroupNorm with the activation fused"),
)


def _fn_key(fn) -> Optional[tuple]:
    """The bytecode of a function with its parameter names and defaults (callers pass them by name)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    n = code.co_argcount + code.co_kwonlyargcount
    return (_patch._code_key(fn), code.co_varnames[:n], code.co_flags & 0x0C, fn.__defaults__,
            tuple(sorted((fn.__kwdefaults__ or {}).items())))


def _unwrapped_forward(cls):
    """cls.forward without transformers' gradient-checkpointing wrapper (GradientCheckpointingLayer
    wraps every subclass's forward, and will wrap the fused class's the same way)."""
    fn = cls.forward
    while getattr(getattr(fn, "__code__", None), "co_name", None) == "forward_with_checkpointing" and \
            fn.__code__.co_filename.replace("\\", "/").endswith("transformers/modeling_layers.py") and \
            hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


_REFERENCE_KEYS = {b: _fn_key(b.reference) for b in _BLOCKS}


@functools.lru_cache(maxsize=None)
def _block_of_class(cls) -> Optional[_Block]:
    if cls is nn.Sequential:
        return _SEQUENTIAL
    key = _fn_key(_unwrapped_forward(cls))
    return next((b for b in _BLOCKS if key is not None and key == _REFERENCE_KEYS[b]), None)


_SEQUENTIAL = _Block(None, _sequential_fused, (), (),
                     "GroupNorm -> [Rearrange/Identity] -> activation runs: GroupNorm with the activation fused")


def _match(module, ops) -> Optional[_Block]:
    """The block `module` is, if its norms (and activations) are ones normkit fuses, else None."""
    cls = type(module)
    if getattr(cls, "_normkit_fused_original", None) is not None or getattr(cls, "_normkit_original", None) is not None \
            or "forward" in module.__dict__:
        return None
    block = _block_of_class(cls)
    if block is None:
        return None
    if block is _SEQUENTIAL:
        mods = list(module._modules.values())
        runs = [i for i in range(len(mods)) if _fusable_run(mods, i) is not None]
        return block if runs and "group_norm" in ops else None
    for attr in block.norms:
        style = _norm_style(getattr(module, attr, None)) if isinstance(getattr(module, attr, None), nn.Module) else None
        if style is None or _OP[style] not in ops:
            return None
    for attr in block.acts:
        if _act_name(getattr(module, attr, None)) is None:
            return None
    return block


# ----------------------------------------------------------------------------- class swapping

_fused_classes: dict = {}


def _rebind(fused: Callable, original_forward: Callable) -> Callable:
    """The fused forward running with the library module's globals (the names its code reads)."""
    g = getattr(original_forward, "__globals__", None)
    if g is None or g is fused.__globals__:
        return fused
    fn = types.FunctionType(fused.__code__, g, fused.__name__, fused.__defaults__, fused.__closure__)
    fn.__kwdefaults__ = fused.__kwdefaults__
    fn.__qualname__, fn.__doc__ = fused.__qualname__, fused.__doc__
    return fn


def _fused_class(original: type, block: _Block, relaxed: bool) -> type:
    """A subclass of `original` (same name and module: accelerate/FSDP wrap policies match layer
    classes by name; _normkit_fused_original marks it) with the fused forward; one per (class,
    relaxed), reused."""
    key = (original, relaxed)
    cls = _fused_classes.get(key)
    if cls is None:
        forward = block.fused if block.reference is None else _rebind(block.fused, _unwrapped_forward(original))
        cls = type(original.__name__, (original,), {
            "forward": forward, "_normkit_fused_original": original, "_normkit_relaxed": relaxed,
            "_normkit_add_norm": staticmethod(add_norm), "_normkit_norm_act": staticmethod(_norm_then_act),
            "_normkit_try_norm_act": staticmethod(norm_act), "_normkit_hooked": staticmethod(_hooked),
            "__module__": original.__module__, "__qualname__": original.__qualname__})
        _fused_classes[key] = cls
    return cls


def fuse(model: nn.Module, *, ops: Iterable[str] = OPS, backend: Optional[str] = None, dry_run: bool = False,
         relaxed: bool = False) -> dict[str, str]:
    """Fuse, in place, the blocks of `model` (the model itself included) around norms of the op
    families in `ops` (see the module docstring). Returns {module name: what is fused there}
    ("" names the model itself); with dry_run=True, what would be, changing nothing. relaxed=True
    also fuses GroupNorm + activation where the block rounds the norm's bf16/fp16 output before the
    activation (one rounding apart). Blocks already fused are left alone."""
    ops = _patch._check_arguments(model, ops, backend)
    for arg, v in (("dry_run", dry_run), ("relaxed", relaxed)):
        if not isinstance(v, bool):
            raise TypeError(f"{arg}: expected a bool, got {v!r}")
    fused = {}
    for name, module in model.named_modules(remove_duplicate=True):
        block = _match(module, ops)
        if block is None:
            continue
        fused[name] = block.what
        if not dry_run:
            module.__class__ = _fused_class(type(module), block, relaxed)
            module._normkit_backend = backend
    return fused


def unfuse(model: nn.Module) -> dict[str, type]:
    """Undo fuse(): every fused block of `model` gets its original class back.
    Returns {module name: original class} of what it restored."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    restored = {}
    for name, module in model.named_modules(remove_duplicate=True):
        original = type(module).__dict__.get("_normkit_fused_original")
        if original is None:
            continue
        module.__class__ = original
        module.__dict__.pop("_normkit_backend", None)
        restored[name] = original
    return restored
