"""Running points: inputs, the float64 oracle, and every implementation checked then timed.

For each point and direction, every implementation runs once untimed on input set 0 (that
first call compiles what it needs, and its output is compared with the float64 oracle on the
same inputs), then is timed on the same inputs. Backward is timed as
torch.autograd.grad(y, (x, weight[, bias]), dy) on a y built once outside the timing, so the
time is dx plus the weight/bias gradient reductions and never includes the forward.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import reference
from . import bytemodel, fused
from .impls import Unsupported, first_line
from .ops import TOL, OPS, Point
from .report import HostRow, Row
from .timing import host_overheads

RING_L2_FACTOR = 4  # the input sets a timing rotates through total at least this many L2 sizes
MAX_RING = 64


@dataclass
class Settings:
    device: str
    warmup_ms: float
    rep_ms: float
    copy_gbps: Optional[float] = None
    l2_bytes: int = 0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """normkit.reference.rel_err, computed where the tensors live when everything is finite:
    moving hundreds of MiB to the host per check would dominate a GPU sweep."""
    if out.is_cuda and ref.device == out.device and out.shape == ref.shape:
        o = out.detach().to(torch.float64)
        if bool(torch.isfinite(o).all()) and bool(torch.isfinite(ref).all()):
            den = torch.linalg.vector_norm(ref).item()
            if den > 0:
                return torch.linalg.vector_norm(o - ref).item() / den
    return reference.rel_err(out, ref)


def point_bytes(p: Point, direction: str) -> int:
    """The byte model of a point: the fused ops count their extra (or fewer) bytes."""
    if p.spec.fusion is not None:
        return fused.bytes_moved(p, direction)
    return bytemodel.bytes_moved(p.numel, p.torch_dtype.itemsize, direction)


def ring_size(p: Point, direction: str, l2_bytes: int) -> int:
    per_set = point_bytes(p, direction)
    return max(1, min(MAX_RING, math.ceil(RING_L2_FACTOR * l2_bytes / max(per_set, 1))))


class Case:
    """The inputs of one point and direction: `ring` sets of x (and dy), one set of weight/bias
    values, and the float64 oracle on set 0, computed once."""

    def __init__(self, p: Point, direction: str, device: str, ring: int, seed: int):
        self.point, self.direction = p, direction
        gen = torch.Generator(device=device).manual_seed(seed)
        dt = p.torch_dtype

        def randn(shape):  # fresh data, never zeros; made in fp32 and rounded, as the tests do
            t = torch.randn(shape, generator=gen, dtype=torch.float32, device=device).to(dt)
            return t.to(memory_format=torch.channels_last) if p.channels_last else t

        grad = direction == "bwd"
        fusion = p.spec.fusion
        self.xs = [randn(p.shape).requires_grad_(grad) for _ in range(ring)]
        # fused ops: a residual per input set; the gradient of h; dy in the output's dtype (fp8)
        self.rs = [randn(p.shape).requires_grad_(grad) for _ in range(ring)] if fusion and fusion.residual else []
        pshape = p.spec.param_shape(p)
        self.w = (1 + 0.1 * torch.randn(pshape, generator=gen, device=device)).to(dt)
        self.b = (0.1 * torch.randn(pshape, generator=gen, device=device)).to(dt) if p.spec.has_bias else None
        self.dys = [randn(p.shape) for _ in range(ring)] if grad else []
        if grad and fusion and fusion.fp8:
            self.dys = [dy.to(fused.FP8) for dy in self.dys]
        self.dhs = [randn(p.shape) for _ in range(ring)] if grad and fusion and fusion.prenorm else []
        self._dys_kept = [dy.clone() for dy in self.dys]  # Liger's RMSNorm writes dx into dy
        self._oracle = None

    def params(self, dtype: Optional[torch.dtype]):
        """Fresh weight/bias leaves, in `dtype` (None: x's dtype); same values for everyone."""
        grad = self.direction == "bwd"
        conv = lambda t: None if t is None else t.to(dtype or t.dtype).detach().requires_grad_(grad)
        return conv(self.w), conv(self.b)

    def restore_dy(self):
        """Undo what an implementation that overwrites its incoming gradient did to dy."""
        for dy, kept in zip(self.dys, self._dys_kept):
            dy.copy_(kept)

    def oracle(self) -> tuple:
        """float64 references on set 0: (y,) forward, (dx, dweight, dbias or None) backward (the
        fused ops: fused.Fusion.outputs)."""
        if self._oracle is None:
            p, spec, x = self.point, self.point.spec, self.xs[0].detach()
            if spec.fusion is not None:
                extra = tuple(t[0].detach() for t in (self.rs, self.dhs) if t)
                if self.direction == "fwd":
                    self._oracle = spec.oracle_fwd(p, x, self.w, self.b, *extra[:1])
                else:
                    self._oracle = spec.oracle_bwd(p, self._dys_kept[0], x, self.w, self.b, *extra)
            elif self.direction == "fwd":
                self._oracle = (spec.oracle_fwd(p, x, self.w, self.b),)
            else:
                self._oracle = tuple(spec.oracle_bwd(p, self._dys_kept[0], x, self.w, self.b))
        return self._oracle

    def check(self, outputs) -> tuple[float, str]:
        """(largest relative error over the outputs, the name of the worst one)."""
        fusion = self.point.spec.fusion
        names = fusion.outputs(self.direction) if fusion is not None else \
            ("y",) if self.direction == "fwd" else ("dx", "dweight", "dbias")
        worst, worst_name = 0.0, ""
        for name, out, ref in zip(names, outputs, self.oracle()):
            if ref is None:
                continue
            err = math.inf if out is None else rel_err(out, ref)
            if err > worst or not worst_name:
                worst, worst_name = err, name
        return worst, worst_name

    def leaves(self, s: int, w, b) -> tuple:
        return (self.xs[s],) + ((self.rs[s],) if self.rs else ()) + (w,) + ((b,) if b is not None else ())

    def call(self, fn, s: int, w, b):
        """fn on input set s: fn(x, w, b), with the residual as a fourth argument for fused ops."""
        return fn(self.xs[s], w, b, *((self.rs[s],) if self.rs else ()))

    def grad_args(self, fn, s: int, w, b) -> tuple:
        """(outputs, leaves, their gradients) for torch.autograd.grad of a call on set s."""
        y = self.call(fn, s, w, b)
        grads = [self.dys[s]] + ([self.dhs[s]] if self.dhs else [])
        outs = (list(y) if isinstance(y, tuple) else [y])[:len(grads)]  # an amax output takes no gradient
        return outs, self.leaves(s, w, b), grads

    def first_call(self, fn, w, b) -> tuple:
        """The untimed first call on set 0; returns what check() compares."""
        if self.direction == "fwd":
            y = self.call(fn, 0, w, b)
            return y if isinstance(y, tuple) else (y,)
        self.restore_dy()
        grads = torch.autograd.grad(*self.grad_args(fn, 0, w, b), retain_graph=True)
        return _pad(grads, len(self.oracle()))

    def timed_calls(self, fn, w, b) -> list[Callable]:
        """One zero-argument call per input set; backward calls reuse a y built here, untimed."""
        if self.direction == "fwd":
            return [functools.partial(self.call, fn, s, w, b) for s in range(len(self.xs))]
        return [functools.partial(torch.autograd.grad, *self.grad_args(fn, s, w, b), retain_graph=True)
                for s in range(len(self.xs))]


def _pad(grads: tuple, n: int = 3) -> tuple:
    """(dx, [dresidual,] dweight, dbias) from autograd's gradients (no dbias without a bias)."""
    return tuple(grads) + (None,) * (n - len(grads))


def _base_row(p: Point, direction: str, impl, device: str) -> Row:
    m, n = p.rows_cols
    return Row(p.suite, p.op, direction, p.dtype, m, n, p.label, impl.name, device)


def run_impl(impl, case: Case, timer, s: Settings) -> Row:
    p, d = case.point, case.direction
    row = _base_row(p, d, impl, s.device)
    notes = [impl.note(p, d)]
    try:
        if impl.is_normkit:
            notes.append(f"backend {impl.resolved_backend(p, s.device)}")
        fn = impl.build(p, d)
    except Unsupported as e:
        row.note = f"unsupported: {e}"
        return row
    except Exception as e:  # noqa: BLE001 - one implementation failing must not stop the sweep
        row.note = f"error: {first_line(e)}"
        return row
    calls = None
    try:
        w, b = case.params(impl.param_dtype(p))
        t0 = time.perf_counter()
        outputs = case.first_call(fn, w, b)
        timer.sync()
        row.first_call_s = time.perf_counter() - t0
        notes.append(impl.after_first_call() or "")
        err, which = case.check(outputs)
        del outputs
        row.rel_err, row.tol = err, fused.tol(p, TOL[p.dtype])
        row.ok = "yes" if err <= row.tol else "no"
        if row.ok == "no":
            notes.append(f"worst output: {which}")
        calls = case.timed_calls(fn, w, b)
        row.time_ms, row.reps = timer.median_ms(calls, s.warmup_ms, s.rep_ms)
        row.gbps = bytemodel.gbps(point_bytes(p, d), row.time_ms)
        row.copy_gbps = s.copy_gbps
    except Exception as e:  # noqa: BLE001
        row.time_ms = row.gbps = None
        if row.ok == "yes":
            row.ok = ""
        notes.insert(0, f"error: {first_line(e)}")
    finally:
        del calls
    row.note = "; ".join(n for n in notes if n)
    return row


def run_task(p: Point, direction: str, impls, timer, s: Settings, seed: int) -> list[Row]:
    ring = ring_size(p, direction, s.l2_bytes) if s.device == "cuda" else 1
    try:
        case = Case(p, direction, s.device, ring, seed)
        case.oracle()
    except Exception as e:  # noqa: BLE001 - e.g. out of memory for this point's inputs
        rows = [_base_row(p, direction, impl, s.device) for impl in impls]
        for r in rows:
            r.note = f"error: building inputs or the oracle: {first_line(e)}"
        return rows
    try:
        return [run_impl(impl, case, timer, s) for impl in impls]
    finally:
        del case
        if s.device == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- host overhead

HOST_MODES = ("fwd", "fwd+bwd")
HOST_DTYPE = "bf16"


def run_host(ops, impls, timer, device: str) -> list[HostRow]:
    """Microseconds per call and single-call latency of every implementation on each op's tiny
    decode-like input, forward and forward+backward; the implementations of a row take turns
    (timing.host_overheads), so normkit and its peers are compared under the same host drift."""
    rows = []
    for op in ops:
        shape, groups = OPS[op].tiny
        p = Point("host", op, HOST_DTYPE, shape, groups)
        for mode in HOST_MODES:
            calls, mode_rows = {}, []
            for impl in impls:
                row = HostRow(p.op, p.dtype, p.label, impl.name, device, mode)
                call = _host_call(p, impl, mode, row)
                if call is not None:
                    calls[len(mode_rows)] = call
                mode_rows.append(row)
            try:
                for i, (us, lat) in host_overheads(calls, timer.sync).items():
                    mode_rows[i].us_per_call, mode_rows[i].latency_us = us, lat
            except Exception as e:  # noqa: BLE001 - the rows say why
                for i in calls:
                    mode_rows[i].note = f"error: {first_line(e)}"
            rows += mode_rows
    names = [i.name for i in impls]
    return sorted(rows, key=lambda r: names.index(r.impl))  # per implementation, as the report lists them


def _host_call(p: Point, impl, mode: str, row: HostRow):
    """The zero-argument call a host row times (its first call made, the row's note set), or None
    with the row's note saying why."""
    direction = "fwd" if mode == "fwd" else "bwd"
    try:
        fn = impl.build(p, direction)
        case = Case(p, direction, row.device, 1, seed=0)
        w, b = case.params(impl.param_dtype(p))
        if mode == "fwd":
            call = functools.partial(case.call, fn, 0, w, b)
        else:
            call = lambda: torch.autograd.grad(*case.grad_args(fn, 0, w, b))  # noqa: E731
        call()
        row.note = impl.after_first_call() or ""
        return call
    except Unsupported as e:
        row.note = f"unsupported: {e}"
    except Exception as e:  # noqa: BLE001
        row.note = f"error: {first_line(e)}"
    return None
