// A model checkpoint directory (DESIGN.md §4): config.json, model.safetensors or an index and shards, and
// tokenizer.model. LoadCheckpoint validates all of it against the tensor-name table; WriteCheckpoint
// writes one so that readers only ever see a complete directory.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/safetensors.h"

namespace oryx {

inline constexpr std::string_view kConfigFileName = "config.json";
inline constexpr std::string_view kTokenizerFileName = "tokenizer.model";
// Shard size used when the caller does not choose one (the HF default, 5 GB of tensor data per file).
inline constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000;

// A loaded, validated checkpoint. The weights stay memory-mapped (read-only) for the object's lifetime;
// views it hands out point into the mappings and die with it. Move-only; const methods are thread-safe.
// Replacing the directory with WriteCheckpoint while a Checkpoint is open is safe: the mapped files are
// unlinked, not modified.
class Checkpoint {
 public:
  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  // dir/tokenizer.model (it exists; loading it is the tokenizer's job).
  const std::string& tokenizer_path() const { return tokenizer_path_; }

  // The tensor named `name` (dtype, shape, raw bytes); NotFound naming the tensor if there is none.
  absl::StatusOr<TensorView> Tensor(std::string_view name) const;
  // The tensor's values as floats (bf16 widened).
  absl::StatusOr<std::vector<float>> TensorAsFloats(std::string_view name) const;
  // Every tensor, sorted by name.
  std::vector<TensorView> tensors() const { return store_.tensors(); }
  // Path of the safetensors file holding `name`, for messages ("" if there is no such tensor).
  std::string FileOf(std::string_view name) const;

 private:
  friend absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& dir);
  Checkpoint(std::string dir, ModelConfig config, std::string tokenizer_path, SafetensorsStore store)
      : dir_(std::move(dir)),
        config_(config),
        tokenizer_path_(std::move(tokenizer_path)),
        store_(std::move(store)) {}

  std::string dir_;
  ModelConfig config_;
  std::string tokenizer_path_;
  SafetensorsStore store_;
};

// Loads and validates `dir`: config.json (ParseModelConfig), tokenizer.model present, weights in
// model.safetensors or model.safetensors.index.json + shards (every header check of
// ParseSafetensorsHeader and the index checks of SafetensorsStore), then against ExpectedTensors(config):
// no missing tensor, no unexpected tensor, every shape as the config implies, dtype F32 or BF16, and every
// value finite (all weights are scanned once). Errors name the file, the tensor and the problem.
absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& dir);

// Checks `tensors` against ExpectedTensors(config) the way LoadCheckpoint does (names, shapes, byte
// sizes, finite values); `source` prefixes the messages.
absl::Status ValidateCheckpointTensors(const ModelConfig& config, std::span<const TensorView> tensors,
                                       std::string_view source);

// Writes a checkpoint into `dir` for exporters. Validates first (ValidateModelConfig and
// ValidateCheckpointTensors: nothing LoadCheckpoint would reject gets written). Then:
//   1. builds the complete checkpoint in the sibling directory "<dir>.tmp.<pid>": config.json, the
//      weights (WriteShardedSafetensors with `max_shard_bytes`), and a copy of `tokenizer_model_path`
//      if it is not empty; every file is fsynced, then the directory;
//   2. if `dir` does not exist, renames the sibling to `dir`; if it does, atomically exchanges the two
//      (renameat2 RENAME_EXCHANGE) and deletes the sibling, which now holds the previous checkpoint;
//      where the filesystem cannot exchange, renames `dir` to "<dir>.old.<pid>", the sibling to `dir`,
//      then deletes the old one (a reader in that instant finds no directory, never a partial one);
//   3. fsyncs the parent directory.
// A failure or crash before step 2 leaves the previous checkpoint untouched (a crash may leave the
// sibling behind). An existing `dir` is replaced only if it is empty or holds nothing but checkpoint
// files (config.json, tokenizer.model, model*.safetensors, the index); anything else is
// FailedPrecondition, so a mistyped path cannot wipe an unrelated directory. Without a tokenizer path
// the new checkpoint has no tokenizer.model and LoadCheckpoint will refuse it until one is added.
absl::Status WriteCheckpoint(const std::string& dir, const ModelConfig& config,
                             std::span<const TensorView> tensors,
                             uint64_t max_shard_bytes = kDefaultMaxShardBytes,
                             const std::string& tokenizer_model_path = "");

}  // namespace oryx
