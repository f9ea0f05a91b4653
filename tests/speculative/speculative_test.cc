// Speculative decoding on random tiny checkpoints of both mixers: greedy output identical to attention-mode
// decoding, sampled output identically distributed (and wrong accept rules caught by the same test), and
// the state after every possible acceptance count equal to attention-mode decoding's.
#include "speculative/speculative.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>

#include "base/status_macros.h"
#include "engine/cpu_backend.h"
#include "gtest/gtest.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx::speculative {
namespace {

Engine SpeculativeEngine(const testutil::ScratchDir& scratch, LinearMixer mixer, uint32_t seed) {
  Engine engine = testutil::TinyEngine(scratch, mixer, seed);
  RegisterPolicies(engine.policies());
  return engine;
}

std::vector<int32_t> RandomPrompt(std::mt19937& rng, int64_t n, int32_t vocab) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(static_cast<int32_t>(4 + rng() % (vocab - 4)));  // no BOS/EOS ids
  return p;
}

// A request of a random prompt (3 to 12 tokens) generating 14 to 21 tokens under `policy`, EOS ignored.
GenerateRequest RandomRequest(std::mt19937& rng, int32_t vocab, std::string policy) {
  GenerateRequest q;
  q.prompt_tokens = RandomPrompt(rng, 3 + rng() % 10, vocab);
  q.max_tokens = 14 + rng() % 8;
  q.stop_at_eos = false;
  q.policy = std::move(policy);
  return q;
}

// SpeculativeEngine's weights twice: `alone` for attention mode's answers, and `engine` behind HostRoundsBackend
// (`backend`), which runs whole rounds as the CUDA backend does.
struct HostRoundsEngines {
  explicit HostRoundsEngines(LinearMixer mixer)
      : alone(SpeculativeEngine(scratch, mixer, 6)),
        engine(RoundsEngine()),
        vocab(static_cast<int32_t>(engine.backend().config().vocab_size)) {}
  Engine RoundsEngine() {
    auto inner = CpuBackend::Load(scratch.Join("m6"), /*threads=*/1);
    if (!inner.ok()) {
      ADD_FAILURE() << inner.status();
      std::abort();
    }
    auto rounds = std::make_unique<testutil::HostRoundsBackend>(std::move(*inner));
    backend = rounds.get();
    Engine e(std::move(rounds), std::nullopt);
    RegisterPolicies(e.policies());
    return e;
  }
  testutil::ScratchDir scratch;
  Engine alone;
  testutil::HostRoundsBackend* backend = nullptr;
  Engine engine;
  int32_t vocab;
};

// Request i's tokens in `got` are those `alone` generates for it in attention mode.
void ExpectAttentionModesTokens(Engine& alone, const std::vector<GenerateRequest>& qs,
                                const std::vector<GenerateResult>& got, const std::vector<size_t>& which) {
  for (size_t i : which) {
    GenerateRequest attention = qs[i];
    attention.policy = "attention";
    auto want = alone.Generate(attention);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got[i].tokens, want->tokens) << "request " << i;
  }
}

// Attention-mode logits of every position of `tokens` (one forward from a fresh sequence).
std::vector<float> AttentionLogits(Backend& backend, const std::vector<int32_t>& tokens) {
  SequenceState seq = backend.NewSequence();
  std::vector<Mode> modes(tokens.size(), Mode::kAttention);
  std::vector<float> logits;
  EXPECT_TRUE(backend.Forward(seq, tokens, modes, true, &logits).ok());
  return logits;
}

double TopTwoMargin(std::span<const float> row) {
  std::vector<float> r(row.begin(), row.end());
  std::partial_sort(r.begin(), r.begin() + 2, r.end(), std::greater<>());
  return r[0] - r[1];
}

class SpeculativeTest : public ::testing::TestWithParam<LinearMixer> {};

TEST_P(SpeculativeTest, GreedyOutputEqualsAttentionModeTokenForToken) {
  testutil::ScratchDir scratch;
  for (uint32_t model_seed : {1u, 2u}) {
    Engine engine = SpeculativeEngine(scratch, GetParam(), model_seed);
    const int32_t V = static_cast<int32_t>(engine.backend().config().vocab_size);
    std::mt19937 rng(model_seed);
    std::vector<GenerateRequest> base;
    for (int p = 0; p < 6; ++p) {
      GenerateRequest q;
      q.prompt_tokens = RandomPrompt(rng, 1 + rng() % 12, V);
      q.max_tokens = 24;
      q.stop_at_eos = false;
      base.push_back(q);
    }
    for (auto& q : base) q.policy = "attention";
    auto reference = engine.Generate(base);
    ASSERT_TRUE(reference.ok()) << reference.status();
    for (const std::string policy : {"speculative:1", "speculative:2", "speculative:4", "speculative:8", "speculative",
                                     "speculative:ngram:3"}) {
      for (size_t batch : {size_t{1}, base.size()}) {
        for (size_t first = 0; first < base.size(); first += batch) {
          std::vector<GenerateRequest> qs(base.begin() + first, base.begin() + first + batch);
          for (auto& q : qs) q.policy = policy;
          auto got = engine.Generate(qs);
          ASSERT_TRUE(got.ok()) << got.status();
          for (size_t i = 0; i < batch; ++i) {
            const std::vector<int32_t>& want = (*reference)[first + i].tokens;
            const std::vector<int32_t>& have = (*got)[i].tokens;
            ASSERT_EQ(have.size(), want.size()) << policy;
            const auto diverge = std::mismatch(want.begin(), want.end(), have.begin()).first - want.begin();
            if (diverge == static_cast<int64_t>(want.size())) continue;
            // Allowed only at a near-tie of the reference's top two logits.
            std::vector<int32_t> ctx = qs[i].prompt_tokens;
            ctx.insert(ctx.end(), want.begin(), want.begin() + diverge);
            const std::vector<float> logits = AttentionLogits(engine.backend(), ctx);
            EXPECT_LT(TopTwoMargin(std::span(logits).last(V)), 1e-4)
                << policy << " batch " << batch << " prompt " << first + i << " diverges at " << diverge;
          }
          if (policy.starts_with("speculative:") && policy != "speculative:ngram:3") {
            for (const GenerateResult& r : *got) {
              ASSERT_TRUE(r.stats.spec.has_value());
              const SpecStats& sp = *r.stats.spec;
              EXPECT_GT(sp.rounds, 0);
              EXPECT_LE(sp.accepted, sp.drafted);
              // The rounds by draft length account for every round and every draft, each with its time.
              int64_t rounds = 0, drafted = 0;
              for (size_t k = 0; k < sp.rounds_by_length.size(); ++k) {
                rounds += sp.rounds_by_length[k];
                drafted += static_cast<int64_t>(k) * sp.rounds_by_length[k];
                EXPECT_EQ(sp.rounds_by_length[k] > 0, sp.round_s_by_length[k] > 0) << policy << " k " << k;
              }
              EXPECT_EQ(rounds, sp.rounds) << policy;
              EXPECT_EQ(drafted, sp.drafted) << policy;
            }
          }
        }
      }
    }
  }
}

// Proposes the first `good` tokens of a known continuation, then deliberately wrong tokens.
class ScriptedProposer final : public Proposer {
 public:
  ScriptedProposer(std::vector<int32_t> continuation, int64_t good, int32_t vocab)
      : continuation_(std::move(continuation)), good_(good), vocab_(vocab) {}
  std::string_view name() const override { return "scripted"; }
  void Propose(const DecodeSlot&, int64_t k, Proposal& out) override {
    out = {};
    for (int64_t j = 0; j < k; ++j) out.tokens.push_back(j < good_ ? continuation_[j] : (continuation_[j] + 1) % vocab_);
  }

 private:
  std::vector<int32_t> continuation_;
  int64_t good_;
  int32_t vocab_;
};

// The greedy attention-mode continuation of `prompt`: n tokens.
std::vector<int32_t> GreedyContinuation(Engine& engine, const std::vector<int32_t>& prompt, int64_t n) {
  GenerateRequest q;
  q.prompt_tokens = prompt;
  q.max_tokens = n;
  q.stop_at_eos = false;
  auto ref = engine.Generate(q);
  EXPECT_TRUE(ref.ok()) << ref.status();
  return ref.ok() ? ref->tokens : std::vector<int32_t>{};
}

// A greedy decode slot on a sequence that has run `prompt` in attention mode, its pending token `first`.
struct PrefilledSlot {
  PrefilledSlot(Backend& backend, const std::vector<int32_t>& prompt, int32_t first)
      : seq(backend.NewSequence()),
        generated{first},
        slot{0, &seq, first, static_cast<int64_t>(prompt.size()), &prompt, &generated, 100, &sampler, &stats, {}} {
    std::vector<Mode> modes(prompt.size(), Mode::kAttention);
    std::vector<float> logits;
    prefilled = backend.Forward(seq, prompt, modes, false, &logits);
  }
  SequenceState seq;
  Sampler sampler{SamplingParams{}};
  GenerateStats stats;
  std::vector<int32_t> generated;
  DecodeSlot slot;
  absl::Status prefilled;
};

TEST_P(SpeculativeTest, AfterARoundTheStateIsAttentionDecodingsForEveryAcceptanceCount) {
  testutil::ScratchDir scratch;
  Engine engine = SpeculativeEngine(scratch, GetParam(), 9);
  Backend& backend = engine.backend();
  const int32_t V = static_cast<int32_t>(backend.config().vocab_size);
  std::mt19937 rng(4);
  const std::vector<int32_t> prompt = RandomPrompt(rng, 7, V);
  // The greedy attention-mode continuation after the prompt: pending x, then its k successors.
  const int64_t k = 5;
  const std::vector<int32_t> cont = GreedyContinuation(engine, prompt, k + 2);  // cont[0] = x
  ASSERT_EQ(static_cast<int64_t>(cont.size()), k + 2);
  const std::vector<int32_t> probe = {5, 6, 7};
  const std::vector<Mode> probe_modes = {Mode::kAttention, Mode::kLinear, Mode::kAttention};
  for (int64_t good = 0; good <= k; ++good) {
    PrefilledSlot p(backend, prompt, cont[0]);
    ASSERT_TRUE(p.prefilled.ok()) << p.prefilled;
    SequenceState& seq = p.seq;
    DecodeSlot& slot = p.slot;
    const GenerateStats& stats = p.stats;
    std::vector<float> logits;
    SpeculativeOptions options;
    options.k = k;
    SpeculativeDecoder decoder(
        std::make_unique<ScriptedProposer>(std::vector<int32_t>(cont.begin() + 1, cont.end()), good, V), options);
    DecodeSlot* slots[] = {&slot};
    ASSERT_TRUE(decoder.Round(backend, slots, {}).ok());
    ASSERT_EQ(static_cast<int64_t>(slot.emitted.size()), good + 1) << "accepted " << good;
    EXPECT_EQ(slot.emitted.back(), cont[good + 1]);  // recovered (or bonus) token = attention's next
    EXPECT_EQ(seq.position(), static_cast<int64_t>(prompt.size()) + 1 + good);
    // Attention-mode decoding of the committed tokens: prompt, x, the accepted drafts.
    SequenceState want = backend.NewSequence();
    std::vector<int32_t> committed = prompt;
    committed.insert(committed.end(), cont.begin(), cont.begin() + 1 + good);
    std::vector<Mode> want_modes(committed.size(), Mode::kAttention);
    ASSERT_TRUE(backend.Forward(want, committed, want_modes, false, &logits).ok());
    std::vector<float> a, b;
    ASSERT_TRUE(backend.Forward(seq, probe, probe_modes, true, &a).ok());
    ASSERT_TRUE(backend.Forward(want, probe, probe_modes, true, &b).ok());
    ASSERT_EQ(a.size(), b.size());
    float worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
    EXPECT_LE(worst, 1e-5f) << "accepted " << good;
    EXPECT_EQ(stats.spec->accepted, good);
    EXPECT_EQ(stats.spec->drafted, k);
  }
}

// A round of draft length 0 for every slot is a plain attention-mode step: the backend draws the next
// token, the state is attention decoding's, and it counts as a round with nothing drafted.
TEST_P(SpeculativeTest, RoundsWithoutDraftsAreAttentionSteps) {
  testutil::ScratchDir scratch;
  Engine engine = SpeculativeEngine(scratch, GetParam(), 9);
  Backend& backend = engine.backend();
  const int32_t V = static_cast<int32_t>(backend.config().vocab_size);
  std::mt19937 rng(6);
  const std::vector<int32_t> prompt = RandomPrompt(rng, 7, V);
  const std::vector<int32_t> ref = GreedyContinuation(engine, prompt, 4);
  ASSERT_EQ(ref.size(), 4u);
  PrefilledSlot p(backend, prompt, ref[0]);
  ASSERT_TRUE(p.prefilled.ok()) << p.prefilled;
  SpeculativeDecoder decoder(std::make_unique<LinearProposer>(), SpeculativeOptions{});
  DecodeSlot* slots[] = {&p.slot};
  const int64_t no_drafts[] = {0};
  for (int step = 1; step < 4; ++step) {
    ASSERT_TRUE(decoder.Round(backend, slots, no_drafts).ok());
    ASSERT_EQ(p.slot.emitted, std::vector<int32_t>{ref[step]}) << "step " << step;
    p.generated.push_back(p.slot.emitted[0]);
    p.slot.pending = p.slot.emitted[0];
  }
  EXPECT_EQ(p.seq.position(), static_cast<int64_t>(prompt.size()) + 3);
  EXPECT_EQ(p.stats.spec->rounds, 3);
  EXPECT_EQ(p.stats.spec->drafted, 0);
  EXPECT_EQ(p.stats.spec->rounds_by_length.at(0), 3);  // three plain steps
  EXPECT_EQ(p.stats.attention_tokens, 3);
  EXPECT_EQ(p.stats.linear_tokens, 0);
}

// ---- lossless sampling ----------------------------------------------------------------------------------

// The chi-square upper 0.1% point for df degrees of freedom (Wilson-Hilferty).
double ChiSquareCritical(int df) {
  const double z = 3.0902, a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

// Chi-square statistic of counts against exact probabilities, cells with expected count < 5 pooled.
std::pair<double, int> ChiSquare(const std::vector<int64_t>& counts, const std::vector<double>& probs, int64_t n) {
  double stat = 0, pooled_e = 0, pooled_o = 0;
  int cells = 0;
  for (size_t v = 0; v < probs.size(); ++v) {
    const double e = probs[v] * n;
    if (e < 5) {
      pooled_e += e, pooled_o += counts[v];
      continue;
    }
    stat += (counts[v] - e) * (counts[v] - e) / e;
    ++cells;
  }
  if (pooled_e > 0) stat += (pooled_o - pooled_e) * (pooled_o - pooled_e) / std::max(pooled_e, 1e-9), ++cells;
  return {stat, cells - 1};
}

// The exact attention-mode distribution of the 2nd and 3rd sampled tokens after `prompt` (temperature 1).
std::array<std::vector<double>, 2> ExactMarginals(Backend& backend, const std::vector<int32_t>& prompt) {
  const int32_t V = static_cast<int32_t>(backend.config().vocab_size);
  Sampler s(SamplingParams{1.f, 0, 1.f, 0});
  auto dist = [&](const std::vector<int32_t>& ctx) {
    std::vector<float> logits = AttentionLogits(backend, ctx), p;
    s.Distribution(std::span(logits).last(V), &p);
    return p;
  };
  std::array<std::vector<double>, 2> out = {std::vector<double>(V), std::vector<double>(V)};
  const std::vector<float> p1 = dist(prompt);
  for (int32_t a = 0; a < V; ++a) {
    std::vector<int32_t> ctx = prompt;
    ctx.push_back(a);
    const std::vector<float> p2 = dist(ctx);
    for (int32_t b = 0; b < V; ++b) {
      out[0][b] += double{p1[a]} * p2[b];
      ctx.push_back(b);
      const std::vector<float> p3 = dist(ctx);
      ctx.pop_back();
      for (int32_t c = 0; c < V; ++c) out[1][c] += double{p1[a]} * p2[b] * p3[c];
    }
  }
  return out;
}

// Samples n continuations of 3 tokens with `policy` and tests tokens 2 and 3 against the exact marginals;
// true when both pass at the 0.1% level.
bool SamplesMatchAttentionMode(Engine& engine, const std::vector<int32_t>& prompt, const std::string& policy,
                               const std::array<std::vector<double>, 2>& exact, int64_t n) {
  const int32_t V = static_cast<int32_t>(engine.backend().config().vocab_size);
  std::array<std::vector<int64_t>, 2> counts = {std::vector<int64_t>(V), std::vector<int64_t>(V)};
  std::vector<GenerateRequest> qs;
  for (int64_t i = 0; i < n; ++i) {
    GenerateRequest q;
    q.prompt_tokens = prompt;
    q.max_tokens = 3;
    q.stop_at_eos = false;
    q.policy = policy;
    q.sampling = {1.f, 0, 1.f, static_cast<uint64_t>(1000 + i)};
    qs.push_back(q);
  }
  auto got = engine.Generate(qs);
  EXPECT_TRUE(got.ok()) << got.status();
  for (const GenerateResult& r : *got) {
    EXPECT_EQ(r.tokens.size(), 3u);
    ++counts[0][r.tokens[1]];
    ++counts[1][r.tokens[2]];
  }
  bool pass = true;
  for (int j = 0; j < 2; ++j) {
    auto [stat, df] = ChiSquare(counts[j], exact[j], n);
    pass &= stat < ChiSquareCritical(df);
  }
  return pass;
}

TEST_P(SpeculativeTest, SampledOutputHasAttentionModesDistributionAndWrongRulesAreCaught) {
  testutil::ScratchDir scratch;
  Engine engine = SpeculativeEngine(scratch, GetParam(), 3);
  const std::vector<int32_t> prompt = {7, 11, 13, 17};
  const auto exact = ExactMarginals(engine.backend(), prompt);
  const int64_t n = 6000;
  EXPECT_TRUE(SamplesMatchAttentionMode(engine, prompt, "attention", exact, n));  // the harness itself
  EXPECT_TRUE(SamplesMatchAttentionMode(engine, prompt, "speculative:2", exact, n));
  EXPECT_TRUE(SamplesMatchAttentionMode(engine, prompt, "speculative:ngram:2", exact, n));

  // Wrong rules on the same test: accepting every draft (output = the linear-mode distribution), and
  // drawing the replacement from p instead of the residual max(0, p - q).
  auto wrong = [&](std::string name, AcceptRule rule) {
    PolicyRegistry& registry = engine.policies();
    registry.Register(name, name, [rule](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
      SpeculativeOptions o;
      o.k = 2;
      o.accept = rule;
      return std::unique_ptr<Decoder>(new SpeculativeDecoder(std::make_unique<LinearProposer>(), o));
    });
    EXPECT_FALSE(SamplesMatchAttentionMode(engine, prompt, name, exact, n)) << name << " was not caught";
  };
  wrong("accept-all", [](Sampler& s, std::span<const float> logits, const Proposal& d, int64_t V, int32_t* next) {
    std::vector<float> p;
    s.Distribution(logits.subspan(d.tokens.size() * V, V), &p);
    *next = s.Draw(p);
    return static_cast<int64_t>(d.tokens.size());
  });
  wrong("resample-from-p", [](Sampler& s, std::span<const float> logits, const Proposal& d, int64_t V, int32_t* next) {
    std::vector<float> p;
    for (size_t i = 0; i < d.tokens.size(); ++i) {
      s.Distribution(logits.subspan(i * V, V), &p);
      const int32_t t = d.tokens[i];
      if (s.Uniform() < p[t] / d.q[i * V + t]) continue;
      *next = s.Draw(p);  // wrong: should be norm(max(0, p - q))
      return static_cast<int64_t>(i);
    }
    s.Distribution(logits.subspan(d.tokens.size() * V, V), &p);
    *next = s.Draw(p);
    return static_cast<int64_t>(d.tokens.size());
  });
}

// A sampled round run by the decoder (LinearProposer, AcceptLossless) draws exactly UniformsOfSampledRound
// uniforms from the slot's sampler: the count a backend that runs the round itself restores the sampler to.
TEST_P(SpeculativeTest, SampledRoundsUseTheUniformsBackendsRestore) {
  testutil::ScratchDir scratch;
  Engine engine = SpeculativeEngine(scratch, GetParam(), 3);
  Backend& backend = engine.backend();
  const int32_t V = static_cast<int32_t>(backend.config().vocab_size);
  std::mt19937 rng(8);
  const std::vector<int32_t> prompt = RandomPrompt(rng, 9, V);
  SequenceState seq = backend.NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(backend.Forward(seq, prompt, std::vector<Mode>(prompt.size(), Mode::kAttention), false, &logits).ok());
  Sampler sampler(SamplingParams{1.0f, 0, 1.f, 12});
  GenerateStats stats;
  std::vector<int32_t> generated = {sampler.Next(logits)};
  DecodeSlot slot{0, &seq, generated[0], static_cast<int64_t>(prompt.size()), &prompt, &generated, 1000, &sampler,
                  &stats, {}};
  const int64_t k = 3;
  SpeculativeOptions options;
  options.k = k;
  SpeculativeDecoder decoder(std::make_unique<LinearProposer>(), options);
  DecodeSlot* slots[] = {&slot};
  std::vector<int64_t> seen(k + 1, 0);  // rounds by accepted count
  const int64_t max_position = backend.config().max_position;
  int round = 0;
  for (; seq.position() + 1 < max_position; ++round) {  // (the decoder's contract: room for the pending token)
    const Sampler before = sampler;
    const int64_t drafted_before = stats.spec ? stats.spec->drafted : 0;
    ASSERT_TRUE(decoder.Round(backend, slots, {}).ok());
    // (Near max_position a round drafts fewer than k.)
    const int64_t drafted = stats.spec->drafted - drafted_before;
    const int64_t accepted = static_cast<int64_t>(slot.emitted.size()) - 1;
    ++seen[accepted];
    Sampler expected = before;
    expected.SkipUniforms(UniformsOfSampledRound(drafted, accepted));
    Sampler actual = sampler;
    ASSERT_EQ(expected.Uniform(), actual.Uniform()) << "round " << round << ", " << accepted << " accepted";
    generated.insert(generated.end(), slot.emitted.begin(), slot.emitted.end());
    slot.pending = slot.emitted.back();
  }
  EXPECT_GE(round, 8);
  // Both endings occurred: a rejection (the recovered token's uniform) and all k accepted (the bonus token's).
  EXPECT_GT(seen[0] + seen[1] + seen[2], 0);
  EXPECT_GT(seen[k], 0);
}

TEST(SpeculativePolicy, NamesParseAndBadOnesAreErrors) {
  for (const char* ok : {"speculative", "speculative:4", "speculative:ngram", "speculative:ngram:2"}) {
    EXPECT_TRUE(MakeSpeculativeDecoder(ok).ok()) << ok;
  }
  for (const char* bad : {"speculative:0", "speculative:x", "speculative:ngram:", "speculative:65", "speculative:4:4"}) {
    EXPECT_EQ(MakeSpeculativeDecoder(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// The controller picks the draft length that maximises expected tokens per second from the round times it
// is fed (fitted as base + per_draft * k, whichever way the rounds ran) and the acceptance it observes.
// Rounds are simulated: each draft accepted with probability `accept` until the first rejection; the choices
// of the last 500 of 1000 rounds are returned.
std::vector<int64_t> SimulatedChoices(double accept, const std::function<double(int64_t k, int round)>& round_s) {
  DraftLengthController controller(8);
  std::mt19937 rng(17);
  std::bernoulli_distribution accepted_draft(accept);
  std::vector<int64_t> chosen;
  const int64_t slot = 0;
  for (int round = 0; round < 1000; ++round) {
    const int64_t k = controller.Choose(std::span(&slot, 1));
    int64_t accepted = 0;
    while (accepted < k && accepted_draft(rng)) ++accepted;
    controller.RecordRound(0, k, accepted);
    controller.RecordCost(k, round_s(k, round));
    if (round >= 500) chosen.push_back(k);  // the last 500 rounds
  }
  return chosen;
}

// Rounds that cost base + per_draft * k, and plain steps plain_s (< 0: the line's base).
std::vector<int64_t> SimulatedChoices(double accept, double base_s, double per_draft_s, double plain_s = -1) {
  return SimulatedChoices(accept, [=](int64_t k, int) {
    return k == 0 && plain_s >= 0 ? plain_s : base_s + per_draft_s * static_cast<double>(k);
  });
}

TEST(DraftLengthController, ChoosesTheDraftLengthTheRoundTimesAndAcceptanceFavour) {
  auto mean = [](const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
  auto zeros = [](const std::vector<int64_t>& v) { return std::count(v.begin(), v.end(), int64_t{0}); };
  // Acceptance 0.9, a verify base of 3 draft steps: expected tokens per unit of time peak at k = 4..5
  // (0.585, 0.586; k = 2: 0.542, k = 1: 0.475, no drafts: 0.333).
  const std::vector<int64_t> good = SimulatedChoices(0.9, 3e-3, 1e-3);
  // (Over seeds 1..17 the mean was 3.3-4.4; without the probes past the chosen length a few early
  // rejections left the estimates of positions 3 and 4 low for good, and it stayed at 2.)
  EXPECT_LE(zeros(good), 8);  // the plain-step probes only, every 64th round
  EXPECT_GE(mean(good), 3.0);
  // Acceptance 0.2: no drafts wins (0.333 against 0.300 at k = 1); only the probes (k = 2, every 16th
  // round) remain.
  const std::vector<int64_t> poor = SimulatedChoices(0.2, 3e-3, 1e-3);
  EXPECT_GE(zeros(poor), 440);
  // Drafts nearly free against the verify: long drafts win even at acceptance 0.5 (the rate peaks at k = 5,
  // and k = 4..7 are within 1% of it; no drafts: 0.1, a fifth of it).
  const std::vector<int64_t> cheap = SimulatedChoices(0.5, 10e-3, 0.1e-3);
  EXPECT_LE(zeros(cheap), 8);
  EXPECT_GE(mean(cheap), 4.0);
  // A plain step cheaper than a verify's base (3 against 4.5 draft steps, as a batch of 8 on the GPU, where
  // a plain step takes the fused single-token path): at acceptance 0.6 plain decoding wins (333 tokens per
  // second against 301 at k = 2 and 291 at k = 1). A line through the drafting rounds would put k = 0 at
  // 4.5 ms and keep drafting; the plain step's own measurement does not.
  const std::vector<int64_t> plain_wins = SimulatedChoices(0.6, 4.5e-3, 1e-3, 3e-3);
  EXPECT_GE(zeros(plain_wins), 440);
  // At acceptance 0.9 drafting still wins there (k = 4: 482 against 333).
  const std::vector<int64_t> drafts_win = SimulatedChoices(0.9, 4.5e-3, 1e-3, 3e-3);
  EXPECT_LE(zeros(drafts_win), 8);
  EXPECT_GE(mean(drafts_win), 3.0);
}

// Round times that are not a line in k, and a start that misleads. The times are those of the H200 at 16K
// tokens and batch 64 (the server's rounds, 2026-12-03): a verify of 2 rows reads the KV cache at a decode
// step's rate (4.3 ms for k = 1, 4.1 ms for a plain step), one of 3 rows takes a slower kernel (6.6 ms), and
// each further draft adds 0.45 ms (k = 8: 9.3 ms). For the first 200 rounds prompts are arriving: each of
// a round's k + 1 forwards also carries a 3 ms prefill chunk. At acceptance 0.95, k = 8 gives 0.79 tokens
// per ms once the prompts are in, k = 1 0.45. A line fitted through rounds of 1 and 2 drafts only (what
// probes of one past the chosen length measure) puts k = 8 at 18 ms and keeps k = 1; the controller has
// to measure long rounds again, and keep each length's own time.
TEST(DraftLengthController, FindsLongDraftsWhenRoundTimesAreNotALine) {
  auto true_s = [](int64_t k) { return k == 0 ? 4.1e-3 : k == 1 ? 4.3e-3 : 6.6e-3 + 0.45e-3 * (k - 2); };
  const std::vector<int64_t> chosen =
      SimulatedChoices(0.95, [&](int64_t k, int round) { return true_s(k) + (round < 200 ? 3e-3 * (k + 1) : 0.0); });
  auto rate = [&](int64_t k) {
    double tokens = 0;
    for (int64_t i = 0; i <= k; ++i) tokens += std::pow(0.95, static_cast<double>(i));
    return tokens / true_s(k);
  };
  double achieved = 0;
  for (int64_t k : chosen) achieved += rate(k) / rate(8);
  EXPECT_GE(achieved / chosen.size(), 0.9);
}

// A batch gets one draft length: the one that maximises its slots' expected tokens together. A slot that
// drafts well and one that drafts badly (0.9 and 0.2, verify base 3 draft steps) share k = 1..3 (tokens per
// unit of time: k = 2 0.790, k = 3 0.781, k = 1 0.775, k = 4 0.764, no drafts 0.667), where alone they would
// take 4..5 and 0. The lengths within 2% of the best are not told apart by acceptance estimates of about
// ten rounds' memory (over seeds 1-20 the mean length was 1.1-1.9), so the test holds the rate they give.
// A slot that joins later (a server's) neither restarts the measuring rounds nor splits the batch.
TEST(DraftLengthController, OneDraftLengthForTheBatchFromEverySlotsAcceptance) {
  DraftLengthController controller(8);
  std::mt19937 rng(5);
  const double accept[] = {0.9, 0.2};
  std::vector<int64_t> ids = {0, 1}, chosen;
  for (int round = 0; round < 1000; ++round) {
    const int64_t k = controller.Choose(ids);
    for (int64_t id : ids) {
      std::bernoulli_distribution accepted_draft(accept[id % 2]);
      int64_t accepted = 0;
      while (accepted < k && accepted_draft(rng)) ++accepted;
      controller.RecordRound(id, k, accepted);
    }
    controller.RecordCost(k, 3e-3 + 1e-3 * static_cast<double>(k));
    if (round >= 500) chosen.push_back(k);
  }
  // Expected tokens per unit of time of a round of length k, from the true acceptances.
  auto rate = [&](int64_t k) {
    double tokens = 0;
    for (double a : accept) {
      for (int64_t i = 0; i <= k; ++i) tokens += std::pow(a, static_cast<double>(i));
    }
    return tokens / (3.0 + static_cast<double>(k));
  };
  double achieved = 0;
  for (int64_t k : chosen) achieved += rate(k) / rate(2);
  EXPECT_GE(achieved / chosen.size(), 0.97);
  EXPECT_LE(std::count(chosen.begin(), chosen.end(), int64_t{0}), 25);
  // A fresh slot joins: the batch keeps a measured length, not the max_k of a first round.
  controller.Release(1);
  ids = {0, 2};
  EXPECT_LT(controller.Choose(ids), 8);
}

// Requests under attention, linear and speculative policies (linear drafts of fixed and adaptive length,
// n-gram drafts) decode in one batch: every step of the batch is one forward, whatever the mix of policies
// and round phases it holds, and each request gets the tokens it gets alone.
TEST_P(SpeculativeTest, MixedPoliciesShareEveryStepsForward) {
  testutil::ScratchDir scratch;
  Engine alone = SpeculativeEngine(scratch, GetParam(), 5);
  auto inner = CpuBackend::Load(scratch.Join("m5"), /*threads=*/1);
  ASSERT_TRUE(inner.ok()) << inner.status();
  auto counting = std::make_unique<testutil::CountingBackend>(std::move(*inner));
  testutil::CountingBackend& counted = *counting;
  Engine engine(std::move(counting), std::nullopt);
  RegisterPolicies(engine.policies());
  const int32_t V = static_cast<int32_t>(engine.backend().config().vocab_size);
  std::mt19937 rng(11);
  GenerationBatch batch(engine);
  std::vector<GenerateRequest> qs;
  for (const char* policy : {"attention", "speculative:3", "linear", "speculative", "speculative:ngram:2",
                             "speculative:5", "prefill-linear"}) {
    qs.push_back(RandomRequest(rng, V, policy));
  }
  int64_t before = 0;
  const std::vector<GenerateResult> got = testutil::RunJoining(batch, qs, 3, [&](size_t step) {
    EXPECT_EQ(counted.forwards - before, 1) << "step " << step;
    before = counted.forwards;
  });
  ASSERT_EQ(got.size(), qs.size());
  for (size_t i = 0; i < qs.size(); ++i) {
    auto want = alone.Generate(qs[i]);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got[i].tokens, want->tokens) << qs[i].policy;
    if (qs[i].policy.starts_with("speculative:") && qs[i].policy != "speculative:ngram:2") {
      ASSERT_TRUE(got[i].stats.spec.has_value()) << qs[i].policy;
      EXPECT_GT(got[i].stats.spec->drafted, 0) << qs[i].policy;
    }
  }
}

// Penalties and biases would change the distributions a round judges its drafts against: refused.
TEST(SpeculativePolicy, PenaltiesAreRefusedNotIgnored) {
  testutil::ScratchDir scratch;
  Engine engine = SpeculativeEngine(scratch, LinearMixer::kMamba2, 2);
  GenerateRequest q;
  q.prompt_tokens = {5, 6, 7};
  q.max_tokens = 4;
  q.policy = "speculative:3";
  q.sampling.frequency_penalty = 1.f;
  auto r = engine.Generate(q);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("not built for the 'speculative:3' policy"), std::string::npos);
  q.policy = "attention";
  EXPECT_TRUE(engine.Generate(q).ok());
}

// Log-probabilities are attention mode's whatever was drafted: a greedy speculative request reports what the
// same request reports under the attention policy.
TEST_P(SpeculativeTest, LogprobsOfSpeculativeRequestsAreAttentionModes) {
  testutil::ScratchDir scratch;
  Engine engine = SpeculativeEngine(scratch, GetParam(), 6);
  const int32_t V = static_cast<int32_t>(engine.backend().config().vocab_size);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 3; ++trial) {
    GenerateRequest q = RandomRequest(rng, V, "attention");
    q.logprobs = 2;
    testutil::ExpectSpeculativeLogprobsAreAttentions(engine, q, "speculative:3", 1e-5);
    auto want = engine.Generate(q);
    ASSERT_TRUE(want.ok());
    q.policy = "speculative:3";
    // Streamed: each token's comes with it, scored as the rounds commit several at a time.
    std::vector<double> seen;
    q.on_token = [&](const TokenEvent& e) {
      if (e.logprob != nullptr) seen.push_back(*e.logprob->logprob);
      return true;
    };
    auto streamed = engine.Generate(q);
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    ASSERT_EQ(seen.size(), want->logprobs.size());
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_NEAR(seen[i], *want->logprobs[i].logprob, 1e-5) << "token " << i;
  }
}

// Greedy speculative requests joining a running batch on a backend that runs whole rounds: each request gets
// attention mode's tokens, the rounds run on the backend (prompts' spans are forwarded apart from them), and
// every drafted token is counted.
TEST_P(SpeculativeTest, RoundsRunByTheBackendGiveAttentionModesTokens) {
  HostRoundsEngines e(GetParam());
  Engine &alone = e.alone, &engine = e.engine;
  testutil::HostRoundsBackend& backend = *e.backend;
  const int32_t V = e.vocab;
  std::mt19937 rng(21);
  for (const char* policy : {"speculative:3", "speculative"}) {
    SCOPED_TRACE(policy);
    GenerationBatch batch(engine);
    std::vector<GenerateRequest> qs;
    for (int i = 0; i < 4; ++i) qs.push_back(RandomRequest(rng, V, policy));
    const int64_t rounds_before = backend.rounds;
    const std::vector<GenerateResult> got = testutil::RunJoining(batch, qs, 2, [](size_t) {});
    ASSERT_EQ(got.size(), qs.size());
    EXPECT_GT(backend.rounds, rounds_before);
    ExpectAttentionModesTokens(alone, qs, got, {0, 1, 2, 3});
    int64_t on_backend = 0;
    for (size_t i = 0; i < qs.size(); ++i) {
      ASSERT_TRUE(got[i].stats.spec.has_value());
      const SpecStats& st = *got[i].stats.spec;
      on_backend += st.backend_rounds;
      EXPECT_LE(st.accepted, st.drafted);
      EXPECT_EQ(std::accumulate(st.drafted_at.begin(), st.drafted_at.end(), int64_t{0}), st.drafted);
    }
    EXPECT_GT(on_backend, 0);
  }
}

// Requests made by `make` (vocabulary, policy, max_position) under speculative:3 and adaptive speculative,
// through the engine whose backend runs whole rounds, one joining every `every` steps: each ends at max_tokens
// with attention mode's tokens, and every round that drafted ran whole on the backend (plain steps, k = 0,
// run in the engine's forward). `also` checks a request's stats further.
void ExpectRequestsKeepTheBatchInWholeRounds(
    LinearMixer mixer, size_t every,
    const std::function<std::vector<GenerateRequest>(int32_t, const char*, int64_t)>& make,
    const std::function<void(const char*, size_t, const SpecStats&)>& also) {
  HostRoundsEngines e(mixer);
  for (const char* policy : {"speculative:3", "speculative"}) {
    SCOPED_TRACE(policy);
    GenerationBatch batch(e.engine);
    const std::vector<GenerateRequest> qs = make(e.vocab, policy, e.engine.backend().config().max_position);
    const std::vector<GenerateResult> got = testutil::RunJoining(batch, qs, every, [](size_t) {});
    ASSERT_EQ(got.size(), qs.size());
    std::vector<size_t> all(qs.size());
    std::iota(all.begin(), all.end(), size_t{0});
    ExpectAttentionModesTokens(e.alone, qs, got, all);
    for (size_t i = 0; i < qs.size(); ++i) {
      EXPECT_EQ(static_cast<int64_t>(got[i].tokens.size()), qs[i].max_tokens) << "request " << i;
      ASSERT_TRUE(got[i].stats.spec.has_value());
      const SpecStats& st = *got[i].stats.spec;
      EXPECT_EQ(st.backend_rounds, st.rounds - st.rounds_by_length.at(0)) << "request " << i;
      // Whether adaptive speculation drafts at all follows the round times it measures (a loaded machine
      // can make a short request's every round plain); a fixed length always drafts.
      if (std::string_view(policy) == "speculative:3") {
        EXPECT_GT(st.backend_rounds, 0) << "request " << i;
      }
      also(policy, i, st);
    }
  }
}

// Requests ending at different lengths keep the batch in whole rounds: a request whose end is within the
// round drafts past it instead of cutting its drafts (which took the batch out of its one draft length, and
// every later round through the engine's steps, one forward each).
TEST_P(SpeculativeTest, RequestsEndingAtDifferentLengthsKeepTheBatchInWholeRounds) {
  std::mt19937 rng(33);
  ExpectRequestsKeepTheBatchInWholeRounds(
      GetParam(), 1,
      [&](int32_t vocab, const char* policy, int64_t) {
        std::vector<GenerateRequest> qs;
        for (int i = 0; i < 4; ++i) {
          qs.push_back(RandomRequest(rng, vocab, policy));
          qs.back().max_tokens = 9 + 4 * i;
        }
        return qs;
      },
      [](const char*, size_t, const SpecStats&) {});
}

// Requests that end at the model's max_position keep the batch in whole rounds too: near the end of the
// context a slot has room for fewer drafts, and the whole batch takes that length for the round, where the
// slot alone taking it sent the batch's other slots into rounds run step by step.
TEST_P(SpeculativeTest, RequestsReachingMaxPositionKeepTheBatchInWholeRounds) {
  std::mt19937 rng(35);
  ExpectRequestsKeepTheBatchInWholeRounds(
      GetParam(), 2,
      [&](int32_t vocab, const char* policy, int64_t max_position) {
        std::vector<GenerateRequest> qs;
        for (int i = 0; i < 3; ++i) {
          qs.push_back(RandomRequest(rng, vocab, policy));
          // The first two end at max_position (their last rounds with room for fewer drafts); the third earlier.
          qs.back().max_tokens = max_position - static_cast<int64_t>(qs.back().prompt_tokens.size()) - (i == 2 ? 9 : 0);
        }
        return qs;
      },
      [](const char* policy, size_t i, const SpecStats& st) {
        // The two that reach max_position had rounds shorter than the policy's length there.
        if (std::string_view(policy) != "speculative:3" || i >= 2) return;
        EXPECT_GT(st.rounds_by_length.at(1) + st.rounds_by_length.at(2), 0) << "request " << i;
      });
}

// A request joining while the batch's rounds run step by step (a sampled request beside greedy ones: rounds
// of one sampling distribution only run whole) takes plain steps until those rounds end, so that the batch's
// rounds stay in step; once the sampled request is done, the greedy ones run whole rounds again.
TEST_P(SpeculativeTest, ARequestJoiningRoundsRunStepByStepWaitsForThemToEnd) {
  HostRoundsEngines e(GetParam());
  Engine &alone = e.alone, &engine = e.engine;
  const int32_t V = e.vocab;
  std::mt19937 rng(34);
  std::vector<GenerateRequest> qs;
  for (int i = 0; i < 3; ++i) qs.push_back(RandomRequest(rng, V, "speculative:3"));
  qs[0].max_tokens = 30;  // greedy, the longest but one
  qs[1].max_tokens = 8;   // sampled: its rounds run step by step
  qs[1].sampling = SamplingParams{1.f, 0, 1.f, 5};
  qs[2].max_tokens = 40;  // greedy, joins while the first two are inside a round
  GenerationBatch batch(engine);
  const std::vector<GenerateResult> got = testutil::RunJoining(batch, qs, 1, [](size_t) {});
  ASSERT_EQ(got.size(), qs.size());
  ExpectAttentionModesTokens(alone, qs, got, {0, 2});
  for (const GenerateResult& r : got) ASSERT_TRUE(r.stats.spec.has_value());
  // The sampled request's rounds ran step by step, and the first request's beside them in step with them; every
  // other round of the first request ran whole (without the wait, the third request's rounds start out of step
  // with the first's and they stay so: one whole round in 24).
  const SpecStats &first = *got[0].stats.spec, &sampled = *got[1].stats.spec;
  EXPECT_EQ(sampled.backend_rounds, 0);
  EXPECT_EQ(first.backend_rounds, first.rounds - sampled.rounds);
}

TEST(NgramProposer, ProposesWhatFollowedTheLatestEarlierMatch) {
  std::vector<int32_t> prompt = {1, 2, 3, 4, 9, 2, 3, 5, 6}, generated = {7, 2, 3};
  DecodeSlot slot{0, nullptr, 3, 9, &prompt, &generated, 10, nullptr, nullptr, {}};
  NgramProposer proposer(3, 1);
  Proposal out;
  // "7 2 3" never occurred; "2 3" did, latest at prompt[5..6], followed by 5 6 7.
  proposer.Propose(slot, 3, out);
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_TRUE(out.q.empty());
}

INSTANTIATE_TEST_SUITE_P(Mixers, SpeculativeTest, ::testing::Values(LinearMixer::kMamba2, LinearMixer::kGdn),
                         [](const auto& info) { return std::string(LinearMixerName(info.param)); });

}  // namespace
}  // namespace oryx::speculative
