// The router trainer's decode-label weights (train/router_labels.h).
#include "train/router_labels.h"

#include <gtest/gtest.h>

#include <vector>

namespace oryx::policies {
namespace {

constexpr Mode A = Mode::kAttention, L = Mode::kLinear;

AnswerDecoding Decoding(const std::vector<Mode>& modes, double reward, int64_t first = 100) {
  AnswerDecoding d;
  d.reward = reward;
  for (size_t i = 0; i < modes.size(); ++i) d.modes[first + static_cast<int64_t>(i)] = modes[i];
  return d;
}

// A needle's answer: an entropy-gated decoding attends at the two answer tokens and wins; all-attention
// ties it but for the cost; all-linear misses the needle.
TEST(DecodeLabelWeights, AnAnswerTokenCarriesTheRegretOfTheDecodingThatRanItLinear) {
  const std::vector<AnswerDecoding> d = {Decoding({L, L, A, A, L, L}, 0.90),   // gated: the best
                                         Decoding({A, A, A, A, A, A}, 0.89),   // all attention
                                         Decoding({L, L, L, L, L, L}, 0.30)};  // all linear
  const std::map<int64_t, double> w = DecodeLabelWeights(d, 0);
  ASSERT_EQ(w.size(), 6u);
  // All-linear differs at the two answer tokens only: 0.6 shared by two.
  EXPECT_NEAR(w.at(102), 0.30, 1e-12);
  EXPECT_NEAR(w.at(103), 0.30, 1e-12);
  // Elsewhere all-attention is the decoding that chose otherwise: its 0.01 shared by four.
  for (int64_t p : {100, 101, 104, 105}) EXPECT_NEAR(w.at(p), 0.0025, 1e-12) << p;
}

TEST(DecodeLabelWeights, TheClosestDecodingThatChoseOtherwiseSetsTheWeight) {
  const std::vector<AnswerDecoding> d = {Decoding({A, A}, 0.5),   // the best
                                         Decoding({L, A}, 0.1),   // differs at 100 only: 0.4 a difference
                                         Decoding({L, L}, 0.3)};  // differs at both: 0.1 a difference
  const std::map<int64_t, double> w = DecodeLabelWeights(d, 0);
  EXPECT_NEAR(w.at(100), 0.1, 1e-12);
  EXPECT_NEAR(w.at(101), 0.1, 1e-12);
}

TEST(DecodeLabelWeights, PositionsWhereNoOtherDecodingChoseOtherwiseAreLeftOut) {
  // The best need not be first. Position 101 is attention in all; 103 is decided by no other decoding (a
  // speculative round covered it).
  std::vector<AnswerDecoding> d = {Decoding({L, A, L}, 0.2), Decoding({A, A, L, L}, 0.7)};
  d[0].modes.erase(102);
  const std::map<int64_t, double> w = DecodeLabelWeights(d, 1);
  EXPECT_EQ(w.size(), 1u);
  EXPECT_NEAR(w.at(100), 0.5, 1e-12);  // the only difference: the whole regret
}

TEST(DecodeLabelWeights, AloneTheBestLabelsNothing) {
  const std::vector<AnswerDecoding> d = {Decoding({A, L}, 0.4)};
  EXPECT_TRUE(DecodeLabelWeights(d, 0).empty());
}

}  // namespace
}  // namespace oryx::policies
