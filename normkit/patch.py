"""Swap the norm layers of an existing model for normkit's, in place, and back.

    replaced = normkit.patch(model)            # {module name: original class}
    replaced.fused                             # {block name: what normkit.blocks fused there}
    restored = normkit.unpatch(model)          # also undoes the fusion

A module is patched by giving it a new class: a subclass of its own class whose forward calls
normkit. Nothing else changes: the module object, its Parameters (so an optimizer holding them keeps
working), devices, dtypes, hooks, state_dict keys, and isinstance checks against the original class
all stay as they were. unpatch puts the original class back.

What is patched, and only when its forward is known to compute exactly what the replacement does:
- torch.nn.LayerNorm / RMSNorm / GroupNorm, and subclasses that keep torch's forward;
- timm's LayerNorm / GroupNorm / GroupNorm1 (torch semantics when its fast-norm mode is off);
- model-specific RMSNorm classes recognised by the bytecode of their forward, so every copy that
  transformers' modular code generation makes of a class matches and a variant does not:
    llama   (Llama, Qwen2/3, Mistral, Mixtral, Phi-3, ...): weight * normed(x in fp32).to(x.dtype)
    gemma   (Gemma 1/2/3, Qwen3-Next, ...): (normed(x in fp32) * (1 + weight.float())).type_as(x)
    olmo2   (OLMo 2/3, GPT-OSS, ...): (weight * normed(x in fp32)).to(x.dtype)
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from . import functional as F

__all__ = ["patch", "unpatch"]

OPS = ("layer_norm", "rms_norm", "group_norm")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- replacement forwards
# Each runs on a patched module; self._normkit_backend is the backend chosen at patch time.

def _layer_norm_forward(self, x):
    return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, backend=self._normkit_backend)


def _rms_norm_forward(self, x):
    return F.rms_norm(x, self.normalized_shape, self.weight, self.eps, backend=self._normkit_backend)


def _group_norm_forward(self, x):
    return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, backend=self._normkit_backend)


def _original_forward(self, x):
    return type(self)._normkit_original.forward(self, x)


def _llama_forward(self, hidden_states):
    # HF rounds the normalized fp32 value to x's dtype and then multiplies by the weight (result in
    # the promoted dtype). For fp32 x that rounding is a no-op, so the weight fuses into the kernel;
    # for bf16/fp16 x normkit rounds the same way and torch does the multiply, as HF does.
    x, w = hidden_states, self.weight
    if x.dtype == torch.float32 and w.dtype in _KERNEL_DTYPES:
        return F.rms_norm(x, w.shape, w, self.variance_epsilon, backend=self._normkit_backend)
    if x.dtype in _LOW_PRECISION:
        return w * F.rms_norm(x, w.shape, None, self.variance_epsilon, backend=self._normkit_backend)
    return _original_forward(self, x)  # HF computes float64 input in fp32; normkit would not


def _gemma_forward(self, x):
    # HF: everything in fp32 with weight (1 + w), one rounding at the end: exactly the fused kernel.
    # The gradient reaches self.weight through the (1 + w.float()) expression.
    if x.dtype not in _KERNEL_DTYPES:
        return _original_forward(self, x)
    return F.rms_norm(x, self.weight.shape, 1.0 + self.weight.float(), self.eps, backend=self._normkit_backend)


def _olmo2_forward(self, hidden_states):
    # HF: weight times the fp32 normalized value, one rounding at the end: the fused kernel
    x, w = hidden_states, self.weight
    if x.dtype not in _KERNEL_DTYPES or w.dtype not in _KERNEL_DTYPES:
        return _original_forward(self, x)
    return F.rms_norm(x, w.shape, w, self.variance_epsilon, backend=self._normkit_backend)


# ----------------------------------------------------------------------------- recognising forwards
# The reference forwards below are transformers' code, verbatim; a class matches when its forward
# compiles to the same bytecode (local names, docstrings and line numbers aside).

class _LlamaReference(nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _GemmaReference(nn.Module):
    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class _Olmo2Reference(nn.Module):
    def forward(self, hidden_states) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


def _code_key(fn) -> Optional[tuple]:
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return code.co_code, code.co_names, tuple(c for c in code.co_consts if not isinstance(c, str))


def _methods_key(cls, names: tuple[str, ...]) -> Optional[tuple]:
    keys = tuple(_code_key(getattr(cls, n, None)) for n in names)
    return None if None in keys else keys


_STYLES = {  # style -> (methods compared, their key in the reference, normkit forward)
    "llama": (("forward",), _methods_key(_LlamaReference, ("forward",)), _llama_forward),
    "gemma": (("forward", "_norm"), _methods_key(_GemmaReference, ("forward", "_norm")), _gemma_forward),
    "olmo2": (("forward",), _methods_key(_Olmo2Reference, ("forward",)), _olmo2_forward),
}

# timm's drop-ins: torch semantics unless their fast-norm mode (lower-precision compute) is on
_TIMM = {
    "timm.layers.norm.LayerNorm": ("layer_norm", _layer_norm_forward),
    "timm.layers.norm.GroupNorm": ("group_norm", _group_norm_forward),
    "timm.layers.norm.GroupNorm1": ("group_norm", _group_norm_forward),
}


_TORCH = ((nn.LayerNorm, "layer_norm", _layer_norm_forward), (nn.RMSNorm, "rms_norm", _rms_norm_forward),
          (nn.GroupNorm, "group_norm", _group_norm_forward))


def _match(module: nn.Module) -> Optional[tuple[str, Callable]]:
    """(op, replacement forward) for a module normkit can stand in for exactly, else None."""
    cls = type(module)
    if "forward" in module.__dict__ or getattr(cls, "_normkit_original", None) is not None:
        return None  # a per-instance forward we know nothing about, or already patched
    for torch_cls, op, fwd in _TORCH:
        if isinstance(module, torch_cls) and cls.forward is torch_cls.forward:
            return op, fwd
    timm = _TIMM.get(f"{cls.__module__}.{cls.__qualname__}")
    if timm is not None and not getattr(module, "_fast_norm", True):
        return timm
    if isinstance(getattr(module, "weight", None), torch.Tensor):
        for names, key, fwd in _STYLES.values():
            if key is not None and _methods_key(cls, names) == key:
                return "rms_norm", fwd
    return None


# ----------------------------------------------------------------------------- class swapping

_patched_classes: dict = {}


def _patched_class(original: type, forward: Callable) -> type:
    """A subclass of `original` whose forward is normkit's; one per (class, forward), reused."""
    key = (original, forward)
    cls = _patched_classes.get(key)
    if cls is None:
        name = f"Normkit{original.__name__}"  # keeps "LayerNorm"/"RMSNorm" in the name: HF init checks it
        cls = type(name, (original,), {"forward": forward, "_normkit_original": original,
                                       "__module__": __name__, "__qualname__": name})
        _patched_classes[key] = cls
    return cls


class Patched(dict):
    """{module name: original class}, with .fused: {block name: what normkit.blocks fused there}."""
    fused: dict = {}


def patch(model: nn.Module, *, ops: Iterable[str] = OPS, backend: Optional[str] = None,
          fuse=True) -> dict[str, type]:
    """Replace, in place, the norm layers of `model` (the model itself included) that normkit computes
    exactly, for the op families in `ops`. Returns {module name: original class} of what it replaced;
    "" names the model itself. Modules already patched are left alone. fuse=True (default) also
    fuses the blocks around the norms (normkit.blocks.fuse; "relaxed": its relaxed mode; False: no
    fusion), listed in the result's .fused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(ops, str):
        raise TypeError(f"ops: expected a collection of op names such as {OPS}, got the string {ops!r}")
    ops = tuple(ops)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"ops: expected names from {OPS}, got {unknown}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected None or a string, got {type(backend).__name__}")
    if fuse not in (True, False, "relaxed"):
        raise ValueError(f"fuse: expected True, False or 'relaxed', got {fuse!r}")

    replaced = Patched()
    for name, module in model.named_modules(remove_duplicate=True):
        found = _match(module)
        if found is None or found[0] not in ops:
            continue
        original = type(module)
        module.__class__ = _patched_class(original, found[1])
        module._normkit_backend = backend
        replaced[name] = original
    if fuse:
        from . import blocks  # imports this module
        replaced.fused = blocks.fuse(model, ops=ops, backend=backend, relaxed=fuse == "relaxed")
    return replaced


def unpatch(model: nn.Module) -> dict[str, type]:
    """Undo patch(): give every patched module of `model` its original class back.
    Returns {module name: original class} of what it restored."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    from . import blocks
    blocks.unfuse(model)
    restored = {}
    for name, module in model.named_modules(remove_duplicate=True):
        original = getattr(type(module), "_normkit_original", None)
        if original is None:
            continue
        module.__class__ = original
        module.__dict__.pop("_normkit_backend", None)
        restored[name] = original
    return restored

