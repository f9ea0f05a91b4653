// The server's engine loop: requests arrive from any thread, wait in a bounded queue, and run in one
// continuous batch (engine/engine.h GenerationBatch) on the scheduler's own thread, which is the only one
// that touches the engine.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "nlohmann/json.hpp"

namespace oryx::server {

struct SchedulerOptions {
  int64_t max_batch = 32;   // requests in the batch (prefilling or decoding) at most
  int64_t max_queue = 256;  // requests waiting for a place in the batch at most; more are refused
  int64_t max_prefill_tokens = 0;  // prompt tokens per batch step at most (GenerationBatch); 0: no bound
  // Bytes of KV cache the batch's requests hold at most (GenerationBatch::set_kv_memory). Requests wait for
  // memory, and the latest admitted are preempted for room. 0: on a device, 90% of its memory free at start
  // less the prefix cache's budget (the rest is for drafts, rollback histories and the forwards' buffers);
  // on the host, no bound.
  int64_t kv_memory = 0;
  // A request not finished this long after it was submitted ends with DeadlineExceeded (at its next token,
  // or when its turn in the queue comes); 0: no limit.
  std::chrono::milliseconds request_timeout{0};
};

// Counters since the scheduler started, and the current load.
struct SchedulerStats {
  int64_t submitted = 0, completed = 0, failed = 0, refused = 0;
  int64_t cancelled = 0;  // ended by Cancel (their clients went away) before they finished
  int64_t queued = 0, active = 0, max_active = 0;
  int64_t steps = 0;          // batch steps run
  double step_s = 0;          // their wall time
  double emit_s = 0;          // of it, handing out tokens (GenerationBatch::emit_seconds)
  double forward_s = 0;       // of it, in forwards and whole rounds (GenerationBatch::forward_seconds)
  GenerationBatch::HostSeconds host_s;  // of the rest, by part (GenerationBatch::host_seconds)
  int64_t decode_rows = 0;    // requests decoding summed over the steps (decode_rows / steps: mean batch)
  int64_t shared_rows = 0;    // of those, decoded in the forward of a prefill (GenerationBatch)
  int64_t prompt_tokens = 0, generated_tokens = 0;  // of the completed requests
  int64_t cached_tokens = 0;  // of their prompt tokens, those restored from the prefix cache
  int64_t preemptions = 0;    // requests that gave their memory back to be recomputed later
  int64_t timed_out = 0;      // requests ended at the request timeout (the batch counts them completed)
  int64_t waiting = 0;        // in the batch but not admitted: waiting for memory (new or preempted)
  int64_t kv_bytes = 0;       // KV cache held by the admitted requests, after the last step
  int64_t max_admitted = 0;   // requests holding memory at once, at most
  int64_t kv_memory = 0;      // the budget in force (SchedulerOptions::kv_memory or its default)
  int64_t kv_pool_bytes = 0;  // memory the backend's KV pool holds (Backend::KvPoolBytes), in use or kept
  int64_t kv_block_bytes = 0;  // one KV block (Backend::KvBytes(1)): the above in blocks, in the JSON
  nlohmann::json ToJson() const;
};

class Scheduler {
 public:
  // Called once per request, on the scheduler's thread: with its result, or with the error that ended it
  // (InvalidArgument for a bad request, Unavailable when the scheduler stopped first, or the error of a
  // batch step, which ends every request in the batch).
  using Done = std::function<void(absl::StatusOr<GenerateResult>)>;

  // Starts the thread. The engine (its policies registered) must outlive the scheduler.
  Scheduler(Engine& engine, SchedulerOptions options);
  ~Scheduler();  // Stop()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request; Unavailable, and `done` never called, when the queue is full or the scheduler has
  // stopped. The request's on_token and `done` run on the scheduler's thread, between batch steps: they
  // should return quickly (every request in the batch waits for them). on_token returning false ends the
  // request ("stop"). `ticket`, when given, is set to the request's number for Cancel.
  absl::Status Submit(GenerateRequest request, Done done, int64_t* ticket = nullptr);

  // Ends a submitted request before the next batch step, wherever it is (queued, waiting for memory,
  // prefilling, decoding): its memory is freed and `done` gets Cancelled. Nothing happens when it has ended
  // already. Any thread; returns at once.
  void Cancel(int64_t ticket);

  // Ends every queued and running request with Unavailable and joins the thread. Idempotent.
  void Stop();
  // Refuses new requests (Unavailable, "draining") while the queued and running ones go on; true once none is
  // left, false if `timeout` passed first (then Stop ends them).
  bool Drain(std::chrono::milliseconds timeout);
  bool draining() const;

  SchedulerStats stats() const;

 private:
  struct Job {
    GenerateRequest request;
    Done done;
    int64_t ticket = 0;
  };
  struct Running {  // a request in the batch
    int64_t ticket = 0;
    Done done;
  };
  using RunningMap = std::map<int64_t, Running>;  // by batch id
  void Loop();
  // Ends the requests Cancel named, then moves queued jobs into the batch while it has room; false when
  // stopping.
  bool Admit(RunningMap& running);
  // Takes the cancelled requests out of the queue and the batch (their `done`s into `ended`; the caller counts
  // them). Holds mu_.
  void TakeCancelled(RunningMap& running, std::vector<Done>& ended);
  void FailAll(RunningMap& running, const absl::Status& status);

  Engine& engine_;
  const SchedulerOptions options_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Job> queue_;  // guarded by mu_
  std::vector<int64_t> cancels_;  // guarded by mu_: tickets to cancel before the next step
  int64_t next_ticket_ = 0;       // guarded by mu_
  bool stopping_ = false;  // guarded by mu_
  bool draining_ = false;  // guarded by mu_: no new requests; those taken run to their end
  SchedulerStats stats_;   // guarded by mu_
  std::unique_ptr<GenerationBatch> batch_;  // the scheduler thread's
  std::thread thread_;
};

}  // namespace oryx::server
