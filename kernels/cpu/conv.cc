// Causal depthwise conv over a span of tokens, continuing from (and updating) the window of the last w-1
// inputs. Single-threaded; channels are independent and would be the axis to split.
#include <Eigen/Core>
#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

#include "kernels/ops.h"

namespace oryx::kernels::cpu {

namespace {
// Row r of the virtual sequence [window; in]: r < w-1 is the window, the rest the span.
const float* InputRow(const CausalConvParams& p, int64_t r) {
  const int64_t history = p.width - 1;
  return r < history ? p.window_ptr + r * p.channels : p.in_ptr + (r - history) * p.in_token_stride;
}

// window <- the last w-1 rows of [window; in], oldest first.
void ShiftWindow(const CausalConvParams& p) {
  const int64_t history = p.width - 1, c = p.channels;
  if (history == 0 || p.tokens == 0) return;
  const int64_t kept = std::max<int64_t>(0, history - p.tokens);  // old window rows that survive
  // Moving forward is safe: the destination row r is always before the source row r + tokens.
  for (int64_t r = 0; r < kept; ++r) std::copy_n(p.window_ptr + (r + p.tokens) * c, c, p.window_ptr + r * c);
  for (int64_t r = kept; r < history; ++r) {
    const int64_t t = p.tokens - history + r;
    std::copy_n(p.in_ptr + t * p.in_token_stride, c, p.window_ptr + r * c);
  }
}
}  // namespace

void CausalConv(const CausalConvParams& p) {
  assert(p.width >= 1);
  const int64_t c = p.channels, w = p.width;
  using ConstStrided = Eigen::Map<const Eigen::ArrayXf, 0, Eigen::InnerStride<>>;
  Eigen::Map<const Eigen::ArrayXf> bias(p.bias_ptr, c);
  for (int64_t t = 0; t < p.tokens; ++t) {
    Eigen::Map<Eigen::ArrayXf> out(p.out_ptr + t * p.out_token_stride, c);
    out = bias;
    for (int64_t j = 0; j < w; ++j) {
      out += ConstStrided(p.weight_ptr + j, c, Eigen::InnerStride<>(w)) *
             Eigen::Map<const Eigen::ArrayXf>(InputRow(p, t + j), c);
    }
    if (p.apply_silu) out = out / (1.0f + (-out).exp());
  }
  ShiftWindow(p);
}

void CausalConvReference(const CausalConvParams& p) {
  const int64_t c = p.channels, w = p.width, history = w - 1;
  // The whole virtual sequence [window; in] as one buffer, then the textbook sum.
  std::vector<float> seq((history + p.tokens) * c);
  for (int64_t r = 0; r < history + p.tokens; ++r) std::copy_n(InputRow(p, r), c, seq.data() + r * c);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const int64_t r = history + t;  // the current token's row in seq
    for (int64_t ch = 0; ch < c; ++ch) {
      double acc = p.bias_ptr[ch];
      for (int64_t j = 0; j < w; ++j) acc += double{p.weight_ptr[ch * w + j]} * seq[(r - (w - 1) + j) * c + ch];
      if (p.apply_silu) acc = acc / (1.0 + std::exp(-acc));
      p.out_ptr[t * p.out_token_stride + ch] = static_cast<float>(acc);
    }
  }
  for (int64_t r = 0; r < history; ++r) std::copy_n(seq.data() + (p.tokens + r) * c, c, p.window_ptr + r * c);
}

}  // namespace oryx::kernels::cpu
