// The host's share of a routed decode step on the CPU backend: LogitStatsOf (the entropy and top-2 margin a
// router that reads them needs, engine/sampler.h; kernels::cpu::DistributionStats) over a batch of logit rows,
// beside its reference, the form it replaced (a softmax, then -sum p log p, in double: three passes and two
// double exps a logit), in one run. Prints one JSON line per (vocabulary, rows): the median time of a batch
// for each, their ratio and the largest difference. Then the other host work a router that reads earlier
// matches does once a prompt (RouterDecoder: the prefill's decisions and the first decode step's): a
// router::EarlierMatch over each of --contexts tokens (ids drawn Zipf-like over the vocabulary, as text's
// are), reserved for them as a prompt's index is (`push_ms`) and grown token by token as a decoding
// sequence's is (`push_unreserved_ms`), and LongestMatchAtEnd of them; one JSON line per context, median
// milliseconds a prompt.
//
// With --policy, the decode decision of a learned policy (one per sequence a step): its features, its
// network, and the whole decision, in microseconds.
//
//   bench_router_stats [--vocab 32000] [--rows 1,8,64] [--contexts 4096,16384] [--passes 9] [--policy FILE]
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "base/flags.h"
#include "base/status_macros.h"
#include "bench/bench_util.h"
#include "engine/sampler.h"
#include "kernels/ops.h"
#include "policies/learned_policy.h"
#include "router/earlier_match.h"
#include "router/features.h"

namespace {

absl::Status Run(int64_t vocab, const std::vector<int64_t>& rows, int passes) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (int64_t n : rows) {
    std::vector<std::vector<float>> logits(n, std::vector<float>(vocab));
    for (auto& row : logits) {
      for (float& l : row) l = normal(rng);
    }
    std::vector<double> fast_s, reference_s;
    double largest_difference = 0;
    for (int pass = 0; pass < passes; ++pass) {
      double fast_sum = 0, reference_sum = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& row : logits) {
        fast_sum += oryx::LogitStatsOf(row).entropy;
      }
      const auto t1 = std::chrono::steady_clock::now();
      for (const auto& row : logits) {
        double entropy = 0, margin = 0;
        oryx::kernels::cpu::DistributionStatsReference(row.data(), vocab, &entropy, &margin);
        reference_sum += entropy;
      }
      const auto t2 = std::chrono::steady_clock::now();
      fast_s.push_back(std::chrono::duration<double>(t1 - t0).count());
      reference_s.push_back(std::chrono::duration<double>(t2 - t1).count());
      largest_difference = std::max(largest_difference, std::abs(fast_sum - reference_sum));
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
  return absl::OkStatus();
}

void RunEarlierMatch(int64_t vocab, const std::vector<int64_t>& contexts, int passes) {
  std::mt19937 rng(2);
  std::vector<double> weights(vocab);
  for (int64_t i = 0; i < vocab; ++i) weights[i] = 1.0 / static_cast<double>(i + 1);
  std::discrete_distribution<int32_t> zipf(weights.begin(), weights.end());
  for (int64_t n : contexts) {
    std::vector<int32_t> tokens(n);
    for (int32_t& t : tokens) t = zipf(rng);
    std::vector<double> push_s, unreserved_s, end_s;
    int64_t longest = 0;
    for (int pass = 0; pass < passes; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      {
        oryx::router::EarlierMatch index;
        index.Reserve(n);
        for (int32_t t : tokens) longest = std::max(longest, index.Push(t).length);
      }
      const auto t1 = std::chrono::steady_clock::now();
      {
        oryx::router::EarlierMatch index;
        for (int32_t t : tokens) longest = std::max(longest, index.Push(t).length);
      }
      const auto t2 = std::chrono::steady_clock::now();
      longest = std::max(longest, oryx::router::LongestMatchAtEnd(tokens, 32).length);
      const auto t3 = std::chrono::steady_clock::now();
      push_s.push_back(std::chrono::duration<double>(t1 - t0).count());
      unreserved_s.push_back(std::chrono::duration<double>(t2 - t1).count());
      end_s.push_back(std::chrono::duration<double>(t3 - t2).count());
    }
    // The heap an index of these tokens holds (glibc's count of bytes in use, before and after one is built).
    const size_t before = mallinfo2().uordblks;
    int64_t index_bytes = 0;
    {
      oryx::router::EarlierMatch index;
      index.Reserve(n);
      for (int32_t t : tokens) index.Push(t);
      index_bytes = static_cast<int64_t>(mallinfo2().uordblks) - static_cast<int64_t>(before);
    }
    std::vector<int32_t> distinct = tokens;
    std::sort(distinct.begin(), distinct.end());
    nlohmann::json line = oryx::bench::Provenance();
    line.update({{"bench", "router_earlier_match"},
                 {"vocab", vocab},
                 {"tokens", n},
                 {"distinct_tokens", std::unique(distinct.begin(), distinct.end()) - distinct.begin()},
                 {"passes", passes},
                 {"push_ms", oryx::bench::Median(push_s) * 1e3},
                 {"push_unreserved_ms", oryx::bench::Median(unreserved_s) * 1e3},
                 {"longest_match_at_end_ms", oryx::bench::Median(end_s) * 1e3},
                 {"longest_match", longest},
                 {"index_mib", static_cast<double>(index_bytes) / (1 << 20)}});
    std::cout << line.dump() << std::endl;
  }
}

// A learned policy's decode decision, as RouterDecoder asks for one per sequence per step: Featurize, the
// network's forward pass (LearnedPolicy::Evaluate) and the whole LearnedRouter::Decide, in microseconds each,
// on a decode context at 16K.
absl::Status RunPolicy(const std::string& path, int passes) {
  ORYX_ASSIGN_OR_RETURN(oryx::policies::PolicyNetwork network, oryx::policies::ReadPolicyFile(path));
  ORYX_ASSIGN_OR_RETURN(oryx::policies::LearnedPolicy policy, oryx::policies::LearnedPolicy::Create(network));
  const auto shared = std::make_shared<const oryx::policies::LearnedPolicy>(std::move(policy));
  const oryx::policies::LearnedRouter router(shared);
  oryx::router::RouterContext c;
  c.phase = oryx::router::Phase::kDecode;
  c.prompt_len = 15872, c.position = 16000, c.batch = 32;
  c.attention_tokens = 3000, c.linear_tokens = 12999, c.tokens_since_attention = 2;
  c.entropy = 1.3, c.margin = 2.1, c.match_length = 4, c.match_distance = 900, c.acceptance = 0.9;
  constexpr int kCalls = 20000;
  std::vector<double> featurize_s, evaluate_s, decide_s;
  float features[oryx::router::kNumFeatures];
  oryx::policies::LearnedPolicy::Output out;
  int64_t attention = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) {
      c.position = 16000 + (i & 255);
      oryx::router::Featurize(c, features);
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) {
      features[0] += 1e-6f;
      shared->Evaluate(features, &out);
    }
    const auto t2 = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) {
      c.position = 16000 + (i & 255);
      attention += router.Decide(c).mode == oryx::Mode::kAttention;
    }
    const auto t3 = std::chrono::steady_clock::now();
    featurize_s.push_back(std::chrono::duration<double>(t1 - t0).count() / kCalls);
    evaluate_s.push_back(std::chrono::duration<double>(t2 - t1).count() / kCalls);
    decide_s.push_back(std::chrono::duration<double>(t3 - t2).count() / kCalls);
  }
  // A request's prefill decisions (RouterDecoder::PrefillModes over a 16K prompt of Zipf-drawn ids: the
  // earlier-match index over the prompt, then a decision a segment), once per request on the serving thread.
  const std::unique_ptr<oryx::Decoder> decoder = oryx::policies::MakeLearnedDecoder(shared);
  std::mt19937 rng(3);
  std::vector<double> weights(8192);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = 1.0 / static_cast<double>(i + 1);
  std::discrete_distribution<int32_t> zipf(weights.begin(), weights.end());
  std::vector<int32_t> prompt(15872);
  for (int32_t& t : prompt) t = zipf(rng);
  std::vector<oryx::Mode> modes(prompt.size());
  std::vector<double> prefill_s;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    decoder->PrefillModes(prompt, 0, modes);
    prefill_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::vector<int64_t> hidden;
  for (const auto& l : network.hidden) hidden.push_back(l.out);
  nlohmann::json line = oryx::bench::Provenance();
  line.update({{"bench", "router_decision"},
               {"policy", path},
               {"features", network.features.size()},
               {"hidden", hidden},
               {"passes", passes},
               {"featurize_us", oryx::bench::Median(featurize_s) * 1e6},
               {"evaluate_us", oryx::bench::Median(evaluate_s) * 1e6},
               {"decide_us", oryx::bench::Median(decide_s) * 1e6},
               {"prefill_modes_16k_ms", oryx::bench::Median(prefill_s) * 1e3},
               {"attention_share", static_cast<double>(attention) / (static_cast<double>(kCalls) * passes)}});
  std::cout << line.dump() << std::endl;
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t vocab = 32000, passes = 9;
  std::vector<std::string> rows = {"1,8,64"}, contexts = {"4096,16384"};
  std::string policy;
  oryx::FlagSet flags(
      "bench_router_stats [--vocab 32000] [--rows 1,8,64] [--contexts 4096,16384] [--passes 9] "
      "[--policy FILE]",
      "Times a router's host work: the entropy and margin of rows of logits against their reference, "
      "and the earlier-match index over a prompt; JSON lines.");
  flags.Int("vocab", &vocab, "logits a row", 2);
  flags.StringList("rows", &rows, "rows a batch (sequences a decode step), comma-separated");
  flags.StringList("contexts", &contexts, "prompt lengths for the earlier-match index, comma-separated");
  flags.Int("passes", &passes, "timed passes; the median is reported", 1, 1000);
  flags.String("policy", &policy, "a learned policy file: also time its decode decision (learned:PATH's file)");
  return oryx::RunWithFlags(flags, std::vector<std::string>(argv + 1, argv + argc), [&]() -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(const std::vector<int64_t> counts, oryx::ParsePositiveInts(rows, "rows"));
    ORYX_ASSIGN_OR_RETURN(const std::vector<int64_t> lengths, oryx::ParsePositiveInts(contexts, "contexts"));
    ORYX_RETURN_IF_ERROR(Run(vocab, counts, static_cast<int>(passes)));
    RunEarlierMatch(vocab, lengths, static_cast<int>(passes));
    if (!policy.empty()) ORYX_RETURN_IF_ERROR(RunPolicy(policy, static_cast<int>(passes)));
    return absl::OkStatus();
  });
}
