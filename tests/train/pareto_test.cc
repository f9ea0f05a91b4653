// The router trainer's comparison of a learned policy with a rule (train/pareto.h).
#include "train/pareto.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

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

TEST(PairedQualityGain, TheExamplesDifficultyDropsOut) {
  // Two tasks of 4 examples. The policy is 0.1 better on every example of task 0, whatever its difficulty, and
  // the same as the rule on task 1: a gain of 0.05 with no error at all, although each policy's own mean
  // quality varies by 0.3-0.4 over the examples.
  const std::vector<std::vector<double>> rule = {{0.1, 0.5, 0.9, 0.3}, {1, 0, 1, 0}};
  const std::vector<std::vector<double>> policy = {{0.2, 0.6, 1.0, 0.4}, {1, 0, 1, 0}};
  const PairedGain g = PairedQualityGain(policy, rule);
  EXPECT_NEAR(g.mean, 0.05, 1e-12);
  EXPECT_NEAR(g.standard_error, 0, 1e-12);
}

TEST(PairedQualityGain, ErrorOfTheMeanDifferenceWeighedByTask) {
  // Task 0: differences +1, -1, +1, -1 (mean 0, sample variance 4/3); task 1: +1, +1 (mean 1, no variance).
  // Mixed: 0.5 * 0 + 0.5 * 1 = 0.5, error sqrt(0.25 * (4/3) / 4) = sqrt(1/12).
  const PairedGain g = PairedQualityGain({{1, 0, 1, 0}, {1, 1}}, {{0, 1, 0, 1}, {0, 0}});
  EXPECT_NEAR(g.mean, 0.5, 1e-12);
  EXPECT_NEAR(g.standard_error, std::sqrt(1.0 / 12), 1e-12);
  // A task of one example adds to the mean and nothing to the error; no tasks is no gain.
  EXPECT_NEAR(PairedQualityGain({{0.75}}, {{0.25}}).mean, 0.5, 1e-12);
  EXPECT_EQ(PairedQualityGain({{0.75}}, {{0.25}}).standard_error, 0);
  EXPECT_EQ(PairedQualityGain({}, {}).mean, 0);
}

}  // namespace
}  // namespace oryx::policies
