// Model-independent scoring of task examples: exact match of generated or teacher-forced predictions,
// teacher-forced answer log-likelihood, and aggregation by (task, length, depth) with a JSON form.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"
#include "tasks/task_example.h"

namespace oryx::tasks {

// The score of one example. Plain value type.
struct ExampleScore {
  TaskKind kind = TaskKind::kMqar;
  int32_t length = 0;
  std::optional<double> depth;
  int32_t num_answers = 0;      // answer spans (MQAR: queries)
  int32_t correct_answers = 0;  // spans whose every token is right
  int32_t answer_tokens = 0;
  int32_t correct_tokens = 0;
  bool exact_match = false;              // every span right: the example's accuracy is 1, else 0
  std::optional<double> log_likelihood;  // sum of log p(answer token) over all spans, when measured
};

// Scores a free generation against the example's only answer span: generated[i] is the i-th token the
// model produced after Prompt(). Tokens beyond the answer length are ignored (e.g. a trailing EOS); a
// generation shorter than the answer gets its missing tokens counted wrong.
// FailedPrecondition for examples with several answer spans (MQAR): use ScoreTeacherForced.
absl::StatusOr<ExampleScore> ScoreGeneration(const TaskExample& example, std::span<const int32_t> generated);

// Scores teacher-forced predictions: predicted[t] is the model's token (e.g. argmax) for ids[t + 1] given
// ids[0..t]. Needs predicted.size() >= the last answer position (extra entries are ignored); entries at
// non-answer positions are not read.
absl::StatusOr<ExampleScore> ScoreTeacherForced(const TaskExample& example,
                                                std::span<const int32_t> predicted);

// The teacher-forced targets of the answers: positions[i] predicts targets[i] == ids[positions[i] + 1].
struct AnswerTargets {
  std::vector<int32_t> positions;
  std::vector<int32_t> targets;
};
AnswerTargets GetAnswerTargets(const TaskExample& example);

// Sum of the answer tokens' log-probabilities, given target_log_probs[t] = log p(ids[t + 1] | ids[0..t]).
// Needs target_log_probs.size() >= the last answer position; InvalidArgument for NaN or positive entries
// at answer positions (-inf is allowed and makes the sum -inf).
absl::StatusOr<double> AnswerLogLikelihood(const TaskExample& example,
                                           std::span<const float> target_log_probs);

// Returns log p(targets[i] | ids[0..positions[i]]) for each i, one call per example; its errors pass through.
using TargetLogProbFn = std::function<absl::StatusOr<std::vector<double>>(std::span<const int32_t> positions,
                                                                          std::span<const int32_t> targets)>;
// Same sum, asking `log_prob` for exactly the GetAnswerTargets() positions.
absl::StatusOr<double> AnswerLogLikelihood(const TaskExample& example, const TargetLogProbFn& log_prob);

// Scores of one group of examples.
struct AggregateResult {
  TaskKind kind = TaskKind::kMqar;
  int32_t length = 0;
  std::optional<double> depth;   // none for MQAR, or when aggregated over depths
  int64_t n = 0;                 // examples
  double accuracy = 0;           // share of examples exactly right
  double answer_accuracy = 0;    // share of answer spans exactly right (MQAR: per-query accuracy)
  double token_accuracy = 0;     // share of answer tokens right
  int64_t n_log_likelihood = 0;  // examples that carried a log-likelihood
  std::optional<double> mean_log_likelihood;        // mean over those examples of their sum
  std::optional<double> mean_token_log_likelihood;  // their total over their answer tokens
};

// Accumulates ExampleScores and reports one AggregateResult per group. Not thread-safe.
class ScoreAggregator {
 public:
  void Add(const ExampleScore& score);
  // One result per (task, length, depth), or per (task, length) when by_depth is false, ordered by task,
  // length, then depth (none first).
  std::vector<AggregateResult> Results(bool by_depth = true) const;

 private:
  std::vector<ExampleScore> scores_;
};

// {"task", "length", "depth" (null when none), "n", "accuracy", "answer_accuracy", "token_accuracy",
//  "n_log_likelihood", "mean_log_likelihood" (null when none), "mean_token_log_likelihood" (null when none)}.
// Callers add their own fields (policy, model, git revision) to the object.
nlohmann::json ToJson(const AggregateResult& result);
// {"task", "length", "depth", "num_answers", "correct_answers", "answer_tokens", "correct_tokens",
//  "exact_match", "log_likelihood" (null when none)}.
nlohmann::json ToJson(const ExampleScore& score);

}  // namespace oryx::tasks
