// CUDA forward of the Oryx model over a ragged batch (DESIGN.md §2, §5): one embedding gather, per layer
// four cuBLAS products over every row of the batch and a handful of fused kernels, the logits of the rows
// asked for copied back. Per-forward metadata (tokens, rows, modes, sequence descriptors) goes up in one
// copy; the only synchronisation is the end of the forward.
#include "engine/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <map>
#include <tuple>
#include <unordered_map>

#include "engine/checkpoint.h"
#include "engine/sampler.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/tensor_names.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/stream.h"

namespace oryx {

namespace kc = kernels::cuda;
using kc::bf16;

namespace {

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
void* TryDeviceAlloc(int64_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<int64_t>(1, bytes)) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return p;
}

}  // namespace

struct CudaBackend::Context {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;  // set explicitly so that cuBLAS allocates nothing inside graph capture
  DevicePool pool;
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

namespace {

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

  absl::StatusOr<std::unique_ptr<DeviceSequence>> Clone(bool with_kv, int64_t position) const override {
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CudaSequence> copy, Create(ctx_, owner_));
    copy->CopyRecurrentFrom(*this);
    if (with_kv && cap_ > 0) {
      copy->kv_ = copy->TryAlloc<bf16>(kv_elements(cap_));
      if (copy->kv_ == nullptr) return OutOfMemory("a copy of a KV cache of", cap_, kv_elements(cap_) * 2);
      copy->cap_ = cap_;
      CopyRows(kv_, cap_, copy->kv_, cap_, position);
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

CudaSequence& DeviceOf(const SequenceState& s) { return static_cast<CudaSequence&>(*s.device()); }

}  // namespace

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

CudaBackend::CudaBackend() = default;

CudaBackend::~CudaBackend() {
  if (ctx_ && ctx_->stream != nullptr) cudaStreamSynchronize(ctx_->stream);
  profiler_.reset();
  scratch_.reset();
  for (Layer& l : layers_) {
    for (void* p : {static_cast<void*>(l.in_proj), static_cast<void*>(l.o_proj), static_cast<void*>(l.mlp_in),
                    static_cast<void*>(l.mlp_down), static_cast<void*>(l.attn_norm), static_cast<void*>(l.mlp_norm),
                    static_cast<void*>(l.conv_weight), static_cast<void*>(l.conv_bias),
                    static_cast<void*>(l.gate_norm), static_cast<void*>(l.dt_bias), static_cast<void*>(l.a_log),
                    static_cast<void*>(l.d_skip)}) {
      cudaFree(p);
    }
  }
  if (lm_head_ != embed_) cudaFree(lm_head_);
  cudaFree(embed_);
  cudaFree(final_norm_);
  cudaFree(rope_freq_);
}

absl::Status CudaBackend::Init(const ModelConfig& c, const CudaSwitches& switches) {
  if (kc::DeviceCount() == 0) return absl::FailedPreconditionError("device 'cuda': no CUDA device is visible");
  config_ = c;
  const int64_t H = c.n_heads, HD = c.qk_dim(), G = c.linear_mixer == LinearMixer::kMamba2 ? H : 2 * H;
  proj_width_ = 4 * HD + G + HD;
  ctx_ = std::make_shared<Context>();
  ORYX_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_->stream, cudaStreamNonBlocking));
  ORYX_CUBLAS_CHECK(cublasCreate(&ctx_->cublas));
  ORYX_CUBLAS_CHECK(cublasSetStream(ctx_->cublas, ctx_->stream));
  constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  ORYX_CUDA_CHECK(cudaMalloc(&ctx_->cublas_workspace, kWorkspaceBytes));
  ORYX_CUBLAS_CHECK(cublasSetWorkspace(ctx_->cublas, ctx_->cublas_workspace, kWorkspaceBytes));
  kc::ModelDims& d = ctx_->dims;
  d.d_model = static_cast<int32_t>(c.d_model);
  d.heads = static_cast<int32_t>(H);
  d.head_dim = static_cast<int32_t>(c.head_dim);
  d.conv_width = static_cast<int32_t>(c.conv_width);
  d.mlp_hidden = static_cast<int32_t>(c.mlp_hidden);
  d.vocab = static_cast<int32_t>(c.vocab_size);
  d.proj_width = static_cast<int32_t>(proj_width_);
  d.gdn = c.linear_mixer == LinearMixer::kGdn;
  d.conv_silu = c.conv_activation == ConvActivation::kSilu;
  d.norm_eps = static_cast<float>(c.norm_eps);
  d.rope_theta = c.rope_theta;
  ctx_->L = c.n_layers;
  ctx_->H = H;
  ctx_->dh = c.head_dim;
  ctx_->HD = HD;
  ctx_->W = c.conv_width - 1;
  scratch_ = std::make_unique<Scratch>();
  layers_.resize(c.n_layers);
  if (c.rope_theta > 0) {  // the RoPE frequencies theta^(-2i/dh), in double as kernels/cpu/rope.cc has them
    std::vector<double> freq(c.head_dim / 2);
    for (size_t i = 0; i < freq.size(); ++i) freq[i] = std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / c.head_dim);
    ORYX_CUDA_CHECK(cudaMalloc(&rope_freq_, std::max<size_t>(1, freq.size()) * sizeof(double)));
    ORYX_CUDA_CHECK(cudaMemcpy(rope_freq_, freq.data(), freq.size() * sizeof(double), cudaMemcpyHostToDevice));
  }
  // Paths that can be turned off, to measure them.
  fused_gemv_ = switches.fused_gemv;
  decode_mixer_ = switches.decode_mixer;
  skip_q_linear_ = switches.skip_q_linear;
  chunked_scan_ = switches.chunked_scan;
  tiled_attention_ = switches.tiled_attention;
  gemv_rows_per_warp_ = switches.gemv_rows_per_warp;
  kc::SetKernelSwitches({.early_loads = switches.early_loads,
                         .programmatic_launch = switches.programmatic_launch,
                         .wide_gemv = switches.wide_gemv,
                         .group_mma = switches.group_mma});
  if (switches.profile) {
    profiler_ = std::make_unique<Profiler>();
    use_graphs_ = false;
  }
  return absl::OkStatus();
}

namespace {
void Upload(const std::vector<float>& host, float** dst) {
  ORYX_CUDA_CHECK(cudaMalloc(dst, std::max<size_t>(1, host.size()) * sizeof(float)));
  ORYX_CUDA_CHECK(cudaMemcpy(*dst, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
}
void UploadBf16(const std::vector<float>& host, bf16** dst) {
  std::vector<bf16> converted(host.size());
  for (size_t i = 0; i < host.size(); ++i) converted[i] = __float2bfloat16(host[i]);
  ORYX_CUDA_CHECK(cudaMalloc(dst, std::max<size_t>(1, host.size()) * sizeof(bf16)));
  ORYX_CUDA_CHECK(cudaMemcpy(*dst, converted.data(), host.size() * sizeof(bf16), cudaMemcpyHostToDevice));
}
}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Load(const std::string& dir, const CudaSwitches& switches) {
  ORYX_ASSIGN_OR_RETURN(Checkpoint ckpt, LoadCheckpoint(dir));
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  ORYX_RETURN_IF_ERROR(b->Init(ckpt.config(), switches));
  const ModelConfig& c = b->config_;
  std::vector<float> host, part;
  auto get = [&](std::string_view name, std::vector<float>& out) -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(out, ckpt.TensorAsFloats(name));
    return absl::OkStatus();
  };
  int64_t bf16_elements = 0;
  auto bf16_upload = [&](const std::vector<float>& v, bf16** dst) {
    UploadBf16(v, dst);
    bf16_elements += static_cast<int64_t>(v.size());
  };
  ORYX_RETURN_IF_ERROR(get(kEmbedWeight, host));
  bf16* embed = nullptr;
  bf16_upload(host, &embed);
  b->embed_ = embed;
  if (c.tie_embeddings) {
    b->lm_head_ = embed;
  } else {
    ORYX_RETURN_IF_ERROR(get(kLmHeadWeight, host));
    bf16* lm = nullptr;
    bf16_upload(host, &lm);
    b->lm_head_ = lm;
  }
  ORYX_RETURN_IF_ERROR(get(kFinalNormWeight, host));
  Upload(host, &b->final_norm_);
  for (int64_t il = 0; il < c.n_layers; ++il) {
    Layer& l = b->layers_[il];
    auto layer = [&](std::string_view suffix, std::vector<float>& out) { return get(LayerTensorName(il, suffix), out); };
    for (auto [suffix, field] : {std::pair{kAttnNorm, &l.attn_norm}, {kMlpNorm, &l.mlp_norm}, {kConvWeight, &l.conv_weight},
                                 {kConvBias, &l.conv_bias}, {kGateNorm, &l.gate_norm}, {kDtBias, &l.dt_bias},
                                 {kALog, &l.a_log}}) {
      ORYX_RETURN_IF_ERROR(layer(suffix, host));
      Upload(host, field);
    }
    std::vector<std::string_view> fused = {kKProj, kVProj, kQLinear, kGProj};
    if (c.linear_mixer == LinearMixer::kMamba2) {
      fused.push_back(kDtProj);
      ORYX_RETURN_IF_ERROR(layer(kDSkip, host));
      Upload(host, &l.d_skip);
    } else {
      fused.push_back(kBetaProj);
      fused.push_back(kAlphaProj);
    }
    fused.push_back(kQAttn);
    host.clear();
    for (std::string_view suffix : fused) {
      ORYX_RETURN_IF_ERROR(layer(suffix, part));
      host.insert(host.end(), part.begin(), part.end());
    }
    bf16_upload(host, &l.in_proj);
    host.clear();
    for (std::string_view suffix : {kMlpGate, kMlpUp}) {
      ORYX_RETURN_IF_ERROR(layer(suffix, part));
      host.insert(host.end(), part.begin(), part.end());
    }
    bf16_upload(host, &l.mlp_in);
    ORYX_RETURN_IF_ERROR(layer(kOProj, host));
    bf16_upload(host, &l.o_proj);
    ORYX_RETURN_IF_ERROR(layer(kMlpDown, host));
    bf16_upload(host, &l.mlp_down);
  }
  b->weight_bytes_ = bf16_elements * static_cast<int64_t>(sizeof(bf16));
  return b;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::CreateRandom(const ModelConfig& config, uint32_t seed,
                                                                      const CudaSwitches& switches) {
  ORYX_RETURN_IF_ERROR(ValidateModelConfig(config, "random model"));
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  ORYX_RETURN_IF_ERROR(b->Init(config, switches));
  const ModelConfig& c = b->config_;
  const int64_t D = c.d_model, H = c.n_heads, dh = c.head_dim, HD = c.qk_dim(), F = c.mlp_hidden, V = c.vocab_size;
  const int64_t P = b->proj_width_;
  cudaStream_t s = b->ctx_->stream;
  uint32_t next = seed * 1000003u;
  int64_t bf16_elements = 0;
  auto matrix = [&](int64_t rows, int64_t cols) {
    bf16* p = nullptr;
    ORYX_CUDA_CHECK(cudaMalloc(&p, rows * cols * sizeof(bf16)));
    const float bound = 1.f / std::sqrt(static_cast<float>(cols));
    kc::FillUniform(p, rows * cols, next++, -bound, bound, s);
    bf16_elements += rows * cols;
    return p;
  };
  auto vec = [&](int64_t n, float lo, float hi) {
    float* p = nullptr;
    ORYX_CUDA_CHECK(cudaMalloc(&p, n * sizeof(float)));
    kc::FillUniform(p, n, next++, lo, hi, s);
    return p;
  };
  bf16* embed = matrix(V, D);
  b->embed_ = embed;
  b->lm_head_ = c.tie_embeddings ? static_cast<void*>(embed) : static_cast<void*>(matrix(V, D));
  b->final_norm_ = vec(D, 1.f, 1.f);
  for (Layer& l : b->layers_) {
    l.in_proj = matrix(P, D);
    l.o_proj = matrix(D, HD);
    l.mlp_in = matrix(2 * F, D);
    l.mlp_down = matrix(D, F);
    l.attn_norm = vec(D, 1.f, 1.f);
    l.mlp_norm = vec(D, 1.f, 1.f);
    l.conv_weight = vec(2 * HD * c.conv_width, -0.5f, 0.5f);
    l.conv_bias = vec(2 * HD, -0.1f, 0.1f);
    l.gate_norm = vec(dh, 1.f, 1.f);
    l.dt_bias = vec(H, -2.f, 0.f);
    l.a_log = vec(H, -1.f, 1.f);
    if (c.linear_mixer == LinearMixer::kMamba2) l.d_skip = vec(H, 0.f, 1.f);
  }
  ORYX_CUDA_CHECK(cudaStreamSynchronize(s));
  b->weight_bytes_ = bf16_elements * static_cast<int64_t>(sizeof(bf16));
  return b;
}

absl::StatusOr<SequenceState> CudaBackend::TryNewSequence() const {
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CudaSequence> seq, CudaSequence::Create(ctx_, this));
  return SequenceState(config_, std::move(seq));
}

SequenceState CudaBackend::NewSequence() const {
  absl::StatusOr<SequenceState> seq = TryNewSequence();
  if (!seq.ok()) {
    std::fprintf(stderr, "fatal: CudaBackend::NewSequence: %s\n", std::string(seq.status().message()).c_str());
    std::abort();
  }
  return std::move(*seq);
}

int64_t CudaBackend::AvailableDeviceBytes() const {
  size_t free = 0, total = 0;
  ORYX_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(free) + ctx_->pool.cached_bytes();
}

std::string CudaBackend::DeviceName() const {
  int device = 0;
  cudaDeviceProp prop{};
  ORYX_CUDA_CHECK(cudaGetDevice(&device));
  ORYX_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

void CudaBackend::Synchronize() const { ORYX_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream)); }

double CudaBackend::MeasureCopyBandwidth() const {
  const int64_t n = int64_t{1} << 28;  // 1 GiB of floats per buffer
  float *x = nullptr, *y = nullptr;
  ORYX_CUDA_CHECK(cudaMalloc(&x, n * sizeof(float)));
  ORYX_CUDA_CHECK(cudaMalloc(&y, n * sizeof(float)));
  ORYX_CUDA_CHECK(cudaMemsetAsync(x, 0, n * sizeof(float), ctx_->stream));
  cudaEvent_t start, stop;
  ORYX_CUDA_CHECK(cudaEventCreate(&start));
  ORYX_CUDA_CHECK(cudaEventCreate(&stop));
  float best_ms = 1e30f;
  for (int i = 0; i < 11; ++i) {
    ORYX_CUDA_CHECK(cudaEventRecord(start, ctx_->stream));
    kc::StreamCopy({.n = n, .x_ptr = x, .y_ptr = y, .sum_ptr = nullptr}, ctx_->stream);
    ORYX_CUDA_CHECK(cudaEventRecord(stop, ctx_->stream));
    ORYX_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    ORYX_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i > 0) best_ms = std::min(best_ms, ms);  // the first pass warms up
  }
  ORYX_CUDA_CHECK(cudaEventDestroy(start));
  ORYX_CUDA_CHECK(cudaEventDestroy(stop));
  ORYX_CUDA_CHECK(cudaFree(x));
  ORYX_CUDA_CHECK(cudaFree(y));
  return 2.0 * n * sizeof(float) / (best_ms * 1e-3);
}

void CudaBackend::LayerForward(int64_t il, const Plan& plan) {
  const ModelConfig& c = config_;
  const Layer& w = layers_[il];
  Scratch& sc = *scratch_;
  Context& ctx = *ctx_;
  cudaStream_t s = ctx.stream;
  const int64_t D = c.d_model, HD = c.qk_dim(), F = c.mlp_hidden, P = proj_width_;
  const kc::ModelDims& dims = ctx.dims;
  const int32_t layer = static_cast<int32_t>(il);
  const int64_t N = plan.N, B = plan.B, NA = plan.NA;
  const int64_t P_used = plan.any_attention ? P : P - HD;  // q_attn only when some token attends
  auto mark = [&](const char* name) {
    if (profiler_) profiler_->Mark(name, s);
  };

  // The fused input projections (after the attention norm), then conv + RoPE + KV append, the window
  // update, the recurrence and attention.
  if (plan.fused) {
    kc::FusedGemvParams in{.m = N, .n = P_used, .k = D, .input = kc::GemvInput::kRmsNorm, .eps = dims.norm_eps,
        .head_dim = 0, .in_row_stride = D, .gate_row_stride = 0, .y_row_stride = P, .in_ptr = sc.x, .gate_ptr = nullptr,
        .weight_ptr = w.attn_norm, .w_ptr = w.in_proj, .y_ptr = sc.proj, .accumulate = false};
    if (plan.skip_q_linear) in.n -= HD, in.skip_begin = 2 * HD, in.skip_rows = HD;
    in.rows_per_warp = gemv_rows_per_warp_;
    kc::FusedGemv(in, s);
    mark("in_proj (norm fused)");
  } else {
    // u = RMSNorm(x) was written by the previous step.
    kc::Gemm({.m = N, .n = P_used, .k = D, .x_row_stride = D, .y_row_stride = P, .x_ptr = sc.u, .w_ptr = w.in_proj,
              .y_ptr = sc.proj}, ctx.cublas);
    mark("in_proj");
  }
  if (plan.decode_mixer) {
    kc::DecodeMixer({.dims = dims, .layer = layer, .seqs = B, .seqs_ptr = sc.seqs, .row_mode_ptr = sc.row_mode,
                     .proj_ptr = sc.proj, .conv_weight_ptr = w.conv_weight, .conv_bias_ptr = w.conv_bias,
                     .dt_bias_ptr = w.dt_bias, .a_log_ptr = w.a_log, .maybe_d_skip_ptr = w.d_skip, .qa_ptr = sc.qa,
                     .out_ptr = sc.o, .maybe_rope_freq_ptr = rope_freq_}, s);
    mark("conv+recurrent");
  } else {
    kc::ConvRopeAppend({.dims = dims, .layer = layer, .rows = N, .row_seq_ptr = sc.row_seq, .row_mode_ptr = sc.row_mode,
                        .seqs_ptr = sc.seqs, .proj_ptr = sc.proj, .conv_weight_ptr = w.conv_weight,
                        .conv_bias_ptr = w.conv_bias, .kv_ptr = sc.kv, .qa_ptr = sc.qa,
                        .maybe_rope_freq_ptr = rope_freq_}, s);
    mark("conv_rope_append");
    kc::ConvWindowUpdate({.dims = dims, .layer = layer, .seqs = B, .seqs_ptr = sc.seqs, .proj_ptr = sc.proj}, s);
    mark("conv_window");
    // The chunked scan's scratch shares the attention partials' buffer: the scan is done with it before the
    // attention below starts.
    kc::Recurrent({.dims = dims, .layer = layer, .seqs = B, .seqs_ptr = sc.seqs, .row_mode_ptr = sc.row_mode,
                   .proj_ptr = sc.proj, .kv_ptr = sc.kv, .dt_bias_ptr = w.dt_bias, .a_log_ptr = w.a_log,
                   .maybe_d_skip_ptr = w.d_skip, .out_ptr = sc.o,
                   .chunked_min_len = plan.scan_chunks > 0 ? kc::kChunkedScanMinLen : 0,
                   .scan_chunks = plan.scan_chunks, .scan_scratch = sc.partial}, s);
    mark("recurrent");
  }
  const kc::AttentionParams attention{.dims = dims, .layer = layer, .attn_rows = NA, .chunk = plan.chunk,
      .max_chunks = plan.max_chunks, .attn_rows_ptr = sc.attn_rows, .row_seq_ptr = sc.row_seq, .seqs_ptr = sc.seqs,
      .qa_ptr = sc.qa, .partial_ptr = sc.partial, .out_ptr = sc.o, .attn_groups = sc.num_groups,
      .groups_ptr = sc.attn_groups, .group_rows = sc.group_rows};
  if (plan.tiled_attention) {
    kc::TiledAttention(attention, s);
  } else {
    kc::Attention(attention, s);
  }
  if (NA > 0) mark("attention");

  // Gated norm, output projection and residual; MLP norm, SwiGLU MLP and residual. Single rows fuse each
  // norm / gate into the product after it, the SwiGLU and the residual adds into epilogues (3 kernels);
  // longer spans run them apart, the MLP's residual add fused into the next norm (the next layer's, or the
  // final norm of the logit rows in Forward).
  if (plan.fused) {
    kc::FusedGemvParams o_proj{.m = N, .n = D, .k = HD, .input = kc::GemvInput::kGatedNorm, .eps = dims.norm_eps,
        .head_dim = c.head_dim, .in_row_stride = HD, .gate_row_stride = P, .y_row_stride = D, .in_ptr = sc.o,
        .gate_ptr = sc.proj + 3 * HD, .weight_ptr = w.gate_norm, .w_ptr = w.o_proj, .y_ptr = sc.x, .accumulate = true};
    o_proj.rows_per_warp = gemv_rows_per_warp_;
    o_proj.y_written_earlier = true;  // x: last written by the previous layer's down projection (or Embed)
    o_proj.gate_written_earlier = true;  // the gate: by the input projection, the mixer at least between
    kc::FusedGemv(o_proj, s);
    mark("o_proj (gated norm fused)");
    // SwiGLU in the up projection's epilogue (each warp takes a gate row and its up row); the down
    // product adds into the residual.
    kc::FusedGemvParams mlp_in{.m = N, .n = 2 * F, .k = D, .input = kc::GemvInput::kRmsNorm, .eps = dims.norm_eps,
        .head_dim = 0, .in_row_stride = D, .gate_row_stride = 0, .y_row_stride = F, .in_ptr = sc.x, .gate_ptr = nullptr,
        .weight_ptr = w.mlp_norm, .w_ptr = w.mlp_in, .y_ptr = nullptr, .accumulate = false};
    mlp_in.maybe_swiglu_ptr = sc.act;
    mlp_in.rows_per_warp = gemv_rows_per_warp_;
    kc::FusedGemv(mlp_in, s);
    mark("mlp_in+swiglu (norm fused)");
    kc::GemmParams down{.m = N, .n = D, .k = F, .x_row_stride = F, .y_row_stride = D, .x_ptr = sc.act,
        .w_ptr = w.mlp_down, .y_ptr = sc.x, .accumulate = true};
    down.y_written_earlier = true;  // x: last written by o_proj, two kernels back
    kc::Gemm(down, ctx.cublas);
    mark("mlp_down (residual fused)");
    return;
  }
  kc::GatedNorm({.rows = N, .heads = c.n_heads, .head_dim = c.head_dim, .eps = dims.norm_eps, .gate_row_stride = P,
                 .o_ptr = sc.o, .gate_ptr = sc.proj + 3 * HD, .weight_ptr = w.gate_norm, .y_ptr = sc.y}, s);
  mark("gated_norm");
  kc::Gemm({.m = N, .n = D, .k = HD, .x_row_stride = HD, .y_row_stride = D, .x_ptr = sc.y, .w_ptr = w.o_proj,
            .y_ptr = sc.tmp}, ctx.cublas);
  mark("o_proj");
  kc::AddRmsNorm({.rows = N, .d = D, .eps = dims.norm_eps, .x_ptr = sc.x, .maybe_delta_ptr = sc.tmp,
                  .weight_ptr = w.mlp_norm, .maybe_rows_ptr = nullptr, .y_ptr = sc.u}, s);
  mark("add_rmsnorm");
  kc::Gemm({.m = N, .n = 2 * F, .k = D, .x_row_stride = D, .y_row_stride = 2 * F, .x_ptr = sc.u, .w_ptr = w.mlp_in,
            .y_ptr = sc.mlp}, ctx.cublas);
  mark("mlp_in");
  kc::SwiGlu({.rows = N, .d = F, .in_ptr = sc.mlp, .y_ptr = sc.act}, s);
  mark("swiglu");
  kc::Gemm({.m = N, .n = D, .k = F, .x_row_stride = F, .y_row_stride = D, .x_ptr = sc.act, .w_ptr = w.mlp_down,
            .y_ptr = sc.tmp}, ctx.cublas);
  mark("mlp_down");
  if (il + 1 < c.n_layers) {
    kc::AddRmsNorm({.rows = N, .d = D, .eps = dims.norm_eps, .x_ptr = sc.x, .maybe_delta_ptr = sc.tmp,
                    .weight_ptr = layers_[il + 1].attn_norm, .maybe_rows_ptr = nullptr, .y_ptr = sc.u}, s);
    mark("add_rmsnorm");
  }
}

namespace {

// Forwards of short spans only (decode steps, verify spans, speculative rounds) run as CUDA graphs: every
// span at most kMaxGraphSpan tokens and at most kMaxGraphRows rows in all. A longer span (a prefill chunk)
// makes the forward a plain one, with the prefill's tiled attention.
constexpr int64_t kMaxGraphSpan = 64;
constexpr int64_t kMaxGraphRows = 1024;
constexpr int64_t kMaxRoundDrafts = 64;

int64_t AlignMeta(int64_t bytes) { return (bytes + 15) / 16 * 16; }

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

}  // namespace

absl::StatusOr<CudaBackend::Plan> CudaBackend::PlanForward(std::span<const ForwardItem> batch) {
  const ModelConfig& c = config_;
  Plan plan{};
  plan.B = static_cast<int64_t>(batch.size());
  int64_t max_keys = 0, max_span = 0;
  bool any_keeps = false;
  // A sequence's attention rows in groups of at most `size`: how many groups, and the largest.
  struct Grouping {
    int64_t size, groups = 0, largest = 0;
    void Add(int64_t rows) {
      groups += (rows + size - 1) / size;
      largest = std::max(largest, std::min(size, rows));
    }
  };
  Grouping cuda_core{kc::kAttentionGroupRows}, mma_groups{kc::kAttentionMmaGroupRows}, tiles{kc::kAttentionTileRows};
  for (const ForwardItem& it : batch) {
    const int64_t T = static_cast<int64_t>(it.tokens.size()), pos = it.seq->position();
    max_span = std::max(max_span, T);
    CudaSequence& ds = DeviceOf(*it.seq);
    // (Growing keeps every state's contents: a batch that fails here leaves its sequences as they were.)
    if (it.seq->has_kv()) ORYX_RETURN_IF_ERROR(ds.EnsureCapacity(pos + T, pos));
    if (it.keep_states) ORYX_RETURN_IF_ERROR(ds.PrepareSpan(T));
    any_keeps |= it.keep_states;
    int64_t item_attention = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (it.modes[t] == Mode::kAttention) {
        ++item_attention;
        max_keys = std::max(max_keys, pos + t + 1);
      }
    }
    plan.NA += item_attention;
    for (Grouping* g : {&cuda_core, &mma_groups, &tiles}) g->Add(item_attention);
    plan.NL += it.logits == LogitsRows::kAll ? T : it.logits == LogitsRows::kLast ? 1 : 0;
    plan.N += T;
  }
  plan.any_attention = plan.NA > 0;
  const Sampler* drawer = nullptr;
  plan.device_draw = plan.NL > 0;
  for (const ForwardItem& it : batch) {
    if (it.logits == LogitsRows::kNone) continue;
    if (drawer == nullptr) drawer = it.sampler;
    plan.device_draw &= it.sampler != nullptr && it.logits_out == nullptr && drawer != nullptr &&
                        it.sampler->params().SameDistributionAs(drawer->params());
  }
  if (plan.device_draw) {
    const SamplingParams& sp = drawer->params();
    plan.temperature = sp.temperature, plan.top_p = sp.top_p, plan.top_k = sp.top_k;
  }
  // Spans too long for a graph (prefill) attend on tensor cores, in tiles of a sequence's attention rows.
  // (Many short spans, a large batch's verify spans, are not tiled: a tile would hold a few rows of its 64.)
  plan.tiled_attention =
      tiled_attention_ && max_span > kMaxGraphSpan && plan.NA > 0 && kc::TiledAttentionApplies(ctx_->dims);
  // Verify spans of more than 4 attention rows attend on tensor cores too, in groups of up to 16 (kc::Attention
  // takes groups of more than 4 rows there); shorter ones in groups of up to 8 on CUDA cores.
  const bool mma = !plan.tiled_attention && mma_groups.largest > 4 && kc::GroupAttentionMmaApplies(ctx_->dims);
  const Grouping& grouping = plan.tiled_attention ? tiles : mma ? mma_groups : cuda_core;
  plan.group_size = static_cast<int32_t>(grouping.size);
  plan.NG = grouping.groups;
  plan.group_rows = static_cast<int32_t>(grouping.largest);
  // Decode steps and short spans (speculative verification) run as CUDA graphs, one per plan. The attention
  // grid is sized for the next power of two of keys, so that a graph serves many steps (blocks past a row's
  // keys exit at once).
  plan.graph = use_graphs_ && !profiler_ && max_span <= kMaxGraphSpan && plan.N <= kMaxGraphRows;
  // A graph bakes in its launches, so the chunked scan must never be wanted by a graph's shape.
  static_assert(kc::kChunkedScanMinLen > kMaxGraphSpan);
  if (plan.graph && max_keys > 0) {
    max_keys = max_keys <= 256 ? 256 : int64_t{1} << (64 - __builtin_clzll(static_cast<uint64_t>(max_keys - 1)));
  }
  // Blocks run per group of a sequence's attention rows (kc::Attention), so the chunk is sized by groups.
  plan.chunk = kc::AttentionChunkFor(std::max<int64_t>(1, max_keys), std::max<int64_t>(1, plan.NG), c.n_heads);
  plan.max_chunks = std::max<int64_t>(1, (max_keys + plan.chunk - 1) / plan.chunk);
  const int64_t D = c.d_model, HD = c.qk_dim(), F = c.mlp_hidden;
  plan.skip_q_linear = skip_q_linear_ && plan.NA == plan.N;
  plan.fused = fused_gemv_ && kc::FusedGemvApplies(plan.N, D) && kc::FusedGemvApplies(plan.N, HD) &&
               kc::FusedGemvApplies(plan.N, F);
  plan.decode_mixer = decode_mixer_ && plan.N == plan.B && !any_keeps && kc::DecodeMixerApplies(ctx_->dims);
  if (chunked_scan_) {
    for (const ForwardItem& it : batch) {
      if (!it.keep_states) plan.scan_chunks += kc::ChunkedScanChunks(it.tokens.size(), kc::kChunkedScanMinLen);
    }
  }
  return plan;
}

namespace {

// A buffer pointer of the scratch to replace by a new buffer of `bytes`: what it holds now, and how to set it.
struct BufferField {
  void* current;
  std::function<void(void*)> set;
  int64_t bytes;
};
template <typename T>
BufferField Field(T*& p, int64_t bytes) {
  return {p, [&p](void* q) { p = static_cast<T*>(q); }, bytes};
}

}  // namespace

absl::Status CudaBackend::EnsureScratch(int64_t N, int64_t NL, int64_t partial, int64_t meta_bytes, int64_t round_q,
                                        int64_t workspace_bytes) {
  const ModelConfig& c = config_;
  const int64_t D = c.d_model, V = c.vocab_size, HD = c.qk_dim(), F = c.mlp_hidden, P = proj_width_;
  Scratch& sc = *scratch_;
  // Replaces the device buffers `fields` (and the pinned host buffer `pinned`, when given) by new ones, all or
  // none: when there is no room, the old buffers stay and the status says so.
  auto replace = [&sc](std::initializer_list<BufferField> fields, const BufferField* pinned,
                       const char* what) -> absl::Status {
    int64_t total = pinned != nullptr ? pinned->bytes : 0;
    for (const BufferField& f : fields) total += f.bytes;
    std::vector<void*> fresh;
    bool ok = true;
    for (const BufferField& f : fields) {
      void* p = TryDeviceAlloc(f.bytes);
      if (p == nullptr) {
        ok = false;
        break;
      }
      fresh.push_back(p);
    }
    void* host = nullptr;
    if (ok && pinned != nullptr && cudaMallocHost(&host, pinned->bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      ok = false;
    }
    if (!ok) {
      for (void* p : fresh) cudaFree(p);
      size_t free = 0, total_device = 0;
      (void)cudaMemGetInfo(&free, &total_device);
      return absl::ResourceExhaustedError(Cat("out of GPU memory: the forward's ", what, " need ",
                                              static_cast<double>(total) / (1 << 30), " GiB; ",
                                              static_cast<double>(free) / (1 << 30), " GiB free"));
    }
    sc.DropGraphs();
    size_t i = 0;
    for (const BufferField& f : fields) {
      if (f.current != nullptr) {
        ORYX_CUDA_CHECK(cudaFree(f.current));
        sc.owned.erase(std::find(sc.owned.begin(), sc.owned.end(), f.current));
      }
      f.set(fresh[i]);
      sc.owned.push_back(fresh[i++]);
    }
    if (pinned != nullptr) {
      if (pinned->current != nullptr) ORYX_CUDA_CHECK(cudaFreeHost(pinned->current));
      pinned->set(host);
    }
    return absl::OkStatus();
  };
  if (N > sc.rows_cap) {
    const int64_t n = std::max(N, 2 * sc.rows_cap);
    ORYX_RETURN_IF_ERROR(replace({Field(sc.x, n * D * 4), Field(sc.proj, n * P * 4), Field(sc.kv, n * 2 * HD * 4),
                                  Field(sc.qa, n * HD * 4), Field(sc.o, n * HD * 4), Field(sc.tmp, n * D * 4),
                                  Field(sc.mlp, n * 2 * F * 4), Field(sc.u, n * D * 2), Field(sc.y, n * HD * 2),
                                  Field(sc.act, n * F * 2)},
                                 nullptr, "activation buffers"));
    sc.rows_cap = n;
  }
  if (NL > sc.logit_rows_cap) {
    const int64_t n = std::max(NL, 2 * sc.logit_rows_cap);
    const BufferField host = Field(sc.logits_host, n * V * 4);
    ORYX_RETURN_IF_ERROR(replace({Field(sc.head, n * D * 2), Field(sc.logits, n * V * 4)}, &host, "logit buffers"));
    sc.logit_rows_cap = n;
  }
  if (partial > sc.partial_cap) {
    const int64_t n = std::max(partial, 2 * sc.partial_cap);
    ORYX_RETURN_IF_ERROR(replace({Field(sc.partial, n * 4)}, nullptr, "attention partials and scan states"));
    sc.partial_cap = n;
  }
  if (meta_bytes > sc.meta_cap) {
    const int64_t n = std::max(meta_bytes, 2 * sc.meta_cap);
    const BufferField host = Field(sc.meta_host, n);
    ORYX_RETURN_IF_ERROR(replace({Field(sc.meta, n)}, &host, "metadata buffers"));
    sc.meta_cap = n;
  }
  if (round_q > sc.round_q_cap) {
    ORYX_RETURN_IF_ERROR(replace({Field(sc.round_q, round_q * 4)}, nullptr, "draft distributions"));
    sc.round_q_cap = round_q;
  }
  if (workspace_bytes > sc.sample_workspace_cap) {
    ORYX_RETURN_IF_ERROR(replace({Field(sc.sample_workspace, workspace_bytes)}, nullptr, "sampling workspace"));
    sc.sample_workspace_cap = workspace_bytes;
  }
  return absl::OkStatus();
}

int64_t CudaBackend::PartialFloats(const Plan& plan) const {
  const int64_t scan = kc::ChunkedScanScratchFloats(ctx_->dims, plan.scan_chunks);
  if (plan.tiled_attention) return scan;
  return std::max(scan, plan.NA * config_.n_heads * plan.max_chunks * (config_.head_dim + 2));
}

void CudaBackend::WriteMeta(std::span<const ForwardItem> batch, const Plan& plan, int64_t pos_shift,
                            char* base) const {
  const int64_t B = plan.B, group_size = plan.group_size;
  const MetaLayout m(plan);
  auto* tokens = reinterpret_cast<int32_t*>(base + m.tokens);
  auto* row_seq = reinterpret_cast<int32_t*>(base + m.row_seq);
  auto* attn_rows = reinterpret_cast<int32_t*>(base + m.attn);
  auto* logit_rows = reinterpret_cast<int32_t*>(base + m.logit);
  auto* row_mode = reinterpret_cast<uint8_t*>(base + m.mode);
  auto* seqs = reinterpret_cast<kc::SeqDesc*>(base + m.seqs);
  auto* groups = reinterpret_cast<int32_t*>(base + m.groups);
  int64_t r = 0, a = 0, lr = 0, g = 0;
  for (int64_t b = 0; b < B; ++b) {
    const ForwardItem& it = batch[b];
    const int64_t T = static_cast<int64_t>(it.tokens.size()), first_attention = a;
    seqs[b] = DeviceOf(*it.seq).Desc(r, T, it.seq->position() + pos_shift, it.keep_states);
    for (int64_t t = 0; t < T; ++t, ++r) {
      tokens[r] = it.tokens[t];
      row_seq[r] = static_cast<int32_t>(b);
      row_mode[r] = it.modes[t] == Mode::kAttention;
      if (row_mode[r]) attn_rows[a++] = static_cast<int32_t>(r);
      if (it.logits == LogitsRows::kAll || (it.logits == LogitsRows::kLast && t == T - 1)) {
        logit_rows[lr++] = static_cast<int32_t>(r);
      }
    }
    for (int64_t a0 = first_attention; a0 < a; a0 += group_size, ++g) {
      groups[2 * g] = static_cast<int32_t>(a0);
      groups[2 * g + 1] = static_cast<int32_t>(std::min<int64_t>(group_size, a - a0));
    }
  }
}

void CudaBackend::SetViews(const Plan& plan, const char* base) {
  Scratch& sc = *scratch_;
  const MetaLayout m(plan);
  sc.tokens = reinterpret_cast<const int32_t*>(base + m.tokens);
  sc.tokens_stride = 1;
  sc.row_seq = reinterpret_cast<const int32_t*>(base + m.row_seq);
  sc.attn_rows = reinterpret_cast<const int32_t*>(base + m.attn);
  sc.logit_rows = reinterpret_cast<const int32_t*>(base + m.logit);
  sc.row_mode = reinterpret_cast<const uint8_t*>(base + m.mode);
  sc.seqs = reinterpret_cast<const kc::SeqDesc*>(base + m.seqs);
  sc.attn_groups = reinterpret_cast<const int32_t*>(base + m.groups);
  sc.num_groups = plan.NG;
  sc.group_rows = plan.group_rows;
  sc.argmax_key = nullptr;
}

void CudaBackend::RunModel(const Plan& plan) {
  const ModelConfig& c = config_;
  Scratch& sc = *scratch_;
  Context& ctx = *ctx_;
  const int64_t D = c.d_model, V = c.vocab_size;
  const float eps = ctx.dims.norm_eps;
  if (profiler_) profiler_->Mark("start", ctx.stream);
  kc::Embed({.rows = plan.N, .d = D, .tokens_ptr = sc.tokens, .table_ptr = static_cast<const bf16*>(embed_),
             .x_ptr = sc.x, .tokens_stride = sc.tokens_stride}, ctx.stream);
  if (!plan.fused) kc::AddRmsNorm({.rows = plan.N, .d = D, .eps = eps, .x_ptr = sc.x, .maybe_delta_ptr = nullptr,
                                   .weight_ptr = layers_[0].attn_norm, .maybe_rows_ptr = nullptr,
                                   .y_ptr = sc.u}, ctx.stream);
  if (profiler_) profiler_->Mark("embed", ctx.stream);
  for (int64_t il = 0; il < c.n_layers; ++il) LayerForward(il, plan);
  if (plan.NL > 0) {
    // The unfused path still owes the last MLP's residual (in tmp).
    kc::AddRmsNorm({.rows = plan.NL, .d = D, .eps = eps, .x_ptr = sc.x,
                    .maybe_delta_ptr = plan.fused ? nullptr : sc.tmp, .weight_ptr = final_norm_,
                    .maybe_rows_ptr = sc.logit_rows, .y_ptr = sc.head}, ctx.stream);
    kc::GemmParams head{.m = plan.NL, .n = V, .k = D, .x_row_stride = D, .y_row_stride = V, .x_ptr = sc.head,
        .w_ptr = static_cast<const bf16*>(lm_head_), .y_ptr = sc.logits};
    head.maybe_argmax_key = sc.argmax_key;
    kc::Gemm(head, ctx.cublas);
    if (profiler_) profiler_->Mark("final_norm+lm_head", ctx.stream);
  }
}

void CudaBackend::FinishForward(std::span<const ForwardItem> batch, const float* logits_host,
                                const int32_t* draws_host) {
  const int64_t V = config_.vocab_size;
  int64_t lr = 0;
  for (const ForwardItem& it : batch) {
    SequenceState& seq = *it.seq;
    const int64_t T = static_cast<int64_t>(it.tokens.size());
    seq.span_start_ = it.keep_states ? seq.position_ : -1;
    seq.span_len_ = it.keep_states ? T : 0;
    seq.position_ += T;
    const int64_t rows = it.logits == LogitsRows::kAll ? T : it.logits == LogitsRows::kLast;
    if (rows > 0 && logits_host != nullptr && it.logits_out != nullptr) {
      it.logits_out->resize(rows * V);
      std::memcpy(it.logits_out->data(), logits_host + lr * V, rows * V * sizeof(float));
    }
    if (it.sampler != nullptr && draws_host != nullptr) {
      *it.next_token = draws_host[lr];
      if (!it.sampler->params().greedy()) it.sampler->SkipUniforms(1);  // the one the device's draw used
    } else if (it.sampler != nullptr) {
      *it.next_token = it.sampler->Next(std::span(logits_host + lr * V, V));
    }
    lr += rows;
  }
}

// Where a forward's next tokens, drawn on the device, sit in the metadata buffer: after the forward's own
// metadata, the tokens [NL] (for one greedy row, the LM head's 64-bit argmax key: kc::ArgmaxKey, zeroed by
// the metadata's copy), then, sampled, each row's uniform. All offsets 0 when the forward draws nothing.
struct CudaBackend::DrawLayout {
  bool on = false, sampled = false, key = false;
  int64_t tokens = 0, uniforms = 0;
  int64_t meta_bytes = 0;  // the metadata's bytes, the draws' included
};

CudaBackend::DrawLayout CudaBackend::LayOutDraws(const Plan& plan, int64_t meta_bytes) const {
  DrawLayout d;
  d.meta_bytes = meta_bytes;
  if (!plan.device_draw) return d;
  const int64_t V = config_.vocab_size, D = config_.d_model;
  d.on = true;
  d.sampled = plan.temperature > 0.f;
  // (The scratch's buffers are whole device allocations, so the LM head's input and output are aligned.)
  d.key = !d.sampled && plan.NL == 1 &&
          kc::GemvApplies({.m = 1, .n = V, .k = D, .x_row_stride = D, .y_row_stride = V, .x_ptr = nullptr,
                           .w_ptr = static_cast<const bf16*>(lm_head_), .y_ptr = nullptr});
  d.tokens = meta_bytes;
  d.uniforms = d.tokens + AlignMeta(plan.NL * 4);  // (room for the key too)
  d.meta_bytes = d.uniforms + (d.sampled ? AlignMeta(plan.NL * 8) : 0);
  return d;
}

void CudaBackend::Draw(const Plan& plan, const DrawLayout& d) {
  if (!d.on || d.key) return;  // (the key: drawn by the LM head, in RunModel)
  Scratch& sc = *scratch_;
  auto* tokens = reinterpret_cast<int32_t*>(sc.meta + d.tokens);
  if (!d.sampled) return kc::Argmax({.rows = plan.NL, .vocab = config_.vocab_size, .logits_ptr = sc.logits,
                                     .tokens_ptr = tokens}, ctx_->stream);
  const kc::SamplingDims dims{config_.vocab_size, plan.temperature, plan.top_k, plan.top_p};
  kc::SampleRows({.rows = plan.NL, .dims = dims, .logits_ptr = sc.logits,
                  .uniforms_ptr = reinterpret_cast<const double*>(sc.meta + d.uniforms), .tokens_ptr = tokens,
                  .workspace_ptr = sc.sample_workspace}, ctx_->stream);
}

namespace {

// A forward's step timing (CudaBackend::set_step_timing): host clocks at its stages and, when on, CUDA
// events in its stream around the kernels and the copy back.
class StepClock {
 public:
  using Clock = std::chrono::steady_clock;
  StepClock(bool on, cudaEvent_t (&events)[3], cudaStream_t stream) : on_(on), events_(events), stream_(stream) {}
  void Host(int stage) {  // 0 enter, 1 launch, 2 wait, 3 synced, 4 done
    if (on_) host_[stage] = Clock::now();
  }
  void Device(int i) {  // 0 the kernels' start, 1 their end, 2 the copy back's end
    if (!on_) return;
    if (events_[i] == nullptr) ORYX_CUDA_CHECK(cudaEventCreate(&events_[i]));
    ORYX_CUDA_CHECK(cudaEventRecord(events_[i], stream_));
  }
  CudaBackend::StepTiming Timing() const {
    auto seconds = [&](int a, int b) { return std::chrono::duration<double>(host_[b] - host_[a]).count(); };
    auto elapsed = [&](int a, int b) {
      float ms = 0;
      ORYX_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[a], events_[b]));
      return ms * 1e-3;
    };
    return {.wall_s = seconds(0, 4), .prepare_s = seconds(0, 1), .launch_s = seconds(1, 2), .device_s = elapsed(0, 1),
            .copy_back_s = elapsed(1, 2), .finish_s = seconds(3, 4)};
  }

 private:
  bool on_;
  cudaEvent_t (&events_)[3];
  cudaStream_t stream_;
  Clock::time_point host_[5];
};

}  // namespace

absl::Status CudaBackend::Forward(std::span<const ForwardItem> batch) {
  StepClock clock(step_timing_, ctx_->timing, ctx_->stream);
  clock.Host(0);
  ORYX_RETURN_IF_ERROR(ValidateForwardBatch(config_, batch, this));
  std::lock_guard<std::mutex> lock(forward_mu_);
  Scratch& sc = *scratch_;
  Context& ctx = *ctx_;
  ORYX_ASSIGN_OR_RETURN(const Plan plan, PlanForward(batch));
  const DrawLayout draws = LayOutDraws(plan, MetaLayout(plan).bytes);
  ORYX_RETURN_IF_ERROR(EnsureScratch(plan.N, plan.NL, PartialFloats(plan), draws.meta_bytes, 0,
                                     draws.sampled ? kc::SamplingWorkspaceBytes(plan.NL) : 0));
  WriteMeta(batch, plan, 0, sc.meta_host);
  if (draws.key) *reinterpret_cast<unsigned long long*>(sc.meta_host + draws.tokens) = 0;
  if (draws.sampled) {  // each row's uniform, peeked (skipped once the draw is back)
    auto* u = reinterpret_cast<double*>(sc.meta_host + draws.uniforms);
    for (const ForwardItem& it : batch) {
      if (it.sampler != nullptr) it.sampler->PeekUniforms(std::span(u++, 1));
    }
  }
  clock.Host(1);
  ORYX_CUDA_CHECK(cudaMemcpyAsync(sc.meta, sc.meta_host, draws.meta_bytes, cudaMemcpyHostToDevice, ctx.stream));
  clock.Device(0);
  SetViews(plan, sc.meta);
  if (draws.key) sc.argmax_key = reinterpret_cast<unsigned long long*>(sc.meta + draws.tokens);
  auto run = [&] {
    RunModel(plan);
    Draw(plan, draws);
  };
  if (plan.graph) {
    cudaGraphExec_t& exec = sc.graphs[plan];
    if (exec == nullptr) exec = Capture(ctx.stream, run);
    ORYX_CUDA_CHECK(cudaGraphLaunch(exec, ctx.stream));
  } else {
    run();
  }
  clock.Device(1);
  // Back to the host: the drawn tokens (or the key), else the logits asked for.
  if (draws.on) {
    ORYX_CUDA_CHECK(cudaMemcpyAsync(sc.meta_host + draws.tokens, sc.meta + draws.tokens, draws.key ? 8 : plan.NL * 4,
                                    cudaMemcpyDeviceToHost, ctx.stream));
  } else if (plan.NL > 0) {
    ORYX_CUDA_CHECK(cudaMemcpyAsync(sc.logits_host, sc.logits, plan.NL * config_.vocab_size * sizeof(float),
                                    cudaMemcpyDeviceToHost, ctx.stream));
  }
  clock.Device(2);
  clock.Host(2);
  ORYX_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));  // the pinned metadata and logits are reused
  clock.Host(3);
  if (profiler_) {
    const char* mode = plan.NA == plan.N ? "attention" : plan.NA == 0 ? "linear" : "mixed";
    const std::string kind = plan.N == plan.B ? Cat("decode step, ", mode, ", batch ", plan.B)
                                              : Cat("span of ", plan.N, " rows in ", plan.B, " sequences, ", mode);
    profiler_->Collect(plan.tiled_attention ? nullptr : &kind);
  }
  const int32_t* drawn = draws.on ? reinterpret_cast<const int32_t*>(sc.meta_host + draws.tokens) : nullptr;
  int32_t key_token = 0;
  if (draws.key) {
    key_token = kc::ArgmaxToken(*reinterpret_cast<const unsigned long long*>(drawn));
    drawn = &key_token;
  }
  FinishForward(batch, sc.logits_host, drawn);
  clock.Host(4);
  if (step_timing_) last_timing_ = clock.Timing();
  return absl::OkStatus();
}

absl::Status CudaBackend::SpeculativeRound(std::span<const RoundItem> items, int64_t k) {
  const ModelConfig& c = config_;
  const int64_t B = static_cast<int64_t>(items.size()), V = c.vocab_size, S = k + 1;
  if (B == 0) return absl::OkStatus();
  if (k < 1 || k > kMaxRoundDrafts) {
    return absl::InvalidArgumentError(Cat("speculative round: k = ", k, " outside [1, ", kMaxRoundDrafts, "]"));
  }
  // The round's forwards as batches: the verify spans [pending, d_1..d_k] (the drafts' places filled in on
  // the device) and the drafts' single linear-mode tokens.
  std::vector<std::vector<int32_t>> spans(B);
  const std::vector<Mode> attention(S, Mode::kAttention);
  const Mode linear = Mode::kLinear;
  std::vector<float> unused;  // (the logits stay on the device)
  std::vector<ForwardItem> verify(B), drafts(B);
  for (int64_t b = 0; b < B; ++b) {
    const RoundItem& it = items[b];
    if (it.seq == nullptr || it.draft == nullptr || it.result == nullptr || it.sampler == nullptr ||
        it.seq == it.draft || it.draft->has_kv() || it.draft->device() == nullptr || it.draft->device()->owner() != this) {
      return absl::InvalidArgumentError(Cat("speculative round: item ", b,
                                            " needs a sequence, a draft sequence of this backend, a sampler and an output"));
    }
    if (it.draft->position() != it.seq->position()) {
      return absl::InvalidArgumentError(Cat("speculative round: item ", b, "'s draft sequence is at position ",
                                            it.draft->position(), ", its sequence at ", it.seq->position(),
                                            " (refresh it with CopyRecurrentFrom)"));
    }
    if (!it.sampler->params().SameDistributionAs(items[0].sampler->params())) {
      return absl::InvalidArgumentError(Cat("speculative round: item ", b, " samples with other parameters than item 0"));
    }
    spans[b].assign(S, it.pending);
    verify[b] = {it.seq, spans[b], attention, LogitsRows::kAll, &unused, /*keep_states=*/true};
    drafts[b] = {it.draft, std::span(&spans[b][0], 1), std::span(&linear, 1), LogitsRows::kLast, &unused, false};
  }
  ORYX_RETURN_IF_ERROR(ValidateForwardBatch(c, verify, this));
  ORYX_RETURN_IF_ERROR(ValidateForwardBatch(c, drafts, this));

  std::lock_guard<std::mutex> lock(forward_mu_);
  Scratch& sc = *scratch_;
  Context& ctx = *ctx_;
  ORYX_ASSIGN_OR_RETURN(const Plan draft_plan, PlanForward(drafts));
  ORYX_ASSIGN_OR_RETURN(const Plan verify_plan, PlanForward(verify));
  const bool graph = verify_plan.graph;  // (the drafts' plan has fewer rows)
  // Sampled rounds take every uniform the round may use from each slot's sampler (k for the drafts, k + 1 for
  // the acceptance) and afterwards advance the sampler past the ones it used.
  const SamplingParams& sampling = items[0].sampler->params();
  const bool sampled = !sampling.greedy();
  const kc::SamplingDims dims{V, sampling.temperature, sampling.top_k, sampling.top_p};
  // Metadata: the k draft steps' (each its positions), the verify span's, then the verify rows' argmaxes
  // (greedy) or each slot's (accepted, next) (sampled), then the uniforms (sampled): the drafts' [k, B],
  // the acceptance's [B, S].
  const int64_t draft_bytes = MetaLayout(draft_plan).bytes;
  const int64_t verify_base = k * draft_bytes;
  const int64_t result_base = verify_base + MetaLayout(verify_plan).bytes;
  const int64_t uniform_base = result_base + AlignMeta(B * S * 4);
  const int64_t meta_bytes = uniform_base + (sampled ? AlignMeta((k * B + B * S) * 8) : 0);
  const int64_t workspace_bytes = sampled ? kc::SamplingWorkspaceBytes(std::max(B, S)) : 0;
  ORYX_RETURN_IF_ERROR(EnsureScratch(verify_plan.N, verify_plan.NL, PartialFloats(verify_plan), meta_bytes,
                                     sampled ? B * k * V : 0, workspace_bytes));
  for (int64_t j = 0; j < k; ++j) WriteMeta(drafts, draft_plan, j, sc.meta_host + j * draft_bytes);
  WriteMeta(verify, verify_plan, 0, sc.meta_host + verify_base);
  if (sampled) {
    auto* u = reinterpret_cast<double*>(sc.meta_host + uniform_base);
    std::vector<double> ahead(k + S);  // a slot's next uniforms: its k drafts', then its acceptance's
    for (int64_t b = 0; b < B; ++b) {
      items[b].sampler->PeekUniforms(ahead);
      for (int64_t j = 0; j < k; ++j) u[j * B + b] = ahead[j];
      std::copy(ahead.begin() + k, ahead.end(), u + k * B + b * S);
    }
  }
  ORYX_CUDA_CHECK(cudaMemcpyAsync(sc.meta, sc.meta_host, meta_bytes, cudaMemcpyHostToDevice, ctx.stream));
  // The verify span's tokens [B, S] (at the verify metadata's base) are where the drafts go: draft step j
  // reads column j and writes its token to column j + 1.
  auto* span_tokens = reinterpret_cast<int32_t*>(sc.meta + verify_base);
  auto* results = reinterpret_cast<int32_t*>(sc.meta + result_base);
  const auto* uniforms = reinterpret_cast<const double*>(sc.meta + uniform_base);
  auto round = [&] {
    for (int64_t j = 0; j < k; ++j) {
      SetViews(draft_plan, sc.meta + j * draft_bytes);
      sc.tokens = span_tokens + j;
      sc.tokens_stride = S;
      RunModel(draft_plan);
      if (sampled) {  // the draft and its distribution q_j, rows [b, j] of round_q
        kc::SampleRows({.rows = B, .dims = dims, .logits_ptr = sc.logits, .uniforms_ptr = uniforms + j * B,
                        .tokens_ptr = span_tokens + j + 1, .workspace_ptr = sc.sample_workspace, .tokens_stride = S,
                        .maybe_probs_ptr = sc.round_q + j * V, .probs_row_stride = k * V}, ctx.stream);
      } else {
        kc::Argmax({.rows = B, .vocab = V, .logits_ptr = sc.logits, .tokens_ptr = span_tokens + j + 1,
                    .tokens_stride = S}, ctx.stream);
      }
    }
    SetViews(verify_plan, sc.meta + verify_base);
    RunModel(verify_plan);
    if (!sampled) return kc::Argmax({.rows = B * S, .vocab = V, .logits_ptr = sc.logits,
                                     .tokens_ptr = results}, ctx.stream);
    for (int64_t b = 0; b < B; ++b) {
      kc::AcceptLossless({.drafts = k, .dims = dims, .logits_ptr = sc.logits + b * S * V,
                          .drafts_ptr = span_tokens + b * S + 1, .maybe_q_ptr = sc.round_q + b * k * V,
                          .uniforms_ptr = uniforms + k * B + b * S, .result_ptr = results + 2 * b,
                          .workspace_ptr = sc.sample_workspace}, ctx.stream);
    }
  };
  if (graph) {
    // (The sampling parameters are baked into the launches, so they are part of the key.)
    cudaGraphExec_t& exec = sc.round_graphs[{draft_plan, verify_plan, k, dims.temperature, dims.top_k, dims.top_p}];
    if (exec == nullptr) exec = Capture(ctx.stream, round);
    ORYX_CUDA_CHECK(cudaGraphLaunch(exec, ctx.stream));
  } else {
    round();
  }
  // The drafts and the results come back in one synchronisation.
  auto* span_host = reinterpret_cast<int32_t*>(sc.meta_host + verify_base);
  auto* results_host = reinterpret_cast<int32_t*>(sc.meta_host + result_base);
  ORYX_CUDA_CHECK(cudaMemcpyAsync(span_host, span_tokens, B * S * 4, cudaMemcpyDeviceToHost, ctx.stream));
  ORYX_CUDA_CHECK(cudaMemcpyAsync(results_host, results, (sampled ? 2 * B : B * S) * 4, cudaMemcpyDeviceToHost,
                                  ctx.stream));
  ORYX_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  if (profiler_) profiler_->Collect(nullptr);
  for (int64_t j = 0; j < k; ++j) FinishForward(drafts, nullptr, nullptr);
  FinishForward(verify, nullptr, nullptr);

  // The drafts, and the verify rows' argmaxes (greedy) or the device's verdict (sampled).
  for (int64_t b = 0; b < B; ++b) {
    RoundResult& r = *items[b].result;
    const int32_t* d = span_host + b * S;  // pending, d_1..d_k
    r.drafts.assign(d + 1, d + S);
    if (sampled) {
      r.targets.clear();
      r.accepted = results_host[2 * b];
      r.next = results_host[2 * b + 1];
    } else {
      r.targets.assign(results_host + b * S, results_host + (b + 1) * S);
    }
  }
  return absl::OkStatus();
}

}  // namespace oryx
