// Tests for tasks/: the PRNG, MQAR and needle generators (determinism, layout re-parsed from the ids,
// vocab ranges, depth placement, bad parameters), the scorers, the training mixer, the grid and JSON.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tasks/copy.h"
#include "tasks/haystack.h"
#include "tasks/mqar.h"
#include "tasks/niah.h"
#include "base/rng.h"
#include "tasks/scoring.h"
#include "tasks/task_example.h"
#include "tasks/task_mix.h"

namespace oryx::tasks {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The Oryx tokenizer's layout: specials 0..17, newline 18, content from 19.
TaskVocab TestVocab() {
  TaskVocab v;
  v.bos = 2;
  v.eos = 3;
  v.sep = 4;
  v.query = 5;
  v.answer = 6;
  v.needle = 7;
  v.key = 8;
  v.value = 9;
  v.first_free_id = 19;
  v.vocab_size = 1000;
  for (int d = 0; d < 10; ++d) v.digits[d] = 100 + d;
  return v;
}

MqarConfig TestMqar(int32_t pairs) {
  MqarConfig c;
  c.key_range = {200, 400};
  c.value_range = {400, 600};
  c.filler_range = {600, 1000};
  c.num_pairs = pairs;
  return c;
}

NiahConfig TestNiah(int32_t needles) {
  NiahConfig c;
  c.key_range = {200, 300};
  c.value_range = {300, 400};
  c.key_length = 2;
  c.value_length = 3;
  c.num_needles = needles;
  return c;
}

// Haystack "text" whose token i is 19 + i: consecutive ids, so the text around the needles can be checked
// for being one unbroken window of the source.
constexpr int32_t kHaystackSize = 900;
InMemoryHaystack CountingHaystack() {
  std::vector<int32_t> tokens(kHaystackSize);
  for (int32_t i = 0; i < kHaystackSize; ++i) tokens[i] = 19 + i;
  return InMemoryHaystack(std::move(tokens));
}

bool IsHaystackToken(int32_t id) { return id >= 19 && id < 19 + kHaystackSize; }

// A source that always fails, or returns a marker.
class BadHaystack : public HaystackSource {
 public:
  explicit BadHaystack(bool fail) : fail_(fail) {}
  absl::StatusOr<std::vector<int32_t>> Tokens(int64_t n, uint64_t) const override {
    if (fail_) return absl::UnavailableError("shard missing");
    std::vector<int32_t> out(n, 500);
    out[n / 2] = TestVocab().needle;
    return out;
  }

 private:
  bool fail_;
};

// ---------------------------------------------------------------------------------------------------------
// Rng

TEST(RngTest, SameSeedSameStreamDifferentSeedDifferentStream) {
  Rng a(42), b(42), c(43);
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a.Next();
    EXPECT_EQ(x, b.Next());
    EXPECT_NE(x, c.Next());
  }
}

TEST(RngTest, UniformIntStaysInRangeAndCoversIt) {
  Rng rng(7);
  std::vector<int> counts(10, 0);
  for (int i = 0; i < 10000; ++i) {
    const uint64_t x = rng.UniformInt(10);
    ASSERT_LT(x, 10u);
    ++counts[x];
  }
  for (int c : counts) EXPECT_NEAR(c, 1000, 150);
  for (int i = 0; i < 1000; ++i) {
    const int64_t x = rng.UniformRange(-3, 3);
    EXPECT_GE(x, -3);
    EXPECT_LE(x, 3);
    const double u = rng.UniformDouble();
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
  }
}

TEST(RngTest, SampleWithoutReplacementIsDistinct) {
  Rng rng(1);
  const std::vector<int64_t> all = SampleWithoutReplacement(rng, 50, 50);
  EXPECT_EQ(std::set<int64_t>(all.begin(), all.end()).size(), 50u);
  const std::vector<int64_t> some = SampleWithoutReplacement(rng, 1'000'000'000, 20);
  EXPECT_EQ(std::set<int64_t>(some.begin(), some.end()).size(), 20u);
  for (int64_t x : some) EXPECT_LT(x, 1'000'000'000);
}

TEST(RngTest, WeightedSampleSkipsZeroWeightsAndFavoursHeavyOnes) {
  Rng rng(3);
  const std::vector<double> weights = {0.0, 100.0, 1.0, 0.0, 1.0};
  int heavy_first = 0;
  for (int i = 0; i < 200; ++i) {
    const std::vector<int64_t> got = WeightedSampleWithoutReplacement(rng, weights, 3);
    ASSERT_EQ(got.size(), 3u);
    EXPECT_EQ(std::set<int64_t>(got.begin(), got.end()), (std::set<int64_t>{1, 2, 4}));
    heavy_first += got[0] == 1 ? 1 : 0;
  }
  EXPECT_GT(heavy_first, 180);
}

TEST(RngTest, MixSeedDependsOnEveryWordAndOrder) {
  EXPECT_NE(MixSeed({1, 2}), MixSeed({2, 1}));
  EXPECT_NE(MixSeed({1, 2}), MixSeed({1, 3}));
  EXPECT_NE(MixSeed({0}), MixSeed({0, 0}));
  EXPECT_EQ(MixSeed({5, 6, 7}), MixSeed({5, 6, 7}));
}

// ---------------------------------------------------------------------------------------------------------
// TaskVocab

TEST(TaskVocabTest, ValidatesIds) {
  EXPECT_TRUE(TestVocab().Validate().ok());
  TaskVocab dup = TestVocab();
  dup.key = dup.value;
  EXPECT_THAT(dup.Validate().message(), HasSubstr("share id"));
  TaskVocab high = TestVocab();
  high.sep = 50;  // not below first_free_id
  EXPECT_FALSE(high.Validate().ok());
  TaskVocab missing = TestVocab();
  missing.needle = -1;
  EXPECT_FALSE(missing.Validate().ok());
  TaskVocab no_digits = TestVocab();
  no_digits.digits[3] = -1;
  EXPECT_TRUE(no_digits.Validate().ok());
  EXPECT_FALSE(no_digits.ValidateDigits().ok());
  EXPECT_FALSE(TestVocab().ValidateRange({5, 30}, "x").ok());      // starts among the specials
  EXPECT_FALSE(TestVocab().ValidateRange({900, 1001}, "x").ok());  // past the vocab
  EXPECT_FALSE(TestVocab().ValidateRange({300, 300}, "x").ok());   // empty
}

TEST(TaskKindTest, NamesRoundTrip) {
  for (TaskKind k : {TaskKind::kMqar, TaskKind::kNiahSingle, TaskKind::kNiahMultiKey, TaskKind::kPasskey,
                     TaskKind::kCopy}) {
    auto parsed = ParseTaskKind(TaskKindName(k));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, k);
  }
  EXPECT_FALSE(ParseTaskKind("niah").ok());
}

// ---------------------------------------------------------------------------------------------------------
// MQAR

TaskExample MustMqar(int32_t pairs, int32_t length, uint64_t seed) {
  auto ex = MakeMqarExample(TestVocab(), TestMqar(pairs), length, seed);
  EXPECT_TRUE(ex.ok()) << ex.status();
  return *ex;
}

TEST(MqarTest, DeterministicBySeed) {
  const TaskExample a = MustMqar(16, 256, 9);
  const TaskExample b = MustMqar(16, 256, 9);
  const TaskExample c = MustMqar(16, 256, 10);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.loss_mask, b.loss_mask);
  EXPECT_EQ(a.answers, b.answers);
  EXPECT_NE(a.ids, c.ids);
}

// The exact output for one seed, so that a change of the generator (or a platform that samples
// differently) is caught.
TEST(MqarTest, GoldenExample) {
  // BOS k1 v1 k2 v2 | k2 v2 | k1 v1 | filler filler
  EXPECT_THAT(MustMqar(2, 11, 1234).ids, ElementsAre(2, 209, 538, 368, 574, 368, 574, 209, 538, 691, 658));
  // xoshiro256** seeded by SplitMix64(0), checked against an independent Python implementation.
  EXPECT_EQ(Rng(0).Next(), 11091344671253066420ULL);
}

TEST(MqarTest, LayoutReparsesAndRespectsRanges) {
  const MqarConfig config = TestMqar(32);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    for (int32_t length : {129, 256, 1000}) {
      const TaskExample ex = MustMqar(32, length, seed);
      ASSERT_TRUE(ex.Validate().ok()) << ex.Validate();
      ASSERT_EQ(ex.length(), length);
      EXPECT_EQ(ex.kind, TaskKind::kMqar);
      EXPECT_EQ(ex.num_pairs, 32);
      EXPECT_FALSE(ex.depth.has_value());
      EXPECT_EQ(ex.ids[0], TestVocab().bos);
      // Context: distinct keys from the key range, each followed by a value from the value range.
      std::map<int32_t, int32_t> value_of;
      std::set<int32_t> values;
      for (int32_t i = 0; i < 32; ++i) {
        const int32_t k = ex.ids[1 + 2 * i], v = ex.ids[2 + 2 * i];
        ASSERT_TRUE(config.key_range.contains(k)) << k;
        ASSERT_TRUE(config.value_range.contains(v)) << v;
        ASSERT_TRUE(value_of.emplace(k, v).second) << "duplicate key " << k;
        ASSERT_TRUE(values.insert(v).second) << "duplicate value " << v;
      }
      // Queries: every key token after the context is a key seen before, followed by its value, at an
      // even offset (a slot), and each key is queried exactly once; all else is filler.
      std::set<int32_t> queried;
      std::vector<int32_t> answer_positions;
      const int32_t query_begin = 1 + 2 * 32;
      for (int32_t t = query_begin; t < length; ++t) {
        const int32_t id = ex.ids[t];
        if (config.key_range.contains(id)) {
          ASSERT_EQ((t - query_begin) % 2, 0);
          ASSERT_TRUE(value_of.count(id)) << "query of unseen key " << id;
          ASSERT_LT(t + 1, length);
          EXPECT_EQ(ex.ids[t + 1], value_of[id]);
          EXPECT_TRUE(queried.insert(id).second);
          answer_positions.push_back(t + 1);
          EXPECT_EQ(ex.loss_mask[t], 1);
          ++t;  // skip the value
        } else {
          EXPECT_TRUE(config.filler_range.contains(id)) << id << " at " << t;
          EXPECT_EQ(ex.loss_mask[t], 0);
        }
      }
      EXPECT_EQ(queried.size(), 32u);
      // Answer spans are exactly the values after the queries; the mask has nothing else.
      ASSERT_EQ(ex.answers.size(), 32u);
      for (size_t i = 0; i < ex.answers.size(); ++i) {
        EXPECT_EQ(ex.answers[i].begin, answer_positions[i]);
        EXPECT_EQ(ex.answers[i].length, 1);
        EXPECT_EQ(value_of[ex.ids[ex.answers[i].begin - 1]], ex.ids[ex.answers[i].begin]);
      }
      EXPECT_EQ(std::count(ex.loss_mask.begin(), ex.loss_mask.end(), 1), 32);
      EXPECT_EQ(ex.prompt_length, ex.answers[0].begin);
    }
  }
}

TEST(MqarTest, QueriesFollowAPowerLaw) {
  // With power_a = 0.01 the slot weights fall like 1/g: most queries land in the first half of the slots.
  int first_half = 0, total = 0;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const TaskExample ex = MustMqar(4, 1 + 8 + 2 * 200, seed);
    for (const AnswerSpan& a : ex.answers) {
      const int32_t slot = (a.begin - 1 - 9) / 2;
      first_half += slot < 100 ? 1 : 0;
      ++total;
    }
  }
  EXPECT_GT(static_cast<double>(first_half) / total, 0.75);
  EXPECT_LT(static_cast<double>(first_half) / total, 0.97);  // but the tail is reached
}

TEST(MqarTest, FitsExactlyAtTheLimit) {
  EXPECT_EQ(MqarMaxPairs(11), 2);
  EXPECT_EQ(MqarMaxPairs(12), 2);
  EXPECT_EQ(MqarMaxPairs(13), 3);
  const TaskExample ex = MustMqar(3, 13, 5);  // every slot is a query
  EXPECT_EQ(std::count(ex.loss_mask.begin(), ex.loss_mask.end(), 1), 3);
}

TEST(MqarTest, BadParametersAreErrors) {
  const TaskVocab v = TestVocab();
  EXPECT_THAT(MakeMqarExample(v, TestMqar(32), 128, 0).status().message(), HasSubstr("do not fit"));
  MqarConfig empty = TestMqar(4);
  empty.key_range = {300, 300};
  EXPECT_THAT(MakeMqarExample(v, empty, 128, 0).status().message(), HasSubstr("empty"));
  MqarConfig overlap = TestMqar(4);
  overlap.value_range = {350, 450};
  EXPECT_THAT(MakeMqarExample(v, overlap, 128, 0).status().message(), HasSubstr("overlap"));
  MqarConfig filler = TestMqar(4);
  filler.filler_range = {399, 401};
  EXPECT_FALSE(MakeMqarExample(v, filler, 128, 0).ok());
  MqarConfig small = TestMqar(8);
  small.key_range = {200, 205};
  EXPECT_THAT(MakeMqarExample(v, small, 128, 0).status().message(), HasSubstr("distinct keys"));
  EXPECT_FALSE(MakeMqarExample(v, TestMqar(0), 128, 0).ok());
  MqarConfig outside = TestMqar(4);
  outside.filler_range = {600, 2000};
  EXPECT_FALSE(MakeMqarExample(v, outside, 128, 0).ok());
  MqarConfig power = TestMqar(4);
  power.power_a = 0;
  EXPECT_FALSE(MakeMqarExample(v, power, 128, 0).ok());
  EXPECT_FALSE(MakeMqarExample(v, TestMqar(1), 0, 0).ok());
  for (const auto& s :
       {MakeMqarExample(v, TestMqar(32), 128, 0).status(), MakeMqarExample(v, empty, 128, 0).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Needle in a haystack

struct ParsedNeedle {
  int32_t position;
  std::vector<int32_t> key;
  std::vector<int32_t> value;
};

// Finds every "<|needle|> [<|key|> k..] <|value|> v.. <|sep|>" block before the question, and returns the
// remaining (haystack) tokens of the context in `text`.
std::vector<ParsedNeedle> ParseNeedles(const TaskExample& ex, int32_t context_end,
                                       std::vector<int32_t>* text) {
  const TaskVocab v = TestVocab();
  std::vector<ParsedNeedle> out;
  for (int32_t t = 1; t < context_end; ++t) {
    if (ex.ids[t] != v.needle) {
      text->push_back(ex.ids[t]);
      continue;
    }
    ParsedNeedle n{t, {}, {}};
    ++t;
    if (ex.ids[t] == v.key) {
      for (++t; ex.ids[t] != v.value; ++t) n.key.push_back(ex.ids[t]);
    }
    EXPECT_EQ(ex.ids[t], v.value);
    for (++t; ex.ids[t] != v.sep; ++t) n.value.push_back(ex.ids[t]);
    out.push_back(n);
  }
  return out;
}

// The haystack text must be one unbroken (wrapping) window of the counting source.
void ExpectUnbrokenText(const std::vector<int32_t>& text) {
  for (size_t i = 1; i < text.size(); ++i) {
    ASSERT_TRUE(IsHaystackToken(text[i]));
    EXPECT_EQ((text[i - 1] - 19 + 1) % kHaystackSize, text[i] - 19) << "break at " << i;
  }
}

TEST(NiahTest, DocumentedExample) {
  const InMemoryHaystack hay({20, 21, 22});
  NiahConfig c = TestNiah(1);
  c.key_length = 1;
  c.value_length = 1;
  auto ex = MakeNiahExample(TestVocab(), c, hay, 16, 0.5, 3);
  ASSERT_TRUE(ex.ok()) << ex.status();
  const std::vector<int32_t>& ids = ex->ids;
  ASSERT_EQ(ids.size(), 16u);
  const int32_t k = ids[5], val = ids[7];
  // BOS a b <|needle|> <|key|> k <|value|> v <|sep|> c <|query|> <|key|> k <|answer|> v EOS
  EXPECT_THAT(std::vector<int32_t>(ids.begin() + 3, ids.end()),
              ElementsAre(7, 8, k, 9, val, 4, ::testing::_, 5, 8, k, 6, val, 3));
  EXPECT_EQ(ex->needle_position, 3);
  EXPECT_EQ(ex->prompt_length, 14);
  EXPECT_THAT(ex->answers, ElementsAre(AnswerSpan{14, 1}));
  EXPECT_THAT(ex->loss_mask, ElementsAre(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0));
}

TEST(NiahTest, SingleNeedleLayoutAndDepth) {
  const InMemoryHaystack hay = CountingHaystack();
  const TaskVocab v = TestVocab();
  const NiahConfig c = TestNiah(1);
  const int32_t needle_len = 2 + 3 + 4, tail = 2 + 3 + 3 + 1;
  for (int32_t length : {NiahMinLength(c), 64, 333, 2048}) {
    for (double depth : {0.0, 0.1, 0.25, 0.5, 0.9, 1.0}) {
      for (uint64_t seed : {1u, 2u}) {
        auto ex = MakeNiahExample(v, c, hay, length, depth, seed);
        ASSERT_TRUE(ex.ok()) << ex.status();
        ASSERT_TRUE(ex->Validate().ok()) << ex->Validate();
        ASSERT_EQ(ex->length(), length);
        EXPECT_EQ(ex->kind, TaskKind::kNiahSingle);
        EXPECT_EQ(ex->num_needles, 1);
        EXPECT_EQ(ex->depth, depth);
        const int32_t context_end = length - tail;  // where <|query|> sits
        std::vector<int32_t> text;
        const std::vector<ParsedNeedle> needles = ParseNeedles(*ex, context_end, &text);
        ASSERT_EQ(needles.size(), 1u);
        ExpectUnbrokenText(text);
        EXPECT_EQ(static_cast<int32_t>(text.size()), context_end - 1 - needle_len);
        // The needle starts at the requested fraction of the context, within one needle length.
        EXPECT_EQ(needles[0].position, ex->needle_position);
        const double want = 1 + depth * (context_end - 1);
        EXPECT_LE(std::abs(needles[0].position - want), needle_len) << length << " " << depth;
        if (depth == 0.0) {
          EXPECT_EQ(needles[0].position, 1);
        }
        if (depth == 1.0) {
          EXPECT_EQ(needles[0].position + needle_len, context_end);
        }
        // Question asks the needle's key; the answer is its value, then EOS.
        EXPECT_THAT(std::vector<int32_t>(ex->ids.begin() + context_end, ex->ids.begin() + context_end + 5),
                    ElementsAre(v.query, v.key, needles[0].key[0], needles[0].key[1], v.answer));
        ASSERT_EQ(ex->answers.size(), 1u);
        EXPECT_EQ(ex->answers[0].begin, context_end + 5);
        EXPECT_EQ(ex->AnswerTokens(0), needles[0].value);
        EXPECT_EQ(ex->ids.back(), v.eos);
        for (int32_t k : needles[0].key) EXPECT_TRUE(c.key_range.contains(k));
        for (int32_t x : needles[0].value) EXPECT_TRUE(c.value_range.contains(x));
        // Loss only on the answer (and the EOS after it).
        EXPECT_EQ(std::count(ex->loss_mask.begin(), ex->loss_mask.end(), 1), 4);
        EXPECT_EQ(ex->prompt_length, context_end + 5);
      }
    }
  }
}

TEST(NiahTest, DeterministicBySeed) {
  const InMemoryHaystack hay = CountingHaystack();
  auto a = MakeNiahExample(TestVocab(), TestNiah(3), hay, 500, 0.3, 77);
  auto b = MakeNiahExample(TestVocab(), TestNiah(3), hay, 500, 0.3, 77);
  auto c = MakeNiahExample(TestVocab(), TestNiah(3), hay, 500, 0.3, 78);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->ids, b->ids);
  EXPECT_NE(a->ids, c->ids);
}

TEST(NiahTest, MultiKeyDistractorsHaveDistinctKeys) {
  const InMemoryHaystack hay = CountingHaystack();
  const TaskVocab v = TestVocab();
  const NiahConfig c = TestNiah(4);
  const int32_t needle_len = 9, tail = 9;
  for (uint64_t seed = 0; seed < 30; ++seed) {
    for (double depth : {0.0, 0.5, 1.0}) {
      const int32_t length = 128 + static_cast<int32_t>(seed);
      auto ex = MakeNiahExample(v, c, hay, length, depth, seed);
      ASSERT_TRUE(ex.ok()) << ex.status();
      ASSERT_TRUE(ex->Validate().ok());
      ASSERT_EQ(ex->length(), length);
      EXPECT_EQ(ex->kind, TaskKind::kNiahMultiKey);
      EXPECT_EQ(ex->num_needles, 4);
      const int32_t context_end = length - tail;
      std::vector<int32_t> text;
      const std::vector<ParsedNeedle> needles = ParseNeedles(*ex, context_end, &text);
      ASSERT_EQ(needles.size(), 4u);
      ExpectUnbrokenText(text);
      std::set<std::vector<int32_t>> keys, values;
      for (const ParsedNeedle& n : needles) {
        keys.insert(n.key);
        values.insert(n.value);
      }
      EXPECT_EQ(keys.size(), 4u);
      EXPECT_EQ(values.size(), 4u);
      // The asked needle is the one at needle_position; the question names its key and the answer is its
      // value.
      const auto asked = std::find_if(needles.begin(), needles.end(), [&](const ParsedNeedle& n) {
        return n.position == ex->needle_position;
      });
      ASSERT_NE(asked, needles.end());
      EXPECT_EQ(std::vector<int32_t>(ex->ids.begin() + context_end + 2, ex->ids.begin() + context_end + 4),
                asked->key);
      EXPECT_EQ(ex->AnswerTokens(0), asked->value);
      const double want = 1 + depth * (context_end - 1);
      EXPECT_LE(std::abs(ex->needle_position - want), needle_len);
    }
  }
}

TEST(NiahTest, Passkey) {
  const InMemoryHaystack hay = CountingHaystack();
  const TaskVocab v = TestVocab();
  PasskeyConfig c;
  c.num_digits = 5;
  std::set<std::vector<int32_t>> answers;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    auto ex = MakePasskeyExample(v, c, hay, 300, 0.4, seed);
    ASSERT_TRUE(ex.ok()) << ex.status();
    ASSERT_TRUE(ex->Validate().ok());
    ASSERT_EQ(ex->length(), 300);
    EXPECT_EQ(ex->kind, TaskKind::kPasskey);
    const std::vector<int32_t> answer = ex->AnswerTokens(0);
    ASSERT_EQ(answer.size(), 5u);
    EXPECT_NE(answer[0], v.digits[0]);
    for (int32_t d : answer) EXPECT_TRUE(d >= 100 && d < 110);
    answers.insert(answer);
    // <|needle|> <|value|> digits <|sep|> at the needle; <|query|> <|answer|> digits EOS at the end.
    const int32_t p = ex->needle_position;
    EXPECT_EQ(ex->ids[p], v.needle);
    EXPECT_EQ(ex->ids[p + 1], v.value);
    EXPECT_EQ(std::vector<int32_t>(ex->ids.begin() + p + 2, ex->ids.begin() + p + 7), answer);
    EXPECT_EQ(ex->ids[p + 7], v.sep);
    EXPECT_THAT(std::vector<int32_t>(ex->ids.end() - 8, ex->ids.end() - 6), ElementsAre(v.query, v.answer));
    EXPECT_EQ(ex->ids.back(), v.eos);
    EXPECT_LE(std::abs(p - (1 + 0.4 * (300 - 1 - 8))), 8);
  }
  EXPECT_GT(answers.size(), 15u);
  EXPECT_EQ(PasskeyMinLength(c), 1 + 8 + 2 + 5 + 1);
  EXPECT_TRUE(MakePasskeyExample(v, c, hay, PasskeyMinLength(c), 1.0, 0).ok());
}

TEST(NiahTest, BadParametersAreErrors) {
  const InMemoryHaystack hay = CountingHaystack();
  const TaskVocab v = TestVocab();
  const NiahConfig c = TestNiah(1);
  for (double depth : {-0.1, 1.1, std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_THAT(MakeNiahExample(v, c, hay, 100, depth, 0).status().message(), HasSubstr("depth"));
    EXPECT_FALSE(MakePasskeyExample(v, {}, hay, 100, depth, 0).ok());
  }
  EXPECT_THAT(MakeNiahExample(v, c, hay, NiahMinLength(c) - 1, 0.5, 0).status().message(),
              HasSubstr("shorter"));
  EXPECT_TRUE(MakeNiahExample(v, c, hay, NiahMinLength(c), 0.5, 0).ok());
  EXPECT_FALSE(MakePasskeyExample(v, {}, hay, 10, 0.5, 0).ok());
  NiahConfig empty = c;
  empty.value_range = {300, 300};
  EXPECT_THAT(MakeNiahExample(v, empty, hay, 100, 0.5, 0).status().message(), HasSubstr("empty"));
  NiahConfig zero = c;
  zero.key_length = 0;
  EXPECT_FALSE(MakeNiahExample(v, zero, hay, 100, 0.5, 0).ok());
  NiahConfig crowded = TestNiah(10);
  crowded.key_range = {200, 202};
  crowded.key_length = 2;  // 4 possible keys for 10 needles
  EXPECT_FALSE(MakeNiahExample(v, crowded, hay, 500, 0.5, 0).ok());
  TaskVocab no_digits = v;
  no_digits.digits.fill(-1);
  EXPECT_THAT(MakePasskeyExample(no_digits, {}, hay, 100, 0.5, 0).status().message(), HasSubstr("digit"));
  // Haystack problems: a marker inside the text, and the source's own error.
  EXPECT_THAT(MakeNiahExample(v, c, BadHaystack(false), 100, 0.5, 0).status().message(), HasSubstr("marker"));
  EXPECT_EQ(MakeNiahExample(v, c, BadHaystack(true), 100, 0.5, 0).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(InMemoryHaystack({}).Tokens(3, 0).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(HaystackTest, InMemoryIsSeededAndWraps) {
  const InMemoryHaystack hay({10, 11, 12, 13});
  auto a = hay.Tokens(10, 5);
  auto b = hay.Tokens(10, 5);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  ASSERT_EQ(a->size(), 10u);
  for (size_t i = 1; i < a->size(); ++i) EXPECT_EQ((*a)[i], 10 + ((*a)[i - 1] - 10 + 1) % 4);
  std::set<int32_t> starts;
  for (uint64_t s = 0; s < 50; ++s) starts.insert((*hay.Tokens(1, s))[0]);
  EXPECT_EQ(starts.size(), 4u);
  EXPECT_TRUE(hay.Tokens(0, 1)->empty());
}

// ---------------------------------------------------------------------------------------------------------
// Scoring

// A hand-made single-answer example: BOS x x <|query|> <|answer|> 50 51 52 EOS.
TaskExample HandExample() {
  TaskExample ex;
  ex.kind = TaskKind::kNiahSingle;
  ex.ids = {2, 30, 31, 5, 6, 50, 51, 52, 3};
  ex.prompt_length = 5;
  ex.answers = {{5, 3}};
  ex.loss_mask = {0, 0, 0, 0, 1, 1, 1, 1, 0};
  ex.depth = 0.5;
  return ex;
}

// Teacher-forced predictions that are all right: predicted[t] = ids[t + 1].
std::vector<int32_t> PerfectPredictions(const TaskExample& ex) {
  return std::vector<int32_t>(ex.ids.begin() + 1, ex.ids.end());
}

TEST(ScoringTest, GenerationExactMatch) {
  const TaskExample ex = HandExample();
  ASSERT_TRUE(ex.Validate().ok()) << ex.Validate();
  auto perfect = ScoreGeneration(ex, std::vector<int32_t>{50, 51, 52, 3});  // trailing EOS ignored
  ASSERT_TRUE(perfect.ok());
  EXPECT_TRUE(perfect->exact_match);
  EXPECT_EQ(perfect->correct_tokens, 3);
  EXPECT_EQ(perfect->correct_answers, 1);
  auto one_wrong = ScoreGeneration(ex, std::vector<int32_t>{50, 99, 52});
  ASSERT_TRUE(one_wrong.ok());
  EXPECT_FALSE(one_wrong->exact_match);
  EXPECT_EQ(one_wrong->correct_tokens, 2);
  EXPECT_EQ(one_wrong->correct_answers, 0);
  auto short_gen = ScoreGeneration(ex, std::vector<int32_t>{50, 51});
  ASSERT_TRUE(short_gen.ok());
  EXPECT_FALSE(short_gen->exact_match);
  EXPECT_EQ(short_gen->correct_tokens, 2);
  EXPECT_EQ(short_gen->answer_tokens, 3);
}

TEST(ScoringTest, TeacherForcedExactMatchOnMqar) {
  const TaskExample ex = MustMqar(8, 100, 4);
  std::vector<int32_t> predicted = PerfectPredictions(ex);
  auto perfect = ScoreTeacherForced(ex, predicted);
  ASSERT_TRUE(perfect.ok());
  EXPECT_TRUE(perfect->exact_match);
  EXPECT_EQ(perfect->correct_answers, 8);
  EXPECT_EQ(perfect->num_answers, 8);
  // Wrong predictions outside the answers do not count.
  for (size_t t = 0; t < predicted.size(); ++t) {
    if (ex.loss_mask[t] == 0) predicted[t] = 0;
  }
  EXPECT_TRUE(ScoreTeacherForced(ex, predicted)->exact_match);
  predicted[ex.answers[3].begin - 1] = 1;  // one wrong answer
  auto one_wrong = ScoreTeacherForced(ex, predicted);
  ASSERT_TRUE(one_wrong.ok());
  EXPECT_FALSE(one_wrong->exact_match);
  EXPECT_EQ(one_wrong->correct_answers, 7);
  EXPECT_EQ(one_wrong->correct_tokens, 7);
  // Too few predictions, and free generation of a many-answer example, are errors.
  EXPECT_FALSE(
      ScoreTeacherForced(ex, std::span<const int32_t>(predicted).first(ex.answers.back().begin - 1)).ok());
  EXPECT_TRUE(
      ScoreTeacherForced(ex, std::span<const int32_t>(predicted).first(ex.answers.back().begin)).ok());
  EXPECT_EQ(ScoreGeneration(ex, predicted).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ScoringTest, TeacherForcedMatchesGenerationOnNeedles) {
  const TaskExample ex = HandExample();
  auto tf = ScoreTeacherForced(ex, PerfectPredictions(ex));
  ASSERT_TRUE(tf.ok());
  EXPECT_TRUE(tf->exact_match);
  EXPECT_EQ(tf->correct_tokens, 3);
}

TEST(ScoringTest, AnswerLogLikelihood) {
  const TaskExample ex = HandExample();
  const AnswerTargets targets = GetAnswerTargets(ex);
  EXPECT_THAT(targets.positions, ElementsAre(4, 5, 6));
  EXPECT_THAT(targets.targets, ElementsAre(50, 51, 52));
  // Array form: entries at positions 4, 5, 6 count.
  std::vector<float> lp = {-9, -9, -9, -9, -0.5f, -1.0f, -0.25f, -9};
  auto ll = AnswerLogLikelihood(ex, lp);
  ASSERT_TRUE(ll.ok());
  EXPECT_DOUBLE_EQ(*ll, -1.75);
  EXPECT_FALSE(AnswerLogLikelihood(ex, std::span<const float>(lp).first(6)).ok());
  lp[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(AnswerLogLikelihood(ex, lp).ok());
  lp[5] = 0.5f;
  EXPECT_FALSE(AnswerLogLikelihood(ex, lp).ok());
  // Function form: asked exactly for the answer positions and targets.
  auto fn = [](std::span<const int32_t> positions,
               std::span<const int32_t> tgts) -> absl::StatusOr<std::vector<double>> {
    EXPECT_THAT(std::vector<int32_t>(positions.begin(), positions.end()), ElementsAre(4, 5, 6));
    EXPECT_THAT(std::vector<int32_t>(tgts.begin(), tgts.end()), ElementsAre(50, 51, 52));
    return std::vector<double>{-1.0, -2.0, -3.0};
  };
  auto ll_fn = AnswerLogLikelihood(ex, fn);
  ASSERT_TRUE(ll_fn.ok());
  EXPECT_DOUBLE_EQ(*ll_fn, -6.0);
  auto bad_count = [](std::span<const int32_t>,
                      std::span<const int32_t>) -> absl::StatusOr<std::vector<double>> {
    return std::vector<double>{-1.0};
  };
  EXPECT_FALSE(AnswerLogLikelihood(ex, bad_count).ok());
  auto failing = [](std::span<const int32_t>,
                    std::span<const int32_t>) -> absl::StatusOr<std::vector<double>> {
    return absl::InternalError("model failed");
  };
  EXPECT_EQ(AnswerLogLikelihood(ex, failing).status().code(), absl::StatusCode::kInternal);
}

TEST(ScoringTest, AggregatesByTaskLengthDepth) {
  ScoreAggregator agg;
  auto add = [&](TaskKind kind, int32_t length, std::optional<double> depth, bool right,
                 std::optional<double> ll) {
    ExampleScore s;
    s.kind = kind;
    s.length = length;
    s.depth = depth;
    s.num_answers = 1;
    s.correct_answers = right ? 1 : 0;
    s.answer_tokens = 2;
    s.correct_tokens = right ? 2 : 1;
    s.exact_match = right;
    s.log_likelihood = ll;
    agg.Add(s);
  };
  add(TaskKind::kNiahSingle, 512, 0.5, true, -1.0);
  add(TaskKind::kNiahSingle, 512, 0.5, false, -3.0);
  add(TaskKind::kNiahSingle, 512, 0.0, true, std::nullopt);
  add(TaskKind::kMqar, 256, std::nullopt, true, std::nullopt);
  const std::vector<AggregateResult> r = agg.Results();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].kind, TaskKind::kMqar);
  EXPECT_FALSE(r[0].depth.has_value());
  EXPECT_FALSE(r[0].mean_log_likelihood.has_value());
  EXPECT_EQ(r[1].depth, 0.0);
  EXPECT_EQ(r[2].depth, 0.5);
  EXPECT_EQ(r[2].n, 2);
  EXPECT_DOUBLE_EQ(r[2].accuracy, 0.5);
  EXPECT_DOUBLE_EQ(r[2].token_accuracy, 0.75);
  EXPECT_DOUBLE_EQ(*r[2].mean_log_likelihood, -2.0);
  EXPECT_DOUBLE_EQ(*r[2].mean_token_log_likelihood, -1.0);
  const std::vector<AggregateResult> by_length = agg.Results(/*by_depth=*/false);
  ASSERT_EQ(by_length.size(), 2u);
  EXPECT_EQ(by_length[1].n, 3);
  EXPECT_DOUBLE_EQ(by_length[1].accuracy, 2.0 / 3.0);
  EXPECT_EQ(by_length[1].n_log_likelihood, 2);

  const nlohmann::json j = ToJson(r[2]);
  EXPECT_EQ(j["task"], "niah_single");
  EXPECT_EQ(j["length"], 512);
  EXPECT_EQ(j["depth"], 0.5);
  EXPECT_EQ(j["n"], 2);
  EXPECT_EQ(j["accuracy"], 0.5);
  EXPECT_EQ(j["mean_log_likelihood"], -2.0);
  EXPECT_TRUE(ToJson(r[0])["depth"].is_null());
  EXPECT_TRUE(ToJson(r[0])["mean_log_likelihood"].is_null());
}

// ---------------------------------------------------------------------------------------------------------
// JSON of examples

TEST(ExampleJsonTest, RoundTrips) {
  const InMemoryHaystack hay = CountingHaystack();
  auto niah = MakeNiahExample(TestVocab(), TestNiah(2), hay, 80, 0.3, 5);
  ASSERT_TRUE(niah.ok());
  for (const TaskExample& ex : {MustMqar(4, 40, 1), *niah}) {
    const nlohmann::json j = ToJson(ex);
    EXPECT_EQ(j["task"], std::string(ex.task()));
    EXPECT_EQ(j["length"], ex.length());
    auto back = TaskExampleFromJson(nlohmann::json::parse(j.dump()));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->ids, ex.ids);
    EXPECT_EQ(back->loss_mask, ex.loss_mask);
    EXPECT_EQ(back->answers, ex.answers);
    EXPECT_EQ(back->kind, ex.kind);
    EXPECT_EQ(back->seed, ex.seed);
    EXPECT_EQ(back->depth, ex.depth);
    EXPECT_EQ(back->needle_position, ex.needle_position);
    EXPECT_EQ(back->num_pairs, ex.num_pairs);
    EXPECT_EQ(back->num_needles, ex.num_needles);
  }
  EXPECT_TRUE(ToJson(MustMqar(4, 40, 1))["depth"].is_null());
}

TEST(ExampleJsonTest, RejectsBadInput) {
  nlohmann::json j = ToJson(HandExample());
  EXPECT_TRUE(TaskExampleFromJson(j).ok());
  nlohmann::json wrong_length = j;
  wrong_length["length"] = 3;
  EXPECT_FALSE(TaskExampleFromJson(wrong_length).ok());
  nlohmann::json bad_span = j;
  bad_span["answers"][0]["begin"] = 100;
  EXPECT_FALSE(TaskExampleFromJson(bad_span).ok());
  nlohmann::json missing = j;
  missing.erase("ids");
  EXPECT_THAT(TaskExampleFromJson(missing).status().message(), HasSubstr("ids"));
  nlohmann::json bad_task = j;
  bad_task["task"] = "copying";
  EXPECT_FALSE(TaskExampleFromJson(bad_task).ok());
  nlohmann::json bad_mask = j;
  bad_mask["loss_mask"][4] = 0;  // an answer position without loss
  EXPECT_FALSE(TaskExampleFromJson(bad_mask).ok());
  EXPECT_FALSE(TaskExampleFromJson(nlohmann::json::array()).ok());
}

// ---------------------------------------------------------------------------------------------------------
// Dispatcher, grid, mixer

TaskConfigs TestConfigs() {
  TaskConfigs c;
  c.vocab = TestVocab();
  c.mqar = TestMqar(8);
  c.niah_single = TestNiah(1);
  c.niah_multikey = TestNiah(3);
  return c;
}

TEST(EvalGridTest, EnumeratesLengthsDepthsSeeds) {
  const std::vector<int32_t> lengths = {256, 512};
  const std::vector<double> depths = {0.0, 0.5, 1.0};
  auto grid = EvalGrid(lengths, depths, 4, 99);
  ASSERT_TRUE(grid.ok());
  ASSERT_EQ(grid->size(), 2u * 3u * 4u);
  EXPECT_EQ((*grid)[0].length, 256);
  EXPECT_EQ((*grid)[0].depth, 0.0);
  EXPECT_EQ((*grid)[5].depth, 0.5);
  EXPECT_EQ((*grid)[5].seed_index, 1);
  EXPECT_EQ((*grid)[12].length, 512);
  std::set<uint64_t> seeds;
  for (const EvalPoint& p : *grid) seeds.insert(p.seed);
  EXPECT_EQ(seeds.size(), grid->size());
  EXPECT_EQ((*EvalGrid(lengths, depths, 4, 99))[7].seed, (*grid)[7].seed);
  auto no_depth = EvalGrid(lengths, {}, 2, 99);
  ASSERT_TRUE(no_depth.ok());
  ASSERT_EQ(no_depth->size(), 4u);
  EXPECT_FALSE((*no_depth)[0].depth.has_value());
  EXPECT_FALSE(EvalGrid(lengths, std::vector<double>{1.5}, 1, 0).ok());
  EXPECT_FALSE(EvalGrid(std::vector<int32_t>{0}, depths, 1, 0).ok());
  EXPECT_FALSE(EvalGrid(lengths, depths, 0, 0).ok());

  // Every grid point makes an example of every needle kind.
  const InMemoryHaystack hay = CountingHaystack();
  for (const EvalPoint& p : *grid) {
    for (TaskKind k : {TaskKind::kNiahSingle, TaskKind::kNiahMultiKey, TaskKind::kPasskey}) {
      auto ex = MakeExample(k, TestConfigs(), &hay, p.length, p.depth, p.seed);
      ASSERT_TRUE(ex.ok()) << ex.status();
      EXPECT_EQ(ex->kind, k);
      EXPECT_EQ(ex->length(), p.length);
    }
  }
}

TEST(MakeExampleTest, NeedsHaystackAndDepthForNeedles) {
  const InMemoryHaystack hay = CountingHaystack();
  EXPECT_TRUE(MakeExample(TaskKind::kMqar, TestConfigs(), nullptr, 128, std::nullopt, 1).ok());
  EXPECT_FALSE(MakeExample(TaskKind::kNiahSingle, TestConfigs(), nullptr, 128, 0.5, 1).ok());
  EXPECT_FALSE(MakeExample(TaskKind::kNiahSingle, TestConfigs(), &hay, 128, std::nullopt, 1).ok());
  TaskConfigs one = TestConfigs();
  one.niah_multikey.num_needles = 1;
  EXPECT_FALSE(MakeExample(TaskKind::kNiahMultiKey, one, &hay, 128, 0.5, 1).ok());
  TaskConfigs many = TestConfigs();
  many.niah_single.num_needles = 5;  // forced to 1
  auto single = MakeExample(TaskKind::kNiahSingle, many, &hay, 128, 0.5, 1);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single->num_needles, 1);
}

TaskMixConfig TestMix(double fraction) {
  TaskMixConfig m;
  m.task_fraction = fraction;
  m.seed = 2024;
  m.weights = {1.0, 1.0, 1.0, 1.0};
  m.mqar_min_pairs = 2;
  m.mqar_max_pairs = 40;
  m.configs = TestConfigs();
  return m;
}

TEST(TaskMixerTest, SelectsAboutTheFractionDeterministically) {
  const InMemoryHaystack hay = CountingHaystack();
  auto mixer = TaskMixer::Create(TestMix(0.2), &hay);
  auto again = TaskMixer::Create(TestMix(0.2), &hay);
  ASSERT_TRUE(mixer.ok() && again.ok()) << mixer.status();
  int selected = 0;
  std::map<TaskKind, int> kinds;
  for (int64_t i = 0; i < 20000; ++i) {
    const bool is_task = mixer->IsTaskSequence(i);
    EXPECT_EQ(is_task, again->IsTaskSequence(i));
    if (is_task) {
      ++selected;
      ++kinds[mixer->KindFor(i)];
    }
  }
  EXPECT_NEAR(selected / 20000.0, 0.2, 0.015);
  ASSERT_EQ(kinds.size(), 4u);
  for (const auto& [kind, count] : kinds) EXPECT_NEAR(count / static_cast<double>(selected), 0.25, 0.04);
  TaskMixConfig other_seed = TestMix(0.2);
  other_seed.seed = 7;
  auto other = TaskMixer::Create(other_seed, &hay);
  int differ = 0;
  for (int64_t i = 0; i < 1000; ++i) differ += other->IsTaskSequence(i) != mixer->IsTaskSequence(i) ? 1 : 0;
  EXPECT_GT(differ, 100);

  auto none = TaskMixer::Create(TestMix(0.0), &hay);
  auto all = TaskMixer::Create(TestMix(1.0), &hay);
  for (int64_t i = 0; i < 1000; ++i) {
    EXPECT_FALSE(none->IsTaskSequence(i));
    EXPECT_TRUE(all->IsTaskSequence(i));
  }
}

TEST(TaskMixerTest, MakesValidSequencesOfTheLength) {
  const InMemoryHaystack hay = CountingHaystack();
  auto mixer = TaskMixer::Create(TestMix(0.5), &hay);
  ASSERT_TRUE(mixer.ok());
  std::set<TaskKind> seen;
  for (int64_t i = 0; i < 200; ++i) {
    auto ex = mixer->MakeTaskSequence(i, 256);
    ASSERT_TRUE(ex.ok()) << ex.status();
    ASSERT_TRUE(ex->Validate().ok()) << ex->Validate();
    EXPECT_EQ(ex->length(), 256);
    EXPECT_EQ(ex->kind, mixer->KindFor(i));
    seen.insert(ex->kind);
    if (ex->kind == TaskKind::kMqar) {
      EXPECT_GE(ex->num_pairs, 2);
      EXPECT_LE(ex->num_pairs, 40);
    } else {
      ASSERT_TRUE(ex->depth.has_value());
    }
    // The mask marks answer targets only (needle tasks: and each packed example's final EOS).
    int32_t answer_tokens = 0;
    for (const AnswerSpan& a : ex->answers) answer_tokens += a.length;
    const auto examples = std::count(ex->ids.begin(), ex->ids.end(), TestVocab().bos);
    const int32_t extra = ex->kind == TaskKind::kMqar ? 0 : static_cast<int32_t>(examples);
    EXPECT_EQ(std::count(ex->loss_mask.begin(), ex->loss_mask.end(), 1), answer_tokens + extra);
    auto same = mixer->MakeTaskSequence(i, 256);
    EXPECT_EQ(same->ids, ex->ids);
  }
  EXPECT_EQ(seen.size(), 4u);
  // MQAR pairs are capped by what fits in a short sequence.
  TaskMixConfig mqar_only = TestMix(1.0);
  mqar_only.weights = {1.0, 0.0, 0.0, 0.0};
  mqar_only.mqar_min_pairs = 30;
  auto short_mixer = TaskMixer::Create(mqar_only, nullptr);
  ASSERT_TRUE(short_mixer.ok()) << short_mixer.status();
  auto short_ex = short_mixer->MakeTaskSequence(3, 41);
  ASSERT_TRUE(short_ex.ok());
  EXPECT_EQ(short_ex->num_pairs, 10);
  EXPECT_FALSE(short_mixer->MakeTaskSequence(3, 4).ok());
}

// The [begin, end) ranges of the examples packed in `ids`: each starts at a BOS.
std::vector<std::pair<int32_t, int32_t>> PackedExamples(const std::vector<int32_t>& ids) {
  std::vector<std::pair<int32_t, int32_t>> out;
  for (int32_t t = 0; t < static_cast<int32_t>(ids.size()); ++t) {
    if (ids[t] != TestVocab().bos) continue;
    if (!out.empty()) out.back().second = t;
    out.push_back({t, static_cast<int32_t>(ids.size())});
  }
  return out;
}

TEST(TaskMixerTest, PacksNeedleExamplesToTheLength) {
  const InMemoryHaystack hay = CountingHaystack();
  TaskMixConfig config = TestMix(1.0);
  config.weights = {0.0, 1.0, 1.0, 1.0};
  config.needle_min_length = 48;  // niah_multikey with 3 needles needs 37 + 8 at every depth
  config.needle_max_length = 120;
  auto mixer = TaskMixer::Create(config, &hay);
  auto again = TaskMixer::Create(config, &hay);
  ASSERT_TRUE(mixer.ok() && again.ok()) << mixer.status();
  size_t most_examples = 0;
  for (int64_t i = 0; i < 60; ++i) {
    auto ex = mixer->MakeTaskSequence(i, 1000);
    ASSERT_TRUE(ex.ok()) << ex.status();
    ASSERT_TRUE(ex->Validate().ok()) << ex->Validate();
    EXPECT_EQ(ex->length(), 1000);
    EXPECT_EQ(ex->kind, mixer->KindFor(i));
    const auto parts = PackedExamples(ex->ids);
    ASSERT_EQ(parts.front().first, 0);
    most_examples = std::max(most_examples, parts.size());
    size_t answer = 0;
    for (size_t k = 0; k < parts.size(); ++k) {
      const auto [begin, end] = parts[k];
      EXPECT_GE(end - begin, 48);
      EXPECT_LE(end - begin, k + 1 < parts.size() ? 120 : 167);  // the last one takes the rest
      EXPECT_EQ(ex->ids[end - 1], TestVocab().eos);
      // Each example's answers lie inside it, and its mask covers them and the EOS, nothing else.
      int32_t masked = 0;
      for (; answer < ex->answers.size() && ex->answers[answer].begin < end; ++answer) {
        const AnswerSpan& a = ex->answers[answer];
        EXPECT_GT(a.begin, begin);
        EXPECT_LE(a.end(), end);
        for (int32_t t = a.begin - 1; t < a.end() - 1; ++t) EXPECT_EQ(ex->loss_mask[t], 1);
        masked += a.length;
      }
      EXPECT_EQ(ex->loss_mask[end - 2], 1);  // predicts the EOS
      EXPECT_EQ(ex->loss_mask[end - 1], 0);  // would predict the next example's BOS
      EXPECT_EQ(std::count(ex->loss_mask.begin() + begin, ex->loss_mask.begin() + end, 1), masked + 1);
    }
    EXPECT_EQ(answer, ex->answers.size());
    auto same = again->MakeTaskSequence(i, 1000);
    EXPECT_EQ(same->ids, ex->ids);
    EXPECT_EQ(same->loss_mask, ex->loss_mask);
    EXPECT_NE(mixer->MakeTaskSequence(i + 1, 1000)->ids, ex->ids);
  }
  EXPECT_GE(most_examples, 10u);
  // A sequence shorter than needle_min_length holds one example.
  auto short_ex = mixer->MakeTaskSequence(0, 45);
  ASSERT_TRUE(short_ex.ok()) << short_ex.status();
  EXPECT_EQ(PackedExamples(short_ex->ids).size(), 1u);
}

TEST(TaskMixerTest, NeedleMaxLengthZeroMakesOneExample) {
  const InMemoryHaystack hay = CountingHaystack();
  TaskMixConfig config = TestMix(1.0);
  config.weights = {0.0, 1.0, 1.0, 1.0};
  config.needle_max_length = 0;
  auto mixer = TaskMixer::Create(config, &hay);
  ASSERT_TRUE(mixer.ok()) << mixer.status();
  for (int64_t i = 0; i < 30; ++i) {
    auto ex = mixer->MakeTaskSequence(i, 1000);
    ASSERT_TRUE(ex.ok()) << ex.status();
    EXPECT_EQ(ex->length(), 1000);
    EXPECT_EQ(PackedExamples(ex->ids).size(), 1u);
    EXPECT_EQ(ex->answers.size(), 1u);
    ASSERT_TRUE(ex->depth.has_value());
    EXPECT_TRUE(ex->needle_position >= 1 && ex->needle_position < ex->prompt_length);
  }
}

// Log-uniform packing covers a wide range at both ends: many short examples (answers) and some that reach
// far (needles thousands of tokens from their question), where uniform lengths give few short ones.
TEST(TaskMixerTest, LogUniformNeedleLengthsCoverBothEndsOfAWideRange) {
  const InMemoryHaystack hay = CountingHaystack();
  TaskMixConfig config = TestMix(1.0);
  config.weights = {0.0, 1.0, 1.0, 0.0};
  config.needle_min_length = 48;
  config.needle_max_length = 6000;
  std::vector<int32_t> uniform, log_uniform;
  for (const bool log : {false, true}) {
    config.needle_length_log_uniform = log;
    auto mixer = TaskMixer::Create(config, &hay);
    ASSERT_TRUE(mixer.ok()) << mixer.status();
    for (int64_t i = 0; i < 40; ++i) {
      auto ex = mixer->MakeTaskSequence(i, 8192);
      ASSERT_TRUE(ex.ok()) << ex.status();
      ASSERT_TRUE(ex->Validate().ok());
      EXPECT_EQ(ex->length(), 8192);
      const auto parts = PackedExamples(ex->ids);
      for (size_t k = 0; k + 1 < parts.size(); ++k) {  // the last one takes the rest
        const int32_t n = parts[k].second - parts[k].first;
        EXPECT_TRUE(n >= 48 && n <= 6000) << n;
        (log ? log_uniform : uniform).push_back(n);
      }
    }
  }
  auto share_below = [](const std::vector<int32_t>& v, int32_t x) {
    return static_cast<double>(std::count_if(v.begin(), v.end(), [&](int32_t n) { return n < x; })) / v.size();
  };
  // log(537) is halfway between log(48) and log(6001): about half the log-uniform examples are shorter.
  EXPECT_NEAR(share_below(log_uniform, 537), 0.5, 0.12);
  EXPECT_LT(share_below(uniform, 537), 0.2);
  EXPECT_GT(1.0 - share_below(log_uniform, 3000), 0.03);  // and some still reach far
  EXPECT_GT(log_uniform.size(), 2 * uniform.size());       // more examples, so more answers, per sequence
}

// Spread MQAR sequences ask their keys anywhere up to the end; the default ones crowd the queries near
// the pairs.
TEST(TaskMixerTest, MqarSpreadPutsQueriesFarFromTheirPairs) {
  TaskMixConfig config = TestMix(1.0);
  config.weights = {1.0, 0.0, 0.0, 0.0};
  config.mqar_min_pairs = config.mqar_max_pairs = 8;
  double mean_answer[2] = {0, 0};
  int answers[2] = {0, 0};
  for (const double spread : {0.0, 1.0}) {
    config.mqar_spread_fraction = spread;
    auto mixer = TaskMixer::Create(config, nullptr);
    ASSERT_TRUE(mixer.ok()) << mixer.status();
    for (int64_t i = 0; i < 30; ++i) {
      auto ex = mixer->MakeTaskSequence(i, 4000);
      ASSERT_TRUE(ex.ok()) << ex.status();
      ASSERT_TRUE(ex->Validate().ok());
      for (const AnswerSpan& a : ex->answers) {
        mean_answer[spread > 0] += a.begin;
        ++answers[spread > 0];
      }
    }
  }
  ASSERT_EQ(answers[0], 240);
  ASSERT_EQ(answers[1], 240);
  EXPECT_LT(mean_answer[0] / answers[0], 1000);  // power law: most queries early
  EXPECT_GT(mean_answer[1] / answers[1], 1500);  // uniform: around the middle on average
  config.mqar_spread_fraction = 1.5;
  EXPECT_THAT(TaskMixer::Create(config, nullptr).status().message(), HasSubstr("mqar_spread_fraction"));
}

TEST(TaskMixerTest, BadConfigsAreErrors) {
  const InMemoryHaystack hay = CountingHaystack();
  EXPECT_FALSE(TaskMixer::Create(TestMix(1.5), &hay).ok());
  EXPECT_FALSE(TaskMixer::Create(TestMix(-0.1), &hay).ok());
  EXPECT_THAT(TaskMixer::Create(TestMix(0.5), nullptr).status().message(), HasSubstr("haystack"));
  TaskMixConfig negative = TestMix(0.5);
  negative.weights[1] = -1;
  EXPECT_FALSE(TaskMixer::Create(negative, &hay).ok());
  TaskMixConfig zero = TestMix(0.5);
  zero.weights = {0, 0, 0, 0};
  EXPECT_FALSE(TaskMixer::Create(zero, &hay).ok());
  TaskMixConfig pairs = TestMix(0.5);
  pairs.mqar_max_pairs = 1;
  EXPECT_FALSE(TaskMixer::Create(pairs, &hay).ok());
  TaskMixConfig bad_mqar = TestMix(0.5);
  bad_mqar.configs.mqar.value_range = bad_mqar.configs.mqar.key_range;
  EXPECT_FALSE(TaskMixer::Create(bad_mqar, &hay).ok());
  // A bad config of a kind with weight 0 is not an error.
  bad_mqar.weights[0] = 0;
  EXPECT_TRUE(TaskMixer::Create(bad_mqar, &hay).ok());
  TaskMixConfig lengths = TestMix(0.5);
  lengths.needle_min_length = 200;
  lengths.needle_max_length = 100;
  EXPECT_THAT(TaskMixer::Create(lengths, &hay).status().message(), HasSubstr("needle length range"));
  lengths.needle_max_length = -1;
  EXPECT_FALSE(TaskMixer::Create(lengths, &hay).ok());
  lengths.needle_min_length = 5;  // below the shortest needle example
  lengths.needle_max_length = 100;
  EXPECT_THAT(TaskMixer::Create(lengths, &hay).status().message(), HasSubstr("needle_min_length"));
  lengths.weights = {1.0, 0.0, 0.0, 0.0};  // ... unless no needle kind is drawn
  EXPECT_TRUE(TaskMixer::Create(lengths, &hay).ok());
}

// ---------------------------------------------------------------------------------------------------------
// Copy

CopyConfig TestCopy(int32_t cue, int32_t answer) {
  CopyConfig c;
  c.cue_length = cue;
  c.answer_length = answer;
  return c;
}

TEST(CopyTest, DocumentedExample) {
  const InMemoryHaystack hay({30, 31, 32, 33});
  auto ex = MakeCopyExample(TestVocab(), TestCopy(1, 1), hay, 8, 0.0, 1);
  ASSERT_TRUE(ex.ok()) << ex.status();
  ASSERT_TRUE(ex->Validate().ok()) << ex->Validate();
  // BOS h1 h2 h3 h4 h1 h2 EOS: the passage is the first two haystack tokens, its repeat follows.
  ASSERT_EQ(ex->length(), 8);
  EXPECT_EQ(ex->ids[0], TestVocab().bos);
  EXPECT_EQ(ex->ids[5], ex->ids[1]);
  EXPECT_EQ(ex->ids[6], ex->ids[2]);
  EXPECT_EQ(ex->ids[7], TestVocab().eos);
  EXPECT_EQ(ex->prompt_length, 6);
  EXPECT_THAT(ex->answers, ElementsAre(AnswerSpan{6, 1}));
  EXPECT_THAT(ex->loss_mask, ElementsAre(0, 0, 0, 0, 0, 1, 0, 0));
  EXPECT_EQ(ex->needle_position, 1);
  EXPECT_EQ(ex->kind, TaskKind::kCopy);
}

TEST(CopyTest, PassageSitsAtItsDepthAndIsRepeatedExactly) {
  const InMemoryHaystack hay = CountingHaystack();  // consecutive ids: every cue is unique
  const CopyConfig config = TestCopy(4, 6);
  const int32_t length = 300, context = length - 2 - 10;
  for (double depth : {0.0, 0.25, 0.5, 1.0}) {
    auto ex = MakeCopyExample(TestVocab(), config, hay, length, depth, 9);
    ASSERT_TRUE(ex.ok()) << ex.status();
    ASSERT_TRUE(ex->Validate().ok()) << ex->Validate();
    EXPECT_EQ(ex->length(), length);
    const int32_t start = 1 + static_cast<int32_t>(std::llround(depth * (context - 10)));
    EXPECT_EQ(ex->needle_position, start);
    for (int32_t i = 0; i < 10; ++i) EXPECT_EQ(ex->ids[1 + context + i], ex->ids[start + i]) << i;
    for (int32_t t = 1; t <= context; ++t) EXPECT_TRUE(IsHaystackToken(ex->ids[t]));
    EXPECT_EQ(ex->prompt_length, 1 + context + 4);
    EXPECT_EQ(std::count(ex->loss_mask.begin(), ex->loss_mask.end(), 1), 6);
    auto again = MakeCopyExample(TestVocab(), config, hay, length, depth, 9);
    EXPECT_EQ(again->ids, ex->ids);
    EXPECT_NE(MakeCopyExample(TestVocab(), config, hay, length, depth, 10)->ids, ex->ids);
  }
}

TEST(CopyTest, AnAmbiguousCueMovesToTheNearestUniqueOne) {
  // Text 19, 20, ... with its first 4 tokens repeated at 100: the cue at offset 0 (depth 0) also occurs at
  // 100 with another continuation, so the passage moves one cue length on.
  std::vector<int32_t> tokens(200);
  for (int32_t i = 0; i < 200; ++i) tokens[i] = 19 + i;
  for (int32_t i = 0; i < 4; ++i) tokens[100 + i] = 19 + i;
  class Fixed : public HaystackSource {
   public:
    explicit Fixed(std::vector<int32_t> t) : t_(std::move(t)) {}
    absl::StatusOr<std::vector<int32_t>> Tokens(int64_t n, uint64_t) const override {
      return std::vector<int32_t>(t_.begin(), t_.begin() + n);
    }
   private:
    std::vector<int32_t> t_;
  } hay(tokens);
  auto ex = MakeCopyExample(TestVocab(), TestCopy(4, 4), hay, 2 + 200 + 8, 0.0, 1);
  ASSERT_TRUE(ex.ok()) << ex.status();
  EXPECT_EQ(ex->needle_position, 1 + 4);
  const std::vector<int32_t> cue(ex->ids.begin() + ex->prompt_length - 4, ex->ids.begin() + ex->prompt_length);
  int occurrences = 0;
  for (int32_t i = 1; i + 4 <= 201; ++i) occurrences += std::equal(cue.begin(), cue.end(), ex->ids.begin() + i);
  EXPECT_EQ(occurrences, 1);
}

TEST(CopyTest, BadParametersAreErrors) {
  const InMemoryHaystack hay = CountingHaystack();
  EXPECT_THAT(MakeCopyExample(TestVocab(), TestCopy(4, 6), hay, CopyMinLength(TestCopy(4, 6)) - 1, 0.5, 1)
                  .status().message(), HasSubstr("shorter"));
  EXPECT_TRUE(MakeCopyExample(TestVocab(), TestCopy(4, 6), hay, CopyMinLength(TestCopy(4, 6)), 0.5, 1).ok());
  EXPECT_FALSE(MakeCopyExample(TestVocab(), TestCopy(4, 6), hay, 100, 1.5, 1).ok());
  EXPECT_FALSE(MakeCopyExample(TestVocab(), TestCopy(0, 6), hay, 100, 0.5, 1).ok());
  EXPECT_FALSE(MakeCopyExample(TestVocab(), TestCopy(4, 0), hay, 100, 0.5, 1).ok());
  EXPECT_THAT(MakeCopyExample(TestVocab(), TestCopy(4, 6), BadHaystack(false), 100, 0.5, 1).status().message(),
              HasSubstr("special"));
  EXPECT_EQ(MakeCopyExample(TestVocab(), TestCopy(4, 6), BadHaystack(true), 100, 0.5, 1).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_FALSE(MakeExample(TaskKind::kCopy, TestConfigs(), nullptr, 100, 0.5, 1).ok());
  EXPECT_FALSE(MakeExample(TaskKind::kCopy, TestConfigs(), &hay, 100, std::nullopt, 1).ok());
  EXPECT_TRUE(MakeExample(TaskKind::kCopy, TestConfigs(), &hay, 100, 0.5, 1).ok());
}

TEST(TaskMixerTest, PacksCopyExamplesWithTheirAnswersMasked) {
  const InMemoryHaystack hay = CountingHaystack();
  TaskMixConfig config = TestMix(1.0);
  config.configs.copy = TestCopy(4, 8);
  ASSERT_TRUE(ApplyTaskWeights("mqar=0,niah_single=0,niah_multikey=0,passkey=0,copy=1", config.weights).ok());
  config.needle_min_length = 48;
  config.needle_max_length = 120;
  auto mixer = TaskMixer::Create(config, &hay);
  ASSERT_TRUE(mixer.ok()) << mixer.status();
  for (int64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(mixer->KindFor(i), TaskKind::kCopy);
    auto ex = mixer->MakeTaskSequence(i, 800);
    ASSERT_TRUE(ex.ok()) << ex.status();
    ASSERT_TRUE(ex->Validate().ok()) << ex->Validate();
    EXPECT_GE(ex->answers.size(), 6u);
    // Only answer tokens are trained: 8 per packed example.
    EXPECT_EQ(std::count(ex->loss_mask.begin(), ex->loss_mask.end(), 1), 8 * static_cast<int>(ex->answers.size()));
  }
  config.needle_min_length = CopyMinLength(config.configs.copy) - 1;
  EXPECT_THAT(TaskMixer::Create(config, &hay).status().message(), HasSubstr("needle_min_length"));
}

TEST(TaskWeightsTest, NamedKindsChangeTheRestStay) {
  TaskWeights w = {1.0, 1.0, 1.0, 0.5, 0.0};
  ASSERT_TRUE(ApplyTaskWeights("", w).ok());
  EXPECT_THAT(w, ElementsAre(1.0, 1.0, 1.0, 0.5, 0.0));
  ASSERT_TRUE(ApplyTaskWeights("copy=2,niah_single=0.25", w).ok());
  EXPECT_THAT(w, ElementsAre(1.0, 0.25, 1.0, 0.5, 2.0));
  for (const char* bad : {"copy", "cpy=1", "copy=-1", "copy=x", "copy=", "copy=1,x=2", "copy=inf"}) {
    TaskWeights before = w;
    EXPECT_FALSE(ApplyTaskWeights(bad, w).ok()) << bad;
    EXPECT_EQ(w, before) << bad;  // unchanged on error
  }
}

}  // namespace
}  // namespace oryx::tasks
