// Token sampling from one row of logits: greedy argmax, and temperature + top-k + top-p driven by a caller-drawn
// uniform number (deterministic given it). Single-threaded; the engine samples sequences in parallel.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/ops.h"

namespace oryx::kernels::cpu {

namespace {
// Given candidates ordered best first, applies temperature, top-p and the uniform draw. Shared arithmetic
// (same operations in the same order) is what makes Sample and SampleReference agree exactly.
int64_t PickFromOrdered(const SampleParams& p, const std::vector<int64_t>& order, int64_t n) {
  const float top_logit = p.logits_ptr[order[0]];
  std::vector<float> weights(n);
  for (int64_t r = 0; r < n; ++r) weights[r] = std::exp((p.logits_ptr[order[r]] - top_logit) / p.temperature);
  float total = 0.0f;
  for (int64_t r = 0; r < n; ++r) total += weights[r];
  int64_t kept = n;
  float kept_mass = total;
  if (p.top_p < 1.0f) {
    float mass = 0.0f;
    for (kept = 0; kept < n;) {
      mass += weights[kept++];
      if (mass >= p.top_p * total) break;
    }
    kept_mass = mass;
  }
  const float threshold = p.uniform * kept_mass;
  float mass = 0.0f;
  for (int64_t r = 0; r < kept; ++r) {
    mass += weights[r];
    if (threshold < mass) return order[r];
  }
  return order[kept - 1];  // only reached through rounding at uniform ~ 1
}
}  // namespace

void SampleGreedy(const SampleParams& p) {
  assert(p.vocab >= 1);
  int64_t best = 0;
  for (int64_t i = 1; i < p.vocab; ++i) {
    if (p.logits_ptr[i] > p.logits_ptr[best]) best = i;  // strict: the lowest index wins ties
  }
  *p.token_ptr = best;
}

// Orders only the top_k candidates (partial sort) when top_k is set; without top_k, top-p needs them all.
void Sample(const SampleParams& p) {
  if (p.temperature <= 0.0f) return SampleGreedy(p);
  const int64_t n = p.top_k > 0 ? std::min(p.top_k, p.vocab) : p.vocab;
  std::vector<int64_t> order(p.vocab);
  std::iota(order.begin(), order.end(), int64_t{0});
  const auto better = [&](int64_t a, int64_t b) {
    return p.logits_ptr[a] > p.logits_ptr[b] || (p.logits_ptr[a] == p.logits_ptr[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + n, order.end(), better);
  *p.token_ptr = PickFromOrdered(p, order, n);
}

void SampleGreedyReference(const SampleParams& p) {
  std::vector<int64_t> order(p.vocab);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return p.logits_ptr[a] > p.logits_ptr[b]; });
  *p.token_ptr = order[0];
}

void SampleReference(const SampleParams& p) {
  if (p.temperature <= 0.0f) return SampleGreedyReference(p);
  std::vector<int64_t> order(p.vocab);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return p.logits_ptr[a] > p.logits_ptr[b]; });
  const int64_t n = p.top_k > 0 ? std::min(p.top_k, p.vocab) : p.vocab;
  *p.token_ptr = PickFromOrdered(p, order, n);
}

}  // namespace oryx::kernels::cpu
