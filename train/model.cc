// The Oryx model in LibTorch: parallel forward with per-token modes, and the token-by-token reference.
#include "train/model.h"

#include <cmath>
#include <numeric>
#include <vector>

#include <ATen/autocast_mode.h>

#include "engine/tensor_names.h"
#include "train/cuda_ops.h"
#include "train/linear_mixers.h"

namespace oryx::train {

namespace F = torch::nn::functional;

torch::Tensor Wide(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat64 ? x : x.to(torch::kFloat32);
}

torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto t = x.scalar_type();
  if (x.is_cuda() && HaveCudaTrainOps() && (t == torch::kFloat32 || t == torch::kFloat64) &&
      weight.scalar_type() == t) {
    // Under autocast the output feeds bf16 products: write it in bf16 rather than cast it after.
    return FusedRmsNorm(x, weight, eps, t == torch::kFloat32 && at::autocast::is_autocast_enabled(at::kCUDA));
  }
  auto xf = Wide(x);
  auto y = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps) * Wide(weight);
  return y.to(x.scalar_type());
}

torch::Tensor ApplyRope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  if (x.is_cuda() && HaveCudaTrainOps() && x.dim() == 4 && cos.scalar_type() == torch::kFloat32 &&
      cos.is_contiguous() && sin.is_contiguous()) {
    return FusedRope(x, cos, sin);
  }
  const int64_t half = x.size(-1) / 2;
  auto c = cos.unsqueeze(-2).to(x.scalar_type());  // [T, 1, dh/2] broadcasts over heads
  auto s = sin.unsqueeze(-2).to(x.scalar_type());
  auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return torch::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

torch::Tensor AttnQueryScales(int64_t attn_log_scale_base, int64_t begin, int64_t len, torch::Device device) {
  std::vector<float> scale(len);
  for (int64_t t = 0; t < len; ++t) scale[t] = static_cast<float>(AttnQueryScale(attn_log_scale_base, begin + t));
  return torch::tensor(scale).view({len, 1, 1}).to(device);
}

std::pair<torch::Tensor, torch::Tensor> RopeTables(double theta, int64_t dh, int64_t begin, int64_t len,
                                                   torch::Device device) {
  auto idx = torch::arange(dh / 2, torch::dtype(torch::kFloat64));
  auto pos = torch::arange(begin, begin + len, torch::dtype(torch::kFloat64));
  auto angle = torch::outer(pos, torch::pow(theta, -2.0 * idx / dh)).to(device, torch::kFloat32);
  return {angle.cos(), angle.sin()};
}

namespace {

torch::Tensor Param(torch::nn::Module& m, const std::string& name, torch::Tensor init) {
  return m.register_parameter(name, std::move(init));
}

torch::Tensor Normal(std::vector<int64_t> shape, double std) { return torch::randn(shape) * std; }

// softplus^-1(y) = log(exp(y) - 1), for dt_bias so that softplus(dt_bias) starts at dt.
torch::Tensor InverseSoftplus(const torch::Tensor& y) { return y + torch::log(-torch::expm1(-y)); }

ScanKind KindOf(const ModelConfig& c) {
  return c.linear_mixer == LinearMixer::kMamba2 ? ScanKind::kMamba2 : ScanKind::kGdn;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Layer

OryxLayerImpl::OryxLayerImpl(const ModelConfig& c) : config_(c) {
  const int64_t D = c.d_model, H = c.n_heads, dh = c.head_dim, HD = c.qk_dim(), Fh = c.mlp_hidden;
  const double std = 0.02, out_std = 0.02 / std::sqrt(2.0 * c.n_layers);
  attn_norm_ = Param(*this, "attn_norm", torch::ones({D}));
  k_proj_ = Param(*this, "k_proj", Normal({HD, D}, std));
  v_proj_ = Param(*this, "v_proj", Normal({HD, D}, std));
  g_proj_ = Param(*this, "g_proj", Normal({HD, D}, std));
  o_proj_ = Param(*this, "o_proj", Normal({D, HD}, out_std));
  const double conv_bound = 1.0 / std::sqrt(static_cast<double>(c.conv_width));
  conv_weight_ = Param(*this, "conv_weight", torch::rand({2 * HD, c.conv_width}) * 2 * conv_bound - conv_bound);
  conv_bias_ = Param(*this, "conv_bias", torch::zeros({2 * HD}));
  gate_norm_ = Param(*this, "gate_norm", torch::ones({dh}));
  q_attn_ = Param(*this, "q_attn", Normal({HD, D}, std));
  q_linear_ = Param(*this, "q_linear", Normal({HD, D}, std));
  // Decay rates spread over heads (A in [1, 16]) and initial step sizes dt log-uniform in [1e-3, 1e-1].
  auto dt = torch::exp(torch::rand({H}) * (std::log(0.1) - std::log(1e-3)) + std::log(1e-3));
  a_log_ = Param(*this, "A_log", torch::log(torch::rand({H}) * 15 + 1));
  dt_bias_ = Param(*this, "dt_bias", InverseSoftplus(dt));
  if (c.linear_mixer == LinearMixer::kMamba2) {
    dt_proj_ = Param(*this, "dt_proj", Normal({H, D}, std));
    d_skip_ = Param(*this, "D_skip", torch::ones({H}));
  } else {
    beta_proj_ = Param(*this, "beta_proj", Normal({H, D}, std));
    alpha_proj_ = Param(*this, "alpha_proj", Normal({H, D}, std));
  }
  mlp_norm_ = Param(*this, "mlp_norm", torch::ones({D}));
  mlp_gate_ = Param(*this, "mlp_gate", Normal({Fh, D}, std));
  mlp_up_ = Param(*this, "mlp_up", Normal({Fh, D}, std));
  mlp_down_ = Param(*this, "mlp_down", Normal({D, Fh}, out_std));
}

std::vector<std::pair<std::string, torch::Tensor>> OryxLayerImpl::NamedTensors() {
  std::vector<std::pair<std::string, torch::Tensor>> t = {
      {std::string(kAttnNorm), attn_norm_}, {std::string(kKProj), k_proj_},
      {std::string(kVProj), v_proj_},       {std::string(kGProj), g_proj_},
      {std::string(kOProj), o_proj_},       {std::string(kConvWeight), conv_weight_},
      {std::string(kConvBias), conv_bias_}, {std::string(kGateNorm), gate_norm_},
      {std::string(kQAttn), q_attn_},       {std::string(kQLinear), q_linear_}};
  if (config_.linear_mixer == LinearMixer::kMamba2) {
    t.insert(t.end(), {{std::string(kDtProj), dt_proj_}, {std::string(kDtBias), dt_bias_},
                       {std::string(kALog), a_log_}, {std::string(kDSkip), d_skip_}});
  } else {
    t.insert(t.end(), {{std::string(kBetaProj), beta_proj_}, {std::string(kAlphaProj), alpha_proj_},
                       {std::string(kDtBias), dt_bias_}, {std::string(kALog), a_log_}});
  }
  t.insert(t.end(), {{std::string(kMlpNorm), mlp_norm_}, {std::string(kMlpGate), mlp_gate_},
                     {std::string(kMlpUp), mlp_up_}, {std::string(kMlpDown), mlp_down_}});
  return t;
}

namespace {

struct Prepared {
  torch::Tensor q, k, v, log_decay, scale;
};

}  // namespace

torch::Tensor OryxLayerImpl::MixerProjection() const {
  return config_.linear_mixer == LinearMixer::kMamba2 ? dt_proj_ : torch::cat({beta_proj_, alpha_proj_}, 0);
}

namespace {

// SiLU(gate) * x: one kernel each way on the GPU where both have one dtype (under autocast, bf16).
torch::Tensor SiluMul(const torch::Tensor& gate, const torch::Tensor& x) {
  if (x.is_cuda() && HaveCudaTrainOps() && gate.scalar_type() == x.scalar_type()) return FusedSiluMul(gate, x);
  return F::silu(gate) * x;
}

}  // namespace

torch::Tensor OryxLayerImpl::Mix(const torch::Tensor& g, const torch::Tensor& o) {
  // o [..., H, dh], g [..., HD]: RMSNormPerHead(o) * gate_norm * SiLU(g), then W_O.
  auto on = RmsNorm(o, gate_norm_, config_.norm_eps).flatten(-2);
  return F::linear(SiluMul(g, on), o_proj_);
}

torch::Tensor OryxLayerImpl::Mlp(const torch::Tensor& h) {
  auto z = RmsNorm(h, mlp_norm_, config_.norm_eps);
  return F::linear(SiluMul(F::linear(z, mlp_gate_), F::linear(z, mlp_up_)), mlp_down_);
}

namespace {

// Mixer-specific scan inputs (DESIGN.md §2) from ql, k, v [..., H, dh] and the mixer's own projections
// of the normed input, mixer_in [..., H] (mamba2: dt_proj) or [..., 2H] (gdn: beta_proj, alpha_proj).
Prepared PrepareScan(const ModelConfig& c, const torch::Tensor& mixer_in, const torch::Tensor& ql,
                     const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& dt_bias,
                     const torch::Tensor& a_log) {
  const int64_t H = c.n_heads;
  auto A = Wide(a_log).exp();
  auto proj = Wide(mixer_in);
  if (c.linear_mixer == LinearMixer::kMamba2) {
    auto dt = F::softplus(proj + Wide(dt_bias));
    return {ql, k, v, -dt * A, dt};
  }
  const double dh = static_cast<double>(c.head_dim);
  torch::Tensor kn, qn;
  if (k.is_cuda() && HaveCudaTrainOps()) {
    // x rsqrt(sum x^2 + eps) is an RMSNorm with eps / dh under the root and weight 1 / sqrt(dh): one fused
    // kernel each way instead of five ops and their backwards (the norms' backwards took 4% of a step).
    auto l2norm = [&](const torch::Tensor& x, double scale) {
      auto xf = Wide(x);
      return FusedRmsNorm(xf, torch::full({c.head_dim}, scale / std::sqrt(dh), xf.options()), 1e-6 / dh,
                          /*bf16_out=*/false);
    };
    kn = l2norm(k, 1.0);
    qn = l2norm(ql, 1.0 / std::sqrt(dh));
  } else {
    kn = Wide(k);
    kn = kn * torch::rsqrt(kn.pow(2).sum(-1, true) + 1e-6);
    qn = Wide(ql);
    qn = qn * torch::rsqrt(qn.pow(2).sum(-1, true) + 1e-6) / std::sqrt(dh);
  }
  auto beta = torch::sigmoid(proj.narrow(-1, 0, H));
  auto log_alpha = -A * F::softplus(proj.narrow(-1, H, H) + Wide(dt_bias));
  return {qn, kn, v, log_alpha, beta};
}

}  // namespace

torch::Tensor OryxLayerImpl::Forward(const torch::Tensor& x, const torch::Tensor& is_attn, bool any_attn, bool any_lin,
                                     const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& q_scale,
                                     int64_t scan_chunk) {
  const int64_t B = x.size(0), T = x.size(1), H = config_.n_heads, dh = config_.head_dim, HD = config_.qk_dim();
  auto u = RmsNorm(x, attn_norm_, config_.norm_eps);
  // Every projection of u in one product (one read of u, one cast under autocast), in parts: k|v (one
  // part, the conv's input), g, then q_attn and q_linear with the mixer's projections where those modes run.
  std::vector<torch::Tensor> w_in = {k_proj_, v_proj_, g_proj_};
  std::vector<int64_t> widths = {2 * HD, HD};
  if (any_attn) {
    w_in.push_back(q_attn_);
    widths.push_back(HD);
  }
  // The mixer's projections (H or 2H rows) take a part of a multiple of 8 rows, zeros after them: with
  // every part's offset a multiple of 16 bytes, the split's backward concatenates with 16-byte accesses
  // (measured: with the mamba2 part at an odd offset, LibTorch took its one-element cat, 189 us a layer for
  // the 205M config at batch 8 against about 66 us).
  const torch::Tensor mixer_w = any_lin ? MixerProjection() : torch::Tensor();
  const int64_t mixer_rows = any_lin ? mixer_w.size(0) : 0, mixer_part = (mixer_rows + 7) / 8 * 8;
  if (any_lin) {
    w_in.push_back(q_linear_);
    w_in.push_back(mixer_w);
    if (mixer_part > mixer_rows) w_in.push_back(torch::zeros({mixer_part - mixer_rows, u.size(-1)}, k_proj_.options()));
    widths.push_back(HD);
    widths.push_back(mixer_part);
  }
  // Rows padded with zeros to a multiple of 64: cuBLAS runs an odd width (5 HD + H) several times slower
  // (measured: 0.43 ms instead of about 0.15 for the 205M config's [16384, 768] x [768, 3852] in bf16).
  const int64_t rows = std::accumulate(widths.begin(), widths.end(), int64_t{0}), padded = (rows + 63) / 64 * 64;
  if (padded > rows) {
    w_in.push_back(torch::zeros({padded - rows, u.size(-1)}, k_proj_.options()));
    widths.push_back(padded - rows);
  }
  // split, not narrow: the backward of one split is one concatenation, while each narrow's backward
  // writes a zero tensor of the whole width (measured: a tenth of a step's kernel time).
  auto parts = F::linear(u, torch::cat(w_in, 0)).split_with_sizes(widths, -1);
  size_t next = 0;
  auto take = [&](int64_t n) {
    TORCH_CHECK(parts[next].size(-1) == n, "projection split out of step");
    return parts[next++];
  };
  // Shared k, v through the causal depthwise conv (left-padded with w-1 zeros).
  torch::Tensor kv;  // [B,T,2HD]
  if (x.is_cuda() && HaveCudaTrainOps()) {
    kv = CausalDepthwiseConv(take(2 * HD), conv_weight_, conv_bias_);
  } else {
    auto kv_raw = take(2 * HD).transpose(1, 2);  // [B,2HD,T]
    kv = torch::conv1d(F::pad(kv_raw, F::PadFuncOptions({config_.conv_width - 1, 0})),
                       conv_weight_.unsqueeze(1).to(kv_raw.scalar_type()), conv_bias_.to(kv_raw.scalar_type()),
                       /*stride=*/at::IntArrayRef{1}, /*padding=*/at::IntArrayRef{0},
                       /*dilation=*/at::IntArrayRef{1}, /*groups=*/2 * HD)
             .transpose(1, 2);
  }
  if (config_.conv_activation == ConvActivation::kSilu) kv = F::silu(kv);
  // split, not two narrows (as above): one concatenation in the backward instead of two zero tensors of
  // the conv output's size.
  const auto kv_parts = kv.split(HD, -1);
  auto k = kv_parts[0].reshape({B, T, H, dh});
  auto v = kv_parts[1].reshape({B, T, H, dh});
  auto g = take(HD);

  torch::Tensor o_attn, o_lin;
  if (any_attn) {
    auto q = take(HD).reshape({B, T, H, dh});
    auto kr = k;
    if (cos.defined()) {
      q = ApplyRope(q, cos, sin);
      kr = ApplyRope(k, cos, sin);
    }
    if (q_scale.defined()) q = (q * q_scale).to(q.scalar_type());  // the factor in fp32, as the engines apply it
    auto va = v;
    if (x.is_cuda() && x.scalar_type() != torch::kFloat64) {
      // bf16 on the GPU so that SDPA takes the flash kernel, not the math fallback that materialises
      // the [T, T] scores (measured: the largest cost of a training step before this cast).
      // contiguous(): v is a view of the conv output whose last dim is strided, and the fused kernels
      // need unit stride there (measured: without it every call fell back to the math kernel).
      q = q.to(torch::kBFloat16).contiguous();
      kr = kr.to(torch::kBFloat16).contiguous();
      va = va.to(torch::kBFloat16).contiguous();
    }
    o_attn = at::scaled_dot_product_attention(q.transpose(1, 2), kr.transpose(1, 2), va.transpose(1, 2), {},
                                              0.0, /*is_causal=*/true, 1.0 / std::sqrt(static_cast<double>(dh)))
                 .transpose(1, 2);  // [B,T,H,dh]
  }
  if (any_lin) {
    auto ql = take(HD).reshape({B, T, H, dh});
    auto mixer_in = take(mixer_part);
    // (Only where padded: even a whole-width narrow's backward writes a zero tensor and copies.)
    if (mixer_part > mixer_rows) mixer_in = mixer_in.narrow(-1, 0, mixer_rows);
    Prepared p = PrepareScan(config_, mixer_in, ql, k, v, dt_bias_, a_log_);
    // From the zero state (undefined: ScanChunked skips its terms).
    o_lin = ScanChunked(KindOf(config_), {p.q, p.k, p.v, p.log_decay, p.scale}, torch::Tensor(), scan_chunk).out;
  }
  const bool mamba2 = config_.linear_mixer == LinearMixer::kMamba2;
  torch::Tensor o;
  if (any_lin && x.is_cuda() && HaveCudaTrainOps()) {
    // One kernel each way for the skip term, the select by mode and the casts.
    o = CombineMixers(any_attn ? o_attn : torch::Tensor(), o_lin, v, mamba2 ? d_skip_ : torch::Tensor(),
                      any_attn ? is_attn : torch::Tensor());
  } else {
    if (any_lin && mamba2) o_lin = o_lin + d_skip_.view({1, 1, H, 1}) * Wide(v);
    if (any_attn && any_lin) {
      o = torch::where(is_attn.view({B, T, 1, 1}), Wide(o_attn), o_lin);
    } else {
      o = any_attn ? o_attn : o_lin;
    }
  }
  auto h = x + Mix(g, o.to(x.scalar_type()));
  return h + Mlp(h);
}

OryxLayerImpl::State OryxLayerImpl::InitialState(int64_t batch, torch::Device device) const {
  const int64_t H = config_.n_heads, dh = config_.head_dim;
  auto opts = Wide(attn_norm_).options().device(device);
  return {torch::zeros({batch, 0, H, dh}, opts), torch::zeros({batch, 0, H, dh}, opts),
          torch::zeros({batch, H, dh, dh}, opts),
          torch::zeros({batch, config_.conv_width - 1, 2 * config_.qk_dim()}, opts)};
}

torch::Tensor OryxLayerImpl::Step(const torch::Tensor& x, const torch::Tensor& is_attn, int64_t pos, State& st) {
  const int64_t B = x.size(0), H = config_.n_heads, dh = config_.head_dim, HD = config_.qk_dim();
  auto u = RmsNorm(x, attn_norm_, config_.norm_eps);  // [B,D]
  // Conv window: the w-1 previous inputs plus this one; weight[c, w-1] multiplies the current token.
  auto window = torch::cat({st.conv, torch::cat({F::linear(u, k_proj_), F::linear(u, v_proj_)}, -1).unsqueeze(1)},
                           1);  // [B,w,2HD]
  st.conv = window.narrow(1, 1, config_.conv_width - 1);
  auto kv = (window * conv_weight_.t().unsqueeze(0)).sum(1) + conv_bias_;  // [B,2HD]
  if (config_.conv_activation == ConvActivation::kSilu) kv = F::silu(kv);
  auto k = kv.narrow(-1, 0, HD).reshape({B, H, dh});
  auto v = kv.narrow(-1, HD, HD).reshape({B, H, dh});
  auto g = F::linear(u, g_proj_);

  // Every token updates both states: the KV cache (rotated keys) and the recurrent state.
  auto q = F::linear(u, q_attn_).reshape({B, H, dh});
  auto kr = k;
  if (config_.rope_theta > 0) {
    auto [cos, sin] = RopeTables(config_.rope_theta, dh, pos, 1, x.device());
    q = ApplyRope(q.unsqueeze(1), cos, sin).squeeze(1);
    kr = ApplyRope(k.unsqueeze(1), cos, sin).squeeze(1);
  }
  if (config_.attn_log_scale_base > 0) q = q * static_cast<float>(AttnQueryScale(config_.attn_log_scale_base, pos));
  st.k_cache = torch::cat({st.k_cache, kr.unsqueeze(1)}, 1);
  st.v_cache = torch::cat({st.v_cache, v.unsqueeze(1)}, 1);
  auto ql = F::linear(u, q_linear_).reshape({B, H, dh});
  Prepared p = PrepareScan(config_, F::linear(Wide(u), Wide(MixerProjection())), ql, k, v, dt_bias_, a_log_);
  ScanResult r = ScanStep(KindOf(config_), st.s, p.q, p.k, p.v, p.log_decay, p.scale);
  st.s = r.state;
  auto o_lin = r.out;
  if (config_.linear_mixer == LinearMixer::kMamba2) o_lin = o_lin + d_skip_.view({1, H, 1}) * v;

  auto scores = torch::einsum("bhd,bthd->bht", {q, st.k_cache}) / std::sqrt(static_cast<double>(dh));
  auto o_attn = torch::einsum("bht,bthd->bhd", {torch::softmax(scores, -1), st.v_cache});
  auto o = torch::where(is_attn.view({B, 1, 1}), o_attn, o_lin);
  auto h = x + Mix(g, o);
  return h + Mlp(h);
}

// ---------------------------------------------------------------------------------------------------
// Model

OryxModelImpl::OryxModelImpl(const ModelConfig& c, uint64_t seed) : config_(c) {
  torch::manual_seed(seed);
  embed_ = register_parameter("embed", Normal({c.vocab_size, c.d_model}, 0.02));
  for (int64_t il = 0; il < c.n_layers; ++il) {
    layers_.push_back(register_module("layer" + std::to_string(il), OryxLayer(c)));
  }
  final_norm_ = register_parameter("final_norm", torch::ones({c.d_model}));
  if (!c.tie_embeddings) lm_head_ = register_parameter("lm_head", Normal({c.vocab_size, c.d_model}, 0.02));
}

torch::Tensor OryxModelImpl::Logits(const torch::Tensor& x) {
  auto h = RmsNorm(x, final_norm_, config_.norm_eps);
  return F::linear(h, config_.tie_embeddings ? embed_ : lm_head_);
}

torch::Tensor OryxModelImpl::Forward(const torch::Tensor& tokens, const torch::Tensor& is_attn) {
  const int64_t n_attn = is_attn.sum().item<int64_t>();  // the one host sync of a forward
  return Forward(tokens, is_attn, {.any_attn = n_attn > 0, .any_lin = n_attn < is_attn.numel()});
}

torch::Tensor OryxModelImpl::Forward(const torch::Tensor& tokens, const torch::Tensor& is_attn, Modes modes) {
  auto x = F::embedding(tokens, embed_);
  torch::Tensor cos, sin;  // undefined without RoPE
  if (config_.rope_theta > 0) {
    // Kept between calls: the tables are built on the host, and a CUDA graph may not copy from there.
    const int64_t T = tokens.size(1);
    if (!rope_cos_.defined() || rope_cos_.size(0) < T || rope_cos_.device() != tokens.device()) {
      std::tie(rope_cos_, rope_sin_) = RopeTables(config_.rope_theta, config_.head_dim, 0, T, tokens.device());
    }
    cos = rope_cos_.narrow(0, 0, T);
    sin = rope_sin_.narrow(0, 0, T);
  }
  torch::Tensor q_scale;  // undefined when attn_log_scale_base = 0
  if (config_.attn_log_scale_base > 0) {
    const int64_t T = tokens.size(1);
    if (!q_scale_.defined() || q_scale_.size(0) < T || q_scale_.device() != tokens.device()) {
      q_scale_ = AttnQueryScales(config_.attn_log_scale_base, 0, T, tokens.device());
    }
    q_scale = q_scale_.narrow(0, 0, T);
  }
  for (auto& layer : layers_) {
    x = layer->Forward(x, is_attn, modes.any_attn, modes.any_lin, cos, sin, q_scale, scan_chunk);
  }
  return Logits(x);
}

OryxModelImpl::State OryxModelImpl::InitialState(int64_t batch) const {
  State s;
  for (const auto& layer : layers_) s.layers.push_back(layer->InitialState(batch, embed_.device()));
  return s;
}

torch::Tensor OryxModelImpl::StepReference(const torch::Tensor& tokens, const torch::Tensor& is_attn, State& state) {
  auto x = F::embedding(tokens, embed_);  // [B,D]
  for (size_t il = 0; il < layers_.size(); ++il) x = layers_[il]->Step(x, is_attn, state.pos, state.layers[il]);
  ++state.pos;
  return Logits(x);
}

torch::Tensor OryxModelImpl::ForwardReference(const torch::Tensor& tokens, const torch::Tensor& is_attn) {
  State state = InitialState(tokens.size(0));
  std::vector<torch::Tensor> logits;
  for (int64_t t = 0; t < tokens.size(1); ++t) {
    logits.push_back(StepReference(tokens.select(1, t), is_attn.select(1, t), state));
  }
  return torch::stack(logits, 1);
}

std::vector<std::pair<std::string, torch::Tensor>> OryxModelImpl::NamedTensors() {
  std::vector<std::pair<std::string, torch::Tensor>> t = {{std::string(kEmbedWeight), embed_}};
  for (size_t il = 0; il < layers_.size(); ++il) {
    for (auto& [suffix, tensor] : layers_[il]->NamedTensors()) {
      t.emplace_back(LayerTensorName(static_cast<int64_t>(il), suffix), tensor);
    }
  }
  t.emplace_back(std::string(kFinalNormWeight), final_norm_);
  if (!config_.tie_embeddings) t.emplace_back(std::string(kLmHeadWeight), lm_head_);
  return t;
}

namespace {
bool IsLinearOnly(const std::string& name) {
  for (std::string_view s : {kQLinear, kDtProj, kDtBias, kALog, kDSkip, kBetaProj, kAlphaProj}) {
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}
}  // namespace

std::vector<torch::Tensor> OryxModelImpl::LinearOnlyParameters() {
  std::vector<torch::Tensor> out;
  for (auto& [name, t] : NamedTensors()) {
    if (IsLinearOnly(name)) out.push_back(t);
  }
  return out;
}

std::vector<torch::Tensor> OryxModelImpl::AttentionOnlyParameters() {
  std::vector<torch::Tensor> out;
  for (auto& [name, t] : NamedTensors()) {
    const std::string_view s = kQAttn;
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) out.push_back(t);
  }
  return out;
}

}  // namespace oryx::train
