"""Run-time compilation of this package's .cu sources with NVRTC (no GPU needed here).

A kernel is named by a KernelSpec: the source file, a C++ name expression (a template
instantiation such as "nk::row_fwd_warp<__half, float, nk::Identity, 8, 8, 4, false>"), and its
parameter list (the C types the launcher packs). build() compiles a spec's name expressions for
one architecture into a cubin, and caches the result in memory per (sources, arch, names,
defines, NVRTC, headers) and on disk under ~/.cache/normkit/cuda (NORMKIT_CACHE_DIR overrides,
NORMKIT_CUDA_DISK_CACHE=0 turns it off). NORMKIT_CUDA_DEFINES (space-separated NAME=VALUE) adds -D defines to
every kernel: for measuring a compile-time knob against its default in one run.

cuda_fp16.h / cuda_bf16.h come from the first of these that NVRTC can compile against:
NORMKIT_CUDA_INCLUDE, the nvidia-cuda-runtime wheels, CUDA_HOME / CUDA_PATH, /usr/local/cuda,
the toolkit of the nvcc on PATH, /usr/include, and NVRTC's own bundled headers (NVRTC >= 13.1,
unpacked into the cache folder).
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
STD = "--std=c++17"


class CudaBackendError(RuntimeError):
    """A failure of the CUDA backend that names what failed (kernel, call) and why."""


class NvrtcError(CudaBackendError):
    """NVRTC could not compile a kernel; the message holds the kernel names and the compiler log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: where it lives, its C++ name expression, and its parameters as (name, C type)
    pairs with C type in normkit.backends.cuda.driver.CTYPES."""

    source: str
    name: str
    params: tuple
    defines: tuple = ()

    def __str__(self) -> str:
        return f"{self.name} ({self.source})"


@dataclass(frozen=True)
class Compiled:
    arch: str  # "sm_90" (cubin) or "compute_90" (PTX only, for the driver to JIT)
    image: bytes  # what cuModuleLoadData takes: cubin, or NUL-terminated PTX
    lowered: dict  # name expression -> mangled symbol
    ptx: str | None  # only for fresh compiles (tests read parameter lists from it)
    log: str


# ----------------------------------------------------------------------------- NVRTC handle

def cuda_module(name: str, pip: str):
    """cuda-python's `name` module (cuda.bindings.<name> since 12.6, cuda.<name> before); if
    neither imports, a CudaBackendError that says what to `pip install`."""
    import importlib
    for path in (f"cuda.bindings.{name}", f"cuda.{'cuda' if name == 'driver' else name}"):
        try:
            return importlib.import_module(path)
        except ImportError:
            pass
    raise CudaBackendError(f"cuda-python is not installed (pip install {pip})")


@functools.lru_cache(maxsize=None)
def bindings():
    """The NVRTC module of cuda-python."""
    return cuda_module("nvrtc", "cuda-python nvidia-cuda-nvrtc")


def _ok(nvrtc, result, what: str):
    """Unpack an NVRTC call's (status, *values), raising with the call's name on failure."""
    status, rest = result[0], result[1:]
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(status)
        raise CudaBackendError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg}")
    return rest[0] if len(rest) == 1 else rest


@functools.lru_cache(maxsize=None)
def version() -> tuple[int, int]:
    nvrtc = bindings()
    try:
        major, minor = _ok(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
    except CudaBackendError:
        raise
    except Exception as e:  # noqa: BLE001 - cuda-python without a loadable libnvrtc raises its own kinds
        raise CudaBackendError(f"NVRTC could not be loaded ({type(e).__name__}: {e}); "
                               "pip install nvidia-cuda-nvrtc matching cuda-python's major version") from e
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def supported_archs() -> tuple[int, ...]:
    version()  # says clearly when libnvrtc cannot be loaded
    nvrtc = bindings()
    archs = _ok(nvrtc, nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    return tuple(sorted(int(a) for a in archs))


def target_arch(capability: tuple[int, int]) -> str:
    """The -arch for a GPU of this compute capability: a cubin when NVRTC knows the GPU, else PTX
    for the newest architecture it knows (the driver compiles that for the GPU)."""
    cc = capability[0] * 10 + capability[1]
    archs = supported_archs()
    if cc in archs:
        return f"sm_{cc}"
    older = [a for a in archs if a <= cc]
    if not older:
        v = version()
        raise CudaBackendError(
            f"this GPU (sm_{cc}) is older than NVRTC {v[0]}.{v[1]} can compile for (sm_{archs[0]} and newer)")
    return f"compute_{older[-1]}"


# ----------------------------------------------------------------------------- headers

_PROBE = '#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n__global__ void normkit_probe(__half* h, __nv_bfloat16* b)' \
         ' { h[0] = __float2half(__bfloat162float(b[0])); }\n'


def cache_dir() -> Path:
    base = os.environ.get("NORMKIT_CACHE_DIR")
    if base:
        return Path(base) / "cuda"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "normkit" / "cuda"


def _header_candidates() -> list[tuple[str, str | None]]:
    """(where it came from, include dir or None for NVRTC's bundled headers), in order."""
    out: list[tuple[str, str | None]] = []
    for d in filter(None, os.environ.get("NORMKIT_CUDA_INCLUDE", "").split(os.pathsep)):
        out.append(("NORMKIT_CUDA_INCLUDE", d))
    try:  # cuda-pathfinder knows the wheel, conda and CUDA_HOME layouts
        from cuda import pathfinder
        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            out.append(("cuda.pathfinder", str(found)))
    except Exception:  # noqa: BLE001 - optional helper; any failure just means "not found here"
        pass
    for site in sys.path:
        for d in sorted(glob.glob(os.path.join(site, "nvidia", "*", "include"))):
            out.append(("nvidia wheel", d))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append((var, os.path.join(os.environ[var], "include")))
    out.append(("/usr/local/cuda", "/usr/local/cuda/include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        out.append(("nvcc on PATH", os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")))
    out.append(("/usr/include", "/usr/include"))
    out.append(("NVRTC bundled headers", None))
    return out


def _bundled_headers() -> str:
    nvrtc = bindings()
    if not hasattr(nvrtc, "nvrtcInstallBundledHeaders"):
        raise CudaBackendError(f"NVRTC {'.'.join(map(str, version()))} has no bundled headers (13.1 and newer do)")
    path = cache_dir() / "nvrtc-headers-{}.{}".format(*version())
    result = nvrtc.nvrtcInstallBundledHeaders(str(path).encode(), 0)
    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CudaBackendError(f"nvrtcInstallBundledHeaders({path}) failed: {result[1:]}")
    return str(path)


_include_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _include_dir_for(arch: str) -> str:
    tried = []
    for origin, d in _header_candidates():
        try:
            if d is None:
                d = _bundled_headers()
            elif not os.path.isfile(os.path.join(d, "cuda_fp16.h")):
                continue
            _nvrtc_compile(_PROBE, "normkit_probe.cu", ["normkit_probe"], [f"--gpu-architecture={arch}", STD, f"-I{d}"])
            return d
        except CudaBackendError as e:
            tried.append(f"  {origin}: {d}: {str(e).splitlines()[-1] if str(e) else e}")
    v = version()
    raise CudaBackendError(
        f"NVRTC {v[0]}.{v[1]} found no cuda_fp16.h / cuda_bf16.h it can compile for {arch}. Tried:\n"
        + ("\n".join(tried) or "  (no folder with cuda_fp16.h)")
        + f"\nSet NORMKIT_CUDA_INCLUDE to the include folder of a CUDA {v[0]}.x toolkit "
          f"(or pip install nvidia-cuda-runtime).")


def include_dir(arch: str) -> str:
    with _include_lock:
        return _include_dir_for(arch)


# ----------------------------------------------------------------------------- compile

def sources_digest() -> str:
    """Hash of every .cu/.cuh in this package: any edit invalidates every cached binary."""
    h = hashlib.sha256()
    for p in sorted(SOURCE_DIR.glob("*.cu*")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


_digest = functools.lru_cache(maxsize=None)(sources_digest)


def read_source(source: str) -> str:
    path = SOURCE_DIR / source
    if not path.is_file():
        raise CudaBackendError(f"CUDA source {source!r} not found in {SOURCE_DIR}")
    return path.read_text()


def _nvrtc_compile(code: str, filename: str, names: list[str], options: list[str], want_ptx: bool = False):
    """Compile `code`; returns (cubin or None, ptx or None, {name: lowered}, log)."""
    nvrtc = bindings()
    prog = _ok(nvrtc, nvrtc.nvrtcCreateProgram(code.encode(), filename.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for n in names:
            _ok(nvrtc, nvrtc.nvrtcAddNameExpression(prog, n.encode()), f"nvrtcAddNameExpression({n})")
        status = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])[0]
        size = _ok(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _ok(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\0").decode(errors="replace").strip()
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            arch = next((o.split("=", 1)[1] for o in options if o.startswith("--gpu-architecture=")), "?")
            kernels = ", ".join(names) or "(no kernels)"
            raise NvrtcError(f"NVRTC failed to compile {kernels} from {filename} for {arch}:\n{log}", log)
        lowered = {}
        for n in names:
            mangled = _ok(nvrtc, nvrtc.nvrtcGetLoweredName(prog, n.encode()), f"nvrtcGetLoweredName({n})")
            lowered[n] = mangled.decode() if isinstance(mangled, bytes) else str(mangled)
        cubin = ptx = None
        if any(o.startswith("--gpu-architecture=sm_") for o in options):
            size = _ok(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            cubin = b" " * size
            _ok(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        if want_ptx or cubin is None:
            size = _ok(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            ptx = b" " * size
            _ok(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
            ptx = ptx.rstrip(b"\0").decode()
        return cubin, ptx, lowered, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


FAST_COMPILE_SINCE = (12, 8)  # NVRTC's --Ofast-compile


def options(arch: str, defines: tuple = (), fast: bool = False) -> list[str]:
    """NVRTC options. fast: skip most optimization (CI checks that code compiles, it never runs it)."""
    opts = [f"--gpu-architecture={arch}", STD, "-default-device", f"-I{SOURCE_DIR}", f"-I{include_dir(arch)}"]
    if fast and version() >= FAST_COMPILE_SINCE:
        opts.append("--Ofast-compile=max")
    return opts + [f"-D{d}" for d in defines]


def _cache_key(source: str, names: tuple, arch: str, defines: tuple) -> str:
    inc = include_dir(arch)
    fp16 = os.path.join(inc, "cuda_fp16.h")
    stamp = os.stat(fp16).st_mtime_ns if os.path.exists(fp16) else 0
    blob = json.dumps([_digest(), source, list(names), arch, list(defines), version(), inc, stamp])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _disk_cache_on() -> bool:
    return os.environ.get("NORMKIT_CUDA_DISK_CACHE", "1").lower() not in ("0", "false", "off", "no")


_memory: dict = {}
_memory_lock = threading.Lock()


def build(source: str, names, arch: str, defines=(), *, want_ptx: bool = False,
          use_disk_cache: bool | None = None, fast: bool = False) -> Compiled:
    """Compile the name expressions `names` of `source` for `arch` (cached). fast: see options()."""
    # NORMKIT_CUDA_DEFINES: more -D defines for every kernel (space-separated NAME=VALUE), for A/B measurements
    # of a compile-time knob in one device call (run S16-3); part of both cache keys
    names, defines = tuple(names), tuple(defines) + tuple(os.environ.get("NORMKIT_CUDA_DEFINES", "").split())
    mkey = (source, names, arch, defines, fast)
    with _memory_lock:
        hit = _memory.get(mkey)
    if hit is not None and (hit.ptx is not None or not want_ptx):
        return hit
    disk = _disk_cache_on() if use_disk_cache is None else use_disk_cache
    key = _cache_key(source, names, arch, defines + (("fast",) if fast else ()))
    folder = cache_dir()
    if disk and not want_ptx:
        try:
            meta = json.loads((folder / f"{key}.json").read_text())
            result = Compiled(arch, (folder / f"{key}.bin").read_bytes(), meta["lowered"], None, meta.get("log", ""))
            with _memory_lock:
                _memory[mkey] = result
            return result
        except (OSError, ValueError, KeyError):
            pass  # not cached yet (or a torn write): compile
    cubin, ptx, lowered, log = _nvrtc_compile(read_source(source), source, list(names),
                                              options(arch, defines, fast), want_ptx=want_ptx)
    image = cubin if cubin is not None else ptx.encode() + b"\0"
    result = Compiled(arch, image, lowered, ptx, log)
    with _memory_lock:
        _memory[mkey] = result
    if disk:
        _write_cache(folder, key, result)
    return result


def _write_cache(folder: Path, key: str, result: Compiled) -> None:
    try:  # a read-only or full cache folder only costs recompiles
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(result.image)
        os.replace(tmp, folder / f"{key}.bin")
        tmp.write_text(json.dumps({"lowered": result.lowered, "log": result.log}))
        os.replace(tmp, folder / f"{key}.json")  # written last: its presence means the .bin is whole
    except OSError:
        pass


def build_specs(specs, arch: str, *, threads: int | None = None, want_ptx: bool = False,
                  use_disk_cache: bool | None = None) -> dict:
    """Compile many specs, one NVRTC program each, on a thread pool (NVRTC releases the GIL).
    Returns {spec: Compiled}. The first failure is raised after all have finished."""
    from concurrent.futures import ThreadPoolExecutor

    specs = list(dict.fromkeys(specs))
    include_dir(arch)  # probe the headers once, before the threads race to do it
    workers = threads or min(len(specs), os.cpu_count() or 1) or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {s: pool.submit(build, s.source, (s.name,), arch, s.defines, want_ptx=want_ptx,
                                  use_disk_cache=use_disk_cache) for s in specs}
    return {s: f.result() for s, f in futures.items()}
