// The mamba2 and gdn recurrences over every sequence's span (DESIGN.md §2). One block per (sequence,
// head, 32 value features j): the block keeps S[:, j-slice] (dh x 32 fp32) in shared memory for the whole
// span, so a verify span reads and writes the state once, plus once per token when it is recorded for
// rollback. Threads: 32 value features x 8 groups of key features i; reductions over i go through shared
// memory.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kLanes = 32, kGroups = 8;

// Sum over the 8 key-feature groups of each value feature; every thread of column x gets its column's sum.
__device__ __forceinline__ float ColumnSum(float v, float* red) {
  red[threadIdx.y * kLanes + threadIdx.x] = v;
  __syncthreads();
  float s = 0.f;
  for (int g = 0; g < kGroups; ++g) s += red[g * kLanes + threadIdx.x];
  __syncthreads();
  return s;
}

// Whether ChunkedScanKernel (not RecurrentKernel) runs this sequence's span.
__device__ __forceinline__ bool TakesChunkedScan(const RecurrentParams& p, const SeqDesc& s) {
  return p.chunked_min_len > 0 && s.maybe_span_states == nullptr && s.len >= p.chunked_min_len;
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
  float* state = s.state + (int64_t(p.layer) * H + h) * dd;
  float* saved = s.maybe_span_states != nullptr
                     ? s.maybe_span_states + (int64_t(p.layer) * H + h) * (s.len + 1) * dd
                     : nullptr;
  // Load the slice first and record it after, so that the loads are all in flight at once (a store to
  // `saved` between them could alias `state` for the compiler and serialise them).
  for (int64_t i = threadIdx.y; i < dh; i += kGroups) S[i * kLanes + threadIdx.x] = col ? __ldg(state + i * dh + j) : 0.f;
  if (saved != nullptr && col) {
    for (int64_t i = threadIdx.y; i < dh; i += kGroups) saved[i * dh + j] = S[i * kLanes + threadIdx.x];
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
      float* dst = saved + (t + 1) * dd;
      for (int64_t i = threadIdx.y; i < dh; i += kGroups) dst[i * dh + j] = S[i * kLanes + threadIdx.x];
    }
    // ColumnSum ended with a barrier, so qs/ks may be overwritten by the next token.
  }
  if (col) {
    for (int64_t i = threadIdx.y; i < dh; i += kGroups) state[i * dh + j] = S[i * kLanes + threadIdx.x];
  }
}


// A long span in chunks of kChunk tokens. With la_t the log of the token's decay (mamba2: -dt_t exp(A_log);
// gdn: log alpha_t) and cum_t its running sum within the chunk (in double, so that differences of nearby
// cum_t lose nothing to cancellation), a chunk starting from state S0 gives, for its tokens t and s <= t,
//   out_t = exp(cum_t) S0^T q_t + sum_{s<=t} exp(cum_t - cum_s) (q_t . k_s) u_s      (+ D v_t for mamba2)
//   S_end = exp(cum_last) S0 + sum_s exp(cum_last - cum_s) k_s u_s^T
// where u_s is what token s writes into the state:
//   mamba2 (SSD form): u_s = dt_s v_s;
//   gdn (the chunked delta rule, with k and q L2-normalised): u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t),
//     which over the chunk is the unit lower-triangular system
//       u_t + sum_{s<t} beta_t exp(cum_t - cum_s) (k_t . k_s) u_s = beta_t (v_t - exp(cum_t) S0^T k_t),
//     solved by forward substitution (each value feature's column on its own).
// That is the token-by-token recurrence of RecurrentKernel regrouped. Chunks run in order; one block per
// (sequence, head, 32 value features j) as in RecurrentKernel, the state slice S[:, j-slice] in shared
// memory. Threads (32 x 8) = (x: value feature, y: group). Per chunk: (1) stage k, q (rows padded to dh+1
// floats against bank conflicts), v's slice, the gates and cum (gdn: normalise k and q); (2) the
// decay-masked scores W[t][s] (gdn: and the system's A[t][s]) in 4x4 register tiles; (3) gdn: u from S0,
// then the substitution; (4) the outputs from S0 and W; (5) the state update.
constexpr int kChunk = 64;

size_t ChunkedScanSmem(int64_t dh, bool gdn) {
  const int64_t scores = kChunk * (kChunk + 1);
  return (dh * kLanes + 2 * kChunk * (dh + 1) + kChunk * kLanes + (gdn ? 2 : 1) * scores + 2 * kChunk) * sizeof(float) +
         kChunk * sizeof(double);
}

template <bool kGdn>
__global__ void ChunkedScanKernel(RecurrentParams p) {
  extern __shared__ double smem_d[];
  AfterPrevious();
  const SeqDesc s = p.seqs_ptr[blockIdx.x];
  if (!TakesChunkedScan(p, s)) return;
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, HD = H * dh, P = p.dims.proj_width, dd = dh * dh;
  const int64_t h = blockIdx.y, j = int64_t(blockIdx.z) * kLanes + threadIdx.x;
  const int x = threadIdx.x, y = threadIdx.y, tid = y * kLanes + x;
  const bool col = j < dh;
  const int ld = static_cast<int>(dh) + 1, lw = kChunk + 1;
  double* cum = smem_d;                                  // [C] cumulative log-decay within the chunk
  float* S = reinterpret_cast<float*>(cum + kChunk);     // [dh, 32]
  float* Ks = S + dh * kLanes;                           // [C, dh+1]
  float* Qs = Ks + kChunk * ld;                          // [C, dh+1]
  float* Vs = Qs + kChunk * ld;                          // [C, 32] v's slice; gdn: then u's
  float* Wm = Vs + kChunk * kLanes;                      // [C, C+1] decay-masked scores
  float* gate = Wm + kChunk * lw;                        // [C] mamba2: dt; gdn: beta
  float* ucoef = gate + kChunk;                          // [C] exp(cum_last - cum_s) (mamba2: times dt_s)
  float* Am = ucoef + kChunk;                            // [C, C+1] gdn: the system's strictly lower part
  float* state = s.state + (int64_t(p.layer) * H + h) * dd;
  for (int64_t i = y; i < dh; i += kGroups) S[i * kLanes + x] = col ? state[i * dh + j] : 0.f;
  const float a_exp = expf(p.a_log_ptr[h]), dt_bias = p.dt_bias_ptr[h];
  const float d_skip = kGdn ? 0.f : p.maybe_d_skip_ptr[h];
  constexpr int kPer = kChunk / kGroups;  // tokens t = y + 8k of a thread in (3) and (4)
  for (int64_t c0 = 0; c0 < s.len; c0 += kChunk) {
    const int n = static_cast<int>(s.len - c0 < kChunk ? s.len - c0 : kChunk);
    const int64_t r0 = s.row + c0;
    // (1) Stage the chunk.
    for (int64_t e = tid; e < n * dh; e += kLanes * kGroups) {
      const int64_t t = e / dh, d = e - t * dh, r = r0 + t;
      Ks[t * ld + d] = p.kv_ptr[r * 2 * HD + h * dh + d];
      Qs[t * ld + d] = p.proj_ptr[r * P + 2 * HD + h * dh + d];
    }
    for (int t = y; t < n; t += kGroups) Vs[t * kLanes + x] = col ? p.kv_ptr[(r0 + t) * 2 * HD + HD + h * dh + j] : 0.f;
    if (tid < kLanes) {  // warp 0: the gates and the inclusive scan of la over the chunk
      double carry = 0;
      for (int base = 0; base < n; base += kLanes) {
        const int t = base + x;
        float g = 0.f;
        double la = 0;
        if (t < n) {
          const float* gates = p.proj_ptr + (r0 + t) * P + 4 * HD;
          if constexpr (kGdn) {  // the float exponents RecurrentKernel takes expf of
            g = Sigmoid(gates[h]);
            la = static_cast<double>(-a_exp * Softplus(gates[H + h] + dt_bias));
          } else {
            g = Softplus(gates[h] + dt_bias);
            la = static_cast<double>(-g * a_exp);
          }
        }
        for (int off = 1; off < kLanes; off *= 2) {
          const double up = __shfl_up_sync(0xffffffffu, la, off);
          if (x >= off) la += up;
        }
        la += carry;
        if (t < n) gate[t] = g, cum[t] = la;
        carry = __shfl_sync(0xffffffffu, la, kLanes - 1);
      }
    }
    __syncthreads();
    if constexpr (kGdn) {  // kn = k / |k|, qn = q / |q| / sqrt(dh), as GdnNorms; warp y takes tokens y + 8k
      for (int t = y; t < n; t += kGroups) {
        float kk = 0.f, qq = 0.f;
        for (int64_t d = x; d < dh; d += kLanes) kk += Ks[t * ld + d] * Ks[t * ld + d], qq += Qs[t * ld + d] * Qs[t * ld + d];
        kk = WarpSum(kk);
        qq = WarpSum(qq);
        const float k_scale = 1.f / sqrtf(kk + 1e-6f), q_scale = 1.f / sqrtf(qq + 1e-6f) / sqrtf(static_cast<float>(dh));
        for (int64_t d = x; d < dh; d += kLanes) Ks[t * ld + d] *= k_scale, Qs[t * ld + d] *= q_scale;
      }
      __syncthreads();
    }
    // (2) W[t][s] = exp(cum_t - cum_s) (q_t . k_s) (mamba2: times dt_s) for s <= t, 0 above the diagonal;
    // gdn: A[t][s] = beta_t exp(cum_t - cum_s) (k_t . k_s) for s < t. Thread tile: t = tr + 16a, s = tc + 16b.
    {
      const int tr = tid / 16, tc = tid % 16;
      float acc[4][4] = {}, kk[4][4] = {};
      for (int d = 0; d < dh; ++d) {
        float qv[4], kv[4], kt[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          qv[a] = Qs[(tr + 16 * a) * ld + d], kv[a] = Ks[(tc + 16 * a) * ld + d];
          if constexpr (kGdn) kt[a] = Ks[(tr + 16 * a) * ld + d];
        }
#pragma unroll
        for (int a = 0; a < 4; ++a) {
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            acc[a][b] += qv[a] * kv[b];
            if constexpr (kGdn) kk[a][b] += kt[a] * kv[b];
          }
        }
      }
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int t = tr + 16 * a;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const int u = tc + 16 * b;
          if (t < n && u < n) {
            const float decay = u <= t ? expf(static_cast<float>(cum[t] - cum[u])) : 0.f;
            if constexpr (kGdn) {
              Wm[t * lw + u] = decay * acc[a][b];
              Am[t * lw + u] = u < t ? gate[t] * decay * kk[a][b] : 0.f;
            } else {
              Wm[t * lw + u] = decay * gate[u] * acc[a][b];
            }
          }
        }
      }
      if (tid < n) ucoef[tid] = expf(static_cast<float>(cum[n - 1] - cum[tid])) * (kGdn ? 1.f : gate[tid]);
    }
    // (3) gdn: u_t = beta_t (v_t - exp(cum_t) S0^T k_t), then the substitution. from_state (S0^T q_t) is
    // summed here too, while S0's column is read.
    float from_state[kPer] = {};
    if constexpr (kGdn) {
      float s0k[kPer] = {};
      for (int64_t i = 0; i < dh; ++i) {
        const float sv = S[i * kLanes + x];
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          from_state[k] += Qs[(y + kGroups * k) * ld + i] * sv;
          s0k[k] += Ks[(y + kGroups * k) * ld + i] * sv;
        }
      }
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int t = y + kGroups * k;
        if (t < n) Vs[t * kLanes + x] = gate[t] * (Vs[t * kLanes + x] - expf(static_cast<float>(cum[t])) * s0k[k]);
      }
      __syncthreads();  // A, and every token's right-hand side
      if (y == 0) {  // warp 0: lane x solves column x on its own, in four partial sums
        for (int t = 1; t < n; ++t) {
          float part[4] = {Vs[t * kLanes + x], 0.f, 0.f, 0.f};
          int u = 0;
          for (; u + 4 <= t; u += 4) {
#pragma unroll
            for (int m = 0; m < 4; ++m) part[m] -= Am[t * lw + u + m] * Vs[(u + m) * kLanes + x];
          }
          for (; u < t; ++u) part[0] -= Am[t * lw + u] * Vs[u * kLanes + x];
          Vs[t * kLanes + x] = (part[0] + part[1]) + (part[2] + part[3]);
        }
      }
    } else {
      for (int64_t i = 0; i < dh; ++i) {
        const float sv = S[i * kLanes + x];
#pragma unroll
        for (int k = 0; k < kPer; ++k) from_state[k] += Qs[(y + kGroups * k) * ld + i] * sv;
      }
    }
    __syncthreads();
    // (4) Outputs of tokens t = y + 8k.
    {
      float from_chunk[kPer] = {};
      for (int u = 0; u < n; ++u) {
        const float vv = Vs[u * kLanes + x];
#pragma unroll
        for (int k = 0; k < kPer; ++k) from_chunk[k] += Wm[(y + kGroups * k) * lw + u] * vv;
      }
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int t = y + kGroups * k;
        if (t < n && col && p.row_mode_ptr[r0 + t] == 0) {
          float out = expf(static_cast<float>(cum[t])) * from_state[k] + from_chunk[k];
          if constexpr (!kGdn) out += d_skip * Vs[t * kLanes + x];
          p.out_ptr[(r0 + t) * HD + h * dh + j] = out;
        }
      }
    }
    __syncthreads();
    // (5) S[i][x] = exp(cum_last) S0[i][x] + sum_s ucoef_s k_s[i] u_s[x], i = y + 8m, 8 rows at a time
    // (mamba2: u_s = v_s, its dt_s being in ucoef).
    {
      const float decay = expf(static_cast<float>(cum[n - 1]));
      for (int64_t i0 = y; i0 < dh; i0 += kGroups * 8) {
        float acc[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const int64_t i = i0 + kGroups * m;
          acc[m] = i < dh ? decay * S[i * kLanes + x] : 0.f;
        }
        for (int u = 0; u < n; ++u) {
          const float w = ucoef[u] * Vs[u * kLanes + x];
#pragma unroll
          for (int m = 0; m < 8; ++m) {
            const int64_t i = i0 + kGroups * m;
            if (i < dh) acc[m] += Ks[u * ld + i] * w;
          }
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const int64_t i = i0 + kGroups * m;
          if (i < dh) S[i * kLanes + x] = acc[m];
        }
      }
    }
    __syncthreads();
  }
  if (col) {
    for (int64_t i = y; i < dh; i += kGroups) state[i * dh + j] = S[i * kLanes + x];
  }
}

template <bool kGdn>
void LaunchChunkedScan(const RecurrentParams& p, dim3 grid, cudaStream_t stream) {
  // Up to the shared memory of head_dim kMaxHeadDimCuda (202 KiB for gdn), configured once.
  static const bool configured = [] {
    ORYX_CUDA_CHECK(cudaFuncSetAttribute(ChunkedScanKernel<kGdn>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(ChunkedScanSmem(kMaxHeadDimCuda, kGdn))));
    return true;
  }();
  (void)configured;
  LaunchAfterPrevious(ChunkedScanKernel<kGdn>, grid, dim3(kLanes, kGroups), ChunkedScanSmem(p.dims.head_dim, kGdn),
                      stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void Recurrent(const RecurrentParams& params, cudaStream_t stream) {
  if (params.seqs == 0) return;
  RecurrentParams p = params;
  const int64_t dh = p.dims.head_dim;
  const size_t smem = (dh * kLanes + 2 * dh + kGroups * kLanes + 2) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(p.seqs), static_cast<unsigned>(p.dims.heads),
                  static_cast<unsigned>(CeilDiv(dh, kLanes)));
  LaunchAfterPrevious(RecurrentKernel, grid, dim3(kLanes, kGroups), smem, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
  if (p.chunked_min_len <= 0) return;
  if (p.dims.gdn) {
    LaunchChunkedScan<true>(p, grid, stream);
  } else {
    LaunchChunkedScan<false>(p, grid, stream);
  }
}

}  // namespace oryx::kernels::cuda
