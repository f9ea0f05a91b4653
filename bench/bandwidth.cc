// Measures memory bandwidth (copy: read + write; sum: read only) on the CPU and, where present, the GPU.
// Prints one JSON object per measurement (JSON lines). The roofline of every decode benchmark divides
// the bytes a step moves by these numbers.
//
//   bench_bandwidth [--mib N] [--iters N]
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "engine/json_text.h"
#include "kernels/stream.h"
#ifdef ORYX_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int64_t mib = 512;  // per buffer
  int iters = 10;
};

nlohmann::json Result(const std::string& device, const std::string& op, int64_t bytes_moved,
                      const std::vector<double>& seconds) {
  const double median = oryx::bench::Median(seconds);
  return {{"bench", "bandwidth"},
          {"device", device},
          {"op", op},
          {"bytes_moved", bytes_moved},
          {"median_s", median},
          {"gb_per_s", bytes_moved / median / 1e9},
          {"iters", seconds.size()}};
}

std::vector<nlohmann::json> MeasureCpu(const Options& opt) {
  const int64_t n = opt.mib * 1024 * 1024 / 4;
  std::vector<float> x(n, 1.0f), y(n, 0.0f);
  float sum = 0.f;
  oryx::kernels::StreamParams p{n, x.data(), y.data(), &sum};
  std::vector<double> copy_s, sum_s;
  for (int i = 0; i < opt.iters + 1; ++i) {
    auto t0 = Clock::now();
    oryx::kernels::cpu::StreamCopy(p);
    auto t1 = Clock::now();
    oryx::kernels::cpu::StreamSum(p);
    auto t2 = Clock::now();
    if (i == 0) continue;  // warm-up
    copy_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    sum_s.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  if (sum != static_cast<float>(n)) std::cerr << "warning: cpu sum mismatch\n";
  return {Result("cpu", "copy", 2 * n * 4, copy_s), Result("cpu", "sum", n * 4, sum_s)};
}

#ifdef ORYX_HAVE_CUDA
std::vector<nlohmann::json> MeasureCuda(const Options& opt) {
  const int64_t n = opt.mib * 1024 * 1024 / 4;
  float *x = nullptr, *y = nullptr, *sum = nullptr;
  ORYX_CUDA_CHECK(cudaMalloc(&x, n * 4));
  ORYX_CUDA_CHECK(cudaMalloc(&y, n * 4));
  ORYX_CUDA_CHECK(cudaMalloc(&sum, 4));
  ORYX_CUDA_CHECK(cudaMemset(x, 0, n * 4));
  cudaEvent_t e0, e1, e2;
  ORYX_CUDA_CHECK(cudaEventCreate(&e0));
  ORYX_CUDA_CHECK(cudaEventCreate(&e1));
  ORYX_CUDA_CHECK(cudaEventCreate(&e2));
  oryx::kernels::StreamParams p{n, x, y, sum};
  std::vector<double> copy_s, sum_s;
  for (int i = 0; i < opt.iters + 2; ++i) {
    ORYX_CUDA_CHECK(cudaEventRecord(e0));
    oryx::kernels::cuda::StreamCopy(p, nullptr);
    ORYX_CUDA_CHECK(cudaEventRecord(e1));
    oryx::kernels::cuda::StreamSum(p, nullptr);
    ORYX_CUDA_CHECK(cudaEventRecord(e2));
    ORYX_CUDA_CHECK(cudaEventSynchronize(e2));
    if (i < 2) continue;  // warm-up
    float ms_copy = 0.f, ms_sum = 0.f;
    ORYX_CUDA_CHECK(cudaEventElapsedTime(&ms_copy, e0, e1));
    ORYX_CUDA_CHECK(cudaEventElapsedTime(&ms_sum, e1, e2));
    copy_s.push_back(ms_copy * 1e-3);
    sum_s.push_back(ms_sum * 1e-3);
  }
  cudaDeviceProp prop{};
  ORYX_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaFree(x);
  cudaFree(y);
  cudaFree(sum);
  auto copy = Result("cuda", "copy", 2 * n * 4, copy_s);
  auto rd = Result("cuda", "sum", n * 4, sum_s);
  copy["gpu"] = rd["gpu"] = prop.name;
  return {copy, rd};
}
#endif

bool ParseArgs(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << "usage: bench_bandwidth [--mib N] [--iters N]\n"
                   "Measures copy and read bandwidth on the CPU and every visible GPU; JSON lines.\n";
      std::exit(0);
    }
    if ((a == "--mib" || a == "--iters") && i + 1 < argc) {
      char* end = nullptr;
      long v = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || v <= 0 || v > 65536) {
        std::cerr << "bench_bandwidth: error: " << a << " needs a positive integer\n";
        return false;
      }
      if (a == "--mib") {
        opt->mib = v;
      } else {
        opt->iters = static_cast<int>(v);
      }
      continue;
    }
    std::cerr << "bench_bandwidth: error: unknown argument '" << a << "' (see --help)\n";
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!ParseArgs(argc, argv, &opt)) return 2;
  std::vector<nlohmann::json> results = MeasureCpu(opt);
#ifdef ORYX_HAVE_CUDA
  if (oryx::kernels::cuda::DeviceCount() > 0) {
    for (auto& r : MeasureCuda(opt)) results.push_back(r);
  }
#endif
  for (auto& r : results) {
    r["machine"] = oryx::bench::MachineInfo();
    r["git"] = oryx::bench::GitRevision();
    r["time"] = oryx::bench::UtcTimestamp();
    std::cout << oryx::JsonText(r) << "\n";
  }
  return 0;
}
