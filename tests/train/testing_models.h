// Small model configs shared by the LibTorch tests: big enough to exercise every path (several heads,
// two layers, chunked scans with a partial chunk), small enough to run in milliseconds on a CPU.
#pragma once

#include "engine/config.h"

namespace oryx::train {

// V=vocab, D=24, L=2, H=3, dh=8, F=40, w=4, RoPE on (theta 10000), untied; gdn uses the SiLU conv.
inline ModelConfig SmallModel(LinearMixer mixer, int64_t vocab = 53) {
  ModelConfig c;
  c.vocab_size = vocab;
  c.d_model = 24;
  c.n_layers = 2;
  c.n_heads = 3;
  c.head_dim = 8;
  c.linear_mixer = mixer;
  c.conv_width = 4;
  c.conv_activation = mixer == LinearMixer::kGdn ? ConvActivation::kSilu : ConvActivation::kIdentity;
  c.mlp_hidden = 40;
  c.rope_theta = 10000.0;
  c.norm_eps = 1e-6;
  c.tie_embeddings = false;
  c.max_position = 256;
  c.bos_id = 2;
  c.eos_id = 3;
  c.pad_id = 0;
  return c;
}

}  // namespace oryx::train
