// Softmax attention of Tq queries over a Tk-long KV cache, causal inside the span (queries are the last Tq
// positions). Per head: scores = Q K^T (a GEMM per block of a paged cache, or one for a contiguous one),
// masked, stable softmax, P V (summed over the blocks). Single-threaded; heads are independent and would be
// the axis to split.
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
  // The keys in pieces of contiguous rows: the whole cache, or its blocks.
  const int64_t piece = p.kv_block_tokens > 0 ? p.kv_block_tokens : tk;
  auto keys = [&](int64_t j, int64_t h) {
    return p.kv_block_tokens > 0 ? p.k_blocks[j] + p.kv_col + h * dh : p.k_ptr + h * dh;
  };
  auto values = [&](int64_t j, int64_t h) {
    return p.kv_block_tokens > 0 ? p.v_blocks[j] + p.kv_col + h * dh : p.v_ptr + h * dh;
  };
  MatrixMap scores(p.scratch_ptr, tq, tk, Eigen::OuterStride<>(tk));
  for (int64_t h = 0; h < p.heads; ++h) {
    ConstMatrixMap q(p.q_ptr + h * dh, tq, dh, Eigen::OuterStride<>(p.q_token_stride));
    for (int64_t j = 0, start = 0; start < tk; ++j, start += piece) {
      const int64_t rows = std::min(piece, tk - start);
      ConstMatrixMap k(keys(j, h), rows, dh, Eigen::OuterStride<>(p.kv_token_stride));
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
      ConstMatrixMap v(values(j, h), rows, dh, Eigen::OuterStride<>(p.kv_token_stride));
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
  // Row s of the keys or values (at the head's column 0).
  auto key = [&](int64_t s) {
    return b > 0 ? p.k_blocks[s / b] + p.kv_col + (s % b) * p.kv_token_stride : p.k_ptr + s * p.kv_token_stride;
  };
  auto value = [&](int64_t s) {
    return b > 0 ? p.v_blocks[s / b] + p.kv_col + (s % b) * p.kv_token_stride : p.v_ptr + s * p.kv_token_stride;
  };
  const double scale = 1.0 / std::sqrt(static_cast<double>(dh));
  std::vector<double> weights(tk);
  for (int64_t i = 0; i < tq; ++i) {
    const int64_t last_key = tk - tq + i;
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* q = p.q_ptr + i * p.q_token_stride + h * dh;
      double max_score = -INFINITY;
      for (int64_t s = 0; s <= last_key; ++s) {
        const float* k = key(s) + h * dh;
        double dot = 0.0;
        for (int64_t d = 0; d < dh; ++d) dot += double{q[d]} * k[d];
        weights[s] = dot * scale;
        max_score = std::max(max_score, weights[s]);
      }
      double total = 0.0;
      for (int64_t s = 0; s <= last_key; ++s) total += weights[s] = std::exp(weights[s] - max_score);
      for (int64_t d = 0; d < dh; ++d) {
        double acc = 0.0;
        for (int64_t s = 0; s <= last_key; ++s) acc += weights[s] * value(s)[h * dh + d];
        p.out_ptr[i * p.out_token_stride + h * dh + d] = static_cast<float>(acc / total);
      }
    }
  }
}

}  // namespace oryx::kernels::cpu
