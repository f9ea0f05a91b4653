// Perplexity by mode schedule, task accuracy by policy, and greedy self-speculation agreement, on the
// LibTorch model.
#include "train/evaluate.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine/status_macros.h"
#include "engine/tokenizer.h"
#include "tasks/scoring.h"
#include "tasks/task_mix.h"
#include "train/model.h"
#include "train/shards.h"
#include "train/task_data.h"
#include "train/torch_io.h"
#include "train/trainer.h"

namespace oryx::train {

namespace {

using Json = nlohmann::json;

// The model, its device and the validation split every evaluation reads.
struct Setup {
  std::optional<OryxModel> model;
  torch::Device device{torch::kCPU};
  std::optional<CorpusReader> val;
};

absl::StatusOr<Setup> Open(const EvalCommon& common, const std::string& data_dir) {
  Setup s;
  ORYX_ASSIGN_OR_RETURN(s.device, ParseDevice(common.device));
  if (common.threads > 0) torch::set_num_threads(common.threads);
  ORYX_ASSIGN_OR_RETURN(OryxModel model, LoadModel(common.model_dir, s.device));
  model->eval();
  s.model.emplace(std::move(model));
  ORYX_ASSIGN_OR_RETURN(CorpusReader val, CorpusReader::Open(data_dir, "val"));
  if (val.vocab_size() != (*s.model)->config().vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(data_dir, ": corpus vocabulary (", val.vocab_size(),
                                                   ") differs from the model's (",
                                                   (*s.model)->config().vocab_size, ")"));
  }
  s.val.emplace(std::move(val));
  return s;
}

// Per-token modes (1 = attention) of a named schedule over `len` tokens.
absl::StatusOr<std::vector<uint8_t>> Schedule(const std::string& name, int64_t len, const ModelConfig& c,
                                              uint64_t seed, int64_t sequence) {
  std::vector<uint8_t> m(len, 0);
  std::vector<std::string> parts = absl::StrSplit(name, absl::MaxSplits(':', 1));
  const std::string& kind = parts[0];
  double arg = 0;
  if (parts.size() == 2 && !absl::SimpleAtod(parts[1], &arg)) {
    return absl::InvalidArgumentError(absl::StrCat("schedule '", name, "': bad number '", parts[1], "'"));
  }
  if (kind == "attention" || kind == "linear") {
    if (parts.size() != 1) return absl::InvalidArgumentError(absl::StrCat("schedule '", name, "' takes no argument"));
    std::fill(m.begin(), m.end(), kind == "attention");
  } else if (kind == "mixed") {
    const double fraction = parts.size() == 2 ? arg : c.attn_fraction;
    if (fraction < 0 || fraction > 1) return absl::InvalidArgumentError("mixed:F needs F in [0, 1]");
    m = SampleModes(seed, sequence, len, c.fragment_len, fraction, ModeMixing::kFragment);
  } else if (kind == "lin-to-attn" || kind == "attn-to-lin") {
    if (parts.size() != 2 || arg < 0 || arg != std::floor(arg)) {
      return absl::InvalidArgumentError(absl::StrCat("schedule '", name, "' needs a position: ", kind, ":P"));
    }
    for (int64_t t = 0; t < len; ++t) m[t] = (t >= arg) == (kind == "lin-to-attn");
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown schedule '", name, "' (attention, linear, mixed[:F], lin-to-attn:P, attn-to-lin:P)"));
  }
  return m;
}

torch::Tensor ToTensor(const std::vector<int32_t>& ids, torch::Device device) {
  std::vector<int64_t> wide(ids.begin(), ids.end());
  return torch::from_blob(wide.data(), {1, static_cast<int64_t>(wide.size())}, torch::kInt64).clone().to(device);
}

torch::Tensor ModesTensor(const std::vector<uint8_t>& modes, torch::Device device) {
  return torch::from_blob(const_cast<uint8_t*>(modes.data()), {1, static_cast<int64_t>(modes.size())}, torch::kUInt8)
      .to(torch::kBool)
      .to(device);
}

double Fraction(const std::vector<uint8_t>& modes) {
  double n = 0;
  for (uint8_t m : modes) n += m;
  return modes.empty() ? 0 : n / modes.size();
}

}  // namespace

static absl::StatusOr<Json> EvalPerplexityImpl(const PplOptions& o) {
  ORYX_ASSIGN_OR_RETURN(Setup s, Open(o.common, o.data_dir));
  OryxModel& model = *s.model;
  const ModelConfig& c = model->config();
  const int64_t T = o.seq_len > 0 ? o.seq_len : std::min<int64_t>(c.max_position, 2048);
  if (T > c.max_position) {
    return absl::InvalidArgumentError(absl::StrCat("--seq-len ", T, " exceeds the model's max_position ", c.max_position));
  }
  const int64_t windows = s.val->NumSequences(T);
  const int64_t n = std::min(o.sequences, windows);
  if (n < 1) return absl::FailedPreconditionError(absl::StrCat(o.data_dir, ": validation split shorter than ", T + 1, " tokens"));
  torch::NoGradGuard no_grad;
  Json results = Json::array();
  for (const std::string& name : o.schedules) {
    torch::Tensor per_position = torch::zeros({T}, torch::kFloat64);
    double attention_tokens = 0;
    for (int64_t i = 0; i < n; ++i) {
      std::vector<int32_t> window(T + 1);
      ORYX_RETURN_IF_ERROR(s.val->ReadSequence(i * windows / n, T, window.data()));
      ORYX_ASSIGN_OR_RETURN(std::vector<uint8_t> modes, Schedule(name, T, c, o.common.seed, i));
      attention_tokens += Fraction(modes) * T;
      auto all = ToTensor(window, s.device);
      auto logits = model->Forward(all.narrow(1, 0, T), ModesTensor(modes, s.device)).to(torch::kFloat32);
      auto nll = torch::nn::functional::cross_entropy(logits.view({T, -1}), all.narrow(1, 1, T).view({T}),
                                                      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
      per_position += nll.to(torch::kCPU, torch::kFloat64);
    }
    per_position /= static_cast<double>(n);
    const double loss = per_position.mean().item<double>();
    Json r = {{"schedule", name}, {"loss", loss}, {"ppl", std::exp(loss)}, {"sequences", n}, {"seq_len", T},
              {"attention_fraction", attention_tokens / (n * T)}};
    if (o.per_position) {
      std::vector<double> curve(per_position.data_ptr<double>(), per_position.data_ptr<double>() + T);
      r["per_position_loss"] = curve;
    }
    results.push_back(r);
  }
  return Json{{"eval", "ppl"}, {"model", o.common.model_dir}, {"results", results}};
}

static absl::StatusOr<Json> EvalTaskImpl(const TaskEvalOptions& o) {
  ORYX_ASSIGN_OR_RETURN(Setup s, Open(o.common, o.data_dir));
  OryxModel& model = *s.model;
  const ModelConfig& c = model->config();
  ORYX_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(s.val->tokenizer_path()));
  ORYX_ASSIGN_OR_RETURN(TaskSetup setup, MakeTaskSetup(tok));
  ORYX_ASSIGN_OR_RETURN(tasks::TaskKind kind, tasks::ParseTaskKind(o.task == "niah" ? "niah_single"
                                                                   : o.task == "niah-multikey" ? "niah_multikey"
                                                                                               : o.task));
  setup.configs.mqar.num_pairs = o.mqar_pairs;
  for (int32_t len : o.lengths) {
    if (len > c.max_position) {
      return absl::InvalidArgumentError(absl::StrCat("length ", len, " exceeds the model's max_position ", c.max_position));
    }
  }
  CorpusHaystack haystack(&*s.val);
  std::vector<double> depths = kind == tasks::TaskKind::kMqar ? std::vector<double>{} : o.depths;
  ORYX_ASSIGN_OR_RETURN(std::vector<tasks::EvalPoint> grid, tasks::EvalGrid(o.lengths, depths, o.seeds, o.common.seed));
  torch::NoGradGuard no_grad;
  Json results = Json::array();
  for (const std::string& policy : o.policies) {
    if (policy != "attention" && policy != "linear" && policy != "prefill-linear") {
      return absl::InvalidArgumentError(absl::StrCat("unknown policy '", policy, "' (attention, linear, prefill-linear)"));
    }
    tasks::ScoreAggregator aggregate;
    double attention_tokens = 0, tokens = 0;
    for (const tasks::EvalPoint& p : grid) {
      ORYX_ASSIGN_OR_RETURN(tasks::TaskExample ex, tasks::MakeExample(kind, setup.configs, &haystack, p.length, p.depth, p.seed));
      const int64_t T = ex.length();
      std::vector<uint8_t> modes(T, policy == "attention");
      if (policy == "prefill-linear") {
        for (int64_t t = ex.prompt_length - 1; t < T; ++t) modes[t] = 1;
      }
      attention_tokens += Fraction(modes) * T;
      tokens += T;
      auto ids = ToTensor(ex.ids, s.device);
      auto logits = model->Forward(ids, ModesTensor(modes, s.device)).to(torch::kFloat32)[0];  // [T, V]
      auto predicted_t = logits.argmax(-1).to(torch::kCPU, torch::kInt32).contiguous();
      std::vector<int32_t> predicted(predicted_t.data_ptr<int32_t>(), predicted_t.data_ptr<int32_t>() + T);
      auto log_probs = torch::log_softmax(logits.narrow(0, 0, T - 1), -1)
                           .gather(1, ids[0].narrow(0, 1, T - 1).unsqueeze(1))
                           .squeeze(1)
                           .to(torch::kCPU, torch::kFloat32)
                           .contiguous();
      std::vector<float> target_lp(log_probs.data_ptr<float>(), log_probs.data_ptr<float>() + T - 1);
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

static absl::StatusOr<Json> EvalAgreementImpl(const AgreementOptions& o) {
  ORYX_ASSIGN_OR_RETURN(Setup s, Open(o.common, o.data_dir));
  OryxModel& model = *s.model;
  const int64_t span = o.prompt_tokens + o.gen_tokens + o.k + 1;
  if (o.k < 1 || o.prompts < 1 || o.prompt_tokens < 1 || o.gen_tokens < 1) {
    return absl::InvalidArgumentError("agreement needs k, prompts, prompt and generated tokens >= 1");
  }
  if (span > model->config().max_position) {
    return absl::InvalidArgumentError(absl::StrCat("prompt + generated + k + 1 = ", span,
                                                   " tokens exceed the model's max_position ", model->config().max_position));
  }
  const int64_t windows = s.val->NumSequences(o.prompt_tokens);
  if (windows < 1) return absl::FailedPreconditionError("validation split shorter than one prompt");
  torch::NoGradGuard no_grad;
  auto on = [&](bool attn) { return torch::full({1}, attn, torch::dtype(torch::kBool).device(s.device)); };
  auto token = [&](int64_t id) { return torch::full({1}, id, torch::dtype(torch::kInt64).device(s.device)); };
  std::vector<int64_t> accepted_at(o.k, 0), drafted_at(o.k, 0);
  int64_t rounds = 0, drafted = 0, accepted = 0, produced = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t p = 0; p < o.prompts; ++p) {
    std::vector<int32_t> prompt(o.prompt_tokens + 1);
    ORYX_RETURN_IF_ERROR(s.val->ReadSequence(p * windows / o.prompts, o.prompt_tokens, prompt.data()));
    OryxModelImpl::State state = model->InitialState(1);
    // Attention-mode prefill of all but the last prompt token; that one is the pending token x.
    for (int64_t t = 0; t + 1 < o.prompt_tokens; ++t) model->StepReference(token(prompt[t]), on(true), state);
    int64_t x = prompt[o.prompt_tokens - 1];
    int64_t generated = 0;
    while (generated < o.gen_tokens) {
      // Propose: k tokens in linear mode from a copy of the state.
      OryxModelImpl::State draft_state = state;
      for (auto& l : draft_state.layers) {
        l = {l.k_cache.clone(), l.v_cache.clone(), l.s.clone(), l.conv.clone()};
      }
      std::vector<int64_t> drafts;
      int64_t d = x;
      for (int64_t i = 0; i < o.k; ++i) {
        d = model->StepReference(token(d), on(false), draft_state).argmax(-1).item<int64_t>();
        drafts.push_back(d);
      }
      // Verify in attention mode token by token, stopping at the first mismatch (greedy acceptance):
      // the state then holds exactly the committed tokens, and the attention prediction at the
      // mismatch is the recovered token (or the bonus token when all k are accepted).
      int64_t n_accepted = 0, next = x;
      for (int64_t i = 0; i <= o.k; ++i) {
        next = model->StepReference(token(i == 0 ? x : drafts[i - 1]), on(true), state).argmax(-1).item<int64_t>();
        if (i == o.k || next != drafts[i]) break;
        ++n_accepted;
      }
      for (int64_t i = 0; i < o.k && i <= n_accepted; ++i) {
        ++drafted_at[i];
        if (i < n_accepted) ++accepted_at[i];
      }
      ++rounds;
      drafted += o.k;
      accepted += n_accepted;
      generated += n_accepted + 1;
      x = next;
    }
    produced += generated;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::vector<double> per_position(o.k);
  for (int64_t i = 0; i < o.k; ++i) per_position[i] = drafted_at[i] ? double(accepted_at[i]) / drafted_at[i] : 0.0;
  return Json{{"eval", "agreement"}, {"model", o.common.model_dir}, {"k", o.k}, {"prompts", o.prompts},
              {"prompt_tokens", o.prompt_tokens}, {"gen_tokens", o.gen_tokens}, {"rounds", rounds},
              {"drafted", drafted}, {"accepted", accepted}, {"acceptance_rate", double(accepted) / drafted},
              {"mean_accepted_per_round", double(accepted) / rounds},
              {"tokens_per_round", double(produced) / rounds},
              {"per_position_acceptance", per_position},
              {"note", "per_position_acceptance[i]: P(draft i+1 accepted | drafts 1..i accepted)"},
              {"seconds", seconds}};
}

// LibTorch reports errors by exception; the evaluation API reports them as Status.
template <typename Fn>
absl::StatusOr<Json> Guarded(Fn fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<Json> EvalPerplexity(const PplOptions& o) { return Guarded([&] { return EvalPerplexityImpl(o); }); }
absl::StatusOr<Json> EvalTask(const TaskEvalOptions& o) { return Guarded([&] { return EvalTaskImpl(o); }); }
absl::StatusOr<Json> EvalAgreement(const AgreementOptions& o) { return Guarded([&] { return EvalAgreementImpl(o); }); }

}  // namespace oryx::train
