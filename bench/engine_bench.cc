#include "bench/engine_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <random>

#include "bench/bench_util.h"
#ifdef ORYX_HAVE_CUDA
#include "bench/cuda_bench.h"
#endif
#include "engine/checkpoint.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "base/file_util.h"
#include "engine/safetensors.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/tensor_names.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/stream.h"
#include "router/cost_model.h"
#include "speculative/speculative.h"
#include "train/shards.h"

namespace oryx::bench {

namespace {
using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// The decode time of a batch that started decoding together: until its last request finished.
double BatchDecodeSeconds(const std::vector<GenerateResult>& results) {
  double s = 0;
  for (const GenerateResult& r : results) s = std::max(s, r.stats.decode_s);
  return s;
}

std::string_view ModeName(Mode m) { return m == Mode::kAttention ? "attention" : "linear"; }

int64_t ParamCount(const ModelConfig& c) {
  int64_t n = 0;
  for (const TensorSpec& t : ExpectedTensors(c)) {
    int64_t e = 1;
    for (int64_t d : t.shape) e *= d;
    n += e;
  }
  return n;
}

}  // namespace

ModelConfig DecodeBenchConfig(int64_t max_position) {
  ModelConfig c;
  c.vocab_size = 8192;
  c.d_model = 512;
  c.n_layers = 4;
  c.n_heads = 8;
  c.head_dim = 64;
  c.mlp_hidden = 1408;
  c.rope_theta = 10000;
  c.tie_embeddings = true;
  c.max_position = max_position;
  c.bos_id = 2;
  c.eos_id = 3;
  return c;
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

absl::Status WriteRandomCheckpoint(const std::string& dir, const ModelConfig& config, uint32_t seed,
                                   const std::string& tokenizer_path) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 0.02f);
  std::vector<HostTensor> tensors;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    int64_t n = 1;
    for (int64_t d : spec.shape) n *= d;
    std::vector<float> values(n);
    for (float& v : values) v = normal(rng);
    tensors.push_back(MakeHostTensor(spec.name, spec.shape, values, DType::kF32));
  }
  if (!tokenizer_path.empty()) return WriteCheckpoint(dir, config, Views(tensors), kDefaultMaxShardBytes, tokenizer_path);
  const std::string tok = dir + ".tokenizer";
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(tok, "random-weight benchmark model: no tokenizer"));
  absl::Status s = WriteCheckpoint(dir, config, Views(tensors), kDefaultMaxShardBytes, tok);
  (void)RemoveTree(tok);
  return s;
}

double ReadBandwidth(double bytes) {
  const int64_t n = std::max<int64_t>(1 << 16, static_cast<int64_t>(bytes / sizeof(float)));
  std::vector<float> x(n, 1.f);
  float sum = 0;
  // The best of 15 passes (the first pages the buffer in): a roofline is what the machine can reach, and
  // on a shared VM single passes vary by 2x.
  double best = 1e30;
  for (int i = 0; i < 16; ++i) {
    const auto t0 = Clock::now();
    kernels::cpu::StreamSum({n, x.data(), nullptr, &sum});
    if (i > 0) best = std::min(best, Seconds(t0));
  }
  return n * sizeof(float) / best;
}

absl::Status RunDecodeBench(const DecodeBenchOptions& o, const Emit& emit) {
  if (o.device == "cuda" && o.kv_dtype != "f32") {
    return absl::InvalidArgumentError(
        "bench decode: --kv-dtype is for the CPU backend (the CUDA backend's cache is bf16)");
  }
  if (o.device == "cuda" && o.kv_block_tokens != 0) {
    return absl::InvalidArgumentError(
        "bench decode: --kv-block-tokens is for the CPU backend (the CUDA kernels read 64-token blocks)");
  }
  if (o.device == "cuda") {
#ifdef ORYX_HAVE_CUDA
    return RunCudaDecodeBench(o, emit);
#else
    return absl::UnimplementedError("bench decode: this build has no CUDA backend (configure with ORYX_CUDA=ON)");
#endif
  }
  if (o.device != "cpu") return absl::InvalidArgumentError(Cat("bench decode: unknown device '", o.device, "' (cpu, cuda)"));
  if (!o.preset.empty() && !o.model_dir.empty()) {
    return absl::InvalidArgumentError("bench decode: --config makes random weights; it does not go with --model");
  }
  int64_t max_context = 0, max_batch = 0;
  for (int64_t c : o.contexts) max_context = std::max(max_context, c);
  for (int64_t b : o.batches) max_batch = std::max(max_batch, b);
  std::string dir = o.model_dir;
  std::string scratch;
  if (dir.empty()) {
    scratch = Cat("/tmp/oryx_bench_decode_", getpid());
    ModelConfig config = DecodeBenchConfig(max_context + o.steps + 1);
    if (!o.preset.empty()) {
      ORYX_ASSIGN_OR_RETURN(config, PresetConfig(o.preset, o.mixer, max_context + o.steps + 1));
    }
    ORYX_RETURN_IF_ERROR(WriteRandomCheckpoint(scratch, config, 1));
    dir = scratch;
  }
  ORYX_ASSIGN_OR_RETURN(const kernels::WeightFormat format, ParseWeightFormat(o.weights));
  ORYX_ASSIGN_OR_RETURN(const kernels::KvFormat kv_format, ParseKvFormat(o.kv_dtype));
  auto loaded = CpuBackend::Load(dir, o.threads, format);
  absl::StatusOr<ReferenceTimer> reference = ReferenceTimer();
  if (loaded.ok() && o.reference) reference = o.reference(dir);
  if (!scratch.empty()) (void)RemoveTree(scratch);
  ORYX_RETURN_IF_ERROR(loaded.status());
  ORYX_RETURN_IF_ERROR(reference.status());
  CpuBackend& backend = **loaded;
  if (o.kv_block_tokens > 0) ORYX_RETURN_IF_ERROR(backend.SetKvBlockTokens(o.kv_block_tokens));
  ORYX_RETURN_IF_ERROR(backend.SetKvFormat(kv_format));
  // Bytes of one position's keys (or values) in one layer: int8 rows carry a scale per head.
  const double kv_row_bytes =
      static_cast<double>(backend.config().n_heads * kernels::KvHeadRowElements(kv_format, backend.config().head_dim) *
                          kernels::KvElementBytes(kv_format));
  const ModelConfig& c = backend.config();
  if (max_context + o.steps > c.max_position) {
    return absl::InvalidArgumentError(Cat("context ", max_context, " + ", o.steps, " steps exceed the model's max_position ",
                                          c.max_position));
  }
  const int64_t params = ParamCount(c);
  std::cerr << "bench decode: " << params / 1e6 << "M parameters, " << backend.num_threads()
            << " threads\n";
  const double dram_bandwidth = ReadBandwidth(1024.0 * (1 << 20));
  // Weight bytes a step reads: every weight but an untied embedding table (a row per sequence; tied, it is the
  // head and read whole) and the query projection of the other mode (a step of one mode computes q_attn or
  // q_linear, not both, where q_linear's rows fill whole panels: CpuBackend::LayerForward), the projections
  // (in_proj, o_proj, MLP, head) in their format, the rest fp32.
  const double packed_params =
      static_cast<double>(c.n_layers) * ((InProjLayout::For(c).width - c.qk_dim()) * c.d_model +
                                         c.d_model * c.qk_dim() + 3 * c.mlp_hidden * c.d_model) +
      static_cast<double>(c.vocab_size) * c.d_model;
  const double bytes_per_weight = kernels::BytesPerWeight(format);
  const double embedding = c.tie_embeddings ? 0.0 : static_cast<double>(c.vocab_size) * c.d_model;
  const double unread_query = static_cast<double>(c.n_layers) * c.qk_dim() * c.d_model;
  const double weight_bytes =
      4.0 * (params - embedding - packed_params - unread_query) + bytes_per_weight * packed_params;
  const double L = static_cast<double>(c.n_layers);
  const double state_bytes = 4.0 * L * c.n_heads * c.head_dim * c.head_dim;
  for (Mode mode : {Mode::kAttention, Mode::kLinear}) {
    for (int64_t context : o.contexts) {
      // Prefill one sequence of `context` tokens (in chunks of 512), then copy it to every batch slot.
      std::vector<int32_t> ctx(context);
      for (int64_t t = 0; t < context; ++t) ctx[t] = static_cast<int32_t>(4 + (t * 7919) % (c.vocab_size - 4));
      SequenceState first = backend.NewSequence();
      ORYX_RETURN_IF_ERROR(first.Reserve(context + o.steps + 1));
      std::vector<Mode> modes(512, mode);
      std::vector<float> logits;
      const auto t0 = Clock::now();
      for (int64_t done = 0; done < context; done += 512) {
        const int64_t n = std::min<int64_t>(512, context - done);
        ORYX_RETURN_IF_ERROR(backend.Forward(first, std::span(ctx).subspan(done, n), std::span(modes).first(n), false, &logits));
      }
      const double prefill_s = Seconds(t0);
      for (int64_t batch : o.batches) {
        std::vector<SequenceState> seqs;
        for (int64_t b = 0; b < batch; ++b) {  // each with a KV cache of its own, as served sequences have
          ORYX_ASSIGN_OR_RETURN(SequenceState copy, first.TryCopy());
          seqs.push_back(std::move(copy));
          ORYX_RETURN_IF_ERROR(seqs.back().Reserve(context + o.steps + 1));
        }
        std::vector<int32_t> tokens(batch, 5);
        std::vector<Mode> step_modes(batch, mode);
        std::vector<std::vector<float>> out(batch);
        std::vector<ForwardItem> items;
        for (int64_t b = 0; b < batch; ++b) {
          items.push_back({&seqs[b], std::span(&tokens[b], 1), std::span(&step_modes[b], 1), LogitsRows::kLast, &out[b], false});
        }
        ORYX_RETURN_IF_ERROR(backend.Forward(items));  // warm-up (scratch buffers)
        std::vector<double> steps;
        for (int64_t i = 1; i < o.steps; ++i) {
          const auto s0 = Clock::now();
          ORYX_RETURN_IF_ERROR(backend.Forward(items));
          steps.push_back(Seconds(s0));
        }
        const double step = Median(steps);
        // Bytes a step must move: every weight once; per sequence the KV cache it reads (attention), its
        // new KV entries, and the recurrent state read and written.
        const double kv_read = mode == Mode::kAttention ? 2.0 * kv_row_bytes * L * (context + 1) : 0.0;
        const double bytes = weight_bytes + batch * (kv_read + 2.0 * kv_row_bytes * L + 2 * state_bytes);
        const double bandwidth = ReadBandwidth(bytes);
        nlohmann::json r = {{"bench", "decode"},
                            {"backend", backend.name()},
                            {"threads", backend.num_threads()},
                            {"weights", o.weights},
                            {"kv_block_tokens", backend.kv_block_tokens()},
                            {"kv_dtype", o.kv_dtype},
                            {"mode", ModeName(mode)},
                            {"context", context},
                            {"batch", batch},
                            {"params", params},
                            {"decode_ms_per_step", step * 1e3},
                            {"decode_tokens_per_s", batch / step},
                            {"prefill_tokens_per_s", context / prefill_s},
                            {"bytes_per_step", bytes},
                            {"read_bandwidth_gb_s", bandwidth / 1e9},
                            {"roofline_fraction", bytes / bandwidth / step},
                            {"dram_read_bandwidth_gb_s", dram_bandwidth / 1e9},
                            {"dram_roofline_fraction", bytes / dram_bandwidth / step}};
        if (*reference) {
          if (std::optional<double> ref = (*reference)(mode, context, batch)) {
            r["libtorch_ms_per_step"] = *ref * 1e3;
            r["speedup_over_libtorch"] = *ref / step;
          }
        }
        r.update(Provenance());
        emit(r);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status RunSpecBench(const SpecBenchOptions& o, const Emit& emit) {
  ORYX_ASSIGN_OR_RETURN(Engine engine, Engine::Load(o.model_dir, {"cpu", o.threads}));
  engine.set_prefix_cache(std::nullopt);  // every run computes its prompts: the runs compare decoding alone
  speculative::RegisterPolicies(engine.policies());
  const ModelConfig& c = engine.backend().config();
  ORYX_ASSIGN_OR_RETURN(CorpusReader val, CorpusReader::Open(o.data_dir, "val"));
  if (val.vocab_size() != c.vocab_size) {
    return absl::InvalidArgumentError(Cat(o.data_dir, ": corpus vocabulary ", val.vocab_size(), " differs from the model's ",
                                          c.vocab_size));
  }
  for (int64_t context : o.contexts) {
    if (context + o.gen_tokens + 65 > c.max_position) {
      return absl::InvalidArgumentError(Cat("context ", context, " + ", o.gen_tokens, " generated tokens exceed the model's max_position ",
                                            c.max_position));
    }
    const int64_t windows = val.NumSequences(context);
    if (windows < 1) return absl::FailedPreconditionError(Cat(o.data_dir, ": validation split shorter than ", context));
    for (int64_t batch : o.batches) {
      // Prompts: evenly spread validation windows of `context` tokens.
      std::vector<GenerateRequest> requests(batch);
      for (int64_t b = 0; b < batch; ++b) {
        std::vector<int32_t> window(context + 1);
        ORYX_RETURN_IF_ERROR(val.ReadSequence(b * windows / batch, context, window.data()));
        window.pop_back();
        requests[b].prompt_tokens = window;
        requests[b].max_tokens = o.gen_tokens;
        requests[b].stop_at_eos = false;
      }
      auto run = [&](const std::string& policy) -> absl::StatusOr<std::vector<GenerateResult>> {
        for (GenerateRequest& r : requests) r.policy = policy;
        return engine.Generate(requests);
      };
      // Attention-mode decoding: a warm-up run (first-touch buffers), then the measured one.
      ORYX_RETURN_IF_ERROR(run("attention").status());
      ORYX_ASSIGN_OR_RETURN(std::vector<GenerateResult> base, run("attention"));
      const double base_tps = batch * (o.gen_tokens - 1) / BatchDecodeSeconds(base);
      std::cerr << "bench spec: context " << context << ", batch " << batch << ": attention-mode decode "
                << base_tps << " tokens/s\n";
      std::vector<std::string> policies;
      for (const std::string& proposer : o.proposers) {
        const std::string prefix = proposer == "ngram" ? "speculative:ngram" : "speculative";
        for (int64_t k : o.ks) policies.push_back(Cat(prefix, ":", k));
        policies.push_back(prefix);  // adaptive
      }
      for (const std::string& policy : policies) {
        ORYX_ASSIGN_OR_RETURN(std::vector<GenerateResult> got, run(policy));
        SpecStats total;
        int64_t identical = 0;
        for (int64_t b = 0; b < batch; ++b) {
          const SpecStats& s = *got[b].stats.spec;
          total.rounds += s.rounds;
          total.drafted += s.drafted;
          total.accepted += s.accepted;
          total.drafted_at.resize(std::max(total.drafted_at.size(), s.drafted_at.size()));
          total.accepted_at.resize(total.drafted_at.size());
          for (size_t j = 0; j < s.drafted_at.size(); ++j) {
            total.drafted_at[j] += s.drafted_at[j];
            total.accepted_at[j] += s.accepted_at[j];
          }
          identical += got[b].tokens == base[b].tokens;
        }
        const GenerateStats& s0 = got[0].stats;
        const double tps = batch * (o.gen_tokens - 1) / BatchDecodeSeconds(got);
        std::vector<double> per_position;
        for (size_t j = 0; j < total.drafted_at.size(); ++j) {
          per_position.push_back(total.drafted_at[j] ? double(total.accepted_at[j]) / total.drafted_at[j] : 0.0);
        }
        nlohmann::json r = {
            {"bench", "spec"}, {"policy", policy}, {"context", context}, {"batch", batch}, {"gen_tokens", o.gen_tokens},
            {"rounds", total.rounds}, {"drafted", total.drafted}, {"accepted", total.accepted},
            {"acceptance_rate", total.drafted ? double(total.accepted) / total.drafted : 0.0},
            {"mean_accepted_per_round", total.rounds ? double(total.accepted) / total.rounds : 0.0},
            {"per_position_acceptance", per_position},
            {"draft_s", s0.spec->draft_s}, {"verify_s", s0.spec->verify_s},
            {"draft_forwards", s0.spec->draft_forwards}, {"verify_forwards", s0.spec->verify_forwards},
            {"draft_step_ms", s0.spec->draft_forwards ? 1e3 * s0.spec->draft_s / s0.spec->draft_forwards : 0.0},
            {"verify_ms", s0.spec->verify_forwards ? 1e3 * s0.spec->verify_s / s0.spec->verify_forwards : 0.0},
            {"attention_decode_tokens_per_s", base_tps}, {"spec_decode_tokens_per_s", tps},
            {"speedup", tps / base_tps}, {"outputs_identical_to_attention", identical}, {"threads", o.threads}};
        r.update(Provenance());
        emit(r);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status RunCostBench(const CostBenchOptions& o, const Emit& emit) {
  std::string dir = o.model_dir, scratch;
  if (dir.empty()) {
    scratch = Cat("/tmp/oryx_bench_cost_", getpid());
    ORYX_RETURN_IF_ERROR(WriteRandomCheckpoint(scratch, DecodeBenchConfig(4096), 1));
    dir = scratch;
  }
  BackendOptions options;
  options.device = o.device, options.threads = o.threads;
  auto loaded = LoadBackend(dir, options);
  if (!scratch.empty()) (void)RemoveTree(scratch);
  ORYX_RETURN_IF_ERROR(loaded.status());
  Backend& backend = **loaded;
  const auto* cpu = dynamic_cast<const CpuBackend*>(&backend);
  const ModelConfig& c = backend.config();
  const int64_t max_ctx = c.max_position - 16;
  // Calibration at short, middle and long contexts; held-out shapes in between, at other batch sizes and
  // span lengths, and prefill segments of the lengths train-router routes (256, 1,024).
  const std::vector<router::SpanShape> fit_shapes = router::CalibrationShapes(c);
  std::vector<router::SpanShape> test_shapes;
  for (Mode m : {Mode::kAttention, Mode::kLinear}) {
    for (int64_t ctx : {max_ctx / 8, max_ctx / 2}) {
      for (int64_t b : {2, 8}) {
        for (int64_t t : {1, 4}) test_shapes.push_back({b, t, ctx, m, /*all_logits=*/true});
      }
      for (int64_t t : {256, 1024}) {
        if (ctx + t <= c.max_position) test_shapes.push_back({1, t, ctx, m});
      }
    }
  }
  std::cerr << "bench cost: measuring " << fit_shapes.size() << " calibration and " << test_shapes.size()
            << " held-out span shapes\n";
  ORYX_ASSIGN_OR_RETURN(std::vector<router::Measurement> fit, router::MeasureSpans(backend, fit_shapes, o.repeats));
  ORYX_ASSIGN_OR_RETURN(router::CostModel model, router::CostModel::Fit(c, fit));
  ORYX_ASSIGN_OR_RETURN(std::vector<router::Measurement> test, router::MeasureSpans(backend, test_shapes, o.repeats));
  // Every shape measured, the calibration's too (marked, so that a fit can be studied offline), and the
  // model's prediction of it.
  auto record = [&](const router::Measurement& m, bool calibration) {
    const double predicted = model.PredictSeconds(m.shape), err = predicted / m.seconds - 1;
    nlohmann::json r = {{"bench", "cost"}, {"mode", ModeName(m.shape.mode)}, {"batch", m.shape.batch},
                        {"tokens", m.shape.tokens}, {"context", m.shape.context},
                        {"all_logits", m.shape.all_logits}, {"measured_ms", m.seconds * 1e3},
                        {"predicted_ms", predicted * 1e3}, {"relative_error", err}};
    if (calibration) r["calibration"] = true;
    emit(r);
    return std::abs(err);
  };
  double fit_sum = 0;
  for (const router::Measurement& m : fit) fit_sum += record(m, true);
  double worst = 0, sum = 0;
  int within = 0;
  for (const router::Measurement& m : test) {
    const double err = record(m, false);
    worst = std::max(worst, err);
    sum += err;
    within += err <= 0.2;
  }
  nlohmann::json summary = {{"bench", "cost"},
                            {"summary", true},
                            {"coefficients", model.ToJson()},
                            {"calibration_shapes", fit.size()},
                            {"calibration_mean_abs_relative_error", fit_sum / fit.size()},
                            {"held_out_shapes", test.size()},
                            {"held_out_within_20_percent", within},
                            {"mean_abs_relative_error", sum / test.size()},
                            {"max_abs_relative_error", worst},
                            {"device", o.device},
                            {"threads", cpu != nullptr ? nlohmann::json(cpu->num_threads()) : nlohmann::json()}};
  summary.update(Provenance());
  emit(summary);
  return absl::OkStatus();
}

}  // namespace oryx::bench
