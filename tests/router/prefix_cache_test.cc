// The prefix cache (engine/prefix_cache.h) on its own and in generation: snapshots found by tokens and modes,
// eviction, shared blocks let go, and greedy outputs equal to a run without the cache under every policy,
// for prefixes that end inside a block, on a block boundary, that diverge in mode only, and prompts that wait
// for an earlier one's snapshot.
#include "engine/prefix_cache.h"

#include <random>

#include "base/str_cat.h"
#include "engine/cpu_backend.h"
#include "gtest/gtest.h"
#include "policies/rule_policies.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx {
namespace {

constexpr int64_t kBlock = 8, kEvery = 16;

PrefixCacheOptions SmallBlocks(int64_t max_bytes = int64_t{1} << 30) { return {kBlock, kEvery, max_bytes}; }

std::unique_ptr<Backend> TinyBackend(const testutil::ScratchDir& scratch, uint32_t seed) {
  return testutil::TinyBackend(scratch, LinearMixer::kMamba2, seed, /*max_position=*/256);
}

std::vector<int32_t> RandomTokens(std::mt19937& rng, size_t n) {
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = 4 + static_cast<int32_t>(rng() % 28);
  return t;
}

std::vector<float> LastLogits(Backend& backend, SequenceState& seq, std::span<const int32_t> tokens,
                              std::span<const Mode> modes) {
  std::vector<float> logits;
  const absl::Status s = backend.Forward(seq, tokens, modes, /*all_logits=*/false, &logits);
  EXPECT_TRUE(s.ok()) << s;
  return logits;
}

// n prompts of one block, each run in attention mode on a sequence of its own: snapshots to fill a cache with.
struct Prompts {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<SequenceState> seqs;
  std::vector<Mode> modes;
};
Prompts OneBlockPrompts(Backend& backend, uint32_t seed, int n) {
  std::mt19937 rng(seed);
  Prompts p{{}, {}, std::vector<Mode>(kBlock, Mode::kAttention)};
  for (int i = 0; i < n; ++i) {
    p.prompts.push_back(RandomTokens(rng, kBlock));
    p.seqs.push_back(backend.NewSequence());
    LastLogits(backend, p.seqs.back(), p.prompts.back(), p.modes);
  }
  return p;
}

// Tokens and modes with the names of their blocks, as the engine hands a prompt to the cache.
class Key {
 public:
  Key(const PrefixCache& cache, std::span<const int32_t> tokens, std::span<const Mode> modes)
      : names_(cache.Names(tokens, modes)), prefix_{tokens, modes, names_} {}
  Key(const Key&) = delete;
  operator const PrefixCache::Prefix&() const { return prefix_; }

 private:
  std::vector<uint64_t> names_;
  PrefixCache::Prefix prefix_;
};

TEST(PrefixCache, FindsTheLongestSnapshotRunInTheSameModes) {
  testutil::ScratchDir scratch;
  std::unique_ptr<Backend> backend = TinyBackend(scratch, 1);
  std::mt19937 rng(1);
  const std::vector<int32_t> tokens = RandomTokens(rng, 40);
  std::vector<Mode> modes(40, Mode::kAttention);
  for (int i = 0; i < 40; i += 3) modes[i] = Mode::kLinear;
  PrefixCache cache(SmallBlocks());
  SequenceState seq = backend->NewSequence();
  for (int64_t end : {16, 32}) {
    const int64_t begin = seq.position();
    LastLogits(*backend, seq, std::span(tokens).subspan(begin, end - begin), std::span(modes).subspan(begin, end - begin));
    EXPECT_TRUE(cache.Insert(Key(cache, std::span(tokens).first(end), std::span(modes).first(end)), seq));
  }
  EXPECT_FALSE(cache.Insert(Key(cache, std::span(tokens).first(32), std::span(modes).first(32)), seq));  // held already
  const std::vector<float> want = LastLogits(*backend, seq, std::span(tokens).subspan(32), std::span(modes).subspan(32));

  EXPECT_EQ(cache.Longest(Key(cache, tokens, modes), 40), 32);
  EXPECT_EQ(cache.Longest(Key(cache, tokens, modes), 31), 16);  // at most max_tokens
  EXPECT_EQ(cache.Longest(Key(cache, std::span(tokens).first(15), std::span(modes).first(15)), 15), 0);
  std::vector<int32_t> other = tokens;
  other[20] = other[20] == 5 ? 6 : 5;  // diverges inside the third block
  EXPECT_EQ(cache.Longest(Key(cache, other, modes), 40), 16);
  std::vector<Mode> flipped = modes;
  flipped[3] = Mode::kLinear == flipped[3] ? Mode::kAttention : Mode::kLinear;  // the same tokens, one mode differs
  EXPECT_EQ(cache.Longest(Key(cache, tokens, flipped), 40), 0);

  // Blocks seen, snapshotted or not: only once remembered, and up to where a prompt leaves them.
  EXPECT_EQ(cache.Seen(Key(cache, tokens, modes), 40), 0);
  cache.Remember(Key(cache, tokens, modes));
  EXPECT_EQ(cache.Seen(Key(cache, tokens, modes), 40), 40);
  EXPECT_EQ(cache.Seen(Key(cache, other, modes), 40), 16);
  EXPECT_EQ(cache.Seen(Key(cache, tokens, flipped), 40), 0);

  PrefixCache::Hit hit = cache.Lookup(Key(cache, tokens, modes), 39);
  ASSERT_EQ(hit.tokens, 32);
  ASSERT_TRUE(hit.state.has_value());
  EXPECT_EQ(hit.state->position(), 32);
  // Resuming from the snapshot gives the bits of the sequence that ran on.
  EXPECT_EQ(LastLogits(*backend, *hit.state, std::span(tokens).subspan(32), std::span(modes).subspan(32)), want);
  EXPECT_EQ(cache.Lookup(Key(cache, other, flipped), 40).tokens, 0);
  const PrefixCacheStats st = cache.stats();
  EXPECT_EQ(st.lookups, 2);
  EXPECT_EQ(st.lookup_tokens, 80);
  EXPECT_EQ(st.hit_tokens, 32);
  EXPECT_EQ(st.snapshots, 2);
  EXPECT_EQ(st.inserted, 2);
}

TEST(PrefixCache, SnapshotsShareFullBlocksAndLetThemGo) {
  testutil::ScratchDir scratch;
  std::unique_ptr<Backend> backend = TinyBackend(scratch, 2);
  std::mt19937 rng(2);
  const std::vector<int32_t> tokens = RandomTokens(rng, 128);
  const std::vector<Mode> modes(128, Mode::kAttention);
  PrefixCache cache({64, 64, int64_t{1} << 30});  // the host's 64-position blocks
  std::optional<SequenceState> seq = backend->NewSequence();
  LastLogits(*backend, *seq, tokens, modes);
  ASSERT_TRUE(cache.Insert(Key(cache, tokens, modes), *seq));
  EXPECT_EQ(seq->kv_shared_blocks(), 2);  // both full blocks held by the snapshot too
  seq.reset();
  PrefixCache::Hit hit = cache.Lookup(Key(cache, tokens, modes), 128);
  ASSERT_EQ(hit.tokens, 128);
  EXPECT_EQ(hit.state->kv_shared_blocks(), 2);
  cache.Clear();
  EXPECT_EQ(hit.state->kv_shared_blocks(), 0);  // the last holder
  EXPECT_EQ(cache.stats().snapshots, 0);
  EXPECT_EQ(cache.stats().bytes, 0);
}

// Snapshots of one prompt every block (as a long prompt's every 2048 tokens, or a conversation's turns) each hold
// the blocks of the ones before: the budget counts those once. Counted one by one, the four below were charged
// 10 blocks, and a budget of the 4 they hold kept the last one alone.
TEST(PrefixCache, CountsTheBlocksItsSnapshotsShareOnce) {
  testutil::ScratchDir scratch;
  std::unique_ptr<Backend> backend = TinyBackend(scratch, 8);
  std::mt19937 rng(8);
  const std::vector<int32_t> tokens = RandomTokens(rng, 256), other = RandomTokens(rng, 64);
  const std::vector<Mode> modes(256, Mode::kAttention);
  SequenceState seq = backend->NewSequence(), other_seq = backend->NewSequence();
  LastLogits(*backend, other_seq, other, std::span(modes).first(64));
  std::vector<SequenceState> snapshots;  // at 64, 128, 192 and 256 (the host's 64-position blocks)
  for (int64_t end = 64; end <= 256; end += 64) {
    LastLogits(*backend, seq, std::span(tokens).subspan(end - 64, 64), std::span(modes).subspan(end - 64, 64));
    snapshots.push_back(*seq.TryClone());
  }
  const int64_t block = seq.kv_block_bytes(), state = seq.recurrent_bytes();
  ASSERT_EQ(snapshots.back().kv_block_ids().size(), 4u);
  ASSERT_GT(block, 0);
  auto insert_all = [&](PrefixCache& cache) {
    for (size_t j = 0; j < snapshots.size(); ++j) {
      const int64_t end = 64 * static_cast<int64_t>(j + 1);
      ASSERT_TRUE(cache.Insert(Key(cache, std::span(tokens).first(end), std::span(modes).first(end)), snapshots[j]));
    }
  };
  auto held = [&](PrefixCache& cache) {  // the ends of the prompt's snapshots the cache holds
    std::vector<int64_t> ends;
    for (int64_t end = 64; end <= 256; end += 64) {
      if (cache.Longest(Key(cache, std::span(tokens).first(end), std::span(modes).first(end)), end) == end) {
        ends.push_back(end);
      }
    }
    return ends;
  };
  const int64_t budget = 4 * block + 4 * state;
  PrefixCache cache({64, 64, budget});
  insert_all(cache);
  EXPECT_EQ(cache.stats().bytes, budget);
  EXPECT_EQ(cache.stats().evicted, 0);
  EXPECT_EQ(held(cache), (std::vector<int64_t>{64, 128, 192, 256}));

  // A snapshot of another prompt's block: the oldest go first, each giving back its state alone (the blocks
  // are the longest one's too), until the last of the four takes its blocks with it.
  ASSERT_TRUE(cache.Insert(Key(cache, other, std::span(modes).first(64)), other_seq));
  int64_t evicted = 0, bytes = budget + block + state;
  while (bytes > budget) bytes -= ++evicted == 4 ? 4 * block + state : state;
  EXPECT_EQ(cache.stats().evicted, evicted);
  EXPECT_EQ(cache.stats().bytes, bytes);
  EXPECT_EQ(static_cast<int64_t>(held(cache).size()), 4 - evicted);
  EXPECT_EQ(cache.Longest(Key(cache, other, std::span(modes).first(64)), 64), 64);

  // Hit, the four count once toward the half of the budget that hit snapshots may keep (4 blocks, not 10): past
  // the budget, the snapshots never hit still go first.
  PrefixCache hits({64, 64, 2 * budget + 2 * block});
  insert_all(hits);
  for (int64_t end = 64; end <= 256; end += 64) {
    EXPECT_EQ(hits.Lookup(Key(hits, std::span(tokens).first(end), std::span(modes).first(end)), end).tokens, end);
  }
  std::vector<std::vector<int32_t>> others;
  std::vector<SequenceState> other_seqs;
  for (int i = 0; i < 6; ++i) {  // 4 blocks and states hit, and 6 others: 2 states over the budget
    others.push_back(RandomTokens(rng, 64));
    other_seqs.push_back(backend->NewSequence());
    LastLogits(*backend, other_seqs.back(), others.back(), std::span(modes).first(64));
    ASSERT_TRUE(hits.Insert(Key(hits, others.back(), std::span(modes).first(64)), other_seqs.back()));
  }
  EXPECT_EQ(held(hits), (std::vector<int64_t>{64, 128, 192, 256}));
  EXPECT_EQ(hits.Longest(Key(hits, others[0], std::span(modes).first(64)), 64), 0);
  EXPECT_EQ(hits.Longest(Key(hits, others[1], std::span(modes).first(64)), 64), 64);
  EXPECT_EQ(hits.stats().evicted, 1);
  EXPECT_EQ(hits.stats().bytes, 9 * block + 9 * state);
  hits.Clear();
  cache.Clear();
  EXPECT_EQ(hits.stats().bytes, 0);
  EXPECT_EQ(cache.stats().bytes, 0);
}

TEST(PrefixCache, EvictsSnapshotsNeverHitFirst) {
  testutil::ScratchDir scratch;
  std::unique_ptr<Backend> backend = TinyBackend(scratch, 6);
  auto [prompts, seqs, modes] = OneBlockPrompts(*backend, 6, 7);
  const int64_t each = seqs[0].kv_bytes() + seqs[0].recurrent_bytes();
  PrefixCache cache(SmallBlocks(4 * each));
  ASSERT_TRUE(cache.Insert(Key(cache, prompts[0], modes), seqs[0]));  // a system prompt, hit by every request
  EXPECT_EQ(cache.Lookup(Key(cache, prompts[0], modes), kBlock).tokens, kBlock);
  for (int i = 1; i <= 5; ++i) ASSERT_TRUE(cache.Insert(Key(cache, prompts[i], modes), seqs[i]));  // ends never hit
  EXPECT_EQ(cache.Longest(Key(cache, prompts[0], modes), kBlock), kBlock);  // outlived them, though the least recent
  EXPECT_EQ(cache.Longest(Key(cache, prompts[1], modes), kBlock), 0);
  EXPECT_EQ(cache.Longest(Key(cache, prompts[2], modes), kBlock), 0);
  EXPECT_EQ(cache.Longest(Key(cache, prompts[5], modes), kBlock), kBlock);
  // Snapshots hit keep at most half the budget: a third one hit pushes out the least recently hit.
  EXPECT_EQ(cache.Lookup(Key(cache, prompts[3], modes), kBlock).tokens, kBlock);
  EXPECT_EQ(cache.Lookup(Key(cache, prompts[4], modes), kBlock).tokens, kBlock);
  ASSERT_TRUE(cache.Insert(Key(cache, prompts[6], modes), seqs[6]));
  EXPECT_EQ(cache.Longest(Key(cache, prompts[0], modes), kBlock), 0);
  EXPECT_EQ(cache.Longest(Key(cache, prompts[3], modes), kBlock), kBlock);
  EXPECT_EQ(cache.Longest(Key(cache, prompts[4], modes), kBlock), kBlock);
  EXPECT_EQ(cache.Longest(Key(cache, prompts[5], modes), kBlock), kBlock);
  EXPECT_EQ(cache.Longest(Key(cache, prompts[6], modes), kBlock), kBlock);
}

TEST(PrefixCache, EvictsTheLeastRecentlyUsedPastItsBudget) {
  testutil::ScratchDir scratch;
  std::unique_ptr<Backend> backend = TinyBackend(scratch, 3);
  auto [prompts, seqs, modes] = OneBlockPrompts(*backend, 3, 3);
  const int64_t each = seqs[0].kv_bytes() + seqs[0].recurrent_bytes();
  PrefixCache cache(SmallBlocks(2 * each));
  ASSERT_TRUE(cache.Insert(Key(cache, prompts[0], modes), seqs[0]));
  ASSERT_TRUE(cache.Insert(Key(cache, prompts[1], modes), seqs[1]));
  EXPECT_EQ(cache.Lookup(Key(cache, prompts[0], modes), kBlock).tokens, kBlock);  // 0 is now the most recently used
  ASSERT_TRUE(cache.Insert(Key(cache, prompts[2], modes), seqs[2]));
  EXPECT_EQ(cache.Longest(Key(cache, prompts[0], modes), kBlock), kBlock);
  EXPECT_EQ(cache.Longest(Key(cache, prompts[1], modes), kBlock), 0);
  EXPECT_EQ(cache.Longest(Key(cache, prompts[2], modes), kBlock), kBlock);
  EXPECT_EQ(cache.stats().evicted, 1);
  EXPECT_EQ(cache.stats().bytes, 2 * each);
}

// A shared system prompt of 43 tokens, then prompts that share 43 tokens (a prefix ending inside a block),
// 48 (on a block boundary), all of it, and one that is the same text run in other modes.
std::vector<GenerateRequest> SharingRequests(std::string policy) {
  std::mt19937 rng(7);
  const std::vector<int32_t> base = RandomTokens(rng, 50);
  std::vector<GenerateRequest> qs;
  auto add = [&](size_t shared, size_t extra) {
    GenerateRequest q;
    q.prompt_tokens.assign(base.begin(), base.begin() + shared);
    for (int32_t t : RandomTokens(rng, extra)) q.prompt_tokens.push_back(t);
    q.max_tokens = 12;
    q.stop_at_eos = false;
    q.policy = policy;
    qs.push_back(std::move(q));
  };
  add(50, 0);
  add(43, 9);
  add(48, 5);
  add(50, 4);
  add(43, 0);
  return qs;
}

class PrefixCacheGeneration : public ::testing::TestWithParam<const char*> {};

// Requests one after the other, then all at once: the tokens are those of an engine without the cache.
TEST_P(PrefixCacheGeneration, GreedyOutputsEqualThoseWithoutIt) {
  testutil::ScratchDir scratch;
  Engine cached(TinyBackend(scratch, 4), std::nullopt), plain(TinyBackend(scratch, 4), std::nullopt);
  for (Engine* e : {&cached, &plain}) policies::RegisterAllPolicies(e->policies());
  cached.set_prefix_cache(SmallBlocks());
  plain.set_prefix_cache(std::nullopt);
  const std::vector<GenerateRequest> qs = SharingRequests(GetParam());
  std::vector<std::vector<int32_t>> want;
  for (const GenerateRequest& q : qs) {
    auto r = plain.Generate(q);
    ASSERT_TRUE(r.ok()) << r.status();
    want.push_back(r->tokens);
  }
  int64_t cached_tokens = 0;
  for (size_t i = 0; i < qs.size(); ++i) {
    auto r = cached.Generate(qs[i]);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens, want[i]) << "request " << i;
    cached_tokens += r->stats.cached_tokens;
  }
  // Run again all at once against a fresh cache: the later prompts wait for the first one's snapshots.
  cached.set_prefix_cache(SmallBlocks());
  auto together = cached.Generate(qs);
  ASSERT_TRUE(together.ok()) << together.status();
  for (size_t i = 0; i < qs.size(); ++i) EXPECT_EQ((*together)[i].tokens, want[i]) << "together, request " << i;
  EXPECT_GT(cached_tokens, 0);
}

INSTANTIATE_TEST_SUITE_P(Policies, PrefixCacheGeneration,
                         ::testing::Values("attention", "linear", "prefill-linear", "periodic:3", "speculative:3",
                                           "speculative", "speculative:ngram:2", "budget:0.5", "entropy:2",
                                           "match:4", "random:0.5"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& ch : name) {
                             if (ch == ':' || ch == '.' || ch == '-') ch = '_';
                           }
                           return name;
                         });

// Where each prompt resumes, one after the other: the first prompt is snapshotted every 16 tokens and at its
// last block boundary (48); a prompt sharing 43 tokens resumes at 32 and is snapshotted where it leaves the
// first one's blocks (40); one sharing 48 resumes at 48, a longer one at 48, the first 43 tokens alone at 40,
// and the same text in other modes nowhere. All at once, a prompt sharing 43 tokens with the one being
// prefilled waits for its snapshot at 40.
TEST(PrefixCacheGeneration, ResumesAtTheLastSnapshotOfWhatIsShared) {
  testutil::ScratchDir scratch;
  Engine engine(TinyBackend(scratch, 5), std::nullopt);
  engine.set_prefix_cache(SmallBlocks());
  std::vector<GenerateRequest> qs = SharingRequests("attention");
  std::vector<int64_t> got;
  for (const GenerateRequest& q : qs) {
    auto r = engine.Generate(q);
    ASSERT_TRUE(r.ok()) << r.status();
    got.push_back(r->stats.cached_tokens);
  }
  EXPECT_EQ(got, (std::vector<int64_t>{0, 32, 48, 48, 40}));
  GenerateRequest other_modes = qs[3];
  other_modes.policy = "prefill-linear";
  auto r = engine.Generate(other_modes);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stats.cached_tokens, 0);

  engine.set_prefix_cache(SmallBlocks());
  auto together = engine.Generate(std::span(qs).first(3));
  ASSERT_TRUE(together.ok()) << together.status();
  EXPECT_EQ((*together)[0].stats.cached_tokens, 0);
  EXPECT_EQ((*together)[1].stats.cached_tokens, 40);
  EXPECT_EQ((*together)[2].stats.cached_tokens, 48);
  const PrefixCacheStats st = engine.prefix_cache()->stats();
  EXPECT_EQ(st.lookups, 3);
  EXPECT_EQ(st.hit_tokens, 88);
}

// A prompt of a whole number of blocks sent again resumes at its last block boundary but one: a snapshot at
// its end could serve only longer prompts, since a prompt's last token is always forwarded. (It was computed
// again from the last periodic snapshot, 32 here, or from the start at the defaults' spacing.) A longer
// prompt that extends it resumes at 48, where the second request's periodic snapshot (every 16) fell.
TEST(PrefixCacheGeneration, APromptOfWholeBlocksSentAgainResumesBeforeItsLastBlock) {
  testutil::ScratchDir scratch;
  Engine engine(TinyBackend(scratch, 5), std::nullopt);
  engine.set_prefix_cache(SmallBlocks());
  std::mt19937 rng(11);
  GenerateRequest q;
  q.prompt_tokens = RandomTokens(rng, 6 * kBlock);  // 48: snapshots at 16, 32 (every 16) and 40
  q.max_tokens = 6;
  q.stop_at_eos = false;
  q.policy = "attention";
  std::vector<int64_t> got;
  GenerateRequest longer = q;
  for (int32_t t : RandomTokens(rng, 5)) longer.prompt_tokens.push_back(t);
  for (const GenerateRequest* r : {&q, &q, &longer}) {
    auto result = engine.Generate(*r);
    ASSERT_TRUE(result.ok()) << result.status();
    got.push_back(result->stats.cached_tokens);
  }
  EXPECT_EQ(got, (std::vector<int64_t>{0, 5 * kBlock, 6 * kBlock}));
  Engine plain(TinyBackend(scratch, 5), std::nullopt);
  auto again = engine.Generate(q), computed = plain.Generate(q);
  ASSERT_TRUE(again.ok() && computed.ok());
  EXPECT_EQ(again->tokens, computed->tokens);
}

}  // namespace
}  // namespace oryx
