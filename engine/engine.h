// The generation API (DESIGN.md §9): load a model and its tokenizer, and generate continuations of
// several prompts together as one batch, each with its own sampling parameters, stop conditions, mode
// policy and streaming callback, and a result with the statistics users and benchmarks read.
//
// How decoding proceeds is a Decoder, chosen per request by policy name from a PolicyRegistry: the engine
// prefills each prompt (in the modes the decoder asks for), samples its first token, then calls the
// decoders' Step until the request is finished. The built-in decoder runs one token per step in the mode
// its ModePolicy gives; speculative/ registers the speculative decoders (a layer above the engine).
// GenerationBatch does this for requests that come and go (continuous batching, a server's loop);
// Engine::Generate is one such batch with all its requests added at once.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "nlohmann/json.hpp"

namespace oryx {

enum class FinishReason { kLength, kStop, kEos };
std::string_view FinishReasonName(FinishReason reason);  // "length" | "stop" | "eos"

// Speculative decoding counters (DESIGN.md §6): a round drafts up to k tokens and accepts some prefix.
struct SpecStats {
  int64_t rounds = 0;
  int64_t drafted = 0;
  int64_t accepted = 0;
  std::vector<int64_t> drafted_at, accepted_at;  // per draft position 0..k-1
  double draft_s = 0, verify_s = 0;              // wall time spent drafting / verifying (and committing)
  int64_t draft_forwards = 0, verify_forwards = 0;  // batched model forwards of each kind
  // Rounds the backend ran whole (Backend::SpeculativeRound) and their wall time; drafting and verifying are
  // not timed apart there, so these rounds add to neither draft_s nor verify_s.
  int64_t backend_rounds = 0;
  double backend_round_s = 0;
  // Rounds by draft length (index 0: plain attention steps) and their wall time, summed: what an adaptive
  // policy chose and what each length cost (a batched round's time, counted once per slot in it).
  std::vector<int64_t> rounds_by_length;
  std::vector<double> round_s_by_length;
};

struct GenerateStats {
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;  // of the prompt's tokens, restored from the prefix cache instead of forwarded
  int64_t preemptions = 0;    // times the request gave its memory back and was recomputed later
  int64_t generated_tokens = 0;
  // Tokens run in attention mode: prompt (cached ones included: they ran in their modes) and generated,
  // verification included. What routers read as the sequence's mode history.
  int64_t attention_tokens = 0;
  int64_t linear_tokens = 0;     // run in linear mode, drafts included
  double prefill_s = 0, decode_s = 0;
  std::optional<SpecStats> spec;  // set by speculative decoders
  double attention_fraction() const;
};

// Alternatives a log-probability may come with (OpenAI's top_logprobs), at most.
inline constexpr int32_t kMaxTopLogprobs = 20;

// One token of a sequence under the model: log p(token | the tokens before it), at temperature 1, in the mode
// the position before it ran in, and the likeliest tokens there.
struct TokenLogProb {
  int32_t token = 0;
  std::optional<double> logprob;                // none for a sequence's first token (nothing precedes it)
  std::vector<std::pair<int32_t, double>> top;  // (token, log-probability), likeliest first
};

struct GenerateResult {
  std::string text;             // the generated text (prompt not included), cut before a matched stop string
  std::vector<int32_t> tokens;  // the generated tokens (an ending EOS not included)
  FinishReason finish_reason = FinishReason::kLength;
  std::string policy;
  GenerateStats stats;
  // With GenerateRequest::logprobs: one entry per generated token; with echo too, one per prompt token (a
  // text prompt's leading BOS not included; the first entry's logprob is none, as OpenAI's echo gives it).
  std::vector<TokenLogProb> logprobs, prompt_logprobs;
};
// The object `oryx generate --json` prints (DESIGN.md §9); with log-probabilities, "logprobs" (and
// "prompt_logprobs"): {"token", "logprob", "top": [[token, logprob], ...]} per token.
nlohmann::json ToJson(const GenerateResult& result);
// The prefix cache's counters and its hit rate (tokens), as /stats shows them.
nlohmann::json ToJson(const PrefixCacheStats& stats);

struct TokenEvent {
  int64_t request = 0;    // index of the request in the Generate call
  int32_t token = 0;
  std::string_view text;  // the bytes this token added to the result's text
  const TokenLogProb* logprob = nullptr;  // with GenerateRequest::logprobs: this token's (valid in the callback)
};

struct GenerateRequest {
  std::string prompt;                  // text; encoded with a leading BOS
  std::vector<int32_t> prompt_tokens;  // or tokens, used as given when non-empty
  int64_t max_tokens = 128;            // >= 1; also capped by the model's max_position
  std::vector<std::string> stop;       // stop strings (non-empty)
  bool stop_at_eos = true;
  SamplingParams sampling;
  std::string policy = "attention";
  std::function<bool(const TokenEvent&)> on_token;  // streaming; return false to stop the request ("stop")
  // Log-probabilities: -1 none; 0 .. kMaxTopLogprobs each generated token's, with that many alternatives.
  // They are scored when the request ends, over the whole sequence in the modes its tokens ran in (the mode
  // log), so a speculative policy reports attention mode's, which verified every token it kept; with on_token,
  // as each token is emitted instead (TokenEvent::logprob), on a second sequence that follows the mode log.
  int32_t logprobs = -1;
  // With logprobs, the prompt's too. With echo, max_tokens may be 0: the prompt is scored, nothing generated.
  bool echo = false;
};

// One unfinished request as a decoder sees it.
struct DecodeSlot {
  int64_t id = 0;        // the request's index: stable for the whole Generate call
  SequenceState* seq = nullptr;
  int32_t pending = 0;   // the last emitted token, not yet run through the model
  int64_t prompt_len = 0;
  const std::vector<int32_t>* prompt = nullptr;     // the prompt's tokens
  const std::vector<int32_t>* generated = nullptr;  // the tokens emitted so far (pending is the last)
  int64_t remaining = 0;  // tokens it may still emit (Step may emit more; the surplus is dropped)
  Sampler* sampler = nullptr;
  GenerateStats* stats = nullptr;
  std::vector<int32_t> emitted;  // Step's output: >= 1 tokens, in order; the last becomes `pending`

  // The sequence so far as one context: the prompt, then the generated tokens.
  int64_t context_size() const { return static_cast<int64_t>(prompt->size() + generated->size()); }
  int32_t context_token(int64_t i) const {
    const int64_t n = static_cast<int64_t>(prompt->size());
    return i < n ? (*prompt)[i] : (*generated)[i - n];
  }
  // The start of the latest earlier occurrence of the context's last `len` tokens, or -1 if none.
  int64_t LatestEarlierMatch(int64_t len) const;
};

// How a policy decodes. Every engine step is one forward shared by all of the step's work: the prompts
// being prefilled and every decoder's slots, whatever their policies and wherever they are in a step that
// takes several forwards (a speculative round: draft steps, then a verify span). A decoder says what its
// slots need forwarded this step (Plan) and reads what came back (Finish).
class Decoder {
 public:
  virtual ~Decoder() = default;
  // The modes of prompt tokens begin .. begin + modes.size() - 1 during prefill (one chunk of the prompt).
  virtual void PrefillModes(std::span<const int32_t> prompt, int64_t begin, std::span<Mode> modes) const = 0;
  // Before their PrefillModes: the prompts that start their prefill in one step, all at once, so that a decoder
  // can do its work over whole prompts side by side (RouterDecoder: their earlier-match indexes, on several
  // threads) rather than one after another on the serving thread. PrefillModes must not depend on it.
  virtual void PreparePrompts(std::span<const std::span<const int32_t>> prompts) { (void)prompts; }
  // How many KV positions past the emitted tokens a step may write (so the engine can Reserve them).
  virtual int64_t Lookahead() const { return 0; }
  // Appends the items this step forwards for `slots` (they point into the decoder and stay valid until
  // Finish); a slot may add none. Must never go past the model's max_position; slots have position() + 1 <=
  // max_position on entry.
  virtual absl::Status Plan(const Backend& backend, std::span<DecodeSlot* const> slots,
                            std::vector<ForwardItem>& items) = 0;
  // After the step's forward: every slot's emitted tokens, >= 0 in order (none while a slot is inside a step
  // of several forwards, such as a speculative round that is drafting). The last becomes `pending`.
  virtual absl::Status Finish(std::span<DecodeSlot* const> slots) = 0;
  // When its slots are the step's only decode work, a decoder may run their step itself with as many
  // forwards as it needs and no return to the engine between them (a speculative round run whole by the
  // backend). Returns false when it did not, and nothing ran: the engine then calls Plan and Finish.
  virtual absl::StatusOr<bool> RunAlone(Backend& backend, std::span<DecodeSlot* const> slots) {
    (void)backend, (void)slots;
    return false;
  }
  // Whether RunAlone may run a step. A step whose only decoding requests are this decoder's then asks it
  // first. The step's prefill spans are forwarded by themselves (after the round when it ran one) unless
  // the step it declined is plain (PlainStep), which shares their forward as attention-mode steps do: draft
  // steps inside a prefill's forward cost more than a whole round on the device
  // (results/2026-12-02-h200-one-forward).
  virtual bool RunsAlone(const Backend& backend) const {
    (void)backend;
    return false;
  }
  // After RunAlone declined: whether the step its Plan would make is one plain token per slot.
  virtual bool PlainStep() const { return false; }
  // The slot's request has finished, or was preempted: drop whatever the decoder keeps for it (a long-running
  // batch, such as a server's, sees ever new ids), from its prefill on.
  virtual void Release(const DecodeSlot& slot) { (void)slot; }
  // Whether its tokens follow SamplingParams' penalties and logit biases (drawn by the slot's sampler, one
  // token at a time). A request that sets them under a decoder that does not is refused.
  virtual bool FollowsLogitAdjustments() const { return true; }
  // Makes the decoder run decode steps it would run in attention mode as speculative rounds whose draft length
  // it chooses as the `speculative` policy does (0 included), in place of any it chose itself: those tokens stay
  // attention mode's (lossless), their time changes (RouterDecoder: the steps whose every slot decides
  // attention). The policy `drafted:POLICY` (PolicyRegistry). InvalidArgument for a decoder that cannot (one
  // that does not choose modes step by step).
  virtual absl::Status DraftAttentionSteps() {
    return absl::InvalidArgumentError("drafted: takes a router policy (entropy, budget, match, tail, random, learned)");
  }
};

// One step of one decoder's slots on their own: RunAlone, or Plan, one forward and Finish.
absl::Status StepDecoder(Decoder& decoder, Backend& backend, std::span<DecodeSlot* const> slots);

// The usual decoder: each step runs every slot's pending token in one mode and samples the next token.
// Subclasses choose the mode per slot and may look at the logits the step produced.
class StepwiseDecoder : public Decoder {
 public:
  absl::Status Plan(const Backend& backend, std::span<DecodeSlot* const> slots,
                    std::vector<ForwardItem>& items) override;
  absl::Status Finish(std::span<DecodeSlot* const> slots) override;

 protected:
  virtual Mode ChooseMode(const DecodeSlot& slot, int64_t batch) = 0;
  // The backend draws each slot's next token itself (ForwardItem::sampler), so that a device backend returns
  // tokens rather than logits. A decoder that reads the statistics of the distribution a token was drawn from
  // (Observe) says so, and the backend returns those beside the token (ForwardItem::stats_out).
  virtual bool ObservesStats() const { return false; }
  virtual void Observe(const DecodeSlot& slot, Mode mode, const LogitStats& stats) {}

 private:
  std::vector<Mode> modes_;
  std::vector<LogitStats> stats_;
  std::vector<int32_t> next_;
};

// Policy names to decoders. Built in: attention, linear, prefill-linear, periodic:N (engine/mode_policy.h).
class PolicyRegistry {
 public:
  using Factory = std::function<absl::StatusOr<std::unique_ptr<Decoder>>(std::string_view policy)>;
  PolicyRegistry();
  // Names equal to `prefix` or starting with `prefix + ":"` go to `factory`; `usage` is shown in errors.
  // Registering a prefix again replaces its entry.
  void Register(std::string prefix, std::string usage, Factory factory);
  // The decoder a policy names; `drafted:POLICY` is POLICY's with Decoder::DraftAttentionSteps.
  absl::StatusOr<std::unique_ptr<Decoder>> Make(std::string_view policy) const;
  bool Has(std::string_view prefix) const;  // registered, or "drafted"
  // Each registered prefix with its usage ("periodic", "periodic:N"), in the order of registration, then
  // ("drafted", "drafted:POLICY").
  std::vector<std::pair<std::string, std::string>> Usages() const;

 private:
  struct Entry {
    std::string prefix, usage;
    Factory factory;
  };
  std::vector<Entry> entries_;
};

class GenerationBatch;

class Engine {
 public:
  // The checkpoint directory must hold the tokenizer (tokenizer.model) beside the weights.
  static absl::StatusOr<Engine> Load(const std::string& model_dir, const BackendOptions& options = {});
  // Without a tokenizer the engine takes token prompts only, produces no text (stop strings never match)
  // and stops at the fixed EOS id.
  Engine(std::unique_ptr<Backend> backend, std::optional<Tokenizer> tokenizer);
  Engine(Engine&&) noexcept;
  ~Engine();

  Backend& backend() { return *backend_; }
  const std::optional<Tokenizer>& tokenizer() const { return tokenizer_; }
  PolicyRegistry& policies() { return policies_; }
  // The prefix cache its batches share (engine/prefix_cache.h), null when off; on by default. A prompt then
  // resumes from the longest snapshot of its beginning run in the same modes, and is snapshotted as it is
  // prefilled. set_prefix_cache(std::nullopt) turns it off (dropping its snapshots). snapshot_every 0 (the
  // engine's default): the backend's prefill span for one prompt rounded up to blocks, at least 2048, so
  // that snapshots do not cut the spans shorter (a 16K prompt on the GPU: one span).
  PrefixCache* prefix_cache() { return prefix_cache_.get(); }
  void set_prefix_cache(std::optional<PrefixCacheOptions> options);

  // Runs the requests together. Every request is checked first: InvalidArgument (naming the request when
  // there are several) for an empty prompt, a prompt past max_position - 1 tokens, max_tokens < 1, bad
  // sampling values, an empty stop string or an unknown policy.
  absl::StatusOr<std::vector<GenerateResult>> Generate(std::span<const GenerateRequest> requests);
  absl::StatusOr<GenerateResult> Generate(const GenerateRequest& request);

  // Teacher-forced log-probabilities of tokens[from ..] (TokenLogProb), with top_n (0 .. kMaxTopLogprobs)
  // alternatives each: one fresh sequence runs tokens[0 .. n-2] in `modes` (at least n - 1 of them), spans
  // of PrefillSpan(1), the LM head only on the rows that score. InvalidArgument for bad arguments;
  // ResourceExhausted when the device has no room for the sequence.
  absl::StatusOr<std::vector<TokenLogProb>> Score(std::span<const int32_t> tokens, std::span<const Mode> modes,
                                                  int64_t from, int32_t top_n);
  // The same on a sequence that has run tokens[0 .. seq.position()), seq.position() <= from - 1, from >= 1:
  // runs it on to n - 1 and appends the entries of tokens[from ..] to `out`. For scoring as tokens come.
  absl::Status ScoreOn(SequenceState& seq, std::span<const int32_t> tokens, std::span<const Mode> modes, int64_t from,
                       int32_t top_n, std::vector<TokenLogProb>& out);

 private:
  friend class GenerationBatch;
  std::unique_ptr<Backend> backend_;
  std::optional<Tokenizer> tokenizer_;
  PolicyRegistry policies_;
  std::unique_ptr<PrefixCache> prefix_cache_;  // holds sequences of backend_: declared after it, dropped first
};

// Continuous batching: requests join between steps and leave as they finish, so that a server keeps the
// backend's batch full while requests come and go. Each Step is one forward: the next span
// (Backend::PrefillSpan) of every prompt still being prefilled, and one decoder step (Decoder::Plan) of
// every request that is decoding, whatever its policy, so a long prompt never stalls the others' decoding
// for more than a span and one pass over the weights serves them all. A step whose only work is one
// decoder's slots may be run by that decoder (Decoder::RunAlone: a speculative round on the device). It
// draws the first token of each prompt it finishes. What a request generates does not
// depend on what else shares its batch (on a device, up to the rounding of its kernels, which may differ
// with the batch's shape).
//
// With the engine's prefix cache, a prompt looks up its longest cached beginning when its prefill starts and
// resumes there; its spans end at its snapshot points (every snapshot_every tokens, its last block boundary,
// and where it leaves the blocks of the prompts before it), where it is snapshotted. A prompt whose beginning an earlier prompt is still prefilling waits
// for that one's snapshot at the end of what they share instead of computing it too.
//
// Statistics are the request's own: prefill_s from its first prefill forward to its first token (other
// requests' steps in between included: the time to its first token), decode_s from there to its end.
// Engine::Generate is this batch with every request added up front. One thread drives it; after an error
// from Step the batch is spoilt (its requests are lost) and should be dropped.
class GenerationBatch {
 public:
  // max_prefill_tokens > 0 bounds the prompt tokens one Step forwards (its spans go to the waiting prompts
  // in the order they were added): a joining prompt then delays the others' next token by less, and its own
  // first token comes later. 0: every waiting prompt gets its next span.
  explicit GenerationBatch(Engine& engine, int64_t max_prefill_tokens = 0);
  ~GenerationBatch();
  GenerationBatch(const GenerationBatch&) = delete;
  GenerationBatch& operator=(const GenerationBatch&) = delete;

  // Checks the request as Engine::Generate does (InvalidArgument; also for a prompt whose KV cache alone
  // passes kv_memory) and queues it: a Step admits it (makes its sequence) when there is memory for it, and
  // prefills it from then on. Returns the request's id, 0, 1, 2, ... in the order of Add: the id its
  // TokenEvents carry.
  absl::StatusOr<int64_t> Add(GenerateRequest request);
  // Bounds the bytes of the admitted requests' KV caches (0: no bound but the device's). Admission takes
  // waiting requests in order while their prompts fit; a decoding sequence that needs room when there is
  // none preempts the latest admitted request (its memory freed, its tokens recomputed when memory allows;
  // it generates what it would have). A request that does not fit even alone fails (TakeFailed).
  void set_kv_memory(int64_t bytes) { kv_memory_ = bytes; }
  int64_t kv_memory() const { return kv_memory_; }
  int64_t kv_bytes() const;  // held by the admitted requests' sequences
  int64_t waiting() const;   // added and not admitted (new, or preempted)
  int64_t preemptions() const { return preemptions_; }
  absl::Status Step();
  int64_t active() const { return static_cast<int64_t>(active_.size()); }  // added and not finished
  int64_t decoding() const;  // of those, past their prefill
  int64_t last_step_decoded() const { return last_step_decoded_; }  // requests the last Step decoded
  // Of those, the ones whose step ran in one forward with prefill spans.
  int64_t last_step_shared() const { return last_step_shared_; }
  // Seconds the steps so far spent handing out tokens (their text, stop strings, the requests' on_token
  // callbacks): host work between forwards, as much for every token whatever the policy.
  double emit_seconds() const { return emit_s_; }
  // Seconds the steps so far spent in the backend's forwards and whole speculative rounds, waiting for their
  // results included: the rest of a step's time is the host's (planning, reading results, emitting), when a
  // device sits idle.
  double forward_seconds() const { return forward_s_; }
  // The rest, the host's, by part, summed over the steps so far: admitting requests and making room for them
  // (admit); choosing the step's prefill spans and starting new prompts, with their modes and prefix-cache
  // lookups (start_prefill); the decoders' and the prompts' forward items (plan); reading back what the
  // forwards produced and emitting tokens (finish; emit_seconds is part of it).
  struct HostSeconds {
    double admit = 0, start_prefill = 0, plan = 0, finish = 0;
    HostSeconds& operator+=(const HostSeconds& o) {
      admit += o.admit, start_prefill += o.start_prefill, plan += o.plan, finish += o.finish;
      return *this;
    }
    HostSeconds operator-(const HostSeconds& o) const {
      return {admit - o.admit, start_prefill - o.start_prefill, plan - o.plan, finish - o.finish};
    }
    nlohmann::json ToJson() const {
      return {{"admit", admit}, {"start_prefill", start_prefill}, {"plan", plan}, {"finish", finish}};
    }
  };
  const HostSeconds& host_seconds() const { return host_; }
  // The requests finished since the last call, with their ids, in the order they finished.
  std::vector<std::pair<int64_t, GenerateResult>> TakeFinished();
  // The requests that failed since the last call (ResourceExhausted: they do not fit in memory even alone).
  std::vector<std::pair<int64_t, absl::Status>> TakeFailed();
  // Ends an unfinished request between steps, wherever it is (waiting for memory, prefilling, decoding),
  // without a result: neither TakeFinished nor TakeFailed returns it, and its sequence (its KV memory) is
  // freed now. False when no request of that id is unfinished. How a server drops a request whose client left.
  bool Cancel(int64_t id);

 private:
  struct Request;
  // Emits one token into a request's result; false once the request is finished.
  bool Emit(Request& r, int32_t token);
  // Emits the tokens a decoder step left in the slots, finishing the requests that end.
  void EmitStep(std::span<DecodeSlot* const> slots);
  // The decoding requests of `decoder`, in the order they were added.
  void DecodingSlots(const Decoder* decoder, std::vector<DecodeSlot*>& slots);
  // The prompts this step prefills (prefilling_) and the span of each (prefill_lengths_).
  void ChoosePrefillSpans(const Backend& backend);
  // The positions a request's sequence reserves: its prompt and first generated tokens.
  int64_t RoomFor(const Request& r) const;
  // A prompt's first prefill step: its modes, its prefix-cache lookup and snapshot points. False when it
  // waits instead for an earlier prompt's snapshot.
  bool StartPrefill(Request& r);
  // Appends those spans' forward items.
  void PlanPrefill();
  // After the forward: counts the spans, draws the first tokens of the prompts they finished.
  void FinishPrefill();
  void Finish(int64_t id);  // into finished_, or failed_ when its log-probabilities cannot be scored
  absl::Status ScoreLogprobs(Request& r);  // GenerateRequest::logprobs into its result
  absl::Status ScoreStreamed(Request& r);  // a streaming request's newest token's log-probability
  void Drop(int64_t id);                   // a failed request: gone without a result
  // Admission and preemption (set_kv_memory).
  void Admit();
  absl::Status AdmitOne(Request& r, int64_t& used);
  void EnsureRoom();
  void Preempt(Request& r);
  Request* LatestAdmitted();
  bool OthersAdmitted(const Request& r) const;       // another request holds memory its end would give back
  void FailAlone(const Request& r, const absl::Status& why);  // it does not fit even alone: into failed_
  Engine& engine_;
  std::map<std::string, std::unique_ptr<Decoder>, std::less<>> decoders_;  // one per policy name
  std::map<int64_t, std::unique_ptr<Request>> active_;                      // by id
  std::vector<std::pair<int64_t, GenerateResult>> finished_;
  const int64_t max_prefill_tokens_;
  int64_t next_id_ = 0, next_admission_ = 0;
  int64_t kv_memory_ = 0, preemptions_ = 0;
  std::vector<std::pair<int64_t, absl::Status>> failed_;
  int64_t last_step_decoded_ = 0, last_step_shared_ = 0;
  double emit_s_ = 0, forward_s_ = 0;
  HostSeconds host_;
  // Per-step buffers.
  std::vector<ForwardItem> items_;
  std::vector<Request*> prefilling_;
  std::vector<int64_t> prefill_lengths_;  // the span each forwards this step
  std::vector<int64_t> done_;
  std::vector<std::pair<Decoder*, std::vector<DecodeSlot*>>> stepping_;  // the decoders' slots this step
  std::vector<std::span<const int32_t>> fresh_prompts_;  // prompts starting this step (Decoder::PreparePrompts)
};

}  // namespace oryx
