"""`normkit ladder --backend cuda`: the seeds' CUDA kernels, run and checked on the GPU at hand.

Four tables, each kernel timed (CUDA events, L2 flushed before every repetition, median) and
compared with the float64 oracle (normkit.reference):

  1. llm.c forward ladder (seed 001), kernels 1-5 at B=8, T=1024, C=768 fp32, block size 512, as
     in the seed's table: GB/s, speedup over kernel 1, fraction of the copy ceiling, error.
  2. OneFlow's kernels (seed 003) at 49152 rows x 32..32768 columns, half: warp / block-smem /
     block-uncached, vectorized, plus the dispatcher's choice with scalar (unpacked) accesses, and
     torch.nn.functional.layer_norm.
  3. Precision: rows offset by 1e4 (unit variance): one-pass E[x^2] - E[x]^2 (llm.c kernels 4, 5)
     fails; two-pass and Welford pass.
  4. GroupNorm + Mish (seed 004): the seed's fused kernel at its own shape, normkit's CUDA
     GroupNorm (both layouts) and torch eager, there and at a Stable-Diffusion-sized shape.

Bandwidth counts what a perfect kernel moves: read x + write y (the seeds' accounting; the few
bytes of mean/rstd are not counted). The ceiling is a 1 GiB device-to-device copy (read + write)
measured in the same run.
"""
from __future__ import annotations

import csv
import datetime
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

LLMC_SHAPE = (8, 1024, 768)  # B, T, C
LLMC_BLOCK = 512
LLMC_BLOCK_SWEEP = (32, 64, 128, 256, 512, 1024)
ONEFLOW_ROWS = 49152
ONEFLOW_WIDTHS = tuple(32 << k for k in range(11))  # 32 .. 32768
QUICK_ROWS, QUICK_WIDTHS = 8192, (32, 256, 1024, 4096, 32768)  # --quick
ONEFLOW_IMPLS = ("warp", "block-smem", "block-uncached")
PRECISION_SHAPE = (8192, 768)
PRECISION_OFFSET = 1e4
PRECISION_PASS = 1e-2  # relative error a LayerNorm must stay under on offset rows (the bf16 test bound)
SEED004_SHAPE = (1, 64, 128, 8)  # B, C, L, G: 1024 elements per group, the seed's one-block groups
GN_BIG_SHAPE = (8, 320, 64 * 64, 32)  # B, C, S, G (a Stable Diffusion UNet block at 512 px)
ORACLE_ROWS = 512  # rows of a big OneFlow input compared with the float64 oracle
COPY_BYTES = 1 << 30
DEVICE = "cuda"
SPIN_CYCLES = 300_000  # ~0.2 ms of GPU spin before each timed run, to cover the host's launch work


def add_arguments(parser) -> None:
    pass  # normkit.ladder adds --plot, --out, --quick


@dataclass
class Row:
    section: str
    kernel: str
    shape: str
    dtype: str
    ms: float = math.nan
    gbps: float = math.nan
    of_ceiling: float = math.nan
    speedup: float = math.nan  # over the section's baseline (llm.c kernel 1; torch for OneFlow)
    max_err: float = math.nan
    rel_err: float = math.nan
    note: str = ""
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- measuring

class Timer:
    def __init__(self, quick: bool):
        import torch
        self.torch = torch
        self.reps, self.warmup = (5, 2) if quick else (20, 3)
        # writing this much evicts the L2 (60 MB on H200) before every timed repetition
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)

    def ms(self, fn) -> float:
        """Median GPU time of fn() in ms. The GPU is kept busy (L2 flush, then a spin) while the
        CPU issues fn's launches, so host overhead does not show in the timing of short kernels."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(SPIN_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return sorted(s.elapsed_time(e) for s, e in times)[len(times) // 2]


def copy_ceiling(timer: Timer) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting the read and the write."""
    torch = timer.torch
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / timer.ms(lambda: dst.copy_(src)) / 1e6


def _errors(out, ref) -> tuple[float, float]:
    """(max |out - ref|, relative error): a NaN where the oracle is finite counts as inf."""
    import torch

    from normkit.reference import rel_err
    r = ref.to(out.device, torch.float64)
    d = (out.double() - r).abs()
    d = torch.where(torch.isnan(r), torch.zeros_like(d), torch.where(torch.isnan(d), math.inf, d))
    return float(d.max()) if d.numel() else 0.0, rel_err(out, ref)


def _fill(row: Row, ms: float, nbytes: int, ceiling: float) -> Row:
    row.ms = ms
    row.gbps = nbytes / ms / 1e6
    row.of_ceiling = row.gbps / ceiling
    return row


# ----------------------------------------------------------------------------- 1. llm.c

def _llmc_runners(index):
    from . import configs, driver, kernels

    k = {name: driver.load(kernels.llmc(name), index) for name in kernels.LLMC}
    cdiv = configs.cdiv

    def per_row(name):
        return lambda o, m, r, x, w, b, N, C, bs: k[name].launch((cdiv(N, bs),), (bs,), [o, m, r, x, w, b, N, C])

    def kernel2(o, m, r, x, w, b, N, C, bs):
        k["mean_kernel"].launch((N,), (bs,), [m, x, N, C, bs], smem=bs * 4)
        k["rstd_kernel"].launch((N,), (bs,), [r, x, m, N, C, bs], smem=bs * 4)
        k["normalization_kernel"].launch((cdiv(N * C, 256),), (256,), [o, x, m, r, w, b, N, 1, C])

    def warp_per_row(name):
        return lambda o, m, r, x, w, b, N, C, bs: k[name].launch((cdiv(N * 32, bs),), (bs,), [o, m, r, x, w, b, N, C])

    return {
        "kernel 1: thread per row": per_row("layernorm_forward_kernel1"),
        "kernel 2: mean / rstd / normalize kernels": kernel2,
        "kernel 3: warp per row, two-pass": warp_per_row("layernorm_forward_kernel3"),
        "kernel 4: warp per row, E[x^2] - E[x]^2": warp_per_row("layernorm_forward_kernel4"),
        "kernel 5: block per row, E[x^2] - E[x]^2": lambda o, m, r, x, w, b, N, C, bs: k["layernorm_forward_kernel5"].launch(
            (N,), (bs,), [o, m, r, x, w, b, N, C]),
    }


def llmc_table(timer, ceiling, index, quick) -> tuple[list[Row], list[dict]]:
    import torch
    import torch.nn.functional as F

    from normkit import reference
    from normkit.backends import cuda as backend

    B, T, C = LLMC_SHAPE
    N = B * T
    x = torch.randn(N, C, device=DEVICE)
    w, b = torch.randn(C, device=DEVICE), torch.randn(C, device=DEVICE)
    ref = reference.layer_norm(x, (C,), w, b)[0]
    out = torch.empty_like(x)
    mean, rstd = torch.empty(N, device=DEVICE), torch.empty(N, device=DEVICE)
    nbytes = 2 * x.numel() * 4
    shape = f"B={B} T={T} C={C}"
    rows, sweep = [], []
    for name, run in _llmc_runners(index).items():
        out.fill_(math.nan)
        run(out, mean, rstd, x, w, b, N, C, LLMC_BLOCK)
        row = _fill(Row("llm.c", name, shape, "fp32", note=f"block {LLMC_BLOCK}"), 
                    timer.ms(lambda: run(out, mean, rstd, x, w, b, N, C, LLMC_BLOCK)), nbytes, ceiling)
        row.max_err, row.rel_err = _errors(out, ref)
        rows.append(row)
        for bs in (LLMC_BLOCK_SWEEP if not quick else (128, 512)):
            ms = timer.ms(lambda: run(out, mean, rstd, x, w, b, N, C, bs))
            sweep.append({"kernel": name, "block": bs, "gbps": nbytes / ms / 1e6})
    peers = {
        "normkit cuda (OneFlow dispatch)": lambda: backend.row_norm_fwd(x, w, b, 1e-5, False)[0],
        "torch.nn.functional.layer_norm": lambda: F.layer_norm(x, (C,), w, b),
    }
    for name, fn in peers.items():
        y = fn()
        row = _fill(Row("llm.c", name, shape, "fp32", note="peer"), timer.ms(fn), nbytes, ceiling)
        row.max_err, row.rel_err = _errors(y, ref)
        rows.append(row)
    base = rows[0].gbps
    for r in rows:
        r.speedup = r.gbps / base
    return rows, sweep


# ----------------------------------------------------------------------------- 2. OneFlow

def _oneflow_specs(widths, dtype):
    """The kernels the OneFlow table runs, to compile in parallel before timing."""
    from . import configs, kernels

    specs = []
    pack = 16 // 2
    for n in widths:
        for p in (pack, 1):
            if n <= configs.WARP_MAX_COLS:
                width, cols = configs.warp_layout(n, p)
                specs.append(kernels.row_fwd(dtype, dtype, None, False, configs.RowPlan("warp", p, 128, width, cols)))
            for cached in (True, False):
                specs.append(kernels.row_fwd(dtype, dtype, None, False, configs.RowPlan("block", p, configs.BLOCK_SIZES[-1], cached=cached)))
    return specs


def oneflow_table(timer, ceiling, index, quick) -> list[Row]:
    import torch

    M = ONEFLOW_ROWS if not quick else QUICK_ROWS
    rows = []
    for n in ONEFLOW_WIDTHS if not quick else QUICK_WIDTHS:
        rows += _oneflow_width(timer, ceiling, M, n)
        torch.cuda.empty_cache()  # the next width's tensors have another size
    return rows


def _oneflow_width(timer, ceiling, M, n) -> list[Row]:
    """One width: each implementation forced (vectorized), the dispatcher's pick with scalar
    accesses, and torch, timed on [M, n] half; errors on ORACLE_ROWS rows spread over x."""
    import torch
    import torch.nn.functional as F

    from normkit import reference
    from normkit.backends import cuda as backend

    x = torch.randn(M, n, device=DEVICE).half()
    w, b = torch.randn(n, device=DEVICE).half(), torch.randn(n, device=DEVICE).half()
    pick = torch.linspace(0, M - 1, min(M, ORACLE_ROWS), device=DEVICE).long()
    ref = reference.layer_norm(x[pick], (n,), w, b)[0]
    nbytes = 2 * x.numel() * x.element_size()
    shape = f"{M} x {n}"
    torch_row = _fill(Row("OneFlow", "torch.nn.functional.layer_norm", shape, "fp16", note="peer"),
                      timer.ms(lambda: F.layer_norm(x, (n,), w, b)), nbytes, ceiling)
    torch_row.max_err, torch_row.rel_err = _errors(F.layer_norm(x[pick], (n,), w, b), ref)
    chosen = backend._row_fwd(x[:1], w, b, 1e-5, False)[3]
    rows = []
    for impl, pack in [(impl, None) for impl in ONEFLOW_IMPLS] + [("dispatch", 1)]:
        force = None if impl == "dispatch" else impl
        label = impl if pack is None else "dispatch, scalar (pack 1)"
        try:
            y, _, _, plan = backend._row_fwd(x, w, b, 1e-5, False, force=force, pack=pack)
        except ValueError as e:  # this implementation cannot take this width
            rows.append(Row("OneFlow", label, shape, "fp16", note=f"n/a: {e}"))
            continue
        row = _fill(Row("OneFlow", label, shape, "fp16"),
                    timer.ms(lambda: backend._row_fwd(x, w, b, 1e-5, False, force=force, pack=pack)), nbytes, ceiling)
        row.max_err, row.rel_err = _errors(y[pick], ref)
        row.note = (f"{plan.name}, " if impl == "dispatch" else "") + f"pack {plan.pack}, block {plan.block}" + (
            " (dispatch's choice)" if plan == chosen else "")
        row.extra = {"impl": plan.name, "pack": plan.pack, "block": plan.block}
        rows.append(row)
    for r in rows + [torch_row]:
        r.speedup = r.gbps / torch_row.gbps
        r.extra["n"] = n
    return rows + [torch_row]


# ----------------------------------------------------------------------------- 3. precision

def precision_table(index) -> list[Row]:
    import torch
    import torch.nn.functional as F

    from normkit import reference
    from normkit.backends import cuda as backend

    M, C = PRECISION_SHAPE
    x = PRECISION_OFFSET + torch.randn(M, C, device=DEVICE)
    w, b = torch.randn(C, device=DEVICE), torch.randn(C, device=DEVICE)
    ref = reference.layer_norm(x, (C,), w, b)[0]
    shape = f"{M} x {C}, rows = {PRECISION_OFFSET:g} + N(0, 1)"
    rows = []
    out = torch.empty_like(x)
    mean, rstd = torch.empty(M, device=DEVICE), torch.empty(M, device=DEVICE)
    method = {"1": "two-pass, serial fp32 sums", "2": "two-pass, tree sums", "3": "two-pass, tree sums",
              "4": "E[x^2] - E[x]^2", "5": "E[x^2] - E[x]^2"}
    for name, run in _llmc_runners(index).items():
        out.fill_(math.nan)
        run(out, mean, rstd, x, w, b, M, C, LLMC_BLOCK)
        rows.append(Row("precision", f"llm.c {name}", shape, "fp32", note=method[name.split()[1].rstrip(":")]))
        rows[-1].max_err, rows[-1].rel_err = _errors(out, ref)
    for impl in ONEFLOW_IMPLS:
        y = backend._row_fwd(x, w, b, 1e-5, False, force=impl)[0]
        rows.append(Row("precision", f"normkit cuda {impl}", shape, "fp32", note="Welford on shifted data"))
        rows[-1].max_err, rows[-1].rel_err = _errors(y, ref)
    rows.append(Row("precision", "torch.nn.functional.layer_norm", shape, "fp32", note="torch"))
    rows[-1].max_err, rows[-1].rel_err = _errors(F.layer_norm(x, (C,), w, b), ref)
    for r in rows:
        ok = r.rel_err <= PRECISION_PASS
        r.extra = {"pass": "pass" if ok else "FAIL"}
    return rows


# ----------------------------------------------------------------------------- 4. GroupNorm + Mish

def groupnorm_table(timer, ceiling, index) -> list[Row]:
    import torch
    import torch.nn.functional as F

    from normkit import reference
    from normkit.backends import cuda as backend

    from . import driver, kernels

    rows = []

    def gn_row(label, shape, dtype_name, fn, nbytes, ref, note=""):
        y = fn()
        row = _fill(Row("GroupNorm+Mish", label, shape, dtype_name, note=note), timer.ms(fn), nbytes, ceiling)
        row.max_err, row.rel_err = _errors(y, ref)
        rows.append(row)

    def torch_gn(x, G, w, b):
        return F.mish(F.group_norm(x, G, w, b, 1e-5))

    # the seed's shape: one batch item, fp32, 1024-element groups
    B, C, L, G = SEED004_SHAPE
    x = torch.randn(B, C, L, device=DEVICE)
    w, b = torch.randn(C, device=DEVICE), torch.randn(C, device=DEVICE)
    ref = reference.group_norm(x, G, w, b, 1e-5, activation_name="mish")[0]
    nbytes = 2 * x.numel() * 4
    shape = f"B={B} C={C} L={L} G={G}"
    chunk = C * L // G
    seed = driver.load(kernels.seed004_group_norm_mish(chunk), index)
    y_seed = torch.empty_like(x)
    gn_row("seed 004: fused, block per group", shape, "fp32",
           lambda: (seed.launch((G,), (chunk,), [x, y_seed, w, b, L]), y_seed)[1], nbytes, ref)
    gn_row("normkit cuda group_norm(activation='mish')", shape, "fp32",
           lambda: backend.group_norm_fwd(x, G, w, b, 1e-5, "mish")[0], nbytes, ref)
    gn_row("torch F.group_norm + F.mish", shape, "fp32", lambda: torch_gn(x, G, w, b), nbytes, ref, note="peer")

    # a big shape, where the seed's one-block groups cannot run
    B, C, S, G = GN_BIG_SHAPE
    side = math.isqrt(S)
    x = torch.randn(B, C, side, side, device=DEVICE).half()
    w, b = torch.randn(C, device=DEVICE).half(), torch.randn(C, device=DEVICE).half()
    ref = reference.group_norm(x, G, w, b, 1e-5, activation_name="mish")[0]
    nbytes = 2 * x.numel() * 2
    rows.append(Row("GroupNorm+Mish", "seed 004: fused, block per group", f"B={B} C={C} {side}x{side} G={G}", "fp16",
                    note="n/a: the seed's kernel takes fp32, one batch item, and groups of at most 1024 elements"))
    for layout, x4 in (("NCHW", x), ("channels_last", x.contiguous(memory_format=torch.channels_last))):
        shape = f"B={B} C={C} {side}x{side} G={G} {layout}"
        gn_row("normkit cuda group_norm(activation='mish')", shape, "fp16",
               lambda x4=x4: _gn_fwd_4d(backend, x4, G, w, b), nbytes, ref)
        gn_row("torch F.group_norm + F.mish", shape, "fp16", lambda x4=x4: torch_gn(x4, G, w, b), nbytes, ref,
               note="peer")
    for r in rows:  # speedup over torch at the same shape and layout
        peer = next((p for p in rows if p.note == "peer" and p.shape == r.shape), None)
        r.speedup = r.gbps / peer.gbps if peer is not None else math.nan
    return rows


def _gn_fwd_4d(backend, x4, G, w, b):
    """The backend's group_norm_fwd on [B, C, H, W] in x4's layout (NCHW or channels_last)."""
    B, C = x4.shape[:2]
    x3 = x4.reshape(B, C, -1) if x4.is_contiguous() else x4.permute(0, 2, 3, 1).reshape(B, -1, C).transpose(1, 2)
    y3 = backend.group_norm_fwd(x3, G, w, b, 1e-5, "mish")[0]
    return y3.as_strided(x4.shape, x4.stride())  # y3 has x3's strides, i.e. x4's memory layout


# ----------------------------------------------------------------------------- output

def _fmt(v, spec):
    return "n/a" if v != v else format(v, spec)


def markdown(title: str, rows: list[Row], columns) -> str:
    head = "| " + " | ".join(c for c, _ in columns) + " |"
    sep = "|" + "|".join(":--" if i == 0 else "--:" for i in range(len(columns))) + "|"
    lines = [f"### {title}", "", head, sep]
    for r in rows:
        lines.append("| " + " | ".join(get(r) for _, get in columns) + " |")
    return "\n".join(lines) + "\n"


def _err_cols():
    return [("max error", lambda r: _fmt(r.max_err, ".2e")), ("rel. error", lambda r: _fmt(r.rel_err, ".2e"))]


def _perf_cols(speedup_name):
    return [("GB/s", lambda r: _fmt(r.gbps, ".1f")), (speedup_name, lambda r: _fmt(r.speedup, ".2f") + ("x" if r.speedup == r.speedup else "")),
            ("of copy", lambda r: _fmt(100 * r.of_ceiling, ".0f") + ("%" if r.of_ceiling == r.of_ceiling else ""))]


def render(env: dict, llmc, oneflow, precision, gn) -> str:
    parts = [
        "## normkit ladder (CUDA): the seeds' kernels on " + env["gpu"], "",
        f"{env['date']}; torch {env['torch']}, cuda-python {env['cuda_python']}, NVRTC {env['nvrtc']}, "
        f"driver {env['driver']}, {env['sms']} SMs. Copy ceiling (1 GiB device-to-device, read + write): "
        f"**{env['ceiling']:.0f} GB/s**. GB/s counts read x + write y; times are medians with the L2 flushed "
        "before each run; errors are against the float64 oracle.", ""]
    parts.append(markdown("1. llm.c LayerNorm forward ladder (seed 001)", llmc,
                          [("kernel", lambda r: r.kernel)] + _perf_cols("vs kernel 1") + _err_cols()))
    parts.append(markdown(f"2. OneFlow LayerNorm (seed 003): {oneflow[0].shape.split(' x ')[0]} rows, half", oneflow,
                          [("N", lambda r: str(r.extra.get("n", ""))), ("kernel", lambda r: r.kernel)]
                          + _perf_cols("vs torch") + _err_cols() + [("config", lambda r: r.note)]))
    parts.append(markdown(f"3. Precision on rows offset by {PRECISION_OFFSET:g} (pass: rel. error <= {PRECISION_PASS:g})",
                          precision, [("kernel", lambda r: r.kernel), ("variance", lambda r: r.note)] + _err_cols()
                          + [("", lambda r: r.extra.get("pass", ""))]))
    parts.append(markdown("4. GroupNorm + Mish (seed 004)", gn,
                          [("kernel", lambda r: r.kernel), ("shape", lambda r: r.shape + " " + r.dtype)]
                          + _perf_cols("vs torch") + _err_cols() + [("note", lambda r: r.note)]))
    return "\n".join(parts)


def write_csv(path: Path, rows: list[Row]) -> None:
    fields = [f for f in asdict(rows[0]) if f != "extra"] + ["extra"]
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=fields)
        out.writeheader()
        for r in rows:
            d = asdict(r)
            d["extra"] = ";".join(f"{k}={v}" for k, v in r.extra.items())
            out.writerow(d)


def plot(path: Path, env, sweep, oneflow) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5))
    for name in dict.fromkeys(s["kernel"] for s in sweep):
        pts = [(s["block"], s["gbps"]) for s in sweep if s["kernel"] == name]
        a.plot(*zip(*pts), marker="o", label=name)
    a.axhline(env["ceiling"], color="gray", ls="--", label="copy ceiling")
    a.set(xscale="log", xlabel="block size", ylabel="GB/s", title=f"llm.c ladder, B*T={LLMC_SHAPE[0] * LLMC_SHAPE[1]}, C={LLMC_SHAPE[2]} fp32")
    a.set_xticks(LLMC_BLOCK_SWEEP, [str(v) for v in LLMC_BLOCK_SWEEP])
    a.legend(fontsize=8)
    for name in dict.fromkeys(r.kernel for r in oneflow):
        pts = [(r.extra["n"], r.gbps) for r in oneflow if r.kernel == name and r.gbps == r.gbps]
        if pts:
            b.plot(*zip(*pts), marker="o", label=name)
    b.axhline(env["ceiling"], color="gray", ls="--", label="copy ceiling")
    b.set(xscale="log", xlabel="num_cols", ylabel="GB/s",
          title=f"OneFlow LayerNorm, {oneflow[0].shape.split(' x ')[0]} rows, half")
    b.legend(fontsize=8)
    fig.suptitle(f"normkit ladder on {env['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _environment(index, ceiling) -> dict:
    import torch

    from . import driver, nvrtc

    try:
        import cuda.bindings as cb
        cuda_python = cb.__version__
    except Exception:  # noqa: BLE001 - a version string is cosmetic
        cuda_python = "?"
    return {"gpu": torch.cuda.get_device_name(index), "torch": torch.__version__, "cuda_python": cuda_python,
            "nvrtc": "{}.{}".format(*nvrtc.version()), "driver": driver.driver_version(),
            "sms": driver.sm_count(index), "ceiling": ceiling, "platform": platform.platform(),
            "date": datetime.date.today().isoformat()}


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("normkit ladder --backend cuda: no CUDA GPU is present, so nothing was run or measured.")
        return 0
    from normkit.backends import cuda as backend

    from . import driver, kernels, nvrtc

    why = backend.why_unavailable(torch.empty(1, device=DEVICE))
    if why is not None:
        print(f"normkit ladder --backend cuda: the CUDA backend cannot run here: {why}.")
        return 2
    index = torch.cuda.current_device()
    quick = bool(getattr(args, "quick", False))
    out = Path(getattr(args, "out", "ladder-out"))
    out.mkdir(parents=True, exist_ok=True)
    # compile everything up front, in parallel (NVRTC releases the GIL)
    specs = [kernels.llmc(n) for n in kernels.LLMC] + _oneflow_specs(ONEFLOW_WIDTHS, torch.float16)
    specs.append(kernels.seed004_group_norm_mish(SEED004_SHAPE[1] * SEED004_SHAPE[2] // SEED004_SHAPE[3]))
    nvrtc.build_specs(specs, driver.arch_for(index))

    timer = Timer(quick)
    ceiling = copy_ceiling(timer)
    env = _environment(index, ceiling)
    llmc, sweep = llmc_table(timer, ceiling, index, quick)
    oneflow = oneflow_table(timer, ceiling, index, quick)
    precision = precision_table(index)
    gn = groupnorm_table(timer, ceiling, index)
    text = render(env, llmc, oneflow, precision, gn)
    print(text)
    (out / "ladder.md").write_text(text)
    write_csv(out / "ladder.csv", llmc + oneflow + precision + gn)
    if getattr(args, "plot", False):
        plot(out / "ladder.png", env, sweep, oneflow)
    print(f"wrote {out / 'ladder.md'}, {out / 'ladder.csv'}" + (f", {out / 'ladder.png'}" if getattr(args, "plot", False) else ""))
    return 0
