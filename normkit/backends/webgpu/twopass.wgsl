// Seed 000's second kernel: the mean first, then the sum of squared deviations from it.
// Exact, but it reads the row three times (mean, variance, normalize).
// Both sums run over x - shift, shift = the row's first value: that subtraction is exact for
// values near shift (Sterbenz), so a large common offset never enters the f32 sums.

alias Acc = f32;

fn acc_zero() -> Acc {
    return 0.0;
}

fn combine(a: Acc, b: Acc) -> Acc {
    return a + b;
}

fn kernel(row: u32, lid: u32, sg_size: u32, sg_lane: u32) {
    if row >= params.rows {
        return;
    }
    let n = f32(params.n);
    let shift = select(first_of(load(row, 0u)), 0.0, RMS);
    var mean_s = 0.0;
    if !RMS {
        var s = acc_zero();
        for (var i = lid; i < row_len(); i += WG) {
            s += hsum(load(row, i) - shift);
        }
        mean_s = reduce(s, lid, sg_size, sg_lane) / n;
    }
    var q = acc_zero();
    for (var i = lid; i < row_len(); i += WG) {
        let d = load(row, i) - shift - mean_s;
        q += hsum(d * d);
    }
    let variance = reduce(q, lid, sg_size, sg_lane) / n;
    normalize_row(row, lid, shift, mean_s, inverseSqrt(variance + params.eps));
}
