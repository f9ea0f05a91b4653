// The CUDA side of a training step for `oryx train`: the optimizer and the gradient clipping as a few
// multi-tensor kernels over all parameters, and a micro-batch's forward + backward recorded once as a CUDA
// graph and replayed. In LibTorch's eager mode every op of the step costs host time to dispatch; a
// graph replay costs one launch.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

namespace oryx::train {

// AdamW (decoupled weight decay) over the groups and state of a torch::optim::AdamW, one fused
// multi-tensor kernel per group. The moments and step counts live in the wrapped optimizer's state, so
// its checkpoints (torch::save / torch::load) are unchanged; build this after loading one.
class FusedAdamW {
 public:
  explicit FusedAdamW(torch::optim::AdamW& optimizer) : optimizer_(optimizer) {}

  // One step at learning rate lr for the parameters with a gradient for which `use` holds.
  void Step(double lr, const std::function<bool(const torch::Tensor&)>& use);

 private:
  torch::optim::AdamW& optimizer_;
  std::unordered_map<const void*, torch::Tensor> steps_;  // per parameter: its step count, on its device
};

// Scales the gradients of `params` (those that have one) so that their joint 2-norm is at most max_norm,
// as torch::nn::utils::clip_grad_norm_ does, and returns the norm before scaling as a 0-d tensor on the
// device: no host synchronisation.
torch::Tensor ClipGradNormFused(const std::vector<torch::Tensor>& params, double max_norm);

// Makes a fresh CUDA stream current for its lifetime. CUDA graphs are recorded on a stream other than the
// default one; running the whole training loop on that stream keeps every op in one order. Does nothing
// for a CPU device.
class TrainingStream {
 public:
  explicit TrainingStream(torch::Device device);
  ~TrainingStream();
  TrainingStream(const TrainingStream&) = delete;
  TrainingStream& operator=(const TrainingStream&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Forward + backward of micro-batches of one shape. The first `warmup` calls run eagerly (cuBLAS, cuDNN
// and the allocator settle), the next one records a CUDA graph, and every call from then on copies its
// batch into the recorded input tensors and replays the graph. Gradients add into the parameters' .grad
// tensors, which must exist before the recording and must never be reset to none (zero them in place).
// Needs a TrainingStream; loss() must not synchronise with the host.
class GraphedBackward {
 public:
  using LossFn = std::function<torch::Tensor(const torch::Tensor& inputs, const torch::Tensor& targets,
                                             const torch::Tensor& is_attn)>;
  GraphedBackward(LossFn loss, int warmup);
  ~GraphedBackward();

  // Adds d loss / d parameter to the gradients; returns the loss (a 0-d tensor on the device).
  torch::Tensor Run(const torch::Tensor& inputs, const torch::Tensor& targets, const torch::Tensor& is_attn);
  bool recorded() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace oryx::train
