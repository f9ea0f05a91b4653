// The CUDA side of a training step: fused AdamW, fused clipping, and the CUDA graph of a micro-batch.
#include "train/cuda_step.h"

#include <ATen/autocast_mode.h>

#include <optional>

#if defined(ORYX_TORCH_CUDA)
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace oryx::train {

void FusedAdamW::Step(double lr, const std::function<bool(const torch::Tensor&)>& use) {
  for (auto& group : optimizer_.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    std::vector<torch::optim::AdamWParamState*> states;
    for (auto& p : group.params()) {
      if (!p.grad().defined() || !use(p)) continue;
      auto& slot = optimizer_.state()[p.unsafeGetTensorImpl()];
      if (slot == nullptr) {  // as torch::optim::AdamW creates it on a parameter's first step
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(0);
        s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& state = static_cast<torch::optim::AdamWParamState&>(*slot);
      auto [it, fresh] = steps_.try_emplace(p.unsafeGetTensorImpl());
      if (fresh) {
        it->second = torch::full({}, static_cast<double>(state.step()), p.options().dtype(torch::kFloat32));
      }
      params.push_back(p);
      grads.push_back(p.grad());
      exp_avgs.push_back(state.exp_avg());
      exp_avg_sqs.push_back(state.exp_avg_sq());
      steps.push_back(it->second);
      states.push_back(&state);
    }
    if (params.empty()) continue;
    torch::NoGradGuard no_grad;
    at::_foreach_add_(steps, 1);
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr,
                      std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                      /*amsgrad=*/false, /*maximize=*/false);
    for (auto* s : states) s->step(s->step() + 1);  // the host copy, for checkpoints
  }
}

torch::Tensor ClipGradNormFused(const std::vector<torch::Tensor>& params, double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return torch::zeros({});
  torch::NoGradGuard no_grad;
  auto total = torch::linalg_vector_norm(torch::stack(at::_foreach_norm(grads, 2)), 2);
  auto coef = torch::clamp_max(max_norm / (total + 1e-6), 1.0);
  at::_foreach_mul_(grads, coef);
  return total;
}

namespace {

// The loss's forward and backward (run, or recorded into a graph under capture); the loss, detached.
torch::Tensor ForwardBackward(const GraphedBackward::LossFn& loss, const torch::Tensor& inputs,
                            const torch::Tensor& targets, const torch::Tensor& is_attn) {
  auto l = loss(inputs, targets, is_attn);
  l.backward();
  return l.detach();
}

}  // namespace

#if defined(ORYX_TORCH_CUDA)

struct TrainingStream::Impl {
  std::optional<c10::cuda::CUDAStreamGuard> guard;
};

TrainingStream::TrainingStream(torch::Device device) : impl_(std::make_unique<Impl>()) {
  if (!device.is_cuda()) return;
  // The side stream does not wait for the default one: finish what setup queued there (the weights'
  // copies to the device) first.
  c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
  impl_->guard.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()));
}

TrainingStream::~TrainingStream() {
  if (!impl_->guard) return;
  try {
    impl_->guard->current_stream().synchronize();  // before work goes back to the default stream
  } catch (const c10::Error&) {  // a destructor may not throw; an error here already failed the run
  }
}

struct GraphedBackward::Impl {
  LossFn loss;
  int warmup = 0;
  int calls = 0;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  torch::Tensor inputs, targets, is_attn, out;  // the recorded graph's inputs and loss
};

torch::Tensor GraphedBackward::Run(const torch::Tensor& inputs, const torch::Tensor& targets,
                                   const torch::Tensor& is_attn) {
  Impl& g = *impl_;
  if (g.calls++ < g.warmup) return ForwardBackward(g.loss, inputs, targets, is_attn);
  if (g.graph == nullptr) {
    g.inputs = inputs.clone();
    g.targets = targets.clone();
    g.is_attn = is_attn.clone();
    // The warm-up's activations sit in the allocator's cache, which the graph's private pool cannot use.
    c10::cuda::CUDACachingAllocator::emptyCache();
    // Autocast caches the bf16 copies of the weights; cached inside the capture they would outlive it.
    struct CacheOff {
      bool was = at::autocast::is_autocast_cache_enabled();
      CacheOff() { at::autocast::set_autocast_cache_enabled(false); }
      ~CacheOff() { at::autocast::set_autocast_cache_enabled(was); }
    } cache_off;
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    graph->capture_begin();
    g.out = ForwardBackward(g.loss, g.inputs, g.targets, g.is_attn);  // recorded, not run
    graph->capture_end();
    g.graph = std::move(graph);  // only a complete recording is kept
  } else {
    g.inputs.copy_(inputs, /*non_blocking=*/true);
    g.targets.copy_(targets, /*non_blocking=*/true);
    g.is_attn.copy_(is_attn, /*non_blocking=*/true);
  }
  g.graph->replay();
  return g.out.clone();  // the next replay overwrites g.out
}

#else  // LibTorch without CUDA: no CUDA device can be chosen, and every call runs eagerly.

struct TrainingStream::Impl {};
TrainingStream::TrainingStream(torch::Device) : impl_(std::make_unique<Impl>()) {}
TrainingStream::~TrainingStream() = default;

struct GraphedBackward::Impl {
  LossFn loss;
  int warmup = 0;
  int calls = 0;
  std::unique_ptr<int> graph;  // never recorded
};

torch::Tensor GraphedBackward::Run(const torch::Tensor& inputs, const torch::Tensor& targets,
                                   const torch::Tensor& is_attn) {
  return ForwardBackward(impl_->loss, inputs, targets, is_attn);
}

#endif

GraphedBackward::GraphedBackward(LossFn loss, int warmup) : impl_(std::make_unique<Impl>()) {
  impl_->loss = std::move(loss);
  impl_->warmup = warmup;
}
GraphedBackward::~GraphedBackward() = default;
bool GraphedBackward::recorded() const { return impl_->graph != nullptr; }

}  // namespace oryx::train
