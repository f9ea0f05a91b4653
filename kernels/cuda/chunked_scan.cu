// The chunked scans of long spans for both linear mixers (DESIGN.md §2; Recurrent in ops_cuda.h says which
// spans take them): every chunk of 64 tokens in parallel, but for one pass over each span's chunks in order.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/recurrence.cuh"

namespace oryx::kernels::cuda {
namespace recurrence {

namespace {

// A long span in chunks of kChunk tokens. With la_t the log of the token's decay (mamba2: -dt_t exp(A_log);
// gdn: log alpha_t) and cum_t its running sum within the chunk (in double, so that differences of nearby
// cum_t lose nothing to cancellation), a chunk starting from state S0 gives, for its tokens t and s <= t,
//   out_t = exp(cum_t) S0^T q_t + sum_{s<=t} exp(cum_t - cum_s) (q_t . k_s) u_s      (+ D v_t for mamba2)
//   S_end = exp(cum_last) S0 + sum_s exp(cum_last - cum_s) k_s u_s^T
// where u_s is what token s writes into the state:
//   mamba2 (SSD form): u_s = dt_s v_s;
//   gdn (the chunked delta rule, with k and q L2-normalised): u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t),
//     which over the chunk is the unit lower-triangular system (I + A) u = diag(beta) V - diag(beta e^cum) K S0
//     with A[t][s] = beta_t exp(cum_t - cum_s) (k_t . k_s) for s < t. Its solution is u = U - W S0 with
//     (I + A) [U W] = [diag(beta) V, diag(beta e^cum) K] (the UT transform's form): U and W do not depend
//     on S0.
// That is the token-by-token recurrence of RecurrentKernel regrouped. All chunks run in parallel except for
// a pass over each span's chunks in order that carries the state from one chunk to the next:
//   mamba2: every chunk's own contribution sum_s exp(cum_last - cum_s) k_s u_s^T (Mamba2ChunkStatesKernel);
//     the pass, elementwise: S <- exp(cum_last) S + contribution (ChunkStatePassKernel);
//   gdn: every chunk's U and W, by forward substitution over its 2 dh columns (GdnChunkSolveKernel); the
//     pass: u = U - W S, then S <- exp(cum_last) S + sum_s exp(cum_last - cum_s) k_s u_s^T, two products
//     per chunk (GdnChunkPassKernel);
// each records the state entering every chunk, and every chunk's outputs follow from it
// (ChunkOutputsKernel), with the decay-masked scores W[t][s] computed once per chunk and head
// (ChunkScoresKernel). Blocks that hold a state slice S[:, j-slice] in shared memory are per (chunk or
// sequence, head, 32 value features j; gdn's pass: 16), threads (32 x 8) = (x: value feature, y: group);
// the others per (chunk, head). A chunk is staged by cp.async: k, q, v's slice, the gates and cum (gdn: k
// and q normalised). Rows of k, q, W and the scores are padded to 16 bytes and read as float4s; products
// of rows come in 4x4 register tiles.
constexpr int kChunk = 64;
constexpr int kPer = kChunk / kGroups;  // tokens t = y + 8k of a thread
constexpr int kScoresLd = kChunk + 4;  // rows of 16 bytes' multiple, read as float4 along s

// Which parts of ChunkSmem a kernel uses (the chunk's gates, cum and ucoef always).
enum ChunkPart : unsigned {
  kPartS = 1,        // the state slice
  kPartQ = 2,        // q
  kPartV = 4,        // v's slice (or u's)
  kPartScores = 8,   // W
  kPartA = 16,       // gdn's system, in k's place (written once k is read; the region sized for either)
  kPartSolve = 32,   // gdn's right-hand sides and solution [C, 2dh]
  kPartW = 64,       // gdn's W rows
  kPartK = 128,      // k
};

// A chunk's shared memory, carved from `base` (null: only count the bytes).
struct ChunkSmem {
  double* cum;   // [C] cumulative log-decay within the chunk
  float* S;      // [dh, 32] the state slice
  float* Ks;     // [C, ld]
  float* Qs;     // [C, ld]
  float* Vs;     // [C, 32] v's slice (gdn: u's)
  float* Wm;     // [C, C+4] decay-masked scores
  float* Am;     // [C, C+4] gdn: the system's strictly lower part (Ks's region)
  float* X;      // [C, 2dh] gdn: [beta V, beta e^cum K], then [U W]
  float* Wg;     // [C, ld] gdn: W
  float* gate;   // [C] mamba2: dt; gdn: beta
  float* ucoef;  // [C] exp(cum_last - cum_s) (mamba2: times dt_s)
  int pad;       // dh rounded up to 4: the rows of S and the columns of Ks, Qs, Wg, read as float4 (past dh: 0)
  int ld;        // pad + 4: rows 16-byte aligned
  size_t bytes;
};

__host__ __device__ inline ChunkSmem LayoutChunkSmem(char* base, int64_t dh, unsigned parts) {
  ChunkSmem m{};
  m.pad = static_cast<int>((dh + 3) / 4 * 4);
  m.ld = m.pad + 4;
  size_t at = 0;
  auto take = [&](size_t floats, unsigned part) -> float* {
    if (part != 0 && (parts & part) == 0) return nullptr;
    float* p = base != nullptr ? reinterpret_cast<float*>(base + at) : nullptr;
    at += (floats * sizeof(float) + 15) / 16 * 16;
    return p;
  };
  m.cum = base != nullptr ? reinterpret_cast<double*>(base) : nullptr;
  at = kChunk * sizeof(double);
  m.S = take(m.pad * kLanes, kPartS);
  const size_t k_floats = size_t(kChunk) * m.ld, a_floats = size_t(kChunk) * kScoresLd;
  m.Ks = take((parts & kPartA) != 0 && a_floats > k_floats ? a_floats : k_floats, kPartK);
  m.Qs = take(kChunk * m.ld, kPartQ);
  m.Vs = take(kChunk * kLanes, kPartV);
  m.Wm = take(kChunk * kScoresLd, kPartScores);
  m.Am = (parts & kPartA) != 0 ? m.Ks : nullptr;
  m.X = take(kChunk * 2 * dh, kPartSolve);
  m.Wg = take(kChunk * m.ld, kPartW);
  m.gate = take(kChunk, 0);
  m.ucoef = take(kChunk, 0);
  m.bytes = at;
  return m;
}

// Stages the chunk of n tokens at rows r0.. (q and v's slice where m has them), its gates and cum, and
// ucoef; gdn normalises k and q. Ends with a barrier.
template <bool kGdn>
__device__ void StageChunk(const RecurrentParams& p, const ChunkSmem& m, int64_t h, int64_t j, int64_t r0, int n) {
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, HD = H * dh, P = p.dims.proj_width;
  const int x = threadIdx.x, y = threadIdx.y, tid = y * kLanes + x, ld = m.ld;
  // By cp.async, all in flight at once (plain loads stored to shared memory through these generic pointers
  // would each wait for the one before).
  for (int t = y; t < n; t += kGroups) {
    const int64_t r = r0 + t;
    for (int64_t d = x; d < dh; d += kLanes) {
      if (m.Ks != nullptr) CopyWordAsync(m.Ks + t * ld + d, p.kv_ptr + r * 2 * HD + h * dh + d);
      if (m.Qs != nullptr) CopyWordAsync(m.Qs + t * ld + d, p.proj_ptr + r * P + 2 * HD + h * dh + d);
    }
    for (int64_t d = dh + x; d < m.pad; d += kLanes) {
      if (m.Ks != nullptr) m.Ks[t * ld + d] = 0.f;
      if (m.Qs != nullptr) m.Qs[t * ld + d] = 0.f;
    }
    if (m.Vs == nullptr) continue;
    if (j < dh) {
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
  if constexpr (kGdn) {  // k and q normalised (GdnKeyScale, GdnQueryScale); warp y takes tokens y + 8k
    for (int t = y; t < n; t += kGroups) {
      float kk = 0.f, qq = 0.f;
      for (int64_t d = x; d < dh; d += kLanes) {
        if (m.Ks != nullptr) kk += m.Ks[t * ld + d] * m.Ks[t * ld + d];
        if (m.Qs != nullptr) qq += m.Qs[t * ld + d] * m.Qs[t * ld + d];
      }
      kk = WarpSum(kk);
      qq = WarpSum(qq);
      const float k_scale = GdnKeyScale(kk), q_scale = GdnQueryScale(qq, dh);
      for (int64_t d = x; d < dh; d += kLanes) {
        if (m.Ks != nullptr) m.Ks[t * ld + d] *= k_scale;
        if (m.Qs != nullptr) m.Qs[t * ld + d] *= q_scale;
      }
    }
    __syncthreads();
  }
}

// The decay-masked products of the chunk's rows in 4x4 register tiles (thread tile t = tr + 16a, s = tc +
// 16b), below the diagonal: kScores: W[t][s] = exp(cum_t - cum_s) (q_t . k_s) for s <= t (mamba2: times
// dt_s); otherwise gdn's A[t][s] = beta_t exp(cum_t - cum_s) (k_t . k_s) for s < t. kStoreOverInputs: a
// barrier between the products and their stores (which may then overwrite the rows). No barrier at the end.
template <bool kScores, bool kGdn, bool kStoreOverInputs = false>
__device__ void ChunkProducts(const ChunkSmem& m, int n) {
  const int tid = threadIdx.y * kLanes + threadIdx.x, tr = tid / 16, tc = tid % 16, ld = m.ld;
  const float* rows = kScores ? m.Qs : m.Ks;
  float acc[4][4] = {};
  for (int d = 0; d < m.pad; d += 4) {  // the columns past dh are 0
    float4 a_val[4], b_val[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      a_val[a] = *reinterpret_cast<const float4*>(rows + (tr + 16 * a) * ld + d);
      b_val[a] = *reinterpret_cast<const float4*>(m.Ks + (tc + 16 * a) * ld + d);
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        acc[a][b] += a_val[a].x * b_val[b].x;
        acc[a][b] += a_val[a].y * b_val[b].y;
        acc[a][b] += a_val[a].z * b_val[b].z;
        acc[a][b] += a_val[a].w * b_val[b].w;
      }
    }
  }
  if constexpr (kStoreOverInputs) __syncthreads();
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int t = tr + 16 * a;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int u = tc + 16 * b;
      if (t >= n || u >= n) continue;
      const float decay = u <= t ? expf(static_cast<float>(m.cum[t] - m.cum[u])) : 0.f;
      if constexpr (kScores) {
        m.Wm[t * kScoresLd + u] = kGdn ? decay * acc[a][b] : decay * m.gate[u] * acc[a][b];
      } else {
        m.Am[t * kScoresLd + u] = u < t ? m.gate[t] * decay * acc[a][b] : 0.f;
      }
    }
  }
}

// acc[k] += sum_{i < len} rows[k * row_step + i] * column[i * kStride] for kRows rows: the rows (16-byte
// aligned, all lanes of a warp on the same ones) read as float4 broadcasts, the column (each lane its own)
// as floats, four i at a time, then the last len % 4 one by one.
template <int kRows, int kStride>
__device__ __forceinline__ void RowsTimesColumn(const float* rows, int row_step, const float* column, int64_t len,
                                                float (&acc)[kRows]) {
  int64_t i = 0;
  for (; i + 4 <= len; i += 4) {
    const float c0 = column[i * kStride], c1 = column[(i + 1) * kStride], c2 = column[(i + 2) * kStride],
                c3 = column[(i + 3) * kStride];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const float4 r = *reinterpret_cast<const float4*>(rows + k * row_step + i);
      acc[k] += r.x * c0;
      acc[k] += r.y * c1;
      acc[k] += r.z * c2;
      acc[k] += r.w * c3;
    }
  }
  for (; i < len; ++i) {
    const float c = column[i * kStride];
#pragma unroll
    for (int k = 0; k < kRows; ++k) acc[k] += rows[k * row_step + i] * c;
  }
}

// The outputs of tokens t = y + 8k from the state slice entering the chunk (m.S), the scores and m.Vs (v's
// slice for mamba2, u's for gdn). Ends with a barrier.
template <bool kGdn>
__device__ void ChunkOutputs(const RecurrentParams& p, const ChunkSmem& m, int64_t h, int64_t j, int64_t r0, int n) {
  const int64_t dh = p.dims.head_dim, HD = p.dims.heads * dh;
  const int x = threadIdx.x, y = threadIdx.y, ld = m.ld;
  float from_state[kPer] = {}, from_chunk[kPer] = {};
  RowsTimesColumn<kPer, kLanes>(m.Qs + y * ld, kGroups * ld, m.S + x, m.pad, from_state);
  RowsTimesColumn<kPer, kLanes>(m.Wm + y * kScoresLd, kGroups * kScoresLd, m.Vs + x, n, from_chunk);
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

// S[i][x] = decay S[i][x] + sum_s ucoef_s k_s[i] u_s[x] (mamba2: u_s = v_s, its dt_s being in ucoef) for
// i < dh, in quads of rows 4q..4q+3, q = y + kRowGroups m, four quads at a time (k_s's quad read as a float4
// broadcast); S and u's rows kCols floats apart (threads kCols x kRowGroups). decay 0 starts from a zero
// state (whatever S holds). S's rows past dh stay as they are. Ends with a barrier.
template <int kCols = kLanes, int kRowGroups = kGroups>
__device__ void ChunkStateUpdate(const ChunkSmem& m, int64_t dh, int n, float decay) {
  constexpr int kQuads = 4;
  const int x = threadIdx.x, y = threadIdx.y, quads = m.pad / 4;
  for (int q0 = y; q0 < quads; q0 += kRowGroups * kQuads) {
    float acc[kQuads][4];
#pragma unroll
    for (int a = 0; a < kQuads; ++a) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t i = 4 * (q0 + kRowGroups * a) + e;
        acc[a][e] = i < dh && decay != 0.f ? decay * m.S[i * kCols + x] : 0.f;
      }
    }
    for (int u = 0; u < n; ++u) {
      const float w = m.ucoef[u] * m.Vs[u * kCols + x];
#pragma unroll
      for (int a = 0; a < kQuads; ++a) {
        const int q = q0 + kRowGroups * a;
        if (q >= quads) break;
        const float4 k = *reinterpret_cast<const float4*>(m.Ks + u * m.ld + 4 * q);
        acc[a][0] += k.x * w;
        acc[a][1] += k.y * w;
        acc[a][2] += k.z * w;
        acc[a][3] += k.w * w;
      }
    }
#pragma unroll
    for (int a = 0; a < kQuads; ++a) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t i = 4 * (q0 + kRowGroups * a) + e;
        if (i < dh) m.S[i * kCols + x] = acc[a][e];
      }
    }
  }
  __syncthreads();
}

// The tokens of chunk c of a span of len tokens.
__device__ __forceinline__ int ChunkLen(int64_t len, int64_t c) {
  return static_cast<int>(len - c * kChunk < kChunk ? len - c * kChunk : kChunk);
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

// Sequence b's first flat chunk; traps when the caller's count falls short of its chunks (never silently
// skip chunks).
__device__ int64_t FirstChunkOf(const RecurrentParams& p, int64_t b) {
  int64_t first = 0;
  for (int64_t q = 0; q < b; ++q) first += ChunksOf(p, q);
  if (first + ChunksOf(p, b) > p.scan_chunks) __trap();
  return first;
}

// The scratch (ChunkedScanScratchFloats), per flat chunk c and head h, each region padded to a multiple of
// 4 floats (the scores are read in 16-byte pieces):
//   states [chunks, H, dh, dh]: the state entering the chunk (mamba2: first the chunk's own contribution)
//   decays [chunks, H]:         exp(cum_last)
//   scores [chunks, H, C, C]:   W, the decay-masked scores
//   gdn: keys [chunks, H, C, dh] (normalised), w [chunks, H, C, dh], u [chunks, H, C, dh] (U, then u),
//        ucoef [chunks, H, C]
__host__ __device__ constexpr int64_t Pad4(int64_t floats) { return (floats + 3) / 4 * 4; }
struct ScanScratch {
  float *states, *decays, *scores, *keys, *w, *u, *ucoef;
  __device__ explicit ScanScratch(const RecurrentParams& p) {
    const int64_t dh = p.dims.head_dim, rows = p.scan_chunks * p.dims.heads;
    states = p.scan_scratch;
    decays = states + Pad4(rows * dh * dh);
    scores = decays + Pad4(rows);
    keys = scores + rows * kChunk * kChunk;
    w = keys + rows * kChunk * dh;
    u = w + rows * kChunk * dh;
    ucoef = u + rows * kChunk * dh;
  }
};

// Chunk blockIdx.x of head blockIdx.y: its sequence, first row and length; false for blocks past the last.
struct ChunkAt {
  int64_t seq, row;
  int n;
  int64_t h = blockIdx.y;                                      // the head
  int64_t j = int64_t(blockIdx.z) * kLanes + threadIdx.x;      // the thread's value feature (slice blockIdx.z)
};
__device__ bool LocateBlockChunk(const RecurrentParams& p, ChunkAt* at) {
  int64_t c = 0;
  if (!LocateChunk(p, blockIdx.x, &at->seq, &c)) return false;
  const SeqDesc& s = p.seqs_ptr[at->seq];
  at->row = s.row + c * kChunk;
  at->n = ChunkLen(s.len, c);
  return true;
}

// mamba2: chunk blockIdx.x's own contribution sum_s ucoef_s k_s v_s^T to the state (value slice
// blockIdx.z), and its decay.
__global__ void Mamba2ChunkStatesKernel(RecurrentParams p) {
  extern __shared__ double smem_d[];
  AfterPrevious();
  ChunkAt at;
  if (!LocateBlockChunk(p, &at)) return;
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, h = at.h, j = at.j;
  const ChunkSmem m = LayoutChunkSmem(reinterpret_cast<char*>(smem_d), dh, kPartK | kPartS | kPartV);
  StageChunk<false>(p, m, h, j, at.row, at.n);
  ChunkStateUpdate(m, dh, at.n, 0.f);
  const ScanScratch scratch(p);
  float* dst = scratch.states + (int64_t(blockIdx.x) * H + h) * dh * dh;
  if (j < dh) {
    for (int64_t i = threadIdx.y; i < dh; i += kGroups) dst[i * dh + j] = m.S[i * kLanes + threadIdx.x];
  }
  if (blockIdx.z == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    scratch.decays[int64_t(blockIdx.x) * H + h] = expf(static_cast<float>(m.cum[at.n - 1]));
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
  const int64_t first = FirstChunkOf(p, b);
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, dd = dh * dh, h = blockIdx.y;
  const int64_t e = int64_t(blockIdx.z) * blockDim.x + threadIdx.x;
  if (e >= dd) return;
  const ScanScratch scratch(p);
  float* state = GlobalPtr(p.seqs_ptr[b].state + (int64_t(p.layer) * H + h) * dd + e);
  float S = *state;
  // Eight chunks at a time, their loads in flight together.
  constexpr int kBatch = 8;
  for (int64_t c0 = first; c0 < first + chunks; c0 += kBatch) {
    float own[kBatch], decay[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t c = c0 + k;
      if (c < first + chunks) own[k] = scratch.states[(c * H + h) * dd + e], decay[k] = scratch.decays[c * H + h];
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t c = c0 + k;
      if (c < first + chunks) {
        scratch.states[(c * H + h) * dd + e] = S;
        S = decay[k] * S + own[k];
      }
    }
  }
  *state = S;
}

// gdn: chunk blockIdx.x's U and W for head blockIdx.y: (I + A) [U W] = [diag(beta) V, diag(beta e^cum) K]
// by forward substitution, thread c taking columns c, c + 256, ... of the 2 dh; then U, W, the normalised
// keys, ucoef and the decay to the scratch.
__global__ void GdnChunkSolveKernel(RecurrentParams p) {
  extern __shared__ double smem_d[];
  AfterPrevious();
  ChunkAt at;
  if (!LocateBlockChunk(p, &at)) return;
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, HD = H * dh, h = at.h, cols = 2 * dh;
  const int tid = threadIdx.y * kLanes + threadIdx.x, n = at.n;
  const ChunkSmem m = LayoutChunkSmem(reinterpret_cast<char*>(smem_d), dh, kPartK | kPartA | kPartSolve);
  for (int t = threadIdx.y; t < n; t += kGroups) {  // v into X's left half (StageChunk waits for the copies)
    for (int64_t d = threadIdx.x; d < dh; d += kLanes) {
      CopyWordAsync(m.X + t * cols + d, p.kv_ptr + (at.row + t) * 2 * HD + HD + h * dh + d);
    }
  }
  StageChunk<true>(p, m, h, dh, at.row, n);
  // The right-hand sides (each thread the elements it copied) and the normalised keys to the scratch, all
  // from k before A takes its place.
  const ScanScratch scratch(p);
  const int64_t rec = int64_t(blockIdx.x) * H + h;
  const int64_t at_rec = rec * kChunk * dh;
  float *keys = scratch.keys + at_rec, *w = scratch.w + at_rec, *u = scratch.u + at_rec;
  for (int t = threadIdx.y; t < n; t += kGroups) {
    const float beta = m.gate[t], beta_decay = beta * expf(static_cast<float>(m.cum[t]));
    for (int64_t d = threadIdx.x; d < dh; d += kLanes) {
      m.X[t * cols + d] *= beta;
      m.X[t * cols + dh + d] = beta_decay * m.Ks[t * m.ld + d];
      keys[t * dh + d] = m.Ks[t * m.ld + d];
    }
  }
  ChunkProducts<false, true, /*kStoreOverInputs=*/true>(m, n);
  __syncthreads();
  for (int64_t c = tid; c < cols; c += kLanes * kGroups) {  // each column on its own, in four partial sums
    for (int t = 1; t < n; ++t) {
      float part[4] = {m.X[t * cols + c], 0.f, 0.f, 0.f};
      int v = 0;
      for (; v + 4 <= t; v += 4) {
        const float4 a = *reinterpret_cast<const float4*>(m.Am + t * kScoresLd + v);
        part[0] -= a.x * m.X[v * cols + c];
        part[1] -= a.y * m.X[(v + 1) * cols + c];
        part[2] -= a.z * m.X[(v + 2) * cols + c];
        part[3] -= a.w * m.X[(v + 3) * cols + c];
      }
      for (; v < t; ++v) part[0] -= m.Am[t * kScoresLd + v] * m.X[v * cols + c];
      m.X[t * cols + c] = (part[0] + part[1]) + (part[2] + part[3]);
    }
  }
  __syncthreads();
  for (int64_t e = tid; e < n * dh; e += kLanes * kGroups) {
    const int64_t t = e / dh, d = e - t * dh;
    u[e] = m.X[t * cols + d];
    w[e] = m.X[t * cols + dh + d];
  }
  if (tid < n) scratch.ucoef[rec * kChunk + tid] = m.ucoef[tid];
  if (tid == 0) scratch.decays[rec] = expf(static_cast<float>(m.cum[n - 1]));
}

// gdn: the chunks of (sequence blockIdx.x, head blockIdx.y, value slice blockIdx.z of kPassCols) in order:
// record the state entering the chunk, u = U - W S, then S <- decay S + sum_s ucoef_s k_s u_s^T; u to the
// scratch. Slices of 16 value features (threads 16 x 16, tokens t = y + 16k) give 128 blocks at 1.4b's 16
// heads of 128, where 32 gave 64 for the H200's 132 SMs; each block reads the chunk's keys and W whole.
constexpr int kPassCols = 16, kPassGroups = 16, kPassPer = kChunk / kPassGroups;
__global__ void GdnChunkPassKernel(RecurrentParams p) {
  extern __shared__ double smem_d[];
  AfterPrevious();
  const int64_t b = blockIdx.x;
  const int64_t chunks = ChunksOf(p, b);
  if (chunks == 0) return;
  const int64_t first = FirstChunkOf(p, b);
  const SeqDesc s = p.seqs_ptr[b];
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, dd = dh * dh, h = blockIdx.y;
  const int64_t j = int64_t(blockIdx.z) * kPassCols + threadIdx.x;
  const int x = threadIdx.x, y = threadIdx.y, tid = y * kPassCols + x;
  const bool col = j < dh;
  const ChunkSmem m = LayoutChunkSmem(reinterpret_cast<char*>(smem_d), dh, kPartK | kPartS | kPartV | kPartW);
  const ScanScratch scratch(p);
  float* state = GlobalPtr(s.state + (int64_t(p.layer) * H + h) * dd);
  for (int64_t i = y; i < m.pad; i += kPassGroups) m.S[i * kPassCols + x] = col && i < dh ? state[i * dh + j] : 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t rec = (first + c) * H + h;
    const int n = ChunkLen(s.len, c);
    const float* keys = scratch.keys + rec * kChunk * dh;
    const float* w = scratch.w + rec * kChunk * dh;
    float* u = scratch.u + rec * kChunk * dh;
    for (int t = y; t < n; t += kPassGroups) {
      for (int64_t d = x; d < dh; d += kPassCols) {
        CopyWordAsync(m.Ks + t * m.ld + d, keys + t * dh + d);
        CopyWordAsync(m.Wg + t * m.ld + d, w + t * dh + d);
      }
      for (int64_t d = dh + x; d < m.pad; d += kPassCols) m.Wg[t * m.ld + d] = 0.f;
    }
    if (tid < n) CopyWordAsync(m.ucoef + tid, scratch.ucoef + rec * kChunk + tid);
    float* entering = scratch.states + rec * dd;
    if (col) {
      for (int64_t i = y; i < dh; i += kPassGroups) entering[i * dh + j] = m.S[i * kPassCols + x];
    }
    float big_u[kPassPer];
#pragma unroll
    for (int k = 0; k < kPassPer; ++k) {
      const int t = y + kPassGroups * k;
      big_u[k] = t < n && col ? u[t * dh + j] : 0.f;
    }
    WaitCopies();
    __syncthreads();
    // u_t = U_t - W_t . S for tokens t = y + 16k.
    float ws[kPassPer] = {};
    RowsTimesColumn<kPassPer, kPassCols>(m.Wg + y * m.ld, kPassGroups * m.ld, m.S + x, m.pad, ws);
#pragma unroll
    for (int k = 0; k < kPassPer; ++k) {
      const int t = y + kPassGroups * k;
      const float value = big_u[k] - ws[k];
      m.Vs[t * kPassCols + x] = t < n ? value : 0.f;
      if (t < n && col) u[t * dh + j] = value;
    }
    __syncthreads();
    ChunkStateUpdate<kPassCols, kPassGroups>(m, dh, n, scratch.decays[rec]);
  }
  if (col) {
    for (int64_t i = y; i < dh; i += kPassGroups) state[i * dh + j] = m.S[i * kPassCols + x];
  }
}

// Chunk blockIdx.x's decay-masked scores W for head blockIdx.y, once for all its value slices, to the
// scratch (rows t < n, each as 16 float4s; the columns past n are not read).
template <bool kGdn>
__global__ void ChunkScoresKernel(RecurrentParams p) {
  extern __shared__ double smem_d[];
  AfterPrevious();
  ChunkAt at;
  if (!LocateBlockChunk(p, &at)) return;
  const int64_t dh = p.dims.head_dim, h = at.h;
  const ChunkSmem m = LayoutChunkSmem(reinterpret_cast<char*>(smem_d), dh, kPartK | kPartQ | kPartScores);
  StageChunk<kGdn>(p, m, h, dh, at.row, at.n);
  ChunkProducts<true, kGdn>(m, at.n);
  __syncthreads();
  const ScanScratch scratch(p);
  float* dst = scratch.scores + (int64_t(blockIdx.x) * p.dims.heads + h) * kChunk * kChunk;
  constexpr int kQuadsPerRow = kChunk / 4;
  for (int e = threadIdx.y * kLanes + threadIdx.x; e < at.n * kQuadsPerRow; e += kLanes * kGroups) {
    const int t = e / kQuadsPerRow, q = e % kQuadsPerRow;
    const float4 row_piece = *reinterpret_cast<const float4*>(m.Wm + t * kScoresLd + 4 * q);
    *reinterpret_cast<float4*>(dst + t * kChunk + 4 * q) = row_piece;
  }
}

// Chunk blockIdx.x's outputs (head blockIdx.y, value slice blockIdx.z) from the state entering it, the
// scores (ChunkScoresKernel) and v (gdn: u, from the scratch).
template <bool kGdn>
__global__ void ChunkOutputsKernel(RecurrentParams p) {
  extern __shared__ double smem_d[];
  AfterPrevious();
  ChunkAt at;
  if (!LocateBlockChunk(p, &at)) return;
  const int64_t dh = p.dims.head_dim, H = p.dims.heads, h = at.h, j = at.j;
  const int x = threadIdx.x, y = threadIdx.y;
  const ChunkSmem m = LayoutChunkSmem(reinterpret_cast<char*>(smem_d), dh, kPartS | kPartQ | kPartV | kPartScores);
  const ScanScratch scratch(p);
  const int64_t rec = int64_t(blockIdx.x) * H + h;
  // The scores, the state entering the chunk (gdn: and u in place of v) by cp.async, which StageChunk
  // waits for.
  const float* scores = scratch.scores + rec * kChunk * kChunk;
  constexpr int kQuadsPerRow = kChunk / 4;
  for (int e = y * kLanes + x; e < at.n * kQuadsPerRow; e += kLanes * kGroups) {
    const int t = e / kQuadsPerRow, q = e % kQuadsPerRow;
    CopyQuadAsync(m.Wm + t * kScoresLd + 4 * q, scores + t * kChunk + 4 * q);
  }
  const float* entering = scratch.states + rec * dh * dh;
  for (int64_t i = y; i < m.pad; i += kGroups) {
    if (j < dh && i < dh) {
      CopyWordAsync(m.S + i * kLanes + x, entering + i * dh + j);
    } else {
      m.S[i * kLanes + x] = 0.f;
    }
  }
  if constexpr (kGdn) {
    for (int t = y; t < kChunk; t += kGroups) {
      if (t < at.n && j < dh) {
        CopyWordAsync(m.Vs + t * kLanes + x, scratch.u + rec * kChunk * dh + t * dh + j);
      } else {
        m.Vs[t * kLanes + x] = 0.f;
      }
    }
    ChunkSmem staged = m;
    staged.Vs = nullptr;  // u is there already
    StageChunk<true>(p, staged, h, j, at.row, at.n);
  } else {
    StageChunk<false>(p, m, h, j, at.row, at.n);
  }
  ChunkOutputs<kGdn>(p, m, h, j, at.row, at.n);
}

// Sets a kernel's dynamic shared memory limit to `bytes`.
template <typename Kernel>
void AllowSmem(Kernel kernel, size_t bytes) {
  ORYX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

size_t SmemBytes(int64_t dh, unsigned parts) { return LayoutChunkSmem(nullptr, dh, parts).bytes; }

}  // namespace

void LaunchChunkedScan(const RecurrentParams& p, dim3 grid, cudaStream_t stream) {
  const int64_t dh = p.dims.head_dim;
  const dim3 block(kLanes, kGroups);
  constexpr unsigned kOutputs = kPartS | kPartQ | kPartV | kPartScores, kScores = kPartK | kPartQ | kPartScores;
  constexpr unsigned kStates = kPartK | kPartS | kPartV, kSolve = kPartK | kPartA | kPartSolve;
  constexpr unsigned kPass = kPartK | kPartS | kPartV | kPartW;
  // Up to the shared memory of head_dim kMaxHeadDimCuda, configured once.
  static const bool configured = [] {
    AllowSmem(Mamba2ChunkStatesKernel, SmemBytes(kMaxHeadDimCuda, kStates));
    AllowSmem(ChunkOutputsKernel<false>, SmemBytes(kMaxHeadDimCuda, kOutputs));
    AllowSmem(ChunkOutputsKernel<true>, SmemBytes(kMaxHeadDimCuda, kOutputs));
    AllowSmem(ChunkScoresKernel<false>, SmemBytes(kMaxHeadDimCuda, kScores));
    AllowSmem(ChunkScoresKernel<true>, SmemBytes(kMaxHeadDimCuda, kScores));
    AllowSmem(GdnChunkSolveKernel, SmemBytes(kMaxHeadDimCuda, kSolve));
    AllowSmem(GdnChunkPassKernel, SmemBytes(kMaxHeadDimCuda, kPass));
    return true;
  }();
  (void)configured;
  const dim3 chunks(static_cast<unsigned>(p.scan_chunks), grid.y, grid.z), chunk_heads(chunks.x, grid.y);
  if (p.dims.gdn) {
    LaunchAfterPrevious(ChunkScoresKernel<true>, chunk_heads, block, SmemBytes(dh, kScores), stream, p);
    ORYX_CUDA_CHECK(cudaGetLastError());
    LaunchAfterPrevious(GdnChunkSolveKernel, chunk_heads, block, SmemBytes(dh, kSolve), stream, p);
    ORYX_CUDA_CHECK(cudaGetLastError());
    const dim3 pass(grid.x, grid.y, static_cast<unsigned>(CeilDiv(dh, kPassCols)));
    LaunchAfterPrevious(GdnChunkPassKernel, pass, dim3(kPassCols, kPassGroups), SmemBytes(dh, kPass), stream, p);
    ORYX_CUDA_CHECK(cudaGetLastError());
    LaunchAfterPrevious(ChunkOutputsKernel<true>, chunks, block, SmemBytes(dh, kOutputs), stream, p);
    ORYX_CUDA_CHECK(cudaGetLastError());
    return;
  }
  LaunchAfterPrevious(ChunkScoresKernel<false>, chunk_heads, block, SmemBytes(dh, kScores), stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
  LaunchAfterPrevious(Mamba2ChunkStatesKernel, chunks, block, SmemBytes(dh, kStates), stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
  constexpr int kPassThreads = 256;
  const dim3 pass(grid.x, grid.y, static_cast<unsigned>(CeilDiv(dh * dh, kPassThreads)));
  LaunchAfterPrevious(ChunkStatePassKernel, pass, dim3(kPassThreads), 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
  LaunchAfterPrevious(ChunkOutputsKernel<false>, chunks, block, SmemBytes(dh, kOutputs), stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace recurrence

using recurrence::kChunk;
using recurrence::Pad4;

int64_t ChunkedScanChunks(int64_t span_len, int32_t chunked_min_len) {
  return chunked_min_len > 0 && span_len >= chunked_min_len ? (span_len + kChunk - 1) / kChunk : 0;
}

int64_t ChunkedScanScratchFloats(const ModelDims& dims, int64_t chunks) {
  const int64_t dh = dims.head_dim, rows = chunks * dims.heads;
  const int64_t mamba2 = Pad4(rows * dh * dh) + Pad4(rows) + rows * kChunk * kChunk;
  return dims.gdn ? mamba2 + rows * (3 * kChunk * dh + kChunk) : mamba2;
}

}  // namespace oryx::kernels::cuda
