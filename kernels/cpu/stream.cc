// CPU bandwidth probes: Eigen vectorised copy and sum, split over threads by hand.
#include "kernels/stream.h"

#include <Eigen/Core>
#include <algorithm>
#include <thread>
#include <vector>

namespace oryx::kernels::cpu {

namespace {

// Runs fn(begin, end) over [0, n) in contiguous chunks, one per hardware thread.
template <typename Fn>
void ParallelFor(int64_t n, Fn fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(),
                                                                 n / (1 << 16) + 1));
  if (threads == 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + threads - 1) / threads;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t begin = t * chunk, end = std::min(n, begin + chunk);
    if (begin < end) pool.emplace_back(fn, begin, end);
  }
  for (auto& th : pool) th.join();
}

}  // namespace

void StreamCopy(const StreamParams& p) {
  ParallelFor(p.n, [&](int64_t b, int64_t e) {
    Eigen::Map<Eigen::ArrayXf>(p.y_ptr + b, e - b) = Eigen::Map<const Eigen::ArrayXf>(p.x_ptr + b, e - b);
  });
}

void StreamSum(const StreamParams& p) {
  // Float sums of 64K-element blocks (Eigen vectorises them with several accumulators), blocks added in
  // double: full read speed, and the rounding of a 64K-element float sum only.
  const int64_t threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  std::vector<double> partial(threads, 0.0);
  const int64_t chunk = (p.n + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t b = std::min(p.n, t * chunk), e = std::min(p.n, b + chunk);
    pool.emplace_back([&, t, b, e] {
      constexpr int64_t kBlock = 1 << 16;
      for (int64_t i = b; i < e; i += kBlock) {
        partial[t] += Eigen::Map<const Eigen::ArrayXf>(p.x_ptr + i, std::min(kBlock, e - i)).sum();
      }
    });
  }
  for (auto& th : pool) th.join();
  double total = 0.0;
  for (double v : partial) total += v;
  *p.sum_ptr = static_cast<float>(total);
}

void StreamCopyReference(const StreamParams& p) {
  for (int64_t i = 0; i < p.n; ++i) p.y_ptr[i] = p.x_ptr[i];
}

void StreamSumReference(const StreamParams& p) {
  double total = 0.0;
  for (int64_t i = 0; i < p.n; ++i) total += p.x_ptr[i];
  *p.sum_ptr = static_cast<float>(total);
}

}  // namespace oryx::kernels::cpu
