// ladder_llmc.cu: the llm.c LayerNorm forward ladder (seed 001, karpathy/llm.c dev/cuda/
// layernorm_forward.cu), kernels 1 to 5, fp32, x of shape [N = B * T, C], eps = 1e-5.
// Each step is kept as the seed wrote it; the comments say what the step changes.
//
// One departure: llm.c reduces a warp with cooperative_groups (cg::reduce(warp, v, cg::plus)),
// whose header needs the CCCL library on the include path. warp_sum below is what that call does
// (a butterfly of shuffles after which every lane holds the sum), so NVRTC needs no extra headers.

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// ---- kernel 1: one thread per row, three loops over the row (the CPU code, parallel over rows).
// Neighbouring threads read addresses C floats apart: every load is its own memory transaction.
extern "C" __global__ void layernorm_forward_kernel1(float* out, float* mean, float* rstd, const float* inp,
                                                     const float* weight, const float* bias, int N, int C) {
  int idx = blockIdx.x * blockDim.x + threadIdx.x;
  float eps = 1.0e-5f;
  if (idx < N) {
    const float* x = inp + idx * C;
    float m = 0.0f;  // mean
    for (int i = 0; i < C; i++) m += x[i];
    m /= C;
    float v = 0.0f;  // variance, from the deviations (two-pass: exact)
    for (int i = 0; i < C; i++) {
      float diff = x[i] - m;
      v += diff * diff;
    }
    v /= C;
    float r = 1.0f / sqrtf(v + eps);
    float* y = out + idx * C;
    for (int i = 0; i < C; i++) y[i] = ((x[i] - m) * r) * weight[i] + bias[i];
    mean[idx] = m;
    rstd[idx] = r;
  }
}

// ---- kernel 2: three kernels. mean and rstd give each row a block (coalesced, thread
// coarsening, then a tree reduction in shared memory); normalization is one thread per element.
extern "C" __global__ void mean_kernel(float* mean, const float* inp, int N, int C, int block_size) {
  extern __shared__ float shared[];
  int idx = blockIdx.x;   // row
  int tid = threadIdx.x;  // [0, block_size)
  const float* x = inp + idx * C;
  float sum = 0.0f;
  for (int i = tid; i < C; i += block_size) sum += x[i];  // thread coarsening
  shared[tid] = sum;
  __syncthreads();
  for (int stride = block_size / 2; stride >= 1; stride /= 2) {  // tree reduction
    __syncthreads();
    if (tid < stride) shared[tid] += shared[tid + stride];
  }
  if (tid == 0) mean[idx] = shared[0] / C;
}

extern "C" __global__ void rstd_kernel(float* rstd, const float* inp, const float* mean, int N, int C,
                                       int block_size) {
  extern __shared__ float shared[];
  int idx = blockIdx.x;
  int tid = threadIdx.x;
  const float* x = inp + idx * C;
  float m = mean[idx];
  float sum = 0.0f;
  for (int i = tid; i < C; i += block_size) {
    float diff = x[i] - m;
    sum += diff * diff;
  }
  shared[tid] = sum;
  __syncthreads();
  for (int stride = block_size / 2; stride >= 1; stride /= 2) {
    __syncthreads();
    if (tid < stride) shared[tid] += shared[tid + stride];
  }
  if (tid == 0) rstd[idx] = 1.0f / sqrtf(shared[0] / C + 1e-5f);
}

extern "C" __global__ void normalization_kernel(float* out, const float* inp, float* mean, float* rstd,
                                                const float* weight, const float* bias, int B, int T, int C) {
  int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= B * T * C) return;  // (llm.c relies on B*T*C being a multiple of 256)
  int bt = idx / C;
  int c = idx % C;
  float n = rstd[bt] * (inp[idx] - mean[bt]);
  out[idx] = n * weight[c] + bias[c];
}

// ---- kernel 3: one warp per row, everything in one kernel again. Warp shuffles replace shared
// memory; __restrict__ lets the compiler cache loads; __ldcs/__stcs ("cache streaming") keep x
// and y from evicting weight and bias, which every row re-reads.
extern "C" __global__ void layernorm_forward_kernel3(float* __restrict__ out, float* __restrict__ mean,
                                                     float* __restrict__ rstd, const float* __restrict__ inp,
                                                     const float* __restrict__ weight,
                                                     const float* __restrict__ bias, int N, int C) {
  int lane = threadIdx.x % 32;
  int idx = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // one row per warp
  if (idx >= N) return;  // the whole warp leaves together
  const float* x = inp + idx * C;
  float sum = 0.0f;
  for (int i = lane; i < C; i += 32) sum += x[i];
  sum = warp_sum(sum);
  float m = sum / C;
  if (lane == 0 && mean != nullptr) __stcs(mean + idx, m);
  sum = 0.0f;
  for (int i = lane; i < C; i += 32) {
    float diff = x[i] - m;
    sum += diff * diff;
  }
  sum = warp_sum(sum);
  float s = rsqrtf(sum / C + 1e-5f);
  if (lane == 0 && rstd != nullptr) __stcs(rstd + idx, s);
  float* o = out + idx * C;
  for (int c = lane; c < C; c += 32) {
    float n = s * (__ldcs(x + c) - m);
    __stcs(o + c, n * weight[c] + bias[c]);
  }
}

// ---- kernel 4: kernel 3 with var = E[x^2] - E[x]^2, so one pass gives both sums. Faster, and
// wrong when |mean| >> std: both terms round at the scale of mean^2 and their difference is noise
// (see the precision table: rows offset by 1e4 lose every digit of the variance).
extern "C" __global__ void layernorm_forward_kernel4(float* __restrict__ out, float* __restrict__ mean,
                                                     float* __restrict__ rstd, const float* __restrict__ inp,
                                                     const float* __restrict__ weight,
                                                     const float* __restrict__ bias, int N, int C) {
  int lane = threadIdx.x % 32;
  int idx = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (idx >= N) return;
  const float* x = inp + idx * C;
  float sum = 0.0f, sum2 = 0.0f;
  for (int i = lane; i < C; i += 32) {
    float xi = x[i];
    sum += xi;
    sum2 += xi * xi;
  }
  sum = warp_sum(sum) / C;    // E[x]
  sum2 = warp_sum(sum2) / C;  // E[x^2]
  float m = sum;
  float var = sum2 - sum * sum;
  float s = rsqrtf(var + 1e-5f);
  if (lane == 0 && mean != nullptr) __stcs(mean + idx, m);
  if (lane == 0 && rstd != nullptr) __stcs(rstd + idx, s);
  float* o = out + idx * C;
  for (int c = lane; c < C; c += 32) {
    float n = s * (__ldcs(x + c) - m);
    __stcs(o + c, n * weight[c] + bias[c]);
  }
}

// ---- kernel 5: one block per row. Each warp reduces its share (still sum and sum of squares,
// as kernel 4), writes it to shared memory, and the first warp reduces the per-warp results.
extern "C" __global__ void layernorm_forward_kernel5(float* __restrict__ out, float* __restrict__ mean,
                                                     float* __restrict__ rstd, const float* __restrict__ inp,
                                                     const float* __restrict__ weight,
                                                     const float* __restrict__ bias, int N, int C) {
  __shared__ float shared_sum[32];   // block_size <= 1024 = 32 warps
  __shared__ float shared_sum2[32];
  int num_warps = blockDim.x / 32;
  int warp_id = threadIdx.x / 32;
  int lane_id = threadIdx.x % 32;
  int idx = blockIdx.x;  // one block per row
  const float* x = inp + idx * C;
  float thread_sum = 0.0f, thread_sum2 = 0.0f;
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    float xi = x[i];
    thread_sum += xi;
    thread_sum2 += xi * xi;
  }
  float warp_s = warp_sum(thread_sum);
  float warp_s2 = warp_sum(thread_sum2);
  shared_sum[warp_id] = warp_s;
  shared_sum2[warp_id] = warp_s2;
  __syncthreads();
  warp_s = (lane_id < num_warps) ? shared_sum[lane_id] : 0.0f;
  warp_s2 = (lane_id < num_warps) ? shared_sum2[lane_id] : 0.0f;
  float block_sum = warp_sum(warp_s) / C;    // E[x]
  float block_sum2 = warp_sum(warp_s2) / C;  // E[x^2]
  float m = block_sum;
  float var = block_sum2 - m * m;
  float s = rsqrtf(var + 1e-5f);
  if (threadIdx.x == 0 && mean != nullptr) __stcs(mean + idx, m);
  if (threadIdx.x == 0 && rstd != nullptr) __stcs(rstd + idx, s);
  float* o = out + idx * C;
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    float n = s * (__ldcs(x + i) - m);
    __stcs(o + i, n * weight[i] + bias[i]);
  }
}
