// The CUDA bandwidth probes agree with the CPU references (runs only where a GPU is visible).
#include <cuda_runtime.h>

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/stream.h"

namespace oryx::kernels {
namespace {

// The device's sum of x (StreamSum), and its copy of x (StreamCopy) checked to be exact.
float DeviceSum(const std::vector<float>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  float *dx = nullptr, *dy = nullptr, *dsum = nullptr;
  ORYX_CUDA_CHECK(cudaMalloc(&dx, n * sizeof(float)));
  ORYX_CUDA_CHECK(cudaMalloc(&dy, n * sizeof(float)));
  ORYX_CUDA_CHECK(cudaMalloc(&dsum, sizeof(float)));
  ORYX_CUDA_CHECK(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  cuda::StreamCopy({n, dx, dy, nullptr}, nullptr);
  cuda::StreamSum({n, dx, nullptr, dsum}, nullptr);
  std::vector<float> y(n);
  float sum = 0.f;
  ORYX_CUDA_CHECK(cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost));
  ORYX_CUDA_CHECK(cudaMemcpy(&sum, dsum, sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(y, x) << "n=" << n;
  cudaFree(dx);
  cudaFree(dy);
  cudaFree(dsum);
  return sum;
}

constexpr int64_t kSizes[] = {1, 5, 4099, (1 << 22) + 1};

// Values in {-1, 0, 1}: every partial sum is an integer below 2^24, exact in float whatever the order of the
// additions, so the device's sum must equal the exact one. A missed, repeated or misplaced element shows.
TEST(StreamCuda, SumOfSmallIntegersIsExact) {
  for (int64_t n : kSizes) {
    std::vector<float> x(n);
    std::mt19937 rng(5);
    for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 3) - 1);
    x[n - 1] = 1.f;  // the last element counts (a tail the grid may miss)
    int64_t exact = 0;
    for (float v : x) exact += static_cast<int64_t>(v);
    EXPECT_EQ(DeviceSum(x), static_cast<float>(exact)) << "n=" << n;
  }
}

// Random floats against the CPU reference, which sums in double. Rounding in any order of additions keeps
// a float sum within n * eps * sum|x| of the exact one; a reduction of a few levels (a per-thread loop, then
// a tree) stays far inside 1e-6 * sum|x| (about 8 eps). Wrong arithmetic breaks that bound; a dropped element
// of the largest n may not (0.5 against 2), which the exact test above sees.
TEST(StreamCuda, SumOfFloatsIsWithinRounding) {
  for (int64_t n : kSizes) {
    std::vector<float> x(n);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    double magnitude = 0;
    for (float& v : x) {
      v = dist(rng);
      magnitude += std::abs(v);
    }
    float sum_ref = 0.f;
    cpu::StreamSumReference({n, x.data(), nullptr, &sum_ref});
    EXPECT_NEAR(DeviceSum(x), sum_ref, 1e-6 * magnitude) << "n=" << n;
  }
}

}  // namespace
}  // namespace oryx::kernels
