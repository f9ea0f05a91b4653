// The segment scheduler and the rule policies on a random tiny model: which tokens each policy runs in which
// mode, the replay of prefill decisions by segment, the distribution statistics, and bad policy names.
#include "router/router.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "engine/cpu_backend.h"
#include "gtest/gtest.h"
#include "policies/rule_policies.h"
#include "router/earlier_match.h"
#include "router/features.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx::router {
namespace {

GenerateStats Generated(Engine& engine, const std::string& policy, int64_t prompt_len, int64_t max_tokens) {
  GenerateRequest q;
  for (int64_t i = 0; i < prompt_len; ++i) q.prompt_tokens.push_back(static_cast<int32_t>(4 + i % 20));
  q.max_tokens = max_tokens;
  q.stop_at_eos = false;
  q.policy = policy;
  auto r = engine.Generate(q);
  EXPECT_TRUE(r.ok()) << policy << ": " << r.status();
  EXPECT_EQ(r->stats.generated_tokens, max_tokens) << policy;
  return r->stats;
}

class RouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_.emplace(testutil::TinyEngine(scratch_, LinearMixer::kMamba2, 4));
    policies::RegisterPolicies(engine_->policies());
  }
  testutil::ScratchDir scratch_;
  std::optional<Engine> engine_;
};

TEST_F(RouterTest, EntropyPolicyAttendsWhenUnsure) {
  // Tokens forwarded: 12 prompt tokens, then 9 of the 10 generated ones (the last is never run).
  const GenerateStats always = Generated(*engine_, "entropy:0", 12, 10);  // every distribution has entropy > 0
  EXPECT_EQ(always.linear_tokens, 11);                                // the prompt but its last token
  EXPECT_EQ(always.attention_tokens, 1 + 9);
  const GenerateStats never = Generated(*engine_, "entropy:1000", 12, 10);
  EXPECT_EQ(never.attention_tokens, 1 + 1);  // the last prompt token; the first step, with no entropy yet
  EXPECT_EQ(never.linear_tokens, 11 + 8);
}

TEST_F(RouterTest, MatchPolicyAttendsToSegmentsThatRepeatEarlierText) {
  // Prompt tokens 4 + i % 20: 12 of them never repeat, so the body runs in linear mode; 30 of them repeat
  // their first 10 from position 20 on, so the body's one segment (128 tokens) runs in attention mode.
  const GenerateStats fresh = Generated(*engine_, "match:3", 12, 10);
  EXPECT_EQ(fresh.linear_tokens, 11);
  EXPECT_EQ(fresh.attention_tokens, 1 + 9);
  const GenerateStats repeated = Generated(*engine_, "match:3", 30, 10);
  EXPECT_EQ(repeated.linear_tokens, 0);
  EXPECT_EQ(repeated.attention_tokens, 30 + 9);
  const GenerateStats longer = Generated(*engine_, "match:11", 30, 10);  // the repeat is 10 tokens long
  EXPECT_EQ(longer.linear_tokens, 29);
}

TEST_F(RouterTest, BudgetPolicyKeepsTheAttentionShare) {
  for (double f : {0.0, 0.1, 0.25, 0.5}) {
    const GenerateStats s = Generated(*engine_, "budget:" + std::to_string(f), 20, 30);
    EXPECT_LE(s.attention_fraction(), f + 1e-9) << f;
    EXPECT_GE(s.attention_fraction(), f - 1.0 / 49) << f;  // it spends what it may, one token at a time
  }
}

TEST_F(RouterTest, RandomPolicyHitsItsFractionOnAverage) {
  // 4 prompt tokens (two segments) and 55 generated tokens: 56 decisions, a fixed hash of the positions.
  const GenerateStats s = Generated(*engine_, "random:0.3", 4, 56);
  EXPECT_NEAR(s.attention_fraction(), 0.3, 0.15);
  EXPECT_EQ(Generated(*engine_, "random:0", 4, 20).attention_tokens, 0);
  EXPECT_EQ(Generated(*engine_, "random:1", 4, 20).linear_tokens, 0);
}

// No router takes a decode step's logits: the backend draws the token (on a GPU, V floats a sequence a step
// not copied), and computes the entropy and margin beside the draw only for a router that reads them.
TEST(RouterDecoder, OnlyRoutersThatReadEntropyAskForTheStepsStatistics) {
  testutil::ScratchDir scratch;
  auto counting = std::make_unique<testutil::CountingBackend>(testutil::TinyBackend(scratch, LinearMixer::kMamba2, 4));
  testutil::CountingBackend* backend = counting.get();
  Engine engine(std::move(counting), std::nullopt);
  policies::RegisterPolicies(engine.policies());
  for (const std::string policy : {"budget:0.5", "tail:4", "match:3", "random:0.5", "entropy:1"}) {
    backend->step_logits = 0, backend->step_stats = 0;
    const GenerateStats s = Generated(engine, policy, 12, 10);
    EXPECT_EQ(backend->step_logits, 0) << policy;
    EXPECT_EQ(backend->step_stats, policy == "entropy:1" ? 9 : 0) << policy;  // every step after the prompt's
    EXPECT_EQ(s.attention_tokens + s.linear_tokens, 12 + 9) << policy;
  }
}

// Attention for even segments, linear for odd ones.
class AlternatingRouter final : public Router {
 public:
  explicit AlternatingRouter(int64_t segment) : segment_(segment) {}
  Decision Decide(const RouterContext& c) const override {
    if (c.last_prompt_token) return {Mode::kAttention};
    return {(c.position / segment_) % 2 == 0 ? Mode::kAttention : Mode::kLinear};
  }

 private:
  int64_t segment_;
};

TEST(RouterDecoder, PrefillDecisionsFollowSegmentsAndTheLastPromptTokenIsItsOwn) {
  RouterOptions o;
  o.segment_len = 4;
  RouterDecoder decoder(std::make_unique<AlternatingRouter>(4), o);
  const int64_t n = 11;  // segments [0,4) [4,8) [8,10), then token 10 alone
  const Mode A = Mode::kAttention, L = Mode::kLinear;
  const std::vector<Mode> want = {A, A, A, A, L, L, L, L, A, A, A};
  const std::vector<int32_t> prompt(n, 7);
  // The whole prompt at once, and in uneven chunks as the engine's prefill asks for it.
  std::vector<Mode> got(n);
  decoder.PrefillModes(prompt, 0, got);
  EXPECT_EQ(got, want);
  std::fill(got.begin(), got.end(), Mode::kLinear);
  for (int64_t begin : {0, 3, 9}) {
    const int64_t len = begin == 0 ? 3 : begin == 3 ? 6 : n - 9;
    decoder.PrefillModes(prompt, begin, std::span(got).subspan(begin, len));
  }
  EXPECT_EQ(got, want);
}

TEST(RouterDecoder, LogitStatsOf) {
  LogitStats stats = LogitStatsOf(std::vector<float>(8, 0.5f));
  EXPECT_NEAR(stats.entropy, std::log(8.0), 1e-9);
  EXPECT_EQ(stats.margin, 0.0);
  stats = LogitStatsOf(std::vector<float>{10.f, 0.f, -1.f});
  EXPECT_LT(stats.entropy, 0.01);
  EXPECT_EQ(stats.margin, 10.0);
  stats = LogitStatsOf(std::vector<float>{3.f});
  EXPECT_EQ(stats.entropy, 0.0);
  EXPECT_EQ(stats.margin, 0.0);
  // A vocabulary's worth of logits, spread and peaked, against softmax then -sum p log p in double.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (float peak : {0.f, 25.f}) {
    std::vector<float> logits(32000);
    for (float& l : logits) l = normal(rng);
    logits[123] += peak;
    const double top = *std::max_element(logits.begin(), logits.end());
    double z = 0, want = 0;
    for (float l : logits) z += std::exp(l - top);
    for (float l : logits) {
      const double p = std::exp(l - top) / z;
      if (p > 0) want -= p * std::log(p);
    }
    stats = LogitStatsOf(logits);
    EXPECT_NEAR(stats.entropy, want, 1e-6) << peak;
    EXPECT_GT(stats.entropy, peak > 0 ? 0.0 : 5.0) << peak;  // spread: near log(32000) - 4.5; peaked: near 0
  }
}

TEST(EarlierMatch, AgreesWithBruteForceOnRepetitiveText) {
  // Small alphabets repeat a lot, so long matches, clones and overlapping occurrences all happen; a large
  // one gives the start state hundreds of transitions.
  for (int32_t vocab : {2, 3, 5, 50, 2000}) {
    std::mt19937 rng(vocab);
    std::vector<int32_t> text;
    for (int i = 0; i < 300; ++i) {
      // Now and then copy an earlier run, as text that quotes itself does.
      if (i > 20 && rng() % 10 == 0) {
        const size_t from = rng() % (text.size() - 10), len = 3 + rng() % 8;
        for (size_t k = 0; k < len; ++k) text.push_back(text[from + k]);
      } else {
        text.push_back(static_cast<int32_t>(rng() % vocab));
      }
    }
    // Grown token by token, and reserved for part of the text up front (as a prompt's index is, then grown by
    // the tokens generated after it).
    EarlierMatch m, reserved;
    reserved.Reserve(100);
    for (size_t n = 0; n < text.size(); ++n) {
      const EarlierMatch::Match got = m.Push(text[n]), want = NaiveEarlierMatch(text, static_cast<int64_t>(n));
      ASSERT_EQ(got.length, want.length) << "vocab " << vocab << ", token " << n;
      ASSERT_EQ(got.distance, want.distance) << "vocab " << vocab << ", token " << n;
      const EarlierMatch::Match also = reserved.Push(text[n]);
      ASSERT_EQ(also.length, want.length) << "reserved, vocab " << vocab << ", token " << n;
      ASSERT_EQ(also.distance, want.distance) << "reserved, vocab " << vocab << ", token " << n;
    }
    EXPECT_EQ(m.size(), static_cast<int64_t>(text.size()));
  }
}

TEST(EarlierMatch, DocumentedCases) {
  EarlierMatch m;
  // a b c x a b c: the second "a b c" matches the first, 4 tokens back.
  const std::vector<int32_t> text = {1, 2, 3, 9, 1, 2, 3};
  std::vector<EarlierMatch::Match> got;
  for (int32_t t : text) got.push_back(m.Push(t));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i].length, 0) << i;
  EXPECT_EQ(got[4].length, 1);
  EXPECT_EQ(got[5].length, 2);
  EXPECT_EQ(got[6].length, 3);
  EXPECT_EQ(got[6].distance, 4);
}

// What a MatchRouter's decisions saw, in order: match_*, prompt_end_match_* and repeated_ngram. The test owns
// it, since the router goes with its decoder (an engine's, when Generate returns).
struct Seen {
  std::vector<std::pair<int64_t, int64_t>> matches, ends;
  std::vector<bool> repeated;
  std::vector<uint64_t> hashes;  // sequence_hash
};

// Attention exactly where the segment repeats at least 3 earlier tokens (and the prompt's last token). With
// `reads` false it says it never reads matches (Router::reads_earlier_match), and sees none.
class MatchRouter final : public Router {
 public:
  explicit MatchRouter(Seen* seen, bool reads = true) : seen_(seen), reads_(reads) {}
  Decision Decide(const RouterContext& c) const override {
    seen_->matches.push_back({c.match_length, c.match_distance});
    seen_->ends.push_back({c.prompt_end_match_length, c.prompt_end_match_distance});
    seen_->repeated.push_back(c.repeated_ngram);
    seen_->hashes.push_back(c.sequence_hash);
    return {c.last_prompt_token || c.match_length >= 3 ? Mode::kAttention : Mode::kLinear};
  }
  bool reads_earlier_match() const override { return reads_; }

 private:
  Seen* seen_;
  bool reads_;
};

TEST(RouterDecoder, PrefillSegmentsSeeWhetherTheirTokensOccurredEarlier) {
  RouterOptions o;
  o.segment_len = 4;
  Seen seen;
  RouterDecoder decoder(std::make_unique<MatchRouter>(&seen), o);
  // Segments [0,4) [4,8) [8,12) [12,14), then the last token alone; [8,12) repeats tokens 1..4.
  const std::vector<int32_t> prompt = {10, 11, 12, 13, 14, 20, 21, 22, 11, 12, 13, 14, 30, 31, 32};
  std::vector<Mode> got(prompt.size());
  decoder.PrefillModes(prompt, 0, got);
  const Mode A = Mode::kAttention, L = Mode::kLinear;
  EXPECT_EQ(got, (std::vector<Mode>{L, L, L, L, L, L, L, L, A, A, A, A, L, L, A}));
  ASSERT_EQ(seen.matches.size(), 5u);
  EXPECT_EQ(seen.matches[2], (std::pair<int64_t, int64_t>(4, 7)));  // 11 12 13 14 at 8..11, first at 1..4
  EXPECT_EQ(seen.matches[3], (std::pair<int64_t, int64_t>(0, 0)));
}

TEST(RouterDecoder, ARouterThatDoesNotReadMatchesGetsNone) {
  RouterOptions o;
  o.segment_len = 4;
  Seen seen;
  RouterDecoder decoder(std::make_unique<MatchRouter>(&seen, false), o);
  const std::vector<int32_t> prompt = {10, 11, 12, 13, 14, 20, 21, 22, 11, 12, 13, 14, 30, 31, 32};
  std::vector<Mode> got(prompt.size());
  decoder.PrefillModes(prompt, 0, got);
  ASSERT_EQ(seen.matches.size(), 5u);
  for (const auto& m : seen.matches) EXPECT_EQ(m, (std::pair<int64_t, int64_t>(0, 0)));
}

// A RouterDecoder that, when it ends, appends how many prompts it indexed to *out (and how many indexes it
// still keeps to *kept).
class IndexCounting final : public Decoder {
 public:
  IndexCounting(std::unique_ptr<RouterDecoder> inner, std::vector<int64_t>* out, std::vector<int64_t>* kept = nullptr)
      : inner_(std::move(inner)), out_(out), kept_(kept) {}
  ~IndexCounting() override {
    out_->push_back(inner_->prompts_indexed());
    if (kept_ != nullptr) kept_->push_back(inner_->prompt_indexes_kept());
  }
  void PrefillModes(std::span<const int32_t> prompt, int64_t begin, std::span<Mode> modes) const override {
    inner_->PrefillModes(prompt, begin, modes);
  }
  void PreparePrompts(std::span<const std::span<const int32_t>> prompts) override { inner_->PreparePrompts(prompts); }
  int64_t Lookahead() const override { return inner_->Lookahead(); }
  absl::Status Plan(const Backend& backend, std::span<DecodeSlot* const> slots,
                    std::vector<ForwardItem>& items) override {
    return inner_->Plan(backend, slots, items);
  }
  absl::Status Finish(std::span<DecodeSlot* const> slots) override { return inner_->Finish(slots); }
  absl::StatusOr<bool> RunAlone(Backend& backend, std::span<DecodeSlot* const> slots) override {
    return inner_->RunAlone(backend, slots);
  }
  bool RunsAlone(const Backend& backend) const override { return inner_->RunsAlone(backend); }
  bool PlainStep() const override { return inner_->PlainStep(); }
  void Release(const DecodeSlot& slot) override { inner_->Release(slot); }
  bool FollowsLogitAdjustments() const override { return inner_->FollowsLogitAdjustments(); }

 private:
  std::unique_ptr<RouterDecoder> inner_;
  std::vector<int64_t>* out_;
  std::vector<int64_t>* kept_;
};

TEST(RouterDecoder, DecodeDecisionsSeeTheMatchEndingAtTheTokenAboutToRun) {
  testutil::ScratchDir scratch;
  Engine engine = testutil::TinyEngine(scratch, LinearMixer::kMamba2, 4);
  Seen seen;
  std::vector<int64_t> indexed;  // each decoder's prompts_indexed() at its end
  engine.policies().Register("match", "match", [&](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
    return std::unique_ptr<Decoder>(new IndexCounting(
        std::make_unique<RouterDecoder>(std::make_unique<MatchRouter>(&seen), RouterOptions{}), &indexed));
  });
  GenerateRequest q;
  q.prompt_tokens = {5, 6, 7, 8, 5, 6, 7};
  q.max_tokens = 6;
  q.stop_at_eos = false;
  q.policy = "match";
  auto result = engine.Generate(q);
  ASSERT_TRUE(result.ok()) << result.status();
  // The prefill is one segment (and the last token alone); each decode decision after it sees the match
  // ending at the token it is about to run, checked here against the brute force over the context, and
  // whether that token's last 3 repeat (repeated_ngram, read off the match).
  std::vector<int32_t> context = q.prompt_tokens;
  context.insert(context.end(), result->tokens.begin(), result->tokens.end());
  ASSERT_GE(seen.matches.size(), 2u + 5u);
  for (size_t i = 2; i < 2 + 5; ++i) {
    const int64_t at = static_cast<int64_t>(q.prompt_tokens.size() + i - 2);  // the token run by decision i
    const EarlierMatch::Match want = NaiveEarlierMatch(context, at);
    EXPECT_EQ(seen.matches[i], (std::pair<int64_t, int64_t>(want.length, want.distance)))
        << "decode decision " << i - 2;
    EXPECT_EQ(seen.repeated[i], want.length >= 3) << "decode decision " << i - 2;
  }
  // The prompt was indexed once: by the prefill, whose index the first decode decision took.
  EXPECT_EQ(indexed, std::vector<int64_t>{1});
  // Prefill and decode decisions alike see the prompt's hash (decode decisions once saw 0).
  for (uint64_t h : seen.hashes) EXPECT_EQ(h, PromptHash(q.prompt_tokens));
  // Every decision, prefill and decode, sees the prompt's end match: 5 6 7 again, ending 4 tokens later.
  ASSERT_EQ(seen.ends.size(), seen.matches.size());
  for (size_t i = 0; i < seen.ends.size(); ++i) EXPECT_EQ(seen.ends[i], (std::pair<int64_t, int64_t>(3, 4))) << i;
  // Longer: a small random model falls into a loop, so that some decisions see a repeat and some do not.
  // A router that reads no matches gets repeated_ngram from a scan back over the context: the same.
  for (const bool reads : {true, false}) {
    Seen longer;
    engine.policies().Register("match", "match", [&](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
      return std::unique_ptr<Decoder>(
          new RouterDecoder(std::make_unique<MatchRouter>(&longer, reads), RouterOptions{}));
    });
    q.max_tokens = 60;
    result = engine.Generate(q);
    ASSERT_TRUE(result.ok()) << result.status();
    std::vector<int32_t> all = q.prompt_tokens;
    all.insert(all.end(), result->tokens.begin(), result->tokens.end());
    ASSERT_GE(longer.repeated.size(), 2u + 40u);
    int64_t repeats = 0;
    for (size_t i = 2; i < longer.repeated.size(); ++i) {
      const int64_t at = static_cast<int64_t>(q.prompt_tokens.size() + i - 2);
      EXPECT_EQ(longer.repeated[i], NaiveEarlierMatch(all, at).length >= 3) << "decode decision " << i - 2;
      repeats += longer.repeated[i];
    }
    EXPECT_GT(repeats, 0) << reads;
    EXPECT_LT(repeats, static_cast<int64_t>(longer.repeated.size()) - 2) << reads;
  }
}

// Requests of prompts of the given lengths (a fixed pattern of ids), each generating max_tokens under `policy`.
std::vector<GenerateRequest> PatternRequests(std::initializer_list<int64_t> lengths, int64_t step, int64_t max_tokens,
                                             const std::string& policy) {
  std::vector<GenerateRequest> requests;
  for (int64_t len : lengths) {
    GenerateRequest q;
    for (int64_t i = 0; i < len; ++i) q.prompt_tokens.push_back(static_cast<int32_t>(5 + (i * step + len) % 23));
    q.max_tokens = max_tokens;
    q.stop_at_eos = false;
    q.policy = policy;
    requests.push_back(q);
  }
  return requests;
}

// Twenty prompts that start their prefill in one step are indexed once each, side by side
// (RouterDecoder::PreparePrompts), each index kept for its request's first decode decision (once, 16 of them at
// most were kept and the rest indexed again); and every request decides as it does alone: the same modes, so
// the same tokens.
TEST(RouterDecoder, PromptsStartingTogetherAreIndexedOnceEachAndDecideAsAlone) {
  testutil::ScratchDir scratch;
  Engine engine = testutil::TinyEngine(scratch, LinearMixer::kMamba2, 4);
  Seen seen;
  std::vector<int64_t> indexed;
  RouterOptions o;
  o.segment_len = 4;
  engine.policies().Register("match", "match", [&](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
    return std::unique_ptr<Decoder>(
        new IndexCounting(std::make_unique<RouterDecoder>(std::make_unique<MatchRouter>(&seen), o), &indexed));
  });
  const std::vector<GenerateRequest> requests =
      PatternRequests({20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39}, 5, 12, "match");
  auto together = engine.Generate(requests);
  ASSERT_TRUE(together.ok()) << together.status();
  EXPECT_EQ(indexed, std::vector<int64_t>{static_cast<int64_t>(requests.size())});
  int64_t attention = 0, linear = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto alone = engine.Generate(requests[i]);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_EQ((*together)[i].tokens, alone->tokens) << "request " << i;
    EXPECT_EQ((*together)[i].stats.attention_tokens, alone->stats.attention_tokens) << "request " << i;
    EXPECT_EQ((*together)[i].stats.linear_tokens, alone->stats.linear_tokens) << "request " << i;
    attention += alone->stats.attention_tokens, linear += alone->stats.linear_tokens;
  }
  EXPECT_GT(attention, 0);  // the prompts' repeats and last tokens attend; the rest of them does not
  EXPECT_GT(linear, 0);
}

// Requests that end with their prefill's token (max_tokens 1) never make a decode decision: their prompts'
// indexes go with them, where they stayed until 128 newer ones pushed them out. The others adopt theirs.
TEST(RouterDecoder, RequestsEndingAtTheirPrefillTakeTheirPromptIndexes) {
  testutil::ScratchDir scratch;
  Engine engine = testutil::TinyEngine(scratch, LinearMixer::kMamba2, 4);
  Seen seen;
  std::vector<int64_t> indexed, kept;
  engine.policies().Register("match", "match", [&](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
    return std::unique_ptr<Decoder>(new IndexCounting(
        std::make_unique<RouterDecoder>(std::make_unique<MatchRouter>(&seen), RouterOptions{}), &indexed, &kept));
  });
  std::vector<GenerateRequest> requests = PatternRequests({20, 21, 22, 23, 24, 25, 26, 27}, 5, 6, "match");
  for (size_t i = 0; i < requests.size(); i += 2) requests[i].max_tokens = 1;
  auto result = engine.Generate(requests);
  ASSERT_TRUE(result.ok()) << result.status();
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ((*result)[i].tokens.size(), static_cast<size_t>(requests[i].max_tokens)) << "request " << i;
  }
  EXPECT_EQ(indexed, std::vector<int64_t>{8});  // once each: the decoding half adopted theirs
  EXPECT_EQ(kept, std::vector<int64_t>{0});
}

// The same on their own, with prompts long enough to be indexed on several threads (20 of 1,000 tokens): the
// prefill decisions are those of a decoder that indexes each prompt in PrefillModes, and no prompt is indexed
// twice.
TEST(RouterDecoder, PromptsPreparedOnThreadsDecideAsPromptsIndexedOneByOne) {
  RouterOptions o;
  o.segment_len = 16;
  Seen seen_prepared, seen_plain;
  RouterDecoder prepared(std::make_unique<MatchRouter>(&seen_prepared), o);
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts(20);
  for (std::vector<int32_t>& p : prompts) {
    for (int i = 0; i < 1000; ++i) p.push_back(static_cast<int32_t>(rng() % (i % 200 < 100 ? 40 : 4000)));
  }
  const std::vector<std::span<const int32_t>> spans(prompts.begin(), prompts.end());
  prepared.PreparePrompts(spans);
  EXPECT_EQ(prepared.prompts_indexed(), 20);
  int64_t attention = 0;
  for (const std::vector<int32_t>& p : prompts) {
    RouterDecoder plain(std::make_unique<MatchRouter>(&seen_plain), o);
    std::vector<Mode> want(p.size()), got(p.size());
    plain.PrefillModes(p, 0, want);
    prepared.PrefillModes(p, 0, got);
    EXPECT_EQ(got, want);
    attention += std::ranges::count(got, Mode::kAttention);
  }
  EXPECT_EQ(prepared.prompts_indexed(), 20);  // PrefillModes took the prepared indexes
  EXPECT_EQ(seen_prepared.matches, seen_plain.matches);
  EXPECT_EQ(seen_prepared.ends, seen_plain.ends);
  EXPECT_GT(attention, 0);
}

// Prefill in attention mode; then speculative rounds of 3 drafts for prompts of even length, plain attention
// steps for the others: one batch holds both kinds of request.
class HalfSpeculatingRouter final : public Router {
 public:
  Decision Decide(const RouterContext& c) const override {
    if (c.phase == Phase::kPrefill) return {Mode::kAttention};
    return {Mode::kAttention, c.prompt_len % 2 == 0 ? 3 : 0};
  }
  int64_t max_draft_length() const override { return 3; }
};

TEST(RouterDecoder, PlainAndSpeculatingRequestsInOneBatchKeepAttentionModesTokens) {
  testutil::ScratchDir scratch;
  Engine engine = testutil::TinyEngine(scratch, LinearMixer::kMamba2, 4);
  engine.policies().Register("half", "half", [](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
    return std::unique_ptr<Decoder>(new RouterDecoder(std::make_unique<HalfSpeculatingRouter>(), RouterOptions{}));
  });
  std::vector<GenerateRequest> requests = PatternRequests({6, 7, 10, 13}, 7, 20, "half");
  auto mixed = engine.Generate(requests);
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  for (GenerateRequest& q : requests) q.policy = "attention";
  auto plain = engine.Generate(requests);
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ((*mixed)[i].tokens, (*plain)[i].tokens) << "request " << i;  // greedy speculation is lossless
    const bool speculates = requests[i].prompt_tokens.size() % 2 == 0;
    const std::optional<SpecStats>& spec = (*mixed)[i].stats.spec;
    EXPECT_EQ(spec.has_value() && spec->rounds > 0, speculates) << "request " << i;
    if (!speculates) {
      EXPECT_EQ((*mixed)[i].stats.linear_tokens, 0) << "request " << i;
    }
  }
}

// Every decode decision speculates with 2 drafts, on a backend that runs whole rounds: requests joining a
// running batch get attention mode's tokens, and the router's rounds run on the backend (RunAlone) between
// the joining prompts' spans.
class AlwaysSpeculatingRouter final : public Router {
 public:
  Decision Decide(const RouterContext& c) const override {
    return {Mode::kAttention, c.phase == Phase::kDecode ? 2 : 0};
  }
  int64_t max_draft_length() const override { return 2; }
};

// Runs `requests` joining a batch on a backend that runs whole rounds, with their policy registered by `add`: each
// gets attention mode's tokens (an engine of the same weights computes those) from rounds run on the backend.
void ExpectAttentionTokensFromBackendRounds(const std::function<void(Engine&)>& add,
                                            const std::vector<GenerateRequest>& requests) {
  testutil::ScratchDir scratch;
  Engine alone = testutil::TinyEngine(scratch, LinearMixer::kMamba2, 7);
  auto inner = CpuBackend::Load(scratch.Join("m7"), /*threads=*/1);
  ASSERT_TRUE(inner.ok()) << inner.status();
  auto rounds = std::make_unique<testutil::HostRoundsBackend>(std::move(*inner));
  testutil::HostRoundsBackend& backend = *rounds;
  Engine engine(std::move(rounds), std::nullopt);
  add(engine);
  GenerationBatch batch(engine);
  const std::vector<GenerateResult> got = testutil::RunJoining(batch, requests, 2, [](size_t) {});
  ASSERT_EQ(got.size(), requests.size());
  EXPECT_GT(backend.rounds, 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerateRequest q = requests[i];
    q.policy = "attention";
    auto want = alone.Generate(q);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got[i].tokens, want->tokens) << "request " << i;
    ASSERT_TRUE(got[i].stats.spec.has_value()) << "request " << i;
    EXPECT_GT(got[i].stats.spec->backend_rounds, 0) << "request " << i;
  }
}

TEST(RouterDecoder, SpeculatingRequestsRunTheirRoundsOnTheBackend) {
  ExpectAttentionTokensFromBackendRounds(
      [](Engine& engine) {
        engine.policies().Register(
            "always", "always", [](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
              return std::unique_ptr<Decoder>(
                  new RouterDecoder(std::make_unique<AlwaysSpeculatingRouter>(), RouterOptions{}));
            });
      },
      PatternRequests({5, 9, 12}, 5, 16, "always"));
}

// Linear-mode decoding for prompts of odd length, attention mode (no drafts of its own) for the others.
class OddLinearRouter final : public Router {
 public:
  Decision Decide(const RouterContext& c) const override {
    if (c.phase == Phase::kPrefill) return {Mode::kAttention};
    return {c.prompt_len % 2 == 1 ? Mode::kLinear : Mode::kAttention};
  }
};

void RegisterRouter(Engine& engine, std::string name, std::function<std::unique_ptr<Router>()> make) {
  engine.policies().Register(name, name, [make](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
    return std::unique_ptr<Decoder>(new RouterDecoder(make(), RouterOptions{}));
  });
}

// drafted:POLICY: in a step whose every slot decides attention, each round takes the controller's length, whatever the
// router asked (3 drafts for even prompts, none for odd ones), and the tokens stay attention mode's; a step that
// also holds linear-mode decisions takes the router's (no drafts here), and those keep their own tokens.
TEST(RouterDecoder, DraftedAttentionStepsKeepTheirTokens) {
  testutil::ScratchDir scratch;
  Engine engine = testutil::TinyEngine(scratch, LinearMixer::kMamba2, 4);
  RegisterRouter(engine, "half", [] { return std::make_unique<HalfSpeculatingRouter>(); });
  RegisterRouter(engine, "odd-linear", [] { return std::make_unique<OddLinearRouter>(); });
  auto run = [&](std::vector<GenerateRequest> qs, const std::string& policy) {
    for (GenerateRequest& q : qs) q.policy = policy;
    auto got = engine.Generate(qs);
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? *got : std::vector<GenerateResult>{};
  };
  const std::vector<GenerateRequest> requests = PatternRequests({6, 7, 10, 13}, 7, 20, "");
  const std::vector<GenerateResult> attention = run(requests, "attention"), drafted = run(requests, "drafted:half");
  ASSERT_EQ(drafted.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(drafted[i].tokens, attention[i].tokens) << "request " << i;
    // The odd prompts' plain attention steps speculate too (the controller's first rounds draft max_k and 1).
    ASSERT_TRUE(drafted[i].stats.spec.has_value()) << "request " << i;
    EXPECT_GT(drafted[i].stats.spec->drafted, 0) << "request " << i;
  }

  // The linear requests end after 6 tokens; the others then decode alone, and draft.
  std::vector<GenerateRequest> shorter = requests;
  for (GenerateRequest& q : shorter) q.max_tokens = q.prompt_tokens.size() % 2 == 1 ? 6 : 20;
  const std::vector<GenerateResult> routed = run(shorter, "odd-linear"), mixed = run(shorter, "drafted:odd-linear");
  ASSERT_EQ(mixed.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const bool linear = requests[i].prompt_tokens.size() % 2 == 1;
    EXPECT_EQ(mixed[i].tokens, linear ? routed[i].tokens : attention[i].tokens) << "request " << i;
    EXPECT_EQ(mixed[i].stats.spec.has_value() && mixed[i].stats.spec->drafted > 0, !linear) << "request " << i;
    EXPECT_FALSE(routed[i].stats.spec.has_value() && routed[i].stats.spec->rounds > 0) << "request " << i;
  }
  // (Which tells the two apart: linear decoding gives other tokens here.)
  bool differs = false;
  for (size_t i = 0; i < requests.size(); ++i) {
    differs |= routed[i].tokens !=
               std::vector<int32_t>(attention[i].tokens.begin(), attention[i].tokens.begin() + routed[i].tokens.size());
  }
  EXPECT_TRUE(differs);
}

// On a backend that runs whole rounds, a router that never drafts of its own, under drafted:, runs rounds there
// (RunAlone), with requests joining a running batch.
TEST(RouterDecoder, DraftedAttentionStepsRunWholeRoundsOnTheBackend) {
  ExpectAttentionTokensFromBackendRounds(
      [](Engine& engine) { RegisterRouter(engine, "odd-linear", [] { return std::make_unique<OddLinearRouter>(); }); },
      PatternRequests({6, 8, 12}, 5, 16, "drafted:odd-linear"));
}

TEST(RouterDecoder, DraftedTakesRouterPoliciesOnly) {
  PolicyRegistry registry;
  policies::RegisterAllPolicies(registry);
  EXPECT_TRUE(registry.Make("drafted:budget:0.5").ok());
  for (const char* bad : {"drafted:attention", "drafted:speculative", "drafted:nonsense", "drafted:"}) {
    const auto made = registry.Make(bad);
    ASSERT_FALSE(made.ok()) << bad;
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(made.status().message().find(bad), std::string::npos) << made.status();
  }
}

TEST(Features, MatchesEnterAsLogs) {
  RouterContext c;
  c.match_length = 7;
  c.match_distance = 100;
  c.prompt_end_match_length = 5;
  c.prompt_end_match_distance = 3000;
  std::vector<float> f(kNumFeatures);
  Featurize(c, f);
  EXPECT_EQ(kFeatureNames[kNumFeatures - 4], "log_match_length");
  EXPECT_FLOAT_EQ(f[kNumFeatures - 4], std::log1p(7.0f));
  EXPECT_FLOAT_EQ(f[kNumFeatures - 3], std::log1p(100.0f));
  EXPECT_EQ(kFeatureNames[kNumFeatures - 2], "log_prompt_end_match");
  EXPECT_FLOAT_EQ(f[kNumFeatures - 2], std::log1p(5.0f));
  EXPECT_FLOAT_EQ(f[kNumFeatures - 1], std::log1p(3000.0f));
}

// The prompt's end match is the longest of the per-token matches over its last `last` tokens, the first on a
// tie, whatever comes before them.
TEST(EarlierMatch, LongestMatchAtEndAgreesWithTheNaiveMatches) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int32_t> text(1 + rng() % 60);
    for (int32_t& t : text) t = static_cast<int32_t>(rng() % 3);
    const int64_t n = static_cast<int64_t>(text.size());
    for (int64_t last : {int64_t{1}, int64_t{5}, int64_t{32}, n + 3}) {
      EarlierMatch::Match want;
      for (int64_t end = std::max<int64_t>(0, n - last); end < n; ++end) {
        const EarlierMatch::Match m = NaiveEarlierMatch(text, end);
        if (m.length > want.length) want = m;
      }
      const EarlierMatch::Match got = LongestMatchAtEnd(text, last);
      EXPECT_EQ(got.length, want.length) << trial << " " << last;
      EXPECT_EQ(got.distance, want.distance) << trial << " " << last;
    }
  }
  EXPECT_EQ(LongestMatchAtEnd({}, 32).length, 0);
}

// Every prefill decision sees the prompt's end match, from the prompt's first segment on: here its last
// tokens 11 12 13 repeat tokens 1..3, ending 10 tokens after them; a router that never reads matches gets 0.
TEST(RouterDecoder, EveryDecisionSeesThePromptsEndMatch) {
  const std::vector<int32_t> prompt = {10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26, 11, 12, 13};
  for (bool reads : {true, false}) {
    RouterOptions o;
    o.segment_len = 4;
    Seen seen;
    RouterDecoder decoder(std::make_unique<MatchRouter>(&seen, reads), o);
    std::vector<Mode> got(prompt.size());
    decoder.PrefillModes(prompt, 0, got);
    ASSERT_EQ(seen.ends.size(), 5u);
    const std::pair<int64_t, int64_t> want = reads ? std::pair<int64_t, int64_t>{3, 10} : std::pair<int64_t, int64_t>{};
    for (const auto& m : seen.ends) EXPECT_EQ(m, want);
  }
}

TEST(RouterDecoder, ATailCutsThePromptsLastSegmentFinerTowardItsEnd) {
  auto segments = [](int64_t prompt_len, int64_t segment_len, int64_t tail_len) {
    std::vector<int64_t> out;
    for (int64_t start = 0; start < prompt_len; start += out.back()) {
      out.push_back(PrefillSegmentTokens(start, prompt_len, segment_len, tail_len));
    }
    return out;
  };
  using V = std::vector<int64_t>;
  EXPECT_EQ(segments(4096, 1024, 0), (V{1024, 1024, 1024, 1023, 1}));
  EXPECT_EQ(segments(4096, 1024, 64), (V{1024, 1024, 1023, 512, 256, 128, 64, 64, 1}));
  EXPECT_EQ(segments(1100, 1024, 64), (V{75, 512, 256, 128, 64, 64, 1}));
  EXPECT_EQ(segments(1001, 1024, 64), (V{488, 256, 128, 64, 64, 1}));  // a prompt shorter than a segment
  EXPECT_EQ(segments(40, 16, 5), (V{16, 7, 6, 5, 5, 1}));              // boundaries 5, 10, 20 before the last
  EXPECT_EQ(segments(3, 16, 5), (V{2, 1}));
  EXPECT_EQ(segments(1, 16, 5), (V{1}));
  EXPECT_EQ(segments(11, 4, 4), segments(11, 4, 0));  // a tail as long as a segment cuts nothing
}

TEST(RulePolicies, TailAttendsToExactlyThePromptsLastTokens) {
  for (int64_t n : {0, 1, 5, 30}) {
    absl::StatusOr<std::unique_ptr<Decoder>> d = policies::MakeRulePolicy("tail:" + std::to_string(n));
    ASSERT_TRUE(d.ok()) << d.status();
    const std::vector<int32_t> prompt(300, 7);
    std::vector<Mode> modes(prompt.size());
    (*d)->PrefillModes(prompt, 0, modes);
    for (int64_t t = 0; t < 300; ++t) {
      EXPECT_EQ(modes[t], t >= 299 - n ? Mode::kAttention : Mode::kLinear) << "tail:" << n << " token " << t;
    }
  }
}

TEST(RulePolicies, BadNamesAreErrors) {
  for (const char* ok : {"entropy:0", "entropy:2.5", "budget:0", "budget:0.1", "budget:1", "random:0.3", "match:1",
                         "match:16", "tail:0", "tail:64"}) {
    EXPECT_TRUE(policies::MakeRulePolicy(ok).ok()) << ok;
  }
  for (const char* bad : {"entropy", "entropy:-1", "entropy:x", "budget:1.5", "budget:", "budget:nan", "random:2",
                          "fancy:1", "match", "match:0", "match:2.5", "match:-3", "tail", "tail:-1", "tail:1.5"}) {
    EXPECT_EQ(policies::MakeRulePolicy(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace oryx::router
