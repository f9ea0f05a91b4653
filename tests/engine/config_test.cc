// ModelConfig tests: a valid config.json parses and round-trips; every kind of bad field is rejected with
// an error that names the file and the field.
#include "engine/config.h"

#include <filesystem>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/testing_checkpoint.h"

namespace oryx {
namespace {

using Json = nlohmann::json;

constexpr char kSource[] = "model/config.json";

Json ValidJson() {
  return Json::parse(R"({
    "format_version": 1, "vocab_size": 32000, "d_model": 768, "n_layers": 12, "n_heads": 12,
    "head_dim": 64, "linear_mixer": "gdn", "conv_width": 4, "conv_activation": "silu",
    "mlp_hidden": 2048, "rope_theta": 10000, "norm_eps": 1e-6, "tie_embeddings": true,
    "max_position": 4096, "fragment_len": 128, "attn_fraction": 0.25,
    "bos_id": 1, "eos_id": 2, "pad_id": 0})");
}

// The error message of parsing `json`; fails the test if it parses.
std::string ErrorOf(const std::string& json) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(json, kSource);
  EXPECT_FALSE(c.ok()) << json;
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(c.status().message());
}

std::string ErrorWith(const std::string& field, const Json& value) {
  Json j = ValidJson();
  j[field] = value;
  return ErrorOf(j.dump());
}

TEST(ConfigTest, ParsesEveryField) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(ValidJson().dump(), kSource);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->format_version, 1);
  EXPECT_EQ(c->vocab_size, 32000);
  EXPECT_EQ(c->d_model, 768);
  EXPECT_EQ(c->n_layers, 12);
  EXPECT_EQ(c->n_heads, 12);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->linear_mixer, LinearMixer::kGdn);
  EXPECT_EQ(c->conv_width, 4);
  EXPECT_EQ(c->conv_activation, ConvActivation::kSilu);
  EXPECT_EQ(c->mlp_hidden, 2048);
  EXPECT_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->norm_eps, 1e-6);
  EXPECT_TRUE(c->tie_embeddings);
  EXPECT_EQ(c->max_position, 4096);
  EXPECT_EQ(c->fragment_len, 128);
  EXPECT_EQ(c->attn_fraction, 0.25);
  EXPECT_EQ(c->bos_id, 1);
  EXPECT_EQ(c->eos_id, 2);
  EXPECT_EQ(c->pad_id, 0);
  EXPECT_EQ(c->qk_dim(), 768);
}

TEST(ConfigTest, RoundTripsThroughToJson) {
  for (LinearMixer mixer : {LinearMixer::kMamba2, LinearMixer::kGdn}) {
    for (bool tie : {false, true}) {
      ModelConfig c = testutil::TinyConfig(mixer, tie);
      c.norm_eps = 1.0 / 3.0;  // needs all 17 digits to survive
      c.rope_theta = 0;
      c.head_dim = 5;
      absl::StatusOr<ModelConfig> back = ParseModelConfig(ToJson(c), kSource);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(*back, c);
    }
  }
}

TEST(ConfigTest, ToJsonWritesFieldsInSchemaOrder) {
  const std::string json = ToJson(testutil::TinyConfig());
  EXPECT_LT(json.find("\"format_version\""), json.find("\"vocab_size\""));
  EXPECT_LT(json.find("\"bos_id\""), json.find("\"pad_id\""));
  EXPECT_NE(json.find("\"linear_mixer\": \"mamba2\""), std::string::npos);
  EXPECT_EQ(json.back(), '\n');
}

TEST(ConfigTest, ErrorNamesFileAndField) {
  EXPECT_EQ(ErrorWith("n_heads", 0), "model/config.json: field 'n_heads': must be >= 1, got 0");
}

TEST(ConfigTest, RejectsTextThatIsNotJson) {
  EXPECT_HAS_SUBSTR(ErrorOf("{\"vocab_size\": 3,"), ("model/config.json: not valid JSON"));
  EXPECT_HAS_SUBSTR(ErrorOf(""), ("not valid JSON"));
  EXPECT_HAS_SUBSTR(ErrorOf("{} trailing"), ("not valid JSON"));
}

TEST(ConfigTest, RejectsNonObject) {
  EXPECT_HAS_SUBSTR(ErrorOf("[1, 2]"), ("model/config.json: must be a JSON object, got an array"));
}

TEST(ConfigTest, RejectsEachMissingField) {
  const Json valid = ValidJson();
  for (const auto& [field, unused] : valid.items()) {
    Json j = valid;
    j.erase(field);
    EXPECT_HAS_SUBSTR(ErrorOf(j.dump()), ("field '" + field + "': missing")) << field;
  }
}

// attn_log_scale_base may be absent (0, off: every checkpoint before it), is read when present, and is
// written only when set, so that older configs round-trip byte for byte.
TEST(ConfigTest, AttnLogScaleBaseIsOptional) {
  absl::StatusOr<ModelConfig> absent = ParseModelConfig(ValidJson().dump(), kSource);
  ASSERT_TRUE(absent.ok()) << absent.status();
  EXPECT_EQ(absent->attn_log_scale_base, 0);
  EXPECT_EQ(ToJson(*absent).find("attn_log_scale_base"), std::string::npos);

  Json j = ValidJson();
  j["attn_log_scale_base"] = 1024;
  absl::StatusOr<ModelConfig> set = ParseModelConfig(j.dump(), kSource);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->attn_log_scale_base, 1024);
  EXPECT_NE(ToJson(*set).find("\"attn_log_scale_base\": 1024"), std::string::npos);
  absl::StatusOr<ModelConfig> back = ParseModelConfig(ToJson(*set), kSource);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, *set);
}

// The query factor: 1 up to the base's position, then ln(p + 1) / ln(base); 1 everywhere when off.
TEST(ConfigTest, AttnQueryScaleGrowsWithLogPosition) {
  EXPECT_EQ(AttnQueryScale(0, 1 << 20), 1.0);
  EXPECT_EQ(AttnQueryScale(1024, 0), 1.0);
  EXPECT_EQ(AttnQueryScale(1024, 1022), 1.0);
  EXPECT_DOUBLE_EQ(AttnQueryScale(1024, 1023), 1.0);
  EXPECT_DOUBLE_EQ(AttnQueryScale(1024, 1024 * 1024 - 1), 2.0);
  EXPECT_DOUBLE_EQ(AttnQueryScale(4096, 16383), 14.0 / 12.0);
  EXPECT_GT(AttnQueryScale(1024, 5000), AttnQueryScale(1024, 4000));
}

TEST(ConfigTest, RejectsUnknownField) {
  Json j = ValidJson();
  j["n_kv_heads"] = 4;
  EXPECT_EQ(ErrorOf(j.dump()), "model/config.json: field 'n_kv_heads': unknown field");
}

TEST(ConfigTest, RejectsDuplicateField) {
  std::string json = ValidJson().dump();
  json.insert(1, "\"n_layers\": 99, ");
  EXPECT_HAS_SUBSTR(ErrorOf(json), ("model/config.json: duplicate key 'n_layers'"));
}

TEST(ConfigTest, IntegerFieldsRejectNonIntegers) {
  EXPECT_HAS_SUBSTR(ErrorWith("n_layers", 3.5), ("field 'n_layers': must be an integer, got 3.5"));
  EXPECT_HAS_SUBSTR(ErrorWith("n_layers", 3.0), ("field 'n_layers': must be an integer, got 3.0"));
  EXPECT_HAS_SUBSTR(ErrorWith("n_layers", "3"),
                    ("field 'n_layers': must be an integer, got the string \"3\""));
  EXPECT_HAS_SUBSTR(ErrorWith("n_layers", true), ("field 'n_layers': must be an integer, got true"));
  EXPECT_HAS_SUBSTR(ErrorWith("bos_id", nullptr), ("field 'bos_id': must be an integer, got null"));
  EXPECT_HAS_SUBSTR(ErrorWith("format_version", Json::array({1})),
                    ("field 'format_version': must be an integer, got an array"));
}

TEST(ConfigTest, OtherFieldsRejectWrongTypes) {
  EXPECT_HAS_SUBSTR(ErrorWith("rope_theta", "10000"), ("field 'rope_theta': must be a number"));
  EXPECT_HAS_SUBSTR(ErrorWith("norm_eps", false), ("field 'norm_eps': must be a number"));
  EXPECT_HAS_SUBSTR(ErrorWith("tie_embeddings", 1), ("field 'tie_embeddings': must be true or false, got 1"));
  EXPECT_HAS_SUBSTR(ErrorWith("tie_embeddings", "true"), ("field 'tie_embeddings': must be true"));
  EXPECT_HAS_SUBSTR(ErrorWith("linear_mixer", "lstm"),
                    ("field 'linear_mixer': must be \"mamba2\" or \"gdn\", got the string \"lstm\""));
  EXPECT_HAS_SUBSTR(ErrorWith("linear_mixer", 2), ("field 'linear_mixer': must be a string"));
  EXPECT_HAS_SUBSTR(ErrorWith("conv_activation", "relu"),
                    ("field 'conv_activation': must be \"identity\" or \"silu\""));
}

TEST(ConfigTest, NumberFieldsAcceptIntegerLiterals) {
  Json j = ValidJson();
  j["attn_fraction"] = 1;
  j["norm_eps"] = 1;
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump(), kSource);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->attn_fraction, 1.0);
}

TEST(ConfigTest, RejectsOutOfRangeValues) {
  struct Case {
    std::string field;
    Json value;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"format_version", 2, "field 'format_version': unsupported version 2 (this build reads 1)"},
      {"vocab_size", 0, "field 'vocab_size': must be >= 1, got 0"},
      {"vocab_size", int64_t{1} << 40, "field 'vocab_size': must be <= 16777216"},
      {"d_model", -8, "field 'd_model': must be >= 1, got -8"},
      {"d_model", 1 << 20, "field 'd_model': must be <= 65536"},
      {"n_layers", 0, "field 'n_layers': must be >= 1"},
      {"n_layers", 5000, "field 'n_layers': must be <= 1024"},
      {"head_dim", 63, "field 'head_dim': must be even when rope_theta > 0"},
      {"conv_width", 0, "field 'conv_width': must be >= 1, got 0"},
      {"conv_width", 17, "field 'conv_width': must be <= 16, got 17"},
      {"mlp_hidden", 0, "field 'mlp_hidden': must be >= 1"},
      {"rope_theta", -1, "field 'rope_theta': must be 0 (no RoPE) or in (1, "},
      {"rope_theta", 0.5, "field 'rope_theta': must be 0 (no RoPE) or in (1, "},
      {"rope_theta", 1e300, "field 'rope_theta': must be 0 (no RoPE) or in (1, "},
      {"norm_eps", 0, "field 'norm_eps': must be in (0, 1], got 0"},
      {"norm_eps", -1e-5, "field 'norm_eps': must be in (0, 1]"},
      {"max_position", 0, "field 'max_position': must be >= 1"},
      {"fragment_len", 0, "field 'fragment_len': must be >= 1"},
      {"attn_fraction", 1.5, "field 'attn_fraction': must be in [0, 1], got 1.5"},
      {"attn_fraction", -0.1, "field 'attn_fraction': must be in [0, 1]"},
      {"bos_id", 32000, "field 'bos_id': must be a token id in [0, vocab_size=32000), got 32000"},
      {"eos_id", -1, "field 'eos_id': must be a token id in [0, vocab_size=32000), got -1"},
      {"pad_id", 40000, "field 'pad_id': must be a token id"},
      {"n_heads", uint64_t{18446744073709551615u}, "field 'n_heads': integer out of range"},
      {"attn_log_scale_base", 1, "field 'attn_log_scale_base': must be 0 (off) or in [2, 1073741824], got 1"},
      {"attn_log_scale_base", -4, "field 'attn_log_scale_base': must be 0 (off) or in [2, "},
      {"attn_log_scale_base", 1.5, "field 'attn_log_scale_base': must be an integer"},
  };
  for (const Case& c : cases) {
    EXPECT_HAS_SUBSTR(ErrorWith(c.field, c.value), (std::string(kSource) + ": " + c.expected))
        << c.field << " = " << c.value.dump();
  }
}

TEST(ConfigTest, RejectsTooManyHeadChannels) {
  Json j = ValidJson();
  j["n_heads"] = 512;
  j["head_dim"] = 256;
  EXPECT_HAS_SUBSTR(ErrorOf(j.dump()),
                    "field 'head_dim': n_heads * head_dim must be <= 65536, got 512 * 256 = 131072");
}

TEST(ConfigTest, RejectsNumberOverflow) {
  std::string json = ValidJson().dump();
  const std::string key = "\"norm_eps\":";
  json.replace(json.find(key), key.size() + 5, key + "1e999");  // 1e-06 -> 1e999
  EXPECT_HAS_SUBSTR(ErrorOf(json), "model/config.json: not valid JSON");
  EXPECT_HAS_SUBSTR(ErrorOf(json), "number overflow");
}

TEST(ConfigTest, OddHeadDimIsFineWithoutRope) {
  Json j = ValidJson();
  j["rope_theta"] = 0;
  j["head_dim"] = 63;
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump(), kSource);
  EXPECT_TRUE(c.ok()) << c.status();
}

TEST(ConfigTest, LoadModelConfigReportsMissingFile) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("/nonexistent/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(std::string(c.status().message()), ("/nonexistent/config.json"));
}

TEST(ConfigTest, WriteThenLoad) {
  testutil::ScratchDir dir;
  const ModelConfig c = testutil::TinyConfig(LinearMixer::kGdn, true);
  ASSERT_TRUE(WriteModelConfig(dir.Join("config.json"), c).ok());
  absl::StatusOr<ModelConfig> back = LoadModelConfig(dir.Join("config.json"));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, c);
}

TEST(ConfigTest, WriteRejectsInvalidConfig) {
  testutil::ScratchDir dir;
  ModelConfig c = testutil::TinyConfig();
  c.norm_eps = 0;
  absl::Status s = WriteModelConfig(dir.Join("config.json"), c);
  EXPECT_HAS_SUBSTR(std::string(s.message()), ("config.json: field 'norm_eps'"));
  EXPECT_FALSE(std::filesystem::exists(dir.Join("config.json")));
}

TEST(StrictJsonTest, RejectsDuplicateKeysAtAnyDepth) {
  absl::StatusOr<Json> j = ParseJsonStrict(R"({"a": {"b": 1, "c": [{"d": 1, "d": 2}]}})", "f.json");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().message(), "f.json: duplicate key 'd'");
  // The same key in sibling objects is not a duplicate.
  EXPECT_TRUE(ParseJsonStrict(R"({"a": {"x": 1}, "b": {"x": 2}})", "f.json").ok());
}

TEST(StrictJsonTest, RejectsDeepNesting) {
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  absl::StatusOr<Json> j = ParseJsonStrict(deep, "f.json");
  ASSERT_FALSE(j.ok());
  EXPECT_HAS_SUBSTR(std::string(j.status().message()), ("nested deeper than 64"));
  EXPECT_TRUE(ParseJsonStrict(std::string(10, '[') + std::string(10, ']'), "f.json").ok());
}

}  // namespace
}  // namespace oryx
