// Test helpers for checkpoint IO: tiny valid configs, random tensors from the tensor-name table,
// scratch directories, and raw file writers for building deliberately broken files.
#pragma once

#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/safetensors.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"

// EXPECT_HAS_SUBSTR(text, needle): `text` (anything convertible to std::string_view, or an
// absl::string_view) contains `needle`; prints both on failure.
#define EXPECT_HAS_SUBSTR(text, needle) \
  EXPECT_PRED_FORMAT2(::oryx::testutil::AssertHasSubstr, std::string(text), std::string(needle))

namespace oryx::testutil {

inline ::testing::AssertionResult AssertHasSubstr(const char* text_expr, const char* needle_expr,
                                                  const std::string& text, const std::string& needle) {
  if (text.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << text_expr << " does not contain " << needle_expr
                                       << "\n  text:   " << text << "\n  needle: " << needle;
}

// V=32, D=8, L=2, H=2, dh=4, F=16, w=4, rope_theta=10000: small enough that a checkpoint is a few KB.
ModelConfig TinyConfig(LinearMixer mixer = LinearMixer::kMamba2, bool tie_embeddings = false);

// Every tensor ExpectedTensors(config) lists, filled with uniform values in [-1, 1) from `seed`.
std::vector<HostTensor> RandomTensors(const ModelConfig& config, DType dtype, uint32_t seed);

class ScratchDir;

// A model for generation tests, written under `dir`: a tokenizer of 512 pieces trained on
// tests/data/tokenizer_corpus.txt (found through ORYX_SOURCE_DIR), and TinyConfig(mamba2) with that vocabulary,
// max_position 64 (or the given one) and random fp32 weights from `seed`. Returns the model directory; fails
// the test when it cannot write it.
std::string WriteTinyModelWithTokenizer(const ScratchDir& dir, uint32_t seed, int64_t max_position = 64);

// A fresh empty directory under the system temp dir, removed (recursively) when the object dies.
class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Join(std::string_view name) const;

 private:
  std::string path_;
};

// Writes `bytes` to `path` as is (not atomic; for fixtures). Aborts the test on failure via ADD_FAILURE.
void WriteRawFile(const std::string& path, std::string_view bytes);
std::string ReadRawFile(const std::string& path);

// A safetensors file image: 8-byte little-endian length of `header_json`, the header, then `data`.
std::string SafetensorsImage(std::string_view header_json, std::string_view data);

// Makes every write past `max_bytes` fail with EFBIG while alive (works as root, unlike chmod).
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t max_bytes) {
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old_);
    struct rlimit limit = old_;
    limit.rlim_cur = max_bytes;
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_handler_);
  }

 private:
  struct rlimit old_;
  sighandler_t old_handler_;
};

// Writes a complete checkpoint into `dir` (WriteCheckpoint with a dummy tokenizer.model).
void WriteTinyCheckpoint(const std::string& dir, const ModelConfig& config,
                         const std::vector<HostTensor>& tensors,
                         uint64_t max_shard_bytes = uint64_t{1} << 40);

// A CPU backend (one thread) on a random checkpoint of TinyConfig(mixer) with this max_position (0: its
// own), written under `scratch`; the weights come from `seed`.
std::unique_ptr<Backend> TinyBackend(const ScratchDir& scratch, LinearMixer mixer, uint32_t seed,
                                     int64_t max_position = 0);
// An engine (no tokenizer) on TinyBackend(scratch, mixer, seed).
Engine TinyEngine(const ScratchDir& scratch, LinearMixer mixer, uint32_t seed);

// A backend that counts the forwards it runs and their rows.
class CountingBackend final : public Backend {
 public:
  explicit CountingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  const ModelConfig& config() const override { return inner_->config(); }
  SequenceState NewSequence() const override { return inner_->NewSequence(); }
  absl::Status Forward(std::span<const ForwardItem> batch) override {
    ++forwards;
    int64_t prompt_rows = 0;
    for (const ForwardItem& item : batch) {
      rows += static_cast<int64_t>(item.tokens.size());
      if (item.tokens.size() > 1) prompt_rows += static_cast<int64_t>(item.tokens.size());
      if (item.tokens.size() == 1 && item.logits_out != nullptr) ++step_logits;
      if (item.stats_out != nullptr) ++step_stats;
    }
    max_prompt_rows = std::max(max_prompt_rows, prompt_rows);
    return inner_->Forward(batch);
  }
  int64_t PrefillSpan(int64_t sequences) const override {
    return prefill_span > 0 ? prefill_span / sequences : inner_->PrefillSpan(sequences);
  }
  int64_t forwards = 0, rows = 0, max_prompt_rows = 0;  // max_prompt_rows: of spans longer than one token
  int64_t step_logits = 0;   // one-token items that asked for their logits back (not only a drawn token)
  int64_t step_stats = 0;    // items that asked for their last row's LogitStats
  int64_t prefill_span = 0;  // > 0: PrefillSpan answers this over the sequences, as a device backend's might

 private:
  std::unique_ptr<Backend> inner_;
};

// A backend that says it runs whole speculative rounds and runs them from its inner backend's forwards
// (greedy only): the decoder's RunWhole, Commit and AcceptGreedy and the engine's steps around them (a
// prompt's spans forwarded apart, then the round) exercised on the CPU, as the CUDA backend drives them.
class HostRoundsBackend final : public Backend {
 public:
  explicit HostRoundsBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  const ModelConfig& config() const override { return inner_->config(); }
  SequenceState NewSequence() const override { return inner_->NewSequence(); }
  absl::Status Forward(std::span<const ForwardItem> batch) override {
    ++forwards;
    return inner_->Forward(batch);
  }
  bool runs_rounds() const override { return true; }
  absl::Status SpeculativeRound(std::span<const RoundItem> items, int64_t k) override;
  int64_t forwards = 0, rounds = 0;

 private:
  std::unique_ptr<Backend> inner_;
};

// Runs `batch` to its end, adding the requests one every `every` steps while the earlier ones decode, and
// calling after_step after each step; the results in the requests' order (empty after a failed step).
std::vector<GenerateResult> RunJoining(GenerationBatch& batch, const std::vector<GenerateRequest>& qs, size_t every,
                                       const std::function<void(size_t step)>& after_step);

// Reads the file, applies `edit` to its tensors, writes it back with WriteSafetensors (no config
// checks), so that tests can make a checkpoint whose weights disagree with its config.
template <typename Edit>
void RewriteWeights(const std::string& path, Edit edit);

std::vector<HostTensor> ReadAllTensors(const std::string& safetensors_path);

// Next tokens drawn by `backend` (ForwardItem::sampler) are the ones the same samplers draw on the host from
// the returned logits, and the samplers' streams move alike: `sequences` (1 to 3) fresh sequences in mixed
// modes, ten steps that feed each draw back, run once with the backend drawing and once with every sequence
// returning logits. With `one_returns_logits`, the middle of three runs a verify-like span instead (two tokens
// in attention mode, every row's logits, states kept) in both batches, and its logits must agree. Each draw's
// LogitStats are the host's of the same logits. Sampled parameters must also draw something other than the
// argmax, or nothing was compared.
void ExpectBackendDrawsAreTheSamplersDraws(Backend& backend, const SamplingParams& params, bool one_returns_logits,
                                           int sequences = 3);

// Log-probabilities are attention mode's whatever was drafted: `q` (greedy, q.logprobs >= 0) generated under
// the attention policy and under `speculative` (registered on the engine) gives the same tokens, and the same
// log-probabilities within `tolerance` (with q.echo, the prompt's too). Returns the speculative result (empty
// when a generation failed).
GenerateResult ExpectSpeculativeLogprobsAreAttentions(Engine& engine, GenerateRequest q, const std::string& speculative,
                                                      double tolerance);

template <typename Edit>
void RewriteWeights(const std::string& path, Edit edit) {
  std::vector<HostTensor> tensors = ReadAllTensors(path);
  edit(tensors);
  std::vector<TensorView> views = Views(tensors);
  absl::Status s = WriteSafetensors(path, views);
  if (!s.ok()) std::abort();
}

}  // namespace oryx::testutil
