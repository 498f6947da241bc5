"""Fused points (issue 15): residual add + norm (with prenorm's h returned) and norm + float8 output,
for normkit and the peers' equivalents, as ops of the benchmark table (ops.OPS).

    rms+add, ln+add          y = norm(x + r)                       (x and the residual r are inputs)
    rms+add+pre, ln+add+pre  (y, h) = (norm(x + r), x + r)          (h: the new residual stream)
    rms+fp8, ln+fp8          y = float8_e4m3fn(norm(x) * scale)     (saturated; the backward passes
                                                                    dy through the cast)
    rms+fp8+amax             (y8, max |norm(x)|)                    (delayed scaling's statistic too;
                                                                    the amax takes no gradient)
Peers: torch (x + r, then F.rms_norm / F.layer_norm; the cast in torch ops), torch.compile of the
same, Liger's LigerFusedAddRMSNormFunction (RMSNorm + residual), quack's rmsnorm(residual=,
prenorm=) (RMSNorm + residual). The byte model counts what a perfect fused kernel moves: a
residual adds a read, prenorm a write (and the read of dh backward), an fp8 output is 1 byte.

    normkit bench --ops rms+add,rms+add+pre,ln+add+pre,rms+fp8 --suites fused-llm,fused-sweep --dtypes bf16
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import reference


class Unsupported(Exception):
    """This implementation does not do this op / dtype / direction; the message says why."""


FP8 = torch.float8_e4m3fn
FP8_SCALE = 8.0
FP8_TOL = 0.05  # float8_e4m3fn's own rounding: 2**-4 relative per element


@dataclass(frozen=True)
class Fusion:
    base: str  # "ln" or "rms"
    residual: bool = False
    prenorm: bool = False
    fp8: bool = False
    amax: bool = False  # also max |y| before the scale (forward output; no gradient)

    def outputs(self, direction: str) -> tuple:
        if direction == "fwd":
            return (("y", "h") if self.prenorm else ("y",)) + (("amax",) if self.amax else ())
        return ("dx", "dresidual", "dweight", "dbias") if self.residual else ("dx", "dweight", "dbias")


FUSIONS = {
    "rms+add": Fusion("rms", residual=True),
    "rms+add+pre": Fusion("rms", residual=True, prenorm=True),
    "ln+add": Fusion("ln", residual=True),
    "ln+add+pre": Fusion("ln", residual=True, prenorm=True),
    "rms+fp8": Fusion("rms", fp8=True),
    "ln+fp8": Fusion("ln", fp8=True),
    "rms+fp8+amax": Fusion("rms", fp8=True, amax=True),
}


def bytes_moved(p, direction: str) -> int:
    """What a perfect fused kernel moves: forward reads x (and r), writes y (and h); backward reads
    h, dy (and dh), writes dx, which is also the residual's gradient (one tensor for both)."""
    f, e = p.spec.fusion, p.torch_dtype.itemsize
    y_bytes = 1 if f.fp8 else e
    if direction == "fwd":
        per = e + y_bytes + (e if f.residual else 0) + (e if f.prenorm else 0)
    else:
        per = e + y_bytes + e + (e if f.prenorm else 0)
    return p.numel * per


def tol(p, base_tol: float) -> float:
    """The point's tolerance against the oracle: an fp8 output is bounded by its own rounding."""
    return FP8_TOL if p.spec.fusion is not None and p.spec.fusion.fp8 else base_tol


# ----------------------------------------------------------------------------- the oracle

def _norm64(p, x, w, b, r):
    f, n = p.spec.fusion, (p.shape[-1],)
    if f.base == "ln":
        return reference.layer_norm(x, n, w, b, p.spec.eps, residual=r)[0]
    return reference.rms_norm(x, n, w, p.spec.eps, residual=r)[0]


def oracle_fwd(p, x, w, b, r=None):
    f = p.spec.fusion
    y = _norm64(p, x, w, b, r)
    if f.fp8:
        return (reference.output_value(y, FP8, FP8_SCALE),) + ((reference.amax(y),) if f.amax else ())
    return (y, reference.residual_sum(x, r)) if f.prenorm else (y,)


def oracle_bwd(p, dy, x, w, b, r=None, dh=None):
    """float64 gradients, in the order of Fusion.outputs("bwd")."""
    f = p.spec.fusion
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in (x, r, w, b) if t is not None]
    it = iter(leaves)
    x64, r64 = next(it), (next(it) if r is not None else None)
    w64, b64 = next(it), (next(it) if b is not None else None)
    outs, grads = [_norm64(p, x64, w64, b64, r64)], [dy.to(torch.float64)]
    if f.prenorm:
        outs.append(reference.residual_sum(x64, r64))
        grads.append(dh.to(torch.float64))
    g = list(torch.autograd.grad(outs, leaves, grads))
    return tuple(g) + (None,) * (len(f.outputs("bwd")) - len(g))


# ----------------------------------------------------------------------------- implementations
# Every call is f(x, w, b, r) (r only with a residual) and returns y, or (y, h) with prenorm.

def normkit_call(p, backend: Optional[str]):
    import normkit
    f, n, eps = p.spec.fusion, p.shape[-1], p.spec.eps
    kw = dict(backend=backend, prenorm=f.prenorm)
    if f.fp8:
        kw.update(out_dtype=FP8, out_scale=FP8_SCALE, return_amax=f.amax)
    if f.base == "ln":
        return lambda x, w, b, r=None: normkit.layer_norm(x, n, w, b, eps, residual=r, **kw)
    return lambda x, w, b, r=None: normkit.rms_norm(x, n, w, eps, residual=r, **kw)


def torch_call(p):
    """x + r, then torch's norm, then the cast: what a model does without fusion (and what
    torch.compile gets to fuse)."""
    F = torch.nn.functional
    f, n, eps = p.spec.fusion, (p.shape[-1],), p.spec.eps
    norm = (lambda h, w, b: F.layer_norm(h, n, w, b, eps)) if f.base == "ln" else \
        (lambda h, w, b: F.rms_norm(h, n, w, eps))

    def call(x, w, b, r=None):
        h = x + r if r is not None else x
        y = norm(h, w, b)
        amax = ()
        if f.fp8:  # the scale is invisible to autograd, as normkit's (and TransformerEngine's) cast is
            z = y.float()
            amax = (z.detach().abs().amax(),) if f.amax else ()
            y = (z + (z * (FP8_SCALE - 1)).detach()).clamp(-448.0, 448.0).to(FP8)
        out = (y, h) if f.prenorm else (y,)
        return out + amax if len(out + amax) > 1 else y
    return call


def _rms_residual_only(p, what: str):
    if p.spec.fusion.base != "rms" or not p.spec.fusion.residual:
        raise Unsupported(f"it fuses the residual add into RMSNorm only ({what})")
    return p.spec.fusion


def liger_call(p):
    f = _rms_residual_only(p, "LigerFusedAddRMSNorm")
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    eps = p.spec.eps

    def call(x, w, b, r=None):
        y, h = LigerFusedAddRMSNormFunction.apply(x, r, w, eps)
        return (y, h) if f.prenorm else y
    return call


def quack_call(p):
    f = _rms_residual_only(p, "rmsnorm(residual=, prenorm=)")
    from quack.rmsnorm import rmsnorm
    eps = p.spec.eps
    return lambda x, w, b, r=None: rmsnorm(x, w, residual=r, eps=eps, prenorm=f.prenorm)


# ----------------------------------------------------------------------------- registration

def register(ops_module) -> None:
    """Add the fused ops and their suites to the benchmark tables in ops.py."""
    OpSpec, Suite = ops_module.OpSpec, ops_module.Suite
    base = ops_module.OPS
    titles = {"rms": "RMSNorm", "ln": "LayerNorm"}
    for name, f in FUSIONS.items():
        b = base[f.base]
        title = titles[f.base] + ("(x + r)" if f.residual else "") + (" -> (y, h)" if f.prenorm else "") + \
            (" -> fp8" if f.fp8 else "")
        ops_module.OPS[name] = OpSpec(name, title, b.eps, b.has_bias, None, b.param_shape, b.rows_cols,
                                      oracle_fwd, oracle_bwd, b.sweep, b.tiny, fusion=f)
    names = tuple(FUSIONS)
    # decoder hidden states: 16384 tokens (e.g. 4 x 4096) at the hidden sizes of 1B-70B models
    llm = tuple(((16384, n), None) for n in (2048, 3072, 4096, 5120, 8192))
    ops_module.SUITES["fused-llm"] = Suite("fused-llm", names, None, llm,
                                           "fused ops at decoder shapes: 16384 tokens x hidden 2048-8192")
    ops_module.SUITES["fused-sweep"] = Suite("fused-sweep", names, None, None, "fused ops over the width sweep")
