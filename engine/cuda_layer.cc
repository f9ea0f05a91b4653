// The CUDA backend's model forward: one layer's kernels, the whole model over a plan, the draws of the
// next tokens on the device, and the host's share after the forward.
#include "engine/cuda_backend_internal.h"

namespace oryx {

using namespace cuda_internal;  // NOLINT: the backend's own internals

CudaBackend::Products CudaBackend::LayerProducts(int64_t il, int64_t rows, bool any_attention) const {
  const ModelConfig& c = config_;
  const Layer& w = layers_[il];
  const Scratch& sc = *scratch_;
  const int64_t D = c.d_model, HD = c.qk_dim(), F = c.mlp_hidden, P = in_proj_.width;
  // y [rows, y_stride] = x [rows, k] W^T, W [n, k].
  auto product = [&](int64_t n, int64_t k, int64_t y_stride, const bf16* x, const Weight& weight, float* y) {
    return kc::GemmParams{.m = rows, .n = n, .k = k, .x_row_stride = k, .y_row_stride = y_stride, .x_ptr = x,
                          .w_ptr = weight.data, .y_ptr = y, .w_scale = weight.scale,
                          .w_bf16_scratch = static_cast<bf16*>(fp8_scratch_)};
  };
  return {.in = product(any_attention ? P : P - HD, D, P, sc.u, w.in_proj, sc.proj),  // q_attn only if some row attends
          .o_proj = product(D, HD, D, sc.y, w.o_proj, sc.tmp),
          .up = product(2 * F, D, 2 * F, sc.u, w.mlp_in, sc.mlp),
          .down = product(D, F, D, sc.act, w.mlp_down, sc.tmp)};
}

void CudaBackend::LayerForward(int64_t il, const Plan& plan) {
  const ModelConfig& c = config_;
  const Layer& w = layers_[il];
  Scratch& sc = *scratch_;
  Context& ctx = *ctx_;
  cudaStream_t s = ctx.stream;
  const int64_t D = c.d_model, HD = c.qk_dim(), F = c.mlp_hidden, P = in_proj_.width;
  const kc::ModelDims& dims = ctx.dims;
  const int32_t layer = static_cast<int32_t>(il);
  const int64_t N = plan.N, B = plan.B, NA = plan.NA;
  const kc::GemmParams::NormIn norm_in{.sum_sq_ptr = sc.tmp, .eps = dims.norm_eps};  // (Plan::split_norms)
  const Products products = LayerProducts(il, N, plan.any_attention);
  auto mark = [&](const char* name) {
    if (profiler_) profiler_->Mark(name, s);
  };
  // Where a kernel asking L2 for a later product's weights measured faster: bf16 steps where no row attends
  // (with FP8 weights, and where the KV reads use the bandwidth, it measured slower).
  const bool prefetch_weights = NA == 0 && !fp8_weights();
  // At most `budget` bytes from the start of a bf16 weight matrix of `rows` rows of D: what a kernel asks L2 for.
  auto first_bytes = [&](int64_t budget, int64_t rows) {
    return std::min<int64_t>(budget, rows * D * int64_t{sizeof(bf16)});
  };

  // The fused input projections (after the attention norm), then conv + RoPE + KV append, the window
  // update, the recurrence and attention.
  if (plan.fused) {
    kc::FusedGemvParams in{.m = N, .n = products.in.n, .k = D, .input = kc::GemvInput::kRmsNorm, .eps = dims.norm_eps,
        .head_dim = 0, .in_row_stride = D, .gate_row_stride = 0, .y_row_stride = P, .in_ptr = sc.x, .gate_ptr = nullptr,
        .weight_ptr = w.attn_norm, .w_ptr = w.in_proj.data, .y_ptr = sc.proj, .accumulate = false,
        .w_scale = w.in_proj.scale};
    if (plan.skip_q_linear) in.n -= HD, in.skip_begin = in_proj_.q_linear, in.skip_rows = HD;
    in.rows_per_warp = gemv_rows_per_warp_;
    kc::FusedGemv(in, s);
    mark("in_proj (norm fused)");
  } else {
    // u = RMSNorm(x) was written by the previous step; split (Plan::split_norms): bf16(x * attn_norm) and its
    // rows' sums of squares, by the previous layer's down projection.
    kc::GemmParams in = products.in;
    if (plan.split_norms && il > 0) in.norm_in = norm_in;
    kc::Gemm(in, ctx.cublas);
    mark("in_proj");
  }
  if (plan.decode_mixer) {
    kc::DecodeMixerParams mixer{.dims = dims, .layer = layer, .seqs = B, .seqs_ptr = sc.seqs,
        .row_mode_ptr = sc.row_mode, .proj_ptr = sc.proj, .conv_weight_ptr = w.conv_weight,
        .conv_bias_ptr = w.conv_bias, .dt_bias_ptr = w.dt_bias, .a_log_ptr = w.a_log, .maybe_d_skip_ptr = w.d_skip,
        .qa_ptr = sc.qa, .out_ptr = sc.o, .maybe_rope_freq_ptr = rope_freq_};
    if (plan.gated_in_mixer) {
      mixer.maybe_gated_ptr = sc.y, mixer.gate_column = in_proj_.g, mixer.gate_norm_ptr = w.gate_norm;
    }
    if (prefetch_weights && mixer_prefetch_bytes_ > 0) {
      // The up projection's first weights into L2 while the mixer runs, which leaves most of the bandwidth idle.
      mixer.maybe_prefetch_ptr = w.mlp_in.data;
      mixer.prefetch_bytes = first_bytes(mixer_prefetch_bytes_, 2 * F);
    }
    kc::DecodeMixer(mixer, s);
    mark(plan.gated_in_mixer ? "conv+recurrent+gated_norm" : "conv+recurrent");
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
        .gate_ptr = sc.proj + in_proj_.g, .weight_ptr = w.gate_norm, .w_ptr = w.o_proj.data, .y_ptr = sc.x,
        .accumulate = true, .w_scale = w.o_proj.scale};
    o_proj.rows_per_warp = gemv_rows_per_warp_;
    o_proj.y_written_earlier = true;  // x: last written by the previous layer's down projection (or Embed)
    o_proj.gate_written_earlier = true;  // the gate: by the input projection, the mixer at least between
    kc::FusedGemv(o_proj, s);
    mark("o_proj (gated norm fused)");
    // SwiGLU in the up projection's epilogue (each warp takes a gate row and its up row); the down
    // product adds into the residual.
    kc::FusedGemvParams mlp_in{.m = N, .n = 2 * F, .k = D, .input = kc::GemvInput::kRmsNorm, .eps = dims.norm_eps,
        .head_dim = 0, .in_row_stride = D, .gate_row_stride = 0, .y_row_stride = F, .in_ptr = sc.x, .gate_ptr = nullptr,
        .weight_ptr = w.mlp_norm, .w_ptr = w.mlp_in.data, .y_ptr = nullptr, .accumulate = false,
        .w_scale = w.mlp_in.scale};
    mlp_in.maybe_swiglu_ptr = sc.act;
    mlp_in.rows_per_warp = gemv_rows_per_warp_;
    kc::FusedGemv(mlp_in, s);
    mark("mlp_in+swiglu (norm fused)");
    kc::GemmParams down = products.down;
    down.y_ptr = sc.x, down.accumulate = true;
    down.y_written_earlier = true;  // x: last written by o_proj, two kernels back
    kc::Gemm(down, ctx.cublas);
    mark("mlp_down (residual fused)");
    return;
  }
  if (!plan.gated_in_mixer) {
    kc::GatedNorm({.rows = N, .heads = c.n_heads, .head_dim = c.head_dim, .eps = dims.norm_eps, .gate_row_stride = P,
                   .o_ptr = sc.o, .gate_ptr = sc.proj + in_proj_.g, .weight_ptr = w.gate_norm, .y_ptr = sc.y}, s);
    mark("gated_norm");
  }
  // The residual adds: into tmp, added by AddRmsNorm, which writes the next product's input u; split, the
  // products add into x themselves and write u = bf16(x * norm weight) and the sums of squares of x (in tmp).
  const bool split = plan.split_norms;
  auto residual_add = [&](kc::GemmParams& p, const float* next_norm) {
    if (!split) return;
    p.y_ptr = sc.x, p.accumulate = true;
    if (next_norm != nullptr) p.norm_out = {.scaled_ptr = sc.u, .weight_ptr = next_norm, .sum_sq_ptr = sc.tmp};
  };
  kc::GemmParams o_proj = products.o_proj;
  residual_add(o_proj, w.mlp_norm);
  kc::Gemm(o_proj, ctx.cublas);
  mark(split ? "o_proj (residual, norm split)" : "o_proj");
  if (!split) {
    kc::AddRmsNorm({.rows = N, .d = D, .eps = dims.norm_eps, .x_ptr = sc.x, .maybe_delta_ptr = sc.tmp,
                    .weight_ptr = w.mlp_norm, .maybe_rows_ptr = nullptr, .y_ptr = sc.u}, s);
    mark("add_rmsnorm");
  }
  kc::GemmParams up = products.up;
  if (split) up.norm_in = norm_in;
  const bool swiglu_fused = fused_gemv_ && kc::MmaGemvApplies(up);  // (the SwiGLU in the product's epilogue)
  if (swiglu_fused) up.maybe_swiglu_ptr = sc.act;
  kc::Gemm(up, ctx.cublas);
  mark(swiglu_fused ? "mlp_in+swiglu" : "mlp_in");
  if (!swiglu_fused) {
    kc::SwiGlu({.rows = N, .d = F, .in_ptr = sc.mlp, .y_ptr = sc.act}, s);
    mark("swiglu");
  }
  kc::GemmParams down = products.down;
  residual_add(down, il + 1 < c.n_layers ? layers_[il + 1].attn_norm : nullptr);  // (the last: the final norm's)
  if (prefetch_weights && down_prefetch_bytes_ > 0 && N <= 8) {
    // The next product's first weights into L2 while this one's blocks wait and drain: the next layer's input
    // projection, or after the last layer the LM head. The tensor-core GEMV asks (batches of 2-8 here; the
    // single-row products ignore it). Not at 16 and 32 rows: 1.4b at 4K and models/default at 15K were
    // 1.01-1.05x slower there (1.4b at 32K: 0.98x at batch 8, neutral at 2 and 4).
    const bool last = il + 1 == c.n_layers;
    down.maybe_prefetch_ptr = last ? lm_head_.data : layers_[il + 1].in_proj.data;
    down.prefetch_bytes = first_bytes(down_prefetch_bytes_, last ? c.vocab_size : P);
  }
  kc::Gemm(down, ctx.cublas);
  mark(split ? "mlp_down (residual, norm split)" : "mlp_down");
  if (!split && il + 1 < c.n_layers) {
    kc::AddRmsNorm({.rows = N, .d = D, .eps = dims.norm_eps, .x_ptr = sc.x, .maybe_delta_ptr = sc.tmp,
                    .weight_ptr = layers_[il + 1].attn_norm, .maybe_rows_ptr = nullptr, .y_ptr = sc.u}, s);
    mark("add_rmsnorm");
  }
}

void CudaBackend::RunModel(const Plan& plan) {
  const ModelConfig& c = config_;
  Scratch& sc = *scratch_;
  Context& ctx = *ctx_;
  const int64_t D = c.d_model, V = c.vocab_size;
  const float eps = ctx.dims.norm_eps;
  bf16* const fp8_scratch = static_cast<bf16*>(fp8_scratch_);
  if (profiler_) profiler_->Mark("start", ctx.stream);
  kc::Embed({.rows = plan.N, .d = D, .tokens_ptr = sc.tokens, .table_ptr = static_cast<const bf16*>(embed_),
             .x_ptr = sc.x, .tokens_stride = sc.tokens_stride}, ctx.stream);
  if (!plan.fused) kc::AddRmsNorm({.rows = plan.N, .d = D, .eps = eps, .x_ptr = sc.x, .maybe_delta_ptr = nullptr,
                                   .weight_ptr = layers_[0].attn_norm, .maybe_rows_ptr = nullptr,
                                   .y_ptr = sc.u}, ctx.stream);
  if (profiler_) profiler_->Mark("embed", ctx.stream);
  for (int64_t il = 0; il < c.n_layers; ++il) LayerForward(il, plan);
  if (plan.NL > 0) {
    // The unfused path, norms not split, still owes the last MLP's residual (in tmp).
    kc::AddRmsNorm({.rows = plan.NL, .d = D, .eps = eps, .x_ptr = sc.x,
                    .maybe_delta_ptr = plan.fused || plan.split_norms ? nullptr : sc.tmp, .weight_ptr = final_norm_,
                    .maybe_rows_ptr = sc.logit_rows, .y_ptr = sc.head}, ctx.stream);
    kc::GemmParams head{.m = plan.NL, .n = V, .k = D, .x_row_stride = D, .y_row_stride = V, .x_ptr = sc.head,
        .w_ptr = lm_head_.data, .y_ptr = sc.logits, .w_scale = lm_head_.scale, .w_bf16_scratch = fp8_scratch};
    head.maybe_argmax_key = sc.argmax_key;
    kc::Gemm(head, ctx.cublas);
    if (profiler_) profiler_->Mark("final_norm+lm_head", ctx.stream);
  }
}

void CudaBackend::FinishForward(std::span<const ForwardItem> batch, const float* logits_host, const int32_t* draws_host,
                                const float* stats_host) {
  const int64_t V = config_.vocab_size;
  int64_t lr = 0;
  for (const ForwardItem& it : batch) {
    SequenceState& seq = *it.seq;
    seq.Advance(it.modes, it.keep_states);
    const int64_t rows = LogitRowsOf(it);
    if (rows > 0 && logits_host != nullptr && it.logits_out != nullptr) {
      it.logits_out->resize(rows * V);
      std::memcpy(it.logits_out->data(), logits_host + lr * V, rows * V * sizeof(float));
    }
    if (it.stats_out != nullptr) {
      *it.stats_out = stats_host != nullptr ? LogitStats{stats_host[2 * lr], stats_host[2 * lr + 1]}
                                            : LogitStatsOf(std::span(logits_host + lr * V, V));
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

void CudaBackend::Draw(const Plan& plan, const DrawLayout& d) {
  if (!d.on) return;
  Scratch& sc = *scratch_;
  if (plan.stats) {
    kc::DistributionStats({.rows = plan.NL,
                           .vocab = config_.vocab_size,
                           .logits_ptr = sc.logits,
                           .stats_ptr = reinterpret_cast<float*>(sc.meta + d.stats)},
                          ctx_->stream);
  }
  if (d.key) return;  // (drawn by the LM head, in RunModel)
  auto* tokens = reinterpret_cast<int32_t*>(sc.meta + d.tokens);
  if (!d.sampled) return kc::Argmax({.rows = plan.NL, .vocab = config_.vocab_size, .logits_ptr = sc.logits,
                                     .tokens_ptr = tokens}, ctx_->stream);
  const kc::SamplingDims dims{config_.vocab_size, plan.temperature, plan.top_k, plan.top_p};
  kc::SampleRows({.rows = plan.NL, .dims = dims, .logits_ptr = sc.logits,
                  .uniforms_ptr = reinterpret_cast<const double*>(sc.meta + d.uniforms), .tokens_ptr = tokens,
                  .workspace_ptr = sc.sample_workspace}, ctx_->stream);
}

}  // namespace oryx
