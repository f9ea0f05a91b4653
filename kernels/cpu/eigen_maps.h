// Row-major Eigen views over raw kernel buffers with an explicit row stride (internal to kernels/cpu).
#pragma once

#include <Eigen/Core>

namespace oryx::kernels::cpu {

using RowMajorMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrixMap = Eigen::Map<const RowMajorMatrix, 0, Eigen::OuterStride<>>;
using MatrixMap = Eigen::Map<RowMajorMatrix, 0, Eigen::OuterStride<>>;

}  // namespace oryx::kernels::cpu
