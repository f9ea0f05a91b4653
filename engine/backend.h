// The Oryx model on the CPU (DESIGN.md §2): a forward over a span of tokens of one sequence, with a mode
// per token, that keeps the KV cache, the recurrent state and the conv window current for every token, so
// the mode can switch at any token. Built on kernels/cpu; no Eigen or LibTorch in this header.
//
// Dimension legend: T tokens in the span, D d_model, H heads, dh head dim, HD = H*dh, F mlp hidden,
// V vocab, w conv width, L layers.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"

namespace oryx {

enum class Mode : uint8_t { kLinear = 0, kAttention = 1 };

// Everything one sequence carries between forwards. Move-only; Clone() is the one deep copy.
class SequenceState {
 public:
  SequenceState(SequenceState&&) = default;
  SequenceState& operator=(SequenceState&&) = default;
  SequenceState(const SequenceState&) = delete;
  SequenceState& operator=(const SequenceState&) = delete;

  int64_t position() const { return position_; }  // tokens processed so far
  SequenceState Clone() const;

 private:
  friend class Model;
  SequenceState() = default;
  struct Layer {
    std::vector<float> k;     // [position, HD]  rotated keys of every token so far
    std::vector<float> v;     // [position, HD]
    std::vector<float> s;     // [H, dh, dh]     recurrent state
    std::vector<float> conv;  // [w-1, 2*HD]     the last w-1 conv inputs, oldest first
  };
  std::vector<Layer> layers_;
  int64_t position_ = 0;
};

// The weights of a checkpoint in fp32 and the forward pass. Immutable after Load(); Forward() on
// different SequenceStates may run concurrently.
class Model {
 public:
  static absl::StatusOr<Model> Load(const std::string& dir);

  const ModelConfig& config() const { return config_; }
  SequenceState NewSequence() const;

  // Runs tokens[i] in modes[i] at positions seq.position() .. + T - 1 and advances the sequence.
  // logits: [T, V] when all_logits, else [V] for the last token. InvalidArgument for an empty span,
  // mismatched lengths, an id outside the vocabulary or a span past max_position (seq is untouched).
  absl::Status Forward(SequenceState& seq, std::span<const int32_t> tokens, std::span<const Mode> modes,
                       bool all_logits, std::vector<float>* logits) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, mlp_norm;              // [D]
    std::vector<float> k_proj, v_proj, g_proj, q_attn, q_linear;  // [HD, D]
    std::vector<float> o_proj;                           // [D, HD]
    std::vector<float> conv_weight, conv_bias;           // [2HD, w], [2HD]
    std::vector<float> gate_norm;                        // [dh]
    std::vector<float> dt_proj, d_skip;                  // mamba2: [H, D], [H]
    std::vector<float> beta_proj, alpha_proj;            // gdn: [H, D], [H, D]
    std::vector<float> dt_bias, a_log;                   // [H], [H]
    std::vector<float> mlp_gate, mlp_up, mlp_down;       // [F, D], [F, D], [D, F]
  };
  void LayerForward(const Layer& w, SequenceState::Layer& st, int64_t pos, std::span<const Mode> modes,
                    std::vector<float>& x) const;

  ModelConfig config_;
  std::vector<float> embed_, final_norm_, lm_head_;  // [V, D], [D], [V, D] (empty when tied)
  std::vector<Layer> layers_;
};

}  // namespace oryx
