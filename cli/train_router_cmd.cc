// `oryx train-router`: trains a learned routing policy file (train/train_router.h).
#include <iostream>

#include "absl/strings/numbers.h"
#include "cli/commands.h"
#include "base/flags.h"
#include "base/status_macros.h"
#include "train/train_router.h"

namespace oryx::cli {

int RunTrainRouter(const Args& args) {
  policies::TrainRouterOptions o;
  std::string lengths = "256,512,1024", hidden = "32,32", lambdas = "1", drafts, rules = "budget:0.1,match:8";
  int64_t seed = static_cast<int64_t>(o.seed), threads = 0;
  FlagSet f("oryx train-router --model DIR --out FILE --data DIR|--haystack FILE... [--lambda L1,L2...]",
            "Trains a routing policy for learned:FILE. Episodes run through the engine: needle-in-a-haystack\n"
            "(the prompt routed in segments, the answer generated greedily), text (held-out text continued;\n"
            "quality = agreement with the all-attention continuation) and MQAR (teacher-forced; quality =\n"
            "queries right). Reward = quality - lambda * cost, the cost relative to all-attention: the share\n"
            "of tokens in attention mode, or the time the cost model predicts (calibrated here), or the bytes\n"
            "moved (a bandwidth-bound GPU). With --draft-lengths the policy also chooses, per decode step in\n"
            "attention mode, whether and how far to speculate. A supervised warm start from counterfactual\n"
            "labels (each decision of prefill-linear flipped once; the answer decoded in attention mode, in\n"
            "linear mode or gated by entropy, the best of those labelling its decode decisions; each draft\n"
            "length tried), then REINFORCE with a leave-one-out baseline and an entropy bonus. With several\n"
            "lambdas, one policy file each (FILE-lambdaL.ext). Writes FILE.log.jsonl and FILE.state (for\n"
            "--resume) as it goes; with --eval-examples, ends with a held-out comparison against the rule\n"
            "policies, and over the tasks together, which rules a learned policy dominates (higher quality at\n"
            "no more cost).\n"
            "--eval-only runs that comparison on the files of a finished run.");
  f.String("model", &o.model_dir, "model directory (config.json, weights, tokenizer.model)", true);
  f.String("out", &o.out_path, "the policy file to write (.safetensors)", true);
  f.String("data", &o.data_dir, "prepared corpus: haystacks from its train split (held out from the benchmark)");
  f.StringList("haystack", &o.haystack_files, "haystack from these text files instead of --data");
  f.StringList("tasks", &o.tasks, "episode tasks: niah, niah-multikey, passkey, mqar, text");
  f.String("lengths", &lengths, "prompt lengths, comma-separated");
  f.String("lambda", &lambdas, "cost weights to sweep, comma-separated (reward = quality - lambda * cost)");
  f.String("cost", &o.cost, "cost of an episode relative to all-attention: attention (token share), time, bytes");
  f.String("draft-lengths", &drafts, "draft lengths the policy chooses from in decode, e.g. 0,2,4 (0: no speculation); the "
           "comparison adds the rules speculative:K and prefill-linear+speculative:K for each K > 0");
  f.Int("continuation", &o.continuation, "tokens a text episode generates", 1, 1 << 16);
  f.Int("eval-examples", &o.eval_examples, "held-out examples per task for the final comparison (0: none)", 0, 1 << 20);
  f.String("eval-rules", &rules,
           "rule policies in the comparison, comma-separated (entropy:TAU budget:F match:L tail:N random:F)");
  f.Bool("eval-only", &o.eval_only, "train nothing: evaluate the policy files of a finished run (needs --eval-examples)");
  f.Int("segment-len", &o.segment_len, "prefill tokens per routing decision", 1, 1 << 20);
  f.Int("segment-tail", &o.tail_len,
        "cut the prompt's last --segment-len tokens finer, into segments ending N, 2N, 4N, ... tokens before its "
        "last token, so that the policy can attend to the last few alone (0: off; below --segment-len)",
        0, 1 << 20);
  f.Bool("warm-tail", &o.warm_tail,
         "with --segment-tail N: the warm start's counterfactuals also flip each decision of the rule tail:N, not "
         "only those of prefill-linear, all-linear and all-attention");
  f.Bool("warm-imitate", &o.warm_imitate,
         "with --warm-tail: the warm start imitates, for each of its examples, the best of the rules tail:N, "
         "tail:2N, tail:4N and tail:8N at the lambda, instead of learning from flipped decisions (and runs no "
         "flipped episodes)");
  f.Bool("warm-margins", &o.warm_margins,
         "with --warm-imitate: label each band of the prompt's tail (and its start, and the decode phase) by the "
         "reward margin between the two neighbouring schedules of all-linear, prefill-linear, tail:N..8N and "
         "all-attention that differ in it, weighted by its size (the flips' cost-sensitive labels), instead of "
         "each example's best tail");
  f.String("hidden", &hidden, "hidden layer widths of the MLP, comma-separated");
  f.Int("warm-examples", &o.warm_examples, "examples for the counterfactual warm start", 0, 1 << 20);
  f.Int("warm-steps", &o.warm_steps, "optimiser steps of the warm start", 0, 1 << 20);
  f.Int("iterations", &o.iterations, "REINFORCE iterations per lambda", 0, 1 << 20);
  f.Int("validation-examples", &o.validation_examples,
        "greedy episodes per task, apart from training and held-out ones, that pick the network kept: the warm "
        "start's or an iteration's, whichever scores the highest reward (0: the last iteration's)",
        0, 1 << 20);
  f.Bool("validation-front", &o.validation_front,
         "with --validation-examples: also write each lambda's networks on its validation front (quality against "
         "cost) as FILE-lambdaL-iterN.ext, and compare them with the rules too (also with --eval-only)");
  f.Int("batch", &o.batch, "examples per iteration", 1, 4096);
  f.Int("samples", &o.samples, "sampled episodes per example (>= 2)", 2, 64);
  f.Double("lr", &o.learning_rate, "Adam learning rate");
  f.Double("entropy-bonus", &o.entropy_bonus, "weight of the policy entropy in the objective");
  f.Double("explore", &o.exploration, "exploration floor e in [0, 1): episodes attend with probability e/2 + (1-e) p");
  f.Int("seed", &seed, "seed of the episodes and the sampling", 0);
  f.Int("threads", &threads, "CPU threads (0: all)", 0, 1024);
  f.String("device", &o.device, "where episodes run: cpu | cuda (then the time cost is the GPU's)");
  f.Bool("resume", &o.resume, "go on from FILE.state");
  f.String("log", &o.log_path, "JSON-lines log (default FILE.log.jsonl; --resume and --eval-only append to it)");
  return RunWithFlags(f, args, [&]() -> absl::Status {
    o.seed = static_cast<uint64_t>(seed);
    o.threads = static_cast<int>(threads);
    if (o.data_dir.empty() && o.haystack_files.empty()) {
      return absl::InvalidArgumentError("train-router: give --data DIR or --haystack FILE...");
    }
    ORYX_ASSIGN_OR_RETURN(std::vector<int64_t> parsed, ParsePositiveInts({lengths}, "--lengths"));
    o.lengths.assign(parsed.begin(), parsed.end());
    ORYX_ASSIGN_OR_RETURN(o.hidden, ParsePositiveInts({hidden}, "--hidden"));
    for (const std::string& item : SplitList({drafts})) {
      int64_t k = 0;
      if (!absl::SimpleAtoi(item, &k)) return absl::InvalidArgumentError("--draft-lengths: '" + item + "' is not an integer");
      o.draft_lengths.push_back(k);
    }
    o.eval_rules = SplitList({rules});
    if (o.warm_tail && o.tail_len == 0) return absl::InvalidArgumentError("--warm-tail needs --segment-tail N");
    if (o.warm_imitate && !o.warm_tail) return absl::InvalidArgumentError("--warm-imitate needs --warm-tail");
    if (o.warm_margins && !o.warm_imitate) return absl::InvalidArgumentError("--warm-margins needs --warm-imitate");
    if (!(o.exploration >= 0 && o.exploration < 1)) return absl::InvalidArgumentError("--explore must be in [0, 1)");
    if (o.validation_front && o.validation_examples == 0 && !o.eval_only) {
      return absl::InvalidArgumentError("--validation-front needs --validation-examples N (N >= 1)");
    }
    o.lambdas.clear();
    for (const std::string& item : SplitList({lambdas})) {
      double v = 0;
      if (!absl::SimpleAtod(item, &v) || !(v >= 0)) {
        return absl::InvalidArgumentError("--lambda: '" + item + "' is not a number >= 0");
      }
      o.lambdas.push_back(v);
    }
    return policies::TrainRouter(o);
  });
}

}  // namespace oryx::cli
