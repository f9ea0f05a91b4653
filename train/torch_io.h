// Moves model weights between LibTorch and the checkpoint format (DESIGN.md §4): export an OryxModel to a
// checkpoint directory, load a checkpoint's tensors into an OryxModel. Names come from the one table.
// Also the device choice shared by the trainer and the evaluation.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/checkpoint.h"
#include "engine/safetensors.h"
#include "train/model.h"

namespace oryx::train {

// "cpu", "cuda" (an error where no CUDA device is visible) or "auto" (CUDA when visible, else CPU).
absl::StatusOr<torch::Device> ParseDevice(const std::string& name);

// A CPU copy of every model tensor as HostTensors in `dtype` (F32 or BF16), in ExpectedTensors order.
std::vector<HostTensor> ToHostTensors(OryxModel& model, DType dtype);

// Writes the model as a checkpoint directory (config.json, weights, tokenizer.model copied from
// `tokenizer_path`) atomically, sharded at `max_shard_bytes`.
absl::Status ExportCheckpoint(OryxModel& model, const std::string& dir, const std::string& tokenizer_path,
                              DType dtype = DType::kF32, uint64_t max_shard_bytes = kDefaultMaxShardBytes);

// Copies every tensor of `checkpoint` into `model` (same config required; bf16 widened to the model's dtype).
absl::Status LoadWeights(const Checkpoint& checkpoint, OryxModel& model);

// Loads a checkpoint directory into a new model on `device`.
absl::StatusOr<OryxModel> LoadModel(const std::string& dir, torch::Device device);

}  // namespace oryx::train
