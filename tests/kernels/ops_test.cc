// Every fast CPU op in kernels/ops.h computes what its slow reference computes (relative Frobenius error for
// fp32 arithmetic, exact equality where the op only moves or selects values), plus hand-computed cases.
#include "kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace oryx::kernels {
namespace {

// fp32 kernels against double-accumulating references: ~1e-7 per element is expected, 1e-5 leaves room for
// sums over a few hundred terms without hiding a wrong index (which shows up as O(1) error).
constexpr double kTol = 1e-5;

std::vector<float> RandomVector(int64_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// ||a - b|| / ||b|| (absolute when b is zero).
double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    norm += double{b[i]} * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// ---------------------------------------------------------------------------------------------- MatMul

TEST(MatMulCpu, MatchesReference) {
  struct Shape { int64_t m, n, k, pad; };
  for (Shape s : {Shape{1, 1, 1, 0}, Shape{1, 17, 33, 0}, Shape{1, 512, 384, 0}, Shape{5, 64, 128, 0},
                  Shape{7, 33, 257, 3}, Shape{16, 8, 64, 5}, Shape{2, 200, 384, 1}, Shape{8, 65, 96, 0},
                  Shape{9, 70, 40, 2}}) {
    const int64_t xs = s.k + s.pad, ws = s.k + s.pad, ys = s.n + s.pad;
    std::vector<float> x = RandomVector(s.m * xs, 1), w = RandomVector(s.n * ws, 2);
    std::vector<float> y(s.m * ys, 0.f), y_ref(s.m * ys, 0.f);
    cpu::MatMul({s.m, s.n, s.k, xs, ws, ys, x.data(), w.data(), y.data()});
    cpu::MatMulReference({s.m, s.n, s.k, xs, ws, ys, x.data(), w.data(), y_ref.data()});
    EXPECT_LE(RelErr(y, y_ref), kTol) << "m=" << s.m << " n=" << s.n << " k=" << s.k;
  }
}

TEST(MatMulCpu, HandComputed) {
  // x = [1 2], W = [[1 0], [0 1], [3 -1]] -> y = [1 2 1]
  std::vector<float> x = {1, 2}, w = {1, 0, 0, 1, 3, -1}, y(3);
  cpu::MatMul({1, 3, 2, 2, 2, 3, x.data(), w.data(), y.data()});
  EXPECT_EQ(y, (std::vector<float>{1, 2, 1}));
}

// Packed weights: the fast kernel (dot products for up to 6 rows, widened weights and GEMM beyond) against the
// double-accumulating reference over the same packed values, at shapes with k tails past the 64- and 16-wide
// loops; and the packing itself: bf16 rounds to nearest even, int8 keeps every weight within half a step of
// its row's scale. w8a8's reference quantises the activation rows the same way (QuantizeRows).
TEST(PackedMatMulCpu, MatchesReferenceAndPacksWithinHalfAStep) {
  struct Shape { int64_t m, n, k, pad; };
  for (WeightFormat format : {WeightFormat::kBf16, WeightFormat::kInt8, WeightFormat::kW8A8}) {
    for (Shape s : {Shape{1, 1, 1, 0}, Shape{1, 17, 33, 0}, Shape{1, 64, 512, 0}, Shape{3, 40, 200, 2},
                    Shape{6, 33, 129, 1}, Shape{7, 65, 96, 0}, Shape{16, 8, 64, 5}}) {
      const int64_t xs = s.k + s.pad, ys = s.n + s.pad, bytes = BytesPerWeight(format);
      const std::vector<float> x = RandomVector(s.m * xs, 1), w = RandomVector(s.n * s.k, 2);
      std::vector<uint8_t> packed(s.n * s.k * bytes);
      std::vector<float> scale(s.n), y(s.m * ys, 0.f), y_ref(s.m * ys, 0.f);
      cpu::PackWeights(w.data(), s.n, s.k, format, packed.data(), scale.data());
      const PackedMatMulParams p{s.m, s.n, s.k, xs, ys, format, x.data(), packed.data(), scale.data(), y.data()};
      cpu::PackedMatMul(p);
      PackedMatMulParams ref = p;
      ref.y_ptr = y_ref.data();
      cpu::PackedMatMulReference(ref);
      EXPECT_LE(RelErr(y, y_ref), kTol) << "m=" << s.m << " n=" << s.n << " k=" << s.k;
      // The packed values against the weights (one output row of the reference is x = a unit vector).
      for (int64_t o = 0; o < s.n; ++o) {
        for (int64_t i = 0; i < s.k; ++i) {
          const float wi = w[o * s.k + i];
          float got;
          if (format == WeightFormat::kBf16) {
            uint32_t bits = uint32_t{reinterpret_cast<const uint16_t*>(packed.data())[o * s.k + i]} << 16;
            std::memcpy(&got, &bits, sizeof(got));
            ASSERT_LE(std::fabs(got - wi), std::fabs(wi) / 256) << "bf16 of " << wi;
          } else {
            got = reinterpret_cast<const int8_t*>(packed.data())[o * s.k + i] * scale[o];
            ASSERT_LE(std::fabs(got - wi), scale[o] / 2 * (1 + 1e-6)) << "int8 of " << wi;
          }
        }
      }
    }
  }
  // Hand-computed: w = [[1, -2], [0.5, 0.25]] -> int8 scales 2/127 and 0.5/127, exact q for these values.
  const std::vector<float> w = {1, -2, 0.5f, 0.25f}, x = {2, 1};
  std::vector<int8_t> q(4);
  std::vector<float> scale(2), y(2);
  cpu::PackWeights(w.data(), 2, 2, WeightFormat::kInt8, q.data(), scale.data());
  EXPECT_EQ(q, (std::vector<int8_t>{64, -127, 127, 64}));  // 63.5 rounds to even: 64
  cpu::PackedMatMul({1, 2, 2, 2, 2, WeightFormat::kInt8, x.data(), q.data(), scale.data(), y.data()});
  EXPECT_NEAR(y[0], (2 * 64 - 127) * 2.f / 127, 1e-6);
  EXPECT_NEAR(y[1], (2 * 127 + 64) * 0.5f / 127, 1e-6);
  // w8a8: x = [2, 1] -> scale 2/127, q = [127, 64]; y = sx * scale[o] * (q . q_w[o]).
  cpu::PackedMatMul({1, 2, 2, 2, 2, WeightFormat::kW8A8, x.data(), q.data(), scale.data(), y.data()});
  EXPECT_NEAR(y[0], 0.f, 1e-6);                                             // 127 * 64 - 64 * 127
  EXPECT_NEAR(y[1], (127.f * 127 + 64 * 64) * (2.f / 127) * (0.5f / 127), 1e-6);  // 1.2540 for 1.25
}

// w8a8 against the fp32 product it approximates: each output within the error the two roundings allow,
// sum_i |x_i| * scale / 2 + |w_i| * sx / 2 (+ their product), for the fast kernel at 1-6 rows and beyond.
TEST(PackedMatMulCpu, W8A8IsWithinItsQuantisationErrorOfFp32) {
  for (int64_t m : {1, 4, 6, 9}) {
    const int64_t n = 37, k = 300;
    const std::vector<float> x = RandomVector(m * k, 5, -3.f, 3.f), w = RandomVector(n * k, 6);
    std::vector<int8_t> q(n * k);
    std::vector<float> scale(n), y(m * n);
    cpu::PackWeights(w.data(), n, k, WeightFormat::kW8A8, q.data(), scale.data());
    cpu::PackedMatMul({m, n, k, k, n, WeightFormat::kW8A8, x.data(), q.data(), scale.data(), y.data()});
    for (int64_t r = 0; r < m; ++r) {
      float largest = 0.f;
      for (int64_t i = 0; i < k; ++i) largest = std::max(largest, std::fabs(x[r * k + i]));
      const double sx = largest / 127.0;
      for (int64_t o = 0; o < n; ++o) {
        double exact = 0, bound = 0;
        for (int64_t i = 0; i < k; ++i) {
          const double xi = x[r * k + i], wi = w[o * k + i];
          exact += xi * wi;
          bound += std::fabs(xi) * scale[o] / 2 + std::fabs(wi) * sx / 2 + sx * scale[o] / 4;
        }
        EXPECT_LE(std::fabs(y[r * n + o] - exact), bound * 1.001 + 1e-5) << "m=" << m << " r=" << r << " o=" << o;
        EXPECT_GT(std::fabs(exact), 0.0);
      }
    }
    // The vector quantiser against the scalar rule (k = 300 leaves a tail past its 16-wide loop), and a given
    // quantisation (xq_ptr) against the kernel's own.
    std::vector<uint8_t> xq(m * k);
    std::vector<float> xs(m), y2(m * n);
    cpu::QuantizeRows(x.data(), m, k, k, xq.data(), xs.data());
    for (int64_t r = 0; r < m; ++r) {
      float largest = 0.f;
      for (int64_t i = 0; i < k; ++i) largest = std::max(largest, std::fabs(x[r * k + i]));
      ASSERT_EQ(xs[r], largest / 127.f);
      for (int64_t i = 0; i < k; ++i) {
        const float want = std::clamp(std::nearbyint(x[r * k + i] * (1.f / xs[r])), -127.f, 127.f) + 128.f;
        ASSERT_EQ(xq[r * k + i], static_cast<uint8_t>(want)) << "r=" << r << " i=" << i;
      }
    }
    cpu::PackedMatMul({m, n, k, k, n, WeightFormat::kW8A8, x.data(), q.data(), scale.data(), y2.data(), xq.data(),
                       xs.data()});
    EXPECT_EQ(y2, y);
  }
}

// ---------------------------------------------------------------------------------------------- norms

TEST(RmsNormCpu, MatchesReference) {
  for (int64_t rows : {1, 3}) {
    for (int64_t d : {1, 7, 64, 1000}) {
      std::vector<float> x = RandomVector(rows * d, 3, -3.f, 3.f), w = RandomVector(d, 4);
      std::vector<float> y(rows * d), y_ref(rows * d);
      cpu::RmsNorm({rows, d, 1e-5f, d, d, x.data(), w.data(), y.data()});
      cpu::RmsNormReference({rows, d, 1e-5f, d, d, x.data(), w.data(), y_ref.data()});
      EXPECT_LE(RelErr(y, y_ref), kTol) << "rows=" << rows << " d=" << d;
      cpu::RmsNorm({rows, d, 1e-5f, d, d, x.data(), w.data(), x.data()});  // in place
      EXPECT_EQ(x, y);
    }
  }
}

TEST(RmsNormCpu, HandComputed) {
  // x = [3 4]: mean(x^2) = 12.5, eps = 0 -> x / sqrt(12.5)
  std::vector<float> x = {3, 4}, w = {1, 2}, y(2);
  cpu::RmsNorm({1, 2, 0.f, 2, 2, x.data(), w.data(), y.data()});
  EXPECT_FLOAT_EQ(y[0], 3 / std::sqrt(12.5f));
  EXPECT_FLOAT_EQ(y[1], 8 / std::sqrt(12.5f));
}

TEST(GatedRmsNormCpu, MatchesReference) {
  for (int64_t rows : {1, 4}) {
    for (int64_t heads : {1, 3}) {
      for (int64_t dh : {8, 64}) {
        const int64_t width = heads * dh, o_stride = width + 2;
        std::vector<float> o = RandomVector(rows * o_stride, 5, -2.f, 2.f);
        std::vector<float> g = RandomVector(rows * width, 6, -6.f, 6.f), w = RandomVector(dh, 7);
        std::vector<float> y(rows * width), y_ref(rows * width);
        cpu::GatedRmsNorm({rows, heads, dh, 1e-6f, o_stride, width, width, o.data(), g.data(), w.data(), y.data()});
        cpu::GatedRmsNormReference(
            {rows, heads, dh, 1e-6f, o_stride, width, width, o.data(), g.data(), w.data(), y_ref.data()});
        EXPECT_LE(RelErr(y, y_ref), kTol) << "rows=" << rows << " heads=" << heads << " dh=" << dh;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- RoPE

TEST(RopeCpu, MatchesReference) {
  for (int64_t tokens : {1, 5}) {
    for (int64_t heads : {1, 3}) {
      for (int64_t dh : {8, 64}) {
        for (int64_t start : {0, 17, 4000}) {
          const int64_t stride = heads * dh + 4;
          std::vector<float> x = RandomVector(tokens * stride, 8), x_ref = x;
          cpu::Rope({tokens, heads, dh, start, 10000.0, stride, x.data()});
          cpu::RopeReference({tokens, heads, dh, start, 10000.0, stride, x_ref.data()});
          EXPECT_LE(RelErr(x, x_ref), 1e-6) << "T=" << tokens << " H=" << heads << " dh=" << dh << " s=" << start;
        }
      }
    }
  }
}

TEST(RopeCpu, PositionZeroIsIdentity) {
  std::vector<float> x = RandomVector(2 * 64, 9), x0 = x;
  cpu::Rope({1, 2, 64, 0, 10000.0, 128, x.data()});
  EXPECT_EQ(x, x0);
}

TEST(RopeCpu, HandComputedRotation) {
  // dh = 2: one pair, f_0 = 1, so position p rotates (x0, x1) by p radians. Token 1 of the span is position 3.
  std::vector<float> x = {1, 0, 0, 1};
  cpu::Rope({2, 1, 2, 2, 10000.0, 2, x.data()});
  EXPECT_FLOAT_EQ(x[0], std::cos(2.f));
  EXPECT_FLOAT_EQ(x[1], std::sin(2.f));
  EXPECT_FLOAT_EQ(x[2], -std::sin(3.f));
  EXPECT_FLOAT_EQ(x[3], std::cos(3.f));
}

// ---------------------------------------------------------------------------------------------- causal conv

TEST(CausalConvCpu, MatchesReference) {
  for (int64_t channels : {1, 5, 64}) {
    for (int64_t width : {1, 2, 4}) {
      for (int64_t tokens : {1, 2, 7}) {
        for (bool silu : {false, true}) {
          const int64_t history = width - 1, in_stride = channels + 3;
          std::vector<float> weight = RandomVector(channels * width, 10), bias = RandomVector(channels, 11);
          std::vector<float> window = RandomVector(history * channels, 12), window_ref = window;
          std::vector<float> in = RandomVector(tokens * in_stride, 13);
          std::vector<float> out(tokens * channels), out_ref(tokens * channels);
          cpu::CausalConv({tokens, channels, width, silu, in_stride, channels, weight.data(), bias.data(),
                           window.data(), in.data(), out.data()});
          cpu::CausalConvReference({tokens, channels, width, silu, in_stride, channels, weight.data(), bias.data(),
                                    window_ref.data(), in.data(), out_ref.data()});
          const std::string where = "C=" + std::to_string(channels) + " w=" + std::to_string(width) +
                                    " T=" + std::to_string(tokens) + " silu=" + std::to_string(silu);
          EXPECT_LE(RelErr(out, out_ref), kTol) << where;
          EXPECT_EQ(window, window_ref) << where;
        }
      }
    }
  }
}

TEST(CausalConvCpu, SpanEqualsTokenByToken) {
  const int64_t c = 6, w = 4, t_len = 5;
  std::vector<float> weight = RandomVector(c * w, 14), bias = RandomVector(c, 15), in = RandomVector(t_len * c, 16);
  std::vector<float> window_span((w - 1) * c, 0.f), window_step = window_span;
  std::vector<float> out_span(t_len * c), out_step(t_len * c);
  cpu::CausalConv({t_len, c, w, true, c, c, weight.data(), bias.data(), window_span.data(), in.data(),
                   out_span.data()});
  for (int64_t t = 0; t < t_len; ++t) {
    cpu::CausalConv({1, c, w, true, c, c, weight.data(), bias.data(), window_step.data(), in.data() + t * c,
                     out_step.data() + t * c});
  }
  EXPECT_EQ(out_span, out_step);
  EXPECT_EQ(window_span, window_step);
}

TEST(CausalConvCpu, LastTapIsIdentity) {
  const int64_t c = 3, w = 4, t_len = 2;
  std::vector<float> weight(c * w, 0.f), bias(c, 0.f);
  for (int64_t ch = 0; ch < c; ++ch) weight[ch * w + w - 1] = 1.f;  // e_{w-1}
  std::vector<float> window = RandomVector((w - 1) * c, 17), in = RandomVector(t_len * c, 18), out(t_len * c);
  const std::vector<float> old_window = window;
  cpu::CausalConv({t_len, c, w, false, c, c, weight.data(), bias.data(), window.data(), in.data(), out.data()});
  EXPECT_EQ(out, in);
  // The window is now [old row 2, in row 0, in row 1].
  std::vector<float> expected(old_window.begin() + 2 * c, old_window.end());
  expected.insert(expected.end(), in.begin(), in.end());
  EXPECT_EQ(window, expected);
}

// ---------------------------------------------------------------------------------------------- attention

TEST(AttentionCpu, MatchesReference) {
  struct Shape { int64_t tq, tk; };
  // Spans across the kernel's blocks of 16 queries and 64 keys too.
  for (Shape s : {Shape{1, 1}, Shape{1, 9}, Shape{4, 4}, Shape{3, 10}, Shape{16, 40}, Shape{1, 300}, Shape{17, 17},
                  Shape{40, 200}, Shape{33, 64}}) {
    for (int64_t heads : {1, 2}) {
      for (int64_t dh : {8, 64}) {
        const int64_t width = heads * dh, q_stride = 3 * width;  // q as a view into a fused [q|k|v] row
        std::vector<float> q = RandomVector(s.tq * q_stride, 19, -2.f, 2.f);
        std::vector<float> k = RandomVector(s.tk * width, 20, -2.f, 2.f), v = RandomVector(s.tk * width, 21);
        std::vector<float> out(s.tq * width), out_ref(s.tq * width), scratch(s.tq * s.tk);
        cpu::Attention({s.tq, s.tk, heads, dh, q_stride, width, width, q.data(), k.data(), v.data(), out.data(),
                        scratch.data()});
        cpu::AttentionReference(
            {s.tq, s.tk, heads, dh, q_stride, width, width, q.data(), k.data(), v.data(), out_ref.data(), nullptr});
        EXPECT_LE(RelErr(out, out_ref), kTol) << "Tq=" << s.tq << " Tk=" << s.tk << " H=" << heads << " dh=" << dh;
      }
    }
  }
}

// A paged KV cache: the same keys and values copied into blocks (rows of a wider layout, at a column offset,
// the last block partly filled) give the contiguous cache's result, within the kernel tolerance, and the
// reference over the blocks equals the reference over the contiguous cache exactly.
TEST(AttentionCpu, PagedCacheMatchesContiguous) {
  struct Shape { int64_t tq, tk, block; };
  for (Shape s : {Shape{1, 1, 4}, Shape{1, 9, 4}, Shape{3, 10, 4}, Shape{16, 40, 16}, Shape{1, 300, 64},
                  Shape{33, 64, 64}, Shape{5, 130, 64}}) {
    for (int64_t dh : {8, 64, 128}) {  // 64, 128: one query takes the vectorised decode path
      // A block holds a token's heads side by side ([pad | k or v | pad] a row), or each head's rows together
      // ([pad | head 0's rows | head 1's rows], as the CPU backend's blocks do).
      for (bool by_head : {false, true}) {
        const int64_t heads = 2, width = heads * dh, q_stride = 3 * width;
        const int64_t row = by_head ? dh : 3 * width, col = width, head_stride = by_head ? s.block * dh : 0;
        std::vector<float> q = RandomVector(s.tq * q_stride, 40, -2.f, 2.f);
        std::vector<float> k = RandomVector(s.tk * width, 41, -2.f, 2.f), v = RandomVector(s.tk * width, 42);
        const int64_t n_blocks = (s.tk + s.block - 1) / s.block;
        std::vector<std::vector<float>> kb(n_blocks, std::vector<float>(col + s.block * 3 * width, 99.f)), vb = kb;
        std::vector<const void*> kp, vp;
        for (int64_t j = 0; j < n_blocks; ++j) {
          for (int64_t r = 0; r < s.block && j * s.block + r < s.tk; ++r) {
            for (int64_t h = 0; h < heads; ++h) {
              const int64_t from = (j * s.block + r) * width + h * dh,
                            to = col + h * (by_head ? head_stride : dh) + r * row;
              std::copy_n(k.data() + from, dh, kb[j].data() + to);
              std::copy_n(v.data() + from, dh, vb[j].data() + to);
            }
          }
          kp.push_back(kb[j].data());
          vp.push_back(vb[j].data());
        }
        std::vector<float> out(s.tq * width), paged_ref(s.tq * width), contiguous_ref(s.tq * width),
            scratch(s.tq * s.tk);
        AttentionParams paged{s.tq,    s.tk,      heads,     dh,      q_stride,   row,
                              width,   q.data(),  nullptr,   nullptr, out.data(), scratch.data(),
                              s.block, kp.data(), vp.data(), col};
        paged.kv_head_stride = head_stride;
        cpu::Attention(paged);
        paged.out_ptr = paged_ref.data();
        cpu::AttentionReference(paged);
        cpu::AttentionReference({s.tq, s.tk, heads, dh, q_stride, width, width, q.data(), k.data(), v.data(),
                                 contiguous_ref.data(), nullptr});
        const std::string where = "Tq=" + std::to_string(s.tq) + " Tk=" + std::to_string(s.tk) +
                                  " block=" + std::to_string(s.block) + " dh=" + std::to_string(dh) +
                                  (by_head ? " by head" : " by token");
        EXPECT_EQ(paged_ref, contiguous_ref) << where;
        EXPECT_LE(RelErr(out, contiguous_ref), kTol) << where;
      }
    }
  }
}

// A bf16 paged cache: the kernel widens each block and computes what the reference computes over the same
// bf16 blocks, and that is exactly the reference over an fp32 cache holding the rounded values.
TEST(AttentionCpu, Bf16PagedCacheMatchesTheRoundedFp32Cache) {
  struct Shape {
    int64_t tq, tk, block;
  };
  for (Shape s :
       {Shape{1, 1, 4}, Shape{1, 9, 4}, Shape{3, 10, 4}, Shape{1, 300, 64}, Shape{33, 64, 64}, Shape{5, 130, 64}}) {
    const int64_t heads = 2, dh = 64, width = heads * dh, q_stride = 3 * width;
    const int64_t row = 3 * width, col = width;  // a block row holds [pad | k or v | pad]
    std::vector<float> q = RandomVector(s.tq * q_stride, 50, -2.f, 2.f);
    std::vector<float> k = RandomVector(s.tk * width, 51, -2.f, 2.f), v = RandomVector(s.tk * width, 52);
    std::vector<uint16_t> k16(k.size()), v16(v.size());
    cpu::RoundToBf16(k.data(), k.size(), k16.data());
    cpu::RoundToBf16(v.data(), v.size(), v16.data());
    std::vector<float> k_rounded(k.size()), v_rounded(v.size());
    cpu::WidenBf16(k16.data(), k16.size(), k_rounded.data());
    cpu::WidenBf16(v16.data(), v16.size(), v_rounded.data());
    EXPECT_NE(k_rounded, k);  // the cache does round
    const int64_t n_blocks = (s.tk + s.block - 1) / s.block;
    std::vector<std::vector<uint16_t>> kb(n_blocks, std::vector<uint16_t>(s.block * row, 0x7fc0)), vb = kb;
    std::vector<const void*> kp, vp;
    for (int64_t j = 0; j < n_blocks; ++j) {
      for (int64_t r = 0; r < s.block && j * s.block + r < s.tk; ++r) {
        std::copy_n(k16.data() + (j * s.block + r) * width, width, kb[j].data() + r * row + col);
        std::copy_n(v16.data() + (j * s.block + r) * width, width, vb[j].data() + r * row + col);
      }
      kp.push_back(kb[j].data());
      vp.push_back(vb[j].data());
    }
    std::vector<float> out(s.tq * width), paged_ref(s.tq * width), rounded_ref(s.tq * width), scratch(s.tq * s.tk);
    std::vector<float> widen(s.block * dh);
    AttentionParams paged{s.tq,    s.tk,      heads,     dh,      q_stride,        row,
                          width,   q.data(),  nullptr,   nullptr, out.data(),      scratch.data(),
                          s.block, kp.data(), vp.data(), col,     KvFormat::kBf16, widen.data()};
    cpu::Attention(paged);
    paged.out_ptr = paged_ref.data();
    cpu::AttentionReference(paged);
    cpu::AttentionReference({s.tq, s.tk, heads, dh, q_stride, width, width, q.data(), k_rounded.data(),
                             v_rounded.data(), rounded_ref.data(), nullptr});
    EXPECT_EQ(paged_ref, rounded_ref) << "Tq=" << s.tq << " Tk=" << s.tk << " block=" << s.block;
    EXPECT_LE(RelErr(out, rounded_ref), kTol) << "Tq=" << s.tq << " Tk=" << s.tk << " block=" << s.block;
  }
}

// An int8 paged cache (each head's rows together, head_dim int8 values and a 4-byte scale per row): the decode
// kernel and the multi-query path compute what the reference computes over the same blocks, and that is
// exactly the reference over an fp32 cache holding the dequantised values.
TEST(AttentionCpu, Int8PagedCacheMatchesTheDequantisedFp32Cache) {
  struct Shape {
    int64_t tq, tk, block;
  };
  for (Shape s :
       {Shape{1, 1, 4}, Shape{1, 9, 4}, Shape{3, 10, 4}, Shape{1, 300, 64}, Shape{33, 64, 64}, Shape{5, 130, 64}}) {
    for (int64_t dh : {8, 64}) {
      const int64_t heads = 2, width = heads * dh, q_stride = 3 * width, row = KvHeadRowElements(KvFormat::kInt8, dh);
      const int64_t col = 16, head_stride = s.block * row;  // a block holds [pad | head 0's rows | head 1's rows]
      std::vector<float> q = RandomVector(s.tq * q_stride, 60, -2.f, 2.f);
      std::vector<float> k = RandomVector(s.tk * width, 61, -2.f, 2.f), v = RandomVector(s.tk * width, 62);
      std::vector<float> k_dequantised(k.size()), v_dequantised(v.size());
      const int64_t n_blocks = (s.tk + s.block - 1) / s.block;
      std::vector<std::vector<int8_t>> kb(n_blocks, std::vector<int8_t>(col + heads * head_stride, 99)), vb = kb;
      std::vector<const void*> kp, vp;
      for (int64_t j = 0; j < n_blocks; ++j) {
        for (int64_t r = 0; r < s.block && j * s.block + r < s.tk; ++r) {
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t from = (j * s.block + r) * width + h * dh, to = col + h * head_stride + r * row;
            cpu::QuantizeKvRow(k.data() + from, dh, kb[j].data() + to);
            cpu::QuantizeKvRow(v.data() + from, dh, vb[j].data() + to);
            cpu::DequantizeKvRow(kb[j].data() + to, dh, k_dequantised.data() + from);
            cpu::DequantizeKvRow(vb[j].data() + to, dh, v_dequantised.data() + from);
          }
        }
        kp.push_back(kb[j].data());
        vp.push_back(vb[j].data());
      }
      EXPECT_NE(k_dequantised, k);  // the cache does round
      std::vector<float> out(s.tq * width), paged_ref(s.tq * width), dequantised_ref(s.tq * width),
          scratch(s.tq * s.tk), widen(s.block * dh);
      AttentionParams paged{s.tq,      s.tk,    heads,           dh,           q_stride,       row,     width,
                            q.data(),  nullptr, nullptr,         out.data(),   scratch.data(), s.block, kp.data(),
                            vp.data(), col,     KvFormat::kInt8, widen.data(), head_stride};
      cpu::Attention(paged);
      paged.out_ptr = paged_ref.data();
      cpu::AttentionReference(paged);
      cpu::AttentionReference({s.tq, s.tk, heads, dh, q_stride, width, width, q.data(), k_dequantised.data(),
                               v_dequantised.data(), dequantised_ref.data(), nullptr});
      const std::string where = "Tq=" + std::to_string(s.tq) + " Tk=" + std::to_string(s.tk) +
                                " block=" + std::to_string(s.block) + " dh=" + std::to_string(dh);
      EXPECT_EQ(paged_ref, dequantised_ref) << where;
      EXPECT_LE(RelErr(out, dequantised_ref), kTol) << where;
    }
  }
}

// One query over many blocks whose scores climb from block to block, and fall again: the decode kernel's
// online softmax must rescale what it summed whenever a later block raises the maximum (scores here reach
// about 60, so a missed rescale is off by orders of magnitude, not by rounding).
TEST(AttentionCpu, DecodeRescalesWhenALaterBlockRaisesTheMaximum) {
  const int64_t dh = 64, tk = 300, block = 32, n_blocks = (tk + block - 1) / block;
  std::vector<float> q = RandomVector(dh, 80, -1.f, 1.f), v = RandomVector(tk * dh, 81);
  float q_norm = 0.f;
  for (float x : q) q_norm += x * x;
  std::vector<float> k(tk * dh);
  for (int64_t s = 0; s < tk; ++s) {  // key s along q, its score peaking at s = 200
    const float target = 60.f * (1.f - std::abs(static_cast<float>(s) - 200.f) / 200.f);
    for (int64_t d = 0; d < dh; ++d) k[s * dh + d] = q[d] * target * std::sqrt(static_cast<float>(dh)) / q_norm;
  }
  std::vector<std::vector<float>> kb(n_blocks, std::vector<float>(block * dh, 0.f)), vb = kb;
  std::vector<const void*> kp, vp;
  for (int64_t j = 0; j < n_blocks; ++j) {
    for (int64_t r = 0; r < block && j * block + r < tk; ++r) {
      std::copy_n(k.data() + (j * block + r) * dh, dh, kb[j].data() + r * dh);
      std::copy_n(v.data() + (j * block + r) * dh, dh, vb[j].data() + r * dh);
    }
    kp.push_back(kb[j].data());
    vp.push_back(vb[j].data());
  }
  std::vector<float> out(dh), ref(dh), scratch(tk);
  cpu::Attention({1, tk, 1, dh, dh, dh, dh, q.data(), nullptr, nullptr, out.data(), scratch.data(), block, kp.data(),
                  vp.data(), 0});
  cpu::AttentionReference({1, tk, 1, dh, dh, dh, dh, q.data(), k.data(), v.data(), ref.data(), nullptr});
  EXPECT_LE(RelErr(out, ref), kTol);
}

// An int8 KV row: the largest |x| maps to +-127, every value lies within half a step of its original, and a
// zero row stays zero (scale 0).
TEST(Int8Kv, QuantisesEachRowToItsOwnScale) {
  std::vector<float> x = RandomVector(64, 70, -3.f, 3.f);
  x[5] = -4.f;
  std::vector<int8_t> packed(64 + 4);
  std::vector<float> back(64);
  cpu::QuantizeKvRow(x.data(), 64, packed.data());
  cpu::DequantizeKvRow(packed.data(), 64, back.data());
  EXPECT_EQ(packed[5], -127);
  for (int i = 0; i < 64; ++i) EXPECT_LE(std::abs(back[i] - x[i]), 0.5f * 4.f / 127.f * (1 + 1e-6f)) << i;
  std::vector<float> zeros(64, 0.f);
  cpu::QuantizeKvRow(zeros.data(), 64, packed.data());
  cpu::DequantizeKvRow(packed.data(), 64, back.data());
  EXPECT_EQ(back, zeros);
}

TEST(Bf16, RoundsToNearestEvenAndWidensExactly) {
  const float in[] = {1.0f, 1.00390625f, 1.01171875f, -2.5f, 0.f, 3.0e38f};
  // 1 + 2^-8 lies halfway between bf16 1 and 1 + 2^-7: to even (1); 1 + 3 * 2^-8 halfway up: to 1 + 2^-6.
  const float want[] = {1.0f, 1.0f, 1.015625f, -2.5f, 0.f};
  uint16_t packed[6];
  float back[6];
  cpu::RoundToBf16(in, 6, packed);
  cpu::WidenBf16(packed, 6, back);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(back[i], want[i]) << in[i];
  EXPECT_LE(std::abs(back[5] - in[5]), std::ldexp(in[5], -9)) << "more than half a bf16 step (8 bits) away";
}

TEST(AttentionCpu, OneKeyReturnsItsValue) {
  std::vector<float> q = RandomVector(16, 22), k = RandomVector(16, 23), v = RandomVector(16, 24), out(16);
  std::vector<float> scratch(1);
  cpu::Attention({1, 1, 2, 8, 16, 16, 16, q.data(), k.data(), v.data(), out.data(), scratch.data()});
  EXPECT_EQ(out, v);
}

TEST(AttentionCpu, FirstQueryOfSpanSeesOnlyTheCachePrefix) {
  // Tq = Tk = 2: query 0 sees key 0 only, whatever key 1 holds.
  std::vector<float> q = RandomVector(2 * 8, 25), k = RandomVector(2 * 8, 26), v = RandomVector(2 * 8, 27);
  std::vector<float> out(2 * 8), scratch(2 * 2);
  cpu::Attention({2, 2, 1, 8, 8, 8, 8, q.data(), k.data(), v.data(), out.data(), scratch.data()});
  EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + 8), std::vector<float>(v.begin(), v.begin() + 8));
}

// ---------------------------------------------------------------------------------------------- recurrences

struct RecurrentCase {
  int64_t tokens, heads, dh;
};

constexpr RecurrentCase kRecurrentCases[] = {{1, 1, 8}, {1, 3, 64}, {6, 2, 8}, {5, 2, 64}};

// A recurrent span against its reference: outputs, final state, per-token states, and the last
// per-token state equal to the final one.
void ExpectRecurrentMatches(const RecurrentCase& c, const std::vector<float>& out, const std::vector<float>& out_ref,
                            const std::vector<float>& state, const std::vector<float>& state_ref,
                            const std::vector<float>& states, const std::vector<float>& states_ref) {
  const std::string where = "T=" + std::to_string(c.tokens) + " H=" + std::to_string(c.heads) +
                            " dh=" + std::to_string(c.dh);
  EXPECT_LE(RelErr(out, out_ref), kTol) << where;
  EXPECT_LE(RelErr(state, state_ref), kTol) << where;
  EXPECT_LE(RelErr(states, states_ref), kTol) << where;
  if (!states.empty()) {
    EXPECT_EQ(std::vector<float>(states.end() - state.size(), states.end()), state) << where;
  }
}

// Long spans that save no per-token states take the chunked path: lengths below, at and across chunks.
constexpr RecurrentCase kChunkedCases[] = {{16, 2, 8}, {64, 1, 64}, {65, 2, 16}, {150, 3, 32}};

// Random inputs against the reference, saving per-token states (the token-by-token path) or not (the
// chunked path for long spans).
void CheckMamba2(const RecurrentCase& c, bool save_states) {
  const int64_t width = c.heads * c.dh, stride = 3 * width, state_size = c.heads * c.dh * c.dh;
  std::vector<float> qkv = RandomVector(c.tokens * stride, 28);
  std::vector<float> dt = RandomVector(c.tokens * c.heads, 29, 0.f, save_states ? 1.f : 0.5f);
  std::vector<float> a_log = RandomVector(c.heads, 30), log_a(c.tokens * c.heads);
  for (int64_t i = 0; i < c.tokens * c.heads; ++i) log_a[i] = -dt[i] * std::exp(a_log[i % c.heads]);
  std::vector<float> d_skip = RandomVector(c.heads, 31);
  std::vector<float> state = RandomVector(state_size, 32), state_ref = state;
  std::vector<float> states(save_states ? c.tokens * state_size : 0), states_ref(states.size());
  std::vector<float> out(c.tokens * width), out_ref(c.tokens * width);
  const float *q = qkv.data(), *k = qkv.data() + width, *v = qkv.data() + 2 * width;
  cpu::Mamba2({c.tokens, c.heads, c.dh, stride, width, dt.data(), log_a.data(), d_skip.data(), q, k, v, state.data(),
               save_states ? states.data() : nullptr, out.data()});
  cpu::Mamba2Reference({c.tokens, c.heads, c.dh, stride, width, dt.data(), log_a.data(), d_skip.data(), q, k, v,
                        state_ref.data(), save_states ? states_ref.data() : nullptr, out_ref.data()});
  ExpectRecurrentMatches(c, out, out_ref, state, state_ref, states, states_ref);
}

void CheckGdn(const RecurrentCase& c, bool save_states) {
  const int64_t width = c.heads * c.dh, stride = 3 * width, state_size = c.heads * c.dh * c.dh;
  std::vector<float> qkv = RandomVector(c.tokens * stride, 36, -2.f, 2.f);
  std::vector<float> beta = RandomVector(c.tokens * c.heads, 37, 0.f, 1.f);
  std::vector<float> log_alpha = RandomVector(c.tokens * c.heads, 38, save_states ? -2.f : -1.f, 0.f);
  std::vector<float> state = RandomVector(state_size, 39), state_ref = state;
  std::vector<float> states(save_states ? c.tokens * state_size : 0), states_ref(states.size());
  std::vector<float> out(c.tokens * width), out_ref(c.tokens * width);
  const float *q = qkv.data(), *k = qkv.data() + width, *v = qkv.data() + 2 * width;
  cpu::Gdn({c.tokens, c.heads, c.dh, stride, width, beta.data(), log_alpha.data(), q, k, v, state.data(),
            save_states ? states.data() : nullptr, out.data()});
  cpu::GdnReference({c.tokens, c.heads, c.dh, stride, width, beta.data(), log_alpha.data(), q, k, v, state_ref.data(),
                     save_states ? states_ref.data() : nullptr, out_ref.data()});
  ExpectRecurrentMatches(c, out, out_ref, state, state_ref, states, states_ref);
}

TEST(Mamba2Cpu, MatchesReference) {
  for (RecurrentCase c : kRecurrentCases) CheckMamba2(c, /*save_states=*/true);
}

TEST(Mamba2Cpu, ChunkedSpanMatchesReference) {
  for (RecurrentCase c : kChunkedCases) CheckMamba2(c, /*save_states=*/false);
}

TEST(GdnCpu, ChunkedSpanMatchesReference) {
  for (RecurrentCase c : kChunkedCases) CheckGdn(c, /*save_states=*/false);
}

TEST(Mamba2Cpu, ZeroDtLeavesStateAndReturnsSkip) {
  const int64_t h = 2, dh = 8, width = h * dh;
  std::vector<float> q(width, 0.f), k = RandomVector(width, 33), v = RandomVector(width, 34);
  std::vector<float> dt(h, 0.f), log_a(h, 0.f), d_skip = {0.5f, -2.f};
  std::vector<float> state = RandomVector(h * dh * dh, 35), out(width);
  const std::vector<float> state0 = state;
  cpu::Mamba2({1, h, dh, width, width, dt.data(), log_a.data(), d_skip.data(), q.data(), k.data(), v.data(),
               state.data(), nullptr, out.data()});
  EXPECT_EQ(state, state0);
  for (int64_t i = 0; i < width; ++i) EXPECT_EQ(out[i], d_skip[i / dh] * v[i]) << i;
}

TEST(GdnCpu, MatchesReference) {
  for (RecurrentCase c : kRecurrentCases) CheckGdn(c, /*save_states=*/true);
}

TEST(GdnCpu, ZeroBetaUnitAlphaLeavesState) {
  const int64_t h = 2, dh = 8, width = h * dh;
  std::vector<float> q = RandomVector(width, 40), k = RandomVector(width, 41), v = RandomVector(width, 42);
  std::vector<float> beta(h, 0.f), log_alpha(h, 0.f), state = RandomVector(h * dh * dh, 43), out(width);
  const std::vector<float> state0 = state;
  cpu::Gdn({1, h, dh, width, width, beta.data(), log_alpha.data(), q.data(), k.data(), v.data(), state.data(),
            nullptr, out.data()});
  EXPECT_EQ(state, state0);
}

TEST(GdnCpu, UnitBetaFromZeroStateStoresTheValue) {
  // S = 0, beta = 1: S' = kn v^T, and reading with q = k gives (kn . qn) v = v / sqrt(dh) (up to the 1e-6 eps).
  const int64_t dh = 8;
  std::vector<float> k = RandomVector(dh, 44), v = RandomVector(dh, 45), state(dh * dh, 0.f), out(dh);
  std::vector<float> beta = {1.f}, log_alpha = {-0.3f};
  cpu::Gdn({1, 1, dh, dh, dh, beta.data(), log_alpha.data(), k.data(), k.data(), v.data(), state.data(), nullptr,
            out.data()});
  for (int64_t j = 0; j < dh; ++j) EXPECT_NEAR(out[j], v[j] / std::sqrt(8.f), 1e-5) << j;
}

// ---------------------------------------------------------------------------------------------- SwiGLU

TEST(SwiGluCpu, MatchesReference) {
  for (int64_t rows : {1, 3}) {
    for (int64_t d : {1, 7, 300}) {
      std::vector<float> gate = RandomVector(rows * d, 46, -10.f, 10.f), up = RandomVector(rows * d, 47);
      std::vector<float> y(rows * d), y_ref(rows * d);
      cpu::SwiGlu({rows, d, d, d, d, gate.data(), up.data(), y.data()});
      cpu::SwiGluReference({rows, d, d, d, d, gate.data(), up.data(), y_ref.data()});
      EXPECT_LE(RelErr(y, y_ref), kTol) << "rows=" << rows << " d=" << d;
    }
  }
}

// ---------------------------------------------------------------------------------------------- sampling

int64_t Greedy(void (*op)(const SampleParams&), const std::vector<float>& logits) {
  int64_t token = -1;
  op({static_cast<int64_t>(logits.size()), logits.data(), &token});
  return token;
}

TEST(SampleCpu, GreedyPicksLowestIndexOnTies) {
  const std::vector<float> logits = {1.f, 3.f, -2.f, 3.f, 3.f};
  EXPECT_EQ(Greedy(cpu::SampleGreedy, logits), 1);
  EXPECT_EQ(Greedy(cpu::SampleGreedyReference, logits), 1);
}

// The one-pass entropy against the double softmax: small sizes and a vocabulary's, logits spread, peaked,
// tied at the top and far below the maximum (whose float exps underflow).
TEST(SampleCpu, DistributionStatsMatchesReference) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (int64_t n : {2, 17, 255, 256, 257, 4099, 32000}) {
    for (int shape = 0; shape < 4; ++shape) {
      std::vector<float> logits(n);
      for (float& l : logits) l = normal(rng);
      if (shape == 1) logits[n / 2] += 30.f;             // peaked
      if (shape == 2) logits[0] = logits[n - 1] = 12.f;  // tied at the top
      for (int64_t i = 1; shape == 3 && i < n; i += 2) logits[i] = -200.f;  // far below
      double entropy = 0, margin = 0, want_entropy = 0, want_margin = 0;
      cpu::DistributionStats(logits.data(), n, &entropy, &margin);
      cpu::DistributionStatsReference(logits.data(), n, &want_entropy, &want_margin);
      EXPECT_NEAR(entropy, want_entropy, 1e-6) << n << " " << shape;
      EXPECT_EQ(margin, want_margin) << n << " " << shape;
    }
  }
  double entropy = 0, margin = 0;
  const std::vector<float> uniform(1000, 0.25f);
  cpu::DistributionStats(uniform.data(), 1000, &entropy, &margin);
  EXPECT_NEAR(entropy, std::log(1000.0), 1e-6);
  EXPECT_EQ(margin, 0.0);
}

TEST(SampleCpu, GreedyMatchesReference) {
  for (int64_t v : {1, 7, 1000}) {
    const std::vector<float> logits = RandomVector(v, 48, -5.f, 5.f);
    EXPECT_EQ(Greedy(cpu::SampleGreedy, logits), Greedy(cpu::SampleGreedyReference, logits));
  }
}

}  // namespace
}  // namespace oryx::kernels
