// Softmax attention of Tq queries over a Tk-long KV cache, causal inside the span (queries are the last Tq
// positions). Per head: scores = Q K^T (a GEMM per block of a paged cache, or one for a contiguous one),
// masked, stable softmax, P V (summed over the blocks); a bf16 or int8 cache's blocks are widened to fp32 a
// block at a time. Single-threaded; heads are independent and would be the axis to split.
#include <immintrin.h>

#include <Eigen/Core>
#include <algorithm>
#include <cassert>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/cpu/eigen_maps.h"
#include "kernels/ops.h"

namespace oryx::kernels::cpu {
namespace {

int64_t HeadStride(const AttentionParams& p) { return p.kv_head_stride > 0 ? p.kv_head_stride : p.head_dim; }

#ifdef __AVX512F__
// 16 keys or values from a row, as fp32 (a bf16 row widened in registers).
__m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
__m512 Load16(const uint16_t* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
__m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

constexpr int64_t kMaxDecodeChunks = 8;  // head_dim up to 128 in registers

// Rows of a block are asked for this many rows ahead of their use, and the next block's first rows this many
// as a block starts (blocks lie apart in memory, where the hardware prefetcher starts over). Measured in a
// scratch copy of bench_attention_cpu (int8, 1,024 positions): 8 / 8 rows read at 9.8 GB/s, 16 / 32 at
// 10.5-10.7; a whole next block, or farther, no faster.
constexpr int64_t kRowsAhead = 16;
constexpr int64_t kNextBlockRows = 32;

// The bytes of a row of head_dim elements (and an int8 row's scale after them), asked for.
template <typename T>
void PrefetchRow(const AttentionParams& p, const T* row) {
  const char* line = reinterpret_cast<const char*>(row);
  const int64_t bytes = KvHeadRowElements(p.kv_format, p.head_dim) * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(line + b, _MM_HINT_T0);
  _mm_prefetch(line + bytes - 1, _MM_HINT_T0);  // an unaligned row's last line
}

// A decode step of head h (one query) over a paged cache of T elements, for head_dim a multiple of 16 up to
// 128, in one pass over the blocks with an online softmax: per block, its keys' scores (four rows at a time:
// four FMA chains, then one reduction each), then its value rows weighted into an output held in registers,
// rescaled whenever a block raises the running maximum. A block's key and value rows are read together, two
// streams at once: bench_attention_cpu reads an int8 cache 1.5x as fast as with scores-then-values (10.2-10.7
// against 6.7-6.9 GB/s), bf16 1.4x, fp32 1.05x. At one query a block is a 64 x dh matrix-vector product,
// small enough that a library call's overhead costs more than its arithmetic.
template <typename T>
void DecodeHead(const AttentionParams& p, int64_t h) {
  // An int8 row's values are q * its scale (after its dh values); fp32 and bf16 rows have none.
  auto row_scale = [dh = p.head_dim](const T* row) {
    if constexpr (std::is_same_v<T, int8_t>) {
      return KvRowScale(row, dh);
    } else {
      return 1.0f;
    }
  };
  const int64_t tk = p.kv_tokens, dh = p.head_dim, bt = p.kv_block_tokens, chunks = dh / 16;
  const int64_t stride = p.kv_token_stride, col = p.kv_col + h * HeadStride(p);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const float* q = p.q_ptr + h * dh;
  float* scores = p.scratch_ptr;  // one block's
  __m512 qv[kMaxDecodeChunks], acc[kMaxDecodeChunks];
  for (int64_t c = 0; c < chunks; ++c) {
    qv[c] = _mm512_loadu_ps(q + 16 * c);
    acc[c] = _mm512_setzero_ps();
  }
  auto score = [&](const T* row, __m512 a) { return _mm512_reduce_add_ps(a) * scale * row_scale(row); };
  float max_score = -INFINITY, total = 0.f;  // the running maximum, and the weights' sum relative to it
  for (int64_t j = 0, start = 0; start < tk; ++j, start += bt) {
    const T* k = static_cast<const T*>(p.k_blocks[j]) + col;
    const T* v = static_cast<const T*>(p.v_blocks[j]) + col;
    const int64_t rows = std::min(bt, tk - start);
    if (start + bt < tk) {
      const T* next_k = static_cast<const T*>(p.k_blocks[j + 1]) + col;
      const T* next_v = static_cast<const T*>(p.v_blocks[j + 1]) + col;
      for (int64_t r = 0; r < std::min({kNextBlockRows, bt, tk - start - bt}); ++r) {
        PrefetchRow(p, next_k + r * stride);
        PrefetchRow(p, next_v + r * stride);
      }
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      for (int64_t later = r + kRowsAhead; later < std::min(rows, r + kRowsAhead + 4); ++later) {
        PrefetchRow(p, k + later * stride);
        PrefetchRow(p, v + later * stride);
      }
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < chunks; ++c) {
        a0 = _mm512_fmadd_ps(qv[c], Load16(k + r * stride + 16 * c), a0);
        a1 = _mm512_fmadd_ps(qv[c], Load16(k + (r + 1) * stride + 16 * c), a1);
        a2 = _mm512_fmadd_ps(qv[c], Load16(k + (r + 2) * stride + 16 * c), a2);
        a3 = _mm512_fmadd_ps(qv[c], Load16(k + (r + 3) * stride + 16 * c), a3);
      }
      scores[r] = score(k + r * stride, a0);
      scores[r + 1] = score(k + (r + 1) * stride, a1);
      scores[r + 2] = score(k + (r + 2) * stride, a2);
      scores[r + 3] = score(k + (r + 3) * stride, a3);
    }
    for (; r < rows; ++r) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) a = _mm512_fmadd_ps(qv[c], Load16(k + r * stride + 16 * c), a);
      scores[r] = score(k + r * stride, a);
    }
    Eigen::Map<Eigen::ArrayXf> block(scores, rows);
    const float block_max = block.maxCoeff();
    if (block_max > max_score) {  // the output and sum so far, relative to the new maximum
      const float shrink = std::exp(max_score - block_max);
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_mul_ps(acc[c], _mm512_set1_ps(shrink));
      total *= shrink;
      max_score = block_max;
    }
    block = (block - max_score).exp();
    total += block.sum();
    for (r = 0; r < rows; ++r) {
      const T* vr = v + r * stride;
      const __m512 w = _mm512_set1_ps(scores[r] * row_scale(vr));
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(w, Load16(vr + 16 * c), acc[c]);
    }
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / total);
  float* out = p.out_ptr + h * dh;
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], inverse));
}
#endif

}  // namespace

void Attention(const AttentionParams& p) {
  assert(p.q_tokens <= p.kv_tokens);
#ifdef __AVX512F__
  if (p.q_tokens == 1 && p.kv_block_tokens > 0 && p.head_dim % 16 == 0 && p.head_dim <= 16 * kMaxDecodeChunks) {
    for (int64_t h = 0; h < p.heads; ++h) {
      switch (p.kv_format) {
        case KvFormat::kF32:
          DecodeHead<float>(p, h);
          break;
        case KvFormat::kBf16:
          DecodeHead<uint16_t>(p, h);
          break;
        case KvFormat::kInt8:
          DecodeHead<int8_t>(p, h);
          break;
      }
    }
    return;
  }
#endif
  const int64_t tq = p.q_tokens, tk = p.kv_tokens, dh = p.head_dim, offset = tk - tq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  assert(p.kv_format == KvFormat::kF32 || (p.kv_block_tokens > 0 && p.widen_ptr != nullptr));
  // The keys in pieces of contiguous rows: the whole cache, or its blocks.
  const int64_t piece = p.kv_block_tokens > 0 ? p.kv_block_tokens : tk;
  // Rows of head h in piece j of the keys or the values, as fp32: where they are, or widened from bf16 into
  // widen_ptr (valid until the next call).
  auto rows_of = [&](const void* const* blocks, const float* contiguous, int64_t j, int64_t h, int64_t rows) {
    if (p.kv_block_tokens == 0)
      return ConstMatrixMap(contiguous + h * dh, rows, dh, Eigen::OuterStride<>(p.kv_token_stride));
    if (p.kv_format == KvFormat::kF32) {
      return ConstMatrixMap(static_cast<const float*>(blocks[j]) + p.kv_col + h * HeadStride(p), rows, dh,
                            Eigen::OuterStride<>(p.kv_token_stride));
    }
    if (p.kv_format == KvFormat::kInt8) {
      const int8_t* packed = static_cast<const int8_t*>(blocks[j]) + p.kv_col + h * HeadStride(p);
      for (int64_t r = 0; r < rows; ++r) DequantizeKvRow(packed + r * p.kv_token_stride, dh, p.widen_ptr + r * dh);
      return ConstMatrixMap(p.widen_ptr, rows, dh, Eigen::OuterStride<>(dh));
    }
    const uint16_t* packed = static_cast<const uint16_t*>(blocks[j]) + p.kv_col + h * HeadStride(p);
    for (int64_t r = 0; r < rows; ++r) WidenBf16(packed + r * p.kv_token_stride, dh, p.widen_ptr + r * dh);
    return ConstMatrixMap(p.widen_ptr, rows, dh, Eigen::OuterStride<>(dh));
  };
  MatrixMap scores(p.scratch_ptr, tq, tk, Eigen::OuterStride<>(tk));
  for (int64_t h = 0; h < p.heads; ++h) {
    ConstMatrixMap q(p.q_ptr + h * dh, tq, dh, Eigen::OuterStride<>(p.q_token_stride));
    for (int64_t j = 0, start = 0; start < tk; ++j, start += piece) {
      const int64_t rows = std::min(piece, tk - start);
      ConstMatrixMap k = rows_of(p.k_blocks, p.k_ptr, j, h, rows);
      if (tq == 1) {  // a decode step: a matrix-vector product over the block's key rows
        Eigen::Map<const Eigen::VectorXf> qv(p.q_ptr + h * dh, dh);
        Eigen::Map<Eigen::VectorXf>(p.scratch_ptr + start, rows).noalias() = (k * qv) * scale;
      } else {
        scores.middleCols(start, rows).noalias() = (q * k.transpose()) * scale;
      }
    }
    for (int64_t i = 0; i < tq; ++i) {
      const int64_t visible = offset + i + 1;  // keys 0 .. offset + i
      auto row = scores.row(i).head(visible).array();
      row = (row - row.maxCoeff()).exp();
      row /= row.sum();
      scores.row(i).tail(tk - visible).setZero();
    }
    MatrixMap out(p.out_ptr + h * dh, tq, dh, Eigen::OuterStride<>(p.out_token_stride));
    for (int64_t j = 0, start = 0; start < tk; ++j, start += piece) {
      const int64_t rows = std::min(piece, tk - start);
      ConstMatrixMap v = rows_of(p.v_blocks, p.v_ptr, j, h, rows);
      if (tq == 1) {  // a decode step: the block's value rows weighted by the probabilities
        Eigen::Map<Eigen::VectorXf> o(p.out_ptr + h * dh, dh);
        Eigen::Map<const Eigen::VectorXf> w(p.scratch_ptr + start, rows);
        if (start == 0) {
          o.noalias() = v.transpose() * w;
        } else {
          o.noalias() += v.transpose() * w;
        }
      } else if (start == 0) {
        out.noalias() = scores.middleCols(0, rows) * v;
      } else {
        out.noalias() += scores.middleCols(start, rows) * v;
      }
    }
  }
}

void AttentionReference(const AttentionParams& p) {
  const int64_t tq = p.q_tokens, tk = p.kv_tokens, dh = p.head_dim, b = p.kv_block_tokens;
  // Element d of head h's row s of the keys or values, as fp32.
  auto element = [&](const void* const* blocks, const float* contiguous, int64_t s, int64_t h, int64_t d) -> float {
    if (b == 0) return contiguous[s * p.kv_token_stride + h * dh + d];
    const int64_t row = p.kv_col + h * HeadStride(p) + (s % b) * p.kv_token_stride;
    float value;
    switch (p.kv_format) {
      case KvFormat::kF32:
        return static_cast<const float*>(blocks[s / b])[row + d];
      case KvFormat::kBf16:
        WidenBf16(static_cast<const uint16_t*>(blocks[s / b]) + row + d, 1, &value);
        return value;
      case KvFormat::kInt8: {
        const int8_t* q = static_cast<const int8_t*>(blocks[s / b]) + row;
        return static_cast<float>(q[d]) * KvRowScale(q, dh);
      }
    }
    return 0.f;
  };
  const double scale = 1.0 / std::sqrt(static_cast<double>(dh));
  std::vector<double> weights(tk);
  for (int64_t i = 0; i < tq; ++i) {
    const int64_t last_key = tk - tq + i;
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* q = p.q_ptr + i * p.q_token_stride + h * dh;
      double max_score = -INFINITY;
      for (int64_t s = 0; s <= last_key; ++s) {
        double dot = 0.0;
        for (int64_t d = 0; d < dh; ++d) dot += double{q[d]} * element(p.k_blocks, p.k_ptr, s, h, d);
        weights[s] = dot * scale;
        max_score = std::max(max_score, weights[s]);
      }
      double total = 0.0;
      for (int64_t s = 0; s <= last_key; ++s) total += weights[s] = std::exp(weights[s] - max_score);
      for (int64_t d = 0; d < dh; ++d) {
        double acc = 0.0;
        for (int64_t s = 0; s <= last_key; ++s) acc += weights[s] * element(p.v_blocks, p.v_ptr, s, h, d);
        p.out_ptr[i * p.out_token_stride + h * dh + d] = static_cast<float>(acc / total);
      }
    }
  }
}

}  // namespace oryx::kernels::cpu
