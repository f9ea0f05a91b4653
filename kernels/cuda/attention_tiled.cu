// Prefill attention on tensor cores (flash attention): a block of 4 warps per (tile of up to 64 attention
// rows of one sequence, head). Keys and values stream through shared memory 64 at a time; each warp
// multiplies its 16 queries by the key tile (mma.m16n8k16, bf16 in, fp32 out), keeps a running max and sum
// per row (online softmax, fp32), and multiplies the probabilities by the value tile into fp32 accumulators.
// The keys and values are bf16 already (the cache); the fp32 queries and probabilities each go in as two bf16
// terms, hi = bf16(x) and lo = bf16(x - hi), 16 bits of mantissa together, so that the result is as close
// to the fp32 split-KV kernels' as their own rounding (a single bf16 term moved logits of the parity tests by
// more than the bf16 weights do). The row at position p sees keys 0..p; rows of a tile are in position
// order. Key and value tiles arrive by cp.async, two stages deep (the next tile loads while this one is
// used); the value fragments are read transposed by ldmatrix.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kTileKeys = 64, kTiledThreads = 128;
static_assert(kAttentionTileRows == 16 * (kTiledThreads / 32), "a warp per 16 rows");

template <int kDh>
struct TiledLayout {
  static constexpr int kStride = kDh + 8;  // bf16 per row of every tile (the padding spreads rows over banks)
  // Queries (two terms), then two stages of keys and of values.
  static constexpr int kBytes = 2 * kStride * (2 * kAttentionTileRows + 4 * kTileKeys);
};

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without registers; src_bytes 0 writes zeros.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(SharedAddress(dst)), "l"(src), "r"(src_bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void CopyAsyncCommit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {  // until at most kPending groups are in flight
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

// The B fragments (keys 2t, 2t+1 and 2t+8, 2t+9 of column g) of a 16 x 8 block of a row-major [key][d] tile
// whose row `lane % 16` starts at `row` (lanes 0..15 give the rows).
__device__ __forceinline__ void LoadTransposed(const bf16* row, uint32_t& b0, uint32_t& b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
               : "=r"(b0), "=r"(b1)
               : "r"(SharedAddress(row)));
#endif
}

__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// x - float(bf16(x)): what the second bf16 term carries.
__device__ __forceinline__ float Rest(float x) { return x - __bfloat162float(__float2bfloat16(x)); }

__device__ __forceinline__ uint32_t Load32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Queries [0, n) of a block's rows as two bf16 terms each, [n][kS] (rows from `rows` on zero).
template <int kDh, int kS>
__device__ __forceinline__ void StageQueries(const AttentionParams& p, const int64_t* row_of, int n, int rows,
                                             int64_t h, int64_t HD, bf16* qs, bf16* qr) {
  for (int e = threadIdx.x; e < n * kDh; e += kTiledThreads) {
    const int i = e / kDh, d = e % kDh;
    const float q = i < rows ? p.qa_ptr[row_of[i] * HD + h * kDh + d] : 0.f;
    qs[i * kS + d] = __float2bfloat16(q);
    qr[i * kS + d] = __float2bfloat16(Rest(q));
  }
}

// Starts loading keys and values kv0..kv0+63 into `tiles` ([keys, values][64][kS]), zeros from key `end` on.
// The keys it loads lie in one block (KvRows): kv0 is a block boundary, or the chunk it starts is 32 keys.
template <int kDh, int kS>
__device__ __forceinline__ void IssueTiles(bf16* tiles, int64_t kv0, int64_t end, const KvRows& keys,
                                           const KvRows& values) {
  constexpr int kPieces = kDh / 8;
  bf16* kt = tiles;
  bf16* vt = kt + kTileKeys * kS;
  const bf16* key_run = keys.Row(kv0);
  const bf16* value_run = values.Row(kv0);
  for (int c = threadIdx.x; c < kTileKeys * kPieces; c += kTiledThreads) {
    const int j = c / kPieces, d8 = (c % kPieces) * 8;
    const bool in = kv0 + j < end;
    const int64_t at = in ? j * keys.HD + d8 : 0;  // (a key past the end copies nothing, from any valid address)
    CopyAsync16(kt + j * kS + d8, key_run + at, in ? 16 : 0);
    CopyAsync16(vt + j * kS + d8, value_run + at, in ? 16 : 0);
  }
  CopyAsyncCommit();
}

// Streams keys [begin, end) through the two stages of `tiles` 64 at a time, the next tile loading while this
// one is used, and calls attend(kv0, tile) for each with the whole block synchronised before and after.
template <int kDh, int kS, typename Attend>
__device__ __forceinline__ void StreamTiles(bf16* tiles, int64_t begin, int64_t end, const KvRows& keys,
                                            const KvRows& values, Attend&& attend) {
  constexpr int kStageElems = 2 * kTileKeys * kS;
  IssueTiles<kDh, kS>(tiles, begin, end, keys, values);
  for (int64_t kv0 = begin, it = 0; kv0 < end; kv0 += kTileKeys, ++it) {
    const int stage = static_cast<int>(it & 1);
    if (kv0 + kTileKeys < end) {
      // (stage ^ 1 was released by the barrier ending the last iteration)
      IssueTiles<kDh, kS>(tiles + (stage ^ 1) * kStageElems, kv0 + kTileKeys, end, keys, values);
      CopyAsyncWait<1>();
    } else {
      CopyAsyncWait<0>();
    }
    __syncthreads();  // this stage's tiles (and the staged queries) are visible to every warp
    attend(kv0, static_cast<const bf16*>(tiles + stage * kStageElems));
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }
}

// A warp's online-softmax step over kKeys keys (rows of `keys` and `values`, [key][kS], the first being key
// `key0`) for its 16 query rows (q_hi, q_lo: the first of them, [16][kS]): the scores (two-term products),
// scaled, masked to keys below limit0 for this lane's row g and limit1 for its row g + 8, folded into the
// running max m, sum l (this lane's part of it) and output o of those two rows.
template <int kDh, int kS, int kKeys>
__device__ __forceinline__ void AttendKeys(const bf16* q_hi, const bf16* q_lo, const bf16* keys, const bf16* values,
                                          int64_t key0, int64_t limit0, int64_t limit1, float scale,
                                          float (&o)[kDh / 8][4], float& m0, float& m1, float& l0, float& l1) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float sc[kKeys / 8][4] = {};
#pragma unroll
  for (int kk = 0; kk < kDh / 16; ++kk) {
    const bf16* q = q_hi + g * kS + kk * 16 + 2 * t;
    const bf16* r = q_lo + g * kS + kk * 16 + 2 * t;
    const uint32_t a[4] = {Load32(q), Load32(q + 8 * kS), Load32(q + 8), Load32(q + 8 * kS + 8)};
    const uint32_t ar[4] = {Load32(r), Load32(r + 8 * kS), Load32(r + 8), Load32(r + 8 * kS + 8)};
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
      const bf16* k = keys + (nt * 8 + g) * kS + kk * 16 + 2 * t;
      const uint32_t b0 = Load32(k), b1 = Load32(k + 8);
      MmaBf16(sc[nt], a, b0, b1);
      MmaBf16(sc[nt], ar, b0, b1);
    }
  }
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t key = key0 + nt * 8 + 2 * t + (e & 1);
      const float v = sc[nt][e] * scale;
      sc[nt][e] = key < (e < 2 ? limit0 : limit1) ? v : -INFINITY;
    }
    mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
    mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
  }
#pragma unroll
  for (int off = 1; off < 4; off *= 2) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
  const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
  // (A row with nothing visible yet keeps max -inf: its exponentials are 0, not NaN.)
  const float base0 = new0 == -INFINITY ? 0.f : new0, base1 = new1 == -INFINITY ? 0.f : new1;
  const float corr0 = __expf(m0 - base0), corr1 = __expf(m1 - base1);
  m0 = new0, m1 = new1;
  float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < kKeys / 8; ++nt) {
    sc[nt][0] = __expf(sc[nt][0] - base0);
    sc[nt][1] = __expf(sc[nt][1] - base0);
    sc[nt][2] = __expf(sc[nt][2] - base1);
    sc[nt][3] = __expf(sc[nt][3] - base1);
    sum0 += sc[nt][0] + sc[nt][1];
    sum1 += sc[nt][2] + sc[nt][3];
  }
  l0 = l0 * corr0 + sum0;
  l1 = l1 * corr1 + sum1;
#pragma unroll
  for (int nt = 0; nt < kDh / 8; ++nt) {
    o[nt][0] *= corr0, o[nt][1] *= corr0, o[nt][2] *= corr1, o[nt][3] *= corr1;
  }
  // o += P V: the score fragments of key tiles 2kk and 2kk+1 are the A fragment of keys 16kk..16kk+15.
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    const float(&x)[4] = sc[2 * kk];
    const float(&y)[4] = sc[2 * kk + 1];
    const uint32_t a[4] = {Pack(x[0], x[1]), Pack(x[2], x[3]), Pack(y[0], y[1]), Pack(y[2], y[3])};
    const uint32_t ar[4] = {Pack(Rest(x[0]), Rest(x[1])), Pack(Rest(x[2]), Rest(x[3])), Pack(Rest(y[0]), Rest(y[1])),
                            Pack(Rest(y[2]), Rest(y[3]))};
#pragma unroll
    for (int nt = 0; nt < kDh / 8; ++nt) {
      uint32_t b0, b1;
      LoadTransposed(values + (kk * 16 + lane % 16) * kS + nt * 8, b0, b1);
      MmaBf16(o[nt], a, b0, b1);
      MmaBf16(o[nt], ar, b0, b1);
    }
  }
}

template <int kDh>
__global__ void __launch_bounds__(kTiledThreads) AttentionTiledKernel(AttentionParams p) {
  using Layout = TiledLayout<kDh>;
  constexpr int kQStride = Layout::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* qs = reinterpret_cast<bf16*>(smem_raw);        // [64 rows][kQStride]: bf16(q)
  bf16* qr = qs + kAttentionTileRows * kQStride;        // [64 rows][kQStride]: bf16(q - bf16(q))
  bf16* kv_tiles = qr + kAttentionTileRows * kQStride;  // [stage][keys, values][64][kQStride]
  __shared__ int64_t row_of[kAttentionTileRows];
  __shared__ int64_t keys_of[kAttentionTileRows];
  AfterPrevious();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t h = blockIdx.y, HD = int64_t(p.dims.heads) * kDh;
  const int first = p.groups_ptr[2 * blockIdx.x], rows = p.groups_ptr[2 * blockIdx.x + 1];
  const SeqDesc s = p.seqs_ptr[p.row_seq_ptr[p.attn_rows_ptr[first]]];
  for (int i = tid; i < kAttentionTileRows; i += kTiledThreads) {
    const int64_t row = i < rows ? p.attn_rows_ptr[first + i] : -1;
    row_of[i] = row;
    keys_of[i] = i < rows ? s.pos + (row - s.row) + 1 : 0;
  }
  __syncthreads();
  StageQueries<kDh, kQStride>(p, row_of, kAttentionTileRows, rows, h, HD, qs, qr);
  const int64_t max_keys = keys_of[rows - 1];
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  const int64_t keys0 = keys_of[r0], keys1 = keys_of[r1];
  const int64_t warp_keys = warp * 16 < rows ? keys_of[min(warp * 16 + 15, rows - 1)] : 0;
  const KvRows keys = KeyRows(s, p.layer, HD, 0, h * kDh), values = ValueRows(s, p.layer, HD, 0, h * kDh);
  const float scale = rsqrtf(static_cast<float>(kDh));

  float o[kDh / 8][4] = {};
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  StreamTiles<kDh, kQStride>(kv_tiles, 0, max_keys, keys, values, [&](int64_t kv0, const bf16* ks) {
    if (kv0 >= warp_keys) return;  // every row of this warp is done (or absent)
    AttendKeys<kDh, kQStride, kTileKeys>(qs + warp * 16 * kQStride, qr + warp * 16 * kQStride, ks,
                                         ks + kTileKeys * kQStride, kv0, keys0, keys1, scale, o, m0, m1, l0, l1);
  });
  // The row sums are spread over the 4 threads of a quad.
#pragma unroll
  for (int off = 1; off < 4; off *= 2) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
#pragma unroll
  for (int nt = 0; nt < kDh / 8; ++nt) {
    const int64_t d = h * kDh + nt * 8 + 2 * t;
    if (r0 < rows) {
      p.out_ptr[row_of[r0] * HD + d] = o[nt][0] / l0;
      p.out_ptr[row_of[r0] * HD + d + 1] = o[nt][1] / l0;
    }
    if (r1 < rows) {
      p.out_ptr[row_of[r1] * HD + d] = o[nt][2] / l1;
      p.out_ptr[row_of[r1] * HD + d + 1] = o[nt][3] / l1;
    }
  }
}

// Launches kKernel (4 warps per block, kSmemBytes of dynamic shared memory, allowed once per kernel) on `grid`.
template <auto kKernel, int kSmemBytes>
void LaunchTensorCoreKernel(dim3 grid, const AttentionParams& p, cudaStream_t stream) {
  static const bool configured = [] {
    ORYX_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)configured;
  LaunchAfterPrevious(kKernel, grid, kTiledThreads, kSmemBytes, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

template <int kDh>
void LaunchTiled(const AttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.attn_groups), static_cast<unsigned>(p.dims.heads));
  LaunchTensorCoreKernel<AttentionTiledKernel<kDh>, TiledLayout<kDh>::kBytes>(grid, p, stream);
}

// Split-KV attention of a group of up to kAttentionMmaGroupRows rows of one sequence (a verify span) on tensor
// cores: a block of 4 warps per (group, head, chunk of p.chunk keys), writing each row's chunk partial (max,
// sum of exponentials, unnormalised output) for AttentionCombine, as the CUDA-core group kernel does. The
// chunk streams through shared memory in tiles of 64 keys (cp.async, two stages); warp w takes keys
// 16w..16w+15 of every tile: the 16 x 16 scores of the group's rows (the 16 rows of an mma; rows past the
// group's are zero and never seen) against its keys, an online softmax per warp, and their product with the 16 values.
// The four warps' running (max, sum, output) merge through shared memory at the end. Queries and
// probabilities go in as two bf16 terms, as in the prefill kernel above.
template <int kDh>
struct GroupLayout {
  static constexpr int kStride = kDh + 8;
  static constexpr int kQBytes = 2 * 16 * kStride * 2;                 // hi and lo terms of 16 query rows
  static constexpr int kTileBytes = 2 * 2 * kTileKeys * kStride * 2;  // [stage][keys, values]
  static constexpr int kMergeBytes = 4 * kAttentionMmaGroupRows * (kDh + 2) * 4;
  static_assert(kMergeBytes <= kTileBytes, "the merge reuses the tiles' memory");
  static constexpr int kBytes = kQBytes + kTileBytes;
};

template <int kDh>
__global__ void __launch_bounds__(kTiledThreads) AttentionGroupMmaKernel(AttentionParams p) {
  using Layout = GroupLayout<kDh>;
  constexpr int kS = Layout::kStride, kRows = kAttentionMmaGroupRows;
  static_assert(kRows == 16, "the rows of one mma");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* qs = reinterpret_cast<bf16*>(smem_raw);  // [16][kS]: bf16(q)
  bf16* qr = qs + 16 * kS;                       // [16][kS]: bf16(q - bf16(q))
  bf16* kv_tiles = qr + 16 * kS;                 // [stage][keys, values][64][kS]
  __shared__ int64_t row_of[kRows], keys_of[kRows];
  AfterPrevious();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t h = blockIdx.y, HD = int64_t(p.dims.heads) * kDh;
  const int first = p.groups_ptr[2 * blockIdx.x], rows = p.groups_ptr[2 * blockIdx.x + 1];
  const SeqDesc s = p.seqs_ptr[p.row_seq_ptr[p.attn_rows_ptr[first]]];
  if (tid < kRows) {
    const int64_t row = tid < rows ? p.attn_rows_ptr[first + tid] : -1;
    row_of[tid] = row;
    keys_of[tid] = tid < rows ? s.pos + (row - s.row) + 1 : 0;
  }
  __syncthreads();
  const int64_t k0 = int64_t(blockIdx.z) * p.chunk, max_keys = keys_of[rows - 1];
  if (k0 >= max_keys) return;  // (the same for the whole block)
  const int64_t end = min(k0 + p.chunk, max_keys);  // the keys this chunk holds for its longest row
  StageQueries<kDh, kS>(p, row_of, kRows, rows, h, HD, qs, qr);
  // This lane's rows of the mma, g and g + 8, see keys [k0, visible0) and [k0, visible1).
  const int64_t visible0 = g < rows ? min(end, keys_of[g]) : k0;
  const int64_t visible1 = g + 8 < rows ? min(end, keys_of[g + 8]) : k0;
  const KvRows keys = KeyRows(s, p.layer, HD, 0, h * kDh), values = ValueRows(s, p.layer, HD, 0, h * kDh);
  const float scale = rsqrtf(static_cast<float>(kDh));

  float o[kDh / 8][4] = {};
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  StreamTiles<kDh, kS>(kv_tiles, k0, end, keys, values, [&](int64_t kv0, const bf16* tile) {
    const bf16* ks = tile + warp * 16 * kS;  // this warp's 16 keys
    const int64_t key0 = kv0 + warp * 16;
    if (key0 >= end) return;
    AttendKeys<kDh, kS, 16>(qs, qr, ks, ks + kTileKeys * kS, key0, visible0, visible1, scale, o, m0, m1, l0, l1);
  });
#pragma unroll
  for (int off = 1; off < 4; off *= 2) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  // Merge the warps: each writes its rows' (max, sum, output) [warp][row][dh + 2] over the tiles' memory.
  float* merge = reinterpret_cast<float*>(kv_tiles);
  float* mine0 = merge + (warp * kRows + g) * (kDh + 2);
  float* mine1 = mine0 + 8 * (kDh + 2);
  if (t == 0) mine0[0] = m0, mine0[1] = l0, mine1[0] = m1, mine1[1] = l1;
#pragma unroll
  for (int nt = 0; nt < kDh / 8; ++nt) {
    mine0[2 + nt * 8 + 2 * t] = o[nt][0], mine0[3 + nt * 8 + 2 * t] = o[nt][1];
    mine1[2 + nt * 8 + 2 * t] = o[nt][2], mine1[3 + nt * 8 + 2 * t] = o[nt][3];
  }
  __syncthreads();
  for (int e = tid; e < rows * (kDh + 1); e += kTiledThreads) {
    const int r = e / (kDh + 1), d = e % (kDh + 1) - 1;  // d = -1: the row's max and sum
    if (k0 >= keys_of[r]) continue;  // the row sees no key of this chunk (the combine does not read it)
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) m = fmaxf(m, merge[(w * kRows + r) * (kDh + 2)]);
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float* part = merge + (w * kRows + r) * (kDh + 2);
      total += (d < 0 ? part[1] : part[2 + d]) * __expf(part[0] - m);
    }
    float* out = p.partial_ptr + ((int64_t(first + r) * p.dims.heads + h) * p.max_chunks + blockIdx.z) * (kDh + 2);
    if (d < 0) {
      out[0] = m, out[1] = total;
    } else {
      out[2 + d] = total;
    }
  }
}

template <int kDh>
void LaunchGroupMma(const AttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.attn_groups), static_cast<unsigned>(p.dims.heads),
                  static_cast<unsigned>(p.max_chunks));
  LaunchTensorCoreKernel<AttentionGroupMmaKernel<kDh>, GroupLayout<kDh>::kBytes>(grid, p, stream);
}

}  // namespace

bool TiledAttentionApplies(const ModelDims& dims) {
  static const bool ampere = CurrentDeviceAttribute(cudaDevAttrComputeCapabilityMajor) >= 8;
  return ampere && (dims.head_dim == 64 || dims.head_dim == 128);
}

bool GroupAttentionMmaApplies(const ModelDims& dims) {
  return GetKernelSwitches().group_mma && TiledAttentionApplies(dims);
}

bool GroupAttentionMmaTakes(const ModelDims& dims, int64_t rows) {
  return rows >= GetKernelSwitches().group_mma_min_rows && GroupAttentionMmaApplies(dims);
}

void GroupAttentionMma(const AttentionParams& p, cudaStream_t stream) {
  switch (p.dims.head_dim) {
    case 64: return LaunchGroupMma<64>(p, stream);
    case 128: return LaunchGroupMma<128>(p, stream);
    default: ORYX_CUDA_CHECK(cudaErrorInvalidValue);  // callers check GroupAttentionMmaApplies
  }
}

void TiledAttention(const AttentionParams& p, cudaStream_t stream) {
  if (p.attn_rows == 0) return;
  switch (p.dims.head_dim) {
    case 64: return LaunchTiled<64>(p, stream);
    case 128: return LaunchTiled<128>(p, stream);
    default: ORYX_CUDA_CHECK(cudaErrorInvalidValue);  // callers check TiledAttentionApplies
  }
}

}  // namespace oryx::kernels::cuda
