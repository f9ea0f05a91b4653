// `oryx serve`'s HTTP layer: the completions endpoint over a Scheduler, and what a deployment expects
// around it.
//   POST /v1/completions   OpenAI-style completions (server/completions.h); server-sent events when
//                          "stream": true, ending with "data: [DONE]"
//   GET  /v1/models        the served model
//   GET  /health           {"status": "ok"}
//   GET  /stats            the scheduler's counters and load (SchedulerStats)
// Errors are JSON ({"error": {"message", "type", "code"}}) with status 400 (bad request, streamed or not),
// 404 (no such route), 413 (a body over 16 MiB), 429 (a connection past the cap per client address), 503
// (queue full, shutting down, no device memory) or 500.
// A client that goes away (closes or resets its connection) while its request waits or streams cancels it:
// the request leaves the batch before the next step, its memory freed, and gets no answer (logged as 499).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "server/completions.h"
#include "server/scheduler.h"

namespace oryx::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;              // 0: any free port (HttpServer::port() says which)
  int http_threads = 64;        // requests served at once: each waiting or streaming request holds one
  // Connections one client address may hold at once (a connection holds an HTTP thread while it sends its
  // request, waits or streams); one more is answered 429 and closed without being read, so that a flood of
  // slow clients from one address leaves threads to the others. 0: half of http_threads (at least 1);
  // http_threads or more: no cap (behind a proxy every client has the proxy's address).
  int max_connections_per_client = 0;
  // Seconds a connection may take to send its request (each read; a client that sends half a request holds
  // an HTTP thread this long at most). A stream's writes have their own, longer, timeout.
  double read_timeout_s = 10;
  std::string model_name = "oryx";
  SchedulerOptions scheduler;
  bool log_requests = true;     // one line per completion request on stderr
  // Non-empty: every endpoint but /health needs `Authorization: Bearer KEY` with one of these (401 otherwise).
  std::vector<std::string> api_keys;
  // Both set: HTTPS with this PEM certificate (chain) and private key (InvalidArgument when they do not load).
  std::string tls_cert, tls_key;
  ChatTemplate chat_template;  // for /v1/chat/completions (ChatTemplate::Load: the model directory's)
};

class HttpServer {
 public:
  // Binds the port (Unavailable naming it when it cannot) and serves on background threads. The engine,
  // its policies registered, must outlive the server.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(Engine& engine, ServerOptions options);
  ~HttpServer();  // Stop()

  int port() const;
  // Blocks until Stop has been called (from another thread) and the server has stopped.
  void Wait();
  // Ends the requests in flight (503), stops listening and joins the threads. Idempotent.
  void Stop();
  // Stops taking requests (503, and /health answers 503 "draining") while those taken run to their end: true
  // once they all have, false when `timeout` passed first. Stop afterwards.
  bool Drain(std::chrono::milliseconds timeout);
  SchedulerStats stats() const;

  struct Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace oryx::server
