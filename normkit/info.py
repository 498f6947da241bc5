"""`normkit info`: versions, devices, and which backends can run here (and why not)."""
from __future__ import annotations

import platform


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    import torch

    from . import __version__, backends

    print(f"normkit {__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton
        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton: not installed")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"cuda:{i} {p.name}  sm_{p.major}{p.minor}  {p.multi_processor_count} SMs  {p.total_memory / 2**30:.0f} GiB")
        probe = torch.empty(1, device="cuda")
    else:
        print("no CUDA GPU")
        probe = torch.empty(1)
    for name in backends.NAMES:
        try:
            why = backends.get(name).why_unavailable(probe)
        except Exception as e:  # a backend that fails to load says so here, not as a crash
            why = f"failed to load: {e}"
        print(f"backend {name:7s} on {probe.device.type}: {'ready' if why is None else why}")
    print(host_path_line())
    return 0


def host_path_line() -> str:
    """Which host path eager calls take, and why (on a GPU this builds or loads the C++ one)."""
    import torch

    from . import _host

    if _host.fast is not None and torch.cuda.is_available():
        _host.activate()
    elif _host.fast is not None:
        return ("host path: Python (no CUDA device; the C++ host path serves CUDA tensors and is built on the "
                "first CUDA call)")
    return f"host path: {_host.status}"
