// Checkpoint tests: the tensor-name table, write -> load round trips (f32/bf16, single/sharded,
// tied/untied, mamba2/gdn), one test per kind of bad checkpoint, and the atomic directory swap.
#include "engine/checkpoint.h"

#include <signal.h>
#include <sys/resource.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "engine/tensor_names.h"
#include "gtest/gtest.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx {
namespace {

using testutil::FileSizeLimit;
using testutil::RandomTensors;
using testutil::ScratchDir;
using testutil::TinyConfig;
using testutil::WriteTinyCheckpoint;

// ---- the tensor-name table ----

const TensorSpec* FindSpec(const std::vector<TensorSpec>& specs, std::string_view name) {
  for (const TensorSpec& s : specs) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

TEST(TensorNamesTest, Mamba2UntiedMatchesDesign) {
  const ModelConfig c = TinyConfig(LinearMixer::kMamba2, /*tie_embeddings=*/false);
  const std::vector<TensorSpec> specs = ExpectedTensors(c);
  // embed + final_norm + lm_head, and per layer 2 norms + 9 mixer + 4 mamba2 + 3 mlp.
  EXPECT_EQ(specs.size(), 3u + 2u * 18u);
  EXPECT_EQ(specs.front().name, "embed.weight");
  EXPECT_EQ(specs.back().name, "lm_head.weight");
  const std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"embed.weight", {32, 8}},
      {"final_norm.weight", {8}},
      {"lm_head.weight", {32, 8}},
      {"layers.0.attn_norm.weight", {8}},
      {"layers.1.mlp_norm.weight", {8}},
      {"layers.1.mixer.k_proj.weight", {8, 8}},
      {"layers.1.mixer.v_proj.weight", {8, 8}},
      {"layers.1.mixer.g_proj.weight", {8, 8}},
      {"layers.1.mixer.o_proj.weight", {8, 8}},
      {"layers.0.mixer.conv.weight", {16, 4}},
      {"layers.0.mixer.conv.bias", {16}},
      {"layers.0.mixer.gate_norm.weight", {4}},
      {"layers.0.mixer.q_attn.weight", {8, 8}},
      {"layers.0.mixer.q_linear.weight", {8, 8}},
      {"layers.0.mixer.dt_proj.weight", {2, 8}},
      {"layers.0.mixer.dt_bias", {2}},
      {"layers.0.mixer.A_log", {2}},
      {"layers.0.mixer.D_skip", {2}},
      {"layers.1.mlp.gate.weight", {16, 8}},
      {"layers.1.mlp.up.weight", {16, 8}},
      {"layers.1.mlp.down.weight", {8, 16}},
  };
  for (const auto& [name, shape] : expected) {
    const TensorSpec* s = FindSpec(specs, name);
    ASSERT_NE(s, nullptr) << name;
    EXPECT_EQ(s->shape, shape) << name;
  }
  EXPECT_EQ(FindSpec(specs, "layers.0.mixer.beta_proj.weight"), nullptr);
  std::set<std::string> unique;
  for (const TensorSpec& s : specs) unique.insert(s.name);
  EXPECT_EQ(unique.size(), specs.size());
}

TEST(TensorNamesTest, GdnTiedMatchesDesign) {
  ModelConfig c = TinyConfig(LinearMixer::kGdn, /*tie_embeddings=*/true);
  c.d_model = 12;  // H*dh != D: shapes must use the right one
  const std::vector<TensorSpec> specs = ExpectedTensors(c);
  EXPECT_EQ(specs.size(), 2u + 2u * 18u);
  EXPECT_EQ(FindSpec(specs, "lm_head.weight"), nullptr);
  EXPECT_EQ(FindSpec(specs, "layers.0.mixer.dt_proj.weight"), nullptr);
  EXPECT_EQ(FindSpec(specs, "layers.0.mixer.D_skip"), nullptr);
  EXPECT_EQ(FindSpec(specs, "layers.1.mixer.beta_proj.weight")->shape, (std::vector<int64_t>{2, 12}));
  EXPECT_EQ(FindSpec(specs, "layers.1.mixer.alpha_proj.weight")->shape, (std::vector<int64_t>{2, 12}));
  EXPECT_EQ(FindSpec(specs, "layers.1.mixer.dt_bias")->shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(FindSpec(specs, "layers.1.mixer.A_log")->shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(FindSpec(specs, "layers.0.mixer.k_proj.weight")->shape, (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(FindSpec(specs, "layers.0.mixer.o_proj.weight")->shape, (std::vector<int64_t>{12, 8}));
  EXPECT_EQ(FindSpec(specs, "embed.weight")->shape_doc, "[vocab_size, d_model]");
}

// ---- round trips ----

// (dtype, sharded, tied, mixer)
using RoundTripParam = std::tuple<DType, bool, bool, LinearMixer>;

class RoundTripTest : public ::testing::TestWithParam<RoundTripParam> {};

TEST_P(RoundTripTest, WriteThenLoadGivesTheSameTensors) {
  const auto [dtype, sharded, tied, mixer] = GetParam();
  ScratchDir scratch;
  const std::string dir = scratch.Join("ckpt");
  const ModelConfig config = TinyConfig(mixer, tied);
  const std::vector<HostTensor> tensors = RandomTensors(config, dtype, /*seed=*/7);
  WriteTinyCheckpoint(dir, config, tensors, sharded ? 2048 : kDefaultMaxShardBytes);
  EXPECT_EQ(std::filesystem::exists(dir + "/model.safetensors.index.json"), sharded);
  EXPECT_EQ(std::filesystem::exists(dir + "/model.safetensors"), !sharded);

  absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->config(), config);
  EXPECT_EQ(ckpt->tokenizer_path(), dir + "/tokenizer.model");
  EXPECT_EQ(ckpt->tensors().size(), tensors.size());
  for (const HostTensor& t : tensors) {
    absl::StatusOr<TensorView> v = ckpt->Tensor(t.name);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->dtype, dtype);
    EXPECT_EQ(std::vector<int64_t>(v->shape.begin(), v->shape.end()), t.shape);
    absl::StatusOr<std::vector<float>> values = ckpt->TensorAsFloats(t.name);
    ASSERT_TRUE(values.ok());
    EXPECT_EQ(*values, TensorToFloats(t.view())) << t.name;
  }
}

std::string RoundTripName(const ::testing::TestParamInfo<RoundTripParam>& info) {
  const auto [dtype, sharded, tied, mixer] = info.param;
  return std::string(DTypeName(dtype)) + (sharded ? "_sharded" : "_single") + (tied ? "_tied_" : "_untied_") +
         std::string(LinearMixerName(mixer));
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, RoundTripTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16), ::testing::Bool(),
                                            ::testing::Bool(),
                                            ::testing::Values(LinearMixer::kMamba2, LinearMixer::kGdn)),
                         RoundTripName);

TEST(CheckpointTest, MixedDTypesLoad) {
  ScratchDir scratch;
  const ModelConfig config = TinyConfig();
  std::vector<HostTensor> tensors = RandomTensors(config, DType::kBF16, 3);
  const std::vector<HostTensor> f32 = RandomTensors(config, DType::kF32, 3);
  tensors[0] = f32[0];  // embed.weight in f32, the rest in bf16
  WriteTinyCheckpoint(scratch.Join("ckpt"), config, tensors);
  absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(scratch.Join("ckpt"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->Tensor("embed.weight")->dtype, DType::kF32);
  EXPECT_EQ(ckpt->Tensor("final_norm.weight")->dtype, DType::kBF16);
}

TEST(CheckpointTest, UnknownTensorNameIsNotFound) {
  ScratchDir scratch;
  const ModelConfig config = TinyConfig();
  WriteTinyCheckpoint(scratch.Join("ckpt"), config, RandomTensors(config, DType::kF32, 1));
  absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(scratch.Join("ckpt"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  absl::StatusOr<TensorView> t = ckpt->Tensor("layers.9.mlp.up.weight");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(t.status().message(), "no tensor 'layers.9.mlp.up.weight'");
  EXPECT_EQ(ckpt->TensorAsFloats("nope").status().code(), absl::StatusCode::kNotFound);
}

// ---- bad checkpoints: one test per kind ----

// A valid tiny checkpoint in `dir()` that each test then breaks.
class BadCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = TinyConfig();
    WriteTinyCheckpoint(dir(), config_, RandomTensors(config_, DType::kF32, 11));
  }
  std::string dir() const { return scratch_.Join("ckpt"); }
  std::string weights() const { return dir() + "/model.safetensors"; }
  std::string config_path() const { return dir() + "/config.json"; }
  // The load error; fails the test if the checkpoint loads.
  absl::Status LoadError() {
    absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(dir());
    EXPECT_FALSE(ckpt.ok());
    return ckpt.status();
  }
  void SetBytes(const std::string& name, size_t element, const void* value, size_t size) {
    testutil::RewriteWeights(weights(), [&](std::vector<HostTensor>& tensors) {
      for (HostTensor& t : tensors) {
        if (t.name == name) std::memcpy(t.bytes.data() + element * size, value, size);
      }
    });
  }

  ScratchDir scratch_;
  ModelConfig config_;
};

TEST_F(BadCheckpointTest, ValidCheckpointLoads) { EXPECT_TRUE(LoadCheckpoint(dir()).ok()); }

TEST_F(BadCheckpointTest, MissingDirectory) {
  absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(scratch_.Join("nope"));
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(ckpt.status().message(), "nope: not a checkpoint directory");
}

TEST_F(BadCheckpointTest, MissingConfig) {
  std::filesystem::remove(config_path());
  absl::Status s = LoadError();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(s.message(), "ckpt/config.json");
}

TEST_F(BadCheckpointTest, MissingTokenizer) {
  std::filesystem::remove(dir() + "/tokenizer.model");
  absl::Status s = LoadError();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(s.message(), "ckpt/tokenizer.model: missing");
}

TEST_F(BadCheckpointTest, MissingWeights) {
  std::filesystem::remove(weights());
  absl::Status s = LoadError();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(s.message(), "no weights: neither model.safetensors nor");
}

TEST_F(BadCheckpointTest, ConfigFieldMissing) {
  std::string json = testutil::ReadRawFile(config_path());
  json.replace(json.find("\"eos_id\": 2,"), 12, "");
  testutil::WriteRawFile(config_path(), json);
  EXPECT_HAS_SUBSTR(LoadError().message(), "ckpt/config.json: field 'eos_id': missing");
}

TEST_F(BadCheckpointTest, ConfigFieldUnknown) {
  std::string json = testutil::ReadRawFile(config_path());
  json.replace(json.find('{'), 1, "{\"dropout\": 0.1,");
  testutil::WriteRawFile(config_path(), json);
  EXPECT_HAS_SUBSTR(LoadError().message(), "ckpt/config.json: field 'dropout': unknown field");
}

TEST_F(BadCheckpointTest, ConfigFieldWrongType) {
  std::string json = testutil::ReadRawFile(config_path());
  json.replace(json.find("\"n_layers\": 2"), 13, "\"n_layers\": 2.0");
  testutil::WriteRawFile(config_path(), json);
  EXPECT_HAS_SUBSTR(LoadError().message(), "ckpt/config.json: field 'n_layers': must be an integer, got 2.0");
}

TEST_F(BadCheckpointTest, ConfigFieldOutOfRange) {
  std::string json = testutil::ReadRawFile(config_path());
  json.replace(json.find("\"bos_id\": 1"), 11, "\"bos_id\": 32");
  testutil::WriteRawFile(config_path(), json);
  EXPECT_HAS_SUBSTR(LoadError().message(),
                    "ckpt/config.json: field 'bos_id': must be a token id in [0, vocab_size=32), got 32");
}

TEST_F(BadCheckpointTest, ConfigVocabSizeDisagreesWithEmbedding) {
  ModelConfig wrong = config_;
  wrong.vocab_size = 48;
  testutil::WriteRawFile(config_path(), ToJson(wrong));
  absl::Status s = LoadError();
  EXPECT_HAS_SUBSTR(s.message(),
                    "ckpt/model.safetensors: tensor 'embed.weight': shape [32, 8] does not "
                    "match config.json: expected [48, 8] = [vocab_size, d_model]");
}

TEST_F(BadCheckpointTest, ConfigMixerDisagreesWithWeights) {
  ModelConfig wrong = config_;
  wrong.linear_mixer = LinearMixer::kGdn;
  testutil::WriteRawFile(config_path(), ToJson(wrong));
  absl::Status s = LoadError();
  EXPECT_HAS_SUBSTR(s.message(),
                    "ckpt: missing tensor 'layers.0.mixer.beta_proj.weight' [2, 8] (4 "
                    "missing in all); there are also 4 unexpected tensors");
  EXPECT_HAS_SUBSTR(s.message(), "does config.json describe these weights");
}

TEST_F(BadCheckpointTest, MissingTensor) {
  testutil::RewriteWeights(weights(), [](std::vector<HostTensor>& tensors) {
    std::erase_if(tensors, [](const HostTensor& t) { return t.name == "layers.1.mlp.up.weight"; });
  });
  absl::Status s = LoadError();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_HAS_SUBSTR(s.message(), "ckpt: missing tensor 'layers.1.mlp.up.weight' [16, 8]");
}

TEST_F(BadCheckpointTest, UnexpectedTensor) {
  testutil::RewriteWeights(weights(), [](std::vector<HostTensor>& tensors) {
    tensors.push_back(MakeHostTensor("layers.0.mixer.extra", {1}, std::vector<float>{1}, DType::kF32));
  });
  EXPECT_HAS_SUBSTR(LoadError().message(),
                    "ckpt/model.safetensors: unexpected tensor 'layers.0.mixer.extra' (not in the tensor "
                    "table for this config)");
}

TEST_F(BadCheckpointTest, LmHeadPresentWhenTied) {
  ModelConfig tied = config_;
  tied.tie_embeddings = true;
  testutil::WriteRawFile(config_path(), ToJson(tied));
  EXPECT_HAS_SUBSTR(LoadError().message(),
                    "unexpected tensor 'lm_head.weight' (tie_embeddings is true, so there is no lm_head)");
}

TEST_F(BadCheckpointTest, ShapeMismatch) {
  testutil::RewriteWeights(weights(), [](std::vector<HostTensor>& tensors) {
    for (HostTensor& t : tensors) {
      if (t.name == "layers.1.mixer.o_proj.weight") t.shape = {4, 16};  // same bytes, wrong shape
    }
  });
  EXPECT_HAS_SUBSTR(LoadError().message(),
                    "ckpt/model.safetensors: tensor 'layers.1.mixer.o_proj.weight': shape [4, 16] does "
                    "not match config.json: expected [8, 8] = [d_model, n_heads*head_dim]");
}

TEST_F(BadCheckpointTest, NaNInF32) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  SetBytes("layers.0.mixer.k_proj.weight", 9, &nan, 4);
  EXPECT_HAS_SUBSTR(LoadError().message(),
                    "ckpt/model.safetensors: tensor 'layers.0.mixer.k_proj.weight': non-finite value "
                    "NaN (F32) at element 9 (index [1, 1])");
}

TEST_F(BadCheckpointTest, InfInF32) {
  const float inf = std::numeric_limits<float>::infinity();
  SetBytes("final_norm.weight", 7, &inf, 4);
  EXPECT_HAS_SUBSTR(LoadError().message(),
                    "tensor 'final_norm.weight': non-finite value +Inf (F32) at element 7 (index [7])");
}

TEST_F(BadCheckpointTest, NaNAndInfInBf16) {
  WriteTinyCheckpoint(dir(), config_, RandomTensors(config_, DType::kBF16, 12));
  const uint16_t nan = 0x7fc1, minus_inf = 0xff80;
  SetBytes("embed.weight", 0, &nan, 2);
  EXPECT_HAS_SUBSTR(LoadError().message(),
                    "tensor 'embed.weight': non-finite value NaN (BF16) at element 0 (index [0, 0])");
  WriteTinyCheckpoint(dir(), config_, RandomTensors(config_, DType::kBF16, 12));
  SetBytes("layers.1.mixer.A_log", 1, &minus_inf, 2);
  EXPECT_HAS_SUBSTR(LoadError().message(),
                    "tensor 'layers.1.mixer.A_log': non-finite value -Inf (BF16) at element 1");
}

TEST_F(BadCheckpointTest, CorruptWeightsFile) {
  std::string bytes = testutil::ReadRawFile(weights());
  testutil::WriteRawFile(weights(), bytes.substr(0, bytes.size() - 4));
  EXPECT_HAS_SUBSTR(LoadError().message(),
                    "ckpt/model.safetensors: tensor 'lm_head.weight': "
                    "data_offsets [8176, 9200] out of range");
  testutil::WriteRawFile(weights(), bytes.substr(0, 5));
  EXPECT_HAS_SUBSTR(LoadError().message(), "ckpt/model.safetensors: truncated: 5 bytes");
}

TEST_F(BadCheckpointTest, BadIndexThroughLoader) {
  WriteTinyCheckpoint(dir(), config_, RandomTensors(config_, DType::kF32, 11), /*max_shard_bytes=*/2048);
  const std::string index = dir() + "/model.safetensors.index.json";
  std::string json = testutil::ReadRawFile(index);
  const std::string shard = "model-00002-of-";
  json.replace(json.find(shard), shard.size(), "../model-00002-of-");
  testutil::WriteRawFile(index, json);
  EXPECT_HAS_SUBSTR(LoadError().message(), "is not a plain *.safetensors file name in the directory");
}

// ---- WriteCheckpoint: validation and the atomic swap ----

size_t CountEntries(const std::string& dir) {
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator(dir); it != std::filesystem::directory_iterator(); ++it) {
    n += 1;
  }
  return n;
}

TEST(WriteCheckpointTest, ReplacesExistingCheckpointAndLeavesNoSibling) {
  ScratchDir scratch;
  const std::string dir = scratch.Join("ckpt");
  const ModelConfig config = TinyConfig();
  WriteTinyCheckpoint(dir, config, RandomTensors(config, DType::kF32, 1), /*max_shard_bytes=*/2048);
  absl::StatusOr<Checkpoint> old_ckpt = LoadCheckpoint(dir);
  ASSERT_TRUE(old_ckpt.ok());
  const std::vector<float> old_embed = *old_ckpt->TensorAsFloats("embed.weight");

  // Replace a sharded f32 mamba2 checkpoint with a single-file bf16 gdn one.
  const ModelConfig new_config = TinyConfig(LinearMixer::kGdn, true);
  const std::vector<HostTensor> new_tensors = RandomTensors(new_config, DType::kBF16, 2);
  WriteTinyCheckpoint(dir, new_config, new_tensors);
  absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->config(), new_config);
  EXPECT_EQ(*ckpt->TensorAsFloats("embed.weight"), TensorToFloats(new_tensors[0].view()));
  EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors.index.json"));  // no stale shards
  EXPECT_EQ(CountEntries(dir), 3u);
  EXPECT_EQ(CountEntries(scratch.path()), 1u);  // no ckpt.tmp.* or ckpt.old.* left behind
  // The checkpoint opened before the swap still reads its own (now unlinked) files.
  EXPECT_EQ(*old_ckpt->TensorAsFloats("embed.weight"), old_embed);
}


TEST(WriteCheckpointTest, FailedWriteLeavesPreviousCheckpointIntact) {
  ScratchDir scratch;
  const std::string dir = scratch.Join("ckpt");
  const ModelConfig config = TinyConfig();
  WriteTinyCheckpoint(dir, config, RandomTensors(config, DType::kF32, 1));
  const std::string old_weights = testutil::ReadRawFile(dir + "/model.safetensors");

  ModelConfig bigger = config;
  bigger.vocab_size = 4096;  // a weights file far over the limit below
  const std::vector<HostTensor> tensors = RandomTensors(bigger, DType::kF32, 2);
  const std::vector<TensorView> views = Views(tensors);
  absl::Status s;
  {
    FileSizeLimit limit(32 * 1024);
    s = WriteCheckpoint(dir, bigger, views);
  }
  EXPECT_FALSE(s.ok());
  EXPECT_HAS_SUBSTR(s.message(), "write failed");
  absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->config(), config);
  EXPECT_EQ(testutil::ReadRawFile(dir + "/model.safetensors"), old_weights);
  EXPECT_EQ(CountEntries(scratch.path()), 1u);  // the temporary sibling was removed
}

TEST(WriteCheckpointTest, RejectsTensorsTheLoaderWouldReject) {
  ScratchDir scratch;
  const std::string dir = scratch.Join("ckpt");
  const ModelConfig config = TinyConfig();
  std::vector<HostTensor> tensors = RandomTensors(config, DType::kF32, 1);
  tensors.pop_back();  // drop lm_head.weight
  absl::Status s = WriteCheckpoint(dir, config, Views(tensors));
  EXPECT_HAS_SUBSTR(s.message(), "missing tensor 'lm_head.weight'");
  tensors = RandomTensors(config, DType::kF32, 1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(tensors[3].bytes.data(), &nan, 4);
  s = WriteCheckpoint(dir, config, Views(tensors));
  EXPECT_HAS_SUBSTR(s.message(), "non-finite value NaN");
  ModelConfig bad = config;
  bad.n_heads = 0;
  s = WriteCheckpoint(dir, bad, Views(RandomTensors(config, DType::kF32, 1)));
  EXPECT_HAS_SUBSTR(s.message(), "ckpt/config.json: field 'n_heads': must be >= 1, got 0");
  EXPECT_FALSE(std::filesystem::exists(dir));
  EXPECT_EQ(CountEntries(scratch.path()), 0u);
}

TEST(WriteCheckpointTest, RefusesToReplaceAForeignDirectory) {
  ScratchDir scratch;
  const std::string dir = scratch.Join("home");
  std::filesystem::create_directory(dir);
  testutil::WriteRawFile(dir + "/notes.txt", "precious");
  const ModelConfig config = TinyConfig();
  absl::Status s = WriteCheckpoint(dir, config, Views(RandomTensors(config, DType::kF32, 1)));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_HAS_SUBSTR(s.message(), "holds 'notes.txt', which is not a checkpoint file; refusing");
  EXPECT_EQ(testutil::ReadRawFile(dir + "/notes.txt"), "precious");
}

TEST(WriteCheckpointTest, FillsAnEmptyDirectoryAndAcceptsTrailingSlash) {
  ScratchDir scratch;
  const std::string dir = scratch.Join("ckpt");
  std::filesystem::create_directory(dir);
  const ModelConfig config = TinyConfig();
  WriteTinyCheckpoint(dir + "/", config, RandomTensors(config, DType::kF32, 1));
  EXPECT_TRUE(LoadCheckpoint(dir).ok());
  EXPECT_EQ(CountEntries(scratch.path()), 1u);
}

TEST(WriteCheckpointTest, FailsWhenTheParentDoesNotExist) {
  ScratchDir scratch;
  const ModelConfig config = TinyConfig();
  absl::Status s =
      WriteCheckpoint(scratch.Join("a/b/ckpt"), config, Views(RandomTensors(config, DType::kF32, 1)));
  EXPECT_FALSE(s.ok());
  EXPECT_HAS_SUBSTR(s.message(), "a/b/ckpt.tmp.");
}

// The fused input projection's rows, as both backends load them: k, v, q_linear, g, the mixer's gates, q_attn.
TEST(InProjLayout, RowsFollowTheMixersGates) {
  for (LinearMixer mixer : {LinearMixer::kMamba2, LinearMixer::kGdn}) {
    const ModelConfig c = testutil::TinyConfig(mixer);
    const InProjLayout l = InProjLayout::For(c);
    const int64_t HD = c.qk_dim(), G = mixer == LinearMixer::kMamba2 ? c.n_heads : 2 * c.n_heads;
    EXPECT_EQ(l.gate_width, G);
    EXPECT_EQ(std::vector<int64_t>({l.k, l.v, l.q_linear, l.g, l.gates, l.q_attn, l.width}),
              std::vector<int64_t>({0, HD, 2 * HD, 3 * HD, 4 * HD, 4 * HD + G, 5 * HD + G}));
    std::vector<std::string_view> want = {kKProj, kVProj, kQLinear, kGProj};
    if (mixer == LinearMixer::kMamba2) {
      want.push_back(kDtProj);
    } else {
      want.insert(want.end(), {kBetaProj, kAlphaProj});
    }
    want.push_back(kQAttn);
    EXPECT_EQ(l.tensors, want);
    // The stacked tensors fill exactly the width: each one's rows from the checkpoint's table.
    int64_t rows = 0;
    for (const TensorSpec& t : ExpectedTensors(c)) {
      for (std::string_view suffix : l.tensors) rows += t.name == LayerTensorName(0, suffix) ? t.shape[0] : 0;
    }
    EXPECT_EQ(rows, l.width);
  }
}

}  // namespace
}  // namespace oryx
