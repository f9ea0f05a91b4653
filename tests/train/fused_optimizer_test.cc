// The fused AdamW and gradient clipping of the CUDA training path (train/cuda_step.h) against LibTorch's
// torch::optim::AdamW and clip_grad_norm_, on the CPU and, where there is one, on the GPU.
#include <torch/torch.h>

#include <vector>

#include "gtest/gtest.h"
#include "train/cuda_step.h"

namespace oryx::train {
namespace {

class FusedOptimizerTest : public ::testing::TestWithParam<torch::Device> {};

// Two copies of the same parameters, one for each optimizer.
std::vector<torch::Tensor> RandomParams(uint64_t seed, torch::Device device) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> ps = {torch::randn({37, 19}), torch::randn({5}), torch::randn({64, 3}), torch::randn({7})};
  for (auto& p : ps) p = p.to(device).requires_grad_(true);
  return ps;
}

std::unique_ptr<torch::optim::AdamW> MakeAdamW(const std::vector<torch::Tensor>& ps) {
  auto opts = [](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(wd).eps(1e-8));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{ps[0], ps[2]}, opts(0.1));
  groups.emplace_back(std::vector<torch::Tensor>{ps[1], ps[3]}, opts(0.0));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(1e-2));
}

TEST_P(FusedOptimizerTest, AdamWMatchesTorchAdamWAndSkipsWhatItIsTold) {
  const torch::Device device = GetParam();
  auto ref = RandomParams(3, device), fused = RandomParams(3, device);
  auto ref_opt = MakeAdamW(ref), fused_opt = MakeAdamW(fused);
  FusedAdamW fused_step(*fused_opt);
  const auto skipped = fused[3].unsafeGetTensorImpl();
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(100 + step);
    for (size_t i = 0; i < ref.size(); ++i) {
      auto g = torch::randn(ref[i].sizes()).to(device);
      // The reference skips parameter 3 because it has no gradient; the fused one because it is told to.
      if (i == 3) {
        ref[i].mutable_grad() = torch::Tensor();
        fused[i].mutable_grad() = torch::zeros_like(fused[i]);
      } else {
        ref[i].mutable_grad() = g.clone();
        fused[i].mutable_grad() = g.clone();
      }
    }
    const double lr = 1e-2 * (step + 1);
    for (auto& g : ref_opt->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    ref_opt->step();
    fused_step.Step(lr, [&](const torch::Tensor& p) { return p.unsafeGetTensorImpl() != skipped; });
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = (ref[i] - fused[i]).abs().max().item<double>();
    EXPECT_LE(err, 1e-5 * (ref[i].abs().max().item<double>() + 1)) << "parameter " << i;
    const auto it = fused_opt->state().find(fused[i].unsafeGetTensorImpl());
    if (i == 3) {
      EXPECT_EQ(it, fused_opt->state().end()) << "a skipped parameter got optimizer state";
      continue;
    }
    ASSERT_NE(it, fused_opt->state().end());
    EXPECT_EQ(static_cast<torch::optim::AdamWParamState&>(*it->second).step(), 5);
    const auto& want = static_cast<torch::optim::AdamWParamState&>(*ref_opt->state()[ref[i].unsafeGetTensorImpl()]);
    const auto& got = static_cast<torch::optim::AdamWParamState&>(*it->second);
    EXPECT_LE((want.exp_avg_sq() - got.exp_avg_sq()).abs().max().item<double>(),
              1e-5 * want.exp_avg_sq().abs().max().item<double>());
  }
}

TEST_P(FusedOptimizerTest, ClippingMatchesClipGradNorm) {
  const torch::Device device = GetParam();
  for (double max_norm : {0.5, 1e6}) {  // clipping, and a bound the gradients are inside of
    auto ref = RandomParams(7, device), fused = RandomParams(7, device);
    torch::manual_seed(8);
    for (size_t i = 0; i < ref.size(); ++i) {
      auto g = torch::randn(ref[i].sizes()).to(device);
      ref[i].mutable_grad() = g.clone();
      fused[i].mutable_grad() = g.clone();
    }
    const double want = torch::nn::utils::clip_grad_norm_(ref, max_norm);
    const double got = ClipGradNormFused(fused, max_norm).item<double>();
    EXPECT_NEAR(got, want, 1e-5 * want);
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_LE((ref[i].grad() - fused[i].grad()).abs().max().item<double>(), 1e-6) << "max_norm " << max_norm;
    }
  }
}

std::vector<torch::Device> Devices() {
  std::vector<torch::Device> d = {torch::kCPU};
  if (torch::cuda::is_available()) d.emplace_back(torch::kCUDA, 0);
  return d;
}

INSTANTIATE_TEST_SUITE_P(Devices, FusedOptimizerTest, ::testing::ValuesIn(Devices()),
                         [](const auto& info) { return info.param.is_cuda() ? "cuda" : "cpu"; });

}  // namespace
}  // namespace oryx::train
