#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "engine/checkpoint.h"
#include "engine/mode_policy.h"
#include "engine/status_macros.h"
#include "engine/str_cat.h"

namespace oryx {

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

void CountModes(std::span<const Mode> modes, GenerateStats& stats) {
  for (Mode m : modes) ++(m == Mode::kAttention ? stats.attention_tokens : stats.linear_tokens);
}

// The built-in decoder: one token per step, its mode from a ModePolicy.
class ScheduleDecoder final : public StepwiseDecoder {
 public:
  explicit ScheduleDecoder(ModePolicy policy) : policy_(std::move(policy)) {}
  void PrefillModes(std::span<const int32_t> prompt, int64_t begin, std::span<Mode> modes) const override {
    for (size_t t = 0; t < modes.size(); ++t) modes[t] = policy_.ModeAt(begin + t, static_cast<int64_t>(prompt.size()));
  }

 protected:
  Mode ChooseMode(const DecodeSlot& s, int64_t) override { return policy_.ModeAt(s.seq->position(), s.prompt_len); }

 private:
  ModePolicy policy_;
};

// The state of one request while it runs.
struct Running {
  const GenerateRequest* request = nullptr;
  std::vector<int32_t> prompt;
  Decoder* decoder = nullptr;
  std::optional<SequenceState> seq;
  std::optional<Sampler> sampler;
  DecodeSlot slot;
  GenerateResult result;
  bool done = false;
  size_t longest_stop = 0;
};

}  // namespace

int64_t DecodeSlot::LatestEarlierMatch(int64_t len) const {
  const int64_t n = context_size();
  for (int64_t s = n - len - 1; s >= 0 && len > 0; --s) {
    bool match = true;
    for (int64_t j = 0; j < len && match; ++j) match = context_token(s + j) == context_token(n - len + j);
    if (match) return s;
  }
  return -1;
}

absl::Status StepwiseDecoder::Step(Backend& backend, std::span<DecodeSlot* const> slots) {
  const size_t n = slots.size();
  const bool observe = ObservesLogits();
  modes_.resize(n);
  logits_.resize(n);
  next_.resize(n);
  items_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    DecodeSlot& s = *slots[i];
    modes_[i] = ChooseMode(s, static_cast<int64_t>(n));
    items_[i] = {s.seq, std::span(&s.pending, 1), std::span(&modes_[i], 1), LogitsRows::kLast,
                 observe ? &logits_[i] : nullptr, false, s.sampler, &next_[i]};
  }
  ORYX_RETURN_IF_ERROR(backend.Forward(items_));
  for (size_t i = 0; i < n; ++i) {
    DecodeSlot& s = *slots[i];
    CountModes(std::span(&modes_[i], 1), *s.stats);
    if (observe) Observe(s, modes_[i], logits_[i]);
    s.emitted.assign(1, next_[i]);
  }
  return absl::OkStatus();
}

std::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kEos:
      return "eos";
  }
  return "length";
}

double GenerateStats::attention_fraction() const {
  const int64_t total = attention_tokens + linear_tokens;
  return total == 0 ? 0.0 : static_cast<double>(attention_tokens) / static_cast<double>(total);
}

nlohmann::json ToJson(const GenerateResult& r) {
  const GenerateStats& s = r.stats;
  nlohmann::json stats = {
      {"prompt_tokens", s.prompt_tokens},
      {"generated_tokens", s.generated_tokens},
      {"attention_tokens", s.attention_tokens},
      {"linear_tokens", s.linear_tokens},
      {"attention_fraction", s.attention_fraction()},
      {"prefill_tokens_per_s", s.prefill_s > 0 ? static_cast<double>(s.prompt_tokens) / s.prefill_s : 0.0},
      // The first generated token comes out of the prefill; decoding makes the rest.
      {"decode_tokens_per_s",
       s.decode_s > 0 ? static_cast<double>(std::max<int64_t>(s.generated_tokens - 1, 0)) / s.decode_s : 0.0},
  };
  if (s.spec) {
    const SpecStats& sp = *s.spec;
    stats["spec"] = {
        {"rounds", sp.rounds},
        {"drafted", sp.drafted},
        {"accepted", sp.accepted},
        {"acceptance_rate", sp.drafted > 0 ? static_cast<double>(sp.accepted) / sp.drafted : 0.0},
        {"mean_accepted_per_round", sp.rounds > 0 ? static_cast<double>(sp.accepted) / sp.rounds : 0.0},
        {"drafted_at", sp.drafted_at},
        {"accepted_at", sp.accepted_at},
        {"draft_s", sp.draft_s},
        {"verify_s", sp.verify_s},
        {"draft_forwards", sp.draft_forwards},
        {"backend_rounds", sp.backend_rounds},
        {"backend_round_s", sp.backend_round_s},
        {"verify_forwards", sp.verify_forwards},
    };
  }
  return {{"text", r.text},
          {"tokens", r.tokens},
          {"finish_reason", FinishReasonName(r.finish_reason)},
          {"policy", r.policy},
          {"stats", stats}};
}

PolicyRegistry::PolicyRegistry() {
  auto schedule = [](std::string_view name) -> absl::StatusOr<std::unique_ptr<Decoder>> {
    ORYX_ASSIGN_OR_RETURN(ModePolicy policy, ModePolicy::Parse(name));
    return std::unique_ptr<Decoder>(new ScheduleDecoder(std::move(policy)));
  };
  Register("attention", "attention", schedule);
  Register("linear", "linear", schedule);
  Register("prefill-linear", "prefill-linear", schedule);
  Register("periodic", "periodic:N", schedule);
}

void PolicyRegistry::Register(std::string prefix, std::string usage, Factory factory) {
  for (Entry& e : entries_) {
    if (e.prefix == prefix) {
      e = {std::move(prefix), std::move(usage), std::move(factory)};
      return;
    }
  }
  entries_.push_back({std::move(prefix), std::move(usage), std::move(factory)});
}

absl::StatusOr<std::unique_ptr<Decoder>> PolicyRegistry::Make(std::string_view policy) const {
  for (const Entry& e : entries_) {
    if (policy == e.prefix || (policy.starts_with(e.prefix) && policy.size() > e.prefix.size() &&
                               policy[e.prefix.size()] == ':')) {
      return e.factory(policy);
    }
  }
  std::string known;
  for (const Entry& e : entries_) known += (known.empty() ? "" : ", ") + e.usage;
  return absl::InvalidArgumentError(Cat("unknown policy '", policy, "' (", known, ")"));
}

Engine::Engine(std::unique_ptr<Backend> backend, std::optional<Tokenizer> tokenizer)
    : backend_(std::move(backend)), tokenizer_(std::move(tokenizer)) {}
Engine::Engine(Engine&&) noexcept = default;
Engine::~Engine() = default;

absl::StatusOr<Engine> Engine::Load(const std::string& model_dir, const BackendOptions& options) {
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, LoadBackend(model_dir, options));
  ORYX_ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::Load(Cat(model_dir, "/", kTokenizerFileName)));
  if (tokenizer.vocab_size() > backend->config().vocab_size) {
    return absl::InvalidArgumentError(Cat(model_dir, ": the tokenizer has ", tokenizer.vocab_size(),
                                          " pieces but the model's vocabulary is ", backend->config().vocab_size));
  }
  return Engine(std::move(backend), std::move(tokenizer));
}

absl::StatusOr<GenerateResult> Engine::Generate(const GenerateRequest& request) {
  ORYX_ASSIGN_OR_RETURN(std::vector<GenerateResult> results, Generate(std::span(&request, 1)));
  return std::move(results[0]);
}

absl::StatusOr<std::vector<GenerateResult>> Engine::Generate(std::span<const GenerateRequest> requests) {
  const ModelConfig& c = backend_->config();
  const int64_t R = static_cast<int64_t>(requests.size());
  if (R == 0) return absl::InvalidArgumentError("generate: no requests");
  std::vector<Running> run(R);
  std::map<std::string, std::unique_ptr<Decoder>, std::less<>> decoders;  // one per policy name
  for (int64_t i = 0; i < R; ++i) {
    const GenerateRequest& q = requests[i];
    Running& r = run[i];
    auto bad = [&](std::string_view what) {
      return absl::InvalidArgumentError(R > 1 ? Cat("request ", i, ": ", what) : std::string(what));
    };
    r.request = &q;
    if (!q.prompt_tokens.empty()) {
      r.prompt = q.prompt_tokens;
    } else if (!q.prompt.empty()) {
      if (!tokenizer_) return bad("a text prompt needs a model with a tokenizer; give prompt tokens instead");
      r.prompt.push_back(kBosId);
      tokenizer_->EncodeAppend(q.prompt, &r.prompt);
    } else {
      return bad("empty prompt");
    }
    const int64_t n = static_cast<int64_t>(r.prompt.size());
    if (n >= c.max_position) {
      return bad(Cat("the prompt is ", n, " tokens; this model takes at most ", c.max_position - 1,
                     " so that at least one token can be generated"));
    }
    for (int32_t t : r.prompt) {
      if (t < 0 || t >= c.vocab_size) return bad(Cat("prompt token id ", t, " outside the vocabulary"));
    }
    if (q.max_tokens < 1) return bad(Cat("max_tokens must be >= 1, got ", q.max_tokens));
    if (absl::Status s = ValidateSampling(q.sampling); !s.ok()) return bad(std::string(s.message()));
    for (const std::string& stop : q.stop) {
      if (stop.empty()) return bad("empty stop string");
      r.longest_stop = std::max(r.longest_stop, stop.size());
    }
    auto it = decoders.find(q.policy);
    if (it == decoders.end()) {
      auto made = policies_.Make(q.policy);
      if (!made.ok()) return bad(std::string(made.status().message()));
      it = decoders.emplace(q.policy, std::move(*made)).first;
    }
    r.decoder = it->second.get();
    ORYX_ASSIGN_OR_RETURN(SequenceState seq, backend_->TryNewSequence());
    r.seq.emplace(std::move(seq));
    ORYX_RETURN_IF_ERROR(r.seq->Reserve(std::min(c.max_position, n + q.max_tokens + r.decoder->Lookahead())));
    r.sampler.emplace(q.sampling);
    r.result.policy = q.policy;
    r.result.stats.prompt_tokens = n;
    r.slot = {i, &*r.seq, 0, n, &r.prompt, &r.result.tokens, q.max_tokens, &*r.sampler, &r.result.stats, {}};
  }

  // Emits one token into request i's result; false once the request is finished.
  auto emit = [&](int64_t i, int32_t token) {
    Running& r = run[i];
    GenerateResult& out = r.result;
    if (r.request->stop_at_eos && token == kEosId) {
      out.finish_reason = FinishReason::kEos;
      return false;
    }
    out.tokens.push_back(token);
    out.stats.generated_tokens = static_cast<int64_t>(out.tokens.size());
    const size_t old_size = out.text.size();
    // Decoding concatenates piece texts, so the new token's text is appended as is.
    if (tokenizer_) out.text += tokenizer_->Decode(std::span(&token, 1));
    bool stopped = false;
    const size_t from = old_size >= r.longest_stop ? old_size - r.longest_stop + 1 : 0;
    size_t cut = std::string::npos;
    for (const std::string& stop : r.request->stop) cut = std::min(cut, out.text.find(stop, from));
    if (cut != std::string::npos) {
      out.text.resize(cut);
      stopped = true;
    }
    if (r.request->on_token && out.text.size() >= old_size) {
      const TokenEvent event{i, token, std::string_view(out.text).substr(old_size)};
      stopped |= !r.request->on_token(event);
    }
    if (stopped) {
      out.finish_reason = FinishReason::kStop;
      return false;
    }
    r.slot.pending = token;
    r.slot.remaining = r.request->max_tokens - out.stats.generated_tokens;
    // A sequence holds at most max_position tokens, the last generated one included.
    if (r.slot.remaining <= 0 || r.slot.prompt_len + out.stats.generated_tokens >= c.max_position) {
      out.finish_reason = FinishReason::kLength;
      return false;
    }
    return true;
  };

  // Prefill every prompt in chunks, all requests in one batch per chunk; sample each first token.
  const auto prefill_start = Clock::now();
  {
    std::vector<std::vector<Mode>> modes(R);
    std::vector<int32_t> first(R);  // each prompt's first generated token, drawn by the backend
    std::vector<ForwardItem> items;
    const int64_t span = backend_->PrefillSpan(R);  // prompt tokens per forward
    for (int64_t done = 0;; done += span) {
      items.clear();
      for (int64_t i = 0; i < R; ++i) {
        const int64_t n = static_cast<int64_t>(run[i].prompt.size());
        if (done >= n) continue;
        const int64_t len = std::min(span, n - done);
        modes[i].resize(len);
        run[i].decoder->PrefillModes(run[i].prompt, done, modes[i]);
        CountModes(modes[i], run[i].result.stats);
        const bool last = done + len == n;
        items.push_back({&*run[i].seq, std::span(run[i].prompt).subspan(done, len), modes[i],
                         last ? LogitsRows::kLast : LogitsRows::kNone, nullptr, false,
                         last ? &*run[i].sampler : nullptr, &first[i]});
      }
      if (items.empty()) break;
      ORYX_RETURN_IF_ERROR(backend_->Forward(items));
    }
    for (int64_t i = 0; i < R; ++i) run[i].done = !emit(i, first[i]);
  }
  const double prefill_s = Seconds(prefill_start);

  // Decode: each decoder steps its unfinished requests together until none is left.
  const auto decode_start = Clock::now();
  std::vector<DecodeSlot*> slots;
  for (;;) {
    bool any = false;
    for (auto& [name, decoder] : decoders) {
      slots.clear();
      for (Running& r : run) {
        if (!r.done && r.decoder == decoder.get()) slots.push_back(&r.slot);
      }
      if (slots.empty()) continue;
      any = true;
      ORYX_RETURN_IF_ERROR(decoder->Step(*backend_, slots));
      for (DecodeSlot* s : slots) {
        for (int32_t token : s->emitted) {
          if (!emit(s->id, token)) {
            run[s->id].done = true;
            break;
          }
        }
      }
    }
    if (!any) break;
  }
  const double decode_s = Seconds(decode_start);

  std::vector<GenerateResult> results;
  for (Running& r : run) {
    r.result.stats.prefill_s = prefill_s;
    r.result.stats.decode_s = decode_s;
    results.push_back(std::move(r.result));
  }
  return results;
}

}  // namespace oryx
