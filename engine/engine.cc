#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "engine/checkpoint.h"
#include "engine/mode_policy.h"
#include "base/status_macros.h"
#include "base/str_cat.h"

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

absl::Status StepDecoder(Decoder& decoder, Backend& backend, std::span<DecodeSlot* const> slots) {
  ORYX_ASSIGN_OR_RETURN(const bool ran, decoder.RunAlone(backend, slots));
  if (ran) return absl::OkStatus();
  std::vector<ForwardItem> items;
  ORYX_RETURN_IF_ERROR(decoder.Plan(backend, slots, items));
  if (!items.empty()) ORYX_RETURN_IF_ERROR(backend.Forward(items));
  return decoder.Finish(slots);
}

absl::Status StepwiseDecoder::Plan(const Backend&, std::span<DecodeSlot* const> slots,
                                   std::vector<ForwardItem>& items) {
  const size_t n = slots.size();
  const bool observe = ObservesLogits();
  modes_.resize(n);
  logits_.resize(n);
  next_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    DecodeSlot& s = *slots[i];
    modes_[i] = ChooseMode(s, static_cast<int64_t>(n));
    items.push_back({s.seq, std::span(&s.pending, 1), std::span(&modes_[i], 1), LogitsRows::kLast,
                     observe ? &logits_[i] : nullptr, false, s.sampler, &next_[i]});
  }
  return absl::OkStatus();
}

absl::Status StepwiseDecoder::Finish(std::span<DecodeSlot* const> slots) {
  const bool observe = ObservesLogits();
  for (size_t i = 0; i < slots.size(); ++i) {
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
      {"cached_tokens", s.cached_tokens},
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
        {"rounds_by_length", sp.rounds_by_length},
        {"round_s_by_length", sp.round_s_by_length},
    };
  }
  return {{"text", r.text},
          {"tokens", r.tokens},
          {"finish_reason", FinishReasonName(r.finish_reason)},
          {"policy", r.policy},
          {"stats", stats}};
}

nlohmann::json ToJson(const PrefixCacheStats& s) {
  return {{"lookups", s.lookups},     {"lookup_tokens", s.lookup_tokens}, {"hit_tokens", s.hit_tokens},
          {"hit_rate", s.hit_rate()}, {"snapshots", s.snapshots},         {"bytes", s.bytes},
          {"inserted", s.inserted},   {"evicted", s.evicted}};
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
    : backend_(std::move(backend)), tokenizer_(std::move(tokenizer)), prefix_cache_(std::make_unique<PrefixCache>()) {}
Engine::Engine(Engine&&) noexcept = default;
Engine::~Engine() = default;

void Engine::set_prefix_cache(std::optional<PrefixCacheOptions> options) {
  prefix_cache_ = options ? std::make_unique<PrefixCache>(*options) : nullptr;
}

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
  const int64_t R = static_cast<int64_t>(requests.size());
  if (R == 0) return absl::InvalidArgumentError("generate: no requests");
  GenerationBatch batch(*this);
  for (int64_t i = 0; i < R; ++i) {
    if (absl::StatusOr<int64_t> id = batch.Add(requests[i]); !id.ok()) {
      if (R == 1) return id.status();
      return absl::Status(id.status().code(), Cat("request ", i, ": ", id.status().message()));
    }
  }
  while (batch.active() > 0) ORYX_RETURN_IF_ERROR(batch.Step());
  std::vector<GenerateResult> results(R);
  for (auto& [id, result] : batch.TakeFinished()) results[id] = std::move(result);
  return results;
}

// ---------------------------------------------------------------------------------------------------------
// GenerationBatch

struct GenerationBatch::Request {
  GenerateRequest request;
  std::vector<int32_t> prompt;
  Decoder* decoder = nullptr;
  std::optional<SequenceState> seq;
  std::optional<Sampler> sampler;
  DecodeSlot slot;
  GenerateResult result;
  size_t longest_stop = 0;
  int64_t prefilled = 0;  // prompt tokens forwarded (or restored from the prefix cache) so far
  bool started = false;   // its prefill has begun (StartPrefill)
  std::vector<Mode> modes;  // the prompt's, from its decoder
  std::vector<int64_t> snapshot_at;  // positions still to snapshot for the prefix cache, ascending
  int32_t first = 0;  // the first generated token, drawn by the backend with the prompt's last span
  Clock::time_point prefill_start, decode_start;
  bool decoding() const { return prefilled == static_cast<int64_t>(prompt.size()); }
};

int64_t GenerationBatch::RoomFor(const Request& r) const {
  // Room for the prompt and the first generated tokens up front; a long generation grows the sequence as it
  // goes (geometrically), so a request that asks for many tokens does not hold their memory from the start
  // (a server's capacity is the memory its requests use, not what they may use).
  constexpr int64_t kReservedAhead = 1024;
  const int64_t n = static_cast<int64_t>(r.prompt.size());
  return std::min(engine_.backend_->config().max_position,
                  n + std::min(r.request.max_tokens, kReservedAhead) + r.decoder->Lookahead());
}

GenerationBatch::GenerationBatch(Engine& engine, int64_t max_prefill_tokens)
    : engine_(engine), max_prefill_tokens_(max_prefill_tokens) {}
GenerationBatch::~GenerationBatch() = default;

int64_t GenerationBatch::decoding() const {
  int64_t n = 0;
  for (const auto& [id, r] : active_) n += r->decoding();
  return n;
}

absl::StatusOr<int64_t> GenerationBatch::Add(GenerateRequest request) {
  const ModelConfig& c = engine_.backend_->config();
  auto r = std::make_unique<Request>();
  r->request = std::move(request);
  const GenerateRequest& q = r->request;
  if (!q.prompt_tokens.empty()) {
    r->prompt = q.prompt_tokens;
  } else if (!q.prompt.empty()) {
    if (!engine_.tokenizer_) {
      return absl::InvalidArgumentError("a text prompt needs a model with a tokenizer; give prompt tokens instead");
    }
    r->prompt.push_back(kBosId);
    engine_.tokenizer_->EncodeAppend(q.prompt, &r->prompt);
  } else {
    return absl::InvalidArgumentError("empty prompt");
  }
  const int64_t n = static_cast<int64_t>(r->prompt.size());
  if (n >= c.max_position) {
    return absl::InvalidArgumentError(Cat("the prompt is ", n, " tokens; this model takes at most ",
                                          c.max_position - 1, " so that at least one token can be generated"));
  }
  for (int32_t t : r->prompt) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(Cat("prompt token id ", t, " outside the vocabulary"));
    }
  }
  if (q.max_tokens < 1) return absl::InvalidArgumentError(Cat("max_tokens must be >= 1, got ", q.max_tokens));
  ORYX_RETURN_IF_ERROR(ValidateSampling(q.sampling));
  for (const std::string& stop : q.stop) {
    if (stop.empty()) return absl::InvalidArgumentError("empty stop string");
    r->longest_stop = std::max(r->longest_stop, stop.size());
  }
  auto it = decoders_.find(q.policy);
  if (it == decoders_.end()) {
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> made, engine_.policies_.Make(q.policy));
    it = decoders_.emplace(q.policy, std::move(made)).first;
  }
  r->decoder = it->second.get();
  ORYX_ASSIGN_OR_RETURN(SequenceState seq, engine_.backend_->TryNewSequence());
  r->seq.emplace(std::move(seq));
  ORYX_RETURN_IF_ERROR(r->seq->Reserve(RoomFor(*r)));
  r->sampler.emplace(q.sampling);
  r->result.policy = q.policy;
  r->result.stats.prompt_tokens = n;
  const int64_t id = next_id_++;
  r->slot = {id, &*r->seq, 0, n, &r->prompt, &r->result.tokens, q.max_tokens, &*r->sampler, &r->result.stats, {}};
  active_.emplace(id, std::move(r));
  return id;
}

bool GenerationBatch::Emit(Request& r, int32_t token) {
  const Tokenizer* tokenizer = engine_.tokenizer_ ? &*engine_.tokenizer_ : nullptr;
  GenerateResult& out = r.result;
  if (r.request.stop_at_eos && token == kEosId) {
    out.finish_reason = FinishReason::kEos;
    return false;
  }
  out.tokens.push_back(token);
  out.stats.generated_tokens = static_cast<int64_t>(out.tokens.size());
  const size_t old_size = out.text.size();
  // Decoding concatenates piece texts, so the new token's text is appended as is.
  if (tokenizer != nullptr) out.text += tokenizer->Decode(std::span(&token, 1));
  bool stopped = false;
  const size_t from = old_size >= r.longest_stop ? old_size - r.longest_stop + 1 : 0;
  size_t cut = std::string::npos;
  for (const std::string& stop : r.request.stop) cut = std::min(cut, out.text.find(stop, from));
  if (cut != std::string::npos) {
    out.text.resize(cut);
    stopped = true;
  }
  if (r.request.on_token && out.text.size() >= old_size) {
    const TokenEvent event{r.slot.id, token, std::string_view(out.text).substr(old_size)};
    stopped |= !r.request.on_token(event);
  }
  if (stopped) {
    out.finish_reason = FinishReason::kStop;
    return false;
  }
  r.slot.pending = token;
  r.slot.remaining = r.request.max_tokens - out.stats.generated_tokens;
  // A sequence holds at most max_position tokens, the last generated one included.
  const int64_t max_position = engine_.backend_->config().max_position;
  if (r.slot.remaining <= 0 || r.slot.prompt_len + out.stats.generated_tokens >= max_position) {
    out.finish_reason = FinishReason::kLength;
    return false;
  }
  return true;
}

void GenerationBatch::Finish(int64_t id) {
  auto it = active_.find(id);
  Request& r = *it->second;
  r.result.stats.decode_s = Seconds(r.decode_start);
  r.decoder->Release(id);
  finished_.emplace_back(id, std::move(r.result));
  active_.erase(it);  // frees the sequence
}

void GenerationBatch::EmitStep(std::span<DecodeSlot* const> slots) {
  done_.clear();
  for (DecodeSlot* s : slots) {
    Request& r = *active_.at(s->id);
    for (int32_t token : s->emitted) {
      if (!Emit(r, token)) {
        done_.push_back(s->id);
        break;
      }
    }
  }
  for (int64_t id : done_) Finish(id);
}

void GenerationBatch::DecodingSlots(const Decoder* decoder, std::vector<DecodeSlot*>& slots) {
  slots.clear();
  for (auto& [id, r] : active_) {
    if (r->decoder == decoder && r->decoding()) slots.push_back(&r->slot);
  }
}

bool GenerationBatch::StartPrefill(Request& r) {
  const int64_t n = static_cast<int64_t>(r.prompt.size());
  r.modes.resize(n);
  r.decoder->PrefillModes(r.prompt, 0, r.modes);
  PrefixCache* cache = engine_.prefix_cache_.get();
  if (cache != nullptr) {
    const int64_t b = cache->options().block_tokens;
    // At least one prompt token is forwarded: its logits give the first generated token.
    const int64_t cached = cache->Longest(r.prompt, r.modes, n - 1);
    // An earlier prompt still being prefilled that shares a longer beginning: wait for its snapshot there.
    for (auto& [id, other] : active_) {
      Request& o = *other;
      if (&o == &r) break;  // only earlier ones, which never wait for this one
      if (!o.started || o.decoding()) continue;
      const int64_t limit = std::min<int64_t>(n - 1, static_cast<int64_t>(o.prompt.size()));
      int64_t shared = 0;
      while (shared < limit && r.prompt[shared] == o.prompt[shared] && r.modes[shared] == o.modes[shared]) ++shared;
      const int64_t point = shared / b * b;
      if (point > cached && point > o.prefilled) {
        if (!std::ranges::binary_search(o.snapshot_at, point)) {
          o.snapshot_at.insert(std::ranges::upper_bound(o.snapshot_at, point), point);
        }
        return false;
      }
    }
    // The restored sequence, with the room of the one made at Add, takes its place.
    PrefixCache::Hit hit = cache->Lookup(r.prompt, r.modes, n - 1, RoomFor(r));
    if (hit.state) {
      *r.seq = std::move(*hit.state);
      r.prefilled = hit.tokens;
      r.result.stats.cached_tokens = hit.tokens;
      CountModes(std::span(r.modes).first(hit.tokens), r.result.stats);
    }
    // Snapshot points: every snapshot_every tokens, the prompt's last block boundary (a later turn of a
    // conversation extends the prompt), and where it leaves the blocks of an earlier prompt (a third prompt
    // with that beginning resumes there).
    const int64_t every = cache->options().snapshot_every;
    for (int64_t p = (r.prefilled / every + 1) * every; p <= n; p += every) r.snapshot_at.push_back(p);
    for (const int64_t p : {n / b * b, cache->Seen(r.prompt, r.modes, n)}) {
      if (p > r.prefilled && !std::ranges::binary_search(r.snapshot_at, p)) {
        r.snapshot_at.insert(std::ranges::upper_bound(r.snapshot_at, p), p);
      }
    }
    cache->Remember(r.prompt, r.modes);
  }
  r.started = true;
  r.prefill_start = Clock::now();
  return true;
}

void GenerationBatch::ChoosePrefillSpans(const Backend& backend) {
  prefilling_.clear();
  for (auto& [id, r] : active_) {
    if (!r->decoding() && (r->started || StartPrefill(*r))) prefilling_.push_back(r.get());
  }
  // With a token budget, the prompts added first take it; the rest wait for a later step.
  const int64_t span = prefilling_.empty() ? 0 : backend.PrefillSpan(static_cast<int64_t>(prefilling_.size()));
  prefill_lengths_.clear();
  for (int64_t left = max_prefill_tokens_ > 0 ? max_prefill_tokens_ : INT64_MAX; Request* r : prefilling_) {
    // A span ends at the next snapshot point, if any.
    const int64_t end = r->snapshot_at.empty() ? static_cast<int64_t>(r->prompt.size()) : r->snapshot_at.front();
    const int64_t len = std::min({span, end - r->prefilled, left});
    if (len == 0) break;
    prefill_lengths_.push_back(len);
    left -= len;
  }
  prefilling_.resize(prefill_lengths_.size());
}

void GenerationBatch::PlanPrefill() {
  for (size_t i = 0; i < prefilling_.size(); ++i) {
    Request& r = *prefilling_[i];
    const int64_t len = prefill_lengths_[i];
    const std::span<const Mode> modes = std::span(r.modes).subspan(r.prefilled, len);
    CountModes(modes, r.result.stats);
    const bool last = r.prefilled + len == static_cast<int64_t>(r.prompt.size());
    items_.push_back({&*r.seq, std::span(r.prompt).subspan(r.prefilled, len), modes,
                      last ? LogitsRows::kLast : LogitsRows::kNone, nullptr, false, last ? &*r.sampler : nullptr,
                      &r.first});
  }
}

void GenerationBatch::FinishPrefill() {
  done_.clear();
  for (size_t i = 0; i < prefilling_.size(); ++i) {
    Request& r = *prefilling_[i];
    r.prefilled += prefill_lengths_[i];
    if (!r.snapshot_at.empty() && r.snapshot_at.front() == r.prefilled) {
      r.snapshot_at.erase(r.snapshot_at.begin());
      engine_.prefix_cache_->Insert(std::span(r.prompt).first(r.prefilled), std::span(r.modes).first(r.prefilled),
                                    *r.seq);
    }
    if (!r.decoding()) continue;
    r.result.stats.prefill_s = Seconds(r.prefill_start);
    r.decode_start = Clock::now();
    if (!Emit(r, r.first)) done_.push_back(r.slot.id);
  }
  for (int64_t id : done_) Finish(id);
}

absl::Status GenerationBatch::Step() {
  Backend& backend = *engine_.backend_;
  last_step_decoded_ = last_step_shared_ = 0;
  // The work of this step: prefill spans, and every decoding request's step under its decoder.
  ChoosePrefillSpans(backend);
  stepping_.clear();
  for (auto& [name, decoder] : decoders_) {
    std::vector<DecodeSlot*> slots;
    DecodingSlots(decoder.get(), slots);
    if (!slots.empty()) stepping_.emplace_back(decoder.get(), std::move(slots));
  }
  for (const auto& [decoder, slots] : stepping_) last_step_decoded_ += static_cast<int64_t>(slots.size());
  if (stepping_.size() == 1 && (prefilling_.empty() || stepping_[0].first->RunsAlone(backend))) {
    auto& [decoder, slots] = stepping_[0];
    if (!prefilling_.empty()) {  // the prompts' spans first, by themselves
      items_.clear();
      PlanPrefill();
      ORYX_RETURN_IF_ERROR(backend.Forward(items_));
      FinishPrefill();
      prefilling_.clear();
    }
    ORYX_ASSIGN_OR_RETURN(const bool ran, decoder->RunAlone(backend, slots));
    if (ran) {
      EmitStep(slots);
      return absl::OkStatus();
    }
  }
  // One forward for all of it.
  items_.clear();
  PlanPrefill();
  if (!prefilling_.empty()) last_step_shared_ = last_step_decoded_;
  for (auto& [decoder, slots] : stepping_) ORYX_RETURN_IF_ERROR(decoder->Plan(backend, slots, items_));
  if (!items_.empty()) ORYX_RETURN_IF_ERROR(backend.Forward(items_));
  FinishPrefill();
  for (auto& [decoder, slots] : stepping_) {
    ORYX_RETURN_IF_ERROR(decoder->Finish(slots));
    EmitStep(slots);
  }
  return absl::OkStatus();
}

std::vector<std::pair<int64_t, GenerateResult>> GenerationBatch::TakeFinished() {
  std::vector<std::pair<int64_t, GenerateResult>> out;
  out.swap(finished_);
  return out;
}

}  // namespace oryx
