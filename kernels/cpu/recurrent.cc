// The mamba2 and gdn recurrences over a span, token by token (T = 1 is the decode step; a chunked prefill is a
// later optimisation), optionally saving the state after every token for speculative rollback.
// Single-threaded; heads are independent and would be the axis to split.
#include <Eigen/Core>
#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

#include "kernels/ops.h"

namespace oryx::kernels::cpu {

namespace {
using RowMajorMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using StateMap = Eigen::Map<RowMajorMatrix>;  // [dh, dh], S(i, j) = S[i][j]
using ConstVec = Eigen::Map<const Eigen::VectorXf>;
using Vec = Eigen::Map<Eigen::VectorXf>;
using HeadVec = Eigen::Matrix<float, Eigen::Dynamic, 1, 0, kMaxHeadDim, 1>;  // on the stack

constexpr double kL2NormEps = 1e-6;

// After token t, copy the whole [H, dh, dh] state to the per-position buffer when the caller asked for it.
void MaybeSaveState(const float* state, int64_t t, int64_t state_size, float* maybe_states_out) {
  if (maybe_states_out != nullptr) std::copy_n(state, state_size, maybe_states_out + t * state_size);
}
}  // namespace

void Mamba2(const Mamba2Params& p) {
  const int64_t dh = p.head_dim, state_size = p.heads * dh * dh;
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t in = t * p.qkv_token_stride + h * dh;
      const float dt = p.dt_ptr[t * p.heads + h], a = std::exp(p.log_a_ptr[t * p.heads + h]);
      ConstVec q(p.q_ptr + in, dh), k(p.k_ptr + in, dh), v(p.v_ptr + in, dh);
      StateMap s(p.state_ptr + h * dh * dh, dh, dh);
      s *= a;
      s.noalias() += (dt * k) * v.transpose();
      Vec(p.out_ptr + t * p.out_token_stride + h * dh, dh).noalias() = s.transpose() * q + p.d_skip_ptr[h] * v;
    }
    MaybeSaveState(p.state_ptr, t, state_size, p.maybe_states_out_ptr);
  }
}

void Mamba2Reference(const Mamba2Params& p) {
  const int64_t dh = p.head_dim, state_size = p.heads * dh * dh;
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* q = p.q_ptr + t * p.qkv_token_stride + h * dh;
      const float* k = p.k_ptr + t * p.qkv_token_stride + h * dh;
      const float* v = p.v_ptr + t * p.qkv_token_stride + h * dh;
      const double dt = p.dt_ptr[t * p.heads + h], a = std::exp(double{p.log_a_ptr[t * p.heads + h]});
      float* s = p.state_ptr + h * dh * dh;
      for (int64_t i = 0; i < dh; ++i) {
        for (int64_t j = 0; j < dh; ++j) s[i * dh + j] = static_cast<float>(a * s[i * dh + j] + dt * k[i] * v[j]);
      }
      for (int64_t j = 0; j < dh; ++j) {
        double read = 0.0;
        for (int64_t i = 0; i < dh; ++i) read += double{s[i * dh + j]} * q[i];
        p.out_ptr[t * p.out_token_stride + h * dh + j] = static_cast<float>(read + double{p.d_skip_ptr[h]} * v[j]);
      }
    }
    MaybeSaveState(p.state_ptr, t, state_size, p.maybe_states_out_ptr);
  }
}

// S = alpha (S - beta kn (kn^T S)) + beta kn v^T is computed as the single rank-1 update
// S = alpha S + kn (beta (v - alpha S^T kn))^T.
void Gdn(const GdnParams& p) {
  const int64_t dh = p.head_dim, state_size = p.heads * dh * dh;
  const float inv_sqrt_dh = 1.0f / std::sqrt(static_cast<float>(dh));
  assert(dh <= kMaxHeadDim);
  HeadVec kn(dh), qn(dh), delta(dh);
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t in = t * p.qkv_token_stride + h * dh;
      const float beta = p.beta_ptr[t * p.heads + h], alpha = std::exp(p.log_alpha_ptr[t * p.heads + h]);
      ConstVec q(p.q_ptr + in, dh), k(p.k_ptr + in, dh), v(p.v_ptr + in, dh);
      kn = k / std::sqrt(k.squaredNorm() + static_cast<float>(kL2NormEps));
      qn = q * (inv_sqrt_dh / std::sqrt(q.squaredNorm() + static_cast<float>(kL2NormEps)));
      StateMap s(p.state_ptr + h * dh * dh, dh, dh);
      delta.noalias() = s.transpose() * kn;
      delta = beta * (v - alpha * delta);
      s *= alpha;
      s.noalias() += kn * delta.transpose();
      Vec(p.out_ptr + t * p.out_token_stride + h * dh, dh).noalias() = s.transpose() * qn;
    }
    MaybeSaveState(p.state_ptr, t, state_size, p.maybe_states_out_ptr);
  }
}

// The formula as written: u = kn^T S, then S = alpha (S - beta kn u) + beta kn v^T.
void GdnReference(const GdnParams& p) {
  const int64_t dh = p.head_dim, state_size = p.heads * dh * dh;
  std::vector<double> kn(dh), qn(dh), u(dh);
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* q = p.q_ptr + t * p.qkv_token_stride + h * dh;
      const float* k = p.k_ptr + t * p.qkv_token_stride + h * dh;
      const float* v = p.v_ptr + t * p.qkv_token_stride + h * dh;
      const double beta = p.beta_ptr[t * p.heads + h], alpha = std::exp(double{p.log_alpha_ptr[t * p.heads + h]});
      double k_sq = 0.0, q_sq = 0.0;
      for (int64_t i = 0; i < dh; ++i) k_sq += double{k[i]} * k[i], q_sq += double{q[i]} * q[i];
      for (int64_t i = 0; i < dh; ++i) {
        kn[i] = k[i] / std::sqrt(k_sq + kL2NormEps);
        qn[i] = q[i] / std::sqrt(q_sq + kL2NormEps) / std::sqrt(static_cast<double>(dh));
      }
      float* s = p.state_ptr + h * dh * dh;
      for (int64_t j = 0; j < dh; ++j) {
        u[j] = 0.0;
        for (int64_t i = 0; i < dh; ++i) u[j] += kn[i] * s[i * dh + j];
      }
      for (int64_t i = 0; i < dh; ++i) {
        for (int64_t j = 0; j < dh; ++j) {
          s[i * dh + j] = static_cast<float>(alpha * (s[i * dh + j] - beta * kn[i] * u[j]) + beta * kn[i] * v[j]);
        }
      }
      for (int64_t j = 0; j < dh; ++j) {
        double read = 0.0;
        for (int64_t i = 0; i < dh; ++i) read += double{s[i * dh + j]} * qn[i];
        p.out_ptr[t * p.out_token_stride + h * dh + j] = static_cast<float>(read);
      }
    }
    MaybeSaveState(p.state_ptr, t, state_size, p.maybe_states_out_ptr);
  }
}

}  // namespace oryx::kernels::cpu
