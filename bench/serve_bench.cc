#include "bench/serve_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <iostream>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/str_split.h"
#include "base/rng.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "bench/bench_util.h"
#include "engine/engine.h"
#include "engine/json_text.h"
#include "httplib.h"
#include "policies/rule_policies.h"
#include "server/http_server.h"
#include "train/shards.h"
#ifdef ORYX_HAVE_CUDA
#include "bench/cuda_bench.h"
#include "engine/cuda_backend.h"
#endif

namespace oryx::bench {

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

struct Sample {
  std::string policy;
  double ttft_s = 0, latency_s = 0;
  std::vector<double> gaps_s;  // between consecutive token chunks, as the client received them
  int64_t tokens = 0;
  int64_t cached_tokens = 0;          // prompt tokens restored from the prefix cache
  int64_t attention_tokens = 0, linear_tokens = 0;  // forwarded in each mode, prompt and generation
  int64_t drafted = 0, accepted = 0;  // speculative policies
  std::vector<int64_t> rounds_by_length;  // and their rounds by draft length, with the rounds' wall time
  std::vector<double> round_s_by_length;
  int64_t backend_rounds = 0;  // of those, the rounds the backend ran whole
  std::string error;  // empty when the request succeeded
};

absl::StatusOr<Engine> MakeEngine(const ServeBenchOptions& o, std::string* model) {
  if (!o.model_dir.empty()) {
    *model = o.model_dir;
    return Engine::Load(o.model_dir, {.device = o.device, .threads = o.threads, .cuda = CudaSwitches::FromEnvironment()});
  }
#ifdef ORYX_HAVE_CUDA
  if (o.device == "cuda") {
    const std::string preset = o.preset.empty() ? "130m" : o.preset;
    ORYX_ASSIGN_OR_RETURN(ModelConfig config,
                          PresetConfig(preset, LinearMixer::kMamba2, o.prompt_tokens + o.max_tokens + 64));
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend, CudaBackend::CreateRandom(config, 1, CudaSwitches::FromEnvironment()));
    *model = Cat("random-", preset, "-mamba2");
    return Engine(std::move(backend), std::nullopt);
  }
#endif
  return absl::InvalidArgumentError("bench serve: give --model (random weights, --config, are for --device cuda)");
}

// The policies of --policy (comma-separated); request i takes the (i mod n)-th.
std::vector<std::string> PolicyList(const ServeBenchOptions& o) {
  std::vector<std::string> out;
  for (absl::string_view p : absl::StrSplit(o.policy, ',')) out.emplace_back(p);
  return out;
}

// One streaming completion of prompt i, timed from the request to its first chunk and to its end.
Sample Complete(httplib::Client& client, const ServeBenchOptions& o, const std::vector<int32_t>& prompt, size_t i) {
  const std::vector<std::string> policies = PolicyList(o);
  Sample s;
  s.policy = policies[i % policies.size()];
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = JsonText(json{{"prompt", prompt}, {"max_tokens", o.max_tokens}, {"ignore_eos", true}, {"stream", true},
                  {"policy", s.policy}});
  std::string body;
  const Clock::time_point start = Clock::now();
  std::vector<double> frame_s;  // when each event frame ("data: ...\n\n") was complete
  size_t scanned = 0;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const double now = Since(start);
    if (body.empty()) s.ttft_s = now;
    body.append(data, n);
    for (size_t at; (at = body.find("\n\n", scanned)) != std::string::npos; scanned = at + 2) frame_s.push_back(now);
    return true;
  };
  auto res = client.send(req);
  s.latency_s = Since(start);
  // The token chunks are every frame but the last two (the usage chunk and [DONE]).
  for (size_t i = 1; i + 2 < frame_s.size(); ++i) s.gaps_s.push_back(frame_s[i] - frame_s[i - 1]);
  if (!res) {
    s.error = httplib::to_string(res.error()) + Cat(" after ", body.size(), " bytes, ", Since(start), " s");
  } else if (res->status != 200) {
    s.error = Cat("HTTP ", res->status, ": ", res->body);
  } else {
    // The last chunk before [DONE] carries the usage and the statistics.
    const size_t end = body.rfind("\n\ndata: [DONE]");
    const size_t from = end == std::string::npos ? end : body.rfind("data: ", end);
    const json last =
        from == std::string::npos ? json() : json::parse(body.substr(from + 6, end - from - 6), nullptr, false);
    if (!last.is_object() || !last.contains("usage")) {
      s.error = "no usage at the end of the stream: " + body.substr(body.size() > 300 ? body.size() - 300 : 0);
    } else {
      s.tokens = last["usage"]["completion_tokens"].get<int64_t>();
      s.cached_tokens = last["oryx"]["stats"].value("cached_tokens", int64_t{0});
      s.attention_tokens = last["oryx"]["stats"].value("attention_tokens", int64_t{0});
      s.linear_tokens = last["oryx"]["stats"].value("linear_tokens", int64_t{0});
      if (last["oryx"]["stats"].contains("spec")) {
        s.drafted = last["oryx"]["stats"]["spec"]["drafted"].get<int64_t>();
        s.accepted = last["oryx"]["stats"]["spec"]["accepted"].get<int64_t>();
        s.rounds_by_length = last["oryx"]["stats"]["spec"].value("rounds_by_length", std::vector<int64_t>{});
        s.round_s_by_length = last["oryx"]["stats"]["spec"].value("round_s_by_length", std::vector<double>{});
        s.backend_rounds = last["oryx"]["stats"]["spec"].value("backend_rounds", int64_t{0});
      }
    }
  }
  return s;
}

// The prompts of `count` requests: corpus windows spread over the validation split (a different part per
// `seed`), or random token ids after a BOS; the first shared_prefix_tokens of every one those of the first.
absl::StatusOr<std::vector<std::vector<int32_t>>> Prompts(const ServeBenchOptions& o, const CorpusReader* corpus,
                                                          int64_t vocab, int64_t count, uint64_t seed) {
  std::vector<std::vector<int32_t>> prompts(count, std::vector<int32_t>(o.prompt_tokens + 1));
  for (int64_t i = 0; i < count; ++i) {
    std::vector<int32_t>& p = prompts[i];
    if (corpus != nullptr) {
      const int64_t windows = corpus->NumSequences(o.prompt_tokens);
      const int64_t index = static_cast<int64_t>((seed * 7919 + static_cast<uint64_t>(i) * 104729) % windows);
      ORYX_RETURN_IF_ERROR(corpus->ReadSequence(index, o.prompt_tokens, p.data()));
    } else {
      Rng rng(seed * 1000003 + static_cast<uint64_t>(i));
      p[0] = kBosId;
      for (size_t t = 1; t < p.size(); ++t) p[t] = static_cast<int32_t>(rng.UniformRange(4, vocab - 1));
    }
    p.pop_back();
    // A corpus window's suffix follows its own text, not the shared prefix: the suffixes still differ, which
    // is what the workload needs.
    if (i > 0) std::copy_n(prompts[0].begin(), o.shared_prefix_tokens, p.begin());
  }
  return prompts;
}

// The prompts sent by `clients` closed-loop clients; the samples in prompt order.
std::vector<Sample> RunLevel(int port, const ServeBenchOptions& o, int64_t clients,
                             const std::vector<std::vector<int32_t>>& prompts) {
  const int64_t count = static_cast<int64_t>(prompts.size());
  std::vector<Sample> samples(count);
  std::atomic<int64_t> next{0};
  std::vector<std::thread> threads;
  for (int64_t c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      httplib::Client client("127.0.0.1", port);
      client.set_read_timeout(std::chrono::seconds(600));
      for (int64_t i = next++; i < count; i = next++) samples[i] = Complete(client, o, prompts[i], i);
    });
  }
  for (std::thread& t : threads) t.join();
  return samples;
}

// The prompts sent at random times, `rate` a second on average (exponential gaps), each on its own
// connection; the samples in prompt order.
std::vector<Sample> RunOpenLoop(int port, const ServeBenchOptions& o, double rate,
                                const std::vector<std::vector<int32_t>>& prompts, uint64_t seed) {
  std::vector<Sample> samples(prompts.size());
  std::vector<std::thread> threads;
  Rng rng(seed);
  Clock::time_point at = Clock::now();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const double gap_s = -std::log(1 - rng.UniformDouble()) / rate;  // exponential: a Poisson process
    at += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap_s));
    std::this_thread::sleep_until(at);
    threads.emplace_back([&, i] {
      httplib::Client client("127.0.0.1", port);
      client.set_read_timeout(std::chrono::seconds(600));
      samples[i] = Complete(client, o, prompts[i], i);
    });
  }
  for (std::thread& t : threads) t.join();
  return samples;
}

}  // namespace

absl::Status RunServeBench(const ServeBenchOptions& o, const Emit& emit) {
  if (o.concurrency.empty() && o.rates.empty()) return absl::InvalidArgumentError("bench serve: no load levels");
  for (double r : o.rates) {
    if (!(r > 0 && r <= 1e5)) {
      return absl::InvalidArgumentError(Cat("bench serve: arrival rate ", r, " is not in (0, 1e5]"));
    }
  }
  const bool open_loop = !o.rates.empty();
  if (o.prompt_tokens < 1 || o.max_tokens < 1) {
    return absl::InvalidArgumentError("bench serve: --prompt-tokens and --max-tokens must be >= 1");
  }
  if (o.shared_prefix_tokens < 0 || o.shared_prefix_tokens > o.prompt_tokens) {
    return absl::InvalidArgumentError(Cat("bench serve: --shared-prefix ", o.shared_prefix_tokens,
                                          " must be in [0, --prompt-tokens ", o.prompt_tokens, "]"));
  }
  std::string model;
  ORYX_ASSIGN_OR_RETURN(Engine engine, MakeEngine(o, &model));
  policies::RegisterAllPolicies(engine.policies());
  for (const std::string& p : PolicyList(o)) {  // an unknown name fails here, not in every request
    if (absl::StatusOr<std::unique_ptr<Decoder>> d = engine.policies().Make(p); !d.ok()) {
      return absl::InvalidArgumentError(Cat("bench serve: --policy: ", d.status().message()));
    }
  }
  const ModelConfig& c = engine.backend().config();
  if (o.prompt_tokens + o.max_tokens > c.max_position) {
    return absl::InvalidArgumentError(Cat("bench serve: ", o.prompt_tokens, " prompt + ", o.max_tokens,
                                          " generated tokens exceed the model's max_position ", c.max_position));
  }
  std::optional<CorpusReader> corpus;
  if (!o.data_dir.empty()) {
    ORYX_ASSIGN_OR_RETURN(corpus, CorpusReader::Open(o.data_dir, "val"));
    if (corpus->vocab_size() != c.vocab_size) {
      return absl::InvalidArgumentError(Cat(o.data_dir, ": corpus vocabulary ", corpus->vocab_size(),
                                            " differs from the model's ", c.vocab_size));
    }
    if (corpus->NumSequences(o.prompt_tokens) < 1) {
      return absl::FailedPreconditionError(Cat(o.data_dir, ": validation split shorter than ", o.prompt_tokens));
    }
  }
  const CorpusReader* text = corpus ? &*corpus : nullptr;
  // Open loop: however many requests are outstanding, the server admits max_batch and queues the rest.
  const int64_t top = open_loop ? 64 : *std::max_element(o.concurrency.begin(), o.concurrency.end());
  server::ServerOptions so;
  so.port = 0;
  so.log_requests = false;
  so.scheduler.max_batch = o.max_batch > 0 ? o.max_batch : top;
  so.scheduler.max_prefill_tokens = o.max_prefill_tokens;
  so.scheduler.kv_memory = o.kv_memory;
  if (!o.prefix_cache) {
    engine.set_prefix_cache(std::nullopt);
  } else if (o.prefix_snapshot_every > 0) {
    engine.set_prefix_cache(PrefixCacheOptions{.snapshot_every = o.prefix_snapshot_every});
  }
  so.scheduler.max_queue = open_loop ? 4096 : std::max<int64_t>(top, 16);
  so.http_threads = open_loop ? 512 : static_cast<int>(top + 8);
  so.max_connections_per_client = so.http_threads;  // no cap: every client is this process, on one address
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<server::HttpServer> http, server::HttpServer::Start(engine, so));

  const size_t levels = open_loop ? o.rates.size() : o.concurrency.size();
  for (size_t level = 0; level < levels; ++level) {
    const int64_t clients = open_loop ? 0 : o.concurrency[level];
    const double rate = open_loop ? o.rates[level] : 0.0;
    const int64_t count = o.requests > 0 ? o.requests
                                         : std::max<int64_t>(8, 4 * (open_loop ? std::llround(rate) : clients));
    // A warm-up run of the same load first, not measured: the device graphs of the batch shapes the level
    // meets are captured there, not during the measurement. Closed loop: one request per client; open loop:
    // a quarter of the level's requests at its rate.
    const int64_t warm_count = open_loop ? std::max<int64_t>(16, count / 4) : clients;
    // Every level starts with an empty prefix cache: its hits are its own prompts'.
    if (engine.prefix_cache() != nullptr) engine.prefix_cache()->Clear();
    ORYX_ASSIGN_OR_RETURN(auto warm_up, Prompts(o, text, c.vocab_size, warm_count, o.seed + 7777 + level));
    const std::vector<Sample> warmed = open_loop ? RunOpenLoop(http->port(), o, rate, warm_up, o.seed + 7777 + level)
                                                 : RunLevel(http->port(), o, clients, warm_up);
    for (const Sample& s : warmed) {
      if (!s.error.empty()) return absl::InternalError(Cat("bench serve: a warm-up request failed: ", s.error));
    }
    ORYX_ASSIGN_OR_RETURN(auto prompts, Prompts(o, text, c.vocab_size, count, o.seed + level));
    // A validation split with fewer windows than requests repeats prompts, which the prefix cache may then
    // serve: the level measures less prefill than its workload asks for.
    const int64_t distinct_prompts = static_cast<int64_t>(std::set(prompts.begin(), prompts.end()).size());
    if (distinct_prompts < count && o.prefix_cache) {
      std::cerr << "bench serve: warning: " << count << " requests but " << distinct_prompts << " distinct prompts of "
                << o.prompt_tokens << " tokens (the validation split is short for them): the prefix cache may "
                << "serve the repeats (prefix_hit_rate); --no-prefix-cache computes every prompt\n";
    }
    const server::SchedulerStats before = http->stats();
    const int64_t graphs_before = engine.backend().graphs_recorded();
    const int64_t warmups_before = engine.backend().graph_warmups();
    const std::vector<std::pair<std::string, double>> counters_before = engine.backend().Counters();
    const Clock::time_point start = Clock::now();
    std::vector<Sample> samples = open_loop ? RunOpenLoop(http->port(), o, rate, prompts, o.seed + 31 * level)
                                            : RunLevel(http->port(), o, clients, prompts);
    const double wall = Since(start);
    const server::SchedulerStats after = http->stats();
    std::vector<double> ttft, latency, between, gaps;
    int64_t tokens = 0, drafted = 0, accepted = 0, cached_tokens = 0, backend_rounds = 0;
    int64_t attention_tokens = 0, linear_tokens = 0;
    std::vector<int64_t> rounds_by_length;
    std::vector<double> round_s_by_length;
    for (const Sample& s : samples) {
      drafted += s.drafted;
      backend_rounds += s.backend_rounds;
      accepted += s.accepted;
      rounds_by_length.resize(std::max(rounds_by_length.size(), s.rounds_by_length.size()));
      round_s_by_length.resize(rounds_by_length.size());
      for (size_t k = 0; k < s.rounds_by_length.size() && k < s.round_s_by_length.size(); ++k) {
        rounds_by_length[k] += s.rounds_by_length[k];
        round_s_by_length[k] += s.round_s_by_length[k];
      }
      if (!s.error.empty()) return absl::InternalError(Cat("bench serve: a request failed: ", s.error));
      ttft.push_back(1e3 * s.ttft_s);
      latency.push_back(1e3 * s.latency_s);
      if (s.tokens > 1) between.push_back(1e3 * (s.latency_s - s.ttft_s) / static_cast<double>(s.tokens - 1));
      for (double g : s.gaps_s) gaps.push_back(1e3 * g);
      tokens += s.tokens;
      cached_tokens += s.cached_tokens;
      attention_tokens += s.attention_tokens, linear_tokens += s.linear_tokens;
    }
    const int64_t steps = after.steps - before.steps;
    json row = {
        {"bench", "serve"},
        {"model", model},
        {"device", o.device},
        {"policy", o.policy},
        {"prompts", text != nullptr ? "corpus" : "random"},
        {"concurrency", clients},  // 0: open loop
        {"requests", count},
        {"distinct_prompts", distinct_prompts},
        {"prompt_tokens", o.prompt_tokens},
        {"shared_prefix_tokens", o.shared_prefix_tokens},
        {"prefix_cache", o.prefix_cache},
        // Prompt tokens restored from the prefix cache, of all the level's prompt tokens.
        {"prefix_hit_rate", static_cast<double>(cached_tokens) / static_cast<double>(count * o.prompt_tokens)},
        {"max_tokens", o.max_tokens},
        // Of the tokens the requests forwarded (prompts and generations), the share in attention mode: what
        // a routed policy chose.
        {"attention_fraction",
         attention_tokens + linear_tokens > 0
             ? static_cast<double>(attention_tokens) / static_cast<double>(attention_tokens + linear_tokens)
             : 0.0},
        {"max_batch", so.scheduler.max_batch},
        {"max_prefill_tokens", o.max_prefill_tokens},
        {"wall_s", wall},
        {"requests_per_s", static_cast<double>(count) / wall},
        {"generated_tokens_per_s", static_cast<double>(tokens) / wall},
        {"ttft_ms", {{"p50", Percentile(ttft, 0.5)}, {"p90", Percentile(ttft, 0.9)}, {"p99", Percentile(ttft, 0.99)}}},
        {"latency_ms", {{"p50", Percentile(latency, 0.5)}, {"p90", Percentile(latency, 0.9)}}},
        // Each request's mean time per token after its first (TPOT), over the requests: the p90 and p99 are the
        // requests served slowest, as those a speculative batch's one draft length suits least.
        {"inter_token_ms_p50", Percentile(between, 0.5)},
        {"inter_token_ms_p90", Percentile(between, 0.9)},
        {"inter_token_ms_p99", Percentile(between, 0.99)},
        // Every gap between two token chunks of a request, all requests pooled: the tail shows the
        // steps that waited for a prefill. (Tokens that arrive together, a speculative round's, give
        // gaps of 0.)
        {"token_gap_ms",
         {{"p50", Percentile(gaps, 0.5)},
          {"p90", Percentile(gaps, 0.9)},
          {"p99", Percentile(gaps, 0.99)},
          {"max", gaps.empty() ? 0.0 : *std::max_element(gaps.begin(), gaps.end())}}},
        {"server_steps", steps},
        // The engine thread's time in those steps, and of it the time handing out tokens (text, stop
        // strings, the server's stream events): host work as large per token under every policy.
        {"server_step_s", after.step_s - before.step_s},
        {"server_emit_s", after.emit_s - before.emit_s},
        // Of the steps' time, that in the backend's forwards and whole rounds (the device's work and the wait
        // for it); the rest is the engine thread's own, when the device waits.
        {"server_forward_s", after.forward_s - before.forward_s},
        // The host's part by what it does (GenerationBatch::HostSeconds): admission, starting prompts (their
        // modes, prefix-cache lookups), planning the forwards, reading their results (emitting included).
        {"server_host_s", (after.host_s - before.host_s).ToJson()},
        {"preemptions", after.preemptions - before.preemptions},
        // Device graphs recorded during the level (shapes the warm-up did not meet): each costs a recording.
        {"graphs_recorded", engine.backend().graphs_recorded() - graphs_before},
        // Forwards and rounds of such shapes before their graphs replayed (their time: graph_warmup_s, one of
        // the backend's counters below).
        {"graph_warmups", engine.backend().graph_warmups() - warmups_before},
        {"kv_memory_mib", static_cast<double>(after.kv_memory) / (1 << 20)},    // the budget in force
        {"kv_pool_mib", static_cast<double>(after.kv_pool_bytes) / (1 << 20)},  // the pool's memory
        {"max_admitted", after.max_admitted},  // requests holding memory at once, so far
        {"mean_decode_batch", steps > 0 ? static_cast<double>(after.decode_rows - before.decode_rows) / steps : 0.0},
        // The share of decode rows that ran in a prefill's forward (GenerationBatch).
        {"shared_decode_fraction", after.decode_rows > before.decode_rows
                                       ? static_cast<double>(after.shared_rows - before.shared_rows) /
                                             static_cast<double>(after.decode_rows - before.decode_rows)
                                       : 0.0},
        {"threads", o.threads}};
    if (open_loop) row["arrival_rate_per_s"] = rate;
    // The backend's own counters over the level (Backend::Counters), as flat keys.
    const std::vector<std::pair<std::string, double>> counters_after = engine.backend().Counters();
    for (size_t i = 0; i < counters_after.size() && i < counters_before.size(); ++i) {
      row[counters_after[i].first] = counters_after[i].second - counters_before[i].second;
    }
    if (const PrefixCache* cache = engine.prefix_cache(); cache != nullptr) {
      const PrefixCacheStats st = cache->stats();  // at the level's end
      row["prefix_cache_snapshots"] = st.snapshots;
      row["prefix_cache_mib"] = static_cast<double>(st.bytes) / (1 << 20);
      row["prefix_snapshot_every"] = cache->options().snapshot_every;
    }
    if (PolicyList(o).size() > 1) {  // mixed policies: how each one's requests fared
      for (const std::string& p : PolicyList(o)) {
        std::vector<double> p_latency, p_ttft, p_rate;
        for (const Sample& s : samples) {
          if (s.policy != p) continue;
          p_latency.push_back(1e3 * s.latency_s);
          p_ttft.push_back(1e3 * s.ttft_s);
          if (s.tokens > 1) p_rate.push_back(static_cast<double>(s.tokens - 1) / (s.latency_s - s.ttft_s));
        }
        row["by_policy"][p] = {{"requests", p_latency.size()},
                               {"latency_ms_p50", Percentile(p_latency, 0.5)},
                               {"ttft_ms_p50", Percentile(p_ttft, 0.5)},
                               // A request's tokens per second after its first token, the median request.
                               {"decode_tokens_per_s_p50", Percentile(p_rate, 0.5)}};
      }
    }
    if (drafted > 0) {
      row["drafted"] = drafted;
      row["accepted"] = accepted;
      row["acceptance_rate"] = static_cast<double>(accepted) / static_cast<double>(drafted);
    }
    if (!rounds_by_length.empty()) {  // what the draft lengths were, and what a round of each cost
      std::vector<double> mean_ms(rounds_by_length.size(), 0.0);
      for (size_t k = 0; k < mean_ms.size(); ++k) {
        if (rounds_by_length[k] > 0) mean_ms[k] = 1e3 * round_s_by_length[k] / static_cast<double>(rounds_by_length[k]);
      }
      row["rounds_by_length"] = rounds_by_length;
      row["round_ms_by_length"] = mean_ms;
      // Of the rounds that drafted (a slot's each), the share the backend ran whole: the rest ran as engine
      // steps, one forward each (a batch out of step, mixed sampling parameters).
      const int64_t drafting = std::accumulate(rounds_by_length.begin() + 1, rounds_by_length.end(), int64_t{0});
      if (drafting > 0)
        row["whole_round_fraction"] = static_cast<double>(backend_rounds) / static_cast<double>(drafting);
    }
    row.update(Provenance());
    emit(row);
  }
  http->Stop();
  return absl::OkStatus();
}

}  // namespace oryx::bench
