// Export of a LibTorch model to the checkpoint format and back gives the same weights and logits.
#include <filesystem>

#include "engine/checkpoint.h"
#include "gtest/gtest.h"
#include "tests/engine/testing_checkpoint.h"
#include "tests/train/testing_models.h"
#include "train/torch_io.h"

namespace oryx::train {
namespace {

ModelConfig SmallConfig(LinearMixer mixer, bool tied) {
  ModelConfig c = SmallModel(mixer, /*vocab=*/40);
  c.tie_embeddings = tied;
  return c;
}

TEST(TorchIo, ExportThenLoadReproducesLogitsForBothMixersAndShards) {
  testutil::ScratchDir scratch;
  const std::string root = scratch.path(), tokenizer = scratch.Join("tokenizer.model");
  testutil::WriteRawFile(tokenizer, "not parsed by the checkpoint loader");
  for (LinearMixer mixer : {LinearMixer::kMamba2, LinearMixer::kGdn}) {
    for (bool tied : {true, false}) {
      OryxModel model(SmallConfig(mixer, tied), 7);
      const std::string dir = root + "/model";
      // Small shards force the HF-style index path.
      ASSERT_TRUE(ExportCheckpoint(model, dir, tokenizer, DType::kF32, /*max_shard_bytes=*/8000).ok());
      EXPECT_TRUE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
      auto loaded = LoadModel(dir, torch::kCPU);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      auto tokens = torch::randint(0, 40, {1, 9}, torch::kLong);
      auto modes = torch::rand({1, 9}) < 0.5;
      torch::NoGradGuard no_grad;
      EXPECT_TRUE(torch::equal(model->Forward(tokens, modes), (*loaded)->Forward(tokens, modes)));
    }
  }
}

TEST(TorchIo, Bf16ExportRoundsWeightsToBf16) {
  testutil::ScratchDir scratch;
  const std::string root = scratch.path(), tokenizer = scratch.Join("tokenizer.model");
  testutil::WriteRawFile(tokenizer, "x");
  OryxModel model(SmallConfig(LinearMixer::kMamba2, true), 3);
  ASSERT_TRUE(ExportCheckpoint(model, root + "/m", tokenizer, DType::kBF16).ok());
  auto loaded = LoadModel(root + "/m", torch::kCPU);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto a = model->NamedTensors()[2].second, b = (*loaded)->NamedTensors()[2].second;  // k_proj
  EXPECT_TRUE(torch::equal(a.to(torch::kBFloat16).to(torch::kFloat32), b));
  EXPECT_FALSE(torch::equal(a, b));  // the random weights are not all representable in bf16
}

TEST(TorchIo, LoadingIntoAModelOfAnotherConfigIsAnError) {
  testutil::ScratchDir scratch;
  const std::string root = scratch.path();
  testutil::WriteRawFile(scratch.Join("tokenizer.model"), "x");
  OryxModel a(SmallConfig(LinearMixer::kMamba2, true), 1);
  ASSERT_TRUE(ExportCheckpoint(a, root + "/m", root + "/tokenizer.model").ok());
  auto checkpoint = LoadCheckpoint(root + "/m");
  ASSERT_TRUE(checkpoint.ok());
  OryxModel b(SmallConfig(LinearMixer::kGdn, true), 1);
  absl::Status s = LoadWeights(*checkpoint, b);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("config differs"), std::string::npos) << s;
}

}  // namespace
}  // namespace oryx::train
