"""Launch plans for the C++ host path (host.cpp), and the Python functions it calls.

A plan is one run of a Triton backend host function (row_norm_fwd / row_norm_bwd / group_norm_fwd /
group_norm_bwd) written down as data: the buffers the run allocated and each kernel launch with its
parameters in the binary layout the kernel takes. host.cpp keys plans on everything those host
functions read (shapes, strides, dtypes, flags, eps, pointer alignment, device), so replaying one is
the same launches, with fresh buffers and the new call's pointers. Nothing of the launch logic
(configurations, grids, scratch buffers, persistent grids, the dweight partials, GroupNorm's staged
path) is written twice: it is recorded from the Python code that has it.

How a run is recorded:
- launch.recording collects every launch (launch.Kernel.__call__): the CompiledKernel, the grid and
  the arguments handed to Triton's launcher; and the CUDA backend's launches the Triton backend
  routes to (its cluster kernels: driver.launch), with their KernelSpec and arguments. Both become
  the same plan launch: a function, grid, block, shared memory, parameters, and a cluster shape
  ((0, 0, 0): a plain launch; else, a cluster of one CTA too, host.cpp launches it with cuLaunchKernelEx);
- a TorchDispatchMode sees every torch op of the run. Allocations (empty, empty_strided, ...) are
  the plan's buffers, torch.zeros a buffer the replay zeroes (the fp8 amax the kernels accumulate
  into); views are free; any other op (a copy_, zero_, fill_, ...) is work a replay would not redo,
  so such a run is not replayable and that call stays on the Python path;
- each pointer argument becomes a slot: one of the call's inputs, a buffer of the run (plus a byte
  offset), or a tensor that outlives the run (backend state such as the split-row counters), which
  the plan keeps alive and passes unchanged;
- every other argument is a constant, packed as Triton's launcher packs it (triton 3.6 and 3.9,
  backends/nvidia/driver.py): CompiledKernel.src.signature has one entry per kernel argument;
  "constexpr" entries (constexprs, None, integers equal to 1) are not passed, the others are, in
  order, each in its own storage of its natural size, followed by two null pointers (the global
  and profile scratch that both versions append to every kernel's parameters). A CUDA-backend
  kernel's parameters are its KernelSpec's, packed the same way, with no scratch pointers.
"""
from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _autograd
from .._layout import as_rows, bcs, flat_param, fresh
from ..backends import triton as tb
from ..backends.triton import launch

# what each allocation becomes at replay: a temporary in the recorded layout, or one of the op's
# outputs (role 1-5: y, mean, rstd, h, amax forward; the first gradient buffer, dweight, dbias, a
# second gradient buffer backward), which host.cpp allocates in the user-facing shape (checked here
# to be the same memory layout as recorded)
ROLE_TEMP = 0
MAX_PARAMS = 64  # host.cpp's fixed parameter arrays
MAX_PARAM_BYTES = 1024
MAX_CLUSTER = 16  # CTAs per cluster on sm_90 (above 8 the function opts in to non-portable sizes)


class NotReplayable(Exception):
    """The recorded run cannot be replayed as data; the message says why."""


# scalar kernel parameters: signature type -> struct format (little-endian, natural size)
_SCALAR = {"i32": "<i", "i64": "<q", "u32": "<I", "u64": "<Q", "fp32": "<f", "f32": "<f", "fp64": "<d"}
TRITON_SCRATCH_POINTERS = 2  # global and profile scratch, null, after every Triton kernel's parameters


@dataclass
class LaunchRecord:
    """One launch as Triton's launcher sees it. signature and args run over every argument of the
    kernel, constexprs included (normkit kernels take runtime arguments first, constexprs last)."""
    signature: list
    args: tuple
    grid: tuple
    num_warps: int
    function: int = 0
    num_ctas: int = 1
    shared: int = 0
    cooperative: bool = False
    pdl: bool = False
    scratch: int = 0  # global + profile scratch bytes per program (Triton allocates them per launch)
    kernel: object = None  # the CompiledKernel: kept alive while a plan uses its CUfunction
    # CTAs per thread-block cluster (CUDA-backend kernels); (0, 0, 0): a plain launch. A cluster of one CTA
    # is still launched as a cluster: its kernel's cluster instructions are illegal in a plain launch
    cluster: tuple = (0, 0, 0)
    null_pointers: int = TRITON_SCRATCH_POINTERS  # appended to the parameters

    @classmethod
    def from_compiled(cls, kernel, grid, args, constexprs):
        md = kernel.metadata
        if getattr(kernel.run, "gsan_enabled", False):
            raise NotReplayable("Triton's GSan instrumentation adds launch parameters")
        return cls(signature=list(kernel.src.signature.values()), args=tuple(args) + tuple(constexprs.values()),
                   grid=tuple(grid), num_warps=md.num_warps, function=kernel.function,
                   num_ctas=getattr(md, "num_ctas", 1), shared=md.shared,
                   cooperative=bool(getattr(md, "launch_cooperative_grid", False)),
                   pdl=bool(getattr(md, "launch_pdl", False)),
                   scratch=(getattr(md, "global_scratch_size", 0) or 0) + (getattr(md, "profile_scratch_size", 0) or 0),
                   kernel=kernel)

    @classmethod
    def from_cuda(cls, spec, function, grid, block, shared, cluster, args):
        """A CUDA-backend launch (driver.launch's note): spec.params give each argument's C type;
        the driver keeps the loaded kernel for the process, and its shared-memory and cluster-size
        opt-ins stay set on the function for the replays."""
        block = tuple(block) + (1,) * (3 - len(block))
        if block[1:] != (1, 1) or block[0] % 32:
            raise NotReplayable(f"kernel {spec.name}: block {block} (plans launch whole warps along x)")
        signature = ["*" if ctype == "ptr" else ctype for _, ctype in spec.params]
        return cls(signature=signature, args=tuple(args), grid=tuple(grid), num_warps=block[0] // 32,
                   function=int(function), shared=int(shared), cluster=tuple(cluster), null_pointers=0)


def pack_params(signature, args, null_pointers: int = TRITON_SCRATCH_POINTERS):
    """(template bytes, offset of each parameter, [(offset, tensor or None) per pointer parameter])
    for one launch: the kernel parameters Triton passes, each at an offset aligned to its size,
    then `null_pointers` null pointers (Triton's two scratch pointers)."""
    if len(signature) != len(args):
        raise NotReplayable(f"the kernel has {len(signature)} arguments, the launch passed {len(args)}")
    buf, offsets, pointers = bytearray(), [], []

    def put(size: int) -> int:
        off = -(-len(buf) // size) * size
        buf.extend(b"\0" * (off + size - len(buf)))
        offsets.append(off)
        return off

    for ty, a in zip(signature, args):
        if not isinstance(ty, str):
            raise NotReplayable(f"tuple argument {ty!r}")
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            if a is not None and not isinstance(a, torch.Tensor):
                raise NotReplayable(f"pointer argument of type {type(a).__name__}")
            pointers.append((put(8), a))
        elif ty in _SCALAR:
            if isinstance(a, bool) or not isinstance(a, (int, float)) or (isinstance(a, float) and ty[0] != "f"):
                raise NotReplayable(f"argument {a!r} for a {ty} parameter")
            fmt = _SCALAR[ty]
            off = put(struct.calcsize(fmt))
            try:
                packed = struct.pack(fmt, a)
            except OverflowError:  # a float beyond float32's range (eps=1e39): inf, as Triton's launcher casts it
                packed = struct.pack(fmt, math.copysign(math.inf, a))
            buf[off:off + struct.calcsize(fmt)] = packed
        else:  # i1 (its size differs between triton versions), fp16/bf16 scalars, tensor descriptors
            raise NotReplayable(f"parameter type {ty}")
    for _ in range(null_pointers):
        put(8)
    if len(offsets) > MAX_PARAMS or len(buf) > MAX_PARAM_BYTES:
        raise NotReplayable(f"{len(offsets)} parameters in {len(buf)} bytes")
    return bytes(buf), tuple(offsets), pointers


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def pointer_slot(t, inputs, allocs, persistent: list):
    """(slot, byte offset) of a pointer argument. Slots: the inputs, then the run's allocations,
    then tensors that outlive the run (appended to `persistent`). None and empty tensors are
    null pointers: (-1, 0)."""
    if t is None or t.data_ptr() == 0:
        return -1, 0
    ptr = t.data_ptr()
    for i, inp in enumerate(inputs):
        if inp is not None and inp.data_ptr() == ptr:
            return i, 0
    storage = _storage_ptr(t)
    for j, a in enumerate(allocs):
        if a.device == t.device and _storage_ptr(a) == storage:
            return len(inputs) + j, ptr - a.data_ptr()
    end = ptr + t.numel() * t.element_size()
    for inp in inputs:  # a view into an input at an offset: not a pattern the plan knows
        if inp is not None and inp.device == t.device and _storage_ptr(inp) == storage:
            raise NotReplayable("a kernel argument is a view into an input at an offset")
        if inp is not None and inp.numel() and ptr < inp.data_ptr() + inp.numel() * inp.element_size() \
                and inp.data_ptr() < end:
            raise NotReplayable("a kernel argument overlaps an input")
    for k, p in enumerate(persistent):
        if p is t:
            return len(inputs) + len(allocs) + k, 0
    persistent.append(t)
    return len(inputs) + len(allocs) + len(persistent) - 1, 0


def _alloc_of(t, allocs, what: str, taken=()) -> int:
    """Index of the allocation that t is all of (the buffer itself, or a view of all of it, of any
    dtype: the amax is its int32 buffer viewed as float32)."""
    for j, a in enumerate(allocs):
        if a is t:
            return j
    for j, a in enumerate(allocs):
        if j not in taken and a.device == t.device and a.nbytes == t.nbytes \
                and a.data_ptr() == t.data_ptr() and _storage_ptr(a) == _storage_ptr(t):
            return j
    raise NotReplayable(f"{what} is not a whole buffer the run allocated")


def build_plan(launches, inputs, allocs, outputs):
    """The plan host.cpp replays (see the module docstring), from one recorded run.
    launches: LaunchRecords; inputs: the call's tensors in host.cpp's order (None where absent);
    allocs: the tensors the run allocated, in order; outputs: [(role, tensor)] for the op's
    outputs, each of which must be one of allocs."""
    device = next(t.device for t in inputs if t is not None)
    zeroed = {id(a) for a in allocs if getattr(a, "_normkit_zeroed", False)}
    allocs = [a for a in allocs if isinstance(a, torch.Tensor) and a.device == device]  # not host-side scalars
    roles = [ROLE_TEMP] * len(allocs)
    for role, t in outputs:
        if t is not None:
            roles[_alloc_of(t, allocs, f"output {role}", [j for j, r in enumerate(roles) if r])] = role
    persistent, plan_launches, kernels = [], [], []
    for rec in launches:
        if rec.num_ctas != 1 or rec.cooperative or rec.pdl or rec.scratch or rec.shared > 227 * 1024:
            raise NotReplayable("the launch needs Triton's clusters (num_ctas), cooperative/PDL attributes, "
                                "scratch memory or oversized shared memory")
        grid = tuple(rec.grid) + (1,) * (3 - len(rec.grid))
        cluster = tuple(rec.cluster) + (1,) * (3 - len(rec.cluster)) if any(rec.cluster) else (0, 0, 0)
        if any(cluster) and (min(cluster) < 1 or math.prod(cluster) > MAX_CLUSTER
                             or any(g % c for g, c in zip(grid, cluster))):
            raise NotReplayable(f"cluster {cluster} for grid {grid}")
        template, offsets, pointers = pack_params(rec.signature, rec.args, rec.null_pointers)
        patches = []
        for off, t in pointers:
            slot, byte_offset = pointer_slot(t, inputs, allocs, persistent)
            if slot >= 0:
                patches.append((off, slot, byte_offset, t.data_ptr() % 16 == 0))
        plan_launches.append((int(rec.function), *map(int, grid), 32 * rec.num_warps, int(rec.shared), template,
                              offsets, tuple(patches), tuple(map(int, cluster))))
        kernels.append(rec.kernel)
    alloc_specs = tuple((roles[j], a.dtype, tuple(a.shape), tuple(a.stride()), id(a) in zeroed)
                        for j, a in enumerate(allocs))
    _KEEP.update(k for k in kernels if k is not None)
    return alloc_specs, tuple(persistent), tuple(plan_launches)


_recording_lock = threading.Lock()
_KEEP: set = set()  # CompiledKernels whose CUfunctions plans use (Triton unloads a module with its kernel)

_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                torch.ops.aten.new_empty_strided.default}
_ZEROED = {torch.ops.aten.zeros.default}  # allocations the replay zeroes (cuMemsetD8Async)


class _Watch(TorchDispatchMode):
    """Every torch op of the recorded run: allocations are kept, views pass, others are noted."""

    def __init__(self):
        super().__init__()
        self.allocs, self.other = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocs.append(out)
        elif func in _ZEROED:
            out._normkit_zeroed = True
            self.allocs.append(out)
        elif not func.is_view:
            self.other.append(str(func))
        return out


class Recorder:
    """with Recorder() as rec: <one run of a host function>; then rec.plan(inputs, outputs).
    One recording at a time: rec.busy is True (and nothing is recorded) while another thread's is
    under way."""

    def __enter__(self):
        self.busy = not _recording_lock.acquire(blocking=False)
        if self.busy:
            return self
        self.launches = []
        launch.recording = (threading.get_ident(), self.launches)
        self.watch = _Watch()
        self.watch.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.busy:
            self.watch.__exit__(*exc)
            launch.recording = None
            _recording_lock.release()
        return False

    def output_allocs(self, outs):
        """The allocations behind the run's outputs (None where an output is None)."""
        return [None if t is None else self.watch.allocs[_alloc_of(t, self.watch.allocs, "an output")] for t in outs]

    def plan(self, inputs, outputs, check=None):
        """(plan, None), or (None, why not); (None, None) if another recording was under way."""
        if self.busy:
            return None, None
        try:
            foreign = [name for k, name, cuda, *_ in self.launches if k == "foreign" and cuda is None]
            if foreign:
                raise NotReplayable(f"CUDA-backend kernels ran without their arguments ({', '.join(foreign)})")
            if self.watch.other:
                raise NotReplayable(f"the run did more than allocate and launch: {', '.join(self.watch.other)}")
            if any(k is None for k, *_ in self.launches):
                raise NotReplayable("the kernels ran under the Triton interpreter")
            if check is not None:
                check()
            launches = [LaunchRecord.from_cuda(*e[2]) if e[0] == "foreign" else
                        LaunchRecord.from_compiled(e[0], *e[2:5]) for e in self.launches]
            return build_plan(launches, inputs, self.watch.allocs, outputs), None
        except NotReplayable as e:
            return None, str(e)


def _require(cond: bool, why: str) -> None:
    if not cond:
        raise NotReplayable(why)


# ----------------------------------------------------------------------------- the calls host.cpp makes
# Each runs the Python path's own code for one call (normkit._autograd and _layout, the Triton
# backend), returns what it returns, and with record=True also the plan of that run (or why none).

def _run(record: bool, fn, inputs, check):
    """fn() -> (out1, ..., out_n) (output roles 1..n); with record, the plan of that run too:
    (outs, plan, why)."""
    if not record:
        return fn(), None, None
    with Recorder() as rec:
        outs = fn()
    plan, why = rec.plan(inputs, list(zip(range(1, len(outs) + 1), outs)), lambda: check(*rec.output_allocs(outs)))
    return outs, plan, why


def _contiguous_like(a, numel: int, what: str) -> None:
    _require(a is None or (a.is_contiguous() and a.numel() == numel), f"{what} is not a contiguous buffer "
             "of its input's size")


def row_fwd(x, weight, bias, residual, scale, mod_scale, mod_shift, gate, ndim, eps, rms, act, store_stats, store_h,
            residual_dtype, weight_offset, out_dtype, out_scale, return_amax, record):
    """LayerNorm/RMSNorm forward with the fused options, as the Python path runs it
    (_autograd.row_norm_forward_fused): (y in x's shape, mean or None, rstd or None, h or None,
    amax or None, plan, why). residual_dtype: h's dtype (set with a residual); out_dtype None: x's;
    out_scale: a float scale (a tensor one comes as `scale`); mod_scale / mod_shift: the adaLN
    modulation tables, gate: the gated norm's gate (with any of the three, the plan's inputs are
    x, weight, bias, residual, scale, mod_scale, mod_shift, gate; else the first five)."""
    opts = _autograd.RowOptions(residual_dtype, float(weight_offset), out_dtype, out_scale, return_amax,
                                mod_scale is not None, mod_shift is not None, gate is not None)
    opts = _autograd.PLAIN if opts == _autograd.PLAIN else opts
    extra = (mod_scale, mod_shift, gate) if opts.modulated or opts.gate else ()

    def fn():
        y, h, mean, rstd, amax = _autograd.row_norm_forward_fused(
            tb, x, weight, bias, ndim, eps, rms, act, residual=residual, scale=scale, opts=opts,
            store_stats=store_stats, store_h=store_h, mod_scale=mod_scale, mod_shift=mod_shift, gate=gate)
        return y, mean, rstd, h, amax

    def check(y2, mean2, rstd2, h2, amax2):
        _contiguous_like(y2, x.numel(), "y")
        _contiguous_like(h2, x.numel(), "h")

    outs, plan, why = _run(record, fn, (x, weight, bias, residual, scale) + extra, check)
    return (*outs, plan, why)


def row_bwd(dy, dh, x, weight, bias, mean, rstd, ndim, rms, act, needs, param_dtypes, weight_offset, x_dtype,
            residual_dtype, record, *extra):
    """LayerNorm/RMSNorm backward as the Python path runs it (_autograd.row_norm_backward_fused):
    x is what was normalized (h with a residual; the ungated input with a gate), dh h's gradient or
    None, needs (x, residual), param_dtypes the dtypes of dweight and dbias (None: not wanted; dbias
    may be wanted without the bias, which the kernels read only with an activation). Returns (the
    first gradient buffer the kernel writes: dx, or dresidual when only it is wanted; dweight or None;
    dbias or None; a second buffer: dresidual in another dtype than dx, or None; plan, why). extra,
    for a call with the modulation or a gate: (mod_scale, mod_shift, (dscale dtype, dshift dtype:
    None where not wanted), gate, need_dgate); then dscale, dshift and dgate (None where not wanted)
    follow the four buffers, and the plan's inputs are dy, x, weight, bias, mean, rstd, dh, mod_scale,
    mod_shift, gate."""
    mod_scale, mod_shift, mod_dtypes, gate, need_dgate = extra or (None, None, (None, None), None, False)
    need_dx, need_dres = needs
    dw_dtype, db_dtype = param_dtypes

    dx_dtype, dres_dtype = _autograd.grad_dtypes(need_dx, need_dres, x_dtype, residual_dtype)

    def fn():
        dx, dres, dw, db, ds, dt, dg = _autograd.row_norm_backward_fused(
            tb, dy, x, ndim, weight, bias, mean, rstd, rms, act, dw_dtype, db_dtype, weight_offset=weight_offset, dh=dh,
            dx_dtype=dx_dtype, dres_dtype=dres_dtype, mod_scale=mod_scale, mod_shift=mod_shift,
            dscale_dtype=mod_dtypes[0], dshift_dtype=mod_dtypes[1], gate=gate)
        return (dx if need_dx or need_dres else None, dw, db, dres) + \
            ((ds, dt, dg if need_dgate else None) if extra else ())

    n_params = next((p.numel() for p in (weight, bias) if p is not None), math.prod(x.shape[x.dim() - ndim:]))

    def check(first, dw, db, second, ds=None, dt=None, dg=None):
        _contiguous_like(first, x.numel(), "dx")
        _contiguous_like(second, x.numel(), "dresidual")
        _contiguous_like(dw, n_params, "dweight")
        _contiguous_like(db, n_params, "dbias")
        _contiguous_like(ds, mod_scale.numel() if mod_scale is not None else 0, "dscale")
        _contiguous_like(dt, mod_shift.numel() if mod_shift is not None else 0, "dshift")
        _contiguous_like(dg, x.numel(), "dgate")

    # the bias only recomputes act's input, or with a scale the affine output dscale sums
    inputs = (dy, x, weight, bias if act or mod_scale is not None else None, mean, rstd, dh)
    outs, plan, why = _run(record, fn, inputs + ((mod_scale, mod_shift, gate) if extra else ()), check)
    return (*outs, plan, why)


def gn_fwd(x, weight, bias, num_groups, eps, act, channels_last, record):
    """GroupNorm forward: (y in x's shape and memory format, mean [B, G], rstd [B, G], plan, why)."""
    x3 = bcs(x, channels_last)
    outs, plan, why = _run(record, lambda: _autograd.group_norm_forward(tb, x, weight, bias, num_groups, eps, act),
                           (x, weight, bias), lambda y3, *_: _require(y3.stride() == x3.stride(), "y is not laid out as x"))
    return (*outs, plan, why)


def gn_bwd(dy, x, weight, bias, mean, rstd, num_groups, act, param_dtypes, channels_last, record):
    """GroupNorm backward, dy in x's layout: (dx, dweight [C] or None, dbias [C] or None, plan, why).
    param_dtypes: the dtypes of dweight and dbias (None: not wanted; dbias may be wanted without the
    bias, which the kernels read only with an activation)."""
    x3 = bcs(x, channels_last)

    def check(dx3, dw, db):
        _require(dx3.stride() == x3.stride(), "dx is not laid out as x")
        _contiguous_like(dw, x.shape[1], "dweight")
        _contiguous_like(db, x.shape[1], "dbias")

    outs, plan, why = _run(record, lambda: _autograd.group_norm_backward(
        tb, dy, x, num_groups, weight, bias, mean, rstd, act, *param_dtypes),
        (dy, x, weight, bias if act else None, mean, rstd), check)
    return (*outs, plan, why)


def row_vjp(dy, dh, x, weight, bias, ndim, eps, rms, act, weight_offset, needs, x_dtype, residual_dtype, mod_scale,
            mod_shift, mod_needs, gate, need_dgate):
    """(dx, dresidual, dweight, dbias, dscale, dshift, dgate) in differentiable torch ops: the backward
    when it is itself recorded (create_graph=True, double backward), runs under a torch.func
    transform, or has only h's gradient. needs: (x, weight, bias, residual); mod_needs: (scale, shift)."""
    return _autograd.row_norm_vjp_fused(dy, dh, x, weight, bias, ndim, eps, rms, act,
                                        _autograd.RowOptions(weight_offset=float(weight_offset)), tuple(needs), x_dtype,
                                        residual_dtype, mod_scale, mod_shift, tuple(mod_needs), gate, need_dgate)


def gn_vjp(dy, x, weight, bias, num_groups, eps, act, needs):
    return _autograd.group_norm_vjp_differentiable(dy, x, weight, bias, num_groups, eps, act, needs)
