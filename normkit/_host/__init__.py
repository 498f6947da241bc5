"""The host path: where the eager calls of normkit's public functions go first.

`fast` is None (every call takes the Python path in normkit.functional) or an object whose
    row_norm(x, normalized_shape, weight, bias, eps, rms, activation, backend[, residual, prenorm,
             residual_dtype, weight_offset, out_dtype, out_scale, return_amax, autocast])
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
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch

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

if os.environ.get("NORMKIT_HOST", "1").strip().lower() in ("0", "false", "off", "no"):
    fast = None
    status = "Python host path: the C++ host path is switched off (NORMKIT_HOST=0)"


def load_extension():
    """The compiled extension, set up for the tests and tools that need no GPU (builds it if needed)."""
    global _ext
    if _ext is None:
        from . import build
        from ..functional import _autocast_upcasts
        from ..reference import ACTIVATIONS

        ext = build.load()
        ext._setup(ACTIVATIONS, (_autocast_upcasts("layer_norm", "cuda"), _autocast_upcasts("rms_norm", "cuda")))
        _ext = ext
    return _ext


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


def stats() -> dict:
    """Counters of the C++ host path (plans, replays, Python runs, records, ...); {} if inactive."""
    return dict(_ext._stats()) if _ext is not None and fast is _ext else {}


@contextlib.contextmanager
def python_path():
    """Calls in the block take the Python host path (tests and benchmarks compare the two)."""
    global fast
    saved, fast = fast, None
    try:
        yield
    finally:
        fast = saved
