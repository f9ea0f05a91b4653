// `oryx serve`: an HTTP completions server over one model (server/http_server.h), with continuous
// batching. Runs until SIGINT or SIGTERM, then ends the requests in flight and prints its counters.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "base/file_util.h"
#include "base/flags.h"
#include "base/status_macros.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "engine/engine.h"
#include "engine/json_text.h"
#include "policies/rule_policies.h"
#include "server/http_server.h"

namespace oryx::cli {

int RunServe(const Args& args) {
  std::string name;
  server::ServerOptions o;
  int64_t port = o.port, max_batch = o.scheduler.max_batch, max_queue = o.scheduler.max_queue;
  int64_t http_threads = o.http_threads, max_prefill_tokens = 0, kv_memory_mib = 0;
  bool quiet = false;
  FlagSet f("oryx serve --model DIR [--device cpu|cuda] [--host H] [--port P] [--max-batch N] [--max-queue N]",
            "Serves the model over HTTP until interrupted (Ctrl-C, SIGTERM):\n"
            "  POST /v1/completions   OpenAI-style completions: prompt (text or token ids), max_tokens, temperature,\n"
            "                         top_p, top_k, seed, stop, stream (server-sent events), ignore_eos, and\n"
            "                         policy (any `oryx generate` policy, speculative ones included; learned ones\n"
            "                         by the names --policy and --policy-dir give them)\n"
            "  POST /v1/chat/completions  OpenAI-style chat: messages through the model's chat_template.json (or\n"
            "                         a default: 'User: ...' / 'Assistant: ...'), streaming, the same fields\n"
            "  GET  /v1/models, /health, /stats, /metrics\n"
            "Requests share one continuously batched decode loop: they join between steps and leave as they\n"
            "finish; a long prompt is prefilled a span per step, so it never stalls the others for long.\n"
            "Example:\n"
            "  curl -s localhost:8080/v1/completions -d '{\"prompt\": \"int main\", \"max_tokens\": 32}'");
  EngineFlags engine_flags;
  engine_flags.AddModel(f);
  f.String("host", &o.host, "address to listen on (0.0.0.0: every interface)");
  f.Int("port", &port, "port to listen on (0: any free port, printed at start)", 0, 65535);
  f.Int("max-batch", &max_batch, "requests generating together at most", 1, 4096);
  f.Int("max-queue", &max_queue, "requests waiting for a place in the batch at most; more get 503", 0, 1 << 20);
  f.Int("max-prefill-tokens", &max_prefill_tokens,
        "prompt tokens prefilled per step at most (0: no bound); smaller: the running requests' next tokens "
        "wait less for a joining prompt, whose first token comes later", 0, 1 << 30);
  f.Int("kv-memory", &kv_memory_mib,
        "MiB of KV cache the running requests may hold (0: as much as the device has); requests wait for "
        "memory, the latest admitted are preempted and recomputed when others need room, "
        "and one that could never fit gets a 400", 0, int64_t{1} << 30);
  f.Int("http-threads", &http_threads, "connections served at once (each waiting or streaming request holds one)",
        1, 4096);
  int64_t max_connections_per_client = 0;
  f.Int("max-connections-per-client", &max_connections_per_client,
        "connections one client address may hold at once; one more is answered 429 (with TLS, closed) without "
        "being read, so that a flood of slow clients leaves HTTP threads to the others (0: half of --http-threads; "
        "--http-threads or more: no cap, as behind a proxy, where every client has the proxy's address)",
        0, 1 << 20);
  engine_flags.AddBackend(f);
  f.String("name", &name, "the model's name in responses (default: the model directory's name)");
  std::vector<std::string> learned;
  std::string learned_dir;
  f.StringList("policy", &learned,
               "NAME=FILE...: learned policies (oryx train-router files) that requests name as NAME or "
               "learned:NAME; a request never names a file");
  std::string api_key_file;
  f.StringList("api-key", &o.api_keys, "require `Authorization: Bearer KEY` with one of these on every endpoint "
               "but /health (401 otherwise)");
  f.String("api-key-file", &api_key_file, "the same, keys read from a file, one per line ('#' starts a comment)");
  f.String("tls-cert", &o.tls_cert, "serve HTTPS with this PEM certificate (chain); needs --tls-key");
  f.String("tls-key", &o.tls_key, "the certificate's PEM private key");
  f.String("policy-dir", &learned_dir, "serve every .safetensors policy file in DIR, named by its file name");
  f.Double("read-timeout", &o.read_timeout_s,
           "seconds a client may take to send its request (a slow client holds an HTTP thread this long at most)");
  double request_timeout = 0;
  f.Double("request-timeout", &request_timeout,
           "seconds a request may take from its arrival; past them it ends with 504 (a stream, with an error "
           "event) at its next token (0: no limit)");
  int64_t drain_seconds = 30;
  f.Int("drain-timeout", &drain_seconds,
        "on SIGINT or SIGTERM, seconds the requests taken may take to finish while new ones get 503 and "
        "/health says draining (a second signal stops at once; 0: stop at once)", 0, 86400);
  f.Bool("quiet", &quiet, "no line per request on stderr");
  return RunWithFlags(f, args, [&]() -> absl::Status {
    // Block the stop signals in every thread (the engine's and the server's inherit this mask); this
    // thread waits for them below.
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

    if (o.tls_cert.empty() != o.tls_key.empty()) {  // before the model loads
      return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
    }
    ORYX_ASSIGN_OR_RETURN(Engine engine, engine_flags.Load());
    std::vector<std::pair<std::string, std::string>> served;
    for (const std::string& spec : learned) {
      const size_t eq = spec.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size()) {
        return absl::InvalidArgumentError(Cat("--policy '", spec, "': give NAME=FILE"));
      }
      served.emplace_back(spec.substr(0, eq), spec.substr(eq + 1));
    }
    if (!learned_dir.empty()) {
      std::error_code ec;
      std::vector<std::filesystem::path> found;
      for (const auto& entry : std::filesystem::directory_iterator(learned_dir, ec)) {
        if (entry.is_regular_file() && entry.path().extension() == ".safetensors") found.push_back(entry.path());
      }
      if (ec) return absl::InvalidArgumentError(Cat("--policy-dir ", learned_dir, ": ", ec.message()));
      std::ranges::sort(found);
      for (const auto& p : found) served.emplace_back(p.stem().string(), p.string());
    }
    ORYX_RETURN_IF_ERROR(policies::RegisterServedLearnedPolicies(engine.policies(), served));
    ORYX_ASSIGN_OR_RETURN(o.chat_template, server::ChatTemplate::Load(engine_flags.model_dir));
    if (!api_key_file.empty()) {
      ORYX_ASSIGN_OR_RETURN(const std::string keys, ReadFile(api_key_file));
      for (absl::string_view line : absl::StrSplit(keys, '\n')) {
        line = absl::StripAsciiWhitespace(line);
        if (!line.empty() && line[0] != '#') o.api_keys.emplace_back(line);
      }
      if (o.api_keys.empty()) return absl::InvalidArgumentError(Cat("--api-key-file ", api_key_file, ": no keys in it"));
    }
    for (const std::string& key : o.api_keys) {
      if (key.empty()) return absl::InvalidArgumentError("--api-key: an empty key");
    }
    const bool loopback = o.host == "127.0.0.1" || o.host == "localhost" || o.host == "::1";
    if (!loopback && o.api_keys.empty()) {
      std::cerr << "oryx serve: warning: listening on " << o.host << " without --api-key: anyone who can reach "
                << "this port can use the server" << std::endl;
    }
    o.port = static_cast<int>(port);
    o.scheduler.max_batch = max_batch;
    o.scheduler.max_queue = max_queue;
    o.scheduler.max_prefill_tokens = max_prefill_tokens;
    o.scheduler.kv_memory = kv_memory_mib << 20;
    if (!(request_timeout >= 0)) return absl::InvalidArgumentError("--request-timeout must be >= 0 seconds");
    o.scheduler.request_timeout = std::chrono::milliseconds(static_cast<int64_t>(request_timeout * 1000));
    o.http_threads = static_cast<int>(http_threads);
    o.max_connections_per_client = static_cast<int>(max_connections_per_client);
    o.log_requests = !quiet;
    o.model_name =
        !name.empty() ? name : std::filesystem::path(engine_flags.model_dir).lexically_normal().filename().string();
    if (o.model_name.empty())
      o.model_name = std::filesystem::path(engine_flags.model_dir).lexically_normal().parent_path().filename().string();
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<server::HttpServer> http, server::HttpServer::Start(engine, o));
    std::cerr << "oryx serve: model '" << o.model_name << "' on " << engine.backend().name() << ", listening on "
              << (o.tls_cert.empty() ? "http://" : "https://")
              << o.host << ":" << http->port() << " (max batch " << max_batch << ", queue " << max_queue
              << "); Ctrl-C stops" << std::endl;
    int signal = 0;
    sigwait(&stop_signals, &signal);
    if (drain_seconds > 0) {
      const server::SchedulerStats st = http->stats();
      std::cerr << "oryx serve: " << (signal == SIGINT ? "SIGINT" : "SIGTERM") << ", draining: requests taken "
                << st.submitted - st.completed - st.failed - st.cancelled << ", up to " << drain_seconds
                << " s to finish (a second signal stops now)" << std::endl;
      std::atomic<bool> drained{false};
      std::thread drain([&] {
        drained = http->Drain(std::chrono::seconds(drain_seconds));
        kill(getpid(), SIGTERM);  // wakes the wait below
      });
      sigwait(&stop_signals, &signal);
      if (!drained) std::cerr << "oryx serve: stopping the requests still running" << std::endl;
      http->Stop();  // ends a drain cut short by the second signal as well
      drain.join();
    } else {
      std::cerr << "oryx serve: " << (signal == SIGINT ? "SIGINT" : "SIGTERM") << ", stopping" << std::endl;
      http->Stop();
    }
    std::cerr << "oryx serve: " << JsonText(http->stats().ToJson()) << std::endl;
    return absl::OkStatus();
  });
}

}  // namespace oryx::cli
