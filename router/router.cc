#include "router/router.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <tuple>
#include <utility>

#include "base/status_macros.h"

namespace oryx::router {

double RouterContext::attention_fraction() const {
  const int64_t total = attention_tokens + linear_tokens;
  return total == 0 ? 0.0 : static_cast<double>(attention_tokens) / static_cast<double>(total);
}

RouterDecoder::RouterDecoder(std::unique_ptr<Router> router, RouterOptions options)
    : router_(std::move(router)), options_(std::move(options)) {
  if (const int64_t k = router_->max_draft_length(); k > 0) {
    spec_ = std::make_unique<speculative::SpeculativeDecoder>(std::make_unique<speculative::LinearProposer>(),
                                                              speculative::SpeculativeOptions{.k = 0, .max_k = k});
  }
}

RouterDecoder::~RouterDecoder() = default;

absl::Status RouterDecoder::DraftAttentionSteps() {
  draft_attention_ = true;
  const speculative::SpeculativeOptions adaptive{};  // k = 0: chosen per round, up to max_k
  const int64_t max_k = std::max(adaptive.max_k, router_->max_draft_length());
  spec_ = std::make_unique<speculative::SpeculativeDecoder>(std::make_unique<speculative::LinearProposer>(),
                                                            speculative::SpeculativeOptions{.k = 0, .max_k = max_k});
  return absl::OkStatus();
}

bool RouterDecoder::PlainStep() const { return controlled_ && spec_->PlainStep(); }

void RouterDecoder::Release(const DecodeSlot& slot) {
  auto it = slots_.find(slot.id);
  const bool started = it != slots_.end() && it->second.started;
  if (it != slots_.end()) slots_.erase(it);
  // A request that ends before its first decode decision (max_tokens 1, or cancelled or preempted during its
  // prefill) never adopts its prompt's index: it goes now, not when newer ones push it out. (Indexes are found
  // by their prompts: of two requests of one prompt, one that ends early, even queued, may take the other's,
  // which then builds it again at its first decision, a cost and not an error. So does a request preempted
  // during its prefill, which keeps its modes: preemption is rare, orphans were not.)
  if (!started && slot.prompt != nullptr) TakePromptIndex(*slot.prompt);
  if (spec_) spec_->Release(slot);
}

int64_t RouterDecoder::Lookahead() const { return spec_ ? spec_->Lookahead() : 0; }

int64_t PrefillSegmentTokens(int64_t start, int64_t prompt_len, int64_t segment_len, int64_t tail_len) {
  if (start == prompt_len - 1) return 1;
  const int64_t len = std::max<int64_t>(1, segment_len), left = prompt_len - 1 - start;
  if (tail_len <= 0 || tail_len >= len) return std::min(len, left);
  if (left > len) return std::min(len, left - len);  // up to the tail
  int64_t boundary = 0;  // the farthest of tail_len, 2 tail_len, 4 tail_len, ... before the last token, short of `left`
  for (int64_t b = tail_len; b < left; b *= 2) boundary = b;
  return left - boundary;
}

uint64_t PromptHash(std::span<const int32_t> prompt) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the ids
  for (int32_t id : prompt) h = (h ^ static_cast<uint32_t>(id)) * 0x100000001b3ull;
  return h;
}

RouterDecoder::PromptIndex RouterDecoder::IndexPrompt(std::span<const int32_t> prompt) {
  PromptIndex p;
  p.prompt.assign(prompt.begin(), prompt.end());
  p.matches.reserve(prompt.size());
  p.index.Reserve(static_cast<int64_t>(prompt.size()));
  for (const int32_t t : prompt) p.matches.push_back(p.index.Push(t));
  p.end = LongestOfLast(p.matches, kPromptEndTokens);
  if (!p.matches.empty()) p.last = p.matches.back();
  return p;
}

void RouterDecoder::PreparePrompts(std::span<const std::span<const int32_t>> prompts) {
  if (!router_->reads_earlier_match() || prompts.empty()) return;
  std::vector<PromptIndex> built(prompts.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < prompts.size(); i = next++) built[i] = IndexPrompt(prompts[i]);
  };
  // Threads only where the work is large (16K tokens take 1.3 ms of one core on the 2-core VM).
  size_t tokens = 0;
  for (const auto& p : prompts) tokens += p.size();
  const size_t threads = tokens < (size_t{1} << 14)
                             ? 1
                             : std::min<size_t>(prompts.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (PromptIndex& p : built) {
    if (!p.prompt.empty()) KeepPromptIndex(std::move(p));
  }
}

void RouterDecoder::KeepPromptIndex(PromptIndex index) const {
  ++prompts_indexed_;
  prompt_indexes_.push_back(std::move(index));
  if (prompt_indexes_.size() > kMaxPromptIndexes) prompt_indexes_.pop_front();
}

void RouterDecoder::PrefillModes(std::span<const int32_t> prompt, int64_t begin, std::span<Mode> modes) const {
  // Replays the segment decisions from the prompt's start (they depend on the counts before them) and
  // writes those that fall in [begin, begin + modes.size()).
  const int64_t prompt_len = static_cast<int64_t>(prompt.size()), end = begin + static_cast<int64_t>(modes.size());
  RouterContext c;
  c.prompt_len = prompt_len;
  c.sequence_hash = PromptHash(prompt);
  const bool match = router_->reads_earlier_match();
  // Every token's match, from one index over the whole prompt: the segments' and the prompt's end match. The
  // index PreparePrompts built, if it did; else one built here. It stays for the request's first decode decision.
  std::vector<EarlierMatch::Match> matches;
  if (match && prompt_len > 0) {
    auto prepared = std::find_if(prompt_indexes_.rbegin(), prompt_indexes_.rend(), [&](const PromptIndex& p) {
      return !p.matches.empty() && std::ranges::equal(p.prompt, prompt);
    });
    if (prepared == prompt_indexes_.rend()) {
      KeepPromptIndex(IndexPrompt(prompt));
      prepared = prompt_indexes_.rbegin();
    }
    matches = std::move(prepared->matches);
    prepared->matches = {};
    c.prompt_end_match_length = prepared->end.length, c.prompt_end_match_distance = prepared->end.distance;
  }
  for (int64_t start = 0; start < std::min(end, prompt_len);) {
    c.position = start;
    c.last_prompt_token = start == prompt_len - 1;
    c.segment_tokens = PrefillSegmentTokens(start, prompt_len, options_.segment_len, options_.tail_len);
    c.match_length = c.match_distance = 0;
    for (int64_t t = start; match && t < start + c.segment_tokens; ++t) {
      const EarlierMatch::Match m = matches[t];
      if (m.length > c.match_length) std::tie(c.match_length, c.match_distance) = std::pair(m.length, m.distance);
    }
    if (options_.cost_model) {
      c.predicted_attention_s = options_.cost_model->PredictSeconds({1, c.segment_tokens, start, Mode::kAttention});
      c.predicted_linear_s = options_.cost_model->PredictSeconds({1, c.segment_tokens, start, Mode::kLinear});
    }
    const Mode m = router_->Decide(c).mode;
    for (int64_t t = std::max(start, begin); t < std::min(start + c.segment_tokens, end); ++t) modes[t - begin] = m;
    (m == Mode::kAttention ? c.attention_tokens : c.linear_tokens) += c.segment_tokens;
    c.tokens_since_attention = m == Mode::kAttention ? 0 : c.tokens_since_attention + c.segment_tokens;
    start += c.segment_tokens;
  }
}

std::optional<RouterDecoder::PromptIndex> RouterDecoder::TakePromptIndex(const std::vector<int32_t>& prompt) {
  // The newest first: a prompt prefilled twice (two requests of one prompt) is kept twice.
  for (auto it = prompt_indexes_.rbegin(); it != prompt_indexes_.rend(); ++it) {
    if (it->prompt != prompt) continue;
    std::optional<PromptIndex> taken = std::move(*it);
    prompt_indexes_.erase(std::next(it).base());
    return taken;
  }
  return std::nullopt;
}

void RouterDecoder::AdoptPromptIndex(const std::vector<int32_t>& prompt, SlotState& st) {
  if (std::optional<PromptIndex> p = TakePromptIndex(prompt)) {
    st.matches = std::move(p->index);
    st.prompt_end = p->end, st.match = p->last;
  }
}

Decision RouterDecoder::DecideDecode(const DecodeSlot& s, int64_t batch) {
  SlotState& st = slots_[s.id];  // (ChooseMode may have made it)
  if (!st.started) {
    st.started = true;
    st.prompt_hash = PromptHash(*s.prompt);
    if (router_->reads_earlier_match()) {
      AdoptPromptIndex(*s.prompt, st);
      if (st.matches.size() == 0 && !s.prompt->empty()) ++prompts_indexed_;  // built below
    }
  }
  RouterContext c;
  c.phase = Phase::kDecode;
  c.position = s.seq->position();
  c.prompt_len = s.prompt_len;
  c.batch = batch;
  c.attention_tokens = s.stats->attention_tokens;
  c.linear_tokens = s.stats->linear_tokens;
  c.tokens_since_attention = st.since_attention;
  c.entropy = st.entropy;
  c.margin = st.margin;
  c.acceptance = st.acceptance;
  c.sequence_hash = st.prompt_hash;
  if (!router_->reads_earlier_match()) {
    c.repeated_ngram = s.LatestEarlierMatch(3) >= 0;  // (a scan back over the context)
  } else {
    for (int64_t i = st.matches.size(); i < s.context_size(); ++i) {
      st.match = st.matches.Push(s.context_token(i));
      // The prompt's last tokens pass once, on the first decision: LongestMatchAtEnd without a second index.
      if (i < s.prompt_len && i >= s.prompt_len - kPromptEndTokens && st.match.length > st.prompt_end.length) {
        st.prompt_end = st.match;
      }
    }
    c.match_length = st.match.length;
    c.match_distance = st.match.distance;
    c.repeated_ngram = st.match.length >= 3;  // the last 3 tokens end somewhere earlier: LatestEarlierMatch(3)
    c.prompt_end_match_length = st.prompt_end.length, c.prompt_end_match_distance = st.prompt_end.distance;
  }
  if (options_.cost_model) {
    c.predicted_attention_s = options_.cost_model->PredictSeconds({batch, 1, c.position, Mode::kAttention});
    c.predicted_linear_s = options_.cost_model->PredictSeconds({batch, 1, c.position, Mode::kLinear});
  }
  Decision d = router_->Decide(c);
  if (d.mode == Mode::kLinear || !spec_) d.draft_length = 0;
  d.draft_length = std::clamp<int64_t>(d.draft_length, 0, router_->max_draft_length());
  return d;
}

Mode RouterDecoder::ChooseMode(const DecodeSlot& s, int64_t batch) {
  SlotState& st = slots_[s.id];
  const Mode m = st.decided ? *st.decided : DecideDecode(s, batch).mode;
  st.decided.reset();
  st.since_attention = m == Mode::kAttention ? 0 : st.since_attention + 1;  // the step runs in m
  return m;
}

void RouterDecoder::DecideStep(std::span<DecodeSlot* const> slots) {
  if (decided_) {
    decided_ = false;
    return;
  }
  const int64_t batch = static_cast<int64_t>(slots.size());
  decisions_.resize(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    // A slot inside a speculative round goes on with it (its decision was made when the round began).
    decisions_[i] = spec_->InRound(slots[i]->id) ? Decision{Mode::kAttention, 1} : DecideDecode(*slots[i], batch);
  }
  // DraftAttentionSteps: a step whose every slot decides attention is the controller's (-1: its length).
  controlled_ =
      draft_attention_ && std::ranges::all_of(decisions_, [](const Decision& d) { return d.mode == Mode::kAttention; });
  for (size_t i = 0; controlled_ && i < slots.size(); ++i) {
    if (!spec_->InRound(slots[i]->id)) decisions_[i].draft_length = -1;
  }
}

absl::StatusOr<bool> RouterDecoder::RunAlone(Backend& backend, std::span<DecodeSlot* const> slots) {
  if (!spec_) return false;
  DecideStep(slots);
  decided_ = true;
  draft_lengths_.resize(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    if (decisions_[i].draft_length == 0 || spec_->InRound(slots[i]->id)) return false;
    draft_lengths_[i] = decisions_[i].draft_length;
  }
  // Every slot speculates: with the controller's length in its steps, else each with the router's.
  ORYX_ASSIGN_OR_RETURN(const bool ran,
                        spec_->RunWhole(backend, slots, controlled_ ? std::span<const int64_t>() : draft_lengths_));
  if (!ran) return false;
  decided_ = false;
  speculating_.assign(slots.begin(), slots.end());
  NoteRounds();
  return true;
}

absl::Status RouterDecoder::Plan(const Backend& backend, std::span<DecodeSlot* const> slots,
                                 std::vector<ForwardItem>& items) {
  if (!spec_) return StepwiseDecoder::Plan(backend, slots, items);
  DecideStep(slots);
  plain_.clear();
  speculating_.clear();
  draft_lengths_.clear();
  for (size_t i = 0; i < slots.size(); ++i) {
    if (decisions_[i].draft_length != 0) {
      speculating_.push_back(slots[i]);
      draft_lengths_.push_back(decisions_[i].draft_length);
    } else {
      slots_[slots[i]->id].decided = decisions_[i].mode;
      plain_.push_back(slots[i]);
    }
  }
  ORYX_RETURN_IF_ERROR(StepwiseDecoder::Plan(backend, plain_, items));
  // In the controller's steps every speculating slot takes its length (an empty `want`; slots inside a round go
  // on with it); otherwise each the router's.
  if (controlled_) draft_lengths_.clear();
  return spec_->PlanRounds(backend, speculating_, draft_lengths_, items);
}

absl::Status RouterDecoder::Finish(std::span<DecodeSlot* const> slots) {
  if (!spec_) return StepwiseDecoder::Finish(slots);
  ORYX_RETURN_IF_ERROR(StepwiseDecoder::Finish(plain_));
  ORYX_RETURN_IF_ERROR(spec_->Finish(speculating_));
  NoteRounds();
  return absl::OkStatus();
}

void RouterDecoder::NoteRounds() {
  for (DecodeSlot* s : speculating_) {
    if (spec_->InRound(s->id)) continue;  // still drafting
    SlotState& st = slots_[s->id];
    st.since_attention = 0;  // the verify span ran in attention mode
    const auto [drafted, accepted] = spec_->LastRound(s->id);
    if (drafted > 0) {
      const double rate = static_cast<double>(accepted) / static_cast<double>(drafted);
      st.acceptance = st.acceptance < 0 ? rate : 0.7 * st.acceptance + 0.3 * rate;
    }
  }
}

void RouterDecoder::Observe(const DecodeSlot& s, Mode, const LogitStats& stats) {
  SlotState& st = slots_[s.id];
  st.entropy = stats.entropy, st.margin = stats.margin;
}

}  // namespace oryx::router
