// The CUDA backend's internals, shared by its translation units (cuda_backend.cc: loading, the forward and
// the speculative round; cuda_memory.cc: sequence and scratch memory; cuda_plan.cc: forward planning and
// metadata; cuda_layer.cc: the layer forward and the draws). Not for use outside engine/cuda_*.cc.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
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
  void* Alloc(int64_t bytes) {
    bytes = std::max<int64_t>(512, (bytes + 511) / 512 * 512);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.lower_bound(bytes);
    if (it != free_.end() && it->first <= 2 * bytes) {
      void* p = it->second;
      cached_ -= it->first;
      free_.erase(it);
      return p;
    }
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      // Out of memory: give the cached blocks back and try once more.
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
    }
    sizes_[p] = bytes;
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

 private:
  std::mutex mu_;
  std::multimap<int64_t, void*> free_;          // bytes -> free block
  std::unordered_map<void*, int64_t> sizes_;    // every block this pool allocated
  int64_t cached_ = 0;                          // bytes in free_
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

}  // namespace cuda_internal

struct CudaBackend::Context {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;  // set explicitly so that cuBLAS allocates nothing inside graph capture
  cuda_internal::DevicePool pool;
  kc::ModelDims dims{};
  int64_t L = 0, H = 0, dh = 0, HD = 0, W = 0;
  cudaEvent_t timing[3] = {nullptr, nullptr, nullptr};  // set_step_timing: launched, computed, copied
  ~Context() {
    for (cudaEvent_t e : timing) if (e != nullptr) cudaEventDestroy(e);
    if (cublas != nullptr) cublasDestroy(cublas);
    if (cublas_workspace != nullptr) cudaFree(cublas_workspace);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

namespace cuda_internal {

// One sequence's state in device memory: recurrent state [L, H, dh, dh] and conv window [L, W, 2HD] fp32,
// the KV cache [2, L, cap, HD] bf16 (keys, then values), and the keep_states history of the last span.
class CudaSequence final : public DeviceSequence {
 public:
  using Context = CudaBackend::Context;
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
    for (void* p : {static_cast<void*>(state_), static_cast<void*>(conv_), static_cast<void*>(kv_),
                    static_cast<void*>(span_states_), static_cast<void*>(span_inputs_)}) {
      ctx_->pool.Free(p);
    }
  }

  const void* owner() const override { return owner_; }

  absl::StatusOr<std::unique_ptr<DeviceSequence>> Clone(bool with_kv, int64_t position,
                                                        int64_t capacity) const override {
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CudaSequence> copy, Create(ctx_, owner_));
    copy->CopyRecurrentFrom(*this);
    const int64_t cap = capacity < 0 ? cap_ : std::max(capacity, position);
    if (with_kv && cap > 0) {
      copy->kv_ = copy->TryAlloc<bf16>(kv_elements(cap));
      if (copy->kv_ == nullptr) return OutOfMemory("a copy of a KV cache of", cap, kv_elements(cap) * 2);
      copy->cap_ = cap;
      CopyRows(kv_, cap_, copy->kv_, cap, position);
    }
    return std::unique_ptr<DeviceSequence>(std::move(copy));
  }

  void CopyRecurrentFrom(const DeviceSequence& other_base) override {
    const auto& other = static_cast<const CudaSequence&>(other_base);
    ORYX_CUDA_CHECK(cudaMemcpyAsync(state_, other.state_, state_floats() * sizeof(float), cudaMemcpyDeviceToDevice,
                                    ctx_->stream));
    ORYX_CUDA_CHECK(cudaMemcpyAsync(conv_, other.conv_, conv_floats() * sizeof(float), cudaMemcpyDeviceToDevice,
                                    ctx_->stream));
  }

  absl::Status Reserve(int64_t tokens, int64_t position) override {
    if (tokens > cap_ && !Grow(tokens, position)) return OutOfMemory("a KV cache of", tokens, kv_elements(tokens) * 2);
    return absl::OkStatus();
  }

  int64_t kv_bytes() const override { return kv_elements(cap_) * static_cast<int64_t>(sizeof(bf16)); }
  int64_t kv_capacity() const override { return cap_; }

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

  // Makes room for `tokens` positions (growing geometrically past a reservation, or exactly when that
  // does not fit).
  absl::Status EnsureCapacity(int64_t tokens, int64_t position) {
    if (tokens <= cap_) return absl::OkStatus();
    if (Grow(std::max({tokens, 2 * cap_, int64_t{64}}), position) || Grow(tokens, position)) return absl::OkStatus();
    return OutOfMemory("a KV cache of", tokens, kv_elements(tokens) * 2);
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
    const int64_t L = ctx_->L, HD = ctx_->HD;
    kc::SeqDesc d{};
    d.row = static_cast<int32_t>(row);
    d.len = static_cast<int32_t>(len);
    d.pos = pos;
    d.kv_cap = cap_;
    d.state = state_;
    d.conv = conv_;
    d.k_cache = kv_;
    d.v_cache = kv_ != nullptr ? kv_ + L * cap_ * HD : nullptr;
    d.maybe_span_states = keep ? span_states_ : nullptr;
    d.maybe_span_inputs = keep ? span_inputs_ : nullptr;
    return d;
  }

 private:
  template <typename T>
  T* TryAlloc(int64_t n) const {  // null when the device is out of memory
    return static_cast<T*>(ctx_->pool.Alloc(n * static_cast<int64_t>(sizeof(T))));
  }
  int64_t state_floats() const { return ctx_->L * ctx_->H * ctx_->dh * ctx_->dh; }
  int64_t conv_floats() const { return ctx_->L * ctx_->W * 2 * ctx_->HD; }
  int64_t kv_elements(int64_t cap) const { return 2 * ctx_->L * cap * ctx_->HD; }

  // Copies the first `rows` positions of every (k|v, layer) slice between caches of two capacities.
  void CopyRows(const bf16* src, int64_t src_cap, bf16* dst, int64_t dst_cap, int64_t rows) const {
    if (rows == 0) return;
    const int64_t row_bytes = ctx_->HD * static_cast<int64_t>(sizeof(bf16));
    ORYX_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_cap * row_bytes, src, src_cap * row_bytes, rows * row_bytes,
                                      2 * ctx_->L, cudaMemcpyDeviceToDevice, ctx_->stream));
  }

  // False, the cache unchanged, when the device has no room for `cap` positions.
  [[nodiscard]] bool Grow(int64_t cap, int64_t position) {
    bf16* grown = TryAlloc<bf16>(kv_elements(cap));
    if (grown == nullptr) return false;
    if (kv_ != nullptr) CopyRows(kv_, cap_, grown, cap, position);
    ctx_->pool.Free(kv_);
    kv_ = grown;
    cap_ = cap;
    return true;
  }

  std::shared_ptr<Context> ctx_;
  const void* owner_;
  float* state_ = nullptr;
  float* conv_ = nullptr;
  bf16* kv_ = nullptr;
  int64_t cap_ = 0;
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

}  // namespace cuda_internal


// ORYX_CUDA_PROFILE=1: time every op of the decode-step and span forwards (verify spans: more rows than
// sequences, each at most kMaxGraphSpan; prefill chunks are not kept) with events (graphs off), and print the
// mean time per forward of each op, by kind of forward, when the backend is destroyed. For finding where a
// step's or a verify's time goes.
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
  bf16* in_proj = nullptr;   // [P, D] rows k, v, q_linear, g, gates, q_attn
  bf16* o_proj = nullptr;    // [D, HD]
  bf16* mlp_in = nullptr;    // [2F, D] gate rows, then up rows
  bf16* mlp_down = nullptr;  // [D, F]
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
  int64_t scan_chunks = 0;         // chunks of kc::Recurrent's chunked scan for long spans (never in a graph)
  bool tiled_attention = false;    // kc::TiledAttention (never in a graph)
  int32_t group_size = kc::kAttentionGroupRows;  // attention rows of a sequence per group (per tile when tiled)
  // Every logits row is a sampler's draw (ForwardItem::sampler), all with these parameters: the next tokens
  // are drawn on the device and only they come back.
  bool device_draw = false;
  float temperature = 0.f, top_p = 1.f;
  int64_t top_k = 0;
  bool graph = false;              // replayed as a CUDA graph (not part of the key)

  auto Key() const {
    return std::tie(N, B, NA, NL, NG, group_rows, chunk, max_chunks, any_attention, skip_q_linear, fused,
                    decode_mixer, scan_chunks, tiled_attention, group_size, device_draw, temperature, top_p, top_k);
  }
  bool operator<(const Plan& o) const { return Key() < o.Key(); }
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
  std::map<Plan, cudaGraphExec_t> graphs;
  // Whole speculative rounds, by (draft step plan, verify plan, k, temperature (0: greedy), top_k, top_p).
  std::map<std::tuple<Plan, Plan, int64_t, float, int64_t, float>, cudaGraphExec_t> round_graphs;
  float* round_q = nullptr;  // sampled rounds: the drafts' distributions [B, k, V]
  int64_t round_q_cap = 0;
  void* sample_workspace = nullptr;
  int64_t sample_workspace_cap = 0;
  void DropGraphs() {
    for (auto& [key, exec] : graphs) cudaGraphExecDestroy(exec);
    for (auto& [key, exec] : round_graphs) cudaGraphExecDestroy(exec);
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
// the metadata's copy), then, sampled, each row's uniform. All offsets 0 when the forward draws nothing.
struct CudaBackend::DrawLayout {
  bool on = false, sampled = false, key = false;
  int64_t tokens = 0, uniforms = 0;
  int64_t meta_bytes = 0;  // the metadata's bytes, the draws' included
};
}  // namespace oryx
