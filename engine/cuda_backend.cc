// CUDA forward of the Oryx model over a ragged batch (DESIGN.md §2, §5): one embedding gather, per layer
// four cuBLAS products over every row of the batch and a handful of fused kernels, the logits of the rows
// asked for copied back. Per-forward metadata (tokens, rows, modes, sequence descriptors) goes up in one
// copy; the only synchronisation is the end of the forward. This file: loading, Forward and the speculative
// round; the rest is in cuda_memory.cc, cuda_plan.cc and cuda_layer.cc over cuda_backend_internal.h.
#include "engine/cuda_backend.h"
#include "engine/cuda_backend_internal.h"

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

using namespace cuda_internal;  // NOLINT: the backend's own internals

CudaBackend::CudaBackend() = default;

CudaBackend::~CudaBackend() {
  if (ctx_ && ctx_->stream != nullptr) cudaStreamSynchronize(ctx_->stream);
  idle_drafts_.clear();
  idle_seqs_.clear();
  profiler_.reset();
  scratch_.reset();
  for (Layer& l : layers_) {
    for (Weight* w : {&l.in_proj, &l.o_proj, &l.mlp_in, &l.mlp_down}) {
      cudaFree(w->data);
      cudaFree(w->scale);
    }
    for (void* p : {static_cast<void*>(l.attn_norm), static_cast<void*>(l.mlp_norm), static_cast<void*>(l.conv_weight),
                    static_cast<void*>(l.conv_bias), static_cast<void*>(l.gate_norm), static_cast<void*>(l.dt_bias),
                    static_cast<void*>(l.a_log), static_cast<void*>(l.d_skip)}) {
      cudaFree(p);
    }
  }
  if (lm_head_.data != embed_) cudaFree(lm_head_.data);
  cudaFree(lm_head_.scale);
  cudaFree(embed_);
  cudaFree(fp8_scratch_);
  cudaFree(final_norm_);
  cudaFree(rope_freq_);
}

absl::Status CudaBackend::Init(const ModelConfig& c, const CudaSwitches& switches) {
  if (kc::DeviceCount() == 0) return absl::FailedPreconditionError("device 'cuda': no CUDA device is visible");
  config_ = c;
  in_proj_ = InProjLayout::For(c);
  const int64_t H = c.n_heads, HD = c.qk_dim();
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
  d.proj_width = static_cast<int32_t>(in_proj_.width);
  d.gdn = c.linear_mixer == LinearMixer::kGdn;
  d.conv_silu = c.conv_activation == ConvActivation::kSilu;
  d.norm_eps = static_cast<float>(c.norm_eps);
  d.rope_theta = c.rope_theta;
  d.attn_log_scale_base = c.attn_log_scale_base;
  ctx_->L = c.n_layers;
  ctx_->H = H;
  ctx_->dh = c.head_dim;
  ctx_->HD = HD;
  ctx_->W = c.conv_width - 1;
  ctx_->kv = std::make_unique<cuda_internal::DeviceKvBlocks>(ctx_->pool, KvBytes(kc::kKvBlockTokens));
  ctx_->pool.set_reclaim([kv = ctx_->kv.get()] { kv->Trim(); });
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
  split_norms_ = switches.split_norms;
  mixer_norm_ = switches.mixer_norm;
  skip_q_linear_ = switches.skip_q_linear;
  chunked_scan_ = switches.chunked_scan;
  tiled_attention_ = switches.tiled_attention;
  gemv_rows_per_warp_ = switches.gemv_rows_per_warp;
  mixer_prefetch_bytes_ = int64_t{switches.mixer_prefetch_mib} << 20;
  down_prefetch_bytes_ = int64_t{switches.down_prefetch_mib} << 20;
  fused_rows_ = switches.fused_rows;
  {
    // The forward's activation buffers per row (EnsureScratch): x, tmp, proj, kv, qa, o, mlp in fp32; u, y, act
    // in bf16. 1.25 GiB of them: 8,704 rows of 1.4b (8,192 before), 32,768 (the most) of models/default.
    const int64_t D = c.d_model, HD = c.qk_dim(), F = c.mlp_hidden, P = in_proj_.width;
    const int64_t row_bytes = 4 * (2 * D + P + 4 * HD + 2 * F) + 2 * (D + HD + F);
    constexpr int64_t kActivationBytes = int64_t{5} << 28;
    prefill_rows_ = switches.prefill_rows > 0
                        ? switches.prefill_rows
                        : std::clamp<int64_t>(kActivationBytes / row_bytes / 256 * 256, 2048, 32768);
  }
  prefill_span_ = std::max(256, switches.prefill_span);  // (PrefillSpan's least)
  graph_after_ = switches.graph_after;
  round_padding_ = switches.round_padding;
  mixed_draws_ = switches.mixed_draws;
  kc::SetKernelSwitches({.early_loads = switches.early_loads,
                         .programmatic_launch = switches.programmatic_launch,
                         .wide_gemv = switches.wide_gemv,
                         .group_mma = switches.group_mma,
                         .group_mma_min_rows = switches.group_mma_min_rows,
                         .attention_chunk = switches.attention_chunk,
                         .group_mma_chunk = switches.group_mma_chunk,
                         .split_ragged_gemm = switches.split_ragged_gemm,
                         .fp8_mma_min_rows = switches.fp8_mma_min_rows,
                         .multirow_bf16 = switches.multirow_bf16 < 0    ? kc::KernelSwitches::MultiRow::kAuto
                                          : switches.multirow_bf16 == 0 ? kc::KernelSwitches::MultiRow::kOff
                                                                        : kc::KernelSwitches::MultiRow::kOn,
                         .bf16_mma_gemv_max_rows = switches.bf16_mma_gemv_rows,
                         .fp8_mma_gemv_max_rows = switches.fp8_mma_gemv_rows,
                         .head_mixer_min_seqs = switches.head_mixer_seqs,
                         .head_mixer_min_dim = switches.head_mixer_dim,
                         .head_mixer_carveout = switches.head_mixer_carveout});
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

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Load(const std::string& dir, const CudaSwitches& switches,
                                                               kernels::WeightFormat weights) {
  if (kernels::IsInt8(weights)) {
    return absl::InvalidArgumentError("the CUDA backend runs bf16 or fp8 weights (f32 and bf16 load as bf16)");
  }
  ORYX_ASSIGN_OR_RETURN(Checkpoint ckpt, LoadCheckpoint(dir));
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  ORYX_RETURN_IF_ERROR(b->Init(ckpt.config(), switches));
  const ModelConfig& c = b->config_;
  std::vector<float> host, part;
  auto get = [&](std::string_view name, std::vector<float>& out) -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(out, ckpt.TensorAsFloats(name));
    return absl::OkStatus();
  };
  auto bf16_upload = [&](const std::vector<float>& v, Weight* dst) {
    bf16* p = nullptr;
    UploadBf16(v, &p);
    dst->data = p;
  };
  ORYX_RETURN_IF_ERROR(get(kEmbedWeight, host));
  bf16* embed = nullptr;
  UploadBf16(host, &embed);
  b->embed_ = embed;
  if (c.tie_embeddings) {
    b->lm_head_.data = embed;
  } else {
    ORYX_RETURN_IF_ERROR(get(kLmHeadWeight, host));
    bf16_upload(host, &b->lm_head_);
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
    if (c.linear_mixer == LinearMixer::kMamba2) {
      ORYX_RETURN_IF_ERROR(layer(kDSkip, host));
      Upload(host, &l.d_skip);
    }
    host.clear();
    for (std::string_view suffix : b->in_proj_.tensors) {
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
  ORYX_RETURN_IF_ERROR(b->SetWeightFormat(weights));
  return b;
}

absl::Status CudaBackend::SetWeightFormat(kernels::WeightFormat weights) {
  const ModelConfig& c = config_;
  const int64_t D = c.d_model, HD = c.qk_dim(), F = c.mlp_hidden, V = c.vocab_size, P = in_proj_.width;
  const bool fp8 = weights == kernels::WeightFormat::kFp8;
  cudaStream_t s = ctx_->stream;
  int64_t bytes = V * D * static_cast<int64_t>(sizeof(bf16)), largest = 0;  // the embedding table
  auto convert = [&](Weight& w, int64_t rows, int64_t cols) {
    largest = std::max(largest, rows * cols);
    if (!fp8) {
      if (w.data != embed_) bytes += rows * cols * static_cast<int64_t>(sizeof(bf16));
      return;
    }
    void* q = nullptr;
    ORYX_CUDA_CHECK(cudaMalloc(&q, std::max<int64_t>(1, rows * cols)));
    ORYX_CUDA_CHECK(cudaMalloc(&w.scale, std::max<int64_t>(1, rows) * sizeof(float)));
    kc::QuantizeRowsFp8(static_cast<const bf16*>(w.data), rows, cols, static_cast<kc::fp8*>(q), w.scale, s);
    ORYX_CUDA_CHECK(cudaStreamSynchronize(s));
    if (w.data != embed_) cudaFree(w.data);
    w.data = q;
    bytes += rows * cols + rows * static_cast<int64_t>(sizeof(float));
  };
  convert(lm_head_, V, D);
  for (Layer& l : layers_) {
    convert(l.in_proj, P, D);
    convert(l.o_proj, D, HD);
    convert(l.mlp_in, 2 * F, D);
    convert(l.mlp_down, D, F);
  }
  if (fp8) ORYX_CUDA_CHECK(cudaMalloc(&fp8_scratch_, largest * sizeof(bf16)));
  weight_bytes_ = bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::CreateRandom(const ModelConfig& config, uint32_t seed,
                                                                       const CudaSwitches& switches,
                                                                       kernels::WeightFormat weights) {
  if (kernels::IsInt8(weights)) {
    return absl::InvalidArgumentError("the CUDA backend runs bf16 or fp8 weights (f32 and bf16 load as bf16)");
  }
  ORYX_RETURN_IF_ERROR(ValidateModelConfig(config, "random model"));
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  ORYX_RETURN_IF_ERROR(b->Init(config, switches));
  const ModelConfig& c = b->config_;
  const int64_t D = c.d_model, H = c.n_heads, dh = c.head_dim, HD = c.qk_dim(), F = c.mlp_hidden, V = c.vocab_size;
  const int64_t P = b->in_proj_.width;
  cudaStream_t s = b->ctx_->stream;
  uint32_t next = seed * 1000003u;
  auto matrix = [&](int64_t rows, int64_t cols) {
    bf16* p = nullptr;
    ORYX_CUDA_CHECK(cudaMalloc(&p, rows * cols * sizeof(bf16)));
    const float bound = 1.f / std::sqrt(static_cast<float>(cols));
    kc::FillUniform(p, rows * cols, next++, -bound, bound, s);
    return Weight{.data = p};
  };
  auto vec = [&](int64_t n, float lo, float hi) {
    float* p = nullptr;
    ORYX_CUDA_CHECK(cudaMalloc(&p, n * sizeof(float)));
    kc::FillUniform(p, n, next++, lo, hi, s);
    return p;
  };
  b->embed_ = matrix(V, D).data;
  b->lm_head_ = c.tie_embeddings ? Weight{.data = b->embed_} : matrix(V, D);
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
  ORYX_RETURN_IF_ERROR(b->SetWeightFormat(weights));
  return b;
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
  const WarmupTimer warmup_timer(graphs_);
  Scratch& sc = *scratch_;
  Context& ctx = *ctx_;
  ORYX_ASSIGN_OR_RETURN(const Plan plan, PlanForward(batch));
  const DrawLayout draws = LayOutDraws(plan, MetaLayout(plan).bytes);
  ORYX_RETURN_IF_ERROR(EnsureScratch(plan.N, plan.NL, PartialFloats(plan), draws.meta_bytes, 0,
                                     draws.sampled ? kc::SamplingWorkspaceBytes(plan.NL) : 0));
  WriteMeta(batch, plan, 0, sc.meta_host);
  if (draws.key) *reinterpret_cast<unsigned long long*>(sc.meta_host + draws.tokens) = 0;
  if (draws.sampled) {  // each row's uniform: a sampler's peeked (skipped once the draw is back), else unused
    auto* u = reinterpret_cast<double*>(sc.meta_host + draws.uniforms);
    for (const ForwardItem& it : batch) {
      const int64_t rows = LogitRowsOf(it);
      if (it.sampler != nullptr) {
        it.sampler->PeekUniforms(std::span(u, 1));
      } else {
        std::fill(u, u + rows, 0.5);
      }
      u += rows;
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
  if (!plan.graph || !ReplayOrCapture(sc.graphs[plan], graph_after_, ctx.stream, run, graphs_)) run();
  clock.Device(1);
  // Back to the host: the drawn tokens (or the key), and the logits asked for (with draws, only those rows).
  if (draws.on) {
    const int64_t bytes = plan.stats ? draws.meta_bytes - draws.tokens : draws.key ? 8 : plan.NL * 4;
    ORYX_CUDA_CHECK(cudaMemcpyAsync(sc.meta_host + draws.tokens, sc.meta + draws.tokens, bytes, cudaMemcpyDeviceToHost,
                                    ctx.stream));
  }
  const int64_t row_bytes = config_.vocab_size * sizeof(float);
  auto copy_rows = [&](int64_t first, int64_t rows) {
    if (rows == 0) return;
    ORYX_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(sc.logits_host) + first * row_bytes,
                                    reinterpret_cast<const char*>(sc.logits) + first * row_bytes, rows * row_bytes,
                                    cudaMemcpyDeviceToHost, ctx.stream));
  };
  int64_t rows_back = 0;
  if (!draws.on) {
    copy_rows(0, plan.NL);
    rows_back = plan.NL;
  } else {  // runs of neighbouring items' rows, one copy each
    int64_t lr = 0, run_start = 0, run_rows = 0;
    for (const ForwardItem& it : batch) {
      const int64_t rows = LogitRowsOf(it);
      if (it.logits_out == nullptr || rows == 0) {
        copy_rows(run_start, run_rows);
        run_start = lr + rows, run_rows = 0;
      } else {
        run_rows += rows;
        rows_back += rows;
      }
      lr += rows;
    }
    copy_rows(run_start, run_rows);
  }
  forward_counts_.forwards.fetch_add(1, std::memory_order_relaxed);
  forward_counts_.rows.fetch_add(plan.N, std::memory_order_relaxed);
  forward_counts_.attention_rows.fetch_add(plan.NA, std::memory_order_relaxed);
  forward_counts_.logit_rows_back.fetch_add(rows_back, std::memory_order_relaxed);
  if (!draws.on) {
    const auto host_draws = std::count_if(batch.begin(), batch.end(), [](const ForwardItem& it) { return it.sampler; });
    forward_counts_.host_draws.fetch_add(host_draws, std::memory_order_relaxed);
  }
  clock.Device(2);
  clock.Host(2);
  ORYX_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));  // the pinned metadata and logits are reused
  clock.Host(3);
  if (profiler_) {
    const char* mode = plan.NA == plan.N ? "attention" : plan.NA == 0 ? "linear" : "mixed";
    // Long spans (tiled attention: prefill chunks) of every length share one entry.
    const std::string kind = plan.N == plan.B       ? Cat("decode step, ", mode, ", batch ", plan.B)
                             : plan.tiled_attention ? Cat("long spans (prefill), ", mode)
                                                    : Cat("span of ", plan.N, " rows in ", plan.B, " sequences, ", mode);
    profiler_->Collect(&kind);
  }
  const int32_t* drawn = draws.on ? reinterpret_cast<const int32_t*>(sc.meta_host + draws.tokens) : nullptr;
  int32_t key_token = 0;
  if (draws.key) {
    key_token = kc::ArgmaxToken(*reinterpret_cast<const unsigned long long*>(drawn));
    drawn = &key_token;
  }
  FinishForward(batch, sc.logits_host, drawn,
                plan.stats ? reinterpret_cast<const float*>(sc.meta_host + draws.stats) : nullptr);
  clock.Host(4);
  if (step_timing_) last_timing_ = clock.Timing();
  return absl::OkStatus();
}

int64_t CudaBackend::RoundBatch(int64_t B, int64_t k) const {
  if (!round_padding_ || !use_graphs_) return B;
  const int64_t padded = B <= 2 ? B : B <= 4 ? 4 : (B + 7) / 8 * 8;
  return padded * (k + 1) <= kMaxGraphRows ? padded : B;
}

absl::Status CudaBackend::EnsureIdleSequences(int64_t count) {
  while (static_cast<int64_t>(idle_seqs_.size()) < count) {
    ORYX_ASSIGN_OR_RETURN(SequenceState seq, TryNewSequence());
    ORYX_RETURN_IF_ERROR(seq.Reserve(kMaxRoundDrafts + 1));  // (so that a round's PlanForward takes nothing)
    ORYX_ASSIGN_OR_RETURN(SequenceState draft, seq.TryMakeDraft());
    idle_seqs_.push_back(std::move(seq));
    idle_drafts_.push_back(std::move(draft));
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, double>> CudaBackend::Counters() const {
  auto seconds = [](const std::atomic<int64_t>& ns) { return 1e-9 * static_cast<double>(ns.load()); };
  const DevicePool& pool = ctx_->pool;
  return {{"graph_warmup_s", seconds(graphs_.warmup_ns)},
          {"device_mallocs", static_cast<double>(pool.mallocs())},
          {"device_malloc_s", pool.malloc_seconds()},
          {"device_shortages", static_cast<double>(pool.shortages())},
          {"rounds", static_cast<double>(round_times_.rounds.load())},
          {"round_prepare_s", seconds(round_times_.prepare_ns)},
          {"round_launch_s", seconds(round_times_.launch_ns)},
          {"round_wait_s", seconds(round_times_.wait_ns)},
          {"round_finish_s", seconds(round_times_.finish_ns)},
          {"forwards", static_cast<double>(forward_counts_.forwards.load())},
          {"forward_rows", static_cast<double>(forward_counts_.rows.load())},
          {"forward_attention_rows", static_cast<double>(forward_counts_.attention_rows.load())},
          {"logit_rows_back", static_cast<double>(forward_counts_.logit_rows_back.load())},
          {"host_draws", static_cast<double>(forward_counts_.host_draws.load())}};
}

absl::Status CudaBackend::SpeculativeRound(std::span<const RoundItem> items, int64_t k) {
  // The round's wall time by stage, added to round_times_ as it goes (a failed round counts up to its failure).
  auto last = std::chrono::steady_clock::now();
  auto lap = [&](std::atomic<int64_t>& ns) {
    const auto now = std::chrono::steady_clock::now();
    ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count(), std::memory_order_relaxed);
    last = now;
  };
  const ModelConfig& c = config_;
  const int64_t n = static_cast<int64_t>(items.size()), V = c.vocab_size, S = k + 1;
  if (n == 0) return absl::OkStatus();
  if (k < 1 || k > kMaxRoundDrafts) {
    return absl::InvalidArgumentError(Cat("speculative round: k = ", k, " outside [1, ", kMaxRoundDrafts, "]"));
  }
  for (int64_t b = 0; b < n; ++b) {
    const RoundItem& it = items[b];
    if (it.seq == nullptr || it.draft == nullptr || it.result == nullptr || it.sampler == nullptr ||
        it.seq == it.draft || it.draft->has_kv() || it.draft->device() == nullptr || it.draft->device()->owner() != this) {
      return absl::InvalidArgumentError(Cat("speculative round: item ", b,
                                            " needs a sequence, a draft sequence of this backend, a sampler and an output"));
    }
    if (!it.sampler->params().SameDistributionAs(items[0].sampler->params())) {
      return absl::InvalidArgumentError(Cat("speculative round: item ", b, " samples with other parameters than item 0"));
    }
  }
  std::lock_guard<std::mutex> lock(forward_mu_);
  const WarmupTimer warmup_timer(graphs_);
  // The round's batch: the n items, then idle sequences up to RoundBatch (unpadded when the device has no room
  // for them), whose rows nothing reads.
  int64_t B = RoundBatch(n, k);
  if (B > n && !EnsureIdleSequences(B - n).ok()) B = n;
  // The round's forwards as batches: the verify spans [pending, d_1..d_k] (the drafts' places filled in on
  // the device) and the drafts' single linear-mode tokens.
  std::vector<std::vector<int32_t>> spans(B);
  const std::vector<Mode> attention(S, Mode::kAttention);
  const Mode linear = Mode::kLinear;
  std::vector<float> unused;  // (the logits stay on the device)
  std::vector<ForwardItem> verify(B), drafts(B);
  for (int64_t b = 0; b < B; ++b) {
    SequenceState* seq = b < n ? items[b].seq : &idle_seqs_[b - n];
    SequenceState* draft = b < n ? items[b].draft : &idle_drafts_[b - n];
    spans[b].assign(S, b < n ? items[b].pending : 0);
    verify[b] = {seq, spans[b], attention, LogitsRows::kAll, &unused, /*keep_states=*/true};
    drafts[b] = {draft, std::span(&spans[b][0], 1), std::span(&linear, 1), LogitsRows::kLast, &unused, false};
  }
  ORYX_RETURN_IF_ERROR(ValidateForwardBatch(c, verify, this));
  // Each draft takes its sequence's position here; its states are copied on the device (CopyRecurrentStates).
  std::vector<int64_t> starts(n);
  for (int64_t b = 0; b < n; ++b) {
    items[b].draft->RecordRecurrentCopy(*items[b].seq);
    starts[b] = items[b].seq->position();
  }
  ORYX_RETURN_IF_ERROR(ValidateForwardBatch(c, drafts, this));

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
    std::fill_n(u, k * B + B * S, 0.5);  // (the idle rows')
    std::vector<double> ahead(k + S);  // a slot's next uniforms: its k drafts', then its acceptance's
    for (int64_t b = 0; b < n; ++b) {
      items[b].sampler->PeekUniforms(ahead);
      for (int64_t j = 0; j < k; ++j) u[j * B + b] = ahead[j];
      std::copy(ahead.begin() + k, ahead.end(), u + k * B + b * S);
    }
  }
  lap(round_times_.prepare_ns);
  ORYX_CUDA_CHECK(cudaMemcpyAsync(sc.meta, sc.meta_host, meta_bytes, cudaMemcpyHostToDevice, ctx.stream));
  // The verify span's tokens [B, S] (at the verify metadata's base) are where the drafts go: draft step j
  // reads column j and writes its token to column j + 1.
  auto* span_tokens = reinterpret_cast<int32_t*>(sc.meta + verify_base);
  auto* results = reinterpret_cast<int32_t*>(sc.meta + result_base);
  const auto* uniforms = reinterpret_cast<const double*>(sc.meta + uniform_base);
  const kc::RoundStateDims state_dims{static_cast<int32_t>(ctx.L), static_cast<int32_t>(ctx.H),
                                      static_cast<int32_t>(ctx.dh), static_cast<int32_t>(ctx.W),
                                      static_cast<int32_t>(2 * ctx.HD)};
  const auto* verify_seqs = reinterpret_cast<const kc::SeqDesc*>(sc.meta + verify_base + MetaLayout(verify_plan).seqs);
  const auto* draft_seqs = reinterpret_cast<const kc::SeqDesc*>(sc.meta + MetaLayout(draft_plan).seqs);
  auto round = [&] {
    kc::CopyRecurrentStates(verify_seqs, draft_seqs, B, state_dims, ctx.stream);  // the drafts refreshed
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
    if (!sampled) {
      kc::Argmax({.rows = B * S, .vocab = V, .logits_ptr = sc.logits, .tokens_ptr = results}, ctx.stream);
    } else {
      for (int64_t b = 0; b < B; ++b) {
        kc::AcceptLossless({.drafts = k,
                            .dims = dims,
                            .logits_ptr = sc.logits + b * S * V,
                            .drafts_ptr = span_tokens + b * S + 1,
                            .maybe_q_ptr = sc.round_q + b * k * V,
                            .uniforms_ptr = uniforms + k * B + b * S,
                            .result_ptr = results + 2 * b,
                            .workspace_ptr = sc.sample_workspace},
                           ctx.stream);
      }
    }
    // The sequences cut back to their accepted drafts (TruncateRestored below keeps the host's side).
    kc::RestoreAccepted({.seqs_ptr = verify_seqs,
                         .rows = B,
                         .drafts = k,
                         .span_tokens_ptr = span_tokens,
                         .results_ptr = results,
                         .sampled = sampled,
                         .dims = state_dims},
                        ctx.stream);
  };
  // (The sampling parameters are baked into the launches, so they are part of the key.)
  if (!graph ||
      !ReplayOrCapture(sc.round_graphs[{draft_plan, verify_plan, k, dims.temperature, dims.top_k, dims.top_p}],
                       graph_after_, ctx.stream, round, graphs_)) {
    round();
  }
  // The drafts and the results come back in one synchronisation.
  auto* span_host = reinterpret_cast<int32_t*>(sc.meta_host + verify_base);
  auto* results_host = reinterpret_cast<int32_t*>(sc.meta_host + result_base);
  ORYX_CUDA_CHECK(cudaMemcpyAsync(span_host, span_tokens, B * S * 4, cudaMemcpyDeviceToHost, ctx.stream));
  ORYX_CUDA_CHECK(cudaMemcpyAsync(results_host, results, (sampled ? 2 * B : B * S) * 4, cudaMemcpyDeviceToHost,
                                  ctx.stream));
  lap(round_times_.launch_ns);
  ORYX_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  lap(round_times_.wait_ns);
  if (profiler_) {  // (the drafts' ops and the verify's summed)
    const std::string kind = Cat("whole round of ", k, " drafts, batch ", B, " (", n, " sequences)");
    profiler_->Collect(&kind);
  }
  // (The idle sequences stay at position 0.)
  for (int64_t j = 0; j < k; ++j) FinishForward(std::span(drafts).first(n), nullptr, nullptr);
  FinishForward(std::span(verify).first(n), nullptr, nullptr);

  // The drafts, and the verify rows' argmaxes (greedy) or the device's verdict (sampled); each sequence is
  // after its pending token and its accepted drafts.
  for (int64_t b = 0; b < n; ++b) {
    RoundResult& r = *items[b].result;
    const int32_t* d = span_host + b * S;  // pending, d_1..d_k
    r.drafts.assign(d + 1, d + S);
    if (sampled) {
      r.targets.clear();
      r.accepted = results_host[2 * b];
      r.next = results_host[2 * b + 1];
    } else {
      r.targets.assign(results_host + b * S, results_host + (b + 1) * S);
      r.accepted = AcceptGreedy(r.drafts, r.targets, &r.next);  // (as the device counted them: kc::RestoreAccepted)
    }
    ORYX_RETURN_IF_ERROR(items[b].seq->TruncateRestored(starts[b] + 1 + r.accepted));
    r.cut = true;
  }
  lap(round_times_.finish_ns);
  round_times_.rounds.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

}  // namespace oryx
