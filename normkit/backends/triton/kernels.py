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
"""
import triton
import triton.language as tl

from .epilogue import act_fwd, act_grad


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
def _load_vec(P, cols, col_mask, PRESENT: tl.constexpr):
    if PRESENT:
        return tl.load(P + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        return 0.0


@triton.jit
def _epilogue(xhat, w, b, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr):
    y = xhat
    if HAS_W:
        y = y * w[None, :]
    if HAS_B:
        y = y + b[None, :]
    return act_fwd(y, ACT)


# ----------------------------------------------------------------------------- forward

@triton.jit
def _load_rows(P, block, M, stride, cols, col_mask, BLOCK_M: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] tile of row block `block` (zeros past the last row), as fp32."""
    rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask = (rows < M)[:, None] & col_mask[None, :]
    return tl.load(P + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _fwd_tile(x, X, Y, W, B, MEAN, RSTD, SYNC, SCRATCH, block, group, k, it, M, N, stride_x, stride_y, eps,
              cols, col_mask, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
              STORE_STATS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              SPLIT: tl.constexpr):
    """Normalize one loaded tile x (rows of `block`, columns `cols`) and store it."""
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
        shift = tl.load(X + rows * stride_x, mask=row_mask, other=0.0).to(tl.float32)
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
    y = _epilogue(xc * rstd[:, None], _load_vec(W, cols, col_mask, HAS_W), _load_vec(B, cols, col_mask, HAS_B),
                  HAS_W, HAS_B, ACT)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_STATS:
        first = row_mask & ((rows * 0 + k) == 0)  # vector form: the interpreter rejects a scalar mask term
        tl.store(RSTD + rows, rstd, mask=first)
        if not IS_RMS:
            tl.store(MEAN + rows, shift + mean_s, mask=first)


@triton.jit
def row_norm_fwd_kernel(
    X, Y, W, B, MEAN, RSTD, SYNC, SCRATCH,
    M, N, stride_x, stride_y, eps,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    LOOPED: tl.constexpr, PERSISTENT: tl.constexpr,
):
    pid = tl.program_id(0)
    if LOOPED:
        rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        _fwd_looped(X, Y, W, B, rows, rows < M, N, stride_x, stride_y, eps, MEAN, RSTD,
                    IS_RMS, HAS_W, HAS_B, STORE_STATS, ACT, BLOCK_M, BLOCK_N)
    elif not PERSISTENT:  # one row block per program
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        x = _load_rows(X, pid, M, stride_x, cols, col_mask, BLOCK_M)
        _fwd_tile(x, X, Y, W, B, MEAN, RSTD, SYNC, SCRATCH, pid, pid, 0, 0, M, N, stride_x, stride_y, eps,
                  cols, col_mask, IS_RMS, HAS_W, HAS_B, STORE_STATS, ACT, BLOCK_M, BLOCK_N, 1)
    else:  # groups of SPLIT programs walk row blocks group, group + G, ...
        group = pid // SPLIT
        k = pid % SPLIT
        num_groups = tl.num_programs(0) // SPLIT
        num_blocks = tl.cdiv(M, BLOCK_M)
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        x_next = _load_rows(X, group, M, stride_x, cols, col_mask, BLOCK_M)
        for block in range(group, num_blocks, num_groups):
            x = x_next
            # prefetch the next tile now: its loads overlap the wait at the group barrier
            x_next = _load_rows(X, block + num_groups, M, stride_x, cols, col_mask, BLOCK_M)
            _fwd_tile(x, X, Y, W, B, MEAN, RSTD, SYNC, SCRATCH, block, group, k, (block - group) // num_groups,
                      M, N, stride_x, stride_y, eps, cols, col_mask,
                      IS_RMS, HAS_W, HAS_B, STORE_STATS, ACT, BLOCK_M, BLOCK_N, SPLIT)
        if SPLIT > 1:
            _group_exit(SYNC, group, num_groups, SPLIT)


@triton.jit
def _fwd_looped(X, Y, W, B, rows, row_mask, N, stride_x, stride_y, eps, MEAN, RSTD,
                IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
                ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program walks its rows in BLOCK_N chunks: statistics, then normalize."""
    x_rows = X + rows[:, None] * stride_x
    num_chunks = tl.cdiv(N, BLOCK_N)
    if IS_RMS:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        shift = tl.load(X + rows * stride_x, mask=row_mask, other=0.0).to(tl.float32)
        mean_s = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for chunk in range(0, num_chunks):
        cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
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
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            xhat = ((x - shift[:, None]) - mean_s[:, None]) * rstd[:, None]
        y = _epilogue(xhat, _load_vec(W, cols, col_mask, HAS_W), _load_vec(B, cols, col_mask, HAS_B), HAS_W, HAS_B, ACT)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(RSTD + rows, rstd, mask=row_mask)
        if not IS_RMS:
            tl.store(MEAN + rows, shift + mean_s, mask=row_mask)


# ----------------------------------------------------------------------------- backward

@triton.jit
def _bwd_terms(x, dy, w, b, mean, rstd, mask, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
               ACT: tl.constexpr):
    """(xhat, g, w*g) for a tile, zero outside `mask`; g is dy through the activation's derivative."""
    if IS_RMS:
        xhat = tl.where(mask, x * rstd[:, None], 0.0)
    else:
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    g = dy
    if ACT != 0:
        z = xhat
        if HAS_W:
            z = z * w[None, :]
        if HAS_B:
            z = z + b[None, :]
        g = tl.where(mask, act_grad(z, dy, ACT), 0.0)
    if HAS_W:
        wg = g * w[None, :]
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
def row_norm_bwd_kernel(
    DY, X, W, B, MEAN, RSTD, DX, DW_PART, DB_PART, SYNC, SCRATCH,
    M, N, stride_dy, stride_x, stride_dx,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, WANT_DW: tl.constexpr,
    WANT_DB: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, LOOPED: tl.constexpr,
):
    """Persistent: group g (SPLIT programs; one program unless the row is split) handles row blocks
    g, g + G, g + 2G, ... and writes its fp32 partial sums of dweight/dbias to row g of
    DW_PART/DB_PART ([G, N]); col_sum_kernel then adds the G partials in a fixed order.
    No float atomics anywhere: gradients are bitwise reproducible."""
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(M, BLOCK_M)
    group = pid // SPLIT
    k = pid % SPLIT
    num_groups = tl.num_programs(0) // SPLIT
    part_row = group.to(tl.int64) * N
    if LOOPED:
        _bwd_looped(DY, X, W, B, MEAN, RSTD, DX, DW_PART, DB_PART, part_row, pid, num_groups, num_blocks,
                    M, N, stride_dy, stride_x, stride_dx,
                    IS_RMS, HAS_W, HAS_B, WANT_DW, WANT_DB, ACT, BLOCK_M, BLOCK_N)
    else:
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w = _load_vec(W, cols, col_mask, HAS_W)
        b = _load_vec(B, cols, col_mask, HAS_B)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_next = _load_rows(X, group, M, stride_x, cols, col_mask, BLOCK_M)
        dy_next = _load_rows(DY, group, M, stride_dy, cols, col_mask, BLOCK_M)
        for block in range(group, num_blocks, num_groups):
            rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            row_mask = rows < M
            mask = row_mask[:, None] & col_mask[None, :]
            if SPLIT > 1:
                # prefetch the next tiles now: their loads overlap the wait at the group barrier
                x, dy = x_next, dy_next
                x_next = _load_rows(X, block + num_groups, M, stride_x, cols, col_mask, BLOCK_M)
                dy_next = _load_rows(DY, block + num_groups, M, stride_dy, cols, col_mask, BLOCK_M)
            else:
                x = _load_rows(X, block, M, stride_x, cols, col_mask, BLOCK_M)
                dy = _load_rows(DY, block, M, stride_dy, cols, col_mask, BLOCK_M)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            mean = rstd
            if not IS_RMS:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            xhat, g, wg = _bwd_terms(x, dy, w, b, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, ACT)
            c1 = tl.sum(xhat * wg, axis=1)
            c2 = c1
            if not IS_RMS:
                c2 = tl.sum(wg, axis=1)
            if SPLIT > 1:
                slot = _publish_and_wait(SYNC, SCRATCH, group, k, (block - group) // num_groups,
                                         c1, c2, SPLIT, BLOCK_M)
                c1 = tl.sum(_read_partials(slot, False, SPLIT, BLOCK_M), axis=0)
                c2 = tl.sum(_read_partials(slot, True, SPLIT, BLOCK_M), axis=0)
            dx = _dx(xhat, wg, rstd, c1 / N, c2 / N, IS_RMS)
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
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
def _bwd_looped(DY, X, W, B, MEAN, RSTD, DX, DW_PART, DB_PART, part_row, pid, num_progs, num_blocks,
                M, N, stride_dy, stride_x, stride_dx,
                IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, WANT_DW: tl.constexpr,
                WANT_DB: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program walks each of its rows in BLOCK_N chunks twice (row sums, then dx), adding its
    weight-gradient sums into its own partial row, which only it ever touches."""
    num_chunks = tl.cdiv(N, BLOCK_N)
    for chunk in range(0, num_chunks):
        cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        if WANT_DW:
            tl.store(DW_PART + part_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
        if WANT_DB:
            tl.store(DB_PART + part_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
    for block in range(pid, num_blocks, num_progs):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < M
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
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xhat, g, wg = _bwd_terms(x, dy, _load_vec(W, cols, col_mask, HAS_W), _load_vec(B, cols, col_mask, HAS_B),
                                     mean, rstd, mask, IS_RMS, HAS_W, HAS_B, ACT)
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
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xhat, g, wg = _bwd_terms(x, dy, _load_vec(W, cols, col_mask, HAS_W), _load_vec(B, cols, col_mask, HAS_B),
                                     mean, rstd, mask, IS_RMS, HAS_W, HAS_B, ACT)
            dx = _dx(xhat, wg, rstd, c1, c2, IS_RMS)
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
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
