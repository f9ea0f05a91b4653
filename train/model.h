// The Oryx model in LibTorch (DESIGN.md §2): every token runs in attention (ATTN) or linear (LIN) mode,
// over one set of weights and one shared state. Two forwards that must agree:
//   Forward():          parallel over [B, T] with a per-token mode tensor (training, evaluation);
//   ForwardReference(): token by token with an explicit state (KV cache, recurrent state, conv window).
//
// Dimension legend: B batch, T tokens, D d_model, H heads, dh head dim, HD = H*dh, V vocab, F mlp hidden,
// w conv width, L layers.
#pragma once

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"

namespace oryx::train {

class OryxLayerImpl : public torch::nn::Module {
 public:
  explicit OryxLayerImpl(const ModelConfig& config);

  // x [B,T,D], is_attn [B,T] bool, rope cos/sin [T, dh/2] (undefined when rope_theta = 0), q_scale
  // [T, 1, 1] the attention queries' factors (AttnQueryScales; undefined when attn_log_scale_base = 0).
  // any_attn / any_lin: whether is_attn has any true / false entry (the branch not taken is skipped).
  torch::Tensor Forward(const torch::Tensor& x, const torch::Tensor& is_attn, bool any_attn, bool any_lin,
                        const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& q_scale,
                        int64_t scan_chunk);

  // The state one layer keeps for a batch of sequences (reference forward).
  struct State {
    torch::Tensor k_cache;  // [B, t, H, dh]  rotated keys of every token so far
    torch::Tensor v_cache;  // [B, t, H, dh]
    torch::Tensor s;        // [B, H, dh, dh] recurrent state, fp32
    torch::Tensor conv;     // [B, w-1, 2*HD] the last w-1 conv inputs (zeros before the start)
  };
  State InitialState(int64_t batch, torch::Device device) const;
  // One token per sequence at position `pos`: x [B,D], is_attn [B] bool. Updates `state`.
  torch::Tensor Step(const torch::Tensor& x, const torch::Tensor& is_attn, int64_t pos, State& state);

  // (checkpoint suffix, parameter), e.g. ("mixer.k_proj.weight", k_proj), in the order of ExpectedTensors.
  std::vector<std::pair<std::string, torch::Tensor>> NamedTensors();

 private:
  torch::Tensor Mix(const torch::Tensor& u, const torch::Tensor& o);  // gated norm, W_O
  torch::Tensor MixerProjection() const;  // mamba2: dt_proj [H, D]; gdn: beta_proj, alpha_proj [2H, D]
  torch::Tensor Mlp(const torch::Tensor& h);

  ModelConfig config_;
  torch::Tensor attn_norm_, mlp_norm_;             // [D]
  torch::Tensor k_proj_, v_proj_, g_proj_;         // [HD, D]
  torch::Tensor o_proj_;                           // [D, HD]
  torch::Tensor conv_weight_, conv_bias_;          // [2HD, w], [2HD]
  torch::Tensor gate_norm_;                        // [dh]
  torch::Tensor q_attn_, q_linear_;                // [HD, D]
  torch::Tensor dt_proj_, dt_bias_, a_log_, d_skip_;  // mamba2: [H, D], [H], [H], [H]
  torch::Tensor beta_proj_, alpha_proj_;           // gdn: [H, D], [H, D] (+ dt_bias_, a_log_)
  torch::Tensor mlp_gate_, mlp_up_, mlp_down_;     // [F, D], [F, D], [D, F]
};
TORCH_MODULE(OryxLayer);

class OryxModelImpl : public torch::nn::Module {
 public:
  OryxModelImpl(const ModelConfig& config, uint64_t seed);

  // tokens [B,T] int64, is_attn [B,T] bool -> logits [B,T,V] (fp32 unless autocast says otherwise).
  // Reads is_attn back to the host to learn which modes occur (one sync).
  torch::Tensor Forward(const torch::Tensor& tokens, const torch::Tensor& is_attn);
  // The same with the modes that occur given by the caller (no host sync; what a CUDA graph needs).
  // Computing a mode that does not occur changes no output, but its only parameters then get a zero
  // gradient instead of none.
  struct Modes {
    bool any_attn = true, any_lin = true;
    bool operator==(const Modes&) const = default;
  };
  torch::Tensor Forward(const torch::Tensor& tokens, const torch::Tensor& is_attn, Modes modes);

  struct State {
    std::vector<OryxLayerImpl::State> layers;
    int64_t pos = 0;
  };
  State InitialState(int64_t batch) const;
  // One token per sequence: tokens [B], is_attn [B] -> logits [B,V].
  torch::Tensor StepReference(const torch::Tensor& tokens, const torch::Tensor& is_attn, State& state);
  // Runs StepReference over [B,T] and stacks the logits: [B,T,V].
  torch::Tensor ForwardReference(const torch::Tensor& tokens, const torch::Tensor& is_attn);

  // Every tensor under its checkpoint name (engine/tensor_names.h), in ExpectedTensors order.
  std::vector<std::pair<std::string, torch::Tensor>> NamedTensors();
  // Parameters that only the linear mode uses, and those only attention uses (for gradient tests).
  std::vector<torch::Tensor> LinearOnlyParameters();
  std::vector<torch::Tensor> AttentionOnlyParameters();

  const ModelConfig& config() const { return config_; }
  int64_t scan_chunk = 64;

 private:
  torch::Tensor Logits(const torch::Tensor& x);

  ModelConfig config_;
  torch::Tensor embed_;       // [V, D]
  torch::Tensor final_norm_;  // [D]
  torch::Tensor lm_head_;     // [V, D], undefined when tied
  std::vector<OryxLayer> layers_;
  torch::Tensor rope_cos_, rope_sin_;  // Forward's RoPE tables on the device, [positions, dh/2]
  torch::Tensor q_scale_;              // Forward's query factors on the device, [positions, 1, 1]
};
TORCH_MODULE(OryxModel);

// fp32 for low-precision tensors, unchanged for fp32/fp64 (the recurrences and norms run wide).
torch::Tensor Wide(const torch::Tensor& x);
// RMSNorm over the last dimension in fp32, cast back to x's dtype: x / sqrt(mean(x^2) + eps) * weight.
torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// cos/sin [len, dh/2] of positions begin .. begin+len-1: angle = pos * theta^(-2i/dh), computed in float64
// and rounded to float32 (the engine's RoPE kernel does the same).
std::pair<torch::Tensor, torch::Tensor> RopeTables(double theta, int64_t dh, int64_t begin, int64_t len,
                                                   torch::Device device);
// The factors attention mode multiplies the queries of positions begin .. begin+len-1 by, [len, 1, 1] fp32
// (AttnQueryScale in double, rounded to float, as the engines compute them).
torch::Tensor AttnQueryScales(int64_t attn_log_scale_base, int64_t begin, int64_t len, torch::Device device);
// Half-split RoPE of x [..., T, H, dh] with cos/sin [T, dh/2].
torch::Tensor ApplyRope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

}  // namespace oryx::train
