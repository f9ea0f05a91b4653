// The tensor-name table: names and shapes of every checkpoint tensor for a config.
#include "engine/tensor_names.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace oryx {

std::string LayerTensorName(int64_t il, std::string_view suffix) {
  return absl::StrCat("layers.", il, ".", absl::string_view(suffix.data(), suffix.size()));
}

std::string ShapeToString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config) {
  const int64_t V = config.vocab_size, D = config.d_model, H = config.n_heads, dh = config.head_dim;
  const int64_t HD = config.qk_dim(), F = config.mlp_hidden, w = config.conv_width;
  std::vector<TensorSpec> specs;
  specs.push_back({std::string(kEmbedWeight), {V, D}, "[vocab_size, d_model]"});
  for (int64_t il = 0; il < config.n_layers; ++il) {
    auto add = [&](std::string_view suffix, std::vector<int64_t> shape, std::string_view doc) {
      specs.push_back({LayerTensorName(il, suffix), std::move(shape), std::string(doc)});
    };
    add(kAttnNorm, {D}, "[d_model]");
    add(kKProj, {HD, D}, "[n_heads*head_dim, d_model]");
    add(kVProj, {HD, D}, "[n_heads*head_dim, d_model]");
    add(kGProj, {HD, D}, "[n_heads*head_dim, d_model]");
    add(kOProj, {D, HD}, "[d_model, n_heads*head_dim]");
    add(kConvWeight, {2 * HD, w}, "[2*n_heads*head_dim, conv_width]");
    add(kConvBias, {2 * HD}, "[2*n_heads*head_dim]");
    add(kGateNorm, {dh}, "[head_dim]");
    add(kQAttn, {HD, D}, "[n_heads*head_dim, d_model]");
    add(kQLinear, {HD, D}, "[n_heads*head_dim, d_model]");
    switch (config.linear_mixer) {
      case LinearMixer::kMamba2:
        add(kDtProj, {H, D}, "[n_heads, d_model]");
        add(kDtBias, {H}, "[n_heads]");
        add(kALog, {H}, "[n_heads]");
        add(kDSkip, {H}, "[n_heads]");
        break;
      case LinearMixer::kGdn:
        add(kBetaProj, {H, D}, "[n_heads, d_model]");
        add(kAlphaProj, {H, D}, "[n_heads, d_model]");
        add(kDtBias, {H}, "[n_heads]");
        add(kALog, {H}, "[n_heads]");
        break;
    }
    add(kMlpNorm, {D}, "[d_model]");
    add(kMlpGate, {F, D}, "[mlp_hidden, d_model]");
    add(kMlpUp, {F, D}, "[mlp_hidden, d_model]");
    add(kMlpDown, {D, F}, "[d_model, mlp_hidden]");
  }
  specs.push_back({std::string(kFinalNormWeight), {D}, "[d_model]"});
  if (!config.tie_embeddings) {
    specs.push_back({std::string(kLmHeadWeight), {V, D}, "[vocab_size, d_model]"});
  }
  return specs;
}

InProjLayout InProjLayout::For(const ModelConfig& c) {
  const int64_t H = c.n_heads, HD = c.qk_dim();
  InProjLayout l;
  l.gate_width = c.linear_mixer == LinearMixer::kMamba2 ? H : 2 * H;
  l.v = HD, l.q_linear = 2 * HD, l.g = 3 * HD, l.gates = 4 * HD, l.q_attn = 4 * HD + l.gate_width;
  l.width = l.q_attn + HD;
  l.tensors = {kKProj, kVProj, kQLinear, kGProj};
  if (c.linear_mixer == LinearMixer::kMamba2) {
    l.tensors.push_back(kDtProj);
  } else {
    l.tensors.push_back(kBetaProj);
    l.tensors.push_back(kAlphaProj);
  }
  l.tensors.push_back(kQAttn);
  return l;
}

}  // namespace oryx
