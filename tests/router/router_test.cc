// The segment scheduler and the rule policies on a random tiny model: which tokens each policy runs in which
// mode, the replay of prefill decisions by segment, the distribution statistics, and bad policy names.
#include <cmath>

#include "gtest/gtest.h"
#include "policies/rule_policies.h"
#include "router/router.h"
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

TEST(RouterDecoder, DistributionStats) {
  double entropy = 0, margin = 0;
  DistributionStats(std::vector<float>(8, 0.5f), &entropy, &margin);
  EXPECT_NEAR(entropy, std::log(8.0), 1e-9);
  EXPECT_EQ(margin, 0.0);
  DistributionStats(std::vector<float>{10.f, 0.f, -1.f}, &entropy, &margin);
  EXPECT_LT(entropy, 0.01);
  EXPECT_EQ(margin, 10.0);
}

TEST(RulePolicies, BadNamesAreErrors) {
  for (const char* ok : {"entropy:0", "entropy:2.5", "budget:0", "budget:0.1", "budget:1", "random:0.3"}) {
    EXPECT_TRUE(policies::MakeRulePolicy(ok).ok()) << ok;
  }
  for (const char* bad : {"entropy", "entropy:-1", "entropy:x", "budget:1.5", "budget:", "budget:nan", "random:2",
                          "fancy:1"}) {
    EXPECT_EQ(policies::MakeRulePolicy(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace oryx::router
