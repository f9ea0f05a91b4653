// `oryx train-router` (DESIGN.md §7): trains a learned routing policy (policies/learned_policy.h) by
// running episodes through the engine.
//
// Episodes:
//   - needle tasks (single, multi-key, passkey): the prompt routed segment by segment (segment_len tokens;
//     the prompt's last token alone), then the answer generated greedily with a decision per token (or per
//     speculative round). Quality: the share of the answer's tokens generated right, position by position.
//   - text: a window of held-out text (the corpus's validation split) continued for `continuation` tokens;
//     quality: the share of tokens that agree with the all-attention greedy continuation of the prompt. This
//     is where speculation matters: it keeps quality (it is lossless) and changes the cost. The share is
//     of the tokens before the first difference: after it the texts differ and a match is noise.
//   - MQAR (answers inside the sequence): the whole sequence routed as a prompt and teacher-forced; quality:
//     the share of queries answered right.
// Haystacks and text come from sources the router benchmark does not use, with seeds disjoint from its grid.
//
// Reward = quality - lambda * cost, the cost relative to the same episode run all in attention mode:
//   attention  the share of tokens run in attention mode;
//   time       the seconds the router's cost model (calibrated here, on this machine's backend) predicts for
//              the episode's forwards: prefill segments, decode steps, and speculative rounds (k linear
//              draft steps and a verify span of k + 1 tokens);
//   bytes      the same forwards costed by the bytes they move (router::SpanBytes): a bandwidth-bound GPU.
// Actions: the mode of each segment and decode step; with draft lengths (two or more, 0 = no speculation),
// also the draft length of each decode step in attention mode (a speculative round when > 0).
//
// Training, for each lambda of the sweep:
//   1. Warm start from counterfactual labels. Mode head: for each warm-start example and each base
//      schedule (prefill-linear: the prompt linear, its last token and the answer in attention mode;
//      all-linear; all-attention; with warm_tail a fourth, the rule tail:<tail_len>), the base episode and
//      one episode per decision with that decision flipped, and prefill-linear with its whole decode phase
//      flipped to linear; a decision is labelled attention when attention there beats linear by more than
//      lambda times what it costs, and weighted by the size of that margin (cost-sensitive: the classifier
//      follows the expected gain, not the majority of examples, where most single flips change nothing).
//      With warm_imitate the mode head instead learns, for each warm-start example, the decisions of the
//      best rule tail:T at the lambda among T = tail_len, 2, 4 and 8 times it (imitation, every decision
//      alike; no flipped episodes are run): REINFORCE starts at a rule's point, or at a tail whose length
//      follows the prompt where the examples' best tails differ. With warm_margins too, each example's
//      schedules form a chain, each attending a superset of the one before (all-linear, prefill-linear, the
//      four tails, all-attention), and where two neighbours differ (a band of the prompt's tail, its start, or
//      the decode phase) the decisions are labelled as flips are, by the sign and size of the reward margin
//      between them: the classifier then follows each band's expected gain over the examples, where the best
//      tail of most examples may be the shortest by a hair.
//      Draft head: each generated warm-start example run prefill-linear with every draft length; its decode
//      decisions are labelled with the best length's, weighted by how much better it is than the others'
//      mean.
//   2. REINFORCE: batches of examples, `samples` sampled episodes each (modes sampled with an exploration
//      floor: attention with probability e/2 + (1 - e) p; draft lengths from the head), advantage = reward
//      minus the mean reward of the example's other samples (leave-one-out), plus an entropy bonus.
//   3. With validation_examples: after the warm start and each iteration, the greedy policy's mean reward on
//      validation examples ("phase": "validation"); the policy file keeps the best of those networks.
// Every iteration appends a JSON line to the log and saves the training state atomically (--resume goes on
// from it); the policy file is written at the end of each lambda. With eval_examples, the trained policies
// and the rule baselines are then run on held-out examples (log lines with "phase": "eval", and a table),
// then over the mixed workload (every task weighted alike: "phase": "eval_mixed"), where each rule is checked
// for a learned policy that dominates it: quality at least as high at a cost at most as high, better on one
// by at least a tolerance (train/pareto.h; better by less is a tie, listed apart) ("phase": "pareto").
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
  int64_t tail_len = 0;  // > 0: the prompt's last segment cut finer (router::PrefillSegmentTokens)
  bool warm_tail = false;  // with tail_len: the rule tail:<tail_len> is a fourth counterfactual base
  bool warm_imitate = false;  // with warm_tail: the warm start imitates each example's best tail rule instead
  bool warm_margins = false;  // with warm_imitate: labels from the reward margins along each example's chain
  std::vector<double> lambdas = {1.0};
  std::string cost = "attention";           // attention | time | bytes
  std::vector<int64_t> draft_lengths;       // the draft head's choices (empty: the router never speculates)
  int64_t continuation = 32;                // tokens generated by a text episode
  int64_t eval_examples = 0;                // held-out examples per task for the final evaluation
  // Rule policies (policies/rule_policies.h: entropy:TAU, budget:F, match:L, tail:N, random:F) the evaluation runs
  // beside attention, linear, prefill-linear and speculative:K.
  std::vector<std::string> eval_rules = {"budget:0.1", "match:8"};
  bool eval_only = false;  // no training: evaluate the policy files a finished run wrote
  std::vector<int64_t> hidden = {32, 32};
  int64_t warm_examples = 48;
  int64_t warm_steps = 300;
  int64_t iterations = 20;
  int64_t batch = 16;    // examples per iteration
  int64_t samples = 4;   // sampled episodes per example
  double learning_rate = 3e-3;
  double entropy_bonus = 0.01;
  double exploration = 0.1;  // e above, in [0, 1)
  // Greedy episodes per task, from a stream of their own, that choose which network a lambda's policy file
  // keeps: the warm start's or one of the REINFORCE iterations', the highest mean reward. 0: the last one.
  int64_t validation_examples = 0;
  // With validation examples: also write each lambda's networks on its validation front (no other check of
  // that lambda has at least their quality at no more cost, one of them better) as FILE-lambdaL-iterN.ext,
  // and evaluate them with the lambda's policy. More candidates judged on the same held-out examples: a
  // candidate may beat a rule by chance by about a standard error.
  bool validation_front = false;
  uint64_t seed = 1;
  int threads = 0;
  // Where the episodes run: cpu, or cuda (the CUDA backend: long episodes at GPU speed, and the `time` cost
  // calibrated on the device the policy will serve on). The policy network trains on the CPU either way.
  std::string device = "cpu";
  bool resume = false;
  std::string log_path;  // default: out_path + ".log.jsonl" (appended to with resume or eval_only)
};

// The policy file path for lambda number `index` of the sweep: out_path itself when there is one lambda,
// else out_path with "-lambda<value>" before its extension.
std::string PolicyPathFor(const TrainRouterOptions& options, size_t index);
// The file of the network after `iteration` on lambda `index`'s validation front: PolicyPathFor with
// "-iter<iteration>" before its extension.
std::string FrontPathFor(const TrainRouterOptions& options, size_t index, int64_t iteration);

absl::Status TrainRouter(const TrainRouterOptions& options);

}  // namespace oryx::policies
