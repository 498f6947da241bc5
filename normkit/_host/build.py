"""Build (once per source, torch and Python version; cached on disk) and load the C++ host path.

A plain torch.utils.cpp_extension C++ extension: g++ and ninja, no CUDA toolkit, so it builds
against CPU-only torch too (CI builds and tests it there). The cache is torch's extension
directory (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), under a name that carries a
hash of the source and of the torch version, so an edit or an upgrade builds afresh.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("host.cpp")


def module_name() -> str:
    import torch

    h = hashlib.sha1(SOURCE.read_bytes())
    h.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return f"normkit_host_{h.hexdigest()[:12]}"


def build_directory() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(module_name(), verbose=False))


def is_built() -> bool:
    d = build_directory()
    return any(d.glob(f"{module_name()}*.so"))


def load(verbose: bool = False):
    """The extension module, compiling it first if this source/torch has not been built here."""
    from torch.utils.cpp_extension import load as _load

    flags = ["-O2", "-fvisibility=hidden"]
    return _load(name=module_name(), sources=[str(SOURCE)], extra_cflags=flags, with_cuda=False,
                 verbose=verbose or os.environ.get("NORMKIT_HOST_VERBOSE") == "1")
