// LibTorch <-> checkpoint conversion.
#include "train/torch_io.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace oryx::train {

absl::StatusOr<torch::Device> ParseDevice(const std::string& name) {
  if (name == "cpu") return torch::Device(torch::kCPU);
  if (name == "cuda" || name == "auto") {
    if (torch::cuda::is_available()) return torch::Device(torch::kCUDA);
    if (name == "cuda") return absl::FailedPreconditionError("--device cuda: no CUDA device is visible");
    return torch::Device(torch::kCPU);
  }
  return absl::InvalidArgumentError(absl::StrCat("--device must be auto, cpu or cuda, got '", name, "'"));
}

std::vector<HostTensor> ToHostTensors(OryxModel& model, DType dtype) {
  std::vector<HostTensor> out;
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : model->NamedTensors()) {
    auto cpu = tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    std::vector<int64_t> shape(cpu.sizes().begin(), cpu.sizes().end());
    out.push_back(MakeHostTensor(name, shape, std::span<const float>(cpu.data_ptr<float>(), cpu.numel()), dtype));
  }
  return out;
}

absl::Status ExportCheckpoint(OryxModel& model, const std::string& dir, const std::string& tokenizer_path,
                              DType dtype, uint64_t max_shard_bytes) {
  std::vector<HostTensor> tensors = ToHostTensors(model, dtype);
  std::vector<TensorView> views = Views(tensors);
  return WriteCheckpoint(dir, model->config(), views, max_shard_bytes, tokenizer_path);
}

absl::Status LoadWeights(const Checkpoint& checkpoint, OryxModel& model) {
  if (!SameArchitecture(checkpoint.config(), model->config())) {
    return absl::InvalidArgumentError(
        absl::StrCat(checkpoint.dir(), ": config differs from the model it is loaded into"));
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : model->NamedTensors()) {
    ORYX_ASSIGN_OR_RETURN(std::vector<float> values, checkpoint.TensorAsFloats(name));
    if (static_cast<int64_t>(values.size()) != tensor.numel()) {
      return absl::InvalidArgumentError(absl::StrCat(checkpoint.FileOf(name), ": tensor '", name, "' has ",
                                                     values.size(), " values, the model expects ", tensor.numel()));
    }
    auto src = torch::from_blob(values.data(), tensor.sizes(), torch::kFloat32);
    tensor.copy_(src);
  }
  return absl::OkStatus();
}

absl::StatusOr<OryxModel> LoadModel(const std::string& dir, torch::Device device) {
  ORYX_ASSIGN_OR_RETURN(Checkpoint checkpoint, LoadCheckpoint(dir));
  OryxModel model(checkpoint.config(), /*seed=*/0);
  ORYX_RETURN_IF_ERROR(LoadWeights(checkpoint, model));
  model->to(device);
  return model;
}

}  // namespace oryx::train
