#include "bench/decode_reference.h"

#include <chrono>
#include <memory>

#include "bench/bench_util.h"
#include "base/status_macros.h"
#include "train/torch_io.h"

namespace oryx::bench {

absl::StatusOr<ReferenceTimer> MakeTorchReference(const std::string& model_dir, int64_t max_context, int64_t steps,
                                                  int threads) {
  if (threads > 0) torch::set_num_threads(threads);
  ORYX_ASSIGN_OR_RETURN(train::OryxModel loaded, train::LoadModel(model_dir, torch::kCPU));
  auto model = std::make_shared<train::OryxModel>(std::move(loaded));
  (*model)->eval();
  return ReferenceTimer([model, max_context, steps](Mode mode, int64_t context, int64_t batch) -> std::optional<double> {
    if (context > max_context) return std::nullopt;
    torch::NoGradGuard no_grad;
    auto state = (*model)->InitialState(batch);
    auto attend = torch::full({batch}, true, torch::kBool);
    auto step_mode = torch::full({batch}, mode == Mode::kAttention, torch::kBool);
    const int64_t V = (*model)->config().vocab_size;
    for (int64_t t = 0; t < context; ++t) (*model)->StepReference(torch::full({batch}, 4 + (t * 7919) % (V - 4)), attend, state);
    std::vector<double> s;
    for (int64_t i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      (*model)->StepReference(torch::full({batch}, int64_t{5}), step_mode, state);
      s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return Median(s);
  });
}

}  // namespace oryx::bench
