// The host's share of a routed decode step: router::DistributionStats (the entropy and top-2 margin a router
// that reads them needs, RouterDecoder::Observe; kernels::cpu::DistributionStats) over a batch of logit rows,
// beside its reference, the form it replaced (a softmax, then -sum p log p, in double: three passes and two
// double exps a logit), in one run. Prints one JSON
// line per (vocabulary, rows): the median time of a batch for each, their ratio and the largest difference.
//
//   bench_router_stats [--vocab 32000] [--rows 1,8,64] [--passes 9]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "kernels/ops.h"
#include "router/router.h"

namespace {

std::vector<int64_t> ParseList(const char* text) {
  std::vector<int64_t> out;
  for (const char* p = text; *p != '\0';) {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    if (end == p || v <= 0) return {};
    out.push_back(v);
    p = *end == ',' ? end + 1 : end;
    if (*end != ',' && *end != '\0') return {};
  }
  return out;
}

int Usage(const std::string& error) {
  std::cerr << "bench_router_stats: error: " << error
            << "\nusage: bench_router_stats [--vocab 32000] [--rows 1,8,64] [--passes 9]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t vocab = 32000;
  std::vector<int64_t> rows = {1, 8, 64};
  int passes = 9;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << "usage: bench_router_stats [--vocab 32000] [--rows 1,8,64] [--passes 9]\n";
      return 0;
    }
    if (i + 1 >= argc) return Usage(flag + " needs a value");
    const std::vector<int64_t> values = ParseList(argv[++i]);
    if (values.empty()) return Usage(flag + ": expected positive integers, got '" + argv[i] + "'");
    if (flag == "--vocab" && values.size() == 1) {
      vocab = values[0];
    } else if (flag == "--rows") {
      rows = values;
    } else if (flag == "--passes" && values.size() == 1) {
      passes = static_cast<int>(values[0]);
    } else {
      return Usage("unknown flag or bad value: " + flag);
    }
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (int64_t n : rows) {
    std::vector<std::vector<float>> logits(n, std::vector<float>(vocab));
    for (auto& row : logits) {
      for (float& l : row) l = normal(rng);
    }
    std::vector<double> fast_s, reference_s;
    double largest_difference = 0, sink = 0;
    for (int pass = 0; pass < passes; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& row : logits) {
        double entropy = 0, margin = 0;
        oryx::router::DistributionStats(row, &entropy, &margin);
        sink += entropy;
      }
      const auto t1 = std::chrono::steady_clock::now();
      double reference_sum = 0;
      for (const auto& row : logits) {
        double entropy = 0, margin = 0;
        oryx::kernels::cpu::DistributionStatsReference(row.data(), vocab, &entropy, &margin);
        reference_sum += entropy;
      }
      const auto t2 = std::chrono::steady_clock::now();
      fast_s.push_back(std::chrono::duration<double>(t1 - t0).count());
      reference_s.push_back(std::chrono::duration<double>(t2 - t1).count());
      largest_difference = std::max(largest_difference, std::abs(sink - reference_sum));
      sink = 0;
    }
    const double fast = oryx::bench::Median(fast_s), reference = oryx::bench::Median(reference_s);
    nlohmann::json line = oryx::bench::Provenance();
    line.update({{"bench", "router_stats"},
                 {"vocab", vocab},
                 {"rows", n},
                 {"passes", passes},
                 {"ms", fast * 1e3},
                 {"reference_ms", reference * 1e3},
                 {"speedup", reference / fast},
                 {"entropy_sum_difference", largest_difference}});
    std::cout << line.dump() << std::endl;
  }
  return 0;
}
