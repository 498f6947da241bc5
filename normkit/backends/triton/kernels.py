"""Triton kernels for row normalization: LayerNorm and RMSNorm are one family (RMS = no centering,
no bias), selected by constexpr flags so each variant compiles to its own lean kernel.

Two shapes of the same algorithm, chosen per row width by the configuration table (configs.py):

* SINGLE_TILE: a [BLOCK_M, BLOCK_N] tile holds BLOCK_M whole rows in registers. The statistics are
  two passes over the on-chip data (mean, then sum of squared deviations), exact and cheap.
  Several rows per program keep small widths (32..1024 columns) from starving the memory system.
* looped: a row too wide for registers is walked in BLOCK_N chunks. Each chunk's mean and M2 come
  from two passes over the chunk in registers, and chunks are merged with Chan's parallel Welford
  update, so no E[x^2] - E[x]^2 cancellation at any width. The second sweep (normalize / dx)
  walks the chunks backwards, so the most recently read chunks are re-read while still in L2.

All row offsets are int64: tensors above 2**31 elements index correctly.
"""
import triton
import triton.language as tl


@triton.jit
def _chunk_welford(x, mask, mean, m2, n_before, n_chunk):
    """Merge one chunk (rows of `x`, `n_chunk` valid columns) into running (mean, m2) per row."""
    c_mean = tl.sum(x, axis=1) / n_chunk
    d = tl.where(mask, x - c_mean[:, None], 0.0)
    c_m2 = tl.sum(d * d, axis=1)
    n_total = n_before + n_chunk
    delta = c_mean - mean
    mean = mean + delta * (n_chunk / n_total)
    m2 = m2 + c_m2 + delta * delta * (n_before * (n_chunk / n_total))
    return mean, m2


@triton.jit
def row_norm_fwd_kernel(
    X, Y, W, B, MEAN, RSTD,
    M, N, stride_x, stride_y, eps,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_TILE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = X + rows[:, None] * stride_x
    y_rows = Y + rows[:, None] * stride_y

    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            # shifted data: x - x[row, 0] is small, so its sum keeps the digits a raw sum loses
            shift = tl.load(X + rows * stride_x, mask=row_mask, other=0.0).to(tl.float32)
            xs = tl.where(mask, x - shift[:, None], 0.0)
            mean_s = tl.sum(xs, axis=1) / N
            xc = tl.where(mask, xs - mean_s[:, None], 0.0)
            mean = shift + mean_s
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        num_chunks = tl.cdiv(N, BLOCK_N)
        # sweep 1: statistics (of shifted data, as above)
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
                n_before = chunk * BLOCK_N * 1.0  # float32 (a Python float in the interpreter)
                n_chunk = tl.minimum(N - chunk * BLOCK_N, BLOCK_N) * 1.0
                xs = tl.where(mask, x - shift[:, None], 0.0)
                mean_s, m2 = _chunk_welford(xs, mask, mean_s, m2, n_before, n_chunk)
        if IS_RMS:
            rstd = tl.rsqrt(sum_sq / N + eps)
        else:
            rstd = tl.rsqrt(m2 / N + eps)
            mean = shift + mean_s
        # sweep 2: normalize, last chunk first (it is the one most likely still in L2)
        for i in range(0, num_chunks):
            cols = (num_chunks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if IS_RMS:
                y = x * rstd[:, None]
            else:
                y = ((x - shift[:, None]) - mean_s[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_B:
                y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    if not IS_RMS:
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _dx_and_sums(x, dy, w, mean, rstd, mask, IS_RMS: tl.constexpr, HAS_W: tl.constexpr):
    """xhat and w*dy for a tile, zero outside `mask` (so padded lanes add nothing)."""
    if IS_RMS:
        xhat = tl.where(mask, x * rstd[:, None], 0.0)
    else:
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    if HAS_W:
        wdy = dy * w[None, :]
    else:
        wdy = dy
    return xhat, wdy


@triton.jit
def row_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART,
    M, N, stride_dy, stride_x, stride_dx,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_TILE: tl.constexpr,
):
    """Persistent: program p handles row blocks p, p + P, p + 2P, ... and writes its own fp32
    partial sums of dweight/dbias to row p of DW_PART/DB_PART ([P, N]); a second kernel
    (col_sum_kernel) adds the P partials in a fixed order. No atomics: bitwise reproducible.

    dx = rstd * (w*dy - xhat * mean(xhat * w*dy) - mean(w*dy))   (LayerNorm)
    dx = rstd * (w*dy - xhat * mean(xhat * w*dy))                (RMSNorm)
    """
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    num_blocks = tl.cdiv(M, BLOCK_M)
    part_row = pid.to(tl.int64) * N

    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        else:
            w = 0.0
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for block in range(pid, num_blocks, num_progs):
            rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            row_mask = rows < M
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            if IS_RMS:
                mean = rstd  # unused
            else:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            xhat, wdy = _dx_and_sums(x, dy, w, mean, rstd, mask, IS_RMS, HAS_W)
            c1 = tl.sum(xhat * wdy, axis=1) / N
            if IS_RMS:
                dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
            else:
                c2 = tl.sum(wdy, axis=1) / N
                dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if WANT_DW:
                dw_acc += dy * xhat
            if WANT_DB:
                db_acc += dy
        if WANT_DW:
            tl.store(DW_PART + part_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if WANT_DB:
            tl.store(DB_PART + part_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        num_chunks = tl.cdiv(N, BLOCK_N)
        # this program's partial rows start at zero; only this program ever touches them
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
            if IS_RMS:
                mean = rstd  # unused
            else:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            # sweep 1: the two row sums
            c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
            c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
            for chunk in range(0, num_chunks):
                cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
                else:
                    w = 0.0
                xhat, wdy = _dx_and_sums(x, dy, w, mean, rstd, mask, IS_RMS, HAS_W)
                c1 += tl.sum(xhat * wdy, axis=1)
                if not IS_RMS:
                    c2 += tl.sum(wdy, axis=1)
            c1 = c1 / N
            c2 = c2 / N
            # sweep 2: dx and the partial weight sums, last chunk first (L2 reuse)
            for i in range(0, num_chunks):
                cols = (num_chunks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
                else:
                    w = 0.0
                xhat, wdy = _dx_and_sums(x, dy, w, mean, rstd, mask, IS_RMS, HAS_W)
                if IS_RMS:
                    dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
                else:
                    dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
                tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                if WANT_DW:
                    p = DW_PART + part_row + cols
                    tl.store(p, tl.load(p, mask=col_mask, other=0.0) + tl.sum(dy * xhat, axis=0), mask=col_mask)
                if WANT_DB:
                    p = DB_PART + part_row + cols
                    tl.store(p, tl.load(p, mask=col_mask, other=0.0) + tl.sum(dy, axis=0), mask=col_mask)


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
