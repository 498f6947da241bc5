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
- any other module recognised by what its forward computes (see "Recognising a forward by its
  computation" below), in one of the styles of `_STYLES`:
    llama   (Llama, Qwen2/3, Mistral, Mixtral, Phi-3, Mamba-2, ...): weight * normed(x in fp32).to(x.dtype)
    gemma   (Gemma 1/2/3, Qwen3-Next, ...): (normed(x in fp32) * (1 + weight.float())).type_as(x)
    olmo2   (OLMo 2/3, GPT-OSS, diffusers' MochiRMSNorm, ...): (weight * normed(x in fp32)).to(x.dtype)
    t5      (T5, mT5, UMT5, diffusers' RMSNorm): weight * normed(x in fp32).to(weight.dtype) [+ bias]
    cohere  (Cohere): layer norm over the last dim in fp32, fp32 weight, no bias, one rounding
    ln_fp32 (diffusers' FP32LayerNorm): F.layer_norm of x, weight and bias in fp32, one rounding
    ln_channels (diffusers' SDCascadeLayerNorm, WuerstchenLayerNorm): LayerNorm over dim 1 of NCHW
    gated   (Mamba-2's MambaRMSNormGated; Bamba, Zamba2, ... where they compute the same): forward(x,
            gate=None) computing weight * normed(x in fp32 * silu(gate in fp32), per group).to(x.dtype);
            normkit's gate= op, groups smaller than the row as per-head weights
  The HF-style ones compute in fp32 and round as the module does whatever autocast says (they are
  written in explicit fp32 ops, which autocast leaves alone); each replacement runs the module's own
  forward for a call it was not proven on (float64 input, another dtype combination, more arguments).

patch() returns a PatchReport: a dict {module name: original class} of what it patched ("" names
the model itself), so `len(report)` and `report == {}` work as before, with
- .patched: that dict; .computes: {module name: what normkit computes for it};
- .skipped: {module name: why it was left alone} for every norm-like module it did not patch (torch's
  norm classes and their subclasses, and any other class named *Norm* with an eps or
  normalized_shape attribute; batch and instance norms aside): a forward that computes something
  else (and where it differs from the closest style), a forward taking more than its input, a
  per-instance forward, timm's fast-norm mode, an op family not in `ops`, already patched;
- .dry_run (True: the model was not changed); and a readable str(), grouped by class.

Recognising a forward by its computation
----------------------------------------
A leaf module with an eps attribute (eps / variance_epsilon / epsilon) whose forward takes one
input (named *args/**kwargs aside: calls using them run the module's own forward), or one input and
one more argument defaulting to None (a gate: probed without it and with a gate of x's shape in
each probe dtype, and matched against the gated styles on all of them), is run once per
(class, attributes) on small CPU probe inputs under a dispatch mode that records every aten op
(`_Recorder`). The record is normalized into a term: names dropped; op names without overload or
in-place suffix; scalar arguments (eps, as the fp32 value the op computes with), shapes, reduction
dims (counted from the end) and the dtype of every value kept; explicit casts and the exact upcasts
that type promotion does inside a mixed-dtype add/mul/sub/div made the same `cast` node; operands
of a commutative add/mul ordered; copies that change nothing dropped. Ops run with grad disabled
(a custom autograd Function, a no_grad block) or on detached values stay distinct, so a forward
with another backward does not match; reads of a tensor's value (data-dependent control flow) and
writes into inputs or parameters match nothing. Each style's reference computation (a small
function in torch ops) is traced the same way on the same probes with the module's eps and
parameter shapes, and a style is proven for a signature -- x fp32/bf16/fp16 x parameters
fp32/bf16/fp16 x train/eval mode -- where the terms are equal; one signature is also checked at
another rank of x (if that differs, only x of the probe's rank runs normkit). The style covering
the most signatures is chosen first (so T5's class, which equals llama only where its weight has
x's dtype, gets t5 everywhere). A patched module's forward looks up (x dtype, train mode,
parameter dtypes) in that table at every call (under a microsecond) and runs its own forward where
the combination was not proven. Probing costs ~5 ms per (class, attributes) (~20 ms the first time
a size and eps are seen: the references), cached for the process. Not seen by a probe: branches on
the device (probes run on the CPU), on grad mode or requires_grad (probes require grad), gradient
hooks registered inside a forward, and attributes changed after patching other than eps and the
parameters' dtypes.
"""
from __future__ import annotations

import inspect
import math
import numbers
import struct
import warnings
from typing import Callable, Iterable, NamedTuple, Optional

import torch
from torch import nn
from torch.nn import functional as TF
from torch.utils._python_dispatch import TorchDispatchMode

from . import functional as F

__all__ = ["patch", "unpatch", "PatchReport"]

OPS = ("layer_norm", "rms_norm", "group_norm")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- replacement forwards
# Each runs on a patched module; self._normkit_backend is the backend chosen at patch time. A plain
# CPU call goes straight to the CPU fast path (normkit/_cpu.py), with the arguments F.layer_norm /
# rms_norm / group_norm would offer it first: two Python layers less a call (microseconds at model
# sizes); a call it declines (and a backend named, torch.compile) takes the public function.

_cpu = F._cpu


def _layer_norm_forward(self, x):
    backend = self._normkit_backend
    if _cpu.offered(x, backend):
        y = _cpu.row_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, False, None, None, None, False,
                          None, 0, None)
        if y is not None:
            return y
    return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, backend=backend)


def _rms_norm_forward(self, x):
    backend = self._normkit_backend
    if _cpu.offered(x, backend):
        y = _cpu.row_norm(x, self.normalized_shape, self.weight, None, self.eps, True, None, None, None, False, None,
                          0, None)
        if y is not None:
            return y
    return F.rms_norm(x, self.normalized_shape, self.weight, self.eps, backend=backend)


def _group_norm_forward(self, x):
    backend = self._normkit_backend
    if _cpu.offered(x, backend):
        y = _cpu.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, None, None)
        if y is not None:
            return y
    return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, backend=backend)


def _layer_norm_2d_forward(self, x):
    # timm's LayerNorm2d: LayerNorm over dim 1 of a 4-D tensor. x.permute(0, 2, 3, 1) has the
    # channels innermost; for channels_last x its rows are contiguous, so normkit reads them in
    # place (NCHW x is copied once, as torch's own layer_norm does); the result is permuted back.
    y = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps,
                     backend=self._normkit_backend)
    return y.permute(0, 3, 1, 2)


def _recognised_forward(self, x, *args, **kwargs):
    """The forward of a module recognised by its computation: the style proven for this call's
    (x dtype, train mode, parameter dtypes) and x's shape, else the module's own forward. A gated
    plan also serves calls passing the gate (None, or a float tensor of x's shape and device, of a dtype probed)."""
    plan = type(self)._normkit_plan
    gate, served = None, not args and not kwargs
    if plan.gate_name is not None and not served:
        if len(args) == 1 and not kwargs:
            gate, served = args[0], True
        elif not args and len(kwargs) == 1 and plan.gate_name in kwargs:
            gate, served = kwargs[plan.gate_name], True
    if served and isinstance(x, torch.Tensor) and (gate is None or (
            isinstance(gate, torch.Tensor) and gate.shape == x.shape and gate.dtype in _PROBE_DTYPES and
            gate.device == x.device)):
        ps = self._parameters
        key = (x.dtype, self.training, *[None if ps.get(n) is None else ps[n].dtype for n in plan.param_names])
        found = plan.table.get(key)
        if found is not None and plan.fits(x):
            style, eps_name = found
            if style.gated:
                return style.forward(self, x, ps.get("weight"), ps.get("bias"), getattr(self, eps_name), plan, gate)
            return style.forward(self, x, ps.get("weight"), ps.get("bias"), getattr(self, eps_name), plan)
    return type(self)._normkit_original.forward(self, x, *args, **kwargs)


# The styles' normkit computations: (module, x, weight, bias, eps, plan). HF's RMSNorm classes
# write the norm out in explicit fp32 ops, which autocast leaves alone: these compute in fp32 and
# round as the module does whatever autocast says (row_norm_as_written), not with torch's autocast
# contract for F.rms_norm. They run only on the (x, weight) dtypes the plan proved.

def _as_written(m, x, shape, weight, bias, eps, rms, **kw):
    return F.row_norm_as_written(x, shape, weight, bias, eps, rms, backend=m._normkit_backend, **kw)


def _nk_llama(m, x, w, b, eps, plan):
    # the normalized fp32 value rounded to x's dtype, then times the weight (result in the promoted
    # dtype). For fp32 x that rounding is a no-op, so the weight fuses into the kernel; for bf16/fp16
    # x normkit rounds the same way and torch does the multiply, as the module does.
    if w is not None and x.dtype == torch.float32:
        return _as_written(m, x, x.shape[-1:], w, None, eps, True)
    y = _as_written(m, x, x.shape[-1:], None, None, eps, True)
    return y if w is None else w * y


def _nk_gemma(m, x, w, b, eps, plan):
    # everything in fp32 with weight (1 + w), one rounding at the end: exactly the fused kernel.
    # The gradient reaches the weight through the (1 + w.float()) expression.
    return _as_written(m, x, x.shape[-1:], 1.0 + w.float(), None, eps, True)


def _nk_olmo2(m, x, w, b, eps, plan):
    # weight times the fp32 normalized value, one rounding at the end: the fused kernel
    return _as_written(m, x, x.shape[-1:], w, None, eps, True)


def _nk_t5(m, x, w, b, eps, plan):
    # the fp32 normalized value rounded to the weight's dtype, then times the weight (bf16/fp16),
    # or times the fp32 weight with no rounding at all (fp32 output, whatever x's dtype)
    if w.dtype == torch.float32:
        y = _as_written(m, x, x.shape[-1:], w, None, eps, True, out_dtype=torch.float32)
    else:
        y = w * _as_written(m, x, x.shape[-1:], None, None, eps, True, out_dtype=w.dtype)
    return y if b is None else y + b


def _nk_cohere(m, x, w, b, eps, plan):
    # layer norm over the last dim in fp32 times the fp32 weight, one rounding: the fused kernel
    # (a (heads, head_dim) weight is normkit's per-head weight)
    return _as_written(m, x, x.shape[-1:], w, None, eps, False)


def _nk_gated(m, x, w, b, eps, plan, gate=None):
    # Mamba-2's gated norm: x * silu(gate) in fp32 (normkit's gate=), normalized per group of
    # plan.groups["gated"] columns (groups smaller than the row: x and the gate viewed as
    # (..., G, group), the weight as per-head (G, group)); rounded to x's dtype, then times the
    # weight, as _nk_llama (fused for fp32 x, where the rounding is a no-op).
    n = x.shape[-1]
    group = plan.groups["gated"] or n  # None: the module normalizes whole rows without a group view
    G = n // group
    if G > 1:
        x = x.unflatten(-1, (G, group))
        gate = None if gate is None else gate.unflatten(-1, (G, group))
    wv = None if w is None else (w.view(G, group) if G > 1 else w)
    if wv is not None and x.dtype == torch.float32:
        y = _as_written(m, x, (group,), wv, None, eps, True, **({} if gate is None else {"gate": gate}))
        return y.flatten(-2) if G > 1 else y
    y = _as_written(m, x, (group,), None, None, eps, True, **({} if gate is None else {"gate": gate}))
    y = y.flatten(-2) if G > 1 else y
    return y if w is None else w * y


def _nk_ln_fp32(m, x, w, b, eps, plan):
    return _as_written(m, x, plan.shape(m), w, b, eps, False)


def _nk_ln_channels(m, x, w, b, eps, plan):
    y = F.layer_norm(x.permute(0, 2, 3, 1), plan.shape(m), w, b, eps, backend=m._normkit_backend)
    return y.permute(0, 3, 1, 2)


# ----------------------------------------------------------------------------- the styles
# A style: the computation a normkit forward performs, written once in torch ops (its reference)
# and traced like the modules. The reference gets the probe x and a _Params with the module's
# eps, its weight/bias probes (or None) and its normalized shape; it raises _NotApplicable for
# attributes the normkit forward does not take.

class _NotApplicable(Exception):
    pass


class _Params(NamedTuple):
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    eps: float
    shape: tuple
    group: Optional[int] = None  # gated styles: the columns normalized together (the row's width, or less)


def _rms_fp32(x, p):  # HF's normalized value: x in fp32 times rsqrt(mean(x^2) + eps), in fp32
    h = x.to(torch.float32)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + p.eps)


def _needs(p, weight: Optional[bool], bias: bool = False):
    if (weight is not None and (p.weight is not None) != weight) or (p.bias is not None and not bias):
        raise _NotApplicable


def _ref_llama(x, p):
    _needs(p, None)
    h = _rms_fp32(x, p).to(x.dtype)
    return h if p.weight is None else p.weight * h


def _ref_gemma(x, p):
    _needs(p, True)
    return (_rms_fp32(x, p) * (1.0 + p.weight.float())).type_as(x)


def _ref_olmo2(x, p):
    _needs(p, None)
    h = _rms_fp32(x, p)
    return (h if p.weight is None else p.weight * h).to(x.dtype)


def _ref_t5(x, p):
    _needs(p, True, bias=True)
    y = p.weight * _rms_fp32(x, p).to(p.weight.dtype)
    return y if p.bias is None else y + p.bias


def _ref_cohere(x, p):
    _needs(p, True)
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + p.eps)
    return (p.weight.to(torch.float32) * h).to(x.dtype)


def _ref_gated(x, p, gate=None):
    # MambaRMSNormGated (transformers' Mamba-2, Bamba, ...): the gate multiplies in fp32 before the
    # statistics, which are per group of p.group columns; HF Llama's rounding, then the weight
    _needs(p, None)
    h = x.to(torch.float32)
    if gate is not None:
        h = h * TF.silu(gate.to(torch.float32))
    if p.group is None:  # whole rows, no group view (transformers before the groups came, e.g. 5.17)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + p.eps)).to(x.dtype)
    else:
        *prefix, last = h.shape
        g = h.view(*prefix, last // p.group, p.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + p.eps)
        h = g.view(*prefix, last).to(x.dtype)
    return h if p.weight is None else p.weight * h


def _ref_ln_fp32(x, p):
    _needs(p, None, bias=True)
    w = None if p.weight is None else p.weight.float()
    b = None if p.bias is None else p.bias.float()
    return TF.layer_norm(x.float(), p.shape, w, b, p.eps).to(x.dtype)


def _ref_ln_channels(x, p):
    _needs(p, None, bias=True)
    return TF.layer_norm(x.permute(0, 2, 3, 1), p.shape, p.weight, p.bias, p.eps).permute(0, 3, 1, 2)


class _Style(NamedTuple):
    name: str
    op: str                 # the op family (patch's `ops=`)
    reference: Callable     # (x, _Params) -> tensor: what the normkit forward computes, in torch ops
    forward: Callable       # (module, x, weight, bias, eps, plan) -> tensor: normkit
    what: str               # for the report
    layout: str = "rows"    # probe x: "rows" (..., *normalized shape) or "nchw" (N, C, H, W)
    gated: bool = False     # reference(x, p, gate=None) and forward(..., plan, gate): a gated norm's


_HF_NOTE = "fp32 math and the module's roundings whatever autocast says"
_STYLES = {s.name: s for s in (
    _Style("llama", "rms_norm", _ref_llama, _nk_llama,
           f"rms_norm, HF Llama style (normed value rounded to x's dtype, then times weight); {_HF_NOTE}"),
    _Style("gemma", "rms_norm", _ref_gemma, _nk_gemma,
           f"rms_norm with weight 1 + w, HF Gemma style (one rounding at the end); {_HF_NOTE}"),
    _Style("olmo2", "rms_norm", _ref_olmo2, _nk_olmo2,
           f"rms_norm, HF OLMo 2 style (weight inside, one rounding at the end); {_HF_NOTE}"),
    _Style("t5", "rms_norm", _ref_t5, _nk_t5,
           "rms_norm, T5 style (normed value rounded to the weight's dtype, then times weight: an fp32 weight "
           f"gives fp32 output); {_HF_NOTE}"),
    _Style("cohere", "layer_norm", _ref_cohere, _nk_cohere,
           f"layer_norm over the last dim without bias, Cohere style (fp32 weight inside, one rounding); {_HF_NOTE}"),
    _Style("ln_fp32", "layer_norm", _ref_ln_fp32, _nk_ln_fp32,
           "layer_norm of x, weight and bias in fp32, one rounding to x's dtype (diffusers' FP32LayerNorm)"),
    _Style("ln_channels", "layer_norm", _ref_ln_channels, _nk_ln_channels,
           "layer_norm over dim 1 (channels) of an NCHW tensor", layout="nchw"),
    _Style("gated", "rms_norm", _ref_gated, _nk_gated,
           "gated rms_norm of x * silu(gate) per group, Mamba-2 style (normed value rounded to x's dtype, then "
           f"times weight; the gate passed through to normkit's gate=); {_HF_NOTE}", gated=True),
)}
# what each style name (and blocks' names for torch's modules) computes, as an op family
_STYLE_OPS = {"ln": "layer_norm", "rms": "rms_norm", "gn": "group_norm", **{s.name: s.op for s in _STYLES.values()}}


# ----------------------------------------------------------------------------- tracing into terms
# A term is a nested tuple: ("in", name, dtype, shape) for an input; ("cast", dtype, term);
# ("op", name, dtype, grad enabled, args, kwargs[, output index]); ("const", dtype, shape, values)
# for a tensor the trace did not make; ("stale",) for an alias of a tensor written in place.

_COMMUTATIVE = ("add", "mul")
_PROMOTING = ("add", "sub", "mul", "div", "where", "maximum", "minimum", "rsub")
_IDENTITY = ("clone", "alias", "contiguous")
_REDUCTIONS = ("mean", "sum", "var", "std", "var_mean", "std_mean", "amax", "amin")
_VALUE_READS = ("_local_scalar_dense", "is_nonzero", "item", "equal", "allclose", "nonzero")


class _Failed(str):
    """Why a probe gave no term (an error, or something the term cannot describe)."""


def _cast(dtype, term):
    return ("cast", dtype, term)


def _exact_upcast(src: torch.dtype, dst: torch.dtype) -> bool:
    return src != dst and src.is_floating_point and dst.is_floating_point and torch.promote_types(src, dst) == dst


class _Recorder(TorchDispatchMode):
    """Records the aten ops a function runs (real tensors, on the CPU) as terms, by tensor identity."""

    def __init__(self, inputs: dict):
        super().__init__()
        self.terms = {id(t): ("in", n, t.dtype, tuple(t.shape)) for n, t in inputs.items() if t is not None}
        self.keep = list(inputs.values())  # tensors stay alive: ids stay unique
        self.storages: dict = {}
        self.bad: Optional[str] = None

    def term(self, a):
        if isinstance(a, torch.Tensor):
            t = self.terms.get(id(a))
            if t is None:
                values = tuple(a.detach().reshape(-1).tolist()) if a.numel() <= 16 else id(a)
                t = ("const", a.dtype, tuple(a.shape), values)
            return t
        if isinstance(a, (list, tuple)):
            return tuple(self.term(b) for b in a)
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype)):
            return a
        return repr(a)  # devices, layouts, memory formats

    def _set(self, t: torch.Tensor, term) -> None:
        self.terms[id(t)] = term
        self.keep.append(t)
        if t.numel():
            self.storages.setdefault(t.untyped_storage().data_ptr(), []).append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.bad is None:
            try:
                self._record(func, args, kwargs, out)
            except Exception as e:  # noqa: BLE001 -- anything unexpected: no term, no match
                self.bad = f"its trace could not be recorded ({type(e).__name__}: {e})"
        return out

    def _record(self, func, args, kwargs, out):
        info = _FUNC_INFO.get(func)
        if info is None:
            name = func._schema.name.split("::")[-1]
            info = _FUNC_INFO[func] = (name, func._schema.is_mutable)
        name, mutable = info
        if name in _VALUE_READS:
            self.bad = f"it reads a tensor's value ({name}): its computation depends on the data"
            return
        target = None
        if mutable:
            target = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if not name.endswith("_") or "out" in kwargs or target is None or out is not target:
                self.bad = f"it writes into a tensor ({func})"
                return
            if self.terms.get(id(target), ("in",))[0] == "in":
                self.bad = f"it writes into its input or a parameter in place ({func})"
                return
            name = name[:-1]  # in place on a value of its own: the op's value, as out of place
        if name == "lift_fresh" or (name in _IDENTITY and len(args) == 1 and not kwargs):
            self._set(out, self.term(args[0]))
            return
        if name == "_to_copy":
            src = self.term(args[0])
            dtype = kwargs.get("dtype") or args[0].dtype
            self._set(out, src if dtype == args[0].dtype else _cast(dtype, src))
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        terms = [self.term(a) for a in args]
        if name in _REDUCTIONS and len(args) > 1 and isinstance(args[0], torch.Tensor) and \
                isinstance(args[1], (list, tuple)) and all(type(d) is int for d in args[1]):
            # dims counted from the end (torch's decompositions count from the front): another rank
            # of x is checked on one probe, where a dim fixed from the front would differ
            terms[1] = tuple(d - args[0].dim() if d >= 0 else d for d in args[1])
        if name in _PROMOTING and isinstance(out, torch.Tensor):
            # the exact upcasts type promotion does are casts; a float scalar is used in the op's
            # fp32 math for fp32/bf16/fp16 tensors (as eps rounded to fp32 by torch's own decompositions)
            dt = out.dtype
            terms = [_cast(dt, t) if isinstance(a, torch.Tensor) and _exact_upcast(a.dtype, dt) else
                     _as_fp32(a) if type(a) is float and dt in _KERNEL_DTYPES else t for a, t in zip(args, terms)]
            if name in _COMMUTATIVE and len(terms) == 2 and kwargs.get("alpha", 1) == 1 and \
                    isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor):
                terms.sort(key=hash)
        kw = tuple(sorted((k, self.term(v)) for k, v in kwargs.items() if not (k == "alpha" and v == 1)))
        head = (name, torch.is_grad_enabled(), tuple(terms), kw)
        if target is not None:  # the other views of a tensor written in place: what they hold changed
            for alias in self.storages.get(target.untyped_storage().data_ptr(), ()):
                if alias is not target:
                    self.terms[id(alias)] = ("stale",)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                self._set(o, ("op", head[0], o.dtype) + head[1:] + ((i,) if len(outs) > 1 else ()))


_FUNC_INFO: dict = {}  # aten overload -> (name, mutable)


def _as_fp32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0] if math.isfinite(v) and abs(v) < 3.4e38 else v


def _trace(fn, inputs: dict):
    """The term of fn()'s tensor result, recorded on these inputs; or a _Failed saying why not."""
    rec = _Recorder(inputs)
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. torch's "mismatched dtypes" notes, once per probe
            with rec:
                out = fn()
    except _NotApplicable:
        return _Failed("not applicable")
    except Exception as e:  # noqa: BLE001 -- a forward that fails on a probe is not proven there
        return _Failed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if rec.bad is not None:
        return _Failed(rec.bad)
    if not isinstance(out, torch.Tensor):
        return _Failed(f"it returns a {type(out).__name__}, not a tensor")
    return rec.term(out)


_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _show(t, depth: int = 4) -> str:
    """A term as an expression, nested `depth` ops deep."""
    if isinstance(t, torch.dtype):
        return _SHORT.get(t, str(t))
    if type(t) is float:
        return f"{t:.7g}"
    if not isinstance(t, tuple):
        return repr(t)
    tag = t[0] if t else None
    if tag == "in":
        return t[1]
    if tag == "cast":
        return f"{_show(t[2], depth)}.to({_show(t[1])})"
    if tag == "const":
        return f"tensor({t[3]!r}, {_show(t[1])})" if isinstance(t[3], tuple) else f"<{_show(t[1])} tensor>"
    if tag == "stale":
        return "<a tensor written in place>"
    if tag == "op":
        if depth <= 0:
            return f"{t[1]}(...)"
        args = [_show(a, depth - 1) for a in t[4]] + [f"{k}={_show(v, depth - 1)}" for k, v in t[5]]
        note = "" if t[3] else " [grad disabled]"
        index = f"[{t[6]}]" if len(t) > 6 else ""
        return f"{t[1]}({', '.join(args)}){index}{note}"
    return "[" + ", ".join(_show(a, depth) for a in t) + "]"


def _is_term(t) -> bool:
    return isinstance(t, tuple) and bool(t) and t[0] in ("in", "cast", "const", "stale", "op")


def _difference(a, b):
    """The first pair of differing sub-terms of two terms (outermost op first), or None. Operands of
    a commutative op pair up by equality first, whatever their order."""
    if a == b:
        return None
    if _is_term(a) and _is_term(b) and a[0] == b[0] and len(a) == len(b):
        if a[0] == "op" and a[1:4] == b[1:4] and a[5:] == b[5:] and len(a[4]) == len(b[4]):
            if a[1] in _COMMUTATIVE and len(a[4]) == 2:  # pair the operands that share the most
                (a0, a1), (b0, b1) = a[4], b[4]
                same, swapped = _shared(a0, b0) + _shared(a1, b1), _shared(a0, b1) + _shared(a1, b0)
                pairs = list(zip(a[4], b[4] if same >= swapped else b[4][::-1]))
            else:
                pairs = list(zip(a[4], b[4]))
        elif a[0] == "cast" and a[1] == b[1]:
            pairs = [(a[2], b[2])]
        else:
            return a, b
        for x, y in pairs:
            if x != y:
                return _difference(x, y) if _is_term(x) and _is_term(y) else (a, b)
    return a, b


def _shared(a, b) -> int:
    return len(_subterms(a, set()) & _subterms(b, set()))


def _subterms(t, acc: set) -> set:
    if _is_term(t):
        acc.add(t)
        for c in (t[4] if t[0] == "op" else t[2:3] if t[0] == "cast" else ()):
            _subterms(c, acc)
    elif isinstance(t, tuple):
        for c in t:
            _subterms(c, acc)
    return acc


# ----------------------------------------------------------------------------- recognising modules

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
_PROBE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Plan:
    """What a recognised module's replacement runs: {(x dtype, training, *parameter dtypes): (style,
    eps attribute)} for the proven calls, x's layout and normalized shape, and the report's text."""

    def __init__(self, table: dict, layout: str, shape: tuple, shape_attr: Optional[str], param_names: tuple,
                 full: set, groups: Optional[dict] = None, gate_name: Optional[str] = None):
        self.table, self.layout, self.S, self.shape_attr = table, layout, shape, shape_attr
        self.param_names, self.ndim = param_names, len(shape)
        # gated styles: {style name: columns per group}; the forward's gate parameter (None: no gate)
        self.groups = {s.name: groups[s.name] for s, _ in table.values() if s.gated} if groups else {}
        self.gate_name = gate_name
        self.any_rank = True  # False: proven only for x with ndim + 2 dims (the probe's)
        styles = {s.name for s, _ in table.values()}
        self.style = next(iter(styles)) if len(styles) == 1 and set(table) == full else None
        self.ops = tuple(sorted({s.op for s, _ in table.values()}))
        self.op = self.ops[0] if len(self.ops) == 1 else "+".join(self.ops)
        self.eps_name = next(iter({e for _, e in table.values()})) if len({e for _, e in table.values()}) == 1 \
            else None
        self.what = self._describe(full)
        self._key = (frozenset((k, (s.name, e)) for k, (s, e) in table.items()), layout, shape, shape_attr,
                     param_names, tuple(sorted(self.groups.items())), gate_name)

    def __eq__(self, other):
        return isinstance(other, _Plan) and (self._key, self.any_rank) == (other._key, other.any_rank)

    def __hash__(self):
        return hash((self._key, self.any_rank))

    def fits(self, x: torch.Tensor) -> bool:
        if self.layout == "nchw":
            return x.dim() == 4 and x.shape[1] == self.S[0]
        return (x.dim() > self.ndim if self.any_rank else x.dim() == self.ndim + 2) and \
            tuple(x.shape[-self.ndim:]) == self.S

    def shape(self, module):
        return getattr(module, self.shape_attr) if self.shape_attr else self.S

    def _describe(self, full: set) -> str:
        by_style: dict = {}
        for key, (style, _) in self.table.items():
            by_style.setdefault(style, []).append(key)
        parts = []
        for style, keys in by_style.items():
            what = style.what
            if style.gated:
                group = self.groups[style.name]
                what += (f"; groups of {group} columns" if group not in (None, math.prod(self.S)) else
                         "; one group per row") + \
                    (f"; the gate ({self.gate_name}=) fused" if self.gate_name else "; no gate argument")
            if len(by_style) == 1 and set(keys) == full:
                parts.append(what)
                continue
            modes: dict = {}  # dtype combination -> the modes it was proven in
            for k in keys:
                combo = "x " + _SHORT[k[0]] + "".join(f" {n} {_SHORT[d]}" for n, d in zip(self.param_names, k[2:])
                                                      if d is not None)
                modes.setdefault(combo, set()).add(k[1])
            combos = [c + ("" if len(m) == 2 else " in train mode" if True in m else " in eval mode")
                      for c, m in sorted(modes.items())]
            parts.append(f"{what} [for {'; '.join(combos)}]")
        others = "a gate of another shape or float64, " if self.gate_name else ""
        return "; ".join(parts) + f"; other calls (float64, other dtypes, {others}more arguments) run its own forward"

    def finish(self, any_rank: bool) -> "_Plan":
        """Records whether another rank of x computed the same (else only x of the probe's rank runs normkit)."""
        self.any_rank = any_rank
        if not any_rank:
            self.what += f"; x with {self.ndim + 2} dims only (another rank computes otherwise)"
        return self


_RECOGNISED: dict = {}      # (class, attributes) -> _Plan, or why not (a string)
_CLASS_STYLES: dict = {}    # class -> {the uniform style of each module of it probed (None: none, or not uniform)}
_REFERENCES: dict = {}      # (style, probe) -> term
_SIGNATURES: dict = {}      # class -> why its forward cannot be probed, or None


def _simple(v) -> bool:
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype)):
        return True
    return isinstance(v, (tuple, list, torch.Size)) and all(isinstance(e, (bool, int, float, str)) for e in v)


def _attributes_key(module: nn.Module) -> tuple:
    """The attributes a forward may read: simple values as they are, other objects by type, the
    parameters' shapes (their dtypes are probed), whether it holds buffers or child modules."""
    items = []
    for k, v in module.__dict__.items():
        if k == "training" or k.startswith("_normkit"):
            continue
        if _simple(v):
            items.append((k, tuple(v) if isinstance(v, (list, torch.Size)) else v))
        elif not k.startswith("_"):
            items.append((k, type(v).__qualname__))
    params = tuple((n, None if p is None else tuple(p.shape)) for n, p in module._parameters.items())
    return type(module), tuple(items), params, bool(module._buffers), bool(module._modules)


def _gate_param(cls) -> Optional[str]:
    """The name of cls.forward's second parameter where its forward is forward(x, <name>=None): a
    possible gate, probed with the gated styles; else None."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(named) == 2 and named[1].default is None and named[1].kind is not named[1].POSITIONAL_ONLY and \
            named[0].default is named[0].empty:
        return named[1].name
    return None


def _forward_takes_more(cls) -> Optional[str]:
    """Why calls of cls.forward(x) alone do not cover its uses (named parameters besides x, other
    than one gate=None that the gated styles probe), or None."""
    if cls not in _SIGNATURES:
        why = None
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]
        except (TypeError, ValueError):
            params = None
        if params is None:
            why = "its forward's signature cannot be read"
        else:
            named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            if not named:
                why = "its forward takes no single input"
            elif len(named) > 1 and _gate_param(cls) is None:
                others = ", ".join(p.name for p in named[1:])
                why = (f"its forward takes more than its input ({others}): normkit's norms normalize one tensor "
                       "and have no op for what those arguments add (a gate, a conditioning, a residual)")
        _SIGNATURES[cls] = why
    return _SIGNATURES[cls]


def _normalized_shape(module) -> Optional[tuple]:
    w = module._parameters.get("weight")
    if isinstance(w, torch.Tensor):
        return tuple(w.shape) if w.dim() >= 1 else None
    for name in ("normalized_shape", "dim", "hidden_size"):
        v = module.__dict__.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return (v,)
        if isinstance(v, (tuple, list, torch.Size)) and v and all(isinstance(e, int) and e > 0 for e in v):
            return tuple(v)
    return None


def _probe_module(module, params: dict, training: bool):
    """A shallow stand-in for `module` holding the probe parameters (the module itself is untouched)."""
    probe = object.__new__(type(module))
    probe.__dict__.update(module.__dict__)
    probe.__dict__.update(_parameters=dict(params), _buffers={}, _modules={}, training=training)
    return probe


def _probe_x(shape, dtype) -> torch.Tensor:
    """A probe input as a module gets one: the output of an earlier op that requires grad (not a leaf)."""
    return torch.ones(shape, dtype=dtype, requires_grad=True).clone()


def _probe_shapes(layout: str, S: tuple) -> tuple:
    """x's probe shape for every signature, and another rank checked on one signature (or None)."""
    if layout == "nchw":
        return ((2, S[0], 2, S[0] + 1), None) if len(S) == 1 else (None, None)
    return (2, 3) + S, (3,) + S


def _reference_term(style: _Style, x_shape, x_dtype, params: dict, eps: float, shape: tuple, group=None,
                    gate_name: Optional[str] = None):
    """The style's term on these probes; for a gated style with gate_name, the tuple (without the gate,
    then with a gate of x's shape named gate_name in each probe dtype), as a gated module's probe gives it."""
    key = (style.name, x_shape, x_dtype, tuple((n, None if p is None else (p.dtype, tuple(p.shape)))
                                               for n, p in params.items()), eps, shape, group, gate_name)
    term = _REFERENCES.get(key)
    if term is None:
        x = _probe_x(x_shape, x_dtype)
        p = _Params(params.get("weight"), params.get("bias"), eps, shape, group)
        term = _trace(lambda: style.reference(x, p), {"x": x, **params})
        terms = [term]
        for gd in (_PROBE_DTYPES if gate_name is not None else ()):
            if isinstance(terms[-1], _Failed):
                break
            x, g = _probe_x(x_shape, x_dtype), _probe_x(x_shape, gd)
            terms.append(_trace(lambda: style.reference(x, p, g), {"x": x, gate_name: g, **params}))
        term = terms[-1] if isinstance(terms[-1], _Failed) else tuple(terms) if len(terms) > 1 else term
        _REFERENCES[key] = term
    return term


def _group_sizes(module, n: int) -> tuple:
    """Candidate group widths of a gated norm over rows of n: n itself, and the divisors of n that
    the module's int attributes name (as a width, or as a count of groups). Only candidates: a width
    is used where the traced computation equals the style's with it. None: whole rows written
    without a group view (the form before Mamba-2's groups reached transformers)."""
    found = [n, None]
    for v in module.__dict__.values():
        if isinstance(v, int) and not isinstance(v, bool) and 0 < v < n and n % v == 0:
            found += [v, n // v]
    return tuple(dict.fromkeys(found))


def _recognise(module: nn.Module):
    """A _Plan for a module whose forward is recognised by its computation; a string saying why not
    where it was probed or is not a leaf with an eps; cached per (class, attributes)."""
    d = module.__dict__
    if not any(isinstance(d.get(n), numbers.Real) and not isinstance(d.get(n), bool) for n in _EPS_NAMES):
        return "it has no eps attribute (eps, variance_epsilon or epsilon) to probe its forward with"
    if module._modules:
        return "it holds submodules (normkit patches the norms among them, not the module itself)"
    key = _attributes_key(module)
    found = _RECOGNISED.get(key)
    if found is None:
        found = _RECOGNISED[key] = _find_plan(module)
        _CLASS_STYLES.setdefault(type(module), set()).add(found.style if isinstance(found, _Plan) else None)
    return found


def _find_plan(module: nn.Module):
    cls = type(module)
    eps = {}  # value -> the first attribute holding it
    for n in _EPS_NAMES:
        v = module.__dict__.get(n)
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            eps.setdefault(float(v), n)
    if module._buffers:
        return "it holds buffers, which normkit's norms do not read"
    why = _forward_takes_more(cls)
    if why:
        return why
    S = _normalized_shape(module)
    if S is None:
        return "its normalized shape is unknown (no weight, normalized_shape or dim attribute) to probe with"
    names = tuple(module._parameters)
    present = [n for n in names if module._parameters[n] is not None]
    shape_attr = "normalized_shape" if isinstance(module.__dict__.get("normalized_shape"), (tuple, list, torch.Size)) \
        else None
    shape = tuple(module.__dict__["normalized_shape"]) if shape_attr else S
    p_dtypes = _PROBE_DTYPES if present else (None,)
    full = {(xd, tr, *[None if n not in present else pd for n in names])
            for xd in _PROBE_DTYPES for tr in (False, True) for pd in p_dtypes}

    def probe_params(pd):
        return {n: None if n not in present else torch.ones(module._parameters[n].shape, dtype=pd, requires_grad=True)
                for n in names}

    gate_name = _gate_param(cls)

    def module_term(xs, xd, params, training):
        probe, x = _probe_module(module, params, training), _probe_x(xs, xd)
        term = _trace(lambda: cls.forward(probe, x), {"x": x, **params})
        if gate_name is None or isinstance(term, _Failed):
            return term
        terms = [term]
        for gd in _PROBE_DTYPES:  # a gate of each dtype: Mamba-2 passes a bf16 gate with an fp32 x
            probe, x, g = _probe_module(module, params, training), _probe_x(xs, xd), _probe_x(xs, gd)
            terms.append(_trace(lambda: cls.forward(probe, x, **{gate_name: g}), {"x": x, gate_name: g, **params}))
            if isinstance(terms[-1], _Failed):
                return terms[-1]
        return tuple(terms)

    groups_found: dict = {}  # gated style -> the group width its reference matched with
    n_cols = math.prod(S)

    first_error, why = None, None
    for layout in ("rows", "nchw"):
        xs, other_rank = _probe_shapes(layout, S)
        styles = [s for s in _STYLES.values() if s.layout == layout and (gate_name is None or s.gated)]
        if xs is None or not styles:
            continue
        cover: dict = {}  # style name -> {signature: eps attribute}
        module_terms: dict = {}
        for xd in _PROBE_DTYPES:
            for pd in p_dtypes:
                params = probe_params(pd)
                for tr in (False, True):
                    sig = (xd, tr, *[None if n not in present else pd for n in names])
                    term = module_terms[sig] = module_term(xs, xd, params, tr)
                    if isinstance(term, _Failed):
                        first_error = first_error or (xd, pd, xs, term)
                        continue
                    for style in styles:
                        widths = ((groups_found[style.name],) if style.name in groups_found else
                                  _group_sizes(module, n_cols)) if style.gated else (None,)
                        for value, attr in eps.items():
                            width = next((w for w in widths if _reference_term(
                                style, xs, xd, params, value, shape, w, gate_name) == term), False)
                            if width is not False:
                                cover.setdefault(style.name, {}).setdefault(sig, attr)
                                if style.gated:
                                    groups_found[style.name] = width
                                break
        if cover:
            plan = _choose(cover, layout, S, shape_attr, names, full, groups_found, gate_name)
            if other_rank is not None:  # one signature at another rank: is the computation rank-free?
                sig, (style, attr) = next(iter(sorted(plan.table.items(), key=lambda kv: repr(kv[0]))))
                params = probe_params(next((d for d in sig[2:] if d is not None), None))
                same = module_term(other_rank, sig[0], params, sig[1]) == \
                    _reference_term(style, other_rank, sig[0], params, getattr(module, attr), shape,
                                    plan.groups.get(style.name), gate_name)
                plan.finish(same)
            return plan
        why = why or _closest(module, module_terms, xs, names, present, eps, shape, styles, gate_name, n_cols)
    if why is not None:
        return why
    if first_error is not None:
        xd, pd, xs, err = first_error
        return (f"its forward failed on every probe (x {_SHORT[xd]} of shape {xs}, parameters "
                f"{_SHORT.get(pd, pd)}): {err}")
    return "its forward could not be probed"


def _choose(cover: dict, layout, S, shape_attr, names, full, groups=None, gate_name=None) -> _Plan:
    """The plan: for each proven signature the style that covers the most signatures (ties: the
    order of _STYLES), so a class computing one style everywhere gets that style everywhere."""
    order = list(_STYLES)
    table, left = {}, set().union(*[set(c) for c in cover.values()])
    while left:
        name = max(cover, key=lambda n: (len(left & set(cover[n])), -order.index(n)))
        for sig in left & set(cover[name]):
            table[sig] = (_STYLES[name], cover[name][sig])
        left -= set(cover[name])
    return _Plan(table, layout, S, shape_attr, names, full, groups, gate_name)


def _closest(module, module_terms: dict, xs, names, present, eps: dict, shape, styles, gate_name=None,
             n_cols=None) -> Optional[str]:
    """Why no style matched: where the module's computation first differs from the closest style's
    (the one sharing most sub-terms), on one probe (bf16 x and parameters where that probe ran)."""
    sigs = [s for s, t in module_terms.items() if not isinstance(t, _Failed)]
    if not sigs:
        return None
    pref = (torch.bfloat16, False, *[None if n not in present else torch.bfloat16 for n in names])
    sig = pref if pref in sigs else sigs[0]
    term = module_terms[sig]
    params = {n: None if d is None else torch.ones(module._parameters[n].shape, dtype=d, requires_grad=True)
              for n, d in zip(names, sig[2:])}
    mine, best = _subterms(term, set()), None
    for style in styles:
        for value in eps:
            ref = _reference_term(style, xs, sig[0], params, value, shape,
                                  _group_sizes(module, n_cols)[-1] if style.gated else None, gate_name)
            if not isinstance(ref, _Failed):
                score = len(mine & _subterms(ref, set()))
                if best is None or score > best[0]:
                    best = (score, style, ref)
    combo = f"x {_SHORT[sig[0]]}" + "".join(f", {n} {_SHORT[d]}" for n, d in zip(names, sig[2:]) if d is not None)
    if best is None:
        return f"its computation matches none of normkit's styles (probed with {combo}: {_show(term)})"
    _, style, ref = best
    if gate_name is not None and not _is_term(term) and not _is_term(ref):  # without, then with a gate of each dtype
        which = next((i for i, (a, b) in enumerate(zip(term, ref)) if a != b), 0)
        term, ref = term[which], ref[which]
        combo += "" if which == 0 else f", with {gate_name} {_SHORT[_PROBE_DTYPES[which - 1]]}"
    a, b = _difference(term, ref) or (term, ref)
    return (f"its computation matches none of normkit's styles; probed with {combo}, it computes {_show(a)} "
            f"where the closest style, {style.name}, computes {_show(b)}")


_TORCH_STYLES = {nn.LayerNorm: "ln", nn.RMSNorm: "rms", nn.GroupNorm: "gn"}


def _style_of(cls_or_module) -> Optional[str]:
    """What a norm class or module computes: "ln", "rms", "gn" (torch's modules and subclasses that
    keep torch's forward), a name of _STYLES ("llama", "gemma", "olmo2", "t5", ...) where it computes
    that style for every dtype combination probed (x and parameters fp32/bf16/fp16, train and eval
    mode), else None. A patched class or module answers from its plan (no probing); an unpatched
    module is probed (cached); an unpatched class answers from the modules of it probed so far."""
    cls = cls_or_module if isinstance(cls_or_module, type) else type(cls_or_module)
    style = _TORCH_STYLES.get(cls)  # torch's own classes: the common case, asked at every fused block's call
    if style is not None:
        return style
    plan = cls.__dict__.get("_normkit_plan")
    if plan is not None:
        return plan.style
    original = getattr(cls, "_normkit_original", None) or cls
    for torch_cls, style in _TORCH_STYLES.items():
        if issubclass(original, torch_cls) and original.forward is torch_cls.forward:
            return style
    if isinstance(cls_or_module, type) or original is not cls:
        styles = _CLASS_STYLES.get(original, set())
        return next(iter(styles)) if len(styles) == 1 else None
    if "forward" in cls_or_module.__dict__:
        return None
    found = _recognise(cls_or_module)
    return found.style if isinstance(found, _Plan) else None


def _eps_of(module) -> Optional[float]:
    """The eps a recognised (or torch) norm module computes with, read from the attribute its plan found."""
    plan = type(module).__dict__.get("_normkit_plan")
    if plan is None and not isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        found = _recognise(module)
        plan = found if isinstance(found, _Plan) else None
    return getattr(module, plan.eps_name if plan is not None and plan.eps_name else "eps", None)


# ----------------------------------------------------------------------------- recognising forwards by code
# timm's classes are matched by the bytecode of their forward against the reference forwards below
# (timm >= 1.0.15, verbatim), which are never run: the global names they read are timm's.

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


_UNKNOWN = ("its forward is not one normkit knows (torch's norms, timm's LayerNorm/LayerNorm2d/GroupNorm/RmsNorm, "
            "or a computation of normkit's styles: " + ", ".join(_STYLES) + ")")


def _classify(module: nn.Module):
    """(op, normkit forward, what it computes, plan or None) for a module normkit can stand in for
    exactly; else the reason it cannot as a string when the module is norm-like; else None."""
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
        return op, fwd, what, None
    subclass = None
    for torch_cls, op, fwd in _TORCH:
        if isinstance(module, torch_cls):
            if cls.forward is torch_cls.forward:
                return op, fwd, op, None
            subclass = torch_cls
            break
    found = _recognise(module)
    if isinstance(found, _Plan):
        return found.op, _recognised_forward, found.what, found
    if subclass is not None:
        return f"a torch.nn.{subclass.__name__} subclass with its own forward, which is not one normkit knows: {found}"
    if _norm_like(module):
        return f"{_UNKNOWN}: {found}"
    return None


# ----------------------------------------------------------------------------- the report

class PatchReport(dict):
    """What patch() did (or, with dry_run=True, would do): a dict {module name: original class} of
    the patched modules, plus .computes {name: what normkit computes for it}, .skipped {name: why a
    norm-like module was left alone}, .fused {block name: what normkit.blocks fused there},
    .unfused {block name: why a module holding a norm normkit knows was not fused} and .dry_run.
    str() is a summary grouped by class."""
    fused: dict = {}
    unfused: dict = {}

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
        for name, what in self.fused.items():
            groups.setdefault(("fused" if not self.dry_run else "would fuse", self._classes[name], what), []).append(name)
        for name, why in self.unfused.items():
            groups.setdefault(("left unfused", self._classes[name], "because " + why), []).append(name)
        for (what, cls_name, how), names in groups.items():
            shown = ", ".join(n or "(the model)" for n in names[:3])
            more = f", ... ({len(names) - 3} more)" if len(names) > 3 else ""
            lines += [f"  {what} {len(names)} {cls_name}: {shown}{more}", f"      {how}"]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- class swapping

_patched_classes: dict = {}


def _patched_class(original: type, forward: Callable, plan: Optional[_Plan] = None) -> type:
    """A subclass of `original` whose forward is normkit's; one per (class, forward, plan), reused."""
    key = (original, forward, plan)
    cls = _patched_classes.get(key)
    if cls is None:
        name = f"Normkit{original.__name__}"  # keeps "LayerNorm"/"RMSNorm" in the name: HF init checks it
        attrs = {"forward": forward, "_normkit_original": original, "__module__": __name__, "__qualname__": name}
        if plan is not None:
            attrs["_normkit_plan"] = plan
        cls = type(name, (original,), attrs)
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
        if isinstance(found, tuple) and any(op not in ops for op in found[0].split("+")):
            found = f"{found[0]} is not in ops={ops}"
        if isinstance(found, str):
            report.skipped[name] = found
            report._classes[name] = type(module).__name__
            continue
        original = type(module)
        report[name] = original
        report.computes[name] = found[2]
        if not dry_run:
            module.__class__ = _patched_class(original, found[1], found[3])
            module._normkit_backend = backend
    if fuse:
        report.unfused = {}
        report.fused = _BLOCKS.fuse(model, ops=ops, backend=backend, dry_run=dry_run, relaxed=fuse == "relaxed",
                                   unfused=report.unfused)
        report._classes.update({n: type(model.get_submodule(n)).__name__ for n in (*report.fused, *report.unfused)})
    return report


class _BlockFusions:
    """normkit.blocks's fuse and unfuse, which patch() and unpatch() call. blocks builds on this
    module (styles, eps, argument checks) and registers itself here when normkit is imported, so
    this module never imports it."""
    fuse = unfuse = None

    @classmethod
    def register(cls, fuse, unfuse) -> None:
        cls.fuse, cls.unfuse = staticmethod(fuse), staticmethod(unfuse)


_BLOCKS = _BlockFusions


def unpatch(model: nn.Module) -> dict[str, type]:
    """Undo patch(): give every patched module of `model` its original class back.
    Returns {module name: original class} of what it restored."""
    _check_model(model)
    _BLOCKS.unfuse(model)
    restored = {}
    for name, module in model.named_modules(remove_duplicate=True):
        original = getattr(type(module), "_normkit_original", None)
        if original is None:
            continue
        module.__class__ = original
        module.__dict__.pop("_normkit_backend", None)
        restored[name] = original
    return restored
