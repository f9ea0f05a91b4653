// The server on a random tiny checkpoint with a real tokenizer: the completions JSON, the scheduler's
// continuous batching (results equal to each request alone, the batch and queue bounds, shutdown), and the
// HTTP endpoints end to end, streaming included.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/str_format.h"
#include "engine/checkpoint.h"
#include "engine/json_text.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "server/completions.h"
#include "server/http_server.h"
#include "server/scheduler.h"
#include "speculative/speculative.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx::server {
namespace {

using json = nlohmann::json;

// A cap of connections per client address past any test's threads: none.
constexpr int kNoCap = 1 << 16;

// A latch the test opens: the first token of a request whose on_token waits on it holds the scheduler's
// thread, so that the test can arrange the queue deterministically.
class Gate {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void WaitOpen() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }
  // on_token for a request that holds the scheduler at its first token and tells `reached`.
  std::function<bool(const TokenEvent&)> HoldAtFirstToken(std::promise<void>* reached) {
    return [this, reached, first = true](const TokenEvent&) mutable {
      if (first) {
        first = false;
        reached->set_value();
        WaitOpen();
      }
      return true;
    };
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new testutil::ScratchDir();
    model_dir_ = testutil::WriteTinyModelWithTokenizer(*scratch_, 5);
  }
  static void TearDownTestSuite() { delete scratch_; }
  void SetUp() override {
    for (std::optional<Engine>* e : {&engine_, &reference_}) {
      auto loaded = Engine::Load(model_dir_, {"cpu", 1});
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      e->emplace(std::move(*loaded));
      speculative::RegisterPolicies((*e)->policies());
    }
  }
  static GenerateRequest Request(std::string prompt, int64_t max_tokens) {
    GenerateRequest q;
    q.prompt = std::move(prompt);
    q.max_tokens = max_tokens;
    q.stop_at_eos = false;
    return q;
  }
  // What the request gets run alone on the reference engine.
  GenerateResult Alone(GenerateRequest q) {
    q.on_token = nullptr;
    auto r = reference_->Generate(q);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : GenerateResult{};
  }
  // A server on `engine` on a port the system picks, with 4 HTTP threads, no cap of connections per client
  // (every test client is 127.0.0.1; the cap's own tests set one) and no request log; `adjust` sets the rest.
  // Null (the test failed) when it does not start.
  static std::unique_ptr<HttpServer> Serve(Engine& engine, const std::function<void(ServerOptions&)>& adjust = {}) {
    ServerOptions o;
    o.port = 0;
    o.http_threads = 4;
    o.max_connections_per_client = kNoCap;
    o.log_requests = false;
    if (adjust) adjust(o);
    auto started = HttpServer::Start(engine, o);
    EXPECT_TRUE(started.ok()) << started.status();
    return started.ok() ? std::move(*started) : nullptr;
  }
  // The tiny model with room for long generations (8192 positions), written under `scratch`.
  static absl::StatusOr<Engine> LongEngine(const testutil::ScratchDir& scratch) {
    return Engine::Load(testutil::WriteTinyModelWithTokenizer(scratch, 5, 8192), {"cpu", 1});
  }
  // The same with room for a generation of kEndless tokens, which takes far longer than any test waits.
  static constexpr int64_t kEndless = 200000;
  static absl::StatusOr<Engine> EndlessEngine(const testutil::ScratchDir& scratch) {
    return Engine::Load(testutil::WriteTinyModelWithTokenizer(scratch, 5, kEndless + 64), {"cpu", 1});
  }
  static testutil::ScratchDir* scratch_;
  static std::string model_dir_;
  std::optional<Engine> engine_, reference_;
};
testutil::ScratchDir* ServerTest::scratch_ = nullptr;
std::string ServerTest::model_dir_;

// Submits a request; its result (or error) comes through the returned future.
std::future<absl::StatusOr<GenerateResult>> SubmitForResult(Scheduler& s, GenerateRequest q, absl::Status* submitted,
                                                            int64_t* ticket = nullptr) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<GenerateResult>>>();
  auto future = promise->get_future();
  *submitted = s.Submit(
      std::move(q), [promise](absl::StatusOr<GenerateResult> r) { promise->set_value(std::move(r)); }, ticket);
  return future;
}

// Raw connections, for what httplib's client cannot do: connect from another loopback address (all of 127/8 is
// this machine's), send half a request, or leave mid-request.
// A TCP connection to 127.0.0.1:port from `from` (-1, the test failed, when it cannot be made).
int ConnectFrom(const char* from, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in local{}, remote{};
  local.sin_family = remote.sin_family = AF_INET;
  inet_pton(AF_INET, from, &local.sin_addr);
  remote.sin_port = htons(static_cast<uint16_t>(port));
  remote.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0 ||
      connect(fd, reinterpret_cast<sockaddr*>(&remote), sizeof(remote)) != 0) {
    ADD_FAILURE() << "cannot connect from " << from << ": " << std::strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}
bool SendText(int fd, std::string_view text) {
  return send(fd, text.data(), text.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(text.size());
}
// A POST of a JSON body, the last request on its connection.
std::string PostText(std::string_view path, std::string_view body) {
  return absl::StrFormat(
      "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
      "Connection: close\r\n\r\n%s",
      path, body.size(), body);
}
// What the peers of `fds` send, read together until `closes` of them have closed their connections (their
// `closed` set) or `seconds` pass.
struct Received {
  std::string text;
  bool closed = false;
};
std::vector<Received> ReadUntilCloses(const std::vector<int>& fds, size_t closes, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::vector<Received> got(fds.size());
  for (size_t closed = 0; closed < closes;) {
    std::vector<pollfd> open;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!got[i].closed) open.push_back({fds[i], POLLIN, 0});
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0 || poll(open.data(), open.size(), static_cast<int>(left.count())) <= 0) break;
    for (const pollfd& p : open) {
      if (p.revents == 0) continue;
      const size_t i = std::find(fds.begin(), fds.end(), p.fd) - fds.begin();
      char buf[8192];
      const ssize_t n = recv(p.fd, buf, sizeof(buf), 0);
      if (n > 0) {
        got[i].text.append(buf, static_cast<size_t>(n));
      } else {
        got[i].closed = true;
        ++closed;
      }
    }
  }
  return got;
}
// What the peer sends until it closes the connection, or until `seconds` pass.
std::string ReadUntilClosed(int fd, double seconds) { return ReadUntilCloses({fd}, 1, seconds)[0].text; }
// The status of a response ("HTTP/1.1 200 OK..."), -1 for none.
int StatusOf(std::string_view response) {
  return response.starts_with("HTTP/1.1 ") && response.size() >= 12
             ? std::atoi(std::string(response.substr(9, 3)).c_str())
             : -1;
}
// Whether `condition` holds within `seconds` (polled).
bool Eventually(const std::function<bool()>& condition, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

TEST(Completions, ParsesEveryFieldAndRefusesWhatItDoesNotKnow) {
  auto r = ParseCompletionRequest(
      R"({"prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 3,
          "stop": ["\n", "}"], "stream": true, "ignore_eos": true, "policy": "speculative:4", "model": "m", "n": 1})",
      "m");
  ASSERT_TRUE(r.ok()) << r.status();
  const GenerateRequest& q = r->generate;
  EXPECT_EQ(q.prompt, "hi");
  EXPECT_EQ(q.max_tokens, 7);
  EXPECT_FLOAT_EQ(q.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(q.sampling.top_p, 0.9f);
  EXPECT_EQ(q.sampling.top_k, 40);
  EXPECT_EQ(q.sampling.seed, 3u);
  EXPECT_EQ(q.stop, (std::vector<std::string>{"\n", "}"}));
  EXPECT_TRUE(r->stream);
  EXPECT_FALSE(q.stop_at_eos);
  EXPECT_EQ(q.policy, "speculative:4");
  // Defaults: greedy attention, 128 tokens, stop at EOS, no stream; a token prompt.
  r = ParseCompletionRequest(R"({"prompt": [2, 17, 40]})", "m");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generate.prompt_tokens, (std::vector<int32_t>{2, 17, 40}));
  EXPECT_EQ(r->generate.max_tokens, kUpToTheContext);
  EXPECT_TRUE(r->generate.sampling.greedy());
  EXPECT_TRUE(r->generate.stop_at_eos);
  EXPECT_EQ(r->generate.policy, "attention");
  EXPECT_FALSE(r->stream);

  auto expect_error = [](std::string body, std::string needle) {
    auto r = ParseCompletionRequest(body, "m");
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_HAS_SUBSTR(r.status().message(), needle);
  };
  expect_error("{\"prompt\": ", "not valid JSON");
  expect_error("[1, 2]", "must be a JSON object");
  expect_error("{}", "'prompt' is missing");
  expect_error(R"({"prompt": ""})", "'prompt' is empty");
  expect_error(R"({"prompt": []})", "'prompt' must be a string, a non-empty array of token ids, or a list");
  expect_error(R"({"prompt": ["a", 3]})", "'prompt' must be a list of strings or of token-id arrays");
  expect_error(R"({"prompt": ["a", ""]})", "'prompt' is empty");
  expect_error(R"({"prompt": [1, -4]})", "'prompt token id' must be an integer in [0,");
  expect_error(R"({"prompt": "x", "max_tokens": 0})", "'max_tokens' must be >= 1 (0 only with echo");
  expect_error(R"({"prompt": "x", "max_tokens": -1})", "'max_tokens' must be an integer in [0,");
  expect_error(R"({"prompt": "x", "max_tokens": "5"})", "'max_tokens' must be an integer");
  expect_error(R"({"prompt": "x", "temperature": -1})", "temperature");
  expect_error(R"({"prompt": "x", "top_p": 1.5})", "top_p");
  expect_error(R"({"prompt": "x", "stop": [""]})", "empty string");
  expect_error(R"({"prompt": "x", "stream": "yes"})", "'stream' must be true or false");
  expect_error(R"({"prompt": "x", "n": 0})", "'n' must be an integer in [1, 16]");
  expect_error(R"({"prompt": "x", "n": 17})", "'n' must be an integer in [1, 16]");
  expect_error(R"({"prompt": "x", "n": 2, "best_of": 3})", "'best_of' 3 must equal 'n' (2)");
  {  // several prompts, several choices each: prompt-major, seeds apart
    auto many = ParseCompletionRequest(R"({"prompt": ["a", [5, 6]], "n": 2, "best_of": 2, "seed": 7})", "m");
    ASSERT_TRUE(many.ok()) << many.status();
    const std::vector<GenerateRequest> choices = Choices(*many);
    ASSERT_EQ(choices.size(), 4u);
    EXPECT_EQ(choices[1].prompt, "a");
    EXPECT_EQ(choices[2].prompt_tokens, (std::vector<int32_t>{5, 6}));
    EXPECT_EQ(choices[0].sampling.seed, 7u);
    EXPECT_EQ(choices[3].sampling.seed, 8u);
  }
  expect_error(R"({"prompt": "x", "model": "other"})", "serves the model 'm'");
  expect_error(R"({"prompt": "x", "logprobs": 21})", "'logprobs' must be an integer in [0, 20]");
  expect_error(R"({"prompt": "x", "logprobs": true})", "'logprobs' must be an integer in [0, 20]");
  expect_error(R"({"prompt": "x", "echo": 1})", "'echo' must be true or false");
  expect_error(R"({"prompt": "x", "echo": true, "logprobs": 0, "stream": true})", "'echo' with 'logprobs' is not built");
  EXPECT_TRUE(ParseCompletionRequest(R"({"prompt": "x", "echo": true, "stream": true})", "m").ok());
  EXPECT_TRUE(ParseCompletionRequest(R"({"prompt": "x", "logprobs": 1, "stream": true})", "m").ok());
  {
    auto scored = ParseCompletionRequest(R"({"prompt": "x", "logprobs": 5, "echo": true, "max_tokens": 0})", "m");
    ASSERT_TRUE(scored.ok()) << scored.status();
    EXPECT_EQ(scored->generate.logprobs, 5);
    EXPECT_TRUE(scored->generate.echo);
    EXPECT_EQ(scored->generate.max_tokens, 0);
    auto none = ParseCompletionRequest(R"({"prompt": "x", "logprobs": null})", "m");
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_EQ(none->generate.logprobs, -1);
  }
  expect_error(R"({"prompt": "x", "presence_penalty": 2.5})", "presence_penalty must be in [-2, 2]");
  expect_error(R"({"prompt": "x", "frequency_penalty": "1"})", "'frequency_penalty' must be a number");
  expect_error(R"({"prompt": "x", "logit_bias": {"five": 10}})", "'logit_bias' must be keyed by token ids");
  expect_error(R"({"prompt": "x", "logit_bias": {"5": 101}})", "logit_bias of token 5 must be in [-100, 100]");
  {
    auto adjusted = ParseCompletionRequest(
        R"({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"5": 10, "7": -100}})", "m");
    ASSERT_TRUE(adjusted.ok()) << adjusted.status();
    EXPECT_EQ(adjusted->generate.sampling.presence_penalty, 0.5f);
    EXPECT_EQ(adjusted->generate.sampling.frequency_penalty, -1.f);
    EXPECT_EQ(adjusted->generate.sampling.logit_bias.size(), 2u);
  }
  EXPECT_TRUE(ParseCompletionRequest(
                  R"({"prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u"})", "m")
                  .ok());
}

TEST(Completions, StreamsHoldBackAnUnfinishedCharacterAndJsonNeverThrows) {
  EXPECT_EQ(CompleteUtf8Prefix("abc"), 3u);
  EXPECT_EQ(CompleteUtf8Prefix("a\xC3"), 1u);              // é cut after its lead byte
  EXPECT_EQ(CompleteUtf8Prefix("a\xC3\xA9"), 3u);          // é whole
  EXPECT_EQ(CompleteUtf8Prefix("\xE2\x82"), 0u);           // € cut
  EXPECT_EQ(CompleteUtf8Prefix("x\xE2\x82\xAC"), 4u);      // € whole
  EXPECT_EQ(CompleteUtf8Prefix("\xF0\x9F\x98"), 0u);       // an emoji cut
  EXPECT_EQ(CompleteUtf8Prefix(""), 0u);
  // A lone invalid byte reaches the JSON as U+FFFD instead of throwing.
  EXPECT_EQ(JsonText(json("a\xFF")), "\"a\xEF\xBF\xBD\"");
}

TEST_F(ServerTest, ConcurrentRequestsShareTheBatchAndGetWhatEachGetsAlone) {
  Scheduler scheduler(*engine_, {.max_batch = 3, .max_queue = 16});
  Gate gate;
  std::promise<void> held;
  std::vector<GenerateRequest> qs = {Request("one two", 20), Request("three", 4), Request("four five", 9),
                                     Request("six", 12), Request("seven eight nine", 6), Request("ten", 15)};
  qs[2].policy = "linear";
  qs[3].sampling = {0.9f, 0, 1.f, 4};
  qs[4].policy = "prefill-linear";
  GenerateRequest first = qs[0];
  first.on_token = gate.HoldAtFirstToken(&held);
  std::vector<std::future<absl::StatusOr<GenerateResult>>> results;
  absl::Status submitted;
  results.push_back(SubmitForResult(scheduler, first, &submitted));
  ASSERT_TRUE(submitted.ok());
  held.get_future().wait();  // request 0 is in the batch, and the scheduler waits in its on_token
  for (size_t i = 1; i < qs.size(); ++i) {
    results.push_back(SubmitForResult(scheduler, qs[i], &submitted));
    ASSERT_TRUE(submitted.ok()) << submitted;
  }
  EXPECT_EQ(scheduler.stats().queued, 5);
  gate.Open();
  for (size_t i = 0; i < qs.size(); ++i) {
    absl::StatusOr<GenerateResult> got = results[i].get();
    ASSERT_TRUE(got.ok()) << got.status();
    const GenerateResult alone = Alone(qs[i]);
    EXPECT_EQ(got->tokens, alone.tokens) << "request " << i;
    EXPECT_EQ(got->text, alone.text) << "request " << i;
  }
  const SchedulerStats s = scheduler.stats();
  EXPECT_EQ(s.submitted, 6);
  EXPECT_EQ(s.completed, 6);
  EXPECT_EQ(s.failed, 0);
  EXPECT_EQ(s.max_active, 3);  // the batch filled up to its bound and never past it
  EXPECT_GT(s.decode_rows, s.steps);  // steps decoded several requests at once
  EXPECT_EQ(s.generated_tokens, 20 + 4 + 9 + 12 + 6 + 15);
}

TEST_F(ServerTest, AFullQueueRefusesABadRequestFailsAloneAndStopRefusesMore) {
  auto scheduler = std::make_unique<Scheduler>(*engine_, SchedulerOptions{.max_batch = 1, .max_queue = 2});
  Gate gate;
  std::promise<void> held;
  GenerateRequest first = Request("one", 30);
  first.on_token = gate.HoldAtFirstToken(&held);
  absl::Status submitted;
  auto r0 = SubmitForResult(*scheduler, first, &submitted);
  held.get_future().wait();
  auto r1 = SubmitForResult(*scheduler, Request(std::string(300, 'x'), 5), &submitted);  // too long a prompt
  ASSERT_TRUE(submitted.ok());
  auto r2 = SubmitForResult(*scheduler, Request("two", 5), &submitted);
  ASSERT_TRUE(submitted.ok());
  auto r3 = SubmitForResult(*scheduler, Request("three", 5), &submitted);
  EXPECT_EQ(submitted.code(), absl::StatusCode::kUnavailable);
  EXPECT_HAS_SUBSTR(submitted.message(), "queue of waiting requests is full");
  gate.Open();
  ASSERT_TRUE(r0.get().ok());
  absl::StatusOr<GenerateResult> bad = r1.get();
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_HAS_SUBSTR(bad.status().message(), "this model takes at most 63");
  ASSERT_TRUE(r2.get().ok());
  SchedulerStats s = scheduler->stats();
  EXPECT_EQ(s.completed, 2);
  EXPECT_EQ(s.failed, 1);
  EXPECT_EQ(s.refused, 1);
  EXPECT_EQ(s.max_active, 1);

  // After Stop, requests are refused.
  scheduler->Stop();
  auto late = SubmitForResult(*scheduler, Request("six", 3), &submitted);
  EXPECT_EQ(submitted.code(), absl::StatusCode::kUnavailable);
  EXPECT_HAS_SUBSTR(submitted.message(), "shutting down");
}

TEST_F(ServerTest, StopEndsEveryRequestStillInTheBatchOrQueue) {
  Scheduler scheduler(*engine_, {.max_batch = 1, .max_queue = 4});
  Gate gate;
  std::promise<void> held;
  GenerateRequest first = Request("one", 30);
  first.on_token = gate.HoldAtFirstToken(&held);
  absl::Status submitted;
  auto r0 = SubmitForResult(scheduler, first, &submitted);
  held.get_future().wait();
  auto r1 = SubmitForResult(scheduler, Request("two", 30), &submitted);
  ASSERT_TRUE(submitted.ok());
  // Stop from another thread while the scheduler is held; it takes effect when the gate opens.
  std::thread stopper([&] { scheduler.Stop(); });
  for (;;) {  // until Stop has taken effect: probes are refused as "shutting down" (or "full" before that)
    const absl::Status probe = scheduler.Submit(Request("probe", 1), [](absl::StatusOr<GenerateResult>) {});
    if (!probe.ok() && probe.message().find("shutting down") != std::string::npos) break;
    std::this_thread::yield();
  }
  gate.Open();
  stopper.join();
  for (auto* r : {&r0, &r1}) {
    absl::StatusOr<GenerateResult> got = r->get();
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  }
}

// Cancel ends a request wherever it is, queued or in the batch (prefilling or decoding), before the next step:
// its `done` gets Cancelled, its memory is freed, and the scheduler serves on.
TEST_F(ServerTest, CancelEndsQueuedAndRunningRequestsBeforeTheNextStep) {
  Scheduler scheduler(*engine_, {.max_batch = 2, .max_queue = 4});
  Gate first_gate, second_gate;
  std::promise<void> first_held, second_held;
  GenerateRequest first = Request("one", 30), second = Request("two three", 30);
  first.on_token = first_gate.HoldAtFirstToken(&first_held);
  second.on_token = second_gate.HoldAtFirstToken(&second_held);
  absl::Status submitted;
  int64_t tickets[3] = {-1, -1, -1};
  auto r0 = SubmitForResult(scheduler, first, &submitted, &tickets[0]);
  ASSERT_TRUE(submitted.ok());
  first_held.get_future().wait();  // request 0 is in the batch; the scheduler waits in its first token
  auto r1 = SubmitForResult(scheduler, second, &submitted, &tickets[1]);
  ASSERT_TRUE(submitted.ok());
  auto r2 = SubmitForResult(scheduler, Request("four", 5), &submitted, &tickets[2]);
  ASSERT_TRUE(submitted.ok());
  EXPECT_EQ(std::set<int64_t>(tickets, tickets + 3).size(), 3u);
  scheduler.Cancel(tickets[2]);  // queued
  first_gate.Open();
  second_held.get_future().wait();  // request 1 joined the batch and drew its first token; 0 is decoding
  EXPECT_EQ(scheduler.stats().active, 2);
  scheduler.Cancel(tickets[0]);
  scheduler.Cancel(tickets[1]);
  second_gate.Open();
  for (auto* r : {&r0, &r1, &r2}) {
    absl::StatusOr<GenerateResult> got = r->get();
    EXPECT_EQ(got.status().code(), absl::StatusCode::kCancelled) << got.status();
  }
  SchedulerStats s = scheduler.stats();
  EXPECT_EQ(s.cancelled, 3);
  EXPECT_EQ(s.completed + s.failed, 0);
  EXPECT_EQ(s.active, 0);
  EXPECT_EQ(s.queued, 0);
  EXPECT_EQ(s.kv_bytes, 0);
  EXPECT_LT(s.steps, 10);  // ended a step after the cancels, not at their 30 tokens
  // The scheduler goes on; a ticket of a request that has ended cancels nothing.
  auto after = SubmitForResult(scheduler, Request("five six", 7), &submitted);
  ASSERT_TRUE(submitted.ok());
  absl::StatusOr<GenerateResult> got = after.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->tokens, Alone(Request("five six", 7)).tokens);
  scheduler.Cancel(tickets[0]);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(scheduler.stats().cancelled, 3);
  EXPECT_EQ(scheduler.stats().completed, 1);
}

// The HTTP layer end to end, over a real socket.
class HttpTest : public ServerTest {
 protected:
  void SetUp() override {
    ServerTest::SetUp();
    ServerOptions o;
    o.port = 0;
    o.model_name = "tiny";
    o.log_requests = false;
    o.http_threads = 8;
    o.max_connections_per_client = kNoCap;
    auto started = HttpServer::Start(*engine_, o);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(*started);
    client_.emplace("127.0.0.1", server_->port());
  }
  void TearDown() override {
    if (server_) server_->Stop();
  }
  // POSTs a completion; returns (status, body).
  std::pair<int, std::string> Post(const std::string& body) { return PostTo("/v1/completions", body); }
  std::pair<int, std::string> PostTo(const std::string& path, const std::string& body) {
    auto res = client_->Post(path, body, "application/json");
    if (!res) return {-1, httplib::to_string(res.error())};
    return {res->status, res->body};
  }
  std::unique_ptr<HttpServer> server_;
  std::optional<httplib::Client> client_;
};

TEST_F(HttpTest, CompletionsMatchTheEngineAndStreamsCarryTheSameText) {
  auto [status, body] = Post(R"({"prompt": "the quick brown", "max_tokens": 12, "ignore_eos": true})");
  ASSERT_EQ(status, 200) << body;
  const json j = json::parse(body);
  const GenerateResult alone = Alone(Request("the quick brown", 12));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_EQ(j["choices"][0]["text"], json::parse(JsonText(json(alone.text))));  // invalid UTF-8 replaced
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["oryx"]["tokens"].get<std::vector<int32_t>>(), alone.tokens);
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  EXPECT_EQ(j["usage"]["total_tokens"], j["usage"]["prompt_tokens"].get<int64_t>() + 12);

  // The same request streamed: server-sent events whose texts add up to the whole text, the last one with
  // the finish reason and usage, then [DONE].
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt": "the quick brown", "max_tokens": 12, "ignore_eos": true, "stream": true})";
  req.set_header("Content-Type", "application/json");
  std::string raw;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    raw.append(data, n);
    return true;
  };
  auto res = client_->send(req);
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  std::vector<std::string> frames;
  for (size_t at = 0; at < raw.size();) {
    const size_t end = raw.find("\n\n", at);
    ASSERT_NE(end, std::string::npos) << raw;
    ASSERT_EQ(raw.compare(at, 6, "data: "), 0) << raw;
    frames.push_back(raw.substr(at + 6, end - at - 6));
    at = end + 2;
  }
  ASSERT_GE(frames.size(), 2u);
  EXPECT_EQ(frames.back(), "[DONE]");
  std::string text;
  std::vector<int32_t> tokens;  // one chunk per token, then the last one
  for (size_t i = 0; i + 1 < frames.size(); ++i) {
    const json chunk = json::parse(frames[i]);
    text += chunk["choices"][0]["text"].get<std::string>();
    if (i + 2 < frames.size()) tokens.push_back(chunk["oryx"]["token"].get<int32_t>());
    const bool last = i + 2 == frames.size();
    EXPECT_EQ(chunk["choices"][0]["finish_reason"].is_null(), !last) << frames[i];
    if (last) {
      EXPECT_EQ(chunk["choices"][0]["finish_reason"], "length");
      EXPECT_EQ(chunk["usage"]["completion_tokens"], 12);
      EXPECT_EQ(chunk["oryx"]["tokens"].get<std::vector<int32_t>>(), alone.tokens);
    }
  }
  EXPECT_EQ(text, j["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(tokens, alone.tokens);
}

TEST_F(HttpTest, ParallelClientsGetWhatEachGetsAlone) {
  const std::vector<std::string> prompts = {"alpha", "beta gamma", "delta", "epsilon zeta eta", "theta", "iota"};
  std::vector<std::pair<int, std::string>> got(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i) {
    clients.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", server_->port());
      const json body = {{"prompt", prompts[i]}, {"max_tokens", 10 + i}, {"ignore_eos", true},
                         {"policy", i % 2 ? "speculative:3" : "attention"}};
      auto res = c.Post("/v1/completions", body.dump(), "application/json");
      got[i] = res ? std::pair(res->status, res->body) : std::pair(-1, httplib::to_string(res.error()));
    });
  }
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(got[i].first, 200) << got[i].second;
    GenerateRequest q = Request(prompts[i], 10 + i);
    q.policy = i % 2 ? "speculative:3" : "attention";
    EXPECT_EQ(json::parse(got[i].second)["oryx"]["tokens"].get<std::vector<int32_t>>(), Alone(q).tokens) << i;
  }
  EXPECT_EQ(server_->stats().completed, static_cast<int64_t>(prompts.size()));
}

TEST_F(HttpTest, BadRequestsAndRoutesGetJsonErrors) {
  auto expect_error = [&](int want_status, const std::string& body, const std::string& needle) {
    auto [status, reply] = Post(body);
    EXPECT_EQ(status, want_status) << body;
    const json j = json::parse(reply, nullptr, false);
    ASSERT_TRUE(j.is_object()) << reply;
    EXPECT_EQ(j["error"]["code"], want_status);
    EXPECT_HAS_SUBSTR(j["error"]["message"].get<std::string>(), needle);
  };
  expect_error(400, "not json", "not valid JSON");
  expect_error(400, R"({"prompt": "hi", "policy": "sometimes"})", "unknown policy 'sometimes'");
  expect_error(400, json({{"prompt", std::string(300, 'x')}}).dump(), "this model takes at most 63");
  expect_error(400, R"({"prompt": [1, 99999]})", "outside the vocabulary");
  // Streamed or not, a request the engine refuses gets its status before any event.
  expect_error(400, json({{"prompt", std::string(300, 'x')}, {"stream", true}}).dump(), "this model takes at most 63");
  auto res = client_->Get("/nowhere");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_HAS_SUBSTR(res->body, "no route GET /nowhere");
  // A body past the limit is refused unread.
  res = client_->Post("/v1/completions", std::string((16 << 20) + 1, ' '), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 413);
  EXPECT_HAS_SUBSTR(res->body, "larger than 16 MiB");
  res = client_->Get("/health");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(json::parse(res->body)["status"], "ok");
  res = client_->Get("/v1/models");
  ASSERT_TRUE(res);
  EXPECT_EQ(json::parse(res->body)["data"][0]["id"], "tiny");
  res = client_->Get("/stats");
  ASSERT_TRUE(res);
  const json stats = json::parse(res->body);
  EXPECT_EQ(stats["scheduler"]["failed"], 4);  // the four the engine refused
  EXPECT_TRUE(stats["backend"].is_object());   // (the CPU backend keeps no counters: empty)
}

// The body is JSON whatever content type the client declares (curl -d sends form-urlencoded), at any size
// up to the limit; a multipart form is refused with 415 naming the type to send.
TEST_F(HttpTest, TheBodyIsReadWhateverItsContentTypeUpToTheLimit) {
  const std::string padded = R"({"prompt": "the quick", "max_tokens": 3, "ignore_eos": true})" + std::string(12000, ' ');
  for (const char* type : {"application/x-www-form-urlencoded", "text/plain", "application/json"}) {
    auto res = client_->Post("/v1/completions", padded, type);
    ASSERT_TRUE(res) << type;
    EXPECT_EQ(res->status, 200) << type << ": " << res->body;
    EXPECT_EQ(json::parse(res->body)["usage"]["completion_tokens"], 3) << type;
  }
  auto res = client_->Post("/v1/completions", std::string((16 << 20) + 1, ' '), "application/x-www-form-urlencoded");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 413);
  EXPECT_HAS_SUBSTR(res->body, "larger than 16 MiB");
  httplib::MultipartFormDataItems form = {{"prompt", "hi", "", ""}};
  res = client_->Post("/v1/completions", form);
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 415);
  EXPECT_HAS_SUBSTR(res->body, "Content-Type: application/json");
}

// Every error response is logged with its status, and a streaming client that goes away is logged as
// cancelled (not as a finished 200).
TEST_F(ServerTest, ErrorsAndCancelledStreamsAreLoggedAsSuch) {
  // A model with room for a long generation, so that the client is gone long before it could end.
  testutil::ScratchDir long_scratch;
  auto engine = LongEngine(long_scratch);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::unique_ptr<HttpServer> server = Serve(*engine, [](ServerOptions& o) { o.log_requests = true; });
  ASSERT_NE(server, nullptr);
  httplib::Client client("127.0.0.1", server->port());
  testing::internal::CaptureStderr();
  auto res = client.Get("/nowhere");
  ASSERT_TRUE(res);
  res = client.Post("/v1/completions", R"({"prompt": "hi", "policy": "sometimes"})", "application/json");
  ASSERT_TRUE(res);
  // A stream read for one chunk, then dropped while the server has many tokens to go.
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = R"({"prompt": "the quick", "max_tokens": 8000, "ignore_eos": true, "stream": true})";
  req.content_receiver = [](const char*, size_t, uint64_t, uint64_t) { return false; };
  httplib::Client streaming("127.0.0.1", server->port());
  (void)streaming.send(req);
  streaming.stop();
  for (int i = 0; i < 3000 && server->stats().cancelled + server->stats().failed < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  server->Stop();
  EXPECT_EQ(server->stats().cancelled, 1);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_HAS_SUBSTR(log, "404 GET /nowhere");
  EXPECT_HAS_SUBSTR(log, " 400: unknown policy 'sometimes'");
  EXPECT_HAS_SUBSTR(log, "499 stream: cancelled, the client disconnected");
  EXPECT_EQ(log.find(" 200 stream"), std::string::npos) << log;
  EXPECT_EQ(server->stats().completed, 0);  // it stopped when the client went, not at the end
}

TEST(Chat, MessagesBecomeAPromptThroughTheTemplateAndBadOnesAreRefused) {
  const ChatTemplate defaults;
  auto ok = ParseChatRequest(
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello."},
                       {"role": "user", "content": [{"type": "text", "text": "Bye"}]}],
          "max_completion_tokens": 7, "stream": true, "stream_options": {"include_usage": true}, "user": "u1"})",
      "m", defaults);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->generate.prompt, "Be brief.\n\nUser: Hi\nAssistant: Hello.\nUser: Bye\nAssistant:");
  EXPECT_EQ(ok->generate.max_tokens, 7);
  EXPECT_EQ(ok->generate.stop, defaults.stop);  // the end of the assistant's turn
  EXPECT_TRUE(ok->chat && ok->stream && ok->include_usage);
  for (const char* bad : {R"({})", R"({"messages": []})", R"({"messages": "hi"})",
                          R"({"messages": [{"role": "robot", "content": "x"}]})",
                          R"({"messages": [{"role": "user"}]})",
                          R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
                          R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})",
                          R"({"messages": [{"role": "user", "content": "x"}], "prompt": "y"})",
                          R"({"messages": [{"role": "user", "content": "x"}], "stream_options": {"x": 1}})",
                          R"({"messages": [{"role": "user", "content": "x"}], "n": 17})", "[1]", "not json"}) {
    auto r = ParseChatRequest(bad, "m", defaults);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  testutil::ScratchDir dir;
  testutil::WriteRawFile(dir.Join(ChatTemplate::kFileName), R"({"user": "<u>{content}</u>", "generation": "<a>"})");
  auto custom = ChatTemplate::Load(dir.path());
  ASSERT_TRUE(custom.ok()) << custom.status();
  auto rendered = ParseChatRequest(R"({"messages": [{"role": "user", "content": "hey"}]})", "m", *custom);
  ASSERT_TRUE(rendered.ok());
  EXPECT_EQ(rendered->generate.prompt, "<u>hey</u><a>");
  testutil::WriteRawFile(dir.Join(ChatTemplate::kFileName), R"({"user": "no placeholder"})");
  EXPECT_FALSE(ChatTemplate::Load(dir.path()).ok());
}

// Chat over HTTP: the reply is what the engine generates for the rendered prompt; a stream starts with the
// role, carries the same text, ends with the finish reason, and with include_usage a last chunk of usage.
TEST_F(HttpTest, ChatCompletionsAnswerAndStreamTheRenderedPrompt) {
  const std::string messages = R"([{"role": "user", "content": "the quick brown"}])";
  auto [status, body] = PostTo("/v1/chat/completions",
                             R"({"messages": )" + messages + R"(, "max_tokens": 10, "ignore_eos": true})");
  ASSERT_EQ(status, 200) << body;
  const json j = json::parse(body);
  GenerateRequest q = Request("User: the quick brown\nAssistant:", 10);
  q.stop = ChatTemplate().stop;
  const GenerateResult alone = Alone(q);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_TRUE(j["id"].get<std::string>().starts_with("chatcmpl-"));
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], json::parse(JsonText(json(alone.text))));
  EXPECT_EQ(j["oryx"]["tokens"].get<std::vector<int32_t>>(), alone.tokens);
  EXPECT_EQ(j["usage"]["completion_tokens"], alone.tokens.size());

  auto [s2, stream] = PostTo("/v1/chat/completions",
                           R"({"messages": )" + messages +
                               R"(, "max_tokens": 10, "ignore_eos": true, "stream": true,
                                   "stream_options": {"include_usage": true}})");
  ASSERT_EQ(s2, 200) << stream;
  std::vector<json> chunks;
  for (size_t at = 0; (at = stream.find("data: ", at)) != std::string::npos; at += 6) {
    const std::string frame = stream.substr(at + 6, stream.find("\n\n", at) - at - 6);
    if (frame != "[DONE]") chunks.push_back(json::parse(frame));
  }
  ASSERT_GE(chunks.size(), 3u);
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i]["object"], "chat.completion.chunk");
    text += chunks[i]["choices"][0]["delta"].value("content", "");
  }
  EXPECT_EQ(text, j["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_EQ(chunks[chunks.size() - 2]["choices"][0]["finish_reason"], j["choices"][0]["finish_reason"]);
  EXPECT_TRUE(chunks.back()["choices"].empty());
  EXPECT_EQ(chunks.back()["usage"]["completion_tokens"], alone.tokens.size());
}

// n > 1 and lists of prompts: every choice is what its prompt and seed give alone, at its index, streamed or
// not; the usage counts each prompt once. Greedy choices of one prompt are the same.
TEST_F(HttpTest, SeveralChoicesAreEachWhatTheyGetAlone) {
  auto [status, body] = Post(R"({"prompt": ["the quick", "brown fox"], "n": 2, "max_tokens": 6, "ignore_eos": true,
                                 "temperature": 0.9, "seed": 3})");
  ASSERT_EQ(status, 200) << body;
  const json j = json::parse(body);
  ASSERT_EQ(j["choices"].size(), 4u);
  int64_t prompt_tokens = 0;
  for (int i = 0; i < 4; ++i) {
    GenerateRequest q = Request(i < 2 ? "the quick" : "brown fox", 6);
    q.sampling = {0.9f, 0, 1.0f, static_cast<uint64_t>(3 + i % 2)};
    const GenerateResult alone = Alone(q);
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["oryx"][i]["tokens"].get<std::vector<int32_t>>(), alone.tokens) << i;
    if (i % 2 == 0) prompt_tokens += alone.stats.prompt_tokens;
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(j["usage"]["completion_tokens"], 24);

  auto [s2, stream] = PostTo("/v1/chat/completions",
                             R"({"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 5,
                                 "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_EQ(s2, 200) << stream;
  std::map<int64_t, std::string> texts;
  std::map<int64_t, int> finished;
  json usage;
  for (size_t at = 0; (at = stream.find("data: ", at)) != std::string::npos; at += 6) {
    const std::string frame = stream.substr(at + 6, stream.find("\n\n", at) - at - 6);
    if (frame == "[DONE]") continue;
    const json chunk = json::parse(frame);
    if (chunk.contains("usage")) usage = chunk["usage"];
    for (const json& c : chunk["choices"]) {
      texts[c["index"].get<int64_t>()] += c["delta"].value("content", "");
      finished[c["index"].get<int64_t>()] += !c["finish_reason"].is_null();
    }
  }
  ASSERT_EQ(texts.size(), 3u);
  EXPECT_EQ(texts[0], texts[1]);  // greedy
  EXPECT_EQ(texts[1], texts[2]);
  for (const auto& [index, count] : finished) EXPECT_EQ(count, 1) << index;
  EXPECT_EQ(usage["completion_tokens"], 15);
}

// GET /metrics is the Prometheus text format (every sample's family declared first, names and labels well
// formed, histograms cumulative) and counts what was served.
// Log-probabilities over HTTP in OpenAI's two forms, and echo: the engine's own scoring of the same text.
TEST_F(HttpTest, LogprobsAndEchoGiveTheEnginesScoresInOpenAisForms) {
  auto [status, body] = Post(R"({"prompt": "the quick brown", "max_tokens": 5, "ignore_eos": true, "logprobs": 2,
                                 "echo": true})");
  ASSERT_EQ(status, 200) << body;
  const json reply = json::parse(body);
  const json& choice = reply["choices"][0];
  const json& lp = choice["logprobs"];
  std::vector<int32_t> prompt = {kBosId};
  engine_->tokenizer()->EncodeAppend("the quick brown", &prompt);
  const size_t echoed = prompt.size() - 1;
  ASSERT_EQ(lp["tokens"].size(), echoed + 5);
  ASSERT_EQ(lp["token_logprobs"].size(), echoed + 5);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  // The text is the prompt and the completion, and the tokens spell it at their offsets.
  const std::string text = choice["text"];
  ASSERT_TRUE(text.starts_with("the quick brown"));
  std::string spelt;
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    EXPECT_EQ(lp["text_offset"][i].get<size_t>(), spelt.size());
    spelt += lp["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(spelt, text);
  // Every score is the engine's: the whole text scored in attention mode.
  std::vector<int32_t> all = prompt;
  for (const json& t : reply["oryx"]["tokens"]) all.push_back(t.get<int32_t>());
  std::vector<Mode> modes(all.size(), Mode::kAttention);
  auto want = engine_->Score(all, modes, 1, 2);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(want->size(), lp["tokens"].size());
  for (size_t i = 1; i < want->size(); ++i) {
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), *(*want)[i].logprob, 1e-6) << i;
    EXPECT_EQ(lp["top_logprobs"][i].size(), 2u) << i;  // two alternatives (unless two tokens share a text)
  }
  // Chat: logprobs.content, one entry per generated token with its bytes and alternatives.
  auto [chat_status, chat_body] = PostTo("/v1/chat/completions",
                                         R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                             "ignore_eos": true, "logprobs": true, "top_logprobs": 3})");
  ASSERT_EQ(chat_status, 200) << chat_body;
  const json chat = json::parse(chat_body);
  const json& content = chat["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), chat["usage"]["completion_tokens"].get<size_t>());
  std::string bytes;
  for (const json& e : content) {
    EXPECT_LE(e["logprob"].get<double>(), 0.0);
    EXPECT_EQ(e["top_logprobs"].size(), 3u);
    for (const json& b : e["bytes"]) bytes.push_back(static_cast<char>(b.get<int>()));
  }
  EXPECT_TRUE(bytes.starts_with(chat["choices"][0]["message"]["content"].get<std::string>()));
  EXPECT_EQ(PostTo("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3})").first,
            400);
}

TEST_F(HttpTest, MetricsAreWellFormedPrometheusTextThatCountsTheRequests) {
  for (const char* policy : {"attention", "speculative:3"}) {
    auto [status, body] = Post(json({{"prompt", "the quick brown"}, {"max_tokens", 12}, {"ignore_eos", true},
                                     {"policy", policy}}).dump());
    ASSERT_EQ(status, 200) << body;
  }
  ASSERT_EQ(Post(R"({"prompt": "x", "max_tokens": 0})").first, 400);
  auto res = client_->Get("/metrics");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  EXPECT_HAS_SUBSTR(res->get_header_value("Content-Type"), "text/plain; version=0.0.4");
  const std::regex sample(R"re(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})? (-?[0-9.]+(e[-+][0-9]+)?|[-+]Inf|NaN)$)re");
  const std::regex type(R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram)$)");
  std::map<std::string, std::string> types;
  std::map<std::string, double> values;  // name{labels} -> value
  std::istringstream lines(res->body);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (line.starts_with("# HELP ")) continue;
    if (std::regex_match(line, m, type)) {
      EXPECT_FALSE(types.contains(m[1])) << "declared twice: " << line;
      types[m[1]] = m[2];
      continue;
    }
    ASSERT_TRUE(std::regex_match(line, m, sample)) << "not a sample: " << line;
    std::string family = m[1];
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (!types.contains(family) && family.ends_with(suffix)) family.resize(family.size() - std::strlen(suffix));
    }
    EXPECT_TRUE(types.contains(family)) << "no TYPE before " << line;
    values[std::string(m[1]) + std::string(m[2])] = std::stod(m[4]);
  }
  EXPECT_EQ(values["oryx_requests_total{status=\"200\"}"], 2);
  EXPECT_EQ(values["oryx_requests_total{status=\"400\"}"], 1);
  EXPECT_EQ(values["oryx_generated_tokens_total"], 24);
  EXPECT_EQ(values["oryx_time_to_first_token_seconds_count"], 2);
  EXPECT_EQ(values["oryx_time_to_first_token_seconds_bucket{le=\"+Inf\"}"], 2);
  EXPECT_GT(values["oryx_drafts_proposed_total{position=\"0\"}"], 0);
  EXPECT_GT(values["oryx_mode_tokens_total{mode=\"attention\"}"], 0);
  double previous = 0;
  for (double le : {0.001, 0.01, 0.1, 1.0, 10.0}) {
    const double v = values[absl::StrFormat("oryx_time_per_output_token_seconds_bucket{le=\"%g\"}", le)];
    EXPECT_GE(v, previous) << le;
    previous = v;
  }
  EXPECT_EQ(types["oryx_time_to_first_token_seconds"], "histogram");
  EXPECT_TRUE(values.contains("oryx_prefix_cache_hit_tokens_total"));
}

// Draining: requests already taken run to their end while new ones and /health get 503.
TEST_F(ServerTest, DrainingFinishesTheRequestsTakenAndRefusesNewOnes) {
  testutil::ScratchDir long_scratch;
  auto engine = LongEngine(long_scratch);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::unique_ptr<HttpServer> server = Serve(*engine);
  ASSERT_NE(server, nullptr);
  std::pair<int, std::string> taken;
  std::thread client([&] {
    httplib::Client c("127.0.0.1", server->port());
    c.set_read_timeout(60);
    auto res = c.Post("/v1/completions", R"({"prompt": "the quick", "max_tokens": 3000, "ignore_eos": true})",
                      "application/json");
    taken = res ? std::pair(res->status, res->body) : std::pair(-1, httplib::to_string(res.error()));
  });
  for (int i = 0; i < 1000 && server->stats().active == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(server->stats().active, 1);
  bool drained = false;
  std::thread drain([&] { drained = server->Drain(std::chrono::seconds(60)); });
  for (int i = 0; i < 1000 && server->stats().refused == 0; ++i) {
    httplib::Client c("127.0.0.1", server->port());
    auto health = c.Get("/health");
    ASSERT_TRUE(health);
    if (health->status != 503) continue;  // the drain has not begun yet
    EXPECT_EQ(json::parse(health->body)["status"], "draining");
    auto refused = c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})", "application/json");
    ASSERT_TRUE(refused);
    EXPECT_EQ(refused->status, 503);
  }
  drain.join();
  client.join();
  EXPECT_TRUE(drained);
  ASSERT_EQ(taken.first, 200) << taken.second;
  EXPECT_EQ(json::parse(taken.second)["usage"]["completion_tokens"], 3000);
  EXPECT_EQ(server->stats().refused, 1);
  server->Stop();
}

// A request past the request timeout ends with 504 (DeadlineExceeded) at its next token; the others are not
// touched by it.
TEST_F(ServerTest, ARequestPastTheTimeoutEndsWith504) {
  testutil::ScratchDir long_scratch;
  auto engine = LongEngine(long_scratch);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::unique_ptr<HttpServer> server =
      Serve(*engine, [](ServerOptions& o) { o.scheduler.request_timeout = std::chrono::milliseconds(100); });
  ASSERT_NE(server, nullptr);
  httplib::Client c("127.0.0.1", server->port());
  c.set_read_timeout(60);
  auto late = c.Post("/v1/completions", R"({"prompt": "the quick", "max_tokens": 8000, "ignore_eos": true})",
                     "application/json");
  ASSERT_TRUE(late);
  EXPECT_EQ(late->status, 504) << late->body;
  EXPECT_HAS_SUBSTR(late->body, "request timeout of 0.1 s");
  auto quick = c.Post("/v1/completions", R"({"prompt": "the quick", "max_tokens": 3})", "application/json");
  ASSERT_TRUE(quick);
  EXPECT_EQ(quick->status, 200) << quick->body;
  EXPECT_EQ(server->stats().timed_out, 1);
  EXPECT_LT(server->stats().generated_tokens, 8000);  // cut short, not run to its end
}

// Clients that send half a request hold an HTTP thread for the read timeout at most: with every thread held by
// one, a well-behaved request still gets its answer soon after.
TEST_F(ServerTest, SlowClientsHoldAThreadForTheReadTimeoutAtMost) {
  std::unique_ptr<HttpServer> server = Serve(*engine_, [](ServerOptions& o) {
    o.http_threads = 2;
    o.read_timeout_s = 1;
  });
  ASSERT_NE(server, nullptr);
  std::vector<int> slow;
  for (int i = 0; i < 2; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const std::string half = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro";
    ASSERT_EQ(send(fd, half.data(), half.size(), 0), static_cast<ssize_t>(half.size()));
    slow.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // both threads now wait on the slow clients
  httplib::Client c("127.0.0.1", server->port());
  c.set_read_timeout(20);
  const auto start = std::chrono::steady_clock::now();
  auto res = c.Post("/v1/completions", R"({"prompt": "the", "max_tokens": 3})", "application/json");
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_LT(waited, 4.0);  // the read and keep-alive timeouts (1 s) freed a thread, not the client's 20 s
  for (int fd : slow) close(fd);
}

// With API keys, every endpoint but /health needs one of them as a bearer token.
TEST_F(ServerTest, ApiKeysGuardEveryEndpointButHealth) {
  std::unique_ptr<HttpServer> server =
      Serve(*engine_, [](ServerOptions& o) { o.api_keys = {"first-key", "second-key"}; });
  ASSERT_NE(server, nullptr);
  httplib::Client c("127.0.0.1", server->port());
  const std::string body = R"({"prompt": "the", "max_tokens": 3})";
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  for (const httplib::Headers& headers : {httplib::Headers{}, httplib::Headers{{"Authorization", "Bearer wrong"}},
                                          httplib::Headers{{"Authorization", "first-key"}},
                                          httplib::Headers{{"Authorization", "Bearer first-key2"}}}) {
    auto res = c.Post("/v1/completions", headers, body, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 401);
    EXPECT_EQ(json::parse(res->body)["error"]["code"], 401);
    for (const char* path : {"/v1/models", "/stats", "/nowhere"}) {
      auto got = c.Get(path, headers);
      ASSERT_TRUE(got);
      EXPECT_EQ(got->status, 401) << path;
    }
  }
  for (const char* key : {"first-key", "second-key"}) {
    const httplib::Headers headers = {{"Authorization", std::string("Bearer ") + key}};
    auto res = c.Post("/v1/completions", headers, body, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
    auto stats = c.Get("/stats", headers);
    ASSERT_TRUE(stats);
    EXPECT_EQ(stats->status, 200);
  }
  EXPECT_EQ(server->stats().completed, 2);
}

// TLS: with a certificate and its key the server speaks HTTPS, and a client that trusts that certificate
// completes the handshake (its name checked) and gets answers; plain HTTP gets none. A certificate that does
// not load, or one without its key, is a clear error.
TEST_F(ServerTest, TlsServesHttpsWithTheGivenCertificate) {
  testutil::ScratchDir dir;
  const std::string cert = dir.Join("cert.pem"), key = dir.Join("key.pem");
  const std::string make = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
                           "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " + key + " -out " + cert +
                           " >/dev/null 2>&1";
  ASSERT_EQ(std::system(make.c_str()), 0) << "openssl (scripts/setup installs it) could not make a certificate";
  const auto with_tls = [&](ServerOptions& o) {
    o.tls_cert = cert;
    o.tls_key = key;
  };
  // A client of the server on `port` that trusts the certificate `ca` only.
  const auto trusting = [](int port, const std::string& ca) {
    auto client = std::make_unique<httplib::SSLClient>("127.0.0.1", port);
    client->set_ca_cert_path(ca.c_str());
    client->enable_server_certificate_verification(true);
    return client;
  };
  std::unique_ptr<HttpServer> server = Serve(*engine_, with_tls);
  ASSERT_NE(server, nullptr);
  auto res = trusting(server->port(), cert)->Post("/v1/completions", R"({"prompt": "the", "max_tokens": 3})", "application/json");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(json::parse(res->body)["usage"]["completion_tokens"], 3);
  httplib::Client plain("127.0.0.1", server->port());
  plain.set_read_timeout(std::chrono::seconds(2));
  auto refused = plain.Get("/health");
  EXPECT_TRUE(!refused || refused->status != 200);
  // A client that trusts another certificate refuses this server.
  const std::string other = dir.Join("other.pem"), other_key = dir.Join("other-key.pem");
  ASSERT_EQ(std::system(("openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -keyout " +
                         other_key + " -out " + other + " >/dev/null 2>&1").c_str()), 0);
  EXPECT_FALSE(trusting(server->port(), other)->Get("/health"));
  server->Stop();

  // A client that gives up waiting mid-request cancels it over TLS too: the close shows on the socket under the
  // TLS session.
  testutil::ScratchDir long_scratch;
  auto endless = EndlessEngine(long_scratch);
  ASSERT_TRUE(endless.ok()) << endless.status();
  std::unique_ptr<HttpServer> long_server = Serve(*endless, with_tls);
  ASSERT_NE(long_server, nullptr);
  auto leaving = trusting(long_server->port(), cert);
  leaving->set_read_timeout(std::chrono::milliseconds(500));
  EXPECT_FALSE(leaving->Post("/v1/completions",
                             absl::StrFormat(R"({"prompt": "the", "max_tokens": %d, "ignore_eos": true})", kEndless),
                             "application/json"));
  EXPECT_TRUE(Eventually([&] { return long_server->stats().cancelled == 1; }, 30)) << "the request ran on";
  EXPECT_EQ(long_server->stats().completed, 0);
  long_server->Stop();

  auto expect_error = [&](const std::string& c, const std::string& k, const std::string& needle) {
    ServerOptions o;
    o.port = 0;
    o.tls_cert = c;
    o.tls_key = k;
    auto started = HttpServer::Start(*engine_, o);
    ASSERT_FALSE(started.ok()) << needle;
    EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_HAS_SUBSTR(started.status().message(), needle);
  };
  expect_error(cert, "", "needs both a certificate");
  expect_error(cert, dir.Join("nope.pem"), "no such file");
  expect_error(key, cert, "cannot use");  // the key given as the certificate
}

// The fault test of a small KV memory: three blocks for twelve requests that each grow to two. Every request
// finishes with the tokens it gets alone (the latest admitted are preempted and recomputed), one that could
// never fit gets a 400 naming the memory, the server stays up, and nothing is held at the end.
TEST_F(ServerTest, ASmallKvMemoryQueuesAndPreemptsAndNeverFails) {
  testutil::ScratchDir scratch;
  const std::string dir = testutil::WriteTinyModelWithTokenizer(scratch, 5, 512);
  auto engine = Engine::Load(dir, {"cpu", 1}), reference = Engine::Load(dir, {"cpu", 1});
  ASSERT_TRUE(engine.ok() && reference.ok());
  for (Engine* e : {&*engine, &*reference}) speculative::RegisterPolicies(e->policies());
  std::unique_ptr<HttpServer> server = Serve(*engine, [&](ServerOptions& o) {
    o.http_threads = 16;
    o.scheduler.kv_memory = 3 * engine->backend().KvBytes(1);  // three blocks of 64 positions (KvBytes rounds up)
  });
  ASSERT_NE(server, nullptr);
  const std::vector<std::string> prompts = {"alpha", "beta gamma", "delta", "epsilon zeta", "eta", "theta iota",
                                            "kappa", "lambda mu", "nu", "xi omicron", "pi", "rho sigma"};
  std::vector<std::pair<int, std::string>> got(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i) {
    clients.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", server->port());
      c.set_read_timeout(120);
      const json body = {{"prompt", prompts[i]}, {"max_tokens", 90}, {"ignore_eos", true},
                         {"policy", i % 2 ? "speculative:3" : "attention"}};
      auto res = c.Post("/v1/completions", body.dump(), "application/json");
      got[i] = res ? std::pair(res->status, res->body) : std::pair(-1, httplib::to_string(res.error()));
    });
  }
  httplib::Client c("127.0.0.1", server->port());
  auto never = c.Post("/v1/completions", R"({"prompt": "tau", "max_tokens": 300, "ignore_eos": true})",
                      "application/json");
  for (std::thread& t : clients) t.join();
  ASSERT_TRUE(never);
  EXPECT_EQ(never->status, 400);
  EXPECT_HAS_SUBSTR(never->body, "KV cache");
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(got[i].first, 200) << got[i].second;
    GenerateRequest q = Request(prompts[i], 90);
    q.policy = i % 2 ? "speculative:3" : "attention";
    auto alone = reference->Generate(q);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_EQ(json::parse(got[i].second)["oryx"]["tokens"].get<std::vector<int32_t>>(), alone->tokens) << i;
  }
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto stats = c.Get("/stats");
  ASSERT_TRUE(stats);
  const json scheduler = json::parse(stats->body)["scheduler"];
  EXPECT_EQ(scheduler["completed"], 12);
  EXPECT_GT(scheduler["preemptions"].get<int64_t>(), 0);
  EXPECT_EQ(scheduler["kv_mib"], 0.0);
  EXPECT_EQ(scheduler["waiting_for_memory"], 0);
  // The pool was sized to the three blocks at start; all three are free again.
  EXPECT_EQ(scheduler["kv_blocks_used"], 0);
  EXPECT_EQ(scheduler["kv_blocks_free"], 3);
  EXPECT_GE(scheduler["kv_pool_mib"].get<double>(), scheduler["kv_memory_mib"].get<double>());
}

// A client that goes away while its (non-streaming) request runs cancels it: the request leaves the batch,
// its memory freed, long before it could have finished; the connection closes unanswered (logged as 499),
// and the server serves on. Bytes the client sends meanwhile (its next request) are not a going away.
TEST_F(ServerTest, AClientThatGoesAwayCancelsItsRequestAndFreesItsSlot) {
  testutil::ScratchDir long_scratch;
  auto engine = EndlessEngine(long_scratch);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::unique_ptr<HttpServer> server = Serve(*engine, [](ServerOptions& o) { o.log_requests = true; });
  ASSERT_NE(server, nullptr);
  const std::string endless =
      absl::StrFormat(R"({"prompt": "the quick", "max_tokens": %d, "ignore_eos": true})", kEndless);
  testing::internal::CaptureStderr();
  const int fd = ConnectFrom("127.0.0.1", server->port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendText(fd, PostText("/v1/completions", endless)));
  ASSERT_TRUE(Eventually([&] { return server->stats().active == 1; }, 30));
  // Its next request, pipelined, while this one runs: not a close.
  ASSERT_TRUE(SendText(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(server->stats().cancelled, 0);
  ASSERT_EQ(server->stats().active, 1);
  EXPECT_GT(server->stats().kv_bytes, 0);
  // The client shuts its side: the request ends, and the connection closes with no answer.
  shutdown(fd, SHUT_WR);
  ASSERT_TRUE(Eventually([&] { return server->stats().cancelled == 1; }, 30)) << "the request ran on";
  EXPECT_EQ(ReadUntilClosed(fd, 30), "");
  close(fd);
  SchedulerStats s = server->stats();
  EXPECT_EQ(s.completed, 0);
  EXPECT_EQ(s.active, 0);
  EXPECT_EQ(s.kv_bytes, 0);
  EXPECT_LT(s.steps, kEndless / 2);
  // A client that closes its connection outright, and one that resets it: the same.
  for (const bool reset : {false, true}) {
    const int64_t cancelled = server->stats().cancelled;
    const int c = ConnectFrom("127.0.0.1", server->port());
    ASSERT_GE(c, 0);
    ASSERT_TRUE(SendText(c, PostText("/v1/chat/completions", absl::StrFormat(R"({"messages": [{"role": "user",
        "content": "hi"}], "max_tokens": %d, "ignore_eos": true, "n": 2})",
                                                                             kEndless))));
    ASSERT_TRUE(Eventually([&] { return server->stats().active == 2; }, 30));
    if (reset) {
      const linger hard{1, 0};  // close sends a reset
      setsockopt(c, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
    }
    close(c);
    ASSERT_TRUE(Eventually([&] { return server->stats().cancelled == cancelled + 2; }, 30)) << reset;
  }
  httplib::Client client("127.0.0.1", server->port());
  auto res = client.Post("/v1/completions", R"({"prompt": "the", "max_tokens": 3})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  auto stats = client.Get("/stats");
  ASSERT_TRUE(stats);
  const json scheduler = json::parse(stats->body)["scheduler"];
  EXPECT_EQ(scheduler["cancelled"], 5);
  EXPECT_EQ(scheduler["completed"], 1);
  EXPECT_EQ(scheduler["active"], 0);
  EXPECT_EQ(scheduler["kv_mib"], 0.0);
  // Each handler counts its 499s once it has seen its choices end (after the scheduler counted them).
  std::string metrics;
  EXPECT_TRUE(Eventually(
      [&] {
        auto got = client.Get("/metrics");
        metrics = got ? got->body : "";
        return metrics.find("oryx_requests_total{status=\"499\"} 5\n") != std::string::npos;
      },
      30))
      << metrics;
  EXPECT_HAS_SUBSTR(metrics, "oryx_requests_cancelled_total 5\n");
  server->Stop();
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_HAS_SUBSTR(log, "499: cancelled, the client disconnected");
}

// A flood of slow clients from one address (each sends half a request and waits, more of them than the HTTP
// threads) beside a well-behaved client from another: the flood holds the cap of connections per address,
// the rest of it is answered 429 at once, and the other client is served as if the flood were not there,
// not after the read timeout. The flood's address is served again once its connections close.
TEST_F(ServerTest, ASlowClientFloodFromOneAddressLeavesTheOthersServed) {
  constexpr int kThreads = 8, kCap = 3, kFlood = 20;
  std::unique_ptr<HttpServer> server = Serve(*engine_, [](ServerOptions& o) {
    o.http_threads = kThreads;
    o.max_connections_per_client = kCap;
    o.read_timeout_s = 10;  // without the cap, the flood would hold every thread this long, a round at a time
  });
  ASSERT_NE(server, nullptr);
  const std::string half = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro";
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    const int fd = ConnectFrom("127.0.0.1", server->port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendText(fd, half));
    flood.push_back(fd);
  }
  const std::string request = PostText("/v1/completions", R"({"prompt": "the", "max_tokens": 3})");
  const auto start = std::chrono::steady_clock::now();
  const int other = ConnectFrom("127.0.0.2", server->port());
  ASSERT_GE(other, 0) << "127.0.0.2 should be this machine's (all of 127/8 is, on Linux)";
  ASSERT_TRUE(SendText(other, request));
  const std::string answer = ReadUntilClosed(other, 60);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  close(other);
  EXPECT_EQ(StatusOf(answer), 200) << answer;
  EXPECT_LT(waited, 5.0);  // not the flood's read timeout (10 s) or more
  // The flood: kCap connections held (their requests unfinished), the others answered 429 and closed.
  int refused = 0, held = 0;
  for (const Received& r : ReadUntilCloses(flood, kFlood - kCap, 30)) {
    if (!r.closed) {
      EXPECT_EQ(r.text, "");
      ++held;
      continue;
    }
    ++refused;
    const std::string& got = r.text;
    EXPECT_EQ(StatusOf(got), 429) << got;
    const size_t body = got.find("\r\n\r\n");
    ASSERT_NE(body, std::string::npos) << got;
    const json error = json::parse(got.substr(body + 4))["error"];
    EXPECT_EQ(error["code"], 429);
    EXPECT_EQ(error["type"], "rate_limit_exceeded");
    EXPECT_HAS_SUBSTR(error["message"].get<std::string>(), "too many connections from 127.0.0.1");
  }
  EXPECT_EQ(held, kCap);
  EXPECT_EQ(refused, kFlood - kCap);
  // The cap is the address's: 127.0.0.1 is refused while its flood holds on, 127.0.0.2 is not.
  auto get_stats = [&](const char* from) {
    const int fd = ConnectFrom(from, server->port());
    EXPECT_TRUE(fd >= 0 && SendText(fd, "GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
    const std::string got = ReadUntilClosed(fd, 30);
    close(fd);
    return got;
  };
  const std::string refused_stats = get_stats("127.0.0.1");
  EXPECT_EQ(StatusOf(refused_stats), 429) << refused_stats;
  json connections;
  // The flood's connections and this one (the client from 127.0.0.2 is counted out once the server has seen
  // its connection close).
  EXPECT_TRUE(Eventually(
      [&] {
        const std::string got = get_stats("127.0.0.2");
        connections = StatusOf(got) == 200 ? json::parse(got.substr(got.find("\r\n\r\n") + 4))["connections"] : json();
        return connections.is_object() && connections["open"] == kCap + 1;
      },
      30))
      << connections;
  EXPECT_EQ(connections["refused"], kFlood - kCap + 1);
  EXPECT_EQ(connections["max_per_client"], kCap);
  for (int fd : flood) close(fd);
  // Its connections closed, the address is served again once the server has seen them close. (Until then a
  // request from it is refused: answered 429, or its connection reset when the refusal closed it before the
  // request was in.)
  httplib::Client client("127.0.0.1", server->port());
  EXPECT_TRUE(Eventually(
      [&] {
        auto res = client.Post("/v1/completions", R"({"prompt": "the", "max_tokens": 3})", "application/json");
        return res && res->status == 200;
      },
      30));
}

}  // namespace
}  // namespace oryx::server
