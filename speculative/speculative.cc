#include "speculative/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/numbers.h"
#include "base/status_macros.h"
#include "base/str_cat.h"

namespace oryx::speculative {

namespace {
using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

int32_t Argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());  // first maximum
}
}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Proposers

void NgramProposer::Propose(const DecodeSlot& slot, int64_t k, Proposal& out) {
  out.tokens.clear();
  out.q.clear();
  // The context is the prompt, then the generated tokens (the last of which is the pending token).
  const int64_t n = slot.context_size();
  for (int64_t len = std::min<int64_t>(max_ngram_, n - 1); len >= min_ngram_ && out.tokens.empty(); --len) {
    const int64_t s = slot.LatestEarlierMatch(len);
    for (int64_t j = s + len; s >= 0 && j < n && static_cast<int64_t>(out.tokens.size()) < k; ++j) {
      out.tokens.push_back(slot.context_token(j));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Accepting

int64_t AcceptLossless(Sampler& sampler, std::span<const float> logits, const Proposal& draft, int64_t V,
                       int32_t* next) {
  const int64_t n = static_cast<int64_t>(draft.tokens.size());
  auto row = [&](int64_t i) { return logits.subspan(i * V, V); };
  if (sampler.params().greedy()) {
    std::vector<int32_t> targets(n + 1);
    for (int64_t i = 0; i <= n; ++i) targets[i] = Argmax(row(i));
    return AcceptGreedy(draft.tokens, targets, next);
  }
  std::vector<float> p;
  for (int64_t i = 0; i < n; ++i) {
    sampler.Distribution(row(i), &p);
    const int32_t d = draft.tokens[i];
    const float qd = draft.q.empty() ? 1.f : draft.q[i * V + d];
    if (sampler.Uniform() < static_cast<double>(p[d]) / qd) continue;  // qd > 0: d was drawn from q
    // Rejected: the recovered token from norm(max(0, p - q)).
    for (int64_t v = 0; v < V; ++v) {
      const float qv = draft.q.empty() ? (v == d ? 1.f : 0.f) : draft.q[i * V + v];
      p[v] = std::max(0.f, p[v] - qv);
    }
    *next = sampler.Draw(p);
    return i;
  }
  sampler.Distribution(row(n), &p);
  *next = sampler.Draw(p);
  return n;
}

// ---------------------------------------------------------------------------------------------------------
// Draft length

DraftLengthController::DraftLengthController(int64_t max_k)
    : max_k_(max_k), length_w_(max_k + 1, 0.0), length_s_(max_k + 1, 0.0) {}

DraftLengthController::Slot& DraftLengthController::SlotFor(int64_t slot_id) {
  // Acceptance starts optimistic (0.8 per position) until rounds are measured.
  return slots_.try_emplace(slot_id, Slot{std::vector<double>(max_k_, 0.8)}).first->second;
}

double DraftLengthController::RoundSeconds(int64_t k) const {
  if (k == 0) return plain_w_ > 0 ? std::max(1e-9, plain_s_ / plain_w_) : -1;
  // A length measured in about the last 30 rounds (0.95^27 = 0.25) is its own mean.
  constexpr double kRecentWeight = 0.25;
  if (length_w_[k] >= kRecentWeight) return std::max(1e-9, length_s_[k] / length_w_[k]);
  // Otherwise the line base + per_draft * k, fitted by weighted least squares over every length's sums.
  double w = 0, wx = 0, wy = 0, wxx = 0, wxy = 0;
  for (int64_t j = 1; j <= max_k_; ++j) {
    const double x = static_cast<double>(j);
    w += length_w_[j], wx += x * length_w_[j], wy += length_s_[j];
    wxx += x * x * length_w_[j], wxy += x * length_s_[j];
  }
  if (w <= 0) return -1;
  const double mx = wx / w, my = wy / w, var = wxx / w - mx * mx;
  if (var < 1e-9) return std::abs(static_cast<double>(k) - mx) < 0.5 ? my : -1;  // one length only: no slope yet
  const double slope = std::max(0.0, (wxy / w - mx * my) / var);
  return std::max(1e-9, my + slope * (static_cast<double>(k) - mx));
}

int64_t DraftLengthController::Choose(std::span<const int64_t> slot_ids) {
  // Measure a long round, a short one and a plain step first.
  if (RoundSeconds(1) < 0)
    return std::all_of(length_w_.begin(), length_w_.end(), [](double w) { return w == 0; }) ? max_k_ : 1;
  if (RoundSeconds(0) < 0) return 0;
  // Expected tokens per round for draft length k, summed over the slots: each slot's accepted prefix plus
  // its recovered / bonus token.
  std::vector<double> expected(max_k_ + 1, 0.0);
  for (int64_t id : slot_ids) {
    const Slot& s = SlotFor(id);
    double reach = 1.0, tokens = 1.0;
    expected[0] += tokens;
    for (int64_t k = 1; k <= max_k_; ++k) {
      reach *= s.accept[k - 1];  // P(the first k drafts are all accepted)
      tokens += reach;
      expected[k] += tokens;
    }
  }
  double best_rate = expected[0] / RoundSeconds(0);
  int64_t best_k = 0;
  for (int64_t k = 1; k <= max_k_; ++k) {
    const double rate = expected[k] / RoundSeconds(k);
    if (rate > best_rate) best_rate = rate, best_k = k;
  }
  // Probes, so that no estimate stays wrong for good after a few unlucky rounds: every 16th round drafts, in
  // turn, next to the best length (one more, one less at max_k, two when not drafting) or the length measured
  // least lately (the longest of equals), and while drafting every 64th round is a plain step (rounds that
  // draft never measure one).
  ++since_plain_;
  if (++since_probe_ >= 16) {
    since_probe_ = 0;
    far_probe_ = !far_probe_;
    if (!far_probe_) return best_k == 0 ? std::min<int64_t>(2, max_k_) : best_k < max_k_ ? best_k + 1 : best_k - 1;
    int64_t oldest = max_k_;
    for (int64_t k = max_k_ - 1; k >= 1; --k) {
      if (length_w_[k] < length_w_[oldest]) oldest = k;
    }
    return oldest;
  }
  if (best_k > 0 && since_plain_ >= 64) {
    since_plain_ = 0;
    return 0;
  }
  if (best_k == 0) since_plain_ = 0;
  return best_k;
}

void DraftLengthController::RecordRound(int64_t slot_id, int64_t drafted, int64_t accepted) {
  Slot& s = SlotFor(slot_id);
  constexpr double kDecay = 0.9;
  // Position i was reached when the i drafts before it were accepted.
  for (int64_t i = 0; i < std::min(drafted, accepted + 1) && i < max_k_; ++i) {
    s.accept[i] = kDecay * s.accept[i] + (1 - kDecay) * (i < accepted ? 1.0 : 0.0);
  }
}

void DraftLengthController::RecordCost(int64_t k, double round_s) {
  constexpr double kDecay = 0.95;
  if (k == 0) {
    plain_w_ = kDecay * plain_w_ + 1;
    plain_s_ = kDecay * plain_s_ + round_s;
    return;
  }
  if (k > max_k_) return;  // (a fixed length past max_k: the controller does not choose it)
  for (int64_t j = 1; j <= max_k_; ++j) {
    length_w_[j] = kDecay * length_w_[j] + (j == k ? 1 : 0);
    length_s_[j] = kDecay * length_s_[j] + (j == k ? round_s : 0);
  }
}

// ---------------------------------------------------------------------------------------------------------
// The round

namespace {
constexpr Mode kLinearMode[] = {Mode::kLinear};
constexpr Mode kAttentionMode[] = {Mode::kAttention};
}  // namespace

// One slot's round in progress, and what it keeps between rounds.
struct SpeculativeDecoder::SlotRound {
  enum class Phase { kIdle, kDrafting, kVerifying, kPlain };
  Phase phase = Phase::kIdle;
  int64_t k = 0;  // drafts this round
  Proposal draft;
  std::optional<SequenceState> draft_seq;  // linear drafts: a KV-less copy of the slot's state
  Clock::time_point start;
  int64_t warmups_at_start = 0;  // Backend::graph_warmups() when it started
  // What the step's forward item points at.
  int32_t input = 0, drawn = 0;
  std::vector<int32_t> span;
  std::vector<Mode> modes;
  std::vector<float> logits, q;
  int64_t last_drafted = -1, last_accepted = -1;
};

SpeculativeDecoder::SpeculativeDecoder(std::unique_ptr<Proposer> proposer, SpeculativeOptions options)
    : proposer_(std::move(proposer)),
      options_(std::move(options)),
      accept_(options_.accept ? options_.accept : AcceptRule(AcceptLossless)),
      controller_(options_.k > 0 ? options_.k : options_.max_k) {}

SpeculativeDecoder::~SpeculativeDecoder() = default;

SpeculativeDecoder::SlotRound& SpeculativeDecoder::RoundOf(int64_t slot_id) {
  std::unique_ptr<SlotRound>& r = rounds_[slot_id];
  if (!r) r = std::make_unique<SlotRound>();
  return *r;
}

void SpeculativeDecoder::Release(const DecodeSlot& slot) {
  rounds_.erase(slot.id);
  controller_.Release(slot.id);
}

bool SpeculativeDecoder::InRound(int64_t slot_id) const {
  auto it = rounds_.find(slot_id);
  return it != rounds_.end() && it->second->phase != SlotRound::Phase::kIdle;
}

std::pair<int64_t, int64_t> SpeculativeDecoder::LastRound(int64_t slot_id) const {
  auto it = rounds_.find(slot_id);
  if (it == rounds_.end()) return {-1, -1};
  return {it->second->last_drafted, it->second->last_accepted};
}

int64_t SpeculativeDecoder::DraftLength(const ModelConfig& c, const DecodeSlot& s, int64_t want) const {
  // The verify span [x, d_1..d_k] must fit below max_position (ChooseLengths then gives the batch the shortest
  // such length). A round may draft past the request's end (the engine emits nothing past max_tokens): cutting
  // the length there would take a batch out of its one length, and so out of whole rounds on the device, and
  // give the host's rounds other lengths than the device's.
  return std::max<int64_t>(
      0, std::min({want, options_.k > 0 ? options_.k : options_.max_k, c.max_position - s.seq->position() - 1}));
}

void SpeculativeDecoder::ChooseLengths(const ModelConfig& c, std::span<DecodeSlot* const> slots,
                                       std::span<const int64_t> want) {
  k_.assign(slots.size(), 0);
  if (!want.empty()) {
    for (size_t i = 0; i < slots.size(); ++i) k_[i] = DraftLength(c, *slots[i], want[i]);
    return;
  }
  ids_.clear();
  for (const DecodeSlot* s : slots) {
    if (!InRound(s->id)) ids_.push_back(s->id);
  }
  int64_t k = options_.k;
  if (k == 0 && !ids_.empty()) k = controller_.Choose(ids_);
  // One length for the batch: the shortest that a slot starting a round has room for below max_position, so
  // that the round stays whole while a request nears the end of the context. (Left to a slot alone, its
  // shorter length took the batch out of whole device rounds: the others then started rounds run as engine
  // steps, which at 16K and batch 64 cost 1.4-1.7x a device round.)
  for (const DecodeSlot* s : slots) {
    if (!InRound(s->id)) k = DraftLength(c, *s, k);
  }
  k_.assign(slots.size(), k);
}

void SpeculativeDecoder::Account(DecodeSlot& s, int64_t drafted, int64_t accepted, double round_s) {
  s.stats->attention_tokens += drafted + 1;
  if (!s.stats->spec) s.stats->spec.emplace();
  SpecStats& st = *s.stats->spec;
  const int64_t positions = options_.k > 0 ? options_.k : options_.max_k;
  st.drafted_at.resize(positions);
  st.accepted_at.resize(positions);
  ++st.rounds;
  st.drafted += drafted;
  st.accepted += accepted;
  for (int64_t j = 0; j < drafted; ++j) {
    ++st.drafted_at[j];
    if (j < accepted) ++st.accepted_at[j];
  }
  st.rounds_by_length.resize(positions + 1);
  st.round_s_by_length.resize(positions + 1);
  ++st.rounds_by_length[drafted];
  st.round_s_by_length[drafted] += round_s;
  controller_.RecordRound(s.id, drafted, accepted);
  SlotRound& r = RoundOf(s.id);
  r.last_drafted = drafted;
  r.last_accepted = accepted;
}

absl::StatusOr<SequenceState*> SpeculativeDecoder::DraftOf(const DecodeSlot& s, bool refresh) {
  SlotRound& r = RoundOf(s.id);
  if (!r.draft_seq) {
    ORYX_ASSIGN_OR_RETURN(SequenceState draft, s.seq->TryMakeDraft());
    r.draft_seq.emplace(std::move(draft));
  } else if (refresh) {
    r.draft_seq->CopyRecurrentFrom(*s.seq);
  }
  return &*r.draft_seq;
}

absl::Status SpeculativeDecoder::Commit(DecodeSlot& s, std::span<const int32_t> drafts, int64_t accepted, int32_t next,
                                        double round_s, bool cut) {
  const int64_t drafted = static_cast<int64_t>(drafts.size());
  if (drafted > 0 && !cut) {  // the sequence is after [x, d_1..d_k]: back to after x and the accepted drafts
    ORYX_RETURN_IF_ERROR(s.seq->Truncate(s.seq->position() - drafted + accepted));
  }
  s.emitted.assign(drafts.begin(), drafts.begin() + accepted);
  s.emitted.push_back(next);
  Account(s, drafted, accepted, round_s);
  return absl::OkStatus();
}

absl::StatusOr<bool> SpeculativeDecoder::RunWhole(Backend& backend, std::span<DecodeSlot* const> slots,
                                                  std::span<const int64_t> want) {
  if (slots.empty() || !backend.runs_rounds() || !proposer_->drafts_in_linear_mode() || options_.accept) {
    return false;
  }
  if (std::any_of(slots.begin(), slots.end(), [this](const DecodeSlot* s) { return InRound(s->id); })) {
    // Some slots are inside rounds run step by step. The others take plain steps until those end, so that
    // the batch's next round is whole again; starting rounds of their own, they would keep the batch out of
    // step, in rounds of one forward a step (at batch 64 on the H200, 1.9-2.3x a device round's time).
    k_.assign(slots.size(), 0);
    lengths_chosen_ = true;
    return false;
  }
  ChooseLengths(backend.config(), slots, want);
  lengths_chosen_ = true;  // PlanRounds takes these when the round does not qualify
  // One draft length and one sampling distribution (the backend's kernels take the parameters per launch).
  const int64_t k = k_[0];
  const SamplingParams& first = slots[0]->sampler->params();
  for (size_t i = 0; i < slots.size(); ++i) {
    if (k_[i] != k || !slots[i]->sampler->params().SameDistributionAs(first)) return false;
  }
  if (k < 1) return false;
  // What the controller is told the round cost: everything it does, the draft states' copies and the
  // rollbacks included (the caller's, when the backend leaves them to it: a copy per slot each, which at batch
  // 64 are not small beside the round itself).
  const auto round_start = Clock::now();
  round_items_.resize(slots.size());
  round_results_.resize(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    DecodeSlot& s = *slots[i];
    ORYX_ASSIGN_OR_RETURN(SequenceState * draft, DraftOf(s, /*refresh=*/false));
    round_items_[i] = {s.seq, draft, s.pending, s.sampler, &round_results_[i]};
  }
  lengths_chosen_ = false;
  const int64_t warmups = backend.graph_warmups();
  const auto t0 = Clock::now();
  ORYX_RETURN_IF_ERROR(backend.SpeculativeRound(round_items_, k));
  const double round_s = Seconds(t0);
  for (size_t i = 0; i < slots.size(); ++i) {
    DecodeSlot& s = *slots[i];
    const RoundResult& res = round_results_[i];
    int64_t accepted = res.accepted;
    int32_t next = res.next;
    if (s.sampler->params().greedy()) {
      // A backend that cut the sequence counted the accepted drafts by the same rule.
      if (!res.cut) accepted = AcceptGreedy(res.drafts, res.targets, &next);
    } else {  // the backend peeked the round's uniforms: the stream goes past the ones it used
      s.sampler->SkipUniforms(UniformsOfSampledRound(k, accepted));
    }
    s.stats->linear_tokens += k;
    ORYX_RETURN_IF_ERROR(Commit(s, res.drafts, accepted, next, round_s, res.cut));
    s.stats->spec->backend_round_s += round_s;
    ++s.stats->spec->backend_rounds;
  }
  // A round that ran before its shape's graph (launched kernel by kernel, or recording the graph) took longer
  // than the next ones will: no measure of what they cost.
  if (backend.graph_warmups() == warmups) controller_.RecordCost(k, Seconds(round_start));
  return true;
}

absl::Status SpeculativeDecoder::PlanRounds(const Backend& backend, std::span<DecodeSlot* const> slots,
                                            std::span<const int64_t> want, std::vector<ForwardItem>& items) {
  const ModelConfig& c = backend.config();
  vocab_ = c.vocab_size;
  if (!lengths_chosen_) ChooseLengths(c, slots, want);
  lengths_chosen_ = false;
  planned_at_ = Clock::now();
  backend_ = &backend;
  const bool linear = proposer_->drafts_in_linear_mode();
  using Phase = SlotRound::Phase;
  for (size_t i = 0; i < slots.size(); ++i) {
    DecodeSlot& s = *slots[i];
    SlotRound& r = RoundOf(s.id);
    if (r.phase == Phase::kIdle) {  // 1. Propose: a new round
      r.k = k_[i];
      r.start = planned_at_;
      r.warmups_at_start = backend.graph_warmups();
      r.draft.tokens.clear();
      r.draft.q.clear();
      if (r.k > 0 && !linear) {
        proposer_->Propose(s, r.k, r.draft);
        r.k = static_cast<int64_t>(r.draft.tokens.size());
      }
      if (r.k > 0 && linear) {
        ORYX_RETURN_IF_ERROR(DraftOf(s, /*refresh=*/true).status());
        r.phase = Phase::kDrafting;
      } else {
        r.phase = r.k > 0 ? Phase::kVerifying : Phase::kPlain;
      }
    }
    switch (r.phase) {
      case Phase::kDrafting:  // one linear-mode draft step
        r.input = r.draft.tokens.empty() ? s.pending : r.draft.tokens.back();
        if (s.sampler->params().greedy()) {  // the argmax, drawn by the backend (a point mass: no q rows)
          items.push_back({&*r.draft_seq, std::span(&r.input, 1), kLinearMode, LogitsRows::kLast, nullptr, false,
                           s.sampler, &r.drawn});
        } else {
          items.push_back({&*r.draft_seq, std::span(&r.input, 1), kLinearMode, LogitsRows::kLast, &r.logits, false});
        }
        break;
      case Phase::kVerifying:  // 2. Verify: attention mode over [x, d_1..d_k], keeping the states for rollback
        r.span.assign(1, s.pending);
        r.span.insert(r.span.end(), r.draft.tokens.begin(), r.draft.tokens.end());
        r.modes.assign(r.span.size(), Mode::kAttention);
        items.push_back({s.seq, r.span, r.modes, LogitsRows::kAll, &r.logits, /*keep_states=*/true});
        break;
      case Phase::kPlain:  // no drafts: a plain attention-mode step, the next token drawn by the backend
        items.push_back({s.seq, std::span(&s.pending, 1), kAttentionMode, LogitsRows::kLast, nullptr, false, s.sampler,
                         &r.drawn});
        break;
      case Phase::kIdle:
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status SpeculativeDecoder::Finish(std::span<DecodeSlot* const> slots) {
  const double step_s = Seconds(planned_at_);
  const auto now = Clock::now();
  using Phase = SlotRound::Phase;
  ended_.clear();  // (k, seconds) of the rounds that end here, for the controller's cost fit
  for (DecodeSlot* sp : slots) {
    DecodeSlot& s = *sp;
    SlotRound& r = RoundOf(s.id);
    s.emitted.clear();
    if (!s.stats->spec) s.stats->spec.emplace();
    SpecStats& st = *s.stats->spec;
    const double round_s = std::chrono::duration<double>(now - r.start).count();  // if the round ends here
    switch (r.phase) {
      case Phase::kDrafting: {
        ++s.stats->linear_tokens;
        st.draft_s += step_s;
        ++st.draft_forwards;
        Sampler& sampler = *s.sampler;
        if (sampler.params().greedy()) {
          r.draft.tokens.push_back(r.drawn);
        } else {
          sampler.Distribution(r.logits, &r.q);
          r.draft.tokens.push_back(sampler.Draw(r.q));
          r.draft.q.insert(r.draft.q.end(), r.q.begin(), r.q.end());
        }
        if (static_cast<int64_t>(r.draft.tokens.size()) == r.k) r.phase = Phase::kVerifying;
        continue;
      }
      case Phase::kVerifying: {  // 3. Accept and 4. commit, each sequence its own count
        int32_t next = 0;
        const int64_t accepted = accept_(*s.sampler, r.logits, r.draft, vocab_, &next);
        ORYX_RETURN_IF_ERROR(Commit(s, r.draft.tokens, accepted, next, round_s));
        break;
      }
      case Phase::kPlain:
        s.emitted.assign(1, r.drawn);
        Account(s, 0, 0, round_s);
        break;
      case Phase::kIdle:
        continue;
    }
    st.verify_s += step_s;
    ++st.verify_forwards;
    r.phase = Phase::kIdle;
    if (backend_->graph_warmups() != r.warmups_at_start) continue;  // its time is a shape's before its graph
    auto it = std::find_if(ended_.begin(), ended_.end(), [&](const auto& e) { return e.first == r.k; });
    if (it == ended_.end()) {
      ended_.emplace_back(r.k, round_s);
    } else {
      it->second = std::max(it->second, round_s);
    }
  }
  for (const auto& [k, round_s] : ended_) controller_.RecordCost(k, round_s);
  return absl::OkStatus();
}

absl::Status SpeculativeDecoder::Round(Backend& backend, std::span<DecodeSlot* const> slots,
                                       std::span<const int64_t> want) {
  ORYX_ASSIGN_OR_RETURN(const bool ran, RunWhole(backend, slots, want));
  if (ran) return absl::OkStatus();
  std::vector<ForwardItem> items;
  do {
    items.clear();
    ORYX_RETURN_IF_ERROR(PlanRounds(backend, slots, want, items));
    if (!items.empty()) ORYX_RETURN_IF_ERROR(backend.Forward(items));
    ORYX_RETURN_IF_ERROR(Finish(slots));
  } while (std::any_of(slots.begin(), slots.end(), [this](const DecodeSlot* s) { return InRound(s->id); }));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------------------
// Policies

absl::StatusOr<std::unique_ptr<Decoder>> MakeSpeculativeDecoder(std::string_view policy) {
  std::string_view rest = policy;
  if (!rest.starts_with("speculative")) return absl::InvalidArgumentError(Cat("not a speculative policy: ", policy));
  rest.remove_prefix(std::string_view("speculative").size());
  std::unique_ptr<Proposer> proposer;
  if (rest.starts_with(":ngram")) {
    proposer = std::make_unique<NgramProposer>();
    rest.remove_prefix(std::string_view(":ngram").size());
  } else {
    proposer = std::make_unique<LinearProposer>();
  }
  SpeculativeOptions options;
  if (!rest.empty()) {
    int64_t k = 0;
    if (rest[0] != ':' || !absl::SimpleAtoi(absl::string_view(rest.data() + 1, rest.size() - 1), &k) || k < 1 ||
        k > 64) {
      return absl::InvalidArgumentError(
          Cat("policy '", policy, "': expected speculative[:K] or speculative:ngram[:K] with 1 <= K <= 64"));
    }
    options.k = k;
  }
  return std::unique_ptr<Decoder>(new SpeculativeDecoder(std::move(proposer), std::move(options)));
}

void RegisterPolicies(PolicyRegistry& registry) {
  registry.Register("speculative", "speculative[:K], speculative:ngram[:K]", MakeSpeculativeDecoder);
}

}  // namespace oryx::speculative
