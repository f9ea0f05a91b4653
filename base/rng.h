// A small deterministic random generator (the synthetic tasks, sampling, routing). Unlike the <random> distributions,
// every sampling routine here is specified by this code, so a seed gives the same task on every
// compiler and standard library.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

namespace oryx {

// Mixes any number of 64-bit words into one seed (SplitMix64 finaliser chained over the words). Use it to
// derive independent per-example seeds: MixSeed({base_seed, index, salt}).
uint64_t MixSeed(std::span<const uint64_t> words);
inline uint64_t MixSeed(std::initializer_list<uint64_t> words) {
  return MixSeed(std::span<const uint64_t>(words.begin(), words.size()));
}

// xoshiro256** seeded through SplitMix64. Not thread-safe; cheap to construct, so make one per example.
class Rng {
 public:
  explicit Rng(uint64_t seed);

  // The next raw 64-bit output.
  uint64_t Next();
  // Uniform integer in [0, n); n must be > 0. Unbiased (Lemire's multiply-and-reject).
  uint64_t UniformInt(uint64_t n);
  // Uniform integer in [lo, hi] (inclusive); lo <= hi.
  int64_t UniformRange(int64_t lo, int64_t hi);
  // Uniform double in [0, 1) with 53 random bits.
  double UniformDouble();

 private:
  uint64_t s_[4];
};

// `k` distinct integers from [0, n), uniformly at random and in random order (partial Fisher-Yates over a
// sparse virtual array, O(k) time and memory). Requires 0 <= k <= n.
std::vector<int64_t> SampleWithoutReplacement(Rng& rng, int64_t n, int64_t k);

// `k` distinct indices from [0, weights.size()), drawn one after another with probability proportional to
// the remaining weights (the distribution of numpy's choice(replace=False, p=...)), via
// Efraimidis-Spirakis keys. Returned in draw order. Requires k <= number of positive weights.
// Uses std::log, which is correctly rounded on glibc; other libms may differ in the last bit, which can
// (very rarely) change a draw.
std::vector<int64_t> WeightedSampleWithoutReplacement(Rng& rng, std::span<const double> weights, int64_t k);

}  // namespace oryx
