// CPU forward of the Oryx model: every token updates the KV cache and the recurrent state; each token's
// output comes from its own mode. Batched over sequences with ragged spans; fp32; kernels from kernels/cpu.
#include "engine/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>

#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/checkpoint.h"
#include "engine/sampler.h"
#include "engine/tensor_names.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"

namespace oryx {

namespace k = kernels;

namespace {

// torch's softplus (threshold 20: linear above it).
float Softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
float Sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// Grows a buffer to at least n floats (never shrinks, so steady-state forwards allocate nothing).
float* AtLeast(kernels::AlignedVector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// CpuBackend

struct CpuBackend::Span {
  int64_t row = 0;  // first row of this item in the batch buffers
  int64_t len = 0;
  bool any_attention = false, all_attention = false;
};

struct CpuBackend::Scratch {
  Floats x, u, proj, qkv, gate_a, gate_b, o_lin, o_attn, y, tmp, mlp, head_rows, logits;
  // Per pool thread: the [T, Tk] scores of one (sequence, head), then (bf16 cache) a block's rows widened to
  // fp32 [block_tokens, dh], or (writing a bf16 cache) a span's keys rotated in fp32 [T, HD].
  std::vector<Floats> attention;
  std::vector<Floats> kv_rows;
  // Per item: its KV blocks, where layer 0's keys and values start (a layer adds layer_stride() elements).
  std::vector<std::vector<const void*>> key_blocks, value_blocks;
  std::vector<Span> spans;
};

CpuBackend::~CpuBackend() = default;

int CpuBackend::num_threads() const { return pool_->num_threads(); }

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Load(const std::string& dir, int threads,
                                                             k::WeightFormat weights) {
  if (threads < 0 || threads > kMaxCpuThreads) {
    return absl::InvalidArgumentError(
        Cat("threads must be in [0, ", kMaxCpuThreads, "] (0: one per hardware thread), got ", threads));
  }
  if (weights == k::WeightFormat::kFp8) {
    return absl::InvalidArgumentError("weights 'fp8' are the CUDA backend's; the CPU runs f32, bf16, int8 or w8a8");
  }
  ORYX_ASSIGN_OR_RETURN(Checkpoint ckpt, LoadCheckpoint(dir));
  std::unique_ptr<CpuBackend> b(new CpuBackend());
  b->config_ = ckpt.config();
  const ModelConfig& c = b->config_;
  b->in_proj_ = InProjLayout::For(c);
  // Each tensor is converted straight into its place, and its file pages are dropped as soon as it is
  // (DropTensorPages): loading then peaks at the fp32 weights plus one tensor, not plus the whole file.
  // With `at`, the tensor goes to out[*at ...] of a matrix fused from several (sized by the caller) and *at
  // moves past it; without, `out` is the tensor.
  auto get = [&](std::string_view name, Floats& out, int64_t* at = nullptr) -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(TensorView view, ckpt.Tensor(name));
    const int64_t n = view.numel();
    if (at == nullptr) out.resize(n);
    const int64_t offset = at == nullptr ? 0 : *at;
    if (offset + n > static_cast<int64_t>(out.size())) {
      return absl::InternalError(Cat(dir, ": ", name, " does not fit its fused matrix"));
    }
    TensorToFloats(view, out.data() + offset);
    if (at != nullptr) *at += n;
    DropTensorPages(view);
    return absl::OkStatus();
  };
  ORYX_RETURN_IF_ERROR(get(kEmbedWeight, b->embed_));
  ORYX_RETURN_IF_ERROR(get(kFinalNormWeight, b->final_norm_));
  if (!c.tie_embeddings) ORYX_RETURN_IF_ERROR(get(kLmHeadWeight, b->head_.f32));
  b->layers_.resize(c.n_layers);
  for (int64_t il = 0; il < c.n_layers; ++il) {
    Layer& l = b->layers_[il];
    auto layer = [&](std::string_view suffix, Floats& out, int64_t* at = nullptr) {
      return get(LayerTensorName(il, suffix), out, at);
    };
    for (auto [suffix, field] : {std::pair{kAttnNorm, &l.attn_norm}, {kMlpNorm, &l.mlp_norm}, {kOProj, &l.o_proj.f32},
                                 {kConvWeight, &l.conv_weight}, {kConvBias, &l.conv_bias}, {kGateNorm, &l.gate_norm},
                                 {kDtBias, &l.dt_bias}, {kALog, &l.a_log}, {kMlpDown, &l.mlp_down.f32}}) {
      ORYX_RETURN_IF_ERROR(layer(suffix, *field));
    }
    if (c.linear_mixer == LinearMixer::kMamba2) ORYX_RETURN_IF_ERROR(layer(kDSkip, l.d_skip));
    l.in_proj.f32.resize(b->in_proj_.width * c.d_model);
    int64_t at = 0;
    for (std::string_view suffix : b->in_proj_.tensors) ORYX_RETURN_IF_ERROR(layer(suffix, l.in_proj.f32, &at));
    l.mlp_in.f32.resize(2 * c.mlp_hidden * c.d_model);
    at = 0;
    for (std::string_view suffix : {kMlpGate, kMlpUp}) ORYX_RETURN_IF_ERROR(layer(suffix, l.mlp_in.f32, &at));
    if (weights != k::WeightFormat::kF32) {
      const int64_t D = c.d_model, HD = c.qk_dim(), F = c.mlp_hidden;
      l.in_proj.Pack(b->in_proj_.width, D, weights);
      l.o_proj.Pack(D, HD, weights);
      l.mlp_in.Pack(2 * F, D, weights);
      l.mlp_down.Pack(D, F, weights);
    }
  }
  if (weights != k::WeightFormat::kF32) {
    if (c.tie_embeddings) b->head_.f32 = b->embed_;  // (the lookup keeps the fp32 embedding)
    b->head_.Pack(c.vocab_size, c.d_model, weights);
  }
  b->pool_ = std::make_unique<k::cpu::ThreadPool>(threads);
  b->kv_pool_ = NewHostKvPool(c, 1);
  b->scratch_ = std::make_unique<Scratch>();
  return b;
}

absl::Status CpuBackend::SetKvBlockTokens(int64_t block_tokens) {
  if (block_tokens < 1 || block_tokens > 4096) {
    return absl::InvalidArgumentError(Cat("KV block size ", block_tokens, " is outside [1, 4096] positions"));
  }
  if (kv_pool_->referenced() > 0) {
    return absl::FailedPreconditionError("the KV block size cannot change while sequences hold blocks");
  }
  kv_pool_ = NewHostKvPool(config_, 1, block_tokens, kv_pool_->format());
  return absl::OkStatus();
}

absl::Status CpuBackend::SetKvFormat(k::KvFormat format) {
  if (format == kv_pool_->format()) return absl::OkStatus();
  if (kv_pool_->referenced() > 0) {
    return absl::FailedPreconditionError("the KV cache's format cannot change while sequences hold blocks");
  }
  kv_pool_ = NewHostKvPool(config_, 1, kv_pool_->block_tokens(), format);
  return absl::OkStatus();
}

absl::Status CpuBackend::ReserveKv(int64_t bytes) {
  // The blocks' memory is written when allocated: more than the host has would be the kernel's OOM killer's.
  const int64_t page = sysconf(_SC_PAGESIZE), available = sysconf(_SC_AVPHYS_PAGES) * page;
  if (page > 0 && available > 0 && bytes - KvPoolBytes() > available) {
    return absl::ResourceExhaustedError(Cat("--kv-memory ", bytes >> 20, " MiB: the host has ", available >> 20,
                                            " MiB of memory free"));
  }
  const int64_t blocks = (std::max<int64_t>(0, bytes) + kv_pool_->block_bytes() - 1) / kv_pool_->block_bytes();
  absl::Status s = kv_pool_->Reserve(blocks);
  if (!s.ok()) return absl::ResourceExhaustedError(Cat("--kv-memory ", bytes >> 20, " MiB: ", s.message()));
  return absl::OkStatus();
}

// y[M, N] = x[M, K] W^T, split over panels of output features on the pool. The panels are fixed (kPanel
// features each, whatever the number of threads) and each is one product, so an output's arithmetic depends
// on its panel alone: which thread runs it, and how many threads there are, cannot change a bit.
void CpuBackend::MatMul(const float* x, int64_t m, int64_t kdim, const Matrix& w, int64_t n, float* y, int64_t x_stride,
                        int64_t y_stride, int64_t first) {
  constexpr int64_t kPanel = kMatMulPanel;
  assert(first % kPanel == 0);
  const int64_t bytes_per_weight = k::BytesPerWeight(w.format);
  const float* f32 = w.format != k::WeightFormat::kF32 ? nullptr : w.f32.empty() ? embed_.data() : w.f32.data();
  // w8a8: x quantised once for every panel.
  thread_local std::vector<uint8_t> xq;
  thread_local std::vector<float> xq_scale;
  const bool quantized = w.format == k::WeightFormat::kW8A8;
  if (quantized) {
    xq.resize(static_cast<size_t>(m * kdim));
    xq_scale.resize(static_cast<size_t>(m));
    k::cpu::QuantizeRows(x, m, kdim, x_stride, xq.data(), xq_scale.data());
  }
  const int64_t first_panel = first / kPanel;
  pool_->ParallelFor((n + kPanel - 1) / kPanel - first_panel, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = first_panel + p0; p < first_panel + p1; ++p) {
      const int64_t n0 = p * kPanel, n1 = std::min(n, n0 + kPanel);
      if (f32 != nullptr) {
        k::cpu::MatMul({m, n1 - n0, kdim, x_stride, kdim, y_stride, x, f32 + n0 * kdim, y + n0});
      } else {
        k::cpu::PackedMatMul({m, n1 - n0, kdim, x_stride, y_stride, w.format, x,
                              w.packed.data() + n0 * kdim * bytes_per_weight,
                              w.scale.empty() ? nullptr : w.scale.data() + n0, y + n0,
                              quantized ? xq.data() : nullptr, quantized ? xq_scale.data() : nullptr});
      }
    }
  });
}

void CpuBackend::Matrix::Pack(int64_t rows, int64_t cols, k::WeightFormat to) {
  format = to;
  packed.resize(rows * cols * k::BytesPerWeight(to));
  if (k::IsInt8(to)) scale.resize(rows);
  k::cpu::PackWeights(f32.data(), rows, cols, to, packed.data(), scale.data());
  Floats().swap(f32);
}

absl::Status CpuBackend::Validate(std::span<const ForwardItem> batch) const {
  for (const ForwardItem& it : batch) {
    if (it.seq != nullptr && it.seq->has_kv_ && it.seq->kv_.pool() != nullptr &&
        it.seq->kv_.pool()->format() != kv_pool_->format()) {
      return absl::InvalidArgumentError(
          "a sequence's KV cache is not in this backend's KV format (make sequences with NewSequence)");
    }
  }
  return ValidateForwardBatch(config_, batch, nullptr);
}

void CpuBackend::LayerForward(int64_t il, std::span<const ForwardItem> batch, std::span<const Span> spans,
                              int64_t N) {
  const ModelConfig& c = config_;
  const Layer& w = layers_[il];
  Scratch& sc = *scratch_;
  const int64_t D = c.d_model, H = c.n_heads, dh = c.head_dim, HD = c.qk_dim(), F = c.mlp_hidden;
  const int64_t P = in_proj_.width, B = static_cast<int64_t>(batch.size()), W = c.conv_width - 1;
  const float eps = static_cast<float>(c.norm_eps);
  const bool mamba2 = c.linear_mixer == LinearMixer::kMamba2;
  bool any_attention = false, all_attention = true;
  for (const Span& s : spans) any_attention |= s.any_attention, all_attention &= s.all_attention;

  float* x = sc.x.data();
  float* u = AtLeast(sc.u, N * D);
  float* proj = AtLeast(sc.proj, N * P);
  float* qkv = AtLeast(sc.qkv, N * 3 * HD);
  float* gate_a = AtLeast(sc.gate_a, H * N);  // per head, then row: [H, N]
  float* gate_b = AtLeast(sc.gate_b, H * N);
  float* o_lin = AtLeast(sc.o_lin, N * HD);
  float* o_attn = AtLeast(sc.o_attn, N * HD);

  // 1. The fused input projections over every row of the batch: q_attn only when some token attends, and
  //    q_linear only when some token is linear. (An attending token's linear output is not used, and the
  //    recurrent state never reads q; its q rows are zeros then.)
  const int64_t col_k = in_proj_.k, col_q = in_proj_.q_linear, col_g = in_proj_.g, col_gates = in_proj_.gates,
                col_qa = in_proj_.q_attn;
  const bool skip_q_linear = all_attention && col_q % kMatMulPanel == 0 && HD % kMatMulPanel == 0;
  k::cpu::RmsNorm({N, D, eps, D, D, x, w.attn_norm.data(), u});
  if (skip_q_linear) {
    MatMul(u, N, D, w.in_proj, col_q, proj, D, P);
    MatMul(u, N, D, w.in_proj, P, proj, D, P, col_q + HD);
  } else {
    MatMul(u, N, D, w.in_proj, any_attention ? P : P - HD, proj, D, P);
  }

  // 2. Mixer gates, transposed to [H, N] so that a head's gates over a span are contiguous.
  for (int64_t r = 0; r < N; ++r) {
    const float* gr = proj + r * P + col_gates;
    for (int64_t h = 0; h < H; ++h) {
      if (mamba2) {
        const float dt = Softplus(gr[h] + w.dt_bias[h]);
        gate_a[h * N + r] = dt;
        gate_b[h * N + r] = -dt * std::exp(w.a_log[h]);
      } else {
        gate_a[h * N + r] = Sigmoid(gr[h]);
        gate_b[h * N + r] = -std::exp(w.a_log[h]) * Softplus(gr[H + h] + w.dt_bias[h]);
      }
    }
  }

  // 3. Per sequence: history for rollback, the causal conv, q next to (k, v), the KV cache append and RoPE.
  pool_->ParallelFor(B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      SequenceState::Layer& st = batch[b].seq->layers_[il];
      const Span& s = spans[b];
      const int64_t T = s.len, pos = batch[b].seq->position_;
      const float* in = proj + s.row * P + col_k;
      if (batch[b].keep_states) {
        float* hist = AtLeast(st.span_inputs, (W + T) * 2 * HD);
        std::copy(st.conv.begin(), st.conv.end(), hist);
        for (int64_t t = 0; t < T; ++t) std::copy(in + t * P, in + t * P + 2 * HD, hist + (W + t) * 2 * HD);
      }
      float* out = qkv + s.row * 3 * HD;
      k::cpu::CausalConv({T, 2 * HD, c.conv_width, c.conv_activation == ConvActivation::kSilu, P, 3 * HD,
                          w.conv_weight.data(), w.conv_bias.data(), st.conv.data(), in, out + HD});
      for (int64_t t = 0; t < T; ++t) {
        const float* q = proj + (s.row + t) * P + col_q;
        if (skip_q_linear) {
          std::fill_n(out + t * 3 * HD, HD, 0.0f);
        } else {
          std::copy(q, q + HD, out + t * 3 * HD);
        }
      }
      SequenceState& seq = *batch[b].seq;
      if (seq.has_kv_ && kv_pool_->format() == k::KvFormat::kF32) {  // the blocks are there (PrepareKv)
        for (int64_t t = 0; t < T; ++t) {
          const float* kv = out + t * 3 * HD + HD;
          for (int64_t h = 0; h < H; ++h) {
            std::copy_n(kv + h * dh, dh, static_cast<float*>(seq.KeyAt(il, pos + t, h)));
            std::copy_n(kv + HD + h * dh, dh, static_cast<float*>(seq.ValueAt(il, pos + t, h)));
          }
        }
        const int64_t bt = seq.kv_block_tokens();
        for (int64_t t = 0, run = 0; c.rope_theta > 0 && t < T; t += run) {  // a run of rows per block and head
          run = std::min(T - t, bt - (pos + t) % bt);
          for (int64_t h = 0; h < H; ++h) {
            k::cpu::Rope({run, 1, dh, pos + t, c.rope_theta, dh, static_cast<float*>(seq.KeyAt(il, pos + t, h))});
          }
        }
      } else if (seq.has_kv_) {  // bf16, int8: the keys rotated in fp32, then each row rounded once
        float* keys = sc.kv_rows[k::cpu::ThreadPool::ThreadIndex()].data();
        for (int64_t t = 0; t < T; ++t) std::copy(out + t * 3 * HD + HD, out + t * 3 * HD + 2 * HD, keys + t * HD);
        if (c.rope_theta > 0) k::cpu::Rope({T, H, dh, pos, c.rope_theta, HD, keys});
        const bool int8 = kv_pool_->format() == k::KvFormat::kInt8;
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t h = 0; h < H; ++h) {
            const float* key = keys + t * HD + h * dh;
            const float* value = out + t * 3 * HD + 2 * HD + h * dh;
            if (int8) {
              k::cpu::QuantizeKvRow(key, dh, static_cast<int8_t*>(seq.KeyAt(il, pos + t, h)));
              k::cpu::QuantizeKvRow(value, dh, static_cast<int8_t*>(seq.ValueAt(il, pos + t, h)));
            } else {
              k::cpu::RoundToBf16(key, dh, static_cast<uint16_t*>(seq.KeyAt(il, pos + t, h)));
              k::cpu::RoundToBf16(value, dh, static_cast<uint16_t*>(seq.ValueAt(il, pos + t, h)));
            }
          }
        }
      }
      if (seq.has_kv_ && s.any_attention && c.rope_theta > 0) {
        k::cpu::Rope({T, H, dh, pos, c.rope_theta, P, proj + s.row * P + col_qa});
      }
      if (seq.has_kv_ && s.any_attention && c.attn_log_scale_base > 0) {
        for (int64_t t = 0; t < T; ++t) {
          const float scale = static_cast<float>(AttnQueryScale(c.attn_log_scale_base, pos + t));
          float* q = proj + (s.row + t) * P + col_qa;
          for (int64_t j = 0; j < HD; ++j) q[j] *= scale;
        }
      }
    }
  });

  // 4. Per (sequence, head): the recurrence for every token, and attention where the span has attention
  //    tokens (computed for the whole span; each token then takes its own mode's output). The score
  //    buffers and each sequence's KV block pointers come from Forward.
  pool_->ParallelFor(B * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      SequenceState& seq = *batch[b].seq;
      SequenceState::Layer& st = seq.layers_[il];
      const Span& s = spans[b];
      const int64_t T = s.len, dd = dh * dh;
      float* state = st.s.data() + h * dd;
      float* saved = nullptr;
      if (batch[b].keep_states) {
        saved = st.span_states.data() + h * (T + 1) * dd;  // sized in Forward before this runs
        std::copy(state, state + dd, saved);
        saved += dd;
      }
      const float* q = qkv + s.row * 3 * HD + h * dh;
      float* o = o_lin + s.row * HD + h * dh;
      if (mamba2) {
        k::cpu::Mamba2({T, 1, dh, 3 * HD, HD, gate_a + h * N + s.row, gate_b + h * N + s.row, w.d_skip.data() + h,
                        q, q + HD, q + 2 * HD, state, saved, o});
      } else {
        k::cpu::Gdn({T, 1, dh, 3 * HD, HD, gate_a + h * N + s.row, gate_b + h * N + s.row, q, q + HD, q + 2 * HD,
                     state, saved, o});
      }
      if (s.any_attention) {
        const int64_t kv_len = seq.position_ + T;
        const int thread = k::cpu::ThreadPool::ThreadIndex();
        float* oa = o_attn + s.row * HD + h * dh;
        k::cpu::Attention({.q_tokens = T,
                           .kv_tokens = kv_len,
                           .heads = 1,
                           .head_dim = dh,
                           .q_token_stride = P,
                           .kv_token_stride = k::KvHeadRowElements(kv_pool_->format(), dh),
                           .out_token_stride = HD,
                           .q_ptr = proj + s.row * P + col_qa + h * dh,
                           .k_ptr = nullptr,
                           .v_ptr = nullptr,
                           .out_ptr = oa,
                           .scratch_ptr = sc.attention[thread].data(),
                           .kv_block_tokens = seq.kv_block_tokens(),
                           .k_blocks = sc.key_blocks[b].data(),
                           .v_blocks = sc.value_blocks[b].data(),
                           .kv_col = il * seq.kv_.pool()->layer_stride() +
                                     h * seq.kv_block_tokens() * k::KvHeadRowElements(kv_pool_->format(), dh),
                           .kv_format = kv_pool_->format(),
                           .widen_ptr = sc.kv_rows[thread].data()});
        for (int64_t t = 0; t < T; ++t) {
          if (batch[b].modes[t] == Mode::kAttention) std::copy(oa + t * HD, oa + t * HD + dh, o + t * HD);
        }
      }
    }
  });

  // 5. Shared gated norm, output projection and residual; shared SwiGLU MLP and residual.
  float* y = AtLeast(sc.y, N * HD);
  float* tmp = AtLeast(sc.tmp, N * D);
  float* mlp = AtLeast(sc.mlp, N * 2 * F);
  k::cpu::GatedRmsNorm({N, H, dh, eps, HD, P, HD, o_lin, proj + col_g, w.gate_norm.data(), y});
  MatMul(y, N, HD, w.o_proj, D, tmp, HD, D);
  for (int64_t i = 0; i < N * D; ++i) x[i] += tmp[i];
  k::cpu::RmsNorm({N, D, eps, D, D, x, w.mlp_norm.data(), u});
  MatMul(u, N, D, w.mlp_in, 2 * F, mlp, D, 2 * F);
  k::cpu::SwiGlu({N, F, 2 * F, 2 * F, 2 * F, mlp, mlp + F, mlp});
  MatMul(mlp, N, F, w.mlp_down, D, tmp, 2 * F, D);
  for (int64_t i = 0; i < N * D; ++i) x[i] += tmp[i];
}

void CpuBackend::GatherKvBlocks(std::span<const ForwardItem> batch) {
  // The pointers to the KV blocks of every sequence with attention tokens, and each thread's score buffer,
  // sized for the KV cache's capacity so that a reserved sequence's decode steps never grow it.
  Scratch& sc = *scratch_;
  const int64_t B = static_cast<int64_t>(batch.size());
  if (static_cast<int64_t>(sc.key_blocks.size()) < B) {
    sc.key_blocks.resize(B);
    sc.value_blocks.resize(B);
  }
  int64_t scores = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (!sc.spans[b].any_attention) continue;
    SequenceState& seq = *batch[b].seq;
    const int64_t blocks = seq.kv_.size();
    scores = std::max<int64_t>(scores, sc.spans[b].len * blocks * seq.kv_.pool()->block_tokens());
    sc.key_blocks[b].resize(blocks);
    sc.value_blocks[b].resize(blocks);
    seq.kv_.Locate(sc.key_blocks[b].data(), sc.value_blocks[b].data());
  }
  sc.attention.resize(pool_->num_threads());
  for (Floats& buffer : sc.attention) AtLeast(buffer, scores);
  sc.kv_rows.resize(pool_->num_threads());
  if (kv_pool_->format() != k::KvFormat::kF32) {
    int64_t span = 0;
    for (int64_t b = 0; b < B; ++b) span = std::max(span, sc.spans[b].len);
    const int64_t floats =
        std::max(span * config_.n_heads * config_.head_dim, kv_pool_->block_tokens() * config_.head_dim);
    for (Floats& buffer : sc.kv_rows) AtLeast(buffer, floats);
  }
}

absl::Status CpuBackend::Forward(std::span<const ForwardItem> batch) {
  ORYX_RETURN_IF_ERROR(Validate(batch));
  std::lock_guard<std::mutex> lock(forward_mu_);
  for (const ForwardItem& it : batch) {  // KV blocks for the spans, before anything changes
    if (it.seq->has_kv_) ORYX_RETURN_IF_ERROR(it.seq->PrepareKv(it.seq->position_ + static_cast<int64_t>(it.tokens.size())));
  }
  const ModelConfig& c = config_;
  const int64_t D = c.d_model, V = c.vocab_size, H = c.n_heads, dd = c.head_dim * c.head_dim;
  const int64_t B = static_cast<int64_t>(batch.size());
  Scratch& sc = *scratch_;
  std::vector<Span>& spans = sc.spans;
  spans.resize(B);
  int64_t N = 0, logit_rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    const ForwardItem& it = batch[b];
    spans[b] = {N, static_cast<int64_t>(it.tokens.size()), false, true};
    for (Mode m : it.modes) {
      spans[b].any_attention |= m == Mode::kAttention;
      spans[b].all_attention &= m == Mode::kAttention;
    }
    N += spans[b].len;
    logit_rows += LogitRowsOf(it);
    if (it.keep_states) {
      for (SequenceState::Layer& l : it.seq->layers_) AtLeast(l.span_states, H * (spans[b].len + 1) * dd);
    }
  }
  GatherKvBlocks(batch);
  float* x = AtLeast(sc.x, N * D);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < spans[b].len; ++t) {
      const int32_t id = batch[b].tokens[t];
      std::copy(&embed_[id * D], &embed_[(id + 1) * D], x + (spans[b].row + t) * D);
    }
  }
  for (int64_t il = 0; il < c.n_layers; ++il) LayerForward(il, batch, spans, N);

  // Final norm and LM head over the rows asked for, all sequences in one product.
  float* h = AtLeast(sc.head_rows, std::max<int64_t>(logit_rows, 1) * D);
  int64_t r = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t rows = LogitRowsOf(batch[b]);
    const float* first = x + (spans[b].row + spans[b].len - rows) * D;
    k::cpu::RmsNorm({rows, D, static_cast<float>(c.norm_eps), D, D, first, final_norm_.data(), h + r * D});
    r += rows;
  }
  float* logits = AtLeast(sc.logits, std::max<int64_t>(logit_rows, 1) * V);
  if (logit_rows > 0) MatMul(h, logit_rows, D, head_, V, logits, D, V);
  r = 0;
  for (int64_t b = 0; b < B; ++b) {
    const ForwardItem& it = batch[b];
    SequenceState& seq = *it.seq;
    seq.Advance(it.modes, it.keep_states);
    const int64_t rows = LogitRowsOf(it);
    if (rows > 0 && it.logits_out != nullptr) {
      it.logits_out->resize(rows * V);
      std::copy(logits + r * V, logits + (r + rows) * V, it.logits_out->data());
    }
    if (it.stats_out != nullptr) *it.stats_out = LogitStatsOf(std::span(logits + r * V, V));
    if (it.sampler != nullptr) *it.next_token = it.sampler->Next(std::span(logits + r * V, V));
    r += rows;
  }
  return absl::OkStatus();
}

}  // namespace oryx
