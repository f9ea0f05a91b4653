// Admission and preemption under a KV memory budget (GenerationBatch::set_kv_memory): requests wait for
// memory, the latest admitted give theirs back when an earlier one needs room and are recomputed later from
// their tokens in the modes they ran in, generating what they generate alone; a request that could never fit
// is refused up front; nothing is held once the batch is done.
#include <random>

#include "base/str_cat.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "gtest/gtest.h"
#include "policies/rule_policies.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx {
namespace {

std::unique_ptr<Backend> TinyBackend(const testutil::ScratchDir& scratch, uint32_t seed) {
  return testutil::TinyBackend(scratch, LinearMixer::kMamba2, seed, /*max_position=*/256);
}

std::vector<GenerateRequest> Requests(const std::vector<std::string>& policies, int per_policy) {
  std::mt19937 rng(3);
  std::vector<GenerateRequest> qs;
  for (int i = 0; i < per_policy; ++i) {
    for (const std::string& policy : policies) {
      GenerateRequest q;
      q.prompt_tokens.resize(20 + rng() % 30);
      for (int32_t& t : q.prompt_tokens) t = 4 + static_cast<int32_t>(rng() % 28);
      q.max_tokens = 60 + static_cast<int64_t>(rng() % 40);  // every sequence grows past its first block
      q.stop_at_eos = false;
      q.policy = policy;
      qs.push_back(std::move(q));
    }
  }
  return qs;
}

class Admission : public ::testing::TestWithParam<bool> {};  // with the prefix cache, or without

TEST_P(Admission, PreemptedRequestsAreRecomputedAndGenerateWhatTheyGenerateAlone) {
  testutil::ScratchDir scratch;
  Engine engine(TinyBackend(scratch, 1), std::nullopt), alone(TinyBackend(scratch, 1), std::nullopt);
  for (Engine* e : {&engine, &alone}) policies::RegisterAllPolicies(e->policies());
  if (!GetParam()) engine.set_prefix_cache(std::nullopt);
  alone.set_prefix_cache(std::nullopt);
  const std::vector<GenerateRequest> qs =
      Requests({"attention", "speculative:3", "linear", "budget:0.5", "periodic:3"}, 2);
  GenerationBatch batch(engine);
  // Five blocks of 64 positions for ten requests that each grow to two.
  const int64_t block = engine.backend().KvBytes(1);
  batch.set_kv_memory(5 * block);
  for (const GenerateRequest& q : qs) ASSERT_TRUE(batch.Add(q).ok());
  int64_t most = 0;
  while (batch.active() > 0) {
    ASSERT_TRUE(batch.Step().ok());
    EXPECT_LE(batch.kv_bytes(), 5 * block);
    most = std::max(most, batch.kv_bytes());
    EXPECT_TRUE(batch.TakeFailed().empty());
  }
  EXPECT_GT(batch.preemptions(), 0);
  EXPECT_EQ(batch.kv_bytes(), 0);
  std::vector<std::pair<int64_t, GenerateResult>> done = batch.TakeFinished();
  ASSERT_EQ(done.size(), qs.size());
  int64_t preempted = 0;
  for (auto& [id, result] : done) {
    auto want = alone.Generate(qs[id]);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(result.tokens, want->tokens) << "request " << id << " (" << qs[id].policy << "), preempted "
                                           << result.stats.preemptions << " times";
    // The modes each token ran in are counted once, preemptions or not.
    if (qs[id].policy == "attention" || qs[id].policy == "linear") {
      EXPECT_EQ(result.stats.attention_tokens, want->stats.attention_tokens) << "request " << id;
      EXPECT_EQ(result.stats.linear_tokens, want->stats.linear_tokens) << "request " << id;
    }
    preempted += result.stats.preemptions;
  }
  EXPECT_EQ(preempted, batch.preemptions());
}

// Under a budget of four blocks for eight requests that grow to three, requests are preempted over and over,
// under a policy whose modes alternate; they still generate what they generate alone.
TEST(Admission, RequestsPreemptedOverAndOverStillGenerateTheirTokens) {
  testutil::ScratchDir scratch;
  Engine engine(TinyBackend(scratch, 4), std::nullopt), alone(TinyBackend(scratch, 4), std::nullopt);
  for (Engine* e : {&engine, &alone}) policies::RegisterAllPolicies(e->policies());
  engine.set_prefix_cache(std::nullopt);
  alone.set_prefix_cache(std::nullopt);
  std::vector<GenerateRequest> qs = Requests({"attention", "periodic:2"}, 4);
  for (GenerateRequest& q : qs) q.max_tokens = 120;  // to three blocks each
  GenerationBatch batch(engine);
  batch.set_kv_memory(engine.backend().KvBytes(4 * 64));
  for (const GenerateRequest& q : qs) ASSERT_TRUE(batch.Add(q).ok());
  while (batch.active() > 0) {
    const absl::Status step = batch.Step();
    ASSERT_TRUE(step.ok()) << step;
    for (auto& [id, status] : batch.TakeFailed()) FAIL() << "request " << id << ": " << status;
  }
  EXPECT_GE(batch.preemptions(), 4);
  for (auto& [id, result] : batch.TakeFinished()) {
    auto want = alone.Generate(qs[id]);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(result.tokens, want->tokens) << "request " << id << " (" << qs[id].policy << "), preempted "
                                           << result.stats.preemptions << " times";
  }
}

INSTANTIATE_TEST_SUITE_P(PrefixCache, Admission, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "on" : "off"; });

TEST(Admission, ARequestThatCouldNeverFitIsRefusedUpFront) {
  testutil::ScratchDir scratch;
  Engine engine(TinyBackend(scratch, 2), std::nullopt);
  GenerationBatch batch(engine);
  batch.set_kv_memory(engine.backend().KvBytes(64));  // one block
  GenerateRequest q;
  q.prompt_tokens.assign(40, 5);
  q.max_tokens = 24;  // 64 positions: fits
  EXPECT_TRUE(batch.Add(q).ok());
  q.max_tokens = 25;  // 65: never
  absl::StatusOr<int64_t> refused = batch.Add(q);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_HAS_SUBSTR(refused.status().message(), "KV cache");
  while (batch.active() > 0) ASSERT_TRUE(batch.Step().ok());
  EXPECT_EQ(batch.TakeFinished().size(), 1u);
}

// Requests wait for memory rather than fail: with room for one at a time, every one finishes.
TEST(Admission, RequestsWaitForMemoryInTheirOrder) {
  testutil::ScratchDir scratch;
  Engine engine(TinyBackend(scratch, 3), std::nullopt);
  engine.set_prefix_cache(std::nullopt);
  GenerationBatch batch(engine);
  batch.set_kv_memory(engine.backend().KvBytes(128));
  std::vector<GenerateRequest> qs = Requests({"attention"}, 4);
  for (const GenerateRequest& q : qs) ASSERT_TRUE(batch.Add(q).ok());
  std::vector<int64_t> order;
  while (batch.active() > 0) {
    ASSERT_TRUE(batch.Step().ok());
    EXPECT_LE(batch.kv_bytes(), engine.backend().KvBytes(128));
    for (auto& [id, result] : batch.TakeFinished()) order.push_back(id);
  }
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace oryx
