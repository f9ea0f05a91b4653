// The generation API on a random tiny checkpoint with a real tokenizer: policies, the sampler, stop
// conditions, streaming, batching, statistics and the errors of bad requests.
#include "engine/engine.h"

#include <cmath>
#include <map>

#include "engine/cpu_backend.h"
#include "engine/checkpoint.h"
#include "engine/mode_policy.h"
#include "gtest/gtest.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/engine/testing_checkpoint.h"
#ifdef ORYX_HAVE_CUDA
#include "kernels/cuda/ops_cuda.h"
#endif

namespace oryx {
namespace {

class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new testutil::ScratchDir();
    model_dir_ = testutil::WriteTinyModelWithTokenizer(*scratch_, 3);
  }
  static void TearDownTestSuite() { delete scratch_; }
  void SetUp() override {
    auto e = Engine::Load(model_dir_, {"cpu", 2});
    ASSERT_TRUE(e.ok()) << e.status();
    engine_.emplace(std::move(*e));
  }
  static GenerateRequest Request(std::string prompt, int64_t max_tokens = 10) {
    GenerateRequest q;
    q.prompt = std::move(prompt);
    q.max_tokens = max_tokens;
    q.stop_at_eos = false;
    return q;
  }
  static testutil::ScratchDir* scratch_;
  static std::string model_dir_;
  std::optional<Engine> engine_;
};
testutil::ScratchDir* EngineTest::scratch_ = nullptr;
std::string EngineTest::model_dir_;

TEST_F(EngineTest, PoliciesSetTheModeOfEveryToken) {
  GenerateRequest q = Request("the quick brown fox", 6);
  const int64_t n = 1 + static_cast<int64_t>(engine_->tokenizer()->Encode(q.prompt).size());
  // Tokens forwarded: the prompt and every generated token but the last (it is never run).
  const int64_t forwarded = n + 5;
  struct Want {
    std::string policy;
    int64_t attention;
  };
  for (const Want& w : {Want{"attention", forwarded}, Want{"linear", 0}, Want{"prefill-linear", 1 + 5},
                        Want{"periodic:3", forwarded / 3}}) {
    q.policy = w.policy;
    auto r = engine_->Generate(q);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->stats.attention_tokens, w.attention) << w.policy;
    EXPECT_EQ(r->stats.attention_tokens + r->stats.linear_tokens, forwarded) << w.policy;
    EXPECT_EQ(r->stats.generated_tokens, 6);
    EXPECT_EQ(r->finish_reason, FinishReason::kLength);
  }
}

TEST_F(EngineTest, SamplingIsReproducibleBySeedAndGreedyIgnoresIt) {
  GenerateRequest q = Request("hello world", 12);
  q.sampling = {1.0f, 0, 1.0f, 7};
  auto a = engine_->Generate(q), b = engine_->Generate(q);
  q.sampling.seed = 8;
  auto c = engine_->Generate(q);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_NE(a->tokens, c->tokens);  // 12 tokens from a 512-way distribution: equal only by a fluke
  q.sampling = {0.f, 0, 1.f, 1};
  auto g1 = engine_->Generate(q);
  q.sampling.seed = 2;
  auto g2 = engine_->Generate(q);
  EXPECT_EQ(g1->tokens, g2->tokens);
}

TEST(Sampler, DistributionAppliesTopKAndTopPAndDrawFollowsIt) {
  const std::vector<float> logits = {2.f, 1.f, 0.f, 3.f, -1.f};
  Sampler s(SamplingParams{1.f, 3, 1.f, 1});
  std::vector<float> p;
  s.Distribution(logits, &p);
  const double z = std::exp(3.) + std::exp(2.) + std::exp(1.);
  EXPECT_NEAR(p[3], std::exp(3.) / z, 1e-6);
  EXPECT_NEAR(p[0], std::exp(2.) / z, 1e-6);
  EXPECT_EQ(p[2], 0.f);
  EXPECT_EQ(p[4], 0.f);
  Sampler nucleus(SamplingParams{1.f, 0, 0.5f, 1});
  nucleus.Distribution(logits, &p);  // token 3 alone has 0.64 of the mass
  EXPECT_EQ(p[3], 1.f);
  // Draw: frequencies follow the distribution.
  Sampler d(SamplingParams{1.f, 0, 1.f, 42});
  const std::vector<float> probs = {0.1f, 0.f, 0.6f, 0.3f};
  std::map<int32_t, int> counts;
  for (int i = 0; i < 20000; ++i) ++counts[d.Draw(probs)];
  EXPECT_EQ(counts[1], 0);
  EXPECT_NEAR(counts[2] / 20000.0, 0.6, 0.02);
  EXPECT_NEAR(counts[0] / 20000.0, 0.1, 0.02);
}

// PeekUniforms shows the stream's next uniforms without moving it; SkipUniforms(n) moves it as n draws do.
TEST(Sampler, PeekShowsTheNextUniformsAndSkipPassesThem) {
  Sampler sampler(SamplingParams{.temperature = 1.f, .seed = 11}), drawn = sampler;
  std::vector<double> peeked(5);
  sampler.PeekUniforms(peeked);
  for (double u : peeked) EXPECT_EQ(u, drawn.Uniform());
  EXPECT_EQ(sampler.Uniform(), peeked[0]);  // peeking did not move the stream
  sampler.SkipUniforms(3);
  EXPECT_EQ(sampler.Uniform(), peeked[4]);
}

TEST(Sampler, BadValuesAreErrors) {
  EXPECT_FALSE(ValidateSampling({-1.f, 0, 1.f, 0}).ok());
  EXPECT_FALSE(ValidateSampling({NAN, 0, 1.f, 0}).ok());
  EXPECT_FALSE(ValidateSampling({1.f, -2, 1.f, 0}).ok());
  EXPECT_FALSE(ValidateSampling({1.f, 0, 0.f, 0}).ok());
  EXPECT_FALSE(ValidateSampling({1.f, 0, 1.5f, 0}).ok());
  EXPECT_TRUE(ValidateSampling({0.7f, 40, 0.9f, 0}).ok());
}

// Penalties and biases change the logits before sampling: by the recorded tokens' counts (presence: once per
// token seen; frequency: per occurrence) and by the biases, greedy or sampled.
TEST(Sampler, PenaltiesAndBiasesAdjustTheLogitsByTheRecordedTokens) {
  const std::vector<float> logits = {2.f, 1.f, 0.f, 3.f, -1.f};
  SamplingParams params{.temperature = 1.f, .seed = 1};
  params.presence_penalty = 0.5f;
  params.frequency_penalty = 0.25f;
  params.logit_bias = {{4, 2.f}};
  Sampler s(params);
  s.Record(3);
  s.Record(3);
  s.Record(0);
  // Adjusted: 0: 2 - 0.5 - 0.25; 3: 3 - 0.5 - 0.5; 4: -1 + 2.
  const std::vector<double> want = {1.25, 1., 0., 2., 1.};
  double z = 0;
  for (double x : want) z += std::exp(x);
  std::vector<float> p;
  s.Distribution(logits, &p);
  for (size_t t = 0; t < want.size(); ++t) EXPECT_NEAR(p[t], std::exp(want[t]) / z, 1e-6) << t;
  // Greedy: the argmax after them.
  SamplingParams greedy;
  greedy.logit_bias = {{3, -100.f}};
  Sampler g(greedy);
  EXPECT_EQ(g.Next(logits), 0);
  greedy.logit_bias.clear();
  greedy.frequency_penalty = 2.f;
  Sampler f(greedy);
  EXPECT_EQ(f.Next(logits), 3);
  f.Record(3);
  EXPECT_EQ(f.Next(logits), 0);  // 3 - 2 < 2
  EXPECT_FALSE(params.SameDistributionAs(params));  // no two samplers share a history
  SamplingParams bad;
  bad.presence_penalty = 2.5f;
  EXPECT_FALSE(ValidateSampling(bad).ok());
  bad = {};
  bad.logit_bias = {{1, 101.f}};
  EXPECT_FALSE(ValidateSampling(bad).ok());
}

// Through the engine: each greedy token is the argmax of its logits less the penalties of the tokens generated
// before it, and a bias of +100 forces a token.
TEST_F(EngineTest, PenaltiesFollowTheGeneratedTokens) {
  GenerateRequest q = Request("the quick brown fox", 24);
  q.sampling.frequency_penalty = 1.5f;
  q.sampling.presence_penalty = 0.5f;
  auto r = engine_->Generate(q);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<int32_t> all = {kBosId};
  engine_->tokenizer()->EncodeAppend(q.prompt, &all);
  const size_t n = all.size();
  all.insert(all.end(), r->tokens.begin(), r->tokens.end());
  SequenceState seq = engine_->backend().NewSequence();
  std::vector<float> logits;
  std::vector<Mode> modes(all.size(), Mode::kAttention);
  ASSERT_TRUE(engine_->backend().Forward(seq, all, modes, true, &logits).ok());
  const int64_t V = engine_->backend().config().vocab_size;
  std::map<int32_t, int> counts;
  for (size_t i = 0; i < r->tokens.size(); ++i) {
    std::vector<float> row(logits.begin() + (n - 1 + i) * V, logits.begin() + (n + i) * V);
    for (const auto& [t, c] : counts) row[t] -= 0.5f + 1.5f * c;
    EXPECT_EQ(r->tokens[i], std::max_element(row.begin(), row.end()) - row.begin()) << "token " << i;
    ++counts[r->tokens[i]];
  }
  auto plain = engine_->Generate(Request("the quick brown fox", 24));
  ASSERT_TRUE(plain.ok());
  EXPECT_NE(plain->tokens, r->tokens);  // the penalties changed something (a greedy tiny model repeats itself)
  GenerateRequest forced = Request("the quick brown fox", 5);
  forced.sampling.logit_bias = {{77, 100.f}};
  auto f = engine_->Generate(forced);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tokens, std::vector<int32_t>(5, 77));
  forced.sampling.logit_bias = {{1 << 20, 1.f}};
  auto bad = engine_->Generate(forced);
  ASSERT_FALSE(bad.ok());
  EXPECT_HAS_SUBSTR(bad.status().message(), "outside the vocabulary");
}

TEST_F(EngineTest, StopStringsCutTheTextAndStreamingSeesExactlyTheText) {
  GenerateRequest q = Request("abc", 40);
  auto free_run = engine_->Generate(q);
  ASSERT_TRUE(free_run.ok());
  ASSERT_GE(free_run->text.size(), 4u);
  // Stop at a piece of text the free run produces: the result is the text before its first occurrence.
  const std::string stop = free_run->text.substr(free_run->text.size() / 2, 2);
  q.stop = {stop};
  std::string streamed;
  q.on_token = [&](const TokenEvent& e) {
    streamed += e.text;
    return true;
  };
  auto r = engine_->Generate(q);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->finish_reason, FinishReason::kStop);
  EXPECT_EQ(r->text, free_run->text.substr(0, free_run->text.find(stop)));
  EXPECT_EQ(streamed, r->text);
  // The callback can stop a request.
  int calls = 0;
  q.stop.clear();
  q.on_token = [&](const TokenEvent&) { return ++calls < 3; };
  r = engine_->Generate(q);
  EXPECT_EQ(r->finish_reason, FinishReason::kStop);
  EXPECT_EQ(r->tokens.size(), 3u);
}

TEST_F(EngineTest, ABatchOfRequestsGivesWhatEachGetsAlone) {
  std::vector<GenerateRequest> qs = {Request("one", 5), Request("two three four", 9), Request("five six", 3)};
  qs[1].policy = "prefill-linear";
  qs[2].sampling = {0.9f, 20, 0.95f, 5};
  auto together = engine_->Generate(qs);
  ASSERT_TRUE(together.ok()) << together.status();
  for (size_t i = 0; i < qs.size(); ++i) {
    auto alone = engine_->Generate(qs[i]);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ((*together)[i].tokens, alone->tokens) << "request " << i;
    EXPECT_EQ((*together)[i].policy, qs[i].policy);
  }
}

TEST_F(EngineTest, RequestsJoiningARunningBatchGetWhatEachGetsAlone) {
  std::vector<GenerateRequest> qs = {Request("one two", 12), Request("three", 3), Request("four five six", 6)};
  qs[1].policy = "linear";
  qs[2].sampling = {0.8f, 0, 1.f, 11};
  std::vector<int64_t> event_ids;
  for (GenerateRequest& q : qs) {
    q.on_token = [&](const TokenEvent& e) {
      event_ids.push_back(e.request);
      return true;
    };
  }
  GenerationBatch batch(*engine_);
  auto id0 = batch.Add(qs[0]);
  ASSERT_TRUE(id0.ok()) << id0.status();
  EXPECT_EQ(*id0, 0);
  EXPECT_EQ(batch.active(), 1);
  EXPECT_EQ(batch.decoding(), 0);
  ASSERT_TRUE(batch.Step().ok());  // prefills request 0 and decodes its second token
  EXPECT_EQ(batch.decoding(), 1);
  ASSERT_TRUE(batch.Step().ok());
  // Two more join while request 0 is decoding; a bad one is refused without disturbing the batch.
  EXPECT_EQ(*batch.Add(qs[1]), 1);
  EXPECT_EQ(*batch.Add(qs[2]), 2);
  auto bad = batch.Add(Request(""));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(batch.active(), 3);
  EXPECT_EQ(batch.decoding(), 1);
  std::vector<std::pair<int64_t, GenerateResult>> finished;
  for (int steps = 0; batch.active() > 0; ++steps) {
    ASSERT_LT(steps, 100);
    ASSERT_TRUE(batch.Step().ok());
    for (auto& f : batch.TakeFinished()) finished.push_back(std::move(f));
  }
  ASSERT_EQ(finished.size(), 3u);
  // Request 1 (3 tokens) ends first, then 2 (6 tokens, one step behind it), then 0 (12 tokens).
  EXPECT_EQ(finished[0].first, 1);
  EXPECT_EQ(finished[1].first, 2);
  EXPECT_EQ(finished[2].first, 0);
  for (auto& [id, got] : finished) {
    GenerateRequest q = qs[id];
    q.on_token = nullptr;
    auto alone = engine_->Generate(q);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(got.tokens, alone->tokens) << "request " << id;
    EXPECT_EQ(got.text, alone->text) << "request " << id;
    EXPECT_EQ(got.stats.generated_tokens, q.max_tokens);
    EXPECT_EQ(std::count(event_ids.begin(), event_ids.end(), id), q.max_tokens) << "request " << id;
  }
  EXPECT_TRUE(batch.TakeFinished().empty());
}

// A cancelled request is gone at once, wherever it was: its memory is freed, it never comes back finished or
// failed, and the others go on to what each gets alone.
TEST_F(EngineTest, CancelledRequestsLeaveTheBatchAndFreeTheirMemory) {
  std::vector<GenerateRequest> qs = {Request("one two", 12), Request("three four", 12), Request("five", 12)};
  GenerationBatch batch(*engine_);
  for (const GenerateRequest& q : qs) ASSERT_TRUE(batch.Add(q).ok());
  EXPECT_TRUE(batch.Cancel(2));  // added, not yet admitted
  ASSERT_TRUE(batch.Step().ok());
  ASSERT_TRUE(batch.Step().ok());
  ASSERT_EQ(batch.decoding(), 2);
  const int64_t both = batch.kv_bytes();
  EXPECT_TRUE(batch.Cancel(0));  // decoding
  EXPECT_EQ(batch.active(), 1);
  EXPECT_LT(batch.kv_bytes(), both);
  EXPECT_GT(batch.kv_bytes(), 0);
  EXPECT_FALSE(batch.Cancel(0));
  EXPECT_FALSE(batch.Cancel(7));  // no such request
  std::vector<std::pair<int64_t, GenerateResult>> finished;
  for (int steps = 0; batch.active() > 0; ++steps) {
    ASSERT_LT(steps, 100);
    ASSERT_TRUE(batch.Step().ok());
    for (auto& f : batch.TakeFinished()) finished.push_back(std::move(f));
    EXPECT_TRUE(batch.TakeFailed().empty());
  }
  ASSERT_EQ(finished.size(), 1u);
  EXPECT_EQ(finished[0].first, 1);
  EXPECT_EQ(finished[0].second.tokens, engine_->Generate(qs[1])->tokens);
  EXPECT_EQ(batch.kv_bytes(), 0);
  EXPECT_FALSE(batch.Cancel(1));  // finished
}

// The test model on a CountingBackend, which *counted points to; nothing when it cannot be loaded.
std::optional<Engine> CountingEngine(const std::string& model_dir, testutil::CountingBackend** counted) {
  auto inner = LoadBackend(model_dir, {"cpu", 2});
  auto tokenizer = Tokenizer::Load(model_dir + "/tokenizer.model");
  EXPECT_TRUE(inner.ok() && tokenizer.ok()) << inner.status() << tokenizer.status();
  if (!inner.ok() || !tokenizer.ok()) return std::nullopt;
  auto backend = std::make_unique<testutil::CountingBackend>(std::move(*inner));
  *counted = backend.get();
  return Engine(std::move(backend), std::move(*tokenizer));
}

// A prompt that joins while others decode is prefilled in the same forward as their decode step, and
// requests under different policies decode in one forward: every step is one pass over the weights, and
// each request gets the same tokens as alone.
TEST_F(EngineTest, PrefillAndDecodeStepsShareOneForward) {
  testutil::CountingBackend* counted = nullptr;
  std::optional<Engine> counting = CountingEngine(model_dir_, &counted);
  ASSERT_TRUE(counting.has_value());
  Engine& engine = *counting;
  testutil::CountingBackend& backend = *counted;
  GenerationBatch batch(engine);
  std::vector<GenerateRequest> qs = {Request("one two", 8), Request("three four five", 5)};
  qs[1].policy = "prefill-linear";
  ASSERT_TRUE(batch.Add(qs[0]).ok());
  ASSERT_TRUE(batch.Step().ok());  // the prefill, which draws the first token
  EXPECT_EQ(backend.forwards, 1);
  ASSERT_TRUE(batch.Add(qs[1]).ok());
  const int64_t prompt_rows = 1 + static_cast<int64_t>(engine.tokenizer()->Encode(qs[1].prompt).size());
  backend.forwards = backend.rows = 0;
  ASSERT_TRUE(batch.Step().ok());  // request 1's prompt and request 0's decode step in one forward
  EXPECT_EQ(backend.forwards, 1);
  EXPECT_EQ(backend.rows, prompt_rows + 1);
  EXPECT_EQ(batch.last_step_decoded(), 1);
  EXPECT_EQ(batch.last_step_shared(), 1);
  backend.forwards = backend.rows = 0;
  ASSERT_TRUE(batch.Step().ok());  // both decode, each under its own policy, in one forward
  EXPECT_EQ(backend.forwards, 1);
  EXPECT_EQ(backend.rows, 2);
  EXPECT_EQ(batch.last_step_decoded(), 2);
  EXPECT_EQ(batch.last_step_shared(), 0);
  std::vector<std::pair<int64_t, GenerateResult>> finished;
  while (batch.active() > 0) {
    ASSERT_TRUE(batch.Step().ok());
    for (auto& f : batch.TakeFinished()) finished.push_back(std::move(f));
  }
  ASSERT_EQ(finished.size(), 2u);
  for (auto& [id, got] : finished) EXPECT_EQ(got.tokens, engine_->Generate(qs[id])->tokens) << "request " << id;
}

// A decoder that may run its steps alone (a speculative one on a backend that runs rounds) but declines: its
// attention steps, with PlainStep saying whether the declined step is plain. A plain step shares the joining
// prompt's forward; any other declined step leaves the prompt a forward of its own first.
class DeclinesToRunAlone final : public Decoder {
 public:
  DeclinesToRunAlone(std::unique_ptr<Decoder> inner, bool plain) : inner_(std::move(inner)), plain_(plain) {}
  void PrefillModes(std::span<const int32_t> prompt, int64_t begin, std::span<Mode> modes) const override {
    inner_->PrefillModes(prompt, begin, modes);
  }
  absl::Status Plan(const Backend& backend, std::span<DecodeSlot* const> slots,
                    std::vector<ForwardItem>& items) override {
    return inner_->Plan(backend, slots, items);
  }
  absl::Status Finish(std::span<DecodeSlot* const> slots) override { return inner_->Finish(slots); }
  absl::StatusOr<bool> RunAlone(Backend&, std::span<DecodeSlot* const>) override { return false; }
  bool RunsAlone(const Backend&) const override { return true; }
  bool PlainStep() const override { return plain_; }

 private:
  std::unique_ptr<Decoder> inner_;
  bool plain_;
};

TEST_F(EngineTest, APlainStepOfADecoderThatRunsAloneSharesThePromptsForward) {
  for (bool plain : {true, false}) {
    SCOPED_TRACE(plain ? "plain step" : "a step that is not plain");
    testutil::CountingBackend* counted = nullptr;
    std::optional<Engine> counting = CountingEngine(model_dir_, &counted);
    ASSERT_TRUE(counting.has_value());
    Engine& engine = *counting;
    engine.policies().Register(
        "declines", "declines", [&engine, plain](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
          auto attention = engine.policies().Make("attention");
          if (!attention.ok()) return attention.status();
          return std::unique_ptr<Decoder>(std::make_unique<DeclinesToRunAlone>(std::move(*attention), plain));
        });
    testutil::CountingBackend& backend = *counted;
    GenerationBatch batch(engine);
    std::vector<GenerateRequest> qs = {Request("one two", 8), Request("three four five", 5)};
    for (GenerateRequest& q : qs) q.policy = "declines";
    ASSERT_TRUE(batch.Add(qs[0]).ok());
    ASSERT_TRUE(batch.Step().ok());  // the prefill
    ASSERT_TRUE(batch.Add(qs[1]).ok());
    backend.forwards = 0;
    ASSERT_TRUE(batch.Step().ok());  // request 1's prompt beside request 0's step
    EXPECT_EQ(backend.forwards, plain ? 1 : 2);
    std::vector<std::pair<int64_t, GenerateResult>> finished;
    while (batch.active() > 0) {
      ASSERT_TRUE(batch.Step().ok());
      for (auto& f : batch.TakeFinished()) finished.push_back(std::move(f));
    }
    ASSERT_EQ(finished.size(), 2u);
    for (auto& [id, got] : finished) {
      GenerateRequest attention = qs[id];
      attention.policy = "attention";
      EXPECT_EQ(got.tokens, engine_->Generate(attention)->tokens) << "request " << id;
    }
  }
}

// With a prefill token budget, a step forwards at most that many prompt tokens (the prompts added first
// take it), and every request still gets what it gets alone.
TEST_F(EngineTest, APrefillBudgetBoundsEachStepsPromptTokens) {
  testutil::CountingBackend* counted = nullptr;
  std::optional<Engine> counting = CountingEngine(model_dir_, &counted);
  ASSERT_TRUE(counting.has_value());
  Engine& engine = *counting;
  testutil::CountingBackend& backend = *counted;
  GenerationBatch batch(engine, /*max_prefill_tokens=*/5);
  std::vector<GenerateRequest> qs = {Request("one two three four five six", 6), Request("seven eight nine ten", 6),
                                     Request("eleven", 6)};
  qs[2].policy = "linear";
  for (const GenerateRequest& q : qs) ASSERT_TRUE(batch.Add(q).ok());
  int64_t prompt_tokens = 0;
  for (const GenerateRequest& q : qs) prompt_tokens += 1 + static_cast<int64_t>(engine.tokenizer()->Encode(q.prompt).size());
  ASSERT_GT(prompt_tokens, 10);  // the prompts need at least three steps of 5
  std::vector<std::pair<int64_t, GenerateResult>> finished;
  int64_t first_token_step = -1;
  for (int64_t step = 0; batch.active() > 0; ++step) {
    ASSERT_LT(step, 100);
    ASSERT_TRUE(batch.Step().ok());
    if (first_token_step < 0 && batch.decoding() + static_cast<int64_t>(finished.size()) == 3) first_token_step = step;
    for (auto& f : batch.TakeFinished()) finished.push_back(std::move(f));
  }
  EXPECT_LE(backend.max_prompt_rows, 5);
  EXPECT_GE(first_token_step, (prompt_tokens + 4) / 5 - 1);  // the last prompt is through no sooner
  ASSERT_EQ(finished.size(), 3u);
  for (auto& [id, got] : finished) EXPECT_EQ(got.tokens, engine_->Generate(qs[id])->tokens) << "request " << id;
}

// A prompt's prefill spans end at its prefix-cache snapshots, so an engine snapshots no closer than its
// backend's span for one prompt: at least 2048 (the CPU's 256), rounded up to blocks (a span of 5000: 5056).
// An explicit interval stays.
TEST(Engine, PrefixSnapshotsAreNoCloserThanTheBackendsPrefillSpan) {
  testutil::ScratchDir scratch, other;
  Engine cpu = testutil::TinyEngine(scratch, LinearMixer::kMamba2, 1);
  ASSERT_NE(cpu.prefix_cache(), nullptr);
  EXPECT_EQ(cpu.prefix_cache()->options().snapshot_every, 2048);
  auto counting = std::make_unique<testutil::CountingBackend>(testutil::TinyBackend(other, LinearMixer::kMamba2, 1));
  counting->prefill_span = 5000;
  Engine long_spans(std::move(counting), std::nullopt);
  ASSERT_NE(long_spans.prefix_cache(), nullptr);
  EXPECT_EQ(long_spans.prefix_cache()->options().snapshot_every, 5056);
  long_spans.set_prefix_cache(PrefixCacheOptions{.snapshot_every = 0});
  EXPECT_EQ(long_spans.prefix_cache()->options().snapshot_every, 5056);
  long_spans.set_prefix_cache(PrefixCacheOptions{.snapshot_every = 128});
  EXPECT_EQ(long_spans.prefix_cache()->options().snapshot_every, 128);
}

TEST_F(EngineTest, GenerationStopsAtMaxPosition) {
  auto r = engine_->Generate(Request("a b c", 1000));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->finish_reason, FinishReason::kLength);
  EXPECT_EQ(r->stats.prompt_tokens + r->stats.generated_tokens, 64);  // max_position
}

TEST_F(EngineTest, BadRequestsAreClearErrors) {
  auto expect_error = [&](GenerateRequest q, const std::string& needle) {
    auto r = engine_->Generate(q);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_HAS_SUBSTR(r.status().message(), needle);
  };
  expect_error(Request(""), "empty prompt");
  expect_error(Request(std::string(300, 'x')), "this model takes at most 63");
  GenerateRequest q = Request("hi");
  q.max_tokens = 0;
  expect_error(q, "max_tokens");
  q = Request("hi");
  q.policy = "sometimes";
  expect_error(q, "unknown policy 'sometimes'");
  q.policy = "periodic:0";
  expect_error(q, "periodic:N");
  q = Request("hi");
  q.sampling.top_p = 0;
  expect_error(q, "top_p");
  q = Request("hi");
  q.stop = {""};
  expect_error(q, "empty stop string");
  q = Request("hi");
  q.prompt_tokens = {1, 99999};
  expect_error(q, "outside the vocabulary");
  q = Request("hi");
  q.logprobs = kMaxTopLogprobs + 1;
  expect_error(q, "logprobs must be in [0, 20]");
  std::vector<GenerateRequest> two = {Request("fine"), Request("")};
  auto r = engine_->Generate(two);
  ASSERT_FALSE(r.ok());
  EXPECT_HAS_SUBSTR(r.status().message(), "request 1: empty prompt");
  EXPECT_FALSE(Engine::Load(scratch_->Join("nope")).ok());
}

// log_softmax(row)[token] and the row's argmax.
std::pair<double, int32_t> LogSoftmaxAt(std::span<const float> row, int32_t token) {
  const float max = *std::max_element(row.begin(), row.end());
  double sum = 0;
  for (float x : row) sum += std::exp(static_cast<double>(x) - max);
  return {row[token] - max - std::log(sum), static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin())};
}

TEST_F(EngineTest, LogprobsAreTheLogSoftmaxOfTheModeEachTokenRanIn) {
  const std::vector<int32_t> prompt = [&] {
    std::vector<int32_t> p = {kBosId};
    engine_->tokenizer()->EncodeAppend("the quick brown fox", &p);
    return p;
  }();
  const int64_t n = static_cast<int64_t>(prompt.size());
  const int64_t V = engine_->backend().config().vocab_size;
  for (const std::string policy : {"attention", "linear", "prefill-linear"}) {
    GenerateRequest q = Request("the quick brown fox", 6);
    q.policy = policy;
    q.logprobs = 3;
    auto r = engine_->Generate(q);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->logprobs.size(), r->tokens.size()) << policy;
    EXPECT_TRUE(r->prompt_logprobs.empty());
    // The reference: one forward of the prompt and the generated tokens in the policy's modes.
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), r->tokens.begin(), r->tokens.end());
    std::vector<Mode> modes(all.size(), policy == "linear" ? Mode::kLinear : Mode::kAttention);
    if (policy == "prefill-linear") std::fill(modes.begin(), modes.begin() + n - 1, Mode::kLinear);
    SequenceState seq = engine_->backend().NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(engine_->backend().Forward(seq, all, modes, true, &logits).ok());
    for (size_t i = 0; i < r->tokens.size(); ++i) {
      const TokenLogProb& t = r->logprobs[i];
      const auto [want, argmax] = LogSoftmaxAt(std::span<const float>(logits).subspan((n - 1 + i) * V, V), r->tokens[i]);
      EXPECT_EQ(t.token, r->tokens[i]);
      ASSERT_TRUE(t.logprob.has_value());
      EXPECT_NEAR(*t.logprob, want, 1e-4) << policy << " token " << i;
      ASSERT_EQ(t.top.size(), 3u);
      EXPECT_EQ(t.top[0].first, argmax);  // greedy: the token drawn is the likeliest
      EXPECT_EQ(t.top[0].first, t.token);
      EXPECT_NEAR(t.top[0].second, *t.logprob, 1e-9);
      EXPECT_GE(t.top[0].second, t.top[1].second);
      EXPECT_GE(t.top[1].second, t.top[2].second);
    }
    // Streamed, each token's comes with it (scored as tokens come, on a sequence that follows the modes): the
    // same.
    std::vector<TokenLogProb> seen;
    q.on_token = [&](const TokenEvent& e) {
      EXPECT_NE(e.logprob, nullptr);
      if (e.logprob != nullptr) seen.push_back(*e.logprob);
      return true;
    };
    auto streamed = engine_->Generate(q);
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    ASSERT_EQ(streamed->tokens, r->tokens);
    ASSERT_EQ(seen.size(), r->logprobs.size()) << policy;
    for (size_t i = 0; i < seen.size(); ++i) {
      EXPECT_NEAR(*seen[i].logprob, *r->logprobs[i].logprob, 1e-5) << policy << " token " << i;
      ASSERT_EQ(seen[i].top.size(), 3u);
      EXPECT_EQ(seen[i].top[0].first, r->logprobs[i].top[0].first);
      EXPECT_EQ(*streamed->logprobs[i].logprob, *seen[i].logprob);
    }
  }
}

TEST_F(EngineTest, EchoScoresThePromptAndMaxTokensZeroGeneratesNothing) {
  GenerateRequest q = Request("the quick brown fox", 0);
  q.logprobs = 0;
  auto bad = engine_->Generate(q);
  ASSERT_FALSE(bad.ok());
  EXPECT_HAS_SUBSTR(bad.status().message(), "max_tokens must be >= 1");
  q.echo = true;
  auto r = engine_->Generate(q);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->tokens.empty());
  EXPECT_TRUE(r->logprobs.empty());
  std::vector<int32_t> all = {kBosId};
  engine_->tokenizer()->EncodeAppend(q.prompt, &all);
  ASSERT_EQ(r->prompt_logprobs.size(), all.size() - 1);  // the BOS is not echoed
  EXPECT_FALSE(r->prompt_logprobs[0].logprob.has_value());
  SequenceState seq = engine_->backend().NewSequence();
  std::vector<float> logits;
  std::vector<Mode> modes(all.size(), Mode::kAttention);
  ASSERT_TRUE(engine_->backend().Forward(seq, all, modes, true, &logits).ok());
  const int64_t V = engine_->backend().config().vocab_size;
  for (size_t i = 1; i < r->prompt_logprobs.size(); ++i) {
    EXPECT_EQ(r->prompt_logprobs[i].token, all[i + 1]);
    ASSERT_TRUE(r->prompt_logprobs[i].logprob.has_value());
    EXPECT_NEAR(*r->prompt_logprobs[i].logprob, LogSoftmaxAt(std::span<const float>(logits).subspan(i * V, V), all[i + 1]).first,
                1e-4);
    EXPECT_TRUE(r->prompt_logprobs[i].top.empty());
  }
  // Echo with generation: the prompt's entries, then the generated tokens'.
  q.max_tokens = 3;
  auto g = engine_->Generate(q);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->tokens.size(), 3u);
  EXPECT_EQ(g->logprobs.size(), 3u);
  ASSERT_EQ(g->prompt_logprobs.size(), r->prompt_logprobs.size());
  for (size_t i = 1; i < r->prompt_logprobs.size(); ++i) {
    EXPECT_NEAR(*g->prompt_logprobs[i].logprob, *r->prompt_logprobs[i].logprob, 1e-5);
  }
}

TEST(ModePolicy, ModesByPosition) {
  auto p = ModePolicy::Parse("prefill-linear");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->ModeAt(0, 5), Mode::kLinear);
  EXPECT_EQ(p->ModeAt(3, 5), Mode::kLinear);
  EXPECT_EQ(p->ModeAt(4, 5), Mode::kAttention);
  EXPECT_EQ(p->ModeAt(9, 5), Mode::kAttention);
  auto q = ModePolicy::Parse("periodic:4");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->ModeAt(3, 100), Mode::kAttention);
  EXPECT_EQ(q->ModeAt(4, 100), Mode::kLinear);
  EXPECT_FALSE(ModePolicy::Parse("periodic:").ok());
  EXPECT_FALSE(ModePolicy::Parse("periodic:-2").ok());
}

TEST(ThreadPool, ParallelForCoversEveryIndexOnceAcrossManyCalls) {
  kernels::cpu::ThreadPool pool(4);
  for (int64_t n : {1, 7, 64, 1000}) {
    for (int rep = 0; rep < 50; ++rep) {
      std::vector<int> hits(n, 0);
      pool.ParallelFor(n, 3, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) ++hits[i];
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << n << " " << i;
    }
  }
}

// The CUDA backend's switches come from ORYX_CUDA_* variables only through CudaSwitches::FromEnvironment:
// every path on when none is set, "0" turns one off, PROFILE=1 and GEMV_ROWS=N set the others.
TEST(CudaSwitches, FromEnvironmentReadsTheVariables) {
  const char* names[] = {"ORYX_CUDA_FUSED",          "ORYX_CUDA_PDL",
                         "ORYX_CUDA_GEMV_ROWS",      "ORYX_CUDA_PROFILE",
                         "ORYX_CUDA_SPLIT_GEMM",     "ORYX_CUDA_GROUP_MMA_ROWS",
                         "ORYX_CUDA_MMA_CHUNK",      "ORYX_CUDA_ATTN_CHUNK",
                         "ORYX_CUDA_FP8_MMA_ROWS",   "ORYX_CUDA_PREFILL_ROWS",
                         "ORYX_CUDA_PREFILL_SPAN",   "ORYX_CUDA_BF16_MMA_ROWS",
                         "ORYX_CUDA_FP8_GEMV_ROWS",  "ORYX_CUDA_HEAD_MIXER_SEQS",
                         "ORYX_CUDA_HEAD_MIXER_DIM", "ORYX_CUDA_HEAD_MIXER_CARVEOUT",
                         "ORYX_CUDA_MIXER_PREFETCH", "ORYX_CUDA_DOWN_PREFETCH"};
  for (const char* n : names) unsetenv(n);
  const CudaSwitches defaults = CudaSwitches::FromEnvironment();
  EXPECT_TRUE(defaults.fused_gemv && defaults.programmatic_launch && defaults.group_mma && defaults.early_loads &&
              defaults.split_ragged_gemm);
  EXPECT_EQ(defaults.gemv_rows_per_warp, 0);
  EXPECT_FALSE(defaults.profile);
  EXPECT_EQ(defaults.group_mma_min_rows, 3);
  EXPECT_EQ(defaults.group_mma_chunk, 1024);
  EXPECT_EQ(defaults.attention_chunk, 256);
  EXPECT_EQ(defaults.fp8_mma_min_rows, 8);
  EXPECT_EQ(defaults.bf16_mma_gemv_rows, 32);
  EXPECT_EQ(defaults.fp8_mma_gemv_rows, 32);
  EXPECT_EQ(defaults.head_mixer_seqs, 2);
  EXPECT_EQ(defaults.head_mixer_dim, 128);
  EXPECT_EQ(defaults.head_mixer_carveout, 0);
  EXPECT_EQ(defaults.mixer_prefetch_mib, 12);
  EXPECT_EQ(defaults.down_prefetch_mib, 8);
  EXPECT_EQ(defaults.prefill_rows, 0);
  EXPECT_EQ(defaults.prefill_span, 16384);
  setenv("ORYX_CUDA_FUSED", "0", 1);
  setenv("ORYX_CUDA_PDL", "0", 1);
  setenv("ORYX_CUDA_GEMV_ROWS", "4", 1);
  setenv("ORYX_CUDA_PROFILE", "1", 1);
  setenv("ORYX_CUDA_SPLIT_GEMM", "0", 1);
  setenv("ORYX_CUDA_GROUP_MMA_ROWS", "5", 1);
  setenv("ORYX_CUDA_MMA_CHUNK", "4096", 1);  // past the kernel's longest: clamped
  setenv("ORYX_CUDA_ATTN_CHUNK", "128", 1);
  setenv("ORYX_CUDA_FP8_MMA_ROWS", "4", 1);
  setenv("ORYX_CUDA_BF16_MMA_ROWS", "0", 1);
  setenv("ORYX_CUDA_FP8_GEMV_ROWS", "5", 1);
  setenv("ORYX_CUDA_HEAD_MIXER_SEQS", "-2", 1);  // under 0: clamped
  setenv("ORYX_CUDA_HEAD_MIXER_DIM", "64", 1);
  setenv("ORYX_CUDA_HEAD_MIXER_CARVEOUT", "150", 1);  // over 100: clamped
  setenv("ORYX_CUDA_MIXER_PREFETCH", "100", 1);       // over 64: clamped
  setenv("ORYX_CUDA_DOWN_PREFETCH", "0", 1);
  setenv("ORYX_CUDA_PREFILL_ROWS", "16384", 1);
  setenv("ORYX_CUDA_PREFILL_SPAN", "100", 1);  // under the least span: clamped
  const CudaSwitches set = CudaSwitches::FromEnvironment();
  for (const char* n : names) unsetenv(n);
  EXPECT_FALSE(set.fused_gemv);
  EXPECT_FALSE(set.programmatic_launch);
  EXPECT_FALSE(set.split_ragged_gemm);
  EXPECT_TRUE(set.decode_mixer && set.tiled_attention && set.wide_gemv);
  EXPECT_EQ(set.gemv_rows_per_warp, 4);
  EXPECT_TRUE(set.profile);
  EXPECT_EQ(set.group_mma_min_rows, 5);
  EXPECT_EQ(set.group_mma_chunk, 1024);
  EXPECT_EQ(set.attention_chunk, 128);
  EXPECT_EQ(set.fp8_mma_min_rows, 4);
  EXPECT_EQ(set.bf16_mma_gemv_rows, 0);
  EXPECT_EQ(set.fp8_mma_gemv_rows, 5);
  EXPECT_EQ(set.head_mixer_seqs, 0);
  EXPECT_EQ(set.head_mixer_dim, 64);
  EXPECT_EQ(set.head_mixer_carveout, 100);
  EXPECT_EQ(set.mixer_prefetch_mib, 64);
  EXPECT_EQ(set.down_prefetch_mib, 0);
  EXPECT_EQ(set.prefill_rows, 16384);
  EXPECT_EQ(set.prefill_span, 256);
}

#ifdef ORYX_HAVE_CUDA
// The attention's chunk of keys per block (host code, no device needed): up to 256 keys while blocks exceed
// a few per SM, longer (the tensor-core groups' 512 and 1024) only while about three waves of blocks
// remain. The cases are the H200 measurements at 16K (models/default: 8 heads): 1024 keys were fastest at
// batch 32 and 64, 512 at batch 8.
TEST(AttentionChunkFor, LongChunksOnlyWhereAboutThreeWavesOfBlocksRemain) {
  namespace kc = kernels::cuda;
  EXPECT_EQ(kc::AttentionChunkFor(16384, 64, 8, kc::kGroupMmaChunk), 1024);  // 8,192 blocks
  EXPECT_EQ(kc::AttentionChunkFor(16384, 32, 8, kc::kGroupMmaChunk), 1024);  // 4,096
  EXPECT_EQ(kc::AttentionChunkFor(16384, 8, 8, kc::kGroupMmaChunk), 512);    // 2,048; 1024 keys: 1,024 blocks
  EXPECT_EQ(kc::AttentionChunkFor(16384, 1, 8, kc::kGroupMmaChunk), 256);    // 512 blocks: as before
  EXPECT_EQ(kc::AttentionChunkFor(16384, 64, 8, 256), 256);                  // the CUDA-core kernels' longest
  EXPECT_EQ(kc::AttentionChunkFor(512, 8, 8, kc::kGroupMmaChunk), 64);       // a short context spreads out
}
#endif

}  // namespace
}  // namespace oryx
