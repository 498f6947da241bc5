// GroupNorm addressing: row r = b * groups + g is group g of sample b, i.e. channels
// [g * cpg, (g + 1) * cpg) at every spatial position (cpg = channels per group = n / spatial).
// NCHW ([B, C, S] memory): those n values are contiguous, as a row of the row norms; a vec4 holds
// four positions of one channel (the host picks vec4 only for NCHW with spatial % 4 == 0).
// channels_last ([B, S, C] memory): cpg consecutive values at each of the spatial positions, C apart;
// element i is channel i % cpg at position i / cpg (VEC is 1 there).

@group(0) @binding(3) var<storage, read> weight: array<f32>;  // [C], read if HAS_WEIGHT
@group(0) @binding(4) var<storage, read> bias: array<f32>;    // [C], read if HAS_BIAS

fn row_len() -> u32 {
    return params.n / VEC;  // in XV elements
}

fn per_group() -> u32 {
    return params.n / params.spatial;
}

fn channels_last() -> bool {
    return (params.flags & CHANNELS_LAST) != 0u;
}

fn at(row: u32, i: u32) -> u32 {
    if !channels_last() {
        return row * row_len() + i;
    }
    let cpg = per_group();
    let b = row / params.groups;
    let g = row % params.groups;
    return (b * params.spatial + i / cpg) * (params.groups * cpg) + g * cpg + i % cpg;
}

fn channel(row: u32, i: u32) -> u32 {
    let cpg = per_group();
    let first = (row % params.groups) * cpg;
    if channels_last() {
        return first + i % cpg;
    }
    return first + i * VEC / params.spatial;
}

fn weight_at(row: u32, i: u32) -> FV {
    return FV(weight[channel(row, i)]);
}

fn bias_at(row: u32, i: u32) -> FV {
    return FV(bias[channel(row, i)]);
}
