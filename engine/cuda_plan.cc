// The CUDA backend's forward planning: the shape of a forward (Plan), its metadata for the device, the
// views into it, and where the drawn tokens go.
#include "engine/cuda_backend_internal.h"

namespace oryx {

using namespace cuda_internal;  // NOLINT: the backend's own internals

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
    // (Growing and unsharing keep every state's contents: a batch that fails here leaves its sequences' tokens
    // as they were.)
    if (it.seq->has_kv()) ORYX_RETURN_IF_ERROR(ds.PrepareWrite(pos, pos + T));
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
    plan.NL += LogitRowsOf(it);
    plan.N += T;
  }
  plan.any_attention = plan.NA > 0;
  // Draws on the device when the batch's samplers share their parameters. Rows without a sampler (a verify span's,
  // say) are drawn too, for nothing, and come back as logits beside the draws: one such span in a step of many
  // decoding sequences leaves the others' draws on the device. (Without mixed_draws_, any item that asks for
  // its logits sends every row back and every draw to the host.)
  const Sampler* drawer = nullptr;
  bool same_draws = true;
  for (const ForwardItem& it : batch) {
    if (!mixed_draws_ && it.logits != LogitsRows::kNone)
      same_draws &= it.sampler != nullptr && it.logits_out == nullptr;
    if (it.sampler == nullptr) continue;
    if (drawer == nullptr) drawer = it.sampler;
    same_draws &= it.sampler->params().SameDistributionAs(drawer->params());
  }
  plan.device_draw = drawer != nullptr && same_draws;
  if (plan.device_draw) {
    const SamplingParams& sp = drawer->params();
    plan.temperature = sp.temperature, plan.top_p = sp.top_p, plan.top_k = sp.top_k;
    for (const ForwardItem& it : batch) plan.stats |= it.stats_out != nullptr;
  }
  // Spans too long for a graph (prefill) attend on tensor cores, in tiles of a sequence's attention rows.
  // (Many short spans, a large batch's verify spans, are not tiled: a tile would hold a few rows of its 64.)
  plan.tiled_attention =
      tiled_attention_ && max_span > kMaxGraphSpan && plan.NA > 0 && kc::TiledAttentionApplies(ctx_->dims);
  // Verify spans of 3 or more attention rows (KernelSwitches::group_mma_min_rows) attend on tensor cores too, in
  // groups of up to 16, and in chunks of up to 1024 keys (group_mma_chunk); others in groups of up to 8 on CUDA
  // cores, in chunks of up to 256 (attention_chunk).
  const bool mma = !plan.tiled_attention && kc::GroupAttentionMmaTakes(ctx_->dims, mma_groups.largest);
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
  const kc::KernelSwitches& sw = kc::GetKernelSwitches();
  plan.chunk = kc::AttentionChunkFor(std::max<int64_t>(1, max_keys), std::max<int64_t>(1, plan.NG), c.n_heads,
                                     mma ? sw.group_mma_chunk : sw.attention_chunk);
  plan.max_chunks = std::max<int64_t>(1, (max_keys + plan.chunk - 1) / plan.chunk);
  const int64_t D = c.d_model, HD = c.qk_dim(), F = c.mlp_hidden;
  plan.skip_q_linear = skip_q_linear_ && plan.NA == plan.N;
  const bool fp8 = fp8_weights();
  plan.fused = fused_gemv_ && kc::FusedGemvApplies(plan.N, D, fp8, fused_rows_) &&
               kc::FusedGemvApplies(plan.N, HD, fp8, fused_rows_) && kc::FusedGemvApplies(plan.N, F, fp8, fused_rows_);
  plan.decode_mixer = decode_mixer_ && plan.N == plan.B && !any_keeps && kc::DecodeMixerApplies(ctx_->dims);
  if (split_norms_ && !plan.fused) {
    // (Every layer's products have these shapes and their weights the same alignment; the scratch, not yet
    // grown, is cudaMalloc's. Gemm refuses a split norm off the tensor-core GEMV.)
    const Products p = LayerProducts(0, plan.N, plan.any_attention);
    plan.split_norms = kc::MmaGemvApplies(p.in) && kc::MmaGemvApplies(p.o_proj) && kc::MmaGemvApplies(p.up) &&
                       kc::MmaGemvApplies(p.down);
  }
  plan.gated_in_mixer = mixer_norm_ && !plan.fused && plan.decode_mixer && plan.NA == 0;
  if (chunked_scan_) {
    for (const ForwardItem& it : batch) {
      if (!it.keep_states) plan.scan_chunks += kc::ChunkedScanChunks(it.tokens.size(), kc::kChunkedScanMinLen);
    }
  }
  return plan;
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
                           .w_ptr = lm_head_.data, .y_ptr = nullptr, .w_scale = lm_head_.scale});
  d.tokens = meta_bytes;
  d.uniforms = d.tokens + AlignMeta(plan.NL * 4);  // (room for the key too)
  d.stats = d.uniforms + (d.sampled ? AlignMeta(plan.NL * 8) : 0);
  d.meta_bytes = d.stats + (plan.stats ? AlignMeta(plan.NL * 8) : 0);
  return d;
}

}  // namespace oryx
