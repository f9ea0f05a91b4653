// Elementwise ops: embedding gather, the SwiGLU gate, fp32 -> bf16. Parallel over elements.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n) { return static_cast<int>(CeilDiv(n, kThreads)); }

__global__ void EmbedKernel(EmbedParams p) {
  AfterPrevious();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.rows * p.d) return;
  const int64_t r = i / p.d, c = i % p.d;
  p.x_ptr[i] = __bfloat162float(p.table_ptr[int64_t(p.tokens_ptr[r * p.tokens_stride]) * p.d + c]);
}

__global__ void SwiGluKernel(SwiGluParams p) {
  AfterPrevious();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.rows * p.d) return;
  const int64_t r = i / p.d, c = i % p.d;
  const float* row = p.in_ptr + r * 2 * p.d;
  p.y_ptr[i] = __float2bfloat16(Silu(row[c]) * row[p.d + c]);
}

__global__ void FloatToBf16Kernel(const float* x, bf16* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(x[i]);
}

// A 32-bit mix of (seed, index) (the "lowbias32" integer hash), mapped to [0, 1).
__device__ __forceinline__ float HashUniform(uint32_t seed, uint64_t i) {
  uint32_t x = static_cast<uint32_t>(i) ^ (static_cast<uint32_t>(i >> 32) * 0x9E3779B9u) ^ (seed * 0x85EBCA6Bu);
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return (x >> 8) * (1.f / 16777216.f);
}

template <typename T>
__global__ void FillUniformKernel(T* y, int64_t n, uint32_t seed, float lo, float hi) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = lo + (hi - lo) * HashUniform(seed, i);
    if constexpr (sizeof(T) == 4) {
      y[i] = v;
    } else {
      y[i] = __float2bfloat16(v);
    }
  }
}

}  // namespace

void FillUniform(float* y, int64_t n, uint32_t seed, float lo, float hi, cudaStream_t stream) {
  if (n == 0) return;
  FillUniformKernel<<<static_cast<unsigned>(std::min<int64_t>(Blocks(n), 65536)), kThreads, 0, stream>>>(y, n, seed, lo, hi);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void FillUniform(bf16* y, int64_t n, uint32_t seed, float lo, float hi, cudaStream_t stream) {
  if (n == 0) return;
  FillUniformKernel<<<static_cast<unsigned>(std::min<int64_t>(Blocks(n), 65536)), kThreads, 0, stream>>>(y, n, seed, lo, hi);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void Embed(const EmbedParams& p, cudaStream_t stream) {
  LaunchAfterPrevious(EmbedKernel, Blocks(p.rows * p.d), kThreads, 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void SwiGlu(const SwiGluParams& p, cudaStream_t stream) {
  LaunchAfterPrevious(SwiGluKernel, Blocks(p.rows * p.d), kThreads, 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void FloatToBf16(const float* x, bf16* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  FloatToBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(x, y, n);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

namespace {
KernelSwitches g_switches;
}  // namespace

void SetKernelSwitches(const KernelSwitches& switches) { g_switches = switches; }
const KernelSwitches& GetKernelSwitches() { return g_switches; }

}  // namespace oryx::kernels::cuda
