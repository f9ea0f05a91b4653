// Policies compared on two axes, quality (higher is better) and cost (lower is better): how `oryx
// train-router` judges a learned policy against each rule on held-out episodes.
#pragma once

#include <vector>

namespace oryx::policies {

struct QualityCost {
  double quality = 0;
  double cost = 0;
};

// How a policy stands against a rule.
enum class Dominance {
  kNone,   // worse on some axis, or equal on both
  kTie,    // no worse on either axis and better on one, but by less than the tolerances on both
  kClear,  // no worse on either axis, and better on one by at least its tolerance
};

// Below these margins a "better" is noise, not a gain: a thousandth of all-attention's cost, half a point
// of quality (held-out standard errors are 1-5 points). On the H200, a policy one decision away from
// prefill-linear scored +0.0002 quality at -0.00001 cost, which plain dominance counts.
struct DominanceTolerance {
  double quality = 0.005;
  double cost = 0.001;
};

Dominance Compare(const QualityCost& policy, const QualityCost& rule, DominanceTolerance tolerance = {});

// How much better a policy's quality is than a rule's on the same held-out examples, with the standard error
// of that difference: each example's difference counts, so what the examples share (their difficulty, which
// moves both policies alike) drops out. Where the two fail on different examples the error is still about
// either mean's (at CPU scale, 0.031 against 0.019-0.028 on 32 examples a task).
struct PairedGain {
  double mean = 0;
  double standard_error = 0;
};

// policy[t][i] and rule[t][i]: the qualities on example i of task t, the same examples for both; the tasks
// weigh alike (the mixed workload). Tasks with fewer than 2 examples add no error.
PairedGain PairedQualityGain(const std::vector<std::vector<double>>& policy,
                             const std::vector<std::vector<double>>& rule);

}  // namespace oryx::policies
