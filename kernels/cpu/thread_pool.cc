#include "kernels/cpu/thread_pool.h"

#include <algorithm>

namespace oryx::kernels::cpu {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunChunks() {
  for (;;) {
    const int64_t begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= n_) return;
    (*body_)(begin, std::min(n_, begin + chunk_));
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunChunks();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (++finished_workers_ == static_cast<int>(workers_.size())) done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_chunks = (n + grain - 1) / grain;
  if (workers_.empty() || max_chunks == 1) {
    body(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  // About two chunks per thread balances uneven chunks without much scheduling.
  const int64_t chunks = std::min<int64_t>(max_chunks, 2 * num_threads());
  {
    std::lock_guard<std::mutex> lock(mu_);
    body_ = &body;
    n_ = n;
    chunk_ = (n + chunks - 1) / chunks;
    next_.store(0, std::memory_order_relaxed);
    finished_workers_ = 0;
    ++generation_;
  }
  work_cv_.notify_all();
  RunChunks();
  std::unique_lock<std::mutex> lock(mu_);
  // Every worker takes part in every job (if only to find no chunk left), so none can lag into the next.
  done_cv_.wait(lock, [&] { return finished_workers_ == static_cast<int>(workers_.size()); });
  body_ = nullptr;
}

}  // namespace oryx::kernels::cpu
