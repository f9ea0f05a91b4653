// Scoring routing decisions on tasks whose answers sit inside the sequence (MQAR): the whole sequence is
// teacher-forced in the given modes, and an answer counts as right when each of its tokens is the argmax of
// the position before it. Shared by `oryx bench router` and `oryx train-router`.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "tasks/task_example.h"

namespace oryx::policies {

struct AnswerScore {
  int64_t right = 0, asked = 0;  // answers (MQAR: queries) right, and asked
};

// modes[i] holds one mode per input token of examples[i] (its ids but the last). Runs the sequences in
// batches of a few (bounding the all-position logits held at once).
absl::StatusOr<std::vector<AnswerScore>> ScoreTeacherForced(Backend& backend,
                                                            std::span<const tasks::TaskExample* const> examples,
                                                            std::span<const std::vector<Mode>> modes);

}  // namespace oryx::policies
