// Projections y = x · W^T (weight [out, in], the checkpoint layout) for decode (M = 1) and prefill (M > 1).
// Single-threaded: Eigen's GEMM/GEMV on the caller's thread; the engine parallelises over sequences.
#include <Eigen/Core>
#include <algorithm>
#include <cassert>

#include "kernels/cpu/eigen_maps.h"
#include "kernels/ops.h"

namespace oryx::kernels::cpu {

// Up to this many rows (decode steps of a small batch, speculative verify spans) the product reads each
// weight block once for all rows with dot products instead of Eigen's GEMM, which packs (copies) the weight
// matrix first. GEMM wins from about 8 rows (docs/RESULTS.md, the CPU decode measurements).
constexpr int64_t kSmallM = 6;

void MatMul(const MatMulParams& p) {
  assert(p.x_row_stride >= p.k && p.w_row_stride >= p.k && p.y_row_stride >= p.n);
  ConstMatrixMap x(p.x_ptr, p.m, p.k, Eigen::OuterStride<>(p.x_row_stride));
  ConstMatrixMap w(p.w_ptr, p.n, p.k, Eigen::OuterStride<>(p.w_row_stride));
  MatrixMap y(p.y_ptr, p.m, p.n, Eigen::OuterStride<>(p.y_row_stride));
  if (p.m == 1 || p.m > kSmallM) {
    y.noalias() = x * w.transpose();  // GEMV for one row, GEMM for many
    return;
  }
  constexpr int64_t kBlock = 32;  // weight rows per block: stays in L1/L2 while every x row uses it
  for (int64_t n0 = 0; n0 < p.n; n0 += kBlock) {
    const int64_t nb = std::min(kBlock, p.n - n0);
    for (int64_t r = 0; r < p.m; ++r) {
      y.row(r).segment(n0, nb).noalias() = (w.middleRows(n0, nb) * x.row(r).transpose()).transpose();
    }
  }
}

void MatMulReference(const MatMulParams& p) {
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t o = 0; o < p.n; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < p.k; ++i) {
        acc += double{p.x_ptr[r * p.x_row_stride + i]} * double{p.w_ptr[o * p.w_row_stride + i]};
      }
      p.y_ptr[r * p.y_row_stride + o] = static_cast<float>(acc);
    }
  }
}

}  // namespace oryx::kernels::cpu
