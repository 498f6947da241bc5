"""The kernel catalog: how each kernel of the .cu sources is named (a C++ name expression built
from a configuration) and what parameters it takes (names and C types, in order).

The parameter lists are the one place the host side states each kernel's C signature; a CI test
compiles every kernel to PTX and checks these lists against the .param entries NVRTC emits.
"""
from __future__ import annotations

import dataclasses

import torch

from . import configs
from .nvrtc import KernelSpec

# element types and activation functors, as the .cu sources spell them
CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
ACTIVATION = {None: "nk::Identity", "relu": "nk::Relu", "silu": "nk::Silu", "mish": "nk::Mish",
              "gelu": "nk::Gelu", "gelu_tanh": "nk::GeluTanh"}


def _p(spec: str) -> tuple:
    """"x:ptr x_stride:i64 ..." -> (("x", "ptr"), ("x_stride", "i64"), ...)"""
    return tuple(tuple(item.split(":")) for item in spec.split())


ROW_FWD_PARAMS = _p("x:ptr x_stride:i64 y:ptr y_stride:i64 weight:ptr bias:ptr mean:ptr rstd:ptr "
                    "rows:i64 cols:i32 eps:f32")
ROW_BWD_PARAMS = _p("dy:ptr dy_stride:i64 x:ptr x_stride:i64 weight:ptr bias:ptr mean:ptr rstd:ptr "
                    "dx:ptr dx_stride:i64 dw_part:ptr db_part:ptr rows:i64 cols:i32")
PARAM_GRAD_PARAMS = _p("dy:ptr dy_stride:i64 x:ptr x_stride:i64 weight:ptr bias:ptr mean:ptr rstd:ptr "
                       "dw_part:ptr db_part:ptr rows:i64 cols:i32 rows_per_split:i64")
ROW_FWD_CLUSTER_PARAMS = _p("x:ptr x_stride:i64 y:ptr y_stride:i64 weight:ptr bias:ptr mean:ptr rstd:ptr "
                            "rows:i64 cols:i32 slice:i32 eps:f32")
ROW_BWD_CLUSTER_PARAMS = ROW_BWD_PARAMS + _p("slice:i32")
GN_FWD_CLUSTER_PARAMS = _p("x:ptr y:ptr weight:ptr bias:ptr mean:ptr rstd:ptr rows:i64 cols:i32 slice:i32 eps:f32 "
                           "groups:i32 spatial:i32")
GN_BWD_CLUSTER_PARAMS = _p("dy:ptr x:ptr weight:ptr bias:ptr mean:ptr rstd:ptr dx:ptr dw_part:ptr db_part:ptr "
                           "rows:i64 cols:i32 slice:i32 groups:i32 spatial:i32")
GN_CL_FWD_CLUSTER_PARAMS = _p("x:ptr y:ptr weight:ptr bias:ptr mean:ptr rstd:ptr C:i32 S:i32 cg:i32 block_c:i32 "
                              "slice:i32 eps:f32")
GN_CL_BWD_CLUSTER_PARAMS = _p("dy:ptr x:ptr weight:ptr bias:ptr mean:ptr rstd:ptr dx:ptr dw_part:ptr db_part:ptr "
                              "C:i32 S:i32 cg:i32 block_c:i32 slice:i32")
COL_SUM_PARAMS = _p("a_part:ptr a:ptr b_part:ptr b:ptr parts:i64 cols:i32")
GN_REDUCE_PARAMS = _p("x:ptr xB:i64 xC:i64 xS:i64 dy:ptr dB:i64 dC:i64 dS:i64 weight:ptr bias:ptr "
                      "mean:ptr rstd:ptr p1:ptr p2:ptr coef:ptr C:i32 S:i32 G:i32 chunk:i32 chunks:i32")
GN_GROUP_PARAMS = _p("p1:ptr p2:ptr weight:ptr mean:ptr rstd:ptr coef:ptr B:i32 C:i32 S:i32 G:i32 "
                     "chunk:i32 chunks:i32 eps:f32")
GN_APPLY_PARAMS = _p("x:ptr xB:i64 xC:i64 xS:i64 dy:ptr dB:i64 dC:i64 dS:i64 out:ptr oB:i64 oC:i64 oS:i64 "
                     "weight:ptr bias:ptr mean:ptr rstd:ptr coef:ptr B:i32 C:i32 S:i32 G:i32")


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def _ctype(dtype) -> str:
    try:
        return CTYPE[dtype]
    except KeyError:
        raise ValueError(f"the CUDA kernels take float32, float16 or bfloat16, not {dtype}") from None


def _act(activation) -> str:
    try:
        return ACTIVATION[activation]
    except KeyError:
        raise ValueError(f"activation: expected None or one of {sorted(k for k in ACTIVATION if k)}, "
                         f"got {activation!r}") from None


# ----------------------------------------------------------------------------- row norms

def row_fwd(dtype, wdtype, activation, rms: bool, plan: configs.RowPlan) -> KernelSpec:
    t, w, a = _ctype(dtype), _ctype(wdtype), _act(activation)
    if plan.impl in ("warp", "regs"):
        name = f"nk::row_fwd_warp<{t}, {w}, {a}, {plan.pack}, {plan.cols_per_thread}, {plan.width}, {_b(rms)}>"
    else:
        name = f"nk::row_fwd_block<{t}, {w}, {a}, {plan.pack}, {_b(rms)}, {_b(plan.cached)}>"
    return KernelSpec("row_norm.cu", name, ROW_FWD_PARAMS)


def row_bwd(dtype, wdtype, activation, rms: bool, plan: configs.RowPlan, want_params: bool) -> KernelSpec:
    t, w, a = _ctype(dtype), _ctype(wdtype), _act(activation)
    if plan.impl in ("warp", "regs"):
        name = (f"nk::row_bwd_warp<{t}, {w}, {a}, {plan.pack}, {plan.cols_per_thread}, {plan.width}, "
                f"{_b(rms)}, {_b(want_params)}>")
    else:
        acc = plan.acc_packs if want_params else 0
        name = f"nk::row_bwd_block<{t}, {w}, {a}, {plan.pack}, {_b(rms)}, {_b(plan.cached)}, {acc}>"
    return KernelSpec("row_norm.cu", name, ROW_BWD_PARAMS)


def row_param_grad(dtype, wdtype, activation, rms: bool) -> KernelSpec:
    name = f"nk::row_param_grad<{_ctype(dtype)}, {_ctype(wdtype)}, {_act(activation)}, {_b(rms)}>"
    return KernelSpec("row_norm.cu", name, PARAM_GRAD_PARAMS)


def _cluster_shape(plan: configs.ClusterPlan) -> tuple:
    """The cluster kernels' template arguments of a plan: (THREADS, ITEMS, STAGES) and the forward's flags
    (RELOAD, PUSH, MERGE, ONE_PASS)."""
    return (f"{plan.threads}, {plan.items}, {plan.stages}",
            f"{_b(plan.recompute)}, {_b(plan.push)}, {_b(plan.merge)}, {_b(plan.one_pass)}")


def row_cluster(direction: str, dtype, wdtype, activation, rms: bool, plan: configs.ClusterPlan,
                want_params: bool = False) -> KernelSpec:
    """The Hopper cluster kernel (row_cluster.cu) for one direction and plan."""
    t, w, a = _ctype(dtype), _ctype(wdtype), _act(activation)
    shape, flags = _cluster_shape(plan)
    if direction == "fwd":
        return KernelSpec("row_cluster.cu",
                          f"nk::row_fwd_cluster<{t}, {w}, {a}, {_b(rms)}, {shape}, {flags}, {plan.sm_threads}, "
                          f"{plan.ahead}, {_b(plan.hold_w)}>",
                          ROW_FWD_CLUSTER_PARAMS)
    return KernelSpec("row_cluster.cu",
                      f"nk::row_bwd_cluster<{t}, {w}, {a}, {_b(rms)}, {shape}, {_b(want_params)}, {_b(plan.recompute)}, "
                      f"{_b(plan.merge)}, {_b(plan.push)}, {_b(plan.overlap)}, {_b(plan.hold_w)}>",
                      ROW_BWD_CLUSTER_PARAMS)


def gn_cluster(direction: str, dtype, wdtype, activation, plan: configs.ClusterPlan,
               want_params: bool = False) -> KernelSpec:
    """GroupNorm over dense NCHW groups as rows of the Hopper cluster kernels (row_cluster.cu)."""
    t, w, a = _ctype(dtype), _ctype(wdtype), _act(activation)
    shape, flags = _cluster_shape(plan)
    if direction == "fwd":
        return KernelSpec("row_cluster.cu", f"nk::gn_fwd_cluster<{t}, {w}, {a}, {shape}, {flags}>",
                          GN_FWD_CLUSTER_PARAMS)
    return KernelSpec("row_cluster.cu",
                      f"nk::gn_bwd_cluster<{t}, {w}, {a}, {shape}, {_b(want_params)}, {_b(plan.recompute)}, "
                      f"{_b(plan.push)}>",
                      GN_BWD_CLUSTER_PARAMS)


def gn_cl_cluster(direction: str, dtype, wdtype, activation, plan, want_params: bool = False) -> KernelSpec:
    """GroupNorm over channels_last groups on Hopper clusters (row_cluster.cu gn_cl_fwd_cluster / gn_cl_bwd_cluster)."""
    t, w, a = _ctype(dtype), _ctype(wdtype), _act(activation)
    if direction == "fwd":
        return KernelSpec("row_cluster.cu", f"nk::gn_cl_fwd_cluster<{t}, {w}, {a}, {plan.threads}>",
                          GN_CL_FWD_CLUSTER_PARAMS)
    return KernelSpec("row_cluster.cu", f"nk::gn_cl_bwd_cluster<{t}, {w}, {a}, {plan.threads}, {_b(want_params)}>",
                      GN_CL_BWD_CLUSTER_PARAMS)


def col_sum(a_dtype, b_dtype) -> KernelSpec:
    """Sums of partial rows into outputs of these dtypes (None: that output is absent)."""
    a = _ctype(a_dtype if a_dtype is not None else torch.float32)
    b = _ctype(b_dtype if b_dtype is not None else torch.float32)
    return KernelSpec("row_norm.cu", f"nk::col_sum<{a}, {b}>", COL_SUM_PARAMS)


# ----------------------------------------------------------------------------- GroupNorm

def gn_reduce(dtype, wdtype, activation, channels_last: bool, backward: bool) -> KernelSpec:
    name = (f"nk::gn_reduce<{_ctype(dtype)}, {_ctype(wdtype)}, {_act(activation if backward else None)}, "
            f"{_b(channels_last)}, {_b(backward)}>")
    return KernelSpec("group_norm.cu", name, GN_REDUCE_PARAMS)


def gn_group(wdtype, backward: bool) -> KernelSpec:
    return KernelSpec("group_norm.cu", f"nk::gn_group<{_ctype(wdtype)}, {_b(backward)}>", GN_GROUP_PARAMS)


def gn_apply(dtype, wdtype, activation, channels_last: bool, backward: bool) -> KernelSpec:
    name = (f"nk::gn_apply<{_ctype(dtype)}, {_ctype(wdtype)}, {_act(activation)}, {_b(channels_last)}, "
            f"{_b(backward)}>")
    return KernelSpec("group_norm.cu", name, GN_APPLY_PARAMS)


# ----------------------------------------------------------------------------- the seeds' ladders

_LLMC_ROW = _p("out:ptr mean:ptr rstd:ptr inp:ptr weight:ptr bias:ptr N:i32 C:i32")
LLMC = {
    "layernorm_forward_kernel1": _LLMC_ROW,
    "mean_kernel": _p("mean:ptr inp:ptr N:i32 C:i32 block_size:i32"),
    "rstd_kernel": _p("rstd:ptr inp:ptr mean:ptr N:i32 C:i32 block_size:i32"),
    "normalization_kernel": _p("out:ptr inp:ptr mean:ptr rstd:ptr weight:ptr bias:ptr B:i32 T:i32 C:i32"),
    "layernorm_forward_kernel3": _LLMC_ROW,
    "layernorm_forward_kernel4": _LLMC_ROW,
    "layernorm_forward_kernel5": _LLMC_ROW,
}


def llmc(name: str) -> KernelSpec:
    return KernelSpec("ladder_llmc.cu", name, LLMC[name])


def seed004_group_norm_mish(chunk_size: int) -> KernelSpec:
    if chunk_size < 1 or chunk_size > 1024 or chunk_size & (chunk_size - 1):
        raise ValueError(f"seed 004's kernel needs a group of a power of two <= 1024 elements, got {chunk_size}")
    return KernelSpec("ladder_gn_mish.cu", f"parallelGroupNormMishKernel<{chunk_size}>",
                      _p("d_input:ptr d_output:ptr d_weights:ptr d_bias:ptr input_length:i32"))


# ----------------------------------------------------------------------------- everything

def row_specs(n: int, dtype, wdtype, activation=None, rms: bool = False) -> list[KernelSpec]:
    """The kernels rows of width n may use (forward and backward, aligned rows: the widest pack
    dividing n), whatever the GPU's occupancy picks: what prebuild() compiles ahead of a run."""
    pack = configs.pick_pack(n, dtype.itemsize, [])
    specs = []
    if n <= configs.WARP_MAX_COLS:
        width, cols = configs.warp_layout(n, pack)
        plan = configs.RowPlan("warp", pack, configs.WARP_BLOCK_THREADS, width, cols)
        specs.append(row_fwd(dtype, wdtype, activation, rms, plan))
        specs += [row_bwd(dtype, wdtype, activation, rms, plan, params) for params in (False, True)]
        return specs
    for direction in ("fwd", "bwd"):
        layout = configs.reg_layout(direction, n, pack, dtype.itemsize)
        if layout is not None:  # the regs impl
            plan = configs.RowPlan("regs", pack, max(layout[0], configs.WARP_BLOCK_THREADS), *layout)
            if direction == "fwd":
                specs.append(row_fwd(dtype, wdtype, activation, rms, plan))
            else:
                specs += [row_bwd(dtype, wdtype, activation, rms, plan, params) for params in (False, True)]
            continue
        acc = max(1, configs.BWD_ACC_ELEMS // pack)  # the block impl (the ladder's forced runs load their own)
        for cached in (True, False):
            plan = configs.RowPlan("block", pack, configs.BLOCK_SIZES[-1], cached=cached, acc_packs=acc)
            if direction == "fwd":
                specs.append(row_fwd(dtype, wdtype, activation, rms, plan))
            else:
                specs += [row_bwd(dtype, wdtype, activation, rms, plan, params) for params in (False, True)]
    specs.append(row_param_grad(dtype, wdtype, activation, rms))
    return specs


def _weight_dtypes(dtype):
    return (dtype,) if dtype == torch.float32 else (dtype, torch.float32)


def warp_layouts() -> list[tuple[int, int, int]]:
    """Every (pack, width, cols_per_thread) the dispatcher can pick for a warp-impl row."""
    out = set()
    for pack in (1, 2, 4, 8):
        for n in range(pack, configs.WARP_MAX_COLS + 1, pack):
            out.add((pack,) + configs.warp_layout(n, pack))
    return sorted(out)


def catalog() -> list[KernelSpec]:
    """A set of instantiations that covers every kernel template, element type combination,
    activation, flag and warp layout at least once (what CI compiles for sm_80 and sm_90)."""
    specs = []
    warp = configs.RowPlan("warp", 4, configs.WARP_BLOCK_THREADS, 32, 8)
    blocks = [configs.RowPlan("block", 4, 256, cached=c, acc_packs=4) for c in (True, False)]
    for dtype in CTYPE:
        for wd in _weight_dtypes(dtype):
            for rms in (False, True):
                for plan in [warp] + blocks:
                    specs.append(row_fwd(dtype, wd, None, rms, plan))
                    for params in (False, True):
                        specs.append(row_bwd(dtype, wd, None, rms, plan, params))
                specs.append(row_param_grad(dtype, wd, None, rms))
            for cl in (False, True):
                for bwd in (False, True):
                    specs.append(gn_reduce(dtype, wd, None, cl, bwd))
                    specs.append(gn_apply(dtype, wd, None, cl, bwd))
        for other in CTYPE:
            specs.append(col_sum(dtype, other))
    for act in ACTIVATION:  # every epilogue, in every kernel family that applies one
        for rms in (False, True):
            for plan in [warp] + blocks:
                specs.append(row_fwd(torch.float16, torch.float32, act, rms, plan))
                specs.append(row_bwd(torch.float16, torch.float32, act, rms, plan, True))
            specs.append(row_param_grad(torch.float16, torch.float32, act, rms))
        for cl in (False, True):
            specs.append(gn_reduce(torch.bfloat16, torch.float32, act, cl, True))
            specs.append(gn_apply(torch.bfloat16, torch.float32, act, cl, False))
            specs.append(gn_apply(torch.bfloat16, torch.float32, act, cl, True))
    for pack, width, cols in warp_layouts():  # every register layout the dispatcher can pick
        plan = configs.RowPlan("warp", pack, configs.WARP_BLOCK_THREADS, width, cols)
        specs.append(row_fwd(torch.float16, torch.float16, None, False, plan))
        specs.append(row_bwd(torch.float16, torch.float16, None, False, plan, True))
    for width in (64, 256, 1024):  # the regs impl: rows across warps (one shape per thread count)
        plan = configs.RowPlan("regs", 8, max(width, configs.WARP_BLOCK_THREADS), width, 16)
        specs.append(row_fwd(torch.bfloat16, torch.float32, None, width == 256, plan))
        specs.append(row_bwd(torch.bfloat16, torch.float32, None, width == 64, plan, True))
    for pack in (1, 2, 4, 8):
        for acc in sorted({max(1, configs.BWD_ACC_ELEMS // pack)}):
            plan = configs.RowPlan("block", pack, configs.BLOCK_SIZES[-1], cached=True, acc_packs=acc)
            specs.append(row_bwd(torch.float16, torch.float16, None, False, plan, True))
            specs.append(row_fwd(torch.float16, torch.float16, None, False, plan))
    for wd in CTYPE:
        for bwd in (False, True):
            specs.append(gn_group(wd, bwd))
    for (direction, elem_bytes), shape in configs.CLUSTER_KERNELS.items():  # sm_90 code (a stub below)
        dtype = {2: torch.bfloat16, 4: torch.float32}[elem_bytes]
        plan = configs.ClusterPlan(*shape[:3], cluster=1, slice=0, smem=0, recompute=len(shape) > 3 and shape[3])
        for rms, act in ((False, None), (True, "silu")):
            for params in ((False, True) if direction == "bwd" else (False,)):
                specs.append(row_cluster(direction, dtype, torch.float32, act, rms, plan, params))
            if direction == "fwd":  # the push exchange, with and without the reload
                for reload in (False, True):
                    p = dataclasses.replace(plan, recompute=reload, push=True)
                    specs.append(row_cluster(direction, dtype, torch.float32, act, rms, p))
                    p = dataclasses.replace(p, merge=True, one_pass=True)  # and the session-10 flags
                    specs.append(row_cluster(direction, dtype, torch.float32, act, rms, p))
                    if reload:  # the register caps CLUSTER_FWD_SM_THREADS sets (session 23)
                        for sm_threads in sorted(set(configs.CLUSTER_FWD_SM_THREADS.values())):
                            specs.append(row_cluster(direction, dtype, torch.float32, act, rms,
                                                     dataclasses.replace(p, sm_threads=sm_threads)))
                        # the parameters fetched ahead, or held over the rows (session 26)
                        specs.append(row_cluster(direction, dtype, torch.float32, act, rms,
                                                 dataclasses.replace(p, ahead=2)))
                        specs.append(row_cluster(direction, dtype, torch.float32, act, rms,
                                                 dataclasses.replace(p, hold_w=True, stages=2)))
        specs.append(row_cluster(direction, torch.float16, torch.float16, "gelu", False, plan, direction == "bwd"))
        if direction == "bwd":  # one value per CTA in the exchange (session 10); the push exchange (session 14)
            specs.append(row_cluster(direction, dtype, torch.float32, None, False, dataclasses.replace(plan, merge=True), True))
            for rms, recompute in ((False, False), (True, True)):
                p = dataclasses.replace(plan, recompute=recompute, push=True)
                specs.append(row_cluster(direction, dtype, torch.float32, None, rms, p, True))
            specs.append(row_cluster(direction, dtype, dtype, "silu", False,
                                     dataclasses.replace(plan, push=True, merge=True), True))
            for rms in (False, True):  # the weight held in registers (session 26), with an activation's bias
                specs.append(row_cluster(direction, dtype, torch.float32, "silu", rms,
                                         dataclasses.replace(plan, push=True, hold_w=True), True))
            # two rows in flight (session 15): three stages, the stage read again; with MERGE and without weights
            p = dataclasses.replace(plan, stages=3, recompute=True, push=True, overlap=True)
            for rms in (False, True):
                specs.append(row_cluster(direction, dtype, torch.float32, "silu" if rms else None, rms, p, True))
            specs.append(row_cluster(direction, dtype, dtype, None, False, dataclasses.replace(p, merge=True), False))
            p = dataclasses.replace(p, stages=2, recompute=False)  # the two rows in two register sets
            specs.append(row_cluster(direction, dtype, torch.float32, None, False, p, True))
            specs.append(row_cluster(direction, dtype, dtype, "silu", True, dataclasses.replace(p, merge=True), False))
    for (direction, elem_bytes), shape in configs.GN_CLUSTER_KERNELS.items():  # GroupNorm NCHW on clusters
        dtype = {2: torch.bfloat16, 4: torch.float32}[elem_bytes]
        plan = configs.ClusterPlan(*shape[:3], cluster=1, slice=0, smem=0, recompute=bool(shape[3]),
                                   push=direction == "fwd" and bool(shape[4]), one_pass=direction == "fwd" and bool(shape[6]))
        for act, wd in ((None, torch.float32), ("silu", dtype), ("mish", torch.float32)):
            for params in ((False, True) if direction == "bwd" else (False,)):
                specs.append(gn_cluster(direction, dtype, wd, act, plan, params))
        specs.append(gn_cluster(direction, torch.float16, torch.float16, "gelu",
                                dataclasses.replace(plan, recompute=not plan.recompute), direction == "bwd"))
        if direction == "bwd":  # the push exchange (session 14; the bf16 default: covered above)
            specs.append(gn_cluster(direction, dtype, torch.float32, "silu", dataclasses.replace(plan, push=True), True))
            specs.append(gn_cluster(direction, dtype, dtype, None, dataclasses.replace(plan, push=True), False))
    for (direction, elem_bytes), shape in configs.GN_CL_CLUSTER_KERNELS.items():  # GroupNorm channels_last
        dtype = {2: torch.bfloat16, 4: torch.float32}[elem_bytes]
        plan = configs.GnClPlan(shape[0], cluster=1, slice=0, block_c=0, smem=0)
        for act, wd in ((None, torch.float32), ("silu", dtype), ("mish", torch.float32)):
            for params in ((False, True) if direction == "bwd" else (False,)):
                specs.append(gn_cl_cluster(direction, dtype, wd, act, plan, params))
        specs.append(gn_cl_cluster(direction, torch.float16, torch.float16, "gelu", plan, direction == "bwd"))
    specs += [llmc(n) for n in LLMC]
    specs += [seed004_group_norm_mish(1 << k) for k in range(5, 11)]
    return list(dict.fromkeys(specs))
