// The CUDA backend's internals, shared by its translation units (cuda_backend.cc: loading, the forward and
// the speculative round; cuda_memory.cc: sequence and scratch memory; cuda_plan.cc: forward planning and
// metadata; cuda_layer.cc: the layer forward and the draws). Not for use outside engine/cuda_*.cc.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/cuda_backend.h"
#include "engine/kv_blocks.h"
#include "engine/sampler.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx {

namespace kc = kernels::cuda;
using kc::bf16;

namespace cuda_internal {


// Device memory for sequence states, reused: freed blocks go to a free list and are handed out again to
// requests of up to their size (and at least half of it), so that cloning and dropping sequences does
// not call cudaMalloc each time. Thread-safe.
class DevicePool {
 public:
  ~DevicePool() {
    for (auto& [ptr, bytes] : sizes_) cudaFree(ptr);
  }
  // What to call when the device is out of memory, before the pool gives back its own cached blocks: whoever
  // keeps memory for reuse apart from the pool (the KV blocks) returns what it can spare. Set once, at start.
  void set_reclaim(std::function<void()> reclaim) { reclaim_ = std::move(reclaim); }
  // Null when the device has no room (after the reclaim, unless may_reclaim is false: for the reclaimer's own
  // allocations, which hold its lock).
  void* Alloc(int64_t bytes, bool may_reclaim = true) {
    bytes = std::max<int64_t>(512, (bytes + 511) / 512 * 512);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes) {
        void* p = it->second;
        cached_ -= it->first;
        free_.erase(it);
        return p;
      }
    }
    const auto start = std::chrono::steady_clock::now();
    void* p = Malloc(bytes, may_reclaim);
    mallocs_.fetch_add(1, std::memory_order_relaxed);
    malloc_ns_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
        std::memory_order_relaxed);
    return p;
  }
  void Free(void* p) {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(sizes_.at(p), p);
    cached_ += sizes_.at(p);
  }
  int64_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return cached_;
  }
  // Allocations the cache could not serve, their wall time (cudaMalloc, and on a shortage the reclaim and the
  // cache given back), and the shortages among them: for CudaBackend::Counters.
  int64_t mallocs() const { return mallocs_.load(std::memory_order_relaxed); }
  double malloc_seconds() const { return 1e-9 * static_cast<double>(malloc_ns_.load(std::memory_order_relaxed)); }
  int64_t shortages() const { return shortages_.load(std::memory_order_relaxed); }

 private:
  // A new block past the cache: cudaMalloc, or when the device is out of memory the reclaim, the cached blocks
  // given back and cudaMalloc once more.
  void* Malloc(int64_t bytes, bool may_reclaim) {
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cudaMalloc(&p, bytes) == cudaSuccess) {
        sizes_[p] = bytes;
        return p;
      }
      (void)cudaGetLastError();
    }
    shortages_.fetch_add(1, std::memory_order_relaxed);
    if (may_reclaim && reclaim_) reclaim_();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, block] : free_) {
      ORYX_CUDA_CHECK(cudaFree(block));
      sizes_.erase(block);
    }
    free_.clear();
    cached_ = 0;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    sizes_[p] = bytes;
    return p;
  }
  std::atomic<int64_t> mallocs_{0}, malloc_ns_{0}, shortages_{0};
  std::mutex mu_;
  std::multimap<int64_t, void*> free_;          // bytes -> free block
  std::unordered_map<void*, int64_t> sizes_;    // every block this pool allocated
  int64_t cached_ = 0;                          // bytes in free_
  std::function<void()> reclaim_;
};

// cudaMalloc, or null (the error cleared) when the device is out of memory.
inline void* TryDeviceAlloc(int64_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<int64_t>(1, bytes)) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return p;
}

// The KV blocks of a backend's sequences (kc::kKvBlockTokens positions of every layer's keys and values each,
// kc::SeqDesc's layout): ids and reference counts from a BlockPool, the memory from slabs of many blocks taken
// from the DevicePool. A block let go keeps its memory here for the next one, so a served request's blocks cost
// no cudaMalloc each (one per block made 64 requests sharing a 4K prefix 2.3x slower to their first token on
// the H200); slabs whose blocks are all free go back to the DevicePool when the device runs out (Trim).
// Thread-safe.
class DeviceKvBlocks {
 public:
  DeviceKvBlocks(DevicePool& memory, int64_t block_bytes)
      : memory_(memory), ids_(64, kc::kKvBlockTokens), storage_(64, nullptr), block_bytes_(block_bytes) {}
  int64_t block_bytes() const { return block_bytes_; }
  // A block referenced once; ResourceExhausted when the device has no room for it.
  absl::StatusOr<int32_t> Allocate() {
    std::lock_guard<std::mutex> lock(mu_);
    if (spare_.empty() && !AddSlab()) {
      return absl::ResourceExhaustedError(Cat("no device memory for a KV block of ", block_bytes_, " bytes"));
    }
    if (ids_.available() == 0) {
      ids_.Grow(ids_.capacity());
      storage_.resize(ids_.capacity(), nullptr);
    }
    ORYX_ASSIGN_OR_RETURN(const int32_t id, ids_.Allocate());
    storage_[id] = spare_.back();
    spare_.pop_back();
    return id;
  }
  void Ref(int32_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    ids_.Ref(id);
  }
  void Unref(int32_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    ids_.Unref(id);
    if (ids_.refs(id) == 0) {
      spare_.push_back(storage_[id]);
      storage_[id] = nullptr;
    }
  }
  int32_t refs(int32_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return ids_.refs(id);
  }
  bf16* data(int32_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return storage_[id];
  }
  // Memory of blocks no one holds, kept for the next ones.
  int64_t free_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(spare_.size()) * block_bytes_;
  }
  // Slabs added until the pool holds at least `bytes` (ResourceExhausted, naming the shortage and keeping
  // what it added, when the device has no room).
  absl::Status Reserve(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    while (PoolBytesLocked() < bytes) {
      if (!AddSlab(/*may_trim=*/false)) {
        size_t free = 0, total = 0;
        (void)cudaMemGetInfo(&free, &total);
        return absl::ResourceExhaustedError(Cat("KV pool: reserved ", PoolBytesLocked() >> 20, " of ", bytes >> 20,
                                                " MiB; the device has ", free >> 20, " MiB free"));
      }
    }
    return absl::OkStatus();
  }
  // Bytes of the slabs it holds.
  int64_t pool_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return PoolBytesLocked();
  }
  // Gives every slab whose blocks are all free back to the DevicePool.
  void Trim() {
    std::lock_guard<std::mutex> lock(mu_);
    TrimLocked();
  }

 private:
  struct Slab {
    char* base;
    int64_t blocks;
  };
  int64_t PoolBytesLocked() const {
    int64_t blocks = 0;
    for (const Slab& s : slabs_) blocks += s.blocks;
    return blocks * block_bytes_;
  }
  // A slab of up to kSlabBytes (fewer blocks when the device has less room); false when not even one fits,
  // after giving back the slabs no block uses (may_trim) and trying once more.
  bool AddSlab(bool may_trim = true) {
    static constexpr int64_t kSlabBytes = int64_t{64} << 20;
    for (int64_t n = std::max<int64_t>(1, kSlabBytes / block_bytes_);; n = n / 2) {
      void* slab = memory_.Alloc(n * block_bytes_, /*may_reclaim=*/false);
      if (slab == nullptr && n == 1 && may_trim) {
        TrimLocked();  // (this lock is held: the pool cannot call Trim)
        slab = memory_.Alloc(n * block_bytes_, /*may_reclaim=*/false);
      }
      if (slab != nullptr) {
        slabs_.push_back({static_cast<char*>(slab), n});
        for (int64_t b = n - 1; b >= 0; --b) {
          spare_.push_back(reinterpret_cast<bf16*>(static_cast<char*>(slab) + b * block_bytes_));
        }
        return true;
      }
      if (n == 1) return false;
    }
  }
  void TrimLocked() {
    // With spare_ sorted, a slab's free blocks are one run of it; the slab goes back when that run is all of it.
    std::sort(spare_.begin(), spare_.end());
    std::vector<std::pair<size_t, size_t>> gone;  // runs [begin, end) of spare_ whose slabs went back
    std::vector<Slab> kept;
    for (const Slab& slab : slabs_) {
      const auto* end = reinterpret_cast<bf16*>(slab.base + slab.blocks * block_bytes_);
      const auto lo = std::lower_bound(spare_.begin(), spare_.end(), reinterpret_cast<bf16*>(slab.base));
      const auto hi = std::lower_bound(lo, spare_.end(), end);
      if (hi - lo < slab.blocks) {
        kept.push_back(slab);
        continue;
      }
      memory_.Free(slab.base);
      gone.emplace_back(lo - spare_.begin(), hi - spare_.begin());
    }
    std::sort(gone.begin(), gone.end());
    std::vector<bf16*> spare;
    size_t at = 0;
    for (const auto& [begin, end] : gone) {
      spare.insert(spare.end(), spare_.begin() + at, spare_.begin() + begin);
      at = end;
    }
    spare.insert(spare.end(), spare_.begin() + at, spare_.end());
    spare_ = std::move(spare);
    slabs_ = std::move(kept);
  }

  mutable std::mutex mu_;
  DevicePool& memory_;
  BlockPool ids_;               // never publishes: device prefixes are cached as snapshots (PrefixCache)
  std::vector<bf16*> storage_;  // by id; null while the id is free
  std::vector<bf16*> spare_;    // slab memory no block holds
  std::vector<Slab> slabs_;
  int64_t block_bytes_;
};

}  // namespace cuda_internal

struct CudaBackend::Context {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;  // set explicitly so that cuBLAS allocates nothing inside graph capture
  cuda_internal::DevicePool pool;
  std::unique_ptr<cuda_internal::DeviceKvBlocks> kv;  // (after pool: goes first)
  kc::ModelDims dims{};
  int64_t L = 0, H = 0, dh = 0, HD = 0, W = 0;
  cudaEvent_t timing[3] = {nullptr, nullptr, nullptr};  // set_step_timing: launched, computed, copied
  // Pinned memory that small host-to-device copies (block tables) pass through, so that they are
  // asynchronous: filled front to back, and reused from the front after a synchronisation once full.
  char* staging = nullptr;
  int64_t staging_used = 0;
  static constexpr int64_t kStagingBytes = int64_t{1} << 18;
  // Copies `bytes` from host memory to `dst` on the stream; `src` may change once this returns.
  void CopyToDevice(void* dst, const void* src, int64_t bytes) {
    if (staging == nullptr && cudaMallocHost(reinterpret_cast<void**>(&staging), kStagingBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      staging = nullptr;
    }
    if (staging == nullptr || bytes > kStagingBytes) {  // (a synchronous copy, in stream order)
      ORYX_CUDA_CHECK(cudaStreamSynchronize(stream));
      ORYX_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
      return;
    }
    if (staging_used + bytes > kStagingBytes) {
      ORYX_CUDA_CHECK(cudaStreamSynchronize(stream));  // every copy out of the staging memory is done
      staging_used = 0;
    }
    std::memcpy(staging + staging_used, src, bytes);
    ORYX_CUDA_CHECK(cudaMemcpyAsync(dst, staging + staging_used, bytes, cudaMemcpyHostToDevice, stream));
    staging_used += (bytes + 15) / 16 * 16;
  }
  ~Context() {
    if (staging != nullptr) cudaFreeHost(staging);
    for (cudaEvent_t e : timing) if (e != nullptr) cudaEventDestroy(e);
    if (cublas != nullptr) cublasDestroy(cublas);
    if (cublas_workspace != nullptr) cudaFree(cublas_workspace);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

namespace cuda_internal {

// One sequence's state in device memory: recurrent state [L, H, dh, dh] and conv window [L, W, 2HD] fp32, the
// paged KV cache (a table of DeviceKvBlocks in position order, mirrored on the device for the kernels), and the
// keep_states history of the last span. Clones share the KV blocks of the positions they have (reference
// counts); a block another holder shares is copied before a forward writes into it (PrepareWrite), so a
// speculative rollback or a later token never touches what a snapshot holds.
class CudaSequence final : public DeviceSequence {
 public:
  using Context = CudaBackend::Context;
  static constexpr int64_t kBlockTokens = kc::kKvBlockTokens;
  CudaSequence(std::shared_ptr<Context> ctx, const void* owner) : ctx_(std::move(ctx)), owner_(owner) {}
  // A sequence at position 0 (zero state and window); ResourceExhausted when the device has no room.
  static absl::StatusOr<std::unique_ptr<CudaSequence>> Create(std::shared_ptr<Context> ctx, const void* owner) {
    auto seq = std::make_unique<CudaSequence>(std::move(ctx), owner);
    seq->state_ = seq->TryAlloc<float>(seq->state_floats());
    seq->conv_ = seq->TryAlloc<float>(seq->conv_floats());
    if (seq->state_ == nullptr || seq->conv_ == nullptr) {
      return OutOfMemory("a sequence's recurrent state and conv window", 1,
                         (seq->state_floats() + seq->conv_floats()) * int64_t{sizeof(float)});
    }
    const cudaStream_t stream = seq->ctx_->stream;
    ORYX_CUDA_CHECK(cudaMemsetAsync(seq->state_, 0, seq->state_floats() * sizeof(float), stream));
    ORYX_CUDA_CHECK(cudaMemsetAsync(seq->conv_, 0, seq->conv_floats() * sizeof(float), stream));
    return seq;
  }
  ~CudaSequence() override {
    for (int32_t b : blocks_) ctx_->kv->Unref(b);
    for (void* p : {static_cast<void*>(state_), static_cast<void*>(conv_), static_cast<void*>(table_),
                    static_cast<void*>(span_states_), static_cast<void*>(span_inputs_)}) {
      ctx_->pool.Free(p);
    }
  }

  const void* owner() const override { return owner_; }

  // The clone holds this one's blocks of positions [0, position) too, and blocks of its own up to `capacity`.
  absl::StatusOr<std::unique_ptr<DeviceSequence>> Clone(bool with_kv, int64_t position,
                                                        int64_t capacity) const override {
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CudaSequence> copy, Create(ctx_, owner_));
    copy->CopyRecurrentFrom(*this);
    if (!with_kv) return std::unique_ptr<DeviceSequence>(std::move(copy));
    const int64_t shared = std::min(Blocks(position), static_cast<int64_t>(blocks_.size()));
    const int64_t cap = capacity < 0 ? kv_capacity() : std::max(capacity, position);
    if (!copy->EnsureTable(std::max(shared, Blocks(cap)))) return OutOfMemory("a KV block table of", cap, 0);
    for (int64_t j = 0; j < shared; ++j) {
      ctx_->kv->Ref(blocks_[j]);
      copy->blocks_.push_back(blocks_[j]);
    }
    copy->UploadTable(0, shared);
    ORYX_RETURN_IF_ERROR(copy->Reserve(cap, position));
    return std::unique_ptr<DeviceSequence>(std::move(copy));
  }

  void CopyRecurrentFrom(const DeviceSequence& other_base) override {
    const auto& other = static_cast<const CudaSequence&>(other_base);
    ORYX_CUDA_CHECK(cudaMemcpyAsync(state_, other.state_, state_floats() * sizeof(float), cudaMemcpyDeviceToDevice,
                                    ctx_->stream));
    ORYX_CUDA_CHECK(cudaMemcpyAsync(conv_, other.conv_, conv_floats() * sizeof(float), cudaMemcpyDeviceToDevice,
                                    ctx_->stream));
  }

  // Blocks for `tokens` positions; ResourceExhausted, the cache as it was, when the device has no room.
  absl::Status Reserve(int64_t tokens, int64_t position) override {
    (void)position;  // (growing a paged cache moves nothing)
    const int64_t had = static_cast<int64_t>(blocks_.size()), want = Blocks(tokens);
    if (want <= had) return absl::OkStatus();
    if (!EnsureTable(want)) return OutOfMemory("a KV block table of", tokens, 0);
    while (static_cast<int64_t>(blocks_.size()) < want) {
      absl::StatusOr<int32_t> block = ctx_->kv->Allocate();
      if (!block.ok()) {
        while (static_cast<int64_t>(blocks_.size()) > had) ReleaseLast();
        return OutOfMemory("a KV cache of", tokens, (want - had) * ctx_->kv->block_bytes());
      }
      blocks_.push_back(*block);
    }
    UploadTable(had, want);
    return absl::OkStatus();
  }

  int64_t kv_bytes() const override { return static_cast<int64_t>(blocks_.size()) * ctx_->kv->block_bytes(); }
  int64_t kv_capacity() const override { return static_cast<int64_t>(blocks_.size()) * kBlockTokens; }
  int64_t kv_block_tokens() const override { return kBlockTokens; }
  int64_t kv_shared_blocks() const override {
    return std::count_if(blocks_.begin(), blocks_.end(), [&](int32_t b) { return ctx_->kv->refs(b) > 1; });
  }
  std::span<const int32_t> kv_block_ids() const override { return blocks_; }
  const void* kv_pool() const override { return ctx_->kv.get(); }
  absl::Status UnshareKv() override { return OwnBlocks(0, static_cast<int64_t>(blocks_.size())); }

  void RestoreSpan(int64_t keep) override {
    const Context& c = *ctx_;
    const int64_t dd = c.dh * c.dh, C = 2 * c.HD;
    ORYX_CUDA_CHECK(cudaMemcpy2DAsync(state_, dd * sizeof(float), span_states_ + keep * dd,
                                      (span_len_ + 1) * dd * sizeof(float), dd * sizeof(float), c.L * c.H,
                                      cudaMemcpyDeviceToDevice, c.stream));
    if (c.W > 0) {
      ORYX_CUDA_CHECK(cudaMemcpy2DAsync(conv_, c.W * C * sizeof(float), span_inputs_ + keep * C,
                                        (c.W + span_len_) * C * sizeof(float), c.W * C * sizeof(float), c.L,
                                        cudaMemcpyDeviceToDevice, c.stream));
    }
  }

  // Before a forward writes positions [from, to): blocks for them, and those that another holder shares
  // copied first. ResourceExhausted when the device has no room (the blocks gained so far kept).
  absl::Status PrepareWrite(int64_t from, int64_t to) {
    ORYX_RETURN_IF_ERROR(Reserve(to, from));
    return OwnBlocks(from / kBlockTokens, Blocks(to));
  }

  // Sizes the keep_states history for a span of T tokens and remembers T.
  absl::Status PrepareSpan(int64_t T) {
    const Context& c = *ctx_;
    const int64_t states = c.L * c.H * (T + 1) * c.dh * c.dh, inputs = c.L * (c.W + T) * 2 * c.HD;
    for (auto [buffer, floats, need] : {std::tuple{&span_states_, &span_states_floats_, states},
                                        std::tuple{&span_inputs_, &span_inputs_floats_, inputs}}) {
      if (need <= *floats) continue;
      float* grown = TryAlloc<float>(need);
      if (grown == nullptr) return OutOfMemory("the rollback history of a span of", T, (states + inputs) * 4);
      ctx_->pool.Free(*buffer);
      *buffer = grown;
      *floats = need;
    }
    span_len_ = T;
    return absl::OkStatus();
  }

  static absl::Status OutOfMemory(std::string_view what, int64_t tokens, int64_t bytes) {
    size_t free = 0, total = 0;
    (void)cudaMemGetInfo(&free, &total);
    return absl::ResourceExhaustedError(Cat("out of GPU memory: ", what, " ", tokens, " positions needs ",
                                            static_cast<double>(bytes) / (1 << 30), " GiB; ",
                                            static_cast<double>(free) / (1 << 30), " GiB free of ",
                                            static_cast<double>(total) / (1 << 30)));
  }

  kc::SeqDesc Desc(int64_t row, int64_t len, int64_t pos, bool keep) const {
    kc::SeqDesc d{};
    d.row = static_cast<int32_t>(row);
    d.len = static_cast<int32_t>(len);
    d.pos = pos;
    d.kv_cap = kv_capacity();
    d.state = state_;
    d.conv = conv_;
    d.kv_blocks = blocks_.empty() ? nullptr : table_;
    d.maybe_span_states = keep ? span_states_ : nullptr;
    d.maybe_span_inputs = keep ? span_inputs_ : nullptr;
    return d;
  }

 private:
  static int64_t Blocks(int64_t positions) { return (positions + kBlockTokens - 1) / kBlockTokens; }
  template <typename T>
  T* TryAlloc(int64_t n) const {  // null when the device is out of memory
    return static_cast<T*>(ctx_->pool.Alloc(n * static_cast<int64_t>(sizeof(T))));
  }
  int64_t state_floats() const { return ctx_->L * ctx_->H * ctx_->dh * ctx_->dh; }
  int64_t conv_floats() const { return ctx_->L * ctx_->W * 2 * ctx_->HD; }

  // Room for n entries in the device table (the ones there kept); false when the device has none.
  [[nodiscard]] bool EnsureTable(int64_t n) {
    if (n <= table_cap_) return true;
    const int64_t cap = std::max({n, 2 * table_cap_, int64_t{16}});
    bf16** grown = TryAlloc<bf16*>(cap);
    if (grown == nullptr) return false;
    if (!blocks_.empty()) {
      ORYX_CUDA_CHECK(cudaMemcpyAsync(grown, table_, blocks_.size() * sizeof(bf16*), cudaMemcpyDeviceToDevice,
                                      ctx_->stream));
    }
    ctx_->pool.Free(table_);
    table_ = grown;
    table_cap_ = cap;
    return true;
  }
  // The device table's entries [from, to) from blocks_.
  void UploadTable(int64_t from, int64_t to) {
    if (to <= from) return;
    std::vector<bf16*> addresses(to - from);
    for (int64_t j = from; j < to; ++j) addresses[j - from] = ctx_->kv->data(blocks_[j]);
    ctx_->CopyToDevice(table_ + from, addresses.data(), (to - from) * static_cast<int64_t>(sizeof(bf16*)));
  }
  void ReleaseLast() {
    ctx_->kv->Unref(blocks_.back());
    blocks_.pop_back();
  }
  // Blocks [first, end) made this sequence's alone: each one another holder shares is replaced by a copy.
  absl::Status OwnBlocks(int64_t first, int64_t end) {
    end = std::min(end, static_cast<int64_t>(blocks_.size()));
    for (int64_t j = first; j < end; ++j) {
      if (ctx_->kv->refs(blocks_[j]) == 1) continue;
      absl::StatusOr<int32_t> copy = ctx_->kv->Allocate();
      if (!copy.ok()) return OutOfMemory("a copy of a shared KV block of", kBlockTokens, ctx_->kv->block_bytes());
      ORYX_CUDA_CHECK(cudaMemcpyAsync(ctx_->kv->data(*copy), ctx_->kv->data(blocks_[j]), ctx_->kv->block_bytes(),
                                      cudaMemcpyDeviceToDevice, ctx_->stream));
      ctx_->kv->Unref(blocks_[j]);
      blocks_[j] = *copy;
      UploadTable(j, j + 1);
    }
    return absl::OkStatus();
  }

  std::shared_ptr<Context> ctx_;
  const void* owner_;
  float* state_ = nullptr;
  float* conv_ = nullptr;
  std::vector<int32_t> blocks_;  // KV blocks in position order (ids of ctx_->kv)
  bf16** table_ = nullptr;       // [table_cap_]: their addresses on the device (SeqDesc::kv_blocks)
  int64_t table_cap_ = 0;
  float* span_states_ = nullptr;  // [L, H, T+1, dh, dh]
  float* span_inputs_ = nullptr;  // [L, W+T, 2HD]
  int64_t span_states_floats_ = 0, span_inputs_floats_ = 0, span_len_ = 0;
};

inline CudaSequence& DeviceOf(const SequenceState& s) { return static_cast<CudaSequence&>(*s.device()); }


// Forwards of short spans only (decode steps, verify spans, speculative rounds) run as CUDA graphs: every
// span at most kMaxGraphSpan tokens and at most kMaxGraphRows rows in all. A longer span (a prefill chunk)
// makes the forward a plain one, with the prefill's tiled attention.
inline constexpr int64_t kMaxGraphSpan = 64;
inline constexpr int64_t kMaxGraphRows = 1024;
inline constexpr int64_t kMaxRoundDrafts = 64;

inline int64_t AlignMeta(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Where a forward's metadata sits, in bytes from the forward's base in the metadata buffer: tokens [N],
// row_seq [N], attn_rows [NA], logit_rows [NL], row_mode [N], seqs [B], attention groups [NG, 2], from the
// forward's plan (CudaBackend::Plan).
struct MetaLayout {
  int64_t tokens = 0, row_seq, attn, logit, mode, seqs, groups, bytes;
  template <typename Plan>
  explicit MetaLayout(const Plan& p)
      : row_seq(AlignMeta(p.N * 4)),
        attn(row_seq + AlignMeta(p.N * 4)),
        logit(attn + AlignMeta(p.NA * 4)),
        mode(logit + AlignMeta(p.NL * 4)),
        seqs(mode + AlignMeta(p.N)),
        groups(seqs + AlignMeta(p.B * int64_t{sizeof(kc::SeqDesc)})),
        bytes(AlignMeta(groups + p.NG * 8)) {}
};

// Captures what `launch` puts on `stream` as an executable graph.
template <typename F>
cudaGraphExec_t Capture(cudaStream_t stream, F&& launch) {
  cudaGraph_t g = nullptr;
  cudaGraphExec_t exec = nullptr;
  ORYX_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch();
  ORYX_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
  ORYX_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  ORYX_CUDA_CHECK(cudaGraphDestroy(g));
  return exec;
}

// One shape's graph, captured at the shape's `after`-th use (CudaSwitches::graph_after).
struct GraphSlot {
  cudaGraphExec_t exec = nullptr;
  int uses = 0;
  void Destroy() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    exec = nullptr, uses = 0;
  }
};

// Replays the slot's graph, capturing it first at the shape's `after`-th use (++recorded); false, with nothing
// launched, before that use: the caller runs `launch` itself. Each use before the first replay and the capture
// count as warm-ups.
template <typename F>
bool ReplayOrCapture(GraphSlot& slot, int after, cudaStream_t stream, F&& launch, CudaGraphCounts& counts) {
  if (slot.exec == nullptr) {
    counts.warmups.fetch_add(1, std::memory_order_relaxed);
    if (++slot.uses < after) return false;
    slot.exec = Capture(stream, launch);
    counts.recorded.fetch_add(1, std::memory_order_relaxed);
  }
  ORYX_CUDA_CHECK(cudaGraphLaunch(slot.exec, stream));
  return true;
}

// Adds the wall time from its construction to its destruction to counts.warmup_ns when the warm-up count
// moved in between: around a whole forward or round.
class WarmupTimer {
 public:
  explicit WarmupTimer(CudaGraphCounts& counts)
      : counts_(counts), warmups_(counts.warmups.load()), start_(std::chrono::steady_clock::now()) {}
  ~WarmupTimer() {
    if (counts_.warmups.load() == warmups_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    counts_.warmup_ns.fetch_add(ns.count(), std::memory_order_relaxed);
  }
  WarmupTimer(const WarmupTimer&) = delete;
  WarmupTimer& operator=(const WarmupTimer&) = delete;

 private:
  CudaGraphCounts& counts_;
  int64_t warmups_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace cuda_internal

// ORYX_CUDA_PROFILE=1: time every op of the decode-step and span forwards (verify spans: more rows than
// sequences, each at most kMaxGraphSpan; prefill chunks, all lengths together) and of whole speculative
// rounds (their forwards' ops summed) with events (graphs off), and print the mean time per forward or round
// of each op, by kind, when the backend is destroyed. For finding where a step's, a verify's, a round's or
// a prefill's time goes.
struct CudaBackend::Profiler {
  std::vector<cudaEvent_t> events;  // reused
  std::vector<const char*> names;   // names[i]: the op that ended at events[i]
  size_t used = 0;
  struct Kind {
    std::map<std::string, double> total_ms;
    int64_t forwards = 0;
  };
  std::map<std::string, Kind> kinds;  // "decode step, linear, batch 1", "span of 4 rows in 1 sequences, attention"
  void Mark(const char* name, cudaStream_t s) {
    if (used == events.size()) {
      events.emplace_back();
      ORYX_CUDA_CHECK(cudaEventCreate(&events.back()));
      names.push_back(nullptr);
    }
    ORYX_CUDA_CHECK(cudaEventRecord(events[used], s));
    names[used++] = name;
  }
  // After the stream synchronised: adds the marked ops to `kind` (nullptr: drops them).
  void Collect(const std::string* kind) {
    if (kind != nullptr) {
      Kind& k = kinds[*kind];
      for (size_t i = 1; i < used; ++i) {
        float ms = 0;
        ORYX_CUDA_CHECK(cudaEventElapsedTime(&ms, events[i - 1], events[i]));
        k.total_ms[names[i]] += ms;
      }
      ++k.forwards;
    }
    used = 0;
  }
  ~Profiler() {
    for (auto& [kind, k] : kinds) {
      double sum = 0;
      for (auto& [name, ms] : k.total_ms) sum += ms;
      const double n = static_cast<double>(std::max<int64_t>(1, k.forwards));
      std::fprintf(stderr, "cuda profile, %s: %lld forwards, %.3f ms of ops per forward\n", kind.c_str(),
                   static_cast<long long>(k.forwards), sum / n);
      for (auto& [name, ms] : k.total_ms) {
        std::fprintf(stderr, "  %-26s %9.3f ms per forward (%4.1f%%)\n", name.c_str(), ms / n, 100 * ms / std::max(sum, 1e-9));
      }
    }
    for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
};

struct CudaBackend::Layer {
  Weight in_proj;                                       // [P, D] rows k, v, q_linear, g, gates, q_attn
  Weight o_proj;                                        // [D, HD]
  Weight mlp_in;                                        // [2F, D] gate rows, then up rows
  Weight mlp_down;                                      // [D, F]
  float *attn_norm = nullptr, *mlp_norm = nullptr;      // [D]
  float *conv_weight = nullptr, *conv_bias = nullptr;   // [2HD, w], [2HD]
  float* gate_norm = nullptr;                           // [dh]
  float *dt_bias = nullptr, *a_log = nullptr;           // [H]
  float* d_skip = nullptr;                              // [H] (mamba2)
};

// What one forward runs, fixed before its launches: the batch's shape and the paths its layers take. A
// forward replayed as a CUDA graph has one graph per distinct plan.
struct CudaBackend::Plan {
  int64_t N, B, NA, NL, NG;  // rows, sequences, attention rows, logit rows, attention row groups
  int32_t group_rows;        // the most rows of an attention group
  int64_t chunk, max_chunks;  // the attention's keys per block and blocks per row
  bool any_attention;              // some row attends: the q_attn rows of the input projection are computed
  bool skip_q_linear = false;      // every row attends: the q_linear rows are not
  bool fused = false;              // single rows: norms, gates and SwiGLU fused into the GEMVs
  bool decode_mixer = false;       // every span one token, none kept: kc::DecodeMixer
  // Not fused, every product on the tensor-core GEMV: each residual RMSNorm is split between the product that
  // adds into the residual and the next one (kc::GemmParams::norm_out and norm_in), no AddRmsNorm between them.
  bool split_norms = false;
  bool gated_in_mixer = false;     // not fused, decode_mixer, no attention row: the mixer writes the gated norm
  int64_t scan_chunks = 0;         // chunks of kc::Recurrent's chunked scan for long spans (never in a graph)
  bool tiled_attention = false;    // kc::TiledAttention (never in a graph)
  int32_t group_size = kc::kAttentionGroupRows;  // attention rows of a sequence per group (per tile when tiled)
  // The batch's samplers (ForwardItem::sampler) share these parameters: every logits row is drawn on the device,
  // and only the draws come back, with the rows of the items that ask for their logits (ForwardItem::logits_out).
  bool device_draw = false;
  float temperature = 0.f, top_p = 1.f;
  int64_t top_k = 0;
  bool stats = false;              // with device_draw: some item asks for its row's LogitStats, computed on the device
  bool graph = false;              // replayed as a CUDA graph (not part of the key)

  auto Key() const {
    return std::tie(N, B, NA, NL, NG, group_rows, chunk, max_chunks, any_attention, skip_q_linear, fused, decode_mixer,
                    split_norms, gated_in_mixer, scan_chunks, tiled_attention, group_size, device_draw, temperature,
                    top_p, top_k, stats);
  }
  bool operator<(const Plan& o) const { return Key() < o.Key(); }
};

struct CudaBackend::Products {
  kc::GemmParams in, o_proj, up, down;  // (o_proj and down into tmp, not accumulating)
};

// Per-forward buffers, grown to the largest batch seen (allocation only on growth).
struct CudaBackend::Scratch {
  int64_t rows_cap = 0, logit_rows_cap = 0, partial_cap = 0, meta_cap = 0;
  float *x = nullptr, *proj = nullptr, *kv = nullptr, *qa = nullptr, *o = nullptr, *tmp = nullptr, *mlp = nullptr;
  bf16 *u = nullptr, *y = nullptr, *act = nullptr, *head = nullptr;
  float* logits = nullptr;
  float* partial = nullptr;
  char* meta = nullptr;       // device copy of the metadata below
  char* meta_host = nullptr;  // pinned
  float* logits_host = nullptr;  // pinned
  // Views into meta (device) for the current forward.
  const int32_t *tokens = nullptr, *row_seq = nullptr, *attn_rows = nullptr, *logit_rows = nullptr;
  int64_t tokens_stride = 1;  // row r's token at tokens[r * tokens_stride]
  const int32_t* attn_groups = nullptr;  // [num_groups, 2]: a sequence's attention rows, plan.group_size at most
  unsigned long long* argmax_key = nullptr;  // a greedy draw of one row: the LM head's argmax (kc::ArgmaxKey)
  int64_t num_groups = 0;
  int32_t group_rows = 0;  // the most rows of a group
  const uint8_t* row_mode = nullptr;
  const kc::SeqDesc* seqs = nullptr;
  std::vector<void*> owned;
  // Forwards of up to kMaxGraphRows rows replayed as CUDA graphs, by plan. The graphs bake in the scratch
  // pointers above, so any growth of the scratch drops them.
  std::map<Plan, cuda_internal::GraphSlot> graphs;
  // Whole speculative rounds, by (draft step plan, verify plan, k, temperature (0: greedy), top_k, top_p).
  std::map<std::tuple<Plan, Plan, int64_t, float, int64_t, float>, cuda_internal::GraphSlot> round_graphs;
  float* round_q = nullptr;  // sampled rounds: the drafts' distributions [B, k, V]
  int64_t round_q_cap = 0;
  void* sample_workspace = nullptr;
  int64_t sample_workspace_cap = 0;
  void DropGraphs() {
    for (auto& [key, slot] : graphs) slot.Destroy();
    for (auto& [key, slot] : round_graphs) slot.Destroy();
    graphs.clear();
    round_graphs.clear();
  }
  void FreeAll() {
    DropGraphs();
    for (void* p : owned) cudaFree(p);
    owned.clear();
    if (meta_host != nullptr) cudaFreeHost(meta_host);
    if (logits_host != nullptr) cudaFreeHost(logits_host);
    meta_host = nullptr;
    logits_host = nullptr;
  }
  ~Scratch() { FreeAll(); }
};

// Where a forward's next tokens, drawn on the device, sit in the metadata buffer: after the forward's own
// metadata, the tokens [NL] (for one greedy row, the LM head's 64-bit argmax key: kc::ArgmaxKey, zeroed by
// the metadata's copy), then, sampled, each row's uniform, then (Plan::stats) each row's entropy and margin
// [NL, 2] as floats. All offsets 0 when the forward draws nothing; the copy back runs from `tokens` to the end.
struct CudaBackend::DrawLayout {
  bool on = false, sampled = false, key = false;
  int64_t tokens = 0, uniforms = 0, stats = 0;
  int64_t meta_bytes = 0;  // the metadata's bytes, the draws' included
};
}  // namespace oryx
