// row_cluster.cu: LayerNorm and RMSNorm for Hopper (sm_90), forward and backward, for rows of any
// width up to 16 CTAs' worth, with no trip of the statistics through global memory.
//
// A row is cut into slices, one per CTA of a thread-block cluster (1..16 CTAs, launched with the
// cluster dimension attribute). The grid is persistent: cluster c walks rows c, c + clusters, ...
// and, since a CTA owns the same columns in every row, its threads keep per-column state (the
// weight-gradient sums) in registers. Per CTA:
//
//   * streaming: thread 0 keeps the next STAGES rows' slices in flight, each a 1D bulk copy (TMA)
//     into its own shared-memory stage that completes on that stage's mbarrier, so HBM reads run
//     ahead of the arithmetic and no register holds data before it is needed;
//   * statistics: each thread reads its packs of the stage once into registers; a sum is reduced
//     per warp (shuffles), then lanes 0..C-1 store the warp's sum into slot [rank, warp] of every
//     CTA of the cluster (distributed shared memory); one cluster barrier; then every warp adds
//     the C x WARPS sums in the same fixed order (the same bits in every CTA and every run);
//   * the first barrier also says every thread has read the stage, so thread 0 refills it with
//     the row STAGES ahead before the rest of the row's work.
//
// Partial slots alternate between two buffers by row parity: a CTA writes row i + 2's partials only
// after the barrier of row i + 1, which every CTA reaches after merging row i's.
//
// PUSH (issue 24, quack's exchange): no cluster barrier per row. Each warp's partial goes
// into every peer's slot by st.async, which completes bytes on that peer's exchange mbarrier (one
// per row parity, armed by its own thread 0 with the bytes it will receive); a CTA waits only for
// the bytes it needs, and no thread pays the release fence of barrier.cluster.arrive (session 14's
// ncu: 1.05 stall cycles per instruction in the barrier backward at 16K). The forward's grid is many
// clusters (about a row each) instead of one persistent wave, so other clusters' loads cover a
// cluster's wait; the backwards keep their persistent wave (their partials are per cluster or per
// sample, and a group per cluster measured slower). Parity reuse is safe: a peer pushes row i + 2
// only after this CTA pushed row i + 1, which it does after its warps merged row i's slots.
// LayerNorm then needs one exchange: each warp's (count, sum, squared deviations from the warp's
// mean), merged exactly (Chan) in a fixed order. RELOAD (forward): the passes read the stage again
// instead of holding the slice in registers (fewer registers: more CTAs per SM).
//
// LayerNorm statistics are two passes over the registers, each summed over the cluster: the mean
// of x shifted by the row's first element, then the squared deviations from it (no
// E[x^2] - E[x]^2). RMSNorm: one sum of squares. Backward:
// dx = rstd * (g - xhat * mean(xhat * g) - mean(g)) with the two row sums exchanged the same way;
// dweight/dbias accumulate per thread over its rows and each cluster writes one fp32
// partial row (rows = clusters) that col_sum (row_norm.cu) adds in a fixed order.
//
// The host (cluster.py) guarantees: cols and slice are multiples of the pack P (16 bytes of T), x,
// dy, y, dx and their row strides are 16-byte aligned, weight/bias 16-byte aligned, and
// slice <= THREADS * ITEMS * P.
#include "common.cuh"

namespace nk {
namespace cl {

constexpr int kMaxCluster = 16;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// the CTA's rank in its cluster, the cluster's size, the cluster's index and the number of clusters
#define NK_SPECIAL_REGISTER(fn, reg)                     \
  __device__ __forceinline__ unsigned fn() {            \
    unsigned r;                                         \
    asm volatile("mov.u32 %0, %%" reg ";" : "=r"(r));   \
    return r;                                           \
  }
NK_SPECIAL_REGISTER(special_ctarank, "cluster_ctarank")
NK_SPECIAL_REGISTER(special_nctarank, "cluster_nctarank")
NK_SPECIAL_REGISTER(special_clusterid, "clusterid.x")
NK_SPECIAL_REGISTER(special_nclusterid, "nclusterid.x")
#undef NK_SPECIAL_REGISTER

// every thread of every CTA of the cluster: arrive (release), then wait (acquire)
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
typedef unsigned long long Barrier;

// the address `local` has in CTA `rank` of the cluster
__device__ __forceinline__ unsigned remote_addr(const void* local, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(local)), "r"(rank));
  return remote;
}
// st.async of v to `local`'s address in CTA `rank`, completing 4 bytes on that CTA's barrier `bar`
__device__ __forceinline__ void push_remote(const float* local, const Barrier* bar, unsigned rank, float v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(
                   remote_addr(local, rank)),
               "f"(v), "r"(remote_addr(bar, rank))
               : "memory");
}
// store v at the address `local` has in CTA `rank` of the cluster
__device__ __forceinline__ void store_remote(const float* local, unsigned rank, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote_addr(local, rank)), "f"(v) : "memory");
}
// split cluster barrier: arrive once the barriers are initialized, wait before the first push
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

__device__ __forceinline__ void barrier_init(Barrier* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void barrier_expect(Barrier* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool barrier_try_wait(Barrier* bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void barrier_wait(Barrier* bar, unsigned parity) {
  while (!barrier_try_wait(bar, parity)) {
  }
}
// 1D bulk copy of `bytes` (a multiple of 16) from global memory into this CTA's shared memory
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, Barrier* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// generic-proxy reads of a stage are ordered before the async-proxy (bulk copy) writes that refill it
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Each stage holds ARRAYS slices (x; or x and dy), each padded to 128 bytes.
template <typename T>
__device__ __forceinline__ int stage_elems(int slice) {
  return (slice * int(sizeof(T)) + 127) / 128 * (128 / int(sizeof(T)));
}

// The CTA's place in its cluster and the slice it owns.
struct Slice {
  unsigned rank, size;
  i64 cluster, clusters;
  int c0, n;  // first column, columns (0 for a CTA past the row's end)
  __device__ Slice(int cols, int slice) {
    rank = special_ctarank();
    size = special_nctarank();
    cluster = special_clusterid();
    clusters = special_nclusterid();
    c0 = int(rank) * slice;
    n = cols - c0 < slice ? cols - c0 : slice;
    n = n > 0 ? n : 0;
  }
};

// Thread 0's producer: slices of row (cluster + it * clusters) of ARRAYS tensors into stage it % STAGES.
template <typename T, int STAGES, int ARRAYS>
struct Stream {
  T* base;
  Barrier* bars;
  int elems;  // per slice, padded
  __device__ T* slice_at(int stage, int array) const { return base + (stage * ARRAYS + array) * elems; }
  __device__ void issue(const Slice& s, i64 rows, int it, const T* a, i64 a_stride, const T* b, i64 b_stride) const {
    const i64 row = s.cluster + i64(it) * s.clusters;
    if (row >= rows || s.n == 0) return;
    const int st = it % STAGES;
    const unsigned bytes = unsigned(s.n) * sizeof(T);
    barrier_expect(&bars[st], bytes * ARRAYS);
    bulk_load(slice_at(st, 0), a + row * a_stride + s.c0, bytes, &bars[st]);
    if (ARRAYS > 1) bulk_load(slice_at(st, 1), b + row * b_stride + s.c0, bytes, &bars[st]);
  }
  // every thread: thread 0 sets up the stage barriers and issues the first STAGES rows
  __device__ void start(const Slice& s, i64 rows, const T* a, i64 a_stride, const T* b, i64 b_stride) const {
    if (threadIdx.x == 0) {
      for (int st = 0; st < STAGES; ++st) barrier_init(&bars[st], 1);
      barrier_init_fence();
      for (int it = 0; it < STAGES; ++it) issue(s, rows, it, a, a_stride, b, b_stride);
    }
    __syncthreads();
  }
  __device__ void wait(const Slice& s, int it) const {
    if (s.n > 0) barrier_wait(&bars[it % STAGES], unsigned(it / STAGES) & 1u);
  }
};

template <bool B, typename A, typename C> struct Pick { typedef A type; };
template <typename A, typename C> struct Pick<false, A, C> { typedef C type; };

// A warp's (count, sum, sum of squared deviations from the warp's own mean) of a LayerNorm row:
// the push exchange's one value per warp. Merged by merge_slots below, not pairwise.
struct Moments {
  float n, sum, m2;
};

// Every thread's merge of the `count` slots, in a fixed order (lane-strided, then shuffles): the
// same bits in every thread, CTA and run.
template <typename V>
__device__ __forceinline__ V merge_slots(const V* slots, int count) {
  V m = V::zero();
  for (int e = threadIdx.x % kWarpSize; e < count; e += kWarpSize) m = V::merge(m, slots[e]);
  return group_allreduce<kWarpSize>(m);
}
// Chan's exact merge in two steps: the total mean first, then each warp's M2 plus its count times
// its mean's squared distance from the total mean.
__device__ __forceinline__ Moments merge_slots(const Moments* slots, int count) {
  Sum2 t = Sum2::zero();  // (count, sum)
  for (int e = threadIdx.x % kWarpSize; e < count; e += kWarpSize) t = Sum2::merge(t, Sum2{slots[e].n, slots[e].sum});
  t = group_allreduce<kWarpSize>(t);
  const float mean = t.b / t.a;
  Sum1 m2 = Sum1::zero();
  for (int e = threadIdx.x % kWarpSize; e < count; e += kWarpSize) {
    const Moments& w = slots[e];
    const float d = w.n > 0.f ? w.sum / w.n - mean : 0.f;
    m2.v += w.m2 + w.n * d * d;
  }
  m2 = group_allreduce<kWarpSize>(m2);
  return Moments{t.a, t.b, m2.v};
}

// Exchange one warp-reduced value V (a struct of floats) with the cluster and merge all of them:
// this warp's value goes to slot [rank * WARPS + warp] of every CTA; returns the merge over the
// cluster, the same in every thread. PUSH: by st.async completing `bar` (this row parity's exchange
// barrier, waited at `phase`) in each CTA; else plain remote stores and a cluster barrier.
// MERGE: the CTA's warps' values are merged first (in `local`, one CTA barrier) and warp 0 sends the
// CTA's one value to slot [rank]: C values to merge per row instead of C x WARPS, and 1/WARPS of the
// remote stores. `local` is written again only after every CTA's warp 0 pushed (this CTA's included).
// exchange_send and exchange_take are its two halves, for a caller that works between them (the
// backward's OVERLAP: the next row's first pass while this row's values travel).
template <int WARPS, bool PUSH, bool MERGE = false, typename V>
__device__ __forceinline__ void exchange_send(const V& v, V* slots, Barrier* bar, const Slice& s, V* local = nullptr) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  constexpr int SENT = MERGE ? 1 : WARPS;  // values each CTA sends
  V mine = v;
  if (MERGE) {
    if (lane == 0) local[warp] = v;
    __syncthreads();
    if (warp == 0) mine = merge_slots(local, WARPS);
  }
  const float* slot = reinterpret_cast<const float*>(&slots[s.rank * SENT + (MERGE ? 0 : warp)]);
  if (PUSH && threadIdx.x == 0) barrier_expect(bar, s.size * SENT * unsigned(sizeof(V)));
  if ((!MERGE || warp == 0) && lane < int(s.size)) {
    const float* f = reinterpret_cast<const float*>(&mine);
#pragma unroll
    for (int i = 0; i < int(sizeof(V) / sizeof(float)); ++i) {
      if (PUSH) push_remote(slot + i, bar, lane, f[i]);
      else store_remote(slot + i, lane, f[i]);
    }
  }
}

template <int WARPS, bool PUSH, bool MERGE = false, typename V>
__device__ __forceinline__ V exchange_take(const V* slots, Barrier* bar, unsigned phase, const Slice& s) {
  if (PUSH) barrier_wait(bar, phase);
  else cluster_sync();
  return merge_slots(slots, int(s.size) * (MERGE ? 1 : WARPS));
}

template <int WARPS, bool PUSH, bool MERGE = false, typename V>
__device__ __forceinline__ V exchange(const V& v, V* slots, Barrier* bar, unsigned phase, const Slice& s,
                                      V* local = nullptr) {
  exchange_send<WARPS, PUSH, MERGE>(v, slots, bar, s, local);
  return exchange_take<WARPS, PUSH, MERGE, V>(slots, bar, phase, s);
}

// A value summed over the cluster for row `it` of this CTA's walk; slots (and, PUSH, the exchange
// barriers xbars) alternate by row parity. PUSH: the peers' barriers are initialised before anyone
// pushes, so the first row waits for the cluster arrive that followed their initialisation (issued
// by the caller after it initialised its own: cluster_arrive_relaxed); every later row waits on the
// exchange barrier alone. Else the barrier exchange.
template <int WARPS, bool MERGE = false, bool PUSH = false, typename V>
__device__ __forceinline__ V cluster_allreduce(V v, V (*slots)[kMaxCluster * WARPS], int it, const Slice& s,
                                               V* local = nullptr, Barrier* xbars = nullptr) {
  if (PUSH && it == 0) cluster_wait();
  return exchange<WARPS, PUSH, MERGE>(group_allreduce<kWarpSize>(v), slots[it & 1], PUSH ? &xbars[it & 1] : nullptr,
                                      unsigned(it >> 1) & 1u, s, local);
}

// This thread's packs of a stage, shifted, into registers (packs past the slice hold 0).
template <typename T, int THREADS, int ITEMS, int P>
__device__ __forceinline__ void load_slice(const T* src, int valid, float shift, float (&v)[ITEMS][P]) {
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    if (k < valid) {
      load_floats<P>(src + (threadIdx.x + k * THREADS) * P, v[k]);
#pragma unroll
      for (int i = 0; i < P; ++i) v[k][i] -= shift;
    } else {
#pragma unroll
      for (int i = 0; i < P; ++i) v[k][i] = 0.f;
    }
  }
}

// sum over this thread's packs (pack(k, f) fills pack k) of (f - center) or its square
template <int ITEMS, int P, typename PACK>
__device__ __forceinline__ float thread_sum(const PACK& pack, int valid, bool squares, float center = 0.f) {
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k)
    if (k < valid) {
      float f[P];
      pack(k, f);
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const float d = f[i] - center;
        s = squares ? fmaf(d, d, s) : s + d;
      }
    }
  return s;
}

}  // namespace cl

// ================================================================== forward

// The forward's body; OUT stores a normalized pack: out.store<P>(xhat, row, col). MERGE: one value
// per CTA in the exchange (see exchange). ONE_PASS (PUSH LayerNorm): a thread's moments from one
// read of its packs (each pack's sum and squared deviations from the pack's own mean, merged exactly
// (Chan) over the thread's packs, then the warp's) instead of a pass for the warp's mean and a second
// for the deviations from it: one read of the stage fewer, one warp reduction less on the row's path.
// OUT::Params<P> where the forward fetches parameters ahead (AHEAD > 0; OUT then has params() and a store taking them)
template <int AHEAD, typename OUT, int P> struct ParamsOf { typedef typename OUT::template Params<P> type; };
template <typename OUT, int P> struct ParamsOf<0, OUT, P> { typedef int type; };
template <typename T, bool RMS, int THREADS, int ITEMS, int STAGES, bool RELOAD, bool PUSH, bool MERGE,
          bool ONE_PASS, int AHEAD_MAX, bool HOLD, typename OUT>
__device__ __forceinline__ void fwd_cluster(const T* __restrict__ x, i64 x_stride, const OUT& out,
                                            float* __restrict__ mean, float* __restrict__ rstd, i64 rows, int cols,
                                            int slice, float eps) {
  constexpr int P = 16 / int(sizeof(T));
  constexpr int WARPS = THREADS / kWarpSize;
  // LayerNorm: two barrier exchanges of sums, or one push exchange of each warp's moments
  using Stat = typename cl::Pick<PUSH && !RMS, cl::Moments, Sum1>::type;
  constexpr int PASSES = RMS || PUSH ? 1 : 2;
  // packs whose parameters are in flight ahead of their stores
  constexpr int AHEAD = AHEAD_MAX < ITEMS ? AHEAD_MAX : ITEMS;
  using Prm = typename ParamsOf<AHEAD + int(HOLD), OUT, P>::type;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ cl::Barrier bars[STAGES];
  __shared__ cl::Barrier xbars[2];                                // PUSH: the exchange's, per row parity
  __shared__ Stat slots[PASSES][2][cl::kMaxCluster * WARPS];  // [pass][row parity][rank * WARPS + warp]
  __shared__ Stat local[MERGE ? WARPS : 1];                   // MERGE: the CTA's warps' values
  const cl::Slice s(cols, slice);
  const cl::Stream<T, STAGES, 1> stream{reinterpret_cast<T*>(smem), bars, cl::stage_elems<T>(slice)};
  const int tid = threadIdx.x;
  if (PUSH && tid == 0) {
    cl::barrier_init(&xbars[0], 1);
    cl::barrier_init(&xbars[1], 1);
  }
  stream.start(s, rows, x, x_stride, x, x_stride);  // its fence and __syncthreads cover xbars too
  if (PUSH) cl::cluster_arrive_relaxed();  // peers may push once every CTA has arrived
  // the next row's shift (its first element), loaded a row ahead so its latency is hidden
  float shift_next = (!RMS && s.cluster < rows) ? to_float(x[s.cluster * x_stride]) : 0.f;
  int valid = 0;  // this thread's packs inside the slice
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) valid += (tid + k * THREADS) * P < s.n ? 1 : 0;
  // HOLD: every pack's parameters loaded once, before the first row, and held over the rows the CTA takes (its
  // columns are the same every row: a persistent cluster reads them once instead of once a row)
  Prm held[HOLD ? ITEMS : 1];
  if constexpr (HOLD) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k)
      if (k < valid) held[k] = out.template params<P>(0, s.c0 + (tid + k * THREADS) * P);
  }
  int it = 0;
  for (i64 row = s.cluster; row < rows; row += s.clusters, ++it) {
    const float shift = shift_next;
    if (!RMS && row + s.clusters < rows) shift_next = to_float(x[(row + s.clusters) * x_stride]);
    stream.wait(s, it);
    const T* src = stream.slice_at(it % STAGES, 0);
    // this thread's packs, shifted: held in registers, or (RELOAD) read from the stage at each use
    float v[RELOAD ? 1 : ITEMS][P];
    if (!RELOAD) cl::load_slice<T, THREADS>(src, valid, shift, v);
    const auto pack = [&](int k, float(&f)[P]) {
      if (RELOAD) {
        load_floats<P>(src + (tid + k * THREADS) * P, f);
#pragma unroll
        for (int i = 0; i < P; ++i) f[i] -= shift;
      } else {
#pragma unroll
        for (int i = 0; i < P; ++i) f[i] = v[RELOAD ? 0 : k][i];
      }
    };
    // the first AHEAD packs' parameters, fetched before the row's sums: their latency (L2: every CTA of every row
    // reads them) hides behind the reduction and the exchange, and each later pack's is fetched AHEAD packs ahead
    Prm ahead[AHEAD > 0 ? AHEAD : 1];
    if constexpr (AHEAD > 0) {
#pragma unroll
      for (int k = 0; k < AHEAD; ++k)
        if (k < valid) ahead[k] = out.template params<P>(row, s.c0 + (tid + k * THREADS) * P);
    }
    float mu = 0.f, m2;
    if constexpr (PUSH) {
      if (it == 0) cl::cluster_wait();
      cl::Barrier* bar = &xbars[it & 1];
      const unsigned phase = unsigned(it >> 1) & 1u;
      if constexpr (RMS) {
        const Sum1 w = group_allreduce<kWarpSize>(Sum1{cl::thread_sum<ITEMS, P>(pack, valid, true)});
        m2 = cl::exchange<WARPS, true, MERGE>(w, slots[0][it & 1], bar, phase, s, local).v;
      } else {
        Sum2 t;
        Sum1 d;
        if constexpr (ONE_PASS) {
          float pmean[ITEMS], pm2[ITEMS], tsum = 0.f;
#pragma unroll
          for (int k = 0; k < ITEMS; ++k) {
            pmean[k] = pm2[k] = 0.f;
            if (k < valid) {
              float f[P], ps = 0.f, q = 0.f;
              pack(k, f);
#pragma unroll
              for (int i = 0; i < P; ++i) ps += f[i];
              pmean[k] = ps * (1.f / float(P));
#pragma unroll
              for (int i = 0; i < P; ++i) q = fmaf(f[i] - pmean[k], f[i] - pmean[k], q);
              pm2[k] = q;
              tsum += ps;
            }
          }
          const float tn = float(valid * P), tmean = valid > 0 ? tsum / tn : 0.f;
          float tm2 = 0.f;
#pragma unroll
          for (int k = 0; k < ITEMS; ++k)
            if (k < valid) tm2 += pm2[k] + float(P) * (pmean[k] - tmean) * (pmean[k] - tmean);
          t = group_allreduce<kWarpSize>(Sum2{tn, tsum});  // the warp's count and sum, then its M2
          const float dl = valid > 0 ? tmean - t.b / t.a : 0.f;
          d = group_allreduce<kWarpSize>(Sum1{tm2 + tn * dl * dl});
        } else {  // the warp's mean, then its squared deviations from it (exact two passes)
          t = group_allreduce<kWarpSize>(Sum2{float(valid * P), cl::thread_sum<ITEMS, P>(pack, valid, false)});
          const float wmean = t.a > 0.f ? t.b / t.a : 0.f;
          d = group_allreduce<kWarpSize>(Sum1{cl::thread_sum<ITEMS, P>(pack, valid, true, wmean)});
        }
        const cl::Moments m =
            cl::exchange<WARPS, true, MERGE>(cl::Moments{t.a, t.b, d.v}, slots[0][it & 1], bar, phase, s, local);
        mu = m.sum / float(cols);
        m2 = m.m2;
      }
    } else {
      // the sum (of squares for RMSNorm), then for LayerNorm the squared deviations from the mean;
      // each summed over the cluster
      m2 = cl::cluster_allreduce<WARPS, MERGE>(Sum1{cl::thread_sum<ITEMS, P>(pack, valid, RMS)}, slots[0], it, s,
                                               local).v;
      if (!RMS) {
        mu = m2 / float(cols);
        m2 = cl::cluster_allreduce<WARPS, MERGE>(Sum1{cl::thread_sum<ITEMS, P>(pack, valid, true, mu)},
                                                 slots[PASSES - 1], it, s, local).v;
      }
    }
    // every thread has read the stage (the exchange completed after every warp's first pass): refill it
    if (!RELOAD && tid == 0) {
      cl::fence_proxy_async();
      stream.issue(s, rows, it + STAGES, x, x_stride, x, x_stride);
    }
    const float r = rsqrtf(m2 / float(cols) + eps);
    if (s.rank == 0 && tid == 0) {
      if (rstd != nullptr) rstd[row] = r;
      if (!RMS && mean != nullptr) mean[row] = shift + mu;
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (k < valid) {
        float f[P];
        pack(k, f);
#pragma unroll
        for (int i = 0; i < P; ++i) f[i] = (f[i] - mu) * r;
        const int col = s.c0 + (tid + k * THREADS) * P;
        if constexpr (HOLD) {
          out.template store<P>(f, row, col, held[HOLD ? k : 0]);
        } else if constexpr (AHEAD > 0) {
          const Prm q = ahead[k % AHEAD];
          if (k + AHEAD < ITEMS && k + AHEAD < valid)
            ahead[k % AHEAD] = out.template params<P>(row, col + AHEAD * THREADS * P);
          out.template store<P>(f, row, col, q);
        } else {
          out.template store<P>(f, row, col);
        }
      }
    }
    if (RELOAD) {
      __syncthreads();  // every thread is done with the stage
      if (tid == 0) {
        cl::fence_proxy_async();
        stream.issue(s, rows, it + STAGES, x, x_stride, x, x_stride);
      }
    }
  }
}

// AHEAD: the packs whose weight and bias a thread fetches ahead of their stores (configs.py CLUSTER_FWD_PARAM_AHEAD):
// fetched next to its store each pack waits an L2 round trip, which showed in fp32 rows only (S26-1: 16-bit rows hid it).
// NK_PARAM_AHEAD (a define, for A/B runs through NORMKIT_CUDA_DEFINES) replaces it in every row forward.
// HOLD: the parameters held over a persistent cluster's rows (configs.py CLUSTER_FWD_HOLD); NK_FWD_HOLD (a define, for
// A/B runs) replaces it in every row forward
#ifdef NK_FWD_HOLD
#define NK_HOLD_FWD(plan) (NK_FWD_HOLD != 0)
#else
#define NK_HOLD_FWD(plan) (plan)
#endif
#ifdef NK_PARAM_AHEAD
#define NK_AHEAD(plan) NK_PARAM_AHEAD
#else
#define NK_AHEAD(plan) (plan)
#endif
// RELOAD kernels are compiled for SM_THREADS / THREADS CTAs per SM (registers capped to fit; configs.py
// CLUSTER_FWD_SM_THREADS), the others for one. NK_FWD_SM_THREADS (a define, for A/B runs through
// NORMKIT_CUDA_DEFINES) replaces SM_THREADS in every RELOAD forward.
#ifdef NK_FWD_SM_THREADS
#define NK_SM_THREADS(table) NK_FWD_SM_THREADS
#else
#define NK_SM_THREADS(table) (table)
#endif
template <typename T, typename W, typename ACT, bool RMS, int THREADS, int ITEMS, int STAGES, bool RELOAD, bool PUSH,
          bool MERGE = false, bool ONE_PASS = false, int SM_THREADS = 1024, int AHEAD = 0, bool HOLD = false>
__global__ void __launch_bounds__(THREADS, RELOAD ? NK_SM_THREADS(SM_THREADS) / THREADS : 1)
    row_fwd_cluster(const T* __restrict__ x, i64 x_stride, T* __restrict__ y, i64 y_stride, const W* __restrict__ w,
                    const W* __restrict__ b, float* __restrict__ mean, float* __restrict__ rstd, i64 rows, int cols,
                    int slice, float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  fwd_cluster<T, RMS, THREADS, ITEMS, STAGES, RELOAD, PUSH, MERGE, ONE_PASS, NK_AHEAD(AHEAD), NK_HOLD_FWD(HOLD)>(
      x, x_stride, AffineActStore<T, W, ACT, !RMS>{y, y_stride, w, b}, mean, rstd, rows, cols, slice, eps);
#endif
}

// ================================================================== backward

// RECOMPUTE: the dx step reads x and dy from the stage again and recomputes xhat and g instead of
// keeping them in registers (2 registers per element fewer: more CTAs per SM); the stage is then
// refilled after the dx step. MERGE: one value per CTA in the row sums' exchange (see exchange).
// PUSH: the row sums go to the peers by st.async onto a per-row-parity mbarrier (the forward's
// exchange) instead of remote stores and a cluster barrier; the grid stays one persistent wave (the
// weight-gradient partials are one row per cluster).
// OVERLAP (PUSH): two rows in flight. Row it's sums are sent, then row it + 1's first pass runs and
// its sums are sent, and only then does the CTA wait for row it's sums and take its dx step: the
// exchange's latency (and the wait for the cluster's slowest CTA) hides behind a row's first pass.
// Four slot buffers and exchange barriers, by row mod 4: a peer sends row it + 4 only after this CTA
// sent row it + 2, which it does after it took row it's sums (one buffer fewer would let a fast peer
// overwrite row it's slots before they are read). With RECOMPUTE rows it and it + 1 stay in their
// stages until their dx steps (STAGES >= 3: the next in flight); else the two rows' xhat and g are
// held in two register sets (the loop unrolled by two) and a row's stage is refilled once its sums
// are taken (STAGES >= 2).
// HOLD_W: the CTA's slice of the weight read once, before the first row, and held in registers (as words) for every
// row it takes (the CTAs are persistent: the same columns every row); else each pack's is read (L1 / L2) at each use.
// NK_BWD_HOLD_W (a define, for A/B runs) replaces it in every row backward.
#ifdef NK_BWD_HOLD_W
#define NK_HOLD(plan) NK_BWD_HOLD_W
#else
#define NK_HOLD(plan) (plan)
#endif
template <typename T, typename W, typename ACT, bool RMS, int THREADS, int ITEMS, int STAGES, bool PARAMS,
          bool RECOMPUTE, bool MERGE = false, bool PUSH = false, bool OVERLAP = false, bool HOLD_PLAN = false>
__global__ void __launch_bounds__(THREADS, 1)
    row_bwd_cluster(const T* __restrict__ dy, i64 dy_stride, const T* __restrict__ x, i64 x_stride,
                    const W* __restrict__ w, const W* __restrict__ b, const float* __restrict__ mean,
                    const float* __restrict__ rstd, T* __restrict__ dx, i64 dx_stride, float* __restrict__ dw_part,
                    float* __restrict__ db_part, i64 rows, int cols, int slice) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(!OVERLAP || (PUSH && STAGES >= (RECOMPUTE ? 3 : 2)), "OVERLAP needs PUSH and 2 stages (3: RECOMPUTE)");
  constexpr int P = 16 / int(sizeof(T));
  constexpr int WARPS = THREADS / kWarpSize;
  constexpr int ACC = PARAMS ? ITEMS : 1;
  constexpr int BUFS = OVERLAP ? 4 : 2;  // slot buffers and exchange barriers, by row (see OVERLAP)
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ cl::Barrier bars[STAGES];
  __shared__ Sum2 slots[BUFS][cl::kMaxCluster * WARPS];
  __shared__ Sum2 local[MERGE ? WARPS : 1];
  __shared__ cl::Barrier xbars[BUFS];  // PUSH: the exchange's, per slot buffer
  const cl::Slice s(cols, slice);
  const cl::Stream<T, STAGES, 2> stream{reinterpret_cast<T*>(smem), bars, cl::stage_elems<T>(slice)};
  const int tid = threadIdx.x;
  if (PUSH && tid == 0) {
    for (int i = 0; i < BUFS; ++i) cl::barrier_init(&xbars[i], 1);
  }
  stream.start(s, rows, x, x_stride, dy, dy_stride);  // its fence and __syncthreads cover xbars too
  if (PUSH) cl::cluster_arrive_relaxed();             // peers may push once every CTA has arrived
  const float inv_cols = 1.f / float(cols);
  int valid = 0;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) valid += (tid + k * THREADS) * P < s.n ? 1 : 0;
  float dw_acc[ACC][P], db_acc[ACC][P];
#pragma unroll
  for (int k = 0; k < ACC; ++k)
#pragma unroll
    for (int i = 0; i < P; ++i) dw_acc[k][i] = db_acc[k][i] = 0.f;
  // (a weight wider than x not in the RECOMPUTE kernels: at their 128-register cap, 256K bf16 rows with an fp32 weight
  // spilled under CUDA 13's ptxas)
  constexpr bool HOLD_W = NK_HOLD(HOLD_PLAN) && (sizeof(W) <= sizeof(T) || !RECOMPUTE);
  Words<W, P> w_held[HOLD_W ? ITEMS : 1];
  if constexpr (HOLD_W) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      w_held[k].fill(0u);
      if (w != nullptr && k < valid) w_held[k].load(w + s.c0 + (tid + k * THREADS) * P);
    }
  }
  // pack k's xhat, dz and g (its weight held, or read here)
  const auto grads = [&](int k, int col, float mu, float rs, const float* xv, const float* dyv, float* xhat, float* dz,
                         float* g) {
    if constexpr (HOLD_W) {
      float wv[P];
#pragma unroll
      for (int i = 0; i < P; ++i) wv[i] = w != nullptr ? w_held[HOLD_W ? k : 0].elem(i) : 1.f;
      pack_grads_with<P, W, ACT, RMS>(wv, b, col, mu, rs, xv, dyv, xhat, dz, g);
    } else {
      pack_grads<P, W, ACT, RMS>(w, b, col, mu, rs, xv, dyv, xhat, dz, g);
    }
  };
  constexpr int HELD = RECOMPUTE ? 1 : ITEMS;
  using Held = float[HELD][P];
  Held xhat_a, g_a, xhat_b, g_b;  // a row's xhat and g (b: OVERLAP's other row)
  // the first pass over row `it`'s stage: the row sums' partial (and the weight gradients'); xhat and g
  // kept unless RECOMPUTE
  auto first_pass = [&](int it, float mu, float rs, Held& xhat, Held& g) {
    const T* xs = stream.slice_at(it % STAGES, 0);
    const T* dys = stream.slice_at(it % STAGES, 1);
    Sum2 part = Sum2::zero();
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (k < valid) {
        const int p = tid + k * THREADS;
        const int h = RECOMPUTE ? 0 : k;
        float xv[P], dyv[P], dz[P];
        load_floats<P>(xs + p * P, xv);
        load_floats<P>(dys + p * P, dyv);
        grads(k, s.c0 + p * P, mu, rs, xv, dyv, xhat[h], dz, g[h]);
#pragma unroll
        for (int i = 0; i < P; ++i) {
          part.a = fmaf(xhat[h][i], g[h][i], part.a);
          part.b += g[h][i];
          if (PARAMS) {
            dw_acc[PARAMS ? k : 0][i] = fmaf(dz[i], xhat[h][i], dw_acc[PARAMS ? k : 0][i]);
            db_acc[PARAMS ? k : 0][i] += dz[i];
          }
        }
      }
    }
    return part;
  };
  // the dx step of row `it` (global row `row`) from the row sums
  auto dx_step = [&](int it, i64 row, float mu, float rs, const Sum2& sums, Held& xhat, Held& g) {
    const T* xs = stream.slice_at(it % STAGES, 0);
    const T* dys = stream.slice_at(it % STAGES, 1);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (k < valid) {
        const int p = tid + k * THREADS;
        const int h = RECOMPUTE ? 0 : k;
        if (RECOMPUTE) {
          float xv[P], dyv[P], dz[P];
          load_floats<P>(xs + p * P, xv);
          load_floats<P>(dys + p * P, dyv);
          grads(k, s.c0 + p * P, mu, rs, xv, dyv, xhat[h], dz, g[h]);
        }
        float d[P];
        pack_dx<P, RMS>(xhat[h], g[h], sums, inv_cols, rs, d);
        store_floats<P>(dx + row * dx_stride + s.c0 + p * P, d);
      }
    }
  };
  // row it + STAGES into row it's stage, once every thread is done with it: after the dx step (RECOMPUTE:
  // a CTA barrier), else once row it's sums are taken (every warp pushed its partial after its first pass)
  auto refill = [&](int it) {
    if (RECOMPUTE) __syncthreads();
    if (tid == 0) {
      cl::fence_proxy_async();
      stream.issue(s, rows, it + STAGES, x, x_stride, dy, dy_stride);
    }
  };
  if constexpr (OVERLAP) {
    auto send = [&](int it, const Sum2& part) {
      cl::exchange_send<WARPS, true, MERGE>(group_allreduce<kWarpSize>(part), slots[it % BUFS], &xbars[it % BUFS], s,
                                            local);
    };
    // the statistics of this row and the next (loaded a row before their first pass)
    float mu = 0.f, rs = 0.f, mu_next = 0.f, rs_next = 0.f;
    if (s.cluster < rows) {
      mu = RMS ? 0.f : mean[s.cluster];
      rs = rstd[s.cluster];
      if (s.cluster + s.clusters < rows) {
        mu_next = RMS ? 0.f : mean[s.cluster + s.clusters];
        rs_next = rstd[s.cluster + s.clusters];
      }
      stream.wait(s, 0);
      const Sum2 part = first_pass(0, mu, rs, xhat_a, g_a);
      cl::cluster_wait();  // the peers' exchange barriers are initialised
      send(0, part);
      if (MERGE) __syncthreads();  // warp 0 has read `local` before row 1's send writes it
    }
    // row it (its xhat and g in cur) and the next one's first pass (into next)
    auto step = [&](int it, i64 row, Held& xhat_cur, Held& g_cur, Held& xhat_next, Held& g_next) {
      const i64 next = row + s.clusters, after = next + s.clusters;
      if (next < rows) {
        stream.wait(s, it + 1);
        send(it + 1, first_pass(it + 1, mu_next, rs_next, xhat_next, g_next));
      }
      float mu_after = 0.f, rs_after = 0.f;
      if (after < rows) {
        mu_after = RMS ? 0.f : mean[after];
        rs_after = rstd[after];
      }
      const Sum2 sums = cl::exchange_take<WARPS, true, MERGE, Sum2>(slots[it % BUFS], &xbars[it % BUFS],
                                                                    unsigned(it / BUFS) & 1u, s);
      if (!RECOMPUTE) refill(it);
      dx_step(it, row, mu, rs, sums, xhat_cur, g_cur);
      if (RECOMPUTE) refill(it);
      mu = mu_next;
      rs = rs_next;
      mu_next = mu_after;
      rs_next = rs_after;
    };
    int it = 0;
    for (i64 row = s.cluster; row < rows; row += 2 * s.clusters, it += 2) {  // the register sets alternate
      step(it, row, xhat_a, g_a, xhat_b, g_b);
      if (row + s.clusters < rows) step(it + 1, row + s.clusters, xhat_b, g_b, xhat_a, g_a);
    }
  } else {
    // the next row's statistics, loaded a row ahead
    float mu_next = 0.f, rs_next = 0.f;
    if (s.cluster < rows) {
      mu_next = RMS ? 0.f : mean[s.cluster];
      rs_next = rstd[s.cluster];
    }
    int it = 0;
    for (i64 row = s.cluster; row < rows; row += s.clusters, ++it) {
      const float mu = mu_next, rs = rs_next;
      if (row + s.clusters < rows) {
        mu_next = RMS ? 0.f : mean[row + s.clusters];
        rs_next = rstd[row + s.clusters];
      }
      stream.wait(s, it);
      const Sum2 part = first_pass(it, mu, rs, xhat_a, g_a);
      const Sum2 sums = cl::cluster_allreduce<WARPS, MERGE, PUSH>(part, slots, it, s, local, xbars);
      if (!RECOMPUTE) refill(it);  // the exchange waited for every warp's first pass
      dx_step(it, row, mu, rs, sums, xhat_a, g_a);
      if (RECOMPUTE) refill(it);
    }
  }
  if (PARAMS) {  // partial row `cluster`: this CTA's columns
#pragma unroll
    for (int k = 0; k < ACC; ++k) {
      if (k < valid) {
        const i64 at = s.cluster * cols + s.c0 + (tid + k * THREADS) * P;
        if (dw_part != nullptr) store_floats<P>(dw_part + at, dw_acc[k]);
        if (db_part != nullptr) store_floats<P>(db_part + at, db_acc[k]);
      }
    }
  }
#endif
}

}  // namespace nk

// ================================================================== GroupNorm, NCHW (issue 24)
//
// A dense NCHW tensor's group (sample n, group g) is one contiguous run of Cg x S elements: a row
// of the kernels above, rows = B x G, cols = Cg x S. The cluster holds the group on chip and reads
// it once. What differs from LayerNorm is the affine (and its gradients): per channel,
// channel = (row % G) * Cg + col / S. The host guarantees S is a whole number of packs (a pack lies
// in one channel) and, for the weight gradients, that each CTA's slice is whole channels.
namespace nk {

// n / d for 0 <= n, n * d < 2^32, d >= 1 (a group's column by its positions: plan_gn_cluster keeps cols * spatial
// below that) as a multiply-high: the runtime integer division it replaces was ~20 instructions for each pack (and
// the forward's 64-bit row % G a call per pack). Runs S24-6 (H200): fp32 forward 0.48-0.69 -> 0.56-0.77 of copy,
// fp32 backward +0.01-0.05, the bf16 backward 0.34-0.57 -> 0.36-0.63
struct DivBy {
  unsigned m;  // ceil(2^32 / d): floor(n * m / 2^32) = floor(n / d) while n * d < 2^32
  __device__ explicit DivBy(int d) : m(0xffffffffu / unsigned(d) + 1u) {}
  __device__ __forceinline__ int operator()(int n) const { return int(__umulhi(unsigned(n), m)); }
};

// y = act(xhat * w[c] + b[c]), the channel's parameters for the whole pack
template <typename T, typename W, typename ACT>
struct GroupAffineActStore {
  T* ptr;
  const W* w;
  const W* b;
  int cols, groups, cg;  // cg: cols / spatial
  DivBy by_spatial;
  // (rows < 2^31: gn_why_not) a 32-bit remainder, the same for every pack of the row: computed once (a 64-bit one
  // was a call per pack)
  template <int P> __device__ __forceinline__ void store(const float* xhat, i64 row, int col) const {
    const int ch = int(unsigned(row) % unsigned(groups)) * cg + by_spatial(col);
    const float wv = w != nullptr ? to_float(w[ch]) : 1.f, bv = b != nullptr ? to_float(b[ch]) : 0.f;
    float y[P];
#pragma unroll
    for (int i = 0; i < P; ++i) y[i] = ACT::fwd(fmaf(xhat[i], wv, bv));
    store_floats<P>(ptr + row * i64(cols) + col, y);
  }
};

// The forward: fwd_cluster over the groups as rows (mean/rstd [B, G] are its per-row statistics).
template <typename T, typename W, typename ACT, int THREADS, int ITEMS, int STAGES, bool RELOAD, bool PUSH,
          bool MERGE = false, bool ONE_PASS = false>
__global__ void __launch_bounds__(THREADS, RELOAD ? 1024 / THREADS : 1)
    gn_fwd_cluster(const T* __restrict__ x, T* __restrict__ y, const W* __restrict__ w, const W* __restrict__ b,
                   float* __restrict__ mean, float* __restrict__ rstd, i64 rows, int cols, int slice, float eps,
                   int groups, int spatial) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // (no parameters ahead: run S26-2, NK_GN_AHEAD 1 / 2, bf16 0.01-0.06 slower, fp32 within 0.01)
  fwd_cluster<T, false, THREADS, ITEMS, STAGES, RELOAD, PUSH, MERGE, ONE_PASS, 0, false>(
      x, i64(cols), GroupAffineActStore<T, W, ACT>{y, w, b, cols, groups, cols / spatial, DivBy(spatial)}, mean, rstd,
      rows, cols, slice, eps);
#endif
}

// The backward: dx = rstd * (g - xhat * mean(xhat * g) - mean(g)) over the group, g = dz * w[c], the two
// group sums exchanged over the cluster (barrier or push exchange, slots by row parity). PARAMS: each (sample,
// channel)'s sums of dz * xhat and dz, written to row n of the [B, C] partials dw_part / db_part, which
// col_sum adds over the samples: a thread leaves each pack's two sums in shared memory, and after the
// exchange's barrier warp j adds channel j's packs of the slice in a fixed order (lane-strided, then
// shuffles): the same bits every run. Each CTA's slice is whole channels (the host's plan). PUSH: the group
// sums go to the peers by st.async onto a per-row-parity mbarrier (as row_bwd_cluster's PUSH), and a CTA
// barrier makes the pack sums visible instead of the cluster barrier.
template <typename T, typename W, typename ACT, int THREADS, int ITEMS, int STAGES, bool PARAMS, bool RECOMPUTE,
          bool PUSH = false>
__global__ void __launch_bounds__(THREADS, 1)
    gn_bwd_cluster(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
                   const W* __restrict__ b, const float* __restrict__ mean, const float* __restrict__ rstd,
                   T* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, i64 rows, int cols,
                   int slice, int groups, int spatial) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int P = 16 / int(sizeof(T));
  constexpr int WARPS = THREADS / kWarpSize;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ cl::Barrier bars[STAGES];
  __shared__ Sum2 slots[2][cl::kMaxCluster * WARPS];
  __shared__ Sum2 pack_sums[PARAMS ? THREADS * ITEMS : 1];  // PARAMS: (sum dz * xhat, sum dz) per pack
  __shared__ cl::Barrier xbars[2];                          // PUSH: the exchange's, per row parity
  const cl::Slice s(cols, slice);
  const cl::Stream<T, STAGES, 2> stream{reinterpret_cast<T*>(smem), bars, cl::stage_elems<T>(slice)};
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int cg = cols / spatial, packs_per_channel = spatial / P;
  const DivBy by_spatial(spatial);
  if (PUSH && tid == 0) {
    cl::barrier_init(&xbars[0], 1);
    cl::barrier_init(&xbars[1], 1);
  }
  stream.start(s, rows, x, i64(cols), dy, i64(cols));  // its fence and __syncthreads cover xbars too
  if (PUSH) cl::cluster_arrive_relaxed();               // peers may push once every CTA has arrived
  const float inv_cols = 1.f / float(cols);
  int valid = 0;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) valid += (tid + k * THREADS) * P < s.n ? 1 : 0;
  float mu_next = 0.f, rs_next = 0.f;
  if (s.cluster < rows) {
    mu_next = mean[s.cluster];
    rs_next = rstd[s.cluster];
  }
  int it = 0;
  for (i64 row = s.cluster; row < rows; row += s.clusters, ++it) {
    const float mu = mu_next, rs = rs_next;
    if (row + s.clusters < rows) {
      mu_next = mean[row + s.clusters];
      rs_next = rstd[row + s.clusters];
    }
    const int gbase = int(row % groups) * cg;  // the group's first channel
    stream.wait(s, it);
    const T* xs = stream.slice_at(it % STAGES, 0);
    const T* dys = stream.slice_at(it % STAGES, 1);
    constexpr int HELD = RECOMPUTE ? 1 : ITEMS;
    float xhat[HELD][P], g[HELD][P];
    // one pack's xhat and g (and dz), its channel's parameters read once
    const auto grads = [&](int p, float(&xh)[P], float(&gg)[P], float(&dz)[P]) {
      const int ch = gbase + by_spatial(s.c0 + p * P);
      const float wv = w != nullptr ? to_float(w[ch]) : 1.f, bv = b != nullptr ? to_float(b[ch]) : 0.f;
      float xv[P], dyv[P];
      load_floats<P>(xs + p * P, xv);
      load_floats<P>(dys + p * P, dyv);
#pragma unroll
      for (int i = 0; i < P; ++i) {
        xh[i] = (xv[i] - mu) * rs;
        dz[i] = dyv[i] * ACT::grad(fmaf(xh[i], wv, bv));
        gg[i] = dz[i] * wv;
      }
    };
    Sum2 part = Sum2::zero();
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (k < valid) {
        const int p = tid + k * THREADS, h = RECOMPUTE ? 0 : k;
        float dz[P];
        grads(p, xhat[h], g[h], dz);
        Sum2 q = Sum2::zero();
#pragma unroll
        for (int i = 0; i < P; ++i) {
          part.a = fmaf(xhat[h][i], g[h][i], part.a);
          part.b += g[h][i];
          q.a = fmaf(dz[i], xhat[h][i], q.a);
          q.b += dz[i];
        }
        if (PARAMS) pack_sums[p] = q;
      }
    }
    // the cluster barrier of the exchange also makes every pack's sums visible to the CTA (PUSH: a CTA barrier)
    const Sum2 sums = cl::cluster_allreduce<WARPS, false, PUSH>(part, slots, it, s, static_cast<Sum2*>(nullptr), xbars);
    if (PUSH && PARAMS) __syncthreads();
    if (!RECOMPUTE && tid == 0) {
      cl::fence_proxy_async();
      stream.issue(s, rows, it + STAGES, x, i64(cols), dy, i64(cols));
    }
    if (PARAMS) {
      const int channels = s.n / spatial, ch0 = gbase + s.c0 / spatial;  // the slice's channels (whole)
      const i64 n_at = (row / groups) * i64(groups) * cg;                // row n of the [B, C] partials
      for (int c = warp; c < channels; c += WARPS) {
        Sum2 t = Sum2::zero();
        for (int e = lane; e < packs_per_channel; e += kWarpSize) t = Sum2::merge(t, pack_sums[c * packs_per_channel + e]);
        t = group_allreduce<kWarpSize>(t);
        if (lane == 0) {
          if (dw_part != nullptr) dw_part[n_at + ch0 + c] = t.a;
          if (db_part != nullptr) db_part[n_at + ch0 + c] = t.b;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (k < valid) {
        const int p = tid + k * THREADS, h = RECOMPUTE ? 0 : k;
        if (RECOMPUTE) {
          float dz[P];
          grads(p, xhat[h], g[h], dz);
        }
        float d[P];
        pack_dx<P, false>(xhat[h], g[h], sums, inv_cols, rs, d);
        store_floats<P>(dx + row * i64(cols) + s.c0 + p * P, d);
      }
    }
    if (RECOMPUTE || PARAMS) {
      __syncthreads();  // every thread is done with the stage (RECOMPUTE) and with pack_sums (PARAMS)
      if (RECOMPUTE && tid == 0) {
        cl::fence_proxy_async();
        stream.issue(s, rows, it + STAGES, x, i64(cols), dy, i64(cols));
      }
    }
  }
#endif
}

}  // namespace nk

// ================================================================== GroupNorm, channels_last (issue 24)
//
// x is [B, S, C] in memory: a group is S runs of Cg channels, 20-80 bytes each, C apart. A cluster
// takes one (sample n, channel block of K = whole groups) slab, [S, K], each position's K channels
// one contiguous run (the host picks K so the runs are whole 16-byte packs, 64 bytes or more where
// whole groups allow); its CTAs split the positions, and each holds its [slice, K] tile(s) in shared
// memory: x (and dy) read from HBM once (cp.async, 16 bytes a thread, every load in flight). Thread
// (ty, px) owns pack px of each position's run (P fixed channels: their parameters and group
// statistics stay in registers) at positions ty, ty + TY, ..., and reads only the packs it loaded
// itself: the first pass runs on each chunk of its loads as it lands (cp.async groups), while the
// rest are in flight. Sums: per thread and channel into shared memory, added in a fixed order (per
// group by one warp; per channel in the backward), then over the cluster's CTAs (each CTA's partials
// stored into every CTA's slots, one cluster barrier, added in rank order): the same bits in every
// CTA and run.
// Forward: LayerNorm's exact two passes over the group, on x shifted by the group's first element
// (offsets of 1e4 keep their precision). Backward: one pass for each channel's sums of dz * xhat and
// dz (the sample's weight-gradient partials, [B, C], that col_sum adds over samples); the group's
// sums of g * xhat and g (g = dz * w) follow from them, then dx.
namespace nk {
namespace cl {
constexpr int kMaxClGroups = 16;  // groups per channel block
constexpr int kClChunks = 4;      // cp.async groups a thread's loads are issued in

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// wait until at most `pending` of this thread's cp.async groups are in flight (0..kClChunks - 1)
__device__ __forceinline__ void cp_async_wait(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
  }
}
static_assert(kClChunks <= 4, "cp_async_wait covers 4 groups");

// The CTA's part of a channels_last slab and its thread's place in it.
template <typename T>
struct ClSlab {
  static constexpr int P = 16 / int(sizeof(T));
  unsigned rank, size;
  int n, cb, block_c, vpp, ty_count, gpb, ty, px, s0, ns, iters;
  bool active;  // the thread owns a pack column (ty < ty_count)
  i64 base;     // the offset of (n, position s0, the block's channel 0)
  int C;
  __device__ ClSlab(int C_, int S, int cg, int block_c_, int slice, int threads) : C(C_) {
    rank = special_ctarank();
    size = special_nctarank();
    const int blocks = C / block_c_, slab = int(special_clusterid());
    n = slab / blocks;
    cb = slab % blocks;
    block_c = block_c_;
    vpp = block_c / P;
    ty_count = threads / vpp;
    gpb = block_c / cg;
    ty = int(threadIdx.x) / vpp;
    px = int(threadIdx.x) % vpp;
    active = ty < ty_count;
    s0 = int(rank) * slice;
    ns = max(0, min(slice, S - s0));
    iters = active && ns > ty ? (ns - ty + ty_count - 1) / ty_count : 0;  // this thread's positions
    base = (i64(n) * S + s0) * C + i64(cb) * block_c;
  }
  __device__ int position(int k) const { return ty + k * ty_count; }  // this thread's k-th position
  __device__ int tile_at(int p) const { return (p * vpp + px) * P; }   // its pack of position p in a tile
  __device__ i64 global_at(int p) const { return base + i64(p) * C + px * P; }
  __device__ int chunk_end(int j) const { return iters * (j + 1) / kClChunks; }
  // this thread's packs of ARRAYS tensors into their tiles, in kClChunks cp.async groups
  template <int ARRAYS>
  __device__ void load(T* const (&tiles)[ARRAYS], const T* const (&src)[ARRAYS]) const {
    int k = 0;
    for (int j = 0; j < kClChunks; ++j) {
      for (; k < chunk_end(j); ++k) {
        const int p = position(k);
#pragma unroll
        for (int a = 0; a < ARRAYS; ++a) cp_async16(tiles[a] + tile_at(p), src[a] + global_at(p));
      }
      cp_async_commit();
    }
  }
  // f(k) over this thread's positions, each chunk once its loads have landed (first pass)
  template <typename F>
  __device__ void each_as_landed(const F& f) const {
    int k = 0;
    for (int j = 0; j < kClChunks; ++j) {
      cp_async_wait(kClChunks - 1 - j);
      for (; k < chunk_end(j); ++k) f(position(k));
    }
  }
};

// a thread's P per-channel partials into its row of the partials: 16-byte stores (the compiler, not knowing the row's
// alignment, stored them a word at a time: threads 8 words apart, 8-way bank conflicts). dst is 16-byte aligned.
template <int P>
__device__ __forceinline__ void store_partials(float* dst, const float (&v)[P]) {
  static_assert(P % 4 == 0, "whole float4s");
#pragma unroll
  for (int j = 0; j < P / 4; ++j)  // as asm: the fp32 kernel's float4 assignment was split into words again
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(smem_u32(dst + 4 * j)), "f"(v[4 * j]),
                 "f"(v[4 * j + 1]), "f"(v[4 * j + 2]), "f"(v[4 * j + 3])
                 : "memory");
}

// each channel's sum over ty: out[c] = sum over r < rows of red[r * stride + c] (warp c % WARPS,
// lane-strided, then shuffles): a fixed order
template <int WARPS>
__device__ __forceinline__ void channel_sums(const float* red, int stride, int rows, int block_c, float* out) {
  for (int c = int(threadIdx.x) / kWarpSize; c < block_c; c += WARPS) {
    Sum1 t{0.f};
    for (int r = int(threadIdx.x) % kWarpSize; r < rows; r += kWarpSize) t.v += red[r * stride + c];
    t = group_allreduce<kWarpSize>(t);
    if (threadIdx.x % kWarpSize == 0) out[c] = t.v;
  }
}

// each group's sum over ty and its cg channels (warp g % WARPS; each lane its channels c = lane, lane + 32, ... summed
// over ty in order, then shuffles: a fixed order), stored by lane 0 into slot [rank * gpb + g] of every CTA of the
// cluster. No division per element: session 13's lane-strided walk over (ty, channel) divided by cg for each one,
// twice a forward on the path between a CTA's loads and its stores (with y as one FMA, runs S24-4 / S24-5: the bf16
// forward 0.32 -> 0.35 of copy at 16x640x32x32, 0.21 -> 0.24 at 8x640x32x32, fp32 0.50-0.51 -> 0.55)
template <int WARPS>
__device__ __forceinline__ void group_sums_to_cluster(const float* red, int block_c, int rows, int cg, int gpb,
                                                      float* slots, unsigned rank, unsigned size) {
  for (int g = int(threadIdx.x) / kWarpSize; g < gpb; g += WARPS) {
    Sum1 t{0.f};
    for (int c = int(threadIdx.x) % kWarpSize; c < cg; c += kWarpSize) {
      const float* col = red + g * cg + c;
      for (int r = 0; r < rows; ++r) t.v += col[r * block_c];
    }
    t = group_allreduce<kWarpSize>(t);
    if (threadIdx.x % kWarpSize == 0)
      for (unsigned r = 0; r < size; ++r) store_remote(&slots[rank * gpb + g], r, t.v);
  }
}

// slot i's sum over the cluster's CTAs, in rank order (after the cluster barrier that follows the stores)
__device__ __forceinline__ float slot_total(const float* slots, int i, int count, unsigned size) {
  float t = 0.f;
  for (unsigned r = 0; r < size; ++r) t += slots[r * count + i];
  return t;
}
}  // namespace cl

template <typename T, typename W, typename ACT, int THREADS>
__global__ void __launch_bounds__(THREADS, 1)
    gn_cl_fwd_cluster(const T* __restrict__ x, T* __restrict__ y, const W* __restrict__ w, const W* __restrict__ b,
                      float* __restrict__ mean, float* __restrict__ rstd, int C, int S, int cg, int block_c,
                      int slice, float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int P = 16 / int(sizeof(T));
  constexpr int WARPS = THREADS / kWarpSize;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float slots[2][cl::kMaxCluster * cl::kMaxClGroups];  // [pass][rank * gpb + group]
  __shared__ float gstat[3][cl::kMaxClGroups];                     // per group: shift, mean (shifted), rstd
  const cl::ClSlab<T> s(C, S, cg, block_c, slice, THREADS);
  const int tid = threadIdx.x;
  T* tile = reinterpret_cast<T*>(smem);  // [slice, block_c]
  float* red = reinterpret_cast<float*>(smem + (i64(slice) * block_c * int(sizeof(T)) + 15) / 16 * 16);
  {
    T* const tiles[1] = {tile};
    const T* const srcs[1] = {x};
    s.load<1>(tiles, srcs);
  }
  const i64 first = i64(s.n) * S * C + i64(s.cb) * block_c;  // (n, position 0, the block's channel 0)
  if (tid < s.gpb) gstat[0][tid] = to_float(x[first + tid * cg]);  // the group's shift: its first element
  cl::cluster_arrive_relaxed();  // peers may store into this CTA's slots once every CTA has arrived
  __syncthreads();
  float sh[P], mu[P], acc[P];  // this thread's channels' group shifts, (shifted) means, sums
#pragma unroll
  for (int i = 0; i < P; ++i) {
    sh[i] = gstat[0][(s.px * P + i) / cg];
    mu[i] = acc[i] = 0.f;
  }
  // pass 0, on each chunk of this thread's loads as it lands: the sums of x - shift
  s.each_as_landed([&](int p) {
    float f[P];
    load_floats<P>(tile + s.tile_at(p), f);
#pragma unroll
    for (int i = 0; i < P; ++i) acc[i] += f[i] - sh[i];
  });
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {  // the squared deviations from the group's mean
#pragma unroll
      for (int i = 0; i < P; ++i) acc[i] = 0.f;
      for (int k = 0; k < s.iters; ++k) {
        float f[P];
        load_floats<P>(tile + s.tile_at(s.position(k)), f);
#pragma unroll
        for (int i = 0; i < P; ++i) {
          const float d = (f[i] - sh[i]) - mu[i];
          acc[i] = fmaf(d, d, acc[i]);
        }
      }
    }
    if (s.active) cl::store_partials<P>(red + s.ty * block_c + s.px * P, acc);
    __syncthreads();
    if (pass == 0) cl::cluster_wait();
    cl::group_sums_to_cluster<WARPS>(red, block_c, s.ty_count, cg, s.gpb, slots[pass], s.rank, s.size);
    cl::cluster_sync();
    if (tid < s.gpb) {
      const float t = cl::slot_total(slots[pass], tid, s.gpb, s.size), count = float(cg) * float(S);
      if (pass == 0) gstat[1][tid] = t / count;
      else gstat[2][tid] = rsqrtf(t / count + eps);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < P; ++i) mu[i] = gstat[1][(s.px * P + i) / cg];
  }
  if (s.rank == 0 && tid < s.gpb) {
    const int g = s.n * (C / cg) + s.cb * s.gpb + tid;
    if (mean != nullptr) mean[g] = gstat[0][tid] + gstat[1][tid];
    if (rstd != nullptr) rstd[g] = gstat[2][tid];
  }
  if (!s.active) return;
  // y = ((x - shift) - mean) * rstd * w + b as one FMA on x - shift: a = rstd * w, c = b - mean * a (the mean is of
  // values shifted by the group's first element: a few standard deviations at most, so c loses no digits y keeps)
  float sa[P], sc[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int c = s.cb * block_c + s.px * P + i;
    const float rs = gstat[2][(s.px * P + i) / cg];
    const float wv = w != nullptr ? to_float(w[c]) : 1.f, bv = b != nullptr ? to_float(b[c]) : 0.f;
    sa[i] = rs * wv;
    sc[i] = fmaf(-mu[i], sa[i], bv);
  }
  for (int k = 0; k < s.iters; ++k) {
    const int p = s.position(k);
    float f[P];
    load_floats<P>(tile + s.tile_at(p), f);
#pragma unroll
    for (int i = 0; i < P; ++i) f[i] = ACT::fwd(fmaf(f[i] - sh[i], sa[i], sc[i]));
    store_floats<P>(y + s.global_at(p), f);
  }
#endif
}

// The backward. Dynamic shared memory: the x and dy tiles, the per-thread partials [2][TY][K], the
// per-channel sums [2][K], the cluster's slots [size][2K]. PARAMS: rank 0 writes the sample's
// per-channel sums of dz * xhat and dz to dw_part / db_part [B, C].
template <typename T, typename W, typename ACT, int THREADS, bool PARAMS>
__global__ void __launch_bounds__(THREADS, 1)
    gn_cl_bwd_cluster(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
                      const W* __restrict__ b, const float* __restrict__ mean, const float* __restrict__ rstd,
                      T* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, int C, int S,
                      int cg, int block_c, int slice) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int P = 16 / int(sizeof(T));
  constexpr int WARPS = THREADS / kWarpSize;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float gsum[2][cl::kMaxClGroups];  // per group: sum of g * xhat, sum of g
  const cl::ClSlab<T> s(C, S, cg, block_c, slice, THREADS);
  const int tid = threadIdx.x;
  const int tile_elems = (slice * block_c * int(sizeof(T)) + 15) / 16 * 16 / int(sizeof(T));
  T* xt = reinterpret_cast<T*>(smem);
  T* dyt = xt + tile_elems;
  float* red = reinterpret_cast<float*>(dyt + tile_elems);  // [2][ty_count][block_c]
  float* chsum = red + 2 * s.ty_count * block_c;             // [2][block_c]
  float* slots = chsum + 2 * block_c;                        // [size][2 * block_c]
  {
    T* const tiles[2] = {xt, dyt};
    const T* const srcs[2] = {x, dy};
    s.load<2>(tiles, srcs);
  }
  cl::cluster_arrive_relaxed();
  // this thread's channels: their group's statistics and their parameters
  const int g0 = s.n * (C / cg) + s.cb * s.gpb;
  float mu[P], rs[P], wv[P], bv[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int cl_ = s.px * P + i, c = s.cb * block_c + cl_;
    mu[i] = s.active ? mean[g0 + cl_ / cg] : 0.f;
    rs[i] = s.active ? rstd[g0 + cl_ / cg] : 0.f;
    wv[i] = w != nullptr && s.active ? to_float(w[c]) : 1.f;
    bv[i] = b != nullptr && s.active ? to_float(b[c]) : 0.f;
  }
  // one pack's xhat, dz
  const auto grads = [&](int p, float(&xh)[P], float(&dz)[P]) {
    float xv[P], dyv[P];
    load_floats<P>(xt + s.tile_at(p), xv);
    load_floats<P>(dyt + s.tile_at(p), dyv);
#pragma unroll
    for (int i = 0; i < P; ++i) {
      xh[i] = (xv[i] - mu[i]) * rs[i];
      dz[i] = dyv[i] * ACT::grad(fmaf(xh[i], wv[i], bv[i]));
    }
  };
  float a[P], q[P];  // per channel: sums of dz * xhat and dz, on each chunk as it lands
#pragma unroll
  for (int i = 0; i < P; ++i) a[i] = q[i] = 0.f;
  s.each_as_landed([&](int p) {
    float xh[P], dz[P];
    grads(p, xh, dz);
#pragma unroll
    for (int i = 0; i < P; ++i) {
      a[i] = fmaf(dz[i], xh[i], a[i]);
      q[i] += dz[i];
    }
  });
  if (s.active) {
    cl::store_partials<P>(red + s.ty * block_c + s.px * P, a);
    cl::store_partials<P>(red + (s.ty_count + s.ty) * block_c + s.px * P, q);
  }
  __syncthreads();
  cl::channel_sums<WARPS>(red, block_c, s.ty_count, block_c, chsum);
  cl::channel_sums<WARPS>(red + s.ty_count * block_c, block_c, s.ty_count, block_c, chsum + block_c);
  __syncthreads();
  cl::cluster_wait();
  // each channel's two sums over the cluster (thread i < 2K: slot i, of dz * xhat for i < K, else of dz)
  if (tid < 2 * block_c)
    for (unsigned r = 0; r < s.size; ++r) cl::store_remote(&slots[s.rank * 2 * block_c + tid], r, chsum[tid]);
  cl::cluster_sync();
  if (tid < 2 * block_c) {
    const float t = cl::slot_total(slots, tid, 2 * block_c, s.size);
    if (PARAMS && s.rank == 0) {
      float* part = tid < block_c ? dw_part : db_part;
      if (part != nullptr) part[i64(s.n) * C + s.cb * block_c + tid % block_c] = t;
    }
    chsum[tid] = t;  // (every thread read chsum before the cluster barrier)
  }
  __syncthreads();
  if (tid < s.gpb) {  // the group's sums of g * xhat and g: its channels' sums times their weights
    float sa = 0.f, sb = 0.f;
    for (int c = tid * cg; c < (tid + 1) * cg; ++c) {
      const float wc = w != nullptr ? to_float(w[s.cb * block_c + c]) : 1.f;
      sa = fmaf(wc, chsum[c], sa);
      sb = fmaf(wc, chsum[block_c + c], sb);
    }
    gsum[0][tid] = sa;
    gsum[1][tid] = sb;
  }
  __syncthreads();
  if (!s.active) return;
  const float inv_count = 1.f / (float(cg) * float(S));
  float c1[P], c2[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int gl = (s.px * P + i) / cg;
    c1[i] = gsum[0][gl] * inv_count;
    c2[i] = gsum[1][gl] * inv_count;
  }
  for (int k = 0; k < s.iters; ++k) {
    const int p = s.position(k);
    float xh[P], dz[P], d[P];
    grads(p, xh, dz);
#pragma unroll
    for (int i = 0; i < P; ++i) d[i] = rs[i] * (dz[i] * wv[i] - xh[i] * c1[i] - c2[i]);
    store_floats<P>(dx + s.global_at(p), d);
  }
#endif
}

}  // namespace nk
