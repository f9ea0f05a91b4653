// The mamba2 and gdn recurrences over a span. Token by token for decode steps, short spans and spans that
// save the state after every token (speculative rollback); in chunks of matrix products for long spans
// (prefill): Mamba-2's SSD form, and for gdn the WY/UT form of the chunked delta rule (the same algebra
// as train/linear_mixers.cc). Single-threaded; the engine splits heads over threads.
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

// Spans at least this long, saving no per-token states, run in chunks of kChunk tokens.
constexpr int64_t kChunkMinTokens = 16;
constexpr int64_t kChunk = 64;

// One head's span in chunks. Per chunk of c tokens, with G_t the cumulative log decay inside the chunk,
// gamma_t = exp(G_t), S0 the state at the chunk's start and u the values entering the state:
//   mamba2: u = diag(dt) V
//   gdn:    (I + diag(beta) A) [U0 W] = [diag(beta) V, diag(beta gamma) Kn], A[t,s] = e^{G_t-G_s} kn_t.kn_s (s < t),
//           u = U0 - W S0
//   out_t = gamma_t S0^T q_t + sum_{s<=t} e^{G_t-G_s} (q_t.k_s) u_s     (+ d_skip v_t for mamba2)
//   S    <- gamma_last S0 + sum_s e^{G_last-G_s} k_s u_s^T
// q and k are the raw inputs for mamba2 and the normalised ones for gdn.
struct ChunkHead {
  int64_t tokens, dh, qkv_stride, out_stride, gate_stride;  // gate_stride: step between tokens in the gates
  const float *q, *k, *v, *scale, *log_decay;
  const float* d_skip;  // mamba2's skip of this head; null for gdn
  float* state;         // [dh, dh]
  float* out;
  bool gdn() const { return d_skip == nullptr; }
};

void RunChunked(const ChunkHead& h) {
  using Mat = RowMajorMatrix;
  const int64_t dh = h.dh;
  const float inv_sqrt_dh = 1.0f / std::sqrt(static_cast<float>(dh));
  StateMap s(h.state, dh, dh);
  Mat q(kChunk, dh), k(kChunk, dh), v(kChunk, dh), u, qk, a, rhs, x, o, next;
  Eigen::VectorXf g(kChunk), sc(kChunk), to_end;
  for (int64_t t0 = 0; t0 < h.tokens; t0 += kChunk) {
    const int64_t c = std::min(kChunk, h.tokens - t0);
    for (int64_t t = 0; t < c; ++t) {
      const int64_t in = (t0 + t) * h.qkv_stride;
      q.row(t) = ConstVec(h.q + in, dh).transpose();
      k.row(t) = ConstVec(h.k + in, dh).transpose();
      v.row(t) = ConstVec(h.v + in, dh).transpose();
      if (h.gdn()) {
        k.row(t) /= std::sqrt(k.row(t).squaredNorm() + static_cast<float>(kL2NormEps));
        q.row(t) *= inv_sqrt_dh / std::sqrt(q.row(t).squaredNorm() + static_cast<float>(kL2NormEps));
      }
      g[t] = (t == 0 ? 0.f : g[t - 1]) + h.log_decay[(t0 + t) * h.gate_stride];
      sc[t] = h.scale[(t0 + t) * h.gate_stride];
    }
    const auto Q = q.topRows(c), K = k.topRows(c), V = v.topRows(c);
    const auto G = g.head(c);
    // qk[t, s] = e^{G_t - G_s} q_t.k_s for s <= t, 0 above the diagonal.
    qk.noalias() = Q * K.transpose();
    for (int64_t t = 0; t < c; ++t) {
      for (int64_t j = 0; j < c; ++j) qk(t, j) = j <= t ? qk(t, j) * std::exp(G[t] - G[j]) : 0.f;
    }
    if (!h.gdn()) {
      u = sc.head(c).asDiagonal() * V;
    } else {
      a.noalias() = K * K.transpose();
      for (int64_t t = 0; t < c; ++t) {
        for (int64_t j = 0; j < c; ++j) {
          a(t, j) = j < t ? sc[t] * a(t, j) * std::exp(G[t] - G[j]) : (j == t ? 1.f : 0.f);
        }
      }
      rhs.resize(c, 2 * dh);
      for (int64_t t = 0; t < c; ++t) {
        rhs.row(t).head(dh) = sc[t] * V.row(t);
        rhs.row(t).tail(dh) = (sc[t] * std::exp(G[t])) * K.row(t);
      }
      x = a.triangularView<Eigen::UnitLower>().solve(rhs);
      u = x.leftCols(dh);
      u.noalias() -= x.rightCols(dh) * s;
    }
    // Outputs, then the state for the next chunk.
    o.noalias() = (G.array().exp().matrix().asDiagonal() * Q) * s;
    o.noalias() += qk * u;
    if (!h.gdn()) o += *h.d_skip * V;
    for (int64_t t = 0; t < c; ++t) Vec(h.out + (t0 + t) * h.out_stride, dh) = o.row(t).transpose();
    const float last = G[c - 1];
    to_end = (last - G.array()).exp().matrix();
    next = std::exp(last) * s;
    next.noalias() += (to_end.asDiagonal() * K).transpose() * u;
    s = next;
  }
}

// Every head of a span in chunks: the head's q, k, v, out and state, its gates at column h of [T, H], its skip.
void RunChunkedHeads(int64_t heads, int64_t dh, ChunkHead head) {
  for (int64_t h = 0; h < heads; ++h) {
    ChunkHead one = head;
    one.q += h * dh, one.k += h * dh, one.v += h * dh, one.out += h * dh;
    one.scale += h, one.log_decay += h;
    one.state += h * dh * dh;
    if (one.d_skip != nullptr) one.d_skip += h;
    RunChunked(one);
  }
}
}  // namespace

void Mamba2(const Mamba2Params& p) {
  const int64_t dh = p.head_dim, state_size = p.heads * dh * dh;
  if (p.tokens >= kChunkMinTokens && p.maybe_states_out_ptr == nullptr) {
    RunChunkedHeads(p.heads, dh, {p.tokens, dh, p.qkv_token_stride, p.out_token_stride, p.heads, p.q_ptr, p.k_ptr,
                                  p.v_ptr, p.dt_ptr, p.log_a_ptr, p.d_skip_ptr, p.state_ptr, p.out_ptr});
    return;
  }
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
  if (p.tokens >= kChunkMinTokens && p.maybe_states_out_ptr == nullptr) {
    RunChunkedHeads(p.heads, dh, {p.tokens, dh, p.qkv_token_stride, p.out_token_stride, p.heads, p.q_ptr, p.k_ptr,
                                  p.v_ptr, p.beta_ptr, p.log_alpha_ptr, nullptr, p.state_ptr, p.out_ptr});
    return;
  }
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
