// The router trainer's comparison of a learned policy with a rule (train/pareto.h).
#include "train/pareto.h"

#include <gtest/gtest.h>

namespace oryx::policies {
namespace {

TEST(Compare, BetterOnOneAxisByItsToleranceIsClear) {
  EXPECT_EQ(Compare({0.70, 0.50}, {0.69, 0.50}), Dominance::kClear);  // +1 point, same cost
  EXPECT_EQ(Compare({0.69, 0.49}, {0.69, 0.50}), Dominance::kClear);  // same quality, 1% cheaper
  EXPECT_EQ(Compare({0.687, 0.142}, {0.674, 0.155}), Dominance::kClear);
}

TEST(Compare, WorseOnEitherAxisIsNone) {
  EXPECT_EQ(Compare({0.90, 0.51}, {0.70, 0.50}), Dominance::kNone);  // much better, a little dearer
  EXPECT_EQ(Compare({0.69, 0.10}, {0.70, 0.50}), Dominance::kNone);  // much cheaper, a little worse
  EXPECT_EQ(Compare({0.70, 0.50}, {0.70, 0.50}), Dominance::kNone);  // the same point
}

// The H200 case: one decision away from prefill-linear, by the plain definition dominating it.
TEST(Compare, MarginsBelowBothTolerancesAreATie) {
  EXPECT_EQ(Compare({0.64034, 0.751408}, {0.64016, 0.751416}), Dominance::kTie);
  EXPECT_EQ(Compare({0.699, 0.0168}, {0.699, 0.0170}), Dominance::kTie);
  // With no tolerance the same margins count.
  EXPECT_EQ(Compare({0.64034, 0.751408}, {0.64016, 0.751416}, {.quality = 0, .cost = 0}), Dominance::kClear);
}

}  // namespace
}  // namespace oryx::policies
