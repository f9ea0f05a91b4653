// Needle-in-a-haystack generation: draw the needles, fetch haystack text, place the asked needle at its
// depth and the distractors around it, then append the question and the answer.
#include "tasks/niah.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "base/rng.h"
#include "base/str_cat.h"

namespace oryx::tasks {
namespace {

using Tokens = std::vector<int32_t>;

// min(base^exponent, cap) without overflow.
int64_t CappedPower(int64_t base, int32_t exponent, int64_t cap) {
  int64_t result = 1;
  for (int32_t i = 0; i < exponent && result < cap; ++i) result = std::min(cap, result * base);
  return result;
}

Tokens RandomTokens(Rng& rng, const TokenRange& range, int32_t n) {
  Tokens out(n);
  for (int32_t& t : out) t = range.begin + static_cast<int32_t>(rng.UniformInt(range.size()));
  return out;
}

// `count` distinct random token sequences of `length` tokens from `range`. The caller has checked that
// the range holds at least `count` such sequences.
absl::StatusOr<std::vector<Tokens>> DistinctSequences(Rng& rng, const TokenRange& range, int32_t length,
                                                      int32_t count) {
  std::set<Tokens> seen;
  std::vector<Tokens> out;
  const int64_t max_attempts = 1000 + 64 * static_cast<int64_t>(count);
  for (int64_t attempt = 0; attempt < max_attempts && static_cast<int32_t>(out.size()) < count; ++attempt) {
    Tokens t = RandomTokens(rng, range, length);
    if (seen.insert(t).second) out.push_back(std::move(t));
  }
  if (static_cast<int32_t>(out.size()) < count) {
    return absl::InvalidArgumentError(Cat("could not draw ", count, " distinct ", length,
                                             "-token sequences from [", range.begin, ", ", range.end,
                                             "); widen the range or lengthen the keys/values"));
  }
  return out;
}

// What a needle task puts into the sequence; every block has the same length.
struct NeedleLayout {
  TaskKind kind;
  Tokens target;  // the asked needle
  std::vector<Tokens> distractors;
  Tokens question;  // from <|query|> to <|answer|>
  Tokens answer;
};

int32_t MinLength(int32_t needle_length, int32_t num_needles, int32_t question_length,
                  int32_t answer_length) {
  return 1 + needle_length * num_needles + question_length + answer_length + 1;
}

absl::Status CheckHaystack(const TaskVocab& vocab, const Tokens& haystack, int64_t expected) {
  if (static_cast<int64_t>(haystack.size()) != expected) {
    return absl::InternalError(
        Cat("haystack source returned ", haystack.size(), " tokens, asked for ", expected));
  }
  for (size_t i = 0; i < haystack.size(); ++i) {
    const int32_t id = haystack[i];
    if (id < 0 || id >= vocab.vocab_size || vocab.IsMarker(id)) {
      return absl::InvalidArgumentError(Cat("haystack token ", i, " (id ", id,
                                               ") is a task marker or outside the vocab [0, ",
                                               vocab.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

// Appends `text` with `blocks` inserted at uniform random offsets in [0, text.size()].
void AppendWithBlocks(Rng& rng, std::span<const int32_t> text, std::span<const Tokens> blocks, Tokens* out) {
  std::vector<int64_t> offsets;
  for (size_t i = 0; i < blocks.size(); ++i) offsets.push_back(rng.UniformRange(0, text.size()));
  std::sort(offsets.begin(), offsets.end());
  size_t done = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    out->insert(out->end(), text.begin() + done, text.begin() + offsets[i]);
    out->insert(out->end(), blocks[i].begin(), blocks[i].end());
    done = offsets[i];
  }
  out->insert(out->end(), text.begin() + done, text.end());
}

absl::StatusOr<TaskExample> BuildNeedleExample(const TaskVocab& vocab, const HaystackSource& source,
                                               int32_t length, double depth, uint64_t seed, Rng& rng,
                                               const NeedleLayout& layout) {
  const int32_t block = static_cast<int32_t>(layout.target.size());
  const int32_t num_needles = 1 + static_cast<int32_t>(layout.distractors.size());
  const int32_t tail = static_cast<int32_t>(layout.question.size() + layout.answer.size()) + 1;
  const int32_t context = length - 1 - tail;          // C: haystack text plus needles
  const int32_t hay = context - num_needles * block;  // H: haystack text only
  const int32_t target_offset = static_cast<int32_t>(std::llround(depth * (context - block)));

  // j distractors before the asked needle need j * block <= target_offset, the rest after need
  // (num_needles - 1 - j) * block <= context - block - target_offset.
  const int32_t j_lo = std::max(0, (target_offset - hay + block - 1) / block);
  const int32_t j_hi = std::min(num_needles - 1, target_offset / block);
  if (j_lo > j_hi) {
    return absl::InvalidArgumentError(Cat(TaskKindName(layout.kind), ": cannot place ", num_needles,
                                             " needles of ", block, " tokens around depth ", depth, " in ",
                                             length, " tokens; use a longer sequence"));
  }
  const uint64_t haystack_seed = rng.Next();
  const int32_t j = static_cast<int32_t>(rng.UniformRange(j_lo, j_hi));
  Tokens text;
  if (hay > 0) {
    absl::StatusOr<Tokens> got = source.Tokens(hay, haystack_seed);
    if (!got.ok()) return got.status();
    text = *std::move(got);
  }
  if (absl::Status s = CheckHaystack(vocab, text, hay); !s.ok()) return s;

  const int32_t hay_before = target_offset - j * block;
  const std::span<const Tokens> distractors(layout.distractors);
  TaskExample ex;
  ex.kind = layout.kind;
  ex.seed = seed;
  ex.depth = depth;
  ex.num_needles = num_needles;
  ex.ids.reserve(length);
  ex.ids.push_back(vocab.bos);
  AppendWithBlocks(rng, std::span<const int32_t>(text).first(hay_before), distractors.first(j), &ex.ids);
  ex.needle_position = static_cast<int32_t>(ex.ids.size());
  ex.ids.insert(ex.ids.end(), layout.target.begin(), layout.target.end());
  AppendWithBlocks(rng, std::span<const int32_t>(text).subspan(hay_before), distractors.subspan(j), &ex.ids);
  ex.ids.insert(ex.ids.end(), layout.question.begin(), layout.question.end());
  ex.prompt_length = static_cast<int32_t>(ex.ids.size());
  ex.ids.insert(ex.ids.end(), layout.answer.begin(), layout.answer.end());
  ex.ids.push_back(vocab.eos);
  ex.answers.push_back({ex.prompt_length, static_cast<int32_t>(layout.answer.size())});
  ex.loss_mask.assign(ex.ids.size(), 0);
  for (int32_t t = ex.prompt_length - 1; t < ex.length() - 1; ++t) ex.loss_mask[t] = 1;
  if (ex.length() != length || ex.needle_position != 1 + target_offset) {
    return absl::InternalError(Cat(TaskKindName(layout.kind), ": built ", ex.length(),
                                      " tokens (needle at ", ex.needle_position, "), wanted ", length,
                                      " (needle at ", 1 + target_offset, ")"));
  }
  return ex;
}

absl::Status CheckLengthAndDepth(TaskKind kind, int32_t length, int32_t min_length, double depth) {
  if (!(depth >= 0.0 && depth <= 1.0)) {
    return absl::InvalidArgumentError(Cat(TaskKindName(kind), ": depth ", depth, " outside [0, 1]"));
  }
  if (length < min_length) {
    return absl::InvalidArgumentError(Cat(TaskKindName(kind), ": length ", length,
                                             " is shorter than the needles, question and answer (",
                                             min_length, " tokens)"));
  }
  return absl::OkStatus();
}

Tokens NiahNeedle(const TaskVocab& v, const Tokens& key, const Tokens& value) {
  Tokens out = {v.needle, v.key};
  out.insert(out.end(), key.begin(), key.end());
  out.push_back(v.value);
  out.insert(out.end(), value.begin(), value.end());
  out.push_back(v.sep);
  return out;
}

}  // namespace

absl::Status ValidateNiahConfig(const TaskVocab& vocab, const NiahConfig& config) {
  if (absl::Status s = vocab.Validate(); !s.ok()) return s;
  if (absl::Status s = vocab.ValidateRange(config.key_range, "niah key"); !s.ok()) return s;
  if (absl::Status s = vocab.ValidateRange(config.value_range, "niah value"); !s.ok()) return s;
  if (config.key_length < 1 || config.value_length < 1 || config.num_needles < 1) {
    return absl::InvalidArgumentError(Cat("niah: key_length ", config.key_length, ", value_length ",
                                             config.value_length, " and num_needles ", config.num_needles,
                                             " must all be >= 1"));
  }
  // Distinct draws by rejection: ask for twice the room so that rejection stays cheap.
  const int64_t want = config.num_needles == 1 ? 1 : 2 * static_cast<int64_t>(config.num_needles);
  if (CappedPower(config.key_range.size(), config.key_length, want) < want ||
      CappedPower(config.value_range.size(), config.value_length, want) < want) {
    return absl::InvalidArgumentError(Cat("niah: ", config.num_needles,
                                             " needles need at least twice as many possible keys and values; "
                                             "widen the ranges or lengthen the keys/values"));
  }
  return absl::OkStatus();
}

absl::Status ValidatePasskeyConfig(const TaskVocab& vocab, const PasskeyConfig& config) {
  if (absl::Status s = vocab.Validate(); !s.ok()) return s;
  if (absl::Status s = vocab.ValidateDigits(); !s.ok()) return s;
  if (config.num_digits < 1) {
    return absl::InvalidArgumentError(Cat("passkey: num_digits ", config.num_digits, " < 1"));
  }
  return absl::OkStatus();
}

int32_t NiahMinLength(const NiahConfig& c) {
  return MinLength(c.key_length + c.value_length + 4, c.num_needles, c.key_length + 3, c.value_length);
}

int32_t PasskeyMinLength(const PasskeyConfig& c) { return MinLength(c.num_digits + 3, 1, 2, c.num_digits); }

absl::StatusOr<TaskExample> MakeNiahExample(const TaskVocab& vocab, const NiahConfig& config,
                                            const HaystackSource& haystack, int32_t length, double depth,
                                            uint64_t seed) {
  if (absl::Status s = ValidateNiahConfig(vocab, config); !s.ok()) return s;
  const TaskKind kind = config.num_needles == 1 ? TaskKind::kNiahSingle : TaskKind::kNiahMultiKey;
  if (absl::Status s = CheckLengthAndDepth(kind, length, NiahMinLength(config), depth); !s.ok()) return s;
  Rng rng(seed);
  absl::StatusOr<std::vector<Tokens>> keys =
      DistinctSequences(rng, config.key_range, config.key_length, config.num_needles);
  if (!keys.ok()) return keys.status();
  absl::StatusOr<std::vector<Tokens>> values =
      DistinctSequences(rng, config.value_range, config.value_length, config.num_needles);
  if (!values.ok()) return values.status();

  NeedleLayout layout;
  layout.kind = kind;
  layout.target = NiahNeedle(vocab, (*keys)[0], (*values)[0]);
  for (int32_t i = 1; i < config.num_needles; ++i)
    layout.distractors.push_back(NiahNeedle(vocab, (*keys)[i], (*values)[i]));
  layout.question = {vocab.query, vocab.key};
  layout.question.insert(layout.question.end(), (*keys)[0].begin(), (*keys)[0].end());
  layout.question.push_back(vocab.answer);
  layout.answer = (*values)[0];
  return BuildNeedleExample(vocab, haystack, length, depth, seed, rng, layout);
}

absl::StatusOr<TaskExample> MakePasskeyExample(const TaskVocab& vocab, const PasskeyConfig& config,
                                               const HaystackSource& haystack, int32_t length, double depth,
                                               uint64_t seed) {
  if (absl::Status s = ValidatePasskeyConfig(vocab, config); !s.ok()) return s;
  if (absl::Status s = CheckLengthAndDepth(TaskKind::kPasskey, length, PasskeyMinLength(config), depth);
      !s.ok()) {
    return s;
  }
  Rng rng(seed);
  NeedleLayout layout;
  layout.kind = TaskKind::kPasskey;
  for (int32_t i = 0; i < config.num_digits; ++i) {
    const int digit = static_cast<int>(i == 0 ? 1 + rng.UniformInt(9) : rng.UniformInt(10));
    layout.answer.push_back(vocab.digits[digit]);
  }
  layout.target = {vocab.needle, vocab.value};
  layout.target.insert(layout.target.end(), layout.answer.begin(), layout.answer.end());
  layout.target.push_back(vocab.sep);
  layout.question = {vocab.query, vocab.answer};
  return BuildNeedleExample(vocab, haystack, length, depth, seed, rng, layout);
}

}  // namespace oryx::tasks
