#include "router/cost_model.h"

#include <Eigen/Dense>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include "base/status_macros.h"
#include "base/str_cat.h"

namespace oryx::router {

namespace {
constexpr int kTerms = 13;
constexpr const char* kTermNames[kTerms] = {"fixed_s",           "s_per_gemv_flop",         "small_product_s",
                                            "gemm_packing_s",    "s_per_gemm_flop",         "s_per_sequence",
                                            "s_per_kv_byte",     "s_per_attention_flop",    "s_per_recurrent_flop",
                                            "long_span_fixed_s", "s_per_long_span_kv_byte", "s_per_short_span_row",
                                            "multi_token_span_s"};
constexpr int64_t kSmallProductRows = 6;  // the CPU backend's MatMul: GEMV, small-product path, GEMM
constexpr int kMaxGraphWarmups = 4;       // runs of a shape beyond `repeats` that may stand in for warm-ups

std::array<double, kTerms> Features(const ModelConfig& c, const SpanShape& s) {
  const SpanWork w = WorkOf(c, s);
  const int64_t m = s.batch * s.tokens;
  const bool long_span = s.tokens > kLongSpanTokens;
  return {1.0,
          m == 1 ? w.dense_flops : 0.0,
          m >= 2 && m <= kSmallProductRows ? 1.0 : 0.0,  // reads each weight once, whatever its rows
          m > kSmallProductRows ? 1.0 : 0.0,             // GEMM packs every weight matrix once per forward
          m > kSmallProductRows ? w.dense_flops : 0.0,
          static_cast<double>(s.batch),
          long_span ? 0.0 : w.kv_bytes,
          w.attention_flops,
          w.recurrent_flops,
          long_span ? 1.0 : 0.0,
          long_span ? w.kv_bytes : 0.0,
          long_span ? 0.0 : static_cast<double>(m),
          s.tokens > 1 && !long_span ? 1.0 : 0.0};
}
}  // namespace

SpanWork WorkOf(const ModelConfig& c, const SpanShape& s) {
  const double D = c.d_model, HD = c.qk_dim(), H = c.n_heads, dh = c.head_dim, F = c.mlp_hidden, L = c.n_layers;
  const double gates = c.linear_mixer == LinearMixer::kMamba2 ? H : 2 * H;
  const bool attention = s.mode == Mode::kAttention;
  const double tokens = static_cast<double>(s.batch * s.tokens);
  const double keys = static_cast<double>(s.context) + 0.5 * static_cast<double>(s.tokens + 1);  // mean visible
  // Per token and layer: k, v, q_linear, g, gates (+ q_attn in attention mode), o, the SwiGLU MLP.
  const double layer_params = (4 * HD + gates + (attention ? HD : 0)) * D + HD * D + 3 * F * D;
  SpanWork w;
  const double logit_rows = static_cast<double>(s.batch * (s.all_logits ? s.tokens : 1));
  w.dense_flops = 2 * (tokens * L * layer_params + logit_rows * static_cast<double>(c.vocab_size) * D);
  if (attention) {
    w.kv_bytes = static_cast<double>(s.batch) * L * (static_cast<double>(s.context + s.tokens)) * 2 * HD * 4;
    w.attention_flops = tokens * L * keys * 4 * HD;
  }
  w.recurrent_flops = tokens * L * H * dh * dh * 6;
  return w;
}

double SpanBytes(const ModelConfig& c, const SpanShape& s) {
  const double D = c.d_model, HD = c.qk_dim(), H = c.n_heads, dh = c.head_dim, F = c.mlp_hidden, L = c.n_layers;
  const double gates = c.linear_mixer == LinearMixer::kMamba2 ? H : 2 * H;
  // The matrices a token of this mode uses: k, v, g, gates, its query, o, the MLP; the LM head.
  const double matrices = L * ((4 * HD + gates) * D + HD * D + 3 * F * D) + static_cast<double>(c.vocab_size) * D;
  const double batch = static_cast<double>(s.batch), tokens = static_cast<double>(s.tokens);
  const double kv_read = s.mode == Mode::kAttention ? L * (static_cast<double>(s.context) + tokens) * 2 * HD * 2 : 0.0;
  const double kv_write = tokens * L * 2 * HD * 2;
  const double state = L * H * dh * dh * 4 * 2;
  return 2 * matrices + batch * (kv_read + kv_write + state);
}

std::vector<SpanShape> CalibrationShapes(const ModelConfig& c) {
  const int64_t max_ctx = c.max_position - 16;
  std::vector<SpanShape> shapes;
  for (Mode m : {Mode::kAttention, Mode::kLinear}) {
    for (int64_t ctx : {std::min<int64_t>(128, max_ctx / 8), max_ctx / 4, 3 * max_ctx / 4}) {
      for (int64_t b : {1, 4, 16}) {
        for (int64_t t : {1, 8}) shapes.push_back({b, t, ctx, m, /*all_logits=*/true});
      }
      // Prefill segments: where the attention FLOPs (tokens x keys) part from the KV bytes (keys), which
      // spans of 1 and 8 tokens, near the fixed cost of a forward, leave unresolved.
      for (int64_t t : {64, 256, 512, 1024}) {
        if (ctx + t <= c.max_position) shapes.push_back({1, t, ctx, m});
      }
    }
  }
  return shapes;
}

absl::StatusOr<CostModel> CostModel::Fit(const ModelConfig& config, std::span<const Measurement> ms) {
  if (ms.size() < 5) return absl::InvalidArgumentError(Cat("cost model: ", ms.size(), " measurements; need 5 or more"));
  const int64_t n = static_cast<int64_t>(ms.size());
  // Rows scaled by 1 / measured time (relative error); columns scaled to a maximum of 1 (conditioning).
  Eigen::MatrixXd x(n, kTerms);
  Eigen::VectorXd y = Eigen::VectorXd::Ones(n);
  for (int64_t i = 0; i < n; ++i) {
    if (!(ms[i].seconds > 0)) return absl::InvalidArgumentError("cost model: a measured time is not positive");
    const auto f = Features(config, ms[i].shape);
    for (int j = 0; j < kTerms; ++j) x(i, j) = f[j] / ms[i].seconds;
  }
  Eigen::VectorXd scale(kTerms);
  for (int j = 0; j < kTerms; ++j) {
    scale[j] = x.col(j).cwiseAbs().maxCoeff();
    if (scale[j] > 0) x.col(j) /= scale[j];
  }
  // Non-negative least squares by trying every set of active terms (2^13): small and exact.
  double best_err = INFINITY;
  Eigen::VectorXd best = Eigen::VectorXd::Zero(kTerms);
  for (int mask = 1; mask < (1 << kTerms); ++mask) {
    std::vector<int> cols;
    for (int j = 0; j < kTerms; ++j) {
      if ((mask >> j & 1) && scale[j] > 0) cols.push_back(j);
    }
    if (cols.empty()) continue;
    Eigen::MatrixXd a(n, cols.size());
    for (size_t j = 0; j < cols.size(); ++j) a.col(j) = x.col(cols[j]);
    const Eigen::VectorXd sol = a.colPivHouseholderQr().solve(y);
    if ((sol.array() < 0).any()) continue;
    const double err = (a * sol - y).squaredNorm();
    if (err < best_err) {
      best_err = err;
      best.setZero();
      for (size_t j = 0; j < cols.size(); ++j) best[cols[j]] = sol[j];
    }
  }
  CostModel m;
  m.config_ = config;
  m.coef_.resize(kTerms);
  for (int j = 0; j < kTerms; ++j) m.coef_[j] = scale[j] > 0 ? best[j] / scale[j] : 0.0;
  return m;
}

double CostModel::PredictSeconds(const SpanShape& shape) const {
  const auto f = Features(config_, shape);
  double t = 0;
  for (int j = 0; j < kTerms; ++j) t += coef_[j] * f[j];
  return t;
}

nlohmann::json CostModel::ToJson() const {
  nlohmann::json j;
  for (int i = 0; i < kTerms; ++i) j[kTermNames[i]] = coef_[i];
  return j;
}

absl::StatusOr<std::vector<Measurement>> MeasureSpans(Backend& backend, std::span<const SpanShape> shapes,
                                                      int repeats) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& c = backend.config();
  std::map<int64_t, SequenceState> prefilled;  // one sequence per context, shared by its shapes
  std::vector<Measurement> out;
  for (const SpanShape& s : shapes) {
    if (s.batch < 1 || s.tokens < 1 || s.context < 0 || s.context + s.tokens > c.max_position) {
      return absl::InvalidArgumentError(Cat("cost model: span of batch ", s.batch, ", ", s.tokens, " tokens after ",
                                            s.context, " does not fit the model (max_position ", c.max_position, ")"));
    }
    auto it = prefilled.find(s.context);
    if (it == prefilled.end()) {
      ORYX_ASSIGN_OR_RETURN(SequenceState seq, backend.TryNewSequence());
      std::vector<float> unused;
      for (int64_t done = 0; done < s.context; done += 512) {
        const int64_t len = std::min<int64_t>(512, s.context - done);
        std::vector<int32_t> ids(len);
        for (int64_t t = 0; t < len; ++t) ids[t] = static_cast<int32_t>(4 + (done + t) * 7919 % (c.vocab_size - 4));
        std::vector<Mode> modes(len, Mode::kLinear);
        ORYX_RETURN_IF_ERROR(backend.Forward(seq, ids, modes, false, &unused));
      }
      it = prefilled.emplace(s.context, std::move(seq)).first;
    }
    std::vector<int32_t> ids(s.tokens, 5);
    std::vector<Mode> modes(s.tokens, s.mode);
    std::vector<std::vector<float>> logits(s.batch);
    // r = 0 warms the buffers up; so do runs during which the backend recorded a graph (or ran the shape
    // eagerly before recording it), which are left out while a few more runs can replace them.
    std::vector<double> times, warmups;
    for (int r = 0; r <= repeats + kMaxGraphWarmups && static_cast<int>(times.size()) < repeats; ++r) {
      std::vector<SequenceState> seqs;
      std::vector<ForwardItem> items;
      for (int64_t b = 0; b < s.batch; ++b) {
        ORYX_ASSIGN_OR_RETURN(SequenceState copy, it->second.TryCopy());  // KV of its own, as served
        seqs.push_back(std::move(copy));
        ORYX_RETURN_IF_ERROR(seqs.back().Reserve(s.context + s.tokens));
      }
      for (int64_t b = 0; b < s.batch; ++b) {
        items.push_back({&seqs[b], ids, modes, s.all_logits ? LogitsRows::kAll : LogitsRows::kLast, &logits[b], false});
      }
      const int64_t graph_warmups = backend.graph_warmups();
      const auto t0 = Clock::now();
      ORYX_RETURN_IF_ERROR(backend.Forward(items));
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      (r > 0 && backend.graph_warmups() == graph_warmups ? times : warmups).push_back(seconds);
    }
    if (times.empty()) times = warmups;  // (a backend that never stops recording: its times as they are)
    std::sort(times.begin(), times.end());
    out.push_back({s, times[times.size() / 2]});
  }
  return out;
}

}  // namespace oryx::router
