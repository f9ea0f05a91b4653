// CPU forward of the Oryx model: every token updates the KV cache and the recurrent state; each token's
// output comes from its own mode. Single sequence, fp32, kernels from kernels/cpu.
#include "engine/model.h"

#include <cmath>

#include "engine/checkpoint.h"
#include "engine/status_macros.h"
#include "engine/str_cat.h"
#include "engine/tensor_names.h"
#include "kernels/ops.h"

namespace oryx {

namespace k = kernels;

namespace {

// y[M, N] = x[M, K] W^T, all rows contiguous unless strides say otherwise.
void Linear(const float* x, int64_t m, int64_t kdim, const std::vector<float>& w, int64_t n, float* y,
            int64_t x_stride = -1, int64_t y_stride = -1) {
  k::cpu::MatMul({m, n, kdim, x_stride < 0 ? kdim : x_stride, kdim, y_stride < 0 ? n : y_stride, x, w.data(), y});
}

void Norm(const float* x, int64_t rows, int64_t d, const std::vector<float>& weight, float eps, float* y) {
  k::cpu::RmsNorm({rows, d, eps, d, d, x, weight.data(), y});
}

// torch's softplus (threshold 20: linear above it).
float Softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
float Sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

}  // namespace

SequenceState SequenceState::Clone() const {
  SequenceState copy;
  copy.layers_ = layers_;
  copy.position_ = position_;
  return copy;
}

absl::StatusOr<Model> Model::Load(const std::string& dir) {
  ORYX_ASSIGN_OR_RETURN(Checkpoint ckpt, LoadCheckpoint(dir));
  Model model;
  model.config_ = ckpt.config();
  const ModelConfig& c = model.config_;
  auto get = [&](std::string_view name, std::vector<float>& out) -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(out, ckpt.TensorAsFloats(name));
    return absl::OkStatus();
  };
  ORYX_RETURN_IF_ERROR(get(kEmbedWeight, model.embed_));
  ORYX_RETURN_IF_ERROR(get(kFinalNormWeight, model.final_norm_));
  if (!c.tie_embeddings) ORYX_RETURN_IF_ERROR(get(kLmHeadWeight, model.lm_head_));
  model.layers_.resize(c.n_layers);
  for (int64_t il = 0; il < c.n_layers; ++il) {
    Layer& l = model.layers_[il];
    auto layer = [&](std::string_view suffix, std::vector<float>& out) { return get(LayerTensorName(il, suffix), out); };
    for (auto [suffix, field] : {std::pair{kAttnNorm, &l.attn_norm}, {kMlpNorm, &l.mlp_norm}, {kKProj, &l.k_proj},
                                 {kVProj, &l.v_proj}, {kGProj, &l.g_proj}, {kOProj, &l.o_proj},
                                 {kConvWeight, &l.conv_weight}, {kConvBias, &l.conv_bias}, {kGateNorm, &l.gate_norm},
                                 {kQAttn, &l.q_attn}, {kQLinear, &l.q_linear}, {kDtBias, &l.dt_bias}, {kALog, &l.a_log},
                                 {kMlpGate, &l.mlp_gate}, {kMlpUp, &l.mlp_up}, {kMlpDown, &l.mlp_down}}) {
      ORYX_RETURN_IF_ERROR(layer(suffix, *field));
    }
    if (c.linear_mixer == LinearMixer::kMamba2) {
      ORYX_RETURN_IF_ERROR(layer(kDtProj, l.dt_proj));
      ORYX_RETURN_IF_ERROR(layer(kDSkip, l.d_skip));
    } else {
      ORYX_RETURN_IF_ERROR(layer(kBetaProj, l.beta_proj));
      ORYX_RETURN_IF_ERROR(layer(kAlphaProj, l.alpha_proj));
    }
  }
  return model;
}

SequenceState Model::NewSequence() const {
  const ModelConfig& c = config_;
  SequenceState seq;
  seq.layers_.resize(c.n_layers);
  for (SequenceState::Layer& l : seq.layers_) {
    l.s.assign(c.n_heads * c.head_dim * c.head_dim, 0.f);
    l.conv.assign((c.conv_width - 1) * 2 * c.qk_dim(), 0.f);
  }
  return seq;
}

void Model::LayerForward(const Layer& w, SequenceState::Layer& st, int64_t pos, std::span<const Mode> modes,
                         std::vector<float>& x) const {
  const ModelConfig& c = config_;
  const int64_t T = static_cast<int64_t>(modes.size()), D = c.d_model, H = c.n_heads, dh = c.head_dim;
  const int64_t HD = c.qk_dim(), F = c.mlp_hidden;
  const float eps = static_cast<float>(c.norm_eps);
  std::vector<float> u(T * D), kv_raw(T * 2 * HD), kv(T * 2 * HD), g(T * HD);
  Norm(x.data(), T, D, w.attn_norm, eps, u.data());
  // Shared k, v (one [T, 2HD] buffer, k then v) through the causal conv; shared gate.
  Linear(u.data(), T, D, w.k_proj, HD, kv_raw.data(), D, 2 * HD);
  Linear(u.data(), T, D, w.v_proj, HD, kv_raw.data() + HD, D, 2 * HD);
  k::cpu::CausalConv({T, 2 * HD, c.conv_width, c.conv_activation == ConvActivation::kSilu, 2 * HD, 2 * HD,
                      w.conv_weight.data(), w.conv_bias.data(), st.conv.data(), kv_raw.data(), kv.data()});
  Linear(u.data(), T, D, w.g_proj, HD, g.data());
  const float* k_ptr = kv.data();
  const float* v_ptr = kv.data() + HD;

  // Every token, whatever its mode: rotated keys and values into the cache, and the recurrent update.
  const int64_t old = static_cast<int64_t>(st.k.size()) / HD;
  st.k.resize((old + T) * HD);
  st.v.resize((old + T) * HD);
  for (int64_t t = 0; t < T; ++t) {
    std::copy(k_ptr + t * 2 * HD, k_ptr + t * 2 * HD + HD, st.k.begin() + (old + t) * HD);
    std::copy(v_ptr + t * 2 * HD, v_ptr + t * 2 * HD + HD, st.v.begin() + (old + t) * HD);
  }
  if (c.rope_theta > 0) k::cpu::Rope({T, H, dh, pos, c.rope_theta, HD, st.k.data() + old * HD});

  // The recurrent kernels read q, k, v with one token stride: lay them out as [T, 3*HD] = (q, k, v).
  std::vector<float> qkv(T * 3 * HD), o_lin(T * HD), gate_h(T * H), decay_h(T * H);
  Linear(u.data(), T, D, w.q_linear, HD, qkv.data(), D, 3 * HD);
  for (int64_t t = 0; t < T; ++t) {
    std::copy(&kv[t * 2 * HD], &kv[(t + 1) * 2 * HD], &qkv[t * 3 * HD + HD]);
  }
  const float *q_lin = qkv.data(), *k_lin = qkv.data() + HD, *v_lin = qkv.data() + 2 * HD;
  if (c.linear_mixer == LinearMixer::kMamba2) {
    Linear(u.data(), T, D, w.dt_proj, H, gate_h.data());  // dt before softplus
    for (int64_t i = 0; i < T * H; ++i) {
      gate_h[i] = Softplus(gate_h[i] + w.dt_bias[i % H]);
      decay_h[i] = -gate_h[i] * std::exp(w.a_log[i % H]);
    }
    k::cpu::Mamba2({T, H, dh, 3 * HD, HD, gate_h.data(), decay_h.data(), w.d_skip.data(), q_lin, k_lin, v_lin,
                    st.s.data(), nullptr, o_lin.data()});
  } else {
    Linear(u.data(), T, D, w.beta_proj, H, gate_h.data());
    Linear(u.data(), T, D, w.alpha_proj, H, decay_h.data());
    for (int64_t i = 0; i < T * H; ++i) {
      gate_h[i] = Sigmoid(gate_h[i]);
      decay_h[i] = -std::exp(w.a_log[i % H]) * Softplus(decay_h[i] + w.dt_bias[i % H]);
    }
    k::cpu::Gdn({T, H, dh, 3 * HD, HD, gate_h.data(), decay_h.data(), q_lin, k_lin, v_lin, st.s.data(), nullptr,
                 o_lin.data()});
  }
  // Attention-mode outputs (the queries of the whole span; each token then takes its own mode's output).
  std::vector<float>& o = o_lin;
  bool any_attention = false;
  for (Mode m : modes) any_attention |= m == Mode::kAttention;
  if (any_attention) {
    std::vector<float> qa(T * HD), o_attn(T * HD);
    Linear(u.data(), T, D, w.q_attn, HD, qa.data());
    if (c.rope_theta > 0) k::cpu::Rope({T, H, dh, pos, c.rope_theta, HD, qa.data()});
    k::cpu::Attention({T, old + T, H, dh, HD, HD, HD, qa.data(), st.k.data(), st.v.data(), o_attn.data()});
    for (int64_t t = 0; t < T; ++t) {
      if (modes[t] == Mode::kAttention) std::copy(&o_attn[t * HD], &o_attn[(t + 1) * HD], &o[t * HD]);
    }
  }
  // Shared gated norm, output projection, residual; shared SwiGLU MLP, residual.
  std::vector<float> y(T * HD), proj(T * D), z(T * D), a(T * F), b(T * F);
  k::cpu::GatedRmsNorm({T, H, dh, eps, HD, HD, HD, o.data(), g.data(), w.gate_norm.data(), y.data()});
  Linear(y.data(), T, HD, w.o_proj, D, proj.data());
  for (int64_t i = 0; i < T * D; ++i) x[i] += proj[i];
  Norm(x.data(), T, D, w.mlp_norm, eps, z.data());
  Linear(z.data(), T, D, w.mlp_gate, F, a.data());
  Linear(z.data(), T, D, w.mlp_up, F, b.data());
  k::cpu::SwiGlu({T, F, F, F, F, a.data(), b.data(), a.data()});
  Linear(a.data(), T, F, w.mlp_down, D, proj.data());
  for (int64_t i = 0; i < T * D; ++i) x[i] += proj[i];
}

absl::Status Model::Forward(SequenceState& seq, std::span<const int32_t> tokens, std::span<const Mode> modes,
                            bool all_logits, std::vector<float>* logits) const {
  const ModelConfig& c = config_;
  const int64_t T = static_cast<int64_t>(tokens.size()), D = c.d_model, V = c.vocab_size;
  if (T == 0) return absl::InvalidArgumentError("forward: empty span of tokens");
  if (modes.size() != tokens.size()) {
    return absl::InvalidArgumentError(Cat("forward: ", tokens.size(), " tokens but ", modes.size(), " modes"));
  }
  if (seq.position_ + T > c.max_position) {
    return absl::InvalidArgumentError(Cat("forward: positions ", seq.position_, "..", seq.position_ + T - 1,
                                          " exceed the model's max_position ", c.max_position));
  }
  std::vector<float> x(T * D);
  for (int64_t t = 0; t < T; ++t) {
    if (tokens[t] < 0 || tokens[t] >= V) {
      return absl::InvalidArgumentError(Cat("forward: token id ", tokens[t], " outside the vocabulary [0, ", V, ")"));
    }
    std::copy(&embed_[tokens[t] * D], &embed_[(tokens[t] + 1) * D], &x[t * D]);
  }
  for (int64_t il = 0; il < c.n_layers; ++il) LayerForward(layers_[il], seq.layers_[il], seq.position_, modes, x);
  seq.position_ += T;
  // Final norm and LM head over the rows asked for.
  const int64_t rows = all_logits ? T : 1;
  const float* last = x.data() + (T - rows) * D;
  std::vector<float> h(rows * D);
  Norm(last, rows, D, final_norm_, static_cast<float>(c.norm_eps), h.data());
  logits->resize(rows * V);
  Linear(h.data(), rows, D, c.tie_embeddings ? embed_ : lm_head_, V, logits->data());
  return absl::OkStatus();
}

}  // namespace oryx
