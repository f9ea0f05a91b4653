#include "train/pareto.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace oryx::policies {

Dominance Compare(const QualityCost& policy, const QualityCost& rule, DominanceTolerance tolerance) {
  const double gain = policy.quality - rule.quality, saving = rule.cost - policy.cost;
  if (gain < 0 || saving < 0 || (gain == 0 && saving == 0)) return Dominance::kNone;
  return gain >= tolerance.quality || saving >= tolerance.cost ? Dominance::kClear : Dominance::kTie;
}

PairedGain PairedQualityGain(const std::vector<std::vector<double>>& policy,
                             const std::vector<std::vector<double>>& rule) {
  PairedGain g;
  if (policy.empty()) return g;
  const double share = 1.0 / static_cast<double>(policy.size());
  double variance = 0;
  for (size_t t = 0; t < policy.size(); ++t) {
    const size_t n = std::min(policy[t].size(), rule[t].size());
    if (n == 0) continue;
    double sum = 0;
    for (size_t i = 0; i < n; ++i) sum += policy[t][i] - rule[t][i];
    const double mean = sum / static_cast<double>(n);
    g.mean += share * mean;
    if (n < 2) continue;
    double squares = 0;  // about the mean (two passes: a difference that never varies has no error)
    for (size_t i = 0; i < n; ++i) squares += std::pow(policy[t][i] - rule[t][i] - mean, 2);
    variance += share * share * squares / static_cast<double>(n - 1) / static_cast<double>(n);
  }
  g.standard_error = std::sqrt(variance);
  return g;
}

}  // namespace oryx::policies
