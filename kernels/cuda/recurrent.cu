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
// That is the token-by-token recurrence of RecurrentKernel regrouped. Blocks are per (..., head, 32 value
// features j), the state slice S[:, j-slice] in shared memory; threads (32 x 8) = (x: value feature, y:
// group). Per chunk: (1) stage k, q (rows padded to dh+1 floats against bank conflicts), v's slice, the
// gates and cum (gdn: normalise k and q); (2) the decay-masked scores W[t][s] (gdn: and the system's
// A[t][s]) in 4x4 register tiles; (3) gdn: u from S0, then the substitution; (4) the outputs from S0 and W;
// (5) the state update.
//
// mamba2's S_end depends on S0 only through exp(cum_last) S0, so its chunks run in parallel, in three
// kernels: every chunk's own contribution to the state (Mamba2ChunkStatesKernel, (1) and (5) from a zero
// state), the pass over chunks in order that turns those into the state entering each chunk
// (ChunkStatePassKernel, elementwise), and every chunk's outputs from the state entering it
// (Mamba2ChunkOutputsKernel, (1) to (4)). gdn's S_end depends on S0 through the chunk's keys (a dh x dh
// product per chunk), so its chunks run one after the other in one block (GdnChunkedScanKernel).
constexpr int kChunk = 64;
constexpr int kPer = kChunk / kGroups;  // tokens t = y + 8k of a thread in (3) and (4)

// The chunk's shared memory: [C] doubles, then floats.
struct ChunkSmem {
  double* cum;   // [C] cumulative log-decay within the chunk
  float* S;      // [dh, 32] the state slice
  float* Ks;     // [C, dh+1]
  float* Qs;     // [C, dh+1] (not with_q: absent)
  float* Vs;     // [C, 32] v's slice; gdn: then u's
  float* Wm;     // [C, C+1] decay-masked scores (not with_q: absent)
  float* gate;   // [C] mamba2: dt; gdn: beta
  float* ucoef;  // [C] exp(cum_last - cum_s) (mamba2: times dt_s)
  float* Am;     // [C, C+1] gdn: the system's strictly lower part
  int ld;        // dh + 1
};
constexpr int kScoresLd = kChunk + 1;

size_t ChunkSmemBytes(int64_t dh, bool with_q, bool gdn) {
  const int64_t scores = kChunk * kScoresLd;
  const int64_t floats = dh * kLanes + (with_q ? 2 : 1) * kChunk * (dh + 1) + kChunk * kLanes +
                         (with_q ? scores : 0) + (gdn ? scores : 0) + 2 * kChunk;
  return floats * sizeof(float) + kChunk * sizeof(double);
}

__device__ ChunkSmem CarveChunkSmem(double* base, int64_t dh, bool with_q, bool gdn) {
  ChunkSmem m;
  m.ld = static_cast<int>(dh) + 1;
  m.cum = base;
  m.S = reinterpret_cast<float*>(base + kChunk);
  m.Ks = m.S + dh * kLanes;
  m.Qs = with_q ? m.Ks + kChunk * m.ld : nullptr;
  m.Vs = m.Ks + (with_q ? 2 : 1) * kChunk * m.ld;
  m.Wm = with_q ? m.Vs + kChunk * kLanes : nullptr;
  m.gate = m.Vs + kChunk * kLanes + (with_q ? kChunk * kScoresLd : 0);
  m.ucoef = m.gate + kChunk;
  m.Am = gdn ? m.ucoef + kChunk : nullptr;
  return m;
}

// (1) Stages the chunk of n tokens at rows r0.. (q only where m.Qs is set), its gates and cum, and ucoef;
// gdn normalises k and q. Ends with a barrier.
template <bool kGdn>
__device__ void StageChunk(const RecurrentParams& p, const ChunkSmem& m, int64_t h, int64_t j, int64_t r0, int n) {
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, HD = H * dh, P = p.dims.proj_width;
  const int x = threadIdx.x, y = threadIdx.y, tid = y * kLanes + x, ld = m.ld;
  const bool col = j < dh;
  // By cp.async, all in flight at once (plain loads stored to shared memory through these generic pointers
  // would each wait for the one before).
  for (int t = y; t < n; t += kGroups) {
    const int64_t r = r0 + t;
    for (int64_t d = x; d < dh; d += kLanes) {
      CopyWordAsync(m.Ks + t * ld + d, p.kv_ptr + r * 2 * HD + h * dh + d);
      if (m.Qs != nullptr) CopyWordAsync(m.Qs + t * ld + d, p.proj_ptr + r * P + 2 * HD + h * dh + d);
    }
    if (col) {
      CopyWordAsync(m.Vs + t * kLanes + x, p.kv_ptr + r * 2 * HD + HD + h * dh + j);
    } else {
      m.Vs[t * kLanes + x] = 0.f;
    }
  }
  if (tid < kLanes) {  // warp 0: the gates and the inclusive scan of la over the chunk
    const float a_exp = expf(p.a_log_ptr[h]), dt_bias = p.dt_bias_ptr[h];
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
      if (t < n) m.gate[t] = g, m.cum[t] = la;
      carry = __shfl_sync(0xffffffffu, la, kLanes - 1);
    }
    __syncwarp();
    for (int t = x; t < n; t += kLanes) {
      m.ucoef[t] = expf(static_cast<float>(m.cum[n - 1] - m.cum[t])) * (kGdn ? 1.f : m.gate[t]);
    }
  }
  WaitCopies();
  __syncthreads();
  if constexpr (kGdn) {  // kn = k / |k|, qn = q / |q| / sqrt(dh), as GdnNorms; warp y takes tokens y + 8k
    for (int t = y; t < n; t += kGroups) {
      float kk = 0.f, qq = 0.f;
      for (int64_t d = x; d < dh; d += kLanes) kk += m.Ks[t * ld + d] * m.Ks[t * ld + d], qq += m.Qs[t * ld + d] * m.Qs[t * ld + d];
      kk = WarpSum(kk);
      qq = WarpSum(qq);
      const float k_scale = 1.f / sqrtf(kk + 1e-6f), q_scale = 1.f / sqrtf(qq + 1e-6f) / sqrtf(static_cast<float>(dh));
      for (int64_t d = x; d < dh; d += kLanes) m.Ks[t * ld + d] *= k_scale, m.Qs[t * ld + d] *= q_scale;
    }
    __syncthreads();
  }
}

// (2) W[t][s] = exp(cum_t - cum_s) (q_t . k_s) (mamba2: times dt_s) for s <= t, 0 above the diagonal;
// gdn: A[t][s] = beta_t exp(cum_t - cum_s) (k_t . k_s) for s < t. Thread tile: t = tr + 16a, s = tc + 16b.
// No barrier at the end.
template <bool kGdn>
__device__ void ChunkScores(const ChunkSmem& m, int64_t dh, int n) {
  const int tid = threadIdx.y * kLanes + threadIdx.x, tr = tid / 16, tc = tid % 16, ld = m.ld;
  float acc[4][4] = {}, kk[4][4] = {};
  for (int d = 0; d < dh; ++d) {
    float qv[4], kv[4], kt[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      qv[a] = m.Qs[(tr + 16 * a) * ld + d], kv[a] = m.Ks[(tc + 16 * a) * ld + d];
      if constexpr (kGdn) kt[a] = m.Ks[(tr + 16 * a) * ld + d];
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
        const float decay = u <= t ? expf(static_cast<float>(m.cum[t] - m.cum[u])) : 0.f;
        if constexpr (kGdn) {
          m.Wm[t * kScoresLd + u] = decay * acc[a][b];
          m.Am[t * kScoresLd + u] = u < t ? m.gate[t] * decay * kk[a][b] : 0.f;
        } else {
          m.Wm[t * kScoresLd + u] = decay * m.gate[u] * acc[a][b];
        }
      }
    }
  }
}

// (3) and (4): the outputs of tokens t = y + 8k from the state slice entering the chunk (m.S) and the
// scores; gdn first turns Vs into u (the substitution). Ends with a barrier.
template <bool kGdn>
__device__ void ChunkOutputs(const RecurrentParams& p, const ChunkSmem& m, int64_t h, int64_t j, int64_t r0, int n) {
  const int64_t dh = p.dims.head_dim, HD = p.dims.heads * dh;
  const int x = threadIdx.x, y = threadIdx.y, ld = m.ld;
  float from_state[kPer] = {};
  if constexpr (kGdn) {  // u_t = beta_t (v_t - exp(cum_t) S0^T k_t); S0^T q_t summed while S0's column is read
    float s0k[kPer] = {};
    for (int64_t i = 0; i < dh; ++i) {
      const float sv = m.S[i * kLanes + x];
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        from_state[k] += m.Qs[(y + kGroups * k) * ld + i] * sv;
        s0k[k] += m.Ks[(y + kGroups * k) * ld + i] * sv;
      }
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int t = y + kGroups * k;
      if (t < n) m.Vs[t * kLanes + x] = m.gate[t] * (m.Vs[t * kLanes + x] - expf(static_cast<float>(m.cum[t])) * s0k[k]);
    }
    __syncthreads();  // A, and every token's right-hand side
    if (y == 0) {  // warp 0: lane x solves column x on its own, in four partial sums
      for (int t = 1; t < n; ++t) {
        float part[4] = {m.Vs[t * kLanes + x], 0.f, 0.f, 0.f};
        int u = 0;
        for (; u + 4 <= t; u += 4) {
#pragma unroll
          for (int q = 0; q < 4; ++q) part[q] -= m.Am[t * kScoresLd + u + q] * m.Vs[(u + q) * kLanes + x];
        }
        for (; u < t; ++u) part[0] -= m.Am[t * kScoresLd + u] * m.Vs[u * kLanes + x];
        m.Vs[t * kLanes + x] = (part[0] + part[1]) + (part[2] + part[3]);
      }
    }
  } else {
    for (int64_t i = 0; i < dh; ++i) {
      const float sv = m.S[i * kLanes + x];
#pragma unroll
      for (int k = 0; k < kPer; ++k) from_state[k] += m.Qs[(y + kGroups * k) * ld + i] * sv;
    }
  }
  __syncthreads();
  float from_chunk[kPer] = {};
  for (int u = 0; u < n; ++u) {
    const float vv = m.Vs[u * kLanes + x];
#pragma unroll
    for (int k = 0; k < kPer; ++k) from_chunk[k] += m.Wm[(y + kGroups * k) * kScoresLd + u] * vv;
  }
  const float d_skip = kGdn ? 0.f : p.maybe_d_skip_ptr[h];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int t = y + kGroups * k;
    if (t < n && j < dh && p.row_mode_ptr[r0 + t] == 0) {
      float out = expf(static_cast<float>(m.cum[t])) * from_state[k] + from_chunk[k];
      if constexpr (!kGdn) out += d_skip * m.Vs[t * kLanes + x];
      p.out_ptr[(r0 + t) * HD + h * dh + j] = out;
    }
  }
  __syncthreads();
}

// (5) S[i][x] = decay S[i][x] + sum_s ucoef_s k_s[i] u_s[x], i = y + 8m, 8 rows at a time (mamba2: u_s =
// v_s, its dt_s being in ucoef). decay 0 starts from a zero state (whatever S holds). Ends with a barrier.
__device__ void ChunkStateUpdate(const ChunkSmem& m, int64_t dh, int n, float decay) {
  const int x = threadIdx.x, y = threadIdx.y;
  for (int64_t i0 = y; i0 < dh; i0 += kGroups * 8) {
    float acc[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int64_t i = i0 + kGroups * q;
      acc[q] = i < dh && decay != 0.f ? decay * m.S[i * kLanes + x] : 0.f;
    }
    for (int u = 0; u < n; ++u) {
      const float w = m.ucoef[u] * m.Vs[u * kLanes + x];
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const int64_t i = i0 + kGroups * q;
        if (i < dh) acc[q] += m.Ks[u * m.ld + i] * w;
      }
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int64_t i = i0 + kGroups * q;
      if (i < dh) m.S[i * kLanes + x] = acc[q];
    }
  }
  __syncthreads();
}

// gdn: a span's chunks in order, the state slice kept in shared memory.
__global__ void GdnChunkedScanKernel(RecurrentParams p) {
  extern __shared__ double smem_d[];
  AfterPrevious();
  const SeqDesc s = p.seqs_ptr[blockIdx.x];
  if (!TakesChunkedScan(p, s)) return;
  const int64_t dh = p.dims.head_dim, dd = dh * dh;
  const int64_t h = blockIdx.y, j = int64_t(blockIdx.z) * kLanes + threadIdx.x;
  const int x = threadIdx.x, y = threadIdx.y;
  const bool col = j < dh;
  const ChunkSmem m = CarveChunkSmem(smem_d, dh, true, true);
  float* state = s.state + (int64_t(p.layer) * p.dims.heads + h) * dd;
  for (int64_t i = y; i < dh; i += kGroups) m.S[i * kLanes + x] = col ? state[i * dh + j] : 0.f;
  for (int64_t c0 = 0; c0 < s.len; c0 += kChunk) {
    const int n = static_cast<int>(s.len - c0 < kChunk ? s.len - c0 : kChunk);
    StageChunk<true>(p, m, h, j, s.row + c0, n);
    ChunkScores<true>(m, dh, n);
    ChunkOutputs<true>(p, m, h, j, s.row + c0, n);
    ChunkStateUpdate(m, dh, n, expf(static_cast<float>(m.cum[n - 1])));
  }
  if (col) {
    for (int64_t i = y; i < dh; i += kGroups) state[i * dh + j] = m.S[i * kLanes + x];
  }
}

// The chunks that sequence b's span takes in the chunked scan (0: it does not take it).
__device__ __forceinline__ int64_t ChunksOf(const RecurrentParams& p, int64_t b) {
  const SeqDesc& s = p.seqs_ptr[b];
  return TakesChunkedScan(p, s) ? (s.len + kChunk - 1) / kChunk : 0;
}

// Flat chunk `index` over the sequences' chunks in order: its sequence and chunk within it; false past the
// last.
__device__ bool LocateChunk(const RecurrentParams& p, int64_t index, int64_t* seq, int64_t* chunk) {
  for (int64_t b = 0; b < p.seqs; ++b) {
    const int64_t n = ChunksOf(p, b);
    if (index < n) {
      *seq = b, *chunk = index;
      return true;
    }
    index -= n;
  }
  return false;
}

// mamba2 scratch: [chunks, H, dh, dh] chunk states, then [chunks, H] chunk decays exp(cum_last).
__device__ __forceinline__ float* ChunkDecays(const RecurrentParams& p) {
  const int64_t dh = p.dims.head_dim;
  return p.scan_scratch + p.scan_chunks * p.dims.heads * dh * dh;
}

// mamba2 (1), (5): chunk blockIdx.x's own contribution sum_s ucoef_s k_s v_s^T to the state, and its decay.
__global__ void Mamba2ChunkStatesKernel(RecurrentParams p) {
  extern __shared__ double smem_d[];
  AfterPrevious();
  int64_t b = 0, c = 0;
  if (!LocateChunk(p, blockIdx.x, &b, &c)) return;
  const SeqDesc s = p.seqs_ptr[b];
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, dd = dh * dh;
  const int64_t h = blockIdx.y, j = int64_t(blockIdx.z) * kLanes + threadIdx.x;
  const int x = threadIdx.x, y = threadIdx.y;
  const ChunkSmem m = CarveChunkSmem(smem_d, dh, false, false);
  const int64_t c0 = c * kChunk;
  const int n = static_cast<int>(s.len - c0 < kChunk ? s.len - c0 : kChunk);
  StageChunk<false>(p, m, h, j, s.row + c0, n);
  ChunkStateUpdate(m, dh, n, 0.f);
  float* dst = p.scan_scratch + (int64_t(blockIdx.x) * H + h) * dd;
  if (j < dh) {
    for (int64_t i = y; i < dh; i += kGroups) dst[i * dh + j] = m.S[i * kLanes + x];
  }
  if (blockIdx.z == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    ChunkDecays(p)[int64_t(blockIdx.x) * H + h] = expf(static_cast<float>(m.cum[n - 1]));
  }
}

// mamba2: for each state element of (sequence blockIdx.x, head blockIdx.y), the chunks in order: the
// chunk's scratch state becomes the state entering it, and the state moves on by the chunk's decay and
// contribution; the sequence's state ends after its last chunk.
__global__ void ChunkStatePassKernel(RecurrentParams p) {
  AfterPrevious();
  const int64_t b = blockIdx.x;
  const int64_t chunks = ChunksOf(p, b);
  if (chunks == 0) return;
  int64_t first = 0;
  for (int64_t q = 0; q < b; ++q) first += ChunksOf(p, q);
  if (first + chunks > p.scan_chunks) __trap();  // the caller's count is short: never silently skip chunks
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, dd = dh * dh, h = blockIdx.y;
  const int64_t e = int64_t(blockIdx.z) * blockDim.x + threadIdx.x;
  if (e >= dd) return;
  float* state = p.seqs_ptr[b].state + (int64_t(p.layer) * H + h) * dd + e;
  const float* decays = ChunkDecays(p);
  float S = *state;
  // Eight chunks at a time, their loads in flight together.
  constexpr int kBatch = 8;
  for (int64_t c0 = first; c0 < first + chunks; c0 += kBatch) {
    float own[kBatch], decay[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t c = c0 + k;
      if (c < first + chunks) own[k] = p.scan_scratch[(c * H + h) * dd + e], decay[k] = decays[c * H + h];
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t c = c0 + k;
      if (c < first + chunks) {
        p.scan_scratch[(c * H + h) * dd + e] = S;
        S = decay[k] * S + own[k];
      }
    }
  }
  *state = S;
}

// mamba2 (1) to (4): chunk blockIdx.x's outputs from the state entering it.
__global__ void Mamba2ChunkOutputsKernel(RecurrentParams p) {
  extern __shared__ double smem_d[];
  AfterPrevious();
  int64_t b = 0, c = 0;
  if (!LocateChunk(p, blockIdx.x, &b, &c)) return;
  const SeqDesc s = p.seqs_ptr[b];
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, dd = dh * dh;
  const int64_t h = blockIdx.y, j = int64_t(blockIdx.z) * kLanes + threadIdx.x;
  const int x = threadIdx.x, y = threadIdx.y;
  const ChunkSmem m = CarveChunkSmem(smem_d, dh, true, false);
  const float* entering = p.scan_scratch + (int64_t(blockIdx.x) * H + h) * dd;
  for (int64_t i = y; i < dh; i += kGroups) m.S[i * kLanes + x] = j < dh ? entering[i * dh + j] : 0.f;
  const int64_t c0 = c * kChunk;
  const int n = static_cast<int>(s.len - c0 < kChunk ? s.len - c0 : kChunk);
  StageChunk<false>(p, m, h, j, s.row + c0, n);
  ChunkScores<false>(m, dh, n);
  ChunkOutputs<false>(p, m, h, j, s.row + c0, n);  // reads the scores only after its first barrier
}

// Sets a kernel's dynamic shared memory limit to `bytes` once.
template <typename Kernel>
void AllowSmem(Kernel kernel, size_t bytes) {
  ORYX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

void LaunchChunkedScan(const RecurrentParams& p, dim3 grid, cudaStream_t stream) {
  const int64_t dh = p.dims.head_dim;
  const dim3 block(kLanes, kGroups);
  // Up to the shared memory of head_dim kMaxHeadDimCuda (202 KiB for gdn), configured once.
  static const bool configured = [] {
    AllowSmem(GdnChunkedScanKernel, ChunkSmemBytes(kMaxHeadDimCuda, true, true));
    AllowSmem(Mamba2ChunkStatesKernel, ChunkSmemBytes(kMaxHeadDimCuda, false, false));
    AllowSmem(Mamba2ChunkOutputsKernel, ChunkSmemBytes(kMaxHeadDimCuda, true, false));
    return true;
  }();
  (void)configured;
  if (p.dims.gdn) {
    LaunchAfterPrevious(GdnChunkedScanKernel, grid, block, ChunkSmemBytes(dh, true, true), stream, p);
    ORYX_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const dim3 chunks(static_cast<unsigned>(p.scan_chunks), grid.y, grid.z);
  LaunchAfterPrevious(Mamba2ChunkStatesKernel, chunks, block, ChunkSmemBytes(dh, false, false), stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
  constexpr int kPassThreads = 256;
  const dim3 pass(grid.x, grid.y, static_cast<unsigned>(CeilDiv(dh * dh, kPassThreads)));
  LaunchAfterPrevious(ChunkStatePassKernel, pass, dim3(kPassThreads), 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
  LaunchAfterPrevious(Mamba2ChunkOutputsKernel, chunks, block, ChunkSmemBytes(dh, true, false), stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

int64_t ChunkedScanChunks(const std::vector<int64_t>& span_lens, int32_t chunked_min_len) {
  int64_t chunks = 0;
  for (int64_t len : span_lens) {
    if (chunked_min_len > 0 && len >= chunked_min_len) chunks += (len + kChunk - 1) / kChunk;
  }
  return chunks;
}

int64_t ChunkedScanScratchFloats(const ModelDims& dims, int64_t chunks) {
  if (dims.gdn) return 0;
  const int64_t dh = dims.head_dim;
  return chunks * dims.heads * (dh * dh + 1);
}

void Recurrent(const RecurrentParams& params, cudaStream_t stream) {
  if (params.seqs == 0) return;
  RecurrentParams p = params;
  if (!p.dims.gdn && p.scan_chunks == 0) p.chunked_min_len = 0;  // no mamba2 span takes the chunked scan
  const int64_t dh = p.dims.head_dim;
  const size_t smem = (dh * kLanes + 2 * dh + kGroups * kLanes + 2) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(p.seqs), static_cast<unsigned>(p.dims.heads),
                  static_cast<unsigned>(CeilDiv(dh, kLanes)));
  LaunchAfterPrevious(RecurrentKernel, grid, dim3(kLanes, kGroups), smem, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
  if (p.chunked_min_len <= 0) return;
  LaunchChunkedScan(p, grid, stream);
}

}  // namespace oryx::kernels::cuda
