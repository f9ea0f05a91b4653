// A fixed set of worker threads for the CPU kernels' one kind of parallelism: split [0, n) into chunks and
// run them on the workers and the calling thread together. ParallelFor allocates nothing (the body is a
// FunctionRef), so the engine's decode loop can use it per token; idle workers spin for 50 us before they
// sleep, since a decode step issues dozens of short jobs back to back.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace oryx::kernels::cpu {

class ThreadPool {
 public:
  // threads <= 0: one per hardware thread. threads == 1 runs everything on the caller.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  // The index in [0, num_threads()) of the calling thread inside a body: 0 for the thread that called
  // ParallelFor, 1.. for the workers. For per-thread scratch buffers.
  static int ThreadIndex();

  // Calls body(begin, end) over disjoint chunks covering [0, n), each at least `grain` long (but the last),
  // and returns when all are done. Not reentrant: a body must not call ParallelFor on the same pool, and
  // one caller at a time (the pool serialises callers).
  void ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body);

 private:
  void WorkerLoop();
  void RunChunks();

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;       // only for sleeping and waking
  std::condition_variable work_cv_, done_cv_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> generation_{0};  // bumped per job; workers wait for a new one
  std::atomic<int> finished_workers_{0};  // workers done with the current job
  // The current job, written before generation_ is bumped (release) and read after (acquire).
  absl::FunctionRef<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

}  // namespace oryx::kernels::cpu
