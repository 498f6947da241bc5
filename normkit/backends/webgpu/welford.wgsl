// Seed 000's third kernel: Welford's running (count, mean, M2) per invocation, merged across the
// workgroup by the reduction above. One read for the statistics, exact like the two-pass kernel.
// With VEC = 4 each invocation loads a vec4 and folds it in as a chunk of four.
// The values are centered on the row's first value, as in twopass.wgsl.
// RMSNorm keeps the mean at 0, so M2 is the plain sum of squares.

alias Acc = vec3<f32>;  // (count, mean, M2)

fn acc_zero() -> Acc {
    return Acc(0.0);
}

// Chan et al.'s merge of two partial results, written so that combine(a, b) and combine(b, a)
// are equal bit for bit (the xor butterfly relies on it).
fn combine(a: Acc, b: Acc) -> Acc {
    if a.x == 0.0 {
        return b;
    }
    if b.x == 0.0 {
        return a;
    }
    let n = a.x + b.x;
    if RMS {
        return Acc(n, 0.0, a.z + b.z);
    }
    let d = b.y - a.y;
    return Acc(n, (a.x * a.y + b.x * b.y) / n, a.z + b.z + d * d * (a.x * b.x / n));
}

// Welford's update by a chunk of VEC values (its own mean and M2, merged in); for VEC = 1 it equals
// the textbook update mean += (v - mean) / n, M2 += (v - mean_old) * (v - mean_new).
fn add_chunk(a: Acc, v: FV) -> Acc {
    let k = f32(VEC);
    if RMS {
        return Acc(a.x + k, 0.0, a.z + hsum(v * v));
    }
    let m = hsum(v) / k;
    let d = v - m;
    return combine(a, Acc(k, m, hsum(d * d)));
}

fn kernel(row: u32, lid: u32, sg_size: u32, sg_lane: u32) {
    if row >= params.rows {
        return;
    }
    let shift = select(first_of(load(row, 0u)), 0.0, RMS);
    var acc = acc_zero();
    for (var i = lid; i < row_len(); i += WG) {
        acc = add_chunk(acc, load(row, i) - shift);
    }
    let total = reduce(acc, lid, sg_size, sg_lane);
    normalize_row(row, lid, shift, total.y, inverseSqrt(total.z / total.x + params.eps));
}
