// The LibTorch side of evaluation: the reference model as a SequenceModel, and the token-by-token
// self-speculation agreement measurement on it.
#include <chrono>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "train/evaluate.h"
#include "train/model.h"
#include "train/shards.h"
#include "train/torch_io.h"

namespace oryx::train {

namespace {

using Json = nlohmann::json;

// LibTorch reports errors by exception; the evaluation API reports them as Status.
template <typename Fn>
auto Guarded(Fn fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
}

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
  if (!data_dir.empty()) {
    ORYX_ASSIGN_OR_RETURN(CorpusReader val, CorpusReader::Open(data_dir, "val"));
    s.val.emplace(std::move(val));
  }
  return s;
}

class TorchModel final : public SequenceModel {
 public:
  explicit TorchModel(Setup s) : s_(std::move(s)) {}
  const ModelConfig& config() const override { return (*s_.model)->config(); }
  absl::StatusOr<std::vector<float>> Logits(std::span<const int32_t> ids, std::span<const uint8_t> modes,
                                            int64_t first_row) override {
    return Guarded([&]() -> absl::StatusOr<std::vector<float>> {
      torch::NoGradGuard no_grad;
      const int64_t T = static_cast<int64_t>(ids.size());
      std::vector<int64_t> wide(ids.begin(), ids.end());
      auto x = torch::from_blob(wide.data(), {1, T}, torch::kInt64).clone().to(s_.device);
      auto m = torch::from_blob(const_cast<uint8_t*>(modes.data()), {1, T}, torch::kUInt8).to(torch::kBool).to(s_.device);
      auto logits = (*s_.model)->Forward(x, m).to(torch::kCPU, torch::kFloat32);
      logits = logits.reshape({T, -1}).slice(0, first_row).contiguous();
      return std::vector<float>(logits.data_ptr<float>(), logits.data_ptr<float>() + logits.numel());
    });
  }

 private:
  Setup s_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SequenceModel>> OpenTorchModel(const EvalCommon& common) {
  return Guarded([&]() -> absl::StatusOr<std::unique_ptr<SequenceModel>> {
    ORYX_ASSIGN_OR_RETURN(Setup s, Open(common, ""));
    return std::unique_ptr<SequenceModel>(new TorchModel(std::move(s)));
  });
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

absl::StatusOr<Json> EvalAgreement(const AgreementOptions& o) { return Guarded([&] { return EvalAgreementImpl(o); }); }

}  // namespace oryx::train
