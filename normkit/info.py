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
    return 0
