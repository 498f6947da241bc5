// The uniform parameters, x / y / stats bindings and the normalize-and-store epilogue of every kernel.
// Above this file: the generated header (T, RMS, ACT, WG) and vec1.wgsl or vec4.wgsl (XV: what one
// invocation loads, FV: its f32 counterpart, VEC, hsum, first_of). Below it: the layout (rows.wgsl or
// groups.wgsl: weight, bias, row_len(), at(), weight_at(), bias_at()), activations.wgsl, a reduction
// (main() and reduce()) and an algorithm (Acc, combine() and kernel(row, lid, sg_size, sg_lane)).
// A "row" is what one workgroup normalizes: a row of x for LayerNorm/RMSNorm, a (sample, group) for GroupNorm.
// Builtins travel as separate scalars, never in a struct: WGSL's uniformity analysis counts a
// struct as non-uniform if any member is, and the barriers need the row and subgroup size uniform.

struct Params {
    rows: u32,     // rows, or batch x groups for GroupNorm: one workgroup each
    n: u32,        // values per row (a multiple of VEC)
    eps: f32,
    flags: u32,    // HAS_WEIGHT | HAS_BIAS | CHANNELS_LAST
    groups: u32,   // GroupNorm: groups per sample (else unused)
    spatial: u32,  // GroupNorm: values per channel (else unused)
    pad0: u32,
    pad1: u32,
}
const HAS_WEIGHT: u32 = 1u;
const HAS_BIAS: u32 = 2u;
const CHANNELS_LAST: u32 = 4u;  // GroupNorm on [B, S, C] memory instead of [B, C, S]

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<XV>;
@group(0) @binding(2) var<storage, read_write> y: array<XV>;             // same layout as x
@group(0) @binding(5) var<storage, read_write> stats: array<vec2<f32>>;  // per row: (mean, rstd)

// One workgroup per row; past 65535 rows the host launches a 2-D grid.
fn row_of(wg: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wg.x + wg.y * nwg.x;
}

fn load(row: u32, i: u32) -> FV {
    return FV(x[at(row, i)]);
}

// y = act(((x - shift) - mean_s) * rstd * weight + bias), in f32, stored as T.
// Variants that center on shift (the row's first value) pass the mean of the shifted values as
// mean_s, so the rounding of a large mean never reaches y.
fn normalize_row(row: u32, lid: u32, shift: f32, mean_s: f32, rstd: f32) {
    for (var i = lid; i < row_len(); i += WG) {
        let k = at(row, i);
        var v = (FV(x[k]) - shift - mean_s) * rstd;
        if (params.flags & HAS_WEIGHT) != 0u {
            v *= weight_at(row, i);
        }
        if (params.flags & HAS_BIAS) != 0u {
            v += bias_at(row, i);
        }
        y[k] = XV(activate(v));
    }
    if lid == 0u {
        stats[row] = vec2<f32>(shift + mean_s, rstd);
    }
}
