// Attention of query rows over a paged bf16 KV cache, split over chunks of keys (flash-decoding): a block per
// (attention row, head, chunk of kAttentionChunk keys) writes the chunk's max score, its sum of
// exponentials and its unnormalised output; a second kernel merges the chunks of each (row, head). The
// same kernels serve decode (one row per sequence), verify spans and prefill (causal: the row at position
// p sees keys 0..p); when the caller groups the rows of a span, a block serves a group of them, so that a
// verify span of k + 1 rows reads the KV cache once rather than k + 1 times.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kThreads = 128, kWarps = kThreads / 32, kUnroll = 8;

struct RowInfo {
  SeqDesc s;
  int64_t row, keys;  // the row and its number of visible keys (position + 1)
};

__device__ __forceinline__ RowInfo GetRow(const AttentionParams& p, int64_t a) {
  RowInfo info;
  info.row = p.attn_rows_ptr[a];
  info.s = p.seqs_ptr[p.row_seq_ptr[info.row]];
  info.keys = info.s.pos + (info.row - info.s.row) + 1;
  return info;
}

// scores[0, n) <- exp(scores - max) over the block; *m = the max, *l = the sum of the exponentials. Ends with
// a block synchronisation, so the exponentials are visible to every thread after it.
__device__ __forceinline__ void BlockSoftmaxInPlace(float* scores, int64_t n, float* scratch, float* m, float* l) {
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) mx = fmaxf(mx, scores[j]);
  mx = BlockMax(mx, scratch);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) {
    const float e = __expf(scores[j] - mx);
    scores[j] = e;
    sum += e;
  }
  *m = mx;
  *l = BlockSum(sum, scratch);
}

// kVec bf16 values per load: 2 when dh is even (bf16x2), else 1.
// Loads, for one thread, 8 bf16 of kUnroll keys kKeysPerLoad apart from key j0 + group (zeros past n).
// The kUnroll * kKeysPerLoad keys from j0 (a multiple of that run length, 8 to 64) lie in one block (KvRows).
template <int kKeysPerLoad>
__device__ __forceinline__ void LoadKeys(uint4 (&raw)[kUnroll], const KvRows& keys, int j0, int group, int n) {
  const bf16* run = keys.Row(j0);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int j = j0 + u * kKeysPerLoad + group;
    raw[u] = j < n ? *reinterpret_cast<const uint4*>(run + int64_t(j - j0) * keys.HD) : make_uint4(0, 0, 0, 0);
  }
}

template <int kVec>
__global__ void AttentionChunkKernel(AttentionParams p) {
  AfterPrevious();
  __shared__ float q[kMaxHeadDimCuda];
  __shared__ float scores[kAttentionChunk];
  __shared__ float scratch[32];
  __shared__ float acc_parts[2 * kThreads];  // [subsets, units, kVec] <= 256
  const int64_t dh = p.dims.head_dim, HD = p.dims.heads * dh, h = blockIdx.y, chunk = blockIdx.z;
  const RowInfo info = GetRow(p, blockIdx.x);
  const int64_t k0 = chunk * p.chunk;
  if (k0 >= info.keys) return;
  const int64_t n = min(int64_t(p.chunk), info.keys - k0);
  const float scale = rsqrtf(static_cast<float>(dh));
  for (int64_t d = threadIdx.x; d < dh; d += kThreads) q[d] = p.qa_ptr[info.row * HD + h * dh + d] * scale;
  __syncthreads();
  const KvRows keys = KeyRows(info.s, p.layer, HD, k0, h * dh), values = ValueRows(info.s, p.layer, HD, k0, h * dh);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t units = dh / kVec;  // loads per key row

  // Scores: a warp per key, kUnroll keys in flight per warp.
  for (int64_t j0 = warp * kUnroll; j0 < n; j0 += kWarps * kUnroll) {
    float dot[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      dot[u] = 0.f;
      const int64_t j = j0 + u;
      if (j >= n) continue;
      const bf16* krow = keys.Row(j);
      for (int64_t e = lane; e < units; e += 32) {
        if constexpr (kVec == 2) {
          const float2 k2 = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(krow)[e]);
          dot[u] += k2.x * q[2 * e] + k2.y * q[2 * e + 1];
        } else {
          dot[u] += __bfloat162float(krow[e]) * q[e];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float d = WarpSum(dot[u]);
      if (lane == 0 && j0 + u < n) scores[j0 + u] = d;
    }
  }
  __syncthreads();
  float m, l;
  BlockSoftmaxInPlace(scores, n, scratch, &m, &l);  // synchronises: the exponentials are visible below

  // Output: thread = (unit e, key subset); subsets stride over the chunk's keys. A unit is kVec features;
  // when dh / kVec > kThreads (odd dh > 128) a thread also takes unit e + kThreads.
  const int64_t subsets = max(int64_t(1), kThreads / units);
  const int64_t e = threadIdx.x % units, subset = threadIdx.x / units;
  float acc[2][kVec] = {};
  if (subset < subsets) {
#pragma unroll 4
    for (int64_t j = subset; j < n; j += subsets) {
      const bf16* vrow = values.Row(j);
      const float pj = scores[j];
#pragma unroll
      for (int m2 = 0; m2 < 2; ++m2) {
        const int64_t u = e + m2 * kThreads;
        if (u >= units) continue;
        if constexpr (kVec == 2) {
          const float2 v2 = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(vrow)[u]);
          acc[m2][0] += pj * v2.x;
          acc[m2][1] += pj * v2.y;
        } else {
          acc[m2][0] += pj * __bfloat162float(vrow[u]);
        }
      }
    }
    for (int m2 = 0; m2 < 2; ++m2) {
      const int64_t u = e + m2 * kThreads;
      if (u >= units) continue;
#pragma unroll
      for (int c = 0; c < kVec; ++c) acc_parts[(subset * units + u) * kVec + c] = acc[m2][c];
    }
  }
  __syncthreads();
  float* out = p.partial_ptr + ((int64_t(blockIdx.x) * p.dims.heads + h) * p.max_chunks + chunk) * (dh + 2);
  if (threadIdx.x == 0) out[0] = m, out[1] = l;
  for (int64_t d = threadIdx.x; d < dh; d += kThreads) {
    const int64_t unit = d / kVec, c = d % kVec;
    float sum = 0.f;
    for (int64_t sub = 0; sub < subsets; ++sub) sum += acc_parts[(sub * units + unit) * kVec + c];
    out[2 + d] = sum;
  }
}

// The fast path for dh in {32, 64, 128, 256}: 16-byte loads of 8 bf16. A key row is read by kLanes = dh / 8
// lanes (32 / kLanes keys per warp load), which reduce their partial dot products with shuffles; each lane
// keeps its 8 query values in registers. For the output, thread t accumulates 8 features (t % kLanes) over
// the keys t / kLanes, t / kLanes + kThreads / kLanes, ..., and the key subsets are summed in shared memory.
template <int kLanes>
__global__ void AttentionChunkVecKernel(AttentionParams p) {
  AfterPrevious();
  constexpr int kKeysPerLoad = 32 / kLanes, kSubsets = kThreads / kLanes, kDh = 8 * kLanes;
  __shared__ float scores[kAttentionChunk];
  __shared__ float scratch[32];
  __shared__ float parts[kSubsets * kDh];  // = 8 * kThreads floats
  const int64_t HD = p.dims.heads * kDh, h = blockIdx.y, chunk = blockIdx.z;
  const RowInfo info = GetRow(p, blockIdx.x);
  const int64_t k0 = chunk * p.chunk;
  if (k0 >= info.keys) return;
  const int n = static_cast<int>(min(int64_t(p.chunk), info.keys - k0));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = lane / kLanes, gl = lane % kLanes;
  const float scale = rsqrtf(static_cast<float>(kDh));
  float q[8];
  const float* qrow = p.qa_ptr + info.row * HD + h * kDh + gl * 8;
#pragma unroll
  for (int e = 0; e < 8; ++e) q[e] = qrow[e] * scale;
  const KvRows keys = KeyRows(info.s, p.layer, HD, k0, h * kDh + gl * 8);

  // Scores: per warp iteration kUnroll loads of kKeysPerLoad keys.
  constexpr int kKeysPerIter = kKeysPerLoad * kUnroll;
  for (int j0 = warp * kKeysPerIter; j0 < n; j0 += kWarps * kKeysPerIter) {
    uint4 raw[kUnroll];
    LoadKeys<kKeysPerLoad>(raw, keys, j0, group, n);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 kf = __bfloat1622float2(k2[e]);
        dot += kf.x * q[2 * e] + kf.y * q[2 * e + 1];
      }
#pragma unroll
      for (int offset = kLanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      const int j = j0 + u * kKeysPerLoad + group;
      if (gl == 0 && j < n) scores[j] = dot;
    }
  }
  __syncthreads();
  float m, l;
  BlockSoftmaxInPlace(scores, n, scratch, &m, &l);  // synchronises: the exponentials are visible below

  const int sub = threadIdx.x / kLanes, f = threadIdx.x % kLanes;
  float acc[8] = {};
  const KvRows values = ValueRows(info.s, p.layer, HD, k0, h * kDh + f * 8);
  for (int w0 = 0; w0 < n; w0 += kKvBlockTokens) {  // 64-key windows, each in one block (KvRows)
    const bf16* window = values.Row(w0);
    const int end = min(n, w0 + kKvBlockTokens);
#pragma unroll 8
    for (int j = w0 + sub; j < end; j += kSubsets) {
      const uint4 raw = *reinterpret_cast<const uint4*>(window + int64_t(j - w0) * HD);
      const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
      const float pj = scores[j];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 vf = __bfloat1622float2(v2[e]);
        acc[2 * e] += pj * vf.x;
        acc[2 * e + 1] += pj * vf.y;
      }
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) parts[sub * kDh + f * 8 + e] = acc[e];
  __syncthreads();
  float* out = p.partial_ptr + ((int64_t(blockIdx.x) * p.dims.heads + h) * p.max_chunks + chunk) * (kDh + 2);
  if (threadIdx.x == 0) out[0] = m, out[1] = l;
  for (int d = threadIdx.x; d < kDh; d += kThreads) {
    float sum = 0.f;
#pragma unroll 8
    for (int s2 = 0; s2 < kSubsets; ++s2) sum += parts[s2 * kDh + d];
    out[2 + d] = sum;
  }
}

// The same over a group of up to kAttentionGroupRows attention rows of one sequence (a verify or prefill
// span): each key chunk is read once for all of them. Rows see different numbers of keys (causal), the
// group's last row the most. Scores: each lane keeps its 8 key values and takes the dot products with
// every row's query (in shared memory), reduced over the kLanes lanes of the key; softmax per row (a warp
// per row); output: thread (key subset, 8 features) accumulates every row's sum from one read of V.
template <int kLanes, int G>  // G: rows per group at most (registers hold G queries and G accumulators)
__global__ void AttentionGroupVecKernel(AttentionParams p) {
  AfterPrevious();
  constexpr int kKeysPerLoad = 32 / kLanes, kSubsets = kThreads / kLanes, kDh = 8 * kLanes;
  __shared__ float q[G][kDh];
  __shared__ float scores[G][kAttentionChunk];
  __shared__ float parts[kSubsets * kDh];
  __shared__ float stats[G][2];
  __shared__ int64_t rows[G], keys[G];
  const int64_t HD = p.dims.heads * kDh, h = blockIdx.y, chunk = blockIdx.z;
  const int a0 = p.groups_ptr[2 * blockIdx.x], R = p.groups_ptr[2 * blockIdx.x + 1];
  const RowInfo last = GetRow(p, a0 + R - 1);  // the group's rows are in position order
  const int64_t k0 = chunk * p.chunk;
  if (k0 >= last.keys) return;
  const int n = static_cast<int>(min(int64_t(p.chunk), last.keys - k0));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = lane / kLanes, gl = lane % kLanes;
  if (threadIdx.x < R) {
    const RowInfo info = GetRow(p, a0 + threadIdx.x);
    rows[threadIdx.x] = info.row;
    keys[threadIdx.x] = info.keys;
  }
  __syncthreads();
  const float scale = rsqrtf(static_cast<float>(kDh));
  for (int i = threadIdx.x; i < R * kDh; i += kThreads) {
    q[i / kDh][i % kDh] = p.qa_ptr[rows[i / kDh] * HD + h * kDh + i % kDh] * scale;
  }
  __syncthreads();
  const KvRows key_rows = KeyRows(last.s, p.layer, HD, k0, h * kDh + gl * 8);

  // Scores of every row against every key of the chunk (masked below per row). Each lane holds its 8
  // features of every row's query (rows past R are zero) and of one key; the G partial dot products are
  // reduced over the key's kLanes lanes by halving exchanges (a lane keeps half of its sums and trades the
  // other half with its partner, G / 2 + G / 4 + ... shuffles instead of G log2(kLanes)), so that each lane
  // ends with the full sums of G / kLanes rows (one row when kLanes >= G).
  float qr[G][8];
#pragma unroll
  for (int r = 0; r < G; ++r) {
#pragma unroll
    for (int e = 0; e < 8; ++e) qr[r][e] = r < R ? q[r][gl * 8 + e] : 0.f;
  }
  constexpr int kKeysPerIter = kKeysPerLoad * kUnroll;
  for (int j0 = warp * kKeysPerIter; j0 < n; j0 += kWarps * kKeysPerIter) {
    uint4 raw[kUnroll];
    LoadKeys<kKeysPerLoad>(raw, key_rows, j0, group, n);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
      float kf[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(k2[e]);
        kf[2 * e] = f.x, kf[2 * e + 1] = f.y;
      }
      float v[G];
#pragma unroll
      for (int r = 0; r < G; ++r) {
        v[r] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) v[r] += kf[e] * qr[r][e];
      }
      int first_row = 0, count = G, plain_mask = 0;
#pragma unroll
      for (int offset = kLanes / 2; offset > 0; offset /= 2) {
        if (count > 1) {
          const bool upper = (gl & offset) != 0;
          const int half = count / 2;
#pragma unroll
          for (int i = 0; i < G / 2; ++i) {
            if (i >= half) break;
            const float send = upper ? v[i] : v[i + half], keep = upper ? v[i + half] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
          }
          first_row += upper ? half : 0;
          count = half;
        } else {
          v[0] += __shfl_xor_sync(0xffffffffu, v[0], offset);
          plain_mask |= offset;
        }
      }
      const int j = j0 + u * kKeysPerLoad + group;
      if ((gl & plain_mask) == 0 && j < n) {
#pragma unroll
        for (int i = 0; i < G; ++i) {
          if (i < count && first_row + i < R) scores[first_row + i][j] = v[i];
        }
      }
    }
  }
  __syncthreads();
  // Softmax over each row's visible keys of the chunk, a warp per row; keys past a row's end weigh 0.
  for (int r = warp; r < R; r += kWarps) {
    const int nr = static_cast<int>(max(int64_t(0), min(int64_t(n), keys[r] - k0)));
    float m = -INFINITY;
    for (int j = lane; j < nr; j += 32) m = fmaxf(m, scores[r][j]);
    m = WarpMax(m);
    float l = 0.f;
    for (int j = lane; j < n; j += 32) {
      const float e = j < nr ? __expf(scores[r][j] - m) : 0.f;
      scores[r][j] = e;
      l += e;
    }
    l = WarpSum(l);
    if (lane == 0) stats[r][0] = m, stats[r][1] = l;
  }
  __syncthreads();

  // kVUnroll loads of V in flight per thread before they are used.
  constexpr int kVUnroll = 4;
  const int sub = threadIdx.x / kLanes, f = threadIdx.x % kLanes;
  float acc[G][8] = {};
  const KvRows values = ValueRows(last.s, p.layer, HD, k0, h * kDh + f * 8);
  for (int w0 = 0; w0 < n; w0 += kKvBlockTokens) {  // 64-key windows, each in one block (KvRows)
    const bf16* window = values.Row(w0);
    const int end = min(n, w0 + kKvBlockTokens);
    for (int j0 = w0 + sub; j0 < end; j0 += kSubsets * kVUnroll) {
      uint4 raw[kVUnroll];
#pragma unroll
      for (int u = 0; u < kVUnroll; ++u) {
        const int j = j0 + u * kSubsets;
        raw[u] = j < end ? *reinterpret_cast<const uint4*>(window + int64_t(j - w0) * HD) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kVUnroll; ++u) {
        const int j = j0 + u * kSubsets;
        if (j >= end) break;
        const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
        float vf[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 t = __bfloat1622float2(v2[e]);
          vf[2 * e] = t.x, vf[2 * e + 1] = t.y;
        }
#pragma unroll
        for (int r = 0; r < G; ++r) {
          if (r >= R) break;
          const float pj = scores[r][j];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][e] += pj * vf[e];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < G; ++r) {
    if (r >= R) break;
    if (k0 >= keys[r]) continue;  // the row sees no key of this chunk (the same for every thread)
#pragma unroll
    for (int e = 0; e < 8; ++e) parts[sub * kDh + f * 8 + e] = acc[r][e];
    __syncthreads();
    float* out = p.partial_ptr + ((int64_t(a0 + r) * p.dims.heads + h) * p.max_chunks + chunk) * (kDh + 2);
    if (threadIdx.x == 0) out[0] = stats[r][0], out[1] = stats[r][1];
    for (int d = threadIdx.x; d < kDh; d += kThreads) {
      float sum = 0.f;
#pragma unroll 8
      for (int s2 = 0; s2 < kSubsets; ++s2) sum += parts[s2 * kDh + d];
      out[2 + d] = sum;
    }
    __syncthreads();
  }
}

// One block per (row, head): the chunks' weights exp(m_c - m) first (shared memory), then groups of dh
// threads sum every groups-th chunk's outputs, and the groups add up.
constexpr int kCombineThreads = 512, kMaxCombineChunks = 4096;
__global__ void AttentionCombineKernel(AttentionParams p) {
  AfterPrevious();
  __shared__ float weights[kMaxCombineChunks];
  __shared__ float sums[kCombineThreads];
  __shared__ float scratch[32];
  const int64_t dh = p.dims.head_dim, HD = p.dims.heads * dh, h = blockIdx.y;
  const RowInfo info = GetRow(p, blockIdx.x);
  const int64_t chunks = CeilDivDevice(info.keys, p.chunk);
  const float* part = p.partial_ptr + (int64_t(blockIdx.x) * p.dims.heads + h) * p.max_chunks * (dh + 2);
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) m = fmaxf(m, part[c * (dh + 2)]);
  m = BlockMax(m, scratch);
  // Rows longer than kMaxCombineChunks chunks (over a million keys) recompute the weights below.
  const bool cached = chunks <= kMaxCombineChunks;
  float l = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    const float w = __expf(part[c * (dh + 2)] - m);
    if (cached) weights[c] = w;
    l += part[c * (dh + 2) + 1] * w;
  }
  l = BlockSum(l, scratch);  // synchronises: the weights are visible below
  const int64_t groups = max(int64_t(1), kCombineThreads / dh), group = threadIdx.x / dh, d0 = threadIdx.x % dh;
  if (group < groups) {
    for (int64_t d = d0; d < dh; d += kCombineThreads) {  // dh > kCombineThreads never (dh <= 256)
      float sum = 0.f;
      for (int64_t c = group; c < chunks; c += groups) {
        sum += part[c * (dh + 2) + 2 + d] * (cached ? weights[c] : __expf(part[c * (dh + 2)] - m));
      }
      sums[threadIdx.x] = sum;
    }
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < dh; d += blockDim.x) {
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) sum += sums[g * dh + d];
    p.out_ptr[info.row * HD + h * dh + d] = sum / l;
  }
}

}  // namespace

int64_t AttentionChunkFor(int64_t max_keys, int64_t attn_rows, int64_t heads, int64_t max_chunk) {
  constexpr int64_t kTargetBlocks = 132 * 4;  // a few blocks per SM of an H100/H200
  auto blocks = [&](int64_t chunk) { return attn_rows * heads * CeilDiv(max_keys, chunk); };
  int64_t chunk = 32;
  while (chunk < std::min<int64_t>(max_chunk, 256) && blocks(chunk) > kTargetBlocks) chunk *= 2;
  // Past 256 keys (the tensor-core groups' chunks), only while three times as many blocks remain: at 16K on
  // the H200, 1024-key chunks were the fastest at batch 32 and 64 (4,096 and 8,192 blocks), but at batch 8
  // 512 beat them (2,048 blocks against 1,024, about a wave and a half at five blocks per SM).
  while (chunk < max_chunk && blocks(2 * chunk) >= 3 * kTargetBlocks) chunk *= 2;
  return chunk;
}

void Attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.attn_rows == 0) return;
  const dim3 grid(static_cast<unsigned>(p.attn_rows), static_cast<unsigned>(p.dims.heads),
                  static_cast<unsigned>(p.max_chunks));
  if (p.groups_ptr != nullptr && p.attn_groups < p.attn_rows) {
    // Some sequence has several attention rows: a block per (group, head, chunk) reads each chunk once.
    const dim3 groups(static_cast<unsigned>(p.attn_groups), grid.y, grid.z);
    const int g = p.group_rows <= 2 ? 2 : p.group_rows <= 4 ? 4 : 8;
    bool launched = true;
    // Groups of 3 or more rows on tensor cores (1.4b at 32K, batch 1: a verify of 9 rows 8.77 -> 6.74 ms; at
    // 16K and batch 64, in chunks of 1024 keys, 3 rows 6.06 -> 4.69 ms of the CUDA-core kernel); at 2 rows the
    // CUDA-core kernel was faster (4.04 against 4.38 ms).
    if (GroupAttentionMmaTakes(p.dims, p.group_rows)) {
      GroupAttentionMma(p, stream);
      LaunchAfterPrevious(AttentionCombineKernel, dim3(grid.x, grid.y), kCombineThreads, 0, stream, p);
      return;
    }
    auto launch = [&](auto kernel2, auto kernel4, auto kernel8) {
      LaunchAfterPrevious(g == 2 ? kernel2 : g == 4 ? kernel4 : kernel8, groups, kThreads, 0, stream, p);
    };
    switch (p.dims.head_dim) {
      case 32: launch(AttentionGroupVecKernel<4, 2>, AttentionGroupVecKernel<4, 4>, AttentionGroupVecKernel<4, 8>); break;
      case 64: launch(AttentionGroupVecKernel<8, 2>, AttentionGroupVecKernel<8, 4>, AttentionGroupVecKernel<8, 8>); break;
      case 128:
        launch(AttentionGroupVecKernel<16, 2>, AttentionGroupVecKernel<16, 4>, AttentionGroupVecKernel<16, 8>);
        break;
      case 256:
        launch(AttentionGroupVecKernel<32, 2>, AttentionGroupVecKernel<32, 4>, AttentionGroupVecKernel<32, 8>);
        break;
      default: launched = false; break;  // the row kernels below
    }
    if (launched) {
      ORYX_CUDA_CHECK(cudaGetLastError());
      LaunchAfterPrevious(AttentionCombineKernel, dim3(grid.x, grid.y), kCombineThreads, 0, stream, p);
      return;
    }
  }
  switch (p.dims.head_dim) {
    case 32: LaunchAfterPrevious(AttentionChunkVecKernel<4>, grid, kThreads, 0, stream, p); break;
    case 64: LaunchAfterPrevious(AttentionChunkVecKernel<8>, grid, kThreads, 0, stream, p); break;
    case 128: LaunchAfterPrevious(AttentionChunkVecKernel<16>, grid, kThreads, 0, stream, p); break;
    case 256: LaunchAfterPrevious(AttentionChunkVecKernel<32>, grid, kThreads, 0, stream, p); break;
    default: break;
  }
  const bool vectorised = p.dims.head_dim == 32 || p.dims.head_dim == 64 || p.dims.head_dim == 128 ||
                          p.dims.head_dim == 256;
  if (vectorised) {
  } else if (p.dims.head_dim % 2 == 0) {
    LaunchAfterPrevious(AttentionChunkKernel<2>, grid, kThreads, 0, stream, p);
  } else {
    LaunchAfterPrevious(AttentionChunkKernel<1>, grid, kThreads, 0, stream, p);
  }
  LaunchAfterPrevious(AttentionCombineKernel, dim3(grid.x, grid.y), kCombineThreads, 0, stream, p);
}

}  // namespace oryx::kernels::cuda
