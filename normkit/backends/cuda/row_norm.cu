// row_norm.cu: LayerNorm and RMSNorm over the rows of an [M, N] matrix, forward and backward.
//
// OneFlow's design (seed 003): Welford statistics (two exact passes where a row sits in
// registers), vectorized packs, and implementations chosen by the host from the row width N
// (configs.py):
//
//   warp     N <= 1024: a group of WIDTH lanes (a warp, or a fraction of one for narrow rows, so
//            several rows share a warp) holds a row in registers: read once, written once.
//   regs     the same kernels with WIDTH = 64..1024 threads per row (the host's "regs" plan, for
//            rows up to configs.REG_ROW_MAX): a block of max(WIDTH, 128) threads holds one or two
//            rows in registers, and the row's statistics cross warps through shared memory (one
//            barrier per all-reduce: one per row in RMSNorm and the backward, two in the
//            LayerNorm forward). Each thread keeps COLS columns in flight, the block kernels
//            only one batch of packs between barriers: what the block impl lacked at N = 2K-8K.
//   block    a block per row. CACHED: the row is kept in dynamic shared memory between the
//            statistics pass and the normalize pass. Not CACHED ("uncached"): the second pass
//            reads global memory again (mostly L2 hits), for rows too wide for shared memory.
//
// Template flags instead of copies: RMS (no centering), ACT (the fused activation), and the
// element types T (x, y) and W (weight, bias). Rows may be strided; row offsets are int64.
//
// Backward, per row (g = dz * w, dz = dy * act'(z), z = xhat * w + b recomputed from x):
//   dx = rstd * (g - xhat * mean(xhat * g) - mean(g))     LayerNorm
//   dx = rstd * (g - xhat * mean(xhat * g))               RMSNorm
// dweight = sum over rows of dz * xhat, dbias = sum of dz: each thread accumulates its columns
// in registers over its rows, each block writes one fp32 partial row, and col_sum adds the partial
// rows in a fixed order (no atomics, so the result is bitwise reproducible). Rows too wide for the register
// accumulators leave the sums to row_param_grad, a column-tiled kernel with the same contract.
#include "common.cuh"

namespace nk {

constexpr int kWarpImplThreads = 128;  // warp-impl blocks (configs.WARP_BLOCK_THREADS)
// threads of a warp/regs-impl block: WIDTH threads hold a row; a block holds at least 128 threads
template <int WIDTH> constexpr int row_block_threads() { return WIDTH > kWarpImplThreads ? WIDTH : kWarpImplThreads; }
// block-impl blocks have at most 512 threads (configs.BLOCK_SIZES): the register file then allows
// 128 registers per thread, room for the batched loads and the fused activations without spills
// (a 1024-thread bound caps a thread at 64 registers and the bf16/fp16 kernels spilled)
constexpr int kMaxBlockThreads = 512;

// ================================================================== forward

// Statistics of shifted data: the row's first element is subtracted before Welford or the two
// passes (exact in fp32 for values near it), and y is formed from the shifted values, so a row offset by 1e4 keeps
// the digits that (x - mean) with a rounded fp32 mean would lose. RMSNorm does not shift.

// warp/regs impl: COLS columns per thread (PACKS packs of P), thread l of a group of WIDTH owns
// packs l, l + WIDTH, l + 2 WIDTH, ... so that neighbouring threads read neighbouring packs.
// Group g of block b holds rows b * GROUPS + g, then + gridDim * GROUPS, ...: the loop bound is
// the same for every thread of the block (the shuffles and barriers need them all); a group whose
// row is past the end only skips its loads and stores.
template <int P, int COLS, int WIDTH, bool RMS, typename LOAD, typename STORE>
__device__ void layer_norm_warp(LOAD load, STORE store, float* mean_out, float* rstd_out, i64 rows, int cols,
                                float eps) {
  static_assert(COLS % P == 0, "COLS must be a multiple of the pack");
  constexpr int PACKS = COLS / P;
  constexpr int GROUPS = row_block_threads<WIDTH>() / WIDTH;
  // The row is in registers, so LayerNorm takes two exact passes over them (the sum, then the
  // squared deviations from the mean) instead of Welford: two all-reduces of plain sums. Welford's
  // merges (a division each, in sequence over the warps of a row) made the LayerNorm forward
  // latency-bound: 0.46 of copy at N = 32768 where the same kernel's RMSNorm reached 0.91 (run
  // S7-2). Scratch: LayerNorm's two all-reduces use arrays 0 and 1 in turn, RMSNorm's one
  // alternates them by row (see row_allreduce).
  __shared__ Sum1 scratch[2][row_block_threads<WIDTH>() / kWarpSize];
  const int lane = threadIdx.x % WIDTH;
  const int group = threadIdx.x / WIDTH;
  int parity = 0;
  for (i64 first = i64(blockIdx.x) * GROUPS; first < rows; first += i64(gridDim.x) * GROUPS, parity ^= 1) {
    const i64 row = first + group;
    const bool live = row < rows;
    const float shift = (RMS || !live) ? 0.f : load.first(row);
    float buf[COLS];  // the row's shifted values, then its normalized values
    Sum1 s1 = Sum1::zero();
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int col = (p * WIDTH + lane) * P;
      if (live && col < cols) {
        load.template load<P>(buf + p * P, row, col);
#pragma unroll
        for (int i = 0; i < P; ++i) {
          buf[p * P + i] -= shift;
          s1.v = RMS ? fmaf(buf[p * P + i], buf[p * P + i], s1.v) : s1.v + buf[p * P + i];
        }
      }
    }
    s1 = row_allreduce<WIDTH>(s1, scratch[RMS ? parity : 0]);
    float mean = 0.f, m2 = s1.v;  // mean of the shifted values
    if constexpr (!RMS) {
      mean = s1.v / float(cols);
      Sum1 s2 = Sum1::zero();
#pragma unroll
      for (int p = 0; p < PACKS; ++p) {
        const int col = (p * WIDTH + lane) * P;
        if (live && col < cols) {
#pragma unroll
          for (int i = 0; i < P; ++i) {
            const float d = buf[p * P + i] - mean;
            s2.v = fmaf(d, d, s2.v);
          }
        }
      }
      m2 = row_allreduce<WIDTH>(s2, scratch[1]).v;
    }
    const float rstd = rsqrtf(m2 / float(cols) + eps);
    if (live && lane == 0) {
      if (!RMS) mean_out[row] = shift + mean;
      rstd_out[row] = rstd;
    }
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int col = (p * WIDTH + lane) * P;
      if (live && col < cols) {
#pragma unroll
        for (int i = 0; i < P; ++i) buf[p * P + i] = (buf[p * P + i] - mean) * rstd;
        store.template store<P>(buf + p * P, row, col);
      }
    }
  }
}

// block impl: thread t owns packs t, t + blockDim, ... of the row, visited kBatch at a time
// (loads first). With CACHED it parks them in shared memory (in T, so a half row takes half the
// space) and reads them back; each thread reads only what it wrote, so no barrier is needed
// between the passes.
template <int P, bool RMS, bool CACHED, typename T, typename STORE>
__device__ void layer_norm_block(RowLoad<T> load, STORE store, float* mean_out, float* rstd_out, i64 rows,
                                 int cols, float eps) {
  typedef typename Select<RMS, SumSq, Welford>::type Stat;
  extern __shared__ __align__(16) unsigned char smem[];
  Pack<T, P>* cache = reinterpret_cast<Pack<T, P>*>(smem);
  const int packs = cols / P;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const float shift = RMS ? 0.f : load.first(row);
    Stat st = Stat::zero();
    for (int p0 = threadIdx.x; p0 < packs; p0 += kBatch * blockDim.x) {
      Pack<T, P> v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < packs) v[k] = load.template raw<P>(row, p * P);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < packs) {
          if (CACHED) cache[p] = v[k];
          float f[P];
          pack_to_floats<P>(v[k], f);
#pragma unroll
          for (int i = 0; i < P; ++i) f[i] -= shift;
          st.template push_pack<P>(f);
        }
      }
    }
    st = block_allreduce(st);
    const float rstd = rsqrtf(st.m2 / float(cols) + eps);
    if (threadIdx.x == 0) {
      if (!RMS) mean_out[row] = shift + st.mean;
      rstd_out[row] = rstd;
    }
    for (int p0 = threadIdx.x; p0 < packs; p0 += kBatch * blockDim.x) {
      Pack<T, P> v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < packs) v[k] = CACHED ? cache[p] : load.template raw<P>(row, p * P);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < packs) {
          float f[P];
          pack_to_floats<P>(v[k], f);
#pragma unroll
          for (int i = 0; i < P; ++i) f[i] = ((f[i] - shift) - st.mean) * rstd;
          store.template store<P>(f, row, p * P);
        }
      }
    }
  }
}

#define NK_ROW_FWD_PARAMS                                                                            \
  const T *__restrict__ x, i64 x_stride, T *__restrict__ y, i64 y_stride, const W *__restrict__ w, \
      const W *__restrict__ b, float *__restrict__ mean, float *__restrict__ rstd, i64 rows, int cols, float eps

template <typename T, typename W, typename ACT, int P, int COLS, int WIDTH, bool RMS>
__global__ void __launch_bounds__(row_block_threads<WIDTH>()) row_fwd_warp(NK_ROW_FWD_PARAMS) {
  layer_norm_warp<P, COLS, WIDTH, RMS>(RowLoad<T>{x, x_stride}, AffineActStore<T, W, ACT>{y, y_stride, w, b}, mean,
                                       rstd, rows, cols, eps);
}

template <typename T, typename W, typename ACT, int P, bool RMS, bool CACHED>
__global__ void __launch_bounds__(kMaxBlockThreads) row_fwd_block(NK_ROW_FWD_PARAMS) {
  layer_norm_block<P, RMS, CACHED>(RowLoad<T>{x, x_stride}, AffineActStore<T, W, ACT>{y, y_stride, w, b}, mean,
                                   rstd, rows, cols, eps);
}

// ================================================================== backward

#define NK_ROW_BWD_PARAMS                                                                                  \
  const T *__restrict__ dy, i64 dy_stride, const T *__restrict__ x, i64 x_stride, const W *__restrict__ w, \
      const W *__restrict__ b, const float *__restrict__ mean, const float *__restrict__ rstd,             \
      T *__restrict__ dx, i64 dx_stride, float *__restrict__ dw_part, float *__restrict__ db_part, i64 rows, int cols

// warp/regs impl backward: the row's xhat and g stay in registers between the sums and dx (rows
// mapped to groups as in layer_norm_warp). PARAMS: each thread accumulates dz * xhat and dz for
// its columns over all its rows; block b writes partial row b of dw_part / db_part ([gridDim, cols]).
template <typename T, typename W, typename ACT, int P, int COLS, int WIDTH, bool RMS, bool PARAMS>
__global__ void __launch_bounds__(row_block_threads<WIDTH>()) row_bwd_warp(NK_ROW_BWD_PARAMS) {
  constexpr int PACKS = COLS / P;
  constexpr int BLOCK = row_block_threads<WIDTH>();
  constexpr int GROUPS = BLOCK / WIDTH;
  constexpr int ACC = PARAMS ? COLS : 1;
  __shared__ Sum2 scratch[2][BLOCK / kWarpSize];
  const int lane = threadIdx.x % WIDTH;
  const int group = threadIdx.x / WIDTH;
  const float inv_cols = 1.f / float(cols);
  float dw_acc[ACC], db_acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) dw_acc[i] = db_acc[i] = 0.f;

  int parity = 0;
  for (i64 first = i64(blockIdx.x) * GROUPS; first < rows; first += i64(gridDim.x) * GROUPS, parity ^= 1) {
    const i64 row = first + group;
    const bool live = row < rows;
    const float mu = (live && !RMS) ? mean[row] : 0.f;
    const float rs = live ? rstd[row] : 0.f;
    float xhat[COLS], g[COLS];
    Sum2 s = Sum2::zero();
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int col = (p * WIDTH + lane) * P;
      if (live && col < cols) {
        float xv[P], dyv[P], dz[P];
        load_floats<P>(x + row * x_stride + col, xv);
        load_floats<P>(dy + row * dy_stride + col, dyv);
        pack_grads<P, W, ACT, RMS>(w, b, col, mu, rs, xv, dyv, xhat + p * P, dz, g + p * P);
#pragma unroll
        for (int i = 0; i < P; ++i) {
          s.a += xhat[p * P + i] * g[p * P + i];
          s.b += g[p * P + i];
          if constexpr (PARAMS) {
            dw_acc[(p * P + i) % ACC] += dz[i] * xhat[p * P + i];
            db_acc[(p * P + i) % ACC] += dz[i];
          }
        }
      }
    }
    s = row_allreduce<WIDTH>(s, scratch[parity]);
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int col = (p * WIDTH + lane) * P;
      if (live && col < cols) {
        float d[P];
        pack_dx<P, RMS>(xhat + p * P, g + p * P, s, inv_cols, rs, d);
        store_floats<P>(dx + row * dx_stride + col, d);
      }
    }
  }
  if constexpr (PARAMS && GROUPS == 1) {
    // one group per block: its threads own disjoint columns, so they write the partial row directly
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int col = (p * WIDTH + lane) * P;
      if (col < cols) {
        if (dw_part != nullptr) store_floats<P>(dw_part + i64(blockIdx.x) * cols + col, dw_acc + p * P);
        if (db_part != nullptr) store_floats<P>(db_part + i64(blockIdx.x) * cols + col, db_acc + p * P);
      }
    }
  } else if constexpr (PARAMS) {
    // one partial row per block: the block's groups are added in a fixed order through shared
    // memory (red[group][col]), first dweight, then dbias
    __shared__ float red[GROUPS][WIDTH * COLS];
    const int group = threadIdx.x / WIDTH;
    for (int which = 0; which < 2; ++which) {
      float* part = which == 0 ? dw_part : db_part;
      const float* acc = which == 0 ? dw_acc : db_acc;
      if (part == nullptr) continue;  // the same for every thread of the block
#pragma unroll
      for (int p = 0; p < PACKS; ++p) {
        const int col = (p * WIDTH + lane) * P;
#pragma unroll
        for (int i = 0; i < P; ++i) red[group][col + i] = acc[(p * P + i) % ACC];
      }
      __syncthreads();
      for (int col = threadIdx.x; col < cols; col += blockDim.x) {
        float total = 0.f;
        for (int g = 0; g < GROUPS; ++g) total += red[g][col];
        part[i64(blockIdx.x) * cols + col] = total;
      }
      __syncthreads();
    }
  }
}

// the block backward holds x and dy per pack: half the forward's batch keeps as many bytes in flight
constexpr int kBwdBatch = kBatch / 2;

// block impl backward. CACHED keeps the x and dy rows in shared memory (2 * cols elements of T)
// between the sums pass and the dx pass. ACC_PACKS > 0: thread t owns at most ACC_PACKS packs
// (t + k * blockDim) and accumulates their dweight/dbias terms in registers, writing partial row
// blockIdx.x; the host guarantees cols <= ACC_PACKS * blockDim * P. ACC_PACKS == 0: dx only.
template <typename T, typename W, typename ACT, int P, bool RMS, bool CACHED, int ACC_PACKS>
__global__ void __launch_bounds__(kMaxBlockThreads) row_bwd_block(NK_ROW_BWD_PARAMS) {
  constexpr int ACC = ACC_PACKS > 0 ? ACC_PACKS : 1;
  constexpr int BATCH = ACC_PACKS > 0 ? 1 : kBwdBatch;  // the accumulators take the batch's registers
  extern __shared__ __align__(16) unsigned char smem[];
  Pack<T, P>* x_cache = reinterpret_cast<Pack<T, P>*>(smem);
  const int packs = cols / P;
  Pack<T, P>* dy_cache = x_cache + packs;
  const float inv_cols = 1.f / float(cols);
  float dw_acc[ACC][P], db_acc[ACC][P];
#pragma unroll
  for (int k = 0; k < ACC; ++k)
#pragma unroll
    for (int i = 0; i < P; ++i) dw_acc[k][i] = db_acc[k][i] = 0.f;

  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const float mu = RMS ? 0.f : mean[row];
    const float rs = rstd[row];
    // this thread's packs of x and dy: from global memory (parked in shared memory when CACHED),
    // or, in the dx pass of a CACHED kernel, from shared memory
    auto read = [&](int p, bool from_cache, Pack<T, P>& xp, Pack<T, P>& dyp) {
      if (CACHED && from_cache) {
        xp = x_cache[p];
        dyp = dy_cache[p];
      } else {
        xp = load_pack<P>(x + row * x_stride + p * P);
        dyp = load_pack<P>(dy + row * dy_stride + p * P);
      }
    };
    auto grads = [&](const Pack<T, P>& xp, const Pack<T, P>& dyp, int p, float* xhat, float* dz, float* g) {
      float xv[P], dyv[P];
      pack_to_floats<P>(xp, xv);
      pack_to_floats<P>(dyp, dyv);
      pack_grads<P, W, ACT, RMS>(w, b, p * P, mu, rs, xv, dyv, xhat, dz, g);
    };
    Sum2 s = Sum2::zero();
    for (int p0 = threadIdx.x; p0 < packs; p0 += BATCH * blockDim.x) {
      Pack<T, P> xp[BATCH], dyp[BATCH];
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < packs) read(p, false, xp[k], dyp[k]);
      }
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < packs) {
          if (CACHED) {
            x_cache[p] = xp[k];
            dy_cache[p] = dyp[k];
          }
          float xhat[P], dz[P], g[P];
          grads(xp[k], dyp[k], p, xhat, dz, g);
#pragma unroll
          for (int i = 0; i < P; ++i) {
            s.a += xhat[i] * g[i];
            s.b += g[i];
          }
        }
      }
    }
    s = block_allreduce(s);
    auto write_dx = [&](const Pack<T, P>& xp, const Pack<T, P>& dyp, int p, float (&dw)[P], float (&db)[P]) {
      float xhat[P], dz[P], g[P], d[P];
      grads(xp, dyp, p, xhat, dz, g);
      pack_dx<P, RMS>(xhat, g, s, inv_cols, rs, d);
      store_floats<P>(dx + row * dx_stride + p * P, d);
#pragma unroll
      for (int i = 0; i < P; ++i) {
        dw[i] += dz[i] * xhat[i];
        db[i] += dz[i];
      }
    };
    if constexpr (ACC_PACKS > 0) {  // at most ACC packs per thread (the accumulators fill the registers)
#pragma unroll
      for (int k = 0; k < ACC; ++k) {
        const int p = threadIdx.x + k * blockDim.x;
        if (p < packs) {
          Pack<T, P> xp, dyp;
          read(p, true, xp, dyp);
          write_dx(xp, dyp, p, dw_acc[k], db_acc[k]);
        }
      }
    } else {
      for (int p0 = threadIdx.x; p0 < packs; p0 += BATCH * blockDim.x) {
        Pack<T, P> xp[BATCH], dyp[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
          const int p = p0 + k * blockDim.x;
          if (p < packs) read(p, true, xp[k], dyp[k]);
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
          const int p = p0 + k * blockDim.x;
          if (p < packs) write_dx(xp[k], dyp[k], p, dw_acc[0], db_acc[0]);
        }
      }
    }
  }
  if constexpr (ACC_PACKS > 0) {
#pragma unroll
    for (int k = 0; k < ACC; ++k) {
      const int p = threadIdx.x + k * blockDim.x;
      if (p < packs) {
        if (dw_part != nullptr) store_floats<P>(dw_part + i64(blockIdx.x) * cols + p * P, dw_acc[k]);
        if (db_part != nullptr) store_floats<P>(db_part + i64(blockIdx.x) * cols + p * P, db_acc[k]);
      }
    }
  }
}

// dweight/dbias partials for rows too wide for the register accumulators: block (32, 8) covers
// 32 columns of split blockIdx.y's rows; the 8 row lanes are added in a fixed order.
constexpr int kParamTileCols = 32, kParamTileRows = 8;

template <typename T, typename W, typename ACT, bool RMS>
__global__ void __launch_bounds__(kParamTileCols* kParamTileRows)
    row_param_grad(const T* __restrict__ dy, i64 dy_stride, const T* __restrict__ x, i64 x_stride,
                   const W* __restrict__ w, const W* __restrict__ b, const float* __restrict__ mean,
                   const float* __restrict__ rstd, float* __restrict__ dw_part, float* __restrict__ db_part, i64 rows,
                   int cols, i64 rows_per_split) {
  __shared__ float part[2][kParamTileRows][kParamTileCols];
  const int col = blockIdx.x * kParamTileCols + threadIdx.x;
  const i64 r0 = blockIdx.y * rows_per_split;
  const i64 r1 = r0 + rows_per_split < rows ? r0 + rows_per_split : rows;
  float dw = 0.f, db = 0.f;
  if (col < cols) {
    for (i64 r = r0 + threadIdx.y; r < r1; r += kBatch * kParamTileRows) {
      float xv[kBatch], dyv[kBatch], mu[kBatch], rs[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {  // loads first
        const i64 row = r + k * kParamTileRows;
        if (row < r1) {
          xv[k] = to_float(x[row * x_stride + col]);
          dyv[k] = to_float(dy[row * dy_stride + col]);
          mu[k] = RMS ? 0.f : mean[row];
          rs[k] = rstd[row];
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (r + k * kParamTileRows < r1) {
          float xhat, dz, g;
          pack_grads<1, W, ACT, RMS>(w, b, col, mu[k], rs[k], &xv[k], &dyv[k], &xhat, &dz, &g);
          dw += dz * xhat;
          db += dz;
        }
      }
    }
  }
  part[0][threadIdx.y][threadIdx.x] = dw;
  part[1][threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float sw = 0.f, sb = 0.f;
    for (int r = 0; r < kParamTileRows; ++r) {
      sw += part[0][r][threadIdx.x];
      sb += part[1][r][threadIdx.x];
    }
    if (dw_part != nullptr) dw_part[i64(blockIdx.y) * cols + col] = sw;
    if (db_part != nullptr) db_part[i64(blockIdx.y) * cols + col] = sb;
  }
}

// out[c] = sum over p of part[p, c]: the deterministic second stage of every weight-gradient
// reduction (row norms and GroupNorm). Block (32, 8): 32 columns; lane y adds rows y, y + 8, ...
// in order, then the 8 lane sums are added in order. Either output may be null.
constexpr int kColSumCols = 32, kColSumRows = 8;

template <typename OUT>
__device__ __forceinline__ void col_sum_one(const float* part, OUT* out, i64 parts, int cols, int col,
                                            float (&lanes)[kColSumRows][kColSumCols]) {
  float s = 0.f;
  if (col < cols) {
    for (i64 p0 = threadIdx.y; p0 < parts; p0 += kBatch * kColSumRows) {
      float v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {  // loads first, then the adds in order
        const i64 p = p0 + k * kColSumRows;
        v[k] = p < parts ? part[p * cols + col] : 0.f;
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) s += v[k];
    }
  }
  lanes[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f;
    for (int r = 0; r < kColSumRows; ++r) total += lanes[r][threadIdx.x];
    out[col] = from_float<OUT>(total);
  }
  __syncthreads();
}

template <typename A, typename B>
__global__ void __launch_bounds__(kColSumCols* kColSumRows)
    col_sum(const float* __restrict__ a_part, A* __restrict__ a, const float* __restrict__ b_part,
            B* __restrict__ b, i64 parts, int cols) {
  __shared__ float lanes[kColSumRows][kColSumCols];
  const int col = blockIdx.x * kColSumCols + threadIdx.x;
  if (a != nullptr) col_sum_one(a_part, a, parts, cols, col, lanes);
  if (b != nullptr) col_sum_one(b_part, b, parts, cols, col, lanes);
}

}  // namespace nk
