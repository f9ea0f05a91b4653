// The cost model's work terms and its fit: exact recovery of a known cost law, non-negative coefficients,
// and clear errors for too few or bad measurements.
#include "router/cost_model.h"

#include <random>

#include "gtest/gtest.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx::router {
namespace {

std::vector<SpanShape> Grid() {
  std::vector<SpanShape> g;
  for (Mode m : {Mode::kAttention, Mode::kLinear}) {
    for (int64_t b : {1, 4, 16}) {
      for (int64_t t : {1, 8}) {
        for (int64_t ctx : {0, 100, 1000}) g.push_back({b, t, ctx, m});
      }
    }
  }
  return g;
}

TEST(CostModel, WorkTermsFollowTheShape) {
  const ModelConfig c = testutil::TinyConfig();
  const SpanWork one = WorkOf(c, {1, 1, 100, Mode::kAttention});
  const SpanWork batch = WorkOf(c, {4, 1, 100, Mode::kAttention});
  EXPECT_DOUBLE_EQ(batch.dense_flops, 4 * one.dense_flops);
  EXPECT_DOUBLE_EQ(batch.kv_bytes, 4 * one.kv_bytes);
  const SpanWork lin = WorkOf(c, {1, 1, 100, Mode::kLinear});
  EXPECT_EQ(lin.kv_bytes, 0);
  EXPECT_EQ(lin.attention_flops, 0);
  EXPECT_LT(lin.dense_flops, one.dense_flops);  // no attention query projection
  EXPECT_EQ(lin.recurrent_flops, one.recurrent_flops);
  EXPECT_GT(WorkOf(c, {1, 1, 1000, Mode::kAttention}).kv_bytes, one.kv_bytes);
}

TEST(CostModel, SpanBytesCountWeightsOncePerForwardAndTheKvCacheRead) {
  const ModelConfig c = testutil::TinyConfig();
  const double HD = static_cast<double>(c.qk_dim()), L = static_cast<double>(c.n_layers);
  const double step = SpanBytes(c, {1, 1, 1000, Mode::kAttention});
  // One more context token: its K and V (bf16) read in every layer.
  EXPECT_DOUBLE_EQ(SpanBytes(c, {1, 1, 1001, Mode::kAttention}) - step, L * 2 * HD * 2);
  // Linear mode reads no cache: the difference is the cache of 1001 positions.
  EXPECT_DOUBLE_EQ(step - SpanBytes(c, {1, 1, 1000, Mode::kLinear}), L * 1001 * 2 * HD * 2);
  // A verify span of 5 tokens reads the weights once: far less than 5 steps, more than one.
  const double span = SpanBytes(c, {1, 5, 1000, Mode::kAttention});
  EXPECT_GT(span, step);
  EXPECT_LT(span, 2 * step);
  // A second sequence adds its own cache and state, not the weights again.
  EXPECT_LT(SpanBytes(c, {2, 1, 1000, Mode::kAttention}), 2 * step);
}

TEST(CostModel, FitRecoversAKnownCostLaw) {
  const ModelConfig c = testutil::TinyConfig();
  // t = 1e-4 + 1e-10 * dense + 5e-11 * kv + 2e-10 * attention (no recurrence term), with 1% noise.
  std::mt19937 rng(3);
  std::normal_distribution<double> noise(1.0, 0.01);
  auto law = [&](const SpanShape& s) {
    const SpanWork w = WorkOf(c, s);
    return 1e-4 + 1e-10 * w.dense_flops + 5e-11 * w.kv_bytes + 2e-10 * w.attention_flops;
  };
  std::vector<Measurement> ms;
  for (const SpanShape& s : Grid()) ms.push_back({s, law(s) * noise(rng)});
  auto model = CostModel::Fit(c, ms);
  ASSERT_TRUE(model.ok()) << model.status();
  for (const SpanShape& s : {SpanShape{2, 3, 500, Mode::kAttention}, SpanShape{8, 1, 50, Mode::kLinear}}) {
    EXPECT_NEAR(model->PredictSeconds(s) / law(s), 1.0, 0.03);
  }
  const nlohmann::json j = model->ToJson();
  ASSERT_EQ(j.size(), 9u);
  for (const auto& [name, value] : j.items()) EXPECT_GE(value.get<double>(), 0.0) << name;
}

TEST(CostModel, TooFewOrBadMeasurementsAreErrors) {
  const ModelConfig c = testutil::TinyConfig();
  std::vector<Measurement> few = {{{1, 1, 0, Mode::kLinear}, 1e-3}, {{2, 1, 0, Mode::kLinear}, 2e-3}};
  EXPECT_EQ(CostModel::Fit(c, few).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<Measurement> bad;
  for (const SpanShape& s : Grid()) bad.push_back({s, 1e-3});
  bad[3].seconds = 0;
  EXPECT_EQ(CostModel::Fit(c, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace oryx::router
