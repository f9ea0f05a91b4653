// Choosing the next token from logits: greedy, or temperature + top-k + top-p, seeded and reproducible.
//
// The sampling distribution of a row of logits is: candidates ordered by (logit descending, index
// ascending), the first top_k kept (top_k = 0: all), softmax of logit / temperature over them, then the
// shortest prefix whose mass reaches top_p (always at least one token), renormalised. temperature = 0 is
// greedy: all mass on the first candidate. Speculative decoding needs this distribution explicitly
// (Distribution); plain decoding draws from it directly (Next), both from one seeded stream.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "base/rng.h"

namespace oryx {

struct SamplingParams {
  float temperature = 0.f;  // >= 0; 0 is greedy
  int64_t top_k = 0;        // >= 0; 0 keeps every token
  float top_p = 1.f;        // in (0, 1]
  uint64_t seed = 0;
  // OpenAI's penalties, each in [-2, 2], on the tokens this sampler has recorded (the generated ones, as
  // serving engines count them): logit - presence_penalty * [count > 0] - frequency_penalty * count.
  float presence_penalty = 0.f, frequency_penalty = 0.f;
  std::vector<std::pair<int32_t, float>> logit_bias = {};  // (token, added to its logit, in [-100, 100])
  bool greedy() const { return temperature == 0.f; }
  // Whether the logits are changed before sampling (penalties, biases): what a token's distribution is then
  // depends on the sampler's history, so no two samplers share one, and device draws do not apply.
  bool adjusts_logits() const { return presence_penalty != 0.f || frequency_penalty != 0.f || !logit_bias.empty(); }
  // The same distribution from the same logits (the seed aside).
  bool SameDistributionAs(const SamplingParams& o) const {
    return temperature == o.temperature && top_k == o.top_k && top_p == o.top_p && !adjusts_logits() &&
           !o.adjusts_logits();
  }
};

// InvalidArgument naming the field for a negative or non-finite temperature, a negative top_k, top_p
// outside (0, 1], a penalty outside [-2, 2], or a logit bias outside [-100, 100] or on a negative token.
absl::Status ValidateSampling(const SamplingParams& params);

// What a router reads of a step's distribution (ForwardItem::stats_out): of the raw logits, before penalties,
// temperature and truncation, the entropy of their softmax in nats and the top-1 minus top-2 logit.
struct LogitStats {
  double entropy = -1, margin = -1;
};
// Of logits [V] in one pass of float exponentials (kernels::cpu::DistributionStats); a vocabulary of one
// entry is certain: 0 and 0.
LogitStats LogitStatsOf(std::span<const float> logits);

// One sequence's sampler: its parameters and its own random stream. Not thread-safe.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  const SamplingParams& params() const { return params_; }

  // Draws the next token from logits [V] (greedy: the argmax, no randomness used), after the penalties and
  // biases of its parameters.
  int32_t Next(std::span<const float> logits);
  // A token the sequence emitted: what the penalties count.
  void Record(int32_t token);

  // The sampling distribution of logits [V] into probs [V] (zeros outside the kept candidates).
  void Distribution(std::span<const float> logits, std::vector<float>* probs);
  // Draws from probs [V] (non-negative, any positive total) by inverse CDF in index order.
  int32_t Draw(std::span<const float> probs);
  // A uniform number in [0, 1) from this sampler's stream.
  double Uniform() { return rng_.UniformDouble(); }
  // The next out.size() uniforms of the stream, which stays where it is (a backend that draws a round's
  // uniforms up front, then Skips the ones the round used).
  void PeekUniforms(std::span<double> out) const {
    Rng ahead = rng_;
    for (double& u : out) u = ahead.UniformDouble();
  }
  void SkipUniforms(int64_t n) {
    for (int64_t i = 0; i < n; ++i) (void)rng_.UniformDouble();
  }

 private:
  // The logits with the penalties and biases applied (adjusted_), or the logits themselves when there are none.
  std::span<const float> Adjusted(std::span<const float> logits);
  SamplingParams params_;
  Rng rng_;
  std::vector<int32_t> counts_;  // per token, of the recorded ones (only when params_.adjusts_logits())
  std::vector<float> adjusted_;
  std::vector<int32_t> order_;  // reused between calls
  std::vector<float> probs_;
};

}  // namespace oryx
