// Greedy token choice from one row of logits (the argmax, lowest index on ties), and a row's entropy and
// top-2 margin (what a router reads). Sampling with temperature, top-k and top-p is engine/sampler.cc's (and
// the CUDA backend's SampleRows).
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <vector>

#include "kernels/ops.h"

namespace oryx::kernels::cpu {

void SampleGreedy(const SampleParams& p) {
  assert(p.vocab >= 1);
  int64_t best = 0;
  for (int64_t i = 1; i < p.vocab; ++i) {
    if (p.logits_ptr[i] > p.logits_ptr[best]) best = i;  // strict: the lowest index wins ties
  }
  *p.token_ptr = best;
}

void SampleGreedyReference(const SampleParams& p) {
  std::vector<int64_t> order(p.vocab);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return p.logits_ptr[a] > p.logits_ptr[b]; });
  *p.token_ptr = order[0];
}

namespace {

void TopTwo(const float* logits, int64_t n, float* top1, float* top2) {
  float a = -INFINITY, b = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float l = logits[i];
    if (l > a) {
      b = a;
      a = l;
    } else if (l > b) {
      b = l;
    }
  }
  *top1 = a, *top2 = b;
}

}  // namespace

void DistributionStats(const float* logits, int64_t n, double* entropy, double* margin) {
  assert(n >= 2);
  float top1, top2;
  TopTwo(logits, n, &top1, &top2);
  *margin = static_cast<double>(top1) - static_cast<double>(top2);
  // With d = l - top1 <= 0 and Z = sum e^d >= 1: H = log Z - (sum e^d d) / Z, in one pass of float exps.
  double z = 0, weighted = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float d = logits[i] - top1, w = std::exp(d);
    z += w;
    weighted += static_cast<double>(w) * d;
  }
  *entropy = std::log(z) - weighted / z;
}

void DistributionStatsReference(const float* logits, int64_t n, double* entropy, double* margin) {
  assert(n >= 2);
  std::vector<float> sorted(logits, logits + n);
  std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
  *margin = static_cast<double>(sorted[0]) - static_cast<double>(sorted[1]);
  double z = 0, e = 0;
  for (int64_t i = 0; i < n; ++i) z += std::exp(static_cast<double>(logits[i]) - sorted[0]);
  for (int64_t i = 0; i < n; ++i) {
    const double p = std::exp(static_cast<double>(logits[i]) - sorted[0]) / z;
    if (p > 0) e -= p * std::log(p);
  }
  *entropy = e;
}

}  // namespace oryx::kernels::cpu
