// The CPU backend: fp32 weights in host memory (the projections optionally packed to bf16 or int8, Load's
// `weights`) and the forward pass on kernels/cpu. A batch is run with
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
#include "kernels/ops.h"

namespace oryx {
namespace kernels::cpu {
class ThreadPool;
}

class CpuBackend final : public Backend {
 public:
  // threads: worker threads in [0, kMaxCpuThreads], 0 for one per hardware thread (InvalidArgument otherwise).
  // `weights`: the format of the projections (in_proj, o_proj, MLP, head); kF32 keeps the checkpoint's values
  // (as fp32), kBf16 and kInt8 read 2 and 4 times fewer bytes per token (kernels/ops.h WeightFormat).
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Load(const std::string& dir, int threads = 0,
                                                          kernels::WeightFormat weights = kernels::WeightFormat::kF32);
  static constexpr int kMaxCpuThreads = 1024;
  ~CpuBackend() override;

  std::string_view name() const override { return "cpu"; }
  const ModelConfig& config() const override { return config_; }
  int64_t KvBytes(int64_t positions) const override {
    const int64_t bt = kv_block_tokens(), blocks = (positions + bt - 1) / bt;
    return blocks * kv_pool_->block_bytes();
  }
  // Positions per KV block of the sequences made from now on (default kHostKvBlockTokens): for measuring the
  // block size. FailedPrecondition while a sequence holds blocks of the pool; InvalidArgument outside [1, 4096].
  absl::Status SetKvBlockTokens(int64_t block_tokens);
  int64_t kv_block_tokens() const { return kv_pool_->block_tokens(); }
  // The KV cache's element type for the sequences made from now on (default fp32): bf16 halves the bytes an
  // attention step reads from the cache, int8 (a scale per head and position) about quarters them; keys and
  // values are rounded once, when written. FailedPrecondition
  // while a sequence holds blocks of the pool.
  absl::Status SetKvFormat(kernels::KvFormat format);
  kernels::KvFormat kv_format() const { return kv_pool_->format(); }
  // Its sequences' KV blocks come from one pool (kv_pool_), grown as they need.
  SequenceState NewSequence() const override { return SequenceState(config_, kv_pool_); }
  absl::Status ReserveKv(int64_t bytes) override;
  int64_t KvPoolBytes() const override { return kv_pool_->allocated() * kv_pool_->block_bytes(); }
  using Backend::Forward;
  absl::Status Forward(std::span<const ForwardItem> batch) override;

  int num_threads() const;

 private:
  using Floats = kernels::AlignedVector<float>;  // every kernel buffer 64-byte aligned: see aligned_vector.h
  // A projection's weights [n, k]: fp32 (f32), or packed into a WeightFormat (packed, and scale for int8).
  struct Matrix {
    kernels::WeightFormat format = kernels::WeightFormat::kF32;
    Floats f32;
    kernels::AlignedVector<uint8_t> packed;
    Floats scale;  // int8: [n]
    void Pack(int64_t rows, int64_t cols, kernels::WeightFormat to);  // from f32, which it frees
  };
  struct Layer {
    Floats attn_norm, mlp_norm;  // [D]
    // The input projections fused into one [P, D] matrix, rows in this order:
    //   k [HD], v [HD], q_linear [HD], g [HD], mixer gates [G], q_attn [HD]
    // where G = H (mamba2: dt) or 2H (gdn: beta, then alpha). q_attn is last so that a span without
    // attention tokens skips it by computing fewer rows.
    Matrix in_proj;
    Matrix o_proj;                 // [D, HD]
    Floats conv_weight, conv_bias;  // [2HD, w], [2HD]
    Floats gate_norm;              // [dh]
    Floats d_skip;                 // mamba2: [H]
    Floats dt_bias, a_log;         // [H], [H]
    Matrix mlp_in;                 // [2F, D]: gate rows, then up rows
    Matrix mlp_down;               // [D, F]
  };
  struct Span;  // one item's rows in the batch
  CpuBackend() = default;
  absl::Status Validate(std::span<const ForwardItem> batch) const;
  void LayerForward(int64_t il, std::span<const ForwardItem> batch, std::span<const Span> spans, int64_t rows);
  void GatherKvBlocks(std::span<const ForwardItem> batch);  // after the spans are planned
  // y[:, first .. n) = x W[first .. n)^T (first a multiple of kMatMulPanel).
  void MatMul(const float* x, int64_t m, int64_t k, const Matrix& w, int64_t n, float* y, int64_t x_stride,
              int64_t y_stride, int64_t first = 0);
  static constexpr int64_t kMatMulPanel = 64;

  ModelConfig config_;
  InProjLayout in_proj_;  // the fused input projection's rows: P = in_proj_.width
  Floats embed_, final_norm_;  // [V, D], [D]
  Matrix head_;  // [V, D]: the lm_head, or the embedding's copy when tied (f32 empty then: embed_ serves)
  std::vector<Layer> layers_;
  std::unique_ptr<kernels::cpu::ThreadPool> pool_;
  std::shared_ptr<HostKvPool> kv_pool_;  // every sequence's KV blocks
  struct Scratch;  // per-forward buffers, grown to the largest batch seen and reused: no allocation per token
  std::unique_ptr<Scratch> scratch_;
  std::mutex forward_mu_;  // one forward at a time (it owns the scratch and the pool)
};

}  // namespace oryx
