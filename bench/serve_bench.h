// `oryx bench serve`: the HTTP server under load. For each concurrency level, that many clients send
// streaming completions back to back (closed loop); or, for each arrival rate, requests arrive at random
// (Poisson) times at that rate (open loop). The server is `oryx serve`, started in this process on a free
// port and reached over real sockets. Each request has a fixed prompt length (random token ids, or windows
// of a corpus's validation split) and generates exactly max_tokens tokens (EOS ignored). One JSON line per
// level: requests/s, generated tokens/s, time to first token and end-to-end latency (p50, p90), the time
// between tokens (each request's mean, and the distribution of every gap), and the server's mean decode
// batch over the level, and the prompt tokens the prefix cache restored.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/engine_bench.h"

namespace oryx::bench {

struct ServeBenchOptions {
  std::string model_dir;     // a model directory; or, with device cuda, empty and a preset
  std::string preset;        // cuda without model_dir: random weights of 130m | 1.4b (token prompts only)
  std::string device = "cpu";
  int threads = 0;           // CPU threads of the engine
  std::vector<int64_t> concurrency = {1, 4, 16};
  // Open-loop levels instead: requests arrive at these rates (per second, Poisson), each on its own
  // connection, whatever the server's pace. Non-empty: concurrency is not used.
  std::vector<double> rates;
  int64_t requests = 0;      // per level; 0: 4 x the level (clients or requests/s), at least 8
  int64_t prompt_tokens = 128;
  // The first this many tokens of every prompt of a level are the same (a system prompt; a new one per
  // level, and another for the warm-up), the rest differ. 0: prompts share nothing.
  int64_t shared_prefix_tokens = 0;
  bool prefix_cache = true;  // the engine's prefix cache (Engine::prefix_cache); off: every prompt is computed
  int64_t prefix_snapshot_every = 0;  // its PrefixCacheOptions::snapshot_every; 0: the default
  int64_t max_tokens = 64;
  std::string policy = "attention";
  // A corpus (`oryx data prepare`): prompts are evenly spread windows of its validation split, so that a
  // trained model sees text and speculation meets its real acceptance. Empty: random token ids.
  std::string data_dir;
  int64_t max_batch = 0;     // the server's; 0: the largest level
  int64_t max_prefill_tokens = 0;  // the server's prompt tokens per step at most; 0: no bound
  int64_t kv_memory = 0;           // the server's KV memory in bytes; 0: the device's
  uint64_t seed = 1;
};

absl::Status RunServeBench(const ServeBenchOptions& options, const Emit& emit);

}  // namespace oryx::bench
