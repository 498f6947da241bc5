"""Triton GroupNorm kernels (forward, backward) with the fused activation epilogue.

A group (b, g) is viewed as a [Cg, S] tile: Cg channels of the group by S spatial positions. The
two memory formats differ only in the tile's strides: NCHW has (stride_c, stride_s) = (S, 1),
channels_last has (1, C); so one kernel serves both, reads in place, and the per-channel affine
is a [BLOCK_R] vector broadcast along the spatial axis. Four paths (configs.py picks):
* split: a group larger than one tile is cut into KR x KS slices (channels x spatial) held by
  K = KR * KS programs, which exchange their partial statistics through the same publish-and-wait
  step as split rows (kernels.py);
* looped (at least one group per SM): a program walks its group's tiles twice, statistics (or the
  backward's two sums) then normalize (or dx), the second pass mostly from L2: no waits;
* two-kernel split (groups of several tiles): a program per slice in two launches, partials then
  merge-and-apply (see its section): no waits, and every slice's loads in flight at once;
* staged (channels_last with small groups): three launches over [channel block, spatial block]
  tiles that read whole rows of channels (see the section at the end of this file).

Backward writes per-channel fp32 partial sums of dweight/dbias for each (batch, spatial slice) (the
staged path: for each batch) to a buffer that col_sum_kernel reduces in a fixed order:
deterministic, no float atomics (the only atomics are the integer counters programs meet at).
"""
import triton
import triton.language as tl

from .epilogue import act_fwd, act_grad
from .kernels import _add_pair, _chan_merge, _group_exit, _publish_and_wait, _read_partials


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
def _gn_tile_at(t, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """The looped walk's tile t (t = kr * n_ks + ks) as (offsets from the group's first element, in int32,
    mask, channels within the group, channel mask), masked off outside 0 <= t < n_tiles (the looped kernels'
    loads one tile ahead run past either end of the walk). int32 offsets (64-bit ones take two registers an
    element): configs.group_config takes these kernels only for NCHW groups of fewer than 2^31 elements."""
    tc = tl.minimum(tl.maximum(t, 0), n_tiles - 1)
    # outside the walk: a channel block past the group's channels, so every lane is masked off
    kr = tl.where((t >= 0) & (t < n_tiles), tc // n_ks, tl.cdiv(Cg, BLOCK_R))
    r = kr * BLOCK_R + tl.arange(0, BLOCK_R)
    s = (tc % n_ks) * BLOCK_S + tl.arange(0, BLOCK_S)
    r_mask = r < Cg
    return r[:, None] * stride_c + s[None, :] * stride_s, r_mask[:, None] & (s < S)[None, :], r, r_mask


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
    SLOTS: tl.constexpr = False,
):
    """Programs come in units of SPLIT (= KR * KS) and walk groups u, u + U, ... (u = unit);
    LOOPED: program p owns group p (SLOTS: _gn_fwd_looped_slots).
    y has x's strides (the host allocates it with empty_like)."""
    pid = tl.program_id(0)
    if LOOPED and SLOTS:
        _gn_fwd_looped_slots(X, Y, W, B, MEAN, RSTD, pid, S, Cg, G, stride_b, stride_c, stride_s, eps,
                             HAS_W, HAS_B, ACT, BLOCK_R, BLOCK_S)
    elif LOOPED:
        _gn_fwd_looped(X, Y, W, B, MEAN, RSTD, pid, S, Cg, G, stride_b, stride_c, stride_s, eps,
                       HAS_W, HAS_B, ACT, BLOCK_R, BLOCK_S)
    else:
        _gn_fwd_split(X, Y, W, B, MEAN, RSTD, SYNC, SCRATCH, pid, Bn, S, Cg, G, stride_b, stride_c, stride_s, eps,
                      HAS_W, HAS_B, ACT, BLOCK_R, BLOCK_S, KS, SPLIT)


@triton.jit
def _gn_fwd_looped(X, Y, W, B, MEAN, RSTD, grp, S, Cg, G, stride_b, stride_c, stride_s, eps,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program, one group, in [BLOCK_R, BLOCK_S] tiles: shifted Welford over the tiles, then
    normalize, last tile first (the tiles read most recently are the likeliest to be in L2).
    Statistics: each tile's exact mean and M2 merged by Chan's rule (two reductions across the
    program's threads per tile, each a barrier the next loads wait behind)."""
    b_idx = grp // G
    g = grp % G
    n_ks = tl.cdiv(S, BLOCK_S)
    n_tiles = tl.cdiv(Cg, BLOCK_R) * n_ks
    shift = _group_shift(X, b_idx, g, Cg, stride_b, stride_c)
    mean_s = tl.zeros([1], dtype=tl.float32)
    m2_s = tl.zeros([1], dtype=tl.float32)
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
        mean_s, m2_s, count = _chan_merge(mean_s, m2_s, count, t_mean, tl.sum(tl.sum(d * d, axis=1), axis=0), n_t)
    mean = tl.sum(mean_s, axis=0)
    m2 = tl.sum(m2_s, axis=0)
    rstd = tl.rsqrt(m2 / (Cg * S) + eps)
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
def _gn_fwd_looped_slots(X, Y, W, B, MEAN, RSTD, grp, S, Cg, G, stride_b, stride_c, stride_s, eps,
                         HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """_gn_fwd_looped as the row norms' looped forward is built (kernels._fwd_looped): the first pass sums the
    values and their squares per element slot, shifted by the first tile's mean, and reduces across the program's
    threads once, after the loop; both passes load the tile after the current one before working on it, so a
    reduction's barrier or a tile's stores never stand between one tile's loads and the next's. The first pass
    asks L2 to keep the group, the second to drop it. The shift bounds the cancellation as in _fwd_looped:
    (mean - shift)^2 <= (tiles - 1) * var."""
    b_idx = grp // G
    g = grp % G
    n_ks = tl.cdiv(S, BLOCK_S)
    n_tiles = tl.cdiv(Cg, BLOCK_R) * n_ks
    L = Cg * S
    base = b_idx.to(tl.int64) * stride_b + (g * Cg).to(tl.int64) * stride_c
    Xg = X + base
    Yg = Y + base
    t0 = grp * 0  # a tensor also under the interpreter
    offs, mask, _, _ = _gn_tile_at(t0, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
    x = tl.load(Xg + offs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    offs, mask_n, _, _ = _gn_tile_at(t0 + 1, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
    x_next = tl.load(Xg + offs, mask=mask_n, other=0.0, eviction_policy="evict_last")
    shift = tl.sum(tl.sum(x, axis=1), axis=0) / (tl.minimum(Cg, BLOCK_R) * tl.minimum(S, BLOCK_S))
    acc1 = tl.where(mask, x - shift, 0.0)
    acc2 = acc1 * acc1
    for t in range(1, n_tiles):
        x = x_next.to(tl.float32)
        mask = mask_n
        offs, mask_n, _, _ = _gn_tile_at(t0 + t + 1, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
        x_next = tl.load(Xg + offs, mask=mask_n, other=0.0, eviction_policy="evict_last")
        xs = tl.where(mask, x - shift, 0.0)
        acc1 += xs
        acc2 += xs * xs
    # normalize, last tile first; its loads issued before the reduction's barrier
    offs, mask, _, _ = _gn_tile_at(t0 + n_tiles - 1, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
    x_next = tl.load(Xg + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    s1, s2 = tl.reduce((acc1, acc2), 1, _add_pair)
    s1, s2 = tl.reduce((s1, s2), 0, _add_pair)
    mean = s1 / L
    rstd = tl.rsqrt(tl.maximum(s2 / L - mean * mean, 0.0) + eps)
    centre = -mean * rstd
    for i in range(0, n_tiles):  # (a tile's offsets are recomputed, not carried from its load: a register an element)
        x = x_next.to(tl.float32)
        offs, mask, r, r_mask = _gn_tile_at(t0 + n_tiles - 1 - i, n_ks, n_tiles, S, Cg, stride_c, stride_s,
                                            BLOCK_R, BLOCK_S)
        offs_n, mask_n, _, _ = _gn_tile_at(t0 + n_tiles - 2 - i, n_ks, n_tiles, S, Cg, stride_c, stride_s,
                                           BLOCK_R, BLOCK_S)
        x_next = tl.load(Xg + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_first")
        _store_y(Yg, W, B, offs, mask, g * Cg + r, r_mask, (x - shift) * rstd + centre, HAS_W, HAS_B, ACT)
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
def _gn_bwd_terms(x, dy, W, B, ch, r_mask, mask, mean, rstd, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                  ACT: tl.constexpr):
    """(xhat, g, w*g) of one tile, zero outside `mask`; g is dy through the activation's derivative
    (the pre-activation z = xhat * w + b recomputed from x and the statistics). w*g is rounded once
    and never fused into dx's subtractions (kernels._bwd_terms): one element per group gives dx = 0."""
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
    return xhat, gr, (tl.fma(gr, w, 0.0) if HAS_W else gr)


@triton.jit
def group_norm_bwd_kernel(
    DY, X, W, B, MEAN, RSTD, DX, DW_PART, DB_PART, SYNC, SCRATCH,
    Bn, C, S, Cg, G, stride_b, stride_c, stride_s,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
    ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, KS: tl.constexpr, SPLIT: tl.constexpr,
    LOOPED: tl.constexpr, SLOTS: tl.constexpr = False,
):
    """dx = rstd * (w*g - xhat * mean(xhat * w*g) - mean(w*g)) over the group, g = dy * act'(z)
    (dy and dx have x's strides). Per-channel sums of g*xhat and g over a (batch, spatial slice)
    go to row (b*KS + ks) of the partial buffers ([B*KS, C]); every entry is written by exactly one
    program. LOOPED: program p owns group p and walks its tiles twice (KS = 1; SLOTS: the first
    walk's two sums accumulate per element slot)."""
    pid = tl.program_id(0)
    if LOOPED:
        _gn_bwd_looped(DY, X, W, B, MEAN, RSTD, DX, DW_PART, DB_PART, pid, C, S, Cg, G, stride_b, stride_c, stride_s,
                       HAS_W, HAS_B, WANT_DW, WANT_DB, ACT, BLOCK_R, BLOCK_S, SLOTS)
    else:
        _gn_bwd_split(DY, X, W, B, MEAN, RSTD, DX, DW_PART, DB_PART, SYNC, SCRATCH, pid, Bn, C, S, Cg, G,
                      stride_b, stride_c, stride_s, HAS_W, HAS_B, WANT_DW, WANT_DB, ACT, BLOCK_R, BLOCK_S, KS, SPLIT)


@triton.jit
def _gn_bwd_tile(DY, X, W, B, b_idx, g, kr, ks, S, Cg, stride_b, stride_c, stride_s, mean, rstd,
                 HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Tile (kr, ks) of group (b_idx, g): (offsets, mask, channels, channel mask, xhat, g, w*g)."""
    offs, mask, ch, r_mask = _gn_tile(b_idx, g, kr, ks, S, Cg, stride_b, stride_c, stride_s, BLOCK_R, BLOCK_S)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    xhat, gr, wg = _gn_bwd_terms(x, dy, W, B, ch, r_mask, mask, mean, rstd, HAS_W, HAS_B, ACT)
    return offs, mask, ch, r_mask, xhat, gr, wg


@triton.jit
def _gn_bwd_looped(DY, X, W, B, MEAN, RSTD, DX, DW_PART, DB_PART, grp, C, S, Cg, G, stride_b, stride_c, stride_s,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
                   ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SLOTS: tl.constexpr):
    """One program, one group, in [BLOCK_R, BLOCK_S] tiles (t = kr * n_ks + ks): the two group
    sums, then dx and the per-channel weight-gradient sums, last tile first (from L2).
    SLOTS: as _gn_fwd_looped_slots, the sums per element slot, reduced across the program's threads once
    instead of per tile, and both passes load the tile after the current one (x and dy) before working on it."""
    b_idx = grp // G
    g = grp % G
    n_ks = tl.cdiv(S, BLOCK_S)
    n_tiles = tl.cdiv(Cg, BLOCK_R) * n_ks
    mean = tl.load(MEAN + grp)
    rstd = tl.load(RSTD + grp)
    L = Cg * S
    dw_acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if SLOTS:  # xhat and w*g are zero outside the group
        base = b_idx.to(tl.int64) * stride_b + (g * Cg).to(tl.int64) * stride_c
        Xg = X + base
        DYg = DY + base
        t0 = grp * 0  # a tensor also under the interpreter
        offs, mask_n, _, _ = _gn_tile_at(t0, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
        x_n = tl.load(Xg + offs, mask=mask_n, other=0.0, eviction_policy="evict_last")
        dy_n = tl.load(DYg + offs, mask=mask_n, other=0.0, eviction_policy="evict_last")
        a1 = tl.zeros([BLOCK_R, BLOCK_S], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_R, BLOCK_S], dtype=tl.float32)
        for t in range(0, n_tiles):
            x, dy = x_n.to(tl.float32), dy_n.to(tl.float32)
            _, mask, r, r_mask = _gn_tile_at(t0 + t, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
            offs, mask_n, _, _ = _gn_tile_at(t0 + t + 1, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
            x_n = tl.load(Xg + offs, mask=mask_n, other=0.0, eviction_policy="evict_last")
            dy_n = tl.load(DYg + offs, mask=mask_n, other=0.0, eviction_policy="evict_last")
            xhat, gr, wg = _gn_bwd_terms(x, dy, W, B, g * Cg + r, r_mask, mask, mean, rstd, HAS_W, HAS_B, ACT)
            a1 += xhat * wg
            a2 += wg
        # dx, last tile first; its loads issued before the reduction's barrier
        offs, mask, _, _ = _gn_tile_at(t0 + n_tiles - 1, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
        x_n = tl.load(Xg + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        dy_n = tl.load(DYg + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        c1, c2 = tl.reduce((a1, a2), 1, _add_pair)
        c1, c2 = tl.reduce((c1, c2), 0, _add_pair)
        c1_n = c1 / L
        c2_n = c2 / L
        for i in range(0, n_tiles):
            x, dy = x_n.to(tl.float32), dy_n.to(tl.float32)
            t = t0 + n_tiles - 1 - i
            offs, mask, r, r_mask = _gn_tile_at(t, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
            offs_n, mask_n, _, _ = _gn_tile_at(t - 1, n_ks, n_tiles, S, Cg, stride_c, stride_s, BLOCK_R, BLOCK_S)
            x_n = tl.load(Xg + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_first")
            dy_n = tl.load(DYg + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_first")
            xhat, gr, wg = _gn_bwd_terms(x, dy, W, B, g * Cg + r, r_mask, mask, mean, rstd, HAS_W, HAS_B, ACT)
            dw_acc, db_acc = _gn_bwd_emit(DX + base, DW_PART, DB_PART, offs, mask, g * Cg + r, r_mask, t % n_ks, xhat,
                                          gr, wg, c1_n, c2_n, rstd, b_idx, C, dw_acc, db_acc, WANT_DW, WANT_DB)
    else:
        c1 = tl.zeros([BLOCK_R], dtype=tl.float32)
        c2 = tl.zeros([BLOCK_R], dtype=tl.float32)
        for t in range(0, n_tiles):
            _, _, _, _, xhat, gr, wg = _gn_bwd_tile(DY, X, W, B, b_idx, g, t // n_ks, t % n_ks, S, Cg, stride_b,
                                                    stride_c, stride_s, mean, rstd, HAS_W, HAS_B, ACT,
                                                    BLOCK_R, BLOCK_S)
            c1 += tl.sum(xhat * wg, axis=1)
            c2 += tl.sum(wg, axis=1)
        c1_n = tl.sum(c1, axis=0) / L
        c2_n = tl.sum(c2, axis=0) / L
        for i in range(0, n_tiles):
            t = n_tiles - 1 - i
            ks = t % n_ks
            offs, mask, ch, r_mask, xhat, gr, wg = _gn_bwd_tile(DY, X, W, B, b_idx, g, t // n_ks, ks, S, Cg,
                                                                stride_b, stride_c, stride_s, mean, rstd, HAS_W,
                                                                HAS_B, ACT, BLOCK_R, BLOCK_S)
            dw_acc, db_acc = _gn_bwd_emit(DX, DW_PART, DB_PART, offs, mask, ch, r_mask, ks, xhat, gr, wg, c1_n, c2_n,
                                          rstd, b_idx, C, dw_acc, db_acc, WANT_DW, WANT_DB)


@triton.jit
def _gn_bwd_emit(DX, DW_PART, DB_PART, offs, mask, ch, r_mask, ks, xhat, gr, wg, c1_n, c2_n, rstd, b_idx, C, dw_acc,
                 db_acc, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr):
    """One tile of the looped backward's second pass: dx stored, the channels' weight-gradient sums added,
    and written to the sample's partial row when the tile ends its channel block. Returns (dw_acc, db_acc)."""
    tl.store(DX + offs, ((wg - (xhat * c1_n + c2_n)) * rstd).to(DX.dtype.element_ty), mask=mask)
    # walking backwards, ks == 0 ends a channel block: its sums are complete
    done = r_mask & ((ch * 0 + ks) == 0)  # vector form, for the interpreter
    part = b_idx.to(tl.int64) * C + ch
    if WANT_DW:
        dw_acc += tl.sum(gr * xhat, axis=1)
        tl.store(DW_PART + part, dw_acc, mask=done)
        dw_acc = tl.where(done, 0.0, dw_acc)
    if WANT_DB:
        db_acc += tl.sum(gr, axis=1)
        tl.store(DB_PART + part, db_acc, mask=done)
        db_acc = tl.where(done, 0.0, db_acc)
    return dw_acc, db_acc


@triton.jit
def _gn_bwd_split(DY, X, W, B, MEAN, RSTD, DX, DW_PART, DB_PART, SYNC, SCRATCH, pid, Bn, C, S, Cg, G,
                  stride_b, stride_c, stride_s,
                  HAS_W: tl.constexpr, HAS_B: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
                  ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, KS: tl.constexpr,
                  SPLIT: tl.constexpr):
    """Persistent: a unit of SPLIT programs holds one group's slices at a time."""
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
        offs, mask, ch, r_mask = _gn_tile(b_idx, grp % G, kr, ks, S, Cg, stride_b, stride_c, stride_s,
                                          BLOCK_R, BLOCK_S)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + grp)
        xhat, gr, wg = _gn_bwd_terms(x, dy, W, B, ch, r_mask, mask, tl.load(MEAN + grp), rstd, HAS_W, HAS_B, ACT)
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


# ----------------------------------------------------------------------------- two-kernel split
# A group larger than one tile, as n_tiles = n_kr * n_ks [BLOCK_R, BLOCK_S] slices, one program
# each, in two launches and no waiting: `split stats` reduces each slice (forward: the slice's mean
# and M2 of x minus the group's first element, P1/P2 [groups * n_tiles]; backward: per-channel sums
# of g*xhat and g, P1/P2 [B * n_ks, C], which are also the weight-gradient partials), `split apply`
# merges its group's partials in a fixed order and writes its slice of y (or dx), last slice
# first (the stats launch read those most recently: likeliest in L2).

@triton.jit
def _split2_slice(pid, n_tiles, n_ks, S, Cg, G, stride_b, stride_c, stride_s,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program pid = group * n_tiles + (kr * n_ks + ks): (group, b, g, kr, ks, offsets, mask,
    channels, channel mask)."""
    grp = pid // n_tiles
    t = pid % n_tiles
    kr = t // n_ks
    ks = t % n_ks
    b_idx = grp // G
    g = grp % G
    offs, mask, ch, r_mask = _gn_tile(b_idx, g, kr, ks, S, Cg, stride_b, stride_c, stride_s, BLOCK_R, BLOCK_S)
    return grp, t, b_idx, g, kr, ks, offs, mask, ch, r_mask


@triton.jit
def group_norm_split_stats_kernel(
    X, DY, W, B, MEAN, RSTD, P1, P2, C, S, Cg, G, n_tiles, n_ks, stride_b, stride_c, stride_s,
    BWD: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One slice per program. Forward: its exact (two-pass) mean and M2 of x minus the group's
    first element -> P1[pid], P2[pid]. Backward: per channel, sum of g*xhat and of g over the
    slice's positions -> row b * n_ks + ks of P1, P2 ([B * n_ks, C])."""
    pid = tl.program_id(0)
    grp, t, b_idx, g, kr, ks, offs, mask, ch, r_mask = _split2_slice(pid, n_tiles, n_ks, S, Cg, G, stride_b,
                                                                      stride_c, stride_s, BLOCK_R, BLOCK_S)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if BWD:
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        xhat, gr, _ = _gn_bwd_terms(x, dy, W, B, ch, r_mask, mask, tl.load(MEAN + grp), tl.load(RSTD + grp),
                                    HAS_W, HAS_B, ACT)
        part = (b_idx * n_ks + ks).to(tl.int64) * C + ch
        tl.store(P1 + part, tl.sum(gr * xhat, axis=1), mask=r_mask)
        tl.store(P2 + part, tl.sum(gr, axis=1), mask=r_mask)
    else:
        shift = _group_shift(X, b_idx, g, Cg, stride_b, stride_c)
        n_t = (tl.minimum(Cg - kr * BLOCK_R, BLOCK_R) * tl.minimum(S - ks * BLOCK_S, BLOCK_S)) * 1.0
        xs = tl.where(mask, x - shift, 0.0)
        t_mean = tl.sum(tl.sum(xs, axis=1), axis=0) / n_t
        d = tl.where(mask, xs - t_mean, 0.0)
        _store_group_stat(P1, pid, t_mean, 0)
        _store_group_stat(P2, pid, tl.sum(tl.sum(d * d, axis=1), axis=0), 0)


@triton.jit
def group_norm_split_apply_kernel(
    X, DY, Y, W, B, MEAN, RSTD, P1, P2, C, S, Cg, G, n_tiles, n_ks, stride_b, stride_c, stride_s, eps,
    BWD: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr,
    BLOCK_RG: tl.constexpr,
):
    """One slice per program, last first. Forward: mean = sum n_j mean_j / L and
    M2 = sum M2_j + sum n_j (mean_j - mean)^2 over the group's slices (exact), y = act(xhat * w + b);
    the group's first slice writes MEAN, RSTD. Backward: c1 = sum_c w_c sum g*xhat / L and
    c2 = sum_c w_c sum g / L from the group's [n_ks, Cg] partials, dx = rstd * (w*g - xhat*c1 - c2)."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    grp, t, b_idx, g, kr, ks, offs, mask, ch, r_mask = _split2_slice(pid, n_tiles, n_ks, S, Cg, G, stride_b,
                                                                      stride_c, stride_s, BLOCK_R, BLOCK_S)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    L = Cg * S
    if BWD:
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + grp)
        rstd = tl.load(RSTD + grp)
        j = tl.arange(0, BLOCK_KS)
        r = tl.arange(0, BLOCK_RG)
        pmask = (j < n_ks)[:, None] & (r < Cg)[None, :]
        poffs = (b_idx * n_ks + j).to(tl.int64)[:, None] * C + (g * Cg + r)[None, :]
        a1 = tl.load(P1 + poffs, mask=pmask, other=0.0)
        a2 = tl.load(P2 + poffs, mask=pmask, other=0.0)
        if HAS_W:
            wv = tl.load(W + g * Cg + r, mask=r < Cg, other=0.0).to(tl.float32)[None, :]
            a1 = a1 * wv
            a2 = a2 * wv
        c1 = tl.sum(tl.sum(a1, axis=1), axis=0) / L
        c2 = tl.sum(tl.sum(a2, axis=1), axis=0) / L
        xhat, _, wg = _gn_bwd_terms(x, dy, W, B, ch, r_mask, mask, mean, rstd, HAS_W, HAS_B, ACT)
        tl.store(Y + offs, ((wg - (xhat * c1 + c2)) * rstd).to(Y.dtype.element_ty), mask=mask)
    else:
        jv = tl.arange(0, BLOCK_T)
        jm = jv < n_tiles
        n_j = tl.where(jm, (tl.minimum(Cg - (jv // n_ks) * BLOCK_R, BLOCK_R)
                            * tl.minimum(S - (jv % n_ks) * BLOCK_S, BLOCK_S)) * 1.0, 0.0)
        m_j = tl.load(P1 + grp.to(tl.int64) * n_tiles + jv, mask=jm, other=0.0)
        q_j = tl.load(P2 + grp.to(tl.int64) * n_tiles + jv, mask=jm, other=0.0)
        mean_s = tl.sum(n_j * m_j, axis=0) / L
        dd = m_j - mean_s
        rstd = tl.rsqrt(tl.sum(tl.where(jm, q_j + n_j * dd * dd, 0.0), axis=0) / L + eps)
        shift = _group_shift(X, b_idx, g, Cg, stride_b, stride_c)
        _store_y(Y, W, B, offs, mask, ch, r_mask, ((x - shift) - mean_s) * rstd, HAS_W, HAS_B, ACT)
        _store_group_stat(MEAN, grp, shift + mean_s, t)
        _store_group_stat(RSTD, grp, rstd, t)


# ----------------------------------------------------------------------------- staged path
# For channels_last (and groups too few for a program each): three launches instead of programs
# that wait on each other. `stats` reduces [BLOCK_C, BLOCK_S] tiles (channel block kc, spatial
# span j of n_sub tiles) to per-channel partials in P1/P2 ([B, spans, C] fp32); `finalize` merges
# a group's partials into its statistics (forward) or its two dx sums (backward); `apply` walks the
# tiles again, last first (the stats pass read them most recently, so they are likeliest in L2).
# Channel blocks need not align with groups: tile rows pick their group's values by index.

@triton.jit
def _staged_tile(pid_tile, C, S, n_cb, n_sb, stride_b, stride_c, stride_s,
                 BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Tile number pid_tile = (b * n_cb + kc) * n_sb + ks: (b, kc, ks, offsets, mask, channels, channel mask)."""
    ks = pid_tile % n_sb
    kc = (pid_tile // n_sb) % n_cb
    b_idx = pid_tile // (n_sb * n_cb)
    offs, mask, ch, c_mask = _gn_tile(b_idx, 0, kc, ks, S, C, stride_b, stride_c, stride_s, BLOCK_C, BLOCK_S)
    return b_idx, kc, ks, offs, mask, ch, c_mask


@triton.jit
def group_norm_staged_stats_kernel(
    X, DY, W, B, MEAN, RSTD, P1, P2, C, S, G, Cg, n_cb, n_sb, n_spans, n_sub, stride_b, stride_c, stride_s,
    BWD: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, SLOTS: tl.constexpr,
):
    """Program (b, kc, span j): per channel of block kc over the span's positions, forward: mean and
    M2; backward: sum of g*xhat and of g, which are also the weight-gradient partials (row
    b * n_spans + j of [B * n_spans, C]). SLOTS: accumulated per element slot (_staged_stats_slots);
    else each tile's exact two-pass values, Chan-merged per tile."""
    pid = tl.program_id(0)
    j = pid % n_spans
    bc = pid // n_spans  # b * n_cb + kc
    if SLOTS:
        p1, p2 = _staged_stats_slots(X, DY, W, B, MEAN, RSTD, bc, j, C, S, G, Cg, n_cb, stride_b, stride_c,
                                     stride_s, n_sub, BWD, HAS_W, HAS_B, ACT, BLOCK_C, BLOCK_S)
    else:
        p1, p2 = _staged_stats_tiles(X, DY, W, B, MEAN, RSTD, bc, j, C, S, G, Cg, n_cb, n_sb, stride_b, stride_c,
                                     stride_s, n_sub, BWD, HAS_W, HAS_B, ACT, BLOCK_C, BLOCK_S)
    b_idx = bc // n_cb
    ch = (bc % n_cb) * BLOCK_C + tl.arange(0, BLOCK_C)
    part = (b_idx * n_spans + j).to(tl.int64) * C + ch
    tl.store(P1 + part, p1, mask=ch < C)
    tl.store(P2 + part, p2, mask=ch < C)


@triton.jit
def _staged_stats_tiles(X, DY, W, B, MEAN, RSTD, bc, j, C, S, G, Cg, n_cb, n_sb, stride_b, stride_c, stride_s, n_sub,
                        BWD: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """The stats program reducing each tile across threads: per-channel (p1, p2) of span j."""
    acc1 = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    count = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(0, n_sub):
        ks = j * n_sub + i
        b_idx, kc, _, offs, mask, ch, c_mask = _staged_tile(bc * n_sb + ks, C, S, n_cb, n_sb,
                                                             stride_b, stride_c, stride_s, BLOCK_C, BLOCK_S)
        # the last span may hold fewer tiles; a tile past it decodes to the next (batch, channel
        # block), past the tensor's end for the last one: its per-channel loads are masked too
        # (unmasked, the shift load read past x: an illegal address on the H200, run S4-1)
        c_mask = c_mask & ((ch * 0 + ks) < n_sb)
        mask = mask & c_mask[:, None]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if BWD:
            grp = b_idx * G + ch // Cg
            mean = tl.load(MEAN + grp, mask=c_mask, other=0.0)[:, None]
            rstd = tl.load(RSTD + grp, mask=c_mask, other=0.0)[:, None]
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            xhat, gr, _ = _gn_bwd_terms(x, dy, W, B, ch, c_mask, mask, mean, rstd, HAS_W, HAS_B, ACT)
            acc1 += tl.sum(gr * xhat, axis=1)
            acc2 += tl.sum(gr, axis=1)
        else:  # on x minus its group's first element, as everywhere (offset data keeps its digits)
            shift = tl.load(X + b_idx.to(tl.int64) * stride_b + ((ch // Cg) * Cg).to(tl.int64) * stride_c,
                            mask=c_mask, other=0.0).to(tl.float32)
            xs = tl.where(mask, x - shift[:, None], 0.0)
            n_t = tl.maximum(tl.minimum(S - ks * BLOCK_S, BLOCK_S), 0) * 1.0
            t_mean = tl.sum(xs, axis=1) / tl.maximum(n_t, 1.0)
            d = tl.where(mask, xs - t_mean[:, None], 0.0)
            acc1, acc2, count = _chan_merge(acc1, acc2, count, t_mean, tl.sum(d * d, axis=1), n_t)
    return acc1, acc2


@triton.jit
def _staged_stats_slots(X, DY, W, B, MEAN, RSTD, bc, j, C, S, G, Cg, n_cb, stride_b, stride_c, stride_s, n_sub,
                        BWD: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """The stats program with per-slot accumulators: each of the [BLOCK_C, BLOCK_S] element slots
    keeps its own running values over the span's tiles (forward: Welford mean and M2 of x minus the
    group's first element; backward: sums of g*xhat and g), so a tile costs its loads and a few
    FMAs, and the slots are reduced across threads once, at the end (forward: Chan's exact merge).
    Per-channel (p1, p2) of span j."""
    b_idx = bc // n_cb
    ch = (bc % n_cb) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = ch < C
    grp = b_idx * G + ch // Cg
    if BWD:
        mean = tl.load(MEAN + grp, mask=c_mask, other=0.0)[:, None]
        rstd = tl.load(RSTD + grp, mask=c_mask, other=0.0)[:, None]
    else:
        shift = tl.load(X + b_idx.to(tl.int64) * stride_b + ((ch // Cg) * Cg).to(tl.int64) * stride_c,
                        mask=c_mask, other=0.0).to(tl.float32)[:, None]
    acc1 = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    cnt = tl.zeros([BLOCK_S], dtype=tl.float32)
    base = b_idx.to(tl.int64) * stride_b + ch.to(tl.int64)[:, None] * stride_c
    for i in range(0, n_sub):
        s = (j * n_sub + i) * BLOCK_S + tl.arange(0, BLOCK_S)
        s_ok = s < S  # also false past the last tile of a short last span
        mask = c_mask[:, None] & s_ok[None, :]
        offs = base + s.to(tl.int64)[None, :] * stride_s
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if BWD:
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            xhat, gr, _ = _gn_bwd_terms(x, dy, W, B, ch, c_mask, mask, mean, rstd, HAS_W, HAS_B, ACT)
            acc1 += gr * xhat
            acc2 += gr
        else:
            ok = s_ok.to(tl.float32)
            cnt += ok
            xs = x - shift
            delta = xs - acc1
            acc1 += delta * (ok / tl.maximum(cnt, 1.0))[None, :]
            acc2 += tl.where(mask, delta * (xs - acc1), 0.0)
    if BWD:
        p1 = tl.sum(acc1, axis=1)
        p2 = tl.sum(acc2, axis=1)
    else:
        p1 = tl.sum(acc1 * cnt[None, :], axis=1) / tl.maximum(tl.sum(cnt, axis=0), 1.0)
        d = acc1 - p1[:, None]
        p2 = tl.sum(acc2 + cnt[None, :] * d * d, axis=1)
    return p1, p2


@triton.jit
def group_norm_staged_finalize_kernel(
    X, P1, P2, W, MEAN, RSTD, C1, C2, Q1, Q2, C, S, G, Cg, n_spans, span, stride_b, stride_c, eps,
    BWD: tl.constexpr, HAS_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Program (b, g): _staged_finalize of one group."""
    grp = tl.program_id(0)
    _staged_finalize(X, P1, P2, W, MEAN, RSTD, C1, C2, Q1, Q2, grp // G, grp % G, C, S, G, Cg, n_spans,
                     stride_b, stride_c, eps, span, BWD, HAS_W, BLOCK_P, 1, BLOCK_R)


@triton.jit
def _staged_finalize(X, P1, P2, W, MEAN, RSTD, C1, C2, Q1, Q2, b_idx, g0, C, S, G, Cg, n_spans, stride_b, stride_c,
                     eps, span, BWD: tl.constexpr, HAS_W: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr):
    """Groups g0 .. g0 + BLOCK_G - 1 of sample b from their [spans, Cg] partials, read as
    [BLOCK_P, BLOCK_G, BLOCK_R] tiles (the finalize launch: one group, BLOCK_G = 1; the group axis and
    the volatile loads are what a finalize inside the stats launch needed, removed after 6c904fd:
    kept because they are the compiled kernel every measurement since session 8 ran). Forward (partials of x minus the group's first element): each
    tile's group mean and M2 (M2 = sum M2_j + sum n_j (mean_j - mean)^2: exact, no cancellation),
    Chan-merged over the tiles -> MEAN, RSTD, and the shifted mean -> C1. Backward: per channel the
    sums over the spans of g*xhat and g -> Q1, Q2 [B, C] (the weight gradients' per-sample partials:
    col_sum then adds B rows instead of B * spans), and c1 = sum w_c * Q1_c / L,
    c2 = sum w_c * Q2_c / L -> C1, C2."""
    p = tl.arange(0, BLOCK_P)[:, None, None]
    gi = g0 + tl.arange(0, BLOCK_G)
    r = tl.arange(0, BLOCK_R)
    g_mask = gi < G
    ch = gi[:, None] * Cg + r[None, :]  # [BLOCK_G, BLOCK_R]
    c_mask = g_mask[:, None] & (r < Cg)[None, :]
    L = Cg * S
    # 32-bit offsets inside a [BLOCK_P, C] slab of partial rows (registers: one per element)
    offs = p * C + ch[None, :, :]
    acc1 = tl.zeros([BLOCK_G, BLOCK_R], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_G, BLOCK_R], dtype=tl.float32)
    mean = tl.zeros([BLOCK_G], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_G], dtype=tl.float32)
    count = tl.zeros([BLOCK_G], dtype=tl.float32)
    for p0 in range(0, n_spans, BLOCK_P):
        mask = ((p0 + p) < n_spans) & c_mask[None, :, :]
        row = (b_idx * n_spans + p0).to(tl.int64) * C
        a1 = tl.load(P1 + row + offs, mask=mask, other=0.0, volatile=True)
        a2 = tl.load(P2 + row + offs, mask=mask, other=0.0, volatile=True)
        if BWD:
            acc1 += tl.sum(a1, axis=0)
            acc2 += tl.sum(a2, axis=0)
        else:  # every group has Cg channels of n_j elements in span j
            n_j = tl.minimum(tl.maximum(S - (p0 + p) * span, 0), span) * 1.0  # [BLOCK_P, 1, 1], 0 past the end
            n_t = tl.sum(n_j, axis=0) * Cg  # [1, 1]
            m_t = tl.sum(tl.sum(n_j * a1, axis=2), axis=0) / tl.reshape(n_t, [1])
            d = a1 - m_t[None, :, None]
            q_t = tl.sum(tl.sum(tl.where(mask, a2 + n_j * d * d, 0.0), axis=2), axis=0)
            mean, m2, count = _chan_merge(mean, m2, count, m_t, q_t, tl.reshape(n_t, [1]))
    grp = b_idx * G + gi
    if BWD:
        q1 = acc1
        q2 = acc2
        tl.store(Q1 + b_idx.to(tl.int64) * C + ch, q1, mask=c_mask)
        tl.store(Q2 + b_idx.to(tl.int64) * C + ch, q2, mask=c_mask)
        if HAS_W:
            w = tl.load(W + ch, mask=c_mask, other=0.0).to(tl.float32)
            q1 = q1 * w
            q2 = q2 * w
        tl.store(C1 + grp, tl.sum(q1, axis=1) / L, mask=g_mask)
        tl.store(C2 + grp, tl.sum(q2, axis=1) / L, mask=g_mask)
    else:
        shift = tl.load(X + b_idx.to(tl.int64) * stride_b + (gi * Cg).to(tl.int64) * stride_c, mask=g_mask,
                        other=0.0).to(tl.float32)
        tl.store(MEAN + grp, shift + mean, mask=g_mask)
        tl.store(C1 + grp, mean, mask=g_mask)  # the shifted mean, for apply: x - shift - mean keeps the digits
        tl.store(RSTD + grp, tl.rsqrt(m2 / L + eps), mask=g_mask)


@triton.jit
def group_norm_staged_apply_kernel(
    X, DY, Y, W, B, MEAN, RSTD, C1, C2, C, S, G, Cg, n_cb, n_sb, stride_b, stride_c, stride_s,
    BWD: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One tile per program, last tile first. Forward: Y = act(xhat * w + b) (C1: the shifted means);
    backward: Y (= dx) = rstd * (w*g - xhat * c1 - c2), with the group values gathered per channel."""
    last = tl.num_programs(0) - 1
    b_idx, kc, ks, offs, mask, ch, c_mask = _staged_tile(last - tl.program_id(0), C, S, n_cb, n_sb,
                                                         stride_b, stride_c, stride_s, BLOCK_C, BLOCK_S)
    grp = b_idx * G + ch // Cg
    mean = tl.load(MEAN + grp, mask=c_mask, other=0.0)[:, None]
    rstd = tl.load(RSTD + grp, mask=c_mask, other=0.0)[:, None]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if BWD:
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        xhat, _, wg = _gn_bwd_terms(x, dy, W, B, ch, c_mask, mask, mean, rstd, HAS_W, HAS_B, ACT)
        c1 = tl.load(C1 + grp, mask=c_mask, other=0.0)[:, None]
        c2 = tl.load(C2 + grp, mask=c_mask, other=0.0)[:, None]
        tl.store(Y + offs, ((wg - (xhat * c1 + c2)) * rstd).to(Y.dtype.element_ty), mask=mask)
    else:  # C1 holds the mean of x minus the group's first element
        shift = tl.load(X + b_idx.to(tl.int64) * stride_b + ((ch // Cg) * Cg).to(tl.int64) * stride_c,
                        mask=c_mask, other=0.0).to(tl.float32)[:, None]
        mean_s = tl.load(C1 + grp, mask=c_mask, other=0.0)[:, None]
        _store_y(Y, W, B, offs, mask, ch, c_mask, ((x - shift) - mean_s) * rstd, HAS_W, HAS_B, ACT)
