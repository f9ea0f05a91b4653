// The mamba2 and gdn recurrences over every sequence's span (DESIGN.md §2). One block per (sequence,
// head, 32 value features j): the block keeps S[:, j-slice] (dh x 32 fp32) in shared memory for the whole
// span, so a verify span reads and writes the state once, plus once per token when it is recorded for
// rollback. Threads: 32 value features x 8 groups of key features i; reductions over i go through shared
// memory.
// Long spans that keep no states take the chunked scan instead (chunked_scan.cu).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/recurrence.cuh"

namespace oryx::kernels::cuda {

namespace {

using recurrence::kGroups;
using recurrence::kLanes;
using recurrence::TakesChunkedScan;

// Sum over the 8 key-feature groups of each value feature; every thread of column x gets its column's sum.
__device__ __forceinline__ float ColumnSum(float v, float* red) {
  red[threadIdx.y * kLanes + threadIdx.x] = v;
  __syncthreads();
  float s = 0.f;
  for (int g = 0; g < kGroups; ++g) s += red[g * kLanes + threadIdx.x];
  __syncthreads();
  return s;
}

__global__ void RecurrentKernel(RecurrentParams p) {
  extern __shared__ float smem[];
  AfterPrevious();
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, HD = H * dh, P = p.dims.proj_width, dd = dh * dh;
  const int64_t b = blockIdx.x, h = blockIdx.y, j = int64_t(blockIdx.z) * kLanes + threadIdx.x;
  const bool col = j < dh;
  const int tid = threadIdx.y * kLanes + threadIdx.x;
  float* S = smem;                  // [dh, 32]: S[i][j0 + x]
  float* qs = S + dh * kLanes;      // [dh]
  float* ks = qs + dh;              // [dh]
  float* red = ks + dh;             // [8, 32]
  float* norms = red + kGroups * kLanes;  // [2]: 1/|k|, 1/|q|/sqrt(dh) (gdn)
  const SeqDesc s = p.seqs_ptr[b];
  if (TakesChunkedScan(p, s)) return;
  float* state = GlobalPtr(s.state + (int64_t(p.layer) * H + h) * dd);
  float* saved = s.maybe_span_states != nullptr
                     ? s.maybe_span_states + (int64_t(p.layer) * H + h) * (s.len + 1) * dd
                     : nullptr;
  // Load the slice first and record it after, so that the loads are all in flight at once (a store to
  // `saved` between them could alias `state` for the compiler and serialise them).
  for (int64_t i = threadIdx.y; i < dh; i += kGroups) S[i * kLanes + threadIdx.x] = col ? __ldg(state + i * dh + j) : 0.f;
  if (saved != nullptr && col) {
    float* dst = GlobalPtr(saved);
    for (int64_t i = threadIdx.y; i < dh; i += kGroups) dst[i * dh + j] = S[i * kLanes + threadIdx.x];
  }
  const float a_exp = expf(p.a_log_ptr[h]), dt_bias = p.dt_bias_ptr[h];
  for (int64_t t = 0; t < s.len; ++t) {
    const int64_t r = s.row + t;
    const float* proj = p.proj_ptr + r * P;
    const float* kv = p.kv_ptr + r * 2 * HD;
    for (int64_t d = tid; d < dh; d += kLanes * kGroups) {
      qs[d] = proj[2 * HD + h * dh + d];
      ks[d] = kv[h * dh + d];
    }
    const float v = col ? kv[HD + h * dh + j] : 0.f;
    __syncthreads();
    float out;
    if (!p.dims.gdn) {
      const float dt = Softplus(proj[4 * HD + h] + dt_bias), a = expf(-dt * a_exp);
      float partial = 0.f;
      for (int64_t i = threadIdx.y; i < dh; i += kGroups) {
        float* e = &S[i * kLanes + threadIdx.x];
        const float next = a * *e + dt * ks[i] * v;
        *e = next;
        partial += next * qs[i];
      }
      out = ColumnSum(partial, red) + p.maybe_d_skip_ptr[h] * v;
    } else {
      GdnNorms(ks, qs, dh, tid, norms);
      const float kn_scale = norms[0], qn_scale = norms[1];
      const float beta = Sigmoid(proj[4 * HD + h]);
      const float alpha = expf(-a_exp * Softplus(proj[4 * HD + H + h] + dt_bias));
      float partial = 0.f;
      for (int64_t i = threadIdx.y; i < dh; i += kGroups) partial += ks[i] * kn_scale * S[i * kLanes + threadIdx.x];
      const float kts = ColumnSum(partial, red);  // (kn^T S)[j]
      partial = 0.f;
      for (int64_t i = threadIdx.y; i < dh; i += kGroups) {
        float* e = &S[i * kLanes + threadIdx.x];
        const float kn = ks[i] * kn_scale;
        const float next = alpha * (*e - beta * kn * kts) + beta * kn * v;
        *e = next;
        partial += next * qs[i] * qn_scale;
      }
      out = ColumnSum(partial, red);
    }
    if (threadIdx.y == 0 && col && p.row_mode_ptr[r] == 0) p.out_ptr[r * HD + h * dh + j] = out;
    if (saved != nullptr && col) {
      float* dst = GlobalPtr(saved + (t + 1) * dd);
      for (int64_t i = threadIdx.y; i < dh; i += kGroups) dst[i * dh + j] = S[i * kLanes + threadIdx.x];
    }
    // ColumnSum ended with a barrier, so qs/ks may be overwritten by the next token.
  }
  if (col) {
    for (int64_t i = threadIdx.y; i < dh; i += kGroups) state[i * dh + j] = S[i * kLanes + threadIdx.x];
  }
}

}  // namespace

void Recurrent(const RecurrentParams& params, cudaStream_t stream) {
  if (params.seqs == 0) return;
  RecurrentParams p = params;
  if (p.scan_chunks == 0) p.chunked_min_len = 0;  // no span takes the chunked scan
  const int64_t dh = p.dims.head_dim;
  const size_t smem = (dh * kLanes + 2 * dh + kGroups * kLanes + 2) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(p.seqs), static_cast<unsigned>(p.dims.heads),
                  static_cast<unsigned>(CeilDiv(dh, kLanes)));
  LaunchAfterPrevious(RecurrentKernel, grid, dim3(kLanes, kGroups), smem, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
  if (p.chunked_min_len <= 0) return;
  recurrence::LaunchChunkedScan(p, grid, stream);
}

}  // namespace oryx::kernels::cuda
