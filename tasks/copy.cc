// Copy examples: fetch haystack text, pick the passage at its depth (moved to a unique cue if need be),
// and append its repeat.
#include "tasks/copy.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "base/str_cat.h"
#include "base/rng.h"

namespace oryx::tasks {
namespace {

// True when text[s, s + cue) occurs nowhere else in `text`.
bool CueIsUnique(std::span<const int32_t> text, int32_t s, int32_t cue) {
  const std::span<const int32_t> pattern = text.subspan(s, cue);
  for (int32_t i = 0; i + cue <= static_cast<int32_t>(text.size()); ++i) {
    if (i != s && text[i] == pattern[0] && std::equal(pattern.begin(), pattern.end(), text.begin() + i)) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::Status ValidateCopyConfig(const TaskVocab& vocab, const CopyConfig& config) {
  if (absl::Status s = vocab.Validate(); !s.ok()) return s;
  if (config.cue_length < 1 || config.answer_length < 1) {
    return absl::InvalidArgumentError(Cat("copy: cue_length ", config.cue_length, " and answer_length ",
                                          config.answer_length, " must both be >= 1"));
  }
  return absl::OkStatus();
}

int32_t CopyMinLength(const CopyConfig& c) { return 2 + 2 * (c.cue_length + c.answer_length); }

absl::StatusOr<TaskExample> MakeCopyExample(const TaskVocab& vocab, const CopyConfig& config,
                                            const HaystackSource& haystack, int32_t length, double depth,
                                            uint64_t seed) {
  if (absl::Status s = ValidateCopyConfig(vocab, config); !s.ok()) return s;
  if (!(depth >= 0.0 && depth <= 1.0)) {
    return absl::InvalidArgumentError(Cat("copy: depth ", depth, " outside [0, 1]"));
  }
  if (length < CopyMinLength(config)) {
    return absl::InvalidArgumentError(Cat("copy: length ", length, " is shorter than a passage and its repeat (",
                                          CopyMinLength(config), " tokens)"));
  }
  const int32_t cue = config.cue_length, passage = cue + config.answer_length;
  const int32_t context = length - 2 - passage;
  Rng rng(seed);
  absl::StatusOr<std::vector<int32_t>> got = haystack.Tokens(context, rng.Next());
  if (!got.ok()) return got.status();
  const std::vector<int32_t>& text = *got;
  if (static_cast<int32_t>(text.size()) != context) {
    return absl::InternalError(Cat("haystack source returned ", text.size(), " tokens, asked for ", context));
  }
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] < 0 || text[i] >= vocab.vocab_size || vocab.IsSpecial(text[i])) {
      return absl::InvalidArgumentError(Cat("haystack token ", i, " (id ", text[i],
                                            ") is special or outside the vocab [0, ", vocab.vocab_size, ")"));
    }
  }
  const int32_t last = context - passage;
  const int32_t base = static_cast<int32_t>(std::llround(depth * last));
  int32_t start = base;  // where no candidate's cue is unique
  for (int32_t attempt = 0; attempt <= 16; ++attempt) {
    // Nearest first: 0, +1, -1, +2, -2, ... cue lengths away (clamped to [0, last]).
    const int32_t step = (attempt + 1) / 2 * cue * (attempt % 2 == 1 ? 1 : -1);
    if (const int32_t candidate = std::clamp(base + step, 0, last); CueIsUnique(text, candidate, cue)) {
      start = candidate;
      break;
    }
  }

  TaskExample ex;
  ex.kind = TaskKind::kCopy;
  ex.seed = seed;
  ex.depth = depth;
  ex.needle_position = 1 + start;
  ex.ids.reserve(length);
  ex.ids.push_back(vocab.bos);
  ex.ids.insert(ex.ids.end(), text.begin(), text.end());
  ex.ids.insert(ex.ids.end(), text.begin() + start, text.begin() + start + cue);
  ex.prompt_length = static_cast<int32_t>(ex.ids.size());
  ex.ids.insert(ex.ids.end(), text.begin() + start + cue, text.begin() + start + passage);
  ex.ids.push_back(vocab.eos);
  ex.answers.push_back({ex.prompt_length, config.answer_length});
  ex.loss_mask.assign(ex.ids.size(), 0);
  for (int32_t t = ex.prompt_length - 1; t < ex.prompt_length - 1 + config.answer_length; ++t) ex.loss_mask[t] = 1;
  return ex;
}

}  // namespace oryx::tasks
