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
#include <cstdint>
#include <functional>
#include <map>
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

class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual std::string_view name() const = 0;
  // For each slot, up to k[i] tokens following slots[i]->pending, drawn with the slot's sampler settings.
  // Must not change the slots' sequences. Linear-mode tokens it runs are added to the slot's linear_tokens.
  virtual absl::Status Propose(Backend& backend, std::span<DecodeSlot* const> slots, std::span<const int64_t> k,
                               std::span<Proposal> out) = 0;
  // Batched model forwards the last Propose ran.
  virtual int64_t last_forwards() const { return 0; }
  // The slot has finished: drop what the proposer keeps for it.
  virtual void Release(int64_t slot_id) { (void)slot_id; }
};

// Drafts in linear mode on a KV-less copy of each sequence's recurrent state (no attention reads, no KV
// writes): k batched linear decode steps from the pending token. Greedy slots get the argmax and no q rows
// (a point mass: greedy acceptance needs none).
class LinearProposer final : public Proposer {
 public:
  std::string_view name() const override { return "linear"; }
  absl::Status Propose(Backend& backend, std::span<DecodeSlot* const> slots, std::span<const int64_t> k,
                       std::span<Proposal> out) override;
  int64_t last_forwards() const override { return last_forwards_; }
  void Release(int64_t slot_id) override { drafts_.erase(slot_id); }
  // The slot's draft sequence (made on first use; refreshed from the slot's sequence by whoever runs it);
  // ResourceExhausted when the device has no room for it.
  absl::StatusOr<SequenceState*> DraftFor(const DecodeSlot& slot);

 private:
  std::map<int64_t, SequenceState> drafts_;  // by slot id, refreshed every round
  int64_t last_forwards_ = 0;
};

// Prompt lookup: finds the latest earlier occurrence of the context's last n tokens (n from max_ngram down
// to min_ngram) and proposes the tokens that followed it. Free to run; proposes with certainty.
class NgramProposer final : public Proposer {
 public:
  explicit NgramProposer(int max_ngram = 3, int min_ngram = 1) : max_ngram_(max_ngram), min_ngram_(min_ngram) {}
  std::string_view name() const override { return "ngram"; }
  absl::Status Propose(Backend& backend, std::span<DecodeSlot* const> slots, std::span<const int64_t> k,
                       std::span<Proposal> out) override;

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

struct SpeculativeOptions {
  int64_t k = 0;        // fixed draft length; 0: adaptive (chosen per round up to max_k)
  int64_t max_k = 8;
  AcceptRule accept = AcceptLossless;
};

// Chooses the draft length of each batched round: from the acceptance rate measured at each draft position
// of each slot (exponential averages) and the measured round times, the one k that maximises the batch's
// expected tokens per second, k = 0 (plain attention decoding) included. One k for the whole batch, so that
// the round can run whole on the backend (Backend::SpeculativeRound takes one draft length) and a slot that
// joins a running batch (a server's) does not split it. A round of draft length k costs k draft steps and a
// verify span of k + 1 tokens per slot, so its time is fitted as base + per_draft * k by weighted least
// squares over recent rounds (whether the backend ran the round whole or the decoder ran it forward by
// forward); the first two rounds use k = max_k and k = 1 so that the fit has two lengths. When k = 0 wins it
// still probes with a short draft every few rounds so that the estimates can recover.
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
  // The fitted time of a round of draft length k, or a negative number before there is a fit.
  double RoundSeconds(double k) const;
  Slot& SlotFor(int64_t slot_id);
  int64_t max_k_;
  std::map<int64_t, Slot> slots_;
  int64_t since_probe_ = 0;
  double w_ = 0, wx_ = 0, wy_ = 0, wxx_ = 0, wxy_ = 0;  // decayed sums of (k, round seconds)
};

// The speculative decoder: rounds of propose / verify / accept / commit, batched over slots (each accepts
// its own number of tokens). When every slot drafts with the linear proposer at one draft length and with
// one sampling distribution, is judged by AcceptLossless, and the backend runs whole rounds
// (Backend::backend_rounds), the round is the backend's SpeculativeRound: the same forwards and, up to
// rounding at near ties of the sampled distributions, the same tokens, without a return to the host between
// them.
class SpeculativeDecoder final : public Decoder {
 public:
  SpeculativeDecoder(std::unique_ptr<Proposer> proposer, SpeculativeOptions options);
  void PrefillModes(std::span<const int32_t>, int64_t, std::span<Mode> modes) const override {
    std::fill(modes.begin(), modes.end(), Mode::kAttention);
  }
  int64_t Lookahead() const override { return options_.k > 0 ? options_.k + 1 : options_.max_k + 1; }
  absl::Status Step(Backend& backend, std::span<DecodeSlot* const> slots) override;
  void Release(int64_t slot_id) override {
    proposer_->Release(slot_id);
    controller_.Release(slot_id);
  }
  // One round for each slot with the draft length given for it (k[i] <= max_k; 0: a plain attention step
  // through the same verify forward). Step is Round with the controller's (or the fixed) k.
  absl::Status Round(Backend& backend, std::span<DecodeSlot* const> slots, std::span<const int64_t> k);

 private:
  // Backend::SpeculativeRound for the slots, all with draft length k, when the round qualifies (see above);
  // false when it does not and nothing ran.
  absl::StatusOr<bool> MaybeBackendRound(Backend& backend, std::span<DecodeSlot* const> slots, int64_t k);
  // Every slot's round has no drafts: a plain attention-mode decode step, the next tokens drawn by the
  // backend (on the device where it can), exactly as attention-mode decoding runs it.
  absl::Status PlainStep(Backend& backend, std::span<DecodeSlot* const> slots);
  // Counts a slot's round (its drafts and how many were accepted) in its stats and the controller.
  void Account(DecodeSlot& s, int64_t drafted, int64_t accepted);
  std::vector<RoundItem> round_items_;
  std::unique_ptr<Proposer> proposer_;
  SpeculativeOptions options_;
  DraftLengthController controller_;
  std::vector<Proposal> proposals_;
  std::vector<int64_t> want_, k_, ids_;
  std::vector<std::vector<int32_t>> spans_;
  std::vector<std::vector<Mode>> modes_;
  std::vector<std::vector<float>> logits_;
  std::vector<ForwardItem> items_;
  std::vector<int32_t> next_;
};

// Parses speculative[:K] and speculative:ngram[:K] (K >= 1; omitted: adaptive).
absl::StatusOr<std::unique_ptr<Decoder>> MakeSpeculativeDecoder(std::string_view policy);
// Adds those names to a registry.
void RegisterPolicies(PolicyRegistry& registry);

}  // namespace oryx::speculative
