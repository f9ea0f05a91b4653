// The cost model's work terms and its fit: exact recovery of a known cost law, non-negative coefficients,
// the fit to spans measured on the H200, and clear errors for too few or bad measurements.
#include "router/cost_model.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

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
  // A verify span computes the logits of its 5 tokens, a prefill segment those of its last one.
  const double lm_head_row = 2.0 * static_cast<double>(c.vocab_size) * static_cast<double>(c.d_model);
  EXPECT_DOUBLE_EQ(WorkOf(c, {2, 5, 100, Mode::kAttention, /*all_logits=*/true}).dense_flops -
                       WorkOf(c, {2, 5, 100, Mode::kAttention}).dense_flops,
                   2 * 4 * lm_head_row);
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
  ASSERT_EQ(j.size(), 11u);
  for (const auto& [name, value] : j.items()) EXPECT_GE(value.get<double>(), 0.0) << name;
}

// A GPU-like cost law for the bundled model's shape: a large fixed cost per forward, so that spans of 1 and 8
// tokens say little about the attention FLOPs, which are most of a long prompt's cost in attention mode. With
// 5% noise on every measurement, a fit on those short spans alone put the linear mode's share of a 16K prompt
// at 0.56-0.86 (truly 0.66) over these seeds; the grid's prefill segments hold it within 0.04.
TEST(CostModel, CalibrationSpansPinTheCostOfPrefillSegments) {
  ModelConfig c = testutil::TinyConfig();
  c.vocab_size = 8192, c.d_model = 512, c.n_layers = 8, c.n_heads = 8, c.head_dim = 64, c.mlp_hidden = 1024;
  c.max_position = 16384;
  auto law = [&](const SpanShape& s) {
    const SpanWork w = WorkOf(c, s);
    return 3e-4 + 8e-14 * w.dense_flops + 1.7e-13 * w.kv_bytes + 1.5e-14 * w.attention_flops;
  };
  // A 16K prompt in segments of 1,024 tokens, all in one mode.
  auto prompt = [&](auto&& seconds, Mode mode) {
    double t = 0;
    for (int64_t ctx = 0; ctx < 16384; ctx += 1024) t += seconds(SpanShape{1, 1024, ctx, mode});
    return t;
  };
  const double true_ratio = prompt(law, Mode::kLinear) / prompt(law, Mode::kAttention);
  for (uint32_t seed = 1; seed <= 8; ++seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> noise(1.0, 0.05);
    std::vector<Measurement> ms;
    for (const SpanShape& s : CalibrationShapes(c)) ms.push_back({s, law(s) * noise(rng)});
    auto model = CostModel::Fit(c, ms);
    ASSERT_TRUE(model.ok()) << model.status();
    auto predicted = [&](const SpanShape& s) { return model->PredictSeconds(s); };
    for (const SpanShape& s : {SpanShape{1, 1024, 15000, Mode::kAttention}, SpanShape{1, 1024, 4000, Mode::kAttention},
                               SpanShape{1, 1024, 8000, Mode::kLinear}}) {
      EXPECT_NEAR(predicted(s) / law(s), 1.0, 0.1)
          << "seed " << seed << ", " << s.tokens << " tokens after " << s.context;
    }
    EXPECT_NEAR(prompt(predicted, Mode::kLinear) / prompt(predicted, Mode::kAttention), true_ratio, 0.04)
        << "seed " << seed;
  }
}

// Spans measured on the H200 (models/default, `oryx bench cost --device cuda`; results/2026-12-05-h200-router-
// validation): a prefill segment's time there is nearly flat in its length and grows with the context at
// 20-30 times the KV rate of a decode step, and segments run outside CUDA graphs. With one fixed cost and one
// KV rate for all spans the law missed these segments by 27% on average (55% at worst) even fitted to them.
TEST(CostModel, LongSpansFollowTheH200) {
  ModelConfig c = testutil::TinyConfig();
  c.vocab_size = 8192, c.d_model = 512, c.n_layers = 8, c.n_heads = 8, c.head_dim = 64, c.mlp_hidden = 1024;
  c.max_position = 16384;
  const char* src = std::getenv("ORYX_SOURCE_DIR");
  std::ifstream in(std::string(src != nullptr ? src : ".") + "/tests/data/cost_model/h200-default-spans.jsonl");
  ASSERT_TRUE(in.good());
  std::vector<Measurement> ms;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const int64_t tokens = j["tokens"];
    const SpanShape s{j["batch"], tokens, j["context"], j["mode"] == "attention" ? Mode::kAttention : Mode::kLinear,
                      /*all_logits=*/tokens <= 8};  // verify spans of a few tokens; prefill segments: the last
    ms.push_back({s, j["measured_ms"].get<double>() * 1e-3});
  }
  ASSERT_EQ(ms.size(), 24u);
  auto model = CostModel::Fit(c, ms);
  ASSERT_TRUE(model.ok()) << model.status();
  double sum = 0, worst = 0;
  int segments = 0;
  for (const Measurement& m : ms) {
    if (m.shape.tokens < 256) continue;  // the prefill segments: 256 and 1,024 tokens
    const double err = std::abs(model->PredictSeconds(m.shape) / m.seconds - 1);
    sum += err, worst = std::max(worst, err), ++segments;
  }
  ASSERT_EQ(segments, 8);
  EXPECT_LT(sum / segments, 0.05);
  EXPECT_LT(worst, 0.1);
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
