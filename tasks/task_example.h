// The common currency of the synthetic tasks: the token ids a task may use (TaskVocab), the task kinds,
// and one generated example (TaskExample) with its answer spans, answer-only loss mask and metadata.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace oryx::tasks {

// A half-open range of token ids [begin, end).
struct TokenRange {
  int32_t begin = 0;
  int32_t end = 0;

  int32_t size() const { return end > begin ? end - begin : 0; }
  bool empty() const { return end <= begin; }
  bool contains(int32_t id) const { return id >= begin && id < end; }
  bool overlaps(const TokenRange& o) const {
    return !empty() && !o.empty() && begin < o.end && o.begin < end;
  }
};

// The token ids the tasks need, filled by the caller from its tokenizer (for the Oryx tokenizer:
// bos = kBosId, eos = kEosId, the markers from TaskTokenId("<|sep|>") etc., first_free_id = kNewlineId + 1,
// vocab_size = Tokenizer::vocab_size(), digits from Encode("0") .. Encode("9") when each is one token).
// The tasks never depend on the tokenizer itself, so they can be tested without one.
struct TaskVocab {
  int32_t bos = -1;
  int32_t eos = -1;
  int32_t sep = -1;     // <|sep|>     ends a needle
  int32_t query = -1;   // <|query|>   starts a question
  int32_t answer = -1;  // <|answer|>  ends a question; the answer follows
  int32_t key = -1;     // <|key|>
  int32_t value = -1;   // <|value|>
  int32_t needle = -1;  // <|needle|>  starts a needle
  // Content ranges (task keys, values, filler) must lie in [first_free_id, vocab_size); every special id
  // above must be below first_free_id.
  int32_t first_free_id = 0;
  int32_t vocab_size = 0;
  // Token ids of the digits 0..9 (only the passkey task needs them; -1 = not provided). Each must be in
  // [0, vocab_size) and not a special id above.
  std::array<int32_t, 10> digits = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1};

  // OK iff the ids are in range, distinct, and below first_free_id, and first_free_id <= vocab_size.
  absl::Status Validate() const;
  // OK iff all ten digits are provided and valid.
  absl::Status ValidateDigits() const;
  // True for bos, eos and the six markers.
  bool IsSpecial(int32_t id) const;
  // True for the six task markers (sep, query, answer, key, value, needle).
  bool IsMarker(int32_t id) const;
  // InvalidArgument (naming `what`) unless `range` is non-empty and inside [first_free_id, vocab_size).
  absl::Status ValidateRange(const TokenRange& range, std::string_view what) const;
};

enum class TaskKind {
  kMqar,          // multi-query associative recall
  kNiahSingle,    // one needle in a haystack of real text
  kNiahMultiKey,  // one needle asked for among distractor needles with other keys
  kPasskey,       // a number hidden in a haystack
  kCopy,          // a passage of the haystack repeated: continue it (tasks/copy.h)
};
// "mqar", "niah_single", "niah_multikey", "passkey", "copy".
std::string_view TaskKindName(TaskKind kind);
absl::StatusOr<TaskKind> ParseTaskKind(std::string_view name);
// True for the tasks that take a haystack and a depth.
bool TaskUsesHaystack(TaskKind kind);

// The answer tokens ids[begin, begin + length). They are predicted, next-token style, from positions
// begin - 1 .. begin + length - 2 (so begin >= 1 always, as ids[0] is BOS).
struct AnswerSpan {
  int32_t begin = 0;
  int32_t length = 0;

  int32_t end() const { return begin + length; }
  bool operator==(const AnswerSpan&) const = default;
};

// One generated task sequence. Plain value type.
//
// Layout invariants (checked by Validate(), except the BOS, whose id it does not know):
//   - ids[0] is BOS; the sequence has exactly `length` tokens (metadata length == ids.size()).
//   - answers are non-empty, sorted, disjoint, non-empty spans inside ids; prompt_length == answers[0].begin,
//     so ids[0, prompt_length) is what a model is given when it has to generate the (first) answer.
//   - loss_mask has ids.size() entries; loss_mask[t] == 1 means "train on predicting ids[t + 1] from
//     position t". It is 1 exactly at the positions predicting answer tokens, plus (for the needle tasks)
//     the position predicting the final EOS, so the model also learns to stop. loss_mask.back() == 0.
struct TaskExample {
  TaskKind kind = TaskKind::kMqar;
  std::vector<int32_t> ids;         // [length] the full sequence: BOS, prompt, answer(s)
  int32_t prompt_length = 0;        // == answers[0].begin
  std::vector<AnswerSpan> answers;  // sorted by position
  std::vector<uint8_t> loss_mask;   // [length] 1 where the next-token target is trained

  // Metadata for reporting.
  uint64_t seed = 0;
  std::optional<double> depth;   // requested needle depth in [0, 1]; none for MQAR
  int32_t needle_position = -1;  // index in ids of the asked needle's first token; -1 for MQAR
  int32_t num_pairs = 0;         // MQAR: key-value pairs (each queried once); 0 otherwise
  int32_t num_needles = 0;       // needle tasks: needles in the haystack (1 + distractors); 0 for MQAR

  int32_t length() const { return static_cast<int32_t>(ids.size()); }
  std::string_view task() const { return TaskKindName(kind); }
  // The answer tokens of span `i`.
  std::vector<int32_t> AnswerTokens(int i) const;
  // The prompt ids[0, prompt_length).
  std::vector<int32_t> Prompt() const;
  // Checks the layout invariants above.
  absl::Status Validate() const;
};

// JSON form: {"task", "length", "seed", "depth" (null for MQAR), "needle_position", "num_pairs",
// "num_needles", "prompt_length", "answers": [{"begin", "length"}], "ids": [...], "loss_mask": [0|1...]}.
nlohmann::json ToJson(const TaskExample& example);
// Parses and validates the form above; errors name the field.
absl::StatusOr<TaskExample> TaskExampleFromJson(const nlohmann::json& json);

}  // namespace oryx::tasks
