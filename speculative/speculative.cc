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

absl::StatusOr<SequenceState*> LinearProposer::DraftFor(const DecodeSlot& slot) {
  auto it = drafts_.find(slot.id);
  if (it == drafts_.end()) {
    ORYX_ASSIGN_OR_RETURN(SequenceState draft, slot.seq->TryMakeDraft());
    it = drafts_.emplace(slot.id, std::move(draft)).first;
  }
  return &it->second;
}

absl::Status LinearProposer::Propose(Backend& backend, std::span<DecodeSlot* const> slots,
                                     std::span<const int64_t> k, std::span<Proposal> out) {
  std::vector<SequenceState*> draft(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    out[i].tokens.clear();
    out[i].q.clear();
    draft[i] = nullptr;
    if (k[i] == 0) continue;
    ORYX_ASSIGN_OR_RETURN(draft[i], DraftFor(*slots[i]));
    draft[i]->CopyRecurrentFrom(*slots[i]->seq);
  }
  const int64_t steps = k.empty() ? 0 : *std::max_element(k.begin(), k.end());
  const Mode linear = Mode::kLinear;
  std::vector<int32_t> inputs(slots.size());
  std::vector<std::vector<float>> logits(slots.size());
  std::vector<ForwardItem> items;
  std::vector<size_t> who;
  std::vector<float> q;
  for (int64_t step = 0; step < steps; ++step) {
    items.clear();
    who.clear();
    for (size_t i = 0; i < slots.size(); ++i) {
      if (step >= k[i]) continue;
      inputs[i] = step == 0 ? slots[i]->pending : out[i].tokens.back();
      items.push_back({draft[i], std::span(&inputs[i], 1), std::span(&linear, 1), LogitsRows::kLast, &logits[i], false});
      who.push_back(i);
    }
    ORYX_RETURN_IF_ERROR(backend.Forward(items));
    for (size_t i : who) {
      Sampler& sampler = *slots[i]->sampler;
      ++slots[i]->stats->linear_tokens;
      if (sampler.params().greedy()) {  // a point mass: no q rows (greedy acceptance compares argmaxes)
        out[i].tokens.push_back(Argmax(logits[i]));
        continue;
      }
      sampler.Distribution(logits[i], &q);
      out[i].tokens.push_back(sampler.Draw(q));
      out[i].q.insert(out[i].q.end(), q.begin(), q.end());
    }
  }
  last_forwards_ = steps;
  return absl::OkStatus();
}

absl::Status NgramProposer::Propose(Backend&, std::span<DecodeSlot* const> slots, std::span<const int64_t> k,
                                    std::span<Proposal> out) {
  for (size_t i = 0; i < slots.size(); ++i) {
    out[i].tokens.clear();
    out[i].q.clear();
    if (k[i] == 0) continue;
    // The context is the prompt, then the generated tokens (the last of which is the pending token).
    const DecodeSlot& slot = *slots[i];
    const int64_t n = slot.context_size();
    for (int64_t len = std::min<int64_t>(max_ngram_, n - 1); len >= min_ngram_ && out[i].tokens.empty(); --len) {
      const int64_t s = slot.LatestEarlierMatch(len);
      for (int64_t j = s + len; s >= 0 && j < n && static_cast<int64_t>(out[i].tokens.size()) < k[i]; ++j) {
        out[i].tokens.push_back(slot.context_token(j));
      }
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------------------
// Accepting

int64_t AcceptLossless(Sampler& sampler, std::span<const float> logits, const Proposal& draft, int64_t V,
                       int32_t* next) {
  const int64_t n = static_cast<int64_t>(draft.tokens.size());
  auto row = [&](int64_t i) { return logits.subspan(i * V, V); };
  if (sampler.params().greedy()) {
    for (int64_t i = 0; i < n; ++i) {
      const int32_t best = Argmax(row(i));
      if (draft.tokens[i] != best) {
        *next = best;
        return i;
      }
    }
    *next = Argmax(row(n));
    return n;
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

DraftLengthController::DraftLengthController(int64_t max_k) : max_k_(max_k) {}

DraftLengthController::Slot& DraftLengthController::SlotFor(int64_t slot_id) {
  // Acceptance starts optimistic (0.8 per position) until rounds are measured.
  return slots_.try_emplace(slot_id, Slot{std::vector<double>(max_k_, 0.8)}).first->second;
}

double DraftLengthController::RoundSeconds(double k) const {
  if (w_ <= 0) return -1;
  const double mx = wx_ / w_, my = wy_ / w_, var = wxx_ / w_ - mx * mx;
  if (var < 1e-9) return -1;  // one draft length only: no slope yet
  const double slope = std::max(0.0, (wxy_ / w_ - mx * my) / var);
  return std::max(1e-9, my + slope * (k - mx));
}

int64_t DraftLengthController::Choose(std::span<const int64_t> slot_ids) {
  if (RoundSeconds(0) < 0) return w_ == 0 ? max_k_ : 1;  // measure a long round and a short one first
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
  // Every 16th round drafts one more than the best length (two when not drafting), so that the estimate just
  // past it keeps being measured: a few unlucky rounds would otherwise leave it low for good.
  if (++since_probe_ >= 16) {
    since_probe_ = 0;
    return std::min<int64_t>(best_k == 0 ? 2 : best_k + 1, max_k_);
  }
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
  const double x = static_cast<double>(k), y = round_s;
  w_ = kDecay * w_ + 1;
  wx_ = kDecay * wx_ + x;
  wy_ = kDecay * wy_ + y;
  wxx_ = kDecay * wxx_ + x * x;
  wxy_ = kDecay * wxy_ + x * y;
}

// ---------------------------------------------------------------------------------------------------------
// The round

SpeculativeDecoder::SpeculativeDecoder(std::unique_ptr<Proposer> proposer, SpeculativeOptions options)
    : proposer_(std::move(proposer)),
      options_(std::move(options)),
      controller_(options_.k > 0 ? options_.k : options_.max_k) {}

absl::Status SpeculativeDecoder::Step(Backend& backend, std::span<DecodeSlot* const> slots) {
  int64_t k = options_.k;
  if (k == 0) {
    ids_.resize(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) ids_[i] = slots[i]->id;
    k = controller_.Choose(ids_);
  }
  want_.assign(slots.size(), k);
  return Round(backend, slots, want_);
}

void SpeculativeDecoder::Account(DecodeSlot& s, int64_t drafted, int64_t accepted) {
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
  controller_.RecordRound(s.id, drafted, accepted);
}

absl::StatusOr<bool> SpeculativeDecoder::MaybeBackendRound(Backend& backend, std::span<DecodeSlot* const> slots,
                                                           int64_t k) {
  auto* linear = dynamic_cast<LinearProposer*>(proposer_.get());
  using Rule = int64_t (*)(Sampler&, std::span<const float>, const Proposal&, int64_t, int32_t*);
  const Rule* rule = options_.accept.target<Rule>();
  if (k < 1 || linear == nullptr || !backend.backend_rounds() || rule == nullptr || *rule != &AcceptLossless) return false;
  // One draft length and one sampling distribution (the backend's kernels take the parameters per launch).
  const SamplingParams& first = slots[0]->sampler->params();
  for (size_t i = 0; i < slots.size(); ++i) {
    if (k_[i] != k || !slots[i]->sampler->params().SameDistributionAs(first)) return false;
  }
  round_items_.resize(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    ORYX_ASSIGN_OR_RETURN(SequenceState* draft, linear->DraftFor(*slots[i]));
    round_items_[i] = {slots[i]->seq, draft, slots[i]->pending, slots[i]->sampler, &slots[i]->emitted};
  }
  const auto t0 = Clock::now();
  ORYX_RETURN_IF_ERROR(backend.SpeculativeRound(round_items_, k));
  const double round_s = Seconds(t0);
  for (DecodeSlot* s : slots) {
    const int64_t accepted = static_cast<int64_t>(s->emitted.size()) - 1;
    s->stats->linear_tokens += k;
    Account(*s, k, accepted);
    s->stats->spec->backend_round_s += round_s;
    ++s->stats->spec->backend_rounds;
  }
  controller_.RecordCost(k, round_s);
  return true;
}

absl::Status SpeculativeDecoder::PlainStep(Backend& backend, std::span<DecodeSlot* const> slots) {
  const size_t n = slots.size();
  modes_.resize(n);
  next_.resize(n);
  items_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    DecodeSlot& s = *slots[i];
    modes_[i].assign(1, Mode::kAttention);
    items_[i] = {s.seq, std::span(&s.pending, 1), modes_[i], LogitsRows::kLast, nullptr, false, s.sampler, &next_[i]};
  }
  const auto t0 = Clock::now();
  ORYX_RETURN_IF_ERROR(backend.Forward(items_));
  const double step_s = Seconds(t0);
  for (size_t i = 0; i < n; ++i) {
    slots[i]->emitted.assign(1, next_[i]);
    Account(*slots[i], 0, 0);
    slots[i]->stats->spec->verify_s += step_s;
    ++slots[i]->stats->spec->verify_forwards;
  }
  controller_.RecordCost(0, step_s);
  return absl::OkStatus();
}

absl::Status SpeculativeDecoder::Round(Backend& backend, std::span<DecodeSlot* const> slots,
                                       std::span<const int64_t> want) {
  const ModelConfig& c = backend.config();
  const int64_t V = c.vocab_size;
  const size_t n = slots.size();
  k_.resize(n);
  proposals_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const DecodeSlot& s = *slots[i];
    // The verify span [x, d_1..d_k] must fit below max_position, and more than remaining - 1 drafts are waste.
    k_[i] = std::max<int64_t>(0, std::min({want[i], options_.k > 0 ? options_.k : options_.max_k, s.remaining - 1,
                                           c.max_position - s.seq->position() - 1}));
  }
  if (n > 0 && std::all_of(k_.begin(), k_.end(), [](int64_t k) { return k == 0; })) return PlainStep(backend, slots);
  if (n > 0) {
    ORYX_ASSIGN_OR_RETURN(const bool ran, MaybeBackendRound(backend, slots, k_[0]));
    if (ran) return absl::OkStatus();
  }

  // 1. Propose.
  auto t0 = Clock::now();
  ORYX_RETURN_IF_ERROR(proposer_->Propose(backend, slots, k_, proposals_));
  const double draft_s = Seconds(t0);
  int64_t draft_steps = 0;
  for (size_t i = 0; i < n; ++i) draft_steps = std::max<int64_t>(draft_steps, proposals_[i].tokens.size());

  // 2. Verify: attention mode over [x, d_1..d_k] for every slot at once, keeping the states for rollback.
  t0 = Clock::now();
  spans_.resize(n);
  modes_.resize(n);
  logits_.resize(n);
  items_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    DecodeSlot& s = *slots[i];
    spans_[i].assign(1, s.pending);
    spans_[i].insert(spans_[i].end(), proposals_[i].tokens.begin(), proposals_[i].tokens.end());
    modes_[i].assign(spans_[i].size(), Mode::kAttention);
    // The states inside the span are kept only when there is something to roll back.
    items_[i] = {s.seq, spans_[i], modes_[i], LogitsRows::kAll, &logits_[i], !proposals_[i].tokens.empty()};
  }
  ORYX_RETURN_IF_ERROR(backend.Forward(items_));

  // 3. Accept and 4. commit, each sequence its own count.
  for (size_t i = 0; i < n; ++i) {
    DecodeSlot& s = *slots[i];
    const Proposal& d = proposals_[i];
    const int64_t drafted = static_cast<int64_t>(d.tokens.size());
    const int64_t start = s.seq->position() - (drafted + 1);
    int32_t next = 0;
    const int64_t accepted = options_.accept(*s.sampler, logits_[i], d, V, &next);
    ORYX_RETURN_IF_ERROR(s.seq->Truncate(start + 1 + accepted));
    s.emitted.assign(d.tokens.begin(), d.tokens.begin() + accepted);
    s.emitted.push_back(next);
    Account(s, drafted, accepted);
  }
  const double verify_s = Seconds(t0);
  controller_.RecordCost(draft_steps, draft_s + verify_s);
  for (DecodeSlot* s : slots) {
    s->stats->spec->draft_s += draft_s;
    s->stats->spec->verify_s += verify_s;
    s->stats->spec->draft_forwards += proposer_->last_forwards();
    ++s->stats->spec->verify_forwards;
  }
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
