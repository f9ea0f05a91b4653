// `oryx bench router` (DESIGN.md §8): routing policies on retrieval tasks, accuracy against the share of
// tokens run in attention mode, with random routing at matched shares and an oracle.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/engine_bench.h"

namespace oryx::bench {

struct RouterBenchOptions {
  std::string model_dir;
  std::string data_dir;                     // haystack from the corpus's validation split, or
  std::vector<std::string> haystack_files;  // from these text files
  std::vector<std::string> tasks = {"niah", "niah-multikey", "mqar"};
  std::vector<int32_t> lengths = {256, 512, 1024};
  std::vector<double> depths = {0.0, 0.25, 0.5, 0.75, 1.0};
  int32_t seeds = 4;
  uint64_t base_seed = 7;  // held-out: the evaluation grid's seeds, not the trainer's
  std::vector<std::string> policies = {"attention", "linear", "prefill-linear", "periodic:8", "periodic:32",
                                       "budget:0.02", "budget:0.05", "budget:0.1", "entropy:0.5", "entropy:2",
                                       "random:0.05", "random:0.1", "random:0.2"};
  bool oracle = true;  // attention on the 16-token segments holding the asked needle, the last prompt token
                       // and the answer; linear elsewhere
  int threads = 0;
};
// Routing policies on retrieval tasks, end to end: for the needle tasks each example's prompt is generated
// from by the engine with the policy (greedy), and the answer counts as right when the generated tokens
// equal it exactly; for MQAR (answers inside the sequence) the sequence is teacher-forced in the modes the
// policy gives it, and a query counts as right when each of its answer tokens is the argmax.
// One JSON line per (task, length, policy), then per (task, policy) summaries with the share of the
// all-linear -> all-attention gap recovered, and the best share at 5%, 10% and 20% attention.
absl::Status RunRouterBench(const RouterBenchOptions& options, const Emit& emit);

}  // namespace oryx::bench
