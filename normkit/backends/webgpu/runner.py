"""The wgpu-py runner: one device per process, pipelines compiled once, kernels run on numpy arrays.

runner() returns the process-wide Runner, creating the device on first use; every failure to get
one (wgpu missing, no adapter) is a WebGPUUnavailable with one sentence saying why, remembered so
later calls answer at once. Runner.run() normalizes the rows of a 2-D numpy array, Runner.group_norm()
the groups of a [B, C, S] (or channels_last [B, S, C]) one; Runner.time()
times a variant for the ladder.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from . import shaders
from .shaders import F16_FEATURE, SUBGROUP_FEATURE, WORKGROUP_SIZE, Variant

_NP_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}
_ALIGN = 16  # buffer sizes are padded to this (copies need multiples of 4; vec4 bindings 16)


class WebGPUError(RuntimeError):
    """Base of the WebGPU backend's errors."""


class WebGPUUnavailable(WebGPUError):
    """No device: wgpu is missing or finds no adapter."""


class FeatureMissing(WebGPUError):
    """The adapter lacks a feature (subgroups, shader-f16) that the requested kernel needs."""


class ShaderError(WebGPUError):
    """A WGSL kernel failed to compile or to build a pipeline."""


def _import_wgpu():
    try:
        import wgpu
    except ImportError as e:
        raise WebGPUUnavailable(f"wgpu is not installed (pip install wgpu): {e}") from None
    return wgpu


def _padded(nbytes: int) -> int:
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


def _as_bytes(a: np.ndarray) -> bytes:
    raw = np.ascontiguousarray(a).tobytes()
    return raw + b"\0" * (_padded(len(raw)) - len(raw))


@dataclass
class _Job:
    """One kernel call's data: x in memory order and how its values split into workgroup rows."""
    op: str                     # layer_norm | rms_norm | group_norm
    x: np.ndarray               # contiguous; y comes back in the same shape
    rows: int                   # rows, or batch x groups: one workgroup each
    n: int                      # values per row
    param_len: int              # values in weight/bias: n, or the channel count for GroupNorm
    groups: int = 0             # GroupNorm only
    spatial: int = 1            # GroupNorm only
    channels_last: bool = False  # GroupNorm only: x is [B, S, C] memory


@dataclass
class _Launch:
    """Everything one dispatch of a kernel needs, kept for repeated dispatches (timing)."""
    pipeline: object
    bind_group: object
    grid: tuple[int, int]
    y: object
    stats: object
    job: _Job


class Runner:
    """A wgpu device with the features normkit can use, and its compiled pipelines."""

    def __init__(self, adapter, *, features=(SUBGROUP_FEATURE, F16_FEATURE)):
        self.wgpu = _import_wgpu()
        self.adapter = adapter
        self.summary = adapter.summary
        wanted = [f for f in features if f in adapter.features]
        limits = adapter.limits
        self.device = adapter.request_device_sync(
            label="normkit",
            required_features=wanted,
            # the defaults cap a binding at 128 MiB; take what the adapter allows
            required_limits={k: limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size")},
        )
        self.max_binding = self.device.limits["max-storage-buffer-binding-size"]
        self.has_f16 = F16_FEATURE in self.device.features
        self.subgroup_size = None
        self.subgroups_off = None  # why the subgroup variants cannot run, if they cannot
        if SUBGROUP_FEATURE not in self.device.features:
            self.subgroups_off = f"the adapter ({self.summary}) has no '{SUBGROUP_FEATURE}' feature"
        self._pipelines: dict = {}
        self._lock = threading.Lock()
        usage = self.wgpu.BufferUsage
        self._storage = usage.STORAGE | usage.COPY_SRC | usage.COPY_DST
        self._uniform = usage.UNIFORM | usage.COPY_DST
        self._layout = self._bind_group_layout()
        self._absent = self.device.create_buffer(size=_ALIGN, usage=self._storage)  # stands in for no weight/bias
        if self.subgroups_off is None:
            try:
                self._probe_subgroups()
            except ShaderError as e:
                self.subgroups_off = f"the subgroup probe kernel did not build: {str(e).splitlines()[0]}"

    @property
    def has_subgroups(self) -> bool:
        return self.subgroups_off is None

    # ------------------------------------------------------------------------- set-up

    def _bind_group_layout(self):
        types = ["uniform", "read-only-storage", "storage", "read-only-storage", "read-only-storage", "storage"]
        stage = self.wgpu.ShaderStage.COMPUTE
        entries = [{"binding": i, "visibility": stage, "buffer": {"type": t}} for i, t in enumerate(types)]
        layout = self.device.create_bind_group_layout(entries=entries)
        self._pipeline_layout = self.device.create_pipeline_layout(bind_group_layouts=[layout])
        return layout

    def compile(self, name: str, code: str, layout=None):
        """A compute pipeline from WGSL source; any compiler or driver error becomes one ShaderError."""
        try:
            module = self.device.create_shader_module(label=name, code=code)
            return self.device.create_compute_pipeline(
                label=name, layout=layout or self._pipeline_layout,
                compute={"module": module, "entry_point": "main"})
        except self.wgpu.GPUError as e:
            detail = "\n".join(line for line in str(e).splitlines() if line.strip())
            raise ShaderError(f"WGSL kernel {name!r} failed to compile on {self.summary}:\n{detail}") from None

    def _probe_subgroups(self):
        """Checks that subgroups are consecutive invocations of one power-of-two size >= 4.

        reduce_subgroup.wgsl puts subgroup s's partial result in slot lid / subgroup_size; that is
        how drivers build subgroups for 1-D workgroups, but no spec promises it, so check once.
        """
        pipeline = self.compile("subgroup_probe", shaders.probe_source(), layout="auto")
        out = self.device.create_buffer(size=WORKGROUP_SIZE * 8, usage=self._storage)
        group = self.device.create_bind_group(
            layout=pipeline.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {"buffer": out}}])
        self._submit(pipeline, group, (1, 1), 1)
        seen = np.frombuffer(self.device.queue.read_buffer(out), dtype=np.uint32).reshape(-1, 2)
        sizes, lanes = seen[:, 0], seen[:, 1]
        size = int(sizes[0])
        lid = np.arange(WORKGROUP_SIZE)
        if not (np.all(sizes == size) and 4 <= size <= WORKGROUP_SIZE and size & (size - 1) == 0
                and np.array_equal(lanes, lid % size)):
            self.subgroups_off = (f"the adapter ({self.summary}) does not build subgroups from consecutive "
                                  f"invocations of one power-of-two size >= 4 (saw sizes {sorted(set(sizes.tolist()))})")
            return
        self.subgroup_size = size

    # ------------------------------------------------------------------------- checks

    def dtype_name(self, dtype) -> str:
        """'f32' or 'f16' for a numpy dtype this device can store, else a clear error."""
        name = _NP_DTYPES.get(np.dtype(dtype))
        if name is None:
            raise TypeError(f"x: expected float32 or float16 data for the WebGPU kernels, got {np.dtype(dtype)}")
        if name == "f16" and not self.has_f16:
            raise FeatureMissing(f"x: float16 needs the adapter feature '{F16_FEATURE}', which "
                                 f"{self.summary} does not have; use float32")
        return name

    def check_variant(self, variant: Variant, n: int, op: str = "layer_norm", spatial: int = 1,
                      channels_last: bool = False) -> None:
        if variant.subgroup and not self.has_subgroups:
            raise FeatureMissing(f"variant {variant.name!r} needs subgroups, but {self.subgroups_off}")
        why = shaders.vec4_blocker(variant, op, n, spatial, channels_last)
        if why is not None:
            raise ValueError(why)

    def best_variant(self, n: int, op: str = "layer_norm", spatial: int = 1, channels_last: bool = False) -> Variant:
        return shaders.best_variant(n, self.has_subgroups, op, spatial, channels_last)

    def pipeline(self, variant: Variant, op: str, dtype: str, activation=None):
        key = (variant.name, op, dtype, activation)
        p = self._pipelines.get(key)
        if p is None:
            name = f"{op}_{variant.name}_{dtype}" + (f"_{activation}" if activation else "")
            p = self.compile(name, shaders.source(variant, op, dtype, activation))
            self._pipelines[key] = p
        return p

    # ------------------------------------------------------------------------- running

    def _buffer(self, data: np.ndarray):
        return self.device.create_buffer_with_data(data=_as_bytes(data), usage=self._storage)

    def _prepare(self, job: _Job, weight, bias, eps, variant, activation=None) -> _Launch:
        x = job.x
        dtype = self.dtype_name(x.dtype)
        kw = dict(op=job.op, spatial=job.spatial, channels_last=job.channels_last)
        variant = self.best_variant(job.n, **kw) if variant is None else _variant(variant)
        self.check_variant(variant, job.n, **kw)
        if x.nbytes > self.max_binding:
            raise ValueError(f"x: {x.nbytes} bytes is more than this adapter binds at once "
                             f"(max-storage-buffer-binding-size {self.max_binding}); split the rows")
        flags = shaders.FLAGS["channels_last"] if job.channels_last else 0
        buffers = []
        for arg, p in (("weight", weight), ("bias", bias)):
            if p is None:
                buffers.append(self._absent)
                continue
            p = np.asarray(p, dtype=np.float32).reshape(-1)
            if p.shape != (job.param_len,):
                what = "x's row length" if job.op != "group_norm" else "x's channel count"
                raise ValueError(f"{arg}: expected {job.param_len} values ({what}), got shape {p.shape}")
            buffers.append(self._buffer(p))
            flags |= shaders.FLAGS[arg]
        params = np.zeros(shaders.PARAMS_BYTES // 4, dtype=np.uint32)
        params[[0, 1, 3, 4, 5]] = job.rows, job.n, flags, job.groups, job.spatial
        params[2:3].view(np.float32)[0] = eps
        uniform = self.device.create_buffer_with_data(data=params.tobytes(), usage=self._uniform)
        xb = self._buffer(x)
        y, stats = self._output(x.nbytes), self._output(job.rows * 8)
        resources = [uniform, xb, y, buffers[0], buffers[1], stats]
        group = self.device.create_bind_group(
            layout=self._layout,
            entries=[{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(resources)])
        return _Launch(self.pipeline(variant, job.op, dtype, activation), group, shaders.grid(job.rows), y, stats, job)

    def _output(self, nbytes: int):
        """A buffer the kernel must fully write (tests replace this to fill it with NaN first)."""
        return self.device.create_buffer(size=_padded(nbytes), usage=self._storage)

    def _submit(self, pipeline, group, grid, repeats: int) -> None:
        encoder = self.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, group)
        for _ in range(repeats):
            compute.dispatch_workgroups(grid[0], grid[1], 1)
        compute.end()
        self.device.queue.submit([encoder.finish()])

    def _results(self, launch: _Launch, stats: bool):
        x, rows = launch.job.x, launch.job.rows
        read = self.device.queue.read_buffer
        y = np.frombuffer(read(launch.y), dtype=x.dtype)[: x.size].reshape(x.shape).copy()
        if not stats:
            return y, None, None
        s = np.frombuffer(read(launch.stats), dtype=np.float32)[: 2 * rows].reshape(rows, 2)
        return y, s[:, 0].copy(), s[:, 1].copy()

    def _execute(self, job: _Job, weight, bias, eps, variant, activation, stats: bool):
        if job.x.size == 0:  # nothing to dispatch; the statistics of empty rows are undefined
            self.dtype_name(job.x.dtype)
            nan = np.full(job.rows, np.nan, np.float32)
            return np.empty(job.x.shape, job.x.dtype), nan, nan.copy()
        with self._lock:
            launch = self._prepare(job, weight, bias, eps, variant, activation)
            self._submit(launch.pipeline, launch.bind_group, launch.grid, 1)
            return self._results(launch, stats)

    def run(self, x: np.ndarray, weight=None, bias=None, eps: float = 1e-5, rms: bool = False, variant=None,
            *, stats: bool = True, activation=None):
        """Normalizes each row of x [M, N] (float32, or float16 with shader-f16).

        weight/bias: [N] or None (any float type; used as float32). variant: a name from
        shaders.VARIANTS, or None for the best one here. activation: None or a name in
        shaders.activation_codes(). Returns (y like x, mean [M], rstd [M]) with mean/rstd float32
        (mean is 0 for RMSNorm), or None for both with stats=False.
        """
        m, n = _rows(x)
        job = _Job("rms_norm" if rms else "layer_norm", x, m, n, n)
        return self._execute(job, weight, bias, eps, variant, activation, stats)

    def group_norm(self, x: np.ndarray, groups: int, weight=None, bias=None, eps: float = 1e-5, variant=None,
                   *, channels_last: bool = False, stats: bool = True, activation=None):
        """GroupNorm of x, a 3-D array in memory order: [B, C, S], or [B, S, C] with channels_last.

        weight/bias: [C] or None. Returns (y like x, mean [B, groups], rstd [B, groups]) with
        mean/rstd float32, or None for both with stats=False.
        """
        if not isinstance(x, np.ndarray) or x.ndim != 3:
            raise ValueError(f"x: expected a 3-D numpy array [B, C, S] (or [B, S, C] with channels_last), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
        b, c, s = (x.shape[0], x.shape[2], x.shape[1]) if channels_last else x.shape
        if not isinstance(groups, int) or groups <= 0 or c % groups:
            raise ValueError(f"groups: expected a positive divisor of the channel count C={c}, got {groups!r}")
        job = _Job("group_norm", x, b * groups, c // groups * s, c, groups, s, channels_last)
        y, mean, rstd = self._execute(job, weight, bias, eps, variant, activation, stats)
        if mean is not None:
            mean, rstd = mean.reshape(b, groups), rstd.reshape(b, groups)
        return y, mean, rstd

    def time(self, x: np.ndarray, weight=None, bias=None, eps: float = 1e-5, rms: bool = False, variant=None,
             *, repeats: int = 5, budget_s: float = 0.05):
        """Seconds per kernel, one sample per repeat: wall time of R back-to-back dispatches in one
        submission, divided by R, with R chosen so a sample takes about budget_s."""
        m, n = _rows(x)
        with self._lock:
            launch = self._prepare(_Job("rms_norm" if rms else "layer_norm", x, m, n, n), weight, bias, eps, variant)
            return self._samples(
                lambda r: self._submit(launch.pipeline, launch.bind_group, launch.grid, r), repeats, budget_s)

    def time_copy(self, nbytes: int, *, repeats: int = 5, budget_s: float = 0.05):
        """Seconds per buffer-to-buffer copy of nbytes: the memory system's ceiling for the ladder."""
        nbytes = _padded(nbytes)
        with self._lock:
            src, dst = self._output(nbytes), self._output(nbytes)

            def submit(r: int) -> None:
                encoder = self.device.create_command_encoder()
                for _ in range(r):
                    encoder.copy_buffer_to_buffer(src, 0, dst, 0, nbytes)
                self.device.queue.submit([encoder.finish()])

            return self._samples(submit, repeats, budget_s)

    def _samples(self, submit, repeats: int, budget_s: float):
        # reading a 16-byte buffer back waits for all work submitted before it (wgpu-py 0.32's
        # on_submitted_work_done_sync fails with a cffi type error)
        wait = lambda: self.device.queue.read_buffer(self._absent)  # noqa: E731
        first = _wait_and_time(wait, submit, 1)  # also the warm-up
        r = int(min(1000, max(1, budget_s / max(first, 1e-7))))
        return [_wait_and_time(wait, submit, r) for _ in range(repeats)]


def _wait_and_time(wait, submit, repeats: int) -> float:
    t0 = time.perf_counter()
    submit(repeats)
    wait()
    return (time.perf_counter() - t0) / repeats


def _rows(x) -> tuple[int, int]:
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"x: expected a 2-D numpy array [rows, N], got {getattr(x, 'shape', type(x).__name__)}")
    return x.shape


def _variant(v) -> Variant:
    if isinstance(v, Variant):
        return v
    if v not in shaders.VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(shaders.VARIANTS)}, got {v!r}")
    return shaders.VARIANTS[v]


# ----------------------------------------------------------------------------- the process's device

_runner: Runner | None = None
_failure: WebGPUUnavailable | None = None
_create_lock = threading.Lock()


def _pick_adapter(wgpu):
    """The adapter wgpu prefers (high performance first). WGPU_BACKEND_TYPE=Vulkan forces a backend
    and WGPUPY_WGPU_ADAPTER_NAME=<part of its name> picks one adapter (both read by wgpu-py)."""
    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception as e:  # wgpu-native reports "no adapter" as an error
        adapter, why = None, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    else:
        why = "none was returned"
    if adapter is None:
        raise WebGPUUnavailable(
            f"wgpu found no WebGPU adapter ({why}); on Linux without a GPU install Mesa's software "
            "Vulkan driver (apt-get install mesa-vulkan-drivers), on a GPU machine its Vulkan loader and driver")
    return adapter


def _create() -> Runner:
    wgpu = _import_wgpu()
    adapter = _pick_adapter(wgpu)
    try:
        return Runner(adapter)
    except wgpu.GPUError as e:  # the device request itself failed
        raise WebGPUUnavailable(f"the WebGPU device on {adapter.summary} could not be created: {e}") from e


def runner() -> Runner:
    """The process's Runner, created on first use; raises WebGPUUnavailable if there can be none."""
    global _runner, _failure
    if _runner is not None:
        return _runner
    with _create_lock:
        if _runner is None:
            if _failure is not None:
                raise _failure
            try:
                _runner = _create()
            except WebGPUUnavailable as e:
                _failure = e
                raise
    return _runner


def unavailable_reason() -> str | None:
    """None if a device can be had, else the one sentence saying why not."""
    try:
        runner()
    except WebGPUUnavailable as e:
        return str(e)
    return None
