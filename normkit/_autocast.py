"""Whether torch's autocast upcasts a norm on a device type: a fact of the torch build, shared by
normkit.functional (the autocast contract) and normkit._host (handed to the C++ host path). A leaf
module: it imports nothing of normkit, so _host need not import functional."""
from __future__ import annotations

import torch

_UPCASTS: dict = {}


def _autocast_upcasts(op: str, device_type: str) -> bool:
    """Whether this torch build gives aten::`op` an autocast kernel on `device_type` (the norms are
    only ever on autocast's float32 list): read from the dispatcher, so it follows torch's version.
    False for device types autocast does not know (meta, ...)."""
    found = _UPCASTS.get((op, device_type))
    if found is None:
        found = _UPCASTS[(op, device_type)] = _query_upcasts(op, device_type)
    return found


def _query_upcasts(op: str, device_type: str) -> bool:
    if not torch.amp.autocast_mode.is_autocast_available(device_type):
        return False
    key = "Autocast" + {"cuda": "CUDA", "cpu": "CPU", "xpu": "XPU", "mps": "MPS"}.get(device_type, device_type.upper())
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)
    except RuntimeError:  # a dispatch key this build does not know
        return False


# a fact of the torch build: dynamo runs it when tracing (as torch.compiler.assume_constant_result
# marks a function) instead of tracing the dispatcher query, which it cannot; a plain dict, not
# functools.lru_cache, whose wrapper dynamo warns about on every compile
_autocast_upcasts._dynamo_marked_constant = True
