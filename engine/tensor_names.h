// The one tensor-name table (DESIGN.md §4): for a config, every tensor a checkpoint holds, with its shape.
// The loader checks files against it and exporters write from it, so names are spelled only here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config.h"

namespace oryx {

// Names of the tensors outside the layers.
inline constexpr std::string_view kEmbedWeight = "embed.weight";           // [V, D]
inline constexpr std::string_view kFinalNormWeight = "final_norm.weight";  // [D]
inline constexpr std::string_view kLmHeadWeight = "lm_head.weight";        // [V, D], absent if tied

// Per-layer tensors: the full name is LayerTensorName(il, suffix), i.e. "layers.{il}.{suffix}".
inline constexpr std::string_view kAttnNorm = "attn_norm.weight";          // [D]
inline constexpr std::string_view kMlpNorm = "mlp_norm.weight";            // [D]
inline constexpr std::string_view kKProj = "mixer.k_proj.weight";          // [H*dh, D]
inline constexpr std::string_view kVProj = "mixer.v_proj.weight";          // [H*dh, D]
inline constexpr std::string_view kGProj = "mixer.g_proj.weight";          // [H*dh, D]
inline constexpr std::string_view kOProj = "mixer.o_proj.weight";          // [D, H*dh]
inline constexpr std::string_view kConvWeight = "mixer.conv.weight";       // [2*H*dh, w]
inline constexpr std::string_view kConvBias = "mixer.conv.bias";           // [2*H*dh]
inline constexpr std::string_view kGateNorm = "mixer.gate_norm.weight";    // [dh]
inline constexpr std::string_view kQAttn = "mixer.q_attn.weight";          // [H*dh, D]
inline constexpr std::string_view kQLinear = "mixer.q_linear.weight";      // [H*dh, D]
inline constexpr std::string_view kDtProj = "mixer.dt_proj.weight";        // [H, D]  mamba2
inline constexpr std::string_view kDtBias = "mixer.dt_bias";               // [H]     mamba2, gdn
inline constexpr std::string_view kALog = "mixer.A_log";                   // [H]     mamba2, gdn
inline constexpr std::string_view kDSkip = "mixer.D_skip";                 // [H]     mamba2
inline constexpr std::string_view kBetaProj = "mixer.beta_proj.weight";    // [H, D]  gdn
inline constexpr std::string_view kAlphaProj = "mixer.alpha_proj.weight";  // [H, D]  gdn
inline constexpr std::string_view kMlpGate = "mlp.gate.weight";            // [F, D]
inline constexpr std::string_view kMlpUp = "mlp.up.weight";                // [F, D]
inline constexpr std::string_view kMlpDown = "mlp.down.weight";            // [D, F]

// "layers.{il}.{suffix}".
std::string LayerTensorName(int64_t il, std::string_view suffix);

// The fused input projection both backends load as one [P, D] matrix: its rows (the columns of its output,
// per token) are k, v, q_linear, g [HD each], the mixer's gates (mamba2: dt [H]; gdn: beta, alpha [H each]),
// then q_attn [HD]. The kernels read the same offsets (kernels/cuda/ops_cuda.h, ModelDims::proj_width).
struct InProjLayout {
  int64_t k = 0, v = 0, q_linear = 0, g = 0, gates = 0, q_attn = 0;  // first row of each
  int64_t gate_width = 0;                                          // G
  int64_t width = 0;                                               // P = 4HD + G + HD
  std::vector<std::string_view> tensors;  // the per-layer tensors stacked in that order (LayerTensorName)
  static InProjLayout For(const ModelConfig& config);
};

// One expected tensor: its name, its shape for the config, and that shape in config terms
// (e.g. "[vocab_size, d_model]") for error messages.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string shape_doc;
};

// Every tensor of a checkpoint for `config`, in a fixed order: embed.weight; then for each layer
// attn_norm, the mixer (k, v, g, o projections, conv weight and bias, gate_norm, q_attn, q_linear, then
// the linear_mixer's supporting parameters), mlp_norm, mlp gate, up, down; then final_norm.weight and,
// unless tie_embeddings, lm_head.weight. `config` must be valid (ValidateModelConfig).
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// "[2, 3]": a shape as error messages print it.
std::string ShapeToString(const std::vector<int64_t>& shape);

}  // namespace oryx
