// The cost model's work terms and its fit: exact recovery of a known cost law, non-negative coefficients,
// the fit to spans measured on the H200 and on the CPU (held-out shapes predicted from the calibration grid),
// and clear errors for too few or bad measurements.
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
  // t = 1e-4 + 1e-10 * dense (a GEMV or a GEMM) + 3e-5 (a product of 2-6 rows) + 5e-11 * kv
  //     + 2e-10 * attention + 2e-6 per row of a short span (no recurrence term), with 1% noise.
  std::mt19937 rng(3);
  std::normal_distribution<double> noise(1.0, 0.01);
  auto law = [&](const SpanShape& s) {
    const SpanWork w = WorkOf(c, s);
    const int64_t m = s.batch * s.tokens;
    return 1e-4 + (m >= 2 && m <= 6 ? 3e-5 : 1e-10 * w.dense_flops) + 5e-11 * w.kv_bytes + 2e-10 * w.attention_flops +
           2e-6 * static_cast<double>(m);
  };
  std::vector<Measurement> ms;
  for (const SpanShape& s : Grid()) ms.push_back({s, law(s) * noise(rng)});
  auto model = CostModel::Fit(c, ms);
  ASSERT_TRUE(model.ok()) << model.status();
  for (const SpanShape& s : {SpanShape{2, 3, 500, Mode::kAttention}, SpanShape{8, 1, 50, Mode::kLinear}}) {
    EXPECT_NEAR(model->PredictSeconds(s) / law(s), 1.0, 0.03);
  }
  const nlohmann::json j = model->ToJson();
  ASSERT_EQ(j.size(), 13u);
  for (const auto& [name, value] : j.items()) EXPECT_GE(value.get<double>(), 0.0) << name;
}

// The bundled model's shape (models/default/config.json), which the measured spans below come from.
ModelConfig DefaultModelShape() {
  ModelConfig c = testutil::TinyConfig();
  c.vocab_size = 8192, c.d_model = 512, c.n_layers = 8, c.n_heads = 8, c.head_dim = 64, c.mlp_hidden = 1024;
  c.max_position = 16384;
  return c;
}

// A GPU-like cost law for the bundled model's shape: a large fixed cost per forward, so that spans of 1 and 8
// tokens say little about the attention FLOPs, which are most of a long prompt's cost in attention mode. With
// 5% noise on every measurement, a fit on those short spans alone put the linear mode's share of a 16K prompt
// at 0.56-0.86 (truly 0.66) over these seeds; the grid's prefill segments hold it within 0.04.
TEST(CostModel, CalibrationSpansPinTheCostOfPrefillSegments) {
  const ModelConfig c = DefaultModelShape();
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

// Spans measured by `oryx bench cost --json` (models/default), from tests/data/cost_model/: the calibration
// grid's shapes (marked "calibration": true) and the held-out ones.
struct MeasuredSpans {
  std::vector<Measurement> calibration, held_out;
};

MeasuredSpans ReadSpans(const std::string& name) {
  const char* src = std::getenv("ORYX_SOURCE_DIR");
  std::ifstream in(std::string(src != nullptr ? src : ".") + "/tests/data/cost_model/" + name);
  EXPECT_TRUE(in.good()) << name;
  MeasuredSpans spans;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const int64_t tokens = j["tokens"];
    // (files without the field: verify spans of a few tokens have every logit, prefill segments the last)
    const SpanShape s{j["batch"], tokens, j["context"], j["mode"] == "attention" ? Mode::kAttention : Mode::kLinear,
                      j.value("all_logits", tokens <= 8)};
    (j.value("calibration", false) ? spans.calibration : spans.held_out)
        .push_back({s, j["measured_ms"].get<double>() * 1e-3});
  }
  return spans;
}

// The mean and the worst relative error of a fitted law on the spans of up to kLongSpanTokens tokens a
// sequence (short: decode steps, verify spans) or on the longer ones (prefill segments).
struct Errors {
  double mean = 0, worst = 0;
  int count = 0;
};
Errors ErrorsOn(const CostModel& model, const std::vector<Measurement>& ms, bool long_spans) {
  Errors e;
  for (const Measurement& m : ms) {
    if ((m.shape.tokens > kLongSpanTokens) != long_spans) continue;
    const double err = std::abs(model.PredictSeconds(m.shape) / m.seconds - 1);
    e.mean += err, e.worst = std::max(e.worst, err), ++e.count;
  }
  if (e.count > 0) e.mean /= e.count;
  return e;
}

// Spans measured on the H200 (results/2026-12-05-h200-router-validation): a prefill segment's time there is
// nearly flat in its length and grows with the context at 20-30 times the KV rate of a decode step, and
// segments run outside CUDA graphs. With one fixed cost and one KV rate for all spans the law missed these
// segments by 27% on average (55% at worst) even fitted to them.
TEST(CostModel, LongSpansFollowTheH200) {
  const MeasuredSpans spans = ReadSpans("h200-default-spans.jsonl");
  ASSERT_EQ(spans.held_out.size(), 24u);
  auto model = CostModel::Fit(DefaultModelShape(), spans.held_out);
  ASSERT_TRUE(model.ok()) << model.status();
  const Errors segments = ErrorsOn(*model, spans.held_out, /*long_spans=*/true);
  ASSERT_EQ(segments.count, 8);  // 256 and 1,024 tokens
  EXPECT_LT(segments.mean, 0.05);
  EXPECT_LT(segments.worst, 0.1);
}

// Fits the law to a file's calibration rows and expects its held-out rows within the bounds (mean and worst
// relative error of the 16 short spans, then of the 8 prefill segments).
void ExpectHeldOutWithin(const std::string& file, Errors short_bound, Errors segment_bound) {
  const MeasuredSpans spans = ReadSpans(file);
  ASSERT_EQ(spans.calibration.size(), 60u);
  auto model = CostModel::Fit(DefaultModelShape(), spans.calibration);
  ASSERT_TRUE(model.ok()) << model.status();
  const Errors short_spans = ErrorsOn(*model, spans.held_out, false), segments = ErrorsOn(*model, spans.held_out, true);
  ASSERT_EQ(short_spans.count, 16);
  ASSERT_EQ(segments.count, 8);
  EXPECT_LT(short_spans.mean, short_bound.mean);
  EXPECT_LT(short_spans.worst, short_bound.worst);
  EXPECT_LT(segments.mean, segment_bound.mean);
  EXPECT_LT(segments.worst, segment_bound.worst);
}

// The device's own calibration predicts the shapes it did not measure (results/2026-12-05-h200-router-fronts,
// call 1, first fit). Before the per-row, multi-token and small-product terms, the H200's held-out short
// spans were missed by 35% on average and 99% at worst (8 sequences of one token costed as a GEMM, 2 as half
// of 4), its segments by 12% and 16%.
TEST(CostModel, CalibrationPredictsHeldOutShapesOnTheH200) {
  ExpectHeldOutWithin("h200-default-calibration.jsonl", {.mean = 0.2, .worst = 0.4}, {.mean = 0.08, .worst = 0.12});
}

// On the 2-core development VM (results/2026-12-05-cost-short-spans) the new terms change little: this run's
// held-out short spans 14.7% on average with them, 14.0% without (another run: 9.7% against 15.0%).
TEST(CostModel, CalibrationPredictsHeldOutShapesOnTheCpu) {
  ExpectHeldOutWithin("cpu-default-calibration.jsonl", {.mean = 0.2, .worst = 0.35}, {.mean = 0.15, .worst = 0.25});
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
