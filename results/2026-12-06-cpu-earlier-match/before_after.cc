// router::EarlierMatch before (8f9d9fa: each state's transitions searched linearly, namespace renamed
// oldrouter by run.sh) against the tree's, alternating in one run, median of 9 over Zipf-like ids.
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#include <algorithm>

#include "old_em.h"

#include "router/earlier_match.h"
template <class M>
double Time(const std::vector<int32_t>& t) {
  auto t0 = std::chrono::steady_clock::now();
  M m;
  int64_t s = 0;
  for (int32_t x : t) s += m.Push(x).length;
  auto t1 = std::chrono::steady_clock::now();
  if (s < 0) printf("x");
  return std::chrono::duration<double>(t1 - t0).count() * 1e3;
}

int main() {
  std::mt19937 rng(1);
  std::vector<double> w(32000);
  for (int i = 0; i < 32000; ++i) w[i] = 1.0 / (i + 1);
  std::discrete_distribution<int> z(w.begin(), w.end());
  for (int n : {4096, 16384}) {
    std::vector<int32_t> t(n);
    for (auto& x : t) x = z(rng);
    std::vector<double> a, b;
    for (int rep = 0; rep < 9; ++rep) {
      a.push_back(Time<oldrouter::EarlierMatch>(t));
      b.push_back(Time<oryx::router::EarlierMatch>(t));
    }
    std::sort(a.begin(), a.end()); std::sort(b.begin(), b.end());
    printf("{\"tokens\": %d, \"distinct\": %zu, \"linear_ms_median\": %.2f, \"hash_ms_median\": %.2f, \"ratio\": %.2f}\n", n,
           [&] { auto u = t; std::sort(u.begin(), u.end()); return size_t(std::unique(u.begin(), u.end()) - u.begin()); }(),
           a[4], b[4], a[4] / b[4]);
  }

}
