#include "router/features.h"

#include <algorithm>
#include <cassert>
#include <cmath>

namespace oryx::router {

namespace {
float Log1p(int64_t x) { return static_cast<float>(std::log1p(static_cast<double>(std::max<int64_t>(0, x)))); }
}  // namespace

void Featurize(const RouterContext& c, std::span<float> out) {
  assert(static_cast<int>(out.size()) >= kNumFeatures);
  const bool decode = c.phase == Phase::kDecode;
  const bool entropy_known = c.entropy >= 0;
  const bool acceptance_known = c.acceptance >= 0;
  const bool costs_known = c.predicted_attention_s > 0 && c.predicted_linear_s > 0;
  const float values[kNumFeatures] = {
      decode ? 1.0f : 0.0f,
      Log1p(c.position),
      c.prompt_len > 0 ? static_cast<float>(std::min(1.0, static_cast<double>(c.position) / c.prompt_len)) : 0.0f,
      decode ? 0.0f : Log1p(c.prompt_len - c.position - c.segment_tokens),
      Log1p(c.prompt_len),
      Log1p(c.segment_tokens),
      c.last_prompt_token ? 1.0f : 0.0f,
      static_cast<float>(c.attention_fraction()),
      Log1p(c.tokens_since_attention),
      entropy_known ? 1.0f : 0.0f,
      entropy_known ? static_cast<float>(c.entropy) : 0.0f,
      c.margin >= 0 ? static_cast<float>(std::min(20.0, c.margin)) : 0.0f,
      c.repeated_ngram ? 1.0f : 0.0f,
      costs_known ? static_cast<float>(std::log(c.predicted_attention_s / c.predicted_linear_s)) : 0.0f,
      acceptance_known ? 1.0f : 0.0f,
      acceptance_known ? static_cast<float>(c.acceptance) : 0.0f,
      Log1p(c.match_length),
      Log1p(c.match_distance),
      Log1p(c.prompt_end_match_length),
      Log1p(c.prompt_end_match_distance),
  };
  std::copy(std::begin(values), std::end(values), out.begin());
}

}  // namespace oryx::router
