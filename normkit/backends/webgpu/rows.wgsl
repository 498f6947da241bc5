// LayerNorm / RMSNorm addressing: row r is x[r * n, (r + 1) * n), contiguous; weight and bias
// hold one f32 per column.

@group(0) @binding(3) var<storage, read> weight: array<FV>;  // [n], read if HAS_WEIGHT
@group(0) @binding(4) var<storage, read> bias: array<FV>;    // [n], read if HAS_BIAS

fn row_len() -> u32 {
    return params.n / VEC;  // in XV elements
}

// index in x and y of element i (in XV units) of the row
fn at(row: u32, i: u32) -> u32 {
    return row * row_len() + i;
}

fn weight_at(row: u32, i: u32) -> FV {
    return weight[i];
}

fn bias_at(row: u32, i: u32) -> FV {
    return bias[i];
}
