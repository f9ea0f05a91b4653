// The CPU backend: fp32 weights in host memory and the forward pass on kernels/cpu. A batch is run with
// its projections over all sequences' tokens at once (each weight read once per forward) and its
// per-sequence parts (conv, KV cache, recurrence, attention) split over (sequence, head) on a thread pool.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/tensor_names.h"
#include "kernels/aligned_vector.h"

namespace oryx {
namespace kernels::cpu {
class ThreadPool;
}

class CpuBackend final : public Backend {
 public:
  // threads: worker threads in [0, kMaxCpuThreads], 0 for one per hardware thread (InvalidArgument otherwise).
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Load(const std::string& dir, int threads = 0);
  static constexpr int kMaxCpuThreads = 1024;
  ~CpuBackend() override;

  std::string_view name() const override { return "cpu"; }
  const ModelConfig& config() const override { return config_; }
  int64_t KvBytes(int64_t positions) const override {
    const int64_t blocks = (positions + kHostKvBlockTokens - 1) / kHostKvBlockTokens;
    return blocks * kHostKvBlockTokens * 2 * config_.n_layers * config_.n_heads * config_.head_dim *
           static_cast<int64_t>(sizeof(float));
  }
  using Backend::Forward;
  absl::Status Forward(std::span<const ForwardItem> batch) override;

  int num_threads() const;

 private:
  using Floats = kernels::AlignedVector<float>;  // every kernel buffer 64-byte aligned: see aligned_vector.h
  struct Layer {
    Floats attn_norm, mlp_norm;  // [D]
    // The input projections fused into one [P, D] matrix, rows in this order:
    //   k [HD], v [HD], q_linear [HD], g [HD], mixer gates [G], q_attn [HD]
    // where G = H (mamba2: dt) or 2H (gdn: beta, then alpha). q_attn is last so that a span without
    // attention tokens skips it by computing fewer rows.
    Floats in_proj;
    Floats o_proj;                 // [D, HD]
    Floats conv_weight, conv_bias;  // [2HD, w], [2HD]
    Floats gate_norm;              // [dh]
    Floats d_skip;                 // mamba2: [H]
    Floats dt_bias, a_log;         // [H], [H]
    Floats mlp_in;                 // [2F, D]: gate rows, then up rows
    Floats mlp_down;               // [D, F]
  };
  struct Span;  // one item's rows in the batch
  CpuBackend() = default;
  absl::Status Validate(std::span<const ForwardItem> batch) const;
  void LayerForward(int64_t il, std::span<const ForwardItem> batch, std::span<const Span> spans, int64_t rows);
  void GatherKvBlocks(std::span<const ForwardItem> batch);  // after the spans are planned
  void MatMul(const float* x, int64_t m, int64_t k, const Floats& w, int64_t n, float* y,
              int64_t x_stride, int64_t y_stride);

  ModelConfig config_;
  InProjLayout in_proj_;  // the fused input projection's rows: P = in_proj_.width
  Floats embed_, final_norm_, lm_head_;  // [V, D], [D], [V, D] (empty when tied)
  std::vector<Layer> layers_;
  std::unique_ptr<kernels::cpu::ThreadPool> pool_;
  struct Scratch;  // per-forward buffers, grown to the largest batch seen and reused: no allocation per token
  std::unique_ptr<Scratch> scratch_;
  std::mutex forward_mu_;  // one forward at a time (it owns the scratch and the pool)
};

}  // namespace oryx
