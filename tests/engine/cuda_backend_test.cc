// The CUDA backend against the CPU backend on the same weights (bf16 checkpoints, so that both see identical
// weights): logits of prefill spans with mixed modes, batched decode steps, verify spans with keep_states
// and Truncate, draft sequences and clones; on random models of both mixers and on models/default; and
// speculative decoding's greedy identity on the GPU. Runs only where a CUDA device is visible.
//
// Tolerance: the CUDA backend rounds every GEMM input (normed activations, gated mixer output, SwiGLU
// output) and the KV cache to bf16 (8-bit mantissa: relative rounding error <= 2^-9 = 0.2%), where the
// CPU backend keeps fp32. Each layer adds such errors in a few places, so a logit row may differ by a few
// tenths of a percent of its scale per layer. We bound the max abs difference of a row by kRelTol times
// the row's largest |logit| (its scale), kRelTol = 3e-2: well above the bf16 rounding the few layers here
// compound, and far below what a wrong kernel gives (a wrong mode, position, state or cache entry moves
// logits by O(scale)).
//
// The random models with long spans get a yardstick, because some of their rows are ill-conditioned:
// perturbing the fp32 model's weights by 2^-9 relative noise (bf16's rounding) moves a few rows' logits by
// ~10% of their scale on the CPU alone. There a GPU row may exceed kRelTol if it stays within 4x of what
// such perturbations (three, with different noise; the largest) do to the same row, measured in the test,
// and the median row error of a long span must stay within 2x of the perturbations'; a wrong kernel's
// errors are O(1) on many rows.
#include "engine/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "engine/tensor_names.h"
#include "gtest/gtest.h"
#include "speculative/speculative.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx {
namespace {

constexpr double kRelTol = 3e-2;

// Weights scaled like a trained model's (matrices uniform in +-1/sqrt(fan_in), norms near 1), stored bf16;
// with `noise` > 0, each then multiplied by (1 + noise * uniform(-1, 1)) and stored fp32 (the yardstick).
std::vector<HostTensor> ScaledTensors(const ModelConfig& config, uint32_t seed, float noise = 0,
                                      uint32_t noise_seed = 0) {
  std::mt19937 rng(seed), noise_rng(seed + 1000 + noise_seed);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::vector<HostTensor> tensors;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    int64_t n = 1;
    for (int64_t d : spec.shape) n *= d;
    std::vector<float> v(n);
    const bool norm = spec.name.find("norm") != std::string::npos;
    const float scale = spec.shape.size() == 2 ? 1.f / std::sqrt(static_cast<float>(spec.shape[1])) : 0.5f;
    for (float& x : v) x = norm ? 1.f + 0.2f * uniform(rng) : scale * uniform(rng);
    if (noise > 0) {
      // The unperturbed model's (bf16) weights, perturbed.
      for (float& x : v) x = Bf16ToFloat(FloatToBf16(x)) * (1.f + noise * uniform(noise_rng));
      tensors.push_back(MakeHostTensor(spec.name, spec.shape, v, DType::kF32));
      continue;
    }
    tensors.push_back(MakeHostTensor(spec.name, spec.shape, v, DType::kBF16));
  }
  return tensors;
}

// Max over rows of max|a - b| / max|b| (b the CPU reference), rows of V logits.
double RowRelError(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t r = 0; r * V < b.size() && r * V < a.size(); ++r) {
    double diff = 0, scale = 1e-6;
    for (int64_t i = 0; i < V; ++i) {
      diff = std::max(diff, std::abs(double(a[r * V + i]) - b[r * V + i]));
      scale = std::max(scale, std::abs(double(b[r * V + i])));
    }
    if (!std::isfinite(diff)) return INFINITY;
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

std::vector<int32_t> Tokens(std::mt19937& rng, int64_t n, int64_t vocab) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

std::vector<Mode> Modes(std::mt19937& rng, int64_t n, double attention) {
  std::vector<Mode> m(n);
  std::bernoulli_distribution coin(attention);
  for (auto& x : m) x = coin(rng) ? Mode::kAttention : Mode::kLinear;
  return m;
}

// Per-row relative errors of [T, V] logits against a reference.
std::vector<double> RowErrors(const std::vector<float>& a, const std::vector<float>& ref, int64_t V) {
  std::vector<double> errs;
  for (size_t t = 0; (t + 1) * V <= ref.size() && (t + 1) * V <= a.size(); ++t) {
    errs.push_back(RowRelError(std::vector<float>(a.begin() + t * V, a.begin() + (t + 1) * V),
                               std::vector<float>(ref.begin() + t * V, ref.begin() + (t + 1) * V), V));
  }
  return errs;
}

// Runs the same scenario on the CPU backend, the CUDA backend and, where given, the yardsticks (the CPU
// model with weights perturbed by 2^-9, see the top), comparing every forward's logits:
//  1. two sequences prefill spans of different lengths with mixed modes (batched, all logits);
//  2. batched decode steps with per-sequence modes;
//  3. a verify span with keep_states, Truncate into it, more decode steps;
//  4. a draft (linear only, no KV) and a clone that continue independently.
// A GPU row passes when its error is below kRelTol, or, with a yardstick, below 4x the yardstick's error
// on that row (a row the fp32 model itself cannot pin down to bf16 precision). Long spans also need a
// median row error within 2x of the yardstick's.
void CompareScenario(Backend& cpu, Backend& gpu, uint32_t seed, int64_t prefill0, int64_t prefill1,
                     std::vector<Backend*> yardsticks = {}) {
  const ModelConfig& c = cpu.config();
  const int64_t V = c.vocab_size;
  std::mt19937 rng(seed);
  std::vector<Backend*> sides = {&cpu, &gpu};
  sides.insert(sides.end(), yardsticks.begin(), yardsticks.end());
  const bool yardstick = !yardsticks.empty();
  std::vector<std::vector<SequenceState>> seqs(sides.size());
  for (size_t i = 0; i < sides.size(); ++i) {
    seqs[i].push_back(sides[i]->NewSequence());
    seqs[i].push_back(sides[i]->NewSequence());
  }
  auto all = [&](std::vector<std::vector<int32_t>> tokens, std::vector<std::vector<Mode>> modes, LogitsRows rows,
                 bool keep, std::vector<std::vector<SequenceState>>& on, const std::string& what) {
    std::vector<std::vector<std::vector<float>>> out(sides.size(), std::vector<std::vector<float>>(2));
    for (size_t i = 0; i < sides.size(); ++i) {
      std::vector<ForwardItem> items;
      for (size_t b = 0; b < 2; ++b) items.push_back({&on[i][b], tokens[b], modes[b], rows, &out[i][b], keep});
      absl::Status s = sides[i]->Forward(items);
      ASSERT_TRUE(s.ok()) << s;
    }
    for (size_t b = 0; b < 2; ++b) {
      EXPECT_EQ(on[1][b].position(), on[0][b].position());
      const std::vector<double> g = RowErrors(out[1][b], out[0][b], V);
      ASSERT_EQ(static_cast<int64_t>(g.size()), rows == LogitsRows::kAll ? static_cast<int64_t>(tokens[b].size()) : 1);
      // The yardstick's error of a row: the largest over its perturbations.
      std::vector<double> y(g.size(), 0.0);
      for (size_t i = 2; i < sides.size(); ++i) {
        const std::vector<double> e = RowErrors(out[i][b], out[0][b], V);
        for (size_t t = 0; t < y.size(); ++t) y[t] = std::max(y[t], e[t]);
      }
      int shown = 0;
      for (size_t t = 0; t < g.size(); ++t) {
        const double bound = std::max(kRelTol, 4 * y[t]);
        if (g[t] < bound) continue;
        const size_t token = rows == LogitsRows::kAll ? t : tokens[b].size() - 1;
        if (shown++ < 8) {
          ADD_FAILURE() << what << ", sequence " << b << ", row " << token
                        << (modes[b][token] == Mode::kAttention ? " (attention)" : " (linear)") << ": relative error "
                        << g[t] << ", bound " << bound << (yardstick ? " (yardstick row error " + std::to_string(y[t]) + ")" : "");
        }
      }
      if (g.size() >= 100) {
        std::vector<double> gs = g, ys = y;
        std::sort(gs.begin(), gs.end());
        std::sort(ys.begin(), ys.end());
        std::printf("%s, sequence %zu: %zu rows: row relative error median / p90 / max: GPU %.3g / %.3g / %.3g, "
                    "yardstick %.3g / %.3g / %.3g\n", what.c_str(), b, gs.size(), gs[gs.size() / 2],
                    gs[gs.size() * 9 / 10], gs.back(), ys[ys.size() / 2], ys[ys.size() * 9 / 10], ys.back());
        if (yardstick) {
          EXPECT_LE(gs[gs.size() / 2], 2 * ys[ys.size() / 2]) << what << ", sequence " << b;
        }
      }
    }
  };
  // 1. Prefill.
  all({Tokens(rng, prefill0, V), Tokens(rng, prefill1, V)}, {Modes(rng, prefill0, 0.5), Modes(rng, prefill1, 0.3)},
      LogitsRows::kAll, false, seqs, "prefill");
  // 2. Decode steps, modes per sequence.
  for (int step = 0; step < 6; ++step) {
    all({Tokens(rng, 1, V), Tokens(rng, 1, V)}, {{step % 2 ? Mode::kAttention : Mode::kLinear}, {Mode::kAttention}},
        LogitsRows::kLast, false, seqs, "decode step " + std::to_string(step));
  }
  // 3. A verify span kept for rollback, truncated to two positions inside it, then decode steps.
  all({Tokens(rng, 5, V), Tokens(rng, 3, V)}, {std::vector<Mode>(5, Mode::kAttention), std::vector<Mode>(3, Mode::kAttention)},
      LogitsRows::kAll, true, seqs, "verify span");
  for (auto& side : seqs) {
    for (int b = 0; b < 2; ++b) {
      const int64_t back = side[b].position() - (b == 0 ? 3 : 1);
      ASSERT_TRUE(side[b].Truncate(back).ok());
    }
  }
  for (int step = 0; step < 3; ++step) {
    all({Tokens(rng, 1, V), Tokens(rng, 2, V)}, {{Mode::kAttention}, {Mode::kLinear, Mode::kAttention}}, LogitsRows::kAll,
        false, seqs, "after truncate " + std::to_string(step));
  }
  // Truncating outside a kept span is refused the same way.
  EXPECT_EQ(seqs[1][0].Truncate(1).code(), seqs[0][0].Truncate(1).code());
  // 4. A draft of sequence 0 and a clone of sequence 1 run on; then the draft is refreshed from its source,
  //    and the originals (left alone by the clones) step on.
  std::vector<std::vector<SequenceState>> drafts(sides.size());
  for (size_t i = 0; i < sides.size(); ++i) {
    drafts[i].push_back(seqs[i][0].MakeDraft());
    drafts[i].push_back(seqs[i][1].Clone());
  }
  for (int step = 0; step < 3; ++step) {
    all({Tokens(rng, 2, V), Tokens(rng, 1, V)}, {{Mode::kLinear, Mode::kLinear}, {Mode::kAttention}}, LogitsRows::kLast,
        false, drafts, "draft/clone " + std::to_string(step));
  }
  for (size_t i = 0; i < sides.size(); ++i) drafts[i][0].CopyRecurrentFrom(seqs[i][0]);
  all({Tokens(rng, 1, V), Tokens(rng, 1, V)}, {{Mode::kLinear}, {Mode::kAttention}}, LogitsRows::kLast, false, drafts,
      "draft refreshed");
  all({Tokens(rng, 1, V), Tokens(rng, 1, V)}, {{Mode::kAttention}, {Mode::kAttention}}, LogitsRows::kLast, false, seqs,
      "original after clone");
}

ModelConfig HeadDim64Config(LinearMixer mixer) {
  ModelConfig c = testutil::TinyConfig(mixer);
  c.vocab_size = 96;
  c.d_model = 128;
  c.n_layers = 3;
  c.n_heads = 2;
  c.head_dim = 64;
  c.mlp_hidden = 256;
  c.max_position = 2048;
  return c;
}

ModelConfig HeadDim128Config(LinearMixer mixer) {
  ModelConfig c = HeadDim64Config(mixer);
  c.head_dim = 128;
  c.n_layers = 2;
  return c;
}

struct Case {
  const char* name;
  ModelConfig config;
  int64_t prefill0, prefill1;
};

class CudaParityTest : public ::testing::TestWithParam<LinearMixer> {};

TEST_P(CudaParityTest, LogitsMatchTheCpuBackendOnRandomModels) {
  ModelConfig tied = testutil::TinyConfig(GetParam(), /*tie_embeddings=*/true);
  ModelConfig silu = testutil::TinyConfig(GetParam());
  silu.conv_activation = ConvActivation::kSilu;
  silu.rope_theta = 0;  // no RoPE
  silu.head_dim = 5;    // odd head_dim (allowed without RoPE): the scalar attention path
  // The head-dim-64 model prefills 600 tokens: attention over more than two 256-key chunks.
  for (const Case& k : {Case{"tiny", testutil::TinyConfig(GetParam()), 12, 7}, Case{"tiny-tied", tied, 9, 1},
                        Case{"tiny-silu-odd", silu, 10, 4}, Case{"dh64", HeadDim64Config(GetParam()), 600, 300},
                        Case{"dh128", HeadDim128Config(GetParam()), 300, 120}}) {
    SCOPED_TRACE(k.name);
    testutil::ScratchDir scratch;
    testutil::WriteTinyCheckpoint(scratch.path(), k.config, ScaledTensors(k.config, 7));
    auto cpu = CpuBackend::Load(scratch.path(), 1);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto gpu = CudaBackend::Load(scratch.path());
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    std::vector<std::unique_ptr<Backend>> yardsticks;
    std::vector<Backend*> views;
    for (uint32_t noise_seed = 0; noise_seed < (k.prefill0 >= 100 ? 3u : 0u); ++noise_seed) {
      testutil::ScratchDir perturbed;
      testutil::WriteTinyCheckpoint(perturbed.path(), k.config, ScaledTensors(k.config, 7, 1.f / 512, noise_seed));
      auto loaded = CpuBackend::Load(perturbed.path(), 1);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      yardsticks.push_back(std::move(*loaded));
      views.push_back(yardsticks.back().get());
    }
    CompareScenario(**cpu, **gpu, 11, k.prefill0, k.prefill1, views);
  }
}

// On the device alone: a 400-token span gives the logits that the same tokens give one decode step at a
// time (same bf16 roundings; only the products' shapes, hence fp32 summation orders, differ).
TEST_P(CudaParityTest, SpanEqualsTokenByTokenOnTheGpu) {
  testutil::ScratchDir scratch;
  const ModelConfig config = HeadDim64Config(GetParam());
  testutil::WriteTinyCheckpoint(scratch.path(), config, ScaledTensors(config, 7));
  auto gpu = CudaBackend::Load(scratch.path());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::mt19937 rng(3);
  const std::vector<int32_t> tokens = Tokens(rng, 400, config.vocab_size);
  const std::vector<Mode> modes = Modes(rng, 400, 0.5);
  SequenceState span = (*gpu)->NewSequence(), steps = (*gpu)->NewSequence();
  std::vector<float> span_logits, step_logits, one;
  ASSERT_TRUE((*gpu)->Forward(span, tokens, modes, true, &span_logits).ok());
  for (size_t t = 0; t < tokens.size(); ++t) {
    ASSERT_TRUE((*gpu)->Forward(steps, std::span(tokens).subspan(t, 1), std::span(modes).subspan(t, 1), false, &one).ok());
    step_logits.insert(step_logits.end(), one.begin(), one.end());
  }
  const double err = RowRelError(step_logits, span_logits, config.vocab_size);
  std::printf("span vs token-by-token on the GPU: max row relative error %.3g\n", err);
  EXPECT_LT(err, kRelTol);
}

TEST_P(CudaParityTest, SpeculativeGreedyOutputEqualsAttentionModeOnTheGpu) {
  testutil::ScratchDir scratch;
  const ModelConfig config = HeadDim64Config(GetParam());
  testutil::WriteTinyCheckpoint(scratch.path(), config, ScaledTensors(config, 3));
  auto gpu = CudaBackend::Load(scratch.path());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  Engine engine(std::move(*gpu), std::nullopt);
  speculative::RegisterPolicies(engine.policies());
  std::mt19937 rng(5);
  std::vector<GenerateRequest> base;
  for (int p = 0; p < 4; ++p) {
    GenerateRequest q;
    q.prompt_tokens = Tokens(rng, 5 + rng() % 40, config.vocab_size);
    for (auto& t : q.prompt_tokens) t = 4 + t % (config.vocab_size - 4);  // no BOS/EOS ids
    q.max_tokens = 32;
    q.stop_at_eos = false;
    q.policy = "attention";
    base.push_back(q);
  }
  auto reference = engine.Generate(base);
  ASSERT_TRUE(reference.ok()) << reference.status();
  int64_t rounds = 0;
  for (const std::string policy : {"speculative:2", "speculative:4", "speculative:8"}) {
    std::vector<GenerateRequest> qs = base;
    for (auto& q : qs) q.policy = policy;
    auto got = engine.Generate(qs);
    ASSERT_TRUE(got.ok()) << got.status();
    for (size_t i = 0; i < qs.size(); ++i) {
      const std::vector<int32_t>& want = (*reference)[i].tokens;
      const std::vector<int32_t>& have = (*got)[i].tokens;
      ASSERT_EQ(have.size(), want.size());
      const auto diverge = std::mismatch(want.begin(), want.end(), have.begin()).first - want.begin();
      if (diverge < static_cast<int64_t>(want.size())) {
        // Allowed only at a near-tie of attention mode's top two logits: a verify span's rows go through
        // products of another shape than a decode step's, which round differently in bf16 (see kRelTol).
        std::vector<int32_t> ctx = qs[i].prompt_tokens;
        ctx.insert(ctx.end(), want.begin(), want.begin() + diverge);
        SequenceState seq = engine.backend().NewSequence();
        std::vector<float> logits;
        ASSERT_TRUE(engine.backend().Forward(seq, ctx, std::vector<Mode>(ctx.size(), Mode::kAttention), false, &logits).ok());
        std::vector<float> sorted = logits;
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
        const float scale = std::max(std::abs(sorted[0]), std::abs(*std::min_element(logits.begin(), logits.end())));
        EXPECT_LT(sorted[0] - sorted[1], 1e-2 * scale) << policy << " prompt " << i << " diverges at " << diverge;
      }
      ASSERT_TRUE((*got)[i].stats.spec.has_value());
      rounds += (*got)[i].stats.spec->rounds;
    }
  }
  EXPECT_GT(rounds, 0);
}

TEST_P(CudaParityTest, BadInputIsRejectedBeforeAnyStateChanges) {
  testutil::ScratchDir scratch;
  const ModelConfig config = testutil::TinyConfig(GetParam());
  testutil::WriteTinyCheckpoint(scratch.path(), config, ScaledTensors(config, 1));
  auto gpu = CudaBackend::Load(scratch.path());
  ASSERT_TRUE(gpu.ok());
  auto cpu = CpuBackend::Load(scratch.path(), 1);
  ASSERT_TRUE(cpu.ok());
  SequenceState seq = (*gpu)->NewSequence();
  std::vector<float> logits;
  std::vector<int32_t> bad = {1, 99};
  std::vector<Mode> modes(2, Mode::kAttention);
  EXPECT_EQ((*gpu)->Forward(seq, bad, modes, false, &logits).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(seq.position(), 0);
  // A device sequence on the CPU backend, and a host sequence on the CUDA backend, are refused.
  std::vector<int32_t> good = {1, 2};
  absl::Status s = (*cpu)->Forward(seq, good, modes, false, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_HAS_SUBSTR(s.message(), "different backend");
  SequenceState host = (*cpu)->NewSequence();
  EXPECT_EQ((*gpu)->Forward(host, good, modes, false, &logits).code(), absl::StatusCode::kInvalidArgument);
  SequenceState draft = seq.MakeDraft();
  EXPECT_EQ((*gpu)->Forward(draft, good, modes, false, &logits).code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Mixers, CudaParityTest, ::testing::Values(LinearMixer::kMamba2, LinearMixer::kGdn),
                         [](const auto& info) { return info.param == LinearMixer::kGdn ? "gdn" : "mamba2"; });

// The trained model (bf16 weights): a 300-token prompt in mixed modes, then decode steps in both modes.
TEST(CudaParity, DefaultModelLogitsMatchTheCpuBackend) {
  const char* src = std::getenv("ORYX_SOURCE_DIR");
  ASSERT_NE(src, nullptr);
  const std::string dir = std::string(src) + "/models/default";
  ASSERT_TRUE(std::filesystem::exists(dir + "/config.json")) << dir;
  auto cpu = CpuBackend::Load(dir, 0);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto gpu = CudaBackend::Load(dir);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  CompareScenario(**cpu, **gpu, 21, 300, 130);
}

}  // namespace
}  // namespace oryx
