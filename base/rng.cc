// Deterministic PRNG (SplitMix64 seeding, xoshiro256**) and the sampling routines built on it.
#include "base/rng.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <unordered_map>

namespace oryx {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

}  // namespace

uint64_t MixSeed(std::span<const uint64_t> words) {
  uint64_t state = 0x6f72797874736b73ULL;  // "oryxtsks"
  uint64_t out = SplitMix64(state);
  for (uint64_t w : words) {
    state ^= w + out;
    out = SplitMix64(state);
  }
  return out;
}

Rng::Rng(uint64_t seed) {
  uint64_t state = seed;
  for (uint64_t& s : s_) s = SplitMix64(state);
}

uint64_t Rng::Next() {
  const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return result;
}

uint64_t Rng::UniformInt(uint64_t n) {
  assert(n > 0);
  unsigned __int128 m = static_cast<unsigned __int128>(Next()) * n;
  uint64_t low = static_cast<uint64_t>(m);
  if (low < n) {
    const uint64_t threshold = (0 - n) % n;  // 2^64 mod n
    while (low < threshold) {
      m = static_cast<unsigned __int128>(Next()) * n;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

int64_t Rng::UniformRange(int64_t lo, int64_t hi) {
  assert(lo <= hi);
  const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
  if (span == 0) return static_cast<int64_t>(Next());  // the full 64-bit range
  return static_cast<int64_t>(static_cast<uint64_t>(lo) + UniformInt(span));
}

double Rng::UniformDouble() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

std::vector<int64_t> SampleWithoutReplacement(Rng& rng, int64_t n, int64_t k) {
  assert(k >= 0 && k <= n);
  std::unordered_map<int64_t, int64_t> moved;  // virtual array: slot -> value where it differs from slot
  auto at = [&](int64_t i) {
    auto it = moved.find(i);
    return it == moved.end() ? i : it->second;
  };
  std::vector<int64_t> out;
  out.reserve(k);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t j = i + static_cast<int64_t>(rng.UniformInt(static_cast<uint64_t>(n - i)));
    const int64_t value_i = at(i);
    out.push_back(at(j));
    moved[j] = value_i;
  }
  return out;
}

std::vector<int64_t> WeightedSampleWithoutReplacement(Rng& rng, std::span<const double> weights, int64_t k) {
  // Each item gets key log(u) / w with u uniform in (0, 1]; the k largest keys, in decreasing order, are
  // distributed as k successive weighted draws without replacement.
  struct Keyed {
    double key;
    int64_t index;
  };
  std::vector<Keyed> keyed;
  keyed.reserve(weights.size());
  for (int64_t i = 0; i < static_cast<int64_t>(weights.size()); ++i) {
    const double u = static_cast<double>((rng.Next() >> 11) + 1) * 0x1.0p-53;  // (0, 1]
    if (weights[i] > 0) keyed.push_back({std::log(u) / weights[i], i});
  }
  assert(k <= static_cast<int64_t>(keyed.size()));
  std::partial_sort(keyed.begin(), keyed.begin() + k, keyed.end(), [](const Keyed& a, const Keyed& b) {
    return a.key != b.key ? a.key > b.key : a.index < b.index;
  });
  std::vector<int64_t> out;
  out.reserve(k);
  for (int64_t i = 0; i < k; ++i) out.push_back(keyed[i].index);
  return out;
}

}  // namespace oryx
