#include "router/router.h"

#include <algorithm>
#include <cmath>


namespace oryx::router {

double RouterContext::attention_fraction() const {
  const int64_t total = attention_tokens + linear_tokens;
  return total == 0 ? 0.0 : static_cast<double>(attention_tokens) / static_cast<double>(total);
}

void DistributionStats(std::span<const float> logits, double* entropy, double* margin) {
  float top1 = -INFINITY, top2 = -INFINITY;
  for (float l : logits) {
    if (l > top1) {
      top2 = top1;
      top1 = l;
    } else if (l > top2) {
      top2 = l;
    }
  }
  *margin = static_cast<double>(top1) - static_cast<double>(top2);
  double z = 0, e = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l) - top1);
  for (float l : logits) {
    const double p = std::exp(static_cast<double>(l) - top1) / z;
    if (p > 0) e -= p * std::log(p);
  }
  *entropy = e;
}

RouterDecoder::RouterDecoder(std::unique_ptr<Router> router, RouterOptions options)
    : router_(std::move(router)), options_(std::move(options)) {}

uint64_t PromptHash(std::span<const int32_t> prompt) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the ids
  for (int32_t id : prompt) h = (h ^ static_cast<uint32_t>(id)) * 0x100000001b3ull;
  return h;
}

Mode RouterDecoder::PrefillMode(std::span<const int32_t> prompt, int64_t position) const {
  // Replays the prefill decisions from the prompt's start up to `position`'s segment.
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  RouterContext c;
  c.prompt_len = prompt_len;
  c.sequence_hash = PromptHash(prompt);
  const int64_t seg = std::max<int64_t>(1, options_.segment_len);
  for (int64_t start = 0; start < prompt_len;) {
    c.position = start;
    c.last_prompt_token = start == prompt_len - 1;
    c.segment_tokens = c.last_prompt_token ? 1 : std::min(seg, prompt_len - 1 - start);
    if (options_.cost_model) {
      const SpanShape shape{1, c.segment_tokens, start, Mode::kAttention};
      c.predicted_attention_s = options_.cost_model->PredictSeconds(shape);
      c.predicted_linear_s = options_.cost_model->PredictSeconds({1, c.segment_tokens, start, Mode::kLinear});
    }
    const Mode m = router_->Decide(c).mode;
    if (position < start + c.segment_tokens) return m;
    (m == Mode::kAttention ? c.attention_tokens : c.linear_tokens) += c.segment_tokens;
    c.tokens_since_attention = m == Mode::kAttention ? 0 : c.tokens_since_attention + c.segment_tokens;
    start += c.segment_tokens;
  }
  return Mode::kAttention;  // unreachable for position < prompt_len
}

Mode RouterDecoder::ChooseMode(const DecodeSlot& s, int64_t batch) {
  const SlotState& st = slots_[s.id];
  RouterContext c;
  c.phase = Phase::kDecode;
  c.position = s.seq->position();
  c.prompt_len = s.prompt_len;
  c.batch = batch;
  c.attention_tokens = s.stats->attention_tokens;
  c.linear_tokens = s.stats->linear_tokens;
  c.tokens_since_attention = st.since_attention;
  c.entropy = st.entropy;
  c.margin = st.margin;
  c.sequence_hash = PromptHash(*s.prompt);
  // The last 3 tokens (prompt and generated together) seen earlier?
  std::vector<int32_t> all(s.prompt->begin(), s.prompt->end());
  all.insert(all.end(), s.generated->begin(), s.generated->end());
  if (all.size() > 3) {
    const auto tail = all.end() - 3;
    c.repeated_ngram = std::search(all.begin(), tail, tail, all.end()) != tail;
  }
  if (options_.cost_model) {
    c.predicted_attention_s = options_.cost_model->PredictSeconds({batch, 1, c.position, Mode::kAttention});
    c.predicted_linear_s = options_.cost_model->PredictSeconds({batch, 1, c.position, Mode::kLinear});
  }
  return router_->Decide(c).mode;
}

void RouterDecoder::Observe(const DecodeSlot& s, Mode mode, std::span<const float> logits) {
  SlotState& st = slots_[s.id];
  st.since_attention = mode == Mode::kAttention ? 0 : st.since_attention + 1;
  DistributionStats(logits, &st.entropy, &st.margin);
}

}  // namespace oryx::router
