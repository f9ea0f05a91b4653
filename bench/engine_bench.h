// The engine's benchmarks behind `oryx bench` (DESIGN.md §8), as JSON lines:
//   decode  prefill and decode tokens/s by mode, batch and context, each against the memory-bandwidth
//           roofline measured in the same run (and against LibTorch's token-by-token decode where given)
//   spec    speculative decoding against attention-mode decoding on a trained model: acceptance, accepted
//           tokens per round, per-position acceptance, draft / verify time split and speedup
// LibTorch-free: the reference timing comes in through a callback from a LibTorch build.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "nlohmann/json.hpp"

namespace oryx::bench {

using Emit = std::function<void(const nlohmann::json&)>;

// The ~20M-parameter config the decode benchmark uses without --model: d 512, 4 layers, 8 heads of 64,
// MLP 1408, vocab 8192, tied embeddings, mamba2.
ModelConfig DecodeBenchConfig(int64_t max_position);
// The random-weight configs of the paper's scales, as bench/torch_reference.py builds them: vocab 32000,
// SwiGLU hidden 8/3 d_model rounded to a multiple of 64, rope_theta 1e4, norm_eps 1e-6, untied LM head.
//   130m: d 768, 24 layers, 12 heads x 64;  1.4b: d 2048, 24 layers, 16 heads x 128.
absl::StatusOr<ModelConfig> PresetConfig(const std::string& name, LinearMixer mixer, int64_t max_position);

// Writes a checkpoint of `config` with small random weights (for timing, and for tests of what any model
// may emit) into `dir`, with the given tokenizer (or, when empty, a placeholder file: no text).
absl::Status WriteRandomCheckpoint(const std::string& dir, const ModelConfig& config, uint32_t seed,
                                   const std::string& tokenizer_path = "");

// Seconds per decode step of LibTorch's token-by-token reference at (mode, context, batch), or nothing.
using ReferenceTimer = std::function<std::optional<double>(Mode mode, int64_t context, int64_t batch)>;

// Makes the reference timer for a checkpoint directory (it may load the model now: the directory is removed
// afterwards when it holds random weights).
using ReferenceFactory = std::function<absl::StatusOr<ReferenceTimer>(const std::string& model_dir)>;

struct DecodeBenchOptions {
  std::string model_dir;  // the model to time (random weights of DecodeBenchConfig when empty)
  std::vector<int64_t> batches = {1, 4, 16};
  std::vector<int64_t> contexts = {256, 1024, 4096, 8192};
  int64_t steps = 8;  // timed decode steps per point (median reported)
  int threads = 0;
  std::string weights = "f32";  // cpu: the projections' format (BackendOptions::weights)
  int64_t kv_block_tokens = 0;  // cpu: positions per KV block (CpuBackend::SetKvBlockTokens); 0: the default
  std::string kv_dtype = "f32";  // cpu: the KV cache's element type (CpuBackend::SetKvFormat)
  ReferenceFactory reference;  // optional
  std::string device = "cpu";  // cpu | cuda (bench/cuda_bench.h, in CUDA builds)
  // cuda only: without model_dir, random weights of this preset (130m, 1.4b) and mixer; attention-mode
  // prefill is timed up to this context.
  std::string preset;
  LinearMixer mixer = LinearMixer::kMamba2;
  int64_t prefill_max_attention = 32768;
  // cuda only: speculative rounds of these draft lengths at every point (bench/cuda_bench.h); with random
  // weights each draft is accepted with probability `acceptance`, with data_dir (a corpus, and model_dir)
  // the contexts are its validation windows and the acceptance is the model's own (greedy).
  std::vector<int64_t> spec_ks;
  double acceptance = 0.84;
  std::string data_dir;
  // cuda, spec_ks with data_dir: the rounds sample at this temperature (AcceptLossless judges the sampled
  // drafts); 0: greedy.
  double temperature = 0;
};
absl::Status RunDecodeBench(const DecodeBenchOptions& options, const Emit& emit);

struct SpecBenchOptions {
  std::string model_dir;
  std::string data_dir;  // corpus: prompts come from its validation split
  std::vector<int64_t> ks = {1, 2, 4, 8};
  std::vector<int64_t> contexts = {512, 2048};
  std::vector<int64_t> batches = {1, 8};
  std::vector<std::string> proposers = {"linear", "ngram"};
  int64_t gen_tokens = 64;
  int threads = 0;
};
absl::Status RunSpecBench(const SpecBenchOptions& options, const Emit& emit);

struct CostBenchOptions {
  std::string model_dir;  // random weights of DecodeBenchConfig when empty
  std::string device = "cpu";  // cpu | cuda
  int threads = 0;
  int repeats = 5;
};
// Calibrates the router's cost model on a grid of span shapes (batch, tokens, context, mode) and reports
// its prediction error on held-out shapes; one JSON line per held-out shape, then a summary line.
absl::Status RunCostBench(const CostBenchOptions& options, const Emit& emit);

// Read bandwidth (bytes/s, best of 15 passes) of a buffer of `bytes`, over all hardware threads. A
// decode step mostly reads (weights, KV cache, state), so sized like the step's working set this is the
// step's achievable bandwidth, caches included (a large L3 can hold a small model's weights); 1 GiB
// measures DRAM.
double ReadBandwidth(double bytes);

}  // namespace oryx::bench
