"""The WGSL kernels: which variants exist and how each shader's source is put together.

Pure Python (no wgpu, no torch), so `normkit export-wgsl`, `normkit export-web` and the CLI's parser
never need a GPU stack. A shader is a short generated header (storage type, LayerNorm or RMSNorm,
activation, workgroup size) followed by .wgsl files chosen by the variant and the op (parts()):
the load width (vec1/vec4), common.wgsl (bindings and epilogue), the layout (rows or groups), the
activations, a reduction (workgroup tree or subgroup butterfly) and an algorithm (onepass, twopass,
welford). The JavaScript module (normkit/web) inlines these same files and assembles them the same
way; tests/test_web.py checks that both give identical text for every kernel.
"""
from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKGROUP_SIZE = 256  # a multiple of every subgroup size from 4 to 64 (and up to 256)
# the kernels work for any power-of-two workgroup size in this range (the JS module lets a page pick one:
# software adapters such as SwiftShader pay per invocation of a workgroup, so smaller ones run faster there)
WORKGROUP_SIZES = (4, 8, 16, 32, 64, 128, 256)
MAX_GRID_X = 65535    # WebGPU's guaranteed maxComputeWorkgroupsPerDimension
ROW_OPS = ("layer_norm", "rms_norm")
OPS = ROW_OPS + ("group_norm",)
DTYPES = ("f32", "f16")
ELEMENT_SIZE = {"f32": 4, "f16": 2}
# the adapter features a variant/dtype needs, by wgpu-py's names (wgpu-py's "subgroups" enables nothing)
SUBGROUP_FEATURE = "subgroup"
F16_FEATURE = "shader-f16"
PARAMS_BYTES = 32  # struct Params in common.wgsl: 8 x 4 bytes
FLAGS = {"weight": 1, "bias": 2, "channels_last": 4}  # Params.flags, as in common.wgsl


@dataclass(frozen=True)
class Variant:
    name: str
    algo: str        # the algorithm file: onepass | twopass | welford
    width: int       # values per load: 1, or 4 (needs N % 4 == 0)
    subgroup: bool   # subgroup butterfly instead of the shared-memory tree
    about: str

    @property
    def exact(self) -> bool:
        """Whether the variant is meant to pass the offset rows (only onepass is not)."""
        return self.algo != "onepass"


# the ladder's rungs, in order (seed 000: one-pass, two-pass, Welford with subgroup shuffles)
VARIANTS = {v.name: v for v in (
    Variant("onepass", "onepass", 1, False, "sum and sum of squares, E[x^2]-E[x]^2; shared-memory tree"),
    Variant("twopass", "twopass", 1, False, "mean, then squared deviations; reads x three times"),
    Variant("welford", "welford", 1, False, "Welford per invocation, shared-memory tree of merges"),
    Variant("welford_subgroup", "welford", 1, True, "Welford per invocation, subgroup xor butterfly"),
    Variant("welford_vec4", "welford", 4, False, "Welford on vec4 loads, shared-memory tree"),
    Variant("welford_vec4_subgroup", "welford", 4, True, "Welford on vec4 loads, subgroup xor butterfly"),
)}


@functools.lru_cache(maxsize=None)
def _read(name: str) -> str:
    return (HERE / name).read_text()


@functools.lru_cache(maxsize=None)
def activation_codes() -> dict:
    """{None: 0, "silu": 1, ...}: the ACT_* constants of activations.wgsl, the one list of codes."""
    found = re.findall(r"^const ACT_([A-Z_]+): u32 = (\d+)u;", _read("activations.wgsl"), re.M)
    return {(None if name == "NONE" else name.lower()): int(code) for name, code in found}


def vec4_blocker(variant: Variant, op: str, n: int, spatial: int = 1, channels_last: bool = False) -> str | None:
    """Why the shape rules out this variant's vec4 loads (None if they fit); names the argument."""
    if variant.width == 1:
        return None
    if op != "group_norm":
        return None if n % 4 == 0 else \
            f"x: variant {variant.name!r} loads vec4s and needs a row length divisible by 4, got N={n}"
    if channels_last:
        return f"x: variant {variant.name!r} loads vec4s along the spatial dims and needs NCHW memory, not channels_last"
    return None if spatial % 4 == 0 else \
        f"x: variant {variant.name!r} loads vec4s and needs a spatial size divisible by 4, got S={spatial}"


def best_variant(n: int, has_subgroups: bool, op: str = "layer_norm", spatial: int = 1,
                 channels_last: bool = False) -> Variant:
    """What the backend runs: Welford, vec4 loads where the shape allows, subgroups where the adapter has them."""
    sub = "_subgroup" if has_subgroups else ""
    vec4 = VARIANTS["welford_vec4" + sub]
    return vec4 if vec4_blocker(vec4, op, n, spatial, channels_last) is None else VARIANTS["welford" + sub]


def _check(variant, op: str, dtype: str, activation) -> Variant:
    if isinstance(variant, str):
        if variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {', '.join(VARIANTS)}, got {variant!r}")
        variant = VARIANTS[variant]
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if activation not in activation_codes():
        raise ValueError(f"activation: expected None or one of {', '.join(a for a in activation_codes() if a)}, "
                         f"got {activation!r}")
    return variant


def parts(variant: Variant, op: str) -> list[str]:
    """The .wgsl files after the header, in order (mirrored by partsOf() in normkit/web/normkit.js)."""
    return [f"vec{variant.width}.wgsl", "common.wgsl", "groups.wgsl" if op == "group_norm" else "rows.wgsl",
            "activations.wgsl", "reduce_subgroup.wgsl" if variant.subgroup else "reduce_workgroup.wgsl",
            f"{variant.algo}.wgsl"]


def header(variant: Variant, op: str, dtype: str, activation, for_browser: bool,
           workgroup_size: int = WORKGROUP_SIZE) -> str:
    """The generated lines before the parts (mirrored by header() in normkit/web/normkit.js)."""
    enables = []
    if dtype == "f16":
        enables.append("enable f16;")
    if variant.subgroup and for_browser:
        # WGSL requires it and browsers (Dawn) enforce it; wgpu's Naga rejects it, so only exports carry it
        enables.append("enable subgroups;")
    return "\n".join([
        f"// normkit {op} forward, variant {variant.name}, {dtype} storage, f32 math, "
        f"activation {activation or 'none'}: {variant.about}.",
        "// Generated from normkit's .wgsl parts (normkit/backends/webgpu); edit those, not this text.",
        *enables,
        "",
        f"alias T = {dtype};",
        f"const RMS: bool = {'true' if op == 'rms_norm' else 'false'};",
        f"const ACT: u32 = {activation_codes()[activation]}u;",
        f"const WG: u32 = {workgroup_size}u;",
        "",
    ])


def source(variant: Variant | str, op: str, dtype: str, activation: str | None = None, *,
           for_browser: bool = False, workgroup_size: int = WORKGROUP_SIZE) -> str:
    """The full WGSL of one kernel. for_browser adds `enable subgroups;` where subgroups are used."""
    variant = _check(variant, op, dtype, activation)
    if workgroup_size not in WORKGROUP_SIZES:
        raise ValueError(f"workgroup_size: expected one of {WORKGROUP_SIZES}, got {workgroup_size!r}")
    return "\n".join([header(variant, op, dtype, activation, for_browser, workgroup_size)] +
                     [_read(p) for p in parts(variant, op)])


def probe_source(workgroup_size: int = WORKGROUP_SIZE) -> str:
    """The subgroup-layout probe (subgroup_probe.wgsl) for this workgroup size."""
    return f"const WG: u32 = {workgroup_size}u;\n" + _read("subgroup_probe.wgsl")


def grid(rows: int) -> tuple[int, int]:
    """Workgroups to dispatch for `rows` rows: one per row, folded into 2-D past MAX_GRID_X."""
    gx = min(rows, MAX_GRID_X)
    return gx, -(-rows // gx)


def web_data() -> dict:
    """Everything normkit/web/normkit.js needs to build the same kernels: the .wgsl files verbatim,
    the variants, the activation codes and the constants above."""
    files = sorted(p.name for p in HERE.glob("*.wgsl"))
    return {
        "wgsl": {name: _read(name) for name in files},
        "variants": [asdict(v) for v in VARIANTS.values()],
        "activations": {("none" if a is None else a): c for a, c in activation_codes().items()},
        "ops": list(OPS),
        "dtypes": list(DTYPES),
        "workgroupSize": WORKGROUP_SIZE,
        "workgroupSizes": list(WORKGROUP_SIZES),
        "maxGridX": MAX_GRID_X,
        "paramsBytes": PARAMS_BYTES,
        "flags": FLAGS,
    }
