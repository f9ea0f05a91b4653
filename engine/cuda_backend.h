// The CUDA backend: bf16 weights on the GPU, the forward on kernels/cuda (fused conv/RoPE/KV append,
// recurrences over spans, split-KV attention) and cuBLAS, sequence states (bf16 KV cache, fp32 recurrent
// state, conv window) in device memory drawn from a pool owned by the backend. Only the logits asked for
// come back to the host. No CUDA types in this header.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/tensor_names.h"

namespace oryx {

// CudaBackend::graphs_recorded(), graph_warmups() and Counters()' graph_warmup_s: forward and round graphs
// captured, runs of their shapes before they replayed, and the wall time of the calls that had such runs.
struct CudaGraphCounts {
  std::atomic<int64_t> recorded{0}, warmups{0}, warmup_ns{0};
};

// Counters()' whole rounds: how many, and their wall time by stage (Backend::Counters).
struct CudaRoundTimes {
  std::atomic<int64_t> rounds{0}, prepare_ns{0}, launch_ns{0}, wait_ns{0}, finish_ns{0};
};

// Counters()' forwards (Forward, not whole rounds): how many, their rows and attention rows, the rows of logits
// copied back to the host, and the tokens drawn on the host (a forward whose samplers differ).
struct CudaForwardCounts {
  std::atomic<int64_t> forwards{0}, rows{0}, attention_rows{0}, logit_rows_back{0}, host_draws{0};
};

class CudaBackend final : public Backend {
 public:
  // Loads a checkpoint onto the current CUDA device. `weights`: the projections and the LM head in bf16 (kF32,
  // kBf16) or FP8 (kFp8: e4m3 with a power-of-two scale per row, kernels::cuda::QuantizeRowsFp8); int8 is
  // InvalidArgument. FailedPrecondition when there is no CUDA device.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Load(
      const std::string& dir, const CudaSwitches& switches = {},
      kernels::WeightFormat weights = kernels::WeightFormat::kBf16);
  // Random weights of `config` made on the device (uniform, small; for benchmarks at sizes whose
  // checkpoints would be slow to write and read), in `weights` as Load's.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> CreateRandom(
      const ModelConfig& config, uint32_t seed, const CudaSwitches& switches = {},
      kernels::WeightFormat weights = kernels::WeightFormat::kBf16);
  ~CudaBackend() override;

  std::string_view name() const override { return "cuda"; }
  const ModelConfig& config() const override { return config_; }
  int64_t KvBytes(int64_t positions) const override;  // bf16 keys and values, in whole blocks
  SequenceState NewSequence() const override;
  absl::StatusOr<SequenceState> TryNewSequence() const override;
  using Backend::Forward;
  absl::Status Forward(std::span<const ForwardItem> batch) override;
  // The whole round on the device, one CUDA graph per shape, with one synchronisation at its end (the
  // drafts come back with the verify rows' argmaxes, greedy, or with the device's AcceptLossless verdict,
  // sampled).
  bool runs_rounds() const override { return runs_rounds_; }
  absl::Status SpeculativeRound(std::span<const RoundItem> items, int64_t k) override;
  int64_t graphs_recorded() const override { return graphs_.recorded.load(std::memory_order_relaxed); }
  int64_t graph_warmups() const override { return graphs_.warmups.load(std::memory_order_relaxed); }
  std::vector<std::pair<std::string, double>> Counters() const override;
  // Whole rounds padded with idle sequences to a few batch sizes (CudaSwitches::round_padding; default on).
  void set_round_padding(bool on) { round_padding_ = on; }
  // Device draws beside items that return their logits (CudaSwitches::mixed_draws; default on).
  void set_mixed_draws(bool on) { mixed_draws_ = on; }
  // Off: runs_rounds() is false and speculative decoding runs its rounds from Forward calls (default on;
  // BackendOptions::device_rounds).
  void set_runs_rounds(bool on) { runs_rounds_ = on; }
  // Up to 16,384 tokens per prompt and as many rows per forward as 1.25 GiB of activations hold (8,704 for
  // 1.4b, 32,768 for models/default; CudaSwitches::prefill_span and prefill_rows), at least 256:
  // attention runs in tiles, with no score buffer, and long spans keep the tiled attention, the chunked scan
  // and the products busy. A decoding request waits for such a forward (`--max-prefill-tokens` bounds it).
  int64_t PrefillSpan(int64_t sequences) const override {
    return std::clamp<int64_t>(prefill_rows_ / std::max<int64_t>(1, sequences), 256, prefill_span_);
  }

  // Bytes of the weight matrices on the device (bf16, or FP8 and their scales), the embedding table's included.
  int64_t weight_bytes() const { return weight_bytes_; }
  // The projections and the LM head are FP8 (Load's `weights`).
  bool fp8_weights() const { return fp8_scratch_ != nullptr; }
  // Copy bandwidth of the device in bytes/s (read + write over the time of a large copy, best of 10).
  double MeasureCopyBandwidth() const;
  // Forwards of short spans (decode steps, verify spans) replayed as CUDA graphs, one per shape (default on).
  void set_cuda_graphs(bool on) { use_graphs_ = on; }
  bool cuda_graphs() const { return use_graphs_; }
  // Forwards of at most 8 rows fuse each norm / gate into the projection after it, and up projections on the
  // tensor-core GEMV (2-32 rows) the SwiGLU after them (default on).
  void set_fused_gemv(bool on) { fused_gemv_ = on; }
  // Decode steps (every span one token, none kept for rollback) run the conv, conv window and recurrence of
  // a layer as one kernel (default on; off: the three kernels of longer spans, for tests and comparisons).
  void set_decode_mixer(bool on) { decode_mixer_ = on; }
  // Free device memory plus what the state pool holds for reuse.
  int64_t AvailableDeviceBytes() const override;
  // The KV blocks' slabs allocated now, up to `bytes` (the pool's size at start).
  absl::Status ReserveKv(int64_t bytes) override;
  int64_t KvPoolBytes() const override;
  std::string DeviceName() const;
  // Blocks until the backend's stream has finished its work (for timing).
  void Synchronize() const;
  // Where a forward's wall time goes, for benchmarks (set_step_timing(true): three CUDA events per forward).
  struct StepTiming {
    double wall_s = 0;     // the whole Forward call
    double prepare_s = 0;  // host: checks, plan, metadata, until the first launch
    double launch_s = 0;   // host: the metadata copy, the launches and the copy back enqueued
    double device_s = 0;     // device: from the metadata copy's end to the last kernel's end
    double copy_back_s = 0;  // device: the logits' (or the drawn tokens') copy to the host
    double finish_s = 0;   // host: from the synchronisation's return to the logits handed out
  };
  void set_step_timing(bool on) { step_timing_ = on; }
  const StepTiming& last_step_timing() const { return last_timing_; }

  struct Context;  // the stream, cuBLAS handle and memory pool shared with the device sequences

 private:
  // A weight matrix [N, K] on the device: bf16, or FP8 e4m3 with one scale per row.
  struct Weight {
    void* data = nullptr;
    float* scale = nullptr;  // set: FP8
  };
  struct Layer;
  struct Scratch;
  struct Profiler;
  CudaBackend();
  absl::Status Init(const ModelConfig& config, const CudaSwitches& switches);
  // Load's and CreateRandom's end: the matrices to FP8 (kFp8, the bf16 freed) or kept, weight_bytes_ counted.
  absl::Status SetWeightFormat(kernels::WeightFormat weights);
  struct Plan;
  // A forward in steps: its plan (the sequences' capacity made), the scratch for it, its metadata written
  // at `base` as the plan lays it out (positions shifted by pos_shift), the device views of it, the launches,
  // the host bookkeeping.
  absl::StatusOr<Plan> PlanForward(std::span<const ForwardItem> batch);
  // ResourceExhausted when the device has no room (the old buffers then stay).
  absl::Status EnsureScratch(int64_t N, int64_t NL, int64_t partial, int64_t meta_bytes, int64_t round_q = 0,
                             int64_t workspace_bytes = 0);
  int64_t PartialFloats(const Plan& plan) const;
  void WriteMeta(std::span<const ForwardItem> batch, const Plan& plan, int64_t pos_shift, char* base) const;
  void SetViews(const Plan& plan, const char* base);
  void RunModel(const Plan& plan);
  // The next tokens drawn on the device (Plan::device_draw): where they sit after the forward's metadata,
  // and the launches that draw them after RunModel.
  struct DrawLayout;
  DrawLayout LayOutDraws(const Plan& plan, int64_t meta_bytes) const;
  void Draw(const Plan& plan, const DrawLayout& d);
  void LayerForward(int64_t il, const Plan& plan);
  // Layer il's four products for a forward of `rows` rows, over the scratch as it is (LayerForward runs them;
  // PlanForward asks which kernel would take them).
  struct Products;
  Products LayerProducts(int64_t il, int64_t rows, bool any_attention) const;
  // The host's side of a finished forward: positions, logits, next tokens and logit statistics (drawn and
  // computed on the device: draws_host, stats_host [NL, 2]).
  void FinishForward(std::span<const ForwardItem> batch, const float* logits_host, const int32_t* draws_host,
                     const float* stats_host = nullptr);
  // The batch a whole round of B sequences and draft length k runs as (round_padding_): B rounded up to 1, 2,
  // 4 or a multiple of 8 while the verify's rows fit a graph; B otherwise.
  int64_t RoundBatch(int64_t B, int64_t k) const;
  // Idle sequences (and their drafts) to pad a round with, made as needed: ResourceExhausted when the device
  // has no room for them (the round then runs unpadded).
  absl::Status EnsureIdleSequences(int64_t count);

  ModelConfig config_;
  InProjLayout in_proj_;  // the fused input projection's rows: P = in_proj_.width
  int64_t weight_bytes_ = 0;
  std::shared_ptr<Context> ctx_;
  std::vector<Layer> layers_;
  void* embed_ = nullptr;       // bf16 [V, D]
  Weight lm_head_;              // [V, D] (data = embed_ when tied and bf16)
  // FP8 weights: a bf16 copy of one matrix, made in front of each cuBLAS product (kc::GemmParams).
  void* fp8_scratch_ = nullptr;
  float* final_norm_ = nullptr;  // [D]
  double* rope_freq_ = nullptr;  // [dh/2] (rope_theta > 0)
  std::unique_ptr<Scratch> scratch_;
  std::unique_ptr<Profiler> profiler_;  // ORYX_CUDA_PROFILE=1
  bool use_graphs_ = true;
  bool fused_gemv_ = true;
  bool runs_rounds_ = true;
  CudaGraphCounts graphs_;
  CudaRoundTimes round_times_;
  CudaForwardCounts forward_counts_;
  // Paths on by default that ORYX_CUDA_<NAME>=0 turns off (Init), to measure them.
  bool decode_mixer_ = true;   // DECODE_MIXER: one mixer kernel for decode steps
  bool split_norms_ = true;    // SPLIT_NORMS: a batch's norms split between its products (Plan::split_norms)
  bool mixer_norm_ = true;     // MIXER_NORM: the gated norm in the decode mixer (Plan::gated_in_mixer)
  bool skip_q_linear_ = true;  // SKIP_Q_LINEAR: no q_linear rows when every token attends
  bool chunked_scan_ = true;   // CHUNKED_SCAN: long spans in chunks
  bool tiled_attention_ = true;  // TILED_ATTENTION: prefill attention on tensor cores
  int gemv_rows_per_warp_ = 0;  // ORYX_CUDA_GEMV_ROWS (0: the kernel's choice)
  // ORYX_CUDA_MIXER_PREFETCH: bytes of the up projection the mixer asks L2 for (Init sets it from the switches).
  int64_t mixer_prefetch_bytes_ = int64_t{CudaSwitches{}.mixer_prefetch_mib} << 20;
  // ORYX_CUDA_DOWN_PREFETCH: bytes of the next layer's input projection the down projection asks L2 for.
  int64_t down_prefetch_bytes_ = int64_t{CudaSwitches{}.down_prefetch_mib} << 20;
  int64_t prefill_rows_ = 8192;   // ORYX_CUDA_PREFILL_ROWS or the activation budget: prompt rows of a forward
  int64_t prefill_span_ = 16384;  // ORYX_CUDA_PREFILL_SPAN: one prompt's tokens in a forward at most
  int fused_rows_ = 1;          // ORYX_CUDA_FUSED_ROWS: the most rows of a forward on the fused path
  int graph_after_ = 2;         // ORYX_CUDA_GRAPH_AFTER: a shape's use at which its graph is captured
  bool round_padding_ = true;   // ORYX_CUDA_ROUND_PADDING: RoundBatch
  bool mixed_draws_ = true;     // ORYX_CUDA_MIXED_DRAWS: device draws beside items that return logits (PlanForward)
  // Sequences at position 0 that never advance, each with its draft: the rows that pad a round (their KV
  // block and states take the padded rows' writes, which nothing reads).
  std::vector<SequenceState> idle_seqs_, idle_drafts_;
  bool step_timing_ = false;
  StepTiming last_timing_;
  std::mutex forward_mu_;
};

}  // namespace oryx
