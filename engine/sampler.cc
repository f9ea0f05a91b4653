#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/str_cat.h"
#include "kernels/ops.h"

namespace oryx {

LogitStats LogitStatsOf(std::span<const float> logits) {
  LogitStats stats{0, 0};
  if (logits.size() >= 2) {
    kernels::cpu::DistributionStats(logits.data(), static_cast<int64_t>(logits.size()), &stats.entropy, &stats.margin);
  }
  return stats;
}

absl::Status ValidateSampling(const SamplingParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.f) {
    return absl::InvalidArgumentError(Cat("temperature must be a finite number >= 0, got ", p.temperature));
  }
  if (p.top_k < 0) return absl::InvalidArgumentError(Cat("top_k must be >= 0, got ", p.top_k));
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) {
    return absl::InvalidArgumentError(Cat("top_p must be in (0, 1], got ", p.top_p));
  }
  for (const auto& [name, value] : {std::pair{"presence_penalty", p.presence_penalty},
                                    std::pair{"frequency_penalty", p.frequency_penalty}}) {
    if (!(value >= -2.f && value <= 2.f)) return absl::InvalidArgumentError(Cat(name, " must be in [-2, 2], got ", value));
  }
  for (const auto& [token, bias] : p.logit_bias) {
    if (token < 0) return absl::InvalidArgumentError(Cat("logit_bias: token ", token, " is not a token id"));
    if (!(bias >= -100.f && bias <= 100.f)) {
      return absl::InvalidArgumentError(Cat("logit_bias of token ", token, " must be in [-100, 100], got ", bias));
    }
  }
  return absl::OkStatus();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

void Sampler::Record(int32_t token) {
  if (!params_.adjusts_logits() || token < 0) return;
  if (static_cast<size_t>(token) >= counts_.size()) counts_.resize(token + 1, 0);
  ++counts_[token];
}

std::span<const float> Sampler::Adjusted(std::span<const float> logits) {
  if (!params_.adjusts_logits()) return logits;
  adjusted_.assign(logits.begin(), logits.end());
  const size_t V = adjusted_.size();
  for (size_t t = 0; t < counts_.size() && t < V; ++t) {
    if (counts_[t] > 0) adjusted_[t] -= params_.presence_penalty + params_.frequency_penalty * counts_[t];
  }
  for (const auto& [token, bias] : params_.logit_bias) {
    if (static_cast<size_t>(token) < V) adjusted_[token] += bias;
  }
  return adjusted_;
}

int32_t Sampler::Next(std::span<const float> raw) {
  if (params_.greedy()) {
    const std::span<const float> logits = Adjusted(raw);
    int64_t token = 0;
    kernels::cpu::SampleGreedy({static_cast<int64_t>(logits.size()), logits.data(), &token});
    return static_cast<int32_t>(token);
  }
  Distribution(raw, &probs_);  // adjusts them
  return Draw(probs_);
}

void Sampler::Distribution(std::span<const float> raw, std::vector<float>* probs) {
  const std::span<const float> logits = Adjusted(raw);
  const int64_t V = static_cast<int64_t>(logits.size());
  probs->assign(V, 0.f);
  order_.resize(V);
  std::iota(order_.begin(), order_.end(), 0);
  auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  if (params_.greedy()) {
    (*probs)[*std::min_element(order_.begin(), order_.end(), better)] = 1.f;
    return;
  }
  const int64_t k = params_.top_k > 0 ? std::min<int64_t>(params_.top_k, V) : V;
  if (k == V && params_.top_p >= 1.f) {
    // Every token is kept, so no order is needed (sorting V logits took most of a sampled speculative
    // round run by the decoder): the softmax in index order.
    const float top = *std::max_element(logits.begin(), logits.end());
    double total = 0.0;
    for (int64_t i = 0; i < V; ++i) total += (*probs)[i] = std::exp((logits[i] - top) / params_.temperature);
    for (int64_t i = 0; i < V; ++i) (*probs)[i] = static_cast<float>((*probs)[i] / total);
    return;
  }
  std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), better);
  const float top = logits[order_[0]];
  double total = 0.0;
  for (int64_t r = 0; r < k; ++r) total += (*probs)[order_[r]] = std::exp((logits[order_[r]] - top) / params_.temperature);
  int64_t kept = k;
  double mass = total;
  if (params_.top_p < 1.f) {
    mass = 0.0;
    for (kept = 0; kept < k;) {
      mass += (*probs)[order_[kept++]];
      if (mass >= params_.top_p * total) break;
    }
    for (int64_t r = kept; r < k; ++r) (*probs)[order_[r]] = 0.f;
  }
  for (int64_t r = 0; r < kept; ++r) (*probs)[order_[r]] = static_cast<float>((*probs)[order_[r]] / mass);
}

int32_t Sampler::Draw(std::span<const float> probs) {
  double total = 0.0;
  for (float p : probs) total += p;
  const double threshold = rng_.UniformDouble() * total;
  double mass = 0.0;
  int32_t last_positive = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.f) continue;
    mass += probs[i];
    last_positive = static_cast<int32_t>(i);
    if (threshold < mass) return last_positive;
  }
  return last_positive;  // rounding at uniform ~ 1
}

}  // namespace oryx
