// Seed 000's first kernel: sum and sum of squares in one read, var = E[x^2] - E[x]^2.
// Fast, but the subtraction cancels catastrophically when |mean| >> std: rows offset by 1e4
// come out wrong. Kept as the ladder's cautionary first rung; never used by the backend.

alias Acc = vec2<f32>;  // (sum, sum of squares)

fn acc_zero() -> Acc {
    return Acc(0.0);
}

fn combine(a: Acc, b: Acc) -> Acc {
    return a + b;
}

fn kernel(row: u32, lid: u32, sg_size: u32, sg_lane: u32) {
    if row >= params.rows {
        return;
    }
    var acc = acc_zero();
    for (var i = lid; i < row_len(); i += WG) {
        let v = load(row, i);
        acc += Acc(hsum(v), hsum(v * v));
    }
    let total = reduce(acc, lid, sg_size, sg_lane);
    let n = f32(params.n);
    let mean = select(total.x / n, 0.0, RMS);
    let variance = max(total.y / n - mean * mean, 0.0);
    normalize_row(row, lid, 0.0, mean, inverseSqrt(variance + params.eps));
}
