// Copying ordinary text: a passage of the haystack is repeated at the end of the sequence, and the model,
// given the first tokens of the repeat (the cue), must continue it as it went before. No markers: it is
// the in-context copying a user sees when a model continues text it has read, trained and measured at a
// requested distance.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "tasks/haystack.h"
#include "tasks/task_example.h"

namespace oryx::tasks {

struct CopyConfig {
  int32_t cue_length = 16;     // tokens of the passage repeated before the answer
  int32_t answer_length = 32;  // tokens of the passage to continue (the answer)
};

// Checks the vocab and that both lengths are >= 1.
absl::Status ValidateCopyConfig(const TaskVocab& vocab, const CopyConfig& config);

// The shortest copy example: BOS, the passage, its repeat, EOS.
int32_t CopyMinLength(const CopyConfig& config);

// One copy example of exactly `length` tokens, a pure function of its arguments and the haystack source.
//
// Layout:  BOS  h_1 .. h_C  c_1 .. c_Q  a_1 .. a_A  EOS       (C = length - 2 - Q - A haystack tokens)
// where the passage c a = h[s + 1 .. s + Q + A] sits at context offset s = round(depth * (C - Q - A))
// (depth 0: first thing after BOS; depth 1: it ends just before its repeat). When the cue also occurs
// elsewhere in the haystack (repetitive text), the passage moves by whole cue lengths, nearest first, to
// the nearest offset whose cue is unique, so that the answer is determined; after 16 tries it stays put.
// The answer is a_1 .. a_A; the loss mask covers only it (the end of a copied passage is no place to stop).
// prompt_length = 1 + C + Q; needle_position = 1 + s.
// E.g. Q = 1, A = 1, length 8, depth 0, haystack "x y z a": BOS x y z a x y EOS (the answer is y).
// Errors: InvalidArgument for a bad config, depth outside [0, 1], a length below CopyMinLength, or
// haystack tokens outside the vocab or special; the source's own errors pass through.
absl::StatusOr<TaskExample> MakeCopyExample(const TaskVocab& vocab, const CopyConfig& config,
                                            const HaystackSource& haystack, int32_t length, double depth,
                                            uint64_t seed);

}  // namespace oryx::tasks
