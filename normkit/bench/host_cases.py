"""Host cost per call of the calls real models make beyond the plain norm (issue 22): each fused
option and each layout normkit reads in place, against what torch runs for the same result
unfused (x + r then the norm, the norm then the weight offset, the cast to float8, GroupNorm then
SiLU, ...). Tiny decode-like inputs, so the GPU is never the bottleneck: the time is the host's.

    normkit bench --host-only --host-cases all      # only these rows (and the plain ops' host rows)

Each case gives both calls on the same inputs; "fwd" runs without autograd, "fwd+bwd" asks for the
gradients of every differentiable output with respect to every input that takes one. Rows go into
host.csv (impl "normkit" or "torch") and the summary's host-cases table (normkit / torch).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .timing import host_overheads

DTYPE = torch.bfloat16
B, T, C = 1, 16, 1024  # decode-like: 16 tokens of a 1024-wide model
H, D = 8, 64  # heads x head_dim of the q/k norms
FP8, FP8_SCALE = torch.float8_e4m3fn, 4.0
# the modulated and gated norms at their models' sizes (issue 22 with 23's options): DiT-XL/2's
# adaLN LayerNorm (256 latent tokens of width 1152, weightless, eps 1e-6) and a Mamba-2 gated
# RMSNorm (width 4096 in 8 groups, the groups as per-head weights); at these sizes the GPU's time
# per call may exceed the host's, and the loop then measures the GPU (see the latency column too)
DIT_B, DIT_T, DIT_C = 8, 256, 1152
MAMBA_B, MAMBA_T, MAMBA_C, MAMBA_G = 8, 512, 4096, 8
# wide rows: on sm_90 16-bit rows from 64K run the CUDA backend's thread-block cluster kernels, which
# the C++ host path replays as plan launches with a cluster shape (cuLaunchKernelEx)
WIDE_M, WIDE_N = 4, 131072


@dataclass
class HostRow:
    op: str
    dtype: str
    shape: str
    impl: str
    device: str
    mode: str  # "fwd" or "fwd+bwd"
    us_per_call: Optional[float] = None
    latency_us: Optional[float] = None
    note: str = ""  # one host-time row (host.csv): the plain ops' and these cases'


@dataclass(frozen=True)
class HostCase:
    title: str
    inputs: Callable  # device -> tensors (leaves; the calls make any view of them)
    normkit: Callable  # (*inputs) -> output(s)
    torch: Callable  # (*inputs) -> the same output(s), unfused
    grads: bool = True  # fwd+bwd measured (float8 outputs: forward only)


def _t(device, *shape):
    return torch.randn(shape, device=device, dtype=DTYPE)


def _nk():
    import normkit
    return normkit


def _torch_fp8(y):
    return (y.float() * FP8_SCALE).clamp(-448.0, 448.0).to(FP8)


def _torch_modulated(x, scale, shift):
    """DiT's unfused adaLN: the weightless norm, then * (1 + scale) + shift per sample."""
    return F.layer_norm(x, (DIT_C,), None, None, 1e-6) * (1 + scale[:, None]) + shift[:, None]


def _grouped(t):
    return t.view(MAMBA_B, MAMBA_T, MAMBA_G, MAMBA_C // MAMBA_G)


def _torch_gated(x, g, w):
    """The gated norm unfused: x * silu(gate), then RMSNorm per group, times the group's weight."""
    return F.rms_norm(_grouped(x * F.silu(g)), (MAMBA_C // MAMBA_G,), None, 1e-5) * w


CASES = {
    "ln column-strided rows": HostCase(  # Whisper's [B, T, C] with strides (T*C, 1, T)
        "LayerNorm of x.transpose(1, 2) ([B, C, T] stored)",
        lambda d: (_t(d, B, C, T), _t(d, C), _t(d, C)),
        lambda xt, w, b: _nk().layer_norm(xt.transpose(1, 2), C, w, b),
        lambda xt, w, b: F.layer_norm(xt.transpose(1, 2), (C,), w, b)),
    "rms+add+pre": HostCase(  # HF Llama's residual add through normkit's fused block
        "RMSNorm(x + r) -> (y, h)", lambda d: (_t(d, B, T, C), _t(d, C), _t(d, B, T, C)),
        lambda x, w, r: _nk().rms_norm(x, C, w, 1e-6, residual=r, prenorm=True),
        lambda x, w, r: (lambda h: (F.rms_norm(h, (C,), w, 1e-6), h))(x + r)),
    "rms weight_offset": HostCase(  # Gemma: x_hat * (1 + w)
        "RMSNorm, weight_offset=1.0", lambda d: (_t(d, B, T, C), _t(d, C)),
        lambda x, w: _nk().rms_norm(x, C, w, 1e-6, weight_offset=1.0),
        lambda x, w: F.rms_norm(x, (C,), None, 1e-6) * (1.0 + w)),
    "rms q head rows": HostCase(  # q of a fused QKV projection, normalized per head in place
        "RMSNorm of qkv[..., :H*D].view(B, T, H, D)", lambda d: (_t(d, B, T, 3 * H * D), _t(d, D)),
        lambda qkv, w: _nk().rms_norm(qkv[..., :H * D].view(B, T, H, D), D, w, 1e-6),
        lambda qkv, w: F.rms_norm(qkv[..., :H * D].view(B, T, H, D), (D,), w, 1e-6)),
    "rms fp8 out": HostCase(
        "RMSNorm -> float8_e4m3fn * scale", lambda d: (_t(d, B, T, C), _t(d, C)),
        lambda x, w: _nk().rms_norm(x, C, w, 1e-6, out_dtype=FP8, out_scale=FP8_SCALE),
        lambda x, w: _torch_fp8(F.rms_norm(x, (C,), w, 1e-6)), grads=False),
    "gn weight is bias": HostCase(
        "GroupNorm(32) with weight and bias one tensor", lambda d: (_t(d, 1, 320, 8, 8), _t(d, 320)),
        lambda x, w: _nk().group_norm(x, 32, w, w),
        lambda x, w: F.group_norm(x, 32, w, w)),
    "gn+silu": HostCase(  # SD-1.5's ResNet blocks, channels_last
        "GroupNorm(32) + SiLU, channels_last",
        lambda d: (_t(d, 1, 320, 8, 8).to(memory_format=torch.channels_last), _t(d, 320), _t(d, 320)),
        lambda x, w, b: _nk().group_norm(x, 32, w, b, activation="silu"),
        lambda x, w, b: F.silu(F.group_norm(x, 32, w, b))),
    "ln adaLN modulation": HostCase(
        f"weightless LayerNorm * (1 + scale) + shift, x ({DIT_B}, {DIT_T}, {DIT_C}), tables ({DIT_B}, {DIT_C})",
        lambda d: (_t(d, DIT_B, DIT_T, DIT_C), _t(d, DIT_B, DIT_C), _t(d, DIT_B, DIT_C)),
        lambda x, scale, shift: _nk().layer_norm(x, DIT_C, None, None, 1e-6, scale=scale, shift=shift),
        _torch_modulated),
    "rms gated groups": HostCase(
        f"RMSNorm(x * silu(gate)) in {MAMBA_G} groups, x and gate ({MAMBA_B}, {MAMBA_T}, {MAMBA_C})",
        lambda d: (_t(d, MAMBA_B, MAMBA_T, MAMBA_C), _t(d, MAMBA_B, MAMBA_T, MAMBA_C),
                   _t(d, MAMBA_G, MAMBA_C // MAMBA_G)),
        lambda x, g, w: _nk().rms_norm(_grouped(x), MAMBA_C // MAMBA_G, w, 1e-5, gate=_grouped(g)),
        _torch_gated),
    "ln wide rows": HostCase(
        f"LayerNorm of ({WIDE_M}, {WIDE_N}) rows (cluster kernels on sm_90)",
        lambda d: (_t(d, WIDE_M, WIDE_N), _t(d, WIDE_N), _t(d, WIDE_N)),
        lambda x, w, b: _nk().layer_norm(x, WIDE_N, w, b),
        lambda x, w, b: F.layer_norm(x, (WIDE_N,), w, b)),
    "rms wide rows": HostCase(
        f"RMSNorm of ({WIDE_M}, {WIDE_N}) rows (cluster kernels on sm_90)",
        lambda d: (_t(d, WIDE_M, WIDE_N), _t(d, WIDE_N)),
        lambda x, w: _nk().rms_norm(x, WIDE_N, w, 1e-6),
        lambda x, w: F.rms_norm(x, (WIDE_N,), w, 1e-6)),
    "ln autocast": HostCase(
        "LayerNorm under bf16 autocast (float32 out)", lambda d: (_t(d, B, T, C), _t(d, C), _t(d, C)),
        lambda x, w, b: _autocast(_nk().layer_norm, x, C, w, b),
        lambda x, w, b: _autocast(F.layer_norm, x, (C,), w, b)),
}


def _autocast(fn, *args):
    with torch.autocast("cuda", dtype=DTYPE):
        return fn(*args)


def _host_stats() -> dict:
    from .. import _host
    return _host.stats()


def _served(before: dict, after: dict, calls: int) -> str:
    """What ran the timed calls: plan replays and Python runs of the C++ host path, per call."""
    if not after or not calls:
        return "Python host path (the C++ one is not active)"
    per = lambda k: (after[k] - before[k]) / calls  # noqa: E731
    return f"per call: {per('replays'):.2g} plan replays, {per('python_runs'):.2g} Python runs"


def _call(fn, inputs, mode: str, calls: list):
    calls.append(1)
    if mode == "fwd":
        with torch.no_grad():
            return fn(*inputs)
    out = fn(*inputs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
    return torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs])


def run(names, timer, device: str) -> list[HostRow]:
    """Rows for the cases `names`, each by normkit and by torch, forward and forward + backward; the
    two take turns (timing.host_overheads), so they are compared under the same host drift."""
    rows = []
    for name in names:
        case = CASES[name]
        for mode in ("fwd", "fwd+bwd"):
            pair = {impl: HostRow(name, "bf16", case.title, impl, device, mode) for impl in ("normkit", "torch")}
            if mode != "fwd" and not case.grads:
                for row in pair.values():
                    row.note = "forward only (float8 output)"
                rows += pair.values()
                continue
            calls, counted = {}, []
            for impl, row in pair.items():
                try:
                    inputs = tuple(t.requires_grad_(mode != "fwd") for t in case.inputs(device))
                    fn = case.normkit if impl == "normkit" else case.torch
                    call = functools.partial(_call, fn, inputs, mode, counted if impl == "normkit" else [])
                    call()
                    call()  # a key's first call runs the Python host function, its second records the plan
                    calls[impl] = call
                except Exception as e:  # noqa: BLE001 - a row that says why
                    row.note = _error(e)
            before, counted[:] = _host_stats(), []
            try:
                for impl, (us, lat) in host_overheads(calls, timer.sync).items():
                    pair[impl].us_per_call, pair[impl].latency_us = us, lat
                if "normkit" in calls:
                    pair["normkit"].note = _served(before, _host_stats(), len(counted))
            except Exception as e:  # noqa: BLE001
                for impl in calls:
                    pair[impl].note = _error(e)
            rows += pair.values()
    return rows


def _error(e: Exception) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def section(host_rows: list[HostRow]) -> list[str]:
    """The summary's table: normkit vs torch's unfused sequence per case and mode."""
    got = {(h.op, h.mode, h.impl): h.us_per_call for h in host_rows if h.op in CASES}
    if not got:
        return []
    body = []
    for name, case in CASES.items():
        for mode in ("fwd", "fwd+bwd"):
            nk, pt = got.get((name, mode, "normkit")), got.get((name, mode, "torch"))
            if nk is None and pt is None:
                continue
            ratio = f"{nk / pt:.2f}" if nk and pt else ""
            body.append([name, case.title, mode, f"{nk:.1f}" if nk else "", f"{pt:.1f}" if pt else "", ratio])
    return ["## Host cost of fused options and strided layouts (us per call; torch: its unfused sequence)", "",
            "| case | call | mode | normkit | torch | normkit / torch |", "| --- | --- | --- | --- | --- | --- |"] + \
        ["| " + " | ".join(r) + " |" for r in body]
