// Bindings, row addressing and the normalize-and-store epilogue shared by every variant.
// The generated header above this file defines T (storage type of x and y), XV (T or vec4<T>:
// what one invocation loads), FV (its f32 counterpart), VEC (1 or 4), RMS, WG, hsum and first_of.
// The reduction file below defines the entry point main() and reduce(); the algorithm file defines
// Acc, combine() and kernel(row, lid, sg_size, sg_lane), which main() calls for its row.
// Builtins travel as separate scalars, never in a struct: WGSL's uniformity analysis counts a
// struct as non-uniform if any member is, and the barriers need the row and subgroup size uniform.

struct Params {
    rows: u32,   // M
    n: u32,      // N, values per row (a multiple of VEC)
    eps: f32,
    flags: u32,  // HAS_WEIGHT | HAS_BIAS
}
const HAS_WEIGHT: u32 = 1u;
const HAS_BIAS: u32 = 2u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<XV>;             // [M, N], rows contiguous
@group(0) @binding(2) var<storage, read_write> y: array<XV>;       // [M, N]
@group(0) @binding(3) var<storage, read> weight: array<FV>;        // [N] f32, read if HAS_WEIGHT
@group(0) @binding(4) var<storage, read> bias: array<FV>;          // [N] f32, read if HAS_BIAS
@group(0) @binding(5) var<storage, read_write> stats: array<vec2<f32>>;  // [M] (mean, rstd)

// One workgroup per row; past 65535 rows the host launches a 2-D grid.
fn row_of(wg: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wg.x + wg.y * nwg.x;
}

fn row_len() -> u32 {
    return params.n / VEC;  // in XV elements
}

fn load(row: u32, i: u32) -> FV {
    return FV(x[row * row_len() + i]);
}

// y = ((x - shift) - mean_s) * rstd * weight + bias, accumulated in f32 and stored as T.
// Variants that center on shift (the row's first value) pass the mean of the shifted values as
// mean_s, so the rounding of a large mean never reaches y.
fn normalize_row(row: u32, lid: u32, shift: f32, mean_s: f32, rstd: f32) {
    let base = row * row_len();
    for (var i = lid; i < row_len(); i += WG) {
        var v = (FV(x[base + i]) - shift - mean_s) * rstd;
        if (params.flags & HAS_WEIGHT) != 0u {
            v *= weight[i];
        }
        if (params.flags & HAS_BIAS) != 0u {
            v += bias[i];
        }
        y[base + i] = XV(v);
    }
    if lid == 0u {
        stats[row] = vec2<f32>(shift + mean_s, rstd);
    }
}
