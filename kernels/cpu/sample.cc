// Greedy token choice from one row of logits (the argmax, lowest index on ties). Sampling with temperature,
// top-k and top-p is engine/sampler.cc's (and the CUDA backend's SampleRows).
#include <algorithm>
#include <cassert>
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

}  // namespace oryx::kernels::cpu
