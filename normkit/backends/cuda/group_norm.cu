// group_norm.cu: GroupNorm with a fused activation, forward and backward, for x viewed as
// [B, C, S] in either layout: NCHW (unit stride over S) or channels_last (unit stride over C).
// A group is C/G channels x S positions; y = act(xhat * w[c] + b[c]).
//
// Seed 004 fuses GroupNorm + Mish in one block per group, which leaves most of a big GPU idle
// when B * G is small. Here every step is spread over the whole tensor:
//
//   forward   gn_reduce<BWD=false>   per (batch, S-chunk, channel): Welford (mean, M2) of the
//                                    data shifted by the group's first element
//             gn_group<BWD=false>    per (batch, group): Chan-combine the chunks -> mean, rstd
//             gn_apply<BWD=false>    y = act(xhat * w + b), elementwise
//   backward  gn_reduce<BWD=true>    per (batch, S-chunk, channel): sum dz * xhat, sum dz
//                                    (dz = dy * act'(z), z recomputed from x)
//             gn_group<BWD=true>     per (batch, group): sum w * dz, sum w * dz * xhat
//             col_sum (row_norm.cu)  dweight, dbias: the per-channel partials, fixed order
//             gn_apply<BWD=true>     dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dz * w
//
// The partials live in [B * chunks, C] fp32 arrays; every combination runs in a fixed order.
#include "common.cuh"

namespace nk {

// gn_reduce: block (32, 8). The 32 x-lanes run along the unit-stride axis: S for NCHW (8
// channels per block, 32 lanes share a channel), C for channels_last (32 channels per block,
// 8 lanes share a channel). blockIdx.x = batch * chunks + chunk, blockIdx.y = channel tile.
template <typename T, typename W, typename ACT, bool CL, bool BWD>
__global__ void __launch_bounds__(256)
    gn_reduce(const T* __restrict__ x, i64 xB, i64 xC, i64 xS, const T* __restrict__ dy, i64 dB, i64 dC, i64 dS,
              const W* __restrict__ w, const W* __restrict__ b, const float* __restrict__ mean,
              const float* __restrict__ rstd, float* __restrict__ p1, float* __restrict__ p2, float* __restrict__ coef,
              int C, int S, int G, int chunk, int chunks) {
  typedef typename Select<BWD, Sum2, Welford>::type Acc;
  constexpr int KT = CL ? 32 : 8;  // channels per block
  constexpr int RT = CL ? 8 : 32;  // lanes sharing one channel, striding over S
  const int kept = CL ? threadIdx.x : threadIdx.y;
  const int lane = CL ? threadIdx.y : threadIdx.x;
  const int bi = blockIdx.x / chunks, ck = blockIdx.x % chunks;
  const int c = blockIdx.y * KT + kept;
  const int s0 = ck * chunk, s1 = min(S, s0 + chunk);
  Acc acc = Acc::zero();
  if (c < C) {
    const T* xc = x + bi * xB + c * xC;
    if constexpr (BWD) {
      const int grp = bi * G + c / (C / G);
      const float mu = mean[grp], rs = rstd[grp];
      const float wc = w != nullptr ? to_float(w[c]) : 1.f, bc = b != nullptr ? to_float(b[c]) : 0.f;
      const T* dyc = dy + bi * dB + c * dC;
      for (int s = s0 + lane; s < s1; s += kBatch * RT) {
        float xv[kBatch], dyv[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {  // loads first
          const int sk = s + k * RT;
          xv[k] = sk < s1 ? to_float(xc[sk * xS]) : 0.f;
          dyv[k] = sk < s1 ? to_float(dyc[sk * dS]) : 0.f;  // a missing element adds dz = 0
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const float xhat = (xv[k] - mu) * rs;
          const float dz = dyv[k] * ACT::grad(xhat * wc + bc);
          acc.a += dz * xhat;
          acc.b += dz;
        }
      }
    } else {
      // shifted data: the group's first element is subtracted (see row_norm.cu); its channel's
      // first chunk records it in coef[2 * group] for gn_group and gn_apply
      const int g = c / (C / G), c0 = g * (C / G);
      const float shift = to_float(x[bi * xB + c0 * xC]);
      int s = s0 + lane;
      for (; s + (kBatch - 1) * RT < s1; s += kBatch * RT) {  // whole batches: loads first
        float v[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) v[k] = to_float(xc[(s + k * RT) * xS]) - shift;
        acc.template push_pack<kBatch>(v);
      }
      for (; s < s1; s += RT) acc.push(to_float(xc[s * xS]) - shift);
      if (c == c0 && ck == 0 && lane == 0) coef[2 * (bi * G + g)] = shift;
    }
  }
  __shared__ Acc part[8][32];  // [threadIdx.y][threadIdx.x]
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (lane == 0 && c < C) {
    Acc t = Acc::zero();
    for (int r = 0; r < RT; ++r) t = Acc::merge(t, CL ? part[r][threadIdx.x] : part[threadIdx.y][r]);
    const i64 at = i64(blockIdx.x) * C + c;  // row (batch * chunks + chunk) of the [B * chunks, C] partials
    if constexpr (BWD) {
      p1[at] = t.a;
      p2[at] = t.b;
    } else {
      p1[at] = t.mean;
      p2[at] = t.m2;
    }
  }
}

// gn_group: a warp per (batch, group) combines the group's C/G channels x chunks partials.
//   forward: Chan-combine (mean, M2) with counts = chunk lengths -> mean, rstd; coef keeps
//            (shift, mean of the shifted data) for gn_apply.
//   backward: coef[2 * (b * G + g) + {0, 1}] = (sum_c w[c] * p2, sum_c w[c] * p1).
template <typename W, bool BWD>
__global__ void __launch_bounds__(128)
    gn_group(const float* __restrict__ p1, const float* __restrict__ p2, const W* __restrict__ w,
             float* __restrict__ mean, float* __restrict__ rstd, float* __restrict__ coef, int B, int C, int S,
             int G, int chunk, int chunks, float eps) {
  typedef typename Select<BWD, Sum2, Welford>::type Acc;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (warp >= B * G) return;  // whole warps leave together
  const int bi = warp / G, g = warp % G, cg = C / G;
  Acc acc = Acc::zero();
  for (int i = lane; i < chunks * cg; i += kWarpSize) {  // lanes stride over (chunk, channel)
    const int k = i / cg, c = g * cg + i % cg;
    const i64 at = (i64(bi) * chunks + k) * C + c;
    if constexpr (BWD) {
      const float wc = w != nullptr ? to_float(w[c]) : 1.f;
      Sum2 t;
      t.a = wc * p2[at];  // sum of g = dz * w
      t.b = wc * p1[at];  // sum of g * xhat
      acc = Sum2::merge(acc, t);
    } else {
      Welford t;
      t.n = float(min(chunk, S - k * chunk));
      t.mean = p1[at];
      t.m2 = p2[at];
      acc = Welford::merge(acc, t);
    }
  }
  acc = group_allreduce<kWarpSize>(acc);
  if (lane == 0) {
    if constexpr (BWD) {
      coef[2 * warp] = acc.a;
      coef[2 * warp + 1] = acc.b;
    } else {
      mean[warp] = coef[2 * warp] + acc.mean;  // shift + mean of the shifted data
      coef[2 * warp + 1] = acc.mean;
      rstd[warp] = rsqrtf(acc.m2 / acc.n + eps);
    }
  }
}

// gn_apply: the elementwise pass. x is walked as rows of its unit-stride axis: row = (batch, o)
// with o a channel (NCHW) or a position (channels_last); block (TX, TY) puts TY rows side by side.
template <typename T, typename W, typename ACT, bool CL, bool BWD>
__global__ void __launch_bounds__(256)
    gn_apply(const T* __restrict__ x, i64 xB, i64 xC, i64 xS, const T* __restrict__ dy, i64 dB, i64 dC, i64 dS,
             T* __restrict__ out, i64 oB, i64 oC, i64 oS, const W* __restrict__ w, const W* __restrict__ b,
             const float* __restrict__ mean, const float* __restrict__ rstd, const float* __restrict__ coef, int B,
             int C, int S, int G) {
  const int outer = CL ? S : C, inner = CL ? C : S, cg = C / G;
  const float inv_count = 1.f / (float(cg) * float(S));
  const i64 rows = i64(B) * outer;
  for (i64 row = i64(blockIdx.x) * blockDim.y + threadIdx.y; row < rows; row += i64(gridDim.x) * blockDim.y) {
    const int bi = int(row / outer), o = int(row % outer);
    for (int j0 = threadIdx.x; j0 < inner; j0 += kBatch * blockDim.x) {
      float xv[kBatch], dyv[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {  // loads first
        const int j = j0 + k * blockDim.x, c = CL ? j : o, s = CL ? o : j;
        if (j < inner) {
          xv[k] = to_float(x[bi * xB + c * xC + s * xS]);
          if (BWD) dyv[k] = to_float(dy[bi * dB + c * dC + s * dS]);
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int j = j0 + k * blockDim.x, c = CL ? j : o, s = CL ? o : j;
        if (j >= inner) continue;
        const int grp = bi * G + c / cg;
        const float wc = w != nullptr ? to_float(w[c]) : 1.f, bc = b != nullptr ? to_float(b[c]) : 0.f;
        const float rs = rstd[grp];
        // forward: from the shifted data (coef = shift, shifted mean); backward: from the saved mean
        const float xhat = BWD ? (xv[k] - mean[grp]) * rs : ((xv[k] - coef[2 * grp]) - coef[2 * grp + 1]) * rs;
        float v;
        if (BWD) {
          // g rounded by itself (__fmul_rn is never contracted): fused into the subtraction below,
          // an FMA would see w * dz unrounded, and one element per group (coef[2 * grp] = w * dz,
          // xhat = 0) would leave its rounding error times rs instead of dx = 0
          const float g = __fmul_rn(dyv[k] * ACT::grad(xhat * wc + bc), wc);
          v = rs * (g - (coef[2 * grp] + xhat * coef[2 * grp + 1]) * inv_count);
        } else {
          v = ACT::fwd(xhat * wc + bc);
        }
        out[bi * oB + c * oC + s * oS] = from_float<T>(v);
      }
    }
  }
}

}  // namespace nk
