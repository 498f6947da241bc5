"""Backend registry and selection.

A backend is a module with NAME, why_unavailable(x) -> str | None, and the kernels it provides
(row_norm_fwd / row_norm_bwd, ...). Modules are imported on first use, so `import normkit` does
not pull in triton, cuda-python or wgpu.
"""
from __future__ import annotations

import importlib

import torch

# name -> module path; the order is the documented list of choices
_MODULES = {
    "torch": "normkit.backends.torch_backend",
    "triton": "normkit.backends.triton",
}
NAMES = tuple(_MODULES)


class BackendUnavailableError(RuntimeError):
    """A backend that was asked for by name cannot run this call."""


_loaded: dict = {}


def get(name: str):
    mod = _loaded.get(name)
    if mod is None:
        if name not in _MODULES:
            raise ValueError(f"backend: expected None or one of {', '.join(map(repr, NAMES))}, got {name!r}")
        mod = _loaded[name] = importlib.import_module(_MODULES[name])
    return mod


def _auto(x: torch.Tensor):
    """backend=None: the fastest correct backend for x's device and dtype."""
    if x.device.type == "cuda":
        triton_backend = get("triton")
        if triton_backend.why_unavailable(x) is None:
            return triton_backend
    return get("torch")


def resolve(name: str | None, x: torch.Tensor, op: str = "this op"):
    """The backend module to run `op` on x. A backend forced by name either runs or raises."""
    if name is None:
        return _auto(x)
    if not isinstance(name, str):
        raise TypeError(f"backend: expected None or a string, got {type(name).__name__}")
    mod = get(name)
    why = mod.why_unavailable(x)
    if why is not None:
        raise BackendUnavailableError(f"backend={name!r} cannot run {op}: {why}.")
    return mod
