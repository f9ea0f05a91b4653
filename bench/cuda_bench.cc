// The CUDA decode benchmark (see cuda_bench.h).
#include "bench/cuda_bench.h"

#include <cmath>
#include <algorithm>
#include <chrono>
#include <iostream>
#include <optional>

#include "bench/bench_util.h"
#include "engine/cuda_backend.h"
#include "engine/engine.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/tensor_names.h"
#include "speculative/speculative.h"
#include "base/rng.h"
#include "train/shards.h"

namespace oryx::bench {

namespace {
using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }
constexpr int64_t kPasses = 10;  // passes per sequence: 2 modes x (logits to the host with graphs on, with step
                                 // timing, graphs off; the token drawn on the device, with step timing)
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

double Mean(const std::vector<double>& v) {
  double total = 0;
  for (double x : v) total += x;
  return v.empty() ? 0.0 : total / static_cast<double>(v.size());
}

int32_t ArgmaxOf(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());  // first maximum
}

// Positions the speculative rounds of one draft length may add to a sequence (every round may write k + 1,
// and so may each of the two passes of TimeVerifyCapture before them); each draft length starts from a
// fresh copy of the context.
int64_t SpecGrowth(const DecodeBenchOptions& o) {
  int64_t n = 0;
  for (int64_t k : o.spec_ks) n = std::max(n, 3 * (o.steps + 2) * (k + 1));
  return n;
}

// Tokens a round emits on average when each of its k drafts is accepted with probability a, independently,
// until the first rejection: the accepted prefix and then the recovered or bonus token, 1 + a + ... + a^k.
double ExpectedTokens(double a, int64_t k) {
  double total = 0, reach = 1;
  for (int64_t i = 0; i <= k; ++i, reach *= a) total += reach;
  return total;
}

// The acceptance at which rounds of `round_s` emit tokens as fast as decode steps of `step_s` (each emits
// one token per sequence): ExpectedTokens(a, k) = round_s / step_s; null when not even a = 1 gets there.
nlohmann::json BreakEvenAcceptance(double round_s, double step_s, int64_t k) {
  const double need = round_s / step_s;
  if (ExpectedTokens(1.0, k) < need) return nullptr;
  double lo = 0, hi = 1;
  for (int i = 0; i < 50; ++i) (ExpectedTokens((lo + hi) / 2, k) < need ? lo : hi) = (lo + hi) / 2;
  return hi;
}

// Prefills `tokens` in attention mode (as `oryx generate` does for the speculative policy) and returns the
// greedy next token.
absl::StatusOr<int32_t> PrefillWindow(CudaBackend& backend, SequenceState& seq, std::span<const int32_t> tokens) {
  constexpr int64_t kChunk = 2048;
  std::vector<Mode> modes(kChunk, Mode::kAttention);
  std::vector<float> logits;
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t done = 0; done < n; done += kChunk) {
    const int64_t m = std::min(kChunk, n - done);
    ORYX_RETURN_IF_ERROR(backend.Forward(seq, tokens.subspan(done, m), std::span(modes).first(m),
                                         /*all_logits=*/false, &logits));
  }
  return ArgmaxOf(logits);
}

// What the rounds of one draft length measured, pooled over the batch's sequences.
struct RoundStats {
  std::vector<double> round_s;  // wall time of each timed round (the whole batch)
  SpecStats spec;               // summed over sequences (draft_s / verify_s: the batch's, once)
};

// Runs o.steps timed rounds of draft length k (after two warm-up rounds: graph capture, buffer growth) on
// `seqs`, whose next tokens are `pending`, with speculative::SpeculativeDecoder and `accept`.
absl::StatusOr<RoundStats> TimeRounds(CudaBackend& backend, std::vector<SequenceState>& seqs,
                                      std::span<const int32_t> pending, int64_t k, int64_t rounds,
                                      speculative::AcceptRule accept, double temperature) {
  const size_t batch = seqs.size();
  speculative::SpeculativeOptions options;
  options.k = options.max_k = k;
  options.accept = std::move(accept);
  speculative::SpeculativeDecoder decoder(std::make_unique<speculative::LinearProposer>(), std::move(options));
  const std::vector<int32_t> none;
  std::vector<Sampler> samplers;
  for (size_t b = 0; b < batch; ++b) {
    samplers.emplace_back(SamplingParams{.temperature = static_cast<float>(temperature), .seed = 0x5a3d + b});
  }
  std::vector<GenerateStats> stats(batch);
  std::vector<DecodeSlot> slots(batch);
  std::vector<DecodeSlot*> slot_ptrs;
  for (size_t b = 0; b < batch; ++b) {
    DecodeSlot& s = slots[b];
    s.id = static_cast<int64_t>(b);
    s.seq = &seqs[b];
    s.pending = pending[b];
    s.prompt = s.generated = &none;
    s.remaining = int64_t{1} << 40;
    s.sampler = &samplers[b];
    s.stats = &stats[b];
    slot_ptrs.push_back(&s);
  }
  const std::vector<int64_t> ks(batch, k);
  RoundStats out;
  for (int64_t r = 0; r < rounds + 2; ++r) {
    if (r == 2) std::fill(stats.begin(), stats.end(), GenerateStats{});
    const auto t0 = Clock::now();
    ORYX_RETURN_IF_ERROR(decoder.Round(backend, slot_ptrs, ks));
    backend.Synchronize();  // the commit's state copies
    if (r >= 2) out.round_s.push_back(Seconds(t0));
    for (DecodeSlot& s : slots) s.pending = s.emitted.back();
  }
  SpecStats& t = out.spec;
  t.drafted_at.assign(k, 0);
  t.accepted_at.assign(k, 0);
  for (const GenerateStats& g : stats) {
    const SpecStats& s = *g.spec;
    t.rounds += s.rounds;
    t.drafted += s.drafted;
    t.accepted += s.accepted;
    for (size_t j = 0; j < s.drafted_at.size() && j < t.drafted_at.size(); ++j) {
      t.drafted_at[j] += s.drafted_at[j];
      t.accepted_at[j] += s.accepted_at[j];
    }
  }
  t.draft_s = stats[0].spec->draft_s;
  t.verify_s = stats[0].spec->verify_s;
  t.draft_forwards = stats[0].spec->draft_forwards;
  t.verify_forwards = stats[0].spec->verify_forwards;
  t.backend_rounds = stats[0].spec->backend_rounds;
  return out;
}

// The median time of a verify forward (k + 1 attention-mode tokens per sequence, all logits, CUDA graphs on)
// with per-token state capture (keep_states, what Truncate rolls back to) and without: what capturing the
// states costs a round. Each of the two passes advances the sequences by (steps + 2)(k + 1) tokens.
absl::StatusOr<std::pair<double, double>> TimeVerifyCapture(CudaBackend& backend, std::vector<SequenceState>& seqs,
                                                            int64_t k, int64_t steps) {
  const std::vector<int32_t> tokens(k + 1, 5);
  const std::vector<Mode> modes(k + 1, Mode::kAttention);
  std::vector<std::vector<float>> out(seqs.size());
  double median[2] = {0, 0};
  for (const bool capture : {true, false}) {
    std::vector<ForwardItem> items;
    for (size_t b = 0; b < seqs.size(); ++b) {
      items.push_back({&seqs[b], tokens, modes, LogitsRows::kAll, &out[b], capture});
    }
    std::vector<double> times;
    for (int64_t i = 0; i < steps + 2; ++i) {
      const auto t0 = Clock::now();
      ORYX_RETURN_IF_ERROR(backend.Forward(items));
      if (i >= 2) times.push_back(Seconds(t0));
    }
    median[capture ? 0 : 1] = Median(times);
  }
  return std::make_pair(median[0], median[1]);
}

// The speculative rounds of one point (context, batch) for every k of o.spec_ks, against the attention and
// linear decode steps measured at the same point. `first` holds the filled context (random weights);
// `val` (a trained model) gives the contexts instead, and the acceptance is then the model's own.
absl::Status RunSpecPoint(CudaBackend& backend, const DecodeBenchOptions& o, const nlohmann::json& base,
                          const SequenceState& first, const CorpusReader* val, int64_t context, int64_t batch,
                          double attention_s, double linear_s, const Emit& emit) {
  const bool measured = val != nullptr;
  const bool greedy_rounds = backend.runs_rounds();
  // Each draft length with rounds run forward by forward from the host, then whole by the backend (one
  // CUDA graph and one synchronisation per round).
  for (int64_t k : o.spec_ks) for (const bool on_device : {false, true}) {
    backend.set_runs_rounds(on_device);
    std::vector<SequenceState> seqs;
    std::vector<int32_t> pending(batch, 5);
    for (int64_t b = 0; b < batch; ++b) {
      if (!measured) {
        ORYX_ASSIGN_OR_RETURN(SequenceState copy, first.TryCopy());  // its own KV blocks, as a served request's
        seqs.push_back(std::move(copy));
        continue;
      }
      // Evenly spread validation windows, one per sequence.
      const int64_t windows = val->NumSequences(context);
      std::vector<int32_t> window(context + 1);
      ORYX_RETURN_IF_ERROR(val->ReadSequence(b * windows / batch, context, window.data()));
      window.pop_back();
      seqs.push_back(backend.NewSequence());
      ORYX_RETURN_IF_ERROR(seqs.back().Reserve(context + SpecGrowth(o) + 8));
      ORYX_ASSIGN_OR_RETURN(pending[b], PrefillWindow(backend, seqs.back(), window));
    }
    if (!measured && !on_device) {
      ORYX_ASSIGN_OR_RETURN(const auto verify, TimeVerifyCapture(backend, seqs, k, o.steps));
      nlohmann::json r = base;
      r.update({{"bench", "verify_capture"}, {"k", k}, {"context", context}, {"batch", batch},
                {"cuda_graph", backend.cuda_graphs()}, {"verify_ms_capturing", verify.first * 1e3},
                {"verify_ms_not_capturing", verify.second * 1e3},
                {"capture_ms", (verify.first - verify.second) * 1e3},
                {"capture_fraction_of_verify", (verify.first - verify.second) / verify.first}});
      emit(r);
    }
    speculative::AcceptRule accept;  // empty: AcceptLossless, the real acceptance, which the backend may run
    Rng rng(0x5eed + k);
    // (A backend round judges its drafts itself, by the model's greedy acceptance; with random weights its
    // time is measured so, and its tokens per round are the simulated acceptance's: a round does the same
    // work whatever it accepts.)
    if (!measured && !on_device) {
      accept = [&rng, a = o.acceptance](Sampler&, std::span<const float> logits, const speculative::Proposal& d,
                                        int64_t V, int32_t* next) {
        const int64_t n = static_cast<int64_t>(d.tokens.size());
        int64_t accepted = 0;
        while (accepted < n && rng.UniformDouble() < a) ++accepted;
        *next = ArgmaxOf(logits.subspan(accepted * V, V));
        return accepted;
      };
    }
    ORYX_ASSIGN_OR_RETURN(RoundStats rs,
                          TimeRounds(backend, seqs, pending, k, o.steps, std::move(accept), o.temperature));
    const SpecStats& s = rs.spec;
    // Drafts judged at each position: those drafted there whose predecessors were all accepted.
    std::vector<double> per_position;
    int64_t judged = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t reached = std::min(s.drafted_at[j], j == 0 ? s.drafted_at[0] : s.accepted_at[j - 1]);
      judged += reached;
      per_position.push_back(reached ? static_cast<double>(s.accepted_at[j]) / reached : 0.0);
    }
    const double judged_rate = judged ? static_cast<double>(s.accepted) / judged : 0.0;
    const double observed_tokens = static_cast<double>(s.accepted + s.rounds) / s.rounds;
    const double tokens = measured ? observed_tokens : ExpectedTokens(o.acceptance, k);  // per sequence and round
    const double round_s = Median(rs.round_s);
    nlohmann::json r = base;
    r.update({{"bench", "speculative"}, {"proposer", "linear"}, {"k", k}, {"context", context}, {"batch", batch},
              {"rounds", o.steps}, {"cuda_graph", backend.cuda_graphs()},
              {"rounds_run_by", on_device ? "backend" : "decoder"}, {"backend_rounds", s.backend_rounds},
              {"temperature", o.temperature},
              {"acceptance_source",
               measured ? Cat("measured: the model's ", o.temperature > 0 ? "sampled" : "greedy",
                              " acceptance (AcceptLossless) on validation windows of the corpus")
               : on_device
                   ? "simulated for the tokens per round (each draft accepted with probability `acceptance` until the "
                     "first rejection); the round time measured with the random model's own greedy acceptance"
                   : "simulated: random weights make real acceptance meaningless, so each draft is accepted with "
                     "probability `acceptance`, independently, until the first rejection (seeded)"},
              {"acceptance", measured ? judged_rate : o.acceptance},
              {"acceptance_per_judged_draft", judged_rate}, {"drafted", s.drafted}, {"judged", judged},
              {"accepted", s.accepted},
              {"acceptance_rate", s.drafted ? static_cast<double>(s.accepted) / s.drafted : 0.0},
              {"per_position_acceptance", per_position},
              {"tokens_per_round", tokens}, {"observed_tokens_per_round", observed_tokens},
              {"round_ms", round_s * 1e3}, {"round_ms_mean", Mean(rs.round_s) * 1e3},
              {"draft_ms_per_step", s.draft_forwards ? 1e3 * s.draft_s / s.draft_forwards : 0.0},
              {"verify_ms", s.verify_forwards ? 1e3 * s.verify_s / s.verify_forwards : 0.0},
              {"ms_per_token", round_s * 1e3 / (batch * tokens)}, {"tokens_per_s", batch * tokens / round_s},
              {"attention_ms_per_step", attention_s * 1e3}, {"linear_ms_per_step", linear_s * 1e3},
              {"speedup_over_attention", attention_s * tokens / round_s},
              {"speedup_over_linear", linear_s * tokens / round_s},
              {"breakeven_acceptance", BreakEvenAcceptance(round_s, attention_s, k)}});
    emit(r);
  }
  backend.set_runs_rounds(greedy_rounds);
  return absl::OkStatus();
}
}  // namespace

double StepBytes(const ModelConfig& c, Mode mode, int64_t context, int64_t batch, bool fp8_weights) {
  const double L = c.n_layers, D = c.d_model, H = c.n_heads, dh = c.head_dim, HD = c.qk_dim(), F = c.mlp_hidden,
               V = c.vocab_size, W = c.conv_width - 1, G = c.linear_mixer == LinearMixer::kGdn ? 2 * H : H;
  // Matrices (bf16, or FP8 with an fp32 scale per row): per layer the input projections but the unused query
  // (k, v, g, gates and one of q_attn / q_linear), o_proj and the MLP; the LM head; only the batch's rows of
  // the (bf16) embedding.
  const double matrices = L * ((4 * HD + G) * D + D * HD + 3 * F * D) + V * D;
  const double matrix_rows = L * ((4 * HD + G) + D + 3 * F) + V;
  const double matrix_bytes =
      fp8_weights ? matrices + 4.0 * matrix_rows + 2.0 * batch * D : 2.0 * (matrices + batch * D);
  // fp32 vectors: norms, conv weights and bias, gate norm, dt_bias, A_log, D_skip; the final norm.
  const double vectors = L * (2 * D + 2 * HD * c.conv_width + 2 * HD + dh + 3 * H) + D;
  const double kv_read = mode == Mode::kAttention ? 2.0 * 2 * L * HD * (context + 1) : 0.0;
  const double per_sequence = kv_read + 2.0 * 2 * L * HD                // KV cache read, new entries written
                              + 2.0 * 4 * L * H * dh * dh               // recurrent state read and written
                              + 2.0 * 4 * L * W * 2 * HD                // conv window read and written
                              + 4.0 * V;                                // logits written (fp32)
  return matrix_bytes + 4.0 * vectors + batch * per_sequence;
}

absl::Status RunCudaDecodeBench(const DecodeBenchOptions& o, const Emit& emit) {
  int64_t max_context = 0;
  for (int64_t c : o.contexts) max_context = std::max(max_context, c);
  std::vector<int64_t> batches = o.batches;
  std::sort(batches.begin(), batches.end());
  if (!o.data_dir.empty() && (o.model_dir.empty() || o.spec_ks.empty())) {
    return absl::InvalidArgumentError("bench decode: --data is for the speculative rounds (--spec-k) of a --model");
  }
  if (!(o.acceptance >= 0 && o.acceptance <= 1)) {
    return absl::InvalidArgumentError(Cat("bench decode: --acceptance must be in [0, 1], got ", o.acceptance));
  }
  // Positions past the context that the timed steps and rounds of one point may write.
  const int64_t growth = std::max(kPasses * (o.steps + 2), SpecGrowth(o)) + 8;
  ORYX_ASSIGN_OR_RETURN(const kernels::WeightFormat weight_format, ParseWeightFormat(o.weights));
  std::unique_ptr<CudaBackend> backend;
  std::string model = o.model_dir;
  if (o.model_dir.empty()) {
    const std::string preset = o.preset.empty() ? "130m" : o.preset;
    ORYX_ASSIGN_OR_RETURN(ModelConfig config, PresetConfig(preset, o.mixer, max_context + growth + 8));
    ORYX_ASSIGN_OR_RETURN(backend,
                          CudaBackend::CreateRandom(config, 1, CudaSwitches::FromEnvironment(), weight_format));
    model = Cat("random-", preset, "-", o.mixer == LinearMixer::kGdn ? "gdn" : "mamba2");
  } else {
    ORYX_ASSIGN_OR_RETURN(backend, CudaBackend::Load(o.model_dir, CudaSwitches::FromEnvironment(), weight_format));
  }
  const ModelConfig& c = backend->config();
  if (max_context + growth > c.max_position) {
    return absl::InvalidArgumentError(Cat("context ", max_context, " + ", growth, " positions of ", o.steps,
                                          " timed steps", o.spec_ks.empty() ? "" : " and rounds",
                                          " exceed the model's max_position ", c.max_position));
  }
  std::optional<CorpusReader> val;
  if (!o.data_dir.empty()) {
    ORYX_ASSIGN_OR_RETURN(val, CorpusReader::Open(o.data_dir, "val"));
    if (val->vocab_size() != c.vocab_size) {
      return absl::InvalidArgumentError(Cat(o.data_dir, ": corpus vocabulary ", val->vocab_size(),
                                            " differs from the model's ", c.vocab_size));
    }
    for (int64_t context : o.contexts) {
      if (val->NumSequences(context) < 1) {
        return absl::FailedPreconditionError(Cat(o.data_dir, ": validation split shorter than ", context));
      }
    }
  }
  const double bandwidth = backend->MeasureCopyBandwidth();
  const double weights = static_cast<double>(backend->weight_bytes());
  const std::string weight_type = backend->fp8_weights() ? "fp8" : "bf16";
  std::cerr << "bench decode (cuda " << backend->DeviceName() << "): " << model << ", " << weights / 1e9 << " GB of "
            << weight_type << " weights, copy bandwidth " << bandwidth / 1e9 << " GB/s\n";
  nlohmann::json base = {{"bench", "decode"}, {"backend", "cuda"}, {"device", backend->DeviceName()}, {"model", model},
                         {"weights", weight_type}, {"weight_bytes", weights},
                         {"copy_bandwidth_gb_s", bandwidth / 1e9}};
  base.update(Provenance());

  // Prefill throughput by mode, from an empty sequence, in the backend's spans for one prompt (attention mode only up
  // to o.prefill_max_attention: its cost grows with the square of the context): the median of three fills, each of a
  // fresh sequence. One untimed fill of a chunk in each mode first, so that no timed fill pays for the process's first
  // launches (cuBLAS's set-up, module loading, scratch growth).
  const int64_t span = backend->PrefillSpan(1);
  const int64_t warm_len = std::min<int64_t>(span, max_context);
  for (Mode mode : {Mode::kLinear, Mode::kAttention}) {
    SequenceState warm = backend->NewSequence();
    ORYX_RETURN_IF_ERROR(warm.Reserve(warm_len));
    ORYX_RETURN_IF_ERROR(Fill(*backend, warm, warm_len, mode, span).status());
  }
  for (Mode mode : {Mode::kLinear, Mode::kAttention}) {
    for (int64_t context : o.contexts) {
      if (mode == Mode::kAttention && context > o.prefill_max_attention) continue;
      std::vector<double> runs;
      for (int rep = 0; rep < 3; ++rep) {
        SequenceState seq = backend->NewSequence();
        ORYX_RETURN_IF_ERROR(seq.Reserve(context));
        ORYX_ASSIGN_OR_RETURN(double s, Fill(*backend, seq, context, mode, span));
        runs.push_back(s);
      }
      const double s = Median(runs);
      nlohmann::json r = base;
      r.update({{"bench", "prefill"},
                {"mode", ModeName(mode)},
                {"context", context},
                {"chunk", span},
                {"prefill_s", s},
                {"prefill_s_runs", runs},
                {"prefill_tokens_per_s", context / s}});
      emit(r);
    }
  }

  for (int64_t context : o.contexts) {
    // One sequence of `context` tokens (linear-mode prefill writes the same KV cache and state sizes),
    // cloned into every batch slot with room for the timed steps of its passes (attention then linear,
    // each with and without CUDA graphs, one after the other: the context grows by a few tokens).
    SequenceState first = backend->NewSequence();
    ORYX_RETURN_IF_ERROR(first.Reserve(context + growth));
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
      for (int64_t b = 0; b < batch; ++b) {
        ORYX_ASSIGN_OR_RETURN(SequenceState copy, first.TryCopy());  // its own KV blocks, as a served request's
        seqs.push_back(std::move(copy));
      }
      // attention, linear (CUDA graphs on, the next token drawn on the device): what the rounds are compared with
      double step_s[2] = {0, 0};
      // Each sequence's sampler (greedy unless --temperature): the device's draws use one set, the host's
      // draws from the returned logits (timed apart, host_draw_ms) the other.
      std::vector<Sampler> samplers, host_samplers;
      for (int64_t b = 0; b < batch; ++b) {
        const SamplingParams params{.temperature = static_cast<float>(o.temperature), .seed = 0x5eed + uint64_t(b)};
        samplers.emplace_back(params);
        host_samplers.emplace_back(params);
      }
      for (Mode mode : {Mode::kAttention, Mode::kLinear}) {
        // The step three ways: returning the last row's logits to the host (as a caller that reads them
        // needs), CUDA graphs on and off; and drawing the next token on the device (greedy), graphs on, as
        // `oryx generate` decodes.
        for (auto [graphs, device_draw] : {std::pair{true, false}, std::pair{false, false}, std::pair{true, true}}) {
          backend->set_cuda_graphs(graphs);
          std::vector<int32_t> tokens(batch, 5), next(batch);
          std::vector<Mode> modes(batch, mode);
          std::vector<std::vector<float>> out(batch);
          std::vector<ForwardItem> items;
          for (int64_t b = 0; b < batch; ++b) {
            items.push_back({&seqs[b], std::span(&tokens[b], 1), std::span(&modes[b], 1), LogitsRows::kLast,
                             device_draw ? nullptr : &out[b], false, device_draw ? &samplers[b] : nullptr, &next[b]});
          }
          std::vector<double> steps;
          for (int64_t i = 0; i < o.steps + 2; ++i) {
            const auto s0 = Clock::now();
            ORYX_RETURN_IF_ERROR(backend->Forward(items));
            if (i >= 2) steps.push_back(Seconds(s0));  // two warm-up steps (the first captures the graph)
          }
          const double step = Median(steps);
          if (device_draw) step_s[mode == Mode::kLinear] = step;
          const double bytes = StepBytes(c, mode, context, batch, backend->fp8_weights());
          nlohmann::json r = base;
          r.update({{"mode", ModeName(mode)}, {"context", context}, {"batch", batch}, {"steps", o.steps},
                    {"cuda_graph", graphs}, {"next_token", device_draw ? "device" : "host"},
                    {"temperature", o.temperature},
                    {"decode_ms_per_step", step * 1e3}, {"decode_tokens_per_s", batch / step},
                    {"fill_tokens_per_s", context / fill_s}, {"bytes_per_step", bytes},
                    {"roofline_ms", bytes / bandwidth * 1e3}, {"roofline_fraction", bytes / bandwidth / step}});
          if (graphs) {
            // The same steps again with events around the graph: where the wall time goes (medians of each
            // part; the events add a little host time, so the headline above is timed without them).
            backend->set_step_timing(true);
            std::vector<double> parts[6], host_draw;
            for (int64_t i = 0; i < o.steps; ++i) {
              ORYX_RETURN_IF_ERROR(backend->Forward(items));
              const CudaBackend::StepTiming& t = backend->last_step_timing();
              int j = 0;
              for (double v : {t.wall_s, t.prepare_s, t.launch_s, t.device_s, t.copy_back_s, t.finish_s}) {
                parts[j++].push_back(v * 1e3);
              }
              if (!device_draw) {  // what drawing from the returned logits costs the host
                const auto d0 = Clock::now();
                for (int64_t b = 0; b < batch; ++b) next[b] = host_samplers[b].Next(out[b]);
                host_draw.push_back(Seconds(d0) * 1e3);
              }
            }
            backend->set_step_timing(false);
            if (!device_draw) r["host_draw_ms"] = Median(host_draw);
            const double device_ms = Median(parts[3]);
            r["breakdown_ms"] = {{"wall", Median(parts[0])},       {"host_prepare", Median(parts[1])},
                                 {"host_launch", Median(parts[2])}, {"device", device_ms},
                                 {"copy_back", Median(parts[4])},   {"host_finish", Median(parts[5])}};
            r["device_roofline_fraction"] = bytes / bandwidth / (device_ms * 1e-3);
          }
          emit(r);
        }
      }
      backend->set_cuda_graphs(true);
      if (o.spec_ks.empty()) continue;
      seqs.clear();  // the rounds' sequences take their place in device memory
      ORYX_RETURN_IF_ERROR(RunSpecPoint(*backend, o, base, first, val ? &*val : nullptr, context, batch, step_s[0],
                                        step_s[1], emit));
    }
  }
  backend->set_cuda_graphs(true);
  return absl::OkStatus();
}

}  // namespace oryx::bench
