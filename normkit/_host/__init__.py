"""The host path: where the eager calls of normkit's public functions go first.

`fast` is None (every call takes the Python path in normkit.functional) or an object whose
    row_norm(x, normalized_shape, weight, bias, eps, rms, activation, backend[, residual, prenorm,
             residual_dtype, weight_offset, out_dtype, out_scale, return_amax, autocast[, mod_scale,
             mod_shift, gate]])
    group_norm(x, num_groups, weight, bias, eps, activation, backend)
return the output (row_norm: y, or (y[, h][, amax]) as the public functions return it), or None for
a call they do not serve (then the Python path runs, and raises the errors for bad arguments).
normkit.functional calls them first, unless torch.compile is tracing. row_norm's `autocast` says
whether to apply torch's autocast contract (the public functions) or not (a caller that applied it,
or row_norm_as_written, which wants none).

The fast object is a C++ extension (host.cpp, plans.py): torch-native autograd nodes and launch
plans replayed through the CUDA driver, a few microseconds per call. It is built with g++ and
ninja on the first call with a CUDA tensor (about a minute, once: then it is loaded from torch's
extension cache). Until then `fast` is a stand-in that builds it on that first CUDA call; where it
cannot be built, `fast` becomes None and `status` says why. NORMKIT_HOST=0 switches it off.

The same extension gives normkit's custom ops (normkit._library) C++ kernels for CUDA tensors, so
torch.compile's generated code, which calls the ops through the dispatcher, replays the same plans
without Python (host.cpp, "the dispatcher's kernels"). They are registered when the extension loads;
a process that compiles before any eager CUDA call loads it when tracing first meets a normkit op on
a CUDA tensor (prepare_for_compile, called by the ops' fake implementations). A call the C++ kernels
do not serve, and every call while the host path is inactive or python_path() is in force, runs the
op's Python implementation.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch

from .._op_args import OPS  # the ops whose dispatcher kernels this path registers (names -> argument tables)

_Tensor = torch.Tensor
status = "C++ host path: not built yet (it is built on the first call with a CUDA tensor)"


def _on_first_cuda_call(op: str):
    def call(x, *args, **kwargs):
        # not inside a torch.func transform: the host path never serves those calls, and building it
        # there would make its probe tensor a functorch wrapper (no storage)
        if type(x) is _Tensor and x.is_cuda and not torch._C._are_functorch_transforms_active():
            ext = activate()
            return getattr(ext, op)(x, *args, **kwargs) if ext is not None else None
        return None
    return staticmethod(call)


class _Pending:
    """Stands in for the C++ extension until the first CUDA call, which builds or loads it."""
    row_norm = _on_first_cuda_call("row_norm")
    group_norm = _on_first_cuda_call("group_norm")


fast = _Pending()
_lock = threading.Lock()
_ext = None
_ops_handle = None  # keeps the dispatcher's C++ kernels of normkit's ops registered

if os.environ.get("NORMKIT_HOST", "1").strip().lower() in ("0", "false", "off", "no"):
    fast = None
    status = "Python host path: the C++ host path is switched off (NORMKIT_HOST=0)"


def load_extension():
    """The compiled extension, set up for the tests and tools that need no GPU (builds it if needed)."""
    global _ext
    if _ext is None:
        from . import build
        from .._autocast import _autocast_upcasts
        from ..reference import ACTIVATIONS

        from .._op_args import HOST_OPS, HOST_ROW, HOST_ROW_LENGTHS

        ext = build.load()
        _forget_plans_when_configs_change()
        # the op kernels and the eager entry read their arguments by name (row_norm_fwd's lead the fused
        # op's, by construction): their positions come from normkit._op_args
        ext._setup(ACTIVATIONS, (_autocast_upcasts("layer_norm", "cuda"), _autocast_upcasts("rms_norm", "cuda")),
                   HOST_ROW, HOST_ROW_LENGTHS)
        for args in HOST_OPS:
            ext._set_op_args(args.op, args.names)
        global _ops_handle
        _ops_handle = ext._register_ops(op_impls(), "CUDA")
        dispatch_changed()
        _ext = ext
    return _ext


def dispatch_changed() -> None:
    """Forget the Python dispatcher's cached kernels of normkit's ops after C++ kernels were
    registered or removed: torch caches them per OpOverload (used while tracing) and invalidates
    that cache only for registrations made through torch.library's Python API, so a stale entry
    would route a later trace to a kernel that is gone (autograd then finds no formula)."""
    for name in OPS:
        op = getattr(torch.ops.normkit, name, None)
        if op is not None:
            for overload in op.overloads():
                getattr(op, overload)._dispatch_cache.clear()


def op_impls() -> dict:
    """{op name: (its Python implementation, its Python autograd kernel)}: what the dispatcher's C++
    kernels call for a call they leave to Python (the custom op's own kernels, which theirs replace).
    normkit._library, which defines the ops and imports this module, hands the table over
    (`_op_impls`) when it is imported, so this module never imports it."""
    if _op_impls is None:
        raise RuntimeError("normkit's custom ops are not defined yet: import normkit first")
    return _op_impls()


_op_impls = None  # set by normkit._library


def prepare_for_compile(x) -> None:
    """Called when a normkit op is traced (its fake implementation): a CUDA tensor loads the host path
    now, so the compiled code's op calls find its C++ kernels (a process may compile before any eager
    CUDA call). Outside the tracing modes: building it makes a real CUDA tensor."""
    if not isinstance(fast, _Pending) or getattr(x, "device", None) is None or x.device.type != "cuda":
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._DisablePythonDispatcher():
        activate()


def activate():
    """Build or load the C++ host path and make it `fast`; None (and `fast = None`) where it
    cannot run, with `status` saying why."""
    global fast, status
    with _lock:
        if not isinstance(fast, _Pending):
            return fast
        why = _unusable()
        ext = None
        if why is None:
            from . import build

            cached = build.is_built()
            if not cached:
                print("normkit: building the C++ host path (g++, once; about a minute) ...", file=sys.stderr, flush=True)
            try:
                ext = load_extension()
                with torch._C._DisableFuncTorch():  # its probe tensor must be a plain one
                    why = ext._init(_callbacks()) or None
            except Exception as e:  # noqa: BLE001 - no compiler, no ninja, headers: the Python path still works
                why = f"it failed to build or load: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
            if why is None:
                fast = ext
                status = f"C++ host path: active ({'loaded from' if cached else 'built into'} {build.build_directory()})"
                return fast
        fast = None
        status = f"Python host path: the C++ host path cannot run here: {why}"
        print(f"normkit: {status}", file=sys.stderr, flush=True)
        return None


def _unusable() -> str | None:
    from ..backends import triton as tb

    if tb._triton_missing():
        return tb._triton_missing()
    if torch.version.hip is not None:
        return "it launches CUDA kernels; this torch is built for ROCm"
    return None


def _callbacks() -> dict:
    from . import plans

    return dict(row_fwd=plans.row_fwd, row_bwd=plans.row_bwd, gn_fwd=plans.gn_fwd, gn_bwd=plans.gn_bwd,
                row_vjp=plans.row_vjp, gn_vjp=plans.gn_vjp)


def clear() -> None:
    """Forget every launch plan (after the Triton backend's configurations change)."""
    if _ext is not None:
        _ext._clear()


def _forget_plans_when_configs_change() -> None:
    from ..backends import triton as tb

    if clear not in tb.ON_CLEAR:
        tb.ON_CLEAR.append(clear)


def stats() -> dict:
    """Counters of the C++ host path (plans, replays, Python runs, records, ...); {} if inactive."""
    return dict(_ext._stats()) if _ext is not None and fast is _ext else {}


@contextlib.contextmanager
def python_path():
    """Calls in the block take the Python host path (tests and benchmarks compare the two)."""
    global fast
    saved, fast = fast, None
    ext = _ext
    on = ext._ops_enabled() if ext is not None else None
    if ext is not None:
        ext._set_ops_enabled(False)  # the ops' dispatcher kernels too
    try:
        yield
    finally:
        fast = saved
        if ext is not None:
            ext._set_ops_enabled(on)
