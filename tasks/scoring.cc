// Exact-match and log-likelihood scoring, aggregation, and their JSON form.
#include "tasks/scoring.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <utility>

#include "nlohmann/json.hpp"
#include "base/str_cat.h"

namespace oryx::tasks {
namespace {

ExampleScore EmptyScore(const TaskExample& example) {
  ExampleScore score;
  score.kind = example.kind;
  score.length = example.length();
  score.depth = example.depth;
  score.num_answers = static_cast<int32_t>(example.answers.size());
  return score;
}

// The entries needed to read every answer target: the position predicting the last answer token + 1.
int64_t NeededPredictions(const TaskExample& example) { return example.answers.back().end() - 1; }

absl::Status CheckPredictionCount(const TaskExample& example, size_t have, std::string_view what) {
  if (example.answers.empty()) {
    return absl::InvalidArgumentError(Cat(example.task(), " example has no answer spans"));
  }
  if (static_cast<int64_t>(have) < NeededPredictions(example)) {
    return absl::InvalidArgumentError(Cat(what, " has ", have, " entries; the ", example.task(),
                                             " example needs ", NeededPredictions(example)));
  }
  return absl::OkStatus();
}

absl::Status CheckLogProb(double lp, int32_t position) {
  if (std::isnan(lp) || lp > 1e-6) {
    return absl::InvalidArgumentError(
        Cat("log-probability ", lp, " at position ", position, " is not a log-probability"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ExampleScore> ScoreGeneration(const TaskExample& example, std::span<const int32_t> generated) {
  if (example.answers.size() != 1) {
    return absl::FailedPreconditionError(Cat("a ", example.task(), " example has ", example.answers.size(),
                                                " answer spans; score it teacher-forced"));
  }
  ExampleScore score = EmptyScore(example);
  const AnswerSpan& span = example.answers[0];
  score.answer_tokens = span.length;
  for (int32_t i = 0; i < span.length; ++i) {
    if (i < static_cast<int32_t>(generated.size()) && generated[i] == example.ids[span.begin + i]) {
      ++score.correct_tokens;
    }
  }
  score.exact_match = score.correct_tokens == span.length;
  score.correct_answers = score.exact_match ? 1 : 0;
  return score;
}

absl::StatusOr<ExampleScore> ScoreTeacherForced(const TaskExample& example,
                                                std::span<const int32_t> predicted) {
  if (absl::Status s = CheckPredictionCount(example, predicted.size(), "predicted"); !s.ok()) return s;
  ExampleScore score = EmptyScore(example);
  for (const AnswerSpan& span : example.answers) {
    int32_t right = 0;
    for (int32_t t = span.begin; t < span.end(); ++t) right += predicted[t - 1] == example.ids[t] ? 1 : 0;
    score.answer_tokens += span.length;
    score.correct_tokens += right;
    score.correct_answers += right == span.length ? 1 : 0;
  }
  score.exact_match = score.correct_answers == score.num_answers;
  return score;
}

AnswerTargets GetAnswerTargets(const TaskExample& example) {
  AnswerTargets out;
  for (const AnswerSpan& span : example.answers) {
    for (int32_t t = span.begin; t < span.end(); ++t) {
      out.positions.push_back(t - 1);
      out.targets.push_back(example.ids[t]);
    }
  }
  return out;
}

absl::StatusOr<double> AnswerLogLikelihood(const TaskExample& example,
                                           std::span<const float> target_log_probs) {
  if (absl::Status s = CheckPredictionCount(example, target_log_probs.size(), "target_log_probs"); !s.ok()) {
    return s;
  }
  double sum = 0;
  for (int32_t p : GetAnswerTargets(example).positions) {
    if (absl::Status s = CheckLogProb(target_log_probs[p], p); !s.ok()) return s;
    sum += target_log_probs[p];
  }
  return sum;
}

absl::StatusOr<double> AnswerLogLikelihood(const TaskExample& example, const TargetLogProbFn& log_prob) {
  if (example.answers.empty()) {
    return absl::InvalidArgumentError(Cat(example.task(), " example has no answer spans"));
  }
  const AnswerTargets targets = GetAnswerTargets(example);
  absl::StatusOr<std::vector<double>> lps = log_prob(targets.positions, targets.targets);
  if (!lps.ok()) return lps.status();
  if (lps->size() != targets.positions.size()) {
    return absl::InvalidArgumentError(Cat("log-prob function returned ", lps->size(), " values for ",
                                             targets.positions.size(), " positions"));
  }
  double sum = 0;
  for (size_t i = 0; i < lps->size(); ++i) {
    if (absl::Status s = CheckLogProb((*lps)[i], targets.positions[i]); !s.ok()) return s;
    sum += (*lps)[i];
  }
  return sum;
}

void ScoreAggregator::Add(const ExampleScore& score) { scores_.push_back(score); }

std::vector<AggregateResult> ScoreAggregator::Results(bool by_depth) const {
  // Group key: (task, length, has depth, depth); none sorts before any depth.
  using Key = std::tuple<TaskKind, int32_t, bool, double>;
  struct Sums {
    int64_t n = 0, exact = 0, answers = 0, correct_answers = 0, tokens = 0, correct_tokens = 0;
    int64_t n_ll = 0, ll_tokens = 0;
    double ll = 0;
  };
  std::map<Key, Sums> groups;
  for (const ExampleScore& s : scores_) {
    const bool has_depth = by_depth && s.depth.has_value();
    Sums& g = groups[Key{s.kind, s.length, has_depth, has_depth ? *s.depth : 0.0}];
    ++g.n;
    g.exact += s.exact_match ? 1 : 0;
    g.answers += s.num_answers;
    g.correct_answers += s.correct_answers;
    g.tokens += s.answer_tokens;
    g.correct_tokens += s.correct_tokens;
    if (s.log_likelihood) {
      ++g.n_ll;
      g.ll += *s.log_likelihood;
      g.ll_tokens += s.answer_tokens;
    }
  }
  auto share = [](int64_t part, int64_t whole) {
    return whole > 0 ? static_cast<double>(part) / whole : 0.0;
  };
  std::vector<AggregateResult> out;
  for (const auto& [key, g] : groups) {
    AggregateResult r;
    r.kind = std::get<0>(key);
    r.length = std::get<1>(key);
    if (std::get<2>(key)) r.depth = std::get<3>(key);
    r.n = g.n;
    r.accuracy = share(g.exact, g.n);
    r.answer_accuracy = share(g.correct_answers, g.answers);
    r.token_accuracy = share(g.correct_tokens, g.tokens);
    r.n_log_likelihood = g.n_ll;
    if (g.n_ll > 0) r.mean_log_likelihood = g.ll / g.n_ll;
    if (g.ll_tokens > 0) r.mean_token_log_likelihood = g.ll / g.ll_tokens;
    out.push_back(r);
  }
  return out;
}

namespace {
nlohmann::json OptionalJson(const std::optional<double>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}
}  // namespace

nlohmann::json ToJson(const AggregateResult& r) {
  return {{"task", std::string(TaskKindName(r.kind))},
          {"length", r.length},
          {"depth", OptionalJson(r.depth)},
          {"n", r.n},
          {"accuracy", r.accuracy},
          {"answer_accuracy", r.answer_accuracy},
          {"token_accuracy", r.token_accuracy},
          {"n_log_likelihood", r.n_log_likelihood},
          {"mean_log_likelihood", OptionalJson(r.mean_log_likelihood)},
          {"mean_token_log_likelihood", OptionalJson(r.mean_token_log_likelihood)}};
}

nlohmann::json ToJson(const ExampleScore& s) {
  return {{"task", std::string(TaskKindName(s.kind))},
          {"length", s.length},
          {"depth", OptionalJson(s.depth)},
          {"num_answers", s.num_answers},
          {"correct_answers", s.correct_answers},
          {"answer_tokens", s.answer_tokens},
          {"correct_tokens", s.correct_tokens},
          {"exact_match", s.exact_match},
          {"log_likelihood", OptionalJson(s.log_likelihood)}};
}

}  // namespace oryx::tasks
