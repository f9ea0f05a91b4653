// CUDA bandwidth probes: a grid-stride float4 copy and a block-reduced sum. Parallel over elements.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/stream.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void CopyKernel(int64_t n, const float* __restrict__ x, float* __restrict__ y) {
  const int64_t n4 = n / 4;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* y4 = reinterpret_cast<float4*>(y);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += stride) y4[i] = x4[i];
  for (int64_t i = n4 * 4 + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) y[i] = x[i];
}

__global__ void SumKernel(int64_t n, const float* __restrict__ x, float* __restrict__ sum) {
  __shared__ float warp_sums[kThreads / 32];
  float acc = 0.f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) acc += x[i];
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (threadIdx.x == 0) atomicAdd(sum, acc);
  }
}

int GridSize() { return MultiprocessorCount() * 8; }

}  // namespace

void StreamCopy(const StreamParams& p, void* stream) {
  CopyKernel<<<GridSize(), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p.n, p.x_ptr, p.y_ptr);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void StreamSum(const StreamParams& p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  ORYX_CUDA_CHECK(cudaMemsetAsync(p.sum_ptr, 0, sizeof(float), s));
  SumKernel<<<GridSize(), kThreads, 0, s>>>(p.n, p.x_ptr, p.sum_ptr);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

}  // namespace oryx::kernels::cuda
