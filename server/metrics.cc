#include "server/metrics.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace oryx::server {

const std::vector<double>& Metrics::Bounds() {
  static const std::vector<double> bounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                             0.5,   1,      2.5,   5,    10,    30,   60};
  return bounds;
}

void Metrics::Histogram::Observe(double seconds) {
  const std::vector<double>& b = Bounds();
  counts.resize(b.size() + 1);  // the last: past every bound
  ++counts[std::lower_bound(b.begin(), b.end(), seconds) - b.begin()];
  sum += seconds;
  ++count;
}

void Metrics::Record(int status, const absl::StatusOr<GenerateResult>& result, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[status];
  if (!result.ok()) return;
  const GenerateStats& s = result->stats;
  prompt_tokens_ += s.prompt_tokens;
  cached_tokens_ += s.cached_tokens;
  generated_tokens_ += s.generated_tokens;
  attention_tokens_ += s.attention_tokens;
  linear_tokens_ += s.linear_tokens;
  if (s.generated_tokens > 0) ttft_.Observe(std::max(0.0, seconds - s.decode_s));
  if (s.generated_tokens > 1) tpot_.Observe(s.decode_s / static_cast<double>(s.generated_tokens - 1));
  if (s.spec) {
    auto add = [](std::vector<int64_t>& into, const std::vector<int64_t>& from) {
      into.resize(std::max(into.size(), from.size()));
      for (size_t i = 0; i < from.size(); ++i) into[i] += from[i];
    };
    add(drafted_at_, s.spec->drafted_at);
    add(accepted_at_, s.spec->accepted_at);
  }
}

namespace {

void Family(std::string& out, const char* name, const char* type, const char* help) {
  absl::StrAppendFormat(&out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}
void Sample(std::string& out, const char* name, double value, const std::string& labels = "") {
  absl::StrAppendFormat(&out, "%s%s %.17g\n", name, labels.empty() ? "" : "{" + labels + "}", value);
}
// A family of one sample without labels.
void Single(std::string& out, const char* name, const char* type, const char* help, double value) {
  Family(out, name, type, help);
  Sample(out, name, value);
}
void HistogramText(std::string& out, const char* name, const char* help, const Metrics::Histogram& h) {
  Family(out, name, "histogram", help);
  const std::vector<double>& b = Metrics::Bounds();
  int64_t cumulative = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    cumulative += i < h.counts.size() ? h.counts[i] : 0;
    Sample(out, (std::string(name) + "_bucket").c_str(), static_cast<double>(cumulative),
           absl::StrFormat("le=\"%g\"", b[i]));
  }
  Sample(out, (std::string(name) + "_bucket").c_str(), static_cast<double>(h.count), "le=\"+Inf\"");
  Sample(out, (std::string(name) + "_sum").c_str(), h.sum);
  Sample(out, (std::string(name) + "_count").c_str(), static_cast<double>(h.count));
}

}  // namespace

std::string Metrics::Text(const SchedulerStats& sch, const ConnectionStats& connections,
                          const PrefixCacheStats* cache) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  Family(out, "oryx_requests_total", "counter", "Completion requests answered, by HTTP status.");
  for (const auto& [status, n] : requests_)
    Sample(out, "oryx_requests_total", static_cast<double>(n), absl::StrFormat("status=\"%d\"", status));
  Single(out, "oryx_prompt_tokens_total", "counter", "Prompt tokens of the requests answered.",
         static_cast<double>(prompt_tokens_));
  Single(out, "oryx_cached_prompt_tokens_total", "counter", "Of those, restored from the prefix cache.",
         static_cast<double>(cached_tokens_));
  Single(out, "oryx_generated_tokens_total", "counter", "Tokens generated for the requests answered.",
         static_cast<double>(generated_tokens_));
  Family(out, "oryx_mode_tokens_total", "counter",
         "Tokens run in each mode (prompt and generated; speculative drafts and verify spans included).");
  Sample(out, "oryx_mode_tokens_total", static_cast<double>(attention_tokens_), "mode=\"attention\"");
  Sample(out, "oryx_mode_tokens_total", static_cast<double>(linear_tokens_), "mode=\"linear\"");
  Family(out, "oryx_drafts_proposed_total", "counter", "Speculative drafts proposed, by position in the round.");
  for (size_t i = 0; i < drafted_at_.size(); ++i)
    Sample(out, "oryx_drafts_proposed_total", static_cast<double>(drafted_at_[i]),
           absl::StrFormat("position=\"%d\"", i));
  Family(out, "oryx_drafts_accepted_total", "counter", "Speculative drafts accepted, by position in the round.");
  for (size_t i = 0; i < accepted_at_.size(); ++i)
    Sample(out, "oryx_drafts_accepted_total", static_cast<double>(accepted_at_[i]),
           absl::StrFormat("position=\"%d\"", i));
  HistogramText(out, "oryx_time_to_first_token_seconds", "From a request's arrival to its first token.", ttft_);
  HistogramText(out, "oryx_time_per_output_token_seconds", "A request's mean time between its generated tokens.",
                tpot_);
  Single(out, "oryx_queue_length", "gauge", "Requests waiting for a place in the batch.",
         static_cast<double>(sch.queued));
  Single(out, "oryx_batch_requests", "gauge", "Requests in the batch (prefilling, decoding or waiting for memory).",
         static_cast<double>(sch.active));
  Single(out, "oryx_waiting_for_memory", "gauge", "Requests in the batch waiting for KV memory (new or preempted).",
         static_cast<double>(sch.waiting));
  Single(out, "oryx_kv_bytes", "gauge", "KV cache held by the admitted requests.", static_cast<double>(sch.kv_bytes));
  Single(out, "oryx_kv_budget_bytes", "gauge", "The KV memory budget (0: none).", static_cast<double>(sch.kv_memory));
  Single(out, "oryx_preemptions_total", "counter", "Requests preempted for memory and recomputed later.",
         static_cast<double>(sch.preemptions));
  Single(out, "oryx_requests_cancelled_total", "counter",
         "Requests cancelled because their clients went away (they are counted as 499 above too).",
         static_cast<double>(sch.cancelled));
  Single(out, "oryx_batch_steps_total", "counter", "Engine steps run.", static_cast<double>(sch.steps));
  Single(out, "oryx_decode_rows_total", "counter",
         "Requests decoded, summed over the steps (over steps: the mean batch).", static_cast<double>(sch.decode_rows));
  Single(out, "oryx_connections_open", "gauge", "HTTP connections being served.",
         static_cast<double>(connections.open));
  Single(out, "oryx_connections_refused_total", "counter",
         "HTTP connections refused at the cap per client address (answered 429, or closed with TLS).",
         static_cast<double>(connections.refused));
  if (cache != nullptr) {
    Single(out, "oryx_prefix_cache_lookup_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
           static_cast<double>(cache->lookup_tokens));
    Single(out, "oryx_prefix_cache_hit_tokens_total", "counter", "Of those, restored from a snapshot.",
           static_cast<double>(cache->hit_tokens));
    Single(out, "oryx_prefix_cache_snapshots", "gauge", "Snapshots held.", static_cast<double>(cache->snapshots));
    Single(out, "oryx_prefix_cache_bytes", "gauge", "Bytes the snapshots hold.", static_cast<double>(cache->bytes));
    Single(out, "oryx_prefix_cache_evictions_total", "counter", "Snapshots evicted.",
           static_cast<double>(cache->evicted));
  }
  return out;
}

}  // namespace oryx::server
