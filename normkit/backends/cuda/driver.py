"""Loading and launching NVRTC-built kernels on torch's CUDA context, through the driver API of
cuda-python. Every driver call's status is checked and a failure names the call and the kernel.

Kernel arguments are packed from a KernelSpec's parameter list (names and C types, kept next to
the kernel's description in kernels.py): pack_args needs no GPU, so CI tests it.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass, field

from .nvrtc import CudaBackendError, KernelSpec, build, cuda_module, target_arch, version

# C type of a kernel parameter -> ctypes type. "ptr": any pointer (a tensor, an int address or None).
CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float}
_INT_RANGE = {"i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1)}
MAX_BLOCK_THREADS = 1024
MAX_GRID = (2**31 - 1, 65535, 65535)
SMEM_DEFAULT_LIMIT = 48 * 1024  # above this a kernel must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)

# NORMKIT_CUDA_SYNC=1: synchronize after every launch, so an asynchronous fault names its kernel
SYNC_AFTER_LAUNCH = os.environ.get("NORMKIT_CUDA_SYNC", "0").lower() in ("1", "true", "on", "yes")


class CudaDriverError(CudaBackendError):
    """A CUDA driver call failed."""


# ----------------------------------------------------------------------------- argument packing

def pack_args(spec: KernelSpec, args) -> tuple:
    """The kernelParams array (void*[n], each pointing at a value of the parameter's exact C type)
    for `args` given in the order of spec.params. Returns (array, values): keep both alive until
    the launch has been issued."""
    params = spec.params
    if len(args) != len(params):
        raise TypeError(f"kernel {spec.name}: expected {len(params)} arguments "
                        f"({', '.join(n for n, _ in params)}), got {len(args)}")
    values = []
    for (pname, ctype), a in zip(params, args):
        values.append(_to_ctype(spec, pname, ctype, a))
    array = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    return array, values


def _to_ctype(spec, pname, ctype, a):
    where = f"kernel {spec.name} argument {pname!r}"
    if ctype == "ptr":
        if a is None:
            return ctypes.c_void_p(0)
        if hasattr(a, "data_ptr"):
            return ctypes.c_void_p(a.data_ptr())
        if isinstance(a, int) and not isinstance(a, bool) and a >= 0:
            return ctypes.c_void_p(a)
        raise TypeError(f"{where}: expected a tensor, an address or None, got {type(a).__name__}")
    if ctype in _INT_RANGE:
        if isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(f"{where}: expected an int ({ctype}), got {type(a).__name__}")
        lo, hi = _INT_RANGE[ctype]
        if not lo <= a <= hi:
            raise OverflowError(f"{where}: {a} does not fit the kernel's {ctype}")
        return CTYPES[ctype](a)
    if ctype == "f32":
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            raise TypeError(f"{where}: expected a float, got {type(a).__name__}")
        return ctypes.c_float(a)
    raise ValueError(f"kernel {spec.name}: parameter {pname!r} has unknown C type {ctype!r}")


def needs_smem_opt_in(dynamic: int, static: int, granted: int | None = None) -> bool:
    """Whether `dynamic` bytes of dynamic shared memory need a larger opt-in than `granted`: the
    default 48 KB covers static plus dynamic. (Counting only the dynamic bytes, a kernel with
    exactly 48 KB of stages and 2 KB of static shared memory could not launch, and its occupancy
    query said 0, which sent every such call to the fallback path: runs S4-1/S4-2.)"""
    if granted is not None:  # the dynamic bytes an earlier opt-in granted
        return dynamic > granted
    return dynamic + static > SMEM_DEFAULT_LIMIT


def check_launch_dims(spec: KernelSpec, grid, block, smem: int) -> None:
    """The launch configuration is within CUDA's limits (checked before the driver sees it)."""
    grid, block = tuple(grid), tuple(block)
    if len(grid) != 3 or len(block) != 3:
        raise ValueError(f"kernel {spec.name}: grid and block must have 3 dims, got {grid} and {block}")
    if any(g < 1 or g > m for g, m in zip(grid, MAX_GRID)):
        raise ValueError(f"kernel {spec.name}: grid {grid} outside 1..{MAX_GRID}")
    threads = block[0] * block[1] * block[2]
    if min(block) < 1 or threads > MAX_BLOCK_THREADS:
        raise ValueError(f"kernel {spec.name}: block {block} must have 1..{MAX_BLOCK_THREADS} threads")
    if smem < 0:
        raise ValueError(f"kernel {spec.name}: negative dynamic shared memory {smem}")


# ----------------------------------------------------------------------------- the driver

@functools.lru_cache(maxsize=None)
def bindings():
    """The driver module of cuda-python."""
    return cuda_module("driver", "cuda-python")


def check(result, what: str):
    """Unpack a driver call's (status, *values); raise CudaDriverError naming `what` on failure."""
    drv = bindings()
    status, rest = result[0], result[1:]
    if status != drv.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(f"{what} failed: {error_text(status)}")
    return rest[0] if len(rest) == 1 else (rest or None)


def error_text(status) -> str:
    drv = bindings()
    try:
        name = drv.cuGetErrorName(status)[1]
        desc = drv.cuGetErrorString(status)[1]
        return f"{name.decode() if isinstance(name, bytes) else name}: {desc.decode() if isinstance(desc, bytes) else desc}"
    except Exception:  # noqa: BLE001 - never hide the original failure behind a formatting one
        return str(status)


_init_lock = threading.Lock()
_primary: dict = {}  # device ordinal -> (CUdevice, primary CUcontext)


def _device(index: int):
    with _init_lock:
        if index not in _primary:
            drv = bindings()
            try:
                result = drv.cuInit(0)
            except Exception as e:  # noqa: BLE001 - cuda-python that cannot load libcuda raises its own kinds
                raise CudaDriverError(f"cuda-python could not load the CUDA driver ({type(e).__name__}: {e})") from e
            check(result, "cuInit")
            dev = check(drv.cuDeviceGet(index), f"cuDeviceGet({index})")
            ctx = check(drv.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain(device {index})")
            _primary[index] = (dev, ctx)
        return _primary[index]


def use_device(index: int) -> None:
    """Make torch's context for this device (the primary context) current in this thread; a
    thread torch has not used yet (autograd's device threads, user threads) may have none."""
    drv = bindings()
    _, ctx = _device(index)
    current = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if current is None or int(current) != int(ctx):
        check(drv.cuCtxSetCurrent(ctx), f"cuCtxSetCurrent(device {index})")


@functools.lru_cache(maxsize=None)
def device_attribute(index: int, name: str) -> int:
    drv = bindings()
    dev, _ = _device(index)
    attr = getattr(drv.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    return int(check(drv.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name})"))


def driver_version() -> str:
    try:
        v = check(bindings().cuDriverGetVersion(), "cuDriverGetVersion")
        return f"{v // 1000}.{v % 1000 // 10}"
    except CudaBackendError:
        return "?"


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    return (device_attribute(index, "COMPUTE_CAPABILITY_MAJOR"), device_attribute(index, "COMPUTE_CAPABILITY_MINOR"))


def sm_count(index: int) -> int:
    return device_attribute(index, "MULTIPROCESSOR_COUNT")


def max_smem_optin(index: int) -> int:
    """The most dynamic shared memory one block may opt in to."""
    return device_attribute(index, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")


@dataclass
class Kernel:
    """A loaded kernel on one device."""

    spec: KernelSpec
    device: int
    module: object
    function: object
    smem_granted: int | None = None  # dynamic shared memory opted in to (None: the default 48 KB in all)
    _occupancy: dict = field(default_factory=dict)
    _nonportable: bool = False

    @functools.cached_property
    def static_smem(self) -> int:
        return self.attribute("SHARED_SIZE_BYTES")

    def smem_fits(self, nbytes: int) -> bool:
        """Whether `nbytes` of dynamic shared memory, on top of the kernel's static shared memory,
        fit one block of this GPU."""
        return nbytes + self.static_smem <= max_smem_optin(self.device)

    def allow_smem(self, nbytes: int) -> None:
        """Opt in to `nbytes` of dynamic shared memory (needed once static + dynamic pass 48 KB)."""
        if not needs_smem_opt_in(nbytes, self.static_smem, self.smem_granted):
            return
        if not self.smem_fits(nbytes):
            raise CudaBackendError(f"kernel {self.spec.name}: needs {nbytes} + {self.static_smem} bytes of shared "
                                   f"memory, the GPU allows {max_smem_optin(self.device)} per block")
        drv = bindings()
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(drv.cuFuncSetAttribute(self.function, attr, nbytes),
              f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes}) for kernel {self.spec.name}")
        self.smem_granted = nbytes

    def occupancy(self, block_threads: int, smem: int = 0) -> int:
        """Resident blocks per SM at this block size and dynamic shared memory (0: cannot launch)."""
        key = (block_threads, smem)
        if key not in self._occupancy:
            if not self.smem_fits(smem):
                self._occupancy[key] = 0
            else:
                self.allow_smem(smem)
                drv = bindings()
                self._occupancy[key] = int(check(
                    drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, block_threads, smem),
                    f"cuOccupancyMaxActiveBlocksPerMultiprocessor for kernel {self.spec.name}"))
        return self._occupancy[key]

    def attribute(self, name: str) -> int:
        drv = bindings()
        attr = getattr(drv.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")
        return int(check(drv.cuFuncGetAttribute(attr, self.function), f"cuFuncGetAttribute({name})"))

    def allow_cluster(self, size: int) -> None:
        """Clusters of more than 8 CTAs are "non-portable": the kernel must opt in."""
        if size > 8 and not self._nonportable:
            drv = bindings()
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            check(drv.cuFuncSetAttribute(self.function, attr, 1),
                  f"cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED) for kernel {self.spec.name}")
            self._nonportable = True

    def max_active_clusters(self, block_threads: int, smem: int, cluster: int) -> int:
        """Clusters of `cluster` CTAs that fit on the GPU at once (0: cannot launch)."""
        key = ("clusters", block_threads, smem, cluster)
        if key not in self._occupancy:
            if not self.smem_fits(smem):
                self._occupancy[key] = 0
            else:
                self.allow_smem(smem)
                self.allow_cluster(cluster)
                drv = bindings()
                config = launch_config((cluster, 1, 1), (block_threads, 1, 1), smem, 0, (cluster, 1, 1))
                self._occupancy[key] = int(check(drv.cuOccupancyMaxActiveClusters(self.function, config),
                                                 f"cuOccupancyMaxActiveClusters for kernel {self.spec.name}"))
        return self._occupancy[key]

    def launch(self, grid, block, args, smem: int = 0, stream=None, cluster=None) -> None:
        """Launch on `stream` (default: torch's current stream of the device); cluster: CTAs per
        cluster along x (None: a plain launch)."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        check_launch_dims(self.spec, grid, block, smem)
        self.allow_smem(smem)
        if cluster is not None:
            if grid[0] % cluster:
                raise ValueError(f"kernel {self.spec.name}: grid {grid} is not a whole number of clusters of {cluster}")
            self.allow_cluster(cluster)
        params, _values = pack_args(self.spec, args)  # _values must outlive the call
        if stream is None:
            import torch
            stream = torch.cuda.current_stream(self.device).cuda_stream
        launch(self.function, grid, block, smem, stream, params, None if cluster is None else (cluster, 1, 1),
               self.spec.name, (self.spec, args))


def launch_config(grid, block, smem: int, stream, cluster):
    """A CUlaunchConfig with the cluster dimension attribute."""
    drv = bindings()
    config = drv.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    config.hStream = drv.CUstream(int(stream))
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
    config.attrs = [attr]
    config.numAttrs = 1
    return config


def launch(function, grid, block, smem: int, stream, params, cluster=None, name: str = "kernel",
           source=None) -> None:
    """The one place a CUDA-backend kernel is launched: a CUfunction, 3D grid and block, dynamic
    shared memory bytes, a stream handle, the kernelParams array (pack_args), and the cluster dims
    (None: a plain cuLaunchKernel; else cuLaunchKernelEx with the cluster attribute). source:
    (KernelSpec, args) the params were packed from, which a host-path recording needs to replay
    the launch (the function's shared-memory and cluster-size opt-ins stay set on it)."""
    drv = bindings()
    from ..triton.launch import note_foreign_launch
    note_foreign_launch(name, None if source is None else
                        (source[0], int(function), grid, block, smem, cluster or (0, 0, 0), tuple(source[1])))
    if cluster is None:
        result = drv.cuLaunchKernel(function, *grid, *block, smem, stream, ctypes.addressof(params), 0)
    else:
        result = drv.cuLaunchKernelEx(launch_config(grid, block, smem, stream, cluster), function,
                                      ctypes.addressof(params), 0)
    if result[0] != drv.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(f"launch of kernel {name} (grid {grid}, block {block}, cluster {cluster}, "
                              f"{smem} B shared) failed: {error_text(result[0])}")
    if SYNC_AFTER_LAUNCH:
        check(drv.cuStreamSynchronize(stream), f"kernel {name} (grid {grid}, block {block}) while running")


_loaded: dict = {}
_load_lock = threading.Lock()


def arch_for(index: int) -> str:
    return target_arch(capability(index))


def load(spec: KernelSpec, index: int) -> Kernel:
    """The kernel `spec` built for device `index`'s architecture and loaded into its context."""
    key = (spec, index)
    kernel = _loaded.get(key)
    if kernel is not None:
        return kernel
    compiled = build(spec.source, (spec.name,), arch_for(index), spec.defines)
    with _load_lock:
        kernel = _loaded.get(key)
        if kernel is None:
            drv = bindings()
            use_device(index)
            image = ctypes.create_string_buffer(compiled.image, len(compiled.image))  # an address works in every cuda-python
            result = drv.cuModuleLoadData(ctypes.addressof(image))
            if result[0] != drv.CUresult.CUDA_SUCCESS:
                raise CudaDriverError(
                    f"cuModuleLoadData for kernel {spec.name} ({compiled.arch}, NVRTC {'.'.join(map(str, version()))}, "
                    f"driver CUDA {driver_version()}) failed: {error_text(result[0])}. A driver older than NVRTC "
                    f"may reject its binaries: install the nvidia-cuda-nvrtc / cuda-python major version the "
                    f"driver supports.")
            module = result[1]
            symbol = compiled.lowered[spec.name]
            function = check(drv.cuModuleGetFunction(module, symbol.encode()),
                             f"cuModuleGetFunction({symbol}) for kernel {spec.name}")
            kernel = _loaded[key] = Kernel(spec, index, module, function)
    return kernel
