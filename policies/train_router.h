// `oryx train-router` (DESIGN.md §7): trains a learned routing policy (policies/learned_policy.h) by
// running episodes through the engine.
//
// Episodes are retrieval tasks (needle-in-a-haystack, single and multi-key, and MQAR) built on a haystack
// that the router benchmark does not use, with seeds disjoint from its grid. A needle episode is the task's
// prompt routed segment by segment (segment_len tokens; the prompt's last token alone), then the answer
// generated greedily with a decision per token; its quality is the share of the answer's tokens generated
// right (position by position: exact match with partial credit, which gives a decision on one answer token
// its own signal). An MQAR episode (answers inside the sequence) is the whole sequence routed as a prompt
// and teacher-forced; its quality is the share of queries answered right. Reward = quality - lambda * cost,
// where cost is the episode's share of tokens run in attention mode.
//
// Training, for each lambda of the sweep:
//   1. Warm start from counterfactual labels: for each warm-start example and each of two base schedules
//      (prefill-linear: the prompt linear, its last token and the answer in attention mode; all-linear),
//      the base episode and one episode per decision with that decision flipped. A decision is labelled
//      attention when attention there beats linear by more than lambda times the tokens it costs, and
//      weighted by the size of that margin (cost-sensitive: the classifier follows the expected gain, not
//      the majority of examples, where most single flips change nothing). Weighted cross-entropy on the
//      labels, from the features the base episode saw.
//   2. REINFORCE: batches of examples, `samples` sampled episodes each (sampled with an exploration floor:
//      attention with probability e/2 + (1 - e) p), advantage = reward minus the mean reward of the
//      example's other samples (leave-one-out), plus an entropy bonus.
// Every iteration appends a JSON line to the log and saves the training state atomically (--resume goes on
// from it); the policy file is written at the end of each lambda.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace oryx::policies {

struct TrainRouterOptions {
  std::string model_dir;
  std::string out_path;                     // the policy file; with several lambdas, one file per lambda
  std::string data_dir;                     // haystack: the corpus's train split, or
  std::vector<std::string> haystack_files;  // these text files
  std::vector<std::string> tasks = {"niah-multikey", "niah", "mqar"};
  std::vector<int32_t> lengths = {256, 512, 1024};
  int64_t segment_len = 64;
  std::vector<double> lambdas = {1.0};
  std::vector<int64_t> hidden = {32, 32};
  int64_t warm_examples = 48;
  int64_t warm_steps = 300;
  int64_t iterations = 20;
  int64_t batch = 16;    // examples per iteration
  int64_t samples = 4;   // sampled episodes per example
  double learning_rate = 3e-3;
  double entropy_bonus = 0.01;
  double exploration = 0.1;  // e above, in [0, 1)
  uint64_t seed = 1;
  int threads = 0;
  bool resume = false;
  std::string log_path;  // default: out_path + ".log.jsonl"
};

// The policy file path for lambda number `index` of the sweep: out_path itself when there is one lambda,
// else out_path with "-lambda<value>" before its extension.
std::string PolicyPathFor(const TrainRouterOptions& options, size_t index);

absl::Status TrainRouter(const TrainRouterOptions& options);

}  // namespace oryx::policies
