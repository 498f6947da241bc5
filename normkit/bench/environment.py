"""What a result was measured on: device, driver, versions, date, host, source revision."""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

PACKAGES = {"torch": "torch", "triton": "triton", "liger": "liger-kernel", "quack": "quack-kernels"}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _run(cmd, cwd=None) -> str:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _commit() -> str:
    root = Path(__file__).resolve().parents[2]
    top = _run(["git", "rev-parse", "--show-toplevel"], cwd=root)
    if not top or Path(top).resolve() != root:  # a copy inside another repository (a device carry folder)
        return "unknown (no git checkout of normkit; see source_sha1)"
    head = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return head + (" + uncommitted changes" if dirty else "")


def _source_digest() -> str:
    """A digest of normkit's own sources, which names the code even where there is no git checkout."""
    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for f in sorted(p for p in pkg.rglob("*") if p.suffix in (".py", ".cu", ".cuh", ".wgsl") and p.is_file()):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _driver() -> str:
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        return smi.splitlines()[0]
    try:
        v = torch._C._cuda_getDriverVersion()
        return f"unknown (CUDA driver API {v // 1000}.{v % 1000 // 10})"
    except Exception:  # noqa: BLE001 - a missing private API only costs this one field
        return "unknown"


def collect(device: str) -> dict:
    from .. import __version__
    env = {"device": device}
    if device == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=p.name, sm=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                   l2_mib=f"{p.L2_cache_size / 2**20:.0f}", gpu_mem_gib=f"{p.total_memory / 2**30:.0f}",
                   driver=_driver(), cuda=torch.version.cuda)
    else:
        env.update(cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
    env.update({name: _version(dist) for name, dist in PACKAGES.items()})
    env.update(normkit=__version__, commit=_commit(), source_sha1=_source_digest(), python=platform.python_version(),
               hostname=socket.gethostname(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    return env
