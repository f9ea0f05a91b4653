#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <chrono>

namespace oryx::kernels::cpu {

namespace {
// How long a worker (or the caller, for completion) spins before it sleeps. A decode step issues dozens
// of short jobs back to back; waking a sleeping thread costs tens of microseconds each time.
constexpr std::chrono::microseconds kSpin{50};

thread_local int tls_thread_index = 0;

template <typename Ready>
bool SpinUntil(Ready ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  while (!ready()) {
    if (std::chrono::steady_clock::now() > until) return false;
  }
  return true;
}
}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this, i] {
      tls_thread_index = i;
      WorkerLoop();
    });
  }
}

int ThreadPool::ThreadIndex() { return tls_thread_index; }

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
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
    auto has_work = [&] { return stop_.load() || generation_.load(std::memory_order_acquire) != seen; };
    if (!SpinUntil(has_work)) {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, has_work);
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    RunChunks();
    if (finished_workers_.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<int>(workers_.size())) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_one();
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
  body_ = &body;
  n_ = n;
  chunk_ = (n + chunks - 1) / chunks;
  next_.store(0, std::memory_order_relaxed);
  finished_workers_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);  // pairs with a worker about to sleep on work_cv_
    generation_.fetch_add(1, std::memory_order_release);
  }
  work_cv_.notify_all();
  RunChunks();
  // Every worker takes part in every job (if only to find no chunk left), so none can lag into the next.
  auto all_done = [&] {
    return finished_workers_.load(std::memory_order_acquire) == static_cast<int>(workers_.size());
  };
  if (!SpinUntil(all_done)) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, all_done);
  }
  body_ = nullptr;
}

}  // namespace oryx::kernels::cpu
