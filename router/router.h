// The router (DESIGN.md §7): at every segment boundary a Router sees a RouterContext and decides the mode of
// the next segment. The RouterDecoder runs a Router inside Engine::Generate: the prompt in segments of
// segment_len tokens (the prompt's last token, whose output predicts the first generated token, is a segment
// of its own; with a tail, the segment before it is cut finer: PrefillSegmentTokens), then one decision per
// generated token.
//
// Features are causal: during prefill only positions, counts, a hash of the prompt and whether its end repeats earlier
// text (the whole prompt is known before prefill); while decoding also the entropy
// and top-2 margin of the distribution the last token was sampled from, a repeated-n-gram signal, and the cost model's
// predicted step times when a calibrated model is given, and the acceptance rate of this sequence's recent speculative
// rounds.
//
// A decode decision may also speculate: attention mode with draft_length k > 0 runs a speculative round
// (k linear-mode drafts verified in attention mode, speculative/) instead of one step. It is lossless, so
// it changes the cost of a token, not the tokens.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "router/cost_model.h"
#include "router/earlier_match.h"
#include "speculative/speculative.h"

namespace oryx::router {

enum class Phase { kPrefill, kDecode };

inline constexpr int64_t kPromptEndTokens = 32;  // RouterContext::prompt_end_match_length

struct RouterContext {
  Phase phase = Phase::kPrefill;
  int64_t position = 0;        // the segment's first token
  int64_t segment_tokens = 1;  // tokens the decision covers
  int64_t prompt_len = 0;
  bool last_prompt_token = false;   // the one-token segment whose output predicts the first generated token
  int64_t batch = 1;
  int64_t attention_tokens = 0;     // forwarded so far in this sequence, in each mode
  int64_t linear_tokens = 0;
  int64_t tokens_since_attention = 0;
  double entropy = -1;  // nats, of the last sampling distribution (decode; -1 when not known)
  double margin = -1;   // top-1 minus top-2 logit of the last token (decode; -1 when not known)
  bool repeated_ngram = false;  // the last 3 tokens occurred earlier in the sequence
  // The longest run of tokens ending at one of the decision's tokens that also occurs earlier in the
  // sequence (router/earlier_match.h): its length (the longest over a prefill segment's tokens; while
  // decoding, ending at the token about to run) and how far back its first occurrence ends. 0 and 0: none.
  int64_t match_length = 0, match_distance = 0;
  // The same for the prompt's last kPromptEndTokens tokens (LongestMatchAtEnd): known before prefill, since the
  // whole prompt is, and the same for every decision of a sequence. It tells a prompt that ends by naming
  // something earlier (a needle's key, a passage to go on with) from one that ends in new text.
  int64_t prompt_end_match_length = 0, prompt_end_match_distance = 0;
  uint64_t sequence_hash = 0;   // a hash of the prompt: lets a randomised policy differ between sequences
  double predicted_attention_s = -1, predicted_linear_s = -1;  // the cost model's step times, when given
  double acceptance = -1;  // running average of accepted / drafted over recent speculative rounds (-1: none)

  double attention_fraction() const;
};

struct Decision {
  Mode mode = Mode::kAttention;
  int64_t draft_length = 0;  // decode in attention mode only: > 0 runs a speculative round of this many drafts
};

// A policy: statistics in, decision out. Decide must be a pure function of the context (prefill decisions
// are recomputed from the start of the prompt on demand).
class Router {
 public:
  virtual ~Router() = default;
  virtual Decision Decide(const RouterContext& context) const = 0;
  // The longest draft a decision may ask for (0: the router never speculates).
  virtual int64_t max_draft_length() const { return 0; }
  // Whether Decide reads match_length / match_distance. Those cost an index over the sequence's tokens, kept
  // only for routers that read them; a router that never does says so and its contexts hold 0 there.
  virtual bool reads_earlier_match() const { return true; }
  // Whether Decide reads entropy / margin. The backend computes those beside each decode step's draw
  // (ForwardItem::stats_out; a device backend on the device, two numbers back a sequence rather than V
  // floats), and a router that never reads them says so: its contexts hold -1 there and nothing is computed.
  virtual bool reads_entropy() const { return true; }
};

struct RouterOptions {
  int64_t segment_len = 128;
  int64_t tail_len = 0;                 // > 0: the prompt's last segment_len tokens cut finer (PrefillSegmentTokens)
  std::optional<CostModel> cost_model;  // for the predicted step times
};

class RouterDecoder final : public StepwiseDecoder {
 public:
  RouterDecoder(std::unique_ptr<Router> router, RouterOptions options);
  ~RouterDecoder() override;
  void PrefillModes(std::span<const int32_t> prompt, int64_t begin, std::span<Mode> modes) const override;
  // Indexes the prompts for earlier matches side by side, on up to one thread a core, for their PrefillModes and
  // first decode decisions (a 16K prompt's index takes 1.3 ms of a core on the 2-core VM, reserved).
  void PreparePrompts(std::span<const std::span<const int32_t>> prompts) override;
  int64_t Lookahead() const override;
  // Slots whose decision speculates step through a speculative round (draft steps, then a verify span); the
  // others take one step, each in its mode; all in the step's one forward. A slot inside a round goes on with it.
  absl::Status Plan(const Backend& backend, std::span<DecodeSlot* const> slots,
                    std::vector<ForwardItem>& items) override;
  absl::Status Finish(std::span<DecodeSlot* const> slots) override;
  // When every slot's decision speculates with one draft length, the backend may run the rounds whole.
  absl::StatusOr<bool> RunAlone(Backend& backend, std::span<DecodeSlot* const> slots) override;
  bool RunsAlone(const Backend& backend) const override { return spec_ != nullptr && backend.runs_rounds(); }
  bool PlainStep() const override;
  void Release(const DecodeSlot& slot) override;
  // A step whose every slot decides attention mode runs speculative rounds of the length the `speculative`
  // policy's controller chooses (0 included: a plain step), whatever draft lengths the router asked for: the
  // slots start them together, so the backend runs them whole. A step that also holds linear-mode decisions
  // takes the router's own lengths. A round among plain steps goes forward one engine step at a time, and
  // its slot emits at most a token a step, fewer when drafts are rejected: at 8K x 32 on the H100 the
  // learned lambda 0.4 took 14% more steps than attention mode; at 16K, where the learned lambda 1 decodes
  // mostly in linear mode, the controller's rounds in such steps served 0.81x of its own (their acceptance
  // 0.71 against its 1.0). With 1 and 8 clients at 16K, where its steps are often all attention, drafted:
  // still served 0.78x and 0.87x of lambda 1 as it is (results/2026-12-07-h100-no-cache-grid, call 6).
  absl::Status DraftAttentionSteps() override;
  // How many prompts were indexed for earlier matches (router/earlier_match.h): once a request when its
  // PrefillModes and its decoding ran here (the first decode decision takes the prefill's index).
  int64_t prompts_indexed() const { return prompts_indexed_; }
  // How many of those indexes are kept for requests that have not made their first decode decision yet.
  int64_t prompt_indexes_kept() const { return static_cast<int64_t>(prompt_indexes_.size()); }

 protected:
  Mode ChooseMode(const DecodeSlot& slot, int64_t batch) override;
  bool ObservesStats() const override { return router_->reads_entropy(); }  // each step's entropy and margin
  void Observe(const DecodeSlot& slot, Mode mode, const LogitStats& stats) override;

 private:
  struct SlotState {
    bool started = false;  // the slot's first decode decision was made (prompt_hash and its index set)
    uint64_t prompt_hash = 0;
    EarlierMatch::Match prompt_end;  // LongestMatchAtEnd of the prompt, kept as `matches` passes its end
    EarlierMatch matches;  // over the slot's context, pushed up to the token about to run
    EarlierMatch::Match match;
    int64_t since_attention = 0;
    double entropy = -1, margin = -1, acceptance = -1;
    std::optional<Mode> decided;  // set by Plan for the plain step's ChooseMode
  };
  Decision DecideDecode(const DecodeSlot& slot, int64_t batch);
  // Every slot's decision for this step (decisions_), unless RunAlone made them already.
  void DecideStep(std::span<DecodeSlot* const> slots);
  // After the speculating slots' step: the acceptance of the rounds that ended.
  void NoteRounds();
  // PrefillModes' index of a prompt, kept for the first decode decision of the request that prefilled it, so
  // that a prompt is indexed once (a 16K prompt's index takes milliseconds of the serving thread): the prompt
  // (to find it by), the index over it, its end match and its last token's match.
  struct PromptIndex {
    std::vector<int32_t> prompt;
    EarlierMatch index;
    EarlierMatch::Match end, last;
    // Every token's match, from PreparePrompts, until PrefillModes takes them (empty after, or when PrefillModes
    // built the index itself).
    std::vector<EarlierMatch::Match> matches;
  };
  // The prompt's index with every token's match, built.
  static PromptIndex IndexPrompt(std::span<const int32_t> prompt);
  // Prompts indexed and not yet decoding, the oldest dropped past this many. A batch of up to this many
  // requests may start all its prompts in one step (when its requests end together) and keep every index for
  // the first decode decisions. A request that ends before its first decode step (max_tokens 1, or cancelled
  // or preempted during its prefill) takes its index with it (Release). An index of 16K tokens holds about
  // 2.3 MiB (bench_router_stats).
  static constexpr size_t kMaxPromptIndexes = 128;
  // Keeps a newly built index (counted in prompts_indexed), dropping the oldest past kMaxPromptIndexes.
  void KeepPromptIndex(PromptIndex index) const;
  // The newest index kept for this prompt, removed from prompt_indexes_, if there is one.
  std::optional<PromptIndex> TakePromptIndex(const std::vector<int32_t>& prompt);
  // A fresh slot takes its prompt's index if PrefillModes kept one (else its first decision builds one).
  void AdoptPromptIndex(const std::vector<int32_t>& prompt, SlotState& st);
  std::unique_ptr<Router> router_;
  RouterOptions options_;
  mutable std::deque<PromptIndex> prompt_indexes_;  // written by PrefillModes (const: it decides nothing)
  mutable int64_t prompts_indexed_ = 0;
  std::map<int64_t, SlotState> slots_;
  std::unique_ptr<speculative::SpeculativeDecoder> spec_;  // when the router may speculate
  // Per-step buffers, reused so that a decode step allocates nothing.
  std::vector<Decision> decisions_;
  bool decided_ = false;  // decisions_ hold this step's (made by RunAlone, for the Plan that follows)
  bool draft_attention_ = false;  // DraftAttentionSteps
  bool controlled_ = false;       // this step's rounds take the controller's length (DecideStep)
  std::vector<DecodeSlot*> plain_, speculating_;
  std::vector<int64_t> draft_lengths_;
};

// The tokens of the prefill segment that starts at `start`: segment_len (at least 1) of the prompt's first
// prompt_len - 1 tokens, the prompt's last token alone. With 0 < tail_len < segment_len, the last segment_len
// of those tokens (the tail) are cut finer toward the prompt's end, at tail_len, 2 tail_len, 4 tail_len, ...
// tokens before its last token, and the segments before the tail end where it begins. A policy can then attend
// to the prompt's last few tokens (where a continuation or a question begins) without its last whole segment:
// with 1,024 and 64, the tail is 512, 256, 128, 64 and 64 tokens.
int64_t PrefillSegmentTokens(int64_t start, int64_t prompt_len, int64_t segment_len, int64_t tail_len);

// FNV-1a of the prompt's ids (RouterContext::sequence_hash).
uint64_t PromptHash(std::span<const int32_t> prompt);

}  // namespace oryx::router
