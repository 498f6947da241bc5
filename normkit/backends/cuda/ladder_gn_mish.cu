// ladder_gn_mish.cu: seed 004's fused GroupNorm + Mish kernel, fp32, one batch item x of shape
// [C, L] (NCHW with one spatial axis), eps = 1e-5. One block per group and one thread per element:
// CHUNK_SIZE = C * L / G threads, so a group must fit one block (<= 1024 elements, a power of two
// for the tree reductions). normkit's production GroupNorm (group_norm.cu) lifts both limits.
//
// One fix: the seed reads the mean from sharedSum[0] and then overwrites sharedSum[tid] with no
// barrier between, so thread 0 can clobber sharedSum[0] before slower warps have read the mean.
// The __syncthreads() marked "fix" closes that race.

template <int CHUNK_SIZE>
__global__ void parallelGroupNormMishKernel(float* d_input, float* d_output, float* d_weights, float* d_bias,
                                            const int input_length) {
  const int tid = threadIdx.x;
  const int bid = blockIdx.x;  // the group
  __shared__ float sharedSum[CHUNK_SIZE];

  // 1. load this thread's element into shared memory
  float dataValue = d_input[bid * CHUNK_SIZE + tid];
  sharedSum[tid] = dataValue;
  __syncthreads();

  // 2. tree reduction: the group's sum
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (tid < stride) sharedSum[tid] += sharedSum[tid + stride];
    __syncthreads();
  }

  // 3. squared deviation from the group mean (two passes: exact)
  float mean = sharedSum[0] / CHUNK_SIZE;
  __syncthreads();  // fix: every thread has read sharedSum[0] before it is overwritten
  float diff = dataValue - mean;
  sharedSum[tid] = diff * diff;
  __syncthreads();

  // 4. tree reduction: the sum of squared deviations
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (tid < stride) sharedSum[tid] += sharedSum[tid + stride];
    __syncthreads();
  }

  // 5. normalize
  float variance = sharedSum[0] / CHUNK_SIZE;
  int global_td = bid * CHUNK_SIZE + tid;
  int weight_bias_idx = global_td / input_length;  // the channel
  float invStdDev = rsqrtf(variance + 1e-5f);
  float normVal = (dataValue - mean) * invStdDev;

  // 6. per-channel scale and shift
  float weightedNormVal = normVal * d_weights[weight_bias_idx] + d_bias[weight_bias_idx];

  // 7. Mish, stored
  float mishVal = weightedNormVal * tanhf(log1pf(expf(weightedNormVal)));
  d_output[bid * CHUNK_SIZE + tid] = mishVal;
}
