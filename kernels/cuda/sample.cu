// Greedy argmax over rows of logits, ties to the lowest index (kernels/cpu/sample.cc's order). One block
// per row.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool Better(float v, int64_t i, float best, int64_t best_i) {
  return v > best || (v == best && i < best_i);
}

__global__ void ArgmaxKernel(ArgmaxParams p) {
  __shared__ float values[kThreads];
  __shared__ int64_t indices[kThreads];
  const float* row = p.logits_ptr + int64_t(blockIdx.x) * p.vocab;
  float best = -INFINITY;
  int64_t best_i = p.vocab;
  for (int64_t i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    if (Better(row[i], i, best, best_i)) best = row[i], best_i = i;
  }
  values[threadIdx.x] = best;
  indices[threadIdx.x] = best_i;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const int other = threadIdx.x + stride;
      if (Better(values[other], indices[other], values[threadIdx.x], indices[threadIdx.x])) {
        values[threadIdx.x] = values[other];
        indices[threadIdx.x] = indices[other];
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) p.tokens_ptr[blockIdx.x] = static_cast<int32_t>(indices[0]);
}

}  // namespace

void Argmax(const ArgmaxParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  ArgmaxKernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace oryx::kernels::cuda
