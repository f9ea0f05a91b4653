// TaskVocab validation, task-kind names, TaskExample invariants and JSON form.
#include "tasks/task_example.h"

#include <algorithm>
#include <utility>

#include "nlohmann/json.hpp"
#include "base/str_cat.h"

namespace oryx::tasks {
namespace {

struct NamedId {
  std::string_view name;
  int32_t id;
};

std::array<NamedId, 8> SpecialIds(const TaskVocab& v) {
  return {{{"bos", v.bos},
           {"eos", v.eos},
           {"sep", v.sep},
           {"query", v.query},
           {"answer", v.answer},
           {"key", v.key},
           {"value", v.value},
           {"needle", v.needle}}};
}

constexpr std::array<std::pair<TaskKind, std::string_view>, 5> kKindNames = {{
    {TaskKind::kMqar, "mqar"},
    {TaskKind::kNiahSingle, "niah_single"},
    {TaskKind::kNiahMultiKey, "niah_multikey"},
    {TaskKind::kPasskey, "passkey"},
    {TaskKind::kCopy, "copy"},
}};

}  // namespace

absl::Status TaskVocab::Validate() const {
  if (vocab_size <= 0)
    return absl::InvalidArgumentError(Cat("task vocab: vocab_size ", vocab_size, " <= 0"));
  if (first_free_id < 0 || first_free_id > vocab_size) {
    return absl::InvalidArgumentError(
        Cat("task vocab: first_free_id ", first_free_id, " outside [0, vocab_size=", vocab_size, "]"));
  }
  const auto ids = SpecialIds(*this);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i].id < 0 || ids[i].id >= first_free_id) {
      return absl::InvalidArgumentError(Cat("task vocab: ", ids[i].name, " id ", ids[i].id,
                                               " not in [0, first_free_id=", first_free_id, ")"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (ids[i].id == ids[j].id) {
        return absl::InvalidArgumentError(
            Cat("task vocab: ", ids[i].name, " and ", ids[j].name, " share id ", ids[i].id));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status TaskVocab::ValidateDigits() const {
  for (int d = 0; d < 10; ++d) {
    const int32_t id = digits[d];
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          Cat("task vocab: digit ", d, " id ", id, " not provided or outside [0, ", vocab_size, ")"));
    }
    if (IsSpecial(id)) {
      return absl::InvalidArgumentError(Cat("task vocab: digit ", d, " id ", id, " is a special id"));
    }
    for (int e = 0; e < d; ++e) {
      if (digits[e] == id) {
        return absl::InvalidArgumentError(Cat("task vocab: digits ", e, " and ", d, " share id ", id));
      }
    }
  }
  return absl::OkStatus();
}

bool TaskVocab::IsSpecial(int32_t id) const { return id == bos || id == eos || IsMarker(id); }

bool TaskVocab::IsMarker(int32_t id) const {
  return id == sep || id == query || id == answer || id == key || id == value || id == needle;
}

absl::Status TaskVocab::ValidateRange(const TokenRange& range, std::string_view what) const {
  if (range.empty()) {
    return absl::InvalidArgumentError(Cat(what, " range [", range.begin, ", ", range.end, ") is empty"));
  }
  if (range.begin < first_free_id || range.end > vocab_size) {
    return absl::InvalidArgumentError(Cat(what, " range [", range.begin, ", ", range.end,
                                             ") is not inside [first_free_id=", first_free_id,
                                             ", vocab_size=", vocab_size, ")"));
  }
  return absl::OkStatus();
}

std::string_view TaskKindName(TaskKind kind) {
  for (const auto& [k, name] : kKindNames) {
    if (k == kind) return name;
  }
  return "unknown";
}

absl::StatusOr<TaskKind> ParseTaskKind(std::string_view name) {
  for (const auto& [k, n] : kKindNames) {
    if (n == name) return k;
  }
  return absl::InvalidArgumentError(
      Cat("unknown task '", name, "' (expected mqar, niah_single, niah_multikey, passkey or copy)"));
}

bool TaskUsesHaystack(TaskKind kind) { return kind != TaskKind::kMqar; }

std::vector<int32_t> TaskExample::AnswerTokens(int i) const {
  const AnswerSpan& s = answers.at(i);
  return std::vector<int32_t>(ids.begin() + s.begin, ids.begin() + s.end());
}

std::vector<int32_t> TaskExample::Prompt() const {
  return std::vector<int32_t>(ids.begin(), ids.begin() + prompt_length);
}

absl::Status TaskExample::Validate() const {
  const int64_t n = static_cast<int64_t>(ids.size());
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(Cat("task example (", task(), ", seed ", seed, "): ", parts...));
  };
  if (n < 2) return error("sequence has ", n, " tokens (needs at least 2)");
  if (static_cast<int64_t>(loss_mask.size()) != n) {
    return error("loss_mask has ", loss_mask.size(), " entries for ", n, " tokens");
  }
  if (answers.empty()) return error("no answer spans");
  int32_t previous_end = 1;
  for (const AnswerSpan& s : answers) {
    if (s.length <= 0 || s.begin < previous_end || s.end() > n) {
      return error("answer span [", s.begin, ", ", s.end(), ") is empty, out of order or outside [1, ", n,
                   ")");
    }
    previous_end = s.end();
  }
  if (prompt_length != answers[0].begin) {
    return error("prompt_length ", prompt_length, " != first answer begin ", answers[0].begin);
  }
  if (loss_mask.back() != 0) return error("loss_mask is set at the last position");
  for (const AnswerSpan& s : answers) {
    for (int32_t t = s.begin - 1; t < s.end() - 1; ++t) {
      if (loss_mask[t] != 1) return error("loss_mask[", t, "] is not set but predicts an answer token");
    }
  }
  for (uint8_t m : loss_mask) {
    if (m > 1) return error("loss_mask holds a value other than 0 or 1");
  }
  if (depth && !(*depth >= 0.0 && *depth <= 1.0)) return error("depth ", *depth, " outside [0, 1]");
  return absl::OkStatus();
}

nlohmann::json ToJson(const TaskExample& example) {
  nlohmann::json answers = nlohmann::json::array();
  for (const AnswerSpan& s : example.answers) answers.push_back({{"begin", s.begin}, {"length", s.length}});
  nlohmann::json j;
  j["task"] = std::string(example.task());
  j["length"] = example.length();
  j["seed"] = example.seed;
  j["depth"] = example.depth ? nlohmann::json(*example.depth) : nlohmann::json(nullptr);
  j["needle_position"] = example.needle_position;
  j["num_pairs"] = example.num_pairs;
  j["num_needles"] = example.num_needles;
  j["prompt_length"] = example.prompt_length;
  j["answers"] = std::move(answers);
  j["ids"] = example.ids;
  j["loss_mask"] = example.loss_mask;
  return j;
}

absl::StatusOr<TaskExample> TaskExampleFromJson(const nlohmann::json& json) {
  if (!json.is_object()) return absl::InvalidArgumentError("task example JSON: not an object");
  TaskExample ex;
  try {
    auto kind = ParseTaskKind(json.at("task").get<std::string>());
    if (!kind.ok()) return kind.status();
    ex.kind = *kind;
    ex.seed = json.at("seed").get<uint64_t>();
    if (!json.at("depth").is_null()) ex.depth = json.at("depth").get<double>();
    ex.needle_position = json.at("needle_position").get<int32_t>();
    ex.num_pairs = json.at("num_pairs").get<int32_t>();
    ex.num_needles = json.at("num_needles").get<int32_t>();
    ex.prompt_length = json.at("prompt_length").get<int32_t>();
    for (const auto& s : json.at("answers")) {
      ex.answers.push_back({s.at("begin").get<int32_t>(), s.at("length").get<int32_t>()});
    }
    ex.ids = json.at("ids").get<std::vector<int32_t>>();
    ex.loss_mask = json.at("loss_mask").get<std::vector<uint8_t>>();
    if (json.at("length").get<int64_t>() != static_cast<int64_t>(ex.ids.size())) {
      return absl::InvalidArgumentError(Cat("task example JSON: length ", json.at("length").dump(),
                                               " != number of ids ", ex.ids.size()));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(Cat("task example JSON: ", e.what()));
  }
  if (absl::Status s = ex.Validate(); !s.ok()) return s;
  return ex;
}

}  // namespace oryx::tasks
