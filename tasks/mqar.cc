// MQAR generation: distinct keys and values, power-law query slots, filler elsewhere.
#include "tasks/mqar.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "base/rng.h"
#include "base/str_cat.h"

namespace oryx::tasks {
namespace {

// `k` distinct tokens of `range`, in random order.
std::vector<int32_t> DistinctTokens(Rng& rng, const TokenRange& range, int32_t k) {
  std::vector<int32_t> out;
  out.reserve(k);
  for (int64_t i : SampleWithoutReplacement(rng, range.size(), k))
    out.push_back(range.begin + static_cast<int32_t>(i));
  return out;
}

}  // namespace

absl::Status ValidateMqarConfig(const TaskVocab& vocab, const MqarConfig& config) {
  if (absl::Status s = vocab.Validate(); !s.ok()) return s;
  if (absl::Status s = vocab.ValidateRange(config.key_range, "mqar key"); !s.ok()) return s;
  if (absl::Status s = vocab.ValidateRange(config.value_range, "mqar value"); !s.ok()) return s;
  if (absl::Status s = vocab.ValidateRange(config.filler_range, "mqar filler"); !s.ok()) return s;
  if (config.key_range.overlaps(config.value_range)) {
    return absl::InvalidArgumentError("mqar: key and value ranges overlap");
  }
  if (config.key_range.overlaps(config.filler_range)) {
    return absl::InvalidArgumentError("mqar: key and filler ranges overlap");
  }
  if (config.num_pairs < 1) {
    return absl::InvalidArgumentError(Cat("mqar: num_pairs ", config.num_pairs, " < 1"));
  }
  if (config.key_range.size() < config.num_pairs || config.value_range.size() < config.num_pairs) {
    return absl::InvalidArgumentError(
        Cat("mqar: ", config.num_pairs, " pairs need as many distinct keys (", config.key_range.size(),
               " available) and values (", config.value_range.size(), " available)"));
  }
  if (!(config.power_a > 0.0 && config.power_a <= 1.0)) {
    return absl::InvalidArgumentError(Cat("mqar: power_a ", config.power_a, " outside (0, 1]"));
  }
  return absl::OkStatus();
}

int32_t MqarMaxPairs(int32_t length) { return length >= 1 ? (length - 1) / 4 : 0; }

absl::StatusOr<TaskExample> MakeMqarExample(const TaskVocab& vocab, const MqarConfig& config, int32_t length,
                                            uint64_t seed) {
  if (absl::Status s = ValidateMqarConfig(vocab, config); !s.ok()) return s;
  const int32_t d = config.num_pairs;
  if (d > MqarMaxPairs(length)) {
    return absl::InvalidArgumentError(Cat("mqar: ", d, " pairs do not fit in ", length,
                                             " tokens (at most ", MqarMaxPairs(length),
                                             "; each pair needs 2 tokens plus a 2-token query slot)"));
  }
  Rng rng(seed);
  const std::vector<int32_t> keys = DistinctTokens(rng, config.key_range, d);
  const std::vector<int32_t> values = DistinctTokens(rng, config.value_range, d);

  const int32_t query_begin = 1 + 2 * d;
  const int32_t num_slots = (length - query_begin) / 2;
  std::vector<double> weights(num_slots);
  for (int32_t g = 0; g < num_slots; ++g)
    weights[g] = std::pow(static_cast<double>(g + 1), config.power_a - 1.0);
  const std::vector<int64_t> slot_of_pair = WeightedSampleWithoutReplacement(rng, weights, d);

  TaskExample ex;
  ex.kind = TaskKind::kMqar;
  ex.seed = seed;
  ex.num_pairs = d;
  ex.ids.resize(length);
  ex.loss_mask.assign(length, 0);
  ex.ids[0] = vocab.bos;
  for (int32_t i = 0; i < d; ++i) {
    ex.ids[1 + 2 * i] = keys[i];
    ex.ids[2 + 2 * i] = values[i];
  }
  for (int32_t t = query_begin; t < length; ++t) {
    ex.ids[t] = config.filler_range.begin + static_cast<int32_t>(rng.UniformInt(config.filler_range.size()));
  }
  for (int32_t i = 0; i < d; ++i) {
    const int32_t pos = query_begin + 2 * static_cast<int32_t>(slot_of_pair[i]);
    ex.ids[pos] = keys[i];
    ex.ids[pos + 1] = values[i];
    ex.loss_mask[pos] = 1;
    ex.answers.push_back({pos + 1, 1});
  }
  std::sort(ex.answers.begin(), ex.answers.end(),
            [](const AnswerSpan& a, const AnswerSpan& b) { return a.begin < b.begin; });
  ex.prompt_length = ex.answers.front().begin;
  return ex;
}

}  // namespace oryx::tasks
