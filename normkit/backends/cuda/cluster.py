"""Rows on Hopper thread-block clusters (row_cluster.cu): host side.

The CUDA backend runs the widths configs.CLUSTER_WIDTHS names here; the Triton backend routes the
widths its tuned table names (triton/configs.py, "cuda" entries) here too. A call is `why_not`
(per call: device, dtypes, alignment), `prepare` (cached per kind of call: plan, loaded kernel,
clusters resident at once), then a launch into buffers the caller allocated, so the caller keeps
its own allocation (and recording) of every buffer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import configs, kernels


@dataclass(frozen=True)
class Prepared:
    plan: configs.ClusterPlan | configs.GnClPlan
    kernel: object  # driver.Kernel
    clusters: int  # the grid's clusters before capping by rows: those resident at once (persistent),
    #                 times configs.CLUSTER_PUSH_WAVES for push forwards

    def grid_clusters(self, rows: int) -> int:
        """Clusters a launch over `rows` rows uses; in the backward, also its partial rows."""
        return max(1, min(self.clusters, rows))


def _aligned16(t) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def why_not(x: torch.Tensor, rows_like=(), weight=None, bias=None, rms_fwd: bool = False) -> str | None:
    """None if the cluster kernels can take x (and the other [M, N] tensors `rows_like`, and the
    parameters), else why not. Cheap: called on every routed call. rms_fwd: for RMSNorm's forward, which
    reads no bias (no public function passes one; the backends' interface may)."""
    if rms_fwd and bias is not None:
        return "RMSNorm's cluster forward takes no bias"
    if x.device.type != "cuda":
        return "x is not a CUDA tensor"
    if x.dtype not in kernels.CTYPE:
        return f"dtype {x.dtype}"
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    unavailable = _unavailable(index)
    if unavailable is not None:
        return unavailable
    if _capability(index) < configs.CLUSTER_MIN_CAPABILITY:
        return "thread-block clusters need compute capability 9.0"
    pack = 16 // x.element_size()
    if x.shape[-1] % pack:
        return f"rows of {x.shape[-1]} columns are not whole 16-byte packs"
    for t in (x,) + tuple(rows_like):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return "a row does not start on a 16-byte boundary"
    params = [p for p in (weight, bias) if p is not None]
    if params:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1 or next(iter(dtypes)) not in (x.dtype, torch.float32):
            return f"weight/bias dtypes {sorted(map(str, dtypes))} (x's dtype or float32 expected)"
        if not all(p.is_contiguous() and _aligned16(p) for p in params):
            return "weight/bias not 16-byte aligned"
    return None


@functools.lru_cache(maxsize=None)
def _unavailable(index: int) -> str | None:
    """Why the CUDA backend cannot build and launch here (cuda-python or NVRTC missing: they are the
    test extra's, not normkit's own dependencies), else None. The Triton backend's routes then keep
    its own kernels instead of failing the call."""
    from . import driver, nvrtc
    try:
        driver.bindings()
        nvrtc.version()  # loads libnvrtc
    except nvrtc.CudaBackendError as e:
        return f"the CUDA backend cannot load: {e}"
    return None


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    from . import driver
    return driver.capability(index)


def _use_device(index: int) -> None:
    """torch's context current in this thread (autograd's device threads may have none)."""
    from . import driver
    driver.use_device(index)


def _load(spec, index):
    from . import driver
    return driver.load(spec, index)


@functools.lru_cache(maxsize=1024)
def prepare(direction: str, cols: int, dtype, wdtype, activation, rms: bool, want_params: bool, index: int,
            shape=None) -> Prepared | None:
    """The plan and loaded kernel for one kind of call; None if the rows cannot take a cluster
    kernel (too wide, or not resident on this GPU). shape: (threads, items, stages) override."""
    plan = configs.plan_cluster(direction, cols, torch.empty((), dtype=dtype).element_size(), shape,
                                "rms" if rms else "ln")
    if plan is None:
        return None
    return _prepared(plan, kernels.row_cluster(direction, dtype, wdtype, activation, rms, plan, want_params), index,
                     direction)


def _prepared(plan, spec, index: int, direction: str) -> Prepared | None:
    """The plan with its kernel loaded and the clusters resident at once (push forwards: times
    CLUSTER_PUSH_WAVES, their clusters each taking few rows; a backward stays one persistent wave: the rows'
    weight-gradient partials are one row per cluster, and GroupNorm's push backward measured slower on many
    waves, run S14-4); None if it cannot launch here."""
    kernel = _load(spec, index)
    if not kernel.smem_fits(plan.smem):
        return None
    clusters = kernel.max_active_clusters(plan.threads, plan.smem, plan.cluster)
    # (a forward holding its parameters over its rows: one wave, each cluster walking rows)
    waves = configs.CLUSTER_PUSH_WAVES if plan.push and direction == "fwd" and not plan.hold_w else 1
    return Prepared(plan, kernel, clusters * waves) if clusters > 0 else None


def launch_fwd(p: Prepared, x, y, weight, bias, mean, rstd, eps: float) -> None:
    """y = norm(x) (and mean/rstd unless None) for x [M, N]; y contiguous like x."""
    M, N = x.shape
    plan = p.plan
    _use_device(p.kernel.device)
    p.kernel.launch((p.grid_clusters(M) * plan.cluster,), (plan.threads,),
                    [x, x.stride(0), y, y.stride(0), weight, bias, mean, rstd, M, N, plan.slice, float(eps)],
                    smem=plan.smem, cluster=plan.cluster)


def launch_bwd(p: Prepared, dy, x, weight, bias, mean, rstd, dx, dw_part, db_part) -> int:
    """dx, and (unless None) the [grid_clusters(M), N] fp32 partial sums of dweight/dbias.
    Returns the number of partial rows written."""
    M, N = x.shape
    plan = p.plan
    clusters = p.grid_clusters(M)
    _use_device(p.kernel.device)
    p.kernel.launch((clusters * plan.cluster,), (plan.threads,),
                    [dy, dy.stride(0), x, x.stride(0), weight, bias, mean, rstd, dx, dx.stride(0), dw_part, db_part,
                     M, N, plan.slice], smem=plan.smem, cluster=plan.cluster)
    return clusters


# ---- GroupNorm over dense NCHW groups (row_cluster.cu gn_fwd_cluster / gn_bwd_cluster)

def gn_why_not(x: torch.Tensor, rows_like=(), weight=None, bias=None) -> str | None:
    """None if the GroupNorm cluster kernels can take x [B, C, S] (and the other tensors of x's
    shape, `rows_like`), else why not. Cheap: called on every routed call."""
    if not x.is_contiguous():
        return "x is not a dense NCHW tensor"
    if x.shape[0] * x.shape[1] >= 2**31:  # the kernels take a group's row index mod G in 32 bits
        return "more than 2^31 rows of channels"
    if any(t.stride() != x.stride() for t in rows_like):
        return "the gradient's strides are not x's"
    pack = 16 // x.element_size() if x.dtype in kernels.CTYPE else 1
    if x.shape[2] % pack:
        return f"{x.shape[2]} positions are not whole 16-byte packs"
    flat = x.view(x.shape[0] * x.shape[1], x.shape[2])  # rows of one channel: why_not's checks apply as is
    why = why_not(flat, tuple(t.view(flat.shape) for t in rows_like))
    if why is not None:
        return why
    params = [p for p in (weight, bias) if p is not None]
    if params and (len({p.dtype for p in params}) > 1 or params[0].dtype not in (x.dtype, torch.float32)):
        return "weight/bias dtypes (x's dtype or float32 expected)"
    if not all(p.is_contiguous() for p in params):
        return "weight/bias not contiguous"
    return None


@functools.lru_cache(maxsize=1024)
def prepare_gn(direction: str, cg: int, spatial: int, dtype, wdtype, activation, want_params: bool, index: int,
               shape=None) -> Prepared | None:
    """prepare() for GroupNorm groups of cg channels of `spatial` positions."""
    plan = configs.plan_gn_cluster(direction, cg, spatial, torch.empty((), dtype=dtype).element_size(),
                                   want_params, shape)
    if plan is None:
        return None
    return _prepared(plan, kernels.gn_cluster(direction, dtype, wdtype, activation, plan, want_params), index,
                     direction)


def launch_gn_fwd(p: Prepared, x, y, weight, bias, mean, rstd, groups: int, eps: float) -> None:
    """y = group_norm(x) and mean/rstd [B, G], for dense x [B, C, S] (NCHW, or channels_last with a
    prepare_gn_cl plan); y dense like x."""
    if isinstance(p.plan, configs.GnClPlan):
        return _launch_gn_cl_fwd(p, x, y, weight, bias, mean, rstd, groups, eps)
    B, C, S = x.shape
    rows, plan = B * groups, p.plan
    _use_device(p.kernel.device)
    p.kernel.launch((p.grid_clusters(rows) * plan.cluster,), (plan.threads,),
                    [x, y, weight, bias, mean, rstd, rows, (C // groups) * S, plan.slice, float(eps), groups, S],
                    smem=plan.smem, cluster=plan.cluster)


def launch_gn_bwd(p: Prepared, dy, x, weight, bias, mean, rstd, dx, dw_part, db_part, groups: int) -> None:
    """dx, and (unless None) the [B, C] fp32 per-sample sums of dweight/dbias, for dense x and dy (NCHW, or
    channels_last with a prepare_gn_cl plan)."""
    if isinstance(p.plan, configs.GnClPlan):
        return _launch_gn_cl_bwd(p, dy, x, weight, bias, mean, rstd, dx, dw_part, db_part, groups)
    B, C, S = x.shape
    rows, plan = B * groups, p.plan
    _use_device(p.kernel.device)
    p.kernel.launch((p.grid_clusters(rows) * plan.cluster,), (plan.threads,),
                    [dy, x, weight, bias, mean, rstd, dx, dw_part, db_part, rows, (C // groups) * S, plan.slice,
                     groups, S], smem=plan.smem, cluster=plan.cluster)


# ---- GroupNorm over channels_last groups (row_cluster.cu gn_cl_fwd_cluster / gn_cl_bwd_cluster)

def gn_cl_why_not(x: torch.Tensor, rows_like=(), weight=None, bias=None) -> str | None:
    """None if the channels_last GroupNorm cluster kernels can take x [B, C, S] (and the other tensors
    of x's shape, `rows_like`), else why not."""
    B, C, S = x.shape
    if x.stride() != (S * C, 1, C):
        return "x is not a dense channels_last tensor"
    if any(t.stride() != x.stride() for t in rows_like):
        return "the gradient's strides are not x's"
    positions = [t.transpose(1, 2).reshape(B * S, C) for t in (x,) + tuple(rows_like)]  # views: a position's channels
    return why_not(positions[0], positions[1:], weight, bias)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=1024)
def prepare_gn_cl(direction: str, batch: int, C: int, S: int, cg: int, dtype, wdtype, activation, want_params: bool,
                  index: int, shape=None) -> Prepared | None:
    """prepare() for channels_last GroupNorm of [batch, C, S] in groups of cg channels."""
    plan = configs.plan_gn_cl_cluster(direction, batch, C, S, cg, torch.empty((), dtype=dtype).element_size(),
                                      _sms(index), shape)
    if plan is None:
        return None
    return _prepared(plan, kernels.gn_cl_cluster(direction, dtype, wdtype, activation, plan, want_params), index,
                     direction)


def _gn_cl_grid(p: Prepared, x) -> tuple:
    """A cluster per (sample, channel block): the grid is every slab, not the resident clusters."""
    B, C, _ = x.shape
    return (B * (C // p.plan.block_c) * p.plan.cluster,)


def _launch_gn_cl_fwd(p: Prepared, x, y, weight, bias, mean, rstd, groups: int, eps: float) -> None:
    """y = group_norm(x) and mean/rstd [B, G] for dense channels_last x [B, C, S]; y channels_last too."""
    _, C, S = x.shape
    plan = p.plan
    _use_device(p.kernel.device)
    p.kernel.launch(_gn_cl_grid(p, x), (plan.threads,),
                    [x, y, weight, bias, mean, rstd, C, S, C // groups, plan.block_c, plan.slice, float(eps)],
                    smem=plan.smem, cluster=plan.cluster)


def _launch_gn_cl_bwd(p: Prepared, dy, x, weight, bias, mean, rstd, dx, dw_part, db_part, groups: int) -> None:
    """dx, and (unless None) the [B, C] fp32 per-sample sums of dweight/dbias, for dense channels_last x and dy."""
    _, C, S = x.shape
    plan = p.plan
    _use_device(p.kernel.device)
    p.kernel.launch(_gn_cl_grid(p, x), (plan.threads,),
                    [dy, x, weight, bias, mean, rstd, dx, dw_part, db_part, C, S, C // groups, plan.block_c,
                     plan.slice], smem=plan.smem, cluster=plan.cluster)
