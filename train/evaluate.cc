// Perplexity by mode schedule and task accuracy by policy on any SequenceModel, and the CPU engine as one.
// No LibTorch here.
#include "train/evaluate.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/cpu_backend.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "engine/tokenizer.h"
#include "tasks/scoring.h"
#include "tasks/task_mix.h"
#include "train/mode_sampling.h"
#include "train/shards.h"
#include "train/task_data.h"

namespace oryx::train {

namespace {

using Json = nlohmann::json;

// The validation split, checked against the model's vocabulary.
absl::StatusOr<CorpusReader> OpenValidation(const std::string& data_dir, const ModelConfig& c) {
  ORYX_ASSIGN_OR_RETURN(CorpusReader val, CorpusReader::Open(data_dir, "val"));
  if (val.vocab_size() != c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(data_dir, ": corpus vocabulary (", val.vocab_size(),
                                                   ") differs from the model's (", c.vocab_size, ")"));
  }
  return val;
}

// -log p(target) of each row of logits [T, V], in double.
std::vector<double> TokenNll(std::span<const float> logits, std::span<const int32_t> targets, int64_t V) {
  std::vector<double> nll(targets.size());
  for (size_t t = 0; t < targets.size(); ++t) {
    const float* row = logits.data() + t * V;
    const double top = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double{row[v]} - top);
    nll[t] = top + std::log(sum) - row[targets[t]];
  }
  return nll;
}

class EngineModel final : public SequenceModel {
 public:
  explicit EngineModel(std::unique_ptr<Backend> backend) : backend_(std::move(backend)) {}
  const ModelConfig& config() const override { return backend_->config(); }
  absl::StatusOr<std::vector<float>> Logits(std::span<const int32_t> ids, std::span<const uint8_t> modes,
                                            int64_t first_row) override {
    if (first_row < 0 || first_row >= static_cast<int64_t>(ids.size())) {
      return absl::InvalidArgumentError(absl::StrCat("logits from row ", first_row, " of ", ids.size()));
    }
    SequenceState seq = backend_->NewSequence();
    std::vector<Mode> m(modes.size());
    for (size_t t = 0; t < modes.size(); ++t) m[t] = modes[t] ? Mode::kAttention : Mode::kLinear;
    std::vector<float> logits;
    if (first_row > 0) {  // the rows before: state only, no LM head
      ForwardItem head{&seq, ids.first(first_row), std::span<const Mode>(m).first(first_row), LogitsRows::kNone,
                       nullptr, false};
      ORYX_RETURN_IF_ERROR(backend_->Forward(std::span(&head, 1)));
    }
    ORYX_RETURN_IF_ERROR(backend_->Forward(seq, ids.subspan(first_row), std::span<const Mode>(m).subspan(first_row),
                                           /*all_logits=*/true, &logits));
    return logits;
  }

 private:
  std::unique_ptr<Backend> backend_;
};

double Fraction(const std::vector<uint8_t>& modes) {
  double n = 0;
  for (uint8_t m : modes) n += m;
  return modes.empty() ? 0 : n / modes.size();
}

}  // namespace

absl::StatusOr<std::unique_ptr<SequenceModel>> OpenEngineModel(const EvalCommon& common) {
  const BackendOptions options{.device = common.device == "auto" ? "cpu" : common.device,
                               .threads = common.threads,
                               .weights = common.weights,
                               .kv_dtype = common.kv_dtype};
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, LoadBackend(common.model_dir, options));
  return std::unique_ptr<SequenceModel>(new EngineModel(std::move(backend)));
}

absl::StatusOr<Json> EvalPerplexity(const PplOptions& o, SequenceModel& model) {
  const ModelConfig& c = model.config();
  const int64_t T = o.seq_len > 0 ? o.seq_len : std::min<int64_t>(c.max_position, 2048);
  if (T > c.max_position) {
    return absl::InvalidArgumentError(absl::StrCat("--seq-len ", T, " exceeds the model's max_position ", c.max_position));
  }
  // The text: windows of T + 1 tokens of the corpus's validation split, or of the given text files (each
  // tokenised with the model's tokenizer after a BOS, then concatenated).
  std::optional<CorpusReader> val;
  std::vector<int32_t> text;
  int64_t windows = 0;
  if (o.text_files.empty()) {
    ORYX_ASSIGN_OR_RETURN(CorpusReader reader, OpenValidation(o.data_dir, c));
    val.emplace(std::move(reader));
    windows = val->NumSequences(T);
  } else {
    ORYX_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(o.common.model_dir + "/tokenizer.model"));
    for (const std::string& f : o.text_files) {
      ORYX_ASSIGN_OR_RETURN(std::string content, ReadFile(f));
      text.push_back(kBosId);
      tok.EncodeAppend(content, &text);
    }
    windows = static_cast<int64_t>(text.size()) / (T + 1);
  }
  auto read_window = [&](int64_t w, int32_t* out) -> absl::Status {
    if (val) return val->ReadSequence(w, T, out);
    std::copy(text.begin() + w * (T + 1), text.begin() + (w + 1) * (T + 1), out);
    return absl::OkStatus();
  };
  const int64_t n = std::min(o.sequences, windows);
  if (n < 1) return absl::FailedPreconditionError(absl::StrCat("the evaluation text is shorter than ", T + 1, " tokens"));
  Json results = Json::array();
  for (const std::string& name : o.schedules) {
    std::vector<double> per_position(T, 0.0);
    double attention_tokens = 0;
    for (int64_t i = 0; i < n; ++i) {
      std::vector<int32_t> window(T + 1);
      ORYX_RETURN_IF_ERROR(read_window(i * windows / n, window.data()));
      ORYX_ASSIGN_OR_RETURN(std::vector<uint8_t> modes, ScheduleModes(name, T, c, o.common.seed, i));
      attention_tokens += Fraction(modes) * T;
      const std::span<const int32_t> ids(window);
      ORYX_ASSIGN_OR_RETURN(std::vector<float> logits, model.Logits(ids.first(T), modes));
      const std::vector<double> nll = TokenNll(logits, ids.subspan(1, T), c.vocab_size);
      for (int64_t t = 0; t < T; ++t) per_position[t] += nll[t];
    }
    double loss = 0;
    for (double& v : per_position) loss += v /= static_cast<double>(n);
    loss /= static_cast<double>(T);
    Json r = {{"schedule", name}, {"loss", loss}, {"ppl", std::exp(loss)}, {"sequences", n}, {"seq_len", T},
              {"attention_fraction", attention_tokens / (n * T)}};
    if (o.per_position) {
      r["per_position_loss"] = per_position;
    }
    results.push_back(r);
  }
  return Json{{"eval", "ppl"}, {"model", o.common.model_dir}, {"results", results}};
}

absl::StatusOr<Json> EvalTask(const TaskEvalOptions& o, SequenceModel& model) {
  const ModelConfig& c = model.config();
  // Haystack text: the corpus's validation split, or the given text files (tokenised with the model's
  // tokenizer).
  std::optional<CorpusReader> val;
  std::unique_ptr<tasks::HaystackSource> haystack;
  std::string tokenizer_path = o.common.model_dir + "/tokenizer.model";
  const bool needs_haystack = o.task != "mqar" || !o.data_dir.empty() || !o.haystack_files.empty();
  if (o.haystack_files.empty() && needs_haystack) {
    ORYX_ASSIGN_OR_RETURN(CorpusReader reader, OpenValidation(o.data_dir, c));
    val.emplace(std::move(reader));
    tokenizer_path = val->tokenizer_path();
  }
  ORYX_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(tokenizer_path));
  if (val) {
    haystack = std::make_unique<CorpusHaystack>(&*val);
  } else if (needs_haystack) {
    ORYX_ASSIGN_OR_RETURN(TextHaystack text, TextHaystack::Load(o.haystack_files, tok));
    haystack = std::make_unique<TextHaystack>(std::move(text));
  }
  ORYX_ASSIGN_OR_RETURN(TaskSetup setup, MakeTaskSetup(tok));
  ORYX_ASSIGN_OR_RETURN(tasks::TaskKind kind, ParseTaskName(o.task));
  setup.configs.mqar.num_pairs = o.mqar_pairs;
  setup.configs.niah_multikey.num_needles = o.multikey_needles;
  setup.configs.copy = {o.copy_cue_length, o.copy_answer_length};
  for (int32_t len : o.lengths) {
    if (len > c.max_position) {
      return absl::InvalidArgumentError(absl::StrCat("length ", len, " exceeds the model's max_position ", c.max_position));
    }
  }
  std::vector<double> depths = kind == tasks::TaskKind::kMqar ? std::vector<double>{} : o.depths;
  ORYX_ASSIGN_OR_RETURN(std::vector<tasks::EvalPoint> grid, tasks::EvalGrid(o.lengths, depths, o.seeds, o.common.seed));
  // Every policy checked before any runs: a bad one at the end of the list fails at once, not after the others.
  for (const std::string& policy : o.policies) {
    if (policy != "attention" && policy != "linear" && policy != "prefill-linear") {
      return absl::InvalidArgumentError(absl::StrCat("unknown policy '", policy,
                                                     "' (attention, linear, prefill-linear; routed policies such as "
                                                     "learned:FILE or entropy:TAU: oryx bench router)"));
    }
  }
  Json results = Json::array();
  for (const std::string& policy : o.policies) {
    tasks::ScoreAggregator aggregate;
    double attention_tokens = 0, tokens = 0;
    for (const tasks::EvalPoint& p : grid) {
      ORYX_ASSIGN_OR_RETURN(tasks::TaskExample ex, tasks::MakeExample(kind, setup.configs, haystack.get(), p.length, p.depth, p.seed));
      const int64_t T = ex.length();
      std::vector<uint8_t> modes(T, policy == "attention");
      if (policy == "prefill-linear") {
        for (int64_t t = ex.prompt_length - 1; t < T; ++t) modes[t] = 1;
      }
      attention_tokens += Fraction(modes) * T;
      tokens += T;
      // Only the rows from the one that predicts the first answer token on are scored (the answers and
      // their masks lie there), so only those logits are computed.
      int64_t first = T - 1;
      for (const tasks::AnswerSpan& a : ex.answers) first = std::min<int64_t>(first, a.begin - 1);
      first = std::max<int64_t>(first, 0);
      ORYX_ASSIGN_OR_RETURN(std::vector<float> logits, model.Logits(ex.ids, modes, first));  // [T - first, V]
      const int64_t V = c.vocab_size;
      std::vector<int32_t> predicted(T, -1);
      for (int64_t t = first; t < T; ++t) {
        const float* row = &logits[(t - first) * V];
        predicted[t] = static_cast<int32_t>(std::max_element(row, row + V) - row);
      }
      const std::vector<double> nll =
          TokenNll(std::span(logits).first((T - 1 - first) * V), std::span(ex.ids).subspan(first + 1), V);
      std::vector<float> target_lp(T - 1, 0.f);
      for (int64_t t = first; t + 1 < T; ++t) target_lp[t] = static_cast<float>(-nll[t - first]);
      ORYX_ASSIGN_OR_RETURN(tasks::ExampleScore score, tasks::ScoreTeacherForced(ex, predicted));
      ORYX_ASSIGN_OR_RETURN(double ll, tasks::AnswerLogLikelihood(ex, target_lp));
      score.log_likelihood = ll;
      aggregate.Add(score);
    }
    for (const tasks::AggregateResult& r : aggregate.Results(/*by_depth=*/true)) {
      Json j = tasks::ToJson(r);
      j["policy"] = policy;
      results.push_back(j);
    }
    double correct = 0, n = 0;
    for (const tasks::AggregateResult& r : aggregate.Results(false)) {
      correct += r.accuracy * r.n;
      n += r.n;
    }
    results.push_back({{"policy", policy}, {"task", o.task}, {"summary", true}, {"n", n},
                       {"accuracy", n > 0 ? correct / n : 0.0}, {"attention_fraction", attention_tokens / tokens}});
  }
  return Json{{"eval", o.task}, {"model", o.common.model_dir}, {"results", results}};
}

}  // namespace oryx::train
