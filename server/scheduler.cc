#include "server/scheduler.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "base/str_cat.h"

namespace oryx::server {

nlohmann::json SchedulerStats::ToJson() const {
  return {{"submitted", submitted},
          {"completed", completed},
          {"failed", failed},
          {"refused", refused},
          {"cancelled", cancelled},
          {"queued", queued},
          {"active", active},
          {"max_active", max_active},
          {"steps", steps},
          {"step_s", step_s},
          {"emit_s", emit_s},
          {"forward_s", forward_s},
          {"host_s", host_s.ToJson()},
          {"mean_decode_batch", steps > 0 ? static_cast<double>(decode_rows) / static_cast<double>(steps) : 0.0},
          {"decode_rows", decode_rows},
          {"shared_rows", shared_rows},
          {"prompt_tokens", prompt_tokens},
          {"cached_tokens", cached_tokens},
          {"preemptions", preemptions},
          {"timed_out", timed_out},
          {"waiting_for_memory", waiting},
          {"kv_mib", static_cast<double>(kv_bytes) / (1 << 20)},
          {"kv_memory_mib", static_cast<double>(kv_memory) / (1 << 20)},
          {"kv_pool_mib", static_cast<double>(kv_pool_bytes) / (1 << 20)},
          {"kv_blocks_used", kv_block_bytes > 0 ? kv_bytes / kv_block_bytes : 0},
          {"kv_blocks_free", kv_block_bytes > 0 ? std::max<int64_t>(0, kv_memory - kv_bytes) / kv_block_bytes : 0},
          {"max_admitted", max_admitted},
          {"generated_tokens", generated_tokens}};
}

namespace {
// SchedulerOptions::kv_memory's default on a device.
SchedulerOptions WithKvMemory(Engine& engine, SchedulerOptions o) {
  if (o.kv_memory == 0) {
    if (const int64_t free = engine.backend().AvailableDeviceBytes(); free > 0) {
      const int64_t cache = engine.prefix_cache() != nullptr ? engine.prefix_cache()->options().max_bytes : 0;
      o.kv_memory = std::max<int64_t>(int64_t{1} << 30, free / 10 * 9 - cache);
    }
  }
  return o;
}
}  // namespace

Scheduler::Scheduler(Engine& engine, SchedulerOptions options)
    : engine_(engine),
      options_(WithKvMemory(engine, options)),
      batch_(std::make_unique<GenerationBatch>(engine, options.max_prefill_tokens)) {
  stats_.kv_memory = options_.kv_memory;
  stats_.kv_block_bytes = engine.backend().KvBytes(1);
  batch_->set_kv_memory(options_.kv_memory);
  thread_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() { Stop(); }

absl::Status Scheduler::Submit(GenerateRequest request, Done done, int64_t* ticket) {
  if (options_.request_timeout.count() > 0) {
    // Past its deadline a request stops at its next token and ends with DeadlineExceeded.
    const auto deadline = std::chrono::steady_clock::now() + options_.request_timeout;
    auto late = std::make_shared<std::atomic<bool>>(false);
    request.on_token = [on_token = std::move(request.on_token), deadline, late](const TokenEvent& e) {
      if (std::chrono::steady_clock::now() > deadline) {
        *late = true;
        return false;
      }
      return on_token ? on_token(e) : true;
    };
    const double seconds = std::chrono::duration<double>(options_.request_timeout).count();
    done = [this, done = std::move(done), late, seconds](absl::StatusOr<GenerateResult> r) {
      if (*late) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          ++stats_.timed_out;
        }
        return done(absl::DeadlineExceededError(
            Cat("the request ran past the server's request timeout of ", seconds, " s",
                r.ok() ? Cat(" (", r->stats.generated_tokens, " tokens generated)") : std::string())));
      }
      done(std::move(r));
    };
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || draining_) {
      ++stats_.refused;
      return absl::UnavailableError("the server is shutting down");
    }
    if (static_cast<int64_t>(queue_.size()) >= options_.max_queue) {
      ++stats_.refused;
      return absl::UnavailableError("the server is at capacity (its queue of waiting requests is full); retry later");
    }
    queue_.push_back({std::move(request), std::move(done), next_ticket_});
    if (ticket != nullptr) *ticket = next_ticket_;
    ++next_ticket_;
    ++stats_.submitted;
    stats_.queued = static_cast<int64_t>(queue_.size());
  }
  wake_.notify_one();
  return absl::OkStatus();
}

void Scheduler::Cancel(int64_t ticket) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancels_.push_back(ticket);
  }
  wake_.notify_one();
}

bool Scheduler::Drain(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
  }
  // The loop updates the counts after every step; a short poll keeps this apart from its wake-ups.
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Every request taken has been answered (completed, failed or cancelled).
      if (stats_.submitted == stats_.completed + stats_.failed + stats_.cancelled) return true;
    }
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool Scheduler::draining() const {
  std::lock_guard<std::mutex> lock(mu_);
  return draining_;
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

SchedulerStats Scheduler::stats() const {
  const int64_t pool = engine_.backend().KvPoolBytes();
  std::lock_guard<std::mutex> lock(mu_);
  SchedulerStats s = stats_;
  s.kv_pool_bytes = pool;
  return s;
}

void Scheduler::TakeCancelled(RunningMap& running, std::vector<Done>& ended) {
  for (const int64_t ticket : cancels_) {
    // Few of either: the queue is bounded by max_queue, the batch by max_batch.
    auto queued = std::ranges::find(queue_, ticket, &Job::ticket);
    if (queued != queue_.end()) {
      ended.push_back(std::move(queued->done));
      queue_.erase(queued);
      continue;
    }
    auto in_batch = std::ranges::find(running, ticket, [](const auto& entry) { return entry.second.ticket; });
    if (in_batch != running.end()) {
      batch_->Cancel(in_batch->first);  // frees its sequence now
      ended.push_back(std::move(in_batch->second.done));
      running.erase(in_batch);
    }
    // Otherwise it has ended already.
  }
  cancels_.clear();
}

bool Scheduler::Admit(RunningMap& running) {
  std::deque<Job> admitted;
  std::vector<Done> cancelled;
  {
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait(lock, [&] { return stopping_ || !queue_.empty() || !cancels_.empty() || batch_->active() > 0; });
    if (stopping_) return false;
    TakeCancelled(running, cancelled);
    while (!queue_.empty() && batch_->active() + static_cast<int64_t>(admitted.size()) < options_.max_batch) {
      admitted.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    stats_.queued = static_cast<int64_t>(queue_.size());
  }
  for (Job& job : admitted) {
    absl::StatusOr<int64_t> id = batch_->Add(std::move(job.request));
    if (!id.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.failed;
      }
      job.done(id.status());
      continue;
    }
    running.emplace(*id, Running{job.ticket, std::move(job.done)});
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.active = batch_->active();
    stats_.max_active = std::max(stats_.max_active, stats_.active);
    stats_.kv_bytes = batch_->kv_bytes();  // less the cancelled requests' memory, with no step to come perhaps
    stats_.cancelled += static_cast<int64_t>(cancelled.size());  // with the load they left
  }
  // After the counts, so that a caller told of its cancel sees its memory freed.
  for (Done& done : cancelled) done(absl::CancelledError("the request was cancelled"));
  return true;
}

void Scheduler::FailAll(RunningMap& running, const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.failed += static_cast<int64_t>(running.size());
  }
  for (auto& [id, r] : running) r.done(status);
  running.clear();
}

namespace {
// A step whose code throws (a bug: nothing in it should) fails its requests like a failed step, with the
// exception's text, rather than ending the server's process.
absl::Status StepCatching(GenerationBatch& batch) {
  try {
    return batch.Step();
  } catch (const std::exception& e) {
    return absl::InternalError(Cat("generation step: ", e.what()));
  } catch (...) {
    return absl::InternalError("generation step: unknown exception");
  }
}
}  // namespace

void Scheduler::Loop() {
  RunningMap running;  // the batch's requests
  while (Admit(running)) {
    if (batch_->active() == 0) continue;  // every admitted request was refused by the batch
    const auto step_start = std::chrono::steady_clock::now();
    const double emitted_before = batch_->emit_seconds(), forwarded_before = batch_->forward_seconds();
    const GenerationBatch::HostSeconds host_before = batch_->host_seconds();
    const absl::Status step = StepCatching(*batch_);
    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    const double emit_s = batch_->emit_seconds() - emitted_before;
    const double forward_s = batch_->forward_seconds() - forwarded_before;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.step_s += step_s;
      stats_.emit_s += emit_s;
      stats_.forward_s += forward_s;
      stats_.host_s += batch_->host_seconds() - host_before;
    }
    if (!step.ok()) {
      // A failed step leaves the batch's sequences in no known state: end its requests, start afresh.
      FailAll(running, step);
      batch_ = std::make_unique<GenerationBatch>(engine_, options_.max_prefill_tokens);
      batch_->set_kv_memory(options_.kv_memory);
      continue;
    }
    std::vector<std::pair<int64_t, GenerateResult>> finished = batch_->TakeFinished();
    std::vector<std::pair<int64_t, absl::Status>> failed = batch_->TakeFailed();
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.steps;
      stats_.failed += static_cast<int64_t>(failed.size());
      stats_.preemptions = batch_->preemptions();
      stats_.waiting = batch_->waiting();
      stats_.kv_bytes = batch_->kv_bytes();
      stats_.max_admitted = std::max(stats_.max_admitted, batch_->active() - batch_->waiting());
      stats_.decode_rows += batch_->last_step_decoded();
      stats_.shared_rows += batch_->last_step_shared();
      stats_.active = batch_->active();
      for (const auto& [id, result] : finished) {
        ++stats_.completed;
        stats_.prompt_tokens += result.stats.prompt_tokens;
        stats_.cached_tokens += result.stats.cached_tokens;
        stats_.generated_tokens += result.stats.generated_tokens;
      }
    }
    for (auto& [id, status] : failed) {
      auto it = running.find(id);
      Done done = std::move(it->second.done);
      running.erase(it);
      done(status);
    }
    for (auto& [id, result] : finished) {
      auto it = running.find(id);
      Done done = std::move(it->second.done);
      running.erase(it);
      done(std::move(result));
    }
  }
  const absl::Status stopped = absl::UnavailableError("the server is shutting down");
  FailAll(running, stopped);
  std::deque<Job> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued.swap(queue_);
    stats_.failed += static_cast<int64_t>(queued.size());
    stats_.queued = 0;
    stats_.active = 0;
  }
  for (Job& job : queued) job.done(stopped);
}

}  // namespace oryx::server
