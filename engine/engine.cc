#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>

#include "engine/checkpoint.h"
#include "engine/mode_policy.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "absl/strings/str_format.h"

namespace oryx {

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }
std::string MiB(int64_t bytes) { return absl::StrFormat("%.2f", static_cast<double>(bytes) / (1 << 20)); }

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
  const bool observe = ObservesStats();
  modes_.resize(n);
  stats_.resize(n);
  next_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    DecodeSlot& s = *slots[i];
    modes_[i] = ChooseMode(s, static_cast<int64_t>(n));
    items.push_back({.seq = s.seq,
                     .tokens = std::span(&s.pending, 1),
                     .modes = std::span(&modes_[i], 1),
                     .sampler = s.sampler,
                     .next_token = &next_[i],
                     .stats_out = observe ? &stats_[i] : nullptr});
  }
  return absl::OkStatus();
}

absl::Status StepwiseDecoder::Finish(std::span<DecodeSlot* const> slots) {
  const bool observe = ObservesStats();
  for (size_t i = 0; i < slots.size(); ++i) {
    DecodeSlot& s = *slots[i];
    CountModes(std::span(&modes_[i], 1), *s.stats);
    if (observe) Observe(s, modes_[i], stats_[i]);
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
      {"preemptions", s.preemptions},
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
  nlohmann::json j = {{"text", r.text},
                      {"tokens", r.tokens},
                      {"finish_reason", FinishReasonName(r.finish_reason)},
                      {"policy", r.policy},
                      {"stats", stats}};
  const auto logprobs = [](const std::vector<TokenLogProb>& entries) {
    nlohmann::json list = nlohmann::json::array();
    for (const TokenLogProb& t : entries) {
      nlohmann::json top = nlohmann::json::array();
      for (const auto& [token, lp] : t.top) top.push_back({token, lp});
      list.push_back({{"token", t.token}, {"logprob", t.logprob ? nlohmann::json(*t.logprob) : nlohmann::json()},
                      {"top", top}});
    }
    return list;
  };
  if (!r.logprobs.empty()) j["logprobs"] = logprobs(r.logprobs);
  if (!r.prompt_logprobs.empty()) j["prompt_logprobs"] = logprobs(r.prompt_logprobs);
  return j;
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

namespace {
// PolicyRegistry::Make's own prefix: drafted:POLICY is POLICY's decoder with Decoder::DraftAttentionSteps.
constexpr std::string_view kDrafted = "drafted";
// Whether `policy` is `prefix` followed by ':' and its arguments.
bool TakesArguments(std::string_view policy, std::string_view prefix) {
  return policy.size() > prefix.size() && policy.starts_with(prefix) && policy[prefix.size()] == ':';
}
}  // namespace

bool PolicyRegistry::Has(std::string_view prefix) const {
  return prefix == kDrafted || std::ranges::any_of(entries_, [&](const Entry& e) { return e.prefix == prefix; });
}

std::vector<std::pair<std::string, std::string>> PolicyRegistry::Usages() const {
  std::vector<std::pair<std::string, std::string>> usages;
  for (const Entry& e : entries_) usages.emplace_back(e.prefix, e.usage);
  usages.emplace_back(kDrafted, Cat(kDrafted, ":POLICY"));
  return usages;
}

absl::StatusOr<std::unique_ptr<Decoder>> PolicyRegistry::Make(std::string_view policy) const {
  if (TakesArguments(policy, kDrafted)) {
    absl::StatusOr<std::unique_ptr<Decoder>> decoder = Make(policy.substr(kDrafted.size() + 1));
    absl::Status s = decoder.ok() ? (*decoder)->DraftAttentionSteps() : decoder.status();
    if (!s.ok()) return absl::InvalidArgumentError(Cat("policy '", policy, "': ", s.message()));
    return decoder;
  }
  for (const Entry& e : entries_) {
    if (policy == e.prefix || TakesArguments(policy, e.prefix)) {
      return e.factory(policy);
    }
  }
  std::string known;
  for (const Entry& e : entries_) known += (known.empty() ? "" : ", ") + e.usage;
  return absl::InvalidArgumentError(Cat("unknown policy '", policy, "' (", known, ", ", kDrafted, ":POLICY)"));
}

Engine::Engine(std::unique_ptr<Backend> backend, std::optional<Tokenizer> tokenizer)
    : backend_(std::move(backend)), tokenizer_(std::move(tokenizer)) {
  set_prefix_cache(PrefixCacheOptions{.snapshot_every = 0});
}
Engine::Engine(Engine&&) noexcept = default;
Engine::~Engine() = default;

void Engine::set_prefix_cache(std::optional<PrefixCacheOptions> options) {
  if (options && options->snapshot_every == 0) {
    const int64_t b = options->block_tokens, span = std::max<int64_t>(2048, backend_->PrefillSpan(1));
    options->snapshot_every = (span + b - 1) / b * b;
  }
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
  while (batch.active() > 0) {
    ORYX_RETURN_IF_ERROR(batch.Step());
    for (auto& [id, status] : batch.TakeFailed()) {
      return R == 1 ? status : absl::Status(status.code(), Cat("request ", id, ": ", status.message()));
    }
  }
  std::vector<GenerateResult> results(R);
  for (auto& [id, result] : batch.TakeFinished()) results[id] = std::move(result);
  return results;
}

namespace {
// log p(token) of one row of logits at temperature 1, and its top_n tokens (ties to the lower id).
TokenLogProb LogProbOf(std::span<const float> logits, int32_t token, int32_t top_n) {
  const float max = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  const double log_z = max + std::log(sum);
  TokenLogProb out{token, logits[token] - log_z, {}};
  if (top_n > 0) {
    std::vector<int32_t> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    const auto likelier = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    std::partial_sort(ids.begin(), ids.begin() + std::min<size_t>(top_n, ids.size()), ids.end(), likelier);
    for (int32_t i = 0; i < top_n && i < static_cast<int32_t>(ids.size()); ++i) {
      out.top.emplace_back(ids[i], logits[ids[i]] - log_z);
    }
  }
  return out;
}
}  // namespace

absl::StatusOr<std::vector<TokenLogProb>> Engine::Score(std::span<const int32_t> tokens, std::span<const Mode> modes,
                                                        int64_t from, int32_t top_n) {
  const ModelConfig& c = backend_->config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (from < 0 || from > n) return absl::InvalidArgumentError(Cat("score: from ", from, " outside [0, ", n, "]"));
  if (n > c.max_position) {
    return absl::InvalidArgumentError(Cat("score: ", n, " tokens; this model takes at most ", c.max_position));
  }
  if (static_cast<int64_t>(modes.size()) < n - 1) {
    return absl::InvalidArgumentError(Cat("score: ", modes.size(), " modes for ", n, " tokens"));
  }
  if (top_n < 0 || top_n > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(Cat("score: top_n must be in [0, ", kMaxTopLogprobs, "], got ", top_n));
  }
  std::vector<TokenLogProb> out;
  if (from == n) return out;
  if (from == 0) out.push_back({tokens[0], {}, {}});
  if (n - 1 <= std::max<int64_t>(from - 1, 0)) return out;
  ORYX_ASSIGN_OR_RETURN(SequenceState seq, backend_->TryNewSequence());
  ORYX_RETURN_IF_ERROR(ScoreOn(seq, tokens, modes, std::max<int64_t>(from, 1), top_n, out));
  return out;
}

absl::Status Engine::ScoreOn(SequenceState& seq, std::span<const int32_t> tokens, std::span<const Mode> modes,
                             int64_t from, int32_t top_n, std::vector<TokenLogProb>& out) {
  // Row t predicts token t + 1: rows first_row .. n-2 score, the ones before only build the state.
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t first_row = from - 1, rows = n - 1;
  if (seq.position() > first_row || static_cast<int64_t>(modes.size()) < rows) {
    return absl::InternalError(Cat("score: a sequence at ", seq.position(), " cannot score from token ", from,
                                   " with ", modes.size(), " modes"));
  }
  ORYX_RETURN_IF_ERROR(seq.Reserve(rows));
  // Scoring spans return [span, V] logits to the host: at most 2048 rows of them at a time.
  const int64_t span = backend_->PrefillSpan(1), score_span = std::min<int64_t>(span, 2048);
  const int64_t V = backend_->config().vocab_size;
  std::vector<float> logits;
  for (int64_t begin = seq.position(); begin < rows;) {
    const bool scores = begin >= first_row;
    const int64_t end = std::min(rows, begin + (scores ? score_span : span));
    const int64_t stop = scores ? end : std::min(end, first_row);
    ForwardItem item{&seq, tokens.subspan(begin, stop - begin), modes.subspan(begin, stop - begin),
                     scores ? LogitsRows::kAll : LogitsRows::kNone, scores ? &logits : nullptr, false};
    ORYX_RETURN_IF_ERROR(backend_->Forward(std::span(&item, 1)));
    if (scores) {
      for (int64_t t = begin; t < stop; ++t) {
        out.push_back(LogProbOf(std::span<const float>(logits).subspan((t - begin) * V, V), tokens[t + 1], top_n));
      }
    }
    begin = stop;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------------------
// GenerationBatch

struct GenerationBatch::Request {
  GenerateRequest request;
  std::vector<int32_t> prompt;
  Decoder* decoder = nullptr;
  std::optional<SequenceState> seq;  // set while admitted (it holds KV memory)
  std::optional<Sampler> sampler;
  DecodeSlot slot;
  GenerateResult result;
  size_t longest_stop = 0;
  int64_t prefilled = 0;  // context() tokens forwarded (or restored from the prefix cache) so far
  bool started = false;   // its prefill has begun (StartPrefill)
  std::vector<Mode> modes;  // of context(): the prompt's from its decoder, or those a preempted sequence ran
  std::vector<uint64_t> names;  // of context()'s full blocks, for the prefix cache (PrefixCache::Names)
  std::vector<int64_t> snapshot_at;  // positions still to snapshot for the prefix cache, ascending
  int64_t admitted_at = 0;  // admission order: preemption takes the latest
  // After a preemption: the tokens to recompute (the prompt and the generated ones but the pending last),
  // in `modes`; decoding goes on from `slot.pending` once they are forwarded.
  std::vector<int32_t> replay;
  int32_t first = 0;  // the first generated token, drawn by the backend with the prompt's last span
  // A stream with log-probabilities: each token's is scored as it is emitted, on a sequence of its own that
  // follows this one's modes (ScoreStreamed), and the first error is kept for Finish.
  std::optional<SequenceState> scorer;
  std::vector<int32_t> scored_context;  // the prompt and the tokens emitted so far, grown as they come
  std::vector<TokenLogProb> streamed;
  absl::Status stream_error;
  Clock::time_point prefill_start, decode_start;
  bool admitted() const { return seq.has_value(); }
  const std::vector<int32_t>& context() const { return replay.empty() ? prompt : replay; }
  bool decoding() const { return admitted() && replay.empty() && prefilled == static_cast<int64_t>(prompt.size()); }
};

int64_t GenerationBatch::RoomFor(const Request& r) const {
  // Room for the context and the next generated tokens up front; a long generation grows the sequence as it
  // goes, so a request that asks for many tokens does not hold their memory from the start (a server's
  // capacity is the memory its requests use, not what they may use).
  constexpr int64_t kReservedAhead = 1024;
  const int64_t n = static_cast<int64_t>(r.context().size());
  const int64_t left = r.request.max_tokens - r.result.stats.generated_tokens;
  return std::min(engine_.backend_->config().max_position, n + std::min(left, kReservedAhead) + r.decoder->Lookahead());
}

int64_t GenerationBatch::kv_bytes() const {
  int64_t bytes = 0;
  for (const auto& [id, r] : active_) bytes += r->admitted() ? r->seq->kv_bytes() : 0;
  return bytes;
}

int64_t GenerationBatch::waiting() const {
  int64_t n = 0;
  for (const auto& [id, r] : active_) n += !r->admitted();
  return n;
}

absl::Status GenerationBatch::AdmitOne(Request& r, int64_t& used) {
  const Backend& backend = *engine_.backend_;
  const int64_t need = std::min(backend.config().max_position,
                                static_cast<int64_t>(r.context().size()) + 1 + r.decoder->Lookahead());
  int64_t room = std::max(need, RoomFor(r));
  if (kv_memory_ > 0) {
    if (used + backend.KvBytes(need) > kv_memory_) {
      return absl::ResourceExhaustedError(Cat("KV memory: ", MiB(used), " MiB in use and ", MiB(backend.KvBytes(need)),
                                              " MiB more needed, of ", MiB(kv_memory_), " MiB"));
    }
    while (room > need && used + backend.KvBytes(room) > kv_memory_) room = std::max(need, room / 2);
  }
  ORYX_ASSIGN_OR_RETURN(SequenceState seq, backend.TryNewSequence());
  if (absl::Status s = seq.Reserve(room); !s.ok()) ORYX_RETURN_IF_ERROR(seq.Reserve(need));
  r.seq.emplace(std::move(seq));
  r.slot.seq = &*r.seq;
  r.admitted_at = next_admission_++;
  used += r.seq->kv_bytes();
  return absl::OkStatus();
}

void GenerationBatch::Admit() {
  int64_t used = kv_bytes();
  done_.clear();
  for (auto& [id, r] : active_) {
    if (r->admitted()) continue;
    // In the order of arrival, none skipped (a large request is not starved by small ones after it); a
    // preempted request comes before every later one.
    const absl::Status s = AdmitOne(*r, used);
    if (s.ok()) continue;
    // Nothing else holds memory that finishing would give back: it will never fit.
    if (!OthersAdmitted(*r)) FailAlone(*r, s);
    break;
  }
  for (int64_t id : done_) Drop(id);
}

void GenerationBatch::Preempt(Request& r) {
  // Recomputed later from its tokens, in the modes they ran in: the prompt and every generated token but the
  // pending one, which the decoder runs next as before.
  // (Preempted again while being recomputed, it keeps the tokens and modes it had; preempted during its first
  // prefill, it starts that again.)
  if (r.decoding()) {
    r.replay = r.prompt;
    r.replay.insert(r.replay.end(), r.result.tokens.begin(), r.result.tokens.end() - 1);
    const std::span<const Mode> ran = r.seq->modes();
    r.modes.assign(ran.begin(), ran.end());  // as many as the replay's tokens: the sequence's position
    r.names.clear();                         // they name the prompt's blocks
  }
  r.decoder->Release(r.slot);
  r.seq.reset();
  r.slot.seq = nullptr;
  r.prefilled = 0;
  r.started = false;
  r.snapshot_at.clear();
  ++r.result.stats.preemptions;
  ++preemptions_;
}

bool GenerationBatch::OthersAdmitted(const Request& r) const {
  return std::ranges::any_of(active_, [&](const auto& entry) { return entry.second.get() != &r && entry.second->admitted(); });
}

void GenerationBatch::FailAlone(const Request& r, const absl::Status& why) {
  failed_.emplace_back(r.slot.id, absl::ResourceExhaustedError(Cat("the request does not fit in memory alone: ", why.message())));
  done_.push_back(r.slot.id);  // dropped by the caller
}

GenerationBatch::Request* GenerationBatch::LatestAdmitted() {
  Request* latest = nullptr;
  for (auto& [id, r] : active_) {
    if (r->admitted() && (latest == nullptr || r->admitted_at > latest->admitted_at)) latest = r.get();
  }
  return latest;
}

void GenerationBatch::EnsureRoom() {
  const Backend& backend = *engine_.backend_;
  const int64_t max_position = backend.config().max_position;
  std::vector<Request*> growing;
  for (auto& [id, r] : active_) {
    if (r->decoding()) growing.push_back(r.get());
  }
  // The earliest admitted first: they are the last to be preempted.
  std::ranges::sort(growing, {}, &Request::admitted_at);
  done_.clear();
  for (Request* r : growing) {
    if (!r->admitted()) continue;  // preempted for an earlier one
    SequenceState& seq = *r->seq;
    const int64_t need = std::min(max_position, seq.position() + 1 + r->decoder->Lookahead());
    if (seq.kv_capacity() >= need) continue;
    // Grow by half again (at least 256 positions), or as far as the budget lets, or preempt the latest
    // admitted request until it fits; alone and still without room, the request fails.
    const int64_t want = std::min(max_position, std::max(need, seq.kv_capacity() + std::max<int64_t>(256, seq.kv_capacity() / 2)));
    while (r->admitted()) {
      int64_t target = want;
      absl::Status s;
      if (kv_memory_ > 0) {
        const int64_t others = kv_bytes() - seq.kv_bytes();
        while (target > need && others + backend.KvBytes(target) > kv_memory_) target = std::max(need, (target + need) / 2);
        if (others + backend.KvBytes(target) > kv_memory_) {
          s = absl::ResourceExhaustedError(Cat("KV memory: a sequence of ", need, " positions needs ",
                                               MiB(backend.KvBytes(need)), " MiB; the budget is ", MiB(kv_memory_), " MiB"));
        }
      }
      if (s.ok()) s = seq.Reserve(target);
      if (s.ok()) break;
      if (!OthersAdmitted(*r)) {
        FailAlone(*r, s);
        break;
      }
      Preempt(*LatestAdmitted());  // perhaps this one: then it waits to be recomputed
    }
  }
  for (int64_t id : done_) Drop(id);
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
  if (q.max_tokens < (q.echo ? 0 : 1)) {
    return absl::InvalidArgumentError(Cat("max_tokens must be >= ", q.echo ? "0 (with echo)" : "1", ", got ", q.max_tokens));
  }
  if (q.logprobs < -1 || q.logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(Cat("logprobs must be in [0, ", kMaxTopLogprobs, "] (or -1: none), got ", q.logprobs));
  }
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
  if (q.sampling.adjusts_logits() && !r->decoder->FollowsLogitAdjustments()) {
    return absl::InvalidArgumentError(Cat("presence_penalty, frequency_penalty and logit_bias are not built for the '",
                                          q.policy, "' policy"));
  }
  for (const auto& [token, bias] : q.sampling.logit_bias) {
    if (token >= c.vocab_size) return absl::InvalidArgumentError(Cat("logit_bias: token ", token, " outside the vocabulary"));
  }
  if (kv_memory_ > 0) {  // a request that could never finish, even alone
    const int64_t most = std::min(c.max_position, n + q.max_tokens + r->decoder->Lookahead());
    if (const int64_t need = engine_.backend_->KvBytes(most); need > kv_memory_) {
      return absl::InvalidArgumentError(Cat("the prompt of ", n, " tokens and max_tokens ", q.max_tokens, " need ",
                                            MiB(need), " MiB of KV cache; the server's KV memory is ", MiB(kv_memory_),
                                            " MiB"));
    }
  }
  r->sampler.emplace(q.sampling);
  r->result.policy = q.policy;
  r->result.stats.prompt_tokens = n;
  const int64_t id = next_id_++;
  r->slot = {id, nullptr, 0, n, &r->prompt, &r->result.tokens, q.max_tokens, &*r->sampler, &r->result.stats, {}};
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
  r.sampler->Record(token);
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
  const TokenLogProb* logprob = nullptr;
  if (r.request.on_token && r.request.logprobs >= 0 && r.stream_error.ok()) {
    r.stream_error = ScoreStreamed(r);
    if (r.stream_error.ok()) logprob = &r.streamed.back();
  }
  if (r.request.on_token && out.text.size() >= old_size) {
    const TokenEvent event{r.slot.id, token, std::string_view(out.text).substr(old_size), logprob};
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

void GenerationBatch::Drop(int64_t id) {
  auto it = active_.find(id);
  it->second->decoder->Release(it->second->slot);
  active_.erase(it);
}

bool GenerationBatch::Cancel(int64_t id) {
  if (!active_.contains(id)) return false;
  Drop(id);
  return true;
}

void GenerationBatch::Finish(int64_t id) {
  auto it = active_.find(id);
  Request& r = *it->second;
  r.result.stats.decode_s = Seconds(r.decode_start);
  r.decoder->Release(r.slot);
  if (absl::Status scored = ScoreLogprobs(r); scored.ok()) {
    finished_.emplace_back(id, std::move(r.result));
  } else {
    failed_.emplace_back(id, std::move(scored));
  }
  active_.erase(it);  // frees the sequence
}

absl::Status GenerationBatch::ScoreStreamed(Request& r) {
  if (!r.scorer) {
    ORYX_ASSIGN_OR_RETURN(SequenceState seq, engine_.backend_->TryNewSequence());
    r.scorer.emplace(std::move(seq));
    r.scored_context = r.prompt;
  }
  std::vector<int32_t>& tokens = r.scored_context;
  const auto emitted = static_cast<std::ptrdiff_t>(tokens.size() - r.prompt.size());
  tokens.insert(tokens.end(), r.result.tokens.begin() + emitted, r.result.tokens.end());
  const std::span<const Mode> log = r.seq->modes();
  const size_t need = tokens.size() - 1;  // the row before the newest token ran in the sequence already
  if (log.size() < need) return absl::InternalError(Cat("logprobs: ", log.size(), " modes logged, ", need, " needed"));
  const int64_t from = static_cast<int64_t>(r.prompt.size() + r.streamed.size());
  return engine_.ScoreOn(*r.scorer, tokens, log.first(need), from, r.request.logprobs, r.streamed);
}

absl::Status GenerationBatch::ScoreLogprobs(Request& r) {
  const GenerateRequest& q = r.request;
  if (q.logprobs < 0) return absl::OkStatus();
  if (q.on_token) {  // streamed: scored token by token as they were emitted
    ORYX_RETURN_IF_ERROR(r.stream_error);
    r.result.logprobs = std::move(r.streamed);
    r.result.logprobs.resize(r.result.tokens.size());
    if (!q.echo) return absl::OkStatus();
  }
  std::vector<int32_t> tokens = r.prompt;
  tokens.insert(tokens.end(), r.result.tokens.begin(), r.result.tokens.end());
  // The modes the tokens ran in: the sequence's log, or (a request that generated nothing) the prompt's.
  std::vector<Mode> modes;
  if (r.admitted()) {
    const std::span<const Mode> log = r.seq->modes();
    modes.assign(log.begin(), log.begin() + std::min(log.size(), tokens.size()));
  } else {
    modes.resize(r.prompt.size());
    r.decoder->PrefillModes(r.prompt, 0, modes);
  }
  const int64_t prompt = static_cast<int64_t>(r.prompt.size());
  const int64_t bos = q.prompt_tokens.empty() ? 1 : 0;  // a text prompt's BOS is not the user's
  ORYX_ASSIGN_OR_RETURN(std::vector<TokenLogProb> scored,
                        engine_.Score(tokens, modes, q.echo ? bos : prompt, q.logprobs));
  if (q.echo) {
    r.result.prompt_logprobs.assign(scored.begin(), scored.begin() + (prompt - bos));
    if (!r.result.prompt_logprobs.empty()) r.result.prompt_logprobs[0] = {r.result.prompt_logprobs[0].token, {}, {}};
    scored.erase(scored.begin(), scored.begin() + (prompt - bos));
  }
  r.result.logprobs = std::move(scored);
  return absl::OkStatus();
}

void GenerationBatch::EmitStep(std::span<DecodeSlot* const> slots) {
  const auto start = Clock::now();
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
  emit_s_ += Seconds(start);
}

void GenerationBatch::DecodingSlots(const Decoder* decoder, std::vector<DecodeSlot*>& slots) {
  slots.clear();
  for (auto& [id, r] : active_) {
    if (r->decoder == decoder && r->decoding()) slots.push_back(&r->slot);
  }
}

bool GenerationBatch::StartPrefill(Request& r) {
  const std::vector<int32_t>& context = r.context();
  const int64_t n = static_cast<int64_t>(context.size());
  // Once per prompt (not again for each step it waits, nor after a preemption in its prefill).
  if (r.modes.empty()) {
    r.modes.resize(n);
    r.decoder->PrefillModes(r.prompt, 0, r.modes);
  }
  PrefixCache* cache = engine_.prefix_cache_.get();
  if (cache != nullptr) {
    const int64_t b = cache->options().block_tokens;
    if (r.names.empty()) r.names = cache->Names(context, r.modes);
    const PrefixCache::Prefix prefix{context, r.modes, r.names};
    // At least one prompt token is forwarded: its logits give the first generated token.
    const int64_t cached = cache->Longest(prefix, n - 1);
    // An earlier prompt still being prefilled that shares a longer beginning: wait for its snapshot there.
    for (auto& [id, other] : active_) {
      Request& o = *other;
      if (&o == &r) break;  // only earlier ones, which never wait for this one
      if (!o.admitted() || !o.started || o.decoding()) continue;
      const std::vector<int32_t>& theirs = o.context();
      const int64_t limit = std::min<int64_t>(n - 1, static_cast<int64_t>(theirs.size()));
      int64_t shared = 0;
      while (shared < limit && context[shared] == theirs[shared] && r.modes[shared] == o.modes[shared]) ++shared;
      const int64_t point = shared / b * b;
      if (point > cached && point > o.prefilled) {
        if (!std::ranges::binary_search(o.snapshot_at, point)) {
          o.snapshot_at.insert(std::ranges::upper_bound(o.snapshot_at, point), point);
        }
        return false;
      }
    }
    // The restored sequence, with the room of the one made at Add, takes its place.
    PrefixCache::Hit hit = cache->Lookup(prefix, n - 1, std::max(RoomFor(r), r.seq->kv_capacity()));
    if (hit.state) {
      *r.seq = std::move(*hit.state);
      r.prefilled = hit.tokens;
      if (r.replay.empty()) r.result.stats.cached_tokens = hit.tokens;
    }
    // Snapshot points: every snapshot_every tokens, the last block boundary before the prompt's last token
    // (the same prompt again, which forwards at least that token, resumes there; so does a later turn of a
    // conversation, which extends the prompt), and where it leaves the blocks of an earlier prompt (a third
    // prompt with that beginning resumes there). A boundary at the prompt's end would serve only longer
    // prompts: prompts of a multiple of block_tokens sent again were computed whole.
    const int64_t every = cache->options().snapshot_every;
    for (int64_t p = (r.prefilled / every + 1) * every; p <= n; p += every) r.snapshot_at.push_back(p);
    for (const int64_t p : {(n - 1) / b * b, cache->Seen(prefix, n - 1)}) {
      if (p > r.prefilled && !std::ranges::binary_search(r.snapshot_at, p)) {
        r.snapshot_at.insert(std::ranges::upper_bound(r.snapshot_at, p), p);
      }
    }
    cache->Remember(prefix);
  }
  r.started = true;
  if (r.prefill_start == Clock::time_point{}) r.prefill_start = Clock::now();  // kept through a preemption
  return true;
}

void GenerationBatch::ChoosePrefillSpans(const Backend& backend) {
  // The prompts that start their prefill now, each decoder's at once (their modes are computed below, one by one).
  for (auto& [name, decoder] : decoders_) {
    fresh_prompts_.clear();
    for (auto& [id, r] : active_) {
      if (r->decoder == decoder.get() && r->admitted() && !r->started && r->modes.empty()) {
        fresh_prompts_.emplace_back(r->prompt);
      }
    }
    if (fresh_prompts_.size() >= 2) decoder->PreparePrompts(fresh_prompts_);
  }
  prefilling_.clear();
  for (auto& [id, r] : active_) {
    if (r->admitted() && !r->decoding() && (r->started || StartPrefill(*r))) prefilling_.push_back(r.get());
  }
  // With a token budget, the prompts added first take it; the rest wait for a later step.
  const int64_t span = prefilling_.empty() ? 0 : backend.PrefillSpan(static_cast<int64_t>(prefilling_.size()));
  prefill_lengths_.clear();
  for (int64_t left = max_prefill_tokens_ > 0 ? max_prefill_tokens_ : INT64_MAX; Request* r : prefilling_) {
    // A span ends at the next snapshot point, if any.
    const int64_t end = r->snapshot_at.empty() ? static_cast<int64_t>(r->context().size()) : r->snapshot_at.front();
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
    const bool replay = !r.replay.empty();
    // The prompt's last span draws the first token; a recomputation's ends before the pending token.
    const bool last = !replay && r.prefilled + len == static_cast<int64_t>(r.prompt.size());
    items_.push_back({&*r.seq, std::span(r.context()).subspan(r.prefilled, len), modes,
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
      PrefixCache& cache = *engine_.prefix_cache_;
      const int64_t b = cache.options().block_tokens;
      cache.Insert(PrefixCache::Prefix{r.context(), r.modes, r.names}.First(r.prefilled / b, b), *r.seq);
    }
    if (!r.replay.empty() && r.prefilled == static_cast<int64_t>(r.replay.size())) {
      // Recomputed: decoding goes on from the pending token, as before the preemption.
      r.replay.clear();
      r.prefilled = static_cast<int64_t>(r.prompt.size());
      continue;
    }
    if (!r.decoding()) continue;
    CountModes(r.modes, r.result.stats);  // the prompt's, once: restored or forwarded, they ran in these modes
    r.result.stats.prefill_s = Seconds(r.prefill_start);
    r.decode_start = Clock::now();
    if (!Emit(r, r.first)) done_.push_back(r.slot.id);
    emit_s_ += Seconds(r.decode_start);
  }
  for (int64_t id : done_) Finish(id);
}

absl::Status GenerationBatch::Step() {
  Backend& backend = *engine_.backend_;
  auto mark = Clock::now();
  // Adds the time since the last mark to `seconds` (GenerationBatch::HostSeconds, forward_s_).
  auto lap = [&mark](double& seconds) {
    const auto now = Clock::now();
    seconds += std::chrono::duration<double>(now - mark).count();
    mark = now;
  };
  last_step_decoded_ = last_step_shared_ = 0;
  // Requests that generate nothing (echo, max_tokens 0) are scored and done.
  done_.clear();
  for (const auto& [id, r] : active_) {
    if (r->request.max_tokens == 0) {
      r->prefill_start = r->decode_start = Clock::now();
      done_.push_back(id);
    }
  }
  for (int64_t id : done_) Finish(id);
  // Requests waiting for memory come in while it lasts; every decoding sequence gets room for its step,
  // preempting the latest admitted requests when there is none.
  Admit();
  EnsureRoom();
  lap(host_.admit);
  // The work of this step: prefill spans, and every decoding request's step under its decoder.
  ChoosePrefillSpans(backend);
  lap(host_.start_prefill);
  stepping_.clear();
  for (auto& [name, decoder] : decoders_) {
    std::vector<DecodeSlot*> slots;
    DecodingSlots(decoder.get(), slots);
    if (!slots.empty()) stepping_.emplace_back(decoder.get(), std::move(slots));
  }
  for (const auto& [decoder, slots] : stepping_) last_step_decoded_ += static_cast<int64_t>(slots.size());
  if (stepping_.size() == 1 && (prefilling_.empty() || stepping_[0].first->RunsAlone(backend))) {
    // The decoder's own step (a whole speculative round on the device), then the prompts' spans by
    // themselves. A plain step that it declined shares the prompts' forward below instead, as attention-mode
    // steps do, rather than taking a forward of its own beside each prefill chunk.
    auto& [decoder, slots] = stepping_[0];
    lap(host_.plan);
    ORYX_ASSIGN_OR_RETURN(const bool ran, decoder->RunAlone(backend, slots));
    lap(forward_s_);
    if (!prefilling_.empty() && (ran || !decoder->PlainStep())) {
      items_.clear();
      PlanPrefill();
      lap(host_.plan);
      ORYX_RETURN_IF_ERROR(backend.Forward(items_));
      lap(forward_s_);
      FinishPrefill();
      prefilling_.clear();
      lap(host_.finish);
    }
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
  lap(host_.plan);
  if (!items_.empty()) ORYX_RETURN_IF_ERROR(backend.Forward(items_));
  lap(forward_s_);
  FinishPrefill();
  for (auto& [decoder, slots] : stepping_) {
    ORYX_RETURN_IF_ERROR(decoder->Finish(slots));
    EmitStep(slots);
  }
  lap(host_.finish);
  return absl::OkStatus();
}

std::vector<std::pair<int64_t, absl::Status>> GenerationBatch::TakeFailed() {
  std::vector<std::pair<int64_t, absl::Status>> out;
  out.swap(failed_);
  return out;
}

std::vector<std::pair<int64_t, GenerateResult>> GenerationBatch::TakeFinished() {
  std::vector<std::pair<int64_t, GenerateResult>> out;
  out.swap(finished_);
  return out;
}

}  // namespace oryx
