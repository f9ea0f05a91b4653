// The CUDA bandwidth probes agree with the CPU references (runs only where a GPU is visible).
#include <cuda_runtime.h>

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/stream.h"

namespace oryx::kernels {
namespace {

TEST(StreamCuda, CopyAndSumMatchCpuReference) {
  for (int64_t n : {1, 5, 4099, (1 << 22) + 1}) {
    std::vector<float> x(n);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    for (float& v : x) v = dist(rng);
    float *dx = nullptr, *dy = nullptr, *dsum = nullptr;
    ORYX_CUDA_CHECK(cudaMalloc(&dx, n * sizeof(float)));
    ORYX_CUDA_CHECK(cudaMalloc(&dy, n * sizeof(float)));
    ORYX_CUDA_CHECK(cudaMalloc(&dsum, sizeof(float)));
    ORYX_CUDA_CHECK(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    cuda::StreamCopy({n, dx, dy, nullptr}, nullptr);
    cuda::StreamSum({n, dx, nullptr, dsum}, nullptr);
    std::vector<float> y(n);
    float sum = 0.f, sum_ref = 0.f;
    ORYX_CUDA_CHECK(cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost));
    ORYX_CUDA_CHECK(cudaMemcpy(&sum, dsum, sizeof(float), cudaMemcpyDeviceToHost));
    cpu::StreamSumReference({n, x.data(), nullptr, &sum_ref});
    EXPECT_EQ(y, x) << "n=" << n;
    EXPECT_NEAR(sum, sum_ref, 1e-4 * n) << "n=" << n;
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(dsum);
  }
}

}  // namespace
}  // namespace oryx::kernels
