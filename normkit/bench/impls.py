"""The timed implementations: normkit (any backend) and the peers, behind one small interface.

An implementation says why it cannot run here (`why_unavailable`, None when it can), and builds
for one point a callable f(x, weight, bias) -> y that autograd can differentiate. It raises
Unsupported (with the reason) for an op, dtype or direction it does not do. Peers are imported
only inside these methods, so `normkit bench --help` stays light and a missing peer is a skip
reason, never an import error.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Optional

import torch

from .fused import Unsupported  # noqa: F401  (the runner imports it from here)
from .ops import Point


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def _activation(name: Optional[str]):
    F = torch.nn.functional
    table = {None: lambda y: y, "relu": F.relu, "silu": F.silu, "mish": F.mish, "gelu": F.gelu,
             "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
    return table[name]


def torch_call(p: Point):
    """The plain torch functional call for p's op (torch eager, and what torch.compile compiles)."""
    if p.spec.fusion is not None:  # x + r, the norm, the cast as separate torch ops
        from .fused import torch_call as fused_torch_call
        return fused_torch_call(p)
    F = torch.nn.functional
    eps, n = p.spec.eps, p.shape[-1]
    if p.op == "ln":
        return lambda x, w, b: F.layer_norm(x, (n,), w, b, eps)
    if p.op == "rms":
        return lambda x, w, b: F.rms_norm(x, (n,), w, eps)
    if p.op == "gn":
        act = _activation(p.spec.activation)
        return lambda x, w, b: act(F.group_norm(x, p.groups, w, b, eps))
    raise Unsupported(f"torch has no call for op {p.op!r}")


class Impl:
    name = "?"
    is_normkit = False

    def why_unavailable(self, device: str) -> Optional[str]:
        return None

    def build(self, p: Point, direction: str):
        raise NotImplementedError

    def param_dtype(self, p: Point) -> Optional[torch.dtype]:
        """dtype this implementation wants its weight/bias in; None: x's dtype."""
        return None

    def note(self, p: Point, direction: str) -> str:
        """A fixed remark for the report, e.g. a non-default mode the call runs in."""
        return ""

    def after_first_call(self) -> Optional[str]:
        """After the first (untimed) call: None, or why the timed numbers would not mean what they say."""
        return None


class Normkit(Impl):
    is_normkit = True

    def __init__(self, backend: Optional[str] = None):
        self.backend = backend
        self.name = "normkit" if backend is None else f"normkit[{backend}]"

    def why_unavailable(self, device):
        from .. import backends
        if self.backend is None:
            return None
        try:
            mod = backends.get(self.backend)
        except (ValueError, backends.BackendUnavailableError) as e:
            return str(e)
        return mod.why_unavailable(torch.empty(1, device=device))

    def resolved_backend(self, p: Point, device) -> str:
        """The backend that runs p (backend=None picks one per device and dtype), or Unsupported."""
        from .. import backends
        probe = torch.empty(1, dtype=p.torch_dtype, device=device)
        try:
            return backends.resolve(self.backend, probe, p.op).NAME
        except backends.BackendUnavailableError as e:
            raise Unsupported(str(e)) from None

    def build(self, p, direction):
        import normkit
        if p.spec.fusion is not None:
            from .fused import normkit_call
            return normkit_call(p, self.backend)
        eps, n, be = p.spec.eps, p.shape[-1], self.backend
        if p.op == "ln":
            return lambda x, w, b: normkit.layer_norm(x, (n,), w, b, eps, backend=be)
        if p.op == "rms":
            return lambda x, w, b: normkit.rms_norm(x, (n,), w, eps, backend=be)
        if p.op == "gn":
            gn = getattr(normkit, "group_norm", None)
            if gn is None:
                raise Unsupported("normkit.group_norm does not exist yet")
            return lambda x, w, b: gn(x, p.groups, w, b, eps, activation=p.spec.activation, backend=be)
        raise Unsupported(f"normkit has no op {p.op!r}")


class Torch(Impl):
    name = "torch"

    def build(self, p, direction):
        return torch_call(p)


# Dynamo gives up after `recompile_limit` recompiles of one function and then silently runs eager,
# which would time eager under the name of compile: every compiled timing raises the limits, resets
# dynamo, and checks afterwards that the compiled-graph counter moved (shared with bench/models.py)
DYNAMO_LIMITS = {"recompile_limit": 1024, "cache_size_limit": 1024,
                 "accumulated_recompile_limit": 4096, "accumulated_cache_size_limit": 4096}


def fresh_dynamo() -> tuple[int, int]:
    """Reset dynamo, raise its recompile limits; returns dynamo_counts() to compare with later."""
    import torch._dynamo
    torch._dynamo.reset()
    for attr, value in DYNAMO_LIMITS.items():
        if hasattr(torch._dynamo.config, attr):
            setattr(torch._dynamo.config, attr, max(getattr(torch._dynamo.config, attr), value))
    return dynamo_counts()


def dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) since the process started."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compiled_path_problem(before: tuple[int, int]) -> Optional[str]:
    """None when a graph was compiled since `before` without graph breaks, else what went wrong."""
    graphs, breaks = dynamo_counts()
    if graphs <= before[0]:
        return "the compiled path did not run (dynamo compiled no graph): these are eager timings"
    if breaks > before[1]:
        return f"{breaks - before[1]} dynamo graph break(s): part of the call ran eager"
    return None


class Compile(Impl):
    """torch.compile(dynamic=False) of the torch call, compiled afresh for every point (see
    DYNAMO_LIMITS for why)."""
    name = "compile"

    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        self._before = (0, 0)  # (compiled graphs, graph breaks) before this point's first call

    def why_unavailable(self, device):
        if device != "cuda":
            return "timed on CUDA GPUs only: inductor's CPU compile takes tens of seconds per shape"
        return None

    def build(self, p, direction):
        self._before = fresh_dynamo()
        return torch.compile(torch_call(p), dynamic=False, backend=self.backend)

    def after_first_call(self):
        return compiled_path_problem(self._before)


class _PeerOnGpu(Impl):
    """A peer library that needs a CUDA GPU and may not be installed."""
    module = "?"  # what to import
    dist = "?"  # what to pip install

    def why_unavailable(self, device):
        if importlib.util.find_spec(self.module) is None:
            return f"not installed ({self.module} is not importable; pip install {self.dist})"
        if device != "cuda":
            return "needs a CUDA GPU"
        try:
            self._import()
        except Exception as e:  # a broken install is a skip reason, not a crash
            return f"import failed: {first_line(e)}"
        return None

    def _import(self):
        raise NotImplementedError


class Liger(_PeerOnGpu):
    name = "liger"
    dist = "liger-kernel"
    module = "liger_kernel"

    def _import(self):
        importlib.import_module("liger_kernel.ops.layer_norm")
        importlib.import_module("liger_kernel.ops.rms_norm")

    def note(self, p, direction):
        return "in_place=True: dx overwrites dy (Liger's default)" if p.op == "rms" and direction == "bwd" else ""

    def build(self, p, direction):
        if p.spec.fusion is not None:
            from .fused import liger_call
            return liger_call(p)
        eps = p.spec.eps
        if p.op == "ln":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, eps)
        if p.op == "rms":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            return lambda x, w, b: LigerRMSNormFunction.apply(x, w, eps)
        if p.op == "gn":
            from liger_kernel.ops.group_norm import LigerGroupNormFunction
            act = _activation(p.spec.activation)
            c = p.shape[1]
            return lambda x, w, b: act(LigerGroupNormFunction.apply(x, w, b, c, p.groups, eps))
        raise Unsupported(f"Liger has no op {p.op!r}")


class Quack(_PeerOnGpu):
    name = "quack"
    dist = "quack-kernels"
    module = "quack"

    def _import(self):
        importlib.import_module("quack.rmsnorm")

    def param_dtype(self, p):
        return torch.float32 if p.op == "ln" else None  # quack's layernorm_fwd asserts fp32 weights

    def note(self, p, direction):
        if p.op == "ln" and direction == "bwd":
            return "quack.rmsnorm.layernorm_bwd in normkit's autograd wrapper (quack ships none for LN)"
        return ""

    def build(self, p, direction):
        if p.spec.fusion is not None:
            from .fused import quack_call
            return quack_call(p)
        eps = p.spec.eps
        if p.op == "rms":
            from quack.rmsnorm import rmsnorm
            return lambda x, w, b: rmsnorm(x, w, eps=eps)
        if p.op == "ln":
            fn = _quack_layer_norm_function()
            return lambda x, w, b: fn.apply(x, w, b, eps)
        raise Unsupported(f"quack has no {p.spec.title}")


@functools.lru_cache(maxsize=None)
def _quack_layer_norm_function():
    """quack 0.6.5 has LayerNorm forward and backward kernels but no autograd.Function for them."""
    from quack.rmsnorm import layernorm_bwd, layernorm_fwd

    class QuackLayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b, eps):
            if not any(ctx.needs_input_grad[:3]):  # forward-only timing: no statistics to store
                return layernorm_fwd(x, w, b, eps)
            y, rstd, mean = layernorm_fwd(x, w, b, eps, return_rstd=True, return_mean=True)
            ctx.save_for_backward(x, w, rstd, mean)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, rstd, mean = ctx.saved_tensors
            dx, dw, db = layernorm_bwd(x, w, dy.contiguous(), rstd, mean, has_bias=True)
            return dx, dw, db, None

    return QuackLayerNorm


PEERS = {"torch": Torch, "compile": Compile, "liger": Liger, "quack": Quack}


def make(normkit_backends, peers) -> list[Impl]:
    """normkit_backends: names, "auto" meaning backend=None; peers: names in PEERS."""
    impls = [Normkit(None if b == "auto" else b) for b in normkit_backends]
    return impls + [PEERS[name]() for name in peers]
