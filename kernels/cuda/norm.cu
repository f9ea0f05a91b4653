// RMSNorm with the residual add fused in front, and the gated per-head norm. One block per row.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kThreads = 256;

constexpr int kMaxPieces = 2;  // rows of up to 4 * kThreads * kMaxPieces floats are held in registers

__global__ void AddRmsNormKernel(AddRmsNormParams p) {
  __shared__ float scratch[32];
  // The row index (metadata of the forward) and the weight before the wait: no kernel writes them.
  const int64_t src = p.maybe_rows_ptr != nullptr ? p.maybe_rows_ptr[blockIdx.x] : blockIdx.x;
  float* x = p.x_ptr + src * p.d;
  const float* delta = p.maybe_delta_ptr != nullptr ? p.maybe_delta_ptr + src * p.d : nullptr;
  if (RowFitsPieces<kMaxPieces>(x, p.d) && RowFitsPieces<kMaxPieces>(p.weight_ptr, p.d) &&
      (delta == nullptr || RowFitsPieces<kMaxPieces>(delta, p.d))) {
    float4 w[kMaxPieces], v[kMaxPieces];
    LoadRowPieces(p.weight_ptr, p.d, w);
    AfterPrevious();
    LoadRowPieces(x, p.d, v);
    if (delta != nullptr) {
      float4 dv[kMaxPieces];
      LoadRowPieces(delta, p.d, dv);
#pragma unroll
      for (int t = 0; t < kMaxPieces; ++t) {
        v[t] = make_float4(v[t].x + dv[t].x, v[t].y + dv[t].y, v[t].z + dv[t].z, v[t].w + dv[t].w);
        if (RowPieceColumn(t) < p.d) *reinterpret_cast<float4*>(x + RowPieceColumn(t)) = v[t];
      }
    }
    const float scale = rsqrtf(BlockSum(SumOfSquares(v), scratch) / p.d + p.eps);
    bf16* y = p.y_ptr + int64_t(blockIdx.x) * p.d;
#pragma unroll
    for (int t = 0; t < kMaxPieces; ++t) {
      const int64_t c = RowPieceColumn(t);
      if (c >= p.d) break;
      y[c] = __float2bfloat16(v[t].x * scale * w[t].x);
      y[c + 1] = __float2bfloat16(v[t].y * scale * w[t].y);
      y[c + 2] = __float2bfloat16(v[t].z * scale * w[t].z);
      y[c + 3] = __float2bfloat16(v[t].w * scale * w[t].w);
    }
    return;
  }
  AfterPrevious();
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < p.d; c += blockDim.x) {
    float v = x[c];
    if (delta != nullptr) {
      v += delta[c];
      x[c] = v;
    }
    sum += v * v;
  }
  const float scale = rsqrtf(BlockSum(sum, scratch) / p.d + p.eps);
  bf16* y = p.y_ptr + int64_t(blockIdx.x) * p.d;
  for (int64_t c = threadIdx.x; c < p.d; c += blockDim.x) y[c] = __float2bfloat16(x[c] * scale * p.weight_ptr[c]);
}

// One warp per head, lanes over the head's features.
__global__ void GatedNormKernel(GatedNormParams p) {
  AfterPrevious();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t r = blockIdx.x, hd = p.heads * p.head_dim;
  for (int64_t h = warp; h < p.heads; h += warps) {
    const float* o = p.o_ptr + r * hd + h * p.head_dim;
    const float* g = p.gate_ptr + r * p.gate_row_stride + h * p.head_dim;
    float sum = 0.f;
    for (int64_t i = lane; i < p.head_dim; i += 32) sum += o[i] * o[i];
    const float scale = rsqrtf(WarpSum(sum) / p.head_dim + p.eps);
    bf16* y = p.y_ptr + r * hd + h * p.head_dim;
    for (int64_t i = lane; i < p.head_dim; i += 32) y[i] = __float2bfloat16(o[i] * scale * p.weight_ptr[i] * Silu(g[i]));
  }
}

}  // namespace

void AddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  LaunchAfterPrevious(AddRmsNormKernel, static_cast<unsigned>(p.rows), kThreads, 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void GatedNorm(const GatedNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  LaunchAfterPrevious(GatedNormKernel, static_cast<unsigned>(p.rows), kThreads, 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace oryx::kernels::cuda
