// config.json parsing, validation and serialisation, driven by one field table in schema order.
#include "engine/config.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "base/str_cat.h"

namespace oryx {

namespace {

using Json = nlohmann::json;

// One config.json field: its name and where it lives in ModelConfig. The variant alternative says the JSON
// type: int64_t = integer literal, double = any number, bool, or one of the two string enums.
using FieldMember = std::variant<int64_t ModelConfig::*, double ModelConfig::*, bool ModelConfig::*,
                                 LinearMixer ModelConfig::*, ConvActivation ModelConfig::*>;
struct Field {
  std::string_view name;
  FieldMember member;
  bool optional = false;  // may be absent (then ModelConfig's default); written only when not the default
};

const std::vector<Field>& Fields() {
  static const std::vector<Field> kFields = {
      {"format_version", &ModelConfig::format_version},
      {"vocab_size", &ModelConfig::vocab_size},
      {"d_model", &ModelConfig::d_model},
      {"n_layers", &ModelConfig::n_layers},
      {"n_heads", &ModelConfig::n_heads},
      {"head_dim", &ModelConfig::head_dim},
      {"linear_mixer", &ModelConfig::linear_mixer},
      {"conv_width", &ModelConfig::conv_width},
      {"conv_activation", &ModelConfig::conv_activation},
      {"mlp_hidden", &ModelConfig::mlp_hidden},
      {"rope_theta", &ModelConfig::rope_theta},
      {"norm_eps", &ModelConfig::norm_eps},
      {"tie_embeddings", &ModelConfig::tie_embeddings},
      {"max_position", &ModelConfig::max_position},
      {"fragment_len", &ModelConfig::fragment_len},
      {"attn_fraction", &ModelConfig::attn_fraction},
      {"bos_id", &ModelConfig::bos_id},
      {"eos_id", &ModelConfig::eos_id},
      {"pad_id", &ModelConfig::pad_id},
      {"attn_log_scale_base", &ModelConfig::attn_log_scale_base, /*optional=*/true},
  };
  return kFields;
}

absl::Status FieldError(std::string_view source, std::string_view field, std::string_view problem) {
  return absl::InvalidArgumentError(Cat(source, ": field '", field, "': ", problem));
}

absl::StatusOr<int64_t> ReadInt(const Json& value) {
  if (value.is_number_integer() && !value.is_number_unsigned()) return value.get<int64_t>();
  if (value.is_number_unsigned()) {
    uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX))
      return absl::InvalidArgumentError(Cat("integer out of range, got ", u));
    return static_cast<int64_t>(u);
  }
  return absl::InvalidArgumentError(Cat("must be an integer, got ", DescribeJson(value)));
}

absl::StatusOr<double> ReadNumber(const Json& value) {
  if (!value.is_number()) {
    return absl::InvalidArgumentError(Cat("must be a number, got ", DescribeJson(value)));
  }
  double d = value.get<double>();
  if (!std::isfinite(d)) return absl::InvalidArgumentError("must be a finite number");
  return d;
}

absl::StatusOr<std::string> ReadString(const Json& value) {
  if (!value.is_string()) {
    return absl::InvalidArgumentError(Cat("must be a string, got ", DescribeJson(value)));
  }
  return value.get<std::string>();
}

absl::StatusOr<LinearMixer> ReadMixer(const Json& value) {
  ORYX_ASSIGN_OR_RETURN(std::string s, ReadString(value));
  if (s == "mamba2") return LinearMixer::kMamba2;
  if (s == "gdn") return LinearMixer::kGdn;
  return absl::InvalidArgumentError(Cat("must be \"mamba2\" or \"gdn\", got ", DescribeJson(value)));
}

absl::StatusOr<ConvActivation> ReadActivation(const Json& value) {
  ORYX_ASSIGN_OR_RETURN(std::string s, ReadString(value));
  if (s == "identity") return ConvActivation::kIdentity;
  if (s == "silu") return ConvActivation::kSilu;
  return absl::InvalidArgumentError(Cat("must be \"identity\" or \"silu\", got ", DescribeJson(value)));
}

// Reads one field's JSON value into `config`; one call operator per field type.
struct FieldReader {
  const Json& value;
  ModelConfig& config;

  absl::Status operator()(int64_t ModelConfig::*m) { return Set(m, ReadInt(value)); }
  absl::Status operator()(double ModelConfig::*m) { return Set(m, ReadNumber(value)); }
  absl::Status operator()(bool ModelConfig::*m) {
    if (!value.is_boolean()) {
      return absl::InvalidArgumentError(Cat("must be true or false, got ", DescribeJson(value)));
    }
    config.*m = value.get<bool>();
    return absl::OkStatus();
  }
  absl::Status operator()(LinearMixer ModelConfig::*m) { return Set(m, ReadMixer(value)); }
  absl::Status operator()(ConvActivation ModelConfig::*m) { return Set(m, ReadActivation(value)); }

  template <typename T>
  absl::Status Set(T ModelConfig::*m, absl::StatusOr<T> v) {
    if (!v.ok()) return v.status();
    config.*m = *v;
    return absl::OkStatus();
  }
};

// Range checks, one per field or rule; the first failure is reported.
absl::Status CheckRange(std::string_view source, std::string_view field, int64_t value, int64_t lo,
                        int64_t hi) {
  if (value < lo) return FieldError(source, field, Cat("must be >= ", lo, ", got ", value));
  if (value > hi) return FieldError(source, field, Cat("must be <= ", hi, ", got ", value));
  return absl::OkStatus();
}

absl::Status CheckTokenId(std::string_view source, std::string_view field, int64_t id, int64_t vocab_size) {
  if (id < 0 || id >= vocab_size) {
    return FieldError(source, field, Cat("must be a token id in [0, vocab_size=", vocab_size, "), got ", id));
  }
  return absl::OkStatus();
}

std::string FormatDouble(double d) { return absl::StrFormat("%.17g", d); }

}  // namespace

std::string_view LinearMixerName(LinearMixer mixer) { return mixer == LinearMixer::kGdn ? "gdn" : "mamba2"; }

std::string_view ConvActivationName(ConvActivation activation) {
  return activation == ConvActivation::kSilu ? "silu" : "identity";
}

std::string DescribeJson(const Json& value) {
  switch (value.type()) {
    case Json::value_t::object:
      return "an object";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::string: {
      std::string s = value.get<std::string>();
      if (s.size() > 40) s = Cat(s.substr(0, 40), "...");
      return Cat("the string \"", s, "\"");
    }
    case Json::value_t::discarded:
      return "a discarded value";
    default:
      return value.dump();  // null, boolean, number: short by construction
  }
}

absl::StatusOr<Json> ParseJsonStrict(std::string_view text, std::string_view source_name) {
  // One set of seen keys per open object; the callback sees keys in document order.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate_key;
  bool too_deep = false;
  auto callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        open_objects.emplace_back();
        [[fallthrough]];
      case Json::parse_event_t::array_start:
        if (depth >= kMaxJsonDepth) too_deep = true;
        break;
      case Json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!open_objects.empty() && parsed.is_string() &&
            !open_objects.back().insert(parsed.get<std::string>()).second && duplicate_key.empty()) {
          duplicate_key = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    // Deep values are dropped rather than built; the error below reports them.
    return !too_deep;
  };
  Json json;
  try {
    json = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true);
  } catch (const Json::exception& e) {
    std::string what = e.what();
    if (what.size() > 200) what = Cat(what.substr(0, 200), "...");
    return absl::InvalidArgumentError(Cat(source_name, ": not valid JSON: ", what));
  }
  if (too_deep) {
    return absl::InvalidArgumentError(
        Cat(source_name, ": JSON nested deeper than ", kMaxJsonDepth, " levels"));
  }
  if (!duplicate_key.empty()) {
    if (duplicate_key.size() > 80) duplicate_key = Cat(duplicate_key.substr(0, 80), "...");
    return absl::InvalidArgumentError(Cat(source_name, ": duplicate key '", duplicate_key, "'"));
  }
  return json;
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view source_name) {
  ORYX_ASSIGN_OR_RETURN(Json json, ParseJsonStrict(json_text, source_name));
  if (!json.is_object()) {
    return absl::InvalidArgumentError(Cat(source_name, ": must be a JSON object, got ", DescribeJson(json)));
  }
  ModelConfig config;
  for (const Field& field : Fields()) {
    auto it = json.find(std::string(field.name));
    if (it == json.end()) {
      if (field.optional) continue;
      return FieldError(source_name, field.name, "missing (a required field)");
    }
    if (absl::Status s = std::visit(FieldReader{*it, config}, field.member); !s.ok()) {
      return FieldError(source_name, field.name, std::string(s.message()));
    }
  }
  for (const auto& [key, value] : json.items()) {
    bool known = false;
    for (const Field& field : Fields()) known = known || field.name == key;
    if (!known) return FieldError(source_name, key, "unknown field");
  }
  ORYX_RETURN_IF_ERROR(ValidateModelConfig(config, source_name));
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  ORYX_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseModelConfig(text, path);
}

absl::Status ValidateModelConfig(const ModelConfig& c, std::string_view src) {
  if (c.format_version != kModelConfigFormatVersion) {
    return FieldError(
        src, "format_version",
        Cat("unsupported version ", c.format_version, " (this build reads ", kModelConfigFormatVersion, ")"));
  }
  ORYX_RETURN_IF_ERROR(CheckRange(src, "vocab_size", c.vocab_size, 1, kMaxVocabSize));
  ORYX_RETURN_IF_ERROR(CheckRange(src, "d_model", c.d_model, 1, kMaxDModel));
  ORYX_RETURN_IF_ERROR(CheckRange(src, "n_layers", c.n_layers, 1, kMaxLayers));
  ORYX_RETURN_IF_ERROR(CheckRange(src, "n_heads", c.n_heads, 1, kMaxHeads));
  ORYX_RETURN_IF_ERROR(CheckRange(src, "head_dim", c.head_dim, 1, kMaxHeadDim));
  if (c.qk_dim() > kMaxQkDim) {
    return FieldError(src, "head_dim",
                      Cat("n_heads * head_dim must be <= ", kMaxQkDim, ", got ", c.n_heads, " * ", c.head_dim,
                          " = ", c.qk_dim()));
  }
  ORYX_RETURN_IF_ERROR(CheckRange(src, "conv_width", c.conv_width, 1, kMaxConvWidth));
  ORYX_RETURN_IF_ERROR(CheckRange(src, "mlp_hidden", c.mlp_hidden, 1, kMaxMlpHidden));
  if (!std::isfinite(c.rope_theta) || c.rope_theta < 0 || (c.rope_theta > 0 && c.rope_theta <= 1) ||
      c.rope_theta > kMaxRopeTheta) {
    return FieldError(src, "rope_theta",
                      Cat("must be 0 (no RoPE) or in (1, ", FormatDouble(kMaxRopeTheta), "], got ",
                          FormatDouble(c.rope_theta)));
  }
  if (c.rope_theta > 0 && c.head_dim % 2 != 0) {
    return FieldError(src, "head_dim",
                      Cat("must be even when rope_theta > 0 (RoPE rotates pairs), got ", c.head_dim));
  }
  if (!(c.norm_eps > 0 && c.norm_eps <= 1)) {
    return FieldError(src, "norm_eps", Cat("must be in (0, 1], got ", FormatDouble(c.norm_eps)));
  }
  ORYX_RETURN_IF_ERROR(CheckRange(src, "max_position", c.max_position, 1, kMaxPosition));
  ORYX_RETURN_IF_ERROR(CheckRange(src, "fragment_len", c.fragment_len, 1, kMaxPosition));
  if (!(c.attn_fraction >= 0 && c.attn_fraction <= 1)) {
    return FieldError(src, "attn_fraction", Cat("must be in [0, 1], got ", FormatDouble(c.attn_fraction)));
  }
  ORYX_RETURN_IF_ERROR(CheckTokenId(src, "bos_id", c.bos_id, c.vocab_size));
  ORYX_RETURN_IF_ERROR(CheckTokenId(src, "eos_id", c.eos_id, c.vocab_size));
  ORYX_RETURN_IF_ERROR(CheckTokenId(src, "pad_id", c.pad_id, c.vocab_size));
  if (c.attn_log_scale_base != 0 && (c.attn_log_scale_base < 2 || c.attn_log_scale_base > kMaxPosition)) {
    return FieldError(src, "attn_log_scale_base",
                      Cat("must be 0 (off) or in [2, ", kMaxPosition, "], got ", c.attn_log_scale_base));
  }
  return absl::OkStatus();
}

double AttnQueryScale(int64_t attn_log_scale_base, int64_t position) {
  if (attn_log_scale_base <= 0) return 1.0;
  return std::max(1.0,
                  std::log(static_cast<double>(position) + 1.0) / std::log(static_cast<double>(attn_log_scale_base)));
}

ModelConfig WithStageFieldsOf(ModelConfig config, const ModelConfig& run) {
  config.fragment_len = run.fragment_len;
  config.attn_fraction = run.attn_fraction;
  config.rope_theta = run.rope_theta;
  config.max_position = run.max_position;
  config.attn_log_scale_base = run.attn_log_scale_base;
  return config;
}

bool SameArchitecture(const ModelConfig& a, const ModelConfig& b) { return a == WithStageFieldsOf(b, a); }

std::string ToJson(const ModelConfig& config) {
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  static const ModelConfig kDefaults;
  for (const Field& field : Fields()) {
    if (field.optional && std::visit([&](auto member) { return config.*member == kDefaults.*member; }, field.member)) {
      continue;  // an optional field at its default is left out, so that older configs round-trip unchanged
    }
    std::string key(field.name);
    std::visit(
        [&](auto member) {
          using T = std::remove_cvref_t<decltype(config.*member)>;
          if constexpr (std::is_same_v<T, LinearMixer>) {
            json[key] = LinearMixerName(config.*member);
          } else if constexpr (std::is_same_v<T, ConvActivation>) {
            json[key] = ConvActivationName(config.*member);
          } else {
            json[key] = config.*member;
          }
        },
        field.member);
  }
  return json.dump(2) + "\n";
}

absl::Status WriteModelConfig(const std::string& path, const ModelConfig& config) {
  ORYX_RETURN_IF_ERROR(ValidateModelConfig(config, path));
  return WriteFileAtomic(path, ToJson(config));
}

}  // namespace oryx
