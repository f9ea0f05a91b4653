// GET /metrics: the server's counters in the Prometheus text format (version 0.0.4): requests by status,
// tokens (prompt, cached, generated, by mode), time to first token and time per output token as histograms,
// speculative drafts proposed and accepted by position, and, from the scheduler, the engine and the HTTP
// layer, the queue, the batch, KV memory, preemptions, cancelled requests, connections and the prefix cache.
// Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "server/scheduler.h"

namespace oryx::server {

// The HTTP layer's connections (server/connections.h GateServer).
struct ConnectionStats {
  int64_t open = 0;     // being served
  int64_t refused = 0;  // refused at the cap per client address since the start
};

class Metrics {
 public:
  // One answered completion request: its HTTP status, and its result when it has one. `seconds` is the time
  // from its arrival to its answer.
  void Record(int status, const absl::StatusOr<GenerateResult>& result, double seconds);
  // The exposition: these counters, then the scheduler's, the connections' and the prefix cache's (null: off).
  std::string Text(const SchedulerStats& scheduler, const ConnectionStats& connections,
                   const PrefixCacheStats* prefix_cache) const;

  struct Histogram {
    std::vector<int64_t> counts;  // per upper bound in kBounds, not cumulative
    double sum = 0;
    int64_t count = 0;
    void Observe(double seconds);
  };
  static const std::vector<double>& Bounds();  // seconds

 private:
  mutable std::mutex mu_;
  std::map<int, int64_t> requests_;  // by HTTP status
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0, generated_tokens_ = 0;
  int64_t attention_tokens_ = 0, linear_tokens_ = 0;
  std::vector<int64_t> drafted_at_, accepted_at_;
  Histogram ttft_, tpot_;
};

}  // namespace oryx::server
