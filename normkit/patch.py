"""Swap the norm layers of an existing model for normkit's, in place, and back.

    report = normkit.patch(model)                # PatchReport: {module name: original class}
    print(report)                                # what was patched, what was skipped and why
    print(normkit.patch(model, dry_run=True))    # the same report, nothing changed
    report.fused                                 # {block name: what normkit.blocks fused there}
    restored = normkit.unpatch(model)            # {module name: original class}; undoes the fusion too

A module is patched by giving it a new class: a subclass of its own class whose forward calls
normkit. Nothing else changes: the module object, its Parameters (so an optimizer holding them keeps
working), devices, dtypes, hooks, state_dict keys, and isinstance checks against the original class
all stay as they were. unpatch puts the original class back.

What is patched, and only when its forward is known to compute exactly what the replacement does:
- torch.nn.LayerNorm / RMSNorm / GroupNorm, and subclasses that keep torch's forward;
- timm's LayerNorm, LayerNorm2d (over the channels of an NCHW or channels_last tensor), GroupNorm,
  GroupNorm1 and RmsNorm, when their forward is the timm code normkit knows and timm's fast-norm
  mode (apex or lower-precision compute) was off when they were built;
- model-specific RMSNorm classes recognised by the bytecode of their forward, so every copy that
  transformers' modular code generation makes of a class matches and a variant does not:
    llama   (Llama, Qwen2/3, Mistral, Mixtral, Phi-3, ...): weight * normed(x in fp32).to(x.dtype)
    gemma   (Gemma 1/2/3, Qwen3-Next, ...): (normed(x in fp32) * (1 + weight.float())).type_as(x)
    olmo2   (OLMo 2/3, GPT-OSS, ...): (weight * normed(x in fp32)).to(x.dtype)
  They compute in fp32 and round as HF does whatever autocast says (HF writes them in explicit fp32
  ops, which autocast leaves alone); float64 input runs the class's own forward (HF computes it in
  fp32, normkit would not).

patch() returns a PatchReport: a dict {module name: original class} of what it patched ("" names
the model itself), so `len(report)` and `report == {}` work as before, with
- .patched: that dict; .computes: {module name: what normkit computes for it};
- .skipped: {module name: why it was left alone} for every norm-like module it did not patch (torch's
  norm classes and their subclasses, and any other class named *Norm* with an eps or
  normalized_shape attribute; batch and instance norms aside): an unknown forward, a per-instance
  forward, timm's fast-norm mode, an op family not in `ops`, already patched;
- .dry_run (True: the model was not changed); and a readable str(), grouped by class.
"""
from __future__ import annotations

import numbers
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from . import functional as F

__all__ = ["patch", "unpatch", "PatchReport"]

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


def _layer_norm_2d_forward(self, x):
    # timm's LayerNorm2d: LayerNorm over dim 1 of a 4-D tensor. x.permute(0, 2, 3, 1) has the
    # channels innermost; for channels_last x its rows are contiguous, so normkit reads them in
    # place (NCHW x is copied once, as torch's own layer_norm does); the result is permuted back.
    y = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps,
                     backend=self._normkit_backend)
    return y.permute(0, 3, 1, 2)


def _original_forward(self, x):
    return type(self)._normkit_original.forward(self, x)


# HF's RMSNorm classes write the norm out in explicit fp32 ops, which autocast leaves alone: their
# replacements compute in fp32 and round to x's dtype whatever autocast says (row_norm_as_written),
# not with torch's autocast contract for F.rms_norm.

def _hf_rms_norm(self, x, weight, eps):
    return F.row_norm_as_written(x, x.shape[-1:], weight, None, eps, True, backend=self._normkit_backend)


def _llama_forward(self, hidden_states):
    # HF rounds the normalized fp32 value to x's dtype and then multiplies by the weight (result in
    # the promoted dtype). For fp32 x that rounding is a no-op, so the weight fuses into the kernel;
    # for bf16/fp16 x normkit rounds the same way and torch does the multiply, as HF does.
    x, w = hidden_states, self.weight
    if x.dtype == torch.float32 and w.dtype in _KERNEL_DTYPES:
        return _hf_rms_norm(self, x, w, self.variance_epsilon)
    if x.dtype in _LOW_PRECISION:
        return w * _hf_rms_norm(self, x, None, self.variance_epsilon)
    return _original_forward(self, x)  # HF computes float64 input in fp32; normkit would not


def _gemma_forward(self, x):
    # HF: everything in fp32 with weight (1 + w), one rounding at the end: exactly the fused kernel.
    # The gradient reaches self.weight through the (1 + w.float()) expression.
    if x.dtype not in _KERNEL_DTYPES:
        return _original_forward(self, x)
    return _hf_rms_norm(self, x, 1.0 + self.weight.float(), self.eps)


def _olmo2_forward(self, hidden_states):
    # HF: weight times the fp32 normalized value, one rounding at the end: the fused kernel
    x, w = hidden_states, self.weight
    if x.dtype not in _KERNEL_DTYPES or w.dtype not in _KERNEL_DTYPES:
        return _original_forward(self, x)
    return _hf_rms_norm(self, x, w, self.variance_epsilon)


# ----------------------------------------------------------------------------- recognising forwards
# The reference forwards below are the libraries' code, verbatim (transformers 5.x, timm >= 1.0.15);
# a class matches when its forward compiles to the same bytecode (local names, docstrings and line
# numbers aside). They are never run: the global names they read (fast_layer_norm, ...) are timm's.

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


# timm.layers.norm; with _fast_norm off each is torch's functional op on the module's attributes
class _TimmLayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast_norm:
            x = fast_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # noqa: F821
        else:
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x


class _TimmLayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        if self._fast_norm:
            x = fast_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # noqa: F821
        else:
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x


class _TimmGroupNorm(nn.GroupNorm):  # GroupNorm and GroupNorm1
    def forward(self, x):
        if self._fast_norm:
            return fast_group_norm(x, self.num_groups, self.weight, self.bias, self.eps)  # noqa: F821
        else:
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class _TimmRmsNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast_norm:
            x = fast_rms_norm(x, self.normalized_shape, self.weight, self.eps)  # noqa: F821
        else:
            x = rms_norm(x, self.normalized_shape, self.weight, self.eps)  # noqa: F821
        return x


def _code_key(fn) -> Optional[tuple]:
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return code.co_code, code.co_names, tuple(c for c in code.co_consts if not isinstance(c, str))


def _methods_key(cls, names: tuple[str, ...]) -> Optional[tuple]:
    keys = tuple(_code_key(getattr(cls, n, None)) for n in names)
    return None if None in keys else keys


_HF_NOTE = "float64 input runs the original forward, as HF computes it in fp32"
_STYLES = {  # style -> (methods compared, their key in the reference, normkit forward, what it computes)
    "llama": (("forward",), _methods_key(_LlamaReference, ("forward",)), _llama_forward,
              f"rms_norm, HF Llama style (normed value rounded to x's dtype, then times weight); {_HF_NOTE}"),
    "gemma": (("forward", "_norm"), _methods_key(_GemmaReference, ("forward", "_norm")), _gemma_forward,
              f"rms_norm with weight 1 + w, HF Gemma style (one rounding at the end); {_HF_NOTE}"),
    "olmo2": (("forward",), _methods_key(_Olmo2Reference, ("forward",)), _olmo2_forward,
              f"rms_norm, HF OLMo 2 style (weight inside, one rounding at the end); {_HF_NOTE}"),
}

# timm's drop-ins by qualified name: (op, normkit forward, what it computes, reference forward's key)
_TIMM = {
    "timm.layers.norm.LayerNorm": ("layer_norm", _layer_norm_forward, "layer_norm", _TimmLayerNorm),
    "timm.layers.norm.LayerNorm2d": ("layer_norm", _layer_norm_2d_forward, "layer_norm over dim 1 (channels)",
                                     _TimmLayerNorm2d),
    "timm.layers.norm.GroupNorm": ("group_norm", _group_norm_forward, "group_norm", _TimmGroupNorm),
    "timm.layers.norm.GroupNorm1": ("group_norm", _group_norm_forward, "group_norm", _TimmGroupNorm),
    "timm.layers.norm.RmsNorm": ("rms_norm", _rms_norm_forward, "rms_norm", _TimmRmsNorm),
}
_TIMM = {k: (op, fwd, what, _methods_key(ref, ("forward",))) for k, (op, fwd, what, ref) in _TIMM.items()}

_TORCH = ((nn.LayerNorm, "layer_norm", _layer_norm_forward), (nn.RMSNorm, "rms_norm", _rms_norm_forward),
          (nn.GroupNorm, "group_norm", _group_norm_forward))

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _norm_like(module: nn.Module) -> bool:
    """Worth a line in the report when not patched: torch's norms and their subclasses, and classes
    named *Norm* with an eps or normalized_shape attribute (batch and instance norms aside: normkit
    has none)."""
    if isinstance(module, tuple(t for t, _, _ in _TORCH)):
        return True
    name = type(module).__name__.lower()
    if "norm" not in name or "batchnorm" in name or isinstance(module, nn.modules.batchnorm._NormBase):
        return False
    eps = [getattr(module, n, None) for n in _EPS_NAMES]
    return hasattr(module, "normalized_shape") or any(
        isinstance(e, numbers.Real) and not isinstance(e, bool) for e in eps)


def _classify(module: nn.Module):
    """(op, normkit forward, what it computes) for a module normkit can stand in for exactly; else
    the reason it cannot as a string when the module is norm-like; else None."""
    cls = type(module)
    if getattr(cls, "_normkit_original", None) is not None:
        return "already patched"
    if cls.__module__.startswith("normkit."):
        return "already a normkit module"
    if "forward" in module.__dict__:
        return "has a per-instance forward, whose computation normkit does not know"
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    timm = _TIMM.get(qualname)
    if timm is not None:
        op, fwd, what, key = timm
        if key is None or _methods_key(cls, ("forward",)) != key:
            return f"{qualname}'s forward differs from the timm code normkit knows (another timm version)"
        if getattr(module, "_fast_norm", True):
            return ("timm's fast-norm mode was on when it was built (apex or lower-precision compute); "
                    "build the model after timm.layers.set_fast_norm(False) to patch it")
        return op, fwd, what
    for torch_cls, op, fwd in _TORCH:
        if isinstance(module, torch_cls):
            if cls.forward is torch_cls.forward:
                return op, fwd, op
            return (f"a torch.nn.{torch_cls.__name__} subclass with its own forward, whose computation normkit "
                    "does not know")
    if isinstance(getattr(module, "weight", None), torch.Tensor):
        for names, key, fwd, what in _STYLES.values():
            if key is not None and _methods_key(cls, names) == key:
                return "rms_norm", fwd, what
    if _norm_like(module):
        return ("its forward is not one normkit knows (torch's norms, timm's LayerNorm/LayerNorm2d/GroupNorm/"
                "RmsNorm, the HF Llama/Gemma/OLMo 2 RMSNorm code)")
    return None


# ----------------------------------------------------------------------------- the report

class PatchReport(dict):
    """What patch() did (or, with dry_run=True, would do): a dict {module name: original class} of
    the patched modules, plus .computes {name: what normkit computes for it}, .skipped {name: why a
    norm-like module was left alone}, .fused {block name: what normkit.blocks fused there} and
    .dry_run. str() is a summary grouped by class."""
    fused: dict = {}

    def __init__(self, dry_run: bool = False):
        super().__init__()
        self.dry_run = dry_run
        self.computes: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self._classes: dict[str, str] = {}  # class names of the skipped modules, for str()

    @property
    def patched(self) -> dict[str, type]:
        return dict(self)

    def __str__(self) -> str:
        verb = ("would patch", "would skip") if self.dry_run else ("patched", "skipped")
        lines = [f"normkit.patch{' (dry run)' if self.dry_run else ''}: {verb[0]} {len(self)} modules, "
                 f"{verb[1]} {len(self.skipped)}"]
        groups: dict[tuple, list[str]] = {}
        for name, cls in self.items():
            groups.setdefault((verb[0], cls.__name__, "as " + self.computes[name]), []).append(name)
        for name, why in self.skipped.items():
            groups.setdefault((verb[1], self._classes[name], "because " + why), []).append(name)
        for (what, cls_name, how), names in groups.items():
            shown = ", ".join(n or "(the model)" for n in names[:3])
            more = f", ... ({len(names) - 3} more)" if len(names) > 3 else ""
            lines += [f"  {what} {len(names)} {cls_name}: {shown}{more}", f"      {how}"]
        return "\n".join(lines)


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


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")


def _check_arguments(model, ops, backend) -> tuple:
    """The arguments patch() and blocks.fuse() share, checked; ops as a tuple."""
    _check_model(model)
    if isinstance(ops, str):
        raise TypeError(f"ops: expected a collection of op names such as {OPS}, got the string {ops!r}")
    ops = tuple(ops)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"ops: expected names from {OPS}, got {unknown}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected None or a string, got {type(backend).__name__}")
    return ops


def patch(model: nn.Module, *, ops: Iterable[str] = OPS, backend: Optional[str] = None,
          dry_run: bool = False, fuse=True) -> PatchReport:
    """Replace, in place, the norm layers of `model` (the model itself included) that normkit computes
    exactly, for the op families in `ops`; with dry_run=True change nothing. Returns a PatchReport:
    {module name: original class} of what it patched ("" names the model itself), with .skipped
    {module name: reason} for the norm-like modules it left alone (see the module docstring).
    fuse=True (default) also fuses the blocks around the norms (normkit.blocks.fuse; "relaxed": its
    relaxed mode; False: none), listed in .fused."""
    ops = _check_arguments(model, ops, backend)
    if not isinstance(dry_run, bool):
        raise TypeError(f"dry_run: expected a bool, got {type(dry_run).__name__}")
    if fuse not in (True, False, "relaxed"):
        raise ValueError(f"fuse: expected True, False or 'relaxed', got {fuse!r}")

    report = PatchReport(dry_run)
    for name, module in model.named_modules(remove_duplicate=True):
        found = _classify(module)
        if found is None:
            continue
        if isinstance(found, tuple) and found[0] not in ops:
            found = f"{found[0]} is not in ops={ops}"
        if isinstance(found, str):
            report.skipped[name] = found
            report._classes[name] = type(module).__name__
            continue
        original = type(module)
        report[name] = original
        report.computes[name] = found[2]
        if not dry_run:
            module.__class__ = _patched_class(original, found[1])
            module._normkit_backend = backend
    if fuse:
        from . import blocks  # imports this module
        report.fused = blocks.fuse(model, ops=ops, backend=backend, dry_run=dry_run, relaxed=fuse == "relaxed")
    return report


def unpatch(model: nn.Module) -> dict[str, type]:
    """Undo patch(): give every patched module of `model` its original class back.
    Returns {module name: original class} of what it restored."""
    _check_model(model)
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
