// The two linear recurrences of DESIGN.md §2 in three forms each: the recurrent step with explicit state,
// the token-by-token scan (the reference), and the chunked parallel form used in training. LibTorch, fp32.
//
// Dimension legend: B batch, T tokens, H heads, dh head dim (dk = dv = dh), C chunk length.
// State S is [B, H, dh, dh] fp32 with S[.., i, j] pairing key feature i with value feature j; Read = S^T q.
#pragma once

#include <torch/torch.h>

namespace oryx::train {

// Inputs of a linear scan over T tokens, already prepared per mixer:
//   mamba2: q, k, v raw; decay = log a_t = -dt_t * exp(A_log); scale = dt_t.
//   gdn:    q = L2norm(q)/sqrt(dh), k = L2norm(k), v raw; decay = log alpha_t; scale = beta_t.
struct ScanInputs {
  torch::Tensor q;          // [B, T, H, dh]
  torch::Tensor k;          // [B, T, H, dh]
  torch::Tensor v;          // [B, T, H, dh]
  torch::Tensor log_decay;  // [B, T, H]   log of the per-token state decay (<= 0)
  torch::Tensor scale;      // [B, T, H]   dt (mamba2) or beta (gdn)
};

struct ScanResult {
  torch::Tensor out;    // [B, T, H, dh]   Read(S_t, q_t), without the mamba2 D-skip term (ScanChunked's:
                        //                 a strided view)
  torch::Tensor state;  // [B, H, dh, dh]  S after the last token
};

enum class ScanKind { kMamba2, kGdn };

// One token: S' = decay-and-update(S, k, v), out = S'^T q. Shapes as ScanInputs without T.
ScanResult ScanStep(ScanKind kind, const torch::Tensor& state, const torch::Tensor& q, const torch::Tensor& k,
                    const torch::Tensor& v, const torch::Tensor& log_decay, const torch::Tensor& scale);

// The reference: ScanStep token by token. `state` [B, H, dh, dh] is the initial state.
ScanResult ScanRecurrent(ScanKind kind, const ScanInputs& in, const torch::Tensor& state);

// The chunked parallel form (Mamba-2 SSD chunks; GDN chunked delta rule in WY/UT form), differentiable.
// T need not be a multiple of `chunk`. Computes in fp32 whatever the input dtype. An undefined `state` is
// the zero state, without the work of carrying it through.
ScanResult ScanChunked(ScanKind kind, const ScanInputs& in, const torch::Tensor& state, int64_t chunk = 64);

}  // namespace oryx::train
