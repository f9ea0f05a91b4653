// ModelConfig: the model hyper-parameters stored as config.json beside the weights (DESIGN.md §2), with a
// strict parser, a validator and a serialiser. Also the strict JSON parsing shared by every checkpoint file.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace oryx {

// The only config.json format version this build reads and writes.
inline constexpr int kModelConfigFormatVersion = 1;

enum class LinearMixer { kMamba2, kGdn };
enum class ConvActivation { kIdentity, kSilu };

// "mamba2" / "gdn" and "identity" / "silu": the spellings used in config.json.
std::string_view LinearMixerName(LinearMixer mixer);
std::string_view ConvActivationName(ConvActivation activation);

// Upper bounds enforced by ValidateModelConfig. They are far above any model we run and keep every product
// of sizes that later code forms (V*D, L*F*D, max_position*L*H*dh, bytes of any tensor) inside int64.
inline constexpr int64_t kMaxVocabSize = int64_t{1} << 24;
inline constexpr int64_t kMaxDModel = int64_t{1} << 16;
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxHeads = 1024;
inline constexpr int64_t kMaxHeadDim = 256;  // = kernels::kMaxHeadDim (per-head temporaries on the stack)
inline constexpr int64_t kMaxQkDim = int64_t{1} << 16;  // n_heads * head_dim
inline constexpr int64_t kMaxConvWidth = 16;
inline constexpr int64_t kMaxMlpHidden = int64_t{1} << 18;
inline constexpr int64_t kMaxPosition = int64_t{1} << 30;
inline constexpr double kMaxRopeTheta = 1e12;

// The factor attention mode multiplies the query at `position` by (ModelConfig::attn_log_scale_base; 1 when
// it is 0). In double, as every backend computes it.
double AttnQueryScale(int64_t attn_log_scale_base, int64_t position);

// Every field of config.json, in schema order. All are required in the file but attn_log_scale_base, which
// may be absent (0); the defaults here only make a default-constructed value well defined (it is not a
// valid config until the sizes are filled in).
struct ModelConfig {
  int64_t format_version = kModelConfigFormatVersion;
  int64_t vocab_size = 0;  // V
  int64_t d_model = 0;     // D
  int64_t n_layers = 0;    // L
  int64_t n_heads = 0;     // H
  int64_t head_dim = 0;    // dh (n_heads * head_dim need not equal d_model)
  LinearMixer linear_mixer = LinearMixer::kMamba2;
  int64_t conv_width = 4;  // w
  ConvActivation conv_activation = ConvActivation::kIdentity;
  int64_t mlp_hidden = 0;  // F
  double rope_theta = 0;   // 0 = no RoPE
  double norm_eps = 1e-6;
  bool tie_embeddings = false;
  int64_t max_position = 0;     // longest context the model supports
  int64_t fragment_len = 128;   // training fragment length (informational)
  double attn_fraction = 0.25;  // training share of attention fragments (informational)
  int64_t bos_id = 0;
  int64_t eos_id = 0;
  int64_t pad_id = 0;
  // Optional. Attention mode multiplies the query of the token at position p (0-based) by
  // max(1, ln(p + 1) / ln(attn_log_scale_base)): its logits sharpen as the keys grow in number past the
  // base, so that a match far back is not diluted by them (scalable softmax). 0: off.
  int64_t attn_log_scale_base = 0;

  int64_t qk_dim() const { return n_heads * head_dim; }  // H*dh: width of q, k, v, g

  bool operator==(const ModelConfig& other) const = default;
};

// `config` with the fields a later training stage may change taken from `run`: the two that record how a
// model was trained (fragment_len, attn_fraction) and the three of its positions (rope_theta,
// max_position, attn_log_scale_base: a stage may raise RoPE's base or the context, as long-context
// continued training does, or sharpen far attention). None changes a weight's shape.
ModelConfig WithStageFieldsOf(ModelConfig config, const ModelConfig& run);

// Whether weights of one config load into a model of the other: every field agrees but those.
bool SameArchitecture(const ModelConfig& a, const ModelConfig& b);

// Parses config.json text. Rejects: non-JSON, duplicate or unknown keys, a missing field, a value of the
// wrong JSON type (integer fields accept only integer literals: not 3.5, 3.0, "3" or true), and anything
// ValidateModelConfig rejects. Errors are InvalidArgument and read
// "<source_name>: field '<name>': <problem>", e.g. "model/config.json: field 'n_heads': must be >= 1, got 0".
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json, std::string_view source_name);

// Reads and parses the file at `path` (NotFound if it cannot be read); errors name `path`.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// Checks ranges and cross-field rules: positive sizes under the kMax* bounds, head_dim even when
// rope_theta > 0, norm_eps in (0, 1], attn_fraction in [0, 1], token ids in [0, vocab_size), ...
absl::Status ValidateModelConfig(const ModelConfig& config, std::string_view source_name);

// config.json text, fields in schema order, pretty-printed, ending in a newline. Round-trips through
// ParseModelConfig for any valid config.
std::string ToJson(const ModelConfig& config);

// Validates `config`, then writes ToJson(config) to `path` atomically.
absl::Status WriteModelConfig(const std::string& path, const ModelConfig& config);

// Strict JSON parsing for untrusted files: like nlohmann::json::parse but a duplicate key in any object
// (which nlohmann would silently resolve) is an error, and so is nesting deeper than kMaxJsonDepth.
// Errors are InvalidArgument naming `source_name`. Never throws.
inline constexpr int kMaxJsonDepth = 64;
absl::StatusOr<nlohmann::json> ParseJsonStrict(std::string_view text, std::string_view source_name);

// A short description of a JSON value for error messages: scalars verbatim (long strings cut), arrays and
// objects by kind only, so that a hostile file cannot make an error message huge.
std::string DescribeJson(const nlohmann::json& value);

}  // namespace oryx
