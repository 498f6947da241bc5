"""Triton kernels for row normalization: LayerNorm and RMSNorm are one family (RMS = no centering,
no bias), selected by constexpr flags so each variant compiles to its own lean kernel.

Three shapes of the same algorithm, chosen per row width by the configuration table (configs.py):

* tile (SPLIT == 1): a [BLOCK_M, BLOCK_N] tile holds BLOCK_M whole rows in registers; the
  statistics are two passes over the on-chip data (mean, then sum of squared deviations). Several
  rows per program keep narrow rows (32..1024 columns) from starving the memory system.
* split row (SPLIT > 1): a row too wide for one program's registers is cut into SPLIT slices held
  by SPLIT programs of one group. Each computes its slice's partial statistics, publishes them to a
  small global scratch and waits on a counter (release/acquire) until the group has published;
  then every program reads all partials at once, merges them in the same fixed order and
  finishes its slice. This is
  what a thread-block cluster with distributed shared memory does; the grid is persistent and
  sized so that all its programs are resident at once (launch.resident_programs_per_sm).
* looped: a row walked in BLOCK_N chunks by one program (any width; also the path the Triton
  interpreter takes for wide rows, since it runs programs one after another and cannot wait).

Statistics are computed on data shifted by the row's first element and merged across slices or
chunks with Chan's parallel Welford update: no E[x^2] - E[x]^2 cancellation, even at 1e4 offsets.
All row offsets are int64: tensors above 2**31 elements index correctly.

Rows are addressed by two strides and a column stride: row r of an input is (r // INNER, r % INNER)
of an [O, INNER] grid, so q/k heads sliced out of a fused QKV projection, or the channels of an
NCHW tensor (column stride H*W), are read where they lie. Triton specializes INNER == 1 and unit
strides to constants, so plain rows compile to the same code as before. Outputs are dense [M, N].

Fused epilogues, each a constexpr flag (epilogue.py): a residual add before the statistics (h = x +
residual, rounded to h's dtype, is what is normalized, and is stored when asked: the new residual
stream), a weight offset (y = xhat * (offset + w)), the output cast (any float dtype, float8 with a
scale and saturation) and the amax of y; in the backward, the gradient of h added to dx, and dx
written in a second dtype for the residual.
"""
import triton
import triton.language as tl

from .epilogue import act_fwd, act_grad, amax_bits, out_value, round_h


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _chan_merge(mean, m2, n, mean_b, m2_b, n_b):
    """Merge (mean_b, m2_b) over n_b elements into (mean, m2) over n elements."""
    n_total = n + n_b
    delta = mean_b - mean
    frac = n_b / tl.maximum(n_total, 1.0)
    return mean + delta * frac, m2 + m2_b + delta * delta * (n * frac), n_total


@triton.jit
def _publish_and_wait(SYNC, SCRATCH, group, k, it, a, b, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Write this program's per-row partials (a, b) to its group's slot for iteration `it` and wait
    until all SPLIT programs of the group have done so. Returns the slot; partial j of the group is
    at slot + j * 2 * BLOCK_M (a) and + BLOCK_M (b). Slots alternate between two buffers, so a
    fast program can never overwrite partials a slow one has yet to read."""
    offs = tl.arange(0, BLOCK_M)
    slot = SCRATCH + ((group * 2 + it % 2) * SPLIT).to(tl.int64) * (2 * BLOCK_M)
    tl.store(slot + k * (2 * BLOCK_M) + offs, a)
    tl.store(slot + k * (2 * BLOCK_M) + BLOCK_M + offs, b)
    tl.debug_barrier()  # every thread's store is done before the release below
    tl.atomic_add(SYNC + group, 1, sem="release")
    target = (it + 1) * SPLIT
    arrived = tl.atomic_add(SYNC + group, 0, sem="acquire")
    while arrived < target:
        arrived = tl.atomic_add(SYNC + group, 0, sem="acquire")
    return slot


@triton.jit
def _read_partials(slot, second: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """All SPLIT partials of the group as one [SPLIT, BLOCK_M] tile (one batch of loads, not SPLIT
    round trips). volatile: straight from L2, never a stale L1 line."""
    offs = tl.arange(0, SPLIT)[:, None] * (2 * BLOCK_M) + tl.arange(0, BLOCK_M)[None, :] + (BLOCK_M if second else 0)
    return tl.load(slot + offs, volatile=True)


@triton.jit
def _group_exit(SYNC, group, num_groups, SPLIT: tl.constexpr):
    """The last program of a group to leave resets the group's counters for the next launch."""
    tl.debug_barrier()
    left = tl.atomic_add(SYNC + num_groups + group, 1, sem="acq_rel")
    if left == SPLIT - 1:
        tl.atomic_xchg(SYNC + group, 0)
        tl.atomic_xchg(SYNC + num_groups + group, 0)


@triton.jit
def _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                 PER_ROW: tl.constexpr):
    """(w, b) as fp32 tiles that broadcast over a tile's rows: the effective weight w_offset + w
    (Gemma's 1 + w) and the bias, [1, BLOCK_N]; with per-head parameters ([W_ROWS, N], row r uses
    row r % W_ROWS: q/k norms with one weight per head), one row each, [BLOCK_M, BLOCK_N]."""
    if PER_ROW:
        offs = (rows % W_ROWS)[:, None] * N + cols[None, :]
    else:
        offs = cols[None, :]
    w = 0.0
    b = 0.0
    if HAS_W:
        w = tl.load(W + offs, mask=col_mask[None, :], other=0.0).to(tl.float32) + w_offset
    if HAS_B:
        b = tl.load(B + offs, mask=col_mask[None, :], other=0.0).to(tl.float32)
    return w, b


@triton.jit
def _epilogue(xhat, w, b, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr):
    y = xhat
    if HAS_W:
        y = y * w
    if HAS_B:
        y = y + b
    return act_fwd(y, ACT)


@triton.jit
def _head_rows(jb, head, rows_per_head, W_ROWS, BLOCK_M: tl.constexpr):
    """(rows, mask) of block jb of one head's rows: the backward walks the rows of a head together
    so that a program's weight-gradient partials belong to one head. Plain parameters (W_ROWS == 1,
    a constant once specialized): block jb of all rows."""
    j = (jb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return j * W_ROWS + head, j < rows_per_head


# ----------------------------------------------------------------------------- row addressing

@triton.jit
def _row_start(rows, INNER, s_o, s_i):
    """Offset of each row's first element: row r is (r // INNER, r % INNER) of an [O, INNER] grid."""
    return (rows // INNER) * s_o + (rows % INNER) * s_i


@triton.jit
def _offsets(rows, cols, INNER, s_o, s_i, s_c):
    return _row_start(rows, INNER, s_o, s_i)[:, None] + cols.to(tl.int64)[None, :] * s_c


@triton.jit
def _load_tile(P, rows, row_mask, cols, col_mask, INNER, s_o, s_i, s_c):
    """The [rows, cols] tile of a strided operand as fp32 (zeros outside the masks)."""
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(P + _offsets(rows, cols, INNER, s_o, s_i, s_c), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_h(X, R, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c,
            HAS_RES: tl.constexpr, H_ROUND: tl.constexpr):
    """The tile that is normalized, fp32: x, or h = x + residual rounded to h's dtype."""
    x = _load_tile(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
    if HAS_RES:
        x = round_h(x + _load_tile(R, rows, row_mask, cols, col_mask, INNER, sr_o, sr_i, sr_c), H_ROUND)
    return x


@triton.jit
def _load_h_first(X, R, rows, row_mask, INNER, sx_o, sx_i, sr_o, sr_i, HAS_RES: tl.constexpr, H_ROUND: tl.constexpr):
    """Each row's first element of what is normalized (the shift of the statistics)."""
    x = tl.load(X + _row_start(rows, INNER, sx_o, sx_i), mask=row_mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + _row_start(rows, INNER, sr_o, sr_i), mask=row_mask, other=0.0).to(tl.float32)
        x = round_h(x + r, H_ROUND)
    return x


@triton.jit
def _store_outputs(Y, H, x, y, rows, cols, mask, N, scale, amax, STORE_H: tl.constexpr, FP8: tl.constexpr,
                   WANT_AMAX: tl.constexpr):
    """Store y (and h) of a tile in the dense [M, N] outputs; returns amax merged with the tile's."""
    offs = rows[:, None] * N + cols[None, :]
    tl.store(Y + offs, out_value(y, scale, Y.dtype.element_ty, FP8), mask=mask)
    if STORE_H:
        tl.store(H + offs, x.to(H.dtype.element_ty), mask=mask)
    if WANT_AMAX:
        amax = tl.maximum(amax, amax_bits(y, mask))
    return amax


# ----------------------------------------------------------------------------- forward

@triton.jit
def _fwd_tile(x, X, R, Y, H, W, B, MEAN, RSTD, SYNC, SCRATCH, block, group, k, it, M, N, INNER,
              sx_o, sx_i, sr_o, sr_i, eps, W_ROWS, w_offset, scale, amax, cols, col_mask,
              IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, PER_ROW_W: tl.constexpr,
              STORE_STATS: tl.constexpr,
              ACT: tl.constexpr, HAS_RES: tl.constexpr, STORE_H: tl.constexpr, H_ROUND: tl.constexpr,
              FP8: tl.constexpr, WANT_AMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              SPLIT: tl.constexpr):
    """Normalize one loaded tile x (rows of `block`, columns `cols`) and store it; returns amax."""
    rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    mask = row_mask[:, None] & col_mask[None, :]
    if IS_RMS:
        sum_sq = tl.sum(x * x, axis=1)
        if SPLIT > 1:
            slot = _publish_and_wait(SYNC, SCRATCH, group, k, it, sum_sq, sum_sq, SPLIT, BLOCK_M)
            sum_sq = tl.sum(_read_partials(slot, False, SPLIT, BLOCK_M), axis=0)
        rstd = tl.rsqrt(sum_sq / N + eps)
        xc = x
    else:
        # shifted data: x - x[row, 0] is small, so its sums keep the digits a raw sum loses
        shift = _load_h_first(X, R, rows, row_mask, INNER, sx_o, sx_i, sr_o, sr_i, HAS_RES, H_ROUND)
        xs = tl.where(mask, x - shift[:, None], 0.0)
        n_local = tl.minimum(tl.maximum(N - k * BLOCK_N, 1), BLOCK_N) * 1.0
        mean_s = tl.sum(xs, axis=1) / n_local
        xc = tl.where(mask, xs - mean_s[:, None], 0.0)
        m2 = tl.sum(xc * xc, axis=1)
        if SPLIT > 1:
            slot = _publish_and_wait(SYNC, SCRATCH, group, k, it, mean_s, m2, SPLIT, BLOCK_M)
            # exact merge of the slices: mean = sum n_j mean_j / N,
            # M2 = sum M2_j + sum n_j (mean_j - mean)^2 (no cancellation: all terms >= 0)
            n_j = (tl.minimum(tl.maximum(N - tl.arange(0, SPLIT) * BLOCK_N, 0), BLOCK_N) * 1.0)[:, None]
            means = _read_partials(slot, False, SPLIT, BLOCK_M)
            mean_s = tl.sum(n_j * means, axis=0) / N
            d = means - mean_s[None, :]
            m2 = tl.sum(_read_partials(slot, True, SPLIT, BLOCK_M) + n_j * d * d, axis=0)
            xc = tl.where(mask, xs - mean_s[:, None], 0.0)
        rstd = tl.rsqrt(m2 / N + eps)
    # weights are loaded late: they are not live (registers) while the statistics are computed
    w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
    y = _epilogue(xc * rstd[:, None], w, b, HAS_W, HAS_B, ACT)
    amax = _store_outputs(Y, H, x, y, rows, cols, mask, N, scale, amax, STORE_H, FP8, WANT_AMAX)
    if STORE_STATS:
        first = row_mask & ((rows * 0 + k) == 0)  # vector form: the interpreter rejects a scalar mask term
        tl.store(RSTD + rows, rstd, mask=first)
        if not IS_RMS:
            tl.store(MEAN + rows, shift + mean_s, mask=first)
    return amax


@triton.jit
def row_norm_fwd_kernel(
    X, R, Y, H, W, B, MEAN, RSTD, AMAX, SCALE, SYNC, SCRATCH,
    M, N, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, eps, W_ROWS, w_offset, scale,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, PER_ROW_W: tl.constexpr,
    STORE_STATS: tl.constexpr,
    ACT: tl.constexpr, HAS_RES: tl.constexpr, STORE_H: tl.constexpr, H_ROUND: tl.constexpr, FP8: tl.constexpr,
    SCALE_PTR: tl.constexpr, WANT_AMAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, LOOPED: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    pid = tl.program_id(0)
    if SCALE_PTR:  # a device-side scale (delayed scaling): read, never synchronized to the host
        scale = tl.load(SCALE).to(tl.float32)
    amax = tl.full([], 0, tl.int32)
    if LOOPED:
        rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        amax = _fwd_looped(X, R, Y, H, W, B, rows, rows < M, N, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, eps,
                           W_ROWS, w_offset, scale, MEAN, RSTD, IS_RMS, HAS_W, HAS_B, PER_ROW_W, STORE_STATS, ACT,
                           HAS_RES, STORE_H, H_ROUND, FP8, WANT_AMAX, BLOCK_M, BLOCK_N)
    elif not PERSISTENT:  # one row block per program
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        x = _load_h(X, R, rows, rows < M, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, HAS_RES, H_ROUND)
        amax = _fwd_tile(x, X, R, Y, H, W, B, MEAN, RSTD, SYNC, SCRATCH, pid, pid, 0, 0, M, N, INNER,
                         sx_o, sx_i, sr_o, sr_i, eps, W_ROWS, w_offset, scale, amax, cols, col_mask,
                         IS_RMS, HAS_W, HAS_B, PER_ROW_W, STORE_STATS, ACT, HAS_RES, STORE_H, H_ROUND, FP8, WANT_AMAX,
                         BLOCK_M, BLOCK_N, 1)
    else:  # groups of SPLIT programs walk row blocks group, group + G, ...
        group = pid // SPLIT
        k = pid % SPLIT
        num_groups = tl.num_programs(0) // SPLIT
        num_blocks = tl.cdiv(M, BLOCK_M)
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        rows = (group * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        x_next = _load_h(X, R, rows, rows < M, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c,
                         HAS_RES, H_ROUND)
        for block in range(group, num_blocks, num_groups):
            x = x_next
            # prefetch the next tile now: its loads overlap the wait at the group barrier
            rows = ((block + num_groups) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            x_next = _load_h(X, R, rows, rows < M, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c,
                             HAS_RES, H_ROUND)
            amax = _fwd_tile(x, X, R, Y, H, W, B, MEAN, RSTD, SYNC, SCRATCH, block, group, k,
                             (block - group) // num_groups, M, N, INNER, sx_o, sx_i, sr_o, sr_i, eps, W_ROWS, w_offset,
                             scale, amax, cols, col_mask, IS_RMS, HAS_W, HAS_B, PER_ROW_W, STORE_STATS, ACT, HAS_RES, STORE_H, H_ROUND,
                             FP8, WANT_AMAX, BLOCK_M, BLOCK_N, SPLIT)
        if SPLIT > 1:
            _group_exit(SYNC, group, num_groups, SPLIT)
    if WANT_AMAX:  # an integer max over programs: exact and the same in any order
        tl.atomic_max(AMAX, amax)


@triton.jit
def _fwd_looped(X, R, Y, H, W, B, rows, row_mask, N, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, eps, W_ROWS,
                w_offset, scale, MEAN, RSTD, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                PER_ROW_W: tl.constexpr, STORE_STATS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr, STORE_H: tl.constexpr,
                H_ROUND: tl.constexpr, FP8: tl.constexpr, WANT_AMAX: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """One program walks its rows in BLOCK_N chunks: statistics, then normalize. Returns amax."""
    num_chunks = tl.cdiv(N, BLOCK_N)
    amax = tl.full([], 0, tl.int32)
    if IS_RMS:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        shift = _load_h_first(X, R, rows, row_mask, INNER, sx_o, sx_i, sr_o, sr_i, HAS_RES, H_ROUND)
        mean_s = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for chunk in range(0, num_chunks):
        cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = _load_h(X, R, rows, row_mask, cols, cols < N, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, HAS_RES, H_ROUND)
        if IS_RMS:
            sum_sq += tl.sum(x * x, axis=1)
        else:
            n_chunk = tl.minimum(N - chunk * BLOCK_N, BLOCK_N) * 1.0
            xs = tl.where(mask, x - shift[:, None], 0.0)
            c_mean = tl.sum(xs, axis=1) / n_chunk
            d = tl.where(mask, xs - c_mean[:, None], 0.0)
            mean_s, m2, _ = _chan_merge(mean_s, m2, chunk * BLOCK_N * 1.0, c_mean, tl.sum(d * d, axis=1), n_chunk)
    if IS_RMS:
        rstd = tl.rsqrt(sum_sq / N + eps)
    else:
        rstd = tl.rsqrt(m2 / N + eps)
    # normalize, last chunk first: it is the one most likely still in L2
    for i in range(0, num_chunks):
        cols = (num_chunks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_h(X, R, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, HAS_RES, H_ROUND)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            xhat = ((x - shift[:, None]) - mean_s[:, None]) * rstd[:, None]
        w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
        y = _epilogue(xhat, w, b, HAS_W, HAS_B, ACT)
        amax = _store_outputs(Y, H, x, y, rows, cols, mask, N, scale, amax, STORE_H, FP8, WANT_AMAX)
    if STORE_STATS:
        tl.store(RSTD + rows, rstd, mask=row_mask)
        if not IS_RMS:
            tl.store(MEAN + rows, shift + mean_s, mask=row_mask)
    return amax


# ----------------------------------------------------------------------------- backward

@triton.jit
def _bwd_terms(x, dy, w, b, mean, rstd, mask, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
               ACT: tl.constexpr, ONE_COL: tl.constexpr):
    """(xhat, g, w*g) for a tile, zero outside `mask`; g is dy through the activation's derivative.
    ONE_COL (rows of one element, where LayerNorm's exact dx is 0: xhat = 0 and c2 = w*g): w*g is
    rounded once, by an FMA with a zero addend, which no compiler fuses into a later add. A plain
    product may be contracted with _dx's subtraction of c2, which then sees w*g unrounded and leaves
    its rounding error times rstd. Wider rows keep the plain product: letting the compiler fuse it
    is faster (8% on a 4096-wide fp32 LayerNorm backward on an H100)."""
    if IS_RMS:
        xhat = tl.where(mask, x * rstd[:, None], 0.0)
    else:
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    g = dy
    if ACT != 0:
        z = xhat
        if HAS_W:
            z = z * w
        if HAS_B:
            z = z + b
        g = tl.where(mask, act_grad(z, dy, ACT), 0.0)
    if HAS_W:
        if ONE_COL:
            wg = tl.fma(g, w, 0.0)
        else:
            wg = g * w
    else:
        wg = g
    return xhat, g, wg


@triton.jit
def _dx(xhat, wg, rstd, c1, c2, IS_RMS: tl.constexpr):
    """dx = rstd * (w*g - xhat * c1 - c2), with c1 = mean(xhat * w*g), c2 = mean(w*g) (0 for RMS)."""
    if IS_RMS:
        return (wg - xhat * c1[:, None]) * rstd[:, None]
    else:
        return (wg - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]


@triton.jit
def _store_dx(DX, DRES, DH, dx, rows, row_mask, cols, col_mask, N, INNER, sdh_o, sdh_i, sdh_c,
              HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr):
    """dx (+ dh, the residual stream's own gradient) into DX, and the same values into DRES in its dtype."""
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_DH:
        dx += _load_tile(DH, rows, row_mask, cols, col_mask, INNER, sdh_o, sdh_i, sdh_c)
    offs = rows[:, None] * N + cols[None, :]
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_DRES:
        tl.store(DRES + offs, dx.to(DRES.dtype.element_ty), mask=mask)


@triton.jit
def row_norm_bwd_kernel(
    DY, X, DH, W, B, MEAN, RSTD, DX, DRES, DW_PART, DB_PART, SYNC, SCRATCH,
    M, N, INNER, sdy_o, sdy_i, sdy_c, sx_o, sx_i, sx_c, sdh_o, sdh_i, sdh_c, W_ROWS, w_offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, PER_ROW_W: tl.constexpr, WANT_DW: tl.constexpr,
    WANT_DB: tl.constexpr, ACT: tl.constexpr, HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, LOOPED: tl.constexpr,
):
    """Persistent: group g (SPLIT programs; one program unless the row is split) handles row blocks
    g, g + G, g + 2G, ... and writes its fp32 partial sums of dweight/dbias to row g of
    DW_PART/DB_PART ([G, N]); col_sum_kernel then adds the G partials in a fixed order.
    With per-head parameters (W_ROWS heads; G a multiple of W_ROWS) group g walks only the rows of
    head g % W_ROWS, so DW_PART is [G / W_ROWS, W_ROWS * N] and the same reduction gives [W_ROWS, N].
    No float atomics anywhere: gradients are bitwise reproducible."""
    pid = tl.program_id(0)
    group = pid // SPLIT
    k = pid % SPLIT
    num_groups = tl.num_programs(0) // SPLIT
    part_row = group.to(tl.int64) * N
    head = group % W_ROWS
    rows_per_head = M // W_ROWS
    blocks_per_head = tl.cdiv(rows_per_head, BLOCK_M)
    step = num_groups // W_ROWS
    if LOOPED:
        _bwd_looped(DY, X, DH, W, B, MEAN, RSTD, DX, DRES, DW_PART, DB_PART, part_row, group // W_ROWS, step,
                    blocks_per_head, head, rows_per_head, N, INNER, sdy_o, sdy_i, sdy_c, sx_o, sx_i, sx_c, sdh_o,
                    sdh_i, sdh_c, W_ROWS, w_offset, IS_RMS, HAS_W, HAS_B, PER_ROW_W, WANT_DW, WANT_DB, ACT, HAS_DH,
                    HAS_DRES, BLOCK_M, BLOCK_N)
    else:
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        rows, row_mask = _head_rows(group // W_ROWS, head, rows_per_head, W_ROWS, BLOCK_M)
        w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_next = _load_tile(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
        dy_next = _load_tile(DY, rows, row_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
        for jb in range(group // W_ROWS, blocks_per_head, step):
            rows, row_mask = _head_rows(jb, head, rows_per_head, W_ROWS, BLOCK_M)
            mask = row_mask[:, None] & col_mask[None, :]
            if SPLIT > 1:
                # prefetch the next tiles now: their loads overlap the wait at the group barrier
                x, dy = x_next, dy_next
                nxt, nxt_mask = _head_rows(jb + step, head, rows_per_head, W_ROWS, BLOCK_M)
                x_next = _load_tile(X, nxt, nxt_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
                dy_next = _load_tile(DY, nxt, nxt_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
            else:
                x = _load_tile(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
                dy = _load_tile(DY, rows, row_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
            if PER_ROW_W:
                w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            mean = rstd
            if not IS_RMS:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            xhat, g, wg = _bwd_terms(x, dy, w, b, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, ACT, BLOCK_N == 1)
            c1 = tl.sum(xhat * wg, axis=1)
            c2 = c1
            if not IS_RMS:
                c2 = tl.sum(wg, axis=1)
            if SPLIT > 1:
                slot = _publish_and_wait(SYNC, SCRATCH, group, k, (jb - group // W_ROWS) // step,
                                         c1, c2, SPLIT, BLOCK_M)
                c1 = tl.sum(_read_partials(slot, False, SPLIT, BLOCK_M), axis=0)
                c2 = tl.sum(_read_partials(slot, True, SPLIT, BLOCK_M), axis=0)
            dx = _dx(xhat, wg, rstd, c1 / N, c2 / N, IS_RMS)
            _store_dx(DX, DRES, DH, dx, rows, row_mask, cols, col_mask, N, INNER, sdh_o, sdh_i, sdh_c,
                      HAS_DH, HAS_DRES)
            if WANT_DW:
                dw_acc += g * xhat
            if WANT_DB:
                db_acc += g
        if WANT_DW:
            tl.store(DW_PART + part_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if WANT_DB:
            tl.store(DB_PART + part_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
        if SPLIT > 1:
            _group_exit(SYNC, group, num_groups, SPLIT)


@triton.jit
def _bwd_looped(DY, X, DH, W, B, MEAN, RSTD, DX, DRES, DW_PART, DB_PART, part_row, first, step, num_blocks, head,
                rows_per_head, N, INNER, sdy_o, sdy_i, sdy_c, sx_o, sx_i, sx_c, sdh_o, sdh_i, sdh_c, W_ROWS, w_offset,
                IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, PER_ROW_W: tl.constexpr,
                WANT_DW: tl.constexpr, WANT_DB: tl.constexpr, ACT: tl.constexpr, HAS_DH: tl.constexpr,
                HAS_DRES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program walks each of its rows in BLOCK_N chunks twice (row sums, then dx), adding its
    weight-gradient sums into its own partial row, which only it ever touches."""
    num_chunks = tl.cdiv(N, BLOCK_N)
    for chunk in range(0, num_chunks):
        cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        if WANT_DW:
            tl.store(DW_PART + part_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
        if WANT_DB:
            tl.store(DB_PART + part_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
    for jb in range(first, num_blocks, step):
        rows, row_mask = _head_rows(jb, head, rows_per_head, W_ROWS, BLOCK_M)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        mean = rstd
        if not IS_RMS:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
        c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for chunk in range(0, num_chunks):
            cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_tile(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
            dy = _load_tile(DY, rows, row_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
            w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
            xhat, g, wg = _bwd_terms(x, dy, w, b, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, ACT, False)
            c1 += tl.sum(xhat * wg, axis=1)
            if not IS_RMS:
                c2 += tl.sum(wg, axis=1)
        c1 = c1 / N
        c2 = c2 / N
        # dx and the partial weight sums, last chunk first (the one most likely still in L2)
        for i in range(0, num_chunks):
            cols = (num_chunks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_tile(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
            dy = _load_tile(DY, rows, row_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
            w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
            xhat, g, wg = _bwd_terms(x, dy, w, b, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, ACT, False)
            dx = _dx(xhat, wg, rstd, c1, c2, IS_RMS)
            _store_dx(DX, DRES, DH, dx, rows, row_mask, cols, col_mask, N, INNER, sdh_o, sdh_i, sdh_c,
                      HAS_DH, HAS_DRES)
            if WANT_DW:
                p = DW_PART + part_row + cols
                tl.store(p, tl.load(p, mask=col_mask, other=0.0) + tl.sum(g * xhat, axis=0), mask=col_mask)
            if WANT_DB:
                p = DB_PART + part_row + cols
                tl.store(p, tl.load(p, mask=col_mask, other=0.0) + tl.sum(g, axis=0), mask=col_mask)


@triton.jit
def col_sum_kernel(
    PART_A, OUT_A, PART_B, OUT_B, P, N,
    HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """OUT[n] = sum_p PART[p, n] over the P partial rows, in a fixed order (deterministic).
    Reduces two partial buffers (dweight, dbias) in one launch when HAS_B."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc_a = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        prow = p0 + tl.arange(0, BLOCK_P)
        mask = (prow < P)[:, None] & col_mask[None, :]
        offs = prow.to(tl.int64)[:, None] * N + cols[None, :]
        acc_a += tl.load(PART_A + offs, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(PART_B + offs, mask=mask, other=0.0)
    tl.store(OUT_A + cols, tl.sum(acc_a, axis=0).to(OUT_A.dtype.element_ty), mask=col_mask)
    if HAS_B:
        tl.store(OUT_B + cols, tl.sum(acc_b, axis=0).to(OUT_B.dtype.element_ty), mask=col_mask)
