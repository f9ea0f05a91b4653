// The SwiGLU MLP gate y = SiLU(gate) * up, elementwise; the three projections around it are MatMul.
// Single-threaded; rows would be the axis to split.
#include <Eigen/Core>
#include <cmath>

#include "kernels/ops.h"

namespace oryx::kernels::cpu {

void SwiGlu(const SwiGluParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const Eigen::Map<const Eigen::ArrayXf> gate(p.gate_ptr + r * p.gate_row_stride, p.d);
    const Eigen::Map<const Eigen::ArrayXf> up(p.up_ptr + r * p.up_row_stride, p.d);
    Eigen::Map<Eigen::ArrayXf>(p.y_ptr + r * p.y_row_stride, p.d) = gate / (1.0f + (-gate).exp()) * up;
  }
}

void SwiGluReference(const SwiGluParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t i = 0; i < p.d; ++i) {
      const double g = p.gate_ptr[r * p.gate_row_stride + i];
      const double silu = g / (1.0 + std::exp(-g));
      p.y_ptr[r * p.y_row_stride + i] = static_cast<float>(silu * p.up_ptr[r * p.up_row_stride + i]);
    }
  }
}

}  // namespace oryx::kernels::cpu
