// Learned policies: the policy file round trip and its errors, the MLP forward against a hand computation,
// learned:PATH inside generation (modes, and speculation decisions that must leave the output unchanged),
// and sampled decisions that repeat when prefill is replayed.
#include "policies/learned_policy.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "engine/safetensors.h"
#include "gtest/gtest.h"
#include "policies/rule_policies.h"
#include "router/features.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx::policies {
namespace {

using router::kNumFeatures;

// No hidden layer, zero weights: p_attention = sigmoid(attention_bias - linear_bias) everywhere.
PolicyNetwork ConstantNetwork(float attention_logit, std::vector<int64_t> draft_lengths = {},
                              std::vector<float> draft_logits = {}) {
  PolicyNetwork n = RandomPolicyNetwork({}, draft_lengths, 4, 1);
  std::fill(n.mode_head.weight.begin(), n.mode_head.weight.end(), 0.0f);
  n.mode_head.bias = {0.0f, attention_logit};
  if (!draft_logits.empty()) {
    std::fill(n.draft_head.weight.begin(), n.draft_head.weight.end(), 0.0f);
    n.draft_head.bias = draft_logits;
  }
  return n;
}

std::vector<float> SomeFeatures() {
  router::RouterContext c;
  c.phase = router::Phase::kDecode;
  c.position = 40, c.prompt_len = 30, c.attention_tokens = 5, c.linear_tokens = 35, c.tokens_since_attention = 3;
  c.entropy = 1.5, c.margin = 2.0;
  std::vector<float> f(kNumFeatures);
  router::Featurize(c, f);
  return f;
}

TEST(LearnedPolicyTest, FileRoundTripKeepsTheFunction) {
  testutil::ScratchDir dir;
  const std::vector<int64_t> hidden = {16, 8}, drafts = {0, 2, 4};
  PolicyNetwork n = RandomPolicyNetwork(hidden, drafts, 64, 42);
  n.input_mean[3] = 0.5f;
  n.input_inv_std[3] = 2.0f;
  n.training = {{"lambda", 0.5}};
  n.tail_len = 16;
  const std::string path = dir.path() + "/p.safetensors";
  ASSERT_TRUE(WritePolicyFile(path, n).ok());
  auto back = ReadPolicyFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->segment_len, 64);
  EXPECT_EQ(back->tail_len, 16);
  EXPECT_EQ(back->draft_lengths, drafts);
  EXPECT_EQ(back->training["lambda"], 0.5);
  auto a = LearnedPolicy::Create(n), b = LearnedPolicy::Create(*std::move(back));
  ASSERT_TRUE(a.ok() && b.ok());
  LearnedPolicy::Output oa, ob;
  const std::vector<float> f = SomeFeatures();
  a->Evaluate(f, &oa);
  b->Evaluate(f, &ob);
  EXPECT_EQ(oa.p_attention, ob.p_attention);
  ASSERT_EQ(ob.draft_probs.size(), 3u);
  EXPECT_EQ(oa.draft_probs, ob.draft_probs);
  EXPECT_NEAR(ob.draft_probs[0] + ob.draft_probs[1] + ob.draft_probs[2], 1.0, 1e-12);
}

TEST(LearnedPolicyTest, ForwardMatchesAHandComputation) {
  // One hidden unit: h = tanh(w . ((x - mean) * inv_std) + b); logits = (0, 3 h - 1).
  PolicyNetwork n = RandomPolicyNetwork(std::vector<int64_t>{1}, {}, 4, 3);
  std::vector<float> x = SomeFeatures();
  n.input_mean.assign(kNumFeatures, 0.25f);
  n.input_inv_std.assign(kNumFeatures, 0.5f);
  n.hidden[0].bias = {0.1f};
  n.mode_head.weight = {0.0f, 3.0f};
  n.mode_head.bias = {0.0f, -1.0f};
  double pre = 0.1;
  for (int i = 0; i < kNumFeatures; ++i) pre += n.hidden[0].weight[i] * (x[i] - 0.25) * 0.5;
  const double logit = 3 * std::tanh(pre) - 1;
  auto p = LearnedPolicy::Create(n);
  ASSERT_TRUE(p.ok());
  LearnedPolicy::Output out;
  p->Evaluate(x, &out);
  EXPECT_NEAR(out.p_attention, 1 / (1 + std::exp(-logit)), 1e-6);
}

// A server's learned policies are files its operator named at start; a request that names a path gets an
// unknown-policy error that says nothing of the file (before, it opened it and reported its size).
TEST(LearnedPolicyTest, AServerNeverOpensAPathARequestNames) {
  testutil::ScratchDir dir;
  const std::string file = dir.path() + "/router.safetensors", other = dir.path() + "/secret";
  ASSERT_TRUE(WritePolicyFile(file, RandomPolicyNetwork(std::vector<int64_t>{4}, {}, 8, 1)).ok());
  testutil::WriteRawFile(other, std::string(631, 'x'));
  PolicyRegistry registry;
  RegisterAllPolicies(registry);
  ASSERT_TRUE(RegisterServedLearnedPolicies(registry, {{"mine", file}}).ok());
  EXPECT_TRUE(registry.Make("mine").ok());
  EXPECT_TRUE(registry.Make("learned:mine").ok());
  EXPECT_TRUE(registry.Make("drafted:mine").ok());
  EXPECT_TRUE(registry.Make("drafted:learned:mine").ok());
  for (const std::string& path : {other, file, std::string("/etc/shadow"), std::string("../router.safetensors")}) {
    SCOPED_TRACE(path);
    auto made = registry.Make("learned:" + path);
    auto drafted = registry.Make("drafted:learned:" + path);  // (drafted: makes its policy through the same registry)
    ASSERT_FALSE(drafted.ok());
    EXPECT_HAS_SUBSTR(drafted.status().message(), "this server serves mine");
    EXPECT_EQ(drafted.status().message().find("631"), std::string::npos) << drafted.status();
    ASSERT_FALSE(made.ok()) << path;
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_HAS_SUBSTR(made.status().message(), "this server serves mine");
    EXPECT_EQ(made.status().message().find("631"), std::string::npos) << made.status();
    EXPECT_EQ(made.status().message().find("bytes"), std::string::npos) << made.status();
  }
  // Names: no paths, no built-in policy's, none twice; a bad file is an error at start, naming it.
  for (const char* name : {"a/b", "", "attention", "budget", "learned", "drafted", "mine"}) {
    PolicyRegistry r;
    RegisterAllPolicies(r);
    std::vector<std::pair<std::string, std::string>> files = {{"mine", file}};
    files.emplace_back(name, file);
    EXPECT_FALSE(RegisterServedLearnedPolicies(r, files).ok()) << "'" << name << "'";
  }
  PolicyRegistry r;
  absl::Status bad = RegisterServedLearnedPolicies(r, {{"broken", other}});
  ASSERT_FALSE(bad.ok());
  EXPECT_HAS_SUBSTR(bad.message(), "policy broken");
  // With none served, learned: is refused too.
  PolicyRegistry none;
  RegisterAllPolicies(none);
  ASSERT_TRUE(RegisterServedLearnedPolicies(none, {}).ok());
  EXPECT_FALSE(none.Make("learned:" + file).ok());
}

TEST(LearnedPolicyTest, BadFilesAreClearErrors) {
  testutil::ScratchDir dir;
  const std::string good = dir.path() + "/good.safetensors";
  ASSERT_TRUE(WritePolicyFile(good, RandomPolicyNetwork(std::vector<int64_t>{4}, {}, 8, 1)).ok());
  auto expect_error = [&](const std::string& path, const std::string& needle) {
    auto r = ReadPolicyFile(path);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
  };
  expect_error(dir.path() + "/missing.safetensors", "missing.safetensors");
  {  // truncated
    std::ifstream in(good, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(dir.path() + "/cut.safetensors", std::ios::binary) << bytes.substr(0, bytes.size() - 9);
    expect_error(dir.path() + "/cut.safetensors", "cut.safetensors");
  }
  {  // a safetensors file that is not a policy
    const HostTensor t = MakeHostTensor("x", {2}, std::vector<float>{1, 2}, DType::kF32);
    ASSERT_TRUE(WriteSafetensors(dir.path() + "/plain.safetensors", Views(std::span(&t, 1))).ok());
    expect_error(dir.path() + "/plain.safetensors", "not a router policy");
  }
  // Files written by hand with one thing wrong each.
  auto write_raw = [&](const std::string& name, const PolicyNetwork& n, nlohmann::json meta_patch,
                       std::vector<HostTensor> extra = {}) {
    std::vector<HostTensor> t;
    const int64_t f = static_cast<int64_t>(n.input_mean.size());
    t.push_back(MakeHostTensor("input.mean", {f}, n.input_mean, DType::kF32));
    t.push_back(MakeHostTensor("input.inv_std", {f}, n.input_inv_std, DType::kF32));
    t.push_back(MakeHostTensor("hidden.0.weight", {n.hidden[0].out, n.hidden[0].in}, n.hidden[0].weight, DType::kF32));
    t.push_back(MakeHostTensor("hidden.0.bias", {n.hidden[0].out}, n.hidden[0].bias, DType::kF32));
    t.push_back(MakeHostTensor("mode.weight", {n.mode_head.out, n.mode_head.in}, n.mode_head.weight, DType::kF32));
    t.push_back(MakeHostTensor("mode.bias", {n.mode_head.out}, n.mode_head.bias, DType::kF32));
    for (HostTensor& e : extra) t.push_back(std::move(e));
    nlohmann::json meta = {{"format", kPolicyFormat}, {"version", kPolicyVersion},
                           {"feature_version", router::kFeatureVersion}, {"features", n.features},
                           {"activation", "tanh"}, {"segment_len", 8}, {"draft_lengths", nlohmann::json::array()}};
    if (meta_patch.is_object()) meta.merge_patch(meta_patch);  // ({} arrives as null)
    const std::string path = dir.path() + "/" + name;
    EXPECT_TRUE(WriteSafetensors(path, Views(t), {{std::string(kPolicyMetadataKey), meta.dump()}}).ok());
    return path;
  };
  PolicyNetwork n = RandomPolicyNetwork(std::vector<int64_t>{4}, {}, 8, 1);
  {  // the hand writer itself is right; it writes no tail length, as files did before there was one
    auto ok = ReadPolicyFile(write_raw("ok.safetensors", n, {}));
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(ok->tail_len, 0);
  }
  expect_error(write_raw("tail.safetensors", n, {{"tail_len", 8}}), "tail_len 8 must be 0 or below segment_len 8");
  expect_error(write_raw("v9.safetensors", n, {{"version", 9}}), "format version 9");
  expect_error(write_raw("fv.safetensors", n, {{"feature_version", 1}}), "feature version 1");
  expect_error(write_raw("fv9.safetensors", n, {{"feature_version", router::kFeatureVersion + 1}}),
               "feature version " + std::to_string(router::kFeatureVersion + 1));
  expect_error(write_raw("act.safetensors", n, {{"activation", "relu"}}), "activation 'relu'");
  PolicyNetwork renamed = n;
  renamed.features[2] = "mystery";
  expect_error(write_raw("feat.safetensors", renamed, {}), "feature 2 of the policy, 'mystery', is not one");
  PolicyNetwork twice = n;
  twice.features[2] = twice.features[1];
  expect_error(write_raw("twice.safetensors", twice, {}), "'" + n.features[1] + "' is listed twice");
  {
    // A file of feature version 2 lists the features before the last two and reads just those: it acts as
    // the whole network with no weight on the two.
    PolicyNetwork whole = n;
    const int64_t old_f = kNumFeatures - 2, width = whole.hidden[0].out;
    for (int64_t o = 0; o < width; ++o) {
      for (int64_t i = old_f; i < kNumFeatures; ++i) whole.hidden[0].weight[o * kNumFeatures + i] = 0;
    }
    PolicyNetwork older = whole;
    older.features.resize(old_f);
    older.input_mean.resize(old_f);
    older.input_inv_std.resize(old_f);
    older.hidden[0].in = old_f;
    older.hidden[0].weight.clear();
    for (int64_t o = 0; o < width; ++o) {
      for (int64_t i = 0; i < old_f; ++i)
        older.hidden[0].weight.push_back(whole.hidden[0].weight[o * kNumFeatures + i]);
    }
    auto read = ReadPolicyFile(write_raw("v2.safetensors", older, {{"feature_version", 2}}));
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->features.size(), static_cast<size_t>(old_f));
    auto a = LearnedPolicy::Create(whole), b = LearnedPolicy::Create(*read);
    ASSERT_TRUE(a.ok() && b.ok());
    std::vector<float> f = SomeFeatures();
    f[kNumFeatures - 2] = 3.0f, f[kNumFeatures - 1] = 7.0f;  // what only the whole network sees
    LearnedPolicy::Output oa, ob;
    a->Evaluate(f, &oa);
    b->Evaluate(f, &ob);
    EXPECT_NEAR(oa.p_attention, ob.p_attention, 1e-6);
    // Listed in another order, with the weights and normalisation in that order, the network is the same.
    PolicyNetwork reversed = older;
    std::reverse(reversed.features.begin(), reversed.features.end());
    std::reverse(reversed.input_mean.begin(), reversed.input_mean.end());
    std::reverse(reversed.input_inv_std.begin(), reversed.input_inv_std.end());
    for (int64_t o = 0; o < width; ++o) {
      auto row = reversed.hidden[0].weight.begin() + o * old_f;
      std::reverse(row, row + old_f);
    }
    auto c = LearnedPolicy::Create(reversed);
    ASSERT_TRUE(c.ok()) << c.status();
    LearnedPolicy::Output oc;
    c->Evaluate(f, &oc);
    EXPECT_NEAR(oc.p_attention, ob.p_attention, 1e-6);
    EXPECT_NE(oc.p_attention, 0.5);  // (the weights are not all zero)
  }
  PolicyNetwork nan = n;
  nan.hidden[0].weight[1] = NAN;
  expect_error(write_raw("nan.safetensors", nan, {}), "hidden.0.weight: not finite");
  std::vector<HostTensor> extra;
  extra.push_back(MakeHostTensor("surplus", {1}, std::vector<float>{0}, DType::kF32));
  expect_error(write_raw("extra.safetensors", n, {}, std::move(extra)), "unexpected tensor surplus");
  PolicyNetwork wide = n;
  wide.mode_head = {3, 4, std::vector<float>(12), std::vector<float>(3)};
  expect_error(write_raw("heads.safetensors", wide, {}), "mode head has 3 outputs");
}

class LearnedGenerationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_.emplace(testutil::TinyEngine(scratch_, LinearMixer::kMamba2, 4));
    RegisterPolicies(engine_->policies());
  }
  absl::StatusOr<GenerateResult> Run(const std::string& policy, int64_t prompt_len = 12, int64_t max_tokens = 10) {
    GenerateRequest q;
    for (int64_t i = 0; i < prompt_len; ++i) q.prompt_tokens.push_back(static_cast<int32_t>(4 + i % 20));
    q.max_tokens = max_tokens;
    q.stop_at_eos = false;
    q.policy = policy;
    return engine_->Generate(q);
  }
  std::string Write(const std::string& name, const PolicyNetwork& n) {
    const std::string path = scratch_.path() + "/" + name;
    EXPECT_TRUE(WritePolicyFile(path, n).ok());
    return path;
  }
  testutil::ScratchDir scratch_;
  std::optional<Engine> engine_;
};

TEST_F(LearnedGenerationTest, ModesFollowThePolicy) {
  auto all = Run("learned:" + Write("attn.safetensors", ConstantNetwork(10)));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->stats.linear_tokens, 0);
  EXPECT_EQ(all->stats.attention_tokens, 12 + 9);
  auto none = Run("learned:" + Write("lin.safetensors", ConstantNetwork(-10)));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->stats.attention_tokens, 0);
  auto reference = Run("attention");
  ASSERT_TRUE(reference.ok());
  EXPECT_EQ(all->tokens, reference->tokens);
}

TEST_F(LearnedGenerationTest, RoutedSpeculationKeepsTheOutput) {
  // Always attention, always draft 3 tokens: speculative rounds that must emit attention mode's tokens.
  const std::string path = Write("spec.safetensors", ConstantNetwork(10, {0, 3}, {-10, 10}));
  auto spec = Run("learned:" + path, 12, 24);
  auto reference = Run("attention", 12, 24);
  ASSERT_TRUE(spec.ok() && reference.ok()) << spec.status();
  EXPECT_EQ(spec->tokens, reference->tokens);
  ASSERT_TRUE(spec->stats.spec.has_value());
  EXPECT_GT(spec->stats.spec->rounds, 0);
  EXPECT_LT(spec->stats.spec->rounds, 23);  // fewer rounds than tokens: drafts were accepted
  EXPECT_GT(spec->stats.spec->drafted, 0);
}

TEST_F(LearnedGenerationTest, SampledDecisionsRepeatAcrossReplays) {
  // A 50/50 sampling policy on 4-token segments: the trace sees every decision, replays included, and a
  // replayed decision must equal the first one at the same (phase, position).
  auto p = LearnedPolicy::Create(ConstantNetwork(0));
  ASSERT_TRUE(p.ok());
  auto policy = std::make_shared<const LearnedPolicy>(*std::move(p));
  std::map<std::pair<int, int64_t>, Mode> seen;
  int conflicts = 0, attention = 0;
  engine_->policies().Register("sampled", "sampled", [&](std::string_view) -> absl::StatusOr<std::unique_ptr<Decoder>> {
    return MakeLearnedDecoder(policy, 7, [&](const router::RouterContext& c, const router::Decision& d) {
      auto [it, fresh] = seen.try_emplace({static_cast<int>(c.phase), c.position}, d.mode);
      conflicts += !fresh && it->second != d.mode;
      attention += fresh && d.mode == Mode::kAttention;
    });
  });
  auto r = Run("sampled", 40, 30);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(conflicts, 0);
  EXPECT_GT(attention, 3);
  EXPECT_LT(attention, static_cast<int>(seen.size()) - 3);
}

TEST_F(LearnedGenerationTest, APolicyWarnsOnceOnPromptsFarLongerThanItsTraining) {
  // `policy`: "learned:PATH", or (served) "NAME" and "learned:NAME" for the file a server was given at start.
  auto warnings = [&](const nlohmann::json& training, int64_t prompt_len, const std::string& policy = "") {
    PolicyNetwork n = ConstantNetwork(10);
    n.training = training;
    const std::string path = Write("p.safetensors", n);
    if (!policy.empty()) {
      EXPECT_TRUE(RegisterServedLearnedPolicies(engine_->policies(), {{"served", path}}).ok());
    }
    testing::internal::CaptureStderr();
    const auto run = Run(policy.empty() ? "learned:" + path : policy, prompt_len);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_TRUE(run.ok()) << run.status();
    int count = 0;
    for (size_t at = err.find("warning: policy "); at != std::string::npos; at = err.find("warning: policy ", at + 1)) {
      ++count;
    }
    return std::pair(count, err);
  };
  // Trained on prompts of up to 4 tokens, given 12: many decisions (segments of 4, then every step), one warning.
  const auto [count, err] = warnings({{"lengths", {2, 4}}}, 12);
  EXPECT_EQ(count, 1) << err;
  EXPECT_NE(err.find("trained on prompts of up to 4 tokens; this one has 12"), std::string::npos) << err;
  EXPECT_EQ(warnings({{"lengths", {8}}}, 12).first, 0);  // within twice its longest
  EXPECT_EQ(warnings({{"lambda", 1.0}}, 12).first, 0);   // lengths not recorded: nothing to compare
  PolicyNetwork recorded = ConstantNetwork(0);
  recorded.training = {{"lengths", {1024, 16000, 4096}}};
  EXPECT_EQ(ReadPolicyFile(Write("q.safetensors", recorded))->LongestTrainedPrompt(), 16000);
  for (const std::string served : {"served", "learned:served"}) {
    SetUp();  // a fresh registry
    const auto [n, e] = warnings({{"lengths", {4}}}, 12, served);
    EXPECT_EQ(n, 1) << served << ": " << e;
    EXPECT_NE(e.find("policy " + served + " was trained"), std::string::npos) << e;
  }
}

TEST_F(LearnedGenerationTest, BadPolicyNamesAreErrors) {
  EXPECT_FALSE(Run("learned:").ok());
  auto r = Run("learned:" + scratch_.path() + "/nope.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("nope.safetensors"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace oryx::policies
