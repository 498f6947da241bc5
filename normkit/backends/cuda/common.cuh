// common.cuh: the small pieces every normkit CUDA kernel is built from.
//
//   * element <-> float conversions (all arithmetic is fp32),
//   * Pack<T, P>: P elements moved as one aligned vector (16 bytes at most per access),
//   * LOAD / STORE functors (OneFlow's design): a kernel reads rows through a LOAD and writes
//     them through a STORE, so an epilogue (affine, activation, cast) is a small functor and not
//     a copy of the kernel,
//   * the fused activations and their derivatives,
//   * reduction values (Welford, sum of squares, pairs of sums) and the warp/block all-reduces
//     that combine them in a fixed order, so every run gives the same bits.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace nk {

typedef long long i64;
constexpr int kWarpSize = 32;
// loops over a runtime number of packs issue this many loads before using any, so enough bytes
// are in flight to hide memory latency (a load-then-use loop waits a full round trip per pack)
constexpr int kBatch = 4;
constexpr unsigned kFullMask = 0xffffffffu;

template <bool C, typename A, typename B> struct Select { typedef A type; };
template <typename A, typename B> struct Select<false, A, B> { typedef B type; };

// ------------------------------------------------------------------ element conversions

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ------------------------------------------------------------------ packs

constexpr int pack_align(int bytes) { return bytes < 16 ? bytes : 16; }

// P elements that travel as one vector load/store (ld.global.v4 for 16 bytes). The host picks P
// so that every row start, row stride and parameter pointer is aligned to the pack.
template <typename T, int P>
struct alignas(pack_align(int(sizeof(T)) * P)) Pack {
  T v[P];
};

// Packs move as whole vectors (16 bytes at most per access). Copying a Pack of __half or
// __nv_bfloat16 member by member compiles to one 2-byte access per element (seen in SASS: 64
// STG.E.U16 per row step where 8 STG.E.128 do), so loads and stores go through these.
template <typename V, typename T, int P>
__device__ __forceinline__ void copy_words(Pack<T, P>* dst, const Pack<T, P>* src) {
#pragma unroll
  for (int i = 0; i < int(sizeof(Pack<T, P>) / sizeof(V)); ++i)
    reinterpret_cast<V*>(dst)[i] = reinterpret_cast<const V*>(src)[i];
}

template <typename T, int P>
__device__ __forceinline__ void copy_pack(Pack<T, P>* dst, const Pack<T, P>* src) {
  constexpr int bytes = int(sizeof(Pack<T, P>));
  if constexpr (bytes % 16 == 0) {
    copy_words<uint4>(dst, src);
  } else if constexpr (bytes == 8) {
    copy_words<uint2>(dst, src);
  } else if constexpr (bytes == 4) {
    copy_words<unsigned>(dst, src);
  } else {
    copy_words<unsigned short>(dst, src);
  }
}

template <int P, typename T>
__device__ __forceinline__ Pack<T, P> load_pack(const T* src) {
  Pack<T, P> p;
  copy_pack(&p, reinterpret_cast<const Pack<T, P>*>(src));
  return p;
}

template <int P, typename T>
__device__ __forceinline__ void pack_to_floats(const Pack<T, P>& p, float* out) {
#pragma unroll
  for (int i = 0; i < P; ++i) out[i] = to_float(p.v[i]);
}

template <int P, typename T>
__device__ __forceinline__ void load_floats(const T* src, float* out) {
  pack_to_floats<P>(load_pack<P>(src), out);
}

// element i of 32-bit words holding elements of the pointer's type (the first in the low half)
__device__ __forceinline__ float word_elem(const unsigned* u, int i, const float*) { return __uint_as_float(u[i]); }
__device__ __forceinline__ float word_elem(const unsigned* u, int i, const __nv_bfloat16*) {
  return __uint_as_float(i & 1 ? u[i >> 1] & 0xffff0000u : u[i >> 1] << 16);
}
__device__ __forceinline__ float word_elem(const unsigned* u, int i, const __half*) {
  return __half2float(__ushort_as_half((unsigned short)(i & 1 ? u[i >> 1] >> 16 : u[i >> 1] & 0xffffu)));
}

// P elements kept as 32-bit words (a Pack of 16-bit elements held across other work was spilled a half-word at a
// time), read back one element at a time by elem()
template <typename T, int P>
struct Words {
  static constexpr int N = int(sizeof(T)) * P / 4;
  static_assert(N >= 1 && int(sizeof(T)) * P % 4 == 0, "Words: whole 32-bit words");
  unsigned u[N];
  __device__ __forceinline__ void load(const T* src) {
    if constexpr (N % 4 == 0) {
#pragma unroll
      for (int i = 0; i < N / 4; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(src)[i];
        u[4 * i] = v.x, u[4 * i + 1] = v.y, u[4 * i + 2] = v.z, u[4 * i + 3] = v.w;
      }
    } else if constexpr (N == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(src);
      u[0] = v.x, u[1] = v.y;
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) u[i] = reinterpret_cast<const unsigned*>(src)[i];
    }
  }
  __device__ __forceinline__ float elem(int i) const { return word_elem(u, i, static_cast<const T*>(nullptr)); }
  __device__ __forceinline__ void fill(unsigned v) {
#pragma unroll
    for (int i = 0; i < N; ++i) u[i] = v;
  }
};

// Words of nothing: zeros (a parameter the caller never has)
struct NoWords {
  __device__ __forceinline__ float elem(int) const { return 0.f; }
  __device__ __forceinline__ void fill(unsigned) {}
  template <typename T> __device__ __forceinline__ void load(const T*) {}
};

// two values rounded to T (16 bits each) as one 32-bit word, the first in the low half
template <typename T> __device__ __forceinline__ unsigned round_pair(float a, float b);
template <> __device__ __forceinline__ unsigned round_pair<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned round_pair<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}

// Global memory only. The rounded values are gathered into 32-bit words and stored 16 bytes at a
// time: a Pack filled element by element was stored 2 or 4 bytes at a time.
template <int P, typename T>
__device__ __forceinline__ void store_floats(T* dst, const float* in) {
  constexpr int bytes = int(sizeof(T)) * P;
  if constexpr (bytes < 4) {
    dst[0] = from_float<T>(in[0]);
  } else {
    constexpr int W = bytes / 4;
    unsigned w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) {
      if constexpr (sizeof(T) == 4) {
        w[i] = __float_as_uint(in[i]);
      } else {
        w[i] = round_pair<T>(in[2 * i], in[2 * i + 1]);
      }
    }
    if constexpr (W % 4 == 0) {  // NVVM split a uint4 assignment into four 32-bit stores
#pragma unroll
      for (int j = 0; j < W / 4; ++j)
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(reinterpret_cast<uint4*>(dst) + j),
                     "r"(w[4 * j]), "r"(w[4 * j + 1]), "r"(w[4 * j + 2]), "r"(w[4 * j + 3]));
    } else if constexpr (W == 2) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    } else {
      *reinterpret_cast<unsigned*>(dst) = w[0];
    }
  }
}

// weight/bias are optional: a null pointer reads as the neutral value
template <int P, typename W>
__device__ __forceinline__ void load_param(const W* p, int col, float neutral, float* out) {
  if (p != nullptr) {
    load_floats<P>(p + col, out);
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i) out[i] = neutral;
  }
}

// ------------------------------------------------------------------ activations
// fwd(z) and grad(z) = d fwd / dz, with z = xhat * w + b (the affine output).

struct Identity {
  __device__ static float fwd(float z) { return z; }
  __device__ static float grad(float) { return 1.f; }
};

struct Relu {
  __device__ static float fwd(float z) { return (z > 0.f || z != z) ? z : 0.f; }  // NaN stays NaN
  __device__ static float grad(float z) { return z > 0.f ? 1.f : 0.f; }
};

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

struct Silu {
  __device__ static float fwd(float z) { return z * sigmoid(z); }
  __device__ static float grad(float z) {
    const float s = sigmoid(z);
    return s * (1.f + z * (1.f - s));
  }
};

struct Mish {  // z * tanh(softplus(z)); softplus(z) = z above 20, where log1p(exp(z)) == z in fp32
  __device__ static float softplus(float z) { return z > 20.f ? z : log1pf(expf(z)); }
  __device__ static float fwd(float z) { return z * tanhf(softplus(z)); }
  __device__ static float grad(float z) {
    const float t = tanhf(softplus(z));
    return t + z * (1.f - t * t) * sigmoid(z);
  }
};

struct Gelu {  // exact (erf) form
  __device__ static float fwd(float z) { return 0.5f * z * (1.f + erff(z * 0.70710678118654752f)); }
  __device__ static float grad(float z) {
    return 0.5f * (1.f + erff(z * 0.70710678118654752f)) + z * 0.39894228040143268f * expf(-0.5f * z * z);
  }
};

struct GeluTanh {  // the tanh approximation
  static constexpr float kK = 0.79788456080286536f;  // sqrt(2 / pi)
  static constexpr float kC = 0.044715f;
  __device__ static float fwd(float z) { return 0.5f * z * (1.f + tanhf(kK * (z + kC * z * z * z))); }
  __device__ static float grad(float z) {
    const float t = tanhf(kK * (z + kC * z * z * z));
    return 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * kK * (1.f + 3.f * kC * z * z);
  }
};

// ------------------------------------------------------------------ LOAD / STORE functors

// Rows of a matrix with unit column stride and any row stride, read as packs.
template <typename T>
struct RowLoad {
  const T* ptr;
  i64 stride;
  template <int P> __device__ __forceinline__ Pack<T, P> raw(i64 row, int col) const {
    return load_pack<P>(ptr + row * stride + col);
  }
  template <int P> __device__ __forceinline__ void load(float* out, i64 row, int col) const {
    load_floats<P>(ptr + row * stride + col, out);
  }
  __device__ __forceinline__ float first(i64 row) const { return to_float(ptr[row * stride]); }
};

// OneFlow's AffineStore plus an activation: y = act(xhat * w + b), rounded to T. BIAS false: b is never read
// (RMSNorm's cluster forward, whose host sends a bias elsewhere), so a pack's parameters ahead take half the registers.
template <typename T, typename W, typename ACT, bool BIAS = true>
struct AffineActStore {
  T* ptr;
  i64 stride;
  const W* w;
  const W* b;
  // A pack's parameters, loaded apart from its store so that a caller can fetch them ahead (row_cluster.cu's
  // forward), as 32-bit words: no bias is zeros, its neutral value
  template <int P> struct Params {
    Words<W, P> w;
    typename Select<BIAS, Words<W, P>, NoWords>::type b;
  };
  template <int P> __device__ __forceinline__ Params<P> params(i64, int col) const {
    Params<P> q;
    q.w.fill(0u);
    q.b.fill(0u);
    if (w != nullptr) q.w.load(w + col);
    if (BIAS && b != nullptr) q.b.load(b + col);
    return q;
  }
  template <int P> __device__ __forceinline__ void store(const float* xhat, i64 row, int col, const Params<P>& q) const {
    float y[P];
#pragma unroll
    for (int i = 0; i < P; ++i) y[i] = ACT::fwd(xhat[i] * (w != nullptr ? q.w.elem(i) : 1.f) + q.b.elem(i));
    store_floats<P>(ptr + row * stride + col, y);
  }
  template <int P> __device__ __forceinline__ void store(const float* xhat, i64 row, int col) const {
    float wv[P], bv[P], y[P];
    load_param<P>(w, col, 1.f, wv);
    load_param<P>(BIAS ? b : nullptr, col, 0.f, bv);
#pragma unroll
    for (int i = 0; i < P; ++i) y[i] = ACT::fwd(xhat[i] * wv[i] + bv[i]);
    store_floats<P>(ptr + row * stride + col, y);
  }
};

// ------------------------------------------------------------------ reduction values
// Each has zero() and merge(a, b); merge is applied in a fixed order by the all-reduces below.

// Welford's running (count, mean, M2). merge is Chan et al.'s parallel update: partial results of
// threads, warps and blocks combine without the E[x^2] - E[x]^2 cancellation.
struct Welford {
  float n, mean, m2;
  __device__ static Welford zero() { Welford r; r.n = 0.f; r.mean = 0.f; r.m2 = 0.f; return r; }
  __device__ __forceinline__ void push(float x) {
    n += 1.f;
    const float d = x - mean;
    mean += d / n;
    m2 += d * (x - mean);
  }
  // P values at once: their mean and M2 exactly (two passes over registers), then one Chan
  // merge, so a pack costs one division instead of P (the division chain is what limits a
  // value-by-value Welford loop, not memory)
  template <int P> __device__ __forceinline__ void push_pack(const float* v) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) s += v[i];
    Welford b;
    b.n = float(P);
    b.mean = s * (1.f / float(P));
    b.m2 = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const float d = v[i] - b.mean;
      b.m2 = fmaf(d, d, b.m2);
    }
    *this = merge(*this, b);
  }
  __device__ static Welford merge(const Welford& a, const Welford& b) {
    const float n = a.n + b.n;
    if (n == 0.f) return a;
    const float wb = b.n / n, d = b.mean - a.mean;
    Welford r;
    r.n = n;
    r.mean = a.mean + d * wb;
    r.m2 = a.m2 + b.m2 + d * d * a.n * wb;
    return r;
  }
};

// RMSNorm's statistic: the sum of squares (mean stays 0, so the normalize step is shared).
struct SumSq {
  float n, mean, m2;
  __device__ static SumSq zero() { SumSq r; r.n = 0.f; r.mean = 0.f; r.m2 = 0.f; return r; }
  __device__ __forceinline__ void push(float x) { n += 1.f; m2 += x * x; }
  template <int P> __device__ __forceinline__ void push_pack(const float* v) {
    n += float(P);
#pragma unroll
    for (int i = 0; i < P; ++i) m2 = fmaf(v[i], v[i], m2);
  }
  __device__ static SumSq merge(const SumSq& a, const SumSq& b) {
    SumSq r; r.n = a.n + b.n; r.mean = 0.f; r.m2 = a.m2 + b.m2; return r;
  }
};

// one plain sum (the forward's row sums when the row is held in registers)
struct Sum1 {
  float v;
  __device__ static Sum1 zero() { Sum1 r; r.v = 0.f; return r; }
  __device__ static Sum1 merge(const Sum1& x, const Sum1& y) { Sum1 r; r.v = x.v + y.v; return r; }
};

// two plain sums (the backward's row sums, the GroupNorm gradient sums)
struct Sum2 {
  float a, b;
  __device__ static Sum2 zero() { Sum2 r; r.a = 0.f; r.b = 0.f; return r; }
  __device__ static Sum2 merge(const Sum2& x, const Sum2& y) { Sum2 r; r.a = x.a + y.a; r.b = x.b + y.b; return r; }
};

// ------------------------------------------------------------------ all-reduces

// shuffle every float of a small struct
template <typename V> __device__ __forceinline__ V shfl_down_v(V v, int delta, int width) {
  float* f = reinterpret_cast<float*>(&v);
#pragma unroll
  for (int i = 0; i < int(sizeof(V) / sizeof(float)); ++i) f[i] = __shfl_down_sync(kFullMask, f[i], delta, width);
  return v;
}
template <typename V> __device__ __forceinline__ V shfl_v(V v, int src, int width) {
  float* f = reinterpret_cast<float*>(&v);
#pragma unroll
  for (int i = 0; i < int(sizeof(V) / sizeof(float)); ++i) f[i] = __shfl_sync(kFullMask, f[i], src, width);
  return v;
}

// All-reduce over aligned groups of WIDTH lanes (WIDTH a power of two <= 32): a tree down to the
// group's first lane, then a broadcast, so every lane holds the same bits. All 32 lanes must call.
template <int WIDTH, typename V>
__device__ __forceinline__ V group_allreduce(V v) {
#pragma unroll
  for (int d = WIDTH / 2; d > 0; d /= 2) v = V::merge(v, shfl_down_v(v, d, WIDTH));
  return shfl_v(v, 0, WIDTH);
}

// All-reduce over aligned groups of WIDTH threads of a block, WIDTH a power of two <= 1024 (a row
// held in the registers of one warp, of a fraction of one, or of several). Above a warp: each
// warp's total goes to scratch[warp], one barrier, and every thread merges its group's warp totals
// in the same order (every thread gets the same bits). scratch holds blockDim / 32 values and is
// used by one call per barrier: callers alternate two scratch arrays, so the barrier of the next
// call also orders this call's reads before the array is written again. Every thread of the block
// must call (above a warp).
template <int WIDTH, typename V>
__device__ __forceinline__ V row_allreduce(V v, V* scratch) {
  if constexpr (WIDTH <= kWarpSize) {
    return group_allreduce<WIDTH>(v);
  } else {
    constexpr int WARPS = WIDTH / kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    v = group_allreduce<kWarpSize>(v);
    if (threadIdx.x % kWarpSize == 0) scratch[warp] = v;
    __syncthreads();
    const V* mine = scratch + (warp / WARPS) * WARPS;
    V t = mine[0];
#pragma unroll
    for (int i = 1; i < WARPS; ++i) t = V::merge(t, mine[i]);
    return t;
  }
}

// All-reduce over the block: warps first, then the first warp over the per-warp results.
template <typename V>
__device__ V block_allreduce(V v) {
  __shared__ V warp_total[kWarpSize];
  __shared__ V total;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = group_allreduce<kWarpSize>(v);
  if (lane == 0) warp_total[warp] = v;
  __syncthreads();
  if (warp == 0) {
    V t = lane < int(blockDim.x / kWarpSize) ? warp_total[lane] : V::zero();
    t = group_allreduce<kWarpSize>(t);
    if (lane == 0) total = t;
  }
  __syncthreads();
  const V r = total;
  __syncthreads();  // a following call reuses warp_total / total
  return r;
}

// ------------------------------------------------------------------ row backward, per pack
// (g = dz * w, dz = dy * act'(z), z = xhat * w + b recomputed from x)

// One pack of the backward's elementwise part: xhat, and the gradients reaching z and xhat, from the pack's weight wv.
template <int P, typename W, typename ACT, bool RMS>
__device__ __forceinline__ void pack_grads_with(const float* wv, const W* b, int col, float mean, float rstd,
                                                const float* x, const float* dy, float* xhat, float* dz, float* g) {
  float bv[P];
  load_param<P>(b, col, 0.f, bv);  // dead (and removed) unless ACT needs z
#pragma unroll
  for (int i = 0; i < P; ++i) {
    xhat[i] = RMS ? x[i] * rstd : (x[i] - mean) * rstd;
    dz[i] = dy[i] * ACT::grad(xhat[i] * wv[i] + bv[i]);
    g[i] = dz[i] * wv[i];
  }
}

// ... with the pack's weight loaded here
template <int P, typename W, typename ACT, bool RMS>
__device__ __forceinline__ void pack_grads(const W* w, const W* b, int col, float mean, float rstd, const float* x,
                                           const float* dy, float* xhat, float* dz, float* g) {
  float wv[P];
  load_param<P>(w, col, 1.f, wv);
  pack_grads_with<P, W, ACT, RMS>(wv, b, col, mean, rstd, x, dy, xhat, dz, g);
}

// dx for one pack from the row sums s = (sum xhat*g, sum g)
template <int P, bool RMS>
__device__ __forceinline__ void pack_dx(const float* xhat, const float* g, Sum2 s, float inv_cols, float rstd,
                                        float* dx) {
  const float c1 = s.a * inv_cols, c2 = RMS ? 0.f : s.b * inv_cols;
#pragma unroll
  for (int i = 0; i < P; ++i) dx[i] = rstd * (g[i] - xhat[i] * c1 - c2);
}

}  // namespace nk
