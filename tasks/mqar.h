// Multi-query associative recall (MQAR, as in Zoology / Based): key-value pairs, then queries of the keys
// at power-law distributed places; the model must say each queried key's value.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "tasks/task_example.h"

namespace oryx::tasks {

struct MqarConfig {
  TokenRange key_range;     // keys, drawn without replacement
  TokenRange value_range;   // values, drawn without replacement; disjoint from key_range
  TokenRange filler_range;  // tokens between queries, drawn with replacement; disjoint from key_range
                            // (it may overlap value_range; a single id such as one word is fine)
  int32_t num_pairs = 8;    // D
  double power_a = 0.01;    // query slot g = 0, 1, ... is chosen with weight (g + 1)^(power_a - 1)
                            // (Zoology's default 0.01: queries crowd near the pairs but reach the end)
};

// Checks ranges (non-empty, inside the vocab, disjoint as above), num_pairs >= 1, both ranges large
// enough for num_pairs distinct tokens, power_a in (0, 1].
absl::Status ValidateMqarConfig(const TaskVocab& vocab, const MqarConfig& config);

// The largest num_pairs that fits in `length` tokens (0 when none).
int32_t MqarMaxPairs(int32_t length);

// One MQAR example of exactly `length` tokens, a pure function of its arguments.
//
// Layout (Zoology's, with BOS and the values written after their queries so the sequence can be
// teacher-forced):
//   BOS k_1 v_1 k_2 v_2 .. k_D v_D | S slots of two tokens [| one filler if odd]
// where S = (length - 1 - 2D) / 2. D distinct slots g (weighted (g+1)^(a-1), drawn without replacement)
// hold "k_i v_i" for pair i; the other slots hold two filler tokens. Every key is queried exactly once,
// in random order. Answer spans: each queried value (length 1); loss mask: the queried key positions.
// E.g. D = 2, length 11:  BOS k1 v1 k2 v2 | k2 v2 | f f | k1 v1  (answers at 6 and 10; prompt_length 6).
// Errors: InvalidArgument for a bad config or when D slots do not fit (D > MqarMaxPairs(length)).
absl::StatusOr<TaskExample> MakeMqarExample(const TaskVocab& vocab, const MqarConfig& config, int32_t length,
                                            uint64_t seed);

}  // namespace oryx::tasks
