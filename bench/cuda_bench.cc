// The CUDA decode benchmark (see cuda_bench.h).
#include "bench/cuda_bench.h"

#include <cmath>
#include <algorithm>
#include <chrono>
#include <iostream>

#include "bench/bench_util.h"
#include "engine/cuda_backend.h"
#include "engine/status_macros.h"
#include "engine/str_cat.h"
#include "engine/tensor_names.h"

namespace oryx::bench {

namespace {
using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }
constexpr int64_t kPasses = 4;  // timed passes per sequence: 2 modes x CUDA graphs on / off
std::string_view ModeName(Mode m) { return m == Mode::kAttention ? "attention" : "linear"; }

// Fills `seq` with `tokens` tokens of `mode` in chunks; returns the seconds it took.
absl::StatusOr<double> Fill(CudaBackend& backend, SequenceState& seq, int64_t tokens, Mode mode, int64_t chunk) {
  const ModelConfig& c = backend.config();
  std::vector<int32_t> ids(chunk);
  std::vector<Mode> modes(chunk, mode);
  std::vector<float> logits;
  const auto t0 = Clock::now();
  for (int64_t done = 0; done < tokens; done += chunk) {
    const int64_t n = std::min(chunk, tokens - done);
    for (int64_t t = 0; t < n; ++t) ids[t] = static_cast<int32_t>(4 + ((done + t) * 7919) % (c.vocab_size - 4));
    ORYX_RETURN_IF_ERROR(backend.Forward(seq, std::span(ids).first(n), std::span(modes).first(n), false, &logits));
  }
  backend.Synchronize();
  return Seconds(t0);
}
}  // namespace

double StepBytes(const ModelConfig& c, Mode mode, int64_t context, int64_t batch) {
  const double L = c.n_layers, D = c.d_model, H = c.n_heads, dh = c.head_dim, HD = c.qk_dim(), F = c.mlp_hidden,
               V = c.vocab_size, W = c.conv_width - 1, G = c.linear_mixer == LinearMixer::kGdn ? 2 * H : H;
  // bf16 matrices: per layer the input projections but the unused query (k, v, g, gates and one of q_attn /
  // q_linear), o_proj and the MLP; the LM head; only the batch's rows of the embedding.
  const double matrices = L * ((4 * HD + G) * D + D * HD + 3 * F * D) + V * D + batch * D;
  // fp32 vectors: norms, conv weights and bias, gate norm, dt_bias, A_log, D_skip; the final norm.
  const double vectors = L * (2 * D + 2 * HD * c.conv_width + 2 * HD + dh + 3 * H) + D;
  const double kv_read = mode == Mode::kAttention ? 2.0 * 2 * L * HD * (context + 1) : 0.0;
  const double per_sequence = kv_read + 2.0 * 2 * L * HD                // KV cache read, new entries written
                              + 2.0 * 4 * L * H * dh * dh               // recurrent state read and written
                              + 2.0 * 4 * L * W * 2 * HD                // conv window read and written
                              + 4.0 * V;                                // logits written (fp32)
  return 2.0 * matrices + 4.0 * vectors + batch * per_sequence;
}

absl::StatusOr<ModelConfig> PresetConfig(const std::string& name, LinearMixer mixer, int64_t max_position) {
  ModelConfig c;
  if (name == "130m") {
    c.d_model = 768, c.n_layers = 24, c.n_heads = 12, c.head_dim = 64;
  } else if (name == "1.4b") {
    c.d_model = 2048, c.n_layers = 24, c.n_heads = 16, c.head_dim = 128;
  } else {
    return absl::InvalidArgumentError(Cat("unknown config '", name, "' (130m, 1.4b)"));
  }
  c.vocab_size = 32000;
  c.mlp_hidden = static_cast<int64_t>(std::round(8.0 * c.d_model / 3 / 64)) * 64;
  c.linear_mixer = mixer;
  c.conv_activation = mixer == LinearMixer::kGdn ? ConvActivation::kSilu : ConvActivation::kIdentity;
  c.rope_theta = 10000;
  c.norm_eps = 1e-6;
  c.tie_embeddings = false;
  c.max_position = max_position;
  c.bos_id = 2;
  c.eos_id = 3;
  return c;
}

absl::Status RunCudaDecodeBench(const DecodeBenchOptions& o, const Emit& emit) {
  int64_t max_context = 0;
  for (int64_t c : o.contexts) max_context = std::max(max_context, c);
  std::vector<int64_t> batches = o.batches;
  std::sort(batches.begin(), batches.end());
  std::unique_ptr<CudaBackend> backend;
  std::string model = o.model_dir;
  if (o.model_dir.empty()) {
    const std::string preset = o.preset.empty() ? "130m" : o.preset;
    ORYX_ASSIGN_OR_RETURN(ModelConfig config, PresetConfig(preset, o.mixer, max_context + kPasses * (o.steps + 2) + 16));
    ORYX_ASSIGN_OR_RETURN(backend, CudaBackend::CreateRandom(config, 1));
    model = Cat("random-", preset, "-", o.mixer == LinearMixer::kGdn ? "gdn" : "mamba2");
  } else {
    ORYX_ASSIGN_OR_RETURN(backend, CudaBackend::Load(o.model_dir));
  }
  const ModelConfig& c = backend->config();
  if (max_context + kPasses * (o.steps + 2) + 8 > c.max_position) {
    return absl::InvalidArgumentError(Cat("context ", max_context, " + ", o.steps, " steps exceed the model's max_position ",
                                          c.max_position));
  }
  const double bandwidth = backend->MeasureCopyBandwidth();
  const double weights = static_cast<double>(backend->weight_bytes());
  std::cerr << "bench decode (cuda " << backend->DeviceName() << "): " << model << ", " << weights / 1e9
            << " GB of bf16 weights, copy bandwidth " << bandwidth / 1e9 << " GB/s\n";
  nlohmann::json base = {{"bench", "decode"}, {"backend", "cuda"}, {"device", backend->DeviceName()}, {"model", model},
                         {"weight_bytes", weights}, {"copy_bandwidth_gb_s", bandwidth / 1e9}};
  base.update(Provenance());

  // Prefill throughput by mode, from an empty sequence, in chunks of 2048 tokens (attention mode only up to
  // o.prefill_max_attention: its prefill attention is the simple split-KV kernel, not a tiled one).
  for (Mode mode : {Mode::kLinear, Mode::kAttention}) {
    for (int64_t context : o.contexts) {
      if (mode == Mode::kAttention && context > o.prefill_max_attention) continue;
      SequenceState seq = backend->NewSequence();
      seq.Reserve(context);
      ORYX_ASSIGN_OR_RETURN(double s, Fill(*backend, seq, context, mode, 2048));
      nlohmann::json r = base;
      r.update({{"bench", "prefill"}, {"mode", ModeName(mode)}, {"context", context}, {"chunk", 2048},
                {"prefill_s", s}, {"prefill_tokens_per_s", context / s}});
      emit(r);
    }
  }

  for (int64_t context : o.contexts) {
    // One sequence of `context` tokens (linear-mode prefill writes the same KV cache and state sizes),
    // cloned into every batch slot with room for the timed steps of its passes (attention then linear,
    // each with and without CUDA graphs, one after the other: the context grows by a few tokens).
    SequenceState first = backend->NewSequence();
    first.Reserve(context + kPasses * (o.steps + 2) + 8);
    ORYX_ASSIGN_OR_RETURN(double fill_s, Fill(*backend, first, context, Mode::kLinear, 2048));
    const int64_t per_seq = first.kv_bytes() + (int64_t{1} << 20);
    for (int64_t batch : batches) {
      std::vector<SequenceState> seqs;
      if (batch * per_seq > backend->AvailableDeviceBytes() - (int64_t{2} << 30)) {
        nlohmann::json r = base;
        r.update({{"context", context}, {"batch", batch}, {"skipped", "KV caches do not fit in device memory"},
                  {"kv_bytes_per_sequence", first.kv_bytes()}});
        emit(r);
        continue;
      }
      for (int64_t b = 0; b < batch; ++b) seqs.push_back(first.Clone());
      for (Mode mode : {Mode::kAttention, Mode::kLinear}) {
        for (bool graphs : {true, false}) {
          backend->set_cuda_graphs(graphs);
          std::vector<int32_t> tokens(batch, 5);
          std::vector<Mode> modes(batch, mode);
          std::vector<std::vector<float>> out(batch);
          std::vector<ForwardItem> items;
          for (int64_t b = 0; b < batch; ++b) {
            items.push_back({&seqs[b], std::span(&tokens[b], 1), std::span(&modes[b], 1), LogitsRows::kLast, &out[b],
                             false});
          }
          std::vector<double> steps;
          for (int64_t i = 0; i < o.steps + 2; ++i) {
            const auto s0 = Clock::now();
            ORYX_RETURN_IF_ERROR(backend->Forward(items));
            if (i >= 2) steps.push_back(Seconds(s0));  // two warm-up steps (the first captures the graph)
          }
          const double step = Median(steps);
          const double bytes = StepBytes(c, mode, context, batch);
          nlohmann::json r = base;
          r.update({{"mode", ModeName(mode)}, {"context", context}, {"batch", batch}, {"steps", o.steps},
                    {"cuda_graph", graphs}, {"decode_ms_per_step", step * 1e3}, {"decode_tokens_per_s", batch / step},
                    {"fill_tokens_per_s", context / fill_s}, {"bytes_per_step", bytes},
                    {"roofline_ms", bytes / bandwidth * 1e3}, {"roofline_fraction", bytes / bandwidth / step}});
          emit(r);
        }
      }
    }
  }
  backend->set_cuda_graphs(true);
  return absl::OkStatus();
}

}  // namespace oryx::bench
