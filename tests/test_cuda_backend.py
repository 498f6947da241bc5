"""The CUDA C++ backend (normkit.backends.cuda) and its kernel ladder.

Without a GPU (CI): every kernel compiles through NVRTC for sm_80 and sm_90, the C signature of
every kernel matches the parameter list the launcher packs, the dispatch tables pick what they
should, the host wrappers size grids and pack arguments correctly, and failures say what failed.
With a GPU (tests marked `gpu`): backend="cuda" through the same checks as test_row_norm.py, the
fused activations, GroupNorm in both layouts, and the ladder end to end.
"""
import ctypes
import math
import re

import pytest
import torch

import normkit
from normkit import backends, reference as ref
from normkit.backends import cuda as cb
from normkit.backends.cuda import configs, driver, kernels, nvrtc

from conftest import HAS_CUDA
from helpers import DTYPES, TOL, assert_close, check_fwd_bwd, missing_tool, oracle, oracle_grads, param_tol, randn, run

# The compile tests need cuda-python and nvidia-cuda-nvrtc (the test extra): without them they fail
# with NVRTC's own error, as CI should.
ARCHS = ["sm_80", "sm_90"]
H100_SMEM_OPTIN = 227 * 1024


# ============================================================================ CPU: compilation

def _ptx_entries(ptx: str) -> dict:
    """{mangled name: [PTX parameter types]} of every kernel entry in a PTX module."""
    out = {}
    for m in re.finditer(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", ptx):
        out[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    return out


# the PTX parameter types each C type of a KernelSpec may compile to
PTX_TYPES = {"ptr": {"u64", "b64"}, "i64": {"u64", "s64", "b64"}, "i32": {"u32", "s32", "b32"}, "f32": {"f32", "b32"}}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_and_matches_its_parameter_list(arch):
    """Every instantiation in the catalog compiles for the architecture (PTX; optimization off, as
    CI checks the code, not its speed), and its PTX .param list is the KernelSpec's, type by type."""
    specs = kernels.catalog()
    by_source = {}
    for s in specs:
        by_source.setdefault(s.source, []).append(s)
    checked = 0
    for source, group in by_source.items():
        built = nvrtc.build(source, [s.name for s in group], arch.replace("sm_", "compute_"), want_ptx=True,
                            use_disk_cache=False, fast=True)
        entries = _ptx_entries(built.ptx)
        for s in group:
            params = entries[built.lowered[s.name]]
            assert len(params) == len(s.params), f"{s}: C has {len(params)} parameters, the launcher packs {len(s.params)}"
            for (pname, ctype), ptx_type in zip(s.params, params):
                assert ptx_type in PTX_TYPES[ctype], f"{s}: parameter {pname!r} is .{ptx_type} in C, packed as {ctype}"
            checked += 1
    assert checked == len(specs) > 300


# one optimized cubin per kernel template (what the GPU runs), through ptxas as well
FAMILY_SAMPLES = [
    kernels.row_fwd(torch.float16, torch.float32, "mish", False, configs.RowPlan("warp", 8, 128, 32, 32)),
    kernels.row_fwd(torch.bfloat16, torch.bfloat16, None, True, configs.RowPlan("block", 8, 512, cached=True)),
    kernels.row_fwd(torch.float32, torch.float32, "gelu", False, configs.RowPlan("block", 4, 512, cached=False)),
    kernels.row_bwd(torch.float32, torch.float32, "silu", False, configs.RowPlan("warp", 4, 128, 32, 32), True),
    kernels.row_bwd(torch.float16, torch.float32, None, False,
                    configs.RowPlan("block", 8, 512, cached=True, acc_packs=2), True),
    kernels.row_bwd(torch.bfloat16, torch.float32, "gelu_tanh", True,
                    configs.RowPlan("block", 1, 512, cached=False), False),
    kernels.row_param_grad(torch.float16, torch.float16, "relu", False),
    kernels.col_sum(torch.float32, torch.bfloat16),
    kernels.gn_reduce(torch.float16, torch.float32, None, True, False),
    kernels.gn_reduce(torch.bfloat16, torch.float32, "mish", False, True),
    kernels.gn_group(torch.float32, False),
    kernels.gn_group(torch.float16, True),
    kernels.gn_apply(torch.float32, torch.float32, "silu", False, False),
    kernels.gn_apply(torch.float16, torch.float16, "gelu", True, True),
    kernels.llmc("layernorm_forward_kernel5"),
    kernels.seed004_group_norm_mish(1024),
]


@pytest.mark.parametrize("arch", ARCHS)
def test_kernel_families_build_cubins(arch):
    built = nvrtc.build_specs(FAMILY_SAMPLES, arch, use_disk_cache=False)
    for spec, c in built.items():
        assert c.arch == arch and c.image[:4] == b"\x7fELF", f"{spec}: no cubin"
        assert spec.name in c.lowered


# compiled in a fresh process whose NVRTC is the device's: its libraries loaded before cuda.bindings looks for one
_DEVICE_NVRTC_SCRIPT = """
import ctypes, sys
for lib in sys.argv[1:-1]:
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
from normkit.backends.cuda import kernels, nvrtc
want = tuple(int(v) for v in sys.argv[-1].split("."))
assert nvrtc.version() == want, f"NVRTC {nvrtc.version()} loaded, {want} wanted"
by_source = {}
for spec in kernels.catalog():
    by_source.setdefault(spec.source, []).append(spec.name)
for source, names in by_source.items():
    nvrtc.build(source, names, "compute_90", want_ptx=True, use_disk_cache=False, fast=True)
rows = [n for n in by_source["row_cluster.cu"] if n.startswith(("nk::row_fwd_cluster", "nk::row_bwd_cluster"))]
nvrtc.build("row_cluster.cu", rows, "sm_90", use_disk_cache=False)
print(f"compiled {sum(map(len, by_source.values()))} kernels to PTX, {len(rows)} to sm_90, with NVRTC {want}")
"""


def test_kernels_compile_under_the_devices_nvrtc():
    """The catalog compiled with the GPU machine's NVRTC (the Makefile's DEVICE_NVRTC, its libraries unpacked beside
    the venv's packages), to PTX, and the row cluster kernels to sm_90 cubins: lambdas taking references to arrays
    compiled on NVRTC 13.5 and crashed 13.0's front end on the device, so no kernel of row_cluster.cu loaded there
    (session 27, run S27-2)."""
    import subprocess
    import sys
    from pathlib import Path
    lib_dir = Path(sys.prefix) / "device-nvrtc" / "site" / "nvidia" / "cu13" / "lib"
    libs = sorted(lib_dir.glob("libnvrtc-builtins.so.*")) + sorted(lib_dir.glob("libnvrtc.so.*"))
    if len(libs) != 2:
        missing_tool(f"{lib_dir} lacks libnvrtc (`make test` unpacks the device's NVRTC there)")
    version = libs[0].name.split(".so.")[1]  # libnvrtc-builtins.so.13.0
    # (`python -c` puts its working directory, this tree's root, first on sys.path: this tree's normkit is compiled)
    r = subprocess.run([sys.executable, "-c", _DEVICE_NVRTC_SCRIPT, *map(str, libs), version],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and f"with NVRTC {tuple(map(int, version.split('.')))}" in r.stdout, \
        f"exit {r.returncode} (-11: NVRTC crashed)\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def test_no_register_spills_in_the_common_kernels():
    """The kernels on the common paths keep their rows and sums in registers (ptxas -v)."""
    for spec in [FAMILY_SAMPLES[0], FAMILY_SAMPLES[1], FAMILY_SAMPLES[3], FAMILY_SAMPLES[4]]:
        _, _, _, log = nvrtc._nvrtc_compile(nvrtc.read_source(spec.source), spec.source, [spec.name],
                                             nvrtc.options("sm_90") + ["--ptxas-options=-v"])
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(int(n) == 0 for n in spills), f"{spec}: {log}"


def test_no_register_spills_in_the_routed_groupnorm_cluster_kernels():
    """The GroupNorm cluster kernels the Triton backend routes to on sm_90 (both layouts, the committed
    shapes) keep their per-thread state in registers (ptxas -v)."""
    specs = []
    for (direction, eb), shape in configs.GN_CL_CLUSTER_KERNELS.items():
        dtype = {2: torch.bfloat16, 4: torch.float32}[eb]
        specs.append(kernels.gn_cl_cluster(direction, dtype, torch.float32, "silu",
                                           configs.GnClPlan(shape[0], 1, 0, 0, 0), direction == "bwd"))
    for (direction, eb), shape in configs.GN_CLUSTER_KERNELS.items():
        dtype = {2: torch.bfloat16, 4: torch.float32}[eb]
        plan = configs.plan_gn_cluster(direction, 10, 4096, eb, direction == "bwd", shape)
        specs.append(kernels.gn_cluster(direction, dtype, torch.float32, "silu", plan, direction == "bwd"))
    for spec in specs:
        _, _, _, log = nvrtc._nvrtc_compile(nvrtc.read_source(spec.source), spec.source, [spec.name],
                                             nvrtc.options("sm_90") + ["--ptxas-options=-v"])
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(int(n) == 0 for n in spills), f"{spec}: {log}"


def test_no_register_spills_in_the_row_cluster_backward():
    """The 16-bit row backward's cluster kernels at their committed shapes (16K-32K: the push exchange with xhat
    and g in registers; 64K-128K: two rows in flight, OVERLAP, in two register sets; 256K: two rows in flight,
    the stage read again) keep their per-thread state in registers."""
    for n in (16384, 32768, 65536, 131072, 262144):
        plan = configs.plan_cluster("bwd", n, 2)
        for rms in (False, True):
            spec = kernels.row_cluster("bwd", torch.bfloat16, torch.float32, None, rms, plan, True)
            _, _, _, log = nvrtc._nvrtc_compile(nvrtc.read_source(spec.source), spec.source, [spec.name],
                                                 nvrtc.options("sm_90") + ["--ptxas-options=-v"])
            spills = re.findall(r"(\d+) bytes spill stores", log)
            assert spills and all(int(k) == 0 for k in spills), f"{spec}: {log}"


def test_compile_error_names_the_kernel_and_shows_the_log(tmp_path, monkeypatch):
    (tmp_path / "broken.cu").write_text(
        "namespace nk {\ntemplate <typename T> __global__ void scale(T* x) { x[0] = undeclared_name; }\n}\n")
    monkeypatch.setattr(nvrtc, "SOURCE_DIR", tmp_path)
    with pytest.raises(nvrtc.NvrtcError) as e:
        nvrtc.build("broken.cu", ["nk::scale<float>"], "sm_90", use_disk_cache=False)
    msg = str(e.value)
    assert "nk::scale<float>" in msg and "broken.cu" in msg and "sm_90" in msg
    assert "undeclared_name" in e.value.log and e.value.log in msg


def test_bad_instantiation_is_a_compile_error():
    with pytest.raises(nvrtc.NvrtcError, match=r"nk::row_fwd_warp<float, float, nk::Identity, 4, 6, 32, false>"):
        # COLS=6 is not a multiple of the pack (4): the kernel's static_assert fires
        nvrtc.build("row_norm.cu", ["nk::row_fwd_warp<float, float, nk::Identity, 4, 6, 32, false>"], "sm_90",
                    use_disk_cache=False, fast=True)


def test_missing_headers_say_where_they_were_looked_for(monkeypatch):
    monkeypatch.setattr(nvrtc, "_header_candidates", lambda: [("test", "/nonexistent/include")])
    nvrtc._include_dir_for.cache_clear()
    try:
        with pytest.raises(nvrtc.CudaBackendError, match="NORMKIT_CUDA_INCLUDE"):
            nvrtc.include_dir("sm_90")
    finally:
        nvrtc._include_dir_for.cache_clear()


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMKIT_CACHE_DIR", str(tmp_path))
    spec = kernels.llmc("layernorm_forward_kernel3")
    first = nvrtc.build(spec.source, [spec.name], "sm_80", use_disk_cache=True)
    assert len(list((tmp_path / "cuda").glob("*.bin"))) == 1
    monkeypatch.setattr(nvrtc, "_memory", {})
    monkeypatch.setattr(nvrtc, "_nvrtc_compile", lambda *a, **k: pytest.fail("recompiled despite the disk cache"))
    second = nvrtc.build(spec.source, [spec.name], "sm_80", use_disk_cache=True)
    assert second.image == first.image and second.lowered == first.lowered


def test_target_arch():
    assert nvrtc.target_arch((9, 0)) == "sm_90"
    assert nvrtc.target_arch((8, 0)) == "sm_80"
    newest = nvrtc.supported_archs()[-1]
    assert nvrtc.target_arch((newest // 10 + 9, 9)) == f"compute_{newest}"  # a GPU newer than NVRTC: PTX
    with pytest.raises(nvrtc.CudaBackendError, match="older than NVRTC"):
        nvrtc.target_arch((3, 0))


# ============================================================================ CPU: marshalling

def test_pack_args_exact_c_types():
    spec = kernels.row_fwd(torch.float16, torch.float32, None, False, configs.RowPlan("warp", 8, 128, 32, 8))
    x = torch.zeros(4, 8, dtype=torch.float16)
    args = [x, 8, 0x1000, 8, None, 0x2000, 0x3000, 0x4000, 2**40, 8, 1e-5]
    array, values = driver.pack_args(spec, args)
    want = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float]
    assert [type(v) for v in values] == want
    assert values[0].value == x.data_ptr() and values[4].value is None and values[8].value == 2**40
    assert values[10].value == pytest.approx(1e-5, rel=1e-7) and values[10].value != 1e-5  # rounded to fp32
    assert [array[i] for i in range(len(values))] == [ctypes.addressof(v) for v in values]


def test_pack_args_errors_name_the_kernel_and_argument():
    spec = kernels.col_sum(torch.float32, torch.float32)
    with pytest.raises(TypeError, match=r"nk::col_sum<float, float>.*expected 6 arguments"):
        driver.pack_args(spec, [None] * 5)
    with pytest.raises(OverflowError, match=r"argument 'cols'.*i32"):
        driver.pack_args(spec, [None, None, None, None, 1, 2**31])
    with pytest.raises(TypeError, match=r"argument 'parts'.*int"):
        driver.pack_args(spec, [None, None, None, None, 1.5, 3])
    with pytest.raises(TypeError, match=r"argument 'a'.*tensor, an address or None"):
        driver.pack_args(spec, [None, "x", None, None, 1, 3])


def test_launch_dims_are_checked():
    spec = kernels.col_sum(torch.float32, None)
    driver.check_launch_dims(spec, (2**31 - 1, 1, 1), (32, 8, 1), 0)
    for grid, block in [((0, 1, 1), (32, 1, 1)), ((1, 65536, 1), (32, 1, 1)), ((1, 1, 1), (1024, 2, 1))]:
        with pytest.raises(ValueError, match="nk::col_sum"):
            driver.check_launch_dims(spec, grid, block, 0)


# ============================================================================ CPU: dispatch tables

def model_occupancy(block, smem):
    """An H100-like SM: 2048 threads, 32 blocks, 228 KB shared memory with 1 KB reserved per block."""
    return min(2048 // block, 32, (228 * 1024) // (smem + 1024))


def _plan(direction, n, dtype, want=False, optin=H100_SMEM_OPTIN, force=None):
    e = dtype.itemsize
    pack = configs.pick_pack(n, e, [])
    return configs.plan_rows(direction, n, pack, e, optin, lambda cached, b, smem, acc: model_occupancy(b, smem),
                             want_params=want, force=force)


# (direction, N, dtype, want dweight) -> (impl, pack, block, width, cols per lane, acc packs, param kernel)
DISPATCH = [
    ("fwd", 1, torch.float32, False, ("warp", 1, 128, 1, 1, 0, False)),
    ("fwd", 7, torch.float32, False, ("warp", 1, 128, 8, 1, 0, False)),
    ("fwd", 32, torch.float16, False, ("warp", 8, 128, 4, 8, 0, False)),
    ("fwd", 100, torch.float32, False, ("warp", 4, 128, 32, 4, 0, False)),
    ("fwd", 768, torch.float32, False, ("warp", 4, 128, 32, 24, 0, False)),
    ("fwd", 768, torch.float16, False, ("warp", 8, 128, 32, 24, 0, False)),
    ("fwd", 1000, torch.float32, False, ("warp", 4, 128, 32, 32, 0, False)),
    ("fwd", 1024, torch.bfloat16, False, ("warp", 8, 128, 32, 32, 0, False)),
    # the regs impl: about REG_COLS columns per thread, at least 64 threads per row, 128 per block
    ("fwd", 1032, torch.bfloat16, False, ("regs", 8, 128, 64, 24, 0, False)),  # 129 packs: 3 per thread
    ("fwd", 2048, torch.bfloat16, False, ("regs", 8, 128, 64, 32, 0, False)),  # 2 rows per block
    ("fwd", 4099, torch.float32, False, ("regs", 1, 512, 512, 12, 0, False)),  # prime: scalar packs
    ("fwd", 8192, torch.bfloat16, False, ("regs", 8, 256, 256, 32, 0, False)),
    ("fwd", 16384, torch.float32, False, ("regs", 4, 1024, 1024, 16, 0, False)),
    ("fwd", 32768, torch.float16, False, ("regs", 8, 1024, 1024, 32, 0, False)),
    ("fwd", 32768, torch.float32, False, ("block-smem", 4, 512, 0, 0, 0, False)),  # 128 KB: one block per SM
    ("fwd", 65536, torch.float16, False, ("block-smem", 8, 512, 0, 0, 0, False)),
    ("fwd", 65536, torch.float32, False, ("block-uncached", 4, 512, 0, 0, 0, False)),  # 256 KB > 227 KB
    ("bwd", 1000, torch.float32, True, ("warp", 4, 128, 32, 32, 0, False)),
    ("bwd", 4099, torch.float32, True, ("regs", 1, 1024, 1024, 8, 0, False)),
    ("bwd", 4096, torch.float16, True, ("regs", 8, 512, 512, 8, 0, False)),
    ("bwd", 8192, torch.float16, True, ("block-smem", 8, 512, 0, 0, 2, False)),  # 512 threads x 2 packs own the row
    ("bwd", 8192, torch.float32, True, ("regs", 4, 1024, 1024, 8, 0, False)),
    ("bwd", 16384, torch.float16, True, ("block-smem", 8, 512, 0, 0, 0, True)),  # too wide to accumulate
    ("bwd", 16384, torch.float16, False, ("block-smem", 8, 512, 0, 0, 0, False)),
    ("bwd", 32768, torch.float16, True, ("block-smem", 8, 512, 0, 0, 0, True)),
    ("bwd", 32768, torch.float32, True, ("block-uncached", 4, 512, 0, 0, 0, True)),
]


@pytest.mark.parametrize("direction,n,dtype,want,expected", DISPATCH,
                         ids=[f"{d}-{n}-{str(t)[6:]}{'-dw' if w else ''}" for d, n, t, w, _ in DISPATCH])
def test_dispatch_table(direction, n, dtype, want, expected):
    p = _plan(direction, n, dtype, want)
    got = (p.name, p.pack, p.block, p.width, p.cols_per_thread, p.acc_packs, p.param_kernel)
    assert got == expected
    if p.impl == "regs":
        assert p.width * p.cols_per_thread >= n and p.block == max(p.width, 128)
        assert p.cols_per_thread <= 2 * configs.REG_COLS[(direction, dtype.itemsize)]
    if p.impl == "block" and p.acc_packs:
        assert p.block * p.acc_packs * p.pack >= n  # the register accumulators cover the row
    if p.cached:
        assert p.smem == n * dtype.itemsize * (1 if direction == "fwd" else 2)


def test_warp_layout_covers_every_width():
    for pack in (1, 2, 4, 8):
        for n in range(pack, configs.WARP_MAX_COLS + 1, pack):
            width, cols = configs.warp_layout(n, pack)
            assert width in (1, 2, 4, 8, 16, 32) and cols % pack == 0 and cols <= 32
            assert width * cols >= n, (n, pack)  # every column has a lane
            assert width == 32 or width * pack >= n > width * pack // 2 or width == 1
    assert len(kernels.warp_layouts()) < 60  # the rounding keeps instantiations few


def test_pick_pack():
    assert configs.pick_pack(1024, 2, [(0x1000, 2), (2048, 2)]) == 8
    assert configs.pick_pack(1024, 4, [(0x1000, 4)]) == 4
    assert configs.pick_pack(1000, 2, []) == 8 and configs.pick_pack(1004, 2, []) == 4
    assert configs.pick_pack(4099, 4, []) == 1
    assert configs.pick_pack(1024, 2, [(0x1000 + 4, 2)]) == 2  # a row start 4 bytes past alignment
    assert configs.pick_pack(1024, 2, [(1037 * 2, 2)]) == 1  # an odd row stride
    assert configs.pick_pack(1024, 2, [(0x1010, 4)]) == 8  # 8 fp32 weights: two 16-byte accesses
    assert configs.pick_pack(1024, 2, [(0x1008, 4)]) == 2


def test_choose_block_size_is_oneflows_rule():
    # same resident blocks at every size: the biggest block
    assert configs.choose_block_size(lambda b: 1) == configs.BLOCK_SIZES[-1] == 512
    assert configs.choose_block_size(lambda b: {128: 3, 256: 3, 512: 2}[b]) == 256
    assert configs.choose_block_size(lambda b: {128: 3, 256: 3, 512: 3, 1024: 2}[b],
                                     candidates=(128, 256, 512, 1024)) == 512
    assert configs.choose_block_size(lambda b: 2048 // b) == 128  # thread-limited: more, smaller blocks
    assert configs.choose_block_size(lambda b: 0) is None  # the row does not fit: uncached
    assert configs.choose_block_size(lambda b: 2, candidates=(512, 1024)) == 1024


def test_plan_rows_force_and_limits():
    assert _plan("fwd", 512, torch.float16, force="block-uncached").name == "block-uncached"
    assert _plan("fwd", 512, torch.float16, force="block-smem").name == "block-smem"
    assert _plan("fwd", 65536, torch.float16, optin=1024).name == "block-uncached"  # no shared memory to spare
    with pytest.raises(ValueError, match="block-smem cannot hold"):
        _plan("fwd", 65536, torch.float32, force="block-smem")
    with pytest.raises(ValueError, match="warp impl holds rows of at most 1024"):
        _plan("fwd", 4096, torch.float32, force="warp")
    assert _plan("fwd", 64, torch.float16, force="regs").name == "regs"
    assert _plan("fwd", 4096, torch.float16, force="block-smem").name == "block-smem"
    with pytest.raises(ValueError, match="regs impl holds rows of at most 8192"):
        _plan("bwd", 16384, torch.float32, force="regs")
    with pytest.raises(ValueError, match="force"):
        _plan("fwd", 64, torch.float32, force="thread")


def test_grid_and_split_sizes():
    assert configs.grid_blocks(10, 132, 16, 32) == 10
    assert configs.grid_blocks(10**9, 132, 16, 32) == 132 * 16 * 32
    assert configs.grid_blocks(10**9, 132, 0, 1) == 132  # occupancy 0 still launches
    splits, per = configs.param_splits(1000, 132)
    assert splits * per >= 1000 > (splits - 1) * per
    assert configs.gn_chunks(8, 320, 4096, False, 132) == (2048, 2)
    assert configs.gn_chunks(8, 320, 4096, True, 132) == (586, 7)
    assert configs.gn_chunks(2, 64, 100, False, 132) == (100, 1)  # never below GN_MIN_CHUNK
    assert configs.gn_apply_block(4096) == (256, 1) and configs.gn_apply_block(1) == (1, 256)
    assert configs.gn_apply_block(40) == (64, 4)


# ============================================================================ CPU: host wrappers

class Recorder:
    """Stands in for a loaded kernel: packs every launch's arguments for the kernel's C
    signature and checks its launch dims (what the driver would reject), and records it."""

    launches: list = []

    def __init__(self, spec):
        self.spec = spec

    device = 0

    def occupancy(self, block, smem=0):
        return model_occupancy(block, smem)

    def smem_fits(self, smem):
        return smem <= H100_SMEM_OPTIN

    def max_active_clusters(self, block, smem, cluster):
        return 132 * model_occupancy(block, smem) // cluster

    def launch(self, grid, block, args, smem=0, stream=None, cluster=None):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        driver.check_launch_dims(self.spec, grid, block, smem)
        driver.pack_args(self.spec, args)
        assert smem <= H100_SMEM_OPTIN
        assert cluster is None or (grid[0] % cluster == 0 and 1 <= cluster <= configs.CLUSTER_MAX)
        Recorder.launches.append((self.spec.name, grid, block, smem, args) + ((cluster,) if cluster else ()))


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setattr(cb, "_load", lambda spec, index: Recorder(spec))
    monkeypatch.setattr(cb, "_begin", lambda x: 0)
    monkeypatch.setattr(cb, "_sms", lambda index: 132)
    monkeypatch.setattr(driver, "max_smem_optin", lambda index: H100_SMEM_OPTIN)
    cb._row_setup.cache_clear()
    Recorder.launches = []
    yield Recorder.launches
    cb._row_setup.cache_clear()


def test_row_forward_launches(recorded):
    x = torch.empty(1000, 64, dtype=torch.float16)
    w = torch.empty(64, dtype=torch.float32)
    y, mean, rstd = cb.row_norm_fwd(x, w, None, 1e-5, False, "silu")
    assert y.shape == (1000, 64) and mean.shape == rstd.shape == (1000,)
    (name, grid, block, smem, args), = recorded
    assert name == "nk::row_fwd_warp<__half, float, nk::Silu, 8, 8, 8, false>"  # 8 lanes x 8 halves per row
    assert block == (128, 1, 1) and grid == (configs.cdiv(1000, 128 // 8), 1, 1) and smem == 0
    assert args[-3:] == [1000, 64, 1e-5] and args[1] == 64


@pytest.mark.parametrize("n,name,block,smem", [
    (4096, "nk::row_bwd_warp<__nv_bfloat16, float, nk::Identity, 8, 8, 512, false, true>", 512, 0),
    (8192, "nk::row_bwd_block<__nv_bfloat16, float, nk::Identity, 8, false, true, 2>", 512, 2 * 8192 * 2)])
def test_row_backward_launches(recorded, n, name, block, smem):
    x = torch.empty(300, n, dtype=torch.bfloat16)
    w = torch.empty(n, dtype=torch.float32)
    dx, dw, db = cb.row_norm_bwd(x, x, w, torch.empty(300), torch.empty(300), False, torch.float32, torch.float32)
    assert dx.shape == x.shape and dw.dtype == db.dtype == torch.float32
    (n1, g1, b1, s1, a1), (n2, g2, b2, s2, a2) = recorded
    assert n1 == name
    assert b1 == (block, 1, 1) and s1 == smem
    assert g1 == (min(300, 132 * min(model_occupancy(block, s1), configs.BWD_MAX_BLOCKS_PER_SM)), 1, 1)
    assert a1[10].shape == (g1[0], n)  # one partial row per block
    assert n2 == "nk::col_sum<float, float>" and g2 == (n // 32, 1, 1) and a2[4] == g1[0]


def test_wide_row_backward_uses_the_param_kernel(recorded):
    x = torch.empty(50, 65536, dtype=torch.float32)
    cb.row_norm_bwd(x, x, torch.empty(65536), torch.empty(50), torch.empty(50), True, torch.float32, None)
    names = [r[0] for r in recorded]
    assert names == ["nk::row_bwd_block<float, float, nk::Identity, 4, true, false, 0>",
                     "nk::row_param_grad<float, float, nk::Identity, true>", "nk::col_sum<float, float>"]
    dx_args, pg, cs = recorded[0][4], recorded[1], recorded[2]
    assert dx_args[10] is None and dx_args[11] is None  # the dx kernel makes no partial sums
    splits = pg[1][1]
    assert pg[1][0] == 65536 // 32 and pg[2] == (32, 8, 1) and pg[4][8].shape == (splits, 65536)
    assert cs[4][2] is None and cs[4][4] == splits  # dweight only (RMSNorm has no bias)


def test_group_norm_launches(recorded):
    x = torch.empty(8, 32, 16, 16, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    x3 = x.permute(0, 2, 3, 1).reshape(8, 256, 32).transpose(1, 2)
    assert x3.stride() == (256 * 32, 1, 32)
    w = torch.empty(32, dtype=torch.float16)
    y, mean, rstd = cb.group_norm_fwd(x3, 4, w, w, 1e-5, "mish")
    assert y.stride() == x3.stride() and mean.shape == rstd.shape == (8, 4)
    names = [r[0] for r in recorded]
    assert names == ["nk::gn_reduce<__half, __half, nk::Identity, true, false>", "nk::gn_group<__half, false>",
                     "nk::gn_apply<__half, __half, nk::Mish, true, false>"]
    chunk, chunks = configs.gn_chunks(8, 32, 256, True, 132)
    assert recorded[0][1] == (8 * chunks, 1, 1) and recorded[0][2] == (32, 8, 1)
    assert recorded[1][1] == (configs.cdiv(8 * 4 * 32, 128), 1, 1)
    assert recorded[2][2] == (32, 8, 1)  # 32 channels along the lanes, 8 positions side by side
    recorded.clear()
    dx, dw, db = cb.group_norm_bwd(x3, x3, 4, w, w, mean, rstd, "mish", torch.float16, None)
    assert dx.stride() == x3.stride() and dw.dtype == torch.float16 and db is None
    assert [r[0] for r in recorded] == ["nk::gn_reduce<__half, __half, nk::Mish, true, true>", "nk::gn_group<__half, true>",
                                        "nk::col_sum<__half, float>", "nk::gn_apply<__half, __half, nk::Mish, true, true>"]


# ============================================================================ CPU: the Hopper cluster kernels

def test_cluster_plans():
    p = configs.plan_cluster("fwd", 16384, 2, (256, 8, 3))
    assert (p.threads, p.cluster, p.slice, p.smem) == (256, 1, 16384, 3 * 32768)
    p = configs.plan_cluster("fwd", 16392, 2, (256, 8, 3))  # not a power of two: slices of whole packs
    assert p.cluster == 2 and p.slice == 8200 and p.slice % 8 == 0 and p.slice * 2 >= 16392
    assert configs.plan_cluster("fwd", 16388, 2) is None  # not whole 16-byte packs
    p = configs.plan_cluster("bwd", 262144, 2, (128, 4, 3, True))  # 64 CTAs of 128 threads: CTAs grow instead
    assert p.cluster <= configs.CLUSTER_MAX and p.threads == 512 and p.recompute
    assert p.smem == 3 * 2 * p.slice * 2  # x and dy per stage
    assert configs.plan_cluster("bwd", 262144, 4, (512, 4, 2)) is None  # 16 CTAs of 16K fp32 columns: too much
    assert configs.plan_cluster("fwd", 2048, 2, (512, 4, 4)).threads == 128  # narrow rows: small CTAs
    p = configs.plan_cluster("fwd", 65536, 2, (256, 8, 1, True, True))  # forward: reload, push exchange
    assert p.recompute and p.push and p.cluster == 4 and p.smem == 65536 * 2 // 4
    p = configs.plan_cluster("bwd", 65536, 2, (512, 2, 2, False, True, False, True))  # backward: push exchange
    assert p.push and not p.one_pass  # one_pass: the push forward's LayerNorm only
    p = configs.plan_cluster("fwd", 65536, 2, (256, 8, 1, True, True, True, False))  # merge per CTA
    assert p.push and p.merge and not p.one_pass
    p = configs.plan_cluster("bwd", 65536, 2, (256, 4, 3, True, False, True, True))  # merge in any exchange
    assert p.merge and not p.one_pass  # one_pass: the push forward's LayerNorm only
    for (direction, eb, n), shape in configs.CLUSTER_SHAPES.items():  # the measured shapes are used and valid
        p = configs.plan_cluster(direction, n, eb)
        assert p is not None and p.threads * p.items * (16 // eb) * p.cluster >= n
        assert (p.items, p.stages) == shape[1:3]
    # the RELOAD forward's register cap, per op and width (session 23); the backward and other widths keep 1024
    for (op, eb, n), sm_threads in configs.CLUSTER_FWD_SM_THREADS.items():
        p = configs.plan_cluster("fwd", n, eb, op=op)
        assert p.recompute and p.sm_threads == sm_threads and sm_threads % p.threads == 0
        assert configs.plan_cluster("fwd", n - 8 * 100, eb, op=op).sm_threads == sm_threads  # padded widths too
        assert configs.plan_cluster("bwd", n, eb, op=op).sm_threads == 1024
        assert configs.plan_cluster("fwd", n, eb, (256, 8, 1, False, True), op=op).sm_threads == 1024  # registers
    assert configs.plan_cluster("fwd", 131072, 2, op="rms").sm_threads != configs.plan_cluster("fwd", 131072, 2).sm_threads
    assert configs.plan_cluster("fwd", 32768, 2, op="rms").sm_threads == 1024
    # the forwards holding their parameters over the rows (session 26): their shape and cap, padded widths too; a
    # shape given (the sweeps') takes the usual plan
    for (op, eb, n), (shape, cap) in configs.CLUSTER_FWD_HOLD.items():
        for cols in (n, n - 8 * 100):
            p = configs.plan_cluster("fwd", cols, eb, op=op)
            assert p.hold_w and p.sm_threads == cap and (p.items, p.stages) == shape[1:3] and cap % p.threads == 0
            assert p.threads * p.items * (16 // eb) * p.cluster >= cols and not p.ahead
        assert not configs.plan_cluster("fwd", n, eb, shape, op=op).hold_w
        assert not configs.plan_cluster("fwd", n, eb, op="ln" if op == "rms" else "rms").hold_w


def test_gn_cluster_plans():
    """GroupNorm groups as cluster rows: the fewest CTAs that hold the group, items sized to the
    slice; the backward with weight gradients takes slices of whole channels (CTAs dividing Cg,
    wider CTAs where no divisor fits); positions that are not whole packs are refused."""
    p = configs.plan_gn_cluster("fwd", 10, 4096, 2, shape=(256, 8, 1, True, True, False, True))
    assert (p.threads, p.cluster, p.push, p.recompute, p.one_pass) == (256, 3, True, True, True)
    assert p.slice % 8 == 0 and p.slice * 3 >= 40960 and p.items == -(-p.slice // (256 * 8))
    assert configs.plan_gn_cluster("fwd", 10, 4100, 2) is None  # 4100 positions: not whole 8-element packs
    assert configs.plan_gn_cluster("fwd", 10, 4100, 4) is not None  # 4-element packs
    for cg, s, eb in ((10, 4096, 2), (20, 1024, 2), (8, 3136, 2), (40, 256, 4), (4, 16384, 2), (40, 64, 2)):
        p = configs.plan_gn_cluster("bwd", cg, s, eb, want_params=True)
        assert p is not None and cg % p.cluster == 0 and p.slice == cg // p.cluster * s, (cg, s, eb, p)
        assert p.threads * p.items * (16 // eb) >= p.slice and p.smem == p.stages * 2 * -(-p.slice * eb // 128) * 128
        q = configs.plan_gn_cluster("bwd", cg, s, eb, want_params=False)
        assert q.cluster * q.threads <= p.cluster * p.threads  # whole channels take no fewer threads
    shape = (256, 4, 2, False)
    assert configs.plan_gn_cluster("bwd", 4, 16384, 2, True, shape).threads == 512  # 8 CTAs of 256 do not divide 4
    assert configs.plan_gn_cluster("bwd", 4, 16384, 4, True, shape) is None  # 4 CTAs of 512 x 4 fp32 packs: too few
    assert configs.plan_gn_cluster("fwd", 40, 64, 2, shape=(256, 8, 1, True, True)).threads == 128  # small: small CTAs
    p = configs.plan_gn_cluster("bwd", 10, 4096, 2, True, (128, 8, 2, False, True, True, True))  # push backward
    assert p.push and not p.one_pass and not p.merge and 10 % p.cluster == 0  # merge, one_pass: forward flags here
    # the kernels find a column's channel by a multiply-high, exact while cols * spatial < 2^32 (session 24)
    assert configs.plan_gn_cluster("fwd", 4, 16384, 4) is not None  # 2^16 x 2^14
    assert configs.plan_gn_cluster("fwd", 1, 65536, 4) is None  # 2^16 x 2^16: past it
    # and a group's row mod G in 32 bits: no more than 2^31 rows of channels
    from normkit.backends.cuda import cluster
    assert cluster.gn_why_not(torch.empty(2**21, 2**10, 8, device="meta")) == "more than 2^31 rows of channels"


def test_gn_cl_cluster_plans():
    """channels_last GroupNorm slabs: channel blocks of whole groups in whole 16-byte packs (a 64-byte run
    where whole groups allow), dividing C; the fewest CTAs whose tiles fit, more for batch-1 grids; no
    plan where channels are not whole packs or a slab needs more than CLUSTER_MAX CTAs. The backward
    holds x and dy, and the cluster's per-channel slots."""
    plan = configs.plan_gn_cl_cluster
    fwd, bwd = (256, 64 * 1024, 64, 2), (256, 48 * 1024, 64, 2)
    p = plan("fwd", 8, 320, 4096, 10, 2, 132, fwd)
    assert (p.block_c, p.cluster, p.slice) == (40, 5, 820)  # 320 KB slabs in CTAs of about 64 KB
    assert p.smem == -(-820 * 80 // 16) * 16 + (256 // 5 + 1) * 40 * 4
    q = plan("bwd", 8, 320, 4096, 10, 2, 132, bwd)
    assert (q.block_c, q.cluster) == (40, 7) and q.smem == 2 * -(-q.slice * 80 // 16) * 16 + 2 * (256 // 5 + 1) * 40 * 4 \
        + 7 * 2 * 40 * 4
    assert plan("fwd", 8, 320, 4096, 10, 4, 132, fwd).block_c == 20  # 80 bytes of fp32
    assert plan("fwd", 8, 320, 4096, 10, 4, 132, (256, 1 << 16, 128, 2)).block_c == 40  # 160 bytes
    assert plan("fwd", 32, 256, 3136, 8, 2, 132, fwd).block_c == 32  # 4 groups of 8: a 64-byte run
    assert plan("fwd", 2, 24, 49, 3, 2, 132, fwd).block_c == 24  # 3 x 8: the only whole-pack block
    assert plan("bwd", 2, 256, 64, 64, 2, 132, (64, 1 << 16, 64, 2)) is None  # 2 x 64 channel sums > 64 threads
    one = plan("fwd", 1, 320, 4096, 10, 2, 132, fwd)
    assert one.cluster == 16 and one.slice == 256  # batch 1: 8 slabs cut into 16 CTAs each
    assert plan("fwd", 1, 1280, 64, 40, 2, 132).slice >= configs.GN_CL_MIN_SLICE
    for args in ((2, 36, 64, 3, 2), (2, 30, 64, 10, 4)):  # 36 / 30 channels: not whole 8 / 4-element packs
        assert plan("fwd", *args, 132) is None
    assert plan("fwd", 1, 2048, 1 << 20, 2048, 2, 132) is None  # one group of 4 GB: no fit
    for d in ("fwd", "bwd"):
        for b, c, s, cg, eb in ((8, 320, 4096, 10, 2), (4, 128, 16384, 4, 4), (3, 60, 7, 20, 4), (5, 48, 3136, 16, 2)):
            p = plan(d, b, c, s, cg, eb, 132)
            assert c % p.block_c == 0 and p.block_c % cg == 0 and p.block_c % (16 // eb) == 0, p
            assert p.cluster <= configs.CLUSTER_MAX and (p.cluster - 1) * p.slice < s <= p.cluster * p.slice, p
            assert p.smem <= configs.CLUSTER_SMEM_MAX


def test_gn_cluster_route_is_data(monkeypatch):
    """Which dense NCHW groups run on the cluster kernels is a table per arch; none under the
    interpreter (arch ""), none on another arch, none where no measurement put a range."""
    from normkit.backends import triton as tb
    from normkit.backends.triton import configs as tc
    # the measured table (S12-1 / S12-2, S25-2, H200): fp32 NCHW groups of 16K-48K elements backward, 8K-64K
    # forward; bf16 backward 16K-64K, bf16 forward 8K-32K and 48K-64K (not 8x320x64x64's 40960)
    assert tc.gn_cluster_routed("fwd", 10, 4096, 4, "sm_90") and tc.gn_cluster_routed("bwd", 8, 3136, 4, "sm_90")
    assert tc.gn_cluster_routed("fwd", 40, 256, 4, "sm_90") and not tc.gn_cluster_routed("bwd", 40, 256, 4, "sm_90")
    assert tc.gn_cluster_routed("bwd", 8, 3136, 2, "sm_90") and tc.gn_cluster_routed("bwd", 10, 4096, 2, "sm_90")
    assert tc.gn_cluster_routed("fwd", 4, 16384, 4, "sm_90") and not tc.gn_cluster_routed("bwd", 4, 16384, 4, "sm_90")
    assert tc.gn_cluster_routed("fwd", 8, 3136, 2, "sm_90") and tc.gn_cluster_routed("fwd", 4, 16384, 2, "sm_90")
    assert not tc.gn_cluster_routed("fwd", 10, 4096, 2, "sm_90") and not tc.gn_cluster_routed("fwd", 8, 16384, 4, "sm_90")
    monkeypatch.setattr(tc, "GN_CLUSTER_ROUTE", {"sm_90": {("fwd", 2): ((8192, 65536),)}})
    assert tc.gn_cluster_routed("fwd", 10, 4096, 2, "sm_90")
    assert not tc.gn_cluster_routed("fwd", 10, 4096, 4, "sm_90")
    assert not tc.gn_cluster_routed("bwd", 10, 4096, 2, "sm_90")
    assert not tc.gn_cluster_routed("fwd", 40, 64, 2, "sm_90")  # below the range
    assert not tc.gn_cluster_routed("fwd", 10, 4096, 2, "")
    assert not tc.gn_cluster_routed("fwd", 10, 4096, 2, "sm_100")
    assert tb._gn_on_clusters("fwd", torch.empty(2, 320, 4096, dtype=torch.bfloat16), (), 32, None, None, None) is None
    # channels_last (S13-1 / S13-2, H200): ranges of group sizes per (direction, element bytes)
    def cl(*args):
        return tc.gn_cluster_routed(*args, channels_last=True)
    assert cl("fwd", 20, 1024, 2, "sm_90") and cl("fwd", 4, 16384, 2, "sm_90") and not cl("fwd", 10, 4096, 2, "sm_90")
    assert cl("fwd", 10, 4096, 4, "sm_90") and not cl("fwd", 40, 256, 4, "sm_90")
    assert cl("bwd", 40, 256, 2, "sm_90") and not cl("bwd", 8, 3136, 2, "sm_90") and cl("bwd", 8, 3136, 4, "sm_90")
    assert not cl("fwd", 40, 64, 2, "sm_90") and not cl("bwd", 40, 64, 4, "sm_90")  # small groups: Triton's
    assert not cl("fwd", 20, 1024, 2, "") and not cl("fwd", 20, 1024, 2, "sm_100")
    x_cl = torch.empty(2, 640, 1024, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    assert tb._gn_on_clusters("fwd", x_cl, (), 32, None, None, None) is None  # a CPU tensor: never routed


def test_gn_cluster_route_picks_the_layouts_kernels(monkeypatch):
    """One route for both layouts: dense NCHW groups go to prepare_gn (groups as rows), channels_last to
    prepare_gn_cl (slabs of whole groups), each behind its own table and checks; here on the CPU with
    the cluster module stood in for (no GPU)."""
    from types import SimpleNamespace

    from normkit.backends import triton as tb
    from normkit.backends.triton import configs as tc
    calls = []
    fake = SimpleNamespace(gn_why_not=lambda *a: None, gn_cl_why_not=lambda *a: None,
                           prepare_gn=lambda *a: calls.append(("nchw",) + a) or "nchw",
                           prepare_gn_cl=lambda *a: calls.append(("cl",) + a) or "cl")
    monkeypatch.setattr(tb, "_cuda_cluster", lambda: fake)
    monkeypatch.setattr(tb, "_device_facts", lambda device: (0, "sm_90", 132))
    monkeypatch.setattr(tc, "GN_CLUSTER_ROUTE", {"sm_90": {("fwd", 2): ((0, 1 << 40),)}})
    monkeypatch.setattr(tc, "GN_CL_CLUSTER_ROUTE", {"sm_90": {("bwd", 2): ((0, 1 << 40),)}})
    nchw = torch.empty(2, 64, 100, dtype=torch.bfloat16)
    cl = nchw.transpose(1, 2).contiguous().transpose(1, 2)
    w = torch.empty(64)
    assert tb._gn_on_clusters("fwd", nchw, (), 8, w, None, "silu") == "nchw"
    assert calls.pop() == ("nchw", "fwd", 8, 100, torch.bfloat16, torch.float32, "silu", False, 0)
    assert tb._gn_on_clusters("bwd", cl, (cl,), 8, None, None, None, True) == "cl"
    assert calls.pop() == ("cl", "bwd", 2, 64, 100, 8, torch.bfloat16, torch.bfloat16, None, True, 0)
    assert tb._gn_on_clusters("fwd", cl, (), 8, None, None, None) is None  # channels_last forward: not in its table
    assert tb._gn_on_clusters("bwd", nchw, (nchw,), 8, None, None, None) is None
    fake.gn_cl_why_not = lambda *a: "x is not a dense channels_last tensor"
    assert tb._gn_on_clusters("bwd", cl, (cl,), 8, None, None, None) is None and not calls


def test_gn_cl_launch_packs_the_kernels_parameters(monkeypatch):
    """launch_gn_fwd / launch_gn_bwd with a channels_last plan: a cluster per (sample, channel block), the
    arguments in the order of the kernels' parameter lists (checked against the PTX by the catalog test)."""
    from normkit.backends.cuda import cluster
    launched = []
    kernel = type("K", (), {"device": 0, "launch": lambda self, grid, block, args, smem, cluster:
                            launched.append((grid, block, args, smem, cluster))})()
    monkeypatch.setattr(cluster, "_use_device", lambda index: None)
    plan = configs.GnClPlan(threads=128, cluster=3, slice=34, block_c=16, smem=4096)
    p = cluster.Prepared(plan, kernel, 1)
    x = torch.empty(2, 64, 100, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    cluster.launch_gn_fwd(p, x, "y", "w", "b", "mean", "rstd", 8, 1e-5)
    grid, block, args, smem, size = launched.pop()
    assert grid == (2 * 4 * 3,) and block == (128,) and (smem, size) == (4096, 3)
    assert dict(zip((n for n, _ in kernels.GN_CL_FWD_CLUSTER_PARAMS), args)) == dict(
        x=x, y="y", weight="w", bias="b", mean="mean", rstd="rstd", C=64, S=100, cg=8, block_c=16, slice=34, eps=1e-5)
    cluster.launch_gn_bwd(p, "dy", x, "w", "b", "mean", "rstd", "dx", "dw", "db", 8)
    grid, block, args, smem, size = launched.pop()
    assert grid == (24,) and dict(zip((n for n, _ in kernels.GN_CL_BWD_CLUSTER_PARAMS), args)) == dict(
        dy="dy", x=x, weight="w", bias="b", mean="mean", rstd="rstd", dx="dx", dw_part="dw", db_part="db", C=64,
        S=100, cg=8, block_c=16, slice=34)


def test_cluster_widths_are_per_op(monkeypatch):
    """configs.CLUSTER_WIDTHS holds, per (direction, op, element bytes), the widths backend="cuda"
    runs on clusters, so LayerNorm and RMSNorm each take their faster kernel at a width; here the
    cluster kernels' own checks are stood in for (no GPU)."""
    from normkit.backends.cuda import cluster
    for direction in ("fwd", "bwd"):
        for op in ("ln", "rms"):
            for eb in (2, 4):
                lo, hi = configs.CLUSTER_WIDTHS[(direction, op, eb)]
                assert lo == configs.next_pow2(lo) and hi == configs.next_pow2(hi) and lo <= hi
                assert configs.plan_cluster(direction, hi, eb) is not None, (direction, op, eb)
    monkeypatch.setattr(cluster, "why_not", lambda *a: None)
    monkeypatch.setattr(cluster, "prepare", lambda direction, n, dtype, wdtype, act, rms, *a: ("prepared", rms))
    monkeypatch.setattr(cb, "_begin", lambda x: 0)
    monkeypatch.setitem(configs.CLUSTER_WIDTHS, ("fwd", "ln", 2), (32768, 65536))
    monkeypatch.setitem(configs.CLUSTER_WIDTHS, ("fwd", "rms", 2), (65536, 65536))
    x = torch.empty(3, 20000 + 12288, dtype=torch.bfloat16)  # 32K once padded
    assert cb._on_clusters("fwd", x, (), None, None, None, False) == ("prepared", False)
    assert cb._on_clusters("fwd", x, (), None, None, None, True) is None
    assert cb._on_clusters("fwd", torch.empty(3, 65536, dtype=torch.bfloat16), (), None, None, None, True) \
        == ("prepared", True)


def test_shared_memory_opt_in_counts_static_bytes():
    # 48 KB of stages + 2 KB of static shared memory is past the default: an opt-in is needed
    assert driver.needs_smem_opt_in(48 * 1024, 2176)
    assert not driver.needs_smem_opt_in(40 * 1024, 2176)
    assert not driver.needs_smem_opt_in(64 * 1024, 2176, granted=96 * 1024)
    assert driver.needs_smem_opt_in(128 * 1024, 2176, granted=96 * 1024)


@pytest.fixture
def cluster_recorded(recorded, monkeypatch):
    from normkit.backends.cuda import cluster
    monkeypatch.setattr(cluster, "_load", lambda spec, index: Recorder(spec))
    monkeypatch.setattr(cluster, "_use_device", lambda index: None)
    cluster.prepare.cache_clear()
    yield recorded
    cluster.prepare.cache_clear()


def test_cluster_launches(cluster_recorded):
    from normkit.backends.cuda import cluster
    x = torch.empty(300, 65536, dtype=torch.bfloat16)
    w = torch.empty(65536, dtype=torch.float32)
    p = cluster.prepare("fwd", 65536, torch.bfloat16, torch.float32, "silu", False, False, 0)
    y, mean, rstd = torch.empty_like(x), torch.empty(300), torch.empty(300)
    cluster.launch_fwd(p, x, y, w, w, mean, rstd, 1e-5)
    name, grid, block, smem, args, cl = cluster_recorded[-1]
    plan = configs.plan_cluster("fwd", 65536, 2)
    flags = ", ".join("true" if f else "false" for f in (plan.recompute, plan.push, plan.merge, plan.one_pass))
    assert name == (f"nk::row_fwd_cluster<__nv_bfloat16, float, nk::Silu, false, {plan.threads}, {plan.items}, "
                    f"{plan.stages}, {flags}, {plan.sm_threads}, {plan.ahead}, false>")
    assert cl == plan.cluster and grid == (p.grid_clusters(300) * cl, 1, 1) and block == (plan.threads, 1, 1)
    # LayerNorm at 128K: the register cap of CLUSTER_FWD_SM_THREADS in the kernel's name (its __launch_bounds__)
    p = cluster.prepare("fwd", 131072, torch.bfloat16, torch.bfloat16, None, False, False, 0)
    assert p.plan.sm_threads == configs.CLUSTER_FWD_SM_THREADS[("ln", 2, 131072)]
    assert p.kernel.spec.name == ("nk::row_fwd_cluster<__nv_bfloat16, __nv_bfloat16, nk::Identity, false, "
                                  f"{p.plan.threads}, {p.plan.items}, 1, true, true, false, true, 1280, 0, false>")
    # RMSNorm at 128K: CLUSTER_FWD_HOLD's plan (the parameters held, its own cap), on one wave of clusters
    p = cluster.prepare("fwd", 131072, torch.bfloat16, torch.bfloat16, None, True, False, 0)
    shape, cap = configs.CLUSTER_FWD_HOLD[("rms", 2, 131072)]
    assert p.plan.hold_w and p.plan.sm_threads == cap and (p.plan.threads, p.plan.items, p.plan.stages) == shape[:3]
    assert p.kernel.spec.name.endswith(f", {cap}, 0, true>")
    walking = cluster.prepare("fwd", 131072, torch.bfloat16, torch.bfloat16, None, False, False, 0)
    assert p.clusters < walking.clusters  # one wave against CLUSTER_PUSH_WAVES
    # and the parameters fetched ahead (CLUSTER_FWD_PARAM_AHEAD) in fp32 RMSNorm's
    p = cluster.prepare("fwd", 131072, torch.float32, torch.float32, None, True, False, 0)
    assert p.kernel.spec.name.endswith(", 1536, 2, false>")
    assert smem == plan.smem and args[-4:] == [300, 65536, plan.slice, 1e-5]
    # backward: one partial row per cluster, the dx kernel with the weight-gradient sums
    p = cluster.prepare("bwd", 65536, torch.bfloat16, torch.float32, None, True, True, 0)
    plan_b = configs.plan_cluster("bwd", 65536, 2)
    parts = p.grid_clusters(3)
    assert parts == 3  # never more clusters than rows
    xs = x[:3]
    dw_part = torch.empty(parts, 65536)
    assert cluster.launch_bwd(p, xs, xs, w, None, None, rstd[:3], torch.empty_like(xs), dw_part, None) == parts
    name, grid, block, smem, args, cl = cluster_recorded[-1]
    assert name.startswith("nk::row_bwd_cluster<__nv_bfloat16, float, nk::Identity, true,") and \
        name.endswith(f"{plan_b.stages}, true, {str(plan_b.recompute).lower()}, false, {str(plan_b.push).lower()}, "
                      f"{str(plan_b.overlap).lower()}, {str(plan_b.hold_w).lower()}>")
    assert plan_b.push  # the 16-bit backward's default exchange (session 14)
    assert grid == (3 * cl, 1, 1) and args[10] is dw_part and args[11] is None


def test_push_backward_stays_one_persistent_wave(cluster_recorded, monkeypatch):
    """The push backward (the exchange by st.async, PUSH) keeps the barrier backward's grid: one wave of
    resident clusters, each a weight-gradient partial row; its kernel name carries the push flag."""
    from normkit.backends.cuda import cluster
    barrier = cluster.prepare("bwd", 65536, torch.bfloat16, torch.float32, None, True, True, 0, shape=(512, 2, 2))
    p = cluster.prepare("bwd", 65536, torch.bfloat16, torch.float32, None, True, True, 0,
                        shape=(512, 2, 2, False, True))
    assert p.plan.push and p.clusters == barrier.clusters
    x = torch.empty(5000, 65536, dtype=torch.bfloat16)
    parts = torch.empty(p.grid_clusters(5000), 65536)
    assert cluster.launch_bwd(p, x, x, None, None, None, torch.empty(5000), torch.empty_like(x), parts, None) == \
        barrier.clusters
    name = cluster_recorded[-1][0]
    assert name.endswith(", 512, 2, 2, true, false, false, true, false, true>")  # the weight held (HOLD_W)
    # two rows in flight: the same grid, its own flag
    o = cluster.prepare("bwd", 65536, torch.bfloat16, torch.float32, None, True, True, 0,
                        shape=(512, 2, 3, True, True, False, True))
    assert o.plan.overlap and o.clusters == cluster.prepare("bwd", 65536, torch.bfloat16, torch.float32, None, True,
                                                            True, 0, shape=(512, 2, 3, True)).clusters
    cluster.launch_bwd(o, x, x, None, None, None, torch.empty(5000), torch.empty_like(x), parts, None)
    assert cluster_recorded[-1][0].endswith(", 512, 2, 3, true, true, false, true, true, true>")
    with pytest.raises(ValueError, match="3 stages"):
        configs.plan_cluster("bwd", 65536, 2, (512, 2, 2, True, True, False, True))
    with pytest.raises(ValueError, match="2 stages"):  # two register sets: two stages are enough
        configs.plan_cluster("bwd", 65536, 2, (512, 2, 1, False, True, False, True))


def test_push_forward_launches_many_clusters(cluster_recorded, monkeypatch):
    """The push forward's grid is up to CLUSTER_PUSH_WAVES waves of resident clusters (about a row
    each), not one persistent wave; its kernel name carries the reload and push flags."""
    from normkit.backends.cuda import cluster
    shape = (256, 8, 1, True, True)
    monkeypatch.setitem(configs.CLUSTER_SHAPES, ("fwd", 2, 65536), shape)
    persistent = cluster.prepare("fwd", 65536, torch.bfloat16, torch.float32, None, True, False, 0,
                                 shape=shape[:3])
    p = cluster.prepare("fwd", 65536, torch.bfloat16, torch.float32, None, True, False, 0)
    assert p.plan.push and p.plan.recompute and p.clusters > persistent.clusters
    x = torch.empty(5000, 65536, dtype=torch.bfloat16)
    cluster.launch_fwd(p, x, torch.empty_like(x), None, None, None, torch.empty(5000), 1e-6)
    name, grid, block, smem, args, cl = cluster_recorded[-1]
    assert name.endswith(", 256, 8, 1, true, true, false, false, 1024, 0, false>") and cl == 4
    # fp32 RMSNorm fetches its weight packs ahead (CLUSTER_FWD_PARAM_AHEAD, session 26); LayerNorm and 16-bit rows do not
    assert configs.plan_cluster("fwd", 131072, 4, op="rms").ahead == 2
    assert configs.plan_cluster("fwd", 131072, 4, op="ln").ahead == configs.plan_cluster("fwd", 131072, 2, op="rms").ahead == 0
    assert configs.plan_cluster("bwd", 131072, 4, op="rms").ahead == 0
    # the backward holds its weight slice in registers (session 26) except where that costs fp32 RMSNorm a CTA per SM
    assert configs.plan_cluster("bwd", 131072, 4, op="rms").hold_w and configs.plan_cluster("bwd", 16384, 2).hold_w
    assert not configs.plan_cluster("bwd", 16384, 4, op="rms").hold_w and configs.plan_cluster("bwd", 16384, 4).hold_w
    assert not configs.plan_cluster("fwd", 131072, 2).hold_w
    assert grid == (min(5000, persistent.clusters * configs.CLUSTER_PUSH_WAVES) * 4, 1, 1)


def test_cluster_routes_are_data():
    """The Triton backend's table says which widths and ops run on the cluster kernels (measured
    on the H200, the 16-bit backward again on the H100 in sessions 8-10, the forward in session
    9): the 16-bit backward of both ops at 16K-256K (session 14: the push exchange won there against the
    register-capped and two-row split rows; session 15: 256K with two rows in flight per cluster), not
    below 16K (LayerNorm's 2K and 8K went to the push clusters in session 14 and back to Triton's tiles in
    session 17, once those load the next tile's statistics with it: run S17-2) but LayerNorm's 2K (back on the
    clusters in session 27, whose CTAs hold their weight since session 26: run S27-7), the fp32 RMSNorm backward
    at 8K-32K;
    never under the interpreter; the bench's overrides win."""
    from normkit.backends.triton import configs as tc
    tc.row_config.cache_clear()
    try:
        assert all(tc.row_config("bwd", n, 2, "sm_90", False, op).cuda for n in (16384, 32768, 65536, 131072)
                   for op in ("ln", "rms"))
        # below 16K Triton's tiles for both ops (LayerNorm's 2K and 8K: run S17-2, 0.81 / 0.78 -> 0.87 / 0.81), but
        # LayerNorm's 2K (rows of 1025-2048 columns): the push clusters with the weight held, run S27-7, 0.865 -> 0.89
        assert not any(tc.row_config("bwd", n, 2, "sm_90", False, op).cuda for n in (1024, 2048, 4096, 8192)
                       for op in ("ln", "rms") if (op, n) != ("ln", 2048))
        assert tc.row_config("bwd", 2048, 2, "sm_90", False, "ln").cuda and tc.row_config("bwd", 1536, 2, "sm_90", False,
                                                                                           "ln").cuda
        # 256K too since session 15 (run S15-3: two rows in flight per cluster beat the capped split rows)
        assert all(tc.row_config("bwd", 262144, 2, "sm_90", False, op).cuda for op in ("ln", "rms"))
        assert tc.row_config("bwd", 8192, 4, "sm_90", False, "rms").cuda
        assert not tc.row_config("bwd", 8192, 4, "sm_90", False, "ln").cuda
        # the push forward (session 9): 16-bit 64K-256K both ops but RMSNorm's 64K (Triton's looped kernel compiled
        # for the width since runs S20-1 / S20-2), and LayerNorm's 32K with ONE_PASS (run S17-5); Triton below
        assert all(tc.row_config("fwd", n, 2, "sm_90", False, op).cuda for n in (65536, 131072, 262144)
                   for op in ("ln", "rms") if (n, op) != (65536, "rms"))
        assert not tc.row_config("fwd", 65536, 2, "sm_90", False, "rms").cuda
        assert tc.row_config("fwd", 32768, 2, "sm_90", False, "ln").cuda
        assert not tc.row_config("fwd", 32768, 2, "sm_90", False, "rms").cuda
        assert not tc.row_config("fwd", 16384, 2, "sm_90", False, "ln").cuda
        assert tc.row_config("fwd", 262144, 4, "sm_90", False, "rms").cuda
        assert not tc.row_config("fwd", 262144, 4, "sm_90", False, "ln").cuda
        assert not tc.row_config("bwd", 16384, 2, "sm_90", True, "ln").cuda  # interpreter
        assert not tc.row_config("bwd", 16384, 2, "sm_80", False, "ln").cuda  # no table for the arch
        tc.CUDA_OVERRIDES[("fwd", 2)] = (4096,)
        tc.row_config.cache_clear()
        assert tc.row_config("fwd", 4096, 2, "sm_90", False, "ln").cuda
    finally:
        tc.CUDA_OVERRIDES.clear()
        tc.row_config.cache_clear()


def test_cluster_refuses_what_it_cannot_take(monkeypatch):
    from types import SimpleNamespace

    from normkit.backends.cuda import cluster, nvrtc
    assert "not a CUDA tensor" in cluster.why_not(torch.ones(4, 16, dtype=torch.bfloat16))
    # RMSNorm's cluster forward reads no bias (its store keeps no registers for one): a bias sends the call elsewhere
    w16 = torch.ones(16, dtype=torch.bfloat16)
    assert "takes no bias" in cluster.why_not(torch.ones(4, 16, dtype=torch.bfloat16), (), w16, w16, rms_fwd=True)
    assert "takes no bias" not in cluster.why_not(torch.ones(4, 16, dtype=torch.bfloat16), (), w16, w16)
    nchw = torch.ones(2, 16, 8, dtype=torch.bfloat16)  # [B, C, S]
    assert "not a dense channels_last tensor" in cluster.gn_cl_why_not(nchw)
    assert "not a CUDA tensor" in cluster.gn_cl_why_not(nchw.transpose(1, 2).contiguous().transpose(1, 2))
    # without cuda-python or NVRTC (the test extra's, not normkit's dependencies) the Triton backend's routes
    # to the cluster kernels say why not, so it keeps its own kernels instead of failing the call
    def missing():
        raise nvrtc.CudaBackendError("cuda-python is not installed (pip install cuda-python)")
    monkeypatch.setattr(driver, "bindings", missing)
    cluster._unavailable.cache_clear()
    try:
        x = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, shape=(4, 65536))
        assert "cannot load: cuda-python is not installed" in cluster.why_not(x)
    finally:
        cluster._unavailable.cache_clear()


# ============================================================================ CPU: availability

def test_why_unavailable_on_cpu_says_why():
    why = cb.why_unavailable(torch.ones(3))
    assert why is not None and "CUDA tensors" in why and "cpu" in why
    with pytest.raises(backends.BackendUnavailableError, match=r"backend='cuda' cannot run layer_norm: .*CUDA tensors"):
        normkit.layer_norm(torch.ones(2, 8), (8,), backend="cuda")


def test_ladder_without_a_gpu_says_so(capsys, tmp_path):
    if HAS_CUDA:
        pytest.skip("a GPU is present: the ladder runs (test_ladder_end_to_end)")
    from normkit.cli import main
    assert main(["ladder", "--backend", "cuda", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "GB/s" not in out


# ============================================================================ GPU

DEVICE = "cuda"
WIDTHS = [1, 7, 64, 100, 1000, 1032, 2048, 4099, 8192, 16384, 32768, 65536]
OPS = ["layer_norm", "rms_norm"]


@pytest.fixture(scope="module")
def prebuilt():
    """Compile most kernels these tests use in parallel, once (later loads hit the caches)."""
    if not HAS_CUDA:
        return
    specs = []
    for dtype in DTYPES.values():
        for wd in {dtype, torch.float32}:
            for rms in (False, True):
                for n in WIDTHS:
                    specs += kernels.row_specs(n, dtype, wd, None, rms)
            for other in (dtype, torch.float32):
                specs.append(kernels.col_sum(other, other))
            for cl in (False, True):
                specs.append(kernels.gn_reduce(dtype, wd, None, cl, False))
                for act in [None] + list(ref.ACTIVATIONS):
                    specs.append(kernels.gn_reduce(dtype, wd, act, cl, True))
                    specs += [kernels.gn_apply(dtype, wd, act, cl, bwd) for bwd in (False, True)]
            specs += [kernels.gn_group(wd, bwd) for bwd in (False, True)]
    for act in ref.ACTIVATIONS:
        for rms in (False, True):
            for n in (64, 1000, 8192, 65536):
                specs += kernels.row_specs(n, torch.float32, torch.float32, act, rms)
    cb.prebuild(specs)


@pytest.fixture
def cuda_poison(monkeypatch):
    """Every buffer the CUDA kernels must fully write starts as NaN."""
    def nan_empty(*shape, dtype=None, device=None, **kw):
        return torch.empty(*shape, dtype=dtype, device=device, **kw).fill_(math.nan)

    monkeypatch.setattr(cb, "_empty", nan_empty)
    monkeypatch.setattr(cb, "_empty_like", lambda t, **kw: torch.empty_like(t, **kw).fill_(math.nan))
    monkeypatch.setattr(driver, "SYNC_AFTER_LAUNCH", True)  # a fault names its kernel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("op", OPS)
def test_matches_oracle(op, n, dtype, prebuilt, cuda_poison):
    p_dtype = torch.float32 if dtype != torch.float16 else torch.float16
    x = randn(5, n, dtype=dtype, device=DEVICE)
    w, b = randn(n, dtype=p_dtype, device=DEVICE), randn(n, dtype=p_dtype, device=DEVICE)
    check_fwd_bwd(op, x, (n,), w, b, backend="cuda", what=f"cuda {op} N={n} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("p_dtype", ["same", "fp32"])
@pytest.mark.parametrize("op,affine", [(op, a) for op in OPS for a in ("none", "weight", "bias", "both")
                                       if op == "layer_norm" or a in ("none", "weight")])  # RMSNorm has no bias
def test_optional_and_mixed_dtype_params(op, affine, p_dtype, prebuilt, cuda_poison):
    x = randn(4, 3, 1000, dtype=torch.bfloat16, device=DEVICE)
    pd = torch.bfloat16 if p_dtype == "same" else torch.float32
    w = randn(1000, dtype=pd, device=DEVICE) if affine in ("weight", "both") else None
    b = randn(1000, dtype=pd, device=DEVICE) if affine in ("bias", "both") else None
    check_fwd_bwd(op, x, (1000,), w, b, backend="cuda", what=f"cuda {op} {affine} {p_dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_many_rows_and_persistent_loops(op, prebuilt, cuda_poison):
    # N=7: 4 rows per warp; 100000 rows: more row tiles than the grids hold, so the kernels loop
    for m, n in ((100000, 7), (20000, 8192)):
        x = randn(m, n, device=DEVICE)
        check_fwd_bwd(op, x, (n,), randn(n, device=DEVICE), randn(n, device=DEVICE), backend="cuda",
                      what=f"cuda {op} M={m} N={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_strided_rows(op, prebuilt, cuda_poison):
    from normkit.functional import _as_rows

    for n, pad in ((1000, 37), (8192, 8), (4096, 1)):
        wide = randn(6, n + pad, device=DEVICE)
        for x in (wide[:, :n], wide[1:5, :n], wide[::2, :n], wide[:, 1:n + 1]):
            rows = _as_rows(x, (n,))
            assert rows.data_ptr() == x.data_ptr() and rows.stride() == x.stride(), "strided rows were copied"
            check_fwd_bwd(op, x.detach(), (n,), randn(n, device=DEVICE), randn(n, device=DEVICE), backend="cuda",
                          what=f"cuda {op} strided {x.stride()} offset {x.storage_offset()}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_empty_batch(op, prebuilt):
    for shape in ((0, 64), (2, 0, 64), (0, 8192)):
        n = shape[-1]
        x = randn(*shape, device=DEVICE).requires_grad_(True)
        w = randn(n, device=DEVICE).requires_grad_(True)
        y = run(op, x, (n,), w, backend="cuda")
        assert y.shape == x.shape
        dx, dw = torch.autograd.grad(y, [x, w], torch.ones_like(y))
        assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 4099])
@pytest.mark.parametrize("op", OPS)
def test_inference_without_autograd(op, n, prebuilt, cuda_poison):
    """No tensor requires grad: functional.py asks the backend not to store statistics."""
    x, w = randn(33, n, device=DEVICE), randn(n, device=DEVICE)
    with torch.no_grad():
        y = run(op, x, (n,), w, backend="cuda")
    assert ref.rel_err(y, oracle(op, x, (n,), w)) <= TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [100, 4099, 65536])
@pytest.mark.parametrize("op", OPS)
def test_nan_stays_in_its_row(op, n, prebuilt):
    x = randn(6, n, device=DEVICE)
    x[2, 17] = math.nan
    w = randn(n, device=DEVICE)
    xg = x.clone().requires_grad_(True)
    y = run(op, xg, (n,), w, backend="cuda")
    ok = torch.tensor([i != 2 for i in range(6)], device=DEVICE)
    assert torch.isnan(y[2]).all()
    assert_close(y[ok], oracle(op, x[ok], (n,), w), TOL[torch.float32], "rows without NaN")
    dx, = torch.autograd.grad(y, [xg], randn(6, n, device=DEVICE))
    assert torch.isnan(dx[2]).all() and torch.isfinite(dx[ok]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["warp", "regs", "block-smem", "block-uncached", None])
@pytest.mark.parametrize("n", [768, 4096, 65536])
def test_offset_rows_keep_their_precision(n, impl, prebuilt):
    if impl == "warp" and n > configs.WARP_MAX_COLS:
        pytest.skip("the warp impl holds rows up to 1024 columns")
    x = 1e4 + randn(4, n, device=DEVICE)
    w, b = randn(n, device=DEVICE), randn(n, device=DEVICE)
    try:
        y, mean, rstd, _ = cb._row_fwd(x, w, b, 1e-5, False, force=impl)
    except ValueError:
        pytest.skip(f"{impl} cannot hold {n} fp32 columns")
    expected, mean_ref, rstd_ref = ref.layer_norm(x, (n,), w, b)
    err = assert_close(y, expected, 1e-5, f"offset rows {impl}")
    assert err < 1e-5, f"{impl}: {err:.3g} (shifted Welford should keep ~1e-7)"
    assert_close(mean, mean_ref, 1e-7, "mean")
    assert_close(rstd, rstd_ref, 1e-4, "rstd")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 8192, 65536])
@pytest.mark.parametrize("op", OPS)
def test_weight_gradients_are_bitwise_reproducible(op, n, prebuilt):
    x = randn(257, n, device=DEVICE).requires_grad_(True)
    w = randn(n, device=DEVICE).requires_grad_(True)
    b = randn(n, device=DEVICE).requires_grad_(True) if op == "layer_norm" else None
    dy = randn(257, n, device=DEVICE)
    leaves = [t for t in (x, w, b) if t is not None]
    first = torch.autograd.grad(run(op, x, (n,), w, b, backend="cuda"), leaves, dy)
    second = torch.autograd.grad(run(op, x, (n,), w, b, backend="cuda"), leaves, dy)
    for g1, g2 in zip(first, second):
        assert torch.equal(g1, g2)


@pytest.fixture
def small_gpu(monkeypatch):
    """A GPU with little shared memory and few register accumulators: the uncached kernels and the
    separate dweight/dbias kernel run at small widths."""
    monkeypatch.setattr(driver, "max_smem_optin", lambda index: 2048)
    monkeypatch.setattr(configs, "WARP_MAX_COLS", 64)
    monkeypatch.setattr(configs, "BWD_ACC_ELEMS", 1)
    cb._row_setup.cache_clear()
    yield
    cb._row_setup.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [100, 1000, 4099])
@pytest.mark.parametrize("op", OPS)
def test_uncached_and_param_kernel_paths(op, n, dtype, small_gpu, cuda_poison):
    x = randn(37, n, dtype=dtype, device=DEVICE)
    check_fwd_bwd(op, x, (n,), randn(n, device=DEVICE), randn(n, device=DEVICE), backend="cuda",
                  what=f"uncached {op} N={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["warp", "regs", "block-smem", "block-uncached"])
@pytest.mark.parametrize("pack", [None, 1])
def test_every_forward_impl_and_pack(impl, pack, prebuilt, cuda_poison):
    for n in (64, 768, 1000):
        x = randn(33, n, dtype=torch.float16, device=DEVICE)
        w, b = randn(n, device=DEVICE).half(), randn(n, device=DEVICE).half()
        y, mean, rstd, plan = cb._row_fwd(x, w, b, 1e-5, False, force=impl, pack=pack)
        assert plan.name == impl and (pack is None or plan.pack == pack)
        expected, mean_ref, rstd_ref = ref.layer_norm(x, (n,), w, b)
        assert_close(y, expected, TOL[torch.float16], f"{impl} pack {plan.pack} N={n}")
        assert_close(rstd, rstd_ref, 1e-5, "rstd")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", list(ref.ACTIVATIONS))
@pytest.mark.parametrize("n", [64, 1000, 8192, 65536])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_row_norm_activations(rms, n, activation, prebuilt, cuda_poison):
    """The fused epilogue y = act(xhat * w + b) and its derivative, through the backend directly."""
    dtype = torch.float32
    x = randn(9, n, dtype=dtype, device=DEVICE)
    w, b = randn(n, device=DEVICE), (None if rms else randn(n, device=DEVICE))
    eps = 1e-5
    y, mean, rstd = cb.row_norm_fwd(x, w, b, eps, rms, activation)
    if rms:
        expected = ref.rms_norm(x, (n,), w, eps, activation_name=activation)[0]
    else:
        expected = ref.layer_norm(x, (n,), w, b, eps, activation_name=activation)[0]
    assert_close(y, expected, 1e-5, f"{activation} y")
    dy = randn(9, n, device=DEVICE)
    dx, dw, db = cb.row_norm_bwd(dy, x, w, mean, rstd, rms, torch.float32, None if rms else torch.float32,
                                 bias=b, activation=activation)
    if rms:
        dx_ref, dw_ref = ref.rms_norm_backward(dy, x, (n,), w, eps, activation_name=activation)
        db_ref = None
    else:
        dx_ref, dw_ref, db_ref = ref.layer_norm_backward(dy, x, (n,), w, b, eps, activation_name=activation)
    assert_close(dx, dx_ref, 1e-4, f"{activation} dx")
    assert_close(dw, dw_ref, 1e-4, f"{activation} dweight")
    if db_ref is not None:
        assert_close(db, db_ref, 1e-4, f"{activation} dbias")


# ---------------------------------------------------------------------------- GroupNorm (GPU)

def _bcs(x4):
    """[B, C, S] view of [B, C, H, W] in its own layout."""
    B, C = x4.shape[:2]
    return x4.reshape(B, C, -1) if x4.is_contiguous() else x4.permute(0, 2, 3, 1).reshape(B, -1, C).transpose(1, 2)


def _mean_err(mean, mean_ref, rstd_ref):
    """Largest error of a mean in units of its group's standard deviation (means near 0 make a
    relative error meaningless; this is what shifts every normalized output)."""
    return ((mean.double().cpu() - mean_ref.cpu()).abs() * rstd_ref.cpu()).max().item()


GN_CASES = [  # B, C, H, W, G
    (2, 64, 8, 8, 8),
    (3, 30, 5, 7, 5),
    (1, 320, 32, 32, 32),
    (4, 16, 1, 1, 4),  # no spatial extent
    (2, 8, 4, 4, 1),  # one group
    (2, 12, 3, 3, 12),  # a group per channel
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("activation", [None] + list(ref.ACTIVATIONS))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_group_norm(dtype, activation, layout, prebuilt, cuda_poison):
    for B, C, H, W, G in GN_CASES:
        x4 = randn(B, C, H, W, dtype=dtype, device=DEVICE)
        if layout == "channels_last":
            x4 = x4.contiguous(memory_format=torch.channels_last)
        p_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        w, b = randn(C, dtype=p_dtype, device=DEVICE), randn(C, dtype=p_dtype, device=DEVICE)
        x = _bcs(x4)
        what = f"group_norm {tuple(x4.shape)} G={G} {dtype} {activation} {layout}"
        y, mean, rstd = cb.group_norm_fwd(x, G, w, b, 1e-5, activation)
        assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == dtype
        y_ref, mean_ref, rstd_ref = ref.group_norm(x4, G, w, b, 1e-5, activation_name=activation)
        assert_close(y.as_strided(x4.shape, x4.stride()), y_ref, TOL[dtype], f"{what} y")
        assert _mean_err(mean, mean_ref, rstd_ref) <= 1e-6, f"{what} mean"
        assert_close(rstd, rstd_ref, 1e-5, f"{what} rstd")
        dy4 = randn(B, C, H, W, dtype=dtype, device=DEVICE)
        if layout == "channels_last":
            dy4 = dy4.contiguous(memory_format=torch.channels_last)
        dx, dw, db = cb.group_norm_bwd(_bcs(dy4), x, G, w, b, mean, rstd, activation, p_dtype, p_dtype)
        assert dx.stride() == x.stride() and dw.dtype == db.dtype == p_dtype
        dx_ref, dw_ref, db_ref = ref.group_norm_backward(dy4, x4, G, w, b, 1e-5, activation_name=activation)
        tol = TOL[dtype] * (5 if activation else 1)  # act' rounds once more in fp32
        assert_close(dx.as_strided(x4.shape, x4.stride()), dx_ref, tol, f"{what} dx")
        assert_close(dw, dw_ref, max(param_tol(p_dtype, dtype), tol), f"{what} dweight")
        assert_close(db, db_ref, max(param_tol(p_dtype, dtype), tol), f"{what} dbias")


@pytest.mark.gpu
def test_group_norm_without_params_and_offset_groups(prebuilt, cuda_poison):
    x4 = 1e4 + randn(2, 32, 16, 16, device=DEVICE)
    for x4 in (x4, x4.contiguous(memory_format=torch.channels_last)):
        y, mean, rstd = cb.group_norm_fwd(_bcs(x4), 8, None, None, 1e-5, None)
        y_ref, mean_ref, _ = ref.group_norm(x4, 8)
        assert_close(y.as_strided(x4.shape, x4.stride()), y_ref, 1e-5, "offset groups (shifted Welford)")
        assert_close(mean, mean_ref, 1e-7, "offset group means")
        dy4 = randn(*x4.shape, device=DEVICE).contiguous(memory_format=torch.channels_last
                                                          if not x4.is_contiguous() else torch.contiguous_format)
        dx, dw, db = cb.group_norm_bwd(_bcs(dy4), _bcs(x4), 8, None, None, mean, rstd, None, None, None)
        assert dw is None and db is None
        assert_close(dx.as_strided(x4.shape, x4.stride()), ref.group_norm_backward(dy4, x4, 8)[0], 2e-3,
                     "dx without params")


@pytest.mark.gpu
def test_group_norm_gradients_are_bitwise_reproducible(prebuilt):
    x4 = randn(4, 64, 32, 32, device=DEVICE).contiguous(memory_format=torch.channels_last)
    w, b = randn(64, device=DEVICE), randn(64, device=DEVICE)
    x = _bcs(x4)
    dy = _bcs(randn(4, 64, 32, 32, device=DEVICE).contiguous(memory_format=torch.channels_last))
    _, mean, rstd = cb.group_norm_fwd(x, 16, w, b, 1e-5, "silu")
    first = cb.group_norm_bwd(dy, x, 16, w, b, mean, rstd, "silu", torch.float32, torch.float32)
    second = cb.group_norm_bwd(dy, x, 16, w, b, mean, rstd, "silu", torch.float32, torch.float32)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


# ---------------------------------------------------------------------------- failures and the ladder (GPU)

@pytest.mark.gpu
def test_launch_failure_names_the_kernel():
    x = torch.zeros(4, 8, device=DEVICE)
    cb._begin(x)
    kernel = driver.load(kernels.col_sum(torch.float32, None), x.device.index or 0)
    kernel.smem_granted = 10**9  # pretend the opt-in happened, so the driver itself refuses
    with pytest.raises(driver.CudaDriverError, match=r"launch of kernel nk::col_sum<float, float>.*CUDA_ERROR"):
        kernel.launch((1,), (32, 8), [x, x[0], None, None, 4, 8], smem=10**6)


@pytest.mark.gpu
def test_ladder_end_to_end(tmp_path, capsys):
    from normkit.cli import main
    assert main(["ladder", "--backend", "cuda", "--quick", "--plot", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for expected in ("kernel 1: thread per row", "kernel 5", "block-uncached", "torch.nn.functional.layer_norm",
                     "seed 004", "Copy ceiling"):
        assert expected in out
    md = (tmp_path / "ladder.md").read_text()
    # precision table: E[x^2] - E[x]^2 fails on offset rows, Welford and two-pass pass
    prec = md[md.index("### 3."):md.index("### 4.")]
    assert re.search(r"kernel 4.*FAIL", prec) and re.search(r"kernel 3.*\| pass", prec)
    assert all("pass" in line for line in prec.splitlines() if "normkit cuda" in line)
    assert (tmp_path / "ladder.csv").stat().st_size > 0 and (tmp_path / "ladder.png").stat().st_size > 0


# ---------------------------------------------------------------------------- the cluster kernels (GPU, sm_90)

def _hopper():
    return HAS_CUDA and torch.cuda.get_device_capability() >= configs.CLUSTER_MIN_CAPABILITY


needs_hopper = pytest.mark.skipif(not _hopper(), reason="thread-block clusters need an sm_90 GPU")
# 200000 pads to 256K: the forward's register caps of CLUSTER_FWD_SM_THREADS at 128K and 256K (session 23)
CLUSTER_CASES = [(3, 16384), (37, 16392), (5, 24576), (2, 131072), (1, 65536), (133, 32768), (3, 200000)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("m,n", CLUSTER_CASES)
@pytest.mark.parametrize("op", OPS)
def test_cluster_kernels_match_oracle(op, m, n, dtype, cuda_poison, monkeypatch):
    """The cluster kernels at awkward row counts (fewer rows than clusters, one row) and widths that
    are not powers of two. configs.CLUSTER_WIDTHS (measured) decides where backend="cuda" takes them;
    here every width of the cases is sent there, so the kernels stay checked at each."""
    from normkit.backends.cuda import configs as cc
    for key in list(cc.CLUSTER_WIDTHS):
        monkeypatch.setitem(cc.CLUSTER_WIDTHS, key, (16384, 262144))
    x = randn(m, n, dtype=dtype, device=DEVICE) * 2 + 0.5
    w, b = randn(n, device=DEVICE), randn(n, device=DEVICE)
    rms = op == "rms_norm"
    assert cb._on_clusters("fwd", x, (), w, None if rms else b, None, rms) is not None
    assert cb._on_clusters("bwd", x, (x,), w, None, None, rms, True) is not None
    check_fwd_bwd(op, x, (n,), w, b, backend="cuda", what=f"cluster {op} {m}x{n} {dtype}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_rms_forward_with_a_bias_at_cluster_widths(backend):
    """The backends' interface takes a bias for RMSNorm too (no public function passes one). The cluster forward
    never reads it, so such a call at a width routed to the clusters runs another kernel, with the bias added."""
    from normkit.backends import get
    n = 131072
    x = randn(3, n, dtype=torch.bfloat16, device=DEVICE) + 0.5
    w, b = randn(n, device=DEVICE), randn(n, device=DEVICE)
    assert cb._on_clusters("fwd", x, (), w, b, None, True) is None and cb._on_clusters("fwd", x, (), w, None, None,
                                                                                          True) is not None
    y = get(backend).row_norm_fwd(x, w, b, 1e-6, True)[0]
    expect = ref.rms_norm(x.double(), (n,), w.double(), 1e-6)[0] + b.double()
    assert ref.rel_err(y, expect) <= TOL[torch.bfloat16]


# the push forward (quack's exchange): reload or registers, one or two stages
# session 10: + merge (one value per CTA in the exchange), one_pass (LayerNorm's moments in one read)
PUSH_SHAPES = [(256, 8, 1, True, True), (256, 8, 1, False, True), (128, 8, 2, True, True),
               (256, 8, 1, True, True, True, True), (256, 8, 1, False, True, True, False),
               (128, 8, 2, True, True, True, True), (256, 8, 1, True, True, False, True)]


def _check_cuda_fwd(x, w, b, rms, offset, what):
    """The CUDA backend's forward of rows x against the float64 oracle (y, mean, rstd), and the same bits twice."""
    n = x.shape[-1]
    y, mean, rstd = cb.row_norm_fwd(x, w, b, 1e-5, rms)
    if rms:
        y_ref, rstd_ref = ref.rms_norm(x, (n,), w, 1e-5)
    else:
        y_ref, mean_ref, rstd_ref = ref.layer_norm(x, (n,), w, b, 1e-5)
        assert_close(mean, mean_ref, 1e-6, what + " mean")
    assert_close(y, y_ref, TOL[x.dtype], what)
    assert_close(rstd, rstd_ref, 1e-4 if offset else 2e-5, what + " rstd")
    y2 = cb.row_norm_fwd(x, w, b, 1e-5, rms)[0]
    assert torch.equal(y.nan_to_num(), y2.nan_to_num()), what


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("waves", [None, 1], ids=["rows", "walking"])
@pytest.mark.parametrize("shape", PUSH_SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + ("-reload" if s[3] else "")
                         + ("-merge" if s[5:6] == (True,) else "") + ("-onepass" if s[6:7] == (True,) else ""))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", OPS)
def test_push_forward_matches_oracle(op, dtype, shape, waves, cuda_poison, monkeypatch):
    """The push forward against the float64 oracle (y, mean, rstd) at awkward shapes, with clusters
    of one row each and (waves=1) clusters walking rows, which reuses each exchange barrier at the
    next phase; rows offset by 1e4; a NaN confined to its row; the same bits twice."""
    from normkit.backends.cuda import cluster
    eb = torch.empty((), dtype=dtype).element_size()
    monkeypatch.setitem(configs.CLUSTER_KERNELS, ("fwd", eb), shape)
    monkeypatch.setattr(configs, "CLUSTER_SHAPES", {})
    monkeypatch.setattr(configs, "CLUSTER_FWD_HOLD", {})  # (test_held_parameters_forward_matches_oracle's)
    for kind in ("ln", "rms"):
        monkeypatch.setitem(configs.CLUSTER_WIDTHS, ("fwd", kind, eb), (16384, 262144))
    if waves is not None:
        monkeypatch.setattr(configs, "CLUSTER_PUSH_WAVES", waves)
    cluster.prepare.cache_clear()
    rms = op == "rms_norm"
    try:
        for m, n, offset in [(37, 16392, 0.0), (5, 24576, 0.0), (1, 65536, 0.0), (700, 65536, 0.0),
                             (3, 262144, 0.0), (9, 32768, 1e4)]:
            x = (randn(m, n, device=DEVICE) * 2 + 0.5 + offset).to(dtype)
            if m >= 3:
                x[m // 2, n // 3] = math.nan
            w, b = randn(n, device=DEVICE), randn(n, device=DEVICE)
            p = cb._on_clusters("fwd", x, (), w, None if rms else b, None, rms)
            assert p is not None and p.plan.push and p.plan.recompute == shape[3]
            assert (p.plan.merge, p.plan.one_pass) == (tuple(shape[5:]) + (False, False))[:2]
            _check_cuda_fwd(x, w, None if rms else b, rms, offset, f"push {op} {m}x{n} {dtype} offset {offset}")
    finally:
        cluster.prepare.cache_clear()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32, None], ids=["w-bf16", "w-fp32", "no-w"])
@pytest.mark.parametrize("op", OPS)
def test_held_parameters_forward_matches_oracle(op, wdtype, cuda_poison, monkeypatch):
    """The forward on one wave of persistent clusters holding their parameters over their rows (CLUSTER_FWD_HOLD,
    session 26), for both ops, at widths that are not powers of two and row counts from one to many walks per cluster,
    rows offset by 1e4, a NaN confined to its row, the same bits twice."""
    from normkit.backends.cuda import cluster
    monkeypatch.setattr(configs, "CLUSTER_FWD_HOLD", {(k, 2, n): ((256, 4, 2, True, True), 1024)
                                                      for k in ("ln", "rms") for n in (65536, 131072, 262144)})
    for kind in ("ln", "rms"):
        monkeypatch.setitem(configs.CLUSTER_WIDTHS, ("fwd", kind, 2), (32768, 262144))
    cluster.prepare.cache_clear()
    rms = op == "rms_norm"
    try:
        for m, n, offset in [(1, 65536, 0.0), (700, 65536, 0.0), (3, 200000, 0.0), (257, 131072, 1e4),
                             (40, 131064, 0.0)]:
            x = (randn(m, n, device=DEVICE) * 2 + 0.5 + offset).to(torch.bfloat16)
            if m >= 3:
                x[m // 2, n // 3] = math.nan
            w = None if wdtype is None else randn(n, device=DEVICE).to(wdtype)
            b = None if rms or wdtype is None else randn(n, device=DEVICE).to(wdtype)
            p = cb._on_clusters("fwd", x, (), w, b, None, rms)
            assert p is not None and p.plan.hold_w and p.plan.stages == 2
            _check_cuda_fwd(x, w, b, rms, offset, f"held {op} {m}x{n} w {wdtype} offset {offset}")
    finally:
        cluster.prepare.cache_clear()


# the push backward (session 14): the row sums' exchange by st.async (registers or recompute, merge); two rows in
# flight (session 15, OVERLAP: four slot buffers reused along each cluster's walk), with and without merge
PUSH_BWD_SHAPES = [(512, 2, 2, False, True), (256, 4, 3, True, True), (256, 4, 3, True, True, True),
                   (256, 4, 3, True, True, False, True), (512, 2, 4, True, True, True, True),
                   (512, 2, 2, False, True, False, True), (512, 2, 3, False, True, True, True)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", PUSH_BWD_SHAPES, ids=lambda s: "x".join(map(str, s[:3])) +
                         ("-recompute" if s[3] else "") + ("-merge" if s[5:6] == (True,) else "") +
                         ("-overlap" if s[6:7] == (True,) else ""))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", OPS)
def test_push_backward_matches_oracle(op, dtype, shape, cuda_poison, monkeypatch):
    """The push backward against the float64 oracle (dx, dweight, dbias) with fewer rows than clusters,
    one row, and clusters walking many rows (each exchange barrier reused at the next phases); rows offset
    by 1e4; a NaN confined to its row's dx; the same bits twice."""
    from normkit.backends.cuda import cluster
    eb = torch.empty((), dtype=dtype).element_size()
    monkeypatch.setitem(configs.CLUSTER_KERNELS, ("bwd", eb), shape)
    monkeypatch.setattr(configs, "CLUSTER_SHAPES", {})
    for kind in ("ln", "rms"):
        monkeypatch.setitem(configs.CLUSTER_WIDTHS, ("bwd", kind, eb), (16384, 262144))
    cluster.prepare.cache_clear()
    rms = op == "rms_norm"
    try:
        for m, n, offset in [(3, 16392, 0.0), (1, 65536, 0.0), (700, 16384, 0.0), (37, 24576, 0.0),
                             (9, 32768, 1e4)]:
            what = f"push backward {op} {m}x{n} {dtype} offset {offset}"
            x = (randn(m, n, device=DEVICE) * 2 + 0.5 + offset).to(dtype)
            w, b = randn(n, device=DEVICE), randn(n, device=DEVICE)
            p = cb._on_clusters("bwd", x, (x,), w, None, None, rms, True)
            if p is None:  # a plan too big for this width (fp32 stages): the shape does not apply
                continue
            assert p.plan.push and p.plan.recompute == shape[3] and p.plan.overlap == (shape[6:7] == (True,))
            dy = randn(m, n, dtype=dtype, device=DEVICE)
            if offset and dtype == torch.float32 and not rms:
                # the forward's fp32 mean of rows at 1e4 is rounded by up to ulp(1e4) / 2 against a spread of 2:
                # xhat, and so dweight, carry ~1.5e-4 of relative error in any kernel that reads the statistics
                _, mean, rstd = cb.row_norm_fwd(x, w, b, 1e-5, rms)
                dx, dw, db = cb.row_norm_bwd(dy, x, w, mean, rstd, rms, torch.float32, torch.float32)
                dx_ref, dw_ref, db_ref = oracle_grads(op, dy, x, (n,), w, b)
                assert_close(dx, dx_ref, TOL[dtype], what + " dx")
                assert_close(dw, dw_ref, 1e-3, what + " dweight")
                assert_close(db, db_ref, 2e-5, what + " dbias")
            else:
                check_fwd_bwd(op, x, (n,), w, b, backend="cuda", what=what)
            _, mean, rstd = cb.row_norm_fwd(x, w, None if rms else b, 1e-5, rms)
            g1, g2 = (cb.row_norm_bwd(dy, x, w, None if rms else mean, rstd, rms, torch.float32,
                                      None if rms else torch.float32) for _ in range(2))
            assert all(a is None and c is None or torch.equal(a, c) for a, c in zip(g1, g2)), what
            if m >= 3:
                xn = x.clone()
                xn[m // 2, n // 3] = math.nan
                _, mean, rstd = cb.row_norm_fwd(xn, w, None if rms else b, 1e-5, rms)
                dx = cb.row_norm_bwd(dy, xn, w, None if rms else mean, rstd, rms, None, None)[0]
                assert torch.isnan(dx[m // 2]).all(), what
                assert torch.isfinite(torch.cat([dx[:m // 2], dx[m // 2 + 1:]])).all(), what
    finally:
        cluster.prepare.cache_clear()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_cluster_kernels_with_activation(activation, cuda_poison):
    m, n = 7, 24576
    x = randn(m, n, dtype=torch.bfloat16, device=DEVICE)
    w, b = randn(n, device=DEVICE), randn(n, device=DEVICE)
    y, mean, rstd = cb.row_norm_fwd(x, w, b, 1e-5, False, activation)
    assert_close(y, ref.layer_norm(x, (n,), w, b, 1e-5, activation)[0], TOL[torch.bfloat16], "y")
    dy = randn(m, n, dtype=torch.bfloat16, device=DEVICE)
    dx, dw, db = cb.row_norm_bwd(dy, x, w, mean, rstd, False, torch.float32, torch.float32, bias=b,
                                 activation=activation)
    dx_ref, dw_ref, db_ref = ref.layer_norm_backward(dy, x, (n,), w, b, 1e-5, activation)
    assert_close(dx, dx_ref, TOL[torch.bfloat16], "dx")
    assert_close(dw, dw_ref, 2e-5, "dweight")
    assert_close(db, db_ref, 2e-5, "dbias")


GN_CLUSTER_CASES = [((2, 320, 64, 64), 32), ((3, 60, 12, 12), 6), ((1, 32, 8, 8), 32), ((3, 128, 64, 64), 32),
                    ((2, 1280, 8, 8), 32), ((5, 48, 56, 56), 3), ((2, 64, 128, 128), 32)]


@pytest.fixture
def gn_cluster_route(monkeypatch):
    """Every dense NCHW group (of positions in whole packs) on the GroupNorm cluster kernels."""
    from normkit.backends import triton as tb
    from normkit.backends.triton import configs as tc
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    monkeypatch.setattr(tc, "GN_CLUSTER_ROUTE", {arch: {(d, b): ((0, 1 << 40),) for d in ("fwd", "bwd") for b in (2, 4)}})
    monkeypatch.setattr(tc, "GN_CL_CLUSTER_ROUTE", {arch: {(d, b): ((0, 1 << 40),) for d in ("fwd", "bwd") for b in (2, 4)}})
    tb.clear_caches()
    yield
    monkeypatch.undo()
    tb.clear_caches()


def _check_gn_cluster_route(x, groups, dtype, act, what):
    """The oracle (affine and not), groups offset by 1e4, a NaN confined to its group and the same gradient
    bits in every run, through normkit.group_norm on the Triton backend (whose route the caller set)."""
    from test_group_norm import check_gn
    B, C = x.shape[:2]
    p_dtype = torch.float32 if dtype == torch.float32 else (dtype if act else torch.float32)
    check_gn(x, groups, randn(C, dtype=p_dtype, device=DEVICE), randn(C, dtype=p_dtype, device=DEVICE), act,
             what=what)
    check_gn(x.detach().clone(), groups, None, None, act, what=what + " no affine")
    xo = x.detach().float() + 1e4
    assert_close(normkit.group_norm(xo, groups, activation=act, backend="triton"),
                 ref.group_norm(xo, groups, None, None, 1e-5, act)[0], 1e-4, what + " offset")
    xn = x.detach().clone()
    xn[B - 1, C - 1, 0, 0] = math.nan  # the last group of the last sample
    y = normkit.group_norm(xn, groups, activation=act, backend="triton")
    cg = C // groups
    assert torch.isnan(y[B - 1, C - cg:]).all()
    assert not torch.isnan(y[:B - 1]).any() and not torch.isnan(y[B - 1, :C - cg]).any()
    w = randn(C, device=DEVICE).requires_grad_(True)
    b = randn(C, device=DEVICE).requires_grad_(True)
    xg = x.detach().requires_grad_(True)
    dy = torch.empty_like(x).copy_(randn(*x.shape, dtype=dtype, device=DEVICE))  # x's memory format
    g1, g2 = (torch.autograd.grad(normkit.group_norm(xg, groups, w, b, activation=act, backend="triton"),
                                  [xg, w, b], dy) for _ in range(2))
    assert all(torch.equal(a, c) for a, c in zip(g1, g2)), what + ": gradients differ between runs"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape,groups", GN_CLUSTER_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"g{v}")
def test_gn_cluster_kernels_match_oracle(shape, groups, dtype, act, gn_cluster_route, cuda_poison):
    """GroupNorm on the cluster kernels (forward and backward, through the Triton backend's route):
    the float64 oracle at diffusion shapes, groups of one channel, small and prime-ish groups, fp32 and
    x-dtype parameters; groups offset by 1e4; a NaN confined to its group; bitwise weight gradients."""
    from normkit.backends import triton as tb
    B, C = shape[:2]
    x = randn(*shape, dtype=dtype, device=DEVICE) * 2 + 0.5
    x3 = x.view(B, C, -1)
    for direction, rows_like, params in (("fwd", (), False), ("bwd", (x3,), True)):
        p = tb._gn_on_clusters(direction, x3, rows_like, groups, None, None, act, params)
        # routed wherever a plan exists (fp32 backward of 2 channels x 16384: no whole-channel slices fit)
        planned = configs.plan_gn_cluster(direction, C // groups, x3.shape[2], x.element_size(), params)
        assert (p is not None) == (planned is not None), f"{shape} G={groups} {direction}: {planned}"
        assert planned is not None or (dtype == torch.float32 and direction == "bwd")
    _check_gn_cluster_route(x, groups, dtype, act, f"cluster GN {shape} G={groups} {dtype} {act}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape,groups", [((2, 320, 64, 64), 32), ((3, 60, 12, 12), 6), ((3, 128, 64, 64), 32),
                                          ((5, 48, 56, 56), 3), ((2, 1280, 8, 8), 32), ((24, 320, 32, 32), 32)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"g{v}")
def test_gn_push_backward_matches_oracle(shape, groups, dtype, gn_cluster_route, cuda_poison, monkeypatch):
    """The GroupNorm cluster backward with the push exchange (session 14; one persistent wave, whose clusters
    walk several groups at 24x320x32x32's 768): the checks of the cluster kernels (oracle, offset, NaN confined,
    bitwise weight gradients)."""
    from normkit.backends import triton as tb
    from normkit.backends.cuda import cluster
    eb = torch.empty((), dtype=dtype).element_size()
    monkeypatch.setitem(configs.GN_CLUSTER_KERNELS, ("bwd", eb), (128, 8, 2, False, True))
    cluster.prepare_gn.cache_clear()
    tb.clear_caches()
    B, C = shape[:2]
    x = randn(*shape, dtype=dtype, device=DEVICE) * 2 + 0.5
    x3 = x.view(B, C, -1)
    try:
        p = tb._gn_on_clusters("bwd", x3, (x3,), groups, None, None, "silu", True)
        assert p is not None and p.plan.push
        _check_gn_cluster_route(x, groups, dtype, "silu", f"push GN backward {shape} G={groups} {dtype}")
    finally:
        cluster.prepare_gn.cache_clear()
        tb.clear_caches()


GN_CL_CLUSTER_CASES = [((2, 320, 64, 64), 32), ((3, 64, 12, 12), 8), ((1, 32, 8, 8), 32), ((3, 128, 64, 64), 32),
                       ((2, 1280, 8, 8), 32), ((5, 48, 56, 56), 3), ((2, 64, 128, 128), 32), ((4, 40, 5, 7), 5),
                       ((1, 320, 64, 64), 32)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape,groups", GN_CL_CLUSTER_CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"g{v}")
def test_gn_cl_cluster_kernels_match_oracle(shape, groups, dtype, act, gn_cluster_route, cuda_poison):
    """channels_last GroupNorm on the cluster kernels (forward and backward, through the Triton backend's
    route): the float64 oracle at diffusion shapes, batch 1 (16 CTAs a slab), groups of one channel, odd
    positions; mean and rstd; groups offset by 1e4; a NaN confined to its group; the same bits in every run."""
    from normkit.backends import triton as tb
    B, C = shape[:2]
    x = (randn(*shape, dtype=dtype, device=DEVICE) * 2 + 0.5).contiguous(memory_format=torch.channels_last)
    x3 = x.permute(0, 2, 3, 1).reshape(B, -1, C).transpose(1, 2)  # [B, C, S], channels innermost
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for direction, rows_like, params in (("fwd", (), False), ("bwd", (x3,), True)):
        p = tb._gn_on_clusters(direction, x3, rows_like, groups, None, None, act, params)
        assert p is not None and p.plan == configs.plan_gn_cl_cluster(direction, B, C, x3.shape[2], C // groups,
                                                                       x.element_size(), sms), direction
    what = f"cluster channels_last GN {shape} G={groups} {dtype} {act}"
    w, b = randn(C, device=DEVICE), randn(C, device=DEVICE)
    y, mean, rstd = tb.group_norm_fwd(x3, groups, w, b, 1e-5, act)
    _, mean_ref, rstd_ref = ref.group_norm(x, groups, w, b, 1e-5, act)
    assert_close(mean, mean_ref, 1e-5, what + " mean")
    assert_close(rstd, rstd_ref, 1e-5, what + " rstd")
    assert torch.equal(y, tb.group_norm_fwd(x3, groups, w, b, 1e-5, act)[0]), what + ": y differs between runs"
    _check_gn_cluster_route(x, groups, dtype, act, what)


@pytest.fixture
def triton_route(monkeypatch):
    """Both paths of the Triton backend at the widths its table routes to the cluster kernels."""
    from normkit.backends import triton as tb
    from normkit.backends.triton import configs as tc

    def use(on: bool):
        for key in (("fwd", 2), ("bwd", 2), ("fwd", 4), ("bwd", 4)):
            monkeypatch.setitem(tc.CUDA_OVERRIDES, key, (16384, 32768, 131072) if on else ())
        tb.clear_caches()
    yield use
    tb.clear_caches()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("routed", [True, False], ids=["cluster", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", OPS)
def test_triton_backend_both_paths(op, dtype, routed, triton_route):
    from normkit.backends import triton as tb
    triton_route(routed)
    n = 16384
    x = randn(9, n, dtype=dtype, device=DEVICE)
    cfg = tb._plan("bwd", n, x.element_size(), x.device, (op == "rms_norm", True, False, None, (True, False)))[0]
    assert cfg.cuda == routed
    check_fwd_bwd(op, x, (n,), randn(n, device=DEVICE), randn(n, device=DEVICE), backend="triton",
                  what=f"triton backend {'routed' if routed else 'kernels'} {op}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("op", OPS)
def test_cluster_weight_gradients_are_bitwise_reproducible_and_nan_stays(op, triton_route):
    triton_route(True)
    n = 32768
    x = randn(301, n, dtype=torch.bfloat16, device=DEVICE)
    x[17] = float("nan")
    w = randn(n, device=DEVICE).requires_grad_(True)
    b = randn(n, device=DEVICE).requires_grad_(True) if op == "layer_norm" else None
    x.requires_grad_(True)
    dy = randn(301, n, dtype=torch.bfloat16, device=DEVICE)
    leaves = [t for t in (x, w, b) if t is not None]
    y = run(op, x, (n,), w, b, backend="triton")
    assert torch.isnan(y[17]).all() and torch.isfinite(torch.cat([y[:17], y[18:]])).all()
    clean = torch.cat([x.detach()[:17], x.detach()[18:]]).requires_grad_(True)
    dyc = torch.cat([dy[:17], dy[18:]])
    grads = [torch.autograd.grad(run(op, clean, (n,), w, b, backend="triton"), [clean] + leaves[1:], dyc)
             for _ in range(2)]
    for g1, g2 in zip(*grads):
        assert torch.equal(g1, g2)
