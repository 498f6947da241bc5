"""`normkit export-wgsl DIR`: the WGSL kernels as a browser (Dawn, WebGPU in JS) wants them.

Each file (no activation) is exactly the shader the wgpu runner compiles and the tests check, plus the
`enable subgroups;` line that WGSL requires where subgroup builtins are used (Naga rejects it, so
the runner leaves it out). A README.md beside them gives the bindings and dispatch sizes.
"""
from __future__ import annotations

from pathlib import Path

from . import shaders


def add_arguments(parser) -> None:
    parser.add_argument("dir", metavar="DIR", help="folder to write the .wgsl files and README.md into")


def file_name(variant: shaders.Variant, op: str, dtype: str) -> str:
    return f"{op}_{variant.name}_{dtype}.wgsl"


README = """\
# normkit WGSL kernels (LayerNorm / RMSNorm / GroupNorm forward)

Written by `normkit export-wgsl`. One file per kernel: `<op>_<variant>_<dtype>.wgsl`, each a
complete compute shader with entry point `main`. Statistics and arithmetic are f32; `f16` files store
x and y as f16. Every one of them ran against a float64 oracle in normkit's tests (on wgpu, without
the `enable subgroups;` line, which Naga does not accept yet, and in Chromium as exported). For a
JavaScript module that wires all this up, see `normkit export-web`.

The files apply no activation (`const ACT: u32 = 0u;` in the header). Set it to 1 (SiLU), 2 (Mish),
3 (GELU), 4 (GELU, tanh form) or 5 (ReLU) to fuse that activation after the affine transform.

| variant | reduction | needs |
|---|---|---|
{variants}

Device features: `f16` files need `"shader-f16"`; `*_subgroup_*` files need `"subgroups"`. Both are
requested in `requestDevice({{requiredFeatures: [...]}})`.

## Bindings (group 0)

| binding | WGSL | buffer binding type | contents |
|---|---|---|---|
| 0 | `var<uniform> params: Params` | `uniform` | {params} bytes: `rows, n: u32, eps: f32, flags, groups, spatial, 0, 0: u32` |
| 1 | `var<storage, read> x` | `read-only-storage` | the input (f32 or f16), see below |
| 2 | `var<storage, read_write> y` | `storage` | output, same layout and type as x |
| 3 | `var<storage, read> weight` | `read-only-storage` | f32, one per column (n) or per channel (C, GroupNorm); read only if `flags & 1` |
| 4 | `var<storage, read> bias` | `read-only-storage` | as weight; read only if `flags & 2` (LayerNorm, GroupNorm) |
| 5 | `var<storage, read_write> stats` | `storage` | rows x `vec2<f32>`: (mean, rstd) per row; mean is 0 for RMSNorm |

LayerNorm / RMSNorm: x holds `rows` rows of `n` values, rows contiguous; `groups`, `spatial` unused.
GroupNorm of x [B, C, S] (S = H x W) in G groups: `rows = B * G`, `n = C / G * S`, `groups = G`,
`spatial = S`; x is NCHW ([B, C, S] memory), or channels_last ([B, S, C] memory) with `flags & 4`.

Bind a small placeholder buffer (16 bytes) for weight or bias when absent and leave its flag bit 0.
Every binding must be in the bind group, also where a kernel does not read it (bias in RMSNorm),
so create the bind group layout explicitly rather than with `layout: "auto"`.
Buffer sizes: round up to a multiple of 16 bytes (the vec4 variants read `vec4` elements).

## Dispatch

Workgroup size {wg} (1-D), one workgroup per row: `dispatchWorkgroups(gx, gy)` with
`gx = min(rows, 65535)` and `gy = ceil(rows / gx)`; row = `workgroup_id.x + workgroup_id.y * gx`,
and workgroups past the last row return at once.

- `vec4` variants load four values at a time: they need `n % 4 == 0`; for GroupNorm, NCHW memory
  and `spatial % 4 == 0`.
- `subgroup` variants assume what every driver does for a 1-D workgroup of {wg}: subgroups are
  consecutive invocations of one power-of-two size (4 to {wg}). normkit checks that once per device
  with a probe kernel before it uses them; a page can do the same, or use the workgroup variants.
- LayerNorm variants other than `onepass` center each row on its first value before summing, so
  rows with a large common offset (say 1e4 with unit variance) stay exact; `onepass` computes
  E[x^2]-E[x]^2 and fails such rows (seed 000's lesson), kept for comparison only.
"""


def run(args) -> int:
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for variant in shaders.VARIANTS.values():
        for op in shaders.OPS:
            for dtype in shaders.DTYPES:
                (out / file_name(variant, op, dtype)).write_text(shaders.source(variant, op, dtype, for_browser=True))
                written += 1
    rows = "\n".join(
        f"| `{v.name}` | {'subgroup xor butterfly' if v.subgroup else 'shared-memory tree'} | "
        f"{', '.join(['n % 4 == 0'] * (v.width == 4) + ['subgroups'] * v.subgroup) or '-'} |"
        for v in shaders.VARIANTS.values())
    (out / "README.md").write_text(README.format(variants=rows, wg=shaders.WORKGROUP_SIZE, params=shaders.PARAMS_BYTES))
    print(f"wrote {written} WGSL kernels and README.md to {out}")
    return 0
