// Needle-in-a-haystack tasks over real text: a single needle, one needle among distractors with other
// keys (multi-key), and a passkey (a number to remember). The needle goes at a requested depth.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "tasks/haystack.h"
#include "tasks/task_example.h"

namespace oryx::tasks {

struct NiahConfig {
  TokenRange key_range;      // needle key tokens, drawn with replacement
  TokenRange value_range;    // needle value tokens, drawn with replacement (may overlap key_range: the
                             // markers tell keys from values)
  int32_t key_length = 2;    // tokens per key
  int32_t value_length = 3;  // tokens per value (the answer)
  int32_t num_needles = 1;   // 1: niah_single; > 1: niah_multikey, the asked needle plus num_needles - 1
                             // distractors; all keys are distinct, and so are all values
};

struct PasskeyConfig {
  int32_t num_digits = 5;  // the passkey's digits (first digit non-zero)
};

// Checks vocab, ranges, lengths >= 1, num_needles >= 1 and that the ranges hold num_needles distinct keys
// and values.
absl::Status ValidateNiahConfig(const TaskVocab& vocab, const NiahConfig& config);
absl::Status ValidatePasskeyConfig(const TaskVocab& vocab, const PasskeyConfig& config);

// The shortest sequence each task fits in (no haystack at all).
int32_t NiahMinLength(const NiahConfig& config);
int32_t PasskeyMinLength(const PasskeyConfig& config);

// One needle example of exactly `length` tokens, a pure function of its arguments and the haystack source.
//
// Needle  N(k, v) = <|needle|> <|key|> k_1..k_K <|value|> v_1..v_V <|sep|>           (L = K + V + 4 tokens)
// Layout:  BOS  [haystack with the needles inside]  <|query|> <|key|> k_1..k_K <|answer|>  v_1..v_V  EOS
// The haystack part (C tokens) holds H = C - num_needles * L tokens of haystack text, the asked needle
// starting at context offset round(depth * (C - L)) (depth 0: first thing after BOS; depth 1: ends just
// before the question), and any distractor needles at random places that keep the asked needle where it
// is. The answer span is v_1..v_V; the loss mask covers it and the final EOS. prompt_length = the answer's
// position; needle_position = 1 + the asked needle's context offset.
// E.g. K = 1, V = 1, length 16, depth 0.5, haystack text "a b c" (C = 9, offset round(0.5 * 3) = 2):
//   BOS a b <|needle|> <|key|> k <|value|> v <|sep|> c <|query|> <|key|> k <|answer|> v EOS
// Kind: niah_single when num_needles == 1, else niah_multikey.
// Errors: InvalidArgument for a bad config, depth outside [0, 1], a length below NiahMinLength, or
// haystack tokens that are task markers or outside the vocab; the source's own errors pass through.
absl::StatusOr<TaskExample> MakeNiahExample(const TaskVocab& vocab, const NiahConfig& config,
                                            const HaystackSource& haystack, int32_t length, double depth,
                                            uint64_t seed);

// One passkey example: as above with the needle <|needle|> <|value|> d_1..d_P <|sep|> (digit tokens from
// vocab.digits) and the question <|query|> <|answer|>; the answer is d_1..d_P.
// E.g. P = 2, length 13, depth 0: BOS <|needle|> <|value|> 4 2 <|sep|> a b <|query|> <|answer|> 4 2 EOS.
// Errors as MakeNiahExample, and InvalidArgument when vocab.digits are not provided.
absl::StatusOr<TaskExample> MakePasskeyExample(const TaskVocab& vocab, const PasskeyConfig& config,
                                               const HaystackSource& haystack, int32_t length, double depth,
                                               uint64_t seed);

}  // namespace oryx::tasks
