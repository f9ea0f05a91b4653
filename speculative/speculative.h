// Speculative decoding inside one model (DESIGN.md §6): cheap proposals verified in attention mode over
// the same state, so that the output is exactly attention-mode decoding's.
//
// Words used here, for one round of a sequence whose next token x ("pending") is known but not yet run:
//   draft      up to k proposed tokens d_1..d_k following x, each with the distribution q_{i-1} it was drawn
//              from (a proposer that copies tokens, like the n-gram one, proposes with certainty: q is a
//              point mass).
//   verify     one attention-mode forward over [x, d_1..d_k] (k+1 tokens), giving the target distributions
//              p_0..p_k, with the states inside the span kept for rollback.
//   accept     d_i is accepted while the previous ones were and: greedy, d_i == argmax p_{i-1}; sampling,
//              u < p_{i-1}(d_i) / q_{i-1}(d_i) for a fresh uniform u.
//   recovered  at the first rejection (of d_i), the token drawn from norm(max(0, p_{i-1} - q_{i-1})); greedy:
//              argmax p_{i-1}. It replaces d_i.
//   bonus      when all k are accepted, the token drawn from p_k.
//   commit     cut the sequence back to just after x and the accepted drafts (Truncate inside the kept span:
//              KV entries and the recurrent and conv state there), without running the model again.
// A round emits the accepted drafts and then the recovered or bonus token, which becomes the next pending.
// With this rule every emitted token has exactly attention mode's distribution (greedy: the same token).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"

namespace oryx::speculative {

// A proposal for one sequence.
struct Proposal {
  std::vector<int32_t> tokens;  // d_1..d_n, n <= the k asked for
  std::vector<float> q;         // [n, V]: q_0..q_{n-1}; empty when proposed with certainty (point masses)
};

// Where a round's drafts come from. A proposer that drafts with the model (linear mode) only says so: the
// decoder runs its draft steps, one forward each, inside the engine's steps, or the backend runs the whole
// round (Backend::SpeculativeRound). The others propose at once, without the model.
class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual std::string_view name() const = 0;
  // Drafts are the model's own, in linear mode on a KV-less copy of the slot's state (SequenceState::MakeDraft):
  // k linear decode steps from the pending token, each drawn from the last step's distribution (greedy: its
  // argmax, and no q rows: greedy acceptance needs none).
  virtual bool drafts_in_linear_mode() const { return false; }
  // Otherwise: up to k tokens following slot.pending, into out (tokens, and q, or no q: point masses).
  virtual void Propose(const DecodeSlot& slot, int64_t k, Proposal& out) { (void)slot, (void)k, (void)out; }
};

// Drafts in linear mode (see drafts_in_linear_mode): no attention reads, no KV writes.
class LinearProposer final : public Proposer {
 public:
  std::string_view name() const override { return "linear"; }
  bool drafts_in_linear_mode() const override { return true; }
};

// Prompt lookup: finds the latest earlier occurrence of the context's last n tokens (n from max_ngram down
// to min_ngram) and proposes the tokens that followed it. Free to run; proposes with certainty.
class NgramProposer final : public Proposer {
 public:
  explicit NgramProposer(int max_ngram = 3, int min_ngram = 1) : max_ngram_(max_ngram), min_ngram_(min_ngram) {}
  std::string_view name() const override { return "ngram"; }
  void Propose(const DecodeSlot& slot, int64_t k, Proposal& out) override;

 private:
  int max_ngram_, min_ngram_;
};

// The accept rule: given the verify logits [n+1, V] (rows p_0..p_n before sampling transforms), the drafts
// and their q (empty: point masses), returns how many drafts are accepted and sets *next to the recovered or
// bonus token. AcceptLossless is the rule above; tests substitute wrong rules to show the tests catch them.
using AcceptRule = std::function<int64_t(Sampler& sampler, std::span<const float> logits, const Proposal& draft,
                                         int64_t vocab, int32_t* next)>;
int64_t AcceptLossless(Sampler& sampler, std::span<const float> logits, const Proposal& draft, int64_t vocab,
                       int32_t* next);
// The greedy case of the rule is AcceptGreedy (engine/backend.h), from the argmax of each verify row.

struct SpeculativeOptions {
  int64_t k = 0;        // fixed draft length; 0: adaptive (chosen per round up to max_k)
  int64_t max_k = 8;
  // Empty: AcceptLossless, which a backend may also run on the device (whole rounds). Tests substitute
  // wrong rules to show that the tests catch them; rounds then always run on the host.
  AcceptRule accept = {};
};

// Chooses the draft length of each batched round: from the acceptance rate measured at each draft position
// of each slot (exponential averages) and the measured round times, the one k that maximises the batch's
// expected tokens per second, k = 0 (plain attention decoding) included. One k for the whole batch, so that
// the round can run whole on the backend (Backend::SpeculativeRound takes one draft length) and a slot that
// joins a running batch (a server's) does not split it. A round of draft length k >= 1 costs k draft steps
// and a verify span of k + 1 tokens per slot. Its time is each length's own recent mean where that length
// was measured lately; otherwise base + per_draft * k, fitted by weighted least squares over recent rounds
// of every length (whether the backend ran the round whole or the decoder ran it forward by forward). The
// line alone is not enough: round times need not be a line in k (on the GPU a verify of 2 rows reads the KV
// cache at a decode step's rate, one of 3 rows takes another kernel). A plain step (k = 0) is a forward of
// one token per slot, on paths the verify span may not take, so its time is measured on its own (a recent
// mean). The first three rounds use k = max_k, 1 and 0 so that every estimate has a measurement. Every few
// rounds it probes, in turn, next to the best length (one longer, or one shorter at max_k; a short draft
// when not drafting) and at the length measured least lately, and, more rarely, with a plain step when
// drafting wins, so that an estimate that happened to come out wrong is measured again.
class DraftLengthController {
 public:
  explicit DraftLengthController(int64_t max_k);
  int64_t Choose(std::span<const int64_t> slot_ids);
  void RecordRound(int64_t slot_id, int64_t drafted, int64_t accepted);
  // The wall time of one batched round whose longest draft was k.
  void RecordCost(int64_t k, double round_s);
  void Release(int64_t slot_id) { slots_.erase(slot_id); }

 private:
  struct Slot {
    std::vector<double> accept;  // P(d_{i+1} accepted | d_1..d_i accepted), per position
  };
  // The estimated time of a round of draft length k (k = 0: a plain step), or a negative number before
  // there is one.
  double RoundSeconds(int64_t k) const;
  Slot& SlotFor(int64_t slot_id);
  int64_t max_k_;
  std::map<int64_t, Slot> slots_;
  int64_t since_probe_ = 0, since_plain_ = 0;
  bool far_probe_ = false;                              // whether the next probe is at the length measured least lately
  std::vector<double> length_w_, length_s_;             // [k]: decayed sums of (1, seconds) of rounds of length k >= 1
  double plain_w_ = 0, plain_s_ = 0;                    // decayed sums of (1, seconds), plain steps
};

// The speculative decoder: rounds of propose / verify / accept / commit, each slot its own round and its own
// count of accepted tokens. A round is a sequence of engine steps, each sharing the engine's one forward
// with everything else in the batch: with linear drafts, k draft steps (one linear-mode token on the slot's
// draft sequence each), then the verify step (the span [x, d_1..d_k] in attention mode); with proposals made
// at once (n-gram), the verify step alone; with k = 0, a plain attention step. When the decoder's slots are
// the step's only work, every slot starts a round with the same draft length and sampling distribution, the
// drafts are linear and judged by the lossless rule, and the backend runs whole rounds
// (Backend::runs_rounds), the round is the backend's SpeculativeRound instead (RunAlone): the same forwards
// and, up to rounding at near ties of the sampled distributions, the same tokens, without a return to the
// host between them. Both ways end in one commit (Commit) and one account of the round.
class SpeculativeDecoder final : public Decoder {
 public:
  SpeculativeDecoder(std::unique_ptr<Proposer> proposer, SpeculativeOptions options);
  ~SpeculativeDecoder() override;
  void PrefillModes(std::span<const int32_t>, int64_t, std::span<Mode> modes) const override {
    std::fill(modes.begin(), modes.end(), Mode::kAttention);
  }
  int64_t Lookahead() const override { return options_.k > 0 ? options_.k + 1 : options_.max_k + 1; }
  // Slots between rounds start one with the controller's (or the fixed) draft length.
  absl::Status Plan(const Backend& backend, std::span<DecodeSlot* const> slots,
                    std::vector<ForwardItem>& items) override {
    return PlanRounds(backend, slots, {}, items);
  }
  absl::Status Finish(std::span<DecodeSlot* const> slots) override;
  absl::StatusOr<bool> RunAlone(Backend& backend, std::span<DecodeSlot* const> slots) override {
    return RunWhole(backend, slots, {});
  }
  bool RunsAlone(const Backend& backend) const override {
    return backend.runs_rounds() && proposer_->drafts_in_linear_mode() && !options_.accept;
  }
  // RunWhole chose the lengths and declined, and no slot between rounds starts a drafting one (a plain step
  // each; slots inside rounds run step by step go on with them).
  bool PlainStep() const override {
    return lengths_chosen_ && std::all_of(k_.begin(), k_.end(), [](int64_t k) { return k == 0; });
  }
  void Release(const DecodeSlot& slot) override;
  // Its rounds judge drafts against distributions that penalties would change within a round: not built.
  bool FollowsLogitAdjustments() const override { return false; }

  // Plan with the draft length of each slot that starts a round given (want[i] <= max_k; 0: a plain attention
  // step; empty: the controller's). For a router that chooses the lengths.
  absl::Status PlanRounds(const Backend& backend, std::span<DecodeSlot* const> slots, std::span<const int64_t> want,
                          std::vector<ForwardItem>& items);
  // The backend's whole round for every slot (RunAlone), with the draft lengths given as in PlanRounds; false
  // when the round does not qualify (see above) and nothing ran.
  absl::StatusOr<bool> RunWhole(Backend& backend, std::span<DecodeSlot* const> slots, std::span<const int64_t> want);
  // One whole round for each slot, by the backend or step by step: for benchmarks and tests.
  absl::Status Round(Backend& backend, std::span<DecodeSlot* const> slots, std::span<const int64_t> want);
  // Whether the slot is inside a round (drafting, or its verify span planned).
  bool InRound(int64_t slot_id) const;
  // The slot's last finished round: (drafted, accepted), or (-1, -1) before its first.
  std::pair<int64_t, int64_t> LastRound(int64_t slot_id) const;

 private:
  struct SlotRound;
  SlotRound& RoundOf(int64_t slot_id);
  // The draft length a slot's round would have: want (or the fixed k / max_k) cut so that the verify span
  // fits below max_position.
  int64_t DraftLength(const ModelConfig& config, const DecodeSlot& s, int64_t want) const;
  // The draft lengths of slots starting a round now: `want`, or one for all of them (the controller's choice, or
  // options' k) cut to the room below max_position that the slot with the least has.
  void ChooseLengths(const ModelConfig& config, std::span<DecodeSlot* const> slots, std::span<const int64_t> want);
  // The slot's draft sequence (made on first use), holding its sequence's recurrent state now when `refresh`
  // (a round the backend runs whole refreshes it itself); ResourceExhausted when the device has no room for it.
  absl::StatusOr<SequenceState*> DraftOf(const DecodeSlot& s, bool refresh);
  // The round's end, however it ran: cuts the sequence back to after x and the accepted drafts (unless the
  // backend did: `cut`), emits them and the next token, and counts the round.
  absl::Status Commit(DecodeSlot& s, std::span<const int32_t> drafts, int64_t accepted, int32_t next, double round_s,
                      bool cut = false);
  // Counts a slot's round (its drafts, how many were accepted, its wall time) in its stats and the controller.
  void Account(DecodeSlot& s, int64_t drafted, int64_t accepted, double round_s);
  std::unique_ptr<Proposer> proposer_;
  SpeculativeOptions options_;
  AcceptRule accept_;  // options_.accept, or AcceptLossless
  DraftLengthController controller_;
  std::map<int64_t, std::unique_ptr<SlotRound>> rounds_;  // by slot id
  std::vector<int64_t> k_, ids_;
  std::vector<RoundItem> round_items_;
  std::vector<RoundResult> round_results_;
  std::chrono::steady_clock::time_point planned_at_;  // when the last Plan ran (its forward follows)
  const Backend* backend_ = nullptr;                  // the last Plan's
  int64_t vocab_ = 0;
  bool lengths_chosen_ = false;  // RunWhole chose k_ and ran nothing: the Plan that follows takes them
  std::vector<std::pair<int64_t, double>> ended_;
};

// Parses speculative[:K] and speculative:ngram[:K] (K >= 1; omitted: adaptive).
absl::StatusOr<std::unique_ptr<Decoder>> MakeSpeculativeDecoder(std::string_view policy);
// Adds those names to a registry.
void RegisterPolicies(PolicyRegistry& registry);

}  // namespace oryx::speculative
