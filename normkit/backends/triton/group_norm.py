"""Triton GroupNorm kernels (forward, backward) with the fused activation epilogue.

A group (b, g) is viewed as a [Cg, S] tile: Cg channels of the group by S spatial positions. The
two memory formats differ only in the tile's strides: NCHW has (stride_c, stride_s) = (S, 1),
channels_last has (1, C); so one kernel serves both, reads in place, and the per-channel affine
is a [BLOCK_R] vector broadcast along the spatial axis. A group larger than one tile is cut into
KR x KS slices (channels x spatial) held by K = KR * KS programs, which exchange their partial
statistics through the same publish-and-wait step as split rows (kernels.py). With many groups
(LOOPED) a program instead walks its group's tiles twice, statistics then normalize, the second
pass mostly from L2: no waits, and enough independent programs to keep the memory system busy.

Backward writes per-channel fp32 partial sums of dweight/dbias for each (batch, spatial slice) to
a [B * KS, C] buffer that col_sum_kernel reduces in a fixed order: deterministic, no atomics.
"""
import triton
import triton.language as tl

from .epilogue import act_fwd, act_grad
from .kernels import _chan_merge, _group_exit, _publish_and_wait, _read_partials


@triton.jit
def _gn_tile(b_idx, g, kr, ks, S, Cg, stride_b, stride_c, stride_s,
             BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Offsets, mask and channel indices of slice (kr, ks) of group (b_idx, g)."""
    r = kr * BLOCK_R + tl.arange(0, BLOCK_R)
    s = ks * BLOCK_S + tl.arange(0, BLOCK_S)
    r_mask = r < Cg
    mask = r_mask[:, None] & (s < S)[None, :]
    ch = g * Cg + r
    offs = b_idx.to(tl.int64) * stride_b + ch.to(tl.int64)[:, None] * stride_c + s.to(tl.int64)[None, :] * stride_s
    return offs, mask, ch, r_mask


@triton.jit
def _slice_sizes(j, Cg, S, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, KS: tl.constexpr):
    """Elements in slice(s) j = kr * KS + ks of a group (works on scalars and vectors)."""
    n_r = tl.minimum(tl.maximum(Cg - (j // KS) * BLOCK_R, 0), BLOCK_R)
    n_s = tl.minimum(tl.maximum(S - (j % KS) * BLOCK_S, 0), BLOCK_S)
    return (n_r * n_s) * 1.0


@triton.jit
def _group_shift(X, b_idx, g, Cg, stride_b, stride_c):
    """The group's first element: statistics of x minus it keep their digits on offset data."""
    return tl.load(X + b_idx.to(tl.int64) * stride_b + (g * Cg).to(tl.int64) * stride_c).to(tl.float32)


@triton.jit
def _store_y(Y, W, B, offs, mask, ch, r_mask, xhat, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr):
    """y = act(xhat * w[channel] + b[channel]) for one tile, stored in Y's dtype."""
    y = xhat
    if HAS_W:
        y = y * tl.load(W + ch, mask=r_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_B:
        y = y + tl.load(B + ch, mask=r_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + offs, act_fwd(y, ACT).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _store_group_stat(P, grp, value, k):
    """Program 0 of the group writes one fp32 value (a [1] store: the interpreter rejects scalar masks)."""
    one = tl.arange(0, 1)
    tl.store(P + grp + one, tl.zeros([1], dtype=tl.float32) + value, mask=(one * 0 + k) == 0)


@triton.jit
def group_norm_fwd_kernel(
    X, Y, W, B, MEAN, RSTD, SYNC, SCRATCH,
    Bn, C, S, Cg, G, stride_b, stride_c, stride_s, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, KS: tl.constexpr, SPLIT: tl.constexpr, LOOPED: tl.constexpr,
):
    """Programs come in units of SPLIT (= KR * KS) and walk groups u, u + U, ... (u = unit);
    LOOPED: program p owns group p. y has x's strides (the host allocates it with empty_like)."""
    pid = tl.program_id(0)
    if LOOPED:
        _gn_fwd_looped(X, Y, W, B, MEAN, RSTD, pid, S, Cg, G, stride_b, stride_c, stride_s, eps,
                       HAS_W, HAS_B, ACT, BLOCK_R, BLOCK_S)
    else:
        _gn_fwd_split(X, Y, W, B, MEAN, RSTD, SYNC, SCRATCH, pid, Bn, S, Cg, G, stride_b, stride_c, stride_s, eps,
                      HAS_W, HAS_B, ACT, BLOCK_R, BLOCK_S, KS, SPLIT)


@triton.jit
def _gn_fwd_looped(X, Y, W, B, MEAN, RSTD, grp, S, Cg, G, stride_b, stride_c, stride_s, eps,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program, one group, in [BLOCK_R, BLOCK_S] tiles: shifted Welford over the tiles (each
    tile's exact mean and M2, merged by Chan's rule), then normalize, last tile first (the tiles
    read most recently are the likeliest to be in L2)."""
    b_idx = grp // G
    g = grp % G
    n_ks = tl.cdiv(S, BLOCK_S)
    n_tiles = tl.cdiv(Cg, BLOCK_R) * n_ks
    shift = _group_shift(X, b_idx, g, Cg, stride_b, stride_c)
    mean_s = tl.zeros([1], dtype=tl.float32)
    m2 = tl.zeros([1], dtype=tl.float32)
    count = tl.zeros([1], dtype=tl.float32)
    for t in range(0, n_tiles):
        kr = t // n_ks
        ks = t % n_ks
        offs, mask, ch, r_mask = _gn_tile(b_idx, g, kr, ks, S, Cg, stride_b, stride_c, stride_s, BLOCK_R, BLOCK_S)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        n_t = (tl.minimum(Cg - kr * BLOCK_R, BLOCK_R) * tl.minimum(S - ks * BLOCK_S, BLOCK_S)) * 1.0
        xs = tl.where(mask, x - shift, 0.0)
        t_mean = tl.sum(tl.sum(xs, axis=1), axis=0) / n_t
        d = tl.where(mask, xs - t_mean, 0.0)
        mean_s, m2, count = _chan_merge(mean_s, m2, count, t_mean, tl.sum(tl.sum(d * d, axis=1), axis=0), n_t)
    mean = tl.sum(mean_s, axis=0)
    rstd = tl.rsqrt(tl.sum(m2, axis=0) / (Cg * S) + eps)
    for i in range(0, n_tiles):
        t = n_tiles - 1 - i
        kr = t // n_ks
        ks = t % n_ks
        offs, mask, ch, r_mask = _gn_tile(b_idx, g, kr, ks, S, Cg, stride_b, stride_c, stride_s, BLOCK_R, BLOCK_S)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        _store_y(Y, W, B, offs, mask, ch, r_mask, ((x - shift) - mean) * rstd, HAS_W, HAS_B, ACT)
    _store_group_stat(MEAN, grp, shift + mean, 0)
    _store_group_stat(RSTD, grp, rstd, 0)


@triton.jit
def _gn_fwd_split(X, Y, W, B, MEAN, RSTD, SYNC, SCRATCH, pid, Bn, S, Cg, G, stride_b, stride_c, stride_s, eps,
                  HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, KS: tl.constexpr, SPLIT: tl.constexpr):
    """Persistent: a unit of SPLIT programs holds one group in registers at a time."""
    unit = pid // SPLIT
    k = pid % SPLIT
    kr = k // KS
    ks = k % KS
    num_units = tl.num_programs(0) // SPLIT
    num_groups = Bn * G
    L = Cg * S
    n_local = _slice_sizes(k, Cg, S, BLOCK_R, BLOCK_S, KS)
    for grp in range(unit, num_groups, num_units):
        grp = grp + 0 * pid  # a tensor also under the interpreter (which iterates Python ints)
        b_idx = grp // G
        g = grp % G
        offs, mask, ch, r_mask = _gn_tile(b_idx, g, kr, ks, S, Cg, stride_b, stride_c, stride_s, BLOCK_R, BLOCK_S)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        shift = _group_shift(X, b_idx, g, Cg, stride_b, stride_c)
        xs = tl.where(mask, x - shift, 0.0)
        mean_l = tl.sum(tl.sum(xs, axis=1), axis=0) / tl.maximum(n_local, 1.0)
        d = tl.where(mask, xs - mean_l, 0.0)
        m2 = tl.sum(tl.sum(d * d, axis=1), axis=0)
        mean_s = mean_l
        if SPLIT > 1:
            one = tl.zeros([1], dtype=tl.float32)
            slot = _publish_and_wait(SYNC, SCRATCH, unit, k, (grp - unit) // num_units, one + mean_l, one + m2, SPLIT, 1)
            n_j = _slice_sizes(tl.arange(0, SPLIT), Cg, S, BLOCK_R, BLOCK_S, KS)[:, None]
            means = _read_partials(slot, False, SPLIT, 1)
            mean_v = tl.sum(n_j * means, axis=0) / L
            dd = means - mean_v[None, :]
            m2 = tl.sum(tl.sum(_read_partials(slot, True, SPLIT, 1) + n_j * dd * dd, axis=0), axis=0)
            mean_s = tl.sum(mean_v, axis=0)
            d = tl.where(mask, xs - mean_s, 0.0)
        rstd = tl.rsqrt(m2 / L + eps)
        _store_y(Y, W, B, offs, mask, ch, r_mask, d * rstd, HAS_W, HAS_B, ACT)
        _store_group_stat(MEAN, grp, shift + mean_s, k)
        _store_group_stat(RSTD, grp, rstd, k)
    if SPLIT > 1:
        _group_exit(SYNC, unit, num_units, SPLIT)


@triton.jit
def group_norm_bwd_kernel(
    DY, X, W, B, MEAN, RSTD, DX, DW_PART, DB_PART, SYNC, SCRATCH,
    Bn, C, S, Cg, G, stride_b, stride_c, stride_s,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
    ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, KS: tl.constexpr, SPLIT: tl.constexpr,
):
    """dx = rstd * (w*g - xhat * mean(xhat * w*g) - mean(w*g)) over the group, g = dy * act'(z)
    (dy and dx have x's strides);
    per-channel sums of g*xhat and g over this slice's positions go to row (b*KS + ks) of the
    partial buffers ([B*KS, C]); every entry is written by exactly one program."""
    pid = tl.program_id(0)
    unit = pid // SPLIT
    k = pid % SPLIT
    kr = k // KS
    ks = k % KS
    num_units = tl.num_programs(0) // SPLIT
    num_groups = Bn * G
    L = Cg * S
    for grp in range(unit, num_groups, num_units):
        grp = grp + 0 * pid  # a tensor also under the interpreter (which iterates Python ints)
        b_idx = grp // G
        g_idx = grp % G
        offs, mask, ch, r_mask = _gn_tile(b_idx, g_idx, kr, ks, S, Cg, stride_b, stride_c, stride_s,
                                          BLOCK_R, BLOCK_S)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + grp)
        rstd = tl.load(RSTD + grp)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        if HAS_W:
            w = tl.load(W + ch, mask=r_mask, other=0.0).to(tl.float32)[:, None]
        else:
            w = 1.0
        gr = dy
        if ACT != 0:
            z = xhat * w
            if HAS_B:
                z = z + tl.load(B + ch, mask=r_mask, other=0.0).to(tl.float32)[:, None]
            gr = tl.where(mask, act_grad(z, dy, ACT), 0.0)
        wg = gr * w
        c1 = tl.sum(tl.sum(xhat * wg, axis=1), axis=0)
        c2 = tl.sum(tl.sum(wg, axis=1), axis=0)
        if SPLIT > 1:
            one = tl.zeros([1], dtype=tl.float32)
            slot = _publish_and_wait(SYNC, SCRATCH, unit, k, (grp - unit) // num_units, one + c1, one + c2, SPLIT, 1)
            c1 = tl.sum(tl.sum(_read_partials(slot, False, SPLIT, 1), axis=1), axis=0)
            c2 = tl.sum(tl.sum(_read_partials(slot, True, SPLIT, 1), axis=1), axis=0)
        dx = (wg - (xhat * (c1 / L) + c2 / L)) * rstd
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        part = (b_idx * KS + ks).to(tl.int64) * C + ch
        if WANT_DW:
            tl.store(DW_PART + part, tl.sum(gr * xhat, axis=1), mask=r_mask)
        if WANT_DB:
            tl.store(DB_PART + part, tl.sum(gr, axis=1), mask=r_mask)
    if SPLIT > 1:
        _group_exit(SYNC, unit, num_units, SPLIT)
