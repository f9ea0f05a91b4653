// RMSNorm over rows, and the layer's gated per-head RMSNorm (norm each head, scale, multiply by SiLU(gate)).
// Single-threaded; rows (tokens) are independent and would be the axis to split.
#include <Eigen/Core>
#include <cmath>

#include "kernels/ops.h"

namespace oryx::kernels::cpu {

namespace {
using ConstRow = Eigen::Map<const Eigen::ArrayXf>;
using Row = Eigen::Map<Eigen::ArrayXf>;

float InvRms(const ConstRow& x, float eps) {
  return 1.0f / std::sqrt(x.square().mean() + eps);
}
}  // namespace

void RmsNorm(const RmsNormParams& p) {
  ConstRow weight(p.weight_ptr, p.d);
  for (int64_t r = 0; r < p.rows; ++r) {
    ConstRow x(p.x_ptr + r * p.x_row_stride, p.d);
    const float inv_rms = InvRms(x, p.eps);
    Row(p.y_ptr + r * p.y_row_stride, p.d) = x * inv_rms * weight;
  }
}

void RmsNormReference(const RmsNormParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.x_ptr + r * p.x_row_stride;
    double sum_sq = 0.0;
    for (int64_t i = 0; i < p.d; ++i) sum_sq += double{x[i]} * x[i];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / p.d + p.eps);
    for (int64_t i = 0; i < p.d; ++i) {
      p.y_ptr[r * p.y_row_stride + i] = static_cast<float>(x[i] * inv_rms * p.weight_ptr[i]);
    }
  }
}

void GatedRmsNorm(const GatedRmsNormParams& p) {
  const int64_t dh = p.head_dim;
  ConstRow weight(p.weight_ptr, dh);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t h = 0; h < p.heads; ++h) {
      ConstRow o(p.o_ptr + r * p.o_row_stride + h * dh, dh);
      ConstRow g(p.gate_ptr + r * p.gate_row_stride + h * dh, dh);
      const float inv_rms = InvRms(o, p.eps);
      Row(p.y_ptr + r * p.y_row_stride + h * dh, dh) = (o * inv_rms * weight) * (g / (1.0f + (-g).exp()));
    }
  }
}

void GatedRmsNormReference(const GatedRmsNormParams& p) {
  const int64_t dh = p.head_dim;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* o = p.o_ptr + r * p.o_row_stride + h * dh;
      const float* g = p.gate_ptr + r * p.gate_row_stride + h * dh;
      double sum_sq = 0.0;
      for (int64_t i = 0; i < dh; ++i) sum_sq += double{o[i]} * o[i];
      const double inv_rms = 1.0 / std::sqrt(sum_sq / dh + p.eps);
      for (int64_t i = 0; i < dh; ++i) {
        const double silu_g = g[i] / (1.0 + std::exp(-double{g[i]}));
        p.y_ptr[r * p.y_row_stride + h * dh + i] = static_cast<float>(o[i] * inv_rms * p.weight_ptr[i] * silu_g);
      }
    }
  }
}

}  // namespace oryx::kernels::cpu
