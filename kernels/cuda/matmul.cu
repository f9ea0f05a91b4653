// Projections: y = x W^T with bf16 operands, fp32 accumulation and fp32 output (the residual stream and the
// mixer inputs stay fp32). Single-row products (decode steps) go through a GEMV kernel that streams the weight
// matrix once with 16-byte loads, a warp per output feature; products of 2 to 32 rows (a batch's decode step, a
// short verify span) through a tensor-core GEMV (MmaGemvKernel), or a several-row GEMV where it is faster
// (Gemm); the rest through cuBLAS (row-major y = x W^T is column-major y^T = W x^T, hence (T, N) below). FP8
// weights (QuantizeRowsFp8) past the tensor-core GEMV take the several-row GEMV up to 7 rows, a tensor-core
// kernel that widens them in registers up to 128 rows, and cuBLAS over a bf16 copy beyond.
#include <cublas_v2.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kGemvWarps = 8;
// Resident blocks of FusedGemvKernel per SM that its register use must allow (at most 64 registers), so
// that a decode-sized product runs in one wave (DefaultRowsPerWarp).
constexpr int kFusedGemvBlocksPerSm = 4;
constexpr int64_t kMaxFusedInputBytes = 200 * 1024;  // shared memory of a Hopper SM: 227 KiB
constexpr int kMaxHeadPieces = 4;  // the gated norm reads a head of up to 32 * 4 values into registers
// GemvKernel copies x into shared memory where it takes at most the default 48 KiB.
__host__ __device__ constexpr bool GemvStagesX(int64_t k) { return k * 2 <= 48 * 1024; }
constexpr int kMaxNormPieces = 2;  // the RMSNorm holds x in registers for K <= 4 * 256 * 2 (LoadRowPieces)

// Whether a product of 4 rows per warp whose grid fits 3 blocks per SM runs the wide kernel (LaunchFusedGemvAs);
// KernelSwitches::wide_gemv off: not.
bool WideGemv() { return GetKernelSwitches().wide_gemv; }

// Pieces of each weight row a lane loads at once: 8 loads in flight (16 would not fit in 64 registers).
constexpr int BatchFor(int rows) { return rows >= 8 ? 1 : 8 / rows; }

__device__ __forceinline__ void Unpack8(const uint4& raw, float* out) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(h[e]);
    out[2 * e] = f.x;
    out[2 * e + 1] = f.y;
  }
}

// A piece of a weight row: 16 bytes, 8 bf16 weights or 16 FP8 e4m3 ones (whose row scale the caller applies
// to the row's sum), unpacked kParts times 8 weights at a time against 8-element pieces of x.
template <bool kFp8>
struct WeightPiece {
  static constexpr int kWeights = 8, kParts = 1;
  static __device__ __forceinline__ void Unpack(const uint4& raw, int /*part*/, float* out) { Unpack8(raw, out); }
};
template <>
struct WeightPiece<true> {
  static constexpr int kWeights = 16, kParts = 2;
  static __device__ __forceinline__ void Unpack(const uint4& raw, int part, float* out) {
    const uint2 half = part == 0 ? make_uint2(raw.x, raw.y) : make_uint2(raw.z, raw.w);
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&half);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[e], __NV_E4M3)));
      out[2 * e] = f.x;
      out[2 * e + 1] = f.y;
    }
  }
};
// Weight row `row` of [N, K] as 16-byte pieces (K a multiple of the piece's weights).
template <bool kFp8>
__device__ __forceinline__ const uint4* WeightRow(const void* w, int64_t row, int64_t k) {
  return reinterpret_cast<const uint4*>(static_cast<const char*>(w) + row * k * (kFp8 ? 1 : 2));
}

// A lane's pieces of a weight row, first, first + stride, ... below `pieces`, kBatch at a time: load(base)
// fills the batch's registers (but for the first batch where it was loaded early), then use(b, part8, xi)
// runs for each 8-weight part of each piece (b: the piece in the batch; xi: the part's index among x's
// 8-element pieces).
template <int kBatch, int kParts, typename Load, typename Use>
__device__ __forceinline__ void ForEachWeightPart(int64_t first, int64_t stride, int64_t pieces, bool loaded_first,
                                                  Load&& load, Use&& use) {
  for (int64_t base = first; base < pieces; base += stride * kBatch) {
    if (!loaded_first || base != first) load(base);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t i = base + stride * b;
      if (i >= pieces) break;
#pragma unroll
      for (int part8 = 0; part8 < kParts; ++part8) use(b, part8, i * kParts + part8);
    }
  }
}

// y (+)= W x for one row x (a decode step). kSplit warps per output feature n (a block of kGemvWarps warps
// covers kGemvWarps / kSplit features): lanes stride over K in 16-byte pieces of W[n] (against 8-element pieces
// of x); with kSplit > 1 the warps of a feature take every kSplit-th stretch of 32 pieces and add up through
// shared memory. Splitting keeps enough loads in flight when N is small (N / 8 blocks would not fill the GPU).
template <int kSplit, int kBatch, bool kFp8>
__global__ void __launch_bounds__(32 * kGemvWarps, kFusedGemvBlocksPerSm) GemvKernel(GemmParams p) {
  using Piece = WeightPiece<kFp8>;
  constexpr int kRowsPerBlock = kGemvWarps / kSplit;
  __shared__ float partial[kGemvWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, part = warp % kSplit;
  const int64_t n = int64_t(blockIdx.x) * kRowsPerBlock + warp / kSplit;
  const bool active = n < p.n;
  const uint4* w = WeightRow<kFp8>(p.w_ptr, active ? n : 0, p.k);
  const uint4* x = reinterpret_cast<const uint4*>(p.x_ptr);
  const int64_t pieces = active ? p.k / Piece::kWeights : 0;
  constexpr int64_t kStride = 32 * kSplit;
  // kBatch pieces of the row per lane in flight at once (all issued before any is used); the first batch
  // before the wait for the previous kernel (see EarlyLoads).
  uint4 raw[kBatch];
  auto load = [&](int64_t base) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t i = base + kStride * b;
      raw[b] = i < pieces ? LoadWeight(w + i) : make_uint4(0, 0, 0, 0);
    }
  };
  // The row's scale (a weight: readable before the wait).
  const float scale = kFp8 && active && part == 0 && lane == 0 ? __ldg(p.w_scale + n) : 1.f;
  const int64_t first = part * 32 + lane;
  // The residual this feature adds to, before the wait where the caller says y was written two or more
  // kernels ago (the thread that writes it reads it).
  float prior = 0.f;
  const bool early_prior = p.early_loads && p.y_written_earlier && p.accumulate;
  if (p.early_loads) {
    load(first);
    if (early_prior && active && part == 0 && lane == 0) prior = p.y_ptr[n];
  }
  AfterPrevious();
  // x, which the kernel just before wrote, copied into shared memory at once: read piece by piece in the
  // loop below, it would be one round trip per piece (the loads cannot move above the loop's exits).
  extern __shared__ __align__(16) uint4 xs[];
  const bool stage = GemvStagesX(p.k);
  if (stage) {
    CopyToSharedAsync(reinterpret_cast<float*>(xs), reinterpret_cast<const float*>(p.x_ptr), p.k / 2);
    WaitCopies();
    __syncthreads();
  }
  float acc = 0.f;
  ForEachWeightPart<kBatch, Piece::kParts>(first, kStride, pieces, p.early_loads, load, [&](int b, int part8, int64_t xi) {
    float wf[8], xf[8];
    Piece::Unpack(raw[b], part8, wf);
    Unpack8(stage ? xs[xi] : __ldg(x + xi), xf);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += wf[e] * xf[e];
  });
  acc = WarpSum(acc);
  if constexpr (kSplit > 1) {
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (part == 0) {
      for (int s = 1; s < kSplit; ++s) acc += partial[warp + s];
    }
  }
  const bool owner = active && lane == 0 && part == 0;  // holds feature n's sum
  if constexpr (kFp8) acc *= scale;
  float y = 0.f;
  if (owner) p.y_ptr[n] = y = p.accumulate ? (early_prior ? prior : p.y_ptr[n]) + acc : acc;
  if (p.maybe_argmax_key != nullptr) {  // the block's best (y, n), then one atomic per block
    __shared__ unsigned long long best[kGemvWarps];
    if (lane == 0) best[warp] = owner ? ArgmaxKey(y, n) : 0ull;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long key = 0;
      for (int w = 0; w < kGemvWarps; ++w) key = max(key, best[w]);
      atomicMax(p.maybe_argmax_key, key);
    }
  }
}

// Input rows of the several-row GEMV, at most.
constexpr int kMaxGemvRows = 8;
// Several-row GEMV layout: each warp takes kMultiRowWeightRows weight rows against all kM input rows, so that
// each piece of x it reads serves 4 weight rows; the 4 warps of a quarter of the block split K.
// (With one weight row per warp the 1.4b linear step at batch 8 took 3.9 ms against 1.7 ms with bf16 weights
// through cuBLAS: 8 rows of x read for every weight byte ask more of shared memory than it delivers, by our
// estimate.)
constexpr int kMultiRowWeightRows = 4, kMultiRowSplit = 4, kMultiRowBlocksPerSm = 2;

// y[m] (+)= W x[m] for 2..8 rows of x and FP8 or bf16 weights (decode steps of a batch, verify spans): the
// weights read once for all the rows, x through L1. (Staging x in shared memory, as the one-row kernels do, made each
// block of 8 weight rows copy all kM rows of x first: at 8 rows, twice the bytes of its weights, and the
// 1.4b linear step at batch 8 took 2.21 ms.)
template <int kM, bool kFp8>
__global__ void __launch_bounds__(32 * kGemvWarps, kMultiRowBlocksPerSm) MultiRowGemvKernel(GemmParams p) {
  using Piece = WeightPiece<kFp8>;
  constexpr int kR = kMultiRowWeightRows, kBatch = kM <= 4 ? 2 : 1;  // (more would spill the sums)
  __shared__ float partial[kGemvWarps][kR][kM];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, part = warp % kMultiRowSplit;
  const int64_t n0 = (int64_t(blockIdx.x) * (kGemvWarps / kMultiRowSplit) + warp / kMultiRowSplit) * kR;
  const int64_t K = p.k, pieces = K / Piece::kWeights;
  const uint4* w[kR];
  float scale[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const int64_t row = n0 + r < p.n ? n0 + r : 0;  // (past the end: row 0, not written)
    w[r] = WeightRow<kFp8>(p.w_ptr, row, K);
    scale[r] = kFp8 ? __ldg(p.w_scale + row) : 1.f;
  }
  constexpr int64_t kStride = 32 * kMultiRowSplit;
  const int64_t first = part * 32 + lane;
  uint4 raw[kBatch][kR];
  auto load = [&](int64_t base) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t i = base + kStride * b;
#pragma unroll
      for (int r = 0; r < kR; ++r) raw[b][r] = i < pieces ? LoadWeight(w[r] + i) : make_uint4(0, 0, 0, 0);
    }
  };
  if (p.early_loads) load(first);
  AfterPrevious();
  float acc[kR][kM] = {};
  ForEachWeightPart<kBatch, Piece::kParts>(first, kStride, pieces, p.early_loads, load, [&](int b, int part8, int64_t xi) {
    float wf[kR][8];
#pragma unroll
    for (int r = 0; r < kR; ++r) Piece::Unpack(raw[b][r], part8, wf[r]);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      float xf[8];
      Unpack8(__ldg(reinterpret_cast<const uint4*>(p.x_ptr + m * p.x_row_stride) + xi), xf);
#pragma unroll
      for (int r = 0; r < kR; ++r) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][m] += wf[r][e] * xf[e];
      }
    }
  });
#pragma unroll
  for (int r = 0; r < kR; ++r) {
#pragma unroll
    for (int m = 0; m < kM; ++m) acc[r][m] = WarpSum(acc[r][m]);
  }
  if (lane == 0) {
    for (int r = 0; r < kR; ++r) {
      for (int m = 0; m < kM; ++m) partial[warp][r][m] = acc[r][m];
    }
  }
  __syncthreads();
  // The split's first warp adds up the others' sums and writes the outputs, its lanes over (row, input).
  if (part != 0) return;
  for (int j = lane; j < kR * kM; j += 32) {
    const int r = j / kM, m = j % kM;
    if (n0 + r >= p.n) continue;
    float sum = 0.f;
    for (int s = 0; s < kMultiRowSplit; ++s) sum += partial[warp + s][r][m];
    float* out = p.y_ptr + m * p.y_row_stride + n0 + r;
    *out = p.accumulate ? *out + sum * scale[r] : sum * scale[r];
  }
}

// Weight bytes 0 and 1 (lo) and 2 and 3 (hi) of `word`, four e4m3 values, as bf16 pairs, exactly. Each byte
// s eeee mmm goes to bf16 bits s 0000 eeee mmm 0000, which read as bf16 are the value times 2^-120 (normal or,
// for e4m3's subnormals, subnormal), and one bf16 multiply by 2^120 restores it. Integer ops and one bf16
// multiply, where cvt to half, then float, then bf16 took three conversions a pair (the conversion pipe runs at
// a quarter of the FMA rate).
__device__ __forceinline__ void Bf16PairsOfFp8(uint32_t word, uint32_t& lo, uint32_t& hi) {
  const __nv_bfloat162 k2to120 = __halves2bfloat162(__ushort_as_bfloat16(0x7B80), __ushort_as_bfloat16(0x7B80));
  auto widen = [&](uint32_t spread) {  // spread: bytes [b, 0, b', 0]
    const uint32_t bits = ((spread << 8) & 0x80008000u) | ((spread << 4) & 0x07f007f0u);
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), k2to120);
    return *reinterpret_cast<const uint32_t*>(&v);
  };
  lo = widen(__byte_perm(word, 0u, 0x4140));
  hi = widen(__byte_perm(word, 0u, 0x4342));
}

// Weights against 2 to kMmaGemvMaxRows rows of x (a batch's decode step, a short verify span) on tensor cores,
// each weight read once for all the rows. The weights are the mma's A operand (a block's 16 weight rows) and x
// its B operand (tiles of 8 rows of x), so that a batch of 8 fills the mma and no padding is multiplied. K goes
// in steps of 64 bytes of each weight row: 32 bf16 weights, or 64 FP8 ones widened in registers
// (Bf16PairsOfFp8, exact; the row's scale applied to its sum). Lane 4g + t reads 16 bytes of weight rows g and
// g + 8, the step's elements [e t, e t + e) (e = 8 bf16 or 16 FP8 weights), and the same elements of x's row g
// of each tile, and feeds them to e / 4 mma steps of 16. The mma's k-index (2t, 2t + 1, 2t + 8, 2t + 9) of
// mma step q stands for elements e t + 4q + (0, 1, 2, 3), the same for both operands, so each k pairs equal
// elements and the step's are each summed once. The warps of a block take every warps-th step of K, each
// holding its next steps' weights and x in flight while it multiplies, and add up their sums through shared
// memory in warp order (the same order at every call).
// (Blocks of 32 weight rows, which read x from L2 half as often, were measured no faster at 9-32 rows on the
// H100, and slower at 9-16: results/2026-12-07-h100-bf16-mma.)
constexpr int kMmaGemvMaxWarps = 16;
template <int kTiles, bool kFp8>
__global__ void __launch_bounds__(32 * kMmaGemvMaxWarps) MmaGemvKernel(GemmParams p) {
  constexpr int kQuads = kFp8 ? 2 : 1;       // 16-byte pieces of x per lane, step and tile
  constexpr int kMmaSteps = 2 * kQuads;      // mma steps of 16 per step
  constexpr int kStep = 32 * kQuads;         // elements of K per step
  constexpr int kBatch = kTiles * kQuads <= 2 ? 2 : 1;  // steps a buffer holds (more would not fit the registers)
  const int warps = static_cast<int>(blockDim.x / 32), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t steps = p.k / kStep;
  // The block's weight row r (0-15): rows [16 b, 16 b + 16) of block b, or with the SwiGLU epilogue the gate
  // rows [8 b, 8 b + 8) and their up rows, n / 2 further.
  const bool swiglu = p.maybe_swiglu_ptr != nullptr;
  const int64_t half = p.n / 2, block = blockIdx.x;
  auto block_row = [&](int r) { return swiglu ? (r < 8 ? 0 : half) + 8 * block + r % 8 : 16 * block + r; };
  auto inside = [&](int r) { return swiglu ? 8 * block + r % 8 < half : block_row(r) < p.n; };
  const uint4* w_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 8 * h + g;  // (past the end: row 0, not written)
    w_row[h] = WeightRow<kFp8>(p.w_ptr, inside(r) ? block_row(r) : 0, p.k) + t;
  }
  const uint4* x_row[kTiles];
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const int64_t m = 8 * i + g;
    x_row[i] = reinterpret_cast<const uint4*>(p.x_ptr + (m < p.m ? m : p.m - 1) * p.x_row_stride) + kQuads * t;
  }
  // Two buffers of kBatch steps each: the one multiplied, the next one loading (indexed by constants, so that
  // they stay in registers). Step b of a buffer whose first step is `base`: base + warps * b.
  uint4 w[2][kBatch][2], x[2][kBatch][kTiles][kQuads];
  auto load_w = [&](int buffer, int64_t base) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t s = base + int64_t(warps) * b;
#pragma unroll
      for (int h = 0; h < 2; ++h) w[buffer][b][h] = s < steps ? LoadWeight(w_row[h] + 4 * s) : uint4{};
    }
  };
  auto load_x = [&](int buffer, int64_t base) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t s = base + int64_t(warps) * b;
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
#pragma unroll
        for (int q = 0; q < kQuads; ++q) x[buffer][b][i][q] = s < steps ? __ldg(x_row[i] + 4 * kQuads * s + q) : uint4{};
      }
    }
  };
  // The bf16 pairs of weight row `raw` (16 bytes) for elements e t + 4q + (0, 1) (lo) and + (2, 3) (hi).
  auto pairs = [](const uint4& raw, int q, uint32_t& lo, uint32_t& hi) {
    if constexpr (kFp8) {
      Bf16PairsOfFp8(q == 0 ? raw.x : q == 1 ? raw.y : q == 2 ? raw.z : raw.w, lo, hi);
    } else {
      lo = q == 0 ? raw.x : raw.z;
      hi = q == 0 ? raw.y : raw.w;
    }
  };
  float acc[kTiles][4] = {};
  auto multiply = [&](const uint4 (&wb)[kBatch][2], const uint4 (&xb)[kBatch][kTiles][kQuads]) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {  // (steps past K hold zeros)
#pragma unroll
      for (int q = 0; q < kMmaSteps; ++q) {
        uint32_t a[4];  // rows g and g + 8 (the mma's a[0], a[2] and a[1], a[3])
        pairs(wb[b][0], q, a[0], a[2]);
        pairs(wb[b][1], q, a[1], a[3]);
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          const uint4& xv = xb[b][i][q / 2];
          MmaBf16(acc[i], a, q % 2 == 0 ? xv.x : xv.z, q % 2 == 0 ? xv.y : xv.w);
        }
      }
    }
  };
  const int64_t first = warp, stride = int64_t(warps) * kBatch;
  if (p.early_loads) load_w(0, first);
  PrefetchShareToL2(p.maybe_prefetch_ptr, p.prefetch_bytes);
  AfterPrevious();
  if (!p.early_loads) load_w(0, first);
  load_x(0, first);
  // Shared memory: the warps' sums [warp][row of x][weight row of the block], then the rows' norm scales
  // (GemmParams::norm_in) and the new values of a residual add (norm_out) [row of x][weight row].
  constexpr int kRowsX = 8 * kTiles;
  extern __shared__ __align__(16) unsigned char mma_gemv_smem[];
  float* sums = reinterpret_cast<float*>(mma_gemv_smem);
  float* row_scale = sums + warps * kRowsX * 16;
  float* fresh = row_scale + kRowsX;
  // The rows' norm scales while the first loads are in flight: warp w adds up the blocks' sums of squares of
  // rows w, w + warps, ..., its lanes over the blocks, in the same order in every block.
  if (p.norm_in.sum_sq_ptr != nullptr) {
    const int64_t parts = CeilDivDevice(p.k, 16);
    for (int m = warp; m < p.m; m += warps) {
      float sum_sq = 0.f;
#pragma unroll 4
      for (int64_t b = lane; b < parts; b += 32) sum_sq += __ldg(p.norm_in.sum_sq_ptr + b * p.m + m);
      sum_sq = WarpSum(sum_sq);
      if (lane == 0) row_scale[m] = rsqrtf(sum_sq / static_cast<float>(p.k) + p.norm_in.eps);
    }
  }
  for (int64_t base = first; base < steps; base += 2 * stride) {
    if (base + stride < steps) {
      load_w(1, base + stride);
      load_x(1, base + stride);
    }
    multiply(w[0], x[0]);
    if (base + stride >= steps) break;
    if (base + 2 * stride < steps) {
      load_w(0, base + 2 * stride);
      load_x(0, base + 2 * stride);
    }
    multiply(w[1], x[1]);
  }
  // The warps' sums, added up in warp order.
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) sums[(warp * kRowsX + 8 * i + 2 * t + e % 2) * 16 + g + 8 * (e / 2)] = acc[i][e];
  }
  __syncthreads();
  // Row r's output for row m of x.
  auto output = [&](int m, int r) {
    float sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += sums[(w * kRowsX + m) * 16 + r];
    if constexpr (kFp8) sum *= __ldg(p.w_scale + block_row(r));
    if (p.norm_in.sum_sq_ptr != nullptr) sum *= row_scale[m];
    return sum;
  };
  if (swiglu) {  // what SwiGlu writes from the outputs, exactly: the same sums in the same order
    for (int e = threadIdx.x; e < kRowsX * 8; e += blockDim.x) {
      const int m = e / 8, j = e % 8;
      if (m < p.m && inside(j)) {
        p.maybe_swiglu_ptr[m * half + block_row(j)] = __float2bfloat16(Silu(output(m, j)) * output(m, 8 + j));
      }
    }
    return;
  }
  const GemmParams::NormOut& norm = p.norm_out;
  for (int e = threadIdx.x; e < kRowsX * 16; e += blockDim.x) {
    const int m = e / 16, r = e % 16;
    if (m >= p.m) continue;
    if (!inside(r)) {
      fresh[e] = 0.f;
      continue;
    }
    const int64_t n = block_row(r);
    float* out = p.y_ptr + m * p.y_row_stride + n;
    const float value = p.accumulate ? *out + output(m, r) : output(m, r);
    *out = value;
    if (norm.scaled_ptr != nullptr) {
      norm.scaled_ptr[m * p.n + n] = __float2bfloat16(value * __ldg(norm.weight_ptr + n));
      fresh[e] = value;
    }
  }
  if (norm.scaled_ptr == nullptr) return;
  __syncthreads();
  for (int m = threadIdx.x; m < p.m; m += blockDim.x) {
    float sum_sq = 0.f;
#pragma unroll
    for (int r = 0; r < 16; ++r) sum_sq += fresh[m * 16 + r] * fresh[m * 16 + r];
    norm.sum_sq_ptr[block * p.m + m] = sum_sq;
  }
}

// FP8 weights against more rows than the GEMVs take (Fp8MmaApplies; 64 rows a launch): tensor cores in bf16,
// the weights widened in registers (Bf16PairsOfFp8: exact), fp32 sums. Each weight is read once for all the
// rows of a launch: 1 byte a weight, where cuBLAS over a bf16 copy made in front reads and writes 5.
//
// A warp owns kFp8MmaTiles tiles of 8 weight rows (the mma's B operand, n) against all the rows of x (A, m, in
// tiles of 16). K (a multiple of 32) goes in chunks of 128, the last maybe short: lane 4g + t reads bytes
// [32t, 32t + 32) of its tiles' weight row g and elements [32t, 32t + 32) of its rows of x, and feeds them to
// the mma as 8 steps of 16. The mma's
// k-index (2t, 2t + 1, 2t + 8, 2t + 9 of a step) is mapped to elements 32t + 4s + (0, 1, 2, 3) of step s; the
// same for both operands, so each step still pairs equal k and the chunk's 128 elements are each summed once.
// Where the weight rows make too few blocks, K is split over the blocks of a thread-block cluster, which add
// up their sums through distributed shared memory in split order (no partial sums in global memory, no
// second kernel).
constexpr int kFp8MmaWarps = 4, kFp8MmaTiles = 4;
constexpr int64_t kFp8MmaRowsPerBlock = 8 * kFp8MmaTiles * kFp8MmaWarps;  // weight rows (outputs)
constexpr int64_t kFp8MmaChunk = 128;
constexpr int kFp8MmaTilesM = 4;     // tiles of 16 rows of x per launch
constexpr int kFp8MmaMaxSplits = 8;  // blocks of a cluster (the portable most), from 33 rows
// Up to 32 rows, clusters of up to 16 blocks (non-portable, allowed on Hopper): in the 1.4b linear step, fp8
// at batch 8 took 1.482 against 1.565 ms with clusters of 8 and at batch 32 2.447 against 2.659 ms
// (the output and down projections, 16 blocks of weight rows each, then split 16 ways); at 64 rows
// clusters of 16 were slower (4.66 against 4.59 ms). results/2026-12-04-h200-fp8-pipeline.
constexpr int kFp8MmaMaxSplitsFewRows = 16;

// Elements a row of staged x takes in shared memory, and the kernel's shared memory: the staged x, or the
// split-K tile of fp32 sums that replaces it at the end, whichever is larger.
__host__ __device__ constexpr int64_t Fp8MmaStagedRow(int64_t chunks_per_split) {
  return chunks_per_split * kFp8MmaChunk + 8;
}
constexpr int64_t Fp8MmaSmemBytes(int tiles_m, int64_t chunks_per_split) {
  const int64_t x = 16 * tiles_m * Fp8MmaStagedRow(chunks_per_split) * 2, tile = 16 * tiles_m * kFp8MmaRowsPerBlock * 4;
  return x > tile ? x : tile;
}
constexpr int64_t kFp8MmaMaxSmem = 100 * 1024;  // two blocks an SM
// (At 64 rows the kernel takes 210 registers, so two blocks an SM. Limited to 168 for three, with a few spills,
// it ran the 1.4b linear step at batch 64 in 4.46 against 4.59 ms, but the attention step in 18.0 against
// 17.8 ms, also where only the up projection took it; not kept. results/2026-12-04-h200-fp8-64-rows.)

// Block (blockIdx.x, blockIdx.y): weight rows [128 x, 128 x + 128), split y of gridDim.y over K (a cluster of
// gridDim.y blocks when it is more than 1). y (+)= scale * sum.
template <int kTilesM>
__global__ void __launch_bounds__(32 * kFp8MmaWarps) Fp8MmaGemmKernel(GemmParams p, int64_t chunks_per_split) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t n_block = int64_t(blockIdx.x) * kFp8MmaRowsPerBlock, n_warp = n_block + warp * (8 * kFp8MmaTiles);
  const int64_t chunks = (p.k + kFp8MmaChunk - 1) / kFp8MmaChunk, first_chunk = int64_t(blockIdx.y) * chunks_per_split;
  const int64_t last_chunk = min(chunks, first_chunk + chunks_per_split);
  // Whether the lane's 32 elements of a chunk lie inside K (K a multiple of 32: the last chunk may be short).
  auto inside = [&](int64_t chunk) { return chunk * kFp8MmaChunk + 32 * t < p.k; };
  const uint8_t* w_row[kFp8MmaTiles];
#pragma unroll
  for (int j = 0; j < kFp8MmaTiles; ++j) {
    const int64_t n = n_warp + 8 * j + g;
    w_row[j] = static_cast<const uint8_t*>(p.w_ptr) + (n < p.n ? n : 0) * p.k + 32 * t;  // (past the end: row 0)
  }
  uint4 w[2][kFp8MmaTiles][2];  // two chunks' 32 bytes per tile: the one computed, the next one loading
  auto load = [&](int buffer, int64_t chunk) {
#pragma unroll
    for (int j = 0; j < kFp8MmaTiles; ++j) {
      const uint4* q = reinterpret_cast<const uint4*>(w_row[j] + chunk * kFp8MmaChunk);
      const bool in = inside(chunk);  // (outside: zeros, which widen to zeros)
      w[buffer][j][0] = in ? LoadWeight(q) : make_uint4(0, 0, 0, 0);
      w[buffer][j][1] = in ? LoadWeight(q + 1) : make_uint4(0, 0, 0, 0);
    }
  };
  if (first_chunk < last_chunk && p.early_loads) load(0, first_chunk);
  AfterPrevious();
  if (first_chunk < last_chunk && !p.early_loads) load(0, first_chunk);
  // The block's slice of x, [16 kTilesM][its chunks x 128 + 8] bf16 (the 8: rows apart in the banks), staged
  // once: each x load would otherwise wait on L2 inside every chunk, with too few warps per SM to hide it.
  // (Rows past M are left as they are: their sums are not written.)
  extern __shared__ __align__(16) unsigned char fp8_mma_smem[];
  bf16* xs = reinterpret_cast<bf16*>(fp8_mma_smem);
  const int64_t columns = min(p.k, last_chunk * kFp8MmaChunk) - first_chunk * kFp8MmaChunk;
  const int64_t row_stride = Fp8MmaStagedRow(chunks_per_split);
  for (int64_t e = threadIdx.x; e < p.m * (columns / 8); e += blockDim.x) {
    const int64_t m = e / (columns / 8), c = 8 * (e % (columns / 8));
    CopyQuadAsync(reinterpret_cast<float*>(xs + m * row_stride + c),
                  reinterpret_cast<const float*>(p.x_ptr + m * p.x_row_stride + first_chunk * kFp8MmaChunk + c));
  }
  WaitCopies();
  __syncthreads();
  // x's rows of this lane: 16 i + g and 16 i + g + 8 of tile i.
  const bf16* x_row[kTilesM][2];
#pragma unroll
  for (int i = 0; i < kTilesM; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) x_row[i][h] = xs + (16 * i + g + 8 * h) * row_stride + 32 * t;
  }
  float acc[kTilesM][kFp8MmaTiles][4] = {};
  // One chunk against the weights in wb (w[0] or w[1]: the buffers are indexed by constants, so that they stay
  // in registers).
  auto compute = [&](const uint4 (&wb)[kFp8MmaTiles][2], int64_t chunk) {
    const bool in = inside(chunk);  // (outside K: zeros, not the unstaged shared memory, which may hold NaNs)
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // 8 elements of x per row: steps 2q and 2q + 1
      uint4 x[kTilesM][2];
#pragma unroll
      for (int i = 0; i < kTilesM; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          x[i][h] = in ? reinterpret_cast<const uint4*>(x_row[i][h] + (chunk - first_chunk) * kFp8MmaChunk)[q]
                       : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * q + half;  // the step: weight bytes 4s .. 4s + 3 of the lane's 32
#pragma unroll
        for (int j = 0; j < kFp8MmaTiles; ++j) {
          const uint4& raw = wb[j][s / 4];
          const uint32_t word = (s % 4 == 0) ? raw.x : (s % 4 == 1) ? raw.y : (s % 4 == 2) ? raw.z : raw.w;
          uint32_t b0, b1;
          Bf16PairsOfFp8(word, b0, b1);
#pragma unroll
          for (int i = 0; i < kTilesM; ++i) {
            const uint32_t a[4] = {half == 0 ? x[i][0].x : x[i][0].z, half == 0 ? x[i][1].x : x[i][1].z,
                                   half == 0 ? x[i][0].y : x[i][0].w, half == 0 ? x[i][1].y : x[i][1].w};
            MmaBf16(acc[i][j], a, b0, b1);
          }
        }
      }
    }
  };
  // Chunks in pairs, each loading the next one's weights before it computes.
  for (int64_t chunk = first_chunk; chunk < last_chunk; chunk += 2) {
    if (chunk + 1 < last_chunk) load(1, chunk + 1);
    compute(w[0], chunk);
    if (chunk + 1 == last_chunk) break;
    if (chunk + 2 < last_chunk) load(0, chunk + 2);
    compute(w[1], chunk + 1);
  }
  auto store = [&](int64_t m, int64_t n, float sum) {
    float* out = p.y_ptr + m * p.y_row_stride + n;
    const float v = sum * __ldg(p.w_scale + n);
    *out = p.accumulate ? *out + v : v;
  };
  // f(m, column of the block's 128, sum) for each of the lane's sums.
  auto for_each_sum = [&](auto&& f) {
#pragma unroll
    for (int i = 0; i < kTilesM; ++i) {
#pragma unroll
      for (int j = 0; j < kFp8MmaTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          f(16 * i + g + 8 * (e / 2), warp * 8 * kFp8MmaTiles + 8 * j + 2 * t + e % 2, acc[i][j][e]);
        }
      }
    }
  };
  if (gridDim.y == 1) {
    for_each_sum([&](int m, int column, float sum) {
      if (m < p.m && n_block + column < p.n) store(m, n_block + column, sum);
    });
    return;
  }
  // Split K: each block's sums into its shared memory; then block r of the cluster adds up its share of the
  // tile's outputs over the splits, in split order, and writes them.
  constexpr int kTileN = static_cast<int>(kFp8MmaRowsPerBlock), kTileElements = 16 * kTilesM * kTileN;
  __syncthreads();  // every warp is done with the staged x, which the tile replaces
  float* tile = reinterpret_cast<float*>(fp8_mma_smem);  // [16 kTilesM][128]
  for_each_sum([&](int m, int column, float sum) { tile[m * kTileN + column] = sum; });
  ClusterSync();
  const int splits = static_cast<int>(gridDim.y), rank = static_cast<int>(ClusterRank());
  const int share = kTileElements / splits;
  for (int e = rank * share + threadIdx.x; e < (rank + 1) * share; e += blockDim.x) {
    const int64_t m = e / kTileN, n = n_block + e % kTileN;
    if (m >= p.m || n >= p.n) continue;
    float sum = 0.f;
    for (int r = 0; r < splits; ++r) sum += ClusterPeer(tile, static_cast<unsigned>(r))[e];
    store(m, n, sum);
  }
  ClusterSync();  // no block leaves while a peer still reads its tile
}

// K split over the blocks of a cluster until about two waves of blocks run, each split at least 2 chunks (1
// up to 32 rows), at most kFp8MmaMaxSplits (kFp8MmaMaxSplitsFewRows up to 32 rows where `wide_clusters`); and
// further, up to that many, while a split's staged x would not fit.
int Fp8MmaSplits(const GemmParams& p, int tiles_m, bool wide_clusters) {
  const bool few_rows = tiles_m <= 2;
  const int max_splits = few_rows && wide_clusters ? kFp8MmaMaxSplitsFewRows : kFp8MmaMaxSplits;
  const int64_t min_chunks = few_rows ? 1 : 2;
  const int64_t blocks = CeilDiv(p.n, kFp8MmaRowsPerBlock), chunks = CeilDiv(p.k, kFp8MmaChunk);
  const int64_t target = int64_t{2} * MultiprocessorCount();  // (1 or 4 waves: no faster on the H200)
  auto smem = [&](int splits) { return Fp8MmaSmemBytes(tiles_m, CeilDiv(chunks, int64_t{splits})); };
  int splits = 1;
  while (2 * splits <= max_splits && 2 * splits <= chunks &&
         ((blocks * splits < target && 2 * splits * min_chunks <= chunks) || smem(splits) > kFp8MmaMaxSmem)) {
    splits *= 2;
  }
  return splits;
}

// Configures an instance of Fp8MmaGemmKernel once: more than the default 48 KiB of shared memory, and clusters
// of more than 8 blocks (kFp8MmaMaxSplitsFewRows).
template <int kTilesM>
auto Fp8MmaKernel() {
  auto kernel = Fp8MmaGemmKernel<kTilesM>;
  static const bool configured = [&] {
    ORYX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kMaxFusedInputBytes)));
    ORYX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    return true;
  }();
  (void)configured;
  return kernel;
}

// Whether clusters of kFp8MmaMaxSplitsFewRows blocks can be resident on this GPU (Hopper parts or partitions
// with smaller GPCs may not hold them; the splits then stop at the portable kFp8MmaMaxSplits). Asked once.
bool WideClustersFit() {
  static const bool fit = [] {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1, kFp8MmaMaxSplitsFewRows, 1);
    config.blockDim = dim3(32 * kFp8MmaWarps, 1, 1);
    config.dynamicSmemBytes = static_cast<size_t>(Fp8MmaSmemBytes(2, 2));  // (a split's x at 32 rows and K 4096)
    cudaLaunchAttribute attribute = {};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = 1;
    attribute.val.clusterDim.y = kFp8MmaMaxSplitsFewRows;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, Fp8MmaKernel<2>(), &config) != cudaSuccess) {
      (void)cudaGetLastError();  // (not an error of the caller's: the query's answer is no)
      return false;
    }
    return clusters > 0;
  }();
  return fit;
}

// Rows in groups of up to 64 (kFp8MmaTilesM tiles of 16), one launch each: a group past the first reads the
// weights again (from L2 where the matrix fits there).
void LaunchFp8Mma(const GemmParams& p_in, cudaStream_t stream) {
  for (int64_t m0 = 0; m0 < p_in.m; m0 += 16 * kFp8MmaTilesM) {
    GemmParams p = p_in;
    p.m = std::min<int64_t>(16 * kFp8MmaTilesM, p_in.m - m0);
    p.x_ptr += m0 * p.x_row_stride;
    p.y_ptr += m0 * p.y_row_stride;
    p.early_loads = EarlyLoads();
    const int tiles_m = static_cast<int>(CeilDiv(p.m, int64_t{16}));
    const int splits = Fp8MmaSplits(p, tiles_m, WideClustersFit());
    const int64_t per_split = CeilDiv(CeilDiv(p.k, kFp8MmaChunk), int64_t{splits});
    const dim3 grid(static_cast<unsigned>(CeilDiv(p.n, kFp8MmaRowsPerBlock)), static_cast<unsigned>(splits));
    const dim3 cluster(1, static_cast<unsigned>(splits), 1);
    const int64_t smem = Fp8MmaSmemBytes(tiles_m, per_split);
    if (smem > kMaxFusedInputBytes) ORYX_CUDA_CHECK(cudaErrorInvalidValue);  // (Fp8MmaApplies: K small enough)
    auto launch = [&](auto tiles) {
      LaunchAfterPrevious(Fp8MmaKernel<decltype(tiles)::value>(), grid, 32 * kFp8MmaWarps, static_cast<size_t>(smem),
                          stream, cluster, p, per_split);
    };
    switch (tiles_m) {
      case 1:
        launch(std::integral_constant<int, 1>{});
        break;
      case 2:
        launch(std::integral_constant<int, 2>{});
        break;
      case 3:
        launch(std::integral_constant<int, 3>{});
        break;
      default:
        launch(std::integral_constant<int, kFp8MmaTilesM>{});
        break;
    }
  }
}

// MmaGemvKernel for p.m rows (MmaGemvApplies), in tiles of 8 rows of x. Each block takes 4, 8 or 16
// warps: the fewest for which the grid holds 16 warps an SM (products of few weight rows, such as 1.4b's
// output and down projections, would otherwise keep too few loads in flight).
void LaunchMmaGemv(const GemmParams& p_in, cudaStream_t stream) {
  GemmParams p = p_in;
  p.early_loads = EarlyLoads();
  auto launch = [&](auto tiles) {
    constexpr int kTiles = decltype(tiles)::value;
    auto kernel = p.w_scale != nullptr ? MmaGemvKernel<kTiles, true> : MmaGemvKernel<kTiles, false>;
    constexpr int64_t kSmemPerWarp = 16 * 8 * kTiles * 4, kSmemNorms = 17 * 8 * kTiles * 4;
    static const bool configured = [] {
      for (auto instance : {MmaGemvKernel<kTiles, true>, MmaGemvKernel<kTiles, false>}) {
        ORYX_CUDA_CHECK(cudaFuncSetAttribute(instance, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int{kMmaGemvMaxWarps * kSmemPerWarp + kSmemNorms}));
      }
      return true;
    }();
    (void)configured;
    const int64_t blocks = p.maybe_swiglu_ptr != nullptr ? CeilDiv(p.n / 2, 8) : CeilDiv(p.n, 16);
    int warps = 4;
    while (warps < kMmaGemvMaxWarps && blocks * warps < int64_t{16} * MultiprocessorCount()) warps *= 2;
    LaunchAfterPrevious(kernel, static_cast<unsigned>(blocks), 32 * warps,
                        static_cast<size_t>(warps * kSmemPerWarp + kSmemNorms), stream, p);
  };
  switch (CeilDiv(p.m, 8)) {
    case 1:
      return launch(std::integral_constant<int, 1>{});
    case 2:
      return launch(std::integral_constant<int, 2>{});
    case 3:
      return launch(std::integral_constant<int, 3>{});
    default:
      return launch(std::integral_constant<int, 4>{});
  }
}

// Calls f(std::integral_constant<int, M>{}) with M = m for m in 1..7 and M = 8 otherwise: the row counts the
// fused GEMV kernel is instantiated for (callers split larger m).
template <typename F>
void WithRowCount(int64_t m, F&& f) {
  switch (m) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// Warps per output feature: 1 when N fills the GPU with N / 8 blocks; else 4, or 2 where 4 would take a
// second wave of blocks (the down projection of 1.4b: 512 blocks, not 1024; 1.269-1.279 against
// 1.293-1.295 ms for the 1.4b linear step at 32K in one call).
int GemvSplit(int64_t n) {
  if (n >= 8192) return 1;
  const int64_t one_wave = int64_t{kFusedGemvBlocksPerSm} * MultiprocessorCount();
  return CeilDiv(n, kGemvWarps / 4) <= one_wave ? 4 : 2;
}

void LaunchGemv(const GemmParams& p_in, cudaStream_t stream) {
  GemmParams p = p_in;
  p.early_loads = EarlyLoads();
  if (p.m > 1) {  // FP8 weights, or bf16 with KernelSwitches::multirow_bf16 (GemvApplies)
    WithRowCount(p.m, [&](auto rows) {
      const int64_t rows_per_block = kMultiRowWeightRows * (kGemvWarps / kMultiRowSplit);
      const auto grid = static_cast<unsigned>(CeilDiv(p.n, rows_per_block));
      if (p.w_scale != nullptr) {
        LaunchAfterPrevious(MultiRowGemvKernel<decltype(rows)::value, true>, grid, 32 * kGemvWarps, 0, stream, p);
      } else {
        LaunchAfterPrevious(MultiRowGemvKernel<decltype(rows)::value, false>, grid, 32 * kGemvWarps, 0, stream, p);
      }
    });
    return;
  }
  constexpr int kBatch = 8;  // 16-byte pieces in flight per lane
  const size_t x_bytes = GemvStagesX(p.k) ? p.k * sizeof(bf16) : 0;
  auto launch = [&](auto kernel, int split) {
    LaunchAfterPrevious(kernel, static_cast<unsigned>(CeilDiv(p.n, kGemvWarps / split)), 32 * kGemvWarps, x_bytes,
                        stream, p);
  };
  auto with = [&](auto fp8) {
    constexpr bool kFp8 = decltype(fp8)::value;
    switch (GemvSplit(p.n)) {
      case 1:
        return launch(GemvKernel<1, kBatch, kFp8>, 1);
      case 2:
        return launch(GemvKernel<2, kBatch, kFp8>, 2);
      default:
        return launch(GemvKernel<4, kBatch, kFp8>, 4);
    }
  };
  if (p.w_scale != nullptr) return with(std::true_type{});
  with(std::false_type{});
}

// The decode-step GEMV with its input computed in the block's prologue (see ops_cuda.h): the M input rows
// are normalised / gated into shared memory as bf16 (what the separate kernels would have written), then
// each warp streams kRows weight rows against them, their loads in flight together. More rows per warp
// spread the prologue over more weight bytes; fewer give more blocks to fill the GPU (DefaultRowsPerWarp).
// kSwiGluOut: the warp's rows are kRows / 2 pairs (gate row j, up row j + n/2) and it writes
// bf16(SiLU(gate) * up) for feature j instead of the two products.
template <int kM, int kRows, bool kSwiGluOut, int kBatch, int kBlocksPerSm, bool kFp8>
__global__ void __launch_bounds__(32 * kGemvWarps, kBlocksPerSm) FusedGemvKernel(FusedGemvParams p) {
  static_assert(!kSwiGluOut || kRows % 2 == 0);
  using Piece = WeightPiece<kFp8>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* xs = reinterpret_cast<bf16*>(smem_raw);  // [kM, K]
  __shared__ float scratch[32];
  const int64_t K = p.k, pieces = K / Piece::kWeights;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // This warp's weight rows (an index past the product's rows reads row 0 and is not written).
  const int64_t unit = int64_t(blockIdx.x) * kGemvWarps + warp, features = kSwiGluOut ? p.n / 2 : p.n;
  int64_t out[kRows];
  const uint4* w[kRows];
  float scale[kRows];  // FP8: each row's scale (weights: read before the wait)
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    int64_t row;
    if constexpr (kSwiGluOut) {
      out[k] = unit * (kRows / 2) + k / 2;
      row = out[k] < features ? out[k] + (k % 2) * features : 0;
    } else {
      const int64_t i = unit * kRows + k;
      out[k] = p.skip_rows > 0 && i >= p.skip_begin ? i + p.skip_rows : i;
      row = i < features ? out[k] : 0;
      if (i >= features) out[k] = -1;
    }
    w[k] = WeightRow<kFp8>(p.w_ptr, row, K);
    scale[k] = kFp8 ? __ldg(p.w_scale + row) : 1.f;
  }
  // kBatch pieces of each of the kRows rows per lane in flight at once (all issued before any is used); the
  // first batch before the wait for the previous kernel (see EarlyLoads), so that it streams during that
  // kernel's tail and this one's prologue.
  uint4 raw[kBatch][kRows];
  auto load = [&](int64_t base) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t i = base + 32 * b;
#pragma unroll
      for (int k = 0; k < kRows; ++k) raw[b][k] = i < pieces ? LoadWeight(w[k] + i) : make_uint4(0, 0, 0, 0);
    }
  };
  // Also before the wait, where the caller says y was written two or more kernels ago: the residual this
  // warp's outputs add to (one input row), into shared memory (registers are short) -- otherwise a read
  // that the final store waits for.
  __shared__ float prior[kGemvWarps * kRows];
  const bool early_prior = p.early_loads && p.y_written_earlier && p.accumulate && kM == 1 && !kSwiGluOut;
  // The prologue's constants -- the norm weight, and the gate where it was written two or more kernels ago --
  // copied into shared memory before the wait, ahead of the first weight loads (p.stage, set by the launcher
  // where they fit and are aligned). After the wait they would be a DRAM round trip queued behind those
  // loads: on the H200 the prologues took 5-5.5 us of a 1.4b layer's products, that round trip the most of it.
  const int64_t norm_size = p.input == GemvInput::kRmsNorm ? K : p.head_dim;
  float* norm_weight = reinterpret_cast<float*>(xs + kM * K);  // (kM * K * 2 bytes: a multiple of 16)
  float* gate_staged = norm_weight + norm_size;                 // [kM, K] (norm_size: a multiple of 4)
  const bool stage = p.stage;
  const bool stage_gate = stage && p.input == GemvInput::kGatedNorm && p.gate_written_earlier;
  if (p.early_loads) {
    // The small copies first, so that they do not queue behind the block's weight loads, and asynchronous,
    // so that no lane waits for them before the weights are requested.
    if (stage) {
      CopyToSharedAsync(norm_weight, p.weight_ptr, norm_size);
      for (int m = 0; stage_gate && m < kM; ++m) CopyToSharedAsync(gate_staged + m * K, p.gate_ptr + m * p.gate_row_stride, K);
    }
    if (early_prior && lane == 0) {
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        if (out[k] >= 0) CopyWordAsync(&prior[warp * kRows + k], p.y_ptr + out[k]);
      }
    }
    load(lane);
  }
  AfterPrevious();
  if (stage || early_prior) WaitCopies();
  if (stage) __syncthreads();
  const float* weight = stage ? norm_weight : p.weight_ptr;
  for (int m = 0; m < kM; ++m) {
    bf16* row = xs + m * K;
    switch (p.input) {
      case GemvInput::kRmsNorm: {
        const float* x = p.in_ptr + m * p.in_row_stride;
        if constexpr (kM > 1) {
          // Several rows: a warp per row, the rows at once (a block-wide sum per row would put kM round trips
          // and barriers in series).
          if (m % kGemvWarps != warp) break;
          float sum = 0.f;
#pragma unroll 4
          for (int64_t c = lane; c < K; c += 32) sum += x[c] * x[c];
          const float scale = rsqrtf(WarpSum(sum) / K + p.eps);
#pragma unroll 4
          for (int64_t c = lane; c < K; c += 32) row[c] = __float2bfloat16(x[c] * scale * weight[c]);
          break;
        }
        if (RowFitsPieces<kMaxNormPieces>(x, K)) {
          // x (written by the kernel just before) read once, into registers: one round trip.
          float4 xv[kMaxNormPieces];
          LoadRowPieces(x, K, xv);
          const float scale = rsqrtf(BlockSum(SumOfSquares(xv), scratch) / K + p.eps);
#pragma unroll
          for (int t = 0; t < kMaxNormPieces; ++t) {
            const int64_t c = RowPieceColumn(t);
            if (c >= K) break;
            const float v[4] = {xv[t].x, xv[t].y, xv[t].z, xv[t].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) row[c + e] = __float2bfloat16(v[e] * scale * weight[c + e]);
          }
          break;
        }
        float sum = 0.f;
        for (int64_t c = threadIdx.x; c < K; c += blockDim.x) sum += x[c] * x[c];
        const float scale = rsqrtf(BlockSum(sum, scratch) / K + p.eps);
        for (int64_t c = threadIdx.x; c < K; c += blockDim.x) row[c] = __float2bfloat16(x[c] * scale * weight[c]);
        break;
      }
      case GemvInput::kGatedNorm: {
        const int64_t dh = p.head_dim;
        const float* o = p.in_ptr + m * p.in_row_stride;
        const float* g = stage_gate ? gate_staged + m * K : p.gate_ptr + m * p.gate_row_stride;
        const int64_t heads = K / dh;
        if (dh % 32 == 0 && dh <= 32 * kMaxHeadPieces) {
          // o read once, into registers, two heads of the warp at a time: their loads in flight together
          // (o was written by the kernel just before; the gate is in shared memory when staged).
          for (int64_t h0 = warp; h0 < heads; h0 += 2 * kGemvWarps) {
            float ov[2][kMaxHeadPieces], sum[2] = {0.f, 0.f};
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              const int64_t h = h0 + u * kGemvWarps;
#pragma unroll
              for (int t = 0; t < kMaxHeadPieces; ++t) {
                if (32 * t >= dh || h >= heads) break;
                ov[u][t] = o[h * dh + lane + 32 * t];
              }
            }
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              const int64_t h = h0 + u * kGemvWarps;
              if (h >= heads) break;
#pragma unroll
              for (int t = 0; t < kMaxHeadPieces; ++t) {
                if (32 * t >= dh) break;
                sum[u] += ov[u][t] * ov[u][t];
              }
              const float scale = rsqrtf(WarpSum(sum[u]) / dh + p.eps);
#pragma unroll
              for (int t = 0; t < kMaxHeadPieces; ++t) {
                if (32 * t >= dh) break;
                const int64_t i = lane + 32 * t;
                row[h * dh + i] = __float2bfloat16(ov[u][t] * scale * weight[i] * Silu(g[h * dh + i]));
              }
            }
          }
          break;
        }
        for (int64_t h = warp; h < heads; h += kGemvWarps) {
          float sum = 0.f;
          for (int64_t i = lane; i < dh; i += 32) sum += o[h * dh + i] * o[h * dh + i];
          const float scale = rsqrtf(WarpSum(sum) / dh + p.eps);
          for (int64_t i = lane; i < dh; i += 32) {
            row[h * dh + i] = __float2bfloat16(o[h * dh + i] * scale * weight[i] * Silu(g[h * dh + i]));
          }
        }
        break;
      }
    }
  }
  __syncthreads();
  float acc[kRows][kM] = {};
  for (int64_t base = lane; base < pieces; base += 32 * kBatch) {
    if (!p.early_loads || base != lane) load(base);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t i = base + 32 * b;
      if (i >= pieces) break;
#pragma unroll
      for (int part8 = 0; part8 < Piece::kParts; ++part8) {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          float xf[8];
          Unpack8(reinterpret_cast<const uint4*>(xs + m * K)[i * Piece::kParts + part8], xf);
#pragma unroll
          for (int k = 0; k < kRows; ++k) {
            float wf[8];
            Piece::Unpack(raw[b][k], part8, wf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[k][m] += wf[e] * xf[e];
          }
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
#pragma unroll
    for (int m = 0; m < kM; ++m) acc[k][m] = WarpSum(acc[k][m]) * scale[k];
  }
  if (lane != 0) return;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    if constexpr (kSwiGluOut) {
      if (k % 2 == 1 && out[k] < features) {
        for (int m = 0; m < kM; ++m) {
          p.maybe_swiglu_ptr[m * p.y_row_stride + out[k]] = __float2bfloat16(Silu(acc[k - 1][m]) * acc[k][m]);
        }
      }
    } else if (out[k] >= 0) {
      for (int m = 0; m < kM; ++m) {
        float* y = p.y_ptr + m * p.y_row_stride + out[k];
        *y = p.accumulate ? (early_prior ? prior[warp * kRows + k] : *y) + acc[k][m] : acc[k][m];
      }
    }
  }
}

// Weight rows per warp for a product of n rows: the fewest (most blocks) that still run in one wave of
// kFusedGemvBlocksPerSm blocks per SM. (A second, partial wave cost more than the extra rows per warp: on
// the H200 the up projection of 1.4b with 2 blocks per SM resident took 24 us for 45 MB.)
int DefaultRowsPerWarp(int64_t n) {
  for (int rows : {1, 2, 4}) {
    if (CeilDiv(n, kGemvWarps * rows) <= int64_t{kFusedGemvBlocksPerSm} * MultiprocessorCount()) return rows;
  }
  return 8;
}

// Shared memory for the prologue's staged constants (FusedGemvKernel's `stage`): the norm weight, and the
// gate where it may be read early; 0 where they cannot be copied 16 bytes at a time.
size_t StageBytes(const FusedGemvParams& p, int64_t m) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const int64_t norm_size = p.input == GemvInput::kRmsNorm ? p.k : p.head_dim;
  if (norm_size % 4 != 0 || !aligned(p.weight_ptr)) return 0;
  size_t bytes = norm_size * sizeof(float);
  if (p.input == GemvInput::kGatedNorm && p.gate_written_earlier) {
    if (p.gate_row_stride % 4 != 0 || !aligned(p.gate_ptr)) return 0;
    bytes += m * p.k * sizeof(float);
  }
  return bytes;
}

// kWide: a grid of at most 3 blocks per SM, whose blocks may then take 85 registers a thread: 1.5x the weight
// pieces in flight per lane, so 1.5x the bytes requested before the wait (4 rows per warp only; measured in
// docs/CUDA.md).
template <int kM, int kRows, bool kSwiGluOut, bool kWide = false, bool kFp8 = false>
void LaunchFusedGemvAs(const FusedGemvParams& p, cudaStream_t stream) {
  // (Several input rows, only in tests, hold their accumulators too: two pieces per row at once.)
  constexpr int kBatchOf = kM == 1 ? (kWide ? BatchFor(kRows) * 3 / 2 : BatchFor(kRows)) : 2;
  auto kernel = FusedGemvKernel < kM, kRows, kSwiGluOut, kBatchOf, kWide ? 3 : kFusedGemvBlocksPerSm, kFp8 > ;
  // Up to kMaxFusedInputBytes of staged input (more than the default 48 KiB), configured once.
  static const bool configured = [&] {
    ORYX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kMaxFusedInputBytes)));
    return true;
  }();
  (void)configured;
  FusedGemvParams q = p;
  q.early_loads = EarlyLoads();
  const size_t input_bytes = kM * p.k * sizeof(bf16);
  const size_t stage_bytes = StageBytes(q, kM);
  q.stage = q.early_loads && stage_bytes > 0 && input_bytes + stage_bytes <= kMaxFusedInputBytes;
  const int64_t units = kSwiGluOut ? CeilDiv(p.n / 2, kRows / 2) : CeilDiv(p.n, kRows);
  LaunchAfterPrevious(kernel, static_cast<unsigned>(CeilDiv(units, kGemvWarps)), 32 * kGemvWarps,
                      input_bytes + (q.stage ? stage_bytes : 0), stream, q);
}

// Single rows (the decode steps) take 1, 2, 4 or 8 weight rows per warp; the kernel's other row counts (in
// tests) one row, or one pair with the SwiGLU output. FP8 weights: single rows only (FusedGemvApplies).
template <int kM>
void LaunchFusedGemv(const FusedGemvParams& p, cudaStream_t stream) {
  const bool swiglu = p.maybe_swiglu_ptr != nullptr;
  int rows = p.rows_per_warp > 0 ? p.rows_per_warp : DefaultRowsPerWarp(p.n);
  if (swiglu) rows = std::max(rows, 2);
  if constexpr (kM == 1) {
    auto as = [&](auto kRows, auto kWide, auto kFp8) {
      if (swiglu) {
        LaunchFusedGemvAs<kM, kRows.value, true, kWide.value, kFp8.value>(p, stream);
      } else {
        LaunchFusedGemvAs<kM, kRows.value, false, kWide.value, kFp8.value>(p, stream);
      }
    };
    auto launch = [&](auto kRows, auto kWide) {
      if (p.w_scale != nullptr) return as(kRows, kWide, std::true_type{});
      as(kRows, kWide, std::false_type{});
    };
    const std::false_type narrow;
    if (rows >= 8) return launch(std::integral_constant<int, 8>{}, narrow);
    if (rows == 4 && WideGemv() && CeilDiv(p.n, kGemvWarps * 4) <= int64_t{3} * MultiprocessorCount()) {
      return launch(std::integral_constant<int, 4>{}, std::true_type{});
    }
    if (rows >= 4) return launch(std::integral_constant<int, 4>{}, narrow);
    if (rows >= 2) return launch(std::integral_constant<int, 2>{}, narrow);
    if (p.w_scale != nullptr) return LaunchFusedGemvAs<kM, 1, false, false, true>(p, stream);
    return LaunchFusedGemvAs<kM, 1, false>(p, stream);  // (swiglu has rows >= 2)
  } else {
    if (p.w_scale != nullptr) ORYX_CUDA_CHECK(cudaErrorInvalidValue);  // (FusedGemvApplies: single rows)
    if (swiglu) return LaunchFusedGemvAs<kM, 2, true>(p, stream);
    LaunchFusedGemvAs<kM, 1, false>(p, stream);
  }
}

}  // namespace

bool GemvApplies(const GemmParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool fp8 = p.w_scale != nullptr;
  // FP8 weights take the GEMV up to kMaxGemvRows rows: it reads each weight once for all of them, where
  // cuBLAS would read a bf16 copy made in front of it (5 bytes a weight instead of 1).
  using MultiRow = KernelSwitches::MultiRow;
  const MultiRow mode = GetKernelSwitches().multirow_bf16;
  const bool bf16_rows = mode == MultiRow::kOn || (mode == MultiRow::kAuto && p.n * p.k <= kMultiRowMaxWeights);
  const bool multirow = (fp8 || bf16_rows) && p.maybe_argmax_key == nullptr;
  const int64_t max_rows = multirow ? kMaxGemvRows : 1;
  return p.m >= 1 && p.m <= max_rows && p.k % (fp8 ? 16 : 8) == 0 && p.x_row_stride % 8 == 0 && aligned(p.x_ptr) &&
         aligned(p.w_ptr);
}

bool Fp8MmaApplies(const GemmParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.w_scale != nullptr && p.maybe_argmax_key == nullptr &&
         p.m >= GetKernelSwitches().fp8_mma_min_rows && p.m <= kFp8MmaMaxRows && p.k % 32 == 0 &&
         Fp8MmaSmemBytes(kFp8MmaTilesM, CeilDiv(CeilDiv(p.k, kFp8MmaChunk), int64_t{kFp8MmaMaxSplits})) <=
             kMaxFusedInputBytes &&
         p.x_row_stride % 8 == 0 && aligned(p.x_ptr) && aligned(p.w_ptr) && HopperOrLater();
}

bool MmaGemvApplies(const GemmParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  static const bool mma = CurrentDeviceAttribute(cudaDevAttrComputeCapabilityMajor) >= 8;  // (mma.sync bf16)
  const bool fp8 = p.w_scale != nullptr;
  const KernelSwitches& switches = GetKernelSwitches();
  const int64_t max_rows = fp8 ? switches.fp8_mma_gemv_max_rows : switches.bf16_mma_gemv_max_rows;
  return p.maybe_argmax_key == nullptr && p.m >= 2 && p.m <= std::min(max_rows, kMmaGemvMaxRows) &&
         (p.m <= 8 || fp8 || p.n * p.k <= kMmaGemvWideMaxWeights) && p.k % (fp8 ? 64 : 32) == 0 &&
         p.x_row_stride % 8 == 0 && aligned(p.x_ptr) && aligned(p.w_ptr) && mma;
}

bool FusedGemvApplies(int64_t m, int64_t k, bool fp8, int64_t max_rows) {
  // Single rows by default: each block recomputes the input op for its rows, which at M > 1 costs more than
  // the separate kernels it saves (on an H200: 1.4b batch 4, 6.4 vs 4.2 ms of ops per step; models/default's
  // linear step at batch 8, 0.316 ms fused against 0.185 ms with the several-row GEMV). FP8 weights: single
  // rows only.
  const int64_t rows = fp8 ? 1 : std::clamp<int64_t>(max_rows, 1, kMaxGemvRows);
  return m >= 1 && m <= rows && k % (fp8 ? 16 : 8) == 0 &&
         m * k * static_cast<int64_t>(sizeof(bf16)) <= kMaxFusedInputBytes;
}

void FusedGemv(const FusedGemvParams& p, cudaStream_t stream) {
  WithRowCount(p.m, [&](auto rows) { LaunchFusedGemv<rows.value>(p, stream); });
}

namespace {
// The stream a cuBLAS handle launches on, for our kernels in its place.
cudaStream_t StreamOf(void* cublas_handle) {
  cudaStream_t stream = nullptr;
  ORYX_CUBLAS_CHECK(cublasGetStream(static_cast<cublasHandle_t>(cublas_handle), &stream));
  return stream;
}
}  // namespace

void Gemm(const GemmParams& p, void* cublas_handle) {
  if (p.m == 0 || p.n == 0) return;
  if (p.maybe_argmax_key != nullptr && !GemvApplies(p)) ORYX_CUDA_CHECK(cudaErrorInvalidValue);  // (callers check)
  if (p.maybe_swiglu_ptr != nullptr) {
    if (!MmaGemvApplies(p) || p.n % 2 != 0 || p.accumulate) ORYX_CUDA_CHECK(cudaErrorInvalidValue);  // (the same)
    if (p.norm_out.scaled_ptr != nullptr) ORYX_CUDA_CHECK(cudaErrorInvalidValue);
    return LaunchMmaGemv(p, StreamOf(cublas_handle));
  }
  if (p.norm_out.scaled_ptr != nullptr || p.norm_in.sum_sq_ptr != nullptr) {  // (a split norm: the same)
    if (!MmaGemvApplies(p)) ORYX_CUDA_CHECK(cudaErrorInvalidValue);
    return LaunchMmaGemv(p, StreamOf(cublas_handle));
  }
  // FP8 weights from 2 rows on: on the H100, 0.50-0.99x the time of the several-row GEMV or the FP8 kernel
  // below for 1.4b's products, but for 2 rows of the narrow ones (1.08-1.11x: the output projection, 3.05
  // against 2.82 µs); summed over the four, 0.92x at 2 rows and 0.57x at 8.
  if (p.w_scale != nullptr && MmaGemvApplies(p)) return LaunchMmaGemv(p, StreamOf(cublas_handle));
  if (Fp8MmaApplies(p)) return LaunchFp8Mma(p, StreamOf(cublas_handle));
  // (Where the several-row GEMV takes 2 or 3 rows, it is up to 10% faster than the tensor-core GEMV: 1.4b's
  // output projection at 2 rows, 3.54 against 3.94 µs on the H100.)
  if (p.m <= 3 && GemvApplies(p)) return LaunchGemv(p, StreamOf(cublas_handle));
  if (MmaGemvApplies(p)) return LaunchMmaGemv(p, StreamOf(cublas_handle));
  if (GemvApplies(p)) return LaunchGemv(p, StreamOf(cublas_handle));
  GemmCublas(p, cublas_handle);
}

namespace {
void GemmCublasOnce(const GemmParams& p, void* cublas_handle) {
  const float alpha = 1.f, beta = p.accumulate ? 1.f : 0.f;
  ORYX_CUBLAS_CHECK(cublasGemmEx(static_cast<cublasHandle_t>(cublas_handle), CUBLAS_OP_T, CUBLAS_OP_N,
                                 static_cast<int>(p.n), static_cast<int>(p.m), static_cast<int>(p.k), &alpha,
                                 p.w_ptr, CUDA_R_16BF, static_cast<int>(p.k), p.x_ptr, CUDA_R_16BF,
                                 static_cast<int>(p.x_row_stride), &beta, p.y_ptr, CUDA_R_32F,
                                 static_cast<int>(p.y_row_stride), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
}  // namespace

void GemmCublas(const GemmParams& p, void* cublas_handle) {
  // The fused input projection has 4HD + G (+ HD) outputs, G one per head, a count cuBLAS runs slowly: the
  // outputs up to the last multiple of 64 go in one product, the few left in another. On 130m's 2048-row
  // prefill chunks that took the projection from 5.5 to 4.2 ms a forward, and prefill 1-11% faster
  // (results/2026-12-02-h200-split-gemm); still 4.5x the MLP's product of about its size.
  constexpr int64_t kAligned = 64;
  if (p.w_scale != nullptr) {
    // FP8 weights: a bf16 copy in front of the product (cuBLAS's FP8 GEMMs would want FP8 inputs too).
    if (p.w_bf16_scratch == nullptr) ORYX_CUDA_CHECK(cudaErrorInvalidValue);  // (the backend provides it)
    DequantizeRowsFp8(static_cast<const fp8*>(p.w_ptr), p.w_scale, p.n, p.k, p.w_bf16_scratch,
                      StreamOf(cublas_handle));
    GemmParams q = p;
    q.w_ptr = p.w_bf16_scratch;
    q.w_scale = nullptr;
    return GemmCublas(q, cublas_handle);
  }
  if (GetKernelSwitches().split_ragged_gemm && p.n > kAligned && p.n % kAligned != 0) {
    GemmParams main = p, rest = p;
    main.n = p.n - p.n % kAligned;
    rest.n = p.n % kAligned;
    rest.w_ptr = static_cast<const bf16*>(p.w_ptr) + main.n * p.k;
    rest.y_ptr = p.y_ptr + main.n;
    GemmCublasOnce(main, cublas_handle);
    GemmCublasOnce(rest, cublas_handle);
    return;
  }
  GemmCublasOnce(p, cublas_handle);
}

namespace {
// One block per row: the row's largest |w|, then the row in e4m3 under a power-of-two scale.
__global__ void QuantizeRowsFp8Kernel(const bf16* src, int64_t cols, fp8* dst, float* scale) {
  __shared__ float scratch[32];
  const bf16* in = src + int64_t(blockIdx.x) * cols;
  float amax = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(__bfloat162float(in[c])));
  amax = BlockMax(amax, scratch);
  const float s = Fp8RowScale(amax);
  fp8* out = dst + int64_t(blockIdx.x) * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    out[c] = __nv_cvt_float_to_fp8(__bfloat162float(in[c]) / s, __NV_SATFINITE, __NV_E4M3);
  }
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
}

// Pieces of kPiece weights (one scale each: cols % kPiece == 0), grid-strided.
template <int kPiece>
__global__ void DequantizeRowsFp8Kernel(const fp8* src, const float* scale, int64_t rows, int64_t cols, bf16* dst) {
  const int64_t pieces = rows * cols / kPiece, row_pieces = cols / kPiece;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pieces; i += int64_t(gridDim.x) * blockDim.x) {
    const float s = scale[i / row_pieces];
#pragma unroll
    for (int e = 0; e < kPiece; ++e) {
      const int64_t j = i * kPiece + e;
      dst[j] = __float2bfloat16(s * __half2float(__half(__nv_cvt_fp8_to_halfraw(src[j], __NV_E4M3))));
    }
  }
}
}  // namespace

void QuantizeRowsFp8(const bf16* src, int64_t rows, int64_t cols, fp8* dst, float* scale, cudaStream_t stream) {
  if (rows == 0) return;
  QuantizeRowsFp8Kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(src, cols, dst, scale);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void DequantizeRowsFp8(const fp8* src, const float* scale, int64_t rows, int64_t cols, bf16* dst, cudaStream_t stream) {
  if (rows * cols == 0) return;
  const int piece = cols % 8 == 0 ? 8 : 1;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(CeilDiv(rows * cols / piece, 256), 16 * 1024));
  if (piece == 8) {
    DequantizeRowsFp8Kernel<8><<<blocks, 256, 0, stream>>>(src, scale, rows, cols, dst);
  } else {
    DequantizeRowsFp8Kernel<1><<<blocks, 256, 0, stream>>>(src, scale, rows, cols, dst);
  }
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace oryx::kernels::cuda
