// LibTorch's token-by-token decode of the reference model, timed, for `oryx bench decode` (LibTorch builds).
#pragma once

#include "bench/engine_bench.h"

namespace oryx::bench {

// Loads the checkpoint into the LibTorch model on the CPU; the timer prefills token by token (so it answers
// only for contexts up to max_context) and returns the median of `steps` decode steps.
absl::StatusOr<ReferenceTimer> MakeTorchReference(const std::string& model_dir, int64_t max_context, int64_t steps,
                                                  int threads);

}  // namespace oryx::bench
