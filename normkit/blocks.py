"""Fuse the blocks around the norms of an existing model (eager mode), in place, and back.

    fused = normkit.blocks.fuse(model)              # {module name: what is fused there}
    normkit.blocks.fuse(model, dry_run=True)        # what would be fused; nothing changes
    normkit.blocks.unfuse(model)                    # {module name: original class} restored

normkit.patch(model) calls fuse() after swapping the norms (patch(model, fuse=False) does not) and
lists the result as its report's `.fused`; normkit.unpatch(model) calls unfuse().

A block is fused as patch.py patches a norm: its module gets a subclass of its own class (same
name) whose forward is the block's code with the norm and its neighbour computed by one normkit call.
A block is recognised from the source of its forward: statements that compute a pattern normkit
fuses (see "blocks recognised by their code" below) are rewritten into one normkit call computing
the same values, and the rest of the forward runs as written, so any transformers release and any
copied or renamed layer is covered; diffusers' ResnetBlock2D, whose branches around norm2 no
statement rule sees, is matched by the bytecode of its forward. `fuse(model, unfused={})` fills in
why each module holding a known norm was not fused. What is fused, and only where the result is
what the block computes, rounding points included:

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

- adaLN modulation (diffusers' AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous,
  AdaLayerNorm, DiT's norm_out, any block written `self.norm(x) * (1 + scale) + shift`, also as
  `y = self.norm(x); y = y * (1 + scale) + shift`): one normkit call with scale= / shift=, where the
  norm is a LayerNorm/RMSNorm normkit knows and scale/shift are one row per sample. The fused kernel
  computes 1 + scale, the product and the sum in fp32 and rounds once; the block rounds the norm's
  output and each step to their dtype. So only all-fp32 calls (x, scale, shift, the norm's weights)
  are fused exactly; bf16/fp16 ones run as written unless fuse(relaxed=True) / patch(fuse="relaxed"),
  which accepts the difference (normkit's value is the more accurate one; Inductor skips the same
  roundings when it fuses these ops).

Every fused forward checks at each call what it relies on (the norm's class, dtypes, no hooks on
the modules it calls through normkit) and otherwise runs the block's own computation.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
import types
from typing import Callable, Iterable, NamedTuple, Optional

import torch
from torch import nn

from . import _cpu, functional as F
from ._layout import sample_rows

_patch = importlib.import_module("normkit.patch")  # the module: normkit.patch is the function

__all__ = ["fuse", "unfuse", "add_norm", "norm_act", "norm_modulate"]

OPS = _patch.OPS
_KERNEL_DTYPES, _LOW_PRECISION = _patch._KERNEL_DTYPES, _patch._LOW_PRECISION


# ----------------------------------------------------------------------------- what a norm module computes

_ROW_STYLES = ("ln", "rms", "llama", "gemma", "olmo2")  # the styles add_norm fuses


def _norm_style(module) -> Optional[str]:
    """What a norm module computes ("ln", "rms", "gn", or a style of normkit.patch such as "llama",
    recognised from its computation), if normkit knows, else None."""
    if not isinstance(module, nn.Module) or "forward" in module.__dict__:
        return None
    return _patch._style_of(module)


def _op_of(style) -> Optional[str]:
    return _patch._STYLE_OPS.get(style)


_ACT_NAMES = {nn.SiLU: "silu", nn.Mish: "mish", nn.ReLU: "relu"}
_GELU_NAMES = {"none": "gelu", "tanh": "gelu_tanh"}


def _act_name(module) -> Optional[str]:
    """normkit's name for an activation module computing exactly that activation, else None."""
    t = type(module)
    name = _GELU_NAMES.get(module.approximate) if t is nn.GELU else _ACT_NAMES.get(t)
    return None if name is None or "forward" in module.__dict__ else name


def _hooked(*modules) -> bool:
    """Hooks on a module normkit would call around (or global hooks): then it must be called."""
    g = nn.modules.module
    if g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks or \
            g._global_backward_pre_hooks:
        return True
    for m in modules:  # a loop, not any(generator): asked at every fused block's call
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
    return False


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
    if style not in _ROW_STYLES or x.shape != residual.shape or x.device != residual.device or \
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
    eps = _patch._eps_of(norm)
    if style == "gemma":  # (normed(h in fp32) * (1 + w.float())).type_as(h)
        return as_written(w, None, eps, weight_offset=1.0)
    if style == "olmo2":  # (w * normed(h in fp32)).to(h.dtype)
        return as_written(w, None, eps)
    # llama: w * normed(h in fp32).to(h.dtype): rounded before the weight, unless h is fp32
    if h_dtype == torch.float32:
        return as_written(w, None, eps)
    y, h = as_written(None, None, eps)
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
    if _cpu.offered(x, backend):
        # the CPU fast path directly, with the arguments F.group_norm would offer it first
        y = _cpu.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, name, None)
        if y is not None:
            return y
    return F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, activation=name, backend=backend)


def _modulated(norm, x, scale, shift):
    """norm(x) * (1 + scale) + shift (shift may be None), as the block writes it."""
    y = norm(x) * (1 + scale)
    return y + shift if shift is not None else y


def norm_modulate(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift, backend: Optional[str] = None,
                  relaxed: bool = False) -> torch.Tensor:
    """norm(x) * (1 + scale) + shift (shift may be None), as one normkit call with the adaLN
    modulation fused where that computes what the block does (see the module docstring: all fp32,
    or relaxed); else as written. The checks are loops, not generators: asked at every block's call."""
    style = _norm_style(norm)
    if style not in ("ln", "rms") or x.dtype not in _KERNEL_DTYPES:
        return _modulated(norm, x, scale, shift)
    w, b = getattr(norm, "weight", None), getattr(norm, "bias", None) if style == "ln" else None
    # first the test that decides the common case (bf16/fp16 without relaxed: the module's own
    # roundings, as written) so that it costs no more host time than the module itself
    for t in (x, scale, shift, w, b):
        if t is not None and not (isinstance(t, torch.Tensor) and t.dtype in _KERNEL_DTYPES and
                                  (relaxed or t.dtype == torch.float32)):
            return _modulated(norm, x, scale, shift)
    shape = tuple(getattr(norm, "normalized_shape", ()) or ())
    if not shape or _hooked(norm):
        return _modulated(norm, x, scale, shift)
    cpu, device, nd, k = x.is_cpu, x.device, x.dim(), len(shape)
    mods, checked = [], None
    for t in (scale, shift):
        if t is not None:
            # on the CPU is_cpu says it (t.device builds a device object: most of this check's cost)
            if not (t.is_cpu if cpu else t.device == device) or t.dim() > nd:
                return _modulated(norm, x, scale, shift)
            # torch broadcasts from the right: with leading ones, normkit's per-sample rule (from the left) agrees
            if t.dim() != nd:
                t = t.reshape((1,) * (nd - t.dim()) + tuple(t.shape))
            if t.shape != checked:  # shift of scale's shape (the common call) passes what scale passed
                if t.shape[nd - k:] != shape or sample_rows(t.shape, x.shape, k) is None:
                    return _modulated(norm, x, scale, shift)
                for a, n in zip(t.shape, x.shape):
                    if a != 1 and a != n:
                        return _modulated(norm, x, scale, shift)
                checked = t.shape
        mods.append(t)
    y_dtype = x.dtype if style == "rms" or not F._autocast_upcasts("layer_norm", device.type) or \
        not torch.is_autocast_enabled(device.type) else torch.float32
    for t in mods:
        if t is not None and t.dtype != y_dtype:
            y_dtype = torch.promote_types(y_dtype, t.dtype)
    rms = style == "rms"
    if _cpu.offered(x, backend):
        # the CPU fast path directly, with the arguments row_norm_as_written would offer it first
        y = _cpu.row_norm(x, shape, w, b, norm.eps, rms, None, None, None, False, None, 0, y_dtype, mods[0], mods[1])
        if y is not None:
            return y
    return F.row_norm_as_written(x, shape, w, b, norm.eps, rms, scale=mods[0], shift=mods[1], backend=backend,
                                 out_dtype=y_dtype)


def _norm_then_act(norm, act, x, backend, relaxed):
    y = norm_act(norm, act, x, backend, relaxed)
    return act(norm(x)) if y is None else y


# ----------------------------------------------------------------------------- library code (recognised)
# Verbatim forwards of transformers 5.x and diffusers 0.3x, never run. Parameter annotations are not
# part of a function's bytecode, but an annotated local assignment compiles differently: kept.

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


# ----------------------------------------------------------------------------- blocks written as library code

class _Block(NamedTuple):
    reference: Optional[Callable]   # the library forward it must equal (None: the forward is `fused` as is)
    fused: Callable
    norms: tuple                    # attributes holding the norms fused (each must be a known style)
    acts: tuple                     # attributes holding the activation fused after them
    what: str


_BLOCKS = (  # diffusers' ResnetBlock2D restructures its branches around norm2: no statement rule sees that
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


# ----------------------------------------------------------------------------- blocks recognised by their code
# Any other block (every HF decoder layer, whatever its release or class name) is read from its
# forward's source: statements that compute a pattern normkit fuses are rewritten into one normkit
# call computing the same values, and the rest of the forward is left as written. The patterns:
#
#   add -> norm:  h = r + e; r = h; h = self.norm(h)   ->  h, r = add_norm(self.norm, e, r)
#                 (e + r too; Llama, Qwen, Mistral, Mixtral, Phi-3, Gemma 2/3 pre-feedforward, ...)
#   norm -> act:  y = self.norm(x); y = self.act(x)   or  self.act(self.norm(x))  (GroupNorm + activation)
#   per head:     q = self.proj(x).view(s).transpose(1, 2) ... q = self.q_norm(q)
#                 ->  q = self.q_norm(self.proj(x).view(s)).transpose(1, 2)   (rows read in place)
#
# Each rewritten call falls back, at run time, to exactly the statements it replaced where normkit
# cannot compute them as written (hooks, dtypes, a norm it does not know), so a rewrite is only ever
# a faster way to the same values. A release that changes the forward elsewhere needs nothing here.

def _self_call(node, self_name) -> Optional[tuple]:
    """(attribute, args) of `self.attribute(args)`, positional arguments only."""
    if isinstance(node, ast.Call) and not node.keywords and isinstance(node.func, ast.Attribute) and \
            isinstance(node.func.value, ast.Name) and node.func.value.id == self_name and \
            not any(isinstance(a, ast.Starred) for a in node.args):
        return node.func.attr, node.args
    return None


def _assigned(stmt) -> Optional[tuple]:
    """(name, value) of `name = value`."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id, stmt.value
    return None


def _is_name(node, name=None) -> bool:
    return isinstance(node, ast.Name) and (name is None or node.id == name)


def _uses(stmts, name) -> bool:
    return any(_is_name(n, name) for s in stmts for n in ast.walk(s))


class _Rewriter(ast.NodeTransformer):
    """Rewrites the patterns above in one forward. `kinds` maps the block's attributes to what they
    hold: "row" (a row norm add_norm fuses), "head" (one over the last dim only), "gn", "act"."""

    def __init__(self, self_name: str, kinds: dict):
        self.self_name, self.kinds, self.sites = self_name, kinds, []

    def _attr(self, name):
        return ast.Attribute(ast.Name(self.self_name, ast.Load()), name, ast.Load())

    def _call(self, helper, *args):
        return ast.Call(self._attr(helper), list(args), [])

    def _add_norm(self, stmts, i):
        """h = r + e; r = h; h2 = self.norm(h)"""
        first, second, third = (_assigned(s) for s in (stmts[i:i + 3] + [None] * 3)[:3])
        if not (first and second and third) or not isinstance(first[1], ast.BinOp) or \
                not isinstance(first[1].op, ast.Add):
            return None
        h, (r, r_value), (h2, call) = first[0], second, third
        if not _is_name(r_value, h) or r == h:
            return None
        left, right = first[1].left, first[1].right
        e = right if _is_name(left, r) else left if _is_name(right, r) else None
        norm = _self_call(call, self.self_name)
        if e is None or norm is None or self.kinds.get(norm[0]) not in ("row", "head") or len(norm[1]) != 1 or \
                not _is_name(norm[1][0], h) or h2 == r:
            return None
        target = ast.Tuple([ast.Name(h2, ast.Store()), ast.Name(r, ast.Store())], ast.Store())
        out = [ast.Assign([target], self._call("_normkit_add_norm", self._attr(norm[0]), e, ast.Name(r, ast.Load()),
                                               self._attr("_normkit_backend")))]
        if h2 != h:  # h is still read below: it is the new residual
            out.append(ast.Assign([ast.Name(h, ast.Store())], ast.Name(r, ast.Load())))
        self.sites.append(f"residual add + {norm[0]} in one normkit call (residual=, prenorm=True)")
        return out

    def _norm_act_pair(self, stmts, i):
        """y = self.norm(x); y = self.act(y)"""
        first, second = (_assigned(s) for s in (stmts[i:i + 2] + [None] * 2)[:2])
        if not (first and second) or first[0] != second[0]:
            return None
        norm, act = _self_call(first[1], self.self_name), _self_call(second[1], self.self_name)
        if not (norm and act) or len(norm[1]) != 1 or len(act[1]) != 1 or not _is_name(act[1][0], first[0]):
            return None
        return self._norm_act(norm, act, stmts[i])

    def _modulation(self, node):
        """(scale expression, shift expression or None) of `P + T` / `P` with P = `(1 + S)` or
        `(1 + S)[idx]`, for the node `N * P (+ T)`; else None."""
        def one_plus(e):
            if isinstance(e, ast.Subscript):
                inner = one_plus(e.value)
                return None if inner is None else ast.Subscript(inner, e.slice, ast.Load())
            if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add) and isinstance(e.left, ast.Constant) and \
                    e.left.value == 1 and not isinstance(e.left.value, bool):
                return e.right
            return None
        return one_plus(node)

    def _norm_modulate(self, norm, x, mult, shift):
        """self.norm(x) * mult (+ shift) -> one call, if mult is (1 + S) (indexed); else None."""
        if self.kinds.get(norm) not in ("row", "head"):
            return None
        scale = self._modulation(mult)
        if scale is None:
            return None
        self.sites.append(f"{norm} + adaLN modulation (x * (1 + scale) + shift) in one normkit call")
        return self._call("_normkit_norm_modulate", self._attr(norm), x, scale,
                          shift if shift is not None else ast.Constant(None), self._attr("_normkit_backend"),
                          self._attr("_normkit_relaxed"))

    def visit_BinOp(self, node):  # self.norm(x) * (1 + scale) + shift, or without the shift
        mul, shift = (node.left, node.right) if isinstance(node.op, ast.Add) else (node, None)
        norm = isinstance(mul, ast.BinOp) and isinstance(mul.op, ast.Mult) and _self_call(mul.left, self.self_name)
        if norm and len(norm[1]) == 1:
            fused = self._norm_modulate(norm[0], self.visit(norm[1][0]), self.visit(mul.right),
                                        None if shift is None else self.visit(shift))
            if fused is not None:
                return fused
        return super().generic_visit(node)

    def _norm_modulate_pair(self, stmts, i):
        """y = self.norm(x); y = y * (1 + S) + T"""
        first, second = (_assigned(s) for s in (stmts[i:i + 2] + [None] * 2)[:2])
        if not (first and second) or first[0] != second[0]:
            return None
        norm = _self_call(first[1], self.self_name)
        value = second[1]
        mul, shift = (value.left, value.right) if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add) \
            else (value, None)
        if not norm or len(norm[1]) != 1 or not isinstance(mul, ast.BinOp) or not isinstance(mul.op, ast.Mult) or \
                not _is_name(mul.left, first[0]) or (shift is not None and _uses([shift], first[0])) or \
                _uses([mul.right], first[0]):
            return None
        call = self._norm_modulate(norm[0], norm[1][0], mul.right, shift)
        return None if call is None else [ast.Assign([ast.Name(first[0], ast.Store())], call)]

    def _norm_act(self, norm, act, at):
        if self.kinds.get(norm[0]) != "gn" or self.kinds.get(act[0]) != "act":
            return None
        self.sites.append(f"{norm[0]} + {act[0]}: GroupNorm with the activation fused")
        call = self._call("_normkit_norm_act", self._attr(norm[0]), self._attr(act[0]), norm[1][0],
                          self._attr("_normkit_backend"), self._attr("_normkit_relaxed"))
        if isinstance(at, ast.stmt):
            return [ast.Assign([ast.Name(_assigned(at)[0], ast.Store())], call)]
        return call

    def _per_head(self, stmts, i):
        """q = self.proj(x).view(s).transpose(1, 2) ... q = self.q_norm(q), q unread in between."""
        first = _assigned(stmts[i])
        if not first or not isinstance(first[1], ast.Call) or not isinstance(first[1].func, ast.Attribute) or \
                first[1].func.attr != "transpose" or first[1].keywords or \
                [getattr(a, "value", None) for a in first[1].args] != [1, 2]:
            return None
        q, view = first[0], first[1].func.value
        if _uses([view], q):
            return None
        for j in range(i + 1, len(stmts)):
            later = _assigned(stmts[j])
            norm = later and _self_call(later[1], self.self_name)
            if norm and later[0] == q and len(norm[1]) == 1 and _is_name(norm[1][0], q) and \
                    self.kinds.get(norm[0]) == "head":
                self.sites.append(f"{norm[0]} per head before the transpose: rows read in place, no copy")
                call = self._call("_normkit_norm_heads", self._attr(norm[0]), view)
                return [ast.Assign([ast.Name(q, ast.Store())], call)], j
            if _uses([stmts[j]], q):
                return None
        return None

    def _body(self, stmts):
        out, i, dropped = [], 0, set()
        while i < len(stmts):
            if i in dropped:
                i += 1
                continue
            new = self._add_norm(stmts, i)
            if new is not None:
                out += new
                i += 3
                continue
            new = self._norm_act_pair(stmts, i) or self._norm_modulate_pair(stmts, i)
            if new is not None:
                out += [self.visit(s) for s in new]
                i += 2
                continue
            found = self._per_head(stmts, i)
            if found is not None:
                out += found[0]
                dropped.add(found[1])
                i += 1
                continue
            out.append(self.visit(stmts[i]))
            i += 1
        return out

    def generic_visit(self, node):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                setattr(node, field, self._body(stmts))
        for handler in getattr(node, "handlers", ()):
            handler.body = self._body(handler.body)
        return super().generic_visit(node) if not isinstance(node, (ast.stmt, ast.excepthandler)) else \
            self._visit_exprs(node)

    def _visit_exprs(self, node):
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, field, self.visit(value))
            elif isinstance(value, list):
                setattr(node, field, [self.visit(v) if isinstance(v, ast.expr) else v for v in value])
        return node

    def visit_Call(self, node):  # self.act(self.norm(x)) anywhere in an expression
        node = super().generic_visit(node)
        act = _self_call(node, self.self_name)
        norm = act and len(act[1]) == 1 and _self_call(act[1][0], self.self_name)
        if norm and len(norm[1]) == 1:
            fused = self._norm_act(norm, act, node)
            if fused is not None:
                return fused
        return node

    def visit_FunctionDef(self, node):  # a nested function or class has its own scope: left as written
        return node

    visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef


@functools.lru_cache(maxsize=None)
def _rewrite(cls, kinds: tuple):
    """A _Block whose forward is cls's with the patterns above rewritten, for a block whose
    attributes hold `kinds` ((attribute, kind) pairs); else why not, as a string."""
    outer = _unwrapped_forward(cls)
    inner = inspect.unwrap(outer)
    code = getattr(inner, "__code__", None)
    if code is None:
        return "its forward is not a Python function"
    if code.co_freevars:
        return "its forward reads a closure or super(), which normkit does not rewrite"
    try:
        source = textwrap.dedent(inspect.getsource(inner))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as e:
        return f"the source of its forward is not available ({type(e).__name__})"
    fdef = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(fdef, ast.FunctionDef) or not fdef.args.args or \
            any(isinstance(n, ast.Attribute) and n.attr.startswith("__") and not n.attr.endswith("__")
                for n in ast.walk(fdef)):
        return "its forward is not a plain method normkit can rewrite"
    rewriter = _Rewriter(fdef.args.args[0].arg, dict(kinds))
    fdef.body = rewriter._body(fdef.body)
    if not rewriter.sites:
        return ("its forward computes no residual add -> norm, GroupNorm -> activation, adaLN modulation or "
                "per-head norm before a transpose that normkit fuses")
    ast.increment_lineno(tree, code.co_firstlineno - 1)
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(tree), code.co_filename, "exec"), inner.__globals__, namespace)
    fused = namespace[fdef.name]
    fused.__qualname__ = getattr(inner, "__qualname__", fdef.name)
    norms = tuple(sorted({a for a, k in kinds if k != "act"}))
    return _Block(None, fused, norms, tuple(a for a, k in kinds if k == "act"), "; ".join(dict.fromkeys(rewriter.sites)))


def _kinds(module, ops) -> tuple:
    """(attribute, kind) for the child modules of `module` that a rewrite may fuse (see _Rewriter)."""
    kinds = []
    for attr, child in module._modules.items():
        if child is None:
            continue
        style = _norm_style(child)
        if style is not None and _op_of(style) in ops:
            if style == "gn":
                kinds.append((attr, "gn"))
            elif style in _ROW_STYLES:
                shape = getattr(child, "normalized_shape", None)
                last_dim_only = shape is None or len(tuple(shape)) == 1
                kinds.append((attr, "head" if last_dim_only else "row"))
        elif _act_name(child) is not None:
            kinds.append((attr, "act"))
    return tuple(kinds)


def _norm_heads(norm, rows):
    """norm(rows).transpose(1, 2) for the per-head pattern: the same values as norm(rows.transpose(1, 2))
    for a norm over the last dim of a >= 4-D tensor, with rows read in place."""
    if rows.dim() < 4 or _hooked(norm):  # the transpose would move the normalized dim; hooks see the input
        return norm(rows.transpose(1, 2))
    return norm(rows).transpose(1, 2)


def _match(module, ops):
    """The block `module` is, if its norms (and activations) are ones normkit fuses; else why not
    (a string) where it holds a norm normkit knows; else None."""
    cls = type(module)
    if getattr(cls, "_normkit_fused_original", None) is not None or getattr(cls, "_normkit_original", None) is not None \
            or "forward" in module.__dict__:
        return None
    block = _block_of_class(cls)
    if block is _SEQUENTIAL:
        mods = list(module._modules.values())
        runs = [i for i in range(len(mods)) if _fusable_run(mods, i) is not None]
        return block if runs and "group_norm" in ops else None
    if block is not None and all(_norm_style(getattr(module, a, None)) == "gn" for a in block.norms) and \
            "group_norm" in ops and all(_act_name(getattr(module, a, None)) is not None for a in block.acts):
        return block
    kinds = _kinds(module, ops)
    if not any(k != "act" for _, k in kinds):
        return None
    return _rewrite(cls, kinds)


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
    block, relaxed), reused."""
    key = (original, block, relaxed)
    cls = _fused_classes.get(key)
    if cls is None:
        forward = block.fused if block.reference is None else _rebind(block.fused, _unwrapped_forward(original))
        cls = type(original.__name__, (original,), {
            "forward": forward, "_normkit_fused_original": original, "_normkit_relaxed": relaxed,
            "_normkit_add_norm": staticmethod(add_norm), "_normkit_norm_act": staticmethod(_norm_then_act),
            "_normkit_try_norm_act": staticmethod(norm_act), "_normkit_hooked": staticmethod(_hooked),
            "_normkit_norm_heads": staticmethod(_norm_heads), "_normkit_norm_modulate": staticmethod(norm_modulate),
            "__module__": original.__module__, "__qualname__": original.__qualname__})
        _fused_classes[key] = cls
    return cls


def fuse(model: nn.Module, *, ops: Iterable[str] = OPS, backend: Optional[str] = None, dry_run: bool = False,
         relaxed: bool = False, unfused: Optional[dict] = None) -> dict[str, str]:
    """Fuse, in place, the blocks of `model` (the model itself included) around norms of the op
    families in `ops` (see the module docstring). Returns {module name: what is fused there}
    ("" names the model itself); with dry_run=True, what would be, changing nothing. relaxed=True
    also fuses GroupNorm + activation where the block rounds the norm's bf16/fp16 output before the
    activation (one rounding apart). Blocks already fused are left alone. `unfused`, a dict, gets
    {module name: why} for every module holding a norm normkit knows that was not fused."""
    ops = _patch._check_arguments(model, ops, backend)
    for arg, v in (("dry_run", dry_run), ("relaxed", relaxed)):
        if not isinstance(v, bool):
            raise TypeError(f"{arg}: expected a bool, got {v!r}")
    fused = {}
    for name, module in model.named_modules(remove_duplicate=True):
        block = _match(module, ops)
        if isinstance(block, str):
            if unfused is not None:
                unfused[name] = block
            continue
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


_patch._BLOCKS.register(fuse, unfuse)
