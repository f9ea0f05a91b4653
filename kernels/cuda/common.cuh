// Device helpers shared by the CUDA kernels: warp/block reductions and the scalar functions of the model.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace oryx::kernels::cuda {

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats of shared memory; the call synchronises the block twice.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// torch's softplus (threshold 20: linear above it), as the CPU backend computes it.
__device__ __forceinline__ float Softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float Silu(float x) { return x / (1.f + expf(-x)); }

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__device__ __forceinline__ int64_t CeilDivDevice(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The largest head_dim the kernels take (= the config bound; per-head vectors live in shared memory).
inline constexpr int kMaxHeadDimCuda = 256;

}  // namespace oryx::kernels::cuda
