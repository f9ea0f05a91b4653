// The CPU bandwidth probes compute what their references compute.
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/stream.h"

namespace oryx::kernels {
namespace {

std::vector<float> RandomVector(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(StreamCpu, CopyMatchesReferenceForOddSizes) {
  for (int64_t n : {0, 1, 7, 1000, (1 << 18) + 3}) {
    std::vector<float> x = RandomVector(n, 1), y(n, 0.f), y_ref(n, 0.f);
    cpu::StreamCopy({n, x.data(), y.data(), nullptr});
    cpu::StreamCopyReference({n, x.data(), y_ref.data(), nullptr});
    EXPECT_EQ(y, y_ref) << "n=" << n;
    EXPECT_EQ(y, x) << "n=" << n;
  }
}

TEST(StreamCpu, SumMatchesReference) {
  for (int64_t n : {1, 1000, (1 << 18) + 3}) {
    std::vector<float> x = RandomVector(n, 2);
    float sum = 0.f, sum_ref = 0.f;
    cpu::StreamSum({n, x.data(), nullptr, &sum});
    cpu::StreamSumReference({n, x.data(), nullptr, &sum_ref});
    EXPECT_NEAR(sum, sum_ref, 1e-5 * n) << "n=" << n;
  }
}

}  // namespace
}  // namespace oryx::kernels
