// Projections over packed weights (WeightFormat in kernels/ops.h): bf16 or int8 rows, fp32 activations and sums.
// A decode step is bound by the weight bytes it reads, so for a few x rows each packed row is read once for all
// of them and widened to fp32 in registers: with AVX-512, 16 values a load and four independent sums per x row
// (one FMA chain would cap a core at 16 weights per FMA latency); elsewhere a plain loop. More x rows (prefill)
// widen the rows into fp32 once per call and take MatMul's GEMM.
// w8a8: each x row is quantised to int8 first (QuantizeRows), and for a few rows the dot products are integer:
// with AVX-512 VNNI, vpdpbusd multiplies 64 (x + 128) bytes by 64 weight bytes and adds them into 16 int32
// sums, and a vpdpbusd of 1-bytes by the same weights sums the row, to take the 128 offset back out.
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/ops.h"

namespace oryx::kernels::cpu {
namespace {

constexpr int64_t kSmallM = 6;  // as MatMul's: from about 8 rows a GEMM over widened weights wins

float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToBf16(float f) {  // round to nearest, ties to even
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

template <WeightFormat F>
float Widen(const void* row, int64_t i) {
  if constexpr (F == WeightFormat::kBf16) {
    return Bf16ToFloat(static_cast<const uint16_t*>(row)[i]);
  } else {
    return static_cast<float>(static_cast<const int8_t*>(row)[i]);
  }
}

template <WeightFormat F>
const void* Row(const PackedMatMulParams& p, int64_t o) {
  if constexpr (F == WeightFormat::kBf16) {
    return static_cast<const uint16_t*>(p.w_ptr) + o * p.k;
  } else {
    return static_cast<const int8_t*>(p.w_ptr) + o * p.k;
  }
}

#if defined(__AVX512F__)
template <WeightFormat F>
__m512 Load16(const void* row, int64_t i) {
  if constexpr (F == WeightFormat::kBf16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + i));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
  }
}
#endif

// y[r, o] = scale[o] * sum_i x[r, i] w[o, i] for the M rows of x.
template <WeightFormat F, int M>
void DotRows(const PackedMatMulParams& p) {
  for (int64_t o = 0; o < p.n; ++o) {
    const void* row = Row<F>(p, o);
    float sums[M];
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc[M][4];
    for (int r = 0; r < M; ++r) {
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
    }
    for (; i + 64 <= p.k; i += 64) {
      for (int u = 0; u < 4; ++u) {
        const __m512 w = Load16<F>(row, i + 16 * u);
        for (int r = 0; r < M; ++r) {
          acc[r][u] = _mm512_fmadd_ps(w, _mm512_loadu_ps(p.x_ptr + r * p.x_row_stride + i + 16 * u), acc[r][u]);
        }
      }
    }
    for (; i + 16 <= p.k; i += 16) {
      const __m512 w = Load16<F>(row, i);
      for (int r = 0; r < M; ++r)
        acc[r][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(p.x_ptr + r * p.x_row_stride + i), acc[r][0]);
    }
    for (int r = 0; r < M; ++r) {
      sums[r] =
          _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
    }
#else
    for (int r = 0; r < M; ++r) sums[r] = 0.f;
#endif
    for (; i < p.k; ++i) {
      const float w = Widen<F>(row, i);
      for (int r = 0; r < M; ++r) sums[r] += w * p.x_ptr[r * p.x_row_stride + i];
    }
    const float scale = F == WeightFormat::kInt8 ? p.scale_ptr[o] : 1.f;
    for (int r = 0; r < M; ++r) p.y_ptr[r * p.y_row_stride + o] = sums[r] * scale;
  }
}

template <WeightFormat F>
void SmallM(const PackedMatMulParams& p) {
  switch (p.m) {
    case 1: return DotRows<F, 1>(p);
    case 2: return DotRows<F, 2>(p);
    case 3: return DotRows<F, 3>(p);
    case 4: return DotRows<F, 4>(p);
    case 5: return DotRows<F, 5>(p);
    default: return DotRows<F, 6>(p);
  }
}

// The rows widened to fp32 (scales applied), then MatMul's GEMM.
template <WeightFormat F>
void Widened(const PackedMatMulParams& p) {
  thread_local std::vector<float> w;
  w.resize(static_cast<size_t>(p.n * p.k));
  for (int64_t o = 0; o < p.n; ++o) {
    const void* row = Row<F>(p, o);
    const float scale = F == WeightFormat::kInt8 ? p.scale_ptr[o] : 1.f;
    for (int64_t i = 0; i < p.k; ++i) w[o * p.k + i] = Widen<F>(row, i) * scale;
  }
  MatMul({p.m, p.n, p.k, p.x_row_stride, p.k, p.y_row_stride, p.x_ptr, w.data(), p.y_ptr});
}

// QuantizeRows into vectors sized for p.
void QuantizeInto(const PackedMatMulParams& p, std::vector<uint8_t>& q, std::vector<float>& sx) {
  q.resize(static_cast<size_t>(p.m * p.k));
  sx.resize(static_cast<size_t>(p.m));
  QuantizeRows(p.x_ptr, p.m, p.k, p.x_row_stride, q.data(), sx.data());
}

// w8a8 for up to kSmallM rows: y[r, o] = sx[r] * scale[o] * (sum_i (q[r, i] + 128) w[o, i] - 128 sum_i w[o, i]),
// the sums exact in int32 (|sum| <= 255 * 127 * k, far inside int32 for any k a model has).
template <int M>
void DotRowsW8A8(const PackedMatMulParams& p, const uint8_t* q, const float* sx) {
  for (int64_t o = 0; o < p.n; ++o) {
    const int8_t* row = static_cast<const int8_t*>(p.w_ptr) + o * p.k;
    int32_t sums[M], wsum = 0;
    int64_t i = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i acc[M], acc_w = _mm512_setzero_si512();
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi8(1);
    for (; i < p.k; i += 64) {
      const __mmask64 mask = p.k - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (p.k - i)) - 1;
      const __m512i w = _mm512_maskz_loadu_epi8(mask, row + i);
      acc_w = _mm512_dpbusd_epi32(acc_w, ones, w);
      for (int r = 0; r < M; ++r) {
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_maskz_loadu_epi8(mask, q + r * p.k + i), w);
      }
    }
    for (int r = 0; r < M; ++r) sums[r] = _mm512_reduce_add_epi32(acc[r]);
    wsum = _mm512_reduce_add_epi32(acc_w);
#else
    for (int r = 0; r < M; ++r) sums[r] = 0;
#endif
    for (; i < p.k; ++i) {
      wsum += row[i];
      for (int r = 0; r < M; ++r) sums[r] += int32_t{q[r * p.k + i]} * row[i];
    }
    for (int r = 0; r < M; ++r) {
      p.y_ptr[r * p.y_row_stride + o] = static_cast<float>(sums[r] - 128 * wsum) * (sx[r] * p.scale_ptr[o]);
    }
  }
}

// w8a8 for more rows: the quantised rows (as fp32 values) through the int8 GEMM path.
void WidenedW8A8(const PackedMatMulParams& p, const uint8_t* q, const float* sx) {
  thread_local std::vector<float> x;
  x.resize(static_cast<size_t>(p.m * p.k));
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t i = 0; i < p.k; ++i) x[r * p.k + i] = (static_cast<float>(q[r * p.k + i]) - 128.f) * sx[r];
  }
  PackedMatMulParams widened = p;
  widened.x_ptr = x.data(), widened.x_row_stride = p.k;
  Widened<WeightFormat::kInt8>(widened);
}

void W8A8(const PackedMatMulParams& p) {
  thread_local std::vector<uint8_t> own_q;
  thread_local std::vector<float> own_sx;
  if (p.xq_ptr == nullptr) QuantizeInto(p, own_q, own_sx);
  const uint8_t* q = p.xq_ptr != nullptr ? p.xq_ptr : own_q.data();
  const float* sx = p.xq_ptr != nullptr ? p.xq_scale_ptr : own_sx.data();
  switch (p.m) {
    case 1: return DotRowsW8A8<1>(p, q, sx);
    case 2: return DotRowsW8A8<2>(p, q, sx);
    case 3: return DotRowsW8A8<3>(p, q, sx);
    case 4: return DotRowsW8A8<4>(p, q, sx);
    case 5: return DotRowsW8A8<5>(p, q, sx);
    case 6: return DotRowsW8A8<6>(p, q, sx);
    default: return WidenedW8A8(p, q, sx);
  }
}

}  // namespace

void QuantizeRows(const float* x, int64_t m, int64_t k, int64_t stride, uint8_t* q, float* scale) {
  for (int64_t r = 0; r < m; ++r, x += stride, q += k) {
    int64_t i = 0;
    float largest = 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 top = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    largest = _mm512_reduce_max_ps(top);
#endif
    for (; i < k; ++i) largest = std::max(largest, std::fabs(x[i]));
    const float s = largest > 0.f ? largest / 127.f : 1.f, inv = 1.f / s;
    scale[r] = s;
    i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // x * inv is within [-127, 127] (up to rounding, clamped); rounded to nearest even as std::nearbyint does.
    const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f), inv16 = _mm512_set1_ps(inv);
    const __m512i offset = _mm512_set1_epi32(128);
    for (; i + 16 <= k; i += 16) {
      const __m512 v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv16)));
      const __m512i n = _mm512_add_epi32(_mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                         offset);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(n));
    }
#endif
    for (; i < k; ++i) q[i] = static_cast<uint8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.f, 127.f) + 128.f);
  }
}

void PackedMatMul(const PackedMatMulParams& p) {
  assert(p.format != WeightFormat::kF32 && p.x_row_stride >= p.k && p.y_row_stride >= p.n);
  if (p.format == WeightFormat::kW8A8) return W8A8(p);
  const bool bf16 = p.format == WeightFormat::kBf16;
  if (p.m <= kSmallM) return bf16 ? SmallM<WeightFormat::kBf16>(p) : SmallM<WeightFormat::kInt8>(p);
  return bf16 ? Widened<WeightFormat::kBf16>(p) : Widened<WeightFormat::kInt8>(p);
}

void PackedMatMulReference(const PackedMatMulParams& p) {
  std::vector<uint8_t> q;
  std::vector<float> sx;
  if (p.format == WeightFormat::kW8A8) QuantizeInto(p, q, sx);
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t o = 0; o < p.n; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < p.k; ++i) {
        const double w = p.format == WeightFormat::kBf16
                             ? Bf16ToFloat(static_cast<const uint16_t*>(p.w_ptr)[o * p.k + i])
                             : static_cast<const int8_t*>(p.w_ptr)[o * p.k + i] * double{p.scale_ptr[o]};
        const double x = p.format == WeightFormat::kW8A8 ? (q[r * p.k + i] - 128.0) * sx[r]
                                                         : double{p.x_ptr[r * p.x_row_stride + i]};
        acc += x * w;
      }
      p.y_ptr[r * p.y_row_stride + o] = static_cast<float>(acc);
    }
  }
}

void PackWeights(const float* w, int64_t n, int64_t k, WeightFormat format, void* out, float* scale) {
  for (int64_t o = 0; o < n; ++o) {
    const float* row = w + o * k;
    if (format == WeightFormat::kBf16) {
      auto* q = static_cast<uint16_t*>(out) + o * k;
      for (int64_t i = 0; i < k; ++i) q[i] = FloatToBf16(row[i]);
      continue;
    }
    float largest = 0.f;
    for (int64_t i = 0; i < k; ++i) largest = std::max(largest, std::fabs(row[i]));
    const float s = largest > 0.f ? largest / 127.f : 1.f;
    scale[o] = s;
    auto* q = static_cast<int8_t*>(out) + o * k;
    for (int64_t i = 0; i < k; ++i) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(row[i] / s), -127.f, 127.f));
  }
}

void RoundToBf16(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBf16(in[i]);
}

void WidenBf16(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

void QuantizeKvRow(const float* in, int64_t n, int8_t* out) {
  float largest = 0.f;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, std::fabs(in[i]));
  const float s = largest > 0.f ? largest / 127.f : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = s > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(in[i] / s), -127.f, 127.f)) : int8_t{0};
  }
  std::memcpy(out + n, &s, sizeof(s));
}

void DequantizeKvRow(const int8_t* in, int64_t n, float* out) {
  const float s = KvRowScale(in, n);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]) * s;
}

}  // namespace oryx::kernels::cpu
