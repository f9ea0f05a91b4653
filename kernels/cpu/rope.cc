// Half-split ("rotate half") RoPE in place over [T, H, dh], angles as the LibTorch model computes them
// (float64 pos * theta^(-2i/dh), cast to float, then float cos/sin). Single-threaded; tokens would split.
#include <Eigen/Core>
#include <cassert>
#include <cmath>
#include <array>
#include <vector>

#include "kernels/ops.h"

namespace oryx::kernels::cpu {

namespace {
float RopeAngle(int64_t pos, int64_t i, int64_t head_dim, double theta) {
  return static_cast<float>(static_cast<double>(pos) * std::pow(theta, -2.0 * static_cast<double>(i) / head_dim));
}
}  // namespace

// The cos/sin table is built once per token and applied to every head.
void Rope(const RopeParams& p) {
  assert(p.head_dim % 2 == 0);
  const int64_t half = p.head_dim / 2;
  assert(p.head_dim <= kMaxHeadDim);
  using HalfArray = Eigen::Array<float, Eigen::Dynamic, 1, 0, kMaxHeadDim / 2, 1>;  // on the stack
  std::array<double, kMaxHeadDim / 2> freq;
  for (int64_t i = 0; i < half; ++i) freq[i] = std::pow(p.theta, -2.0 * static_cast<double>(i) / p.head_dim);
  HalfArray cos_a(half), sin_a(half);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const double pos = static_cast<double>(p.start_pos + t);
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(pos * freq[i]);
      cos_a[i] = std::cos(a);
      sin_a[i] = std::sin(a);
    }
    for (int64_t h = 0; h < p.heads; ++h) {
      float* x = p.x_ptr + t * p.x_token_stride + h * p.head_dim;
      Eigen::Map<Eigen::ArrayXf> x1(x, half), x2(x + half, half);
      const HalfArray x1_old = x1;
      x1 = x1_old * cos_a - x2 * sin_a;
      x2 = x2 * cos_a + x1_old * sin_a;
    }
  }
}

void RopeReference(const RopeParams& p) {
  const int64_t half = p.head_dim / 2;
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t h = 0; h < p.heads; ++h) {
      float* x = p.x_ptr + t * p.x_token_stride + h * p.head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = RopeAngle(p.start_pos + t, i, p.head_dim, p.theta);
        const float c = std::cos(a), s = std::sin(a);
        const float lo = x[i], hi = x[i + half];
        x[i] = lo * c - hi * s;
        x[i + half] = hi * c + lo * s;
      }
    }
  }
}

}  // namespace oryx::kernels::cpu
