#include "train/pareto.h"

namespace oryx::policies {

Dominance Compare(const QualityCost& policy, const QualityCost& rule, DominanceTolerance tolerance) {
  const double gain = policy.quality - rule.quality, saving = rule.cost - policy.cost;
  if (gain < 0 || saving < 0 || (gain == 0 && saving == 0)) return Dominance::kNone;
  return gain >= tolerance.quality || saving >= tolerance.cost ? Dominance::kClear : Dominance::kTie;
}

}  // namespace oryx::policies
