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

Gated norms (HAS_GATE; Mamba-2's MambaRMSNormGated): what is normalized is z = x * silu(gate), formed
in fp32 and not rounded. The gate is read like the residual, through R and its strides (the two are
exclusive); the backward reads x, the gate (through DH's pointer and strides) and dy, and writes dx =
dz * silu(gate) and dgate = dz * x * silu'(gate) (through DRES) in the same pass, dz being the usual
input gradient of the norm.

adaLN modulation (HAS_MS / HAS_MT): y = act((xhat * w + b) * (1 + scale) + shift), the scale and
shift rows of a [S, N] table per sample (row r of x uses table row r // rows_per_sample), in fp32
in the same pass. Its backward walks the rows sample by sample (the "sample walk": work item
(sample s, chunk c) is a run of whole row blocks of one sample), so each item's dscale/dshift
column sums go to one partial row [chunks, S * N] that col_sum_kernel reduces in a fixed order,
as the weight gradients' partials: no float atomics.
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
    row r % W_ROWS: q/k norms with one weight per head), one row each, [BLOCK_M, BLOCK_N].
    w_offset None (a constexpr: the launch passes None for 0) adds nothing: an FADD an element saved in the
    forward's loops, which ncu found issue-bound (run S21-2)."""
    if PER_ROW:
        offs = (rows % W_ROWS)[:, None] * N + cols[None, :]
    else:
        offs = cols[None, :]
    w = 0.0
    b = 0.0
    if HAS_W:
        w = tl.load(W + offs, mask=col_mask[None, :], other=0.0).to(tl.float32)
        if w_offset is not None:
            w += w_offset
    if HAS_B:
        b = tl.load(B + offs, mask=col_mask[None, :], other=0.0).to(tl.float32)
    return w, b


@triton.jit
def _load_mod(MS, MT, samples, cols, col_mask, sms_r, smt_r, HAS_MS: tl.constexpr, HAS_MT: tl.constexpr):
    """(1 + scale, shift) as fp32 [len(samples), BLOCK_N] tiles: the modulation table rows of the
    given samples (row stride sms_r / smt_r, unit column stride)."""
    ms = 1.0
    mt = 0.0
    if HAS_MS:
        ms = tl.load(MS + samples[:, None] * sms_r + cols[None, :], mask=col_mask[None, :], other=0.0).to(tl.float32)
        ms = ms + 1.0
    if HAS_MT:
        mt = tl.load(MT + samples[:, None] * smt_r + cols[None, :], mask=col_mask[None, :], other=0.0).to(tl.float32)
    return ms, mt


@triton.jit
def _affine(xhat, w, b, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    y = xhat
    if HAS_W:
        y = y * w
    if HAS_B:
        y = y + b
    return y


@triton.jit
def _modulate(y, ms, mt, HAS_MS: tl.constexpr, HAS_MT: tl.constexpr):
    if HAS_MS:
        y = y * ms
    if HAS_MT:
        y = y + mt
    return y


@triton.jit
def _epilogue(xhat, w, b, ms, mt, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_MS: tl.constexpr,
              HAS_MT: tl.constexpr, ACT: tl.constexpr):
    return act_fwd(_modulate(_affine(xhat, w, b, HAS_W, HAS_B), ms, mt, HAS_MS, HAS_MT), ACT)


@triton.jit
def _walk_rows(jb, base, stride, limit, BLOCK_M: tl.constexpr):
    """(rows, mask) of block jb of a walk over rows base, base + stride, ... (limit rows). The
    backward walks the rows of one head together (base = head, stride = heads), so that a program's
    weight-gradient partials belong to one head, or of one sample (base = its first row, stride 1),
    so that its dscale/dshift partials do. Plain parameters: base 0, stride 1 (constants once
    specialized), all rows."""
    j = (jb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return j * stride + base, j < limit


# ----------------------------------------------------------------------------- row addressing

@triton.jit
def _row_start(rows, INNER, s_o, s_i):
    """Offset of each row's first element: row r is (r // INNER, r % INNER) of an [O, INNER] grid."""
    return (rows // INNER) * s_o + (rows % INNER) * s_i


@triton.jit
def _offsets(rows, cols, INNER, s_o, s_i, s_c):
    return _row_start(rows, INNER, s_o, s_i)[:, None] + cols.to(tl.int64)[None, :] * s_c


@triton.jit
def _load_raw_as(P, rows, row_mask, cols, col_mask, INNER, s_o, s_i, s_c, POLICY: tl.constexpr):
    """The [rows, cols] tile of a strided operand in its own dtype (zeros outside the masks): a
    prefetched 16-bit tile holds half the registers of its fp32 form until it is used. POLICY: the
    loads' L2 eviction policy ("": the default; "evict_last": read again soon; "evict_first": the
    last read). No default value on a constexpr here: triton 3.6 rejects one on a helper."""
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(P + _offsets(rows, cols, INNER, s_o, s_i, s_c), mask=mask, other=0.0, eviction_policy=POLICY)


@triton.jit
def _load_raw(P, rows, row_mask, cols, col_mask, INNER, s_o, s_i, s_c):
    return _load_raw_as(P, rows, row_mask, cols, col_mask, INNER, s_o, s_i, s_c, "")


@triton.jit
def _load_tile(P, rows, row_mask, cols, col_mask, INNER, s_o, s_i, s_c):
    """The [rows, cols] tile of a strided operand as fp32 (zeros outside the masks)."""
    return _load_raw(P, rows, row_mask, cols, col_mask, INNER, s_o, s_i, s_c).to(tl.float32)


@triton.jit
def _load_h_as(X, R, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c,
               HAS_RES: tl.constexpr, H_ROUND: tl.constexpr, HAS_GATE: tl.constexpr, POLICY: tl.constexpr):
    """The tile that is normalized, fp32: x, or h = x + residual rounded to h's dtype, or (HAS_GATE:
    R is the gate) x * silu(gate), unrounded; its loads with L2 eviction policy POLICY."""
    x = _load_raw_as(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c, POLICY).to(tl.float32)
    if HAS_RES:
        r = _load_raw_as(R, rows, row_mask, cols, col_mask, INNER, sr_o, sr_i, sr_c, POLICY).to(tl.float32)
        x = round_h(x + r, H_ROUND)
    if HAS_GATE:
        g = _load_raw_as(R, rows, row_mask, cols, col_mask, INNER, sr_o, sr_i, sr_c, POLICY).to(tl.float32)
        x = x * (g * tl.sigmoid(g))
    return x


@triton.jit
def _load_h(X, R, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c,
            HAS_RES: tl.constexpr, H_ROUND: tl.constexpr, HAS_GATE: tl.constexpr):
    return _load_h_as(X, R, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c,
                      HAS_RES, H_ROUND, HAS_GATE, "")


@triton.jit
def _load_h_first(X, R, rows, row_mask, INNER, sx_o, sx_i, sr_o, sr_i, HAS_RES: tl.constexpr, H_ROUND: tl.constexpr,
                  HAS_GATE: tl.constexpr):
    """Each row's first element of what is normalized (the shift of the statistics)."""
    x = tl.load(X + _row_start(rows, INNER, sx_o, sx_i), mask=row_mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + _row_start(rows, INNER, sr_o, sr_i), mask=row_mask, other=0.0).to(tl.float32)
        x = round_h(x + r, H_ROUND)
    if HAS_GATE:
        g = tl.load(R + _row_start(rows, INNER, sr_o, sr_i), mask=row_mask, other=0.0).to(tl.float32)
        x = x * (g * tl.sigmoid(g))
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
def _fwd_tile(x, X, R, Y, H, W, B, MEAN, RSTD, SYNC, SCRATCH, MS, MT, block, group, k, it, M, N, INNER,
              sx_o, sx_i, sr_o, sr_i, eps, W_ROWS, w_offset, scale, mod_rps, sms_r, smt_r, amax, cols, col_mask,
              IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, PER_ROW_W: tl.constexpr,
              ACT: tl.constexpr, HAS_RES: tl.constexpr, STORE_H: tl.constexpr, H_ROUND: tl.constexpr,
              FP8: tl.constexpr, WANT_AMAX: tl.constexpr, HAS_MS: tl.constexpr, HAS_MT: tl.constexpr, HAS_GATE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
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
        shift = _load_h_first(X, R, rows, row_mask, INNER, sx_o, sx_i, sr_o, sr_i, HAS_RES, H_ROUND, HAS_GATE)
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
    ms, mt = _load_mod(MS, MT, tl.where(row_mask, rows // mod_rps, 0), cols, col_mask, sms_r, smt_r, HAS_MS, HAS_MT)
    y = _epilogue(xc * rstd[:, None], w, b, ms, mt, HAS_W, HAS_B, HAS_MS, HAS_MT, ACT)
    amax = _store_outputs(Y, H, x, y, rows, cols, mask, N, scale, amax, STORE_H, FP8, WANT_AMAX)
    # the statistics are always stored (backends/triton: the kernel without these stores rounds y differently)
    first = row_mask & ((rows * 0 + k) == 0)  # vector form: the interpreter rejects a scalar mask term
    tl.store(RSTD + rows, rstd, mask=first)
    if not IS_RMS:
        tl.store(MEAN + rows, shift + mean_s, mask=first)
    return amax


@triton.jit
def row_norm_fwd_kernel(
    X, R, Y, H, W, B, MEAN, RSTD, AMAX, SCALE, SYNC, SCRATCH, MS, MT,
    M, N, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, eps, W_ROWS, w_offset, scale, mod_rps, sms_r, smt_r,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, PER_ROW_W: tl.constexpr,
    ACT: tl.constexpr, HAS_RES: tl.constexpr, STORE_H: tl.constexpr, H_ROUND: tl.constexpr, FP8: tl.constexpr,
    SCALE_PTR: tl.constexpr, WANT_AMAX: tl.constexpr, HAS_MS: tl.constexpr, HAS_MT: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, LOOPED: tl.constexpr,
    PERSISTENT: tl.constexpr, LOOP_POLICY_1: tl.constexpr, LOOP_POLICY_2: tl.constexpr, N_STATIC: tl.constexpr,
):
    pid = tl.program_id(0)
    if SCALE_PTR:  # a device-side scale (delayed scaling): read, never synchronized to the host
        scale = tl.load(SCALE).to(tl.float32)
    amax = tl.full([], 0, tl.int32)
    if LOOPED:
        rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        amax = _fwd_looped(X, R, Y, H, W, B, MS, MT, rows, rows < M, N, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c,
                           eps, W_ROWS, w_offset, scale, mod_rps, sms_r, smt_r, MEAN, RSTD, IS_RMS, HAS_W, HAS_B,
                           PER_ROW_W, ACT, HAS_RES, STORE_H, H_ROUND, FP8, WANT_AMAX, HAS_MS, HAS_MT, HAS_GATE,
                           BLOCK_M, BLOCK_N, LOOP_POLICY_1, LOOP_POLICY_2, N_STATIC)
    elif not PERSISTENT:  # one row block per program
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        x = _load_h(X, R, rows, rows < M, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, HAS_RES, H_ROUND, HAS_GATE)
        amax = _fwd_tile(x, X, R, Y, H, W, B, MEAN, RSTD, SYNC, SCRATCH, MS, MT, pid, pid, 0, 0, M, N, INNER,
                         sx_o, sx_i, sr_o, sr_i, eps, W_ROWS, w_offset, scale, mod_rps, sms_r, smt_r, amax, cols,
                         col_mask, IS_RMS, HAS_W, HAS_B, PER_ROW_W, ACT, HAS_RES, STORE_H, H_ROUND, FP8,
                         WANT_AMAX, HAS_MS, HAS_MT, HAS_GATE, BLOCK_M, BLOCK_N, 1)
    else:  # groups of SPLIT programs walk row blocks group, group + G, ...
        group = pid // SPLIT
        k = pid % SPLIT
        num_groups = tl.num_programs(0) // SPLIT
        num_blocks = tl.cdiv(M, BLOCK_M)
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        rows = (group * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        x_next = _load_h(X, R, rows, rows < M, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c,
                         HAS_RES, H_ROUND, HAS_GATE)
        for block in range(group, num_blocks, num_groups):
            x = x_next
            # prefetch the next tile now: its loads overlap the wait at the group barrier
            rows = ((block + num_groups) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            x_next = _load_h(X, R, rows, rows < M, cols, col_mask, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c,
                             HAS_RES, H_ROUND, HAS_GATE)
            amax = _fwd_tile(x, X, R, Y, H, W, B, MEAN, RSTD, SYNC, SCRATCH, MS, MT, block, group, k,
                             (block - group) // num_groups, M, N, INNER, sx_o, sx_i, sr_o, sr_i, eps, W_ROWS, w_offset,
                             scale, mod_rps, sms_r, smt_r, amax, cols, col_mask, IS_RMS, HAS_W, HAS_B, PER_ROW_W,
                             ACT, HAS_RES, STORE_H, H_ROUND, FP8, WANT_AMAX, HAS_MS, HAS_MT, HAS_GATE, BLOCK_M,
                             BLOCK_N, SPLIT)
        if SPLIT > 1:
            _group_exit(SYNC, group, num_groups, SPLIT)
    if WANT_AMAX:  # an integer max over programs: exact and the same in any order
        tl.atomic_max(AMAX, amax)


@triton.jit
def _shifted(x, shift, mask, BLOCK_N: tl.constexpr, N_STATIC: tl.constexpr):
    """x - shift per lane, 0 outside the mask. Where the width is compiled in and a multiple of the chunk no
    column is masked, and a masked row loads zeros and has shift 0: no select (an ALU instruction an element,
    in a loop that ncu found issue-bound, run S21-2)."""
    xs = x - shift[:, None]
    if N_STATIC == 0 or N_STATIC % BLOCK_N != 0:
        xs = tl.where(mask, xs, 0.0)
    return xs


@triton.jit
def _fwd_looped(X, R, Y, H, W, B, MS, MT, rows, row_mask, N, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, eps, W_ROWS,
                w_offset, scale, mod_rps, sms_r, smt_r, MEAN, RSTD, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
                HAS_B: tl.constexpr, PER_ROW_W: tl.constexpr, ACT: tl.constexpr,
                HAS_RES: tl.constexpr, STORE_H: tl.constexpr, H_ROUND: tl.constexpr, FP8: tl.constexpr,
                WANT_AMAX: tl.constexpr, HAS_MS: tl.constexpr, HAS_MT: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, POLICY_1: tl.constexpr, POLICY_2: tl.constexpr, N_STATIC: tl.constexpr):
    """One program walks its rows in BLOCK_N chunks: statistics, then normalize. Returns amax.
    The first pass accumulates per lane ([BLOCK_M, BLOCK_N] registers: a sum of squares, or sums of
    the values and their squares shifted by the first chunk's mean) and reduces across the row once,
    after the loop: a reduction per chunk would put a CTA barrier between a chunk's loads and the
    next's. The shift bounds the variance's cancellation: (mean - shift)^2 <= (chunks - 1) * var for
    the mean of any one chunk, so var = E[xs^2] - E[xs]^2 loses at most log2(chunks) bits, never the
    row's offset (1e4 in the oracle checks). (It replaced a per-lane Welford update, measured no slower.
    LayerNorm's loop stays 0.1-0.2 of copy below RMSNorm's: not its registers, its L2 streams nor its
    instruction count (runs S21-1 to S21-3); ncu's stall samples (S21-7) put its waits on its own unpacks
    and cross-warp reductions, RMSNorm's on memory.)
    Both passes load the chunk after the current one before working on it: ptxas otherwise let a
    chunk's loads wait on each other (one round trip each) and the next chunk's wait on the stores.
    POLICY_1 / POLICY_2: the passes' L2 eviction policies (Inductor's looped reductions keep the row
    in the first, "evict_last", and drop it in the second, "evict_first"; "": the default).
    N_STATIC: the width as a compile-time constant (0: N at run time): the trip counts and masks are then
    known to the compiler, which was worth 0.03-0.13 of copy to Inductor's own looped kernel (run S18-4)."""
    if N_STATIC > 0:
        n = N_STATIC
    else:
        n = N
    num_chunks = tl.cdiv(n, BLOCK_N)
    amax = tl.full([], 0, tl.int32)
    lane = tl.arange(0, BLOCK_N)
    x_next = _load_h_as(X, R, rows, row_mask, lane, lane < n, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, HAS_RES,
                        H_ROUND, HAS_GATE, POLICY_1)
    if IS_RMS:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        first = 0
    else:  # the first chunk's mean (its masked lanes load 0), the second chunk's loads issued before its reduction:
        # loads are not moved across the reduction's CTA barrier, so they would otherwise wait for the first's data
        x = x_next
        x_next = _load_h_as(X, R, rows, row_mask, lane + BLOCK_N, lane + BLOCK_N < n, INNER, sx_o, sx_i, sx_c, sr_o,
                            sr_i, sr_c, HAS_RES, H_ROUND, HAS_GATE, POLICY_1)
        shift = tl.sum(x, axis=1) / tl.minimum(n, BLOCK_N)
        acc1 = _shifted(x, shift, row_mask[:, None] & (lane < n)[None, :], BLOCK_N, N_STATIC)
        acc = acc1 * acc1
        first = 1
    for chunk in range(first, num_chunks):
        x = x_next
        cols = chunk * BLOCK_N + lane
        mask = row_mask[:, None] & (cols < n)[None, :]
        nxt = cols + BLOCK_N  # past the row in the last chunk: masked off, no load
        x_next = _load_h_as(X, R, rows, row_mask, nxt, nxt < n, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, HAS_RES,
                            H_ROUND, HAS_GATE, POLICY_1)
        if IS_RMS:
            acc += x * x  # zeros outside the masks
        else:
            xs = _shifted(x, shift, mask, BLOCK_N, N_STATIC)
            acc1 += xs
            acc += xs * xs
    # normalize, last chunk first: it is the one most likely still in L2; its loads issued before the row's
    # reduction (whose CTA barrier loads are not moved across)
    cols = (num_chunks - 1) * BLOCK_N + lane
    x_next = _load_h_as(X, R, rows, row_mask, cols, cols < n, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, HAS_RES,
                        H_ROUND, HAS_GATE, POLICY_2)
    w_next, b_next = _load_params(W, B, rows, cols, cols < n, n, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
    if IS_RMS:
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / n + eps)
    else:  # both sums in one reduction: its two CTA barriers instead of four (run S22-1: 0.70 -> 0.78 of copy at 16K)
        sum_1, sum_sq = tl.reduce((acc1, acc), 1, _add_pair)
        mean_s = sum_1 / n
        rstd = tl.rsqrt(tl.maximum(sum_sq / n - mean_s * mean_s, 0.0) + eps)
        centre = -mean_s * rstd  # xhat = (x - shift) * rstd + centre: one FFMA an element, not a subtraction too
    for i in range(0, num_chunks):
        x, w, b = x_next, w_next, b_next
        cols = (num_chunks - 1 - i) * BLOCK_N + lane
        col_mask = cols < n
        mask = row_mask[:, None] & col_mask[None, :]
        nxt = cols - BLOCK_N  # before the row after the first chunk: masked off, no load
        x_next = _load_h_as(X, R, rows, row_mask, nxt, nxt >= 0, INNER, sx_o, sx_i, sx_c, sr_o, sr_i, sr_c, HAS_RES,
                            H_ROUND, HAS_GATE, POLICY_2)
        w_next, b_next = _load_params(W, B, rows, nxt, nxt >= 0, n, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            xhat = (x - shift[:, None]) * rstd[:, None] + centre[:, None]
        ms, mt = _load_mod(MS, MT, tl.where(row_mask, rows // mod_rps, 0), cols, col_mask, sms_r, smt_r, HAS_MS, HAS_MT)
        y = _epilogue(xhat, w, b, ms, mt, HAS_W, HAS_B, HAS_MS, HAS_MT, ACT)
        amax = _store_outputs(Y, H, x, y, rows, cols, mask, n, scale, amax, STORE_H, FP8, WANT_AMAX)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    if not IS_RMS:
        tl.store(MEAN + rows, shift + mean_s, mask=row_mask)
    return amax


# ----------------------------------------------------------------------------- backward

@triton.jit
def _bwd_terms(x, dy, w, b, ms, mt, mean, rstd, mask, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
               HAS_MS: tl.constexpr, HAS_MT: tl.constexpr, ACT: tl.constexpr, ONE_COL: tl.constexpr):
    """(xhat, g, w*g, gy, yaff) for a tile, zero outside `mask`: yaff = xhat * w + b, gy the gradient
    at the modulated value yaff * ms + mt (dy through the activation's derivative), g = gy * ms the
    gradient of yaff (g = gy without a scale; ms is 1 + scale).
    ONE_COL (rows of one element, where LayerNorm's exact dx is 0: xhat = 0 and c2 = w*g): w*g is
    rounded once, by an FMA with a zero addend, which no compiler fuses into a later add. A plain
    product may be contracted with _dx's subtraction of c2, which then sees w*g unrounded and leaves
    its rounding error times rstd. Wider rows keep the plain product: letting the compiler fuse it
    is faster (8% on a 4096-wide fp32 LayerNorm backward on an H100)."""
    if IS_RMS:
        xhat = tl.where(mask, x * rstd[:, None], 0.0)
    elif ONE_COL:  # a one-element row is its own mean: xhat is 0 (NaN where rstd is), whatever recomputing x rounds
        xhat = tl.where(mask, 0.0 * rstd[:, None] + tl.zeros_like(x), 0.0)
    else:
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    yaff = _affine(xhat, w, b, HAS_W, HAS_B)
    gy = dy
    if ACT != 0:
        gy = tl.where(mask, act_grad(_modulate(yaff, ms, mt, HAS_MS, HAS_MT), dy, ACT), 0.0)
    g = gy
    if HAS_MS:
        g = gy * ms
    if HAS_W:
        if ONE_COL:
            wg = tl.fma(g, w, 0.0)
        else:
            wg = g * w
    else:
        wg = g
    return xhat, g, wg, gy, yaff


@triton.jit
def _dx(xhat, wg, rstd, c1, c2, IS_RMS: tl.constexpr):
    """dx = rstd * (w*g - xhat * c1 - c2), with c1 = mean(xhat * w*g), c2 = mean(w*g) (0 for RMS)."""
    if IS_RMS:
        return (wg - xhat * c1[:, None]) * rstd[:, None]
    else:
        return (wg - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]


@triton.jit
def _store_dx(DX, DRES, DH, dx, xg, gt, rows, row_mask, cols, col_mask, N, INNER, sdh_o, sdh_i, sdh_c,
              HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr, HAS_GATE: tl.constexpr):
    """dx (+ dh, the residual stream's own gradient) into DX, and the same values into DRES in its dtype.
    HAS_GATE: dx is the gradient of z = xg * silu(gt); DX gets dx * silu(gt) and DRES the gate's
    gradient dx * xg * silu'(gt)."""
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_DH:
        dx += _load_tile(DH, rows, row_mask, cols, col_mask, INNER, sdh_o, sdh_i, sdh_c)
    offs = rows[:, None] * N + cols[None, :]
    if HAS_GATE:
        sg = tl.sigmoid(gt)
        tl.store(DRES + offs, (dx * xg * (sg * (1.0 + gt * (1.0 - sg)))).to(DRES.dtype.element_ty), mask=mask)
        dx = dx * (gt * sg)
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_DRES:
        tl.store(DRES + offs, dx.to(DRES.dtype.element_ty), mask=mask)


@triton.jit
def _gate_in(x, DG, rows, row_mask, cols, col_mask, INNER, sg_o, sg_i, sg_c, HAS_GATE: tl.constexpr):
    """(z, gate tile): what was normalized, x * silu(gate) with HAS_GATE (the gate read through the
    dh operand's pointer and strides), else (x, 0)."""
    gt = 0.0
    if HAS_GATE:
        gt = _load_tile(DG, rows, row_mask, cols, col_mask, INNER, sg_o, sg_i, sg_c)
        x = x * (gt * tl.sigmoid(gt))
    return x, gt


@triton.jit
def _load_stats(MEAN, RSTD, rows, row_mask, IS_RMS: tl.constexpr):
    """(mean, rstd) of the rows the forward saved (mean = rstd for RMSNorm, which has none)."""
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    mean = rstd
    if not IS_RMS:
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    return mean, rstd


@triton.jit
def _bwd_tile(x, dy, w, b, ms, mt, DX, DRES, DH, mean, rstd, SYNC, SCRATCH, group, k, it, rows, row_mask, cols,
              col_mask, N, INNER, sdh_o, sdh_i, sdh_c, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
              HAS_B: tl.constexpr, HAS_MS: tl.constexpr, HAS_MT: tl.constexpr, ACT: tl.constexpr,
              HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """dx of one loaded [BLOCK_M, BLOCK_N] tile (the row sums exchanged within a split group),
    stored, given its rows' statistics (_load_stats); returns (g * xhat, g, gy * yaff, gy): the tile's
    terms of dweight, dbias, dscale, dshift.
    HAS_GATE: x is the ungated input; the gate comes through DH (and dgate goes out through DRES)."""
    mask = row_mask[:, None] & col_mask[None, :]
    xg = x
    x, gt = _gate_in(xg, DH, rows, row_mask, cols, col_mask, INNER, sdh_o, sdh_i, sdh_c, HAS_GATE)
    xhat, g, wg, gy, yaff = _bwd_terms(x, dy, w, b, ms, mt, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, HAS_MS, HAS_MT,
                                       ACT, BLOCK_N == 1)
    if IS_RMS:
        c1 = tl.sum(xhat * wg, axis=1)
        c2 = c1
    else:  # both row sums in one reduction: one cross-warp exchange (and barrier) instead of two
        c1, c2 = tl.reduce((xhat * wg, wg), 1, _add_pair)
    if SPLIT > 1:
        slot = _publish_and_wait(SYNC, SCRATCH, group, k, it, c1, c2, SPLIT, BLOCK_M)
        c1 = tl.sum(_read_partials(slot, False, SPLIT, BLOCK_M), axis=0)
        c2 = tl.sum(_read_partials(slot, True, SPLIT, BLOCK_M), axis=0)
    dx = _dx(xhat, wg, rstd, c1 / N, c2 / N, IS_RMS)
    _store_dx(DX, DRES, DH, dx, xg, gt, rows, row_mask, cols, col_mask, N, INNER, sdh_o, sdh_i, sdh_c, HAS_DH,
              HAS_DRES, HAS_GATE)
    return g * xhat, g, gy * yaff, gy


@triton.jit
def _add_pair(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _zero_part(P, row, N, BLOCK_N: tl.constexpr, WANT: tl.constexpr):
    """Zero one partial-sum row (the looped kernels add into theirs chunk by chunk)."""
    if WANT:
        for chunk in range(0, tl.cdiv(N, BLOCK_N)):
            cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(P + row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)


@triton.jit
def _add_part(P, row, cols, col_mask, t, WANT: tl.constexpr):
    """Add the column sums of tile t into partial row `row` (looped kernels: only this program touches it)."""
    if WANT:
        p = P + row + cols
        tl.store(p, tl.load(p, mask=col_mask, other=0.0) + tl.sum(t, axis=0), mask=col_mask)


@triton.jit
def row_norm_bwd_kernel(
    DY, X, DH, W, B, MEAN, RSTD, DX, DRES, DW_PART, DB_PART, SYNC, SCRATCH, MS, MT, DS_PART, DT_PART,
    M, N, INNER, sdy_o, sdy_i, sdy_c, sx_o, sx_i, sx_c, sdh_o, sdh_i, sdh_c, W_ROWS, w_offset,
    mod_s, mod_rps, sms_r, smt_r, mod_chunks, mod_bpc,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, PER_ROW_W: tl.constexpr, WANT_DW: tl.constexpr,
    WANT_DB: tl.constexpr, ACT: tl.constexpr, HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr,
    HAS_MS: tl.constexpr, HAS_MT: tl.constexpr, WANT_DS: tl.constexpr, WANT_DT: tl.constexpr,
    HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, LOOPED: tl.constexpr,
    PREFETCH: tl.constexpr, PREFETCH_STATS: tl.constexpr,
):
    """Persistent: group g (SPLIT programs; one program unless the row is split) handles row blocks
    g, g + G, g + 2G, ... and writes its fp32 partial sums of dweight/dbias to row g of
    DW_PART/DB_PART ([G, N]); col_sum_kernel then adds the G partials in a fixed order.
    With per-head parameters (W_ROWS heads; G a multiple of W_ROWS) group g walks only the rows of
    head g % W_ROWS, so DW_PART is [G / W_ROWS, W_ROWS * N] and the same reduction gives [W_ROWS, N].
    With modulation (the sample walk; SPLIT == 1): group g handles items g, g + G, ... of the
    mod_s * mod_chunks items, item (s, c) being row blocks [c * mod_bpc, (c + 1) * mod_bpc) of
    sample s's mod_rps rows; its dscale/dshift sums go to row c, columns s * N.. of DS_PART/DT_PART
    ([mod_chunks, mod_s * N]), which the same reduction turns into [mod_s, N].
    PREFETCH (and every split row): the plain walk loads its next tile, in the inputs' dtype, before
    working on the current one, so that loads stay in flight through the row sums and the stores;
    PREFETCH_STATS: its rows' mean and rstd with it (else loaded as the tile is worked on: a memory
    round trip between a tile's arrival and its row sums, which a program with no other on its SM waits).
    No float atomics anywhere: gradients are bitwise reproducible."""
    pid = tl.program_id(0)
    group = pid // SPLIT
    k = pid % SPLIT
    num_groups = tl.num_programs(0) // SPLIT
    part_row = group.to(tl.int64) * N
    if LOOPED:
        _zero_part(DW_PART, part_row, N, BLOCK_N, WANT_DW)
        _zero_part(DB_PART, part_row, N, BLOCK_N, WANT_DB)
        if HAS_MS or HAS_MT:
            for item in range(group, mod_s * mod_chunks, num_groups):
                s = item // mod_chunks
                c = item - s * mod_chunks
                mod_row = (c.to(tl.int64) * mod_s + s) * N
                _zero_part(DS_PART, mod_row, N, BLOCK_N, WANT_DS)
                _zero_part(DT_PART, mod_row, N, BLOCK_N, WANT_DT)
                _bwd_looped(DY, X, DH, W, B, MEAN, RSTD, DX, DRES, DW_PART, DB_PART, MS, MT, DS_PART, DT_PART,
                            part_row, mod_row, s, c * mod_bpc, 1, tl.minimum(c * mod_bpc + mod_bpc,
                                                                             tl.cdiv(mod_rps, BLOCK_M)),
                            s.to(tl.int64) * mod_rps, 1, mod_rps, N, INNER, sdy_o, sdy_i, sdy_c, sx_o, sx_i, sx_c,
                            sdh_o, sdh_i, sdh_c, W_ROWS, w_offset, sms_r, smt_r, IS_RMS, HAS_W, HAS_B, PER_ROW_W,
                            WANT_DW, WANT_DB, ACT, HAS_DH, HAS_DRES, HAS_MS, HAS_MT, WANT_DS, WANT_DT, HAS_GATE,
                            BLOCK_M, BLOCK_N)
        else:
            head = group % W_ROWS
            rows_per_head = M // W_ROWS
            _bwd_looped(DY, X, DH, W, B, MEAN, RSTD, DX, DRES, DW_PART, DB_PART, MS, MT, DS_PART, DT_PART,
                        part_row, part_row, 0, group // W_ROWS, num_groups // W_ROWS,
                        tl.cdiv(rows_per_head, BLOCK_M), head, W_ROWS, rows_per_head, N, INNER, sdy_o, sdy_i, sdy_c,
                        sx_o, sx_i, sx_c, sdh_o, sdh_i, sdh_c, W_ROWS, w_offset, sms_r, smt_r, IS_RMS, HAS_W,
                        HAS_B, PER_ROW_W, WANT_DW, WANT_DB, ACT, HAS_DH, HAS_DRES, False, False, False, False,
                        HAS_GATE, BLOCK_M, BLOCK_N)
    else:
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        # split rows: the accumulators are [1, BLOCK_N], each tile's rows summed as it is done (its
        # few rows are in every thread's registers: no exchange), so a two-row tile holds half the
        # registers of two rows of sums (LayerNorm, 2 x 2048 x 8 warps: 152 -> 128, two programs per SM).
        # Only while the warps lie along the columns (BLOCK_N >= 32 x warps x a 16-byte vector): a
        # 4 x 2048 x 16-warp tile puts warps on rows and pays a cross-warp sum per tile (H100: 0.24-0.41)
        dw_acc = tl.zeros([BLOCK_M if SPLIT == 1 else 1, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M if SPLIT == 1 else 1, BLOCK_N], dtype=tl.float32)
        if HAS_MS or HAS_MT:  # the sample walk (SPLIT == 1, per-sample parameters are plain)
            w, b = _load_params(W, B, cols, cols, col_mask, N, 1, w_offset, HAS_W, HAS_B, False)
            for item in range(group, mod_s * mod_chunks, num_groups):
                s = item // mod_chunks
                c = item - s * mod_chunks
                ms, mt = _load_mod(MS, MT, (s + tl.zeros([1], dtype=tl.int32)).to(tl.int64), cols, col_mask,
                                   sms_r, smt_r, HAS_MS, HAS_MT)
                ds_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                dt_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for jb in range(c * mod_bpc, tl.minimum(c * mod_bpc + mod_bpc, tl.cdiv(mod_rps, BLOCK_M))):
                    rows, row_mask = _walk_rows(jb, s.to(tl.int64) * mod_rps, 1, mod_rps, BLOCK_M)
                    x = _load_tile(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
                    dy = _load_tile(DY, rows, row_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
                    mean, rstd = _load_stats(MEAN, RSTD, rows, row_mask, IS_RMS)
                    tw, tb, ts, tt = _bwd_tile(x, dy, w, b, ms, mt, DX, DRES, DH, mean, rstd, SYNC, SCRATCH, group,
                                               k, 0, rows, row_mask, cols, col_mask, N, INNER, sdh_o, sdh_i, sdh_c,
                                               IS_RMS, HAS_W, HAS_B, HAS_MS, HAS_MT, ACT, HAS_DH, HAS_DRES,
                                               HAS_GATE, BLOCK_M, BLOCK_N, 1)
                    dw_acc += tw
                    db_acc += tb
                    ds_acc += ts
                    dt_acc += tt
                mod_row = (c.to(tl.int64) * mod_s + s) * N
                if WANT_DS:
                    tl.store(DS_PART + mod_row + cols, tl.sum(ds_acc, axis=0), mask=col_mask)
                if WANT_DT:
                    tl.store(DT_PART + mod_row + cols, tl.sum(dt_acc, axis=0), mask=col_mask)
        else:
            head = group % W_ROWS
            rows_per_head = M // W_ROWS
            blocks_per_head = tl.cdiv(rows_per_head, BLOCK_M)
            step = num_groups // W_ROWS
            rows, row_mask = _walk_rows(group // W_ROWS, head, W_ROWS, rows_per_head, BLOCK_M)
            w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
            x_next = _load_raw(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
            dy_next = _load_raw(DY, rows, row_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
            mean_next, rstd_next = _load_stats(MEAN, RSTD, rows, row_mask, IS_RMS)
            for jb in range(group // W_ROWS, blocks_per_head, step):
                rows, row_mask = _walk_rows(jb, head, W_ROWS, rows_per_head, BLOCK_M)
                if SPLIT > 1 or PREFETCH:
                    # prefetch the next tiles now, in their own dtype: their loads overlap this
                    # block's row sums, stores and (split rows) the wait at the group barrier
                    x, dy = x_next.to(tl.float32), dy_next.to(tl.float32)
                    nxt, nxt_mask = _walk_rows(jb + step, head, W_ROWS, rows_per_head, BLOCK_M)
                    x_next = _load_raw(X, nxt, nxt_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
                    dy_next = _load_raw(DY, nxt, nxt_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
                    if PREFETCH_STATS:  # and their statistics: no load left between a tile and its row sums
                        mean, rstd = mean_next, rstd_next
                        mean_next, rstd_next = _load_stats(MEAN, RSTD, nxt, nxt_mask, IS_RMS)
                    else:
                        mean, rstd = _load_stats(MEAN, RSTD, rows, row_mask, IS_RMS)
                else:
                    x = _load_tile(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
                    dy = _load_tile(DY, rows, row_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
                    mean, rstd = _load_stats(MEAN, RSTD, rows, row_mask, IS_RMS)
                if PER_ROW_W:
                    w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
                tw, tb, _, _ = _bwd_tile(x, dy, w, b, 1.0, 0.0, DX, DRES, DH, mean, rstd, SYNC, SCRATCH, group, k,
                                         (jb - group // W_ROWS) // step, rows, row_mask, cols, col_mask, N, INNER,
                                         sdh_o, sdh_i, sdh_c, IS_RMS, HAS_W, HAS_B, False, False, ACT, HAS_DH,
                                         HAS_DRES, HAS_GATE, BLOCK_M, BLOCK_N, SPLIT)
                if SPLIT > 1:
                    dw_acc += tl.sum(tw, axis=0, keep_dims=True)
                    db_acc += tl.sum(tb, axis=0, keep_dims=True)
                else:
                    dw_acc += tw
                    db_acc += tb
        if WANT_DW:
            tl.store(DW_PART + part_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if WANT_DB:
            tl.store(DB_PART + part_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
        if SPLIT > 1:
            _group_exit(SYNC, group, num_groups, SPLIT)


@triton.jit
def _bwd_looped(DY, X, DH, W, B, MEAN, RSTD, DX, DRES, DW_PART, DB_PART, MS, MT, DS_PART, DT_PART, part_row, mod_row,
                sample, first, step, num_blocks, base, stride, limit, N, INNER, sdy_o, sdy_i, sdy_c, sx_o, sx_i, sx_c,
                sdh_o, sdh_i, sdh_c, W_ROWS, w_offset, sms_r, smt_r,
                IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, PER_ROW_W: tl.constexpr,
                WANT_DW: tl.constexpr, WANT_DB: tl.constexpr, ACT: tl.constexpr, HAS_DH: tl.constexpr,
                HAS_DRES: tl.constexpr, HAS_MS: tl.constexpr, HAS_MT: tl.constexpr, WANT_DS: tl.constexpr,
                WANT_DT: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program walks blocks first, first + step, ... < num_blocks of the rows base + j * stride
    (j < limit), each row in BLOCK_N chunks twice (row sums, then dx), adding its weight-gradient
    sums into partial row part_row (and, with modulation, the rows being all of one sample, its
    dscale/dshift sums into mod_row), which only it ever touches; the caller zeroes them first."""
    num_chunks = tl.cdiv(N, BLOCK_N)
    srow = (sample + tl.zeros([1], dtype=tl.int32)).to(tl.int64)
    for jb in range(first, num_blocks, step):
        rows, row_mask = _walk_rows(jb, base, stride, limit, BLOCK_M)
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
            x, _ = _gate_in(_load_tile(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c), DH, rows,
                            row_mask, cols, col_mask, INNER, sdh_o, sdh_i, sdh_c, HAS_GATE)
            dy = _load_tile(DY, rows, row_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
            w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
            ms, mt = _load_mod(MS, MT, srow, cols, col_mask, sms_r, smt_r, HAS_MS, HAS_MT)
            xhat, g, wg, _, _ = _bwd_terms(x, dy, w, b, ms, mt, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, HAS_MS,
                                           HAS_MT, ACT, False)
            c1 += tl.sum(xhat * wg, axis=1)
            if not IS_RMS:
                c2 += tl.sum(wg, axis=1)
        c1 = c1 / N
        c2 = c2 / N
        # dx and the partial sums, last chunk first (the one most likely still in L2)
        for i in range(0, num_chunks):
            cols = (num_chunks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            xg = _load_tile(X, rows, row_mask, cols, col_mask, INNER, sx_o, sx_i, sx_c)
            x, gt = _gate_in(xg, DH, rows, row_mask, cols, col_mask, INNER, sdh_o, sdh_i, sdh_c, HAS_GATE)
            dy = _load_tile(DY, rows, row_mask, cols, col_mask, INNER, sdy_o, sdy_i, sdy_c)
            w, b = _load_params(W, B, rows, cols, col_mask, N, W_ROWS, w_offset, HAS_W, HAS_B, PER_ROW_W)
            ms, mt = _load_mod(MS, MT, srow, cols, col_mask, sms_r, smt_r, HAS_MS, HAS_MT)
            xhat, g, wg, gy, yaff = _bwd_terms(x, dy, w, b, ms, mt, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, HAS_MS,
                                               HAS_MT, ACT, False)
            dx = _dx(xhat, wg, rstd, c1, c2, IS_RMS)
            _store_dx(DX, DRES, DH, dx, xg, gt, rows, row_mask, cols, col_mask, N, INNER, sdh_o, sdh_i, sdh_c,
                      HAS_DH, HAS_DRES, HAS_GATE)
            _add_part(DW_PART, part_row, cols, col_mask, g * xhat, WANT_DW)
            _add_part(DB_PART, part_row, cols, col_mask, g, WANT_DB)
            _add_part(DS_PART, mod_row, cols, col_mask, gy * yaff, WANT_DS)
            _add_part(DT_PART, mod_row, cols, col_mask, gy, WANT_DT)


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
