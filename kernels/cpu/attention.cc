// Softmax attention of Tq queries over a Tk-long KV cache, causal inside the span (queries are the last Tq
// positions). Per head: scores = Q K^T (one GEMM for the span), masked, stable softmax, P V. Single-threaded;
// heads are independent and would be the axis to split.
#include <Eigen/Core>
#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

#include "kernels/cpu/eigen_maps.h"
#include "kernels/ops.h"

namespace oryx::kernels::cpu {

void Attention(const AttentionParams& p) {
  assert(p.q_tokens <= p.kv_tokens);
  const int64_t tq = p.q_tokens, tk = p.kv_tokens, dh = p.head_dim, offset = tk - tq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  MatrixMap scores(p.scratch_ptr, tq, tk, Eigen::OuterStride<>(tk));
  for (int64_t h = 0; h < p.heads; ++h) {
    ConstMatrixMap q(p.q_ptr + h * dh, tq, dh, Eigen::OuterStride<>(p.q_token_stride));
    ConstMatrixMap k(p.k_ptr + h * dh, tk, dh, Eigen::OuterStride<>(p.kv_token_stride));
    ConstMatrixMap v(p.v_ptr + h * dh, tk, dh, Eigen::OuterStride<>(p.kv_token_stride));
    scores.noalias() = (q * k.transpose()) * scale;
    for (int64_t i = 0; i < tq; ++i) {
      const int64_t visible = offset + i + 1;  // keys 0 .. offset + i
      auto row = scores.row(i).head(visible).array();
      row = (row - row.maxCoeff()).exp();
      row /= row.sum();
      scores.row(i).tail(tk - visible).setZero();
    }
    MatrixMap(p.out_ptr + h * dh, tq, dh, Eigen::OuterStride<>(p.out_token_stride)).noalias() = scores * v;
  }
}

void AttentionReference(const AttentionParams& p) {
  const int64_t tq = p.q_tokens, tk = p.kv_tokens, dh = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dh));
  std::vector<double> weights(tk);
  for (int64_t i = 0; i < tq; ++i) {
    const int64_t last_key = tk - tq + i;
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* q = p.q_ptr + i * p.q_token_stride + h * dh;
      double max_score = -INFINITY;
      for (int64_t s = 0; s <= last_key; ++s) {
        const float* k = p.k_ptr + s * p.kv_token_stride + h * dh;
        double dot = 0.0;
        for (int64_t d = 0; d < dh; ++d) dot += double{q[d]} * k[d];
        weights[s] = dot * scale;
        max_score = std::max(max_score, weights[s]);
      }
      double total = 0.0;
      for (int64_t s = 0; s <= last_key; ++s) total += weights[s] = std::exp(weights[s] - max_score);
      for (int64_t d = 0; d < dh; ++d) {
        double acc = 0.0;
        for (int64_t s = 0; s <= last_key; ++s) acc += weights[s] * p.v_ptr[s * p.kv_token_stride + h * dh + d];
        p.out_ptr[i * p.out_token_stride + h * dh + d] = static_cast<float>(acc / total);
      }
    }
  }
}

}  // namespace oryx::kernels::cpu
