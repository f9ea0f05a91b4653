#include "server/http_server.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <variant>

#include "absl/strings/str_format.h"
#include "base/str_cat.h"
#include "engine/json_text.h"
#include "httplib.h"
#include "server/completions.h"
#include "server/connections.h"
#include "server/metrics.h"

namespace oryx::server {

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// A prompt of a model's whole context is well under this; a larger body is refused before it is read.
constexpr size_t kMaxBodyBytes = size_t{16} << 20;

// The status logged (never sent) for a request whose client went away before it was answered, as nginx logs
// it: "client closed request".
constexpr int kClientClosedRequest = 499;

double MsSince(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// Leaves the request unanswered: the connection this thread serves is shut down, so that httplib writes
// nothing more and closes it. For a client that has gone (a client that only half-closed gets no answer
// either, as from nginx).
void CloseUnanswered() {
  if (const socket_t sock = GateServer::CurrentConnection(); sock != INVALID_SOCKET) shutdown(sock, SHUT_RDWR);
}

void Reply(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(JsonText(body), "application/json");
}

void ReplyError(httplib::Response& res, const absl::Status& status) {
  Reply(res, HttpStatus(status), ErrorObject(status));
}

// One streaming request's events, from the scheduler's thread (Token, Finish) to the connection's thread
// (WaitForFirst, then WriteTo as httplib's chunked content provider). A request of several choices streams
// them interleaved, each chunk with its choice's index, and ends when the last one does. A token's chunk is
// made into JSON on the connection's thread: the scheduler's thread, which every request's steps wait for,
// only queues its text.
struct EventStream {
  // A token's chunk before it is made into JSON.
  struct TokenChunk {
    int64_t index = 0;  // the choice
    int32_t token = 0;
    std::string text;    // the complete UTF-8 characters it brings (held back ones come with a later chunk)
    bool first = false;  // the choice's first chunk
    std::optional<TokenLogProb> logprob;
  };
  using Event = std::variant<std::string, TokenChunk>;  // a server-sent event ready to write, or a token's
  std::mutex mu;
  std::condition_variable ready;
  std::deque<Event> frames;        // in order
  bool finished = false;           // the last frame is queued
  absl::Status error;              // what ended the request, when it failed
  std::atomic<bool> cancelled{false};        // the client went away (Impl::Cancel)
  std::vector<int64_t> tickets;              // the choices' in the scheduler
  bool chat = false, include_usage = false;  // chat.completion.chunk frames; a last one with the usage
  int64_t n = 1;                             // choices per prompt
  struct Choice {
    std::string held;    // text held back: it ends inside a UTF-8 character
    bool first = true;   // no token sent yet
    std::optional<GenerateResult> result;
    ChoiceContext context;  // names tokens in log-probabilities
    size_t offset = 0;      // the next token's text offset (after the prompt's text); the connection's thread's
  };
  CompletionId id;
  std::vector<Choice> choices;
  int64_t running = 0, tokens = 0;

  EventStream(const CompletionId& id, size_t count) : id(id), choices(count), running(static_cast<int64_t>(count)) {}

  void Push(const json& j) { frames.emplace_back("data: " + JsonText(j) + "\n\n"); }

  // One chunk per token, even when its text is held back or empty (a model without a tokenizer).
  void Token(int64_t index, const TokenEvent& e) {
    std::lock_guard<std::mutex> lock(mu);
    Choice& c = choices[index];
    c.held += e.text;
    const size_t n = CompleteUtf8Prefix(c.held);
    TokenChunk chunk{index, e.token, c.held.substr(0, n), c.first, std::nullopt};
    if (e.logprob != nullptr) chunk.logprob = *e.logprob;
    frames.emplace_back(std::move(chunk));
    c.first = false;
    c.held.erase(0, n);
    ++tokens;
    ready.notify_one();
  }

  // The chunk's server-sent event (on the connection's thread, in the chunks' order).
  std::string Frame(const TokenChunk& t) {
    Choice& c = choices[t.index];
    json logprobs = nullptr;
    if (t.logprob) {
      logprobs =
          chat ? ChatTokenLogprobs(*t.logprob, c.context) : CompletionTokenLogprobs(*t.logprob, c.context, c.offset);
      c.offset += TokenTextBytes(c.context, t.token);
    }
    const json j = chat ? ChatCompletionChunk(id, t.text, nullptr, t.first, t.index, std::move(logprobs))
                        : CompletionChunk(id, t.text, nullptr, t.token, t.index, std::move(logprobs));
    return "data: " + JsonText(j) + "\n\n";
  }

  void Finish(int64_t index, const absl::StatusOr<GenerateResult>& r) {
    std::lock_guard<std::mutex> lock(mu);
    Choice& c = choices[index];
    if (r.ok()) {
      // Anything held back goes out, made valid.
      Push(chat ? ChatCompletionChunk(id, c.held, &*r, c.first, index) : CompletionChunk(id, c.held, &*r, -1, index));
      c.result = *r;
    } else if (error.ok()) {
      error = r.status();
      Push(ErrorObject(r.status()));
    }
    if (--running > 0) return;
    if (chat && include_usage && error.ok()) {
      std::vector<GenerateResult> all;
      for (const Choice& x : choices) all.push_back(*x.result);
      Push(ChatUsageChunk(id, all, n));
    }
    frames.emplace_back("data: [DONE]\n\n");
    finished = true;
    ready.notify_one();
  }

  // Waits for the first event: OK, or the error of a request that ended before producing anything
  // (Cancelled when its client has gone).
  absl::Status WaitForFirst() {
    std::unique_lock<std::mutex> lock(mu);
    ready.wait(lock, [&] { return tokens > 0 || finished || cancelled; });
    if (cancelled) return absl::CancelledError("the client went away");
    return tokens == 0 && !error.ok() ? error : absl::OkStatus();
  }

  // The client has gone: wakes the connection's thread (Impl::Cancel ends the choices).
  void Cancel() {
    std::lock_guard<std::mutex> lock(mu);
    cancelled = true;
    ready.notify_one();
  }

  // Writes the frames so far (waiting for one); false when the client has gone.
  bool WriteTo(httplib::DataSink& sink) {
    std::deque<Event> out;
    bool last = false;
    {
      std::unique_lock<std::mutex> lock(mu);
      ready.wait(lock, [&] { return !frames.empty() || finished || cancelled; });
      if (cancelled) return false;
      out.swap(frames);
      last = finished;
    }
    std::string made;
    for (const Event& event : out) {
      const auto* token = std::get_if<TokenChunk>(&event);
      const std::string& frame = token ? (made = Frame(*token)) : std::get<std::string>(event);
      if (!sink.write(frame.data(), frame.size())) return false;  // the releaser cancels the request
    }
    if (last) sink.done();
    return true;
  }
};

}  // namespace

struct HttpServer::Impl {
  Impl(Engine& engine, ServerOptions o) : engine(engine), options(std::move(o)), scheduler(engine, options.scheduler) {}

  void Routes();
  // What a choice's response needs of its prompt: its text when echoed or given offsets (log-probabilities).
  ChoiceContext ContextOf(const GenerateRequest& q) const {
    const Tokenizer* tokenizer = engine.tokenizer() ? &*engine.tokenizer() : nullptr;
    ChoiceContext context{tokenizer, {}, q.echo};
    if (q.echo || q.logprobs >= 0) {
      context.prompt_text = q.prompt_tokens.empty() || tokenizer == nullptr ? q.prompt : tokenizer->Decode(q.prompt_tokens);
    }
    return context;
  }
  void Completion(const std::string& body, bool chat, httplib::Response& res);
  void Stream(CompletionRequest request, const CompletionId& id, Clock::time_point arrival, httplib::Response& res);
  void Log(const CompletionId& id, int status, bool stream, const absl::StatusOr<GenerateResult>& r,
           Clock::time_point arrival) const;
  // Ends a request's choices in the scheduler (its client has gone, or one choice was refused).
  void Cancel(const std::vector<int64_t>& tickets) {
    for (const int64_t t : tickets) scheduler.Cancel(t);
  }
  // Watches the connection this thread serves while its request waits or streams: when the client goes,
  // `gone` runs (on the watch's thread).
  DisconnectWatch::Watching WatchClient(std::function<void()> gone) {
    return watch.Watch(GateServer::CurrentConnection(), std::move(gone));
  }

  Engine& engine;
  mutable Metrics metrics;  // recorded as requests are answered (Log)
  ServerOptions options;
  Scheduler scheduler;
  DisconnectWatch watch;  // after the scheduler: its callbacks cancel there
  // The server with the routes (an httplib::SSLServer with TLS), and the gate that listens and hands it the
  // connections it lets in (made in Start).
  std::unique_ptr<httplib::Server> http;
  std::unique_ptr<GateServer> gate;
  int port = 0;
  socket_t listening = INVALID_SOCKET;  // the listening socket, seen when httplib sets its options
  std::thread listener;
  std::atomic<int64_t> next_id{0};
  const int64_t started = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch()).count();
  std::once_flag stop_once;
  std::mutex mu;
  std::condition_variable stopped_cv;
  bool stopped = false;  // guarded by mu
};

namespace {
// Compares in time that depends on the lengths alone, not on where the first difference is.
bool SameKey(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

// The backend's own counters (Backend::Counters: graph warm-ups, device allocations, whole rounds by stage),
// cumulative since it loaded; an empty object for a backend that keeps none.
json BackendCounters(const Backend& backend) {
  json counters = json::object();
  for (const auto& [name, value] : backend.Counters()) counters[name] = value;
  return counters;
}
}  // namespace

void HttpServer::Impl::Routes() {
  if (!options.api_keys.empty()) {
    http->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
      const std::string auth = req.get_header_value("Authorization");
      constexpr std::string_view kBearer = "Bearer ";
      bool ok = false;
      if (std::string_view(auth).starts_with(kBearer)) {
        const std::string_view key = std::string_view(auth).substr(kBearer.size());
        for (const std::string& k : options.api_keys) ok |= SameKey(key, k);
      }
      if (ok) return httplib::Server::HandlerResponse::Unhandled;
      res.set_header("WWW-Authenticate", "Bearer");
      Reply(res, 401, ErrorObject(auth.empty() ? "this server needs an API key: send Authorization: Bearer KEY"
                                               : "the API key is not valid",
                                  401));
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  // Ready, or draining (a load balancer should send no more): 503 then, as new requests get.
  http->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (scheduler.draining()) return Reply(res, 503, {{"status", "draining"}});
    Reply(res, 200, {{"status", "ok"}});
  });
  http->Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    Reply(res, 200,
          {{"object", "list"},
           {"data", json::array({{{"id", options.model_name}, {"object", "model"}, {"created", started},
                                  {"owned_by", "oryx"}}})}});
  });
  http->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    const PrefixCache* cache = engine.prefix_cache();
    const std::optional<PrefixCacheStats> cache_stats =
        cache != nullptr ? std::optional(cache->stats()) : std::nullopt;
    res.set_content(metrics.Text(scheduler.stats(), gate->stats(), cache_stats ? &*cache_stats : nullptr),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  http->Get("/stats", [this](const httplib::Request&, httplib::Response& res) {
    const PrefixCache* cache = engine.prefix_cache();
    const ConnectionStats connections = gate->stats();
    Reply(res, 200,
          {{"model", options.model_name},
           {"max_batch", options.scheduler.max_batch},
           {"max_queue", options.scheduler.max_queue},
           {"scheduler", scheduler.stats().ToJson()},
           {"connections",
            {{"open", connections.open}, {"refused", connections.refused}, {"max_per_client", gate->max_per_client()}}},
           {"prefix_cache", cache != nullptr ? ToJson(cache->stats()) : json(nullptr)},
           {"backend", BackendCounters(engine.backend())}});
  });
  // The body is read here, whatever its content type: httplib's own reading would parse a form-urlencoded
  // body (what `curl -d` sends) as form fields and refuse one over 8 KB. A multipart form has no JSON body.
  for (const bool chat : {false, true}) {
    http->Post(chat ? "/v1/chat/completions" : "/v1/completions",
              [this, chat](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
                if (req.is_multipart_form_data()) {
                  res.status = 415;
                  return;  // the error handler writes the body
                }
                std::string body;
                if (!reader([&](const char* data, size_t n) {
                      body.append(data, n);
                      return true;
                    })) {
                  if (res.status < 400) res.status = 400;  // httplib sets 413 for a body over the limit
                  return;
                }
                Completion(body, chat, res);
              });
  }
  // Errors that no handler answered (an unknown route or method, a body too large or unreadable) get a JSON
  // body rather than an empty one, and a log line.
  http->set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string message;
    if (res.status == 404) {
      message = Cat("no route ", req.method, " ", req.path, " (POST /v1/completions, /v1/chat/completions, GET /v1/models, /health, /stats, /metrics)");
    } else if (res.status == 413) {
      message = Cat("the request body is larger than ", kMaxBodyBytes >> 20, " MiB");
    } else if (res.status == 415) {
      message = Cat("unsupported content type '", req.get_header_value("Content-Type"),
                    "': send the request as a JSON body (Content-Type: application/json)");
    } else if (res.status == 400) {
      message = "the request body could not be read";
    } else {
      message = Cat("HTTP status ", res.status);
    }
    if (options.log_requests) {
      std::fprintf(stderr, "[serve] - %d %s %s: %s\n", res.status, req.method.c_str(), req.path.c_str(),
                   message.c_str());
    }
    res.set_content(JsonText(ErrorObject(message, res.status)), "application/json");
  });
  http->set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr e) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = ex.what();
    } catch (...) {
    }
    ReplyError(res, absl::InternalError(what));
  });
}

void HttpServer::Impl::Log(const CompletionId& id, int status, bool stream, const absl::StatusOr<GenerateResult>& r,
                           Clock::time_point arrival) const {
  metrics.Record(status, r, MsSince(arrival) / 1e3);
  if (!options.log_requests) return;
  std::string line = absl::StrFormat("[serve] %s %d%s", id.id, status, stream ? " stream" : "");
  if (status == kClientClosedRequest) {
    line += absl::StrFormat(": cancelled, the client disconnected (%.1f ms in all%s)", MsSince(arrival),
                            r.ok() ? absl::StrFormat(", %d tokens generated", r->stats.generated_tokens) : "");
  } else if (r.ok()) {
    const json stats = ToJson(*r)["stats"];
    line += absl::StrFormat(" %s: %d prompt + %d generated tokens (%s) | first token %.1f ms after admission, "
                            "decode %.1f tok/s | %.1f ms in all",
                            r->policy, r->stats.prompt_tokens, r->stats.generated_tokens,
                            FinishReasonName(r->finish_reason), 1e3 * r->stats.prefill_s,
                            stats["decode_tokens_per_s"].get<double>(), MsSince(arrival));
  } else {
    line += ": " + std::string(r.status().message());
  }
  std::fprintf(stderr, "%s\n", line.c_str());
}

void HttpServer::Impl::Completion(const std::string& body, bool chat, httplib::Response& res) {
  const Clock::time_point arrival = Clock::now();
  const CompletionId id{Cat(chat ? "chatcmpl-" : "cmpl-", next_id++),
                        std::chrono::duration_cast<std::chrono::seconds>(
                            std::chrono::system_clock::now().time_since_epoch()).count(),
                        options.model_name};
  absl::StatusOr<CompletionRequest> parsed = chat ? ParseChatRequest(body, options.model_name, options.chat_template)
                                                  : ParseCompletionRequest(body, options.model_name);
  if (!parsed.ok()) {
    Log(id, HttpStatus(parsed.status()), false, parsed.status(), arrival);
    return ReplyError(res, parsed.status());
  }
  if (parsed->stream) return Stream(std::move(*parsed), id, arrival, res);
  std::vector<GenerateRequest> choices = Choices(*parsed);
  std::vector<ChoiceContext> contexts;
  for (const GenerateRequest& q : choices) contexts.push_back(ContextOf(q));
  std::vector<std::future<absl::StatusOr<GenerateResult>>> futures;
  std::vector<int64_t> tickets;
  for (GenerateRequest& q : choices) {
    auto promise = std::make_shared<std::promise<absl::StatusOr<GenerateResult>>>();
    futures.push_back(promise->get_future());
    auto done = [promise](absl::StatusOr<GenerateResult> r) { promise->set_value(std::move(r)); };
    int64_t ticket = 0;
    if (absl::Status s = scheduler.Submit(std::move(q), std::move(done), &ticket); !s.ok()) {
      Cancel(tickets);  // the choices already queued
      Log(id, HttpStatus(s), false, s, arrival);
      return ReplyError(res, s);
    }
    tickets.push_back(ticket);
  }
  // A client that goes while its choices wait or run cancels them: they end with Cancelled.
  const DisconnectWatch::Watching watching = WatchClient([this, tickets] { Cancel(tickets); });
  std::vector<json> objects;
  absl::Status failed;
  bool gone = false;
  for (size_t i = 0; i < futures.size(); ++i) {
    absl::StatusOr<GenerateResult> result = futures[i].get();
    const bool cancelled = result.status().code() == absl::StatusCode::kCancelled;  // only Cancel gives it
    gone |= cancelled;
    Log(id, cancelled ? kClientClosedRequest : result.ok() ? 200 : HttpStatus(result.status()), false, result, arrival);
    if (!result.ok()) {
      if (failed.ok()) failed = result.status();
      continue;
    }
    objects.push_back(chat ? ChatCompletionObject(id, *result, contexts[i]) : CompletionObject(id, *result, contexts[i]));
  }
  if (gone) return CloseUnanswered();
  if (!failed.ok()) return ReplyError(res, failed);
  Reply(res, 200, MergeChoices(std::move(objects), parsed->n));
}

void HttpServer::Impl::Stream(CompletionRequest request, const CompletionId& id, Clock::time_point arrival,
                              httplib::Response& res) {
  std::vector<GenerateRequest> choices = Choices(request);
  auto events = std::make_shared<EventStream>(id, choices.size());
  events->chat = request.chat;
  events->include_usage = request.include_usage;
  events->n = request.n;
  for (size_t i = 0; i < choices.size(); ++i) {
    const int64_t index = static_cast<int64_t>(i);
    EventStream::Choice& c = events->choices[i];
    c.context = ContextOf(choices[i]);
    c.offset = c.context.prompt_text.size();
    if (c.context.echo) {  // the prompt first, as a chunk of its own
      std::lock_guard<std::mutex> lock(events->mu);
      events->Push(CompletionChunk(id, c.context.prompt_text, nullptr, -1, index));
    }
    choices[i].on_token = [events, index](const TokenEvent& e) {
      events->Token(index, e);
      return true;
    };
    auto done = [this, events, id, arrival, index](absl::StatusOr<GenerateResult> r) {
      const bool cancelled = events->cancelled.load() || r.status().code() == absl::StatusCode::kCancelled;
      Log(id, cancelled ? kClientClosedRequest : r.ok() ? 200 : HttpStatus(r.status()), true, r, arrival);
      events->Finish(index, r);
    };
    int64_t ticket = 0;
    if (absl::Status s = scheduler.Submit(std::move(choices[i]), std::move(done), &ticket); !s.ok()) {
      Log(id, HttpStatus(s), true, s, arrival);
      Cancel(events->tickets);  // the choices already queued
      for (size_t k = i; k < choices.size(); ++k) events->Finish(static_cast<int64_t>(k), s);
      break;
    }
    events->tickets.push_back(ticket);
  }
  // A client that goes while the choices wait or stream cancels them. The watch lasts as long as the response
  // (its releaser holds it), which ends before the connection closes.
  auto cancel = [this, events] {
    events->Cancel();
    Cancel(events->tickets);
  };
  auto watching = std::make_shared<DisconnectWatch::Watching>(WatchClient(cancel));
  // The status line goes out with the first token. A request that fails before it (one the engine refuses:
  // an over-long prompt, an unknown policy) gets its error status, as without streaming.
  if (absl::Status refused = events->WaitForFirst(); !refused.ok()) {
    return events->cancelled ? CloseUnanswered() : ReplyError(res, refused);
  }
  res.set_header("Cache-Control", "no-cache");
  // A failed write (the client has gone, or stopped reading for the write timeout) cancels it too.
  res.set_chunked_content_provider(
      "text/event-stream", [events](size_t, httplib::DataSink& sink) { return events->WriteTo(sink); },
      [cancel, watching](bool success) {
        if (!success) cancel();
      });
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(Engine& engine, ServerOptions options) {
  if (options.http_threads < 1) return absl::InvalidArgumentError("serve: http_threads must be >= 1");
  if (options.max_connections_per_client < 0) {
    return absl::InvalidArgumentError("serve: max_connections_per_client must be >= 0");
  }
  if (!(options.read_timeout_s > 0)) return absl::InvalidArgumentError("serve: read_timeout must be > 0 seconds");
  if (options.scheduler.max_batch < 1) return absl::InvalidArgumentError("serve: max_batch must be >= 1");
  if (options.scheduler.max_queue < 0) return absl::InvalidArgumentError("serve: max_queue must be >= 0");
  if (options.scheduler.max_prefill_tokens < 0) {
    return absl::InvalidArgumentError("serve: max_prefill_tokens must be >= 0");
  }
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("serve: TLS needs both a certificate (--tls-cert) and its key (--tls-key)");
  }
  for (const std::string& f : {options.tls_cert, options.tls_key}) {
    if (!f.empty() && !std::filesystem::is_regular_file(f)) {
      return absl::InvalidArgumentError(Cat("serve: ", f, ": no such file"));
    }
  }
  auto impl = std::make_unique<Impl>(engine, std::move(options));
  Impl& s = *impl;
  // The KV pool sized at start to the budget: its memory is there before the first request.
  if (const int64_t kv = s.scheduler.stats().kv_memory; kv > 0) {
    if (absl::Status r = engine.backend().ReserveKv(kv); !r.ok()) {
      return absl::ResourceExhaustedError(Cat("serve: cannot set aside the KV memory: ", r.message(),
                                              " (a smaller --kv-memory?)"));
    }
  }
  if (s.options.tls_cert.empty()) {
    s.http = std::make_unique<httplib::Server>();
  } else {
    auto tls = std::make_unique<httplib::SSLServer>(s.options.tls_cert.c_str(), s.options.tls_key.c_str());
    if (!tls->is_valid()) {
      return absl::InvalidArgumentError(Cat("serve: cannot use ", s.options.tls_cert, " and ", s.options.tls_key,
                                            " for TLS (not a PEM certificate and its private key?)"));
    }
    s.http = std::move(tls);
  }
  const int threads = s.options.http_threads;
  const int per_client =
      s.options.max_connections_per_client > 0 ? s.options.max_connections_per_client : std::max(1, threads / 2);
  s.gate = std::make_unique<GateServer>(*s.http, per_client, !s.options.tls_cert.empty(), s.options.log_requests);
  s.gate->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  for (httplib::Server* server : {static_cast<httplib::Server*>(s.gate.get()), s.http.get()}) {
    // Generation can take a while between a streamed request's tokens (a long prompt ahead of it).
    server->set_write_timeout(std::chrono::seconds(60));
    server->set_read_timeout(std::chrono::microseconds(static_cast<int64_t>(s.options.read_timeout_s * 1e6)));
  }
  // An idle kept-alive connection holds its thread too: no longer than a read may take (whole seconds, at
  // least one; httplib's default is 5).
  s.http->set_keep_alive_timeout(std::clamp<time_t>(static_cast<time_t>(s.options.read_timeout_s), 1, 5));
  s.http->set_payload_max_length(kMaxBodyBytes);
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a second server on the same port
  // starts silently and the kernel splits the connections between the two.
  s.gate->set_socket_options([&s](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    s.listening = sock;
  });
  s.Routes();
  if (s.options.port == 0) {
    s.port = s.gate->bind_to_any_port(s.options.host);
  } else {
    s.port = s.gate->bind_to_port(s.options.host, s.options.port) ? s.options.port : -1;
  }
  if (s.port <= 0) {
    return absl::UnavailableError(Cat("serve: cannot listen on ", s.options.host, ":", s.options.port,
                                      " (in use, or not an address of this machine)"));
  }
  // Debian's httplib listens with a backlog of 5: a burst of clients connecting at once overflows it, and
  // the dropped connections wait a second for the kernel's retry (or fail). Listen again with the system's
  // full backlog (Linux changes the backlog of a listening socket in place).
  if (s.listening != INVALID_SOCKET) ::listen(s.listening, SOMAXCONN);
  s.gate->OpenServing();
  s.listener = std::thread([&s] { s.gate->listen_after_bind(); });
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

int HttpServer::port() const { return impl_->port; }

void HttpServer::Wait() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->stopped_cv.wait(lock, [&] { return impl_->stopped; });
}

void HttpServer::Stop() {
  std::call_once(impl_->stop_once, [this] {
    // The scheduler first: every waiting handler then has its answer, so the HTTP threads can finish.
    impl_->scheduler.Stop();
    impl_->gate->CloseServing();  // ends the kept-alive connections and streams
    impl_->gate->stop();
    if (impl_->listener.joinable()) impl_->listener.join();
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopped = true;
    impl_->stopped_cv.notify_all();
  });
}

bool HttpServer::Drain(std::chrono::milliseconds timeout) { return impl_->scheduler.Drain(timeout); }

SchedulerStats HttpServer::stats() const { return impl_->scheduler.stats(); }

}  // namespace oryx::server
