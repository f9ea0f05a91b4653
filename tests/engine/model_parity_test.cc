// The CPU engine against the LibTorch model (the reference the engine is checked against): the same
// checkpoint gives the same logits for any mode schedule, however the tokens are split into forwards.
#include <random>

#include "engine/cpu_backend.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"
#include "tests/engine/testing_checkpoint.h"
#include "tests/train/testing_models.h"
#include "train/torch_io.h"

namespace oryx {
namespace {

struct ParityCase {
  LinearMixer mixer;
  bool rope;
  bool tied;
  int64_t attn_log_scale_base = 0;  // > 0: queries sharpen from this position on (T = 41 reaches 1.8x at 8)
};

class ModelParityTest : public ::testing::TestWithParam<ParityCase> {};

// Exports `reference` into scratch/model (with a stand-in tokenizer file) and loads it into the engine.
absl::StatusOr<std::unique_ptr<CpuBackend>> ExportAndLoad(train::OryxModel& reference, const testutil::ScratchDir& scratch) {
  testutil::WriteRawFile(scratch.Join("tokenizer.model"), "tokenizer bytes are not read by the model");
  ORYX_RETURN_IF_ERROR(train::ExportCheckpoint(reference, scratch.Join("model"), scratch.Join("tokenizer.model")));
  return CpuBackend::Load(scratch.Join("model"));
}

TEST_P(ModelParityTest, EngineLogitsEqualLibTorchForAnyModeScheduleAndSplit) {
  const ParityCase pc = GetParam();
  ModelConfig config = train::SmallModel(pc.mixer, /*vocab=*/61);
  config.rope_theta = pc.rope ? 10000.0 : 0.0;
  config.tie_embeddings = pc.tied;
  config.attn_log_scale_base = pc.attn_log_scale_base;
  train::OryxModel reference(config, /*seed=*/17);
  testutil::ScratchDir scratch;
  auto model = ExportAndLoad(reference, scratch);
  ASSERT_TRUE(model.ok()) << model.status();

  const int64_t T = 41;
  std::mt19937 rng(5);
  std::vector<int32_t> tokens(T);
  std::vector<Mode> modes(T);
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = static_cast<int32_t>(rng() % 61);
    // Fragments of 6 with a random mode, plus single-token flips: switches inside and at fragment edges.
    modes[t] = ((t / 6) % 2 == 0) != (rng() % 7 == 0) ? Mode::kAttention : Mode::kLinear;
  }
  torch::NoGradGuard no_grad;
  std::vector<int64_t> ids(tokens.begin(), tokens.end());
  std::vector<uint8_t> attn(T);
  for (int64_t t = 0; t < T; ++t) attn[t] = modes[t] == Mode::kAttention;
  auto expected = reference
                      ->Forward(torch::from_blob(ids.data(), {1, T}, torch::kInt64),
                                torch::from_blob(attn.data(), {1, T}, torch::kUInt8).to(torch::kBool))
                      .contiguous();

  // Prefill in uneven chunks, then decode steps of one token.
  for (std::vector<int64_t> split : {std::vector<int64_t>{T}, {5, 1, 12, 3}, {1, 1, 1, 16, 9}}) {
    SequenceState seq = (*model)->NewSequence();
    int64_t begin = 0;
    for (size_t i = 0; begin < T; ++i) {
      const int64_t n = i < split.size() ? std::min(split[i], T - begin) : 1;
      std::vector<float> logits;
      ASSERT_TRUE((*model)->Forward(seq, std::span(tokens).subspan(begin, n), std::span(modes).subspan(begin, n),
                                 /*all_logits=*/true, &logits)
                      .ok());
      auto got = torch::from_blob(logits.data(), {n, config.vocab_size}, torch::kFloat32);
      const double diff = (got - expected[0].narrow(0, begin, n)).abs().max().item<double>();
      EXPECT_LE(diff, 1e-4) << "tokens " << begin << ".." << begin + n - 1;
      begin += n;
    }
    EXPECT_EQ(seq.position(), T);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configs, ModelParityTest,
    ::testing::Values(ParityCase{LinearMixer::kMamba2, true, false}, ParityCase{LinearMixer::kMamba2, false, true},
                      ParityCase{LinearMixer::kGdn, true, true}, ParityCase{LinearMixer::kGdn, false, false},
                      ParityCase{LinearMixer::kMamba2, true, false, 8}, ParityCase{LinearMixer::kGdn, false, true, 4}),
    [](const auto& info) {
      const ParityCase& c = info.param;
      return std::string(LinearMixerName(c.mixer)) + (c.rope ? "_rope" : "_norope") + (c.tied ? "_tied" : "_untied") +
             (c.attn_log_scale_base > 0 ? "_logscale" + std::to_string(c.attn_log_scale_base) : "");
    });

TEST(ModelInput, BadSpansAreErrorsAndLeaveTheSequenceUntouched) {
  ModelConfig config = train::SmallModel(LinearMixer::kMamba2, 61);
  config.max_position = 8;
  train::OryxModel reference(config, 1);
  testutil::ScratchDir scratch;
  auto model = ExportAndLoad(reference, scratch);
  ASSERT_TRUE(model.ok()) << model.status();
  SequenceState seq = (*model)->NewSequence();
  std::vector<float> logits;
  std::vector<int32_t> ok_ids = {1, 2}, bad_id = {1, 61};
  std::vector<Mode> two = {Mode::kLinear, Mode::kAttention}, one = {Mode::kLinear};
  EXPECT_EQ((*model)->Forward(seq, {}, {}, false, &logits).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->Forward(seq, ok_ids, one, false, &logits).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->Forward(seq, bad_id, two, false, &logits).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> nine(9, 1);
  std::vector<Mode> nine_modes(9, Mode::kLinear);
  EXPECT_EQ((*model)->Forward(seq, nine, nine_modes, false, &logits).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(seq.position(), 0);
  ASSERT_TRUE((*model)->Forward(seq, ok_ids, two, false, &logits).ok());
  EXPECT_EQ(logits.size(), 61u);
  EXPECT_EQ(seq.position(), 2);
}

}  // namespace
}  // namespace oryx
